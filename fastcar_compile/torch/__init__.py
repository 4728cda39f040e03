"""FastCar inside PyTorch: `model = fastcar_compile.torch.apply(model, frame_tokens=256, threshold=-4)`.

The decoder is captured with torch.export (non-strict, ATen level); the attention -> MLP blocks are found
from the graph's dataflow (fastcar_compile.torch.discover, the anchors of the ONNX pass), FastCar is
inserted into that graph (fastcar_compile.torch.rewrite) and the rewritten program runs in place of the
model's forward. A transformers causal LM comes back as a model of the same class whose `generate()` just
works; `to_onnx` lowers the same program to a fast.onnx with the ONNX path's contract.

A chunk-causal video DiT (fastcar_compile.dit.model) takes `apply_dit(model, tempcache=0.9,
threshold=...)` instead (fastcar_compile.torch.dit): its modes change what the cache holds.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn

from fastcar_compile.core import limits
from fastcar_compile.core import options as declared
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.passes.analysis import parse_layers
from fastcar_compile.passes.compile_report import CompileReport, LayerReport
from fastcar_compile.torch import capture, discover, native, optimize
from fastcar_compile.torch.module import (
    FastCarCausalLMMixin,
    FastCarDecoder,
    FastCarStats,
    check_video_start,
    wrap_causal_lm,
)
from fastcar_compile.torch.rewrite import rewrite


def _check_options(opts: dict) -> dict:
    """The options `apply` takes (declared in fastcar_compile/core/options.py with torch=True): every one set, checked
    as the compiler checks it, named as the keyword."""
    declared.unknown(opts, "apply", declared.TORCH_OPTIONS)
    if "frame_tokens" not in opts:
        raise TypeError("apply() missing required keyword argument: 'frame_tokens'")
    full = {o.name: o.default for o in declared.TORCH_OPTIONS if o.default is not declared.REQUIRED} | opts
    return declared.check_all(full, spell=lambda o: o.name)


def build(model: nn.Module, *, example_inputs: tuple[torch.Tensor, ...] | None = None, embeds: bool = False,
          **options) -> FastCarDecoder:
    """Capture, discover and rewrite: the flat-contract FastCar program (what `apply` runs and `to_onnx` lowers).
    With `embeds` the program's first input is inputs_embeds [B, S, hidden] instead of input_ids. The options
    are `apply`'s."""
    opts = _check_options(options)
    frame_tokens, tas_query, max_replay = opts["frame_tokens"], opts["tas_query"], opts["max_replay"]
    layers, per_layer_threshold, taus = opts["layers"], opts["per_layer_threshold"], list(opts["threshold"])
    native.load()  # the ops' CPU kernels (built once; without a compiler the ATen composite runs)
    front, _ = capture.flat_front(model, embeds)
    if example_inputs is None:
        if not capture.is_transformers_lm(model):
            raise FastCarError(f"{type(model).__name__} is not a transformers causal LM; pass example_inputs="
                               "(input_ids, attention_mask, position_ids, *past_kv)")
        example_inputs = capture.example_inputs(model, embeds=embeds)
    ep = capture.capture(front, tuple(example_inputs))
    program = ep.module(check_guards=False)
    program._forward_pre_hooks.clear()  # input-constraint checks: past length 0 (a new video) is valid here
    program.graph.set_codegen(torch.fx.CodeGen())  # plain positional inputs/outputs (we add some)
    program.recompile()
    # The captured graph is the inference graph (dropout folded); model.eval()/train() must not fail on it.
    program.train = types.MethodType(lambda self, mode=True: self, program)
    matches = discover.discover(program.graph)
    report = CompileReport([LayerReport(m.layer, m.ok, False, discover.summary(m), m.trace) for m in matches])
    if not matches:
        raise FastCarError("the captured program has no KV-cache outputs (present.N.key/value after the logits); "
                           "the forward must return (logits, *present_kv)")
    if not any(m.ok for m in matches):
        first = matches[0].failure
        raise FastCarError(f"no decoder layer matched: missing anchor '{first.anchor}' in layer {matches[0].layer} "
                           f"({first.reason}); fastcar_compile.torch.inspect(model) explains every layer")
    chosen = parse_layers(list(layers) if layers is not None and not isinstance(layers, str) else layers,
                          [m.layer for m in matches])
    selected = [m for m in matches if m.ok and (chosen is None or m.layer in chosen)]
    unmatched = [m.layer for m in matches if not m.ok and (chosen is None or m.layer in chosen)]
    if chosen is not None and unmatched:
        raise FastCarError(f"layers {unmatched} were asked for but did not match:\n" + report.format())
    if unmatched:
        report.notes.append(f"layers {unmatched} left dense (not matched)")
    limits.check_state_size(frame_tokens, selected[0].hidden, len(selected))  # the replay cache, before allocating
    if per_layer_threshold and len(taus) not in (1, len(selected)):
        raise FastCarError(f"threshold gives {len(taus)} values for {len(selected)} rewritten layers")
    if not per_layer_threshold and len(taus) != 1:
        raise FastCarError("several thresholds need per_layer_threshold=True")
    done = rewrite(program, selected, frame_tokens=frame_tokens, tas_query=tas_query, max_replay=max_replay,
                   per_layer_threshold=per_layer_threshold)
    for r in report.layers:
        r.rewritten = r.layer in done
    lowering = optimize.copy_program(program)  # what to_onnx lowers: the exported form, as the ONNX path sees it
    optimize.sdpa_gqa(program)  # what runs: grouped heads read in place, as the eager model does
    optimize.drop_metadata_asserts(program)
    optimize.drop_empty_cats(program)  # the KV cache copied once per step, as the eager model copies it
    optimize.sdpa_float_mask(program)
    first = selected[0]
    kshape = first.present_key.meta["val"].shape
    dtype = first.entry.meta["val"].dtype
    decoder = FastCarDecoder(program, layers=done, num_kv=2 * len(matches), frame_tokens=frame_tokens,
                             hidden=first.hidden, threshold=taus if per_layer_threshold else taus[0],
                             per_layer_threshold=per_layer_threshold, kv_shape=(int(kshape[1]), int(kshape[3])),
                             dtype=dtype, report=report)
    object.__setattr__(decoder, "lowering_program", lowering)  # not a submodule: its weights are the program's
    decoder.options = {"frame_tokens": frame_tokens, "tas_query": tas_query, "max_replay": max_replay,
                       "num_layers": len(matches), "num_heads": first.num_heads, "num_kv_heads": first.num_kv_heads,
                       "head_dim": first.head_dim}
    return decoder


def apply(model: nn.Module, *, video_start: int = 0, example_inputs: tuple[torch.Tensor, ...] | None = None,
          **options) -> nn.Module:
    """FastCar inserted into `model` (never modified). A transformers causal LM comes back as the same class
    (`generate()` works, also from `inputs_embeds`; `video_start=`/`prompt_frames=`/`fastcar_threshold=` may
    be passed per call); any other module with the flat forward `(input_ids, attention_mask, position_ids,
    *past_kv)` comes back as a FastCarDecoder.

    `video_start` is the KV position of the video's first frame token (the default for calls that give none).
    A prompt that ends with frame 0 of the video starts it at `len(prompt) - frame_tokens`, not at the prompt
    length (that leaves frame 0 out of the replay cache: the first generated frame cannot replay). Per call,
    `prompt_frames=k` (the prompt ends with k whole frames) computes it, and refuses a `video_start` that
    disagrees. The options (frame_tokens required, threshold, tas_query, max_replay, layers, per_layer_threshold)
    are fastcar-compile's, declared in fastcar_compile/core/options.py."""
    opts = _check_options(options)
    decoder = build(model, **opts, example_inputs=example_inputs)
    decoder.video_start = check_video_start(video_start)
    if capture.is_transformers_lm(model):
        # A call with inputs_embeds (a multimodal prefix) runs a second program captured from the embeddings
        # on first use; it shares the FastCar state, so the prefix and the tokens after it form one video.
        decoder.capture_embeds = functools.partial(build, model, **opts, embeds=True)
        return wrap_causal_lm(model, decoder)
    return decoder


apply.__signature__ = declared.signature(apply, 3, declared.TORCH_OPTIONS)
build.__signature__ = declared.signature(build, 3, declared.TORCH_OPTIONS)


def inspect(model: nn.Module, example_inputs: tuple[torch.Tensor, ...] | None = None) -> CompileReport:
    """Discovery only: what was found in each layer of the captured graph, and why a layer did not match."""
    front, _ = capture.flat_front(model)
    if example_inputs is None:
        example_inputs = capture.example_inputs(model)
    ep = capture.capture(front, tuple(example_inputs))
    matches = discover.discover(ep.module(check_guards=False).graph)
    return CompileReport([LayerReport(m.layer, m.ok, False, discover.summary(m), m.trace) for m in matches])


def to_onnx(model, path, *, opset: int = 20, emit_diagnostics: bool = False):
    """Lower a model from `apply` to a fast.onnx with the ONNX path's contract (see onnx_export)."""
    from fastcar_compile.torch.onnx_export import to_onnx as lower

    return lower(model, path, opset=opset, emit_diagnostics=emit_diagnostics)


def apply_dit(model: nn.Module, **options):
    """TempCache and FastCar on a PyTorch DiT (fastcar_compile.torch.dit.apply_dit; imported on use)."""
    from fastcar_compile.torch.dit import apply_dit as apply_to_dit

    return apply_to_dit(model, **options)


__all__ = ["apply_dit", "to_onnx", "FastCarCausalLMMixin", "FastCarDecoder", "FastCarStats", "apply", "build", "inspect"]
