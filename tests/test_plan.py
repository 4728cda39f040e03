"""The per-layer plan: `--inspect -v` and `--verbose` print it, and the compiled model is what it says."""

from __future__ import annotations

import re

import onnx
import pytest

from fastcar_compile.cli import main
from fastcar_compile.core import contract

L = 4


def _plan_blocks(text: str) -> dict[int, dict[str, str]]:
    """The `plan:` section of a report: layer -> {field: value}."""
    assert "plan:" in text, text
    blocks: dict[int, dict[str, str]] = {}
    layer = None
    for line in text.split("plan:", 1)[1].splitlines()[1:]:
        head = re.match(r"^  layer +(\d+): (\S.*)$", line)
        if head:
            layer = int(head.group(1))
            blocks[layer] = {"state": head.group(2)}
        elif line.startswith("    ") and layer is not None and ": " in line:
            key, value = line.strip().split(": ", 1)
            blocks[layer][key] = value
        elif not line.startswith("  "):
            break
    return blocks


def _gate_forms(path) -> dict[int, set[str]]:
    """Layer -> the variant attributes set on its TemporalGate in the written model (ONNX's own reader)."""
    forms: dict[int, set[str]] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.domain == contract.DOMAIN and node.op_type == contract.TEMPORAL_GATE:
            layer = int(dict((p.key, p.value) for p in node.metadata_props)[contract.TAG_LAYER])
            forms[layer] = {a.name for a in node.attribute if a.name in contract.GATE_FORM_ATTRIBUTES and a.i}
    return forms


def test_inspect_v_plans_every_layer_of_a_dynamo_export(zoo_model, tmp_path, capsys):
    model = zoo_model("llama", "dynamo20")
    assert main([str(model), "--inspect", "-v"]) == 0
    blocks = _plan_blocks(capsys.readouterr().out)
    num_layers = len([o for o in onnx.load(str(model), load_external_data=False).graph.output
                      if re.fullmatch(r"present\.\d+\.key", o.name)])
    assert sorted(blocks) == list(range(num_layers))
    # the dynamo export after the exporter fusions (they run before discovery): MatMul/Softmax attention, the
    # rotate-half RoPE as RotaryEmbedding, the MLP norm joined to the residual Add (genai's builder's forms)
    for b in blocks.values():
        assert b["state"] == "rewrite"
        assert b["attention"].startswith("MatMul/Softmax")
        assert b["attention op"] == "ai.fastcar.CompressedAttention"  # the default --fused-attention
        assert b["rotary"] == "com.microsoft::RotaryEmbedding"
        assert b["residual"] == "fused Skip*Norm"
        assert b["kv"] == "dense"
        assert b["gate"].startswith("TemporalGate")
    out = tmp_path / "fast.onnx"
    assert main([str(model), "-o", str(out), "--frame-tokens", str(L), "--verbose"]) == 0
    assert _plan_blocks(capsys.readouterr().out) == blocks  # the compile plans what --inspect -v printed


def test_inspect_v_says_tas_reads_the_raw_query_on_a_layer_without_rotary(zoo_model, capsys):
    """GPT-2 (learned positions): every layer's rotary is 'none', so the plan says the TAS query the option names
    is the raw query there, never 'rope' beside 'rotary: none'; a LLaMA layer keeps 'rope'."""
    assert main([str(zoo_model("gpt2", "dynamo20")), "--inspect", "-v"]) == 0
    blocks = _plan_blocks(capsys.readouterr().out)
    assert blocks and all(b["rotary"] == "none" for b in blocks.values())
    assert all(b["tas query"].startswith("rope = raw: no rotary") for b in blocks.values()), blocks
    assert main([str(zoo_model("llama", "dynamo20")), "--inspect", "-v"]) == 0
    assert {b["tas query"] for b in _plan_blocks(capsys.readouterr().out).values()} == {"rope"}


def test_inspect_v_plans_a_genai_graph_and_the_compile_builds_that_gate(genai_model, tmp_path, capsys):
    src = genai_model("llama", "fp32")
    assert main([str(src / "model.onnx"), "--inspect", "-v"]) == 0
    blocks = _plan_blocks(capsys.readouterr().out)
    assert blocks and all(b["state"] == "rewrite" for b in blocks.values())
    for b in blocks.values():  # onnxruntime-genai's builder: packed QKV GroupQueryAttention rotating inside
        assert "GroupQueryAttention" in b["attention"]
        assert b["attention op"] == "ai.fastcar.GroupQueryAttention"  # --native-attention on (default)
        assert b["residual"] == "fused Skip*Norm"
        assert b["gate"] == "TemporalGate [use_total_len, packed_qkv, do_rotary, select_rows]"
        assert b["row selection"] == "in the gate (select_rows)"
    out = tmp_path / "fast.onnx"
    assert main([str(src / "model.onnx"), "-o", str(out), "--frame-tokens", str(L), "--verbose"]) == 0
    compiled = _plan_blocks(capsys.readouterr().out)
    assert compiled == blocks  # --verbose prints the same plan for the default options
    built = _gate_forms(out)
    assert sorted(built) == sorted(blocks)
    for layer, attrs in built.items():
        assert attrs == {"use_total_len", "packed_qkv", "do_rotary", "select_rows"}, (layer, attrs)


def test_the_plan_follows_the_options(genai_model, zoo_model, tmp_path, capsys):
    src = genai_model("llama", "fp32")
    out = tmp_path / "raw.onnx"
    assert main([str(src / "model.onnx"), "-o", str(out), "--frame-tokens", str(L), "--tas-query", "raw",
                 "--layers", "0", "--verbose"]) == 0
    blocks = _plan_blocks(capsys.readouterr().out)
    assert blocks[0]["gate"] == "TemporalGate [use_total_len, packed_qkv, select_rows]"  # raw TAS: no rotation
    assert all(b["state"] == "matched" and b["gate"] == "-" for n, b in blocks.items() if n != 0)
    assert _gate_forms(out) == {0: {"use_total_len", "packed_qkv", "select_rows"}}
    out = tmp_path / "kv.onnx"
    assert main([str(zoo_model("llama", "dynamo20")), "-o", str(out), "--frame-tokens", str(L), "--kv-budget", "16",
                 "--kv-sinks", "2", "--kv-window", "8", "--verbose"]) == 0
    blocks = _plan_blocks(capsys.readouterr().out)
    for b in blocks.values():
        assert b["kv"].startswith("compressed (budget 16, sinks 2, window 8"), b["kv"]
        assert b["gate"] == "TemporalGate [use_total_len, aligned_keys]"
    assert set(map(frozenset, _gate_forms(out).values())) == {frozenset({"use_total_len", "aligned_keys"})}


PACKED_ROPE = {"use_total_len", "packed_qkv", "do_rotary", "select_rows"}
PACKED = {"use_total_len", "packed_qkv", "select_rows"}


@pytest.mark.parametrize("flags,gate,packing", [
    ([], PACKED_ROPE, "one QKV MatMul"),
    (["--tas-query", "raw"], PACKED, "[B, S, H*D] q/k/v"),
    (["--pack-qkv", "off"], PACKED, "[B, S, H*D] q/k/v"),
    (["--fused-attention", "gqa"], PACKED_ROPE, "one QKV MatMul"),
    (["--fused-attention", "gqa", "--tas-query", "raw"], {"use_total_len"}, "separate q/k/v"),
], ids=["default", "raw", "nopack", "gqa", "gqa-raw"])
def test_the_plan_of_a_dynamo_export_is_what_the_compile_builds(zoo_model, tmp_path, capsys, flags, gate, packing):
    """The printed plan names each layer's final gate and attention form (the layout and packing included), the
    ones the written model holds (read back with ONNX's own reader)."""
    out = tmp_path / "fast.onnx"
    assert main([str(zoo_model("llama", "dynamo20")), "-o", str(out), "--frame-tokens", str(L), "--verbose",
                 *flags]) == 0
    text = capsys.readouterr().out
    blocks = _plan_blocks(text)
    assert " built: " not in text  # nothing is built other than planned
    assert {n: set(b["gate"].removeprefix("TemporalGate [").removesuffix("]").split(", "))
            for n, b in blocks.items()} == _gate_forms(out) == dict.fromkeys(blocks, gate)
    assert all(b["packing"].startswith(packing) for b in blocks.values()), blocks
    attention = [n for n in onnx.load(str(out), load_external_data=False).graph.node
                 if n.op_type in (contract.COMPRESSED_ATTENTION, contract.GROUP_QUERY_ATTENTION)]
    assert len(attention) == len(blocks)
    for node in attention:  # one QKV MatMul: the op takes the packed projection and rotates itself
        rotates = node.overload == "packed_rotary" or any(a.name == "do_rotary" and a.i for a in node.attribute)
        assert rotates == (packing == "one QKV MatMul"), node.name


INSPECTED = {"kv": ["--kv-budget", "16", "--kv-sinks", "2", "--kv-window", "8"],
             "gqa": ["--fused-attention", "gqa"],
             "per-layer": ["--per-layer-threshold", "--threshold", "0.3,0.6"],
             "layers": ["--layers", "1", "--tas-query", "raw"]}


def _attention_ops(path) -> dict[int, str]:
    """Layer -> 'domain.op' of its fused attention op in the written model (ONNX's own reader)."""
    ops = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.op_type in (contract.COMPRESSED_ATTENTION, contract.GROUP_QUERY_ATTENTION):
            ops[int(dict((p.key, p.value) for p in node.metadata_props)[contract.TAG_LAYER])] = \
                f"{node.domain}.{node.op_type}"
    return ops


@pytest.mark.parametrize("flags", INSPECTED.values(), ids=INSPECTED.keys())
def test_inspect_plans_with_the_options_given(zoo_model, tmp_path, capsys, flags):
    """`--inspect -v` with compile options prints the plan a compile with them builds (not the default plan): the
    one `--verbose` prints while compiling, and what the written model holds (gates, attention ops, tau)."""
    model = str(zoo_model("llama", "dynamo20"))
    assert main([model, "--inspect", "-v"]) == 0
    default = _plan_blocks(capsys.readouterr().out)
    assert main([model, "--inspect", "-v", *flags]) == 0
    inspected = _plan_blocks(capsys.readouterr().out)
    assert inspected != default
    out = tmp_path / "fast.onnx"
    assert main([model, "-o", str(out), "--frame-tokens", str(L), "--verbose", *flags]) == 0
    assert _plan_blocks(capsys.readouterr().out) == inspected
    rewritten = {n: b for n, b in inspected.items() if b["state"] == "rewrite"}
    assert _gate_forms(out) == {n: set(b["gate"].removeprefix("TemporalGate [").removesuffix("]").split(", "))
                                for n, b in rewritten.items()}
    assert _attention_ops(out) == {n: b["attention op"] for n, b in inspected.items()}
    graph = onnx.load(str(out), load_external_data=False).graph
    taus = next(onnx.numpy_helper.to_array(t) for t in graph.initializer if t.name == contract.THRESHOLD)
    assert [float(b["threshold"].split()[0]) for _, b in sorted(rewritten.items())] == \
        pytest.approx(taus.reshape(-1).tolist() if taus.size > 1 else [float(taus)] * len(rewritten))


def test_inspect_refuses_what_it_cannot_plan(zoo_model, capsys):
    """Settings that act only when a model is written, calibrated or scheduled are refused, in one line naming them,
    not ignored."""
    model = str(zoo_model("llama", "dynamo20"))
    assert main([model, "--inspect", "-o", "x.onnx", "--calibrate-replay", "0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--output" in err and "--calibrate-replay" in err, err
