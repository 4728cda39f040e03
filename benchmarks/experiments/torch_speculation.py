"""Speculative decoding in the PyTorch front end on the long demo model: plain greedy `generate()` of the FastCar
model vs `fastcar_compile.torch.speculate.generate` (previous-frame candidates), at tau = +inf (dense) and at
the long model's tau, greedy, tokens checked identical.

    python benchmarks/experiments/torch_speculation.py                  # 2 frames after a given frame 0, 3 rounds
    python benchmarks/experiments/torch_speculation.py --frames 4 --draft-tokens 8,16,32

Each round runs every variant once (interleaved); per variant the median over rounds of generate()'s wall time
(prefill included), tokens/s and the ratio to plain generate() at the same tau in the same round. 1 thread.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fastcar_compile.core.atomic import write_text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=2, help="frames generated after the given frame 0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clip", type=int, default=0)
    ap.add_argument("--draft-tokens", default="4,8,16", help="fixed K values (comma-separated; <= L - 1)")
    ap.add_argument("--out", type=Path, default=None, help="output stem (.json, .md); default: print only")
    a = ap.parse_args(argv)
    import fastcar_compile.torch as fct
    from fastcar_compile.demo import data
    from fastcar_compile.demo.evaluate import load_tokenizer
    from fastcar_compile.demo.export import LONG_CONFIG, LONG_WEIGHTS, load_model
    from fastcar_compile.demo.longvideo import DEFAULT_LONG_TAU
    from fastcar_compile.demo.model import VIDEO_START, prompt
    from fastcar_compile.torch import speculate

    torch.set_num_threads(1)
    tok = load_tokenizer()
    L = tok.tokens_per_frame
    c = data.make_clip("eval", a.clip, 2, seed=0)
    ids = torch.as_tensor([prompt(c.motion) + [int(t) for t in tok.encode(c.frames[:1]).reshape(-1)]])
    n = a.frames * L
    model = load_model(LONG_WEIGHTS, LONG_CONFIG)
    ks = [int(k) for k in a.draft_tokens.split(",")]
    res: dict = {"command": "python benchmarks/experiments/torch_speculation.py " + " ".join(argv or sys.argv[1:]),
                 "frame_tokens": L, "tokens": n, "clip": a.clip, "taus": {}}
    lines = [f"PyTorch front end, long demo model, greedy, {a.frames} frames ({n} tokens) after prompt + given frame "
             f"0 (eval clip {a.clip}), 1 thread, {a.rounds} interleaved rounds, shared machine (ratios within the "
             "run).\n", "| tau | variant | tokens/s | x plain generate | candidates accepted | tokens identical |",
             "|---|---|---:|---:|---:|---|"]
    for tau in (math.inf, DEFAULT_LONG_TAU):
        fm = fct.apply(model, frame_tokens=L, threshold=tau, video_start=VIDEO_START)
        names = ["plain generate"] + [f"temporal K {k}" for k in ks] + ["temporal adaptive K"]
        times = {v: [] for v in names}
        acc, same, ref = {}, dict.fromkeys(names, True), None
        with torch.no_grad():
            for _ in range(a.rounds):
                for name in names:
                    t0 = time.perf_counter()
                    if name == "plain generate":
                        out = fm.generate(ids, max_new_tokens=n, do_sample=False)
                    else:
                        k = None if name.endswith("adaptive K") else int(name.split()[-1])
                        out = speculate.generate(fm, ids, draft_tokens=k, max_new_tokens=n, do_sample=False)
                        g = fm.fastcar.last_candidates
                        acc[name] = g.accepted / max(g.proposed, 1)
                    times[name].append(time.perf_counter() - t0)
                    ref = out if ref is None else ref
                    same[name] &= bool(torch.equal(out, ref))
        plain = np.array(times["plain generate"])
        rows = {}
        for name in names:
            t = np.array(times[name])
            rows[name] = {"tokens_per_s": float(n / np.median(t)), "x_plain": float(np.median(plain / t)),
                          "acceptance": acc.get(name), "identical": same[name], "seconds": t.tolist()}
            lines.append(f"| {tau} | {name} | {rows[name]['tokens_per_s']:.0f} | {rows[name]['x_plain']:.2f}x | "
                         f"{'-' if name not in acc else f'{100 * acc[name]:.0f}%'} | {'yes' if same[name] else 'NO'} |")
        res["taus"][str(tau)] = rows
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out is not None:
        write_text(a.out.with_suffix(".md"), text)
        write_text(a.out.with_suffix(".json"), json.dumps(res, indent=1))
    return 0 if all(r["identical"] for rows in res["taus"].values() for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
