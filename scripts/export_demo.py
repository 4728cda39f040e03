"""Export the shipped demo weights (fastcar_compile/demo/assets/model.safetensors) to decoder.onnx.

    python scripts/export_demo.py [--check]
    python scripts/export_demo.py --long --check   # the long-video model: export into the user cache, compare

The ONNX holds the fp16-rounded weights in float32 (ORT CPU runs fp32), dynamo exporter, opset 20, KV cache
I/O per docs/DESIGN.md. --check compares ORT logits with eager PyTorch on a prefill and a decode step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fastcar_compile.demo.export import ASSETS, CONFIG, ONNX, WEIGHTS, export_onnx, load_model


def check(onnx_path: Path, model) -> float:
    """Max |logits ORT - logits PyTorch| over a 70-token prefill and 5 decode steps."""
    import onnxruntime as ort
    import torch

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    s = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    cfg = model.config
    n, kvh, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    ids = np.random.default_rng(0).integers(0, 512, size=(1, 75))
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(ids)).logits.numpy()
    past = {f"past_key_values.{i}.{kv}": np.zeros((1, kvh, 0, hd), np.float32) for i in range(n) for kv in
            ("key", "value")}
    got = []
    for a, b in [(0, 70)] + [(t, t + 1) for t in range(70, 75)]:
        feed = {"input_ids": ids[:, a:b], "attention_mask": np.ones((1, b), np.int64),
                "position_ids": np.arange(a, b, dtype=np.int64)[None], **past}
        outs = s.run(None, feed)
        got.append(outs[0])
        past = {k: v for k, v in zip(past, outs[1:], strict=True)}
    return float(np.abs(np.concatenate(got, axis=1) - ref).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ONNX)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--long", action="store_true", help="the long-video model (its ONNX lives in the user cache)")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    if a.long:
        from fastcar_compile.demo.export import LONG_CONFIG, LONG_WEIGHTS
        from fastcar_compile.demo.longvideo import long_onnx

        path = long_onnx()
        print(f"long-video decoder: {path} ({path.stat().st_size / 1e6:.2f} MB)")
        if a.check:
            print(f"max |ORT - PyTorch| logits: {check(path, load_model(LONG_WEIGHTS, LONG_CONFIG)):.3g}")
        return
    model = load_model(WEIGHTS, CONFIG)
    export_onnx(model, a.out)
    sizes = {p.name: p.stat().st_size for p in sorted(ASSETS.iterdir()) if p.is_file()}
    print(f"wrote {a.out} ({a.out.stat().st_size / 1e6:.2f} MB); assets total {sum(sizes.values()) / 1e6:.2f} MB")
    if a.check:
        print(f"max |ORT - PyTorch| logits: {check(a.out, model):.3g}")


if __name__ == "__main__":
    main()
