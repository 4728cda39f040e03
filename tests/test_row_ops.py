"""BranchPass's row ops (passes/branch.py): ai.fastcar.SelectRows, MLPCacheMerge and the packed gate's
select_rows forms, function bodies (stock ORT) and native kernels against NumPy readings of docs/DESIGN.md; the compiled
one-MLP layout against the eager reference at batch 3 (mixed rows, every row replaying, none), and its kernel
launches per step against the older nested layout's, counted by ORT's profiler.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import ort_driver
import pytest
import test_genai_gate as tgg
from gate_models import gate_model, legacy
from onnx import TensorProto, helper

from fastcar_compile.core import contract
from fastcar_compile.passes.fastcar_ops import DOMAIN, function_proto

pytestmark = pytest.mark.filterwarnings("ignore")
F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


@pytest.fixture(scope="module")
def native_lib():
    """The kernels' library, or None where it cannot be built (then only the bodies are checked)."""
    return ort_driver.native_or_none()


def _model(op: str, ins: list[tuple[str, int]], outs: list[tuple[str, int]], attrs: dict | None = None,
           used: tuple[str, ...] = ()) -> onnx.ModelProto:
    node = helper.make_node(op, [n for n, _ in ins], [n for n, _ in outs], domain=DOMAIN, **(attrs or {}))
    return helper.make_model(
        helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, None) for n, t in ins],
                          [helper.make_tensor_value_info(n, t, None) for n, t in outs]),
        ir_version=10, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(DOMAIN, 1),
                                      helper.make_opsetid("com.microsoft", 1)],
        functions=[function_proto(o, 20) for o in (op, *used)])


def _session(model: onnx.ModelProto, lib) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = 1, 3
    if lib is not None:
        so.register_custom_ops_library(str(lib))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _runs(model: onnx.ModelProto, feeds: dict, native_lib) -> list[tuple[str, list[np.ndarray]]]:
    """(which, outputs) for the function body and, where it exists, the native kernel."""
    libs = [None] + ([native_lib] if native_lib is not None else [])
    return [("body" if lib is None else "kernel", _session(model, lib).run(None, feeds)) for lib in libs]


SELECT = _model(contract.SELECT_ROWS, [("x", F), ("replay", BOOL)], [("rows", F), ("some", BOOL)])
MERGE = _model(contract.MLP_CACHE_MERGE, [("c", F), ("a", I64), ("rows", F), ("r", BOOL), ("s", I64), ("w", BOOL)],
               [("c2", F), ("a2", I64), ("used", F)], {"age_offset": 1}, used=(contract.MLP_CACHE_UPDATE,))
REPLAYS = {"mixed": lambda rng, shape: rng.random(shape) > 0.5, "none": lambda rng, shape: np.zeros(shape, bool),
           "all": lambda rng, shape: np.ones(shape, bool)}


@pytest.mark.parametrize("replay", list(REPLAYS))
@pytest.mark.parametrize("shape", [(3, 1, 8), (2, 5, 8), (6, 8)], ids=["decode-b3", "chunk-b2", "flat"])
def test_select_rows_matches_numpy(native_lib, shape, replay):
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    tokens = (shape[0], shape[1]) if len(shape) == 3 else (2, 3)
    r = REPLAYS[replay](rng, tokens)
    if replay == "mixed":
        r.flat[0], r.flat[-1] = True, False
    want = x.reshape(-1, shape[-1])[~r.reshape(-1)][None]
    for which, (rows, some) in _runs(SELECT, {"x": x, "replay": r}, native_lib):
        assert rows.shape == want.shape, which
        np.testing.assert_array_equal(rows, want, err_msg=which)
        assert bool(some) == (not r.all()), which
    ort_driver.skip_native_half(native_lib)


def _merge_reference(f: dict, offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """used = computed rows in token order / the slot's cached row; then the cache update (DESIGN.md)."""
    c, a, r, s, w = f["c"], f["a"], f["r"], f["s"], f["w"]
    B, S, Hd = r.shape[0], r.shape[1], c.shape[2]
    rows = iter(f["rows"].reshape(-1, Hd))
    used = np.zeros((B, S, Hd), np.float32)
    for b in range(B):
        for i in range(S):
            used[b, i] = c[b, s[i]] if r[b, i] else next(rows)
    assert next(rows, None) is None
    c2, a2 = c.copy(), a.copy()
    for i in np.flatnonzero(w):
        c2[:, s[i]] = used[:, i]
        a2[:, s[i]] = np.where(r[:, i], a[:, s[i]] + 1, offset)
    return c2, a2, used


@pytest.mark.parametrize("replay", list(REPLAYS))
@pytest.mark.parametrize("B,S", [(3, 1), (2, 6)])
def test_cache_merge_matches_numpy(native_lib, B, S, replay):
    rng = np.random.default_rng(B * 10 + S)
    L, Hd = 4, 6
    r = REPLAYS[replay](rng, (B, S))
    p = np.arange(7, 7 + S)
    f = {"c": rng.standard_normal((B, L, Hd)).astype(np.float32), "a": rng.integers(0, 4, (B, L)).astype(np.int64),
         "rows": rng.standard_normal((1, int((~r).sum()), Hd)).astype(np.float32), "r": r, "s": (p - 5) % L,
         "w": (p >= 5) & (p >= p[-1] + 1 - L)}
    want = _merge_reference(f, offset=1)
    for which, got in _runs(MERGE, f, native_lib):
        for name, g, w in zip(("cache", "age", "used"), got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=0, atol=0, err_msg=f"{name} ({which})")
    ort_driver.skip_native_half(native_lib)


def test_cache_merge_in_place_reads_the_past_rows(native_lib):
    """present_mlp_cache bound to past_mlp_cache's buffer (FastCarSession's IO binding): a replaying row takes
    the cached value as it was before the step, computed rows land in the buffer itself."""
    if native_lib is None:
        pytest.skip("native kernels not built here")
    rng = np.random.default_rng(5)
    B, L, Hd = 3, 4, 5
    f = {"c": rng.standard_normal((B, L, Hd)).astype(np.float32), "a": np.full((B, L), 2, np.int64),
         "rows": rng.standard_normal((1, 2, Hd)).astype(np.float32), "r": np.array([[False], [True], [False]]),
         "s": np.array([2]), "w": np.array([True])}
    want = _merge_reference(f, offset=1)
    sess = _session(MERGE, native_lib)
    cache, age = ort.OrtValue.ortvalue_from_numpy(f["c"].copy()), ort.OrtValue.ortvalue_from_numpy(f["a"].copy())
    io = sess.io_binding()
    for name in ("rows", "r", "s", "w"):
        io.bind_cpu_input(name, f[name])
    io.bind_ortvalue_input("c", cache)
    io.bind_ortvalue_input("a", age)
    io.bind_ortvalue_output("c2", cache)
    io.bind_ortvalue_output("a2", age)
    io.bind_output("used")
    sess.run_with_iobinding(io)
    np.testing.assert_array_equal(io.copy_outputs_to_cpu()[2], want[2])
    np.testing.assert_array_equal(cache.numpy(), want[0])
    np.testing.assert_array_equal(age.numpy(), want[1])


def test_cache_merge_refuses_a_wrong_row_count(native_lib):
    if native_lib is None:
        pytest.skip("native kernels not built here")
    f = {"c": np.zeros((2, 4, 3), np.float32), "a": np.zeros((2, 4), np.int64), "rows": np.zeros((1, 2, 3), np.float32),
         "r": np.array([[True], [False]]), "s": np.array([1]), "w": np.array([True])}
    with pytest.raises(Exception, match="MLPCacheMerge: more rows than computing tokens"):
        _session(MERGE, native_lib).run(None, f)
    with pytest.raises(Exception, match="MLPCacheMerge: slot out of"):
        _session(MERGE, native_lib).run(None, {**f, "rows": f["rows"][:, :1], "s": np.array([4])})


@pytest.mark.parametrize("name", ["decode rope, shared buffer, genai ages, per-layer tau", "decode raw",
                                  "every row replays", "prefill past a frame: writes, never replays"])
def test_packed_gate_rows_variant_matches_numpy(native_lib, name):
    """The packed TemporalGate with select_rows (do_rotary or not): the gate's outputs as test_genai_gate's NumPy
    reference, plus rows = the MLP input's rows of the computing tokens; body, kernel, kernel under the old name."""
    B, H, Hkv, D, S, past, nrows, L, vs, K, rope, rot, inter, offset, n_tau, tau = tgg.CASES[name]
    T = past + S
    rng, feeds, attrs = tgg.case_feeds(name)
    names = ["qkv", "key", "age", "cache", "threshold", "video_start", "total_len"]
    if rope:
        names += ["cos", "sin"]
        attrs |= {"rotary_embedding_dim": rot, "interleaved": inter}
        angles = rng.uniform(0, 6.3, (T + 5, rot // 2))
        feeds["cos"], feeds["sin"] = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    feeds["x"] = rng.standard_normal((B, S, 12)).astype(np.float32)
    types = dict(zip([*tgg.OUTS, "rows"], [*tgg.OUT_TYPES, F], strict=True))
    ins = [(n, {"age": I64, "video_start": I64, "total_len": TensorProto.INT32}.get(n, F)) for n in [*names, "x"]]
    form = contract.GateForm(use_total_len=True, packed_qkv=True, do_rotary=rope, select_rows=True)
    model = gate_model(form, {k: v for k, v in tgg.FEEDS.items() if v in names} | {"mlp_input": "x"}, attrs,
                       [helper.make_tensor_value_info(n, t, None) for n, t in ins],
                       [helper.make_tensor_value_info(n, t, None) for n, t in types.items()])
    want = tgg._reference(feeds, H=H, L=L, K=K, age_offset=offset, t_index=attrs["threshold_index"], rope=rope,
                          rot=rot, interleaved=inter)
    want["rows"] = feeds["x"].reshape(-1, 12)[~want["replay"].reshape(-1)][None]
    runs = _runs(model, feeds, native_lib)
    if native_lib is not None:
        runs.append(("kernel, old op name", _session(legacy(model), native_lib).run(None, feeds)))
    for which, got in runs:
        for k, g in zip(types, got, strict=True):
            assert g.shape == want[k].shape, (k, which)
            tol = 1e-5 if k == "tas" else 0
            np.testing.assert_allclose(g, want[k], atol=tol, rtol=0, err_msg=f"{k} ({which})")
    ort_driver.skip_native_half(native_lib)


# --- compiled models -------------------------------------------------------------------------------------------

def _launches(path: Path, replay_all: bool, native: bool) -> float:
    """Kernel launches per decode step (ORT's profiler), batch 1, after a 12-token prompt, at tau -inf / +inf."""
    from fastcar_compile.runtime import FastCarSession

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = 1, 1, 3
    so.enable_profiling = True
    so.profile_file_prefix = str(path.parent / f"prof-{path.stem}-{int(replay_all)}")
    sess = FastCarSession(path, session_options=so, threads=1, native=native)
    taus = -np.inf if replay_all else np.inf
    prompt = np.arange(3, 15)[None, :]
    out = sess.step(sess.new_state(1), prompt, threshold=taus)
    for _ in range(4):
        out = sess.step(out.state, out.logits[:, -1].argmax(-1)[:, None], threshold=taus, check=False)
    ev = json.loads(Path(sess.session.end_profiling()).read_text())
    runs = [e for e in ev if e.get("name") == "model_run"]
    start = runs[-3]["ts"]  # the last three steps
    n = sum(1 for e in ev if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start)
    return n / 3


@pytest.mark.parametrize("source", ["dynamo", "genai"])
def test_shared_layout_launches_no_more_than_the_nested_one(zoo_model, genai_model, fc_compile, tmp_path, source,
                                                            native_lib):
    """The one-MLP layout costs no more launches per step than the nested one, at 0% replay (computing
    layers: the If and the MLP) and at 100% (skipping layers: the If and one Identity, one If fewer)."""
    src = zoo_model("llama", "dynamo20") if source == "dynamo" else genai_model("llama", "fp32") / "model.onnx"
    counts = {}
    for shared in (True, False):
        out = tmp_path / f"{shared}" / "fast.onnx"
        _, report = fc_compile(str(src), output=str(out), frame_tokens=4, threshold=0.0, shared_mlp=shared,
                               genai=False)
        layers = len(report.rewritten)
        counts[shared] = {r: _launches(out, r, native_lib is not None) for r in (False, True)}
    assert counts[True][False] == counts[False][False], counts  # computing: If + MLP in both
    assert counts[True][True] == counts[False][True] - layers, counts  # skipping: one If fewer per layer


def _genai_reference(model, tau: float, prompt: np.ndarray, n: int):
    import test_genai_graphs as tgr

    return tgr._reference(model, tau, "rope", prompt, n)


@pytest.mark.parametrize("tau", ["mixed", "-inf", "+inf"])
def test_compiled_genai_graph_batch3_matches_reference(genai_model, fc_compile, tmp_path, native_lib, tau):
    """Path (a) at batch 3 on the one-MLP layout, kernels and bodies: logits, replay decisions and the final
    state equal the eager reference (transformers + hooks) when rows decide differently in one step (tau in a
    gap of layer 0's TAS), when every eligible row replays (-inf) and when none does (+inf)."""
    import genai_zoo
    import test_genai_graphs as tgr

    src = genai_model("llama", "fp32") / "model.onnx"
    model = genai_zoo.reference_model("llama", src)
    prompt = np.random.default_rng(17).integers(3, genai_zoo.GENAI_VOCAB, (3, tgr.VIDEO_START + 2))
    t = {"-inf": -math.inf, "+inf": math.inf}.get(tau)
    if t is None:
        t = tgr._pick_tau(_genai_reference(model, math.inf, prompt, 4 * tgr.L))
    run = _genai_reference(model, t, prompt, 4 * tgr.L)
    out = tmp_path / "fast.onnx"
    fc_compile(str(src), output=str(out), frame_tokens=tgr.L, threshold=t, tas_query="rope", max_replay=2,
               emit_diagnostics=True, genai=False)
    per_step = [run.replay[i][k][:, 0] for i in (0, 1) for k in range(1, len(run.steps))]
    if tau == "mixed":
        assert any(s.any() and not s.all() for s in per_step), "no step mixes replaying and computing rows"
    elif tau == "-inf":
        assert any(s.all() for s in per_step), "no step where every row replays"
    else:
        assert not any(s.any() for s in per_step)
    for native in [None] + ([native_lib] if native_lib is not None else []):
        got = ort_driver.decode(tgr._session(out, "fp32", compiled=True, native=native, inputs={"video_start"}), run.steps,
                                video_start=tgr.VIDEO_START, head_dim=tgr.HEAD_DIM)
        for k, (g, w) in enumerate(zip(got.logits, run.logits, strict=True)):
            assert np.abs(g - w).max() <= tgr.TOL, f"step {k} ({native})"
        for i in (0, 1):
            for k in range(1, len(run.steps)):
                np.testing.assert_array_equal(got.replay_mask[i][k].astype(bool), run.replay[i][k],
                                              err_msg=f"layer {i} step {k} ({native})")
            np.testing.assert_array_equal(got.final_state[f"past_mlp_age.{i}"], run.final_age[i])
    ort_driver.skip_native_half(native_lib)


def test_an_unknown_rank_mlp_entry_still_compiles_and_runs(genai_model, fc_compile, tmp_path, native_lib,
                                                            monkeypatch):
    """An MLP entry whose static shape is unknown (cleared here before BranchPass) gets the Reshape of `used` to
    the entry's own shape, and the compiled graph still equals the eager reference at batch 3 with rows that
    replay and rows that compute. The entry is really [B, S, H], so that Reshape is an identity: a 2-D
    [B*S, H] MLP entry (the case the Reshape exists for) is NOT exercised by this or any test."""
    import genai_zoo
    import test_genai_graphs as tgr

    from fastcar_compile.passes import branch

    shared = branch.BranchPass._shared

    def unknown_rank(self, graph, lr, b, full_nodes):
        lr.match.mlp.entry.shape = None
        return shared(self, graph, lr, b, full_nodes)

    monkeypatch.setattr(branch.BranchPass, "_shared", unknown_rank)
    src = genai_model("llama", "fp32") / "model.onnx"
    model = genai_zoo.reference_model("llama", src)
    prompt = np.random.default_rng(17).integers(3, genai_zoo.GENAI_VOCAB, (3, tgr.VIDEO_START + 2))
    t = tgr._pick_tau(_genai_reference(model, math.inf, prompt, 4 * tgr.L))
    run = _genai_reference(model, t, prompt, 4 * tgr.L)
    out = tmp_path / "fast.onnx"
    fc_compile(str(src), output=str(out), frame_tokens=tgr.L, threshold=t, tas_query="rope", max_replay=2,
               genai=False)
    reshaped = [n for n in onnx.load(str(out)).graph.node if n.op_type == "Reshape" and
                n.output[0].endswith(".mlp_used")]
    assert len(reshaped) == 2  # one per rewritten layer
    sess = tgr._session(out, "fp32", compiled=True, native=native_lib, inputs={"video_start"})
    got = ort_driver.decode(sess, run.steps,
                            video_start=tgr.VIDEO_START, head_dim=tgr.HEAD_DIM)
    for k, (g, w) in enumerate(zip(got.logits, run.logits, strict=True)):
        assert np.abs(g - w).max() <= tgr.TOL, f"step {k}"
