"""The token world model: its RoPE kernels against NumPy, its frequencies reaching the model, rollouts through the
compiled graph (full context and sink + window cache) equal to eager transformers, the fidelity metrics on hand-made
cases, training that resumes bit for bit, and the world-memory benchmark on a tiny run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("skimage")
pytest.importorskip("scipy")

from fastcar_compile.demo import world  # noqa: E402
from fastcar_compile.demo import worldmodel as wm  # noqa: E402
from fastcar_compile.demo import worldrun as wr  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
needs_weights = pytest.mark.skipif(not wr.WORLD_WEIGHTS.exists(), reason="world model weights not shipped")


def test_position_kernel_separates_hits_from_misses() -> None:
    """The LP's kernel, evaluated independently as sum c cos(d w) + s sin(d w), is >= t at the hit distances and
    <= -t at the misses, with |c|, |s| <= 1."""
    freqs = tuple(float(f) for f in wm.ROPE_FREQUENCIES)
    hit, miss = (0, 8, 16), tuple(d for d in range(-40, 200) if d not in (0, 8, 16))
    (c, s), t = wm.position_kernel(freqs, hit, miss)
    f = np.asarray(freqs)
    k = lambda d: float(np.sum(c * np.cos(d * f) + s * np.sin(d * f)))  # noqa: E731
    assert t > 0.1 and np.abs(c).max() <= 1 + 1e-9 and np.abs(s).max() <= 1 + 1e-9
    assert min(k(d) for d in hit) >= t - 1e-6
    assert max(k(d) for d in miss) <= -t + 1e-6


def test_query_key_score_is_the_scaled_kernel() -> None:
    """A query / key pair from `_qk`, rotated by an independent NumPy rotate-half RoPE at positions m and n, scores
    score / margin * K(m - n) after the 1/sqrt(head) scaling."""
    f = np.asarray(wm.ROPE_FREQUENCIES)
    hd = 2 * len(f)
    w, margin = wm.position_kernel(tuple(float(x) for x in f), (3,), tuple(d for d in range(0, 70) if d != 3))
    q, k = wm._qk(w, margin, 60.0, hd)

    def rope(x, p):
        a, b = x[: hd // 2], x[hd // 2:]
        cs, sn = np.cos(p * f), np.sin(p * f)
        return np.concatenate([a * cs - b * sn, b * cs + a * sn])

    for m, n in ((10, 7), (500, 480), (70000, 69997)):
        got = rope(q, m) @ rope(k, n) / math.sqrt(hd)
        d = m - n
        want = 60.0 / margin * np.sum(w[0] * np.cos(d * f) + w[1] * np.sin(d * f))
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_rope_frequencies_reach_the_model() -> None:
    """The model's rotary cos/sin at positions p are cos/sin(p * f) of the configured frequencies (both halves)."""
    import torch

    from fastcar_compile.demo.model import DemoConfig, build_model

    f = wm.ROPE_FREQUENCIES
    cfg = DemoConfig(hidden_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, vocab_size=wm.VOCAB, max_position_embeddings=70000, copy_offsets=(),
                     rope_frequencies=f)
    model = build_model(cfg)
    pos = torch.tensor([[0, 1, 7, 65000]])
    cos, sin = model.model.rotary_emb(torch.zeros(1, 4, 128), pos)
    ang = np.array([0, 1, 7, 65000], np.float64)[:, None] * np.asarray(f)
    np.testing.assert_allclose(cos[0].numpy(), np.cos(np.concatenate([ang, ang], 1)), atol=2e-2)
    np.testing.assert_allclose(sin[0].numpy(), np.sin(np.concatenate([ang, ang], 1)), atol=2e-2)
    np.testing.assert_allclose(cos[0, :3].numpy(), np.cos(np.concatenate([ang, ang], 1))[:3], atol=1e-5)


def _eager_rollout(model, first: np.ndarray, actions: np.ndarray, keep=None) -> np.ndarray:
    """Greedy frames from eager transformers, the whole sequence every token; keep(i, j): query i sees key j."""
    import torch

    T = len(actions)
    out = np.zeros((T, wm.PATCHES), np.int64)
    out[0] = first
    seq = [wm.BOS, wm.ACTION0 + int(actions[0]), *first.tolist(), wm.ACTION0 + int(actions[1])]
    with torch.no_grad():
        for t in range(1, T):
            for j in range(wm.PATCHES):
                ids = torch.tensor([seq])
                if keep is None:
                    logits = model(input_ids=ids).logits
                else:
                    n = len(seq)
                    i_, j_ = np.arange(n)[:, None], np.arange(n)[None, :]
                    allow = torch.from_numpy(keep(i_, j_) & (j_ <= i_))
                    mask = torch.zeros(1, 1, n, n).masked_fill(~allow, float("-inf"))
                    logits = model(input_ids=ids, attention_mask=mask).logits
                out[t, j] = int(logits[0, -1, :wm.CODES].argmax())
                seq.append(int(out[t, j]))
            if t + 1 < T:
                seq.append(wm.ACTION0 + int(actions[t + 1]))
    return out


@needs_weights
def test_compiled_rollouts_equal_eager_transformers(tmp_path) -> None:
    """The full-context graph and the sink + window graph generate, token for token, what eager transformers
    generates from the same weights with the whole past / with attention limited to the sinks and the last
    window + 1 tokens (the cache's oldest-first eviction)."""
    import fastcar_compile
    from fastcar_compile.demo.export import TOKENIZER, load_model
    from fastcar_compile.demo.tokenizer import PatchTokenizer
    from fastcar_compile.runtime.session import FastCarSession

    tok = PatchTokenizer.load(TOKENIZER)
    paths = world.make_paths("eval", 2, 3, seed=3)
    truth, actions = wr.path_tokens(tok, paths)
    onnx = wr.world_onnx(progress=False)
    model = load_model(wr.WORLD_WEIGHTS, wr.WORLD_CONFIG_FILE)
    L, sinks, window = wm.FRAME_TOKENS, 4, wm.FRAME_TOKENS
    kv = {"full": {}, "window": {"kv_budget": sinks + window + 1, "kv_sinks": sinks, "kv_window": window,
                                 "kv_eviction": "oldest"}}
    keeps = {"full": None, "window": lambda i, j: (j < sinks) | (j > i - window - 1)}
    got = {}
    for name, opts in kv.items():
        path = tmp_path / f"{name}.onnx"
        fastcar_compile.compile(str(onnx), str(path), frame_tokens=L, video_start=wm.VIDEO_START, rotary_positions=4096,
                                **opts)
        got[name] = wr.rollout(FastCarSession(path, threads=1), truth[:, 0], actions, threshold=float("inf")).tokens
        for b in range(len(paths)):
            want = _eager_rollout(model, truth[b, 0], actions[b], keeps[name])
            np.testing.assert_array_equal(got[name][b], want, err_msg=name)
    assert (got["full"] != got["window"]).any()  # the window's mask mattered: the check tells the two apart
    # in lockstep (one frame of each in turn, as the long-video speed run rolls them out) each still generates
    # what eager transformers does: no state crosses between the interleaved rollouts
    runs = {name: wr.rollout_frames(FastCarSession(tmp_path / f"{name}.onnx", threads=1), truth[:, 0], actions,
                                    threshold=float("inf")) for name in kv}
    for name, done in wr.lockstep(runs).items():
        for b in range(len(paths)):
            np.testing.assert_array_equal(done.tokens[b], _eager_rollout(model, truth[b, 0], actions[b], keeps[name]))


def test_label_accuracy_and_interval_by_hand() -> None:
    p = world.make_path("eval", 0, 24)
    truth = np.random.default_rng(0).integers(0, 512, (1, 24, 64))
    pred = truth.copy()
    lab, gap = p.cell_labels.reshape(24, 64), p.gap.reshape(24, 64)
    later = np.arange(24)[:, None] >= 1  # frame 0 is given, never scored
    far = (lab == world.REVISIT) & (gap > 2) & later
    near = (lab == world.REVISIT) & (gap <= 2) & later
    assert far.sum() > 0 and near.sum() > 0  # the path revisits both within and beyond a 2-frame window
    wrong = ((lab == world.NEW) & later) | far
    pred[0][wrong] = (truth[0][wrong] + 1) % 512  # every new and every far-revisited cell wrong, all else right
    acc = wr.label_accuracy(pred, truth, [p], window_frames=2)
    assert acc["new"][0] == 0.0 and acc["previous"][0] == 1.0 and acc["revisit_far"][0] == 0.0
    assert acc["revisit"][0] == pytest.approx(near.sum() / (near.sum() + far.sum()))
    m, h, n = wr.mean_ci(np.array([0.5, 0.7, np.nan, 0.9]))
    # mean 0.7, sd 0.2, t(0.975, 2) = 4.302653 (tables)
    assert (m, n) == (pytest.approx(0.7), 3) and h == pytest.approx(4.302653 * 0.2 / math.sqrt(3), rel=1e-5)


def test_training_resumes_bit_for_bit(tmp_path) -> None:
    """Two steps in one run and 1 + 1 steps with a stop in between end with the same weights."""
    import torch

    from fastcar_compile.demo.export import TOKENIZER
    from fastcar_compile.demo.model import DemoConfig
    from fastcar_compile.demo.tokenizer import PatchTokenizer
    from fastcar_compile.demo.worldtrain import train_world_model

    tok = PatchTokenizer.load(TOKENIZER)
    cfg = DemoConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, vocab_size=wm.VOCAB, max_position_embeddings=70000, copy_offsets=())
    s = wm.WorldTrainSettings(steps=4, threads=1, bf16=False, eval_every=100, eval_paths=2, circuit=None,
                              config=cfg, data=wm.WorldData(frames=3, batch=2))
    a, b = tmp_path / "a", tmp_path / "b"
    train_world_model(s, tok, a, a / "log.jsonl", until=2)
    train_world_model(s, tok, b, b / "log.jsonl", until=1)
    train_world_model(s, tok, b, b / "log.jsonl", until=2)
    sa, sb = (torch.load(d / "checkpoint.pt", weights_only=False)["model"] for d in (a, b))
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    first = torch.load(a / "checkpoint.pt", weights_only=False)
    assert first["step"] == 2


def _shift_accuracy(p: world.WorldPath, truth: np.ndarray, label: int) -> float:
    """Accuracy of "shift the last frame by the action" on `label` cells, by index arithmetic on [T, 8, 8] tokens."""
    g = truth[0].copy()
    pred = [g]
    for t in range(1, len(p)):
        dx, dy = world.MOVES[world.ACTIONS[p.actions[t]]]
        g = np.array([[g[min(max(r + dy, 0), 7), min(max(c + dx, 0), 7)] for c in range(8)] for r in range(8)])
        pred.append(g)
    ok = (np.stack(pred) == truth)[1:]
    sel = p.cell_labels[1:] == label
    return float(ok[sel].mean()) if sel.any() else float("nan")


@needs_weights
def test_world_demo_writes_the_figures(tmp_path) -> None:
    """`fastcar-compile demo --world --json FILE`: the GIF, and per variant revisit / new accuracy, FPS and cache MiB,
    the shift baseline's equal to an independent shift of the chosen path's truth; bad input is one line."""
    from fastcar_compile.cli.demo_world import pick_path
    from fastcar_compile.demo.export import TOKENIZER
    from fastcar_compile.demo.tokenizer import PatchTokenizer

    out, js = tmp_path / "demo", tmp_path / "w.json"
    cli = [sys.executable, "-m", "fastcar_compile", "demo", "--world"]
    r = subprocess.run([*cli, "--frames", "10", "--out", str(out), "--json", str(js)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "demo.gif").stat().st_size > 1000
    v = json.loads(js.read_text())["variants"]
    assert set(v) == {"full", "window", "fastar", "fastcar", "shift"}
    for name in ("full", "window", "fastar", "fastcar"):
        assert 0.0 <= v[name]["revisit"] <= 1.0 and v[name]["fps"] > 0 and v[name]["cache_mib"] > 0
    assert v["window"]["cache_mib"] < v["full"]["cache_mib"]
    p = pick_path(10, 4, None)
    truth = PatchTokenizer.load(TOKENIZER).encode(p.frames).reshape(10, 8, 8)
    assert v["shift"]["revisit"] == pytest.approx(_shift_accuracy(p, truth, world.REVISIT))
    assert v["shift"]["new"] == pytest.approx(_shift_accuracy(p, truth, world.NEW))
    bad = subprocess.run([*cli, "--frames", "3"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and bad.stderr.strip().count("\n") == 0
    assert "--frames" in bad.stderr


@needs_weights
def test_world_memory_bench_tiny(tmp_path) -> None:
    """The benchmark's tiny run: every variant scored, the shift baseline equal to an independent shift of the truth's
    frame 0, full context equal to itself, the window's cache flat while the full one grows."""
    out = tmp_path / "wm"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "world_memory.py"), "--paths", "2", "--frames", "8",
                        "--window-frames", "1", "--fastar-budget-frames", "2", "--calib-paths", "1",
                        "--calib-frames", "3", "--quick", "--speed-frames", "20", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    raw = json.loads((out / "world_memory.json").read_text())
    rows = {x["variant"]: x for x in raw["rows"]}
    assert set(rows) == {"full", "window", "fastar", "fastcar", "shift"}
    assert (out / "plot.png").stat().st_size > 1000
    # the shift baseline, recomputed with np.roll-free index arithmetic on the truth's tokens
    from fastcar_compile.demo.export import TOKENIZER
    from fastcar_compile.demo.tokenizer import PatchTokenizer

    paths = world.make_paths("eval", 2, 8, seed=0)
    truth = PatchTokenizer.load(TOKENIZER).encode(np.stack([p.frames for p in paths])).reshape(2, 8, 8, 8)
    hits = [_shift_accuracy(p, truth[i], world.NEW) for i, p in enumerate(paths)]
    assert rows["shift"]["new"] == pytest.approx(np.nanmean(hits))
    assert rows["full"]["agree_full"] is None and 0.0 <= rows["window"]["agree_full"] <= 1.0
    assert rows["window"]["cache_mib_late"] == rows["window"]["cache_mib_early"]
    assert rows["full"]["cache_mib_late"] > rows["full"]["cache_mib_early"]  # the full cache grows
    for x in rows.values():
        assert all(0.0 <= x[k] <= 1.0 for k in ("previous", "new") if x[k] == x[k])
    # the long-video run: the bounded caches over 20 frames, speeds at frames 1-3 and 18-20, caches flat
    assert raw["speed_windows"] == [[1, 3], [18, 20]]
    long = {x["variant"]: x for x in raw["long_rows"]}
    assert set(long) == {"window", "fastar", "fastcar+fastar"}
    for x in long.values():
        assert x["cache_mib_late"] == x["cache_mib_early"] and x["fps_late"] > 0
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from suites import SUITES

    text = "\n".join(SUITES["world-memory"].sections(raw))
    assert "x 20 frames" in text and text.count("\n| fastar") == 1


@pytest.mark.slow
@needs_weights
def test_world_memory_suite_quick(tmp_path) -> None:
    """`python -m benchmarks world-memory --size quick --out DIR` writes DIR/world-memory/{result.json, table.md,
    plot.png} over >= 16 held-out paths."""
    r = subprocess.run([sys.executable, "-m", "benchmarks", "world-memory", "--size", "quick", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stderr[-2000:]
    d = tmp_path / "world-memory"
    res = json.loads((d / "result.json").read_text())
    assert res["raw"]["paths"] >= 16 and (d / "table.md").is_file() and (d / "plot.png").is_file()
