"""Residual matchers: where the attention output joins the stream, and which branch is the MLP.

First the join: following the attention output forward (through the output projection and any norm applied
to it, as Gemma2/OLMo2 do) to the first Add / Skip*Norm that adds a value from outside, with nothing of the
attention path used elsewhere. Then the residual forms, tried in order:
- `fused Skip*Norm`: the join is a Skip*Norm whose 4th output is the stream and whose normed output starts
  the MLP branch (onnxscript ort_fusions, ORT transformers optimizer);
- `sequential Add`: the stream after the join is added, later, to a branch computed from it (pre-norm,
  post-norm and norm-free MLPs alike: the norms are part of the branch);
- `parallel residual`: the join is part of one sum x + attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX, GPT-J,
  Phi-2, Falcon, Cohere); the MLP branch starts at x, or at ln(x) when the norm is shared with attention.
Each form's branch must be isolable (match_mlp.isolate) or the next form is tried.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import onnx_ir as ir

from fastcar_compile.passes import graph_utils as gu
from fastcar_compile.passes.layer_match import MLPBlock
from fastcar_compile.passes.match_base import MatchContext, MatchFailure, first_match
from fastcar_compile.passes.match_mlp import isolate

_MAX_PATH = 96  # nodes between the attention output and the join (projection, bias, norm, casts)


@dataclass
class Join:
    node: ir.Node  # the Add / Skip*Norm that adds the attention path to a value from outside
    attn_in: ir.Value  # its input on the attention side
    other: ir.Value  # its other input


def _is_skip_norm(node: ir.Node) -> bool:
    return node.op_type in gu.SKIP_NORM_OPS and len(node.outputs) >= 4 and node.outputs[3] is not None


def find_join(ctx: MatchContext, core_out: ir.Value) -> Join:
    """The first Add/Skip*Norm after the attention output that adds an outside value, the path being closed."""
    cone_values = {core_out}
    cone: list[ir.Node] = []
    producer = core_out.producer()
    start = ctx.order.get(producer, -1) + 1 if producer is not None else 0
    for node in ctx.nodes[start:]:
        if not any(i in cone_values for i in node.inputs if i is not None):
            continue
        if len(cone) > _MAX_PATH:
            break
        if node.op_type == "Add" or _is_skip_norm(node):
            pair = [i for i in node.inputs[:2] if i is not None]
            attn_side = [i for i in pair if i in cone_values]
            other = [i for i in pair if i not in cone_values]
            if len(attn_side) == 1 and len(other) == 1 and not gu.is_static(other[0]):
                _check_closed(core_out, cone, node)
                what = "fused norm" if _is_skip_norm(node) else "Add"
                ctx.trace.append(f"attention joins the stream: {gu.describe(node)} ({what}, "
                                 f"{len(cone)} nodes after attention)")
                return Join(node, attn_side[0], other[0])
        cone.append(node)
        cone_values.update(o for o in node.outputs if o is not None)
    last = gu.describe(cone[-1]) if cone else gu.describe(producer)
    raise MatchFailure("residual", "no residual Add after the attention output", last)


def _check_closed(core_out: ir.Value, cone: list[ir.Node], join: ir.Node) -> None:
    """Nothing between the attention output and the join may be used elsewhere (else it is no residual path)."""
    inside = set(cone) | {join}
    for value in [core_out, *(o for n in cone for o in n.outputs if o is not None)]:
        outside = [c for c in gu.real_consumers(value) if c not in inside]
        if outside or value.is_graph_output():
            users = [gu.describe(n) for n in outside] + (["a graph output"] if value.is_graph_output() else [])
            raise MatchFailure("residual", f"attention output path forks at {value.name}: also used by "
                               f"{', '.join(users)} before it joins the stream at {gu.describe(join)}",
                               users[0])


def _aliases(value: ir.Value) -> list[ir.Value]:
    """The value and its no-op Cast/Identity copies (TorchScript: RMSNorm's .to(float32))."""
    aliases = [value]
    for alias in aliases:
        aliases.extend(n.outputs[0] for n in alias.consumers() if n.op_type in ("Cast", "Identity"))
    return aliases


def _closing_branch(residual: ir.Value, entry: ir.Value | None) -> tuple[ir.Node, ir.Value, ir.Value]:
    """(closing node, branch output, residual alias): an Add of the stream and a branch computed from it."""
    for alias in _aliases(residual):
        start = entry if entry is not None else alias
        for node in alias.consumers():
            # Skip*Norm sums input and skip: the stream may be either (genai's builder puts it first).
            if node.op_type == "Add" or (node.op_type in gu.SKIP_NORM_OPS and alias in node.inputs[:2]):
                others = [i for i in node.inputs[:2] if i is not None and i is not alias]
                if len(others) == 1 and gu.depends_on(others[0], start):
                    return node, others[0], alias
    raise MatchFailure("mlp", f"no Add closes a branch that starts at {residual.name}",
                       ", ".join(gu.describe(n) for n in residual.consumers()))


# --- forms ----------------------------------------------------------------------------------------------------


def fused_skip_norm(ctx: MatchContext, join: Join) -> MLPBlock:
    if not _is_skip_norm(join.node):
        raise MatchFailure("mlp", f"{gu.describe(join.node)} is not a Skip*Norm with a residual output",
                           gu.describe(join.node), applies=False)
    residual, entry = join.node.outputs[3], join.node.outputs[0]
    closing, branch_out, residual = _closing_branch(residual, entry)
    return isolate(ctx, entry, branch_out, residual, closing, fused=True)


def sequential_add(ctx: MatchContext, join: Join) -> MLPBlock:
    if join.node.op_type != "Add":
        raise MatchFailure("mlp", f"{gu.describe(join.node)} is not an Add", gu.describe(join.node), applies=False)
    closing, branch_out, residual = _closing_branch(join.node.outputs[0], None)
    return isolate(ctx, residual, branch_out, residual, closing, fused=False)


def parallel_residual(ctx: MatchContext, join: Join, core_out: ir.Value) -> MLPBlock:
    """x + attn(ln1(x)) + mlp(ln2(x)), summed in any order: the MLP branch starts at x (or the shared ln(x))."""
    if join.node.op_type != "Add":
        raise MatchFailure("mlp", f"{gu.describe(join.node)} is not an Add", gu.describe(join.node), applies=False)
    leaves, top = [(join.other, join.node)], join.node
    while len(leaves) < 2:
        total = top.outputs[0]
        cons = gu.real_consumers(total)
        if len(cons) != 1 or cons[0].op_type != "Add" or total.is_graph_output():
            raise MatchFailure("mlp", f"the attention sum {total.name} is not one sum of three terms "
                               "(stream, attention, MLP)", ", ".join(gu.describe(n) for n in cons) or "graph output")
        nxt = cons[0]
        other = [i for i in nxt.inputs[:2] if i is not None and i is not total]
        if len(other) != 1 or gu.is_static(other[0]):
            raise MatchFailure("mlp", f"{gu.describe(nxt)} adds no third term to the attention sum", gu.describe(nxt))
        leaves.append((other[0], nxt))
        top = nxt
    stream = [(v, n) for v, n in leaves if gu.depends_on(core_out, v)]
    branch = [(v, n) for v, n in leaves if (v, n) not in stream]
    if len(stream) != 1 or len(branch) != 1 or not gu.depends_on(branch[0][0], stream[0][0]):
        raise MatchFailure("mlp", "the three-term sum has no stream that both attention and the other term read",
                           gu.describe(top))
    x, (branch_out, closing) = stream[0][0], branch[0]
    entry = _branch_entry(x, branch_out)
    ctx.trace.append(f"parallel residual: stream {x.name}, MLP branch from {entry.name}, summed by {gu.describe(top)}")
    return isolate(ctx, entry, branch_out, x, closing, fused=False)


def _branch_entry(x: ir.Value, branch_out: ir.Value) -> ir.Value:
    """x, or the one value of the branch that attention also reads (a norm shared by attention and MLP)."""
    nodes = gu.descendants(x, gu.ancestors_until([branch_out], {x}))
    shared = [o for n in nodes for o in n.outputs
              if o is not None and o is not branch_out and any(c not in nodes for c in gu.real_consumers(o))]
    if len(shared) == 1:
        return shared[0]
    return x


def find_mlp(ctx: MatchContext, core_out: ir.Value) -> tuple[Join, str, MLPBlock]:
    """The join, then the first residual form whose MLP branch isolates."""
    join = find_join(ctx, core_out)
    forms = (
        ("fused Skip*Norm", lambda: fused_skip_norm(ctx, join)),
        ("sequential Add", lambda: sequential_add(ctx, join)),
        ("parallel residual", lambda: parallel_residual(ctx, join, core_out)),
    )
    name, mlp = first_match("mlp", forms, ctx.trace)
    return join, name, dataclasses.replace(mlp, form=name)
