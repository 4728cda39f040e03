"""Insert FastCar into a captured ATen graph (per matched layer; semantics in docs/DESIGN.md):

    replay, tas, slot, write = fastcar::temporal_gate(q, present_key, past_mlp_age, tau, video_start)
    cached = fastcar::mlp_cache_read(past_mlp_cache, slot)
    used = FastCarBranch(entry, replay, cached)        # the MLP branch, moved into its own GraphModule
    present_mlp_cache, present_mlp_age = fastcar::mlp_cache_update(..., used, replay, slot, write)

The branch runs on the computed rows only (index_select / index_copy over the flattened (row, token) axis)
and not at all when every row replays. Under torch.compile the same three cases are nested `torch.cond`s:
no row replays -> the compiled MLP; some -> `fastcar::compact_branch` (an opaque custom op running the
compacted branch eagerly, so the data-dependent row count breaks no graph); all -> the cache. Under
torch.export (whose graph cannot call back into these modules): skip when all replay, else compute and select.
Lowering to ONNX (`dense_branches`) traces the branch as the plain MLP; onnx_export then replaces it with
the ONNX path's own all/compacted/none `If` (passes/branch.py), so one builder makes that branch.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import Iterator

import torch
from torch import fx, nn

from fastcar_compile.torch import ops  # registers torch.ops.fastcar
from fastcar_compile.torch.discover import TorchLayerMatch

aten = torch.ops.aten
_DENSE = False
_HANDLES = itertools.count()


@contextlib.contextmanager
def dense_branches() -> Iterator[None]:
    """Trace every FastCarBranch as its bare MLP (the output feeds the residual Add and the cache update as
    is). Only for onnx_export, which rebuilds each branch with passes/branch.py right after tracing."""
    global _DENSE
    old, _DENSE = _DENSE, True
    try:
        yield
    finally:
        _DENSE = old


class FastCarBranch(nn.Module):
    """The MLP branch of one layer with real skipping. `branch(x, *weights)` is the original computation."""

    def __init__(self, branch: fx.GraphModule):
        super().__init__()
        self.branch = branch
        self.handle = next(_HANDLES)
        ops.BRANCHES[self.handle] = self

    def forward(self, x: torch.Tensor, replay: torch.Tensor, cached: torch.Tensor, *ext: torch.Tensor) -> torch.Tensor:
        if _DENSE:
            return self.branch(x, *ext)
        if torch.compiler.is_exporting():  # an export's graph cannot call back into this process's modules
            branch = self.branch

            def all_replay(x, replay, cached, *ext):
                return cached.to(x.dtype).clone()

            def select(x, replay, cached, *ext):
                return torch.where(replay.unsqueeze(-1), cached.to(x.dtype), branch(x, *ext))

            return torch.cond(replay.all(), all_replay, select, (x, replay, cached, *ext))
        if torch.compiler.is_compiling():
            return torch.cond(replay.any(), self._some_replay, self._no_replay, (x, replay, cached, *ext))
        if not replay.any():
            return self.branch(x, *ext)
        if replay.all():
            return cached.to(x.dtype)
        return self.compacted(x, replay, cached, *ext)

    # torch.cond merges its branches' strides; different expressions (x's static hidden size vs the cache
    # input's symbolic one) become unbacked symbols inductor cannot allocate: every branch returns a
    # contiguous tensor of x's shape.
    def _no_replay(self, x, replay, cached, *ext):
        return self.branch(x, *ext).contiguous()

    def _some_replay(self, x, replay, cached, *ext):
        """torch.compile: the compacted rows through the opaque fastcar::compact_branch, nothing when all replay."""
        handle = self.handle

        def some(x, replay, cached, *ext):
            return torch.ops.fastcar.compact_branch(handle, x, replay, cached, list(ext))

        def none(x, replay, cached, *ext):
            return cached.to(x.dtype).reshape(x.shape).clone(memory_format=torch.contiguous_format)

        return torch.cond(replay.all(), none, some, (x, replay, cached, *ext))

    def eager(self, x: torch.Tensor, replay: torch.Tensor, past_mlp_cache: torch.Tensor, slot: torch.Tensor,
              *ext: torch.Tensor) -> torch.Tensor:
        """forward as the eager step runs it (optimize.inplace_state): the cache is read only when a row replays,
        and the branch's generated code is called without two module calls' hooks around it. At 0% replay a
        layer then adds a gate, one host check and a cache write to the dense layer, nothing more."""
        if not (replay.item() if replay.numel() == 1 else replay.any()):  # (one host read at batch 1)
            return self.branch.forward(x, *ext)
        cached = torch.ops.fastcar.mlp_cache_read.default(past_mlp_cache, slot)
        if replay.numel() == 1 or replay.all():
            return cached.to(x.dtype)
        return self.compacted(x, replay, cached, *ext)

    def compacted(self, x: torch.Tensor, replay: torch.Tensor, cached: torch.Tensor, *ext: torch.Tensor) -> torch.Tensor:
        """The branch on the rows that compute (index_select over the flattened (row, token) axis), scattered
        into the cached rows (index_copy)."""
        hidden = x.shape[-1]
        idx = (~replay).reshape(-1).nonzero().squeeze(1)
        rows = x.reshape(-1, hidden).index_select(0, idx).unsqueeze(0)  # [1, kept, hidden]
        fresh = self.branch(rows, *ext).reshape(-1, hidden)
        return cached.to(x.dtype).reshape(-1, hidden).index_copy(0, idx, fresh).reshape(x.shape)


def extract_branch(m: TorchLayerMatch) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The branch as a GraphModule `(x, *weights) -> out`; symbolic sizes read from outside are rebuilt from
    x's shape (they are the batch/sequence sizes, which change when rows are compacted)."""
    g = fx.Graph()
    x = g.placeholder("x")
    env: dict[fx.Node, fx.Node] = {m.entry: x}
    ext: list[fx.Node] = []
    eshape = list(m.entry.meta["val"].shape)

    def arg(node: fx.Node) -> fx.Node:
        if node in env:
            return env[node]
        if node.op == "get_attr" or isinstance(node.meta.get("val"), torch.Tensor):  # weights, outer tensors
            env[node] = g.placeholder(f"ext{len(ext)}")
            ext.append(node)
        else:  # a SymInt: the same expression over x's sizes
            env[node] = _size_expr(g, x, node.meta.get("val"), eshape, node)
        return env[node]

    for node in m.branch:
        env[node] = g.node_copy(node, arg)
    g.output(env[m.branch_out])
    return fx.GraphModule(nn.Module(), g, class_name="FastCarMLPBranch"), ext


def _size_expr(g: fx.Graph, x: fx.Node, sym, eshape: list, node: fx.Node) -> fx.Node:
    dims = [str(d) for d in eshape[:-1]]
    if str(sym) in dims:
        return g.call_function(aten.sym_size.int, (x, dims.index(str(sym))))
    if len(dims) == 2 and str(sym) in (f"{dims[0]}*{dims[1]}", f"{dims[1]}*{dims[0]}"):
        a = g.call_function(aten.sym_size.int, (x, 0))
        b = g.call_function(aten.sym_size.int, (x, 1))
        return g.call_function(operator.mul, (a, b))
    raise ValueError(f"MLP branch reads size {sym} ({node.name}), not a size of its input {eshape}")


def rewrite(gm: fx.GraphModule, matches: list[TorchLayerMatch], *, frame_tokens: int, tas_query: str,
            max_replay: int, per_layer_threshold: bool) -> list[int]:
    """Rewrite `gm` in place. New inputs after the existing ones: video_start, threshold, then per layer
    past_mlp_cache, past_mlp_age; new outputs after the existing ones: per layer present_mlp_cache,
    present_mlp_age, then per layer replay, tas. Returns the rewritten layers."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_after(placeholders[-1]):
        video_start = graph.placeholder("video_start")
    with graph.inserting_after(video_start):
        threshold = graph.placeholder("fastcar_threshold")
    last = threshold
    state_in = []
    for m in matches:
        with graph.inserting_after(last):
            cache = graph.placeholder(f"past_mlp_cache_{m.layer}")
        with graph.inserting_after(cache):
            age = graph.placeholder(f"past_mlp_age_{m.layer}")
        last = age
        state_in.append((cache, age))
    state_out, diag = [], []
    for k, (m, (cache, age)) in enumerate(zip(matches, state_in, strict=True)):
        branch_gm, ext = extract_branch(m)
        name = f"fastcar_mlp_{m.layer}"
        gm.add_submodule(name, FastCarBranch(branch_gm))
        with graph.inserting_before(m.closing):
            tau = graph.call_function(aten.select.int, (threshold, 0, k)) if per_layer_threshold else threshold
            gate = graph.call_function(torch.ops.fastcar.temporal_gate.default,
                                       (m.q if tas_query == "rope" else m.q_raw, m.present_key, age, tau, video_start, frame_tokens, max_replay))
            replay, tas, slot, write = (graph.call_function(operator.getitem, (gate, i)) for i in range(4))
            cached = graph.call_function(torch.ops.fastcar.mlp_cache_read.default, (cache, slot))
            used = graph.call_module(name, (m.entry, replay, cached, *ext))
            upd = graph.call_function(torch.ops.fastcar.mlp_cache_update.default,
                                      (cache, age, used, replay, slot, write))
            new_cache, new_age = (graph.call_function(operator.getitem, (upd, i)) for i in range(2))
        m.closing.replace_input_with(m.branch_out, used)
        for node in reversed(m.branch):
            for user in list(node.users):
                if user.target is aten._assert_tensor_metadata.default:
                    graph.erase_node(user)
            graph.erase_node(node)
        state_out += [new_cache, new_age]
        diag += [replay, tas]
    outs = output.args[0]
    output.args = (tuple(outs) + tuple(state_out) + tuple(diag),)
    graph.lint()
    gm.recompile()
    return [m.layer for m in matches]
