"""Partitioner: task graphs, tiling to the board, dims read from ONNX, unsupported ops reported by name."""

from __future__ import annotations

import sys
from pathlib import Path

import networkx as nx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.fpga_backend import LLAMA2_7B, ModelSpec, load_board
from fastcar_compile.fpga_backend.hwspec import PRESETS
from fastcar_compile.fpga_backend.modelspec import spec_from_onnx
from fastcar_compile.fpga_backend.partition import partition, tile_gemm

sys.path.insert(0, str(Path(__file__).parent))
import zoo  # noqa: E402


@pytest.mark.parametrize("board", sorted(PRESETS))
@pytest.mark.parametrize("shape", [(4096, 11008), (11008, 4096), (64, 48), (32000, 4096), (100, 37)])
def test_tiles_cover_each_weight_once_and_fit_the_buffer(board, shape):
    cfg = load_board(board)
    m_total, k_total = shape
    tiles = tile_gemm(m_total, k_total, cfg)
    cover = np.zeros((k_total, m_total), np.int8)
    for om, m, ok, k in tiles:
        cover[ok : ok + k, om : om + m] += 1
        assert m * k * cfg.dtype_bytes <= cfg.weight_tile_bytes
    assert (cover == 1).all()
    om, m, ok, k = tiles[0]
    if m < m_total:
        assert m % cfg.array_cols == 0
    if k < k_total:
        assert k % cfg.array_rows == 0


def test_task_graph_per_layer():
    spec = ModelSpec(layers=3, hidden=256, intermediate=512, heads=8, kv_heads=2, head_dim=32, vocab=300,
                     replay_layers=(1,), frame_tokens=256)
    part = partition(spec, load_board("kv260"))
    assert len(part.graphs) == spec.layers + 1  # + head
    for layer, g in enumerate(part.graphs[:-1]):
        assert nx.is_directed_acyclic_graph(g)
        units = {n: d["unit"] for n, d in g.nodes(data=True)}
        assert units["q_proj"] == units["down_proj"] == units["attn_qk"] == "matrix"
        assert units["softmax"] == "sfu" and units["attn_norm"] == "vector" and units["kv_store_k"] == "dma"
        replayable = {n for n, d in g.nodes(data=True) if d["replayable"]}
        if layer == 1:
            assert replayable == {"mlp_norm", "gate_proj", "up_proj", "act", "down_proj"}
            assert "tas" in g and "replay_xchg" in g
            assert nx.has_path(g, "kv_store_k", "tas")
        else:
            assert not replayable and "tas" not in g
        assert nx.has_path(g, "kv_store_k", "attn_qk") and nx.has_path(g, "gate_proj", "mlp_residual")
        order = g.graph["order"]
        assert all(order.index(a) < order.index(b) for a, b in g.edges)  # program order respects dependencies
    weights = {t["name"]: t["shape"] for t in part.tensors}
    assert weights["L0.k_proj"] == [256, 64] and weights["lm_head"] == [256, 300]


def test_dims_from_a_plain_export_and_from_fast_onnx(zoo_model, tmp_path):
    import fastcar_compile as fc

    path = zoo_model("llama", "dynamo20")
    spec, notes = spec_from_onnx(path)
    want = (zoo.LAYERS, zoo.HIDDEN, zoo.INTER, zoo.HEADS, zoo.KV_HEADS, zoo.HIDDEN // zoo.HEADS, zoo.VOCAB)
    assert (spec.layers, spec.hidden, spec.intermediate, spec.heads, spec.kv_heads, spec.head_dim, spec.vocab) == want
    # a plain export compiles to a dense program: no replay layers, no tokens per frame invented
    assert spec.replay_layers == () and spec.frame_tokens is None and any("plain decoder" in n for n in notes)
    fast = tmp_path / "fast.onnx"
    fc.compile(str(path), str(fast), frame_tokens=4, layers=[1])
    spec2, _ = spec_from_onnx(fast)
    assert spec2.replay_layers == (1,) and spec2.frame_tokens == 4 and spec2.kv_heads == zoo.KV_HEADS
    part = partition(fast, load_board("kv260"))
    assert part.unsupported == []
    srcs = {t["name"]: t["source"] for t in part.tensors}
    assert all(srcs[f"L{i}.{n}"] for i in range(zoo.LAYERS) for n in ("q_proj", "down_proj", "o_proj"))


def _toy_with(op_type: str) -> onnx.ModelProto:
    h, v = 8, 16
    inits = [numpy_helper.from_array(np.ones((h, h), np.float32), f"w{i}") for i in range(4)]
    inits += [numpy_helper.from_array(np.ones((h, 2 * h), np.float32), f"g{i}") for i in range(2)]
    inits += [numpy_helper.from_array(np.ones((2 * h, h), np.float32), "d0"),
              numpy_helper.from_array(np.ones((h, v), np.float32), "lm"),
              numpy_helper.from_array(np.array([2], np.int64), "kk")]
    nodes = [helper.make_node("MatMul", ["x", n], [f"y_{n}"], name=f"mm_{n}") for n in ("w0", "w1", "w2", "w3", "g0",
                                                                                         "g1", "lm")]
    nodes.append(helper.make_node("MatMul", ["y_g0", "d0"], ["y_d0"], name="mm_d0"))
    if op_type == "TopK":
        nodes.append(helper.make_node("TopK", ["y_lm", "kk"], ["vals", "idx"], name="pick_top"))
    else:
        nodes.append(helper.make_node(op_type, ["y_lm"], ["vals"], name="odd_op"))
    g = helper.make_graph(nodes, "toy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, h])],
                          [helper.make_tensor_value_info("vals", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])


def test_unsupported_ops_reported_by_name():
    model = _toy_with("TopK")
    with pytest.raises(FastCarError, match=r"TopK \(pick_top"):
        partition(model, load_board("kv260"), num_heads=2)
    part = partition(model, load_board("kv260"), num_heads=2, strict=False)
    assert part.unsupported == ["TopK (pick_top, domain ai.onnx)"]
    assert part.op_counts["TopK"] == 1


def test_paper_model_partition_is_fast_and_complete():
    part = partition(LLAMA2_7B, load_board("u280"))
    total = sum(sum(m * k for _, m, _, k in t.tiles) for g in part.graphs for t in part.tasks(g) if t.tiles)
    per_layer = sum(LLAMA2_7B.layer_weight_elems().values())
    assert total == LLAMA2_7B.layers * per_layer + LLAMA2_7B.hidden * LLAMA2_7B.vocab
