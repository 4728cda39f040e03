"""Capture a decoder as one ATen graph with torch.export (strict=False).

The captured program has the exported-decoder I/O contract (docs/semantics.md section 4, fastcar_compile.core.contract):
`(input_ids, attention_mask, position_ids, *past_kv) -> (logits, *present_kv)`, KV tensors flat and
[batch, kv_heads, past, head_dim]. A transformers causal LM is put behind `fastcar_compile.export.flat_kv_wrapper` to get it; any other
module with that forward is captured as it is (pass `example_inputs`).
"""

from __future__ import annotations

import inspect
import warnings

import torch
from torch import nn

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.export import flat_kv_wrapper, kv_shape


def is_transformers_lm(model: nn.Module) -> bool:
    """A transformers PreTrainedModel with a decoder config (what `generate()` drives)."""
    cfg = getattr(model, "config", None)
    return cfg is not None and hasattr(model, "generate") and hasattr(cfg, "get_text_config")


def _kv_geometry(model: nn.Module) -> tuple[int, int, int, int]:
    """(layers, kv heads, head dim, vocab) from the config: only to build example inputs of the right shape."""
    s = kv_shape(model.config)
    return s.num_layers, s.num_kv_heads, s.head_dim, s.vocab


def flat_front(model: nn.Module, embeds: bool = False) -> tuple[nn.Module, int]:
    """(module with the flat contract, number of KV layers); with `embeds` its first input is inputs_embeds."""
    if is_transformers_lm(model):
        layers = _kv_geometry(model)[0]
        return flat_kv_wrapper(model, embeds=embeds), layers
    if embeds:
        raise FastCarError(f"inputs_embeds needs a transformers causal LM; {type(model).__name__} is captured with "
                           "its own example_inputs (pass token ids)")
    return model, -1


def example_inputs(model: nn.Module, batch: int = 2, seq: int = 3, past: int = 5,
                   embeds: bool = False) -> tuple[torch.Tensor, ...]:
    """Distinct batch/seq/past sizes (> 1) so the exporter keeps them symbolic; with `embeds` the first
    input is the model's own embedding of the ids (its hidden size and dtype)."""
    layers, kv, head_dim, vocab = _kv_geometry(model)
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    if embeds:
        with torch.no_grad():
            ids = model.get_input_embeddings()(ids)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    pos = torch.arange(past, past + seq).unsqueeze(0).expand(batch, seq).contiguous()
    kvs = [torch.randn(batch, kv, past, head_dim, generator=g).to(dtype) for _ in range(2 * layers)]
    return (ids, mask, pos, *kvs)


def capture(front: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.export.ExportedProgram:
    """torch.export (non-strict) with dynamic batch, sequence and past length."""
    from torch.export import Dim

    if len(inputs) < 3 or (len(inputs) - 3) % 2:
        raise FastCarError("example_inputs must be (input_ids, attention_mask, position_ids, *past_kv) with a "
                           f"key and a value per layer; got {len(inputs)} tensors")
    n_kv = len(inputs) - 3
    ids_shape = {0: Dim.DYNAMIC, 1: Dim.DYNAMIC}
    kv = tuple({0: Dim.DYNAMIC, 2: Dim.DYNAMIC} for _ in range(n_kv))
    params = list(inspect.signature(front.forward).parameters.values())
    varargs = len(params) > 3 and params[3].kind is inspect.Parameter.VAR_POSITIONAL
    shapes = (ids_shape, {0: Dim.DYNAMIC, 1: Dim.DYNAMIC}, ids_shape, *((kv,) if varargs else kv))
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.export.export(front, inputs, dynamic_shapes=shapes, strict=False)
    except Exception as exc:  # noqa: BLE001 - torch.export raises many kinds; the user needs the first line
        first = " ".join(str(exc).split())[:300]
        raise FastCarError(f"torch.export could not capture {type(front).__name__} ({type(exc).__name__}: {first}); "
                           "the forward must take (input_ids, attention_mask, position_ids, *past_kv)") from None
