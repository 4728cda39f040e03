"""`--provider cuda`: the compiled model holds only ops that ONNX Runtime's CUDA provider has kernels for (checked
against the provider's registry as ONNX Runtime's own generated table lists it, passes/cuda_ep_kernels.txt), no
`ai.fastcar` op or function is left, and it computes what the CPU compile computes: the same greedy tokens for a
FastCar decoder (native CPU kernels on the CPU compile, inlined function bodies on the CUDA one), the same
rollout for a DiT step graph with FastCar and TempCache compiled in. The GPU run itself is scripts/gpu_check.py."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

pytest.importorskip("onnxruntime")

from dit_modes_helpers import refusal  # noqa: E402

from fastcar_compile.cli import main  # noqa: E402
from fastcar_compile.passes.cuda_target import for_cuda, kernels  # noqa: E402

DECODER_TAU = 33.0  # the bundled 1-layer model's ~80% replay (demo/bundled.SMALL_TAU)


def registry_ops(path) -> set[tuple[str, str]]:
    m = onnx.load(str(path))
    assert not m.functions and all(d.domain != "ai.fastcar" for d in m.opset_import)
    ops = set()

    def walk(g):
        for n in g.node:
            ops.add((n.domain or "ai.onnx", n.op_type))
            for a in n.attribute:
                if a.g.node:
                    walk(a.g)

    walk(m.graph)
    return ops


def test_decoder_for_cuda_has_only_provider_ops_and_the_cpu_tokens(tmp_path, capsys):
    from fastcar_compile.demo.export import ONNX
    from fastcar_compile.runtime import FastCarSession

    cpu, cuda = tmp_path / "cpu.onnx", tmp_path / "cuda.onnx"
    for out, target in ((cpu, "cpu"), (cuda, "cuda")):
        assert main([str(ONNX), "-o", str(out), "--frame-tokens", "64", "--threshold", str(DECODER_TAU),
                     "--provider", target]) == 0
    assert "each with a CUDA provider kernel" in capsys.readouterr().out
    table = kernels()
    ops = registry_ops(cuda)
    assert ops and all(op in table for op in ops), sorted(op for op in ops if op not in table)
    assert any(n.domain == "ai.fastcar" for n in onnx.load(str(cpu)).graph.node)  # the CPU compile's own ops
    ids = np.random.default_rng(3).integers(0, 100, (2, 6))
    want = FastCarSession(cpu, threads=1).generate(ids, num_frames=3, progress=False)
    got = FastCarSession(cuda, threads=1, native=False).generate(ids, num_frames=3, progress=False)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert got.stats.replay_ratio == want.stats.replay_ratio > 0


def test_dit_for_cuda_rolls_out_as_the_cpu_compile(dit_tiny_export, tmp_path):
    from fastcar_compile.dit.stream import OrtDiT, StreamSettings, rollout

    cpu, cuda = tmp_path / "cpu.onnx", tmp_path / "cuda.onnx"
    for out, target in ((cpu, "cpu"), (cuda, "cuda")):
        assert main([str(dit_tiny_export), "-o", str(out), "--threshold", "0.5", "--tempcache", "0.9",
                     "--provider", target]) == 0
    table = kernels()
    assert all(op in table for op in registry_ops(cuda))
    settings = StreamSettings(frames=6, seed=2)
    a = np.concatenate([r.frames for r in rollout(OrtDiT(cpu), settings)], 1)
    b = np.concatenate([r.frames for r in rollout(OrtDiT(cuda), settings)], 1)
    np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)


def test_an_op_without_a_cuda_kernel_is_refused(tmp_path):
    from onnx import TensorProto, helper

    from fastcar_compile.core.errors import FastCarError

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    g = helper.make_graph([helper.make_node("Acos", ["x"], ["y"])], "g", [x], [y])  # CPU-only in ORT's table
    with pytest.raises(FastCarError, match=r"no kernel for ai.onnx::Acos \(opset 20\)"):
        for_cuda(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]))


def test_weights_in_external_data_are_refused_in_one_line(tmp_path, capsys):
    from fastcar_compile.demo.export import ONNX

    src = onnx.load(str(ONNX))
    big = tmp_path / "ext.onnx"
    onnx.save(src, str(big), save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    err = refusal([str(big), "-o", str(tmp_path / "o.onnx"), "--frame-tokens", "64", "--provider", "cuda"], capsys)
    assert "external data" in err
