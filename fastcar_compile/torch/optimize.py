"""Graph rewrites that make the captured program run as fast as the eager model it came from.

torch.export captures attention with an explicit mask, and transformers then expands the KV heads for grouped
query attention (repeat_kv: unsqueeze, expand, reshape) before scaled_dot_product_attention. With that
reshape the whole key and value caches are copied per layer and step; the eager model, which passes no mask at
batch 1, lets SDPA read the grouped heads (enable_gqa) and copies nothing. `sdpa_gqa` gives the captured program
the eager model's form. The program lowered to ONNX keeps the exported form (onnx_export), so the ONNX path
and its tests see what the exporter emits.
"""

from __future__ import annotations

import math
import types

import torch
from torch import fx

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_FULL = (0, None, 9223372036854775807)  # a slice that keeps everything
_MASK_META = "fastcar_additive_mask"  # node.meta key: the query dtype of a mask made by sdpa_float_mask


def copy_program(program: fx.GraphModule) -> fx.GraphModule:
    """A second GraphModule over the same weights and submodules with its own copy of the graph."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    copy = fx.GraphModule(program, graph, class_name=type(program).__name__)
    copy.train = types.MethodType(lambda self, mode=True: self, copy)  # as build() does for the program
    return copy


def _shape(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _skip_full_slices(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target is aten.slice.Tensor:
        start = node.args[2] if len(node.args) > 2 else 0
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        if start != 0 or end not in _FULL or step != 1:
            break
        node = node.args[0]
    return node


def repeated_kv(node: fx.Node) -> fx.Node | None:
    """x [B, Hkv, T, D] when `node` is repeat_kv(x) = reshape(expand(x[:, :, None], [B, Hkv, g, T, D]),
    [B, Hkv * g, T, D]) (full slices allowed in between), else None."""
    if node.op != "call_function" or node.target not in (aten.reshape.default, aten.view.default):
        return None
    expand = _skip_full_slices(node.args[0])
    if expand.op != "call_function" or expand.target is not aten.expand.default:
        return None
    unsq = _skip_full_slices(expand.args[0])
    if unsq.op != "call_function" or unsq.target is not aten.unsqueeze.default or unsq.args[1] != 2:
        return None
    base = _skip_full_slices(unsq.args[0])
    bs, es, rs = _shape(base), _shape(expand), _shape(node)
    if bs is None or es is None or rs is None or len(bs) != 4 or len(es) != 5 or len(rs) != 4:
        return None
    same = [str(a) == str(b) for a, b in ((bs[0], rs[0]), (bs[2], rs[2]), (bs[3], rs[3]), (bs[1], es[1]))]
    if not all(same) or str(rs[1]) != str(es[1] * es[2]):
        return None
    return base


def sdpa_gqa(gm: fx.GraphModule) -> int:
    """SDPA on repeat_kv'd key and value -> SDPA on the grouped heads with enable_gqa=True (same result, no
    copy of the caches). Returns the number of attention ops rewritten."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA or len(node.args) > 7:
            continue
        key, value = repeated_kv(node.args[1]), repeated_kv(node.args[2])
        if key is None or value is None or node.kwargs.get("enable_gqa"):
            continue
        node.args = (node.args[0], key, value, *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        done += 1
    if done:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return done


def sdpa_float_mask(gm: fx.GraphModule) -> int:
    """Boolean SDPA masks -> one additive float mask per step. SDPA turns a boolean mask into 0 / -inf
    (`where(mask, 0, -inf)`, three ops) on every call, i.e. in every layer; converted once where the mask is made,
    every layer reads the same values. Returns the number of attention ops rewritten."""
    done = 0
    converted: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        in_args = len(node.args) > 3
        mask = node.args[3] if in_args else node.kwargs.get("attn_mask")
        mval = mask.meta.get("val") if isinstance(mask, fx.Node) else None
        qval = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if not isinstance(mval, torch.Tensor) or mval.dtype != torch.bool or not isinstance(qval, torch.Tensor):
            continue
        key = (mask, qval.dtype)
        if key not in converted:
            with gm.graph.inserting_after(mask):
                zero = gm.graph.call_function(aten.scalar_tensor.default, (0.0,), {"dtype": qval.dtype})
            with gm.graph.inserting_after(zero):
                ninf = gm.graph.call_function(aten.scalar_tensor.default, (-math.inf,), {"dtype": qval.dtype})
            with gm.graph.inserting_after(ninf):
                converted[key] = gm.graph.call_function(aten.where.self, (mask, zero, ninf))
            converted[key].meta[_MASK_META] = qval.dtype  # (skip_full_masks finds it by this)
        if in_args:
            node.args = (*node.args[:3], converted[key], *node.args[4:])
        else:
            node.kwargs = {**node.kwargs, "attn_mask": converted[key]}
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def additive_mask_or_none(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """SDPA's additive form of a boolean mask, or None when it lets every query see every key (one query and
    no padding: a decode step at batch 1). SDPA with a mask is slower than without it (the transformers model
    passes none in that case), and an all-visible mask adds only zeros."""
    if bool(mask.all()):
        return None
    return torch.where(mask, torch.scalar_tensor(0.0, dtype=dtype), torch.scalar_tensor(-math.inf, dtype=dtype))


def skip_full_masks(gm: fx.GraphModule) -> int:
    """The masks of sdpa_float_mask -> `additive_mask_or_none`: a host check once per step, so attention runs
    unmasked whenever the mask hides nothing. Eager programs only (a data-dependent branch breaks a
    torch.compile graph). Returns the number of masks rewritten."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or _MASK_META not in node.meta:
            continue
        mask, zero, ninf = node.args
        with gm.graph.inserting_before(node):
            lazy = gm.graph.call_function(additive_mask_or_none, (mask, node.meta[_MASK_META]))
        node.replace_all_uses_with(lazy)
        gm.graph.erase_node(node)
        for const in (zero, ninf):
            if not const.users:
                gm.graph.erase_node(const)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _empty_constant(node: fx.Node, gm: fx.GraphModule) -> bool:
    """`node` is a constant tensor with no elements (through lift_fresh_copy / detach_ / detach)."""
    while node.op == "call_function" and node.target in (aten.lift_fresh_copy.default, aten.detach_.default,
                                                         aten.detach.default):
        node = node.args[0]
    if node.op != "get_attr":
        return False
    value = getattr(gm, node.target, None)
    return isinstance(value, torch.Tensor) and value.numel() == 0 and value.dim() == 1


def drop_empty_cats(gm: fx.GraphModule) -> int:
    """`cat([empty constant, past], d)` -> `past`. transformers' DynamicCache starts each layer from a 1-D empty
    tensor and concatenates the past onto it, so the captured program copied every layer's KV cache twice per
    step (that, then the new token's cat); the eager model, which keeps its cache, copies it once. cat skips
    1-D empty inputs, so the result is the same tensor values. Returns the number of cats removed."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.cat.default:
            continue
        empty = [p for p in node.args[0] if _empty_constant(p, gm)]
        parts = [p for p in node.args[0] if p not in empty]
        if len(parts) != 1 or not empty or str(_shape(parts[0])) != str(_shape(node)):
            continue
        node.replace_all_uses_with(parts[0])
        gm.graph.erase_node(node)
        done += 1
        for chain in empty:  # the constant's lift_fresh_copy / detach_ nodes (in-place, so not dead code)
            while chain.op == "call_function" and not chain.users:
                nxt = chain.args[0]
                gm.graph.erase_node(chain)
                chain = nxt
    if done:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return done


def drop_metadata_asserts(gm: fx.GraphModule) -> int:
    """Remove torch.export's `_assert_tensor_metadata` checks (dtype/device asserts on values the graph itself
    made): one dispatch each per step, dozens per decoder, nothing to check at run time."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten._assert_tensor_metadata.default]
    for node in nodes:
        gm.graph.erase_node(node)
    if nodes:
        gm.recompile()
    return len(nodes)


def inplace_state(program: fx.GraphModule) -> fx.GraphModule:
    """A copy of the FastCar program that writes the MLP cache update into its state inputs
    (`fastcar::mlp_cache_update_`) and returns them as the new state: no copy of every layer's cache per step;
    its branches run as `FastCarBranch.eager` (_eager_branches), its attention unmasked when the mask hides
    nothing (skip_full_masks).
    Only for a caller that owns the state it passes (FastCarDecoder's eager steps); the program itself stays
    functional for torch.compile, export and callers that keep their inputs."""
    gm = copy_program(program)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.fastcar.mlp_cache_update.default:
            continue
        cache, age = node.args[0], node.args[1]
        if any(order[u] > order[node] for v in (cache, age) for u in v.users if u is not node and u.op != "output"):
            continue  # the old state is read after the update: keep the copy
        with gm.graph.inserting_before(node):
            gm.graph.call_function(torch.ops.fastcar.mlp_cache_update_.default, node.args)
        for user in list(node.users):  # getitem 0 / 1: the state just written
            user.replace_all_uses_with(cache if user.args[1] == 0 else age)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
    _eager_branches(gm)
    skip_full_masks(gm)
    gm.graph.lint()
    gm.recompile()
    return gm


def _eager_branches(gm: fx.GraphModule) -> None:
    """Each `FastCarBranch(x, replay, mlp_cache_read(cache, slot), *w)` -> `FastCarBranch.eager(x, replay, cache,
    slot, *w)`: the eager step reads the cache only when a row replays (what a layer costs at 0% replay)."""
    from fastcar_compile.torch.rewrite import FastCarBranch

    read_op = torch.ops.fastcar.mlp_cache_read.default
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), FastCarBranch):
            continue
        x, replay, cached, *ext = node.args
        if cached.op != "call_function" or cached.target is not read_op or len(cached.users) != 1:
            continue
        with gm.graph.inserting_before(node):
            branch = gm.graph.get_attr(node.target)
            eager = gm.graph.call_method("eager", (branch, x, replay, *cached.args, *ext))
        node.replace_all_uses_with(eager)
        gm.graph.erase_node(node)
        gm.graph.erase_node(cached)
