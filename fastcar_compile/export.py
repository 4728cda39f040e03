"""Export a transformers causal LM to the ONNX decoder the compiler expects (`fastcar-compile export`).

The exporters cannot take transformers' `DynamicCache` object as a graph input, so a small wrapper takes
flat KV tensors, builds the cache, and returns flat presents. The I/O is the contract of
`fastcar_compile.core.contract.io_names`: `input_ids`, `attention_mask`, `position_ids`,
`past_key_values.N.key|value` -> `logits`, `present.N.key|value`, KV [batch, kv_heads, past, head_dim]
with dynamic batch, sequence and past length. dynamo (torch.onnx, opset 20) by default; TorchScript
(`dynamo=False`, opset 17) as the fallback for models dynamo cannot trace.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastcar_compile.core.contract import io_names
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.fileio import refuse_special, refuse_special_input, with_path

DEFAULT_OPSET = {"dynamo": 20, "torchscript": 17}
EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf's 2 GB limit, with headroom


@dataclass(frozen=True)
class KVShape:
    """What the flat KV inputs look like for one model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab: int


def kv_shape(config: Any) -> KVShape:
    """Layer count, KV heads and head size from a transformers config (GPT-2 style and multimodal configs too)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if hidden and heads else None)
    vocab = getattr(cfg, "vocab_size", None)
    if None in (layers, heads, head_dim, vocab):
        raise FastCarError(f"cannot read layers/heads/head_dim/vocab from the config ({type(config).__name__}); "
                           "pass example_inputs=(input_ids, attention_mask, position_ids, *past_kv)")
    return KVShape(int(layers), int(kv), int(head_dim), int(vocab))


def flat_kv_wrapper(model, additive_mask: bool = False, embeds: bool = False):
    """A module with flat KV tensors in and out around a transformers causal LM (eval mode).

    embeds: the first input is `inputs_embeds` [B, S, hidden] instead of token ids (a multimodal prefix).

    additive_mask: pass a ready 4-D additive mask (causal over KV indices and padding) instead of the 2-D
    mask; a handful of ONNX nodes instead of transformers' mask builder, which costs as much as a layer at
    batch 1 in a small model. Only for models whose attention accepts a 4-D float mask (LLaMA-style).
    """
    import torch

    n = kv_shape(model.config).num_layers

    class FlatKV(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, position_ids, *past):
            from transformers import DynamicCache

            cache = DynamicCache([(past[2 * i], past[2 * i + 1]) for i in range(n)], config=self.m.config)
            mask = attention_mask
            if additive_mask:
                total, seq = attention_mask.shape[1], input_ids.shape[1]
                k_idx = torch.arange(total, device=input_ids.device)
                q_idx = torch.arange(seq, device=input_ids.device) + (total - seq)
                allowed = (k_idx[None, None, None, :] <= q_idx[None, None, :, None]) & \
                    attention_mask[:, None, None, :].bool()
                mask = torch.where(allowed, torch.zeros((), dtype=torch.float32),
                                   torch.full((), torch.finfo(torch.float32).min))
            first = {"inputs_embeds" if embeds else "input_ids": input_ids}
            out = self.m(**first, attention_mask=mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, return_dict=True)
            flat = []
            for layer in out.past_key_values.layers[:n]:
                flat += [layer.keys, layer.values]
            return (out.logits, *flat)

    return FlatKV(model).eval()


def example_inputs(shape: KVShape, dtype=None, batch: int = 2, seq: int = 3, past: int = 5) -> tuple:
    """Distinct batch/seq/past sizes so that the exporter cannot specialise any of them."""
    import torch

    g = torch.Generator().manual_seed(0)
    ex = [torch.randint(0, shape.vocab, (batch, seq), generator=g),
          torch.ones(batch, past + seq, dtype=torch.int64),
          torch.arange(past, past + seq).unsqueeze(0).expand(batch, seq).contiguous()]
    ex += [torch.randn(batch, shape.num_kv_heads, past, shape.head_dim, generator=g).to(dtype or torch.float32)
           for _ in range(2 * shape.num_layers)]
    return tuple(ex)


def load_model(source: str | os.PathLike, seed: int = 0):
    """A float32 causal LM from a transformers folder (config + weights), or random weights from a config.

    Returns (model, with_weights). Random weights (a config.json alone) are for trying the tool chain only.
    """
    try:
        import torch
        import transformers as tf
    except ImportError:
        raise FastCarError("export needs torch and transformers: pip install -c constraints.txt -e '.[torch]'") \
            from None
    src = Path(source)
    if not src.exists():
        raise FastCarError(f"{src} does not exist; give a transformers model folder (config.json + weights) or "
                           "a config.json")
    folder = src if src.is_dir() else src.parent
    cfg_file = folder / "config.json" if src.is_dir() else src
    refuse_special_input(cfg_file, "config")
    if not cfg_file.is_file():
        raise FastCarError(f"{folder} has no config.json; give the folder written by save_pretrained()")
    try:
        config = tf.AutoConfig.from_pretrained(str(cfg_file))
    except Exception as exc:  # noqa: BLE001 - transformers raises ValueError/OSError/KeyError for a bad config
        raise FastCarError(f"{cfg_file}: transformers cannot read this config ({str(exc).splitlines()[0][:200]})") \
            from None
    config._attn_implementation = "sdpa"
    check_size(config, cfg_file)
    weight_files = [*folder.glob("*.safetensors"), *folder.glob("pytorch_model*.bin")] if src.is_dir() else []
    for f in weight_files:
        refuse_special_input(f, "weight file")
    weights = bool(weight_files)
    verbosity = tf.logging.get_verbosity()
    tf.logging.set_verbosity_error()  # its load report of a broken checkpoint: said in one line below
    from fastcar_compile.core.progress import hf_bars_on_terminal_only

    hf_bars_on_terminal_only()
    try:
        if weights and src.is_dir():
            model, info = tf.AutoModelForCausalLM.from_pretrained(str(folder), config=config, dtype=torch.float32,
                                                                  output_loading_info=True,
                                                                  ignore_mismatched_sizes=True)
        else:
            torch.manual_seed(seed)
            model, info = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32), {}
    except ValueError as exc:
        raise FastCarError(f"{cfg_file}: not a causal LM transformers knows ({_first_line(exc)})") from None
    except Exception as exc:  # noqa: BLE001 - safetensors/torch/pickle raise many types for a broken weight file
        raise FastCarError(f"{folder}: cannot load the weights ({type(exc).__name__}: {_first_line(exc)}); check "
                           "that the weight files are complete and match config.json") from None
    finally:
        tf.logging.set_verbosity(verbosity)
    _refuse_incomplete(info, folder)
    model = model.float().eval()
    if weights and src.is_dir():
        _refuse_non_finite(model, folder)
    return model, bool(weights and src.is_dir())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def check_size(config: Any, where: Path) -> None:
    """Refuse a config whose model cannot fit in this machine's memory (vocab_size 10^12 would otherwise fail
    as a MemoryError deep inside torch): embedding and layer weights estimated in float32."""
    from fastcar_compile.core.limits import memory_bytes

    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    dims = {k: getattr(cfg, k, None) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                               "intermediate_size")}
    bad = [f"{k}={v!r}" for k, v in dims.items() if v is not None and (isinstance(v, bool) or
                                                                       not isinstance(v, int) or v < 1)]
    if bad:
        raise FastCarError(f"{where}: {', '.join(bad)} must be positive integers; fix config.json")
    vocab, hidden, layers = (dims[k] or 1 for k in ("vocab_size", "hidden_size", "num_hidden_layers"))
    inter = dims["intermediate_size"] or 4 * hidden
    need = 4 * (2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * inter))
    if need > memory_bytes():
        raise FastCarError(f"{where}: vocab_size {vocab}, hidden_size {hidden}, {layers} layers need about "
                           f"{need / 2**30:.0f} GiB of float32 weights, more than this machine's "
                           f"{memory_bytes() / 2**30:.0f} GiB; check config.json")


def _names(names, n: int = 4) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _refuse_incomplete(info: dict, folder: Path) -> None:
    """transformers fills weights a checkpoint lacks with random values (and drops unknown ones) with only a
    log line: an export of such a model is not the user's model."""
    for key, what in (("missing_keys", "lacks weights the model in config.json needs"),
                      ("mismatched_keys", "has weights whose shapes contradict config.json"),
                      ("unexpected_keys", "has weights the model in config.json does not have")):
        names = [k if isinstance(k, str) else k[0] for k in info.get(key) or ()]
        if names:
            raise FastCarError(f"{folder}: the checkpoint {what} ({_names(names)}); give the complete checkpoint "
                               "saved with this config")
    if info.get("error_msgs"):
        raise FastCarError(f"{folder}: the weights do not load cleanly ({str(info['error_msgs'][0])[:200]})")


def _refuse_non_finite(model, folder: Path) -> None:
    import torch

    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise FastCarError(f"{folder}: weights hold NaN or infinity ({_names(bad)}); the checkpoint is broken")


def export_decoder(model, output: str | os.PathLike, *, opset: int | None = None, dynamo: bool = True,
                   additive_mask: bool = False) -> Path:
    """Export `model` (a transformers causal LM) to `output`, atomically; checks the I/O names it wrote."""
    import logging

    import onnx
    import torch

    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)  # torchvision note
    exporter = "dynamo" if dynamo else "torchscript"
    opset = opset or DEFAULT_OPSET[exporter]
    shape = kv_shape(model.config)
    ins, outs = io_names(shape.num_layers)
    wrapper = flat_kv_wrapper(model, additive_mask)
    example = example_inputs(shape, next(model.parameters()).dtype)
    big = sum(p.numel() * p.element_size() for p in model.parameters()) > EXTERNAL_DATA_BYTES
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmpdir = Path(tempfile.mkdtemp(dir=out.parent, prefix=".export-"))
    tmp = tmpdir / out.name
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            if dynamo:
                kv_axes = tuple({0: "batch", 2: "past"} for _ in range(2 * shape.num_layers))
                shapes = ({0: "batch", 1: "seq"}, {0: "batch", 1: "total"}, {0: "batch", 1: "seq"}, kv_axes)
                prog = torch.onnx.export(wrapper, example, input_names=ins, output_names=outs,
                                         dynamic_shapes=shapes, opset_version=opset, dynamo=True, optimize=True,
                                         verbose=False)
                prog.save(str(tmp), external_data=big)
            else:
                axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
                        "position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
                axes.update({n: {0: "batch", 2: "past"} for n in ins[3:]})
                axes.update({n: {0: "batch", 2: "total"} for n in outs[1:]})
                torch.onnx.export(wrapper, example, str(tmp), input_names=ins, output_names=outs,
                                  dynamic_axes=axes, opset_version=opset, dynamo=False, do_constant_folding=True)
        proto = onnx.load(str(tmp), load_external_data=False)
        got_in, got_out = [i.name for i in proto.graph.input], [o.name for o in proto.graph.output]
        if got_in != ins or got_out != outs:
            raise FastCarError(f"the {exporter} exporter broke the I/O contract: inputs {got_in[:5]}..., outputs "
                               f"{got_out[:3]}...; try the other exporter (--torchscript / dynamo)")
        if not big:  # one self-contained file (TorchScript may have split weights out)
            onnx.save(onnx.load(str(tmp)), str(tmp))
            for f in tmpdir.iterdir():
                if f != tmp:
                    f.unlink()
        refuse_special(out)  # the API's caller may not have run check_outputs: never replace a device or FIFO
        for f in tmpdir.iterdir():  # data file first, then the model: a reader never sees a model without data
            if f != tmp:
                os.replace(f, out.parent / f.name)
        os.replace(tmp, out)
    except OSError as exc:  # a full disk fails a write, which names no file: name the output
        raise with_path(exc, out) from None
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return out


def check_logits(model, path: str | os.PathLike, steps: int = 2) -> float:
    """Max |logit difference| between ONNX Runtime and the eager model: a prompt, then `steps` decode steps
    fed with the ONNX presents, against one eager forward over the whole sequence."""
    import numpy as np
    import onnxruntime as ort
    import torch

    shape = kv_shape(model.config)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape.vocab, (1, 4 + steps), generator=g)
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits.float().numpy()
    kv_dtype = np.float32
    past = {f"past_key_values.{i}.{k}": np.zeros((1, shape.num_kv_heads, 0, shape.head_dim), kv_dtype)
            for i in range(shape.num_layers) for k in ("key", "value")}
    names = [o.name for o in sess.get_outputs()]
    got = []
    t = 0
    for n in [4] + [1] * steps:
        x = ids[:, t:t + n].numpy()
        feed = {"input_ids": x, "attention_mask": np.ones((1, t + n), np.int64),
                "position_ids": np.arange(t, t + n, dtype=np.int64)[None], **past}
        res = dict(zip(names, sess.run(None, feed), strict=True))
        got.append(res["logits"])
        past = {k: res[k.replace("past_key_values", "present")] for k in past}
        t += n
    got = np.concatenate(got, axis=1)
    if not (np.isfinite(want).all() and np.isfinite(got).all()):  # NaN - NaN is no match
        raise FastCarError(f"{path}: the logits hold NaN or infinity (eager: {int((~np.isfinite(want)).sum())}, "
                           f"ONNX Runtime: {int((~np.isfinite(got)).sum())} values); the model is broken")
    return float(np.abs(got - want).max())
