"""`fastcar-compile dit.onnx -o fast.onnx --annsa lsh|int8`: AnnSA compiled into the DiT step graph
(passes/dit_annsa.py, the runtime's blocks in dit/annsa_index.py). References: the eager stream runtime's AnnSA
(dit/fastar.FastARDiT, itself checked against NumPy softmaxes in test_dit_fastar.py) over whole rollouts, and a
NumPy brute force of one attention (every query against every slot: bucket ids from fastar's hashers, the
selected set, the softmax over it)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

import onnx_ir as ir  # noqa: E402
from dit_modes_helpers import compile_cli, not_a_dit  # noqa: E402

from fastcar_compile.cli import main  # noqa: E402
from fastcar_compile.core.contract import (  # noqa: E402
    ANNSA_DENSE,
    ANNSA_GRAPH,
    ANNSA_NATIVE,
    DIT_MODES_KEY,
    AnnSARecord,
    annsa_io,
)
from fastcar_compile.dit import modes  # noqa: E402
from fastcar_compile.dit.annsa_index import blocks  # noqa: E402
from fastcar_compile.dit.config import PRESETS  # noqa: E402
from fastcar_compile.dit.fastar import FastARDiT  # noqa: E402
from fastcar_compile.dit.stream import OrtDiT, StreamSettings, rollout  # noqa: E402
from fastcar_compile.fastar.int8 import Int8Buckets  # noqa: E402
from fastcar_compile.fastar.lsh import SignLSH  # noqa: E402
from fastcar_compile.passes import dit_annsa as annsa_graph  # noqa: E402
from fastcar_compile.passes.build import Builder  # noqa: E402

CFG = PRESETS["tiny"]
# tiny (32 queries per head, a 5-frame cache) is too small for AnnSA to pay (passes/dit_cost.py keeps it dense):
# the tests of the compiled AnnSA compile it anyway
ALWAYS = ("--ann-always",)


def _kernel_args(kernel: str, monkeypatch) -> list[str]:
    """The compile flags asking for AnnSA's `kernel` form (config.ANNSA_KERNELS); "body": the native op compiled,
    run with the library off (FASTCAR_NATIVE=0: its function body)."""
    if kernel == ANNSA_GRAPH:
        return ["--native-attention", "off"]
    from fastcar_compile.runtime.native import library_path

    if library_path() is None:
        pytest.skip("native ai.fastcar kernels not built here")
    return []


@pytest.mark.parametrize("kernel", [ANNSA_NATIVE, ANNSA_GRAPH, "body"])
@pytest.mark.parametrize("kind, window, tables, local", [("lsh", 2, "2", "1"), ("int8", None, "2", "1"),
                                                         ("lsh", 0, "3", "0"), ("int8", 3, "1", "2")])
def test_compiled_annsa_equals_the_eager_mode(dit_tiny_export, tmp_path, dit_tiny_eager, kind, window, tables, local,
                                              kernel, monkeypatch):
    """6 chunks (the ring wrapping at a 2-frame window, the default window, the buffers growing): the compiled
    rollout == the eager runtime's AnnSA with the same buckets within 1e-4, executing the same q.k pairs; in each
    compiled form (the native op, its function body, the ONNX-op graph)."""
    path = compile_cli(dit_tiny_export, tmp_path, *ALWAYS, "--annsa", kind, "--ann-tables", tables, "--annsa-local", local,
                       "--ann-seed", "5", *_kernel_args(kernel, monkeypatch))
    if kernel == "body":
        monkeypatch.setenv("FASTCAR_NATIVE", "0")
    fast = OrtDiT(path)
    assert fast.annsa.kind == kind and fast.annsa.ann_tables == int(tables)  # read back from the metadata
    assert fast.annsa.annsa_kernel == (ANNSA_GRAPH if kernel == ANNSA_GRAPH else ANNSA_NATIVE)
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert ("AnnSAAttention" in ops) == (kernel != ANNSA_GRAPH)
    fast.self_pairs = [0, 0]
    settings = StreamSettings(frames=12, seed=3, window_frames=window)
    ref = FastARDiT(dit_tiny_eager, modes.settings(annsa=kind, ann_tables=int(tables), annsa_local=int(local), ann_seed=5,
                                                   ann_always=True))
    for a, b in zip(rollout(fast, settings), rollout(ref, settings), strict=True):
        assert a.resident == b.resident
        np.testing.assert_allclose(a.frames, b.frames, atol=1e-4, rtol=0)
    executed, dense = sum(s.sa_executed for s in ref.stats), sum(s.sa_dense for s in ref.stats)
    assert fast.self_pairs == [executed, dense] and executed < dense


def test_compiled_annsa_with_annca_and_fastcar_equals_the_eager_modes(dit_tiny_export, tmp_path, dit_tiny_eager):
    """AnnSA (int8 buckets) + AnnCA (the same bucketing, as the eager runtime draws it) + FastCar replay, all
    compiled in: the eager runtime with the three modes on within 1e-4 over 5 chunks, the same pair counts."""
    fast = OrtDiT(compile_cli(dit_tiny_export, tmp_path, *ALWAYS, "--annsa", "int8", "--annca", "--threshold", "0"))
    assert fast.annca.kind == "int8" and fast.tau == 0.0
    fast.self_pairs = [0, 0]
    settings = StreamSettings(frames=10, seed=2)
    ref = FastARDiT(dit_tiny_eager, modes.settings(annsa="int8", annca=True, threshold=0.0, ann_always=True))
    for a, b in zip(rollout(fast, settings), rollout(ref, settings), strict=True):
        np.testing.assert_allclose(a.frames, b.frames, atol=1e-4, rtol=0)
    assert fast.self_pairs == [sum(s.sa_executed for s in ref.stats), sum(s.sa_dense for s in ref.stats)]
    assert fast.cross_pairs[0] == sum(s.ca_executed for s in ref.stats)
    assert fast.replayed[0] == sum(s.ffn_replayed for s in ref.stats) > 0


def test_annsa_covering_the_cache_is_the_dense_export(dit_tiny_export, tmp_path):
    """Local frames covering the whole window: every slot attended densely, the dense export's rollout."""
    fast = OrtDiT(compile_cli(dit_tiny_export, tmp_path, *ALWAYS, "--annsa", "lsh", "--annsa-local", "8"))
    settings = StreamSettings(frames=10, seed=4)
    for a, b in zip(rollout(fast, settings), rollout(OrtDiT(dit_tiny_export), settings), strict=True):
        np.testing.assert_allclose(a.frames, b.frames, atol=1e-4, rtol=0)


class _Attention:  # what annsa_graph.cache_scores reads of discovery's SelfAttention
    def __init__(self, query, heads):
        self.query, self.heads = query, heads


def _attention_graph(mode: AnnSARecord, B: int, H: int, Q: int, C: int, d: int) -> tuple[bytes, list[str]]:
    """A graph holding only the compiled AnnSA attention: q, k, v of the chunk [B, H, Q, d] and the cache
    buffers [B, H, C, d] (+ the AnnSA inputs) -> softmax([cache part | q k^T]) over [cache values | v], and the
    query codes."""
    f = ir.DataType.FLOAT
    vals = {n: ir.Value(name=n, type=ir.TensorType(f), shape=ir.Shape(s))
            for n, s in (("q", [B, H, Q, d]), ("k", [B, H, Q, d]), ("v", [B, H, Q, d]), ("past_key", [B, H, C, d]),
                         ("past_value", [B, H, C, d]))}
    graph = ir.Graph(list(vals.values()), [], nodes=[], opset_imports={"": 20, "com.microsoft": 1}, name="annsa")
    annsa_graph.add_dense_input(graph)
    nodes: list[ir.Node] = []
    b = Builder(0, nodes, itertools.count())
    scores, context = annsa_graph.cache_scores(b, graph, 0, _Attention(vals["q"], H), vals["q"], vals["past_key"],
                                               vals["past_value"], mode, d)
    own = b("MatMul", [vals["q"], b("Transpose", [vals["k"]], {"perm": [0, 1, 3, 2]})])
    probs = b("Softmax", [b("Concat", [scores, own], {"axis": -1})], {"axis": -1})
    width = b("Shape", [scores], {"start": 3, "end": 4})
    last = ir.Value(name="axis", const_value=ir.tensor(np.array([-1], np.int64)))
    graph.register_initializer(last)
    end = ir.Value(name="end", const_value=ir.tensor(np.array([1 << 62], np.int64)))
    graph.register_initializer(end)
    zero = ir.Value(name="zero", const_value=ir.tensor(np.array([0], np.int64)))
    graph.register_initializer(zero)
    out = b("Add", [context(b, b("Slice", [probs, zero, width, last])),
                    b("MatMul", [b("Slice", [probs, width, end, last]), vals["v"]])], names=["out"])
    out.type = ir.TensorType(f)
    graph.outputs.append(out)
    for n in nodes:
        graph.append(n)
    model = ir.Model(graph, ir_version=10)
    return ir.serde.serialize_model(model).SerializeToString(), [v.name for v in graph.outputs]


@pytest.mark.parametrize("kind, tables", [("lsh", 1), ("lsh", 3), ("int8", 2)])
def test_annsa_attention_equals_a_numpy_brute_force(kind, tables):
    """The compiled attention on its own, against every query x slot in NumPy: the graph's query codes are the
    reference hasher's; a query's selected slots are the dense ones plus every slot sharing a bucket in some
    table (the runtime's blocks never list a pair twice); the output is the softmax over exactly that set and
    the chunk's own keys."""
    rng = np.random.default_rng(7)
    B, H, Q, C, d, T = 2, 3, 12, 40, 16, tables
    mode = AnnSARecord(kind, lsh_bits=3, int8_dirs=2, ann_tables=T, ann_seed=11, annsa_local=1)
    proto, outs = _attention_graph(mode, B, H, Q, C, d)
    sess = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    h = SignLSH(d, 3, T, 11) if kind == "lsh" else Int8Buckets(d, 2, T, 11)
    # keys near a few directions, so that buckets hold several keys and queries share them
    centres = rng.standard_normal((4, d))
    pk = (centres[rng.integers(0, 4, (B, H, C))] + 0.3 * rng.standard_normal((B, H, C, d))).astype(np.float32)
    pv = rng.standard_normal((B, H, C, d)).astype(np.float32)
    q = (centres[rng.integers(0, 4, (B, H, Q))] + 0.3 * rng.standard_normal((B, H, Q, d))).astype(np.float32)
    k, v = (rng.standard_normal((B, H, Q, d)).astype(np.float32) for _ in range(2))
    dense = np.arange(0, 8, dtype=np.int64)  # e.g. a sink frame
    live = np.arange(10, 36, dtype=np.int64)  # the bucketed slots (some buffer slots are not live)
    kcodes = h.codes(pk)  # [B, H, C, T]
    names = annsa_io(0)
    feed = {"q": q, "k": k, "v": v, "past_key": pk, "past_value": pv, ANNSA_DENSE: dense}
    feed.update(zip((names["buckets"], names["keys"], names["bias"], names["kcodes"]),
                    blocks(kcodes[:, :, live], live), strict=True))
    got = dict(zip(outs, sess.run(outs, feed), strict=True))
    qcodes = h.codes(q)
    np.testing.assert_array_equal(got[names["codes"]], qcodes)
    shared = (qcodes[:, :, :, None, :] == kcodes[:, :, None, :, :]).any(-1)  # [B, H, Q, C]
    selected = np.zeros((B, H, Q, C), bool)
    selected[..., dense] = True
    selected[..., live] |= shared[..., live]
    assert 0 < selected[..., live].sum() < selected[..., live].size  # the buckets select something, not all
    logits = np.concatenate([np.where(selected, np.einsum("bhqd,bhcd->bhqc", q, pk), -np.inf),
                             np.einsum("bhqd,bhkd->bhqk", q, k)], -1).astype(np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("bhqc,bhcd->bhqd", p, np.concatenate([pv, v], 2))
    np.testing.assert_allclose(got["out"], want, atol=1e-5, rtol=0)


def test_graph_reads_the_cache_through_gathers_only_and_records_the_mode(dit_tiny_export, tmp_path):
    """Block-sparse, not masked: every read of past.N.key|value's values is a Gather / GatherND (the dense slots,
    the bucket blocks; Shape reads its size only), no product over the whole buffer; the mode is in the metadata
    with its settings."""
    path = compile_cli(dit_tiny_export, tmp_path, *ALWAYS, "--annsa", "int8", "--int8-dirs", "4", "--ann-tables", "3",
                       "--native-attention", "off")
    m = onnx.load(str(path))
    meta = json.loads({p.key: p.value for p in m.metadata_props}[DIT_MODES_KEY])
    assert meta["annsa"] == {"kind": "int8", "annsa_local": 1, "lsh_bits": 4, "int8_dirs": 4, "ann_tables": 3,
                             "ann_seed": 0, "annsa_kernel": ANNSA_GRAPH}
    readers = {}
    for n in m.graph.node:
        for x in n.input:
            if x.startswith("past."):
                readers.setdefault(x, set()).add(n.op_type)
    assert len(readers) == 2 * CFG.layers and all(ops <= {"Gather", "GatherND", "Shape"} for ops in readers.values())
    assert all({"Gather", "GatherND"} <= ops for ops in readers.values())


def test_native_form_is_one_op_per_block_with_its_function_body(dit_tiny_export, tmp_path, monkeypatch):
    """With the native library (the default): each block's cache is read by one ai.fastcar AnnSAAttention node
    (no softmax over the buffer in ONNX ops), the model ships the op's function body, the metadata says so."""
    path = compile_cli(dit_tiny_export, tmp_path, *ALWAYS, "--annsa", "lsh", *_kernel_args(ANNSA_NATIVE, monkeypatch))
    m = onnx.load(str(path))
    assert json.loads({p.key: p.value for p in m.metadata_props}[DIT_MODES_KEY])["annsa"]["annsa_kernel"] == ANNSA_NATIVE
    ops = [n for n in m.graph.node if n.op_type == "AnnSAAttention"]
    assert len(ops) == CFG.layers and {f.name for f in m.functions} >= {"AnnSAAttention"}
    for n in m.graph.node:
        if any(x.startswith("past.") for x in n.input):
            assert n.op_type in ("AnnSAAttention", "Shape"), n.op_type


@pytest.mark.parametrize("args, msg", [
    (["--lsh-bits", "6"], "--lsh-bits is a setting of --annsa / --annca / --tempcache-match lsh|int8: give one"),
    (["--annca", "--annsa-local", "2"], "--annsa-local is a setting of --annsa: give one of them"),
    (["--native-attention", "off"], "--native-attention picks the compiled form of --annsa / --tempcache: give one"),
    (["--annsa", "lsh", "--tempcache", "0.9"], "--annsa with --tempcache"),
    (["--annsa", "int8", "--int8-dirs", "3"], "--int8-dirs must be one of 1, 2, 4, 8"),
    (["--annsa", "bogus"], "--annsa"),
])
def test_bad_annsa_options_are_refused_in_one_line(dit_tiny_export, tmp_path, capsys, args, msg):
    try:
        rc = main([str(dit_tiny_export), "-o", str(tmp_path / "x.onnx"), *args])
    except SystemExit as exc:  # argparse's own refusal (a word it does not know)
        rc = exc.code
    assert rc == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 1 and msg in err[0], err
    assert not (tmp_path / "x.onnx").exists()


def test_a_decoder_refuses_the_dit_modes(tmp_path):
    import fastcar_compile as fc
    from fastcar_compile.core.errors import FastCarError

    src = not_a_dit(tmp_path)
    with pytest.raises(FastCarError, match="--annsa applies to video DiT step graphs"):
        fc.compile(str(src), frame_tokens=4, annsa="lsh")


@pytest.mark.parametrize("tables", [1, 2, 3, 4])
def test_shared_pairs_count_equals_comparing_every_pair(tables):
    from fastcar_compile.dit.annsa_index import shared_pairs

    rng = np.random.default_rng(tables)
    q, k = rng.integers(0, 5, (2, 3, 20, tables)), rng.integers(0, 5, (2, 3, 30, tables))
    want = int((q[:, :, :, None, :] == k[:, :, None, :, :]).any(-1).sum())
    assert shared_pairs(q, k) == want and 0 < want < q[..., 0].size * 30


def test_stream_cli_reports_the_compiled_annsa(dit_tiny_export, tmp_path, capsys):
    path = compile_cli(dit_tiny_export, tmp_path, *ALWAYS, "--annsa", "lsh")
    capsys.readouterr()
    assert main(["stream", str(path), "--frames", "8", "-o", str(tmp_path / "run")]) == 0
    assert "AnnSA compiled in (lsh buckets x 2 tables, 1 local frames)" in capsys.readouterr().out
    done = json.loads((tmp_path / "run" / "stream.json").read_text())["compiled_modes"]
    assert done["annsa"]["kind"] == "lsh" and 0 < done["self_density"] < 1


def test_calibrate_replay_with_annsa_equals_the_eager_calibration(dit_tiny_export, tmp_path, dit_tiny_eager, capsys):
    """`--calibrate-replay 0.4 --annsa int8`: the probe attends as the final graph does, so tau equals the
    eager runtime's calibration with AnnSA on (its TAS over the same 4-frame stream)."""
    from fastcar_compile.dit.fastar import calibrate_tau

    out = tmp_path / "cal.onnx"
    assert main([str(dit_tiny_export), "-o", str(out), "--calibrate-replay", "0.4", *ALWAYS, "--annsa", "int8",
                 "--calib-frames", "6"]) == 0
    fast = OrtDiT(out)
    assert fast.annsa.kind == "int8"
    want = calibrate_tau(dit_tiny_eager, modes.settings(calibrate_replay=0.4, annsa="int8", ann_always=True), StreamSettings(frames=6, seed=0),
                         chunks=3)
    dense = calibrate_tau(dit_tiny_eager, modes.settings(calibrate_replay=0.4), StreamSettings(frames=6, seed=0), chunks=3)
    assert fast.tau == pytest.approx(want, abs=1e-4) and abs(want - dense) > 1e-4
