"""The PyTorch front end's refusals: a NaN or non-numeric fastcar_threshold, input_ids that are not integer token
ids [batch, seq] and a to_onnx path that is a FIFO are one FastCarError each, never a torch traceback, a silent
NaN run or a replaced special file."""

from __future__ import annotations

import os

import pytest
import torch

from fastcar_compile.core.errors import FastCarError

fct = pytest.importorskip("fastcar_compile.torch")


@pytest.fixture(scope="module")
def model():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return fct.apply(tf.LlamaForCausalLM(cfg).eval(), frame_tokens=4, threshold=0.0)


IDS = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("call, word", [
    (lambda m: m.generate(IDS, max_new_tokens=8, fastcar_threshold=float("nan")), "NaN"),
    (lambda m: m.generate(IDS, max_new_tokens=8, fastcar_threshold="x"), "fastcar_threshold"),
    (lambda m: m.generate(IDS.float(), max_new_tokens=4), "integer token ids"),
    (lambda m: m(IDS[0]), "[batch, seq]"),
], ids=["threshold NaN", "threshold str", "float ids", "1-d ids"])
def test_bad_call_is_one_fastcar_error(model, call, word):
    with pytest.raises(FastCarError, match=None) as e:
        call(model)
    assert word in str(e.value)


def test_to_onnx_never_replaces_a_fifo(model, tmp_path):
    fifo = tmp_path / "fast.onnx"
    os.mkfifo(fifo)
    with pytest.raises(FastCarError, match="FIFO"):
        fct.to_onnx(model, fifo)
    assert fifo.is_fifo() and sorted(p.name for p in tmp_path.iterdir()) == ["fast.onnx"]
