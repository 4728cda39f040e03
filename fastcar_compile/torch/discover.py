"""Find decoder layers in a captured ATen graph (torch.export) from dataflow alone.

The same anchors as the ONNX pass (passes/discover.py), searched in the same order:
1. `kv`: the program outputs `present.N.key/value` (positions 1.. of the flat output contract).
2. `attention`: the op that consumes the key cache (scaled_dot_product_attention, or the matmul of Q.K^T),
   reached through layout ops (GQA unsqueeze/expand/reshape, transpose, slicing, scaling).
3. `query`: the other operand as attention uses it (after RoPE) and, behind a rotate-half rotary
   (x*cos + rotate_half(x)*sin, optionally concatenated with an unrotated slice), the raw query.
4. `residual`: following the attention output forward to the add that joins the stream.
5. `mlp`: the consumer of that residual which closes a branch depending on it; the branch is every node
   between the branch entry (the residual) and the closing input.
Module paths, parameter names and node names are never used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

aten = torch.ops.aten

_LAYOUT = {aten.slice.Tensor, aten.unsqueeze.default, aten.expand.default, aten.reshape.default, aten.view.default,
           aten.transpose.int, aten.permute.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
           aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.repeat_interleave.self_int,
           aten._unsafe_view.default, aten.repeat.default}
_SCALE = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar}
_SDPA = {aten.scaled_dot_product_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
         aten._scaled_dot_product_efficient_attention.default}
_MATMUL = {aten.matmul.default, aten.bmm.default}
_NOOP = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.alias.default, aten.clone.default,
         aten.contiguous.default, aten.dropout.default}
_ADD = {aten.add.Tensor}


class MatchFailure(Exception):
    """A layer did not match; `anchor` is what was missing, `where` where the search stopped."""

    def __init__(self, anchor: str, reason: str, where: str = ""):
        super().__init__(reason)
        self.anchor, self.reason, self.where = anchor, reason, where


@dataclass
class TorchLayerMatch:
    layer: int
    present_key: fx.Node | None = None
    core: fx.Node | None = None
    q: fx.Node | None = None
    q_raw: fx.Node | None = None
    rope: str = "none"
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    join: fx.Node | None = None
    entry: fx.Node | None = None  # residual value the MLP branch starts from (its input)
    branch_out: fx.Node | None = None
    closing: fx.Node | None = None
    branch: list[fx.Node] = field(default_factory=list)
    hidden: int = 0
    weights: list[tuple[int, ...]] = field(default_factory=list)
    failure: MatchFailure | None = None
    trace: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failure is None and self.closing is not None


def describe(node: fx.Node | None) -> str:
    if node is None:
        return "nothing"
    target = node.target if node.op != "call_function" else getattr(node.target, "__name__", str(node.target))
    return f"{node.op} {target} ({node.name})"


def _shape(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _static_int(x) -> int | None:
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


class _Graph:
    """Memoised dataflow queries over one fx graph."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self._static: dict[fx.Node, bool] = {}

    def is_static(self, node) -> bool:
        """True for weights/constants and values computed only from them (no graph input reaches them)."""
        if not isinstance(node, fx.Node):
            return True
        if node in self._static:
            return self._static[node]
        if node.op == "placeholder":  # graph inputs (weights are get_attr in the unlifted program)
            res = False
        elif node.op == "get_attr":
            res = True
        else:
            res = all(self.is_static(a) for a in node.all_input_nodes)
        self._static[node] = res
        return res

    def depends_on(self, node: fx.Node, source: fx.Node) -> bool:
        stack, seen = [node], set()
        lo = self.order[source]
        while stack:
            n = stack.pop()
            if n is source:
                return True
            if n in seen or self.order[n] < lo:
                continue
            seen.add(n)
            stack.extend(n.all_input_nodes)
        return False


def kv_outputs(graph: fx.Graph) -> dict[int, dict[str, fx.Node]]:
    out = next(n for n in graph.nodes if n.op == "output")
    flat = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    layers: dict[int, dict[str, fx.Node]] = {}
    for k, node in enumerate(flat[1:]):
        layers.setdefault(k // 2, {})["key" if k % 2 == 0 else "value"] = node
    return layers


def discover(graph: fx.Graph) -> list[TorchLayerMatch]:
    g = _Graph(graph)
    matches = []
    for layer, kv in kv_outputs(graph).items():
        m = TorchLayerMatch(layer)
        try:
            if "key" not in kv or "value" not in kv:
                raise MatchFailure("kv", f"present.{layer}.key/value: only {sorted(kv)} among the outputs", "outputs")
            _find_attention(g, m, kv["key"], kv["value"])
            _find_mlp(g, m)
        except MatchFailure as exc:
            m.failure = exc
        matches.append(m)
    return matches


# --- attention -------------------------------------------------------------------------------------------


def _walk_to_consumer(g: _Graph, value: fx.Node, what: str, trace: list[str]) -> tuple[fx.Node, int]:
    frontier, seen, last = [value], set(), "the program output"
    while frontier:
        v = frontier.pop(0)
        for user in sorted(v.users, key=g.order.get):
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            last = describe(user)
            idx = next((i for i, a in enumerate(user.args) if a is v), None)
            if idx is None:
                continue
            if user.target in _SDPA or user.target in _MATMUL:
                trace.append(f"{what} {value.name} -> {describe(user)} (input {idx})")
                return user, idx
            if user.target in _LAYOUT and idx == 0:
                frontier.append(user)
            elif user.target in _SCALE and not isinstance(user.args[1 - idx], fx.Node):
                frontier.append(user)
    raise MatchFailure("attention", f"no attention op (scaled_dot_product_attention/matmul) consumes the {what} "
                       f"{value.name}", f"stopped after {last}")


def _walk_back(node: fx.Node, ops: set) -> fx.Node:
    while node.op == "call_function" and node.target in ops:
        if node.target in _SCALE and isinstance(node.args[1], fx.Node):
            break
        if node.target in (aten.transpose.int, aten.permute.default):
            break
        node = node.args[0]
    return node


def _rope_input(q: fx.Node) -> tuple[fx.Node, str]:
    """The query before the rotary, and what rotary was found ("none" for learned/absolute positions)."""
    node = q
    partial = False
    if node.target is aten.cat.default and len(node.args[0]) == 2:  # cat(rope(x[..:r]), x[r:])
        rot, rest = node.args[0]
        if rest.op == "call_function" and rest.target is aten.slice.Tensor:
            node, partial = rot, True
    if node.op == "call_function" and node.target in _ADD and all(
            isinstance(a, fx.Node) and a.target in (aten.mul.Tensor,) for a in node.args[:2]):
        m0, m1 = node.args[0], node.args[1]
        for a, b in ((m0, m1), (m1, m0)):
            for cand in a.args:
                if not isinstance(cand, fx.Node):
                    continue
                # x * cos + rotate_half(x) * sin: x also feeds the other product (through slices/neg/cat).
                if any(isinstance(o, fx.Node) and _reaches(o, cand, 6) for o in b.args):
                    raw = _walk_back(cand, {aten.alias.default, aten.slice.Tensor} if partial else {aten.alias.default})
                    return raw, ("partial " if partial else "") + "rotate-half (mul/add)"
    return q, "none"


def _reaches(node: fx.Node, target: fx.Node, depth: int) -> bool:
    if node is target:
        return True
    if depth == 0 or node.op != "call_function":
        return False
    return any(_reaches(a, target, depth - 1) for a in node.all_input_nodes)


def _find_attention(g: _Graph, m: TorchLayerMatch, pkey: fx.Node, pvalue: fx.Node) -> None:
    kshape = _shape(pkey)
    if kshape is None or len(kshape) != 4 or _static_int(kshape[1]) is None or _static_int(kshape[3]) is None:
        raise MatchFailure("kv", f"present.{m.layer}.key must be [batch, kv_heads, seq, head_dim] with static heads "
                           f"and head_dim", f"shape {kshape}")
    m.present_key = pkey
    m.num_kv_heads, m.head_dim = int(kshape[1]), int(kshape[3])
    core, kidx = _walk_to_consumer(g, pkey, "key cache", m.trace)
    if core.target in _SDPA:
        if kidx != 1:
            raise MatchFailure("attention", f"the key cache is input {kidx} of {describe(core)}, expected 1", describe(core))
        q = core.args[0]
        vcore, vidx = _walk_to_consumer(g, pvalue, "value cache", m.trace)
        if vcore is not core or vidx != 2:
            raise MatchFailure("attention", f"the value cache feeds {describe(vcore)}, not the attention op", describe(vcore))
        out = core
    else:
        q = _walk_back(core.args[1 - kidx], _SCALE | {aten.clone.default, aten.contiguous.default})
        vcore, _ = _walk_to_consumer(g, pvalue, "value cache", m.trace)
        if vcore.target not in _MATMUL:
            raise MatchFailure("attention", f"the value cache feeds {describe(vcore)}, expected a matmul", describe(vcore))
        out = vcore
    if q is None or not isinstance(q, fx.Node):
        raise MatchFailure("query", f"{describe(core)} has no query input", describe(core))
    qshape = _shape(q)
    if qshape is None or len(qshape) != 4 or _static_int(qshape[1]) is None or _static_int(qshape[3]) != m.head_dim:
        raise MatchFailure("query", f"query {q.name} is not [batch, heads, seq, {m.head_dim}] (shape {qshape})",
                           describe(q))
    m.core, m.q, m.num_heads = out, q, int(qshape[1])
    m.q_raw, m.rope = _rope_input(q)
    if _shape(m.q_raw) != qshape:
        raise MatchFailure("query", f"raw query {m.q_raw.name} has shape {_shape(m.q_raw)}, the rotated one {qshape}",
                           describe(m.q_raw))
    if m.num_heads % m.num_kv_heads:
        raise MatchFailure("query", f"{m.num_heads} query heads do not group over {m.num_kv_heads} kv heads", q.name)
    m.trace.append(f"query {q.name}, raw {m.q_raw.name}, rotary: {m.rope}")
    m.trace.append(f"heads {m.num_heads}, kv heads {m.num_kv_heads}, head dim {m.head_dim}")


# --- residual and MLP ------------------------------------------------------------------------------------


def _find_join(g: _Graph, m: TorchLayerMatch) -> fx.Node:
    v = m.core
    for _ in range(64):
        users = [u for u in v.users if u.op == "call_function" and u.target is not aten._assert_tensor_metadata.default]
        if len(users) != 1:
            raise MatchFailure("residual", f"attention output path forks at {v.name} ({len(users)} consumers)",
                               ", ".join(describe(u) for u in users) or "no consumer")
        node = users[0]
        if node.target in _ADD:
            other = node.args[1] if node.args[0] is v else node.args[0]
            if isinstance(other, fx.Node) and not g.is_static(other):
                m.trace.append(f"attention residual: {describe(node)}")
                return node
        v = node
    raise MatchFailure("residual", "no residual add after the attention output", describe(v))


def _aliases(node: fx.Node) -> list[fx.Node]:
    out = [node]
    for a in out:
        out.extend(u for u in a.users if u.op == "call_function" and u.target in _NOOP and u.args[0] is a)
    return out


def _find_mlp(g: _Graph, m: TorchLayerMatch) -> None:
    join = _find_join(g, m)
    m.join = join
    for alias in _aliases(join):
        for user in sorted(alias.users, key=g.order.get):
            if user.op != "call_function" or user.target not in _ADD:
                continue
            others = [a for a in user.args[:2] if isinstance(a, fx.Node) and a is not alias]
            if len(others) == 1 and g.depends_on(others[0], alias):
                m.entry, m.branch_out, m.closing = alias, others[0], user
                break
        if m.closing is not None:
            break
    if m.closing is None:
        raise MatchFailure("mlp", f"no add closes a branch that starts at {join.name}",
                           ", ".join(describe(u) for u in join.users))
    ancestors = _ancestors_until(m.branch_out, m.entry, g)
    branch = [n for n in ancestors if g.depends_on(n, m.entry) and n is not m.entry]
    branch.sort(key=g.order.get)
    inside = set(branch)
    for node in branch:
        for inp in node.all_input_nodes:
            if inp is m.entry or inp in inside or g.is_static(inp):
                continue
            if not isinstance(inp.meta.get("val"), torch.Tensor):  # a symbolic size: rebuilt from the entry's shape
                continue
            raise MatchFailure("mlp", f"MLP branch reads {inp.name} from outside the branch ({describe(inp)}); "
                               "cannot isolate it", describe(node))
        if node is m.branch_out:
            continue
        outside = [u for u in node.users if u not in inside and u.target is not aten._assert_tensor_metadata.default]
        if outside:
            raise MatchFailure("mlp", f"MLP value {node.name} is also used outside the branch",
                               ", ".join(describe(u) for u in outside))
    m.branch = branch
    for node in branch:
        if node.target in (aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default):
            w = node.args[2] if node.target is aten.addmm.default else node.args[1]
            if isinstance(w, fx.Node) and g.is_static(w) and _shape(w) is not None:
                m.weights.append(tuple(int(d) for d in _shape(w)))
    if not m.weights:
        raise MatchFailure("mlp", "branch has no matmul with a weight", describe(m.closing))
    eshape = _shape(m.entry)
    m.hidden = int(eshape[-1])
    m.trace.append(f"MLP branch: {len(branch)} nodes, weights {m.weights}, closed by {describe(m.closing)}")


def _ancestors_until(node: fx.Node, stop: fx.Node, g: _Graph) -> list[fx.Node]:
    lo = g.order[stop]
    out, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if n in seen or n is stop or g.order[n] < lo:
            continue
        seen.add(n)
        out.append(n)
        stack.extend(n.all_input_nodes)
    return out


def summary(m: TorchLayerMatch) -> str:
    """One line per layer, as `--inspect` prints it."""
    if m.failure is not None:
        where = f" (search stopped at {m.failure.where})" if m.failure.where else ""
        return f"missing anchor '{m.failure.anchor}': {m.failure.reason}{where}"
    return (f"heads {m.num_heads}/{m.num_kv_heads}x{m.head_dim}, rotary {m.rope}, "
            f"MLP {len(m.branch)} nodes {m.weights}")


__all__ = ["MatchFailure", "TorchLayerMatch", "describe", "discover", "kv_outputs", "summary"]
