"""Export the demo decoder to ONNX with a KV cache (dynamo exporter) and load/save its weights.

I/O contract (docs/DESIGN.md): inputs `input_ids`, `attention_mask`, `position_ids`,
`past_key_values.N.key|value`; outputs `logits`, `present.N.key|value`; KV [batch, kv_heads, past, head_dim].
Weights ship as float16 safetensors; the ONNX holds the same fp16-rounded values in float32 (ORT CPU runs
fp32), so the two agree up to float32 arithmetic.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fastcar_compile.core.atomic import atomic_path, write_text
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.demo.model import DemoConfig, build_model
from fastcar_compile.export import export_decoder

ASSETS = Path(__file__).with_name("assets")
WEIGHTS = ASSETS / "model.safetensors"
CONFIG = ASSETS / "config.json"
ONNX = ASSETS / "decoder.onnx"
TOKENIZER = ASSETS / "tokenizer.npz"
# The long-video model (demo --long): fp16 weights + config only; its ONNX is exported on first use.
LONG_WEIGHTS = ASSETS / "long.safetensors"
LONG_CONFIG = ASSETS / "long.json"
LONG_LOG = ASSETS / "long_train_log.json"


def export_onnx(model, path: str | os.PathLike, opset: int = 20) -> Path:
    """Export `model` (float32 LlamaForCausalLM) to a single-file ONNX at `path`, atomically.

    The generic exporter (`fastcar-compile export`) with a ready 4-D additive mask: a handful of ONNX nodes
    instead of transformers' ~30-node mask builder, which costs as much as a layer at batch 1 here.
    """
    return export_decoder(model, path, opset=opset, dynamo=True, additive_mask=True)


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
