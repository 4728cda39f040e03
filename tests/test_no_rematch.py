"""No pass decides from the ai.fastcar nodes an earlier pass built: they read the plan and the layer records, and
each layer's attention op and gate are emitted once, in their final form.

A structural check over passes/*.py (Python's own parser): no comparison of a node's `op_type` or `domain` with an
ai.fastcar op or domain, no reader of an emitted gate's form/inputs/attributes, no read of a compressed-cache
setting (`budget`) off a node. Building such nodes (ir.node(contract.TEMPORAL_GATE, ...)) is what emission does
and is not flagged. The one place that looks at ai.fastcar nodes is the input check before anything is emitted
(an already compiled model is refused). The compile tests run the pipeline pass by pass and watch every
ai.fastcar node and every attention op the compile built: once emitted, no later pass may replace it or change its
inputs or attributes (`--fused-attention gqa` builds ai.fastcar's GroupQueryAttention itself: NativeGqaPass swaps
only the export's own com.microsoft nodes), and no pass after discovery matches a layer again.
"""

from __future__ import annotations

import ast
from pathlib import Path
from unittest import mock

import onnx_ir as ir
import pytest

import fastcar_compile.passes as passes_pkg
from fastcar_compile.core import contract
from fastcar_compile.passes import discover, pipeline
from fastcar_compile.passes.context import CompileContext, CompileOptions

PASSES = Path(passes_pkg.__file__).parent
# every folder that builds or rewrites graphs: the passes, and the PyTorch front end's and the DiT's modules
SCANNED = (PASSES, PASSES.parent / "fastcar_compile" / "torch", PASSES.parent / "fastcar_compile" / "dit")
# ai.fastcar's op names, GroupQueryAttention aside: that name is also com.microsoft's op, which exports contain
OPS = set(contract.OP_NAMES) - {contract.GROUP_QUERY_ATTENTION}
FASTCAR_NAMES = {"DOMAIN", *(name for name in dir(contract) if isinstance(getattr(contract, name), str) and getattr(contract, name) in OPS)}
READERS = {"gate_form", "gate_inputs", "gate_attributes"}  # read an emitted gate back
SETTINGS = {"budget", "qkv_perm", "frame_tokens", "age_offset"}  # settings the plan holds
# (file, function) allowed to look: the input check, before any pass has emitted anything; and the PyTorch path's
# lowering, which finds the ai.fastcar nodes torch.onnx exported from the program's custom ops (its input, not
# what an earlier pass built) to type them and to hand BranchPass the layer's gate and cache values
ALLOWED = {("analysis.py", "find_layers"), ("onnx_branch.py", "_layer"), ("onnx_branch.py", "rebuild_branches"),
           ("onnx_export.py", "_type_gate_outputs")}


def _names(node: ast.AST) -> set[str]:
    """Names and attribute names in an expression, and its string constants."""
    out: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            out.add(sub.attr)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            out.add(sub.value)
    return out


def _fastcar_mention(expr: ast.AST) -> bool:
    names = _names(expr)
    return bool(names & FASTCAR_NAMES) or bool(names & OPS) or contract.DOMAIN in names


def violations(source: str, filename: str) -> list[str]:
    """What in `source` decides from an emitted ai.fastcar node (file:line: what)."""
    tree = ast.parse(source)
    found = []
    for func in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]:
        name = func.name
        if (filename, name) in ALLOWED:
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                reads = any(isinstance(s, ast.Attribute) and s.attr in ("op_type", "domain") for s in sides)
                if reads and any(_fastcar_mention(s) for s in sides):
                    found.append(f"{filename}:{node.lineno}: compares a node's op_type/domain with an ai.fastcar one")
            elif isinstance(node, ast.Call):
                callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if callee in READERS:
                    found.append(f"{filename}:{node.lineno}: reads an emitted gate back ({callee})")
                on_attributes = isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Attribute) \
                    and node.func.value.attr == "attributes"  # node.attributes.get(...), not a dict's get
                if (callee == "_attr" or callee in ("get_int", "get") and on_attributes) and any(
                        isinstance(a, ast.Constant) and a.value in SETTINGS for a in node.args):
                    found.append(f"{filename}:{node.lineno}: reads a setting back off a node ({callee})")
    return sorted(set(found))


def test_no_pass_matches_or_reads_back_ai_fastcar_nodes():
    files = [path for folder in SCANNED for path in sorted(folder.glob("*.py"))]
    assert len({f.parent for f in files}) == len(SCANNED), "a scanned folder has no Python files: moved?"
    found = [v for path in files for v in violations(path.read_text(), path.name)]
    assert not found, "\n".join(found)


def test_the_check_sees_what_it_forbids():
    # the forms the passes used before the plan: each one must be caught
    cases = {
        "def f(n):\n    return n.op_type == contract.SELECT_ROWS\n": "op_type",
        "def f(n):\n    return n.domain == contract.DOMAIN and n.op_type == 'CompressedAttention'\n": "op_type",
        "def f(g):\n    return [n for n in g if fastcar_ops.gate_form(n) == AT]\n": "gate back",
        "def f(ca):\n    return ca.attributes.get_int('budget', 0)\n": "setting",
        "def f(ca):\n    return ca.attributes.get('frame_tokens')\n": "setting",
        "def f(ca):\n    return _attr(ca, 'qkv_perm', [0])\n": "setting",
        "def f(g):\n    return [n for n in g if n.op_type == 'If' and n.domain != contract.DOMAIN]\n": "op_type",
    }
    for source, what in cases.items():
        assert any(what in v for v in violations(source, "x.py")), source
    fine = "def f(b):\n    return b(contract.TEMPORAL_GATE, [], domain=contract.DOMAIN)\n"  # emission
    assert violations(fine, "x.py") == []
    assert violations("def f(opts):\n    return opts.get('frame_tokens')\n", "x.py") == []  # an options dict


def _signature(node: ir.Node) -> tuple:
    """A node's op, inputs (by name: a pass that replaces the op producing an input, e.g. NativeGqaPass, hands the
    node the same value anew) and attributes."""
    return (node.domain, node.op_type, node.overload, tuple(v.name if v is not None else None for v in node.inputs),
            tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items())))


def _emitted(model: ir.Model, before: set[ir.Node]) -> dict[ir.Node, tuple]:
    """The nodes the compiler built that a later pass must leave as they are (If branches included): every
    ai.fastcar node, and the com.microsoft attention ops it built (not in the input: `before`)."""
    return {node: _signature(node) for node in ir.traversal.RecursiveGraphIterator(model.graph)
            if node.domain == contract.DOMAIN or (node.domain == contract.MS_DOMAIN and
                                                   node.op_type == contract.GROUP_QUERY_ATTENTION and
                                                   node not in before)}


def compile_watching(path, **options) -> tuple[CompileContext, dict[ir.Node, str], dict[ir.Node, tuple]]:
    """Run the compile pipeline on `path` one pass at a time; fail when a pass replaces, rewires or re-attributes a
    node an earlier pass built (an ai.fastcar op, or a com.microsoft attention op the compile wrote). (context,
    node -> the pass that built it, the final nodes -> their signatures)."""
    model = ir.load(str(path))
    exported = set(ir.traversal.RecursiveGraphIterator(model.graph))
    ctx = CompileContext(CompileOptions(frame_tokens=4, **options))
    built: dict[ir.Node, str] = {}
    seen: dict[ir.Node, tuple] = {}
    matched: list[str] = []  # the pass running each time a layer is matched
    match_layer = discover._match_layer
    with mock.patch.object(discover, "_match_layer", lambda *a: (matched.append(name), match_layer(*a))[1]):
        for p in pipeline.build(ctx).passes:
            name = type(p).__name__
            p(model)
            now = _emitted(model, exported)
            for node, sig in seen.items():
                assert now.get(node) == sig, f"{name} rewrote {node.op_type} {node.name} {built[node]} built"
            for node in now.keys() - seen.keys():
                built[node] = name
            seen = now
    # discovery matches the export, once (twice when a first look needed shape inference), and nothing after it
    assert matched and set(matched) == {"DiscoverPass"}, matched
    return ctx, built, seen


def compile_watching_gates(path, **options) -> tuple[CompileContext, dict[ir.Node, str], dict[ir.Node, tuple]]:
    """compile_watching, its TemporalGate nodes only."""
    ctx, built, final = compile_watching(path, **options)
    gates = {n for n in final if n.op_type == contract.TEMPORAL_GATE and n.domain == contract.DOMAIN}
    return ctx, {n: built[n] for n in gates}, {n: final[n] for n in gates}


OPTIONS = [{}, {"tas_query": "raw"}, {"fused_attention": "gqa"}, {"pack_qkv": False},
           {"fused_attention": "gqa", "tas_query": "raw"}, {"per_layer_threshold": True, "threshold": [0.3, 0.6]},
           {"kv_budget": 16, "kv_sinks": 2, "kv_window": 8}]
OPTION_IDS = ["default", "raw", "gqa", "nopack", "gqa-raw", "per-layer", "kv"]


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_a_dynamo_exports_attention_ops_are_built_once(zoo_model, options):
    """Each fused layer's attention op is built once, by the attention emission, in its final form (the layout and
    the packed QKV with RoPE inside it included): no later pass replaces, rewires or re-attributes it, nor any other
    ai.fastcar node."""
    ctx, built, final = compile_watching(zoo_model("llama", "dynamo20"), **options)
    ops = (contract.COMPRESSED_ATTENTION, contract.GROUP_QUERY_ATTENTION)
    attention = [built[n] for n in final if n.op_type in ops]
    swapped = [p for n, p in built.items() if n.op_type in ops and n not in final]
    assert len(ctx.fusions) == 2
    assert swapped == [] and attention == ["FusedAttentionPass"] * 2
    if options.get("fused_attention") == "gqa":  # ai.fastcar's GroupQueryAttention (native on), built as such
        assert {(n.domain, n.op_type) for n in final if n.op_type in ops} == {
            (contract.DOMAIN, contract.GROUP_QUERY_ATTENTION)}


@pytest.mark.parametrize("options", [{}, {"tas_query": "raw"}, {"fused_attention": "gqa"},
                                     {"per_layer_threshold": True, "threshold": [0.3, 0.6]}],
                         ids=["default", "raw", "gqa", "per-layer"])
def test_a_dynamo_exports_gates_are_emitted_once(zoo_model, options):
    ctx, emitted, final = compile_watching_gates(zoo_model("llama", "dynamo20"), **options)
    assert ctx.rewritten and len(emitted) == len(ctx.rewritten)  # one gate creation per rewritten layer
    assert set(emitted.values()) == {"GatePass"}
    if not options or "per_layer_threshold" in options:  # the fusions' final form: packed q/k/v, RoPE, rows
        for node in final:
            on = {k for k in contract.GATE_FORM_ATTRIBUTES if node.attributes.get_int(k, 0)}
            assert on == {"use_total_len", "packed_qkv", "do_rotary", "select_rows"}, (node.name, on)


def test_a_genai_graphs_gates_are_emitted_once(genai_model):
    ctx, emitted, _ = compile_watching_gates(genai_model("llama", "fp32") / "model.onnx")
    assert ctx.rewritten and len(emitted) == len(ctx.rewritten)
    assert set(emitted.values()) == {"GatePass"}


DIT_OPTIONS = [{"threshold": [0.05]}, {"tempcache": 0.3, "tempcache_match": "lsh", "annca": True},
               {"annsa": "int8", "annca": True, "threshold": [0.05]}, {"annsa": "lsh", "native_attention": False}]


@pytest.mark.parametrize("options", DIT_OPTIONS, ids=["fastcar", "tempcache-annca", "annsa-annca-fastcar", "annsa-graph"])
def test_a_dit_step_graphs_blocks_are_matched_once(dit_tiny_export, options):
    """The DiT target matches each block once, in DiTDiscoverPass: the emission passes (in-place cache, replay,
    AnnCA) build on the nodes it found; no later pass walks an attention chain or a block again."""
    from fastcar_compile import api
    from fastcar_compile.passes import dit_discover

    loaded = api.load(dit_tiny_export)
    ctx, _ = api._dit_context(loaded, options, None)
    calls: list[str] = []
    running = [""]
    match_block, chain = dit_discover._match_block, dit_discover.attention_chain
    with mock.patch.object(dit_discover, "_match_block", lambda *a: (calls.append(running[0]), match_block(*a))[1]), \
            mock.patch.object(dit_discover, "attention_chain", lambda *a: (calls.append(running[0]), chain(*a))[1]):
        for p in pipeline.build(ctx).passes:
            running[0] = type(p).__name__
            p(loaded.model)
    assert calls and set(calls) == {"DiTDiscoverPass"}, calls
    assert [type(p).__name__ for p in pipeline.build(ctx).passes][:2] == ["DiTDiscoverPass", "DiTPlanPass"]
