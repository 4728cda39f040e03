"""`fastcar-compile demo` runs end to end on a tiny setting and writes every promised file, with numbers
that agree with an independent recomputation from the files it wrote."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("skimage")
pytest.importorskip("torch")

import ort_driver  # noqa: E402

import fastcar_compile as fc  # noqa: E402
from fastcar_compile.cli import main  # noqa: E402
from fastcar_compile.demo import data  # noqa: E402
from fastcar_compile.demo.evaluate import load_tokenizer  # noqa: E402
from fastcar_compile.demo.export import ONNX  # noqa: E402
from fastcar_compile.demo.model import CODES, VIDEO_START, prompt  # noqa: E402


def test_demo_tiny_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    rc = main(["demo", "--demo-model", "small", "--clips", "1", "--frames", "3", "--out", str(out), "--threshold=-inf"])
    assert rc == 0
    text = capsys.readouterr().out
    for name in ("demo.gif", "strip.png", "replay_heatmap.png", "quality.png", "results.json", "fast.onnx"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
        assert str(out / name) in text
    for key in ("replay ratio", "ms/token, ORT run", "speed-up, ORT run", "compiled at tau=+inf", "graph",
                "FastCar vs dense", "FastCar vs truth"):
        assert key in text
    s = json.loads((out / "results.json").read_text())["summary"]
    # tau = -inf: every eligible decode-step MLP replays (frame 0 is context, so all decode steps are eligible)
    assert s["replay_ratio"] == pytest.approx(1.0)
    gif = Image.open(out / "demo.gif")
    assert gif.n_frames == 3
    assert gif.size[0] > 4 * 32 * 2  # four panels, upscaled
    # the count it announces is the number of paths it lists, and every file in --out is listed
    import re

    n = int(re.search(r"wrote (\d+) files", text).group(1))
    listed = [ln.split()[0] for ln in text.splitlines() if ln.startswith(f"  {out}")]
    assert n == len(listed) == len(list(out.iterdir()))
    # strip.png carries labels: a text column left of the frames, text above them (dark pixels on white)
    strip = np.asarray(Image.open(out / "strip.png").convert("L"))
    assert strip.shape[1] == 110 + 3 * 32 * 3
    assert (strip[16:, :100] < 128).sum() > 200 and (strip[:14, 110:] < 128).sum() > 50


def test_print_compile_report_is_readable(zoo_model) -> None:
    import fastcar_compile as fc

    report = fc.inspect(zoo_model("llama", "dynamo20"))
    text = str(report)
    assert text.startswith("2/2 decoder layers matched") and "layer   1:" in text and "CompileReport(" not in text


def test_demo_never_replay_equals_dense(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tau = +inf: the compiled model must generate exactly the dense model's video, sampled (the default) with
    the clip's shared seed."""
    out = tmp_path / "demo"
    assert main(["demo", "--demo-model", "small", "--clips", "1", "--frames", "2", "--out", str(out),
                 "--threshold", "inf"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["decoding"]["do_sample"] is True
    s = res["summary"]
    assert s["replay_ratio"] == 0.0
    assert s["token_agreement"] == 1.0
    assert s["psnr_fast_vs_dense"] == float("inf")  # identical videos
    assert np.isfinite(s["psnr_dense_vs_gt"])


def test_demo_bad_args(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--clips", "0"]) == 2
    assert "--clips" in capsys.readouterr().err


def test_eval_tiny_writes_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Function bodies, as the reference driver below runs them: the quantile tau equals one TAS value of the
    # dense run, and the native kernel's TAS may round that tie the other way (test_runtime_native covers it).
    monkeypatch.setenv("FASTCAR_NATIVE", "0")
    out = tmp_path / "eval"
    rc = main(["eval", "--clips", "1", "--frames", "2", "--variants", "rope", "--guard", "0", "--targets", "0.5",
               "--greedy", "--out", str(out)])
    assert rc == 0
    for name in ("eval.json", "eval.md", "eval.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    assert sorted(p.name for p in out.iterdir()) == ["eval.json", "eval.md", "eval.png"]  # no leftover models
    rows = json.loads((out / "eval.json").read_text())["rows"]
    tok = load_tokenizer()
    by_tau = {r["tau"]: r for r in rows}
    never, always = by_tau[float("inf")], by_tau[float("-inf")]
    assert never["replay_ratio"] == 0.0 and never["token_agreement"] == 1.0
    assert always["replay_ratio"] == pytest.approx(1.0)
    # The quantile row against an independent greedy run: the bundled model compiled here at that tau (with
    # diagnostics outputs), driven by the tests' own ORT loop; its replay bits and tokens must be eval's.
    mid = next(r for r in rows if np.isfinite(r["tau"]))
    fast = tmp_path / "mid.onnx"
    # compiled as eval compiles it (exported attention and ops kept): a greedy near-tie may flip between graphs
    # that differ by 1e-5 in the logits (fused ops), which is not what this test checks
    fc.compile(ONNX, fast, frame_tokens=tok.tokens_per_frame, threshold=mid["tau"], emit_diagnostics=True,
               fused_attention=None, fusions=False)
    clip = data.make_clips("eval", 1, 2)[0]
    frame0 = [int(t) for t in tok.encode(clip.frames)[0]]
    n = tok.tokens_per_frame
    ours, bits = ort_driver.greedy(fast, prompt(clip.motion) + frame0, n, VIDEO_START, vocab_limit=CODES)
    dense, _ = ort_driver.greedy(ONNX, prompt(clip.motion) + frame0, n, VIDEO_START, vocab_limit=CODES)
    assert bits.shape[0] == n - 1 and bits.shape[1] >= 1
    assert mid["replay_ratio"] == pytest.approx(bits.mean())
    assert mid["token_agreement"] == pytest.approx((ours == dense).mean())
    assert 0.0 < mid["replay_ratio"] < 1.0
    assert (out / "eval.md").read_text().count("\n") == len(rows) + 2
    for r in rows:  # the ORT speed-up as its factors, each a ratio of the row's own timings
        assert r["speedup_graph_ort"] == pytest.approx(r["dense_ort_ms"] / r["inf_ort_ms"])
        assert r["speedup_replay_ort"] == pytest.approx(r["inf_ort_ms"] / r["fast_ort_ms"])
        assert r["speedup_ort"] == pytest.approx(r["speedup_graph_ort"] * r["speedup_replay_ort"])


@pytest.mark.slow
def test_demo_video_model_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The default model (conditioned, CFG rows in the batch): every file it writes is listed (its compiled
    weights go to external data), tau = -inf replays every decode step of both rows, and the quality targets
    are reported from the figures results.json holds."""
    import re

    out = tmp_path / "demo"
    assert main(["demo", "--clips", "1", "--frames", "4", "--out", str(out), "--threshold=-inf"]) == 0
    text = capsys.readouterr().out
    n = int(re.search(r"wrote (\d+) files", text).group(1))
    listed = [ln.split()[0] for ln in text.splitlines() if ln.startswith(f"  {out}")]
    assert n == len(listed) == len(list(out.iterdir()))
    res = json.loads((out / "results.json").read_text())
    assert res["model"] == "video" and res["decoding"]["cfg_scale"] is not None and res["decoding"]["do_sample"]
    assert res["summary"]["replay_ratio"] == pytest.approx(1.0)
    q = res["quality"]
    gain = q["targets"]["dense_vs_repeat_last_db"]
    assert gain["value"] == pytest.approx(q["psnr_dense_vs_truth"] - q["psnr_repeat_last_vs_truth"])
    assert gain["met"] == (gain["value"] >= 2.0) and ("MISSED" in text) != all(t["met"] for t in q["targets"].values())
    assert (out / "quality.png").stat().st_size > 0
