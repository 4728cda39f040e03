"""Export the demo decoder to ONNX with a KV cache (dynamo exporter) and load/save its weights.

I/O contract (docs/DESIGN.md): inputs `input_ids`, `attention_mask`, `position_ids`,
`past_key_values.N.key|value`; outputs `logits`, `present.N.key|value`; KV [batch, kv_heads, past, head_dim].
Weights ship as float16 safetensors; the ONNX holds the same fp16-rounded values in float32 (ORT CPU runs
fp32), so the two agree up to float32 arithmetic.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path

from fastcar_compile.atomic import atomic_path, write_text
from fastcar_compile.contract import io_names
from fastcar_compile.demo.model import DemoConfig, build_model
from fastcar_compile.errors import FastCarError

ASSETS = Path(__file__).with_name("assets")
WEIGHTS = ASSETS / "model.safetensors"
CONFIG = ASSETS / "config.json"
ONNX = ASSETS / "decoder.onnx"
TOKENIZER = ASSETS / "tokenizer.npz"


def _wrapper(model):
    import torch

    class FlatKV(torch.nn.Module):
        """Flat KV tensors in and out (the exporter cannot take a DynamicCache object as input)."""

        def __init__(self, m):
            super().__init__()
            self.m = m
            self.n = m.config.num_hidden_layers

        def forward(self, input_ids, attention_mask, position_ids, *past):
            from transformers import DynamicCache

            cache = DynamicCache([(past[2 * i], past[2 * i + 1]) for i in range(self.n)], config=self.m.config)
            # A ready 4D additive mask (causal over KV indices, and the padding mask): a handful of ONNX
            # nodes instead of transformers' ~30-node mask builder, which costs as much as a layer at batch 1.
            total, seq = attention_mask.shape[1], input_ids.shape[1]
            k_idx = torch.arange(total, device=input_ids.device)
            q_idx = torch.arange(seq, device=input_ids.device) + (total - seq)
            allowed = (k_idx[None, None, None, :] <= q_idx[None, None, :, None]) & attention_mask[:, None, None,
                                                                                                   :].bool()
            mask = torch.where(allowed, torch.zeros((), dtype=torch.float32),
                               torch.full((), torch.finfo(torch.float32).min))
            out = self.m(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, return_dict=True)
            flat = []
            for layer in out.past_key_values.layers:
                flat += [layer.keys, layer.values]
            return (out.logits, *flat)

    return FlatKV(model).eval()


def export_onnx(model, path: str | os.PathLike, opset: int = 20) -> Path:
    """Export `model` (float32 LlamaForCausalLM) to a single-file ONNX at `path`, atomically."""
    import onnx
    import torch

    cfg = model.config
    n = cfg.num_hidden_layers
    kvh = cfg.num_key_value_heads
    hd = cfg.hidden_size // cfg.num_attention_heads
    batch, seq, past = 2, 3, 5
    g = torch.Generator().manual_seed(0)
    example = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=g),
               torch.ones(batch, past + seq, dtype=torch.int64),
               torch.arange(past, past + seq).unsqueeze(0).expand(batch, seq).contiguous()]
    example += [torch.randn(batch, kvh, past, hd, generator=g) for _ in range(2 * n)]
    ins, outs = io_names(n)
    kv_shapes = tuple({0: "batch", 2: "past"} for _ in range(2 * n))
    shapes = ({0: "batch", 1: "seq"}, {0: "batch", 1: "total"}, {0: "batch", 1: "seq"}, kv_shapes)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmpdir = tempfile.mkdtemp(dir=path.parent, prefix=".export-")
    tmp = Path(tmpdir) / "model.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(_wrapper(model), tuple(example), input_names=ins, output_names=outs,
                                 dynamic_shapes=shapes, opset_version=opset, dynamo=True, optimize=True,
                                 verbose=False)
        prog.save(str(tmp))
    proto = onnx.load(str(tmp))
    got_in, got_out = [i.name for i in proto.graph.input], [o.name for o in proto.graph.output]
    if got_in != ins or got_out != outs:
        raise FastCarError(f"exporter broke the I/O contract: inputs {got_in}, outputs {got_out}")
    final = Path(tmpdir) / "final.onnx"
    onnx.save(proto, str(final))  # single file, no external data
    os.replace(final, path)
    for f in Path(tmpdir).iterdir():
        f.unlink()
    os.rmdir(tmpdir)
    return path


def save_weights(model, cfg: DemoConfig, weights: str | os.PathLike = WEIGHTS,
                 config: str | os.PathLike = CONFIG) -> None:
    """float16 safetensors + config.json, both atomic."""
    from safetensors.torch import save_file

    weights, config = Path(weights), Path(config)
    weights.parent.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu").half().contiguous() for k, v in model.state_dict().items()}
    with atomic_path(weights) as tmp:
        save_file(sd, str(tmp))
    write_text(config, json.dumps(cfg.to_dict(), indent=1))


def load_model(weights: str | os.PathLike = WEIGHTS, config: str | os.PathLike = CONFIG):
    """The shipped (fp16) weights as a float32 LlamaForCausalLM in eval mode."""
    from safetensors.torch import load_file

    if not Path(weights).exists() or not Path(config).exists():
        raise FastCarError(f"demo weights not found at {weights}; run scripts/train_demo.py first")
    cfg = DemoConfig(**json.loads(Path(config).read_text()))
    model = build_model(cfg)
    sd = {k: v.float() for k, v in load_file(str(weights)).items()}
    model.load_state_dict(sd)
    return model.eval()
