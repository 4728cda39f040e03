"""Runtime modules around the rewritten program: the replay cache as explicit state, reset by a new video.

`FastCarDecoder` keeps the flat contract `(input_ids, attention_mask, position_ids, *past_kv) -> (logits,
*present_kv)`; `FastCarCausalLM` is a transformers model whose forward runs the program, so `generate()`
works unchanged. A call with an empty KV cache (past length 0) starts a new video: caches 0, ages -1.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from fastcar_compile.core.errors import FastCarError


@dataclass
class FastCarStats:
    """Replay counts since the last reset (decode steps x rows x rewritten layers)."""

    replayed: int = 0
    decisions: int = 0
    per_layer: dict[int, list[int]] = field(default_factory=dict)  # layer -> [replayed, decisions]

    @property
    def ratio(self) -> float:
        return self.replayed / self.decisions if self.decisions else 0.0


def check_video_start(video_start) -> int:
    """`video_start` is a KV index (an int >= 0), the position of the video's first frame token."""
    if isinstance(video_start, torch.Tensor) and video_start.numel() == 1:
        video_start = video_start.item()
    if isinstance(video_start, bool) or not isinstance(video_start, int) or video_start < 0:
        raise FastCarError(f"video_start must be an integer >= 0 (the KV position of the video's first frame "
                           f"token), got {video_start!r}")
    return video_start


def start_from_frames(prompt_frames, prompt_len: int, frame_tokens: int, video_start=None) -> int:
    """video_start of a prompt that ends with `prompt_frames` whole frames of the video: prompt_len - frames * L.
    A `video_start` given as well must agree (the usual mistake is the prompt length, which leaves frame 0 of
    the prompt out of the replay cache so the first generated frame cannot replay)."""
    if isinstance(prompt_frames, bool) or not isinstance(prompt_frames, int) or prompt_frames < 0:
        raise FastCarError(f"prompt_frames must be an integer >= 0 (whole video frames at the end of the prompt), "
                           f"got {prompt_frames!r}")
    start = prompt_len - prompt_frames * frame_tokens
    if start < 0:
        raise FastCarError(f"prompt_frames={prompt_frames} needs {prompt_frames * frame_tokens} tokens "
                           f"({frame_tokens} per frame) but the prompt has {prompt_len}")
    if video_start is not None and check_video_start(video_start) != start:
        raise FastCarError(f"video_start={video_start} disagrees with prompt_frames={prompt_frames}: a "
                           f"{prompt_len}-token prompt ending with {prompt_frames} frame(s) of {frame_tokens} "
                           f"tokens starts its video at {start}; pass one of the two")
    return start


class FastCarDecoder(nn.Module):
    """The rewritten program with its FastCar state. `last_replay` / `last_tas`: {layer: [B, S]} of the last call.

    `video_start` is the KV position of the video's first frame token. When the prompt holds frames of the video
    (frame 0 given, the next generated), that is the prompt length minus those frames' tokens, not the prompt
    length: pass `prompt_frames=` (frames at the end of the prompt) on a new video's call to have it computed."""

    def __init__(self, program: fx.GraphModule, *, layers: list[int], num_kv: int, frame_tokens: int,
                 hidden: int, threshold, per_layer_threshold: bool, kv_shape: tuple[int, int], dtype: torch.dtype,
                 report=None):
        super().__init__()
        self.program = program
        self.layers = list(layers)
        self.num_kv = num_kv
        self.frame_tokens = frame_tokens
        self.hidden = hidden
        self.per_layer_threshold = per_layer_threshold
        self.kv_shape = kv_shape  # (kv heads, head dim): an empty cache for a new video
        self.dtype = dtype
        self.report = report
        self.video_start = 0  # default for calls that give neither video_start nor prompt_frames
        self.video_start_now: int | None = None  # this video's, from prompt_frames on its first call
        self.threshold = threshold
        self.state: list[torch.Tensor] = []
        self.stats = FastCarStats()
        self.last_replay: dict[int, torch.Tensor] = {}
        self.last_tas: dict[int, torch.Tensor] = {}
        self.capture_embeds: Callable[[], FastCarDecoder] | None = None  # set by apply for transformers LMs
        self.embeds_program: fx.GraphModule | None = None
        self.lowering_program: fx.GraphModule | None = None  # the program in its exported form (to_onnx); set by build
        # compile_with(ctx) runs the programs compiled by a torch.compile context (see FastCarCausalLMMixin)
        self._compile_ctx: Callable | None = None
        self._compiled: dict[tuple[int, int], tuple[Callable, nn.Module]] = {}
        self._inplace: dict[int, tuple[fx.GraphModule, fx.GraphModule]] = {}  # program -> its in-place form
        # speculative decoding (fastcar_compile/torch/speculate.py): transformers' candidate generator, and the
        # program transform whose gates decide every token of a multi-token decode (verify) step
        self.candidates = None
        self.decode_program: Callable[[fx.GraphModule], fx.GraphModule] | None = None
        self.last_candidates = None
        self._decode: dict[int, tuple[fx.GraphModule, fx.GraphModule]] = {}
        self._scalars: tuple = (None, None)  # (key, (video_start, threshold) tensors): _step_scalars

    @contextlib.contextmanager
    def compile_with(self, ctx: Callable) -> Iterator[None]:
        """Run the programs compiled by `ctx` (a torch.compile context, e.g. the `dynamo_ctx` of the module that
        `torch.compile(model)` returned) while in this block: the decode step is one graph, so compiling it
        compiles everything FastCar adds. Compiled once per (context, program)."""
        old, self._compile_ctx = self._compile_ctx, ctx
        try:
            yield
        finally:
            self._compile_ctx = old

    def _runnable(self, program: fx.GraphModule, prefill: bool = False) -> nn.Module:
        """What runs `program` this step: eagerly, its form that updates this decoder's own state in place; under
        a torch.compile context the compiled decode step (a prefill runs eagerly: compiling a graph that runs
        once per video costs more than it saves)."""
        if self._compile_ctx is None or prefill:
            if not isinstance(program, fx.GraphModule):
                return program  # e.g. a compiled program put in its place
            entry = self._inplace.get(id(program))
            if entry is None or entry[0] is not program:
                from fastcar_compile.torch.optimize import inplace_state

                entry = self._inplace[id(program)] = (program, inplace_state(program))
            return entry[1]
        key = (id(self._compile_ctx), id(program))
        if key not in self._compiled or self._compiled[key][0] is not self._compile_ctx:  # (ids may be reused)
            self._compiled[key] = (self._compile_ctx, self._compile_ctx(program))
        return self._compiled[key][1]

    def program_for(self, first: torch.Tensor) -> fx.GraphModule:
        """The program for token ids, or (floating first input) the inputs_embeds one, captured on first use."""
        if not first.is_floating_point():
            return self.program
        if self.embeds_program is None:
            if self.capture_embeds is None:
                raise FastCarError("this FastCar model takes input_ids only (inputs_embeds needs a transformers "
                                   "causal LM passed to fastcar_compile.torch.apply)")
            other = self.capture_embeds()
            if other.layers != self.layers:
                raise FastCarError(f"the inputs_embeds program rewrites layers {other.layers}, the input_ids one "
                                   f"{self.layers}; pass layers= to apply")
            self.embeds_program = other.program
        return self.embeds_program

    def reset(self, batch: int, device=None) -> None:
        """Start a new video for `batch` rows: MLP caches zero, ages -1 (never written)."""
        self.state = []
        for _ in self.layers:
            self.state.append(torch.zeros(batch, self.frame_tokens, self.hidden, dtype=self.dtype, device=device))
            self.state.append(torch.full((batch, self.frame_tokens), -1, dtype=torch.int64, device=device))
        self.stats = FastCarStats()

    def threshold_tensor(self, threshold=None) -> torch.Tensor:
        tau = self.threshold if threshold is None else threshold
        try:
            t = torch.as_tensor(tau, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            raise FastCarError(f"fastcar_threshold must be a number or one per rewritten layer, got {tau!r}") from None
        if torch.isnan(t).any():
            raise FastCarError("fastcar_threshold is NaN; give a number (TAS > threshold replays; +inf never replays)")
        if self.per_layer_threshold:
            t = t.reshape(-1)
            if t.numel() == 1:
                t = t.expand(len(self.layers)).contiguous()
            if t.numel() != len(self.layers):
                raise FastCarError(f"threshold gives {t.numel()} values for {len(self.layers)} rewritten layers")
        elif t.numel() != 1:
            raise FastCarError("several thresholds need per_layer_threshold=True")
        return t.reshape(-1) if self.per_layer_threshold else t.reshape(())

    def _step_scalars(self, start: int, threshold) -> tuple[torch.Tensor, torch.Tensor]:
        """(video_start, threshold) tensors of a step, made once while they stay the same (a few small ops
        per decode step otherwise)."""
        tau = self.threshold if threshold is None else threshold
        values = tuple(tau) if isinstance(tau, (list, tuple)) else (tau,)
        plain = all(type(v) in (int, float) for v in values)  # anything else (tensors, arrays) is made anew
        key = (start, self.per_layer_threshold, isinstance(tau, (list, tuple)), values) if plain else None
        if key is None or self._scalars[0] != key:
            self._scalars = (key, (torch.tensor(start, dtype=torch.int64), self.threshold_tensor(threshold)))
        return self._scalars[1]

    def resolve_video_start(self, video_start, prompt_frames, total: int, new_video: bool) -> int:
        """This call's video_start: given, or from prompt_frames on a new video's first call (kept for its
        later calls), or the default."""
        if prompt_frames is not None:
            if new_video or self.video_start_now is None:
                self.video_start_now = start_from_frames(prompt_frames, total, self.frame_tokens, video_start)
            return self.video_start_now
        return self.video_start if video_start is None else check_video_start(video_start)

    def forward(self, input_ids, attention_mask, position_ids, *past, video_start=None, threshold=None,
                prompt_frames=None):
        """One step; `input_ids` may be inputs_embeds [B, S, hidden] (floating point) instead of ids."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() not in (2, 3) or (
                input_ids.dim() == 2 and input_ids.dtype.is_floating_point) or (
                input_ids.dim() == 3 and not input_ids.dtype.is_floating_point):
            got = f"{input_ids.dtype} [{', '.join(map(str, input_ids.shape))}]" if isinstance(
                input_ids, torch.Tensor) else type(input_ids).__name__
            raise FastCarError(f"input_ids must be integer token ids [batch, seq] (or inputs_embeds, floating point "
                               f"[batch, seq, hidden]), got {got}")
        new_video = past[0].shape[2] == 0
        if new_video or not self.state or self.state[0].shape[0] != input_ids.shape[0]:
            self.reset(input_ids.shape[0], input_ids.device)
        start = self.resolve_video_start(video_start, prompt_frames, attention_mask.shape[1], new_video)
        vs, tau = self._step_scalars(start, threshold)
        program = self.program_for(input_ids)
        if self.decode_program is not None and input_ids.shape[1] > 1 and not new_video:
            entry = self._decode.get(id(program))
            if entry is None or entry[0] is not program:
                entry = self._decode[id(program)] = (program, self.decode_program(program))
            program = entry[1]
        program = self._runnable(program, prefill=new_video)
        if self._compile_ctx is not None and not new_video:  # one decode graph for every KV length
            for t in (attention_mask, *past):
                torch._dynamo.maybe_mark_dynamic(t, t.dim() - 1 if t is attention_mask else 2)
        outs = program(input_ids, attention_mask, position_ids, *past, vs, tau, *self.state)
        n = 1 + self.num_kv
        k = 2 * len(self.layers)
        self.state = list(outs[n:n + k])
        diag = outs[n + k:]
        self.last_replay = {layer: diag[2 * i] for i, layer in enumerate(self.layers)}
        self.last_tas = {layer: diag[2 * i + 1] for i, layer in enumerate(self.layers)}
        if input_ids.shape[1] == 1 and self.layers:
            # one count for all layers (a host read per layer was a measurable part of a 0%-replay step)
            counts = torch.stack([diag[2 * i] for i in range(len(self.layers))]).flatten(1).sum(1).tolist()
            for layer, r in zip(self.layers, counts, strict=True):
                d = self.last_replay[layer].numel()
                self.stats.replayed += r
                self.stats.decisions += d
                acc = self.stats.per_layer.setdefault(layer, [0, 0])
                acc[0] += r
                acc[1] += d
        return tuple(outs[:n])

    def empty_past(self, batch: int, device=None) -> list[torch.Tensor]:
        hkv, d = self.kv_shape
        return [torch.zeros(batch, hkv, 0, d, dtype=self.dtype, device=device) for _ in range(self.num_kv)]


def position_ids_from_mask(mask: torch.Tensor, seq: int) -> torch.Tensor:
    """transformers' convention: cumsum - 1 over the mask, pads at 1; the last `seq` positions."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 1)[:, -seq:]


class _CompiledGenerate:
    """`generate` of a FastCar causal LM. Looked up through the module that `torch.compile(model)` returns (whose
    attribute lookup forwards to the model, so transformers' generate() would otherwise run the model's eager
    forward and compile nothing), it runs with the FastCar program compiled by that module's torch.compile
    context: `torch.compile(model, ...).generate(...)` compiles the decode step with those options."""

    def __get__(self, instance, owner):
        if instance is None:
            return self
        plain = super(FastCarCausalLMMixin, instance).generate
        caller = sys._getframe(1)  # OptimizedModule.__getattr__ when reached through torch.compile(model)
        wrapper = caller.f_locals.get("self") if caller.f_code is _optimized_getattr() else None
        if wrapper is None or wrapper._orig_mod is not instance:
            return plain

        @functools.wraps(plain)
        def generate(*args, **kwargs):
            with instance.fastcar.compile_with(wrapper.dynamo_ctx):
                return plain(*args, **kwargs)

        return generate


@functools.cache
def _optimized_getattr():
    from torch._dynamo.eval_frame import OptimizedModule

    return OptimizedModule.__getattr__.__code__


class FastCarCausalLMMixin:
    """Put in front of a transformers causal LM class: forward runs the FastCar program, generate() unchanged
    (through `torch.compile(model)`, with the FastCar program compiled: _CompiledGenerate)."""

    fastcar: FastCarDecoder
    generate = _CompiledGenerate()

    def _get_candidate_generator(self, *args, **kwargs):
        """transformers' assisted decoding asks here for its candidates: the previous-frame generator while
        fastcar_compile.torch.speculate.generate runs, else transformers' own."""
        mine = self.fastcar.candidates
        return mine if mine is not None else super()._get_candidate_generator(*args, **kwargs)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=True, video_start=None, fastcar_threshold=None, return_dict=True, inputs_embeds=None,
                prompt_frames=None, **kwargs):
        from transformers import DynamicCache
        from transformers.modeling_outputs import CausalLMOutputWithPast

        fc = self.fastcar
        if inputs_embeds is not None and input_ids is not None and input_ids.shape[-1] > 0:
            raise FastCarError("pass input_ids or inputs_embeds, not both")
        if inputs_embeds is not None:
            input_ids = inputs_embeds  # the program for embeddings is chosen by the dtype (FastCarDecoder)
        if input_ids is None:
            raise FastCarError("the FastCar model needs input_ids or inputs_embeds")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() < 2:
            shape = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise FastCarError(f"input_ids must be a tensor [batch, seq] (inputs_embeds [batch, seq, hidden]), got "
                               f"{shape}")
        batch, seq = input_ids.shape[:2]
        cache = past_key_values if past_key_values is not None else DynamicCache(config=self.config)
        past_len = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
        if attention_mask is None:
            attention_mask = torch.ones(batch, past_len + seq, dtype=torch.int64, device=input_ids.device)
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask, seq)
        if past_len == 0:
            past = fc.empty_past(batch, input_ids.device)
        else:
            past = []
            for layer in cache.layers[: fc.num_kv // 2]:
                past += [layer.keys, layer.values]
        outs = fc(input_ids, attention_mask.to(torch.int64), position_ids, *past, video_start=video_start,
                  threshold=fastcar_threshold, prompt_frames=prompt_frames)
        logits, present = outs[0], outs[1:]
        store_present(cache, present, past_len)
        out = CausalLMOutputWithPast(logits=logits, past_key_values=cache)
        return out if return_dict else out.to_tuple()


def store_present(cache, present, past_len: int) -> None:
    """Put the program's present KV (past and new tokens, one fresh tensor per layer) into transformers' cache.
    A DynamicLayer (generate()'s default) takes the tensors as they are: its update() would concatenate the new
    tokens onto the past again, a second copy of every layer's cache per step that the eager model does not
    make. Any other layer type is updated with the new tokens through its own update()."""
    from transformers.cache_utils import DynamicLayer

    for i in range(len(present) // 2):
        key, value = present[2 * i], present[2 * i + 1]
        layer = cache.layers[i] if i < len(getattr(cache, "layers", ())) else None
        if type(layer) is DynamicLayer:
            if not layer.is_initialized:
                layer.lazy_initialization(key, value)
            layer.keys, layer.values = key, value
        else:
            cache.update(key[:, :, past_len:], value[:, :, past_len:], i)


def wrap_causal_lm(model: nn.Module, decoder: FastCarDecoder) -> nn.Module:
    """A new object of a subclass of type(model) sharing its submodules and weights, with FastCar's forward.
    The input model is left as it was."""
    cls = type(f"FastCar{type(model).__name__}", (FastCarCausalLMMixin, type(model)), {})
    new = cls.__new__(cls)
    new.__dict__.update(model.__dict__)
    for key in ("_modules", "_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks"):
        if key in model.__dict__:
            new.__dict__[key] = type(model.__dict__[key])(model.__dict__[key])
    new._modules["fastcar"] = decoder
    return new
