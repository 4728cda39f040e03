"""fastcar_compile.torch: FastCar found in the torch.export graph and run in PyTorch, checked
against the eager hook reference (tests/reference.py) with the protocol of test_pass_reference: greedy
decode by the reference at a tau in a TAS gap, the same tokens fed here; logits, replay decisions, TAS and
the final replay state within 1e-4."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import test_pass_reference as tpr
import torch
import zoo
from ort_driver import left_pad_masks
from reference import FastCarReference
from test_pass_reference import TOL, Case

fct = pytest.importorskip("fastcar_compile.torch")
from fastcar_compile.core.errors import FastCarError  # noqa: E402

L = tpr.L
CASES = [
    Case("llama", "torch", "rope", max_replay=2, pad=(0, 2), video_start=3, chunk=L + 2),
    Case("qwen2", "torch", "raw", max_replay=1, pad=(1, 0), video_start=2, per_layer=True),
    Case("phi3", "torch", "rope", max_replay=2, pad=(0, 1), video_start=3, layers=(0,)),
    Case("gpt2", "torch", "raw", max_replay=3, pad=(0, 2), video_start=2, per_layer=True, runtime_tau=True),
]


def feed(model, steps, pad, **kw):
    """Run the FastCar transformers model over `steps` with a DynamicCache; per step logits/replay/tas."""
    from transformers import DynamicCache

    B = steps[0].shape[0]
    mask, pos = left_pad_masks(list(pad), steps[0].shape[1])
    cache = DynamicCache(config=model.config)
    logits, replay, tas = [], [], []
    with torch.no_grad():
        for k, ids in enumerate(steps):
            if k > 0:
                s = ids.shape[1]
                pos = pos[:, -1:] + 1 + np.arange(s)[None, :]
                mask = np.concatenate([mask, np.ones((B, s), np.int64)], axis=1)
            out = model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                        position_ids=torch.as_tensor(pos), past_key_values=cache, **kw)
            logits.append(out.logits.numpy())
            replay.append({i: r.numpy().copy() for i, r in model.fastcar.last_replay.items()})
            tas.append({i: t.numpy().copy() for i, t in model.fastcar.last_tas.items()})
    return logits, replay, tas


def check(case: Case):
    run, taus, layers = tpr.reference_run(case, n_decode=5 * L - 1)
    model = zoo.build_model(case.family)
    tau = taus if case.per_layer else taus[0]
    fm = fct.apply(model, frame_tokens=L, threshold=([100.0] * len(taus) if case.per_layer else 100.0)
                   if case.runtime_tau else tau, tas_query=case.tas_query, max_replay=case.max_replay,
                   layers=list(case.layers) if case.layers else None, per_layer_threshold=case.per_layer,
                   video_start=0 if case.runtime_tau else case.video_start)
    assert fm.fastcar.layers == layers
    kw = {"fastcar_threshold": tau, "video_start": case.video_start} if case.runtime_tau else {}
    logits, replay, tas = feed(fm, run.steps, case.pad, **kw)
    for k in range(len(run.steps)):
        real = tpr._real(run, case.pad, k, aligned=False)
        diff = np.abs(logits[k] - run.logits[k])[real].max()
        assert diff <= TOL, f"step {k}: logits differ from the reference by {diff:.3g}"
        for i in layers:
            assert np.array_equal(replay[k][i], run.replay[i][k]), f"step {k} layer {i}: replay differs"
            m = tpr._real(run, case.pad, k, aligned=True)
            if m.any():
                tdiff = np.abs(tas[k][i].astype(np.float64) - run.tas[i][k])[m].max()
                assert tdiff <= TOL, f"step {k} layer {i}: TAS differs by {tdiff:.3g}"
    state = fm.fastcar.state
    for j, i in enumerate(layers):
        np.testing.assert_array_equal(state[2 * j + 1].numpy(), run.final_age[i])
        np.testing.assert_allclose(state[2 * j].numpy(), run.final_cache[i], atol=TOL, rtol=0)
    dec = tpr._decisions(run, layers, case.video_start)
    assert dec.any() and not dec.all() and (dec[0] != dec[1]).any()
    return fm, run


@pytest.mark.parametrize("case", CASES[::3], ids=[c.id for c in CASES[::3]])
def test_matches_eager_reference(case):
    check(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES[1:3], ids=[c.id for c in CASES[1:3]])
def test_matches_eager_reference_more(case):
    check(case)


def test_model_untouched_and_dense_at_inf():
    """tau=+inf: the FastCar model's logits are the original model's; the input model keeps its forward."""
    model = zoo.build_model("llama")
    fm = fct.apply(model, frame_tokens=L, threshold=math.inf)
    assert type(model).forward is not type(fm).forward and "fastcar" not in dict(model.named_children())
    ids = torch.randint(0, zoo.VOCAB, (1, 3 * L))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=2 * L, do_sample=False)
        got = fm.generate(ids, max_new_tokens=2 * L, do_sample=False)
    assert torch.equal(want, got)


def test_generate_replays_like_reference():
    """transformers' own generate() on the applied model: greedy tokens equal the reference's at finite tau;
    a second generate() (a new video) starts from a reset replay cache."""
    model = zoo.build_model("qwen2")
    prompt = np.random.default_rng(3).integers(0, zoo.VOCAB, (1, 6))
    probe_tau = None
    for tau in (0.5, 0.0, 1.0, -0.5):
        with FastCarReference(model, frame_tokens=L, threshold=tau, video_start=2) as ref:
            run = ref.run([prompt], greedy=4 * L)
        dec = np.concatenate([np.concatenate(run.replay[i][1:], 1) for i in (0, 1)])
        if dec.any() and not dec.all():
            probe_tau = tau
            break
    assert probe_tau is not None
    fm = fct.apply(model, frame_tokens=L, threshold=probe_tau)  # video_start given per call below
    want = np.concatenate([s for s in run.steps], axis=1)
    for _ in range(2):  # the second call must not replay the first video's cache
        with torch.no_grad():
            got = fm.generate(torch.as_tensor(prompt), max_new_tokens=4 * L, do_sample=False, video_start=2)
        np.testing.assert_array_equal(got.numpy(), want)
        assert fm.fastcar.stats.replayed == int(dec.sum())
    with torch.no_grad():  # tau per call: +inf never replays, so generate() is the plain model's
        got = fm.generate(torch.as_tensor(prompt), max_new_tokens=4 * L, do_sample=False, fastcar_threshold=math.inf)
        plain = model.generate(torch.as_tensor(prompt), max_new_tokens=4 * L, do_sample=False)
    assert torch.equal(got, plain) and fm.fastcar.stats.replayed == 0


def test_video_start_with_frame_zero_in_prompt():
    """A prompt of text then frame 0 (the README's case): the video starts at len(prompt) - L. generate() with
    prompt_frames=1, and with that video_start, replays as the eager reference does; the prompt length as
    video_start (frame 0 left out of the replay cache) never replays in frame 1 where the reference does; a video_start that disagrees with
    prompt_frames is refused in one line."""
    model = zoo.build_model("llama")
    text = 3
    prompt = np.random.default_rng(5).integers(0, zoo.VOCAB, (1, text + L))
    for tau in (0.5, 0.0, 1.0, -0.5, 2.0):
        with FastCarReference(model, frame_tokens=L, threshold=tau, video_start=text) as ref:
            run = ref.run([prompt], greedy=4 * L)
        # generate() feeds every token but the last one it samples: the reference's decode steps but its last
        dec = np.concatenate([np.concatenate(run.replay[i][1:-1], 1) for i in (0, 1)])
        first = np.concatenate([np.concatenate(run.replay[i][1:L + 1], 1) for i in (0, 1)])  # frame 1
        if dec.any() and not dec.all() and first.any():
            break
    else:
        pytest.fail("no tau with mixed decisions (reference)")
    fm = fct.apply(model, frame_tokens=L, threshold=tau)
    want = np.concatenate(run.steps, axis=1)
    for kw in ({"prompt_frames": 1}, {"video_start": text}, {"prompt_frames": 1, "video_start": text}):
        with torch.no_grad():
            got = fm.generate(torch.as_tensor(prompt), max_new_tokens=4 * L, do_sample=False, **kw)
        np.testing.assert_array_equal(got.numpy(), want, err_msg=str(kw))
        assert fm.fastcar.stats.replayed == int(dec.sum()), kw
    with torch.no_grad():  # frame 1 (the first L tokens fed after the prompt) never replays: frame 0 is not cached
        fm.generate(torch.as_tensor(prompt), max_new_tokens=L + 1, do_sample=False, video_start=prompt.shape[1])
    assert fm.fastcar.stats.replayed == 0 < int(first.sum())
    for kw, msg in (({"prompt_frames": 1, "video_start": prompt.shape[1]}, "disagrees with prompt_frames"),
                    ({"prompt_frames": 3}, "prompt has 7"), ({"video_start": -1}, "integer >= 0")):
        with pytest.raises(FastCarError, match=msg) as err, torch.no_grad():
            fm.generate(torch.as_tensor(prompt), max_new_tokens=2, do_sample=False, **kw)
        assert "\n" not in str(err.value)


class _NoAttention(torch.nn.Module):
    """Flat KV contract, but the cache is never read by an attention op."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.k = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, input_ids, attention_mask, position_ids, past_k, past_v):
        h = self.emb(input_ids)
        k = torch.cat([past_k, self.k(h).unsqueeze(1)], dim=2)
        v = torch.cat([past_v, h.unsqueeze(1)], dim=2)
        return self.head(h + k.mean(2).sum(1, keepdim=True)), k, v


def test_no_block_is_one_clear_error():
    ex = (torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 8, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long),
          torch.zeros(2, 1, 5, 8), torch.zeros(2, 1, 5, 8))
    with pytest.raises(FastCarError) as err:
        fct.apply(_NoAttention(), frame_tokens=L, threshold=0.0, example_inputs=ex)
    msg = str(err.value)
    assert "\n" not in msg and "missing anchor 'attention'" in msg and "layer 0" in msg
    with pytest.raises(FastCarError, match="tas-query"):
        fct.apply(_NoAttention(), frame_tokens=L, threshold=0.0, tas_query="post", example_inputs=ex)


def _decode_inputs(dec, batch: int, past: int, ages: list[int], seed: int = 0) -> list[torch.Tensor]:
    """Program inputs of one decode step (1 token after `past`), each row's ages set to ages[row]."""
    g = torch.Generator().manual_seed(seed)
    hkv, d = dec.kv_shape
    args = [torch.randint(0, zoo.VOCAB, (batch, 1), generator=g), torch.ones(batch, past + 1, dtype=torch.long),
            torch.full((batch, 1), past)]
    args += [torch.randn(batch, hkv, past, d, generator=g) for _ in range(dec.num_kv)]
    args += [torch.tensor(0), dec.threshold_tensor()]
    for _ in dec.layers:
        args += [torch.randn(batch, L, dec.hidden, generator=g),
                 torch.tensor(ages, dtype=torch.long)[:, None].expand(batch, L).contiguous()]
    return args


def _down_proj_rows(fn, args) -> tuple[tuple, int]:
    """Rows the MLP down projections ([rows, INTER] @ [INTER, HIDDEN]) ran on in one call of `fn` (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out = fn(*args)
    rows = sum(e.input_shapes[0][0] for e in prof.events()
               if e.name == "aten::mm" and list(e.input_shapes[1]) == [zoo.INTER, zoo.HIDDEN])
    return out, rows


def _compile_check(backend: str, count_rows: bool):
    """The decode step traces into one graph (no graph break: the three cases are nested torch.conds, the
    compacted rows go through an opaque custom op), the compiled step gives the eager step's outputs when all
    rows, some rows or no row replays, and its MLP runs on the computed rows only (profiled matmul shapes)."""
    fm = fct.apply(zoo.build_model("llama"), frame_tokens=L, threshold=-1e9)
    prog = fm.fastcar.program
    explain = torch._dynamo.explain(prog)(*_decode_inputs(fm.fastcar, 2, 2 * L + 1, [0, 0]))
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(prog, backend=backend, dynamic=True)
    n_out = 1 + fm.fastcar.num_kv + 2 * len(fm.fastcar.layers)
    for ages in ([0, 0], [0, -1], [-1, -1], [-1, 0]):  # all replay / row 1 never written / nothing replays
        args = _decode_inputs(fm.fastcar, 2, 2 * L + 1, ages)
        with torch.no_grad():
            want = prog(*args)
            compiled(*args)  # compiles on first use; profile the second call
        got, rows = _down_proj_rows(compiled, args)
        replay = want[n_out]
        assert replay.tolist() == [[a >= 0] for a in ages]
        if count_rows:
            assert rows == sum(a < 0 for a in ages) * len(fm.fastcar.layers), (ages, rows)
        for a, b in zip(want, got, strict=True):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_torch_compile_decode_step_one_graph():
    _compile_check("aot_eager", count_rows=True)


@pytest.mark.slow
def test_torch_compile_inductor():
    _compile_check("inductor", count_rows=False)


def test_torch_compile_model_generate():
    """torch.compile(model).generate(...) compiles the FastCar decode step with the given backend (frames counted
    by the backend, the fastcar ops in its graphs) and generates the eager model's tokens with its replays; the
    model itself keeps running eagerly."""
    from torch._dynamo.testing import CompileCounterWithBackend

    fm = fct.apply(zoo.build_model("llama"), frame_tokens=L, threshold=0.0)
    prompt = torch.as_tensor(np.random.default_rng(5).integers(0, zoo.VOCAB, (1, 3 + L)))
    with torch.no_grad():
        want = fm.generate(prompt, max_new_tokens=3 * L, do_sample=False, prompt_frames=1)
    replayed = fm.fastcar.stats.replayed
    assert 0 < replayed < fm.fastcar.stats.decisions
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    with torch.no_grad():
        got = torch.compile(fm, backend=counter, dynamic=True).generate(prompt, max_new_tokens=3 * L, do_sample=False,
                                                                         prompt_frames=1)
    assert torch.equal(got, want) and fm.fastcar.stats.replayed == replayed
    assert counter.frame_count >= 1
    ops = {str(n.target) for g in counter.graphs for n in g.graph.nodes}
    assert {"fastcar.temporal_gate.default", "fastcar.mlp_cache_update.default"} <= ops
    frames = counter.frame_count
    with torch.no_grad():
        assert torch.equal(fm.generate(prompt, max_new_tokens=3 * L, do_sample=False, prompt_frames=1), want)
    assert counter.frame_count == frames


def test_torch_compile_compiles_one_decode_graph():
    """torch.compile(model) with its defaults (no dynamic=True): a whole generate() compiles one graph, the decode
    step, for every KV length (the prefill, once per video, runs eagerly): it compiled three before (prefill, the
    first decode step, then a dynamic one), each taking a minute or more on a CPU; the tokens are the eager model's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    fm = fct.apply(zoo.build_model("llama"), frame_tokens=L, threshold=0.0)
    prompt = torch.as_tensor(np.random.default_rng(6).integers(0, zoo.VOCAB, (1, 3 + L)))
    with torch.no_grad():
        want = fm.generate(prompt, max_new_tokens=2 * L, do_sample=False, prompt_frames=1)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    with torch.no_grad():
        got = torch.compile(fm, backend=counter).generate(prompt, max_new_tokens=2 * L, do_sample=False,
                                                          prompt_frames=1)
    assert torch.equal(got, want)
    assert counter.frame_count == 1


def _mlp_rows_run(path, profile: str) -> dict[int, int]:
    """Rows each layer's MLP ran on in an ORT profile: every MLP MatMul/Gemm event's input rows (all but the last
    dim of its first input), summed and divided by the MatMuls per branch."""
    import json

    import onnx

    from fastcar_compile.core import contract
    from fastcar_compile.fpga_backend.modelspec import iter_nodes

    model = onnx.load(str(path), load_external_data=False)
    mlp = {}
    for node in iter_nodes(model.graph):
        tags = {p.key: p.value for p in node.metadata_props}
        if node.op_type in ("MatMul", "Gemm") and tags.get(contract.TAG_PART) == "mlp":
            mlp[node.name] = int(tags[contract.TAG_LAYER])
    # MatMuls of one MLP per layer (BranchPass runs its nodes once; the older nested layout's compacted copy
    # is named "/fastcar_compact_N" and not counted)
    per_branch = Counter(i for name, i in mlp.items() if "/fastcar_compact_" not in name)
    rows: Counter = Counter()
    for ev in json.load(open(profile)):
        name = ev["name"].removesuffix("_kernel_time")
        if ev.get("cat") == "Node" and name in mlp and ev["name"].endswith("_kernel_time"):
            shape = next(iter(ev["args"]["input_type_shape"][0].values()))
            rows[mlp[name]] += math.prod(shape[:-1])
    return {i: rows[i] // per_branch[i] for i in per_branch}


def _fpga_view(path):
    """What the FPGA flow makes of a fast.onnx: the spec, every task graph, and the contents of each weight."""
    import dataclasses

    import onnx
    from onnx import numpy_helper

    from fastcar_compile.fpga_backend import load_board
    from fastcar_compile.fpga_backend.partition import partition

    proto = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    part = partition(proto, load_board("kv260"))
    tasks = [[dataclasses.astuple(t) for t in part.tasks(g)] for g in part.graphs]
    weights = {t["name"]: inits[t["source"]] for t in part.tensors if t.get("source")}
    return part.spec, tasks, weights


def _lowering_vs_onnx_path(family, zoo_model, fc_compile, tmp_path, fpga=False):
    """fast.onnx lowered from the torch program and fast.onnx from the ONNX pass on the dynamo export of the
    same model: same metadata and node tags (`fastcar.layer`/`fastcar.part` per op type), same logits and
    replay decisions in ORT, both equal to the reference; rows replay differently at batch 2 and the lowered
    MLP runs on the computed rows only (ORT profile); with `fpga` the FPGA partitioner builds the same task
    graphs from both, with the same weights."""
    import onnxruntime as ort
    import ort_driver

    from fastcar_compile.core import contract
    from fastcar_compile.fpga_backend.modelspec import iter_nodes

    case = Case(family, "dynamo20", "rope", max_replay=2, pad=(0, 2), video_start=3)
    run, taus, layers = tpr.reference_run(case, n_decode=4 * L - 1)
    opts = dict(frame_tokens=L, threshold=taus[0], tas_query="rope", max_replay=2)
    fm = fct.apply(zoo.build_model(family), video_start=case.video_start, **opts)
    fct.to_onnx(fm, tmp_path / "torch.onnx", emit_diagnostics=True)
    fc_compile(str(zoo_model(family, "dynamo20")), output=str(tmp_path / "onnx.onnx"), emit_diagnostics=True,
               fused_attention=None, fusions=False, video_start=case.video_start,  # apply's video_start, compiled in
               **opts)  # the exported attention and ops, as the torch path keeps them
    import onnx

    protos = [onnx.load(str(tmp_path / f"{n}.onnx"), load_external_data=False) for n in ("torch", "onnx")]
    metas = [contract.FastCarMetadata.from_props({p.key: p.value for p in m.metadata_props}) for m in protos]
    assert {**vars(metas[0]), "version": ""} == {**vars(metas[1]), "version": ""}
    tags = [Counter((d[contract.TAG_LAYER], d[contract.TAG_PART], n.op_type) for n in iter_nodes(m.graph)
                    for d in [{p.key: p.value for p in n.metadata_props}] if contract.TAG_LAYER in d) for m in protos]
    assert tags[0] == tags[1] and {p for _, p, _ in tags[0]} >= {"attention", "gate", "cache", "mlp"}
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep the node names
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(ort_driver.model_source(tmp_path / "torch.onnx", so, {"video_start"}), so,
                                providers=["CPUExecutionProvider"])
    got = [ort_driver.decode(sess, run.steps, pad=list(case.pad), video_start=case.video_start),
           ort_driver.decode(tmp_path / "onnx.onnx", run.steps, pad=list(case.pad), video_start=case.video_start)]
    rows = _mlp_rows_run(tmp_path / "torch.onnx", sess.end_profiling())
    for k in range(len(run.steps)):
        real = tpr._real(run, case.pad, k, aligned=False)
        for res in got:
            assert np.abs(res.logits[k] - run.logits[k])[real].max() <= TOL
        for i in layers:
            assert np.array_equal(got[0].replay_mask[i][k], got[1].replay_mask[i][k])
            assert np.array_equal(got[0].replay_mask[i][k].astype(bool), run.replay[i][k])
    dec = tpr._decisions(run, layers, case.video_start)
    assert dec.any() and (dec[0] != dec[1]).any()  # some steps replay one row and compute the other
    for i in layers:
        computed = sum(int((~run.replay[i][k].astype(bool)).sum()) for k in range(len(run.steps)))
        total = sum(run.replay[i][k].size for k in range(len(run.steps)))
        assert rows[i] == computed < total, f"layer {i}: MLP ran on {rows[i]} rows, {computed} computed tokens"
    if fpga:
        views = [_fpga_view(tmp_path / f"{n}.onnx") for n in ("torch", "onnx")]
        assert views[0][0] == views[1][0] and views[0][1] == views[1][1]
        assert views[0][2].keys() == views[1][2].keys() and len(views[0][2]) > 2
        for name, w in views[0][2].items():
            np.testing.assert_array_equal(w, views[1][2][name], err_msg=name)


def test_onnx_lowering_matches_onnx_path(zoo_model, fc_compile, tmp_path):
    _lowering_vs_onnx_path("llama", zoo_model, fc_compile, tmp_path, fpga=True)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "qwen2", "phi3"])
def test_onnx_lowering_matches_onnx_path_all(family, zoo_model, fc_compile, tmp_path):
    _lowering_vs_onnx_path(family, zoo_model, fc_compile, tmp_path, fpga=family == "qwen2")


def _embeds_run(step, prefix: np.ndarray, tokens: list[np.ndarray] | None, n_decode: int):
    """A video after a multimodal prefix: `prefix` [B, P, hidden] as inputs_embeds, then one token per step
    (`tokens`, or greedy when None). step(ids | None, embeds | None, mask, pos) -> (logits, replay, tas)."""
    from reference import RefRun

    B, P = prefix.shape[:2]
    mask, pos = np.ones((B, P), np.int64), np.tile(np.arange(P), (B, 1))
    run = RefRun()
    run.steps.append(np.zeros((B, P), np.int64))  # stands for the prefix (its shape is what _decisions reads)
    ids, embeds = None, prefix
    for k in range(n_decode + 1):
        if k > 0:
            ids = tokens[k] if tokens is not None else run.logits[-1][:, -1].argmax(-1)[:, None].astype(np.int64)
            embeds, pos = None, pos[:, -1:] + 1
            mask = np.concatenate([mask, np.ones((B, 1), np.int64)], axis=1)
            run.steps.append(ids)
        logits, replay, tas = step(ids, embeds, mask, pos)
        run.logits.append(logits)
        for i, r in replay.items():
            run.replay.setdefault(i, []).append(np.asarray(r))
            run.tas.setdefault(i, []).append(np.asarray(tas[i]))
    return run


def test_inputs_embeds_prefix_matches_reference():
    """inputs_embeds (a prefix that is no token's embedding) then tokens: logits, decisions and TAS equal the
    eager reference driven the same way; generate(inputs_embeds=...) gives the reference's greedy tokens."""
    from transformers import DynamicCache

    model, vs, n = zoo.build_model("llama"), 2, 4 * L
    prefix = np.random.default_rng(11).normal(0, 1.0, (2, 6, zoo.HIDDEN)).astype(np.float32)

    def reference(tau):
        with FastCarReference(model, frame_tokens=L, threshold=tau, video_start=vs) as ref:
            ref.reset(2)
            return _embeds_run(lambda i, e, m, p: ref.step(i, m, p, embeds=e), prefix, None, n)

    probe = reference(math.inf)
    for tau in tpr._gap_candidates(tpr._eligible_tas(probe, 0, vs), 0.45)[:12]:
        run = reference(tau)
        if tpr._decisions_ok(run, [0, 1], [tau, tau], vs):
            break
    else:
        pytest.fail("no tau with mixed decisions and a margin (reference)")
    fm = fct.apply(model, frame_tokens=L, threshold=tau, video_start=vs)
    cache = DynamicCache(config=model.config)

    def step(ids, embeds, mask, pos):
        with torch.no_grad():
            out = fm(input_ids=None if ids is None else torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                     inputs_embeds=None if embeds is None else torch.as_tensor(embeds),
                     position_ids=torch.as_tensor(pos), past_key_values=cache)
        return out.logits.numpy(), fm.fastcar.last_replay, fm.fastcar.last_tas

    got = _embeds_run(step, prefix, run.steps, n)
    el = tpr._eligible(run, vs)
    for k in range(n + 1):
        assert np.abs(got.logits[k] - run.logits[k]).max() <= TOL, f"step {k}: logits differ"
        for i in (0, 1):
            assert np.array_equal(got.replay[i][k], run.replay[i][k]), f"step {k} layer {i}: replay differs"
            if k > 0 and el[k - 1]:
                assert np.abs(got.tas[i][k] - run.tas[i][k]).max() <= TOL
    with torch.no_grad():
        gen = fm.generate(inputs_embeds=torch.as_tensor(prefix), attention_mask=torch.ones(prefix.shape[:2]),
                          max_new_tokens=n, do_sample=False, video_start=vs)
    np.testing.assert_array_equal(gen.numpy(), np.concatenate(run.steps[1:], axis=1))
    # generate() feeds n - 1 tokens (the last one is only sampled): their replays are the reference's
    assert fm.fastcar.stats.replayed == sum(int(run.replay[i][k].sum()) for i in (0, 1) for k in range(1, n)) > 0
    with pytest.raises(FastCarError, match="not both"):
        fm(input_ids=torch.zeros(2, 1, dtype=torch.long), inputs_embeds=torch.as_tensor(prefix))


def test_to_onnx_prints_nothing(tmp_path, capfd):
    """to_onnx writes the model and says nothing: no torchvision notes, no untyped-value warnings from onnx_ir
    (the gate's outputs carry the fake impl's types)."""
    import onnx

    fm = fct.apply(zoo.build_model("llama"), frame_tokens=L, threshold=0.0)
    capfd.readouterr()
    fct.to_onnx(fm, tmp_path / "fast.onnx")
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out + err)[:500]
    proto = onnx.load(str(tmp_path / "fast.onnx"), load_external_data=False)
    gate = [n for n in proto.graph.node if n.op_type == "TemporalGate"]
    typed = {v.name: v.type.tensor_type.elem_type for v in proto.graph.value_info}
    assert gate and all(typed.get(o) for n in gate for o in n.output if o)


def test_decode_step_copies_the_kv_cache_as_the_model_does():
    """A decode step of the FastCar model through forward + DynamicCache (what generate() runs) concatenates
    each layer's past once, as the transformers model's own step does (the captured program used to copy it
    onto DynamicCache's empty start tensor first, and the cache then appended the new token again), and leaves
    the cache holding the model's keys and values."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import DynamicCache

    class KVCats(TorchDispatchMode):
        """cats that make a [B, H, T, D] tensor with T the past (+ 1): each copies a layer's key or value cache."""

        def __init__(self, total: int):
            super().__init__()
            self.total, self.n = total, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.cat.default and out.dim() == 4 and out.shape[2] >= self.total - 1:
                self.n += 1
            return out

    model = zoo.build_model("llama")
    fm = fct.apply(model, frame_tokens=L, threshold=math.inf)
    n = 2 * L + 1
    ids = torch.randint(0, zoo.VOCAB, (1, n), generator=torch.Generator().manual_seed(0))
    counts, caches, logits = [], [], []
    for m in (model, fm):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            m(input_ids=ids[:, :-1], attention_mask=torch.ones(1, n - 1, dtype=torch.long), past_key_values=cache)
            with KVCats(n) as cats:
                out = m(input_ids=ids[:, -1:], attention_mask=torch.ones(1, n, dtype=torch.long),
                        past_key_values=cache)
        counts.append(cats.n)
        caches.append(cache)
        logits.append(out.logits)
    assert counts[0] == 2 * zoo.LAYERS and counts[1] == counts[0], counts
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=0)
    assert caches[1].get_seq_length() == n
    for want, got in zip(caches[0].layers, caches[1].layers, strict=True):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seq,pad", [(1, 0), (1, 3), (4, 0), (4, 2)])
def test_attention_mask_forms_match_sdpa_boolean_mask(seq, pad):
    """The runtime program's mask forms (optimize.sdpa_float_mask / skip_full_masks) give SDPA's output with the
    boolean mask torch.export captured: padded, causal, and all-visible (a decode step without padding, where
    the mask is dropped as the transformers model drops it)."""
    from fastcar_compile.torch.optimize import additive_mask_or_none

    g = torch.Generator().manual_seed(seq * 10 + pad)
    total = 9
    q, k, v = (torch.randn(2, h, n, 8, generator=g) for h, n in ((4, seq), (2, total), (2, total)))
    kpos, qpos = torch.arange(total), torch.arange(total - seq, total)
    mask = (kpos[None, :] <= qpos[:, None]).expand(2, 1, seq, total).clone()
    mask[1, :, :, :pad] = False
    attn = torch.ops.aten.scaled_dot_product_attention.default
    want = attn(q, k, v, mask, enable_gqa=True)
    form = additive_mask_or_none(mask, q.dtype)
    assert (form is None) == (seq == 1 and pad == 0)
    torch.testing.assert_close(attn(q, k, v, form, enable_gqa=True), want, atol=1e-6, rtol=1e-6)
