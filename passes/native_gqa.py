"""com.microsoft.GroupQueryAttention -> ai.fastcar.GroupQueryAttention (`--native-attention on|off`, default on).

ORT's CPU GroupQueryAttention costs ~1 ms per layer per decode step at ctx 4096 on the benchmark LLaMA (8.2 of a
20.7 ms onnxruntime-genai step); the ai.fastcar op has the same inputs, outputs and semantics and runs the shared
dense attention core (runtime/native/group_query_attention.h). Its function body is the original node, so a model
run without the native library behaves exactly as before: that is why the swap is on by default (it can only
change speed, never values beyond float rounding; tests/test_native_gqa.py checks the kernel against ORT's op).

Which nodes: the export's own (onnxruntime-genai builder graphs: packed QKV, do_rotary; in a compile, the ones the
plan recorded before anything was emitted: `--fused-attention gqa` builds its op as the plan says, ai.fastcar's where
this subset holds), float32 activations (fp16 graphs keep ORT's op; int4 MatMulNBits graphs have
fp32 activations and are swapped). `unsupported` says in one line why a node is left alone (`--inspect` prints it).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import onnx_ir as ir

from fastcar_compile.core import contract
from fastcar_compile.passes import fastcar_ops
from fastcar_compile.passes import graph_utils as gu

KEPT = contract.OP_ATTRIBUTES[contract.GROUP_QUERY_ATTENTION]
# attributes the kernel does not implement, with the values that mean "off" (absent = off too; ORT reads
# smooth_softmax as on only when 1, and -1 is its documented "off")
DEFAULTS: dict[str, tuple] = {"local_window_size": (-1,), "softcap": (0.0,), "smooth_softmax": (0, -1),
                              "qk_output": (0,), "causal": (1,), "sliding_window_cache": (0,),
                              "k_quant_type": ("NONE",), "v_quant_type": ("NONE",)}
IGNORED = frozenset({"qk_norm_epsilon"})  # only read with q/k norm weights, which are refused below
INPUTS = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos_cache",
          "sin_cache", "position_ids", "attention_bias")
BIAS, POSITION_IDS = INPUTS.index("attention_bias"), INPUTS.index("position_ids")
MASK_FLOOR = -1e30  # attention_bias entries at or below this are masked columns (the kernel reads them so)


def is_ms_gqa(node: ir.Node) -> bool:
    return node.op_type == "GroupQueryAttention" and node.domain == contract.MS_DOMAIN


def _const(value: ir.Value | None):
    """The value of a constant (initializer or Constant node), else None."""
    if value is None:
        return None
    arr = ir.convenience.get_const_tensor(value)
    return None if arr is None else arr.numpy()


ELEMENTWISE = frozenset({"Equal", "Not", "Cast", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or"})


def _dims(value: ir.Value | None) -> list | None:
    """A value's dims (ints, names or None), from its shape, a constant, or the NumPy broadcast of an elementwise
    producer's inputs (the pad condition is often untyped before shape inference); None when unknown."""
    if value is None:
        return None
    if value.shape is not None:
        return [d if isinstance(d, int) else str(d) for d in value.shape]
    if (arr := _const(value)) is not None:
        return list(arr.shape)
    node = value.producer()
    if node is None or node.op_type not in ELEMENTWISE:
        return None
    shapes = [_dims(v) for v in node.inputs]
    if not shapes or any(d is None for d in shapes):
        return None
    rank = max(len(d) for d in shapes)
    padded = [[1] * (rank - len(d)) + d for d in shapes]
    return [1 if all(d[i] == 1 for d in padded) else next(d[i] for d in padded if d[i] != 1) for i in range(rank)]


def _mask_form_bias(bias: ir.Value) -> str | None:
    """Why `bias` is not `--fused-attention gqa`'s mask form (None: it is): Where(pad, <= -1e30, 0) whose pad
    condition is constant across query rows, as [B, T] Unsqueezed at axes 1, 2, or [B, 1, 1, T], then Expands
    only, so the bias is [B, 1, 1|S, T] and every entry is 0 (visible) or a masked column. The kernel builds its
    mask from the bias's last query row, so a condition that varies per query row must keep ORT's op."""
    chain, node = [], bias.producer()
    while node is not None and node.op_type in ("Expand", "Unsqueeze"):
        chain.append(node)
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    if node is None or node.op_type != "Where" or len(node.inputs) != 3:
        return "it is not Where(pad, lowest, 0) through Unsqueeze/Expand"
    low, zero = _const(node.inputs[1]), _const(node.inputs[2])
    if low is None or zero is None or not (low <= MASK_FLOOR).all() or not (zero == 0).all():
        return "its Where does not pick a constant <= -1e30 or 0"
    if low.size != 1 or zero.size != 1:
        return "its Where's constants are not scalars"
    dims, unsq = _dims(node.inputs[0]), [n for n in chain if n.op_type == "Unsqueeze"]
    if dims is not None and len(dims) == 2 and len(unsq) == 1 and len(unsq[0].inputs) > 1:
        axes = _const(unsq[0].inputs[1])
        ok = axes is not None and sorted(int(a) % 4 for a in axes.reshape(-1)) == [1, 2]
    else:
        ok = dims is not None and len(dims) == 4 and not unsq and dims[1] == 1 and dims[2] == 1
    if not ok:
        return "its pad condition is not [B, T] (Unsqueezed at 1, 2) or [B, 1, 1, T]: it may vary per query row"
    if bias.shape is not None and (len(bias.shape) != 4 or bias.shape[1] != 1):
        return f"its shape {bias.shape} is not [B, 1, 1 or S, T]"
    return None


def _dtype(node: ir.Node) -> ir.DataType | None:
    for v in (node.inputs[0], node.inputs[3] if len(node.inputs) > 3 else None, node.outputs[1]):
        if v is not None and v.type is not None:
            return v.dtype
    return None


def unsupported(node: ir.Node) -> str | None:
    """Why this com.microsoft.GroupQueryAttention cannot become the ai.fastcar op (None: it can)."""
    if _dtype(node) != ir.DataType.FLOAT:
        dt = _dtype(node)
        return f"{dt.name.lower() if dt is not None else 'untyped'} activations (the kernel is float32)"
    for name, attr in node.attributes.items():
        if name in KEPT or name in IGNORED:
            continue
        if name not in DEFAULTS:
            return f"attribute {name} is not supported"
        if attr.value not in DEFAULTS[name]:
            return f"{name}={attr.value} is not supported (only {' or '.join(map(str, DEFAULTS[name]))})"
    extra = [i for i, v in enumerate(node.inputs) if v is not None and (i > BIAS or i == POSITION_IDS)]
    if extra:
        names = ", ".join(f"input {i}" if i >= len(INPUTS) else INPUTS[i] for i in extra)
        return f"{names} not supported (position_ids, head_sink, KV scales, q/k norm)"
    if len(node.outputs) < 3:
        return f"{len(node.outputs)} outputs (the ai.fastcar op has output, present_key, present_value)"
    if len(node.outputs) > 3 and (node.outputs[3].uses() or node.outputs[3].is_graph_output()):
        return "output_qk is read"
    rotary = node.attributes["do_rotary"].value if "do_rotary" in node.attributes else 0
    if rotary and (len(node.inputs) < 9 or node.inputs[7] is None or node.inputs[8] is None):
        return "do_rotary without cos_cache/sin_cache"
    bias = node.inputs[BIAS] if len(node.inputs) > BIAS else None
    if bias is not None and (why := _mask_form_bias(bias)) is not None:
        return f"attention_bias is not a 0 / -inf left-padding mask (Where(pad, lowest, 0)): {why}"
    return None


def inspect_notes(model: ir.Model) -> list[str]:
    """One line for --inspect: how many GroupQueryAttention nodes the swap takes, and why the others stay."""
    nodes = [n for n in model.graph if is_ms_gqa(n)]
    if not nodes:
        return []
    why = {n.name: r for n in nodes if (r := unsupported(n)) is not None}
    line = f"native attention: {len(nodes) - len(why)}/{len(nodes)} GroupQueryAttention nodes swappable"
    return [line] + [f"native attention: {name} stays ORT's: {r}" for name, r in why.items()]


class NativeGqaPass(ir.passes.InPlacePass):
    """com.microsoft.GroupQueryAttention -> ai.fastcar.GroupQueryAttention (native dense core; body = the original)."""

    def __init__(self, notes: list[str] | None = None, exported: Callable[[], Collection[ir.Node]] | None = None):
        super().__init__()
        self.notes = notes if notes is not None else []
        # the compile's: the export's own GroupQueryAttention nodes (the plan's record). The attention emission
        # builds its ops in their final form, so this pass never rewrites a node the compile built.
        self.exported = exported

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        swapped, kept = 0, []
        own = set(self.exported()) if self.exported is not None else None
        for node in [n for n in graph if is_ms_gqa(n) and (own is None or n in own)]:
            if (why := unsupported(node)) is not None:
                kept.append(f"{node.name}: {why}")
                continue
            inputs = list(node.inputs[:len(INPUTS)])
            while inputs and inputs[-1] is None:
                inputs.pop()
            attrs = {k: a.value for k, a in node.attributes.items() if k in KEPT}
            new = ir.node(contract.GROUP_QUERY_ATTENTION, inputs, attrs, domain=contract.DOMAIN, num_outputs=3,
                          name=node.name)
            graph.insert_before(node, new)
            for old, out in zip(node.outputs[:3], new.outputs, strict=True):
                gu.take_over(old, out, graph_outputs=True)
            graph.remove(node, safe=True)
            swapped += 1
        if swapped:
            fastcar_ops.add_functions(model, model.opset_imports.get("", 17))
            self.notes.append(f"native attention: {swapped} GroupQueryAttention nodes -> ai.fastcar (native dense core)")
        if kept:
            self.notes.append("native attention: kept ORT's GroupQueryAttention for " + "; ".join(kept))
        return ir.passes.PassResult(model, modified=swapped > 0)
