"""Compressed KV cache in CompressedAttention's native kernel (--kv-budget/--kv-sinks/--kv-window, --tempcache,
--sparse-attention): the kernel against the NumPy reference fastcar_compile/fastar (HeadCache via run_trace) on
the same q/k/v, slot bookkeeping against the reference's, and end to end: budget >= context equals the original
export (logits 1e-4) and the uncompressed fused model at a finite tau (replay decisions included)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import ort_driver
import pytest
import zoo
from kernel_driver import run_kernel
from session_driver import assert_cli_refuses, run_session
from test_compressed_attention import session

from fastcar_compile.core import contract
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.fastar.attention import run_trace
from fastcar_compile.fastar.config import KVCompressConfig
from fastcar_compile.fastar.rope import apply_rope
from fastcar_compile.passes.fused_attention import SLOT_FIELDS, compressed_attributes, slot_width

HQ, HKV, D, L = 4, 2, 8, 6


def _trace(seed: int, T: int, repeat: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pre-RoPE q [T, Hq, D], k and v [T, Hkv, D]; with `repeat`, frames of L tokens whose keys mostly recur
    (TempCache merges them) but whose values differ."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, HQ, D))
    k = rng.standard_normal((T, HKV, D))
    if repeat:
        for t in range(L, T):
            if rng.random() < 0.7:
                k[t] = k[t - L] + 0.01 * rng.standard_normal((HKV, D))
    v = rng.standard_normal((T, HKV, D))
    return q, k, v


CONFIGS = {
    "window": dict(budget=12, sinks=2, window=5),
    "window-oldest": dict(budget=12, sinks=2, window=5, eviction="oldest"),
    "tempcache": dict(budget=40, sinks=1, window=2, tempcache_sim=0.9),
    "tempcache-bounded": dict(budget=14, sinks=2, window=3, tempcache_sim=0.9),
    "lsh": dict(budget=64, sinks=2, window=4, lsh_bits=3, lsh_tables=2),
    "all": dict(budget=16, sinks=2, window=4, tempcache_sim=0.95, lsh_bits=2, lsh_tables=2),
    "int8": dict(budget=64, sinks=2, window=4, int8_dirs=2, int8_tables=2),
    "int8-4dirs": dict(budget=64, sinks=1, window=3, int8_dirs=4, int8_tables=3),
    "prune": dict(budget=64, prune_prompt=0.06, video_start=9),
    # a prompt prefix: the first video frame's keys recur the prompt's one frame back (p - L < video_start),
    # which must not merge (the token one frame back is no video token)
    "tempcache-prefix": dict(budget=40, sinks=1, window=2, tempcache_sim=0.9, video_start=3),
    "tempcache-prefix-bounded": dict(budget=14, sinks=0, window=3, tempcache_sim=0.9, video_start=4),
    "prune-tempcache": dict(budget=20, sinks=2, window=4, tempcache_sim=0.9, prune_prompt=0.06, video_start=5),
    "prune-evict-int8": dict(budget=20, sinks=2, window=4, int8_dirs=1, int8_tables=2, prune_prompt=0.06,
                             video_start=9),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kernel_equals_fastar_reference(name):
    """Outputs over a 60-token trace (single-token steps and multi-token chunks) and the final slots (KV index,
    member count per slot) equal the reference HeadCache's."""
    cfg = KVCompressConfig(**{"video_start": 0, **CONFIGS[name]}, frame_tokens=L)
    q, k, v = _trace(7, 60, repeat=cfg.tempcache_sim is not None)
    ref = run_trace(q, k, v, cfg)
    got, slots = run_kernel(cfg, q, k, v, [5, 1, 1, 3] + [1] * 50)
    assert np.abs(got - ref.out).max() <= 1e-4, np.abs(got - ref.out).max()
    tables = cfg.sparse_tables
    for h, cache in enumerate(ref.caches):
        live = slots[h, :, 0] > 0
        # (KV index, count, AnnSA bucket per table, hit frame with pruning) of every live slot
        got_slots = sorted(zip(slots[h, live, 0].astype(int) - 1, slots[h, live, 1].astype(int),
                               *(slots[h, live, 3 + t].astype(int) for t in range(tables)), strict=True))
        want = sorted(zip(cache.pos[cache.live].tolist(), cache.count[cache.live].tolist(),
                          *(cache.codes[cache.live, t].tolist() for t in range(tables)), strict=True))
        assert got_slots == want
        if cfg.prune_prompt is not None:
            got_hits = sorted(zip(slots[h, live, 0].astype(int) - 1, slots[h, live, -1].astype(int), strict=True))
            want_hits = sorted(zip(cache.pos[cache.live].tolist(), cache.hit_frame[cache.live].tolist(), strict=True))
            assert [x for x in got_hits if x[0] < cfg.video_start] == \
                [x for x in want_hits if x[0] < cfg.video_start]
    if tables or cfg.prune_prompt is not None:
        assert ref.metrics.density < 1  # the case skips keys (buckets or pruned prompt keys)
    if cfg.tempcache_sim is not None:
        assert ref.metrics.merges > 0  # the case exercises merging
    if cfg.budget < 60 - ref.metrics.merges / HKV:  # more tokens than slots: eviction is exercised
        assert ref.metrics.evicted > 0


@pytest.mark.parametrize("name", ["window", "tempcache-bounded", "lsh", "int8", "prune"])
def test_diagnostics_equal_the_reference_metrics(name):
    """Dense attention on the side (--kv-diagnostics): the kernel's density (executed / dense q.k pairs) and
    recall (dense softmax mass kept, merged slots shared by their members) equal run_trace's metrics."""
    cfg = KVCompressConfig(**{"video_start": 0, **CONFIGS[name]}, frame_tokens=L)
    q, k, v = _trace(7, 60, repeat=cfg.tempcache_sim is not None)
    ref = run_trace(q, k, v, cfg).metrics
    stats: list[np.ndarray] = []
    got, _ = run_kernel(cfg, q, k, v, [5, 1, 1, 3] + [1] * 50, stats=stats)
    executed, dense, recall, queries = np.sum(stats, axis=(0, 1))
    assert queries == 60 * HQ
    assert executed / dense == pytest.approx(ref.density, abs=1e-6)
    assert recall / queries == pytest.approx(ref.recall, abs=1e-4)
    assert ref.density < 1 and ref.recall < 1


def test_budget_above_context_is_dense():
    """No compression in effect (budget >= tokens, no merging, no sparsity): the kernel equals dense attention
    written independently (softmax over every earlier token, keys at their true positions)."""
    cfg = KVCompressConfig(budget=64, frame_tokens=L, video_start=0)
    q, k, v = _trace(3, 30, repeat=False)
    got, _ = run_kernel(cfg, q, k, v, [4] + [1] * 26)
    pos = np.arange(30)
    qp, kp = apply_rope(np.swapaxes(q, 0, 1), pos), apply_rope(np.swapaxes(k, 0, 1), pos)
    for t in range(30):
        for h in range(HQ):
            s = kp[h // 2, : t + 1] @ qp[h, t] / np.sqrt(D)
            w = np.exp(s - s.max())
            assert np.abs(got[t, h] - (w / w.sum()) @ v[: t + 1, h // 2]).max() <= 1e-5


def test_tempcache_prefix_batch_left_padded():
    """TempCache with a prompt prefix, batch 2, left padding (prompts of 3 and 5 tokens padded to one KV index
    for the video): every row equals the reference run on its own unpadded trace with its own video_start. The
    first video frame copies the keys one frame back (prompt tokens and pads), which must not merge."""
    pads, vs, frames = [2, 0], 5, 7
    T = vs + frames * L
    rng = np.random.default_rng(21)
    q = rng.standard_normal((2, T, HQ, D))
    k = rng.standard_normal((2, T, HKV, D))
    v = rng.standard_normal((2, T, HKV, D))
    for t in range(L, T):  # in KV indices: the first video frame always recurs p - L, later frames mostly
        if t < vs + L or rng.random() < 0.7:
            k[:, t] = k[:, t - L] + 0.01 * rng.standard_normal((2, HKV, D))
    cfg = KVCompressConfig(budget=T, sinks=0, window=2, tempcache_sim=0.9, frame_tokens=L, video_start=vs)
    got, slots = run_kernel(cfg, q, k, v, [vs, 2, 1, 3] + [1] * (T - vs - 6), pads=pads)
    for b, n in enumerate(pads):
        row = dataclasses.replace(cfg, video_start=vs - n)
        ref = run_trace(q[b, n:], k[b, n:], v[b, n:], row)
        assert ref.metrics.merges > 0
        assert np.abs(got[b, n:] - ref.out).max() <= 1e-4, (b, np.abs(got[b, n:] - ref.out).max())
        for h, cache in enumerate(ref.caches):
            sl = slots[b, h]
            live = (sl[:, 0] > 0) & (sl[:, 0] - 1 >= n)  # the row's real tokens (its pads hold slots too)
            got_slots = sorted(zip(sl[live, 0].astype(int) - 1 - n, sl[live, 1].astype(int), strict=True))
            assert got_slots == sorted(zip(cache.pos[cache.live].tolist(), cache.count[cache.live].tolist(),
                                           strict=True))


def test_slot_bookkeeping_properties():
    """Over a long trace with merging and eviction: at most C live slots, KV indices distinct, counts >= 1, the
    sinks and the last W tokens resident, and every member count adds up with the reference's evictions."""
    cfg = KVCompressConfig(budget=10, sinks=2, window=3, tempcache_sim=0.9, frame_tokens=L, video_start=0)
    q, k, v = _trace(11, 80, repeat=True)
    _, slots = run_kernel(cfg, q, k, v, [1] * 80)
    ref = run_trace(q, k, v, cfg)
    for h in range(HKV):
        live = slots[h, :, 0] > 0
        pos, count = slots[h, live, 0].astype(int) - 1, slots[h, live, 1].astype(int)
        assert live.sum() <= cfg.budget and len(set(pos)) == len(pos) and (count >= 1).all()
        assert {0, 1} <= set(pos) and {77, 78, 79} <= set(pos)
        assert count.sum() + ref.caches[h].evicted == 80


# --- end to end ----------------------------------------------------------------------------------------------

def test_budget_above_context_equals_the_export(zoo_model, fc_compile, tmp_path):
    """--kv-budget >= every token of the decode (sinks, window, eviction policy set but never used): logits equal
    the original export within 1e-4, batch 2 with left padding and a multi-token step after the prompt; and at a
    finite tau the compiled model equals the uncompressed fastcar-fused one (replay decisions included)."""
    from fastcar_compile.runtime import FastCarSession

    src = zoo_model("llama", "dynamo20")
    comp, plain = tmp_path / "comp.onnx", tmp_path / "plain.onnx"
    fc_compile(str(src), output=str(comp), frame_tokens=4, threshold=float("inf"), kv_budget=64, kv_sinks=2,
               kv_window=8)
    rng = np.random.default_rng(8)
    pad = [0, 3]
    prompt = rng.integers(0, zoo.VOCAB, (2, 6))
    mask, _ = ort_driver.left_pad_masks(pad, 6)
    steps = [rng.integers(0, zoo.VOCAB, (2, 3 if k == 4 else 1)) for k in range(30)]
    got = run_session(FastCarSession(comp), prompt, mask, steps).logits
    want = ort_driver.decode(src, [prompt, *steps], pad=pad).logits
    real = mask.astype(bool)
    assert np.abs(got[0] - want[0])[real].max() <= 1e-4
    for k in range(1, len(want)):
        assert np.abs(got[k] - want[k]).max() <= 1e-4, f"step {k}"
    meta = onnx.load(str(comp), load_external_data=False).metadata_props
    kvc = {p.key: p.value for p in meta}["fastcar.kv_compress"]
    assert '"budget": 64' in kvc and '"layers": [0, 1]' in kvc
    # finite tau: the gate reads the aligned key the op gathered from its slots
    fc_compile(str(src), output=str(comp), frame_tokens=4, threshold=0.0, kv_budget=64, kv_sinks=2, kv_window=8)
    # (pack_qkv off: the compressed op keeps the export's RoPE outside, so both rotate at the same positions and
    # decisions can be compared exactly; packed layers rotate at KV indices, equal up to rounding)
    fc_compile(str(src), output=str(plain), frame_tokens=4, threshold=0.0, fused_attention="fastcar", pack_qkv=False)
    steps = [rng.integers(0, zoo.VOCAB, (2, 1)) for _ in range(24)]
    got = run_session(FastCarSession(comp), prompt, mask, steps)
    want = run_session(FastCarSession(plain), prompt, mask, steps)
    assert np.array_equal(np.stack(got.replay), np.stack(want.replay)) and np.stack(want.replay).any()
    assert max(np.abs(a - b).max() for a, b in zip(got.logits, want.logits, strict=True)) <= 1e-4


def test_small_budget_runs_flat(zoo_model, fc_compile, tmp_path):
    """A budget below the context: the state stays [batch, kv_heads, C, D] per layer while the video grows, and
    logits stay finite (eviction and the sinks/window at work; quality is benchmarks' business)."""
    from fastcar_compile.runtime import FastCarSession

    src = zoo_model("llama", "dynamo20")
    comp = tmp_path / "comp.onnx"
    fc_compile(str(src), output=str(comp), frame_tokens=4, threshold=0.0, kv_budget=10, kv_sinks=2, kv_window=5,
               tempcache=0.9, sparse_attention="lsh:4x2")
    sess = FastCarSession(comp)
    rng = np.random.default_rng(9)
    run = run_session(sess, rng.integers(0, zoo.VOCAB, (1, 6)), np.ones((1, 6), np.int64),
                      [rng.integers(0, zoo.VOCAB, (1, 1)) for _ in range(40)])
    assert all(np.isfinite(x).all() for x in run.logits)
    state = run.state  # after 46 tokens, far past the budget of 10
    assert state.past_len == 46
    assert state.arrays["past_key_values.0.key"].shape == (1, 2, 10, 16)
    slots = state.arrays["past_kv_slots.0"]
    assert slots.shape == (1, 2, 10, SLOT_FIELDS + 2)
    live = (slots[..., 0] > 0).sum(axis=-1)
    assert (live >= 1).all() and (live <= 10).all()


def test_kv_diagnostics_in_run_stats(zoo_model, fc_compile, tmp_path):
    """--kv-diagnostics: generate's run stats carry per-layer density, recall and resident KV bytes; a budget
    above the video is dense (density 1, recall 1), a small one is not, with fewer resident bytes. The stats'
    running sums over the 32 steps equal NumPy sums of every step's kv_stats.N output taken from scratch."""
    from fastcar_compile.runtime import FastCarSession

    src = zoo_model("llama", "dynamo20")
    prompt = np.random.default_rng(2).integers(0, zoo.VOCAB, (1, 3))
    result = {}
    for budget in (64, 8):
        out = tmp_path / f"b{budget}.onnx"
        fc_compile(str(src), output=str(out), frame_tokens=4, threshold=float("inf"), kv_budget=budget,
                   kv_sinks=1, kv_window=4, kv_diagnostics=64)
        sess, seen = FastCarSession(out), []
        step = sess.step

        def recording(*args, step=step, seen=seen, **kwargs):
            res = step(*args, **kwargs)
            seen.append({n: np.array(a, np.float64) for n, a in res.extra.items()})
            return res

        sess.step = recording
        result[budget] = sess.generate(prompt, 8).stats.kv_diagnostics
        assert len(seen) == 8 * 4  # prefill + every fed token
        for layer, acc in result[budget].items():
            executed, dense, recall, queries = np.stack([s[contract.kv_stats_output(int(layer))]
                                                         for s in seen]).sum(axis=(0, 1, 2))
            assert acc["density"] == pytest.approx(executed / dense, rel=1e-9)
            assert acc["recall"] == pytest.approx(recall / queries, rel=1e-6)
    # hand count: 3 prompt + 8 frames x 4 generated, the last one never fed; per KV head one slot per token
    # (budget 64) or 8 (budget 8);
    # a slot holds key + value (head_dim float32 each) and its SLOT_FIELDS float32 bookkeeping fields (no LSH)
    tokens, head_dim = 3 + 8 * 4 - 1, zoo.HIDDEN // zoo.HEADS
    slot_bytes = 2 * head_dim * 4 + SLOT_FIELDS * 4
    for layer in ("0", "1"):
        big, small = result[64][layer], result[8][layer]
        assert big["density"] == 1.0 and big["recall"] == pytest.approx(1.0, abs=1e-5)
        assert small["density"] < 1.0 and small["recall"] < 1.0
        assert big["dense_kv_bytes"] == small["dense_kv_bytes"] == tokens * zoo.KV_HEADS * 2 * head_dim * 4
        assert big["kv_bytes"] == zoo.KV_HEADS * tokens * slot_bytes
        assert small["kv_bytes"] == zoo.KV_HEADS * 8 * slot_bytes


def test_prompt_pruning_and_int8_end_to_end(zoo_model, fc_compile, tmp_path):
    """Through the compiler and FastCarSession (video_start = 6, the prompt): --prune-prompt 0 (every prompt key is
    hit, none skipped) with a budget above the video equals the original export (logits 1e-4, batch 2, left
    padding); --prune-prompt 0.5 does skip prompt keys (logits move); int8 buckets + pruning on a small budget
    (evicting) equal the NumPy reference path inside the transformers model (logits 1e-4, batch 1)."""
    from fastcar_compile.runtime import FastCarSession

    src = zoo_model("llama", "dynamo20")
    rng = np.random.default_rng(12)
    pad = [0, 2]
    prompt = rng.integers(0, zoo.VOCAB, (2, 6))
    mask, _ = ort_driver.left_pad_masks(pad, 6)
    steps = [rng.integers(0, zoo.VOCAB, (2, 1)) for _ in range(20)]
    want = ort_driver.decode(src, [prompt, *steps], pad=pad).logits
    diff = {}
    for prune in (0.0, 0.5):
        out = tmp_path / f"p{prune}.onnx"
        fc_compile(str(src), output=str(out), frame_tokens=4, threshold=float("inf"), kv_budget=64,
                   kv_window=4, prune_prompt=prune)
        got = run_session(FastCarSession(out), prompt, mask, steps, video_start=6).logits
        diff[prune] = max(np.abs(got[k] - want[k]).max() for k in range(1, len(want)))
    assert diff[0.0] <= 1e-4 < diff[0.5], diff
    # int8 buckets + pruning on a small budget (evicting), no replay: the NumPy reference path (fastar.generate,
    # HeadCache per KV head inside the transformers model) on the first row
    import json

    import torch

    from fastcar_compile.fastar.generate import ReferenceAttention, reference_attention

    small = tmp_path / "small.onnx"
    fc_compile(str(src), output=str(small), frame_tokens=4, threshold=float("inf"), kv_budget=12, kv_sinks=1,
               kv_window=4, sparse_attention="int8:4x3", prune_prompt=0.05)
    cfg = KVCompressConfig(budget=12, sinks=1, window=4, int8_dirs=4, int8_tables=3, prune_prompt=0.05,
                           frame_tokens=4, video_start=6)
    run = run_session(FastCarSession(small), prompt[:1], mask[:1], [s[:1] for s in steps], video_start=6)
    assert run.arrays["past_kv_slots.0"].shape == (1, 2, 12, slot_width(cfg))
    model = zoo.build_model("llama", attn_implementation="eager")
    ref = ReferenceAttention([cfg] * zoo.LAYERS, 6 + len(steps), model.config.rope_parameters["rope_theta"])
    with reference_attention(model, ref), torch.no_grad():
        past, want_small = None, []
        for ids in [prompt[:1], *(s[:1] for s in steps)]:
            res = model(input_ids=torch.as_tensor(ids), past_key_values=past, use_cache=True)
            past = res.past_key_values
            want_small.append(res.logits.numpy())
    for k, (g, w) in enumerate(zip(run.logits, want_small, strict=True)):
        assert np.abs(g - w).max() <= 1e-4, (k, np.abs(g - w).max())
    assert all(s.summary()["density"] < 1 for s in ref.stats)  # buckets, eviction and pruning skip keys
    assert max(np.abs(w[0, -1] - d[0, -1]).max() for w, d in zip(want_small[1:], want[1:], strict=True)) > 1e-3
    props = {p.key: p.value for p in onnx.load(str(small), load_external_data=False).metadata_props}
    kvc = json.loads(props[contract.FastCarMetadata.key("kv_compress")])
    assert (kvc["int8_dirs"], kvc["int8_tables"], kvc["prune_prompt"]) == (4, 3, 0.05)


def test_tempcache_waits_for_video_end_to_end(zoo_model, fc_compile, tmp_path):
    """Through the compiler and FastCarSession with a 6-token prompt (video_start = 6, batch 2, left padding) and
    --tempcache -1 (any two keys merge): by docs/semantics.md's "one frame back" no prompt token merges and neither does
    video frame 0 (its p - L is prompt), every later video token merges into frame 0's slot of its spatial
    position; so each (row, KV head) ends with one slot per prompt KV index (pads included, count 1) and one per
    spatial position (latest member: its last video token, count: its video tokens)."""
    from fastcar_compile.runtime import FastCarSession

    src = zoo_model("llama", "dynamo20")
    out = tmp_path / "tc.onnx"
    fc_compile(str(src), output=str(out), frame_tokens=4, threshold=float("inf"), kv_budget=32, kv_window=4, tempcache=-1.0)
    graph = onnx.load(str(out), load_external_data=False).graph
    assert all(n.input[11] == contract.VIDEO_START for n in graph.node if n.op_type == "CompressedAttention")
    rng = np.random.default_rng(13)
    pad, T = [0, 2], 6 + 13
    prompt = rng.integers(0, zoo.VOCAB, (2, 6))
    mask, _ = ort_driver.left_pad_masks(pad, 6)
    steps = [rng.integers(0, zoo.VOCAB, (2, 1)) for _ in range(T - 6)]
    run = run_session(FastCarSession(out), prompt, mask, steps, video_start=6)
    video = np.arange(6, T)
    want = sorted([(p, 1) for p in range(6)] + [(int(video[(video - 6) % 4 == s].max()), int(((video - 6) % 4 == s)
                                                                                             .sum())) for s in range(4)])
    for layer in range(zoo.LAYERS):
        slots = run.arrays[f"past_kv_slots.{layer}"]
        for b in range(2):
            for h in range(slots.shape[1]):
                live = slots[b, h, :, 0] > 0
                got = sorted(zip(slots[b, h, live, 0].astype(int) - 1, slots[b, h, live, 1].astype(int), strict=True))
                assert got == want, (layer, b, h)


@pytest.mark.parametrize("kw,msg", [
    (dict(kv_sinks=2), "need --kv-budget"),
    (dict(kv_budget=4, kv_sinks=2, kv_window=2), "must exceed sinks \\+ window"),
    (dict(kv_budget=8, sparse_attention="lsh8x4"), "lsh:BITSxTABLES"),
    (dict(kv_budget=8, tempcache=1.5), "cosine in \\[-1, 1\\]"),
    (dict(kv_budget=8, fused_attention="gqa"), "--fused-attention fastcar"),
    (dict(kv_budget=8, sparse_attention="int8:3x4"), "--sparse-attention int8:3x4: int8 buckets need 1/2/4/8 dir"),
    (dict(kv_budget=8, sparse_attention="int8:"), "int8:DIRSxTABLES"),
    (dict(kv_budget=8, prune_prompt=1.5), "softmax weight in \\[0, 1\\]"),
    (dict(prune_prompt=0.1), "need --kv-budget"),
    (dict(kv_layers=("0:budget=8,prune=x",)), "tempcache/prune numbers"),
])
def test_bad_kv_options_are_one_line(kw, msg):
    from fastcar_compile.passes.context import CompileOptions

    with pytest.raises(FastCarError, match=msg):
        CompileOptions(frame_tokens=4, **kw)


def test_valid_kv_options_are_kept():
    """The control case of the refusals above: valid values pass through to the config the pass reads."""
    from fastcar_compile.passes.context import CompileOptions

    cfg = CompileOptions(frame_tokens=4, kv_budget=8, kv_sinks=2, kv_window=4).kv_compress
    assert (cfg.budget, cfg.sinks, cfg.window) == (8, 2, 4)
    cfg = CompileOptions(frame_tokens=4, kv_budget=8, kv_window=4, sparse_attention="int8", prune_prompt=0.02).kv_compress
    assert (cfg.int8_dirs, cfg.int8_tables, cfg.lsh_bits, cfg.prune_prompt) == (2, 4, None, 0.02)
    opts = CompileOptions(frame_tokens=4, kv_layers=("1:budget=8,window=4,sparse=int8:8x2,prune=0.1",))
    assert (opts.kv_config(1).int8_dirs, opts.kv_config(1).int8_tables, opts.kv_config(1).prune_prompt) == (8, 2, 0.1)


def test_int8_buckets_against_a_per_element_loop():
    """fastar.int8's vectorised bucket ids equal a plain loop over the definition (unit vector, projection
    scaled by sqrt(D), floor(32 y) clamped to int8, top 8/dirs bits offset and packed), for every dirs."""
    import math

    from fastcar_compile.fastar.int8 import Int8Buckets

    x = np.random.default_rng(4).standard_normal((30, 16)) * np.linspace(0.1, 9, 30)[:, None]
    x[0] = 0.0
    for dirs in (1, 2, 4, 8):
        hb = Int8Buckets(16, dirs, 3, seed=dirs)
        bits = 8 // dirs
        for row in x:
            n = math.sqrt(sum(float(a) ** 2 for a in row))
            want = []
            for t in range(3):
                code = 0
                for r in range(dirs):
                    dot = sum(float(u) * float(a) for u, a in zip(hb.planes[t, r], row, strict=True))
                    y = math.sqrt(16) * dot / n if n > 0 else 0.0
                    c = min(127, max(-128, math.floor(32 * y)))
                    code += (c // 2 ** (8 - bits) + 2 ** (bits - 1)) * 2 ** (bits * r)
                want.append(code)
            assert hb.codes(row).tolist() == want
            assert all(0 <= w < 256 for w in want)


def test_tempcache_lemma_in_the_kernel():
    """TempCache's lemma, kernel side: m identical keys (post-RoPE identical: fed directly) with different values
    merge into one slot (mean value, count m, logit + log m), and attention over that slot equals dense attention
    over the m copies, written independently, at every step."""
    rng = np.random.default_rng(5)
    T, m = 12, 10
    key = rng.standard_normal((HKV, D))
    k = np.concatenate([rng.standard_normal((T - m, HKV, D)), np.repeat(key[None], m, 0)])
    v = rng.standard_normal((T, HKV, D))
    q = rng.standard_normal((T, HQ, D))
    cfg = KVCompressConfig(budget=T, tempcache_sim=0.999, frame_tokens=1, video_start=0)
    attrs = compressed_attributes(cfg, D)
    sess = session(True, n_in=10, n_out=6, **attrs)
    f32 = np.float32
    st = [np.zeros((1, HKV, T, D), f32), np.zeros((1, HKV, T, D), f32), np.zeros((1, HKV, T, SLOT_FIELDS), f32),
          np.zeros((1, HKV, T, D), f32)]
    for t in range(T):
        one = {n: x[t][:, None][None].astype(f32) for n, x in (("q", q), ("k", k), ("v", v), ("k_raw", k))}
        res = sess.run(None, {**one, "past_key": st[0], "past_value": st[1], "past_slots": st[2],
                              "past_key_raw": st[3], "attention_mask": np.ones((1, t + 1), np.int64),
                              "total_len": np.array(t + 1, np.int32)})
        st = [res[1], res[2], res[3], res[5]]
        for h in range(HQ):
            s = k[: t + 1, h // 2] @ q[t, h] / np.sqrt(D)
            w = np.exp(s - s.max())
            want = (w / w.sum()) @ v[: t + 1, h // 2]
            assert np.abs(res[0][0, 0, h * D:(h + 1) * D] - want).max() <= 1e-5, (t, h)
    live = st[2][0, :, :, 0] > 0
    assert live.sum(axis=1).tolist() == [T - m + 1] * HKV  # the m copies share one slot per KV head
    assert sorted(st[2][0, 0, live[0], 1].tolist()) == [1.0] * (T - m) + [float(m)]


def test_compressed_model_refusals_are_one_line(zoo_model, fc_compile, tmp_path):
    """A compressed model without the native kernels, and compression asked of a model whose attention cannot
    take the op (GPT-2's 2-D Gemm projection), fail with one clear FastCarError each."""
    from fastcar_compile.runtime import FastCarSession

    comp = tmp_path / "comp.onnx"
    fc_compile(str(zoo_model("llama", "dynamo20")), output=str(comp), frame_tokens=4, kv_budget=16, kv_window=4)
    with pytest.raises(FastCarError, match="only the native kernels run"):
        FastCarSession(comp, native=False)
    with pytest.raises(FastCarError, match="cannot take .*no exported MatMul/Softmax attention core"):
        fc_compile(str(zoo_model("gpt2", "dynamo20")), output=str(tmp_path / "g.onnx"), frame_tokens=4, kv_budget=16, kv_window=4)


def test_bad_sparse_and_prune_cli_exit_2(zoo_model, tmp_path, capsys):
    """On the command line: bad int8 / prune values are one stderr line, exit 2, no output file."""
    from fastcar_compile.cli import main

    src = str(zoo_model("llama", "dynamo20"))
    for extra, msg in ((["--kv-budget", "8", "--sparse-attention", "int8:3x4"], "int8 buckets need 1/2/4/8 directions"),
                       (["--kv-budget", "8", "--sparse-attention", "int9"], "int8:DIRSxTABLES"),
                       (["--kv-budget", "8", "--prune-prompt", "1.5"], "softmax weight in [0, 1]"),
                       (["--prune-prompt", "0.1"], "need --kv-budget")):
        assert_cli_refuses(main, [src, "-o", str(tmp_path / "o.onnx"), "--frame-tokens", "4", *extra], msg,
                           tmp_path / "o.onnx", capsys)


def test_prune_everything_equals_attention_without_the_prompt():
    """--prune-prompt 1.0 (no softmax weight over several keys reaches 1: no prompt key is ever hit): the prompt
    and frame 0 attend to everything, every later query to the video tokens only (written independently)."""
    vs = 7
    cfg = KVCompressConfig(budget=64, prune_prompt=1.0, frame_tokens=L, video_start=vs)
    q, k, v = _trace(5, 40, repeat=False)
    got, _ = run_kernel(cfg, q, k, v, [9] + [1] * 31)
    pos = np.arange(40)
    qp, kp = apply_rope(np.swapaxes(q, 0, 1), pos), apply_rope(np.swapaxes(k, 0, 1), pos)
    for t in range(40):
        first = vs if t >= vs + L else 0
        for h in range(HQ):
            s = kp[h // 2, first: t + 1] @ qp[h, t] / np.sqrt(D)
            w = np.exp(s - s.max())
            assert np.abs(got[t, h] - (w / w.sum()) @ v[first: t + 1, h // 2]).max() <= 1e-5, (t, h)


def test_per_layer_int8_and_prune_slot_widths_equal_the_export(zoo_model, fc_compile, tmp_path):
    """--kv-layer with the new settings on different layers: layer 0 prunes at 0 (nothing skipped), layer 1
    buckets by int8 but every token is a sink (all attended): logits equal the original export (1e-4, batch 2,
    left padding, a 3-token step), each layer's slot state has its own width (3 + 1 hit field; 3 + 3 tables)
    and the bucket ids were written."""
    import json

    from fastcar_compile.runtime import FastCarSession

    src = zoo_model("llama", "dynamo20")
    comp = tmp_path / "comp.onnx"
    fc_compile(str(src), output=str(comp), frame_tokens=4, threshold=float("inf"),
               kv_layers=["0:budget=64,window=4,prune=0", "1:budget=80,sinks=64,window=4,sparse=int8:2x3"])
    rng = np.random.default_rng(21)
    prompt = rng.integers(0, zoo.VOCAB, (2, 6))
    mask, _ = ort_driver.left_pad_masks([0, 3], 6)
    steps = [rng.integers(0, zoo.VOCAB, (2, 3 if k == 4 else 1)) for k in range(24)]
    run = run_session(FastCarSession(comp), prompt, mask, steps, video_start=6)
    want = ort_driver.decode(src, [prompt, *steps], pad=[0, 3]).logits
    for k in range(1, len(want)):
        assert np.abs(run.logits[k] - want[k]).max() <= 1e-4, f"step {k}"
    s0, s1 = run.arrays["past_kv_slots.0"], run.arrays["past_kv_slots.1"]
    assert s0.shape == (2, 2, 64, SLOT_FIELDS + 1) and s1.shape == (2, 2, 80, SLOT_FIELDS + 3)
    live = s1[..., 0] > 0
    assert live.sum() == 2 * 2 * 32 and (s1[..., 3:][live] > 0).any()  # 32 tokens, bucket ids stored
    meta = json.loads({p.key: p.value for p in onnx.load(str(comp), load_external_data=False)
                       .metadata_props}["fastcar.kv_compress"])
    assert meta["per_layer"]["0"]["prune_prompt"] == 0.0 and meta["per_layer"]["1"]["int8_dirs"] == 2


def test_slot_state_of_another_width_is_refused():
    """A past_slots record one field narrower than the op's settings (LSH tables: a state from another compile)
    is refused with a message naming the expected layout, instead of the kernel writing past the buffer; the
    state of the right width runs (control)."""
    cfg = KVCompressConfig(**{"video_start": 0, **CONFIGS["lsh"]}, frame_tokens=L)
    C, F = cfg.budget, slot_width(cfg)
    sess = session(True, n_in=8, n_out=5, **compressed_attributes(cfg, D))
    rng = np.random.default_rng(0)
    feeds = {"q": rng.standard_normal((1, HQ, 1, D)).astype(np.float32),
             "k": rng.standard_normal((1, HKV, 1, D)).astype(np.float32),
             "v": rng.standard_normal((1, HKV, 1, D)).astype(np.float32),
             "past_key": np.zeros((1, HKV, C, D), np.float32), "past_value": np.zeros((1, HKV, C, D), np.float32),
             "attention_mask": np.ones((1, 1), np.int64), "total_len": np.array(1, np.int32)}
    out = sess.run(None, {**feeds, "past_slots": np.zeros((1, HKV, C, F), np.float32)})
    assert np.isfinite(out[0]).all() and out[3].shape == (1, HKV, C, F)
    with pytest.raises(Exception, match=rf"past_slots must be \[batch, kv_heads, budget, {F}\]"):
        sess.run(None, {**feeds, "past_slots": np.zeros((1, HKV, C, F - 1), np.float32)})


@pytest.mark.parametrize("name,key", [("lsh", "lsh_planes"), ("int8", "int8_planes")])
def test_bucket_planes_of_another_size_are_refused(name, key):
    """Bucket planes that do not match tables x bits x head_dim (a model edited by hand, or compiled for another
    head size) are refused instead of read past their end; the compiler's own planes run (control)."""
    cfg = KVCompressConfig(**{"video_start": 0, **CONFIGS[name]}, frame_tokens=L)
    C, F = cfg.budget, slot_width(cfg)
    attrs = compressed_attributes(cfg, D)
    rng = np.random.default_rng(0)
    feeds = {"q": rng.standard_normal((1, HQ, 1, D)).astype(np.float32),
             "k": rng.standard_normal((1, HKV, 1, D)).astype(np.float32),
             "v": rng.standard_normal((1, HKV, 1, D)).astype(np.float32),
             "past_key": np.zeros((1, HKV, C, D), np.float32), "past_value": np.zeros((1, HKV, C, D), np.float32),
             "attention_mask": np.ones((1, 1), np.int64), "total_len": np.array(1, np.int32),
             "past_slots": np.zeros((1, HKV, C, F), np.float32)}
    assert np.isfinite(session(True, n_in=8, n_out=5, **attrs).run(None, feeds)[0]).all()
    short = session(True, n_in=8, n_out=5, **{**attrs, key: list(attrs[key])[:-D]})
    with pytest.raises(Exception, match="do not match tables x bits"):
        short.run(None, feeds)


def test_kv_ratios_without_finalize():
    """A caller that steps the session itself never calls finalize: `kv_ratios` must give
    density/recall from the running sums alone, equal to NumPy ratios of the summed kv_stats.N outputs, and
    finalize must store the same numbers."""
    from fastcar_compile.runtime.stats import RunStats

    rng = np.random.default_rng(0)
    stats = RunStats(model="m", fastcar=False, frame_tokens=4, layers=[], batch=2, video_start=0, num_frames=2)
    steps = [{contract.kv_stats_output(n): rng.uniform(1, 50, (2, 3, 4)).astype(np.float32) for n in (1, 3)}
             | {"logits": np.zeros(1)} for _ in range(5)]
    for extra in steps:
        stats.add_kv_stats(extra)
    ratios = stats.kv_ratios()
    assert sorted(ratios) == ["1", "3"]
    for n in (1, 3):
        executed, dense, recall, queries = np.stack([s[contract.kv_stats_output(n)] for s in steps],
                                                    dtype=np.float64).sum(axis=(0, 1, 2))
        assert ratios[str(n)]["density"] == pytest.approx(executed / dense, rel=1e-6)
        assert ratios[str(n)]["recall"] == pytest.approx(recall / queries, rel=1e-6)
    assert "density" not in stats.kv_diagnostics["1"]  # nothing stored before finalize
    stats.finalize()
    assert {k: {f: v[f] for f in ("density", "recall")} for k, v in stats.kv_diagnostics.items()} == ratios
