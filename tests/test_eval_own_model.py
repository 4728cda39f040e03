"""`fastcar-compile eval --model fast.onnx --prompts p.npy` and `report fast.json dense.json`: the numbers
match direct runs of the dense and compiled models (NumPy KL, tokens, replay from the trace)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import zoo

from fastcar_compile.cli import main
from fastcar_compile.runtime import FastCarSession
from fastcar_compile.runtime.decode import left_pad

L = 8


@pytest.fixture(scope="module")
def setup(zoo_model, tmp_path_factory):
    import fastcar_compile as fc

    d = tmp_path_factory.mktemp("ev")
    dense = zoo_model("llama", "dynamo20")
    fc.compile(str(dense), str(d / "fast.onnx"), frame_tokens=L, threshold=0.0)
    np.save(d / "p.npy", np.random.default_rng(5).integers(0, zoo.VOCAB, (4, 3)))
    return dense, d


def _log_softmax(x):
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_eval_own_model_matches_direct_runs(setup, capsys):
    dense_path, d = setup
    out = d / "out"
    assert main(["eval", "--model", str(d / "fast.onnx"), "--dense", str(dense_path), "--prompts",
                 str(d / "p.npy"), "--frames", "3", "--batch", "2", "--threads", "1", "--out", str(out),
                 "--frame-shape", "2x4", "--rounds", "1"]) == 0
    text = capsys.readouterr().out
    assert "speed-up" in text and "KL(dense || FastCar)" in text
    res = json.loads((out / "eval.json").read_text())
    for f in res["files"]:
        assert (out / f.split("/")[-1]).is_file()
    prompts = np.load(d / "p.npy")
    fast, dense = FastCarSession(d / "fast.onnx", threads=1), FastCarSession(dense_path, frame_tokens=L, threads=1)
    f = fast.generate(prompts, 3, keep_logits=True)
    g = dense.generate(prompts, 3)
    assert res["replay_ratio"] == pytest.approx(f.stats.replay_array().mean())
    assert res["token_agreement"] == pytest.approx((f.tokens == g.tokens).mean())
    ids, mask = left_pad([list(r) for r in prompts], 0)
    seq = np.concatenate([ids, f.tokens[:, :-1]], 1)
    full = np.concatenate([mask, np.ones_like(f.tokens[:, :-1])], 1)
    p = dense.step(dense.new_state(len(prompts)), seq, attention_mask=full).logits[:, ids.shape[1] - 1:]
    lp, lq = _log_softmax(p), _log_softmax(f.logits)
    assert res["kl_mean"] == pytest.approx(float((np.exp(lp) * (lp - lq)).sum(-1).mean()), rel=1e-4)
    assert res["speedup"] == pytest.approx(res["dense_ms_per_token"] / res["fast_ms_per_token"])
    assert 0 < res["replay_ratio"] < res["replay_ratio_eligible"] < 1
    # the speed-up as its factors, from the three runs' own traces: input model -> compiled at tau=+inf -> FastCar
    from fastcar_compile.runtime.stats import RunStats

    runs = {k: RunStats.load(out / f"{k}.json") for k in ("dense", "fast_inf", "fast")}
    ms = {k: r.ms_per_token for k, r in runs.items()}
    assert res["inf_ms_per_token"] == pytest.approx(ms["fast_inf"]) and res["dense_ms_per_token"] == ms["dense"]
    assert res["speedup_graph"] == pytest.approx(ms["dense"] / ms["fast_inf"])
    assert res["speedup_replay"] == pytest.approx(ms["fast_inf"] / ms["fast"])
    assert res["speedup"] == pytest.approx(res["speedup_graph"] * res["speedup_replay"])
    assert runs["fast_inf"].threshold == float("inf") and runs["fast_inf"].replay_array().sum() == 0
    assert runs["fast_inf"].videos == runs["dense"].videos == runs["fast"].videos == 2
    # tau=+inf is the compiled model's overridable input, no recompile: its greedy tokens are the input model's
    inf = fast.generate(prompts, 3, threshold=float("inf"))
    assert (inf.tokens == g.tokens).all() and res["inf_token_agreement"] == 1.0
    for line in ("graph/attention", "replay", "in all", "compiled at tau=+inf"):
        assert line in text


def test_eval_repeats_its_rounds_and_prints_median_and_range(setup, capsys):
    """--rounds 3: each factor is the median of three interleaved rounds' values, printed with their range; the
    quality figures and traces are those of one round (the same greedy videos: 2 per model)."""
    import statistics

    from fastcar_compile.runtime.stats import RunStats

    dense_path, d = setup
    out = d / "rounds"
    assert main(["eval", "--model", str(d / "fast.onnx"), "--dense", str(dense_path), "--prompts",
                 str(d / "p.npy"), "--frames", "3", "--batch", "2", "--threads", "1", "--out", str(out),
                 "--rounds", "3"]) == 0
    text = capsys.readouterr().out
    res = json.loads((out / "eval.json").read_text())
    assert res["rounds"] == 3
    for key in ("speedup_graph", "speedup_replay", "speedup"):
        values = res[f"{key}_rounds"]
        assert len(values) == 3 and res[key] == pytest.approx(statistics.median(values))
        assert res[f"{key}_range"] == [min(values), max(values)]
        lo, hi = res[f"{key}_range"]
        assert f"{statistics.median(values):.2f}x ({lo:.2f}-{hi:.2f})" in text
    assert "median (lowest-highest) of 3 interleaved rounds" in text
    assert RunStats.load(out / "fast.json").videos == 2
    assert main(["eval", "--model", str(d / "fast.onnx"), "--prompts", str(d / "p.npy"), "--out", str(d / "r0"),
                 "--rounds", "0"]) == 2
    assert "--rounds" in capsys.readouterr().err


def test_report_compares_runs_and_draws_tokens(setup, tmp_path, capsys):
    _, d = setup
    fast = FastCarSession(d / "fast.onnx", threads=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = fast.generate([[1, 2, 3]], 3, threshold=-1e9, trace=str(tmp_path / "all.json"))
    m = r.stats.per_token_replay()  # tau=-1e9: every eligible token replays, frame 0 never
    assert m.shape == (3, L) and (m[0] == 0).all() and (m[1] == 1).all() and (m[2, :-1] == 1).all()
    fast.generate([[1, 2, 3]], 3, threshold=float("inf"), trace=str(tmp_path / "inf.json"))
    FastCarSession(setup[0], frame_tokens=L, threads=1).generate([[1, 2, 3]], 3, trace=str(tmp_path / "d.json"))
    assert main(["report", str(tmp_path / "d.json"), str(tmp_path / "all.json"), "--frame-shape", "2x4"]) == 0
    text = capsys.readouterr().out
    assert "speed-up" in text
    for name in ("all.latency.png", "all.replay.png", "all.tokens.png"):
        assert (tmp_path / name).is_file()
    assert main(["report", str(tmp_path / "all.json"), str(tmp_path / "inf.json"), str(tmp_path / "d.json")]) == 0
    text = capsys.readouterr().out
    assert "graph/attention" in text and "replay" in text and "in all" in text
    assert main(["report", str(tmp_path / "all.json"), str(tmp_path / "all.json")]) == 2
    assert "one FastCar run" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "all.json"), "--frame-shape", "3x3"]) == 2
    assert "8 tokens per frame" in capsys.readouterr().err


def test_eval_bad_input(setup, tmp_path, capsys):
    dense_path, d = setup
    assert main(["eval", "--model", str(d / "fast.onnx")]) == 2
    assert "--prompts" in capsys.readouterr().err
    assert main(["eval", "--model", str(dense_path), "--prompts", str(d / "p.npy"), "--out", str(tmp_path)]) == 2
    assert "not FastCar-compiled" in capsys.readouterr().err
    np.save(tmp_path / "f.npy", np.zeros((2, 3), np.float32))
    assert main(["eval", "--model", str(d / "fast.onnx"), "--prompts", str(tmp_path / "f.npy")]) == 2
    assert "integer token ids" in capsys.readouterr().err
