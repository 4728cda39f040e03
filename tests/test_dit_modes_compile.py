"""`fastcar-compile dit.onnx -o fast.onnx --threshold TAU --tempcache SIM`: FastCar's FFN replay (passes/dit_replay.py,
the replay cache as graph I/O) and TempCache 'aligned' at cache-write time (the runtime merges, the graph adds
log(count)) compiled into the DiT step graph, recorded in the metadata and read back by the stream runtime.
References: the eager stream runtime's modes (dit/fastar.FastARDiT: its replay checked against computing every
row, its TempCache against the NumPy reference, in test_dit_fastar.py) and the dense export in ONNX Runtime."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from dit_modes_helpers import compile_cli  # noqa: E402

from fastcar_compile.cli import main  # noqa: E402
from fastcar_compile.core.contract import (  # noqa: E402
    DIT_MODES_KEY,
    TEMPCACHE_MASKED,
    TEMPCACHE_SLOTS,
    replay_io,
    tempcache_io,
    tempcache_slots_name,
)
from fastcar_compile.dit import modes  # noqa: E402
from fastcar_compile.dit.cache import resident_slots  # noqa: E402
from fastcar_compile.dit.config import PRESETS  # noqa: E402
from fastcar_compile.dit.fastar import FastARDiT  # noqa: E402
from fastcar_compile.dit.stream import OrtDiT, StreamSettings, rollout  # noqa: E402

CFG = PRESETS["tiny"]


def _compile(exported: Path, folder: Path, tau: str, *extra: str) -> Path:
    return compile_cli(exported, folder, "--threshold", tau, *extra)


@pytest.mark.parametrize("tau, window", [("0", None), ("0", 0), ("-1e30", None)])
def test_compiled_replay_equals_the_eager_mode(dit_tiny_export, tmp_path, dit_tiny_eager, tau, window):
    """5 chunks: the compiled rollout == the eager FastCar rollout at the same tau within 1e-4, with the same
    number of replayed FFN rows (tau -1e30: every eligible row replays, so a step computes no FFN row)."""
    fast = OrtDiT(_compile(dit_tiny_export, tmp_path, tau))
    assert fast.tau == float(tau)  # read back from the metadata
    settings = StreamSettings(frames=10, seed=3, window_frames=window)
    ref = FastARDiT(dit_tiny_eager, modes.settings(threshold=float(tau)))
    for a, b in zip(rollout(fast, settings), rollout(ref, settings), strict=True):
        assert a.resident == b.resident
        np.testing.assert_allclose(a.frames, b.frames, atol=1e-4, rtol=0)
    replayed, rows = sum(s.ffn_replayed for s in ref.stats), sum(s.ffn_rows for s in ref.stats)
    assert fast.replayed == [replayed, rows] and 0 < replayed < rows


def test_tau_no_score_exceeds_is_the_dense_export(dit_tiny_export, tmp_path):
    fast = OrtDiT(_compile(dit_tiny_export, tmp_path, "1e30"))
    settings = StreamSettings(frames=10, seed=4)
    for a, b in zip(rollout(fast, settings), rollout(OrtDiT(dit_tiny_export), settings), strict=True):
        np.testing.assert_allclose(a.frames, b.frames, atol=1e-4, rtol=0)
    assert fast.replayed[0] == 0 and fast.replayed[1] > 0


def test_replay_cache_is_graph_io_and_the_ffn_reads_gathered_rows(dit_tiny_export, tmp_path):
    """The graph's I/O holds the replay cache per block, the metadata the tau; each FFN's first MatMul reads
    rows gathered at the non-replayed positions (row skipping, not a mask over all rows)."""
    path = _compile(dit_tiny_export, tmp_path, "0.25")
    m = onnx.load(str(path))
    meta = {p.key: p.value for p in m.metadata_props}
    assert json.loads(meta[DIT_MODES_KEY]) == {"threshold": 0.25, "tempcache": None, "tempcache_match": None,
                                           "tempcache_buckets": None, "tempcache_kernel": None, "annca": None,
                                           "annsa": None}
    ins, outs = {i.name for i in m.graph.input}, {o.name for o in m.graph.output}
    for i in range(CFG.layers):
        (a, b), (c, d), mask = replay_io(i)
        assert {a, b} <= ins and {c, d, mask} <= outs
    producer = {o: n for n in m.graph.node for o in n.output}
    gelus = [n for n in m.graph.node if n.op_type == "Gelu"]
    assert len(gelus) == CFG.layers
    for g in gelus:
        up = producer[producer[g.input[0]].input[0]]  # Add(bias) <- MatMul
        assert up.op_type == "MatMul"
        gather = producer[up.input[0]]
        assert gather.op_type == "Gather" and producer[producer[gather.input[1]].input[0]].op_type == "NonZero"


def test_dense_compile_records_no_mode(dit_tiny_export, tmp_path):
    fast = OrtDiT(_compile(dit_tiny_export, tmp_path, "inf"))
    assert fast.tau is None and fast.sim is None and fast.modes.dense


def _tempcache_form(form: str, monkeypatch) -> list[str]:
    """The compile flags for TempCache's `form` ("slots": SlotAttention over the resident slots, the default with
    the native library; "body": that graph run with the library off, its function body; "masked": the in-place
    graph over the whole buffer, --native-attention off)."""
    if form == TEMPCACHE_MASKED:
        return ["--native-attention", "off"]
    from fastcar_compile.runtime.native import library_path

    if library_path() is None:
        pytest.skip("native ai.fastcar kernels not built here")
    return []


@pytest.mark.parametrize("form", [TEMPCACHE_SLOTS, TEMPCACHE_MASKED, "body"])
@pytest.mark.parametrize("sim, tau, window", [("0.3", "inf", None), ("0.3", "inf", 0), ("0.2", "0", 2),
                                              ("0.3", "0", None)])
def test_compiled_tempcache_equals_the_eager_mode(dit_tiny_export, tmp_path, dit_tiny_eager, sim, tau, window, form,
                                                  monkeypatch):
    """6 chunks (the ring wrapping, or the buffers growing): TempCache compiled in (alone, or with FastCar)
    == the eager runtime's TempCache 'aligned' at the same SIM within 1e-4, with the same merges; in each form
    (SlotAttention over the resident slots, its function body, the masked in-place graph)."""
    path = _compile(dit_tiny_export, tmp_path, tau, "--tempcache", sim, *_tempcache_form(form, monkeypatch))
    if form == "body":
        monkeypatch.setenv("FASTCAR_NATIVE", "0")
    fast = OrtDiT(path)
    assert fast.sim == float(sim) and fast.modes.threshold == (None if tau == "inf" else float(tau))
    slot_ops = [n for n in onnx.load(str(path)).graph.node if n.op_type == "SlotAttention"]
    assert fast.modes.tempcache_kernel == (TEMPCACHE_MASKED if form == TEMPCACHE_MASKED else TEMPCACHE_SLOTS)
    assert len(slot_ops) == (0 if form == TEMPCACHE_MASKED else CFG.layers)
    settings = StreamSettings(frames=12, seed=3, window_frames=window)
    kw = {"tempcache": float(sim)} | ({} if tau == "inf" else {"threshold": 0.0})
    ref = FastARDiT(dit_tiny_eager, modes.settings(**kw))
    for a, b in zip(rollout(fast, settings), rollout(ref, settings), strict=True):
        assert a.resident == b.resident
        np.testing.assert_allclose(a.frames, b.frames, atol=1e-4, rtol=0)
    merged = sum(s.merges for s in ref.stats)
    assert fast.cache.merges == [merged, sum(s.written for s in ref.stats)] and merged > 0
    assert fast.replayed[0] == sum(s.ffn_replayed for s in ref.stats)


def test_tempcache_merging_nothing_is_the_dense_export(dit_tiny_export, tmp_path):
    """SIM 1 (no cosine exceeds it) with a tau no TAS exceeds: every mode's machinery on, the dense result."""
    fast = OrtDiT(_compile(dit_tiny_export, tmp_path, "1e30", "--tempcache", "1"))
    settings = StreamSettings(frames=10, seed=4)
    for a, b in zip(rollout(fast, settings), rollout(OrtDiT(dit_tiny_export), settings), strict=True):
        np.testing.assert_allclose(a.frames, b.frames, atol=1e-4, rtol=0)
    assert fast.cache.merges[0] == 0 < fast.cache.merges[1]


def test_the_slots_form_reads_the_cache_only_through_slot_attention(dit_tiny_export, tmp_path):
    """TempCache's slots form: each block's attention is one SlotAttention over past.N.* with the resident slots
    the runtime lists and log(count); no other node reads the cache buffers' values (the whole buffer is never
    multiplied; the export's Shape of past.N.key, its batch size, reads the dimensions only)."""
    path = _compile(dit_tiny_export, tmp_path, "inf", "--tempcache", "0.3", *_tempcache_form(TEMPCACHE_SLOTS, None))
    g = onnx.load(str(path)).graph
    for i in range(CFG.layers):
        readers = {n.op_type for n in g.node if {f"past.{i}.key", f"past.{i}.value"} & set(n.input)}
        assert readers - {"Shape"} == {"SlotAttention"}
        (op,) = [n for n in g.node if n.op_type == "SlotAttention" and f"past.{i}.key" in n.input]
        assert list(op.input[5:]) == [tempcache_slots_name(i), tempcache_io(i)[0]]


def test_resident_slots_list_the_live_positions():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 3, (2, 3, 50)) * (rng.random((2, 3, 50)) < 0.6)
    got = resident_slots(counts)
    for b in range(2):
        for h in range(3):
            want = [p for p in range(50) if counts[b, h, p] > 0]
            assert got[b, h].tolist() == want + [-1] * (got.shape[2] - len(want))
    assert got.shape[2] == max(int((counts[b, h] > 0).sum()) for b in range(2) for h in range(3))


def test_ring_merges_match_a_numpy_recount():
    """RingCache's TempCache bookkeeping against a recount of the merge chains per (row, head, token): the
    slot at the newest frame of a chain holds count = chain length, the mean value and the newest key; the
    slots a chain left are dead (count 0, bias -inf); sink frames never merge; the ring overwrites evicted
    frames."""
    from fastcar_compile.dit.cache import RingCache

    rng = np.random.default_rng(1)
    B, H, T, d, sinks, window, frames = 2, 2, 3, 4, 1, 3, 8
    ring = RingCache(1, T, sinks, window, tempcache=0.5)
    base = rng.standard_normal((B, H, T, d)).astype(np.float32)
    ks, vs, pres = [], [], []
    for f in range(frames):
        pres.append(base + (0.2 + 0.4 * (f % 3 == 0)) * rng.standard_normal((B, H, T, d)).astype(np.float32))
        ks.append(rng.standard_normal((B, H, T, d)).astype(np.float32))
        vs.append(rng.standard_normal((B, H, T, d)).astype(np.float32))
    for f in range(0, frames, 2):
        ring.write(f, [np.concatenate(x[f:f + 2], 2) for x in (ks, vs, pres)])
    count, value = np.ones((frames, B, H, T), np.int64), np.array(vs)
    for f in range(sinks + 1, frames):
        a, b = pres[f], pres[f - 1]
        m = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1) > 0.5
        value[f] = np.where(m[..., None], (value[f - 1] * count[f - 1][..., None] + value[f]) /
                            (count[f - 1] + 1)[..., None], value[f])
        count[f], count[f - 1] = np.where(m, count[f - 1] + 1, 1), np.where(m, 0, count[f - 1])
    assert (count == 0).any() and (count > 2).any()
    assert ring.resident == [0, 5, 6, 7]
    for f in ring.resident:
        s = slice(ring.slot(f) * T, (ring.slot(f) + 1) * T)
        np.testing.assert_array_equal(ring.counts[0][:, :, s], count[f])
        np.testing.assert_allclose(ring.buffers[1][:, :, s], value[f], atol=1e-6)
        np.testing.assert_array_equal(ring.buffers[0][:, :, s], ks[f])
        np.testing.assert_array_equal(ring.bias[0][:, :, s], np.where(count[f] > 0, np.log(np.maximum(count[f], 1)),
                                                                      -np.inf).astype(np.float32))


def test_stream_cli_reports_the_compiled_mode(dit_tiny_export, tmp_path, capsys):
    path = _compile(dit_tiny_export, tmp_path, "0", "--tempcache", "0.3")
    capsys.readouterr()
    assert main(["stream", str(path), "--frames", "6", "-o", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "FastCar compiled in (tau 0)" in out and "TempCache compiled in (SIM 0.3, aligned match)" in out
    done = json.loads((tmp_path / "run" / "stream.json").read_text())["compiled_modes"]
    assert done["threshold"] == 0.0 and 0 < done["replay_ratio"] < 1
    assert done["tempcache"] == 0.3 and 0 < done["merge_ratio"] < 1


def test_calibrate_replay_equals_the_eager_calibration(dit_tiny_export, tmp_path, dit_tiny_eager, capsys):
    """`--calibrate-replay 0.4`: the tau read from the probe graph's TAS outputs equals the eager runtime's
    calibration (its own TAS over the same 4-frame stream) and the compiled stream then replays about that
    share of the eligible rows."""
    from fastcar_compile.dit.fastar import calibrate_tau

    out = tmp_path / "cal.onnx"
    capsys.readouterr()
    assert main([str(dit_tiny_export), "-o", str(out), "--calibrate-replay", "0.4"]) == 0
    assert "calibrated --threshold" in capsys.readouterr().out
    fast = OrtDiT(out)
    settings = StreamSettings(frames=4, seed=0)
    want = calibrate_tau(dit_tiny_eager, modes.settings(calibrate_replay=0.4), settings)
    assert fast.tau == pytest.approx(want, abs=1e-4)
    list(rollout(fast, settings))
    ratio = fast.replayed[0] / fast.replayed[1]
    assert 0.4 * 0.75 - 0.15 < ratio < 0.4 * 0.75 + 0.15  # over all rows: frame 0's are not eligible
