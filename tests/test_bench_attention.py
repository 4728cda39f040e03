"""The attention kernel benchmark (benchmarks/bench_attention.py, `python -m benchmarks attention`): its problems,
density and recall against brute-force NumPy, and a run's rows carry what the suite's check reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

pytest.importorskip("torch")

import bench_attention as ba  # noqa: E402
from attention_data import Capture  # noqa: E402


def _capture(seed: int = 0, frames: int = 10, layers: int = 2, B: int = 2, H: int = 4, T: int = 8, d: int = 8
             ) -> Capture:
    rng = np.random.default_rng(seed)
    chunk = 2
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return Capture(q=f(layers, frames // chunk, B, H, chunk * T, d), k=f(layers, frames // chunk, B, H, chunk * T, d),
                   v=f(layers, frames // chunk, B, H, chunk * T, d), ck=f(layers, frames, B, H, T, d),
                   cv=f(layers, frames, B, H, T, d), ck_pre=f(layers, frames, B, H, T, d), tokens=T, chunk=chunk,
                   sinks=1)


def test_wan_tiling_puts_a_layers_heads_side_by_side():
    """Head h of the tiled shape: the capture's heads of layer h % layers concatenated, a frame's tokens a seeded
    permutation of the capture frame's tokens repeated; the chunk's frames from the recorded steps."""
    cap = _capture()
    shape = ba.Shape("w", "", 1, 3, 32, 20, 3, 1)
    p = ba.wan_problem(cap, shape, 4)
    for h in range(3):
        layer = h % 2
        perm = np.random.default_rng(h // 2).permutation(8)
        for f in range(4):
            for j in (0, 7, 19):
                want = np.concatenate([cap.ck[layer, f, 0, c, perm[j % 8]] for c in range(4)])
                np.testing.assert_array_equal(p.pk[0, h, f * 20 + j], want)
        # chunk frame 2 of the step at context 4 is frame 6 = recorded chunk 3's first frame
        want = np.concatenate([cap.q[layer, 3, 0, c, perm[5]] for c in range(4)])
        np.testing.assert_allclose(p.q[0, h, 2 * 20 + 5], want * 32 ** -0.5, rtol=1e-6)


def _brute_annsa(p, dense, codes, qcodes, sparse):
    """Per query: the selected keys by definition, their count and the dense softmax mass on them."""
    B, H, Q, _ = p.q.shape
    pairs, mass = 0, []
    for b in range(B):
        for h in range(H):
            keys = np.concatenate([p.pk[b, h], p.k[b, h]]).astype(np.float64)
            for i in range(Q):
                s = keys @ p.q[b, h, i].astype(np.float64)
                w = np.exp(s - s.max())
                w /= w.sum()
                sel = [j for j in range(p.pk.shape[2]) if j in set(dense.tolist()) or
                       (j in set(sparse.tolist()) and (codes[b, h, j] == qcodes[b, h, i]).any())]
                sel += list(range(p.pk.shape[2], keys.shape[0]))
                pairs += len(sel)
                mass.append(w[sel].sum())
    return pairs, float(np.mean(mass))


@pytest.mark.parametrize("kind", ["lsh", "int8"])
def test_annsa_density_and_recall_match_brute_force(kind):
    cap = _capture(1)
    shape = ba.Shape("dit", "", 2, 4, 8, 8, 2, 1)
    p = ba.dit_problem(cap, 0, 6)
    _, info = ba.annsa_inputs(p, shape, 6, kind)
    selected = info["selected"]
    pairs, recall = _brute_annsa(p, *selected)
    assert info["pairs"] == pairs
    assert ba.annsa_recall(p, selected, exact=True) == pytest.approx(recall, rel=1e-9)


def test_tempcache_of_identical_frames_is_exact_and_of_distinct_ones_dense():
    """Frames whose keys are all the same merge into one slot per position (besides the sink frame): the TempCache
    lemma makes that attention exact, so recall 1 at the density of one frame's slots; with SIM above 1 nothing
    merges: every key resident, recall 1."""
    cap = _capture(2)
    cap.ck[:] = cap.ck[:, :1]
    cap.ck_pre[:] = cap.ck_pre[:, :1]
    shape = ba.Shape("dit", "", 2, 4, 8, 8, 2, 1)
    p = ba.dit_problem(cap, 0, 6)
    feed, info = ba.tempcache_inputs(p, shape, 6, 0.5)
    assert info["resident"] == pytest.approx(2 / 6)  # the sink frame's slots + one merged slot per position
    assert ba.tempcache_recall(p, shape, feed, info["counts"], exact=True) == pytest.approx(1.0, abs=1e-9)
    p = ba.dit_problem(_capture(3), 0, 6)
    feed, info = ba.tempcache_inputs(p, shape, 6, 1.5)
    assert info["resident"] == 1.0 and info["pairs"] == 2 * 4 * 16 * (48 + 16)
    assert ba.tempcache_recall(p, shape, feed, info["counts"], exact=True) == pytest.approx(1.0, abs=1e-9)


def _run_rows(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "att.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_attention.py"), *args, "--rounds", "1",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(out.read_text())["rows"]


def _check_rows(rows: list[dict], shape: str) -> None:
    need = {"shape", "context_frames", "mode", "density", "recall", "ms", "ms_dense"}
    assert rows and all(need <= set(r) and r["shape"] == shape for r in rows)
    dense = [r for r in rows if r["mode"] == "dense"]
    assert min(r["ms"] for r in dense) == rows[0]["ms_dense"]
    for r in rows:
        assert 0 < r["density"] <= 1 and 0 <= r["recall"] <= 1 + 1e-9 and r["ms"] > 0
        assert r["pair_cost"] == pytest.approx(r["ms"] / (r["ms_dense"] * r["density"]))
    assert {r["mode"] for r in rows} >= {"dense", "AnnSA-LSH 4x2", "AnnSA-int8 2x2", "TempCache SIM 0.9"}


def test_a_dit_run_writes_the_rows_the_suite_reads(tmp_path):
    _check_rows(_run_rows(tmp_path, "--shapes", "dit", "--contexts", "4", "--capture-frames", "8"), "dit")


def test_a_token_run_writes_the_rows_the_suite_reads(tmp_path):
    _check_rows(_run_rows(tmp_path, "--shapes", "token", "--contexts", "2"), "token")


@pytest.mark.slow
def test_a_wan_run_writes_the_rows_the_suite_reads(tmp_path):
    """Wan2.1-1.3B's shape (1560 tokens per frame, 12 heads x 128): minutes per context on 2 cores."""
    _check_rows(_run_rows(tmp_path, "--shapes", "wan", "--contexts", "4", "--capture-frames", "8"), "wan")
