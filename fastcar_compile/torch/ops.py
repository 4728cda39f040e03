"""The FastCar ops as torch ops (`fastcar::*`): opaque to torch.export / torch.compile, lowered to the
`ai.fastcar` ONNX functions of passes/fastcar_ops.py by `fastcar_compile.torch.onnx_export`.

Semantics are docs/DESIGN.md's (`TemporalGate`, `MLPCacheRead`, `MLPCacheUpdate`). Each op is defined once
(SCHEMAS) with three implementations:
- the ATen composite below (vectorised over rows and tokens), registered for CompositeExplicitAutograd: it
  serves every device without a kernel of its own, and is the reference the kernels are tested against;
- a C++ kernel for the CPU dispatch key (fastcar_torch_ops.cc, built and loaded by native.load()): one call
  instead of the ~10-15 small ATen ops of the composite, which dominated a batch-1 decode step;
- a fake (meta) impl, so torch.compile and torch.export trace the ops without running them.
A CUDA (e.g. Triton) kernel goes in with `torch.library.impl(f"fastcar::{name}", "CUDA")`; until then CUDA
tensors run the composite.
"""

from __future__ import annotations

import math
import weakref

import torch

NAMESPACE = "fastcar"
LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
SCHEMAS = {
    "temporal_gate": "(Tensor q, Tensor present_key, Tensor past_mlp_age, Tensor threshold, Tensor video_start, "
                     "int frame_tokens, int max_replay) -> (Tensor, Tensor, Tensor, Tensor)",
    # the gate of a multi-token decode step that decides per token, as single-token steps would (verify steps
    # of speculative decoding: fastcar_compile/torch/speculate.py)
    "temporal_gate_decode": "(Tensor q, Tensor present_key, Tensor past_mlp_age, Tensor threshold, "
                            "Tensor video_start, int frame_tokens, int max_replay) -> (Tensor, Tensor, Tensor, Tensor)",
    "mlp_cache_read": "(Tensor past_mlp_cache, Tensor slot) -> Tensor",
    "mlp_cache_update": "(Tensor past_mlp_cache, Tensor past_mlp_age, Tensor branch, Tensor replay, Tensor slot, "
                        "Tensor write) -> (Tensor, Tensor)",
    # the same update written into the state (the eager runtime's own state: optimize.inplace_state)
    "mlp_cache_update_": "(Tensor(a!) past_mlp_cache, Tensor(b!) past_mlp_age, Tensor branch, Tensor replay, "
                         "Tensor slot, Tensor write) -> ()",
}
for _name, _schema in SCHEMAS.items():
    LIB.define(_name + _schema)


def temporal_gate(
    q: torch.Tensor,
    present_key: torch.Tensor,
    past_mlp_age: torch.Tensor,
    threshold: torch.Tensor,
    video_start: torch.Tensor,
    frame_tokens: int,
    max_replay: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(replay [B,S] bool, tas [B,S] float32, slot [S] int64, write [S] bool) for q [B,H,S,D], K [B,Hkv,T,D]."""
    return _gate(q, present_key, past_mlp_age, threshold, video_start, frame_tokens, max_replay, False)


def temporal_gate_decode(q, present_key, past_mlp_age, threshold, video_start, frame_tokens: int, max_replay: int):
    """temporal_gate deciding every token of a decode step of 1 < S <= L tokens on a non-empty past: each token's
    slot is distinct and written before this step, and its key one frame back is in the past, so the decisions,
    cached rows and the state written are those of S single-token steps (a prefill still computes every MLP)."""
    return _gate(q, present_key, past_mlp_age, threshold, video_start, frame_tokens, max_replay, True)


def _gate(q, present_key, past_mlp_age, threshold, video_start, frame_tokens: int, max_replay: int, per_token: bool):
    B, H, S, D = q.shape
    Hkv, T = present_key.shape[1], present_key.shape[2]
    L = frame_tokens
    p = torch.arange(T - S, T, device=q.device)
    aligned = p - L
    k = present_key.index_select(2, aligned.clamp(min=0)).float()  # [B, Hkv, S, D]
    q_grp = q.float().reshape(B, Hkv, H // Hkv, S, D).sum(2)  # head h reads kv head h // g
    tas = (q_grp * k).sum(-1).sum(1) / (H * math.sqrt(D))
    vs = video_start.to(torch.int64)
    slot = torch.remainder(p - vs, L)
    write = (p >= vs) & (p >= T - L)
    age = past_mlp_age.index_select(1, slot)
    eligible = (age >= 0) & ((age < max_replay) if max_replay > 0 else torch.ones_like(age, dtype=torch.bool))
    decides = S == 1 or (per_token and present_key.shape[2] > S and S <= L)
    eligible = eligible & (aligned >= vs) & decides
    replay = eligible & (tas > threshold.float())
    return replay, tas, slot, write


def _temporal_gate_fake(q, present_key, past_mlp_age, threshold, video_start, frame_tokens, max_replay):
    B, S = q.shape[0], q.shape[2]
    return (q.new_empty((B, S), dtype=torch.bool), q.new_empty((B, S), dtype=torch.float32),
            q.new_empty((S,), dtype=torch.int64), q.new_empty((S,), dtype=torch.bool))


def mlp_cache_read(past_mlp_cache: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """cached [B,S,H]: the stored MLP branch output of each token's slot."""
    return past_mlp_cache.index_select(1, slot)


def _mlp_cache_read_fake(past_mlp_cache, slot):
    return past_mlp_cache.new_empty((past_mlp_cache.shape[0], slot.shape[0], past_mlp_cache.shape[2]))


def mlp_cache_update(
    past_mlp_cache: torch.Tensor,
    past_mlp_age: torch.Tensor,
    branch: torch.Tensor,
    replay: torch.Tensor,
    slot: torch.Tensor,
    write: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the value used this step in each written token's slot; age+1 if replayed, else 0."""
    widx = write.nonzero().squeeze(1)
    slots = slot.index_select(0, widx)
    cache = past_mlp_cache.index_copy(1, slots, branch.index_select(1, widx).to(past_mlp_cache.dtype))
    old = past_mlp_age.index_select(1, slots)
    new = torch.where(replay.index_select(1, widx), old + 1, torch.zeros_like(old))
    return cache, past_mlp_age.index_copy(1, slots, new)


def _mlp_cache_update_fake(past_mlp_cache, past_mlp_age, branch, replay, slot, write):
    return torch.empty_like(past_mlp_cache), torch.empty_like(past_mlp_age)


def mlp_cache_update_(past_mlp_cache: torch.Tensor, past_mlp_age: torch.Tensor, branch: torch.Tensor,
                      replay: torch.Tensor, slot: torch.Tensor, write: torch.Tensor) -> None:
    """mlp_cache_update written into past_mlp_cache / past_mlp_age."""
    cache, age = mlp_cache_update(past_mlp_cache, past_mlp_age, branch, replay, slot, write)
    past_mlp_cache.copy_(cache)
    past_mlp_age.copy_(age)


def _mlp_cache_update_inplace_fake(past_mlp_cache, past_mlp_age, branch, replay, slot, write):
    return None


COMPOSITES = {"temporal_gate": temporal_gate, "temporal_gate_decode": temporal_gate_decode, "mlp_cache_read": mlp_cache_read, "mlp_cache_update": mlp_cache_update,
              "mlp_cache_update_": mlp_cache_update_}
for _name, _fn in COMPOSITES.items():
    LIB.impl(_name, _fn, "CompositeExplicitAutograd")
for _name, _fake in (("temporal_gate", _temporal_gate_fake), ("temporal_gate_decode", _temporal_gate_fake), ("mlp_cache_read", _mlp_cache_read_fake),
                     ("mlp_cache_update", _mlp_cache_update_fake),
                     ("mlp_cache_update_", _mlp_cache_update_inplace_fake)):
    torch.library.register_fake(f"{NAMESPACE}::{_name}", _fake, lib=LIB)


# Branch modules by handle, for compact_branch (a custom op takes tensors and ints, not modules).
BRANCHES: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()


@torch.library.custom_op(f"{NAMESPACE}::compact_branch", mutates_args=())
def compact_branch(handle: int, x: torch.Tensor, replay: torch.Tensor, cached: torch.Tensor,
                   ext: list[torch.Tensor]) -> torch.Tensor:
    """The MLP branch `handle` on the rows that do not replay, the cached rows elsewhere. Opaque to
    torch.compile, so the data-dependent row count (nonzero) causes no graph break; runs eagerly."""
    return BRANCHES[handle].compacted(x, replay, cached, *ext)


@compact_branch.register_fake
def _compact_branch_fake(handle, x, replay, cached, ext):
    return x.new_empty(x.shape)  # contiguous, as compacted() returns
