"""Speculative decoding of a FastCar transformers model with transformers' assisted generation (docs/speculation.md).

`generate(model, input_ids, draft="temporal", draft_tokens=K, ...)` runs the model's own `generate()` on its
assisted-decoding path, with a candidate generator that proposes the previous frame's tokens (as transformers'
prompt-lookup decoding proposes earlier n-grams; the drafts are runtime/speculate.py's `propose`). transformers
verifies the K candidates in one K+1-token step, keeps the agreeing prefix plus one and crops the KV cache; the
FastCar state is the part transformers does not know:
- the verify step decides replay per token (fastcar::temporal_gate_decode in a copy of the program): with
  K + 1 <= L tokens on a non-empty past every token reads its slot as left by earlier steps and its key one frame
  back from the past, so decisions, cached rows and ages equal those of sequential single-token steps;
- after the verify, the slots written by rejected candidates are restored from a copy taken before the step (each
  slot is written at most once in a step of <= L tokens), so the state is that of decoding the kept tokens only.
Greedy output is then plain greedy `generate()`'s. Batch 1 (transformers' assisted decoding).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from torch import fx
from transformers.generation.candidate_generator import CandidateGenerator

from fastcar_compile.core import contract
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.runtime.speculate import DraftLength, parse_draft, propose
from fastcar_compile.torch.module import FastCarDecoder
from fastcar_compile.torch.optimize import copy_program


def decode_program(program: fx.GraphModule) -> fx.GraphModule:
    """A copy of the FastCar program whose gates decide every token of a multi-token decode step."""
    gm = copy_program(program)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.fastcar.temporal_gate.default:
            node.target = torch.ops.fastcar.temporal_gate_decode.default
    gm.recompile()
    return gm


class PreviousFrameCandidates(CandidateGenerator):
    """Candidates = the tokens one frame back (runtime/speculate.py's drafts), and the FastCar state of rejected
    candidates rolled back after transformers' verify step."""

    def __init__(self, decoder: FastCarDecoder, draft, draft_tokens: int | None, max_length: int):
        self.decoder = decoder
        self.spec = parse_draft(draft, draft_tokens)
        L = decoder.frame_tokens
        if self.spec.tokens is not None and self.spec.tokens > L - 1:
            raise FastCarError(f"draft tokens {self.spec.tokens}: a verify step of K + 1 tokens must fit one frame "
                               f"(K <= {L - 1} with frame_tokens {L})")
        self.length = DraftLength(self.spec.tokens)
        self.max_length = max_length
        self.first = True
        self.snapshot: tuple[list[torch.Tensor], int, int] | None = None  # (state, first candidate's position, K)
        self.proposed = self.accepted = self.verify_steps = 0

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, None]:
        cur = input_ids.shape[1]
        self.snapshot = None
        if self.first:  # the prompt's prefill runs alone, as plain generate() runs it (every MLP computed)
            self.first = False
            return input_ids, None
        fc = self.decoder
        L = fc.frame_tokens
        k = min(self.length.k, L - 1, self.max_length - cur - 1)
        vs = fc.video_start_now if fc.video_start_now is not None else fc.video_start
        if k < 1:
            return input_ids, None
        draft = propose(self.spec, [input_ids[0].cpu().numpy()], max(cur - vs, 0), L, k)
        if draft.shape[1] == 0:
            return input_ids, None
        # the verify step feeds the last token (position cur - 1) and the candidates (cur .. cur + k - 1)
        self.snapshot = ([t.clone() for t in fc.state], cur, draft.shape[1])
        return torch.cat([input_ids, torch.as_tensor(draft, device=input_ids.device)], 1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        if self.snapshot is None:
            return
        old, first, k = self.snapshot
        n = int(num_matches)
        self.verify_steps += 1
        self.proposed += k
        self.accepted += n
        self.length.update(k, n)
        fc = self.decoder
        vs = fc.video_start_now if fc.video_start_now is not None else fc.video_start
        rejected = np.arange(first + n, first + k)
        rejected = rejected[rejected >= vs]
        if rejected.size:
            slots = torch.as_tensor((rejected - vs) % fc.frame_tokens)
            for now, before in zip(fc.state, old, strict=True):
                now.index_copy_(1, slots.to(now.device), before.index_select(1, slots.to(before.device)))
        self.snapshot = None


@contextlib.contextmanager
def _drafting(model, generator: PreviousFrameCandidates) -> Iterator[None]:
    fc: FastCarDecoder = model.fastcar
    fc.candidates, fc.decode_program = generator, decode_program
    try:
        yield
    finally:
        fc.candidates = fc.decode_program = None


def generate(model, input_ids: torch.Tensor, *, draft: str = contract.DRAFT_TEMPORAL, draft_tokens: int | None = None,
             **generate_kwargs):
    """`model.generate(input_ids, **generate_kwargs)` with previous-frame drafts verified by transformers' assisted
    decoding (greedy: the same tokens as plain `generate`). `model` is what fastcar_compile.torch.apply returned;
    draft "temporal", "ngram" or "temporal+ngram" (runtime/speculate.py's drafts), K = draft_tokens (<= L - 1;
    None: adaptive). The candidate generator (with `proposed`, `accepted`, `verify_steps`) is left in
    `model.fastcar.last_candidates`."""
    fc = getattr(model, "fastcar", None)
    if not isinstance(fc, FastCarDecoder):
        raise FastCarError("speculative generate needs the model fastcar_compile.torch.apply returned")
    if input_ids.shape[0] != 1:
        raise FastCarError(f"transformers' assisted decoding takes batch 1, got {input_ids.shape[0]} rows")
    max_length = generate_kwargs.get("max_length") or input_ids.shape[1] + generate_kwargs.get("max_new_tokens", 20)
    gen = PreviousFrameCandidates(fc, draft, draft_tokens, max_length)
    with _drafting(model, gen):
        # prompt_lookup_num_tokens selects transformers' assisted path; the mixin hands it this generator
        out = model.generate(input_ids, prompt_lookup_num_tokens=max(gen.length.k, 1), **generate_kwargs)
    fc.last_candidates = gen
    return out
