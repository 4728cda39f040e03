"""Sampled decoding of the demo videos against an independent reference: the tests' own ORT loop over the bundled
1-layer model (conditional and unconditional rows in one batch), guidance, masking, temperature, top-k and top-p
done here in PyTorch, one uniform per step from a NumPy generator seeded as the clip's seed; the demo's
generation must choose exactly the same tokens. Plus: dense and FastCar share the seed, no label token is ever
drawn, and the command-line options."""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ort_driver  # noqa: E402

from fastcar_compile.core.errors import FastCarError  # noqa: E402
from fastcar_compile.demo import data  # noqa: E402
from fastcar_compile.demo.decoding import (  # noqa: E402
    GREEDY,
    SAMPLED,
    Decoding,
    add_decoding_args,
    clip_seed,
    decoding_from_args,
)
from fastcar_compile.demo.evaluate import load_tokenizer  # noqa: E402
from fastcar_compile.demo.export import ONNX  # noqa: E402
from fastcar_compile.demo.model import BOS, CODES, VIDEO_START, VIDEO_START_TOKEN, VOCAB, prompt  # noqa: E402
from fastcar_compile.demo.video import generate_video, open_session  # noqa: E402


def _choose(logits: np.ndarray, d: Decoding, u: float) -> int:
    """One token from [vocab] float64 logits, as the papers define the filters (PyTorch ops)."""
    x = torch.from_numpy(logits.copy())
    x[CODES:] = -float("inf")
    if not d.do_sample:
        return int(x.argmax())
    x = x / d.temperature
    if d.top_k:
        kth = torch.topk(x, d.top_k).values[-1]
        x = torch.where(x < kth, torch.tensor(-float("inf"), dtype=x.dtype), x)
    p = torch.softmax(x, 0)
    if d.top_p < 1:
        sp, idx = torch.sort(p, descending=True, stable=True)
        before = torch.cumsum(sp, 0) - sp  # mass of the likelier tokens
        keep = torch.zeros_like(p, dtype=torch.bool)
        keep[idx[before < d.top_p]] = True
        p = torch.where(keep, p, torch.zeros_like(p))
    cdf = torch.cumsum(p, 0).numpy()
    return int(np.searchsorted(cdf, u * cdf[-1], side="left"))


def _reference(rows: list[list[int]], n: int, d: Decoding, seed: int) -> np.ndarray:
    """n tokens; rows = [conditional] or [conditional, unconditional] prompts (CFG); both rows get the token."""
    sess = ort_driver.make_session(ONNX)
    names = [o.name for o in sess.get_outputs()]
    state = ort_driver.initial_state(sess, len(rows))
    rng = np.random.default_rng(seed)
    ids, past, out = np.array(rows, np.int64), 0, []
    while len(out) < n:
        s = ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": np.ones((len(rows), past + s), np.int64),
                 "position_ids": np.repeat(np.arange(past, past + s)[None], len(rows), 0), **state}
        res = dict(zip(names, sess.run(names, feeds), strict=True))
        for k, v in res.items():
            if ort_driver.past_name_for(k) in state:
                state[ort_driver.past_name_for(k)] = v
        past += s
        last = res["logits"][:, -1].astype(np.float64)
        g = last[1] + d.cfg_scale * (last[0] - last[1]) if len(rows) == 2 else last[0]
        u = float(rng.random(1)[0]) if d.do_sample else 0.0
        out.append(_choose(g, d, u))
        ids = np.full((len(rows), 1), out[-1], np.int64)
    return np.array(out)


@pytest.mark.parametrize("d, cfg", [(Decoding(temperature=1.3, top_k=40, top_p=0.9), False),
                                    (Decoding(temperature=0.8, top_k=0, top_p=0.96, cfg_scale=3.0), True),
                                    (GREEDY, False)])
def test_demo_sampling_matches_reference(d: Decoding, cfg: bool) -> None:
    tok = load_tokenizer()
    clip = data.make_clips("eval", 1, 2)[0]
    f0 = [int(t) for t in tok.encode(clip.frames)[0]]
    # the bundled model has no unconditional prompt: another motion's prompt stands in, as CFG only needs a row
    uncond = [BOS, prompt("drift")[1], VIDEO_START_TOKEN] if cfg else None
    seed = clip_seed(7, 3)
    run = generate_video(open_session(ONNX), prompt(clip.motion), f0, 1, decoding=d, seed=seed, uncond_ids=uncond)
    rows = [prompt(clip.motion) + f0] + ([uncond + f0] if cfg else [])
    want = _reference(rows, len(f0), d, seed)
    np.testing.assert_array_equal(run.tokens[0], f0)
    np.testing.assert_array_equal(run.tokens[1], want)
    if d.do_sample:  # sampling really samples here: the greedy video differs
        assert not np.array_equal(want, _reference(rows, len(f0), replace(d, do_sample=False), seed))


def test_only_image_codes_are_drawn_and_seeds_differ_per_clip() -> None:
    """A hot temperature makes the special tokens likely were they not masked; two clip seeds, two videos."""
    tok = load_tokenizer()
    clip = data.make_clips("eval", 1, 2)[0]
    f0 = tok.encode(clip.frames)[0]
    hot = Decoding(temperature=50.0)
    sess = open_session(ONNX)
    a = generate_video(sess, prompt(clip.motion), f0, 1, decoding=hot, seed=clip_seed(0, 0))
    b = generate_video(sess, prompt(clip.motion), f0, 1, decoding=hot, seed=clip_seed(0, 1))
    assert a.tokens.max() < CODES and b.tokens.max() < CODES and VOCAB > CODES
    assert not np.array_equal(a.tokens, b.tokens)
    assert clip_seed(0, 1) != clip_seed(1, 0) and clip_seed(3, 2) == clip_seed(3, 2)
    assert VIDEO_START == len(prompt(clip.motion))


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_decoding_args(ap)
    return ap.parse_args(list(argv))


def test_decoding_options() -> None:
    assert decoding_from_args(_args(), SAMPLED) == SAMPLED
    assert decoding_from_args(_args("--greedy"), SAMPLED) == GREEDY
    d = decoding_from_args(_args("--top-k", "10", "--cfg-scale", "1"), SAMPLED)
    assert d.top_k == 10 and d.cfg_scale is None and d.top_p == SAMPLED.top_p and d.do_sample
    for argv, msg in ((("--temperature", "0"), "temperature"), (("--top-p", "1.5"), "top_p"),
                      (("--top-k", "-1"), "top_k"), (("--greedy", "--top-k", "3"), "--greedy"),
                      (("--sample-seed", "-1"), "--sample-seed")):
        with pytest.raises(FastCarError, match=msg):
            decoding_from_args(_args(*argv), SAMPLED)
    g = SAMPLED.generation_config(CODES, VOCAB)
    assert g["do_sample"] and g["top_k"] == SAMPLED.top_k and g["suppress_tokens"] == list(range(CODES, VOCAB))
    assert GREEDY.generation_config(CODES, VOCAB) == {"do_sample": False, "suppress_tokens": list(range(CODES, VOCAB))}


def test_video_model_missing_files_say_what_to_do(tmp_path) -> None:
    from fastcar_compile.demo.bundled import video_files

    with pytest.raises(FastCarError, match="video.safetensors, video.json, video_tokenizer.npz not found.*--demo-model small"):
        video_files(tmp_path)
