"""`fastcar-compile export` on the zoo families: ONNX Runtime logits equal the eager transformers model's,
prompt and KV-cached decode steps, and the result compiles."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
zoo = pytest.importorskip("zoo")
ort = pytest.importorskip("onnxruntime")

from fastcar_compile.cli import main  # noqa: E402

FAST = [("llama", "dynamo")]
SLOW = [("gpt2", "dynamo"), ("qwen2", "dynamo"), ("phi3", "dynamo"), ("llama", "torchscript"), ("gpt2", "torchscript")]


def _ort_vs_eager(model, path: Path, prompt: int = 5, steps: int = 3) -> float:
    """Eager forward over the whole sequence (batch 2) vs ORT: prompt, then one token at a time with the
    presents fed back as past_key_values."""
    info = zoo.model_info(model.config.model_type if model.config.model_type != "gpt2" else "gpt2")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    ids = torch.randint(0, info.vocab, (2, prompt + steps), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = model(input_ids=ids).logits.numpy()
    past = {f"past_key_values.{i}.{k}": np.zeros((2, info.num_kv_heads, 0, info.head_dim), np.float32)
            for i in range(info.num_layers) for k in ("key", "value")}
    names = [o.name for o in sess.get_outputs()]
    got, t = [], 0
    for n in [prompt] + [1] * steps:
        feed = {"input_ids": ids[:, t:t + n].numpy(), "attention_mask": np.ones((2, t + n), np.int64),
                "position_ids": np.tile(np.arange(t, t + n), (2, 1)), **past}
        out = dict(zip(names, sess.run(None, feed), strict=True))
        got.append(out["logits"])
        past = {k: out[k.replace("past_key_values", "present")] for k in past}
        t += n
    return float(np.abs(np.concatenate(got, axis=1) - want).max())


@pytest.mark.parametrize("family,exporter", FAST + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW])
def test_export_matches_eager(family, exporter, tmp_path, capsys):
    model = zoo.build_model(family)
    src = tmp_path / "hf"
    model.save_pretrained(src)
    out = tmp_path / "model.onnx"
    argv = ["export", str(src), "-o", str(out)] + (["--torchscript"] if exporter == "torchscript" else [])
    assert main(argv) == 0
    assert "logits match" in capsys.readouterr().out
    assert _ort_vs_eager(model, out) < 1e-4
    import fastcar_compile as fc

    _, report = fc.compile(str(out), str(tmp_path / "fast.onnx"), frame_tokens=4)
    assert report.rewritten == list(range(zoo.LAYERS))
    if (family, exporter) == FAST[0]:  # a NaN logit difference is no match (NaN > tolerance is False)
        from fastcar_compile.export import check_logits

        with torch.no_grad():
            model.get_output_embeddings().weight[0] = float("nan")  # logit 0 of every token
        with pytest.raises(fc.FastCarError, match="NaN"):
            check_logits(model, out)


def test_export_config_only_and_opset(tmp_path, capsys):
    """A config.json alone gives random weights (said so), at the opset asked for."""
    import onnx

    zoo.make_config("qwen2").save_pretrained(tmp_path)
    out = tmp_path / "q.onnx"
    assert main(["export", str(tmp_path / "config.json"), "-o", str(out), "--opset", "18", "--no-check"]) == 0
    assert "random weights" in capsys.readouterr().out
    m = onnx.load(str(out), load_external_data=False)
    assert [o.version for o in m.opset_import if o.domain == ""] == [18]
    assert [i.name for i in m.graph.input][:4] == ["input_ids", "attention_mask", "position_ids",
                                                   "past_key_values.0.key"]


@pytest.mark.parametrize("args,msg", [
    (["/nonexistent/model"], "does not exist"),
    (["{tmp}", "--opset", "3"], "outside 7..24"),
    (["{tmp}"], "no config.json"),
])
def test_export_bad_input(args, msg, tmp_path, capsys):
    argv = ["export"] + [a.replace("{tmp}", str(tmp_path)) for a in args] + ["-o", str(tmp_path / "x.onnx")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
