"""The shipped ONNX decoder equals the shipped PyTorch weights (eager transformers) in ORT, within budget."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

from fastcar_compile.demo.export import ASSETS, CONFIG, ONNX, WEIGHTS, load_model  # noqa: E402
from fastcar_compile.demo.model import VIDEO_START, VOCAB, prompt  # noqa: E402


def test_assets_within_budget_and_contract() -> None:
    import onnx

    total = sum(p.stat().st_size for p in ASSETS.iterdir() if p.is_file())
    assert total <= 20 * 2**20
    cfg = json.loads(CONFIG.read_text())
    m = onnx.load(str(ONNX), load_external_data=False)
    # The I/O names docs/semantics.md section 4 asks exporters for, written out here (not taken from the exporter's code).
    n = cfg["num_hidden_layers"]
    kv_in = [f"past_key_values.{i}.{k}" for i in range(n) for k in ("key", "value")]
    assert [i.name for i in m.graph.input] == ["input_ids", "attention_mask", "position_ids", *kv_in]
    kv_out = [f"present.{i}.{k}" for i in range(n) for k in ("key", "value")]
    assert [o.name for o in m.graph.output] == ["logits", *kv_out]
    kv = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    last = f"past_key_values.{n - 1}.value"  # [batch, kv_heads, past, head_dim]
    assert kv[last][1] == cfg["num_key_value_heads"] and kv[last][3] == hd
    assert cfg["vocab_size"] == VOCAB and len(prompt("pan_left")) == VIDEO_START


def test_onnx_matches_pytorch_prefill_and_decode() -> None:
    torch.set_num_threads(1)
    model = load_model(WEIGHTS, CONFIG)
    cfg = model.config
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    s = ort.InferenceSession(str(ONNX), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    ids = np.concatenate([np.asarray(prompt("zoom_in"))[None], rng.integers(0, 512, size=(1, 72))], axis=1)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(ids)).logits.numpy()
    hd = cfg.hidden_size // cfg.num_attention_heads
    past = {f"past_key_values.{i}.{kv}": np.zeros((1, cfg.num_key_value_heads, 0, hd), np.float32)
            for i in range(cfg.num_hidden_layers) for kv in ("key", "value")}
    got = []
    n = ids.shape[1]
    for a, b in [(0, n - 6)] + [(t, t + 1) for t in range(n - 6, n)]:
        feed = {"input_ids": ids[:, a:b], "attention_mask": np.ones((1, b), np.int64),
                "position_ids": np.arange(a, b, dtype=np.int64)[None], **past}
        outs = s.run(None, feed)
        got.append(outs[0])
        past = dict(zip(past, outs[1:], strict=True))
    got = np.concatenate(got, axis=1)
    assert got.shape == ref.shape
    err = np.abs(got - ref).max()
    assert err < 2e-3 * max(1.0, np.abs(ref).max()), err
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.99
