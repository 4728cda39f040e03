"""`fastcar-compile dit.onnx -o fast.onnx --annca`: AnnCA compiled into the DiT step graph (passes/dit_annca.py),
recorded in the metadata and read back by the stream runtime. References: the eager stream runtime's AnnCA
(dit/fastar.FastARDiT, itself checked against NumPy in test_dit_fastar.py) over whole rollouts, and a NumPy
recomputation of the op (the reference hashers' codes, the kept set per frame by comparing codes, softmax over
the kept tokens) on random inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ir = pytest.importorskip("onnx_ir")
ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from dit_modes_helpers import compile_cli, not_a_dit  # noqa: E402

from fastcar_compile.cli import main  # noqa: E402
from fastcar_compile.core.contract import DIT_MODES_KEY, annca_io  # noqa: E402
from fastcar_compile.dit import modes  # noqa: E402
from fastcar_compile.dit.config import PRESETS  # noqa: E402
from fastcar_compile.dit.fastar import FastARDiT  # noqa: E402
from fastcar_compile.dit.stream import OrtDiT, StreamSettings, rollout  # noqa: E402
from fastcar_compile.fastar.int8 import Int8Buckets  # noqa: E402
from fastcar_compile.fastar.lsh import SignLSH  # noqa: E402

CFG = PRESETS["tiny"]


def _compile(exported: Path, folder: Path, *extra: str) -> Path:
    return compile_cli(exported, folder, "--annca", "--ann-always", *extra)


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "masked"])
@pytest.mark.parametrize("extra, window, eager_kw", [
    ((), None, {}),
    (("--lsh-bits", "2", "--ann-tables", "1", "--ann-seed", "5"), 0, {"lsh_bits": 2, "ann_tables": 1, "ann_seed": 5}),
    (("--threshold", "0"), None, {"threshold": 0.0}),
    (("--annsa", "int8"), None, {"annsa": "int8"}),  # AnnSA's int8 buckets, for AnnCA too
])
def test_compiled_annca_equals_the_eager_mode(dit_tiny_export, tmp_path, dit_tiny_eager, extra, window, eager_kw, gather,
                                              monkeypatch):
    """5 chunks (window, growing cache, with FastCar, with AnnSA's int8 buckets), the kept tokens gathered or the others masked (tiny's
    6-token prompt is masked by default): the compiled rollout == the eager AnnCA rollout within 1e-4, with the
    same executed query x prompt pairs; some pairs dropped, some kept."""
    from fastcar_compile.passes import dit_annca as annca_graph

    monkeypatch.setattr(annca_graph, "GATHER_FROM", 0 if gather else 1 << 30)
    fast = OrtDiT(_compile(dit_tiny_export, tmp_path, *extra))
    assert fast.annca.kind == eager_kw.get("annsa", "lsh")  # read back from the metadata
    settings = StreamSettings(frames=10, seed=3, window_frames=window)
    ref = FastARDiT(dit_tiny_eager, modes.settings(annca=True, ann_always=True, **eager_kw))
    for a, b in zip(rollout(fast, settings), rollout(ref, settings), strict=True):
        assert a.resident == b.resident
        np.testing.assert_allclose(a.frames, b.frames, atol=1e-4, rtol=0)
    executed, dense = sum(s.ca_executed for s in ref.stats), sum(s.ca_dense for s in ref.stats)
    assert fast.cross_pairs == [executed, dense] and 0 < executed < dense
    assert fast.replayed[0] == sum(s.ffn_replayed for s in ref.stats)


def _reference(q, k, v, hasher, frames):
    """NumPy AnnCA: q [G, Q, d] in `frames` frames over k, v [G, L, d]; (output, kept [G, frames, L])."""
    G, Q, d = q.shape
    qc, kc = hasher.codes(q), hasher.codes(k)  # [G, Q, T], [G, L, T]
    per = Q // frames
    out = np.zeros((G, Q, d))
    kept = np.zeros((G, frames, k.shape[1]), bool)
    for g in range(G):
        for f in range(frames):
            rows = slice(f * per, (f + 1) * per)
            keep = (qc[g, rows, None, :] == kc[g, None, :, :]).any(-1).any(0)  # [L]
            kept[g, f] = keep
            if keep.any():
                s = q[g, rows].astype(np.float64) @ k[g, keep].T / np.sqrt(d)
                p = np.exp(s - s.max(-1, keepdims=True))
                out[g, rows] = (p / p.sum(-1, keepdims=True)) @ v[g, keep]
    return out, kept


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "masked"])
@pytest.mark.parametrize("kind, bits, tables, prompt", [("lsh", 4, 2, 9), ("lsh", 12, 1, 40), ("int8", 2, 2, 40),
                                                        ("int8", 1, 3, 7)])
def test_op_matches_numpy(kind, bits, tables, prompt, gather):
    """The queries' codes, the kept set per frame and the attention over it vs NumPy (some frames keep nothing:
    output 0), the kept tokens gathered or the dropped ones masked (the prompt keys' codes are an input, as the
    prompt graph computes them: checked in the next test)."""
    rng = np.random.default_rng(bits * 10 + tables)
    B, H, F, T, d = 2, 3, 3, 5, 8
    hasher = SignLSH(d, bits, tables, seed=4) if kind == "lsh" else Int8Buckets(d, bits, tables, seed=4)
    q = rng.standard_normal((B, H, F * T, d)).astype(np.float32)
    k, v = (rng.standard_normal((B, H, prompt, d)).astype(np.float32) for _ in range(2))
    from fastcar_compile.passes.dit_annca import standalone

    sess = ort.InferenceSession(ir.to_proto(standalone(hasher, F, d, gather)).SerializeToString(), providers=["CPUExecutionProvider"])
    ctx, kept = sess.run(None, {"q": q, "k": k, "v": v, "kc": hasher.codes(k)})  # the prompt graph's codes
    want, want_kept = _reference(q.reshape(B * H, F * T, d), k.reshape(B * H, prompt, d),
                                 v.reshape(B * H, prompt, d), hasher, F)
    np.testing.assert_array_equal(kept.reshape(B * H, F, prompt), want_kept)
    np.testing.assert_allclose(ctx.reshape(B * H, F * T, d), want, atol=1e-5, rtol=0)
    assert want_kept.any() and not want_kept.all()
    if bits == 12:
        assert (~want_kept.any(-1)).any()  # a frame that kept no token


def test_graph_gathers_the_kept_tokens_and_records_the_mode(dit_tiny_export, tmp_path, monkeypatch):
    """The metadata records the buckets; each block outputs its kept mask; the prompt graph hashes the prompt
    keys once (its `cross.N.codes` equal the reference hasher's codes of its keys) and the step graph reads them;
    with gathering on (a prompt of GATHER_FROM tokens or more) the prompt keys reach the cross-attention's
    product only through a Gather (no product of every query with the whole prompt)."""
    from fastcar_compile.passes import dit_annca as annca_graph

    monkeypatch.setattr(annca_graph, "GATHER_FROM", CFG.text_len)
    path = _compile(dit_tiny_export, tmp_path, "--ann-tables", "3")
    m = onnx.load(str(path))
    meta = json.loads({p.key: p.value for p in m.metadata_props}[DIT_MODES_KEY])
    assert meta["annca"] == {"kind": "lsh", "lsh_bits": 4, "int8_dirs": 2, "ann_tables": 3, "ann_seed": 0}
    assert meta["threshold"] is None and meta["tempcache"] is None
    ins, outs = {i.name for i in m.graph.input}, {o.name for o in m.graph.output}
    assert {annca_io(i)[0] for i in range(CFG.layers)} <= ins and {annca_io(i)[1] for i in range(CFG.layers)} <= outs
    producer = {o: n for n in m.graph.node for o in n.output}
    for i in range(CFG.layers):
        reads = [n for n in m.graph.node if f"cross.{i}.key" in n.input]
        assert {n.op_type for n in reads} <= {"Reshape", "Shape"}, [n.op_type for n in reads]
    gathered = [n for n in m.graph.node if n.op_type == "FusedMatMul" and n.input[1] in producer
                and producer[n.input[1]].op_type == "Gather"]
    assert len(gathered) == CFG.layers
    text = ort.InferenceSession(str(path.with_name("fast.text.onnx")), providers=["CPUExecutionProvider"])
    emb = np.random.default_rng(0).standard_normal((2, 9, CFG.text_dim)).astype(np.float32)
    got = dict(zip([o.name for o in text.get_outputs()], text.run(None, {"text_embeds": emb}), strict=True))
    hasher = SignLSH(CFG.head_dim, 4, 3, seed=0)
    for i in range(CFG.layers):
        np.testing.assert_array_equal(got[annca_io(i)[0]], hasher.codes(got[f"cross.{i}.key"]))


def test_stream_cli_reports_the_compiled_mode(dit_tiny_export, tmp_path, capsys):
    path = _compile(dit_tiny_export, tmp_path)
    capsys.readouterr()
    assert main(["stream", str(path), "--frames", "4", "-o", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "AnnCA compiled in (lsh buckets x 2 tables)" in out
    done = json.loads((tmp_path / "run" / "stream.json").read_text())["compiled_modes"]
    assert done["annca"]["kind"] == "lsh" and 0 < done["cross_density"] < 1


def test_annca_on_a_decoder_is_refused(tmp_path, capsys):
    """A graph without the DiT metadata: one line naming the flag, exit 2, nothing written."""
    src = not_a_dit(tmp_path)
    assert main([str(src), "-o", str(tmp_path / "o.onnx"), "--frame-tokens", "4", "--annca"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "--annca" in err[0] and "DiT" in err[0]
    assert not (tmp_path / "o.onnx").exists()
