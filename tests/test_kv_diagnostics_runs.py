"""--kv-diagnostics over several videos: the run stats pool every video (not the first one's numbers), keep each
video's, and `eval` / `report` print density, recall and resident KV and draw them (fast.kv.png)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import zoo

from fastcar_compile.cli import main
from fastcar_compile.core import contract
from fastcar_compile.runtime.decode import ThresholdWarning

L, FRAMES = 4, 6


@pytest.fixture(scope="module")
def compressed(zoo_model, tmp_path_factory):
    import fastcar_compile as fc

    d = tmp_path_factory.mktemp("kvruns")
    fc.compile(str(zoo_model("llama", "dynamo20")), str(d / "fast.onnx"), frame_tokens=L, threshold=0.0,
               kv_budget=9, kv_sinks=1, kv_window=L, tempcache=0.2, kv_diagnostics=64)
    prompts = np.random.default_rng(3).integers(0, zoo.VOCAB, (2, 3))
    np.save(d / "p.npy", prompts)
    return d, prompts


def _one_video(path, prompt) -> dict[str, dict[str, float]]:
    """One video on its own, its density and recall from NumPy sums of every step's kv_stats.N output and its
    resident KV bytes counted from the final slot records."""
    from fastcar_compile.runtime import FastCarSession

    sess, seen = FastCarSession(path, threads=1), []
    step = sess.step

    def recording(*args, **kwargs):
        res = step(*args, **kwargs)
        seen.append({n: np.array(a, np.float64) for n, a in res.extra.items()})
        return res

    sess.step = recording
    with warnings.catch_warnings():  # tau 0 may replay nothing on this random model: not what is measured here
        warnings.simplefilter("ignore", ThresholdWarning)
        run = sess.generate(prompt[None], FRAMES)
    out = {}
    for layer in ("0", "1"):
        executed, dense, recall, queries = np.stack([s[contract.kv_stats_output(int(layer))]
                                                     for s in seen]).sum(axis=(0, 1, 2))
        out[layer] = {"density": executed / dense, "recall": recall / queries,
                      "kv_bytes": run.stats.kv_diagnostics[layer]["kv_bytes"]}
    return out


def test_eval_pools_every_video_and_prints_them(compressed, capsys):
    d, prompts = compressed
    out = d / "ev"
    assert main(["eval", "--model", str(d / "fast.onnx"), "--prompts", str(d / "p.npy"), "--frames", str(FRAMES),
                 "--threads", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    alone = [_one_video(d / "fast.onnx", p) for p in prompts]
    for key in ("density", "recall"):  # the videos differ (TempCache merges by content)
        assert alone[0]["1"][key] != pytest.approx(alone[1]["1"][key], rel=1e-3), key
    res = json.loads((out / "eval.json").read_text())
    saved = json.loads((out / "fast.json").read_text())
    for diag, per_video in ((res["kv_diagnostics"], res["kv_diagnostics_per_video"]),
                            (saved["kv_diagnostics"], saved["kv_diagnostics_per_video"])):
        assert len(per_video) == 2
        for layer in ("0", "1"):
            for key in ("density", "recall", "kv_bytes"):  # equal-length videos: pooled = the mean of the videos
                assert diag[layer][key] == pytest.approx(np.mean([a[layer][key] for a in alone]), rel=1e-6)
                for v, a in zip(per_video, alone, strict=True):
                    assert v[layer][key] == pytest.approx(a[layer][key], rel=1e-6)
    assert "KV cache against dense attention on the side, over 2 video(s)" in text
    assert f"layer 1: density {100 * res['kv_diagnostics']['1']['density']:.1f}%" in text
    assert (out / "fast.kv.png").is_file() and str(out / "fast.kv.png") in res["files"]
    assert main(["report", str(out / "fast.json"), "-o", str(d / "rep")]) == 0
    text = capsys.readouterr().out
    assert "over 2 video(s)" in text and "resident KV" in text and (d / "rep" / "fast.kv.png").is_file()


def test_one_batch_keeps_each_row(compressed):
    """A batch-2 generate call lists each row as a video: each equals that prompt run alone."""
    from fastcar_compile.runtime import FastCarSession

    d, prompts = compressed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ThresholdWarning)
        run = FastCarSession(d / "fast.onnx", threads=1).generate(prompts, FRAMES)
    alone = [_one_video(d / "fast.onnx", p) for p in prompts]
    assert len(run.stats.kv_diagnostics_per_video) == 2
    for v, a in zip(run.stats.kv_diagnostics_per_video, alone, strict=True):
        for layer in ("0", "1"):
            for key in ("density", "recall", "kv_bytes"):
                assert v[layer][key] == pytest.approx(a[layer][key], rel=1e-6), (layer, key)
