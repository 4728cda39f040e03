"""Speculative decoding inside onnxruntime-genai's generator on the long demo model: plain genai vs genai's n-gram
lookup vs the previous-frame draft model (`fastcar-compile genai-speculate`), greedy, tokens checked identical.

    python benchmarks/experiments/genai_speculation.py                       # 4 frames after a given frame 0, 5 rounds
    python benchmarks/experiments/genai_speculation.py --frames 8 --rounds 3 --clips 0,1

Each round runs every variant once on every clip (interleaved, so load drift hits all alike); per variant the
median over rounds of the decode time (append of the prompt + frame 0, then `generate_next_token` to the end),
tokens/s and the ratio to plain genai in the same round. 1 intra-op thread. Writes --out (JSON + Markdown).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fastcar_compile.core.atomic import write_text
from fastcar_compile.runtime.genai_draft import write as write_speculation

VARIANTS = {  # name -> genai-speculate's --draft (None: the plain folder)
    "plain genai": None,
    "genai n-gram (ngram_size 4, K 16)": "ngram:16",
    "temporal draft K 4": "temporal:4",
    "temporal draft K 8": "temporal:8",
    "temporal draft K 16": "temporal:16",
    "temporal draft, adaptive K": "temporal",
}


def _threads(folder: Path, threads: int) -> None:
    cfg_path = folder / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    for block in ("decoder", "draft"):
        if block in cfg["model"]:
            so = cfg["model"][block].setdefault("session_options", {})
            so["intra_op_num_threads"], so["inter_op_num_threads"] = threads, 1
    write_text(cfg_path, json.dumps(cfg, indent=4))


def _run(og, folder: Path, ids: list[int], n: int) -> tuple[np.ndarray, float, dict]:
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + n, do_sample=False)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(np.asarray([ids], np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    dt = time.perf_counter() - t0
    stats = gen.get_speculative_stats() if "speculative" in json.loads((folder / "genai_config.json").read_text()) \
        else {}
    return np.array(gen.get_sequence(0))[len(ids):], dt, stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=4, help="frames generated after the given frame 0")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clips", default="0", help="eval clips (comma-separated)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/bench/genai_speculation"), help="output stem (.json, .md)")
    a = ap.parse_args(argv)
    import onnxruntime_genai as og
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common (long_video sits next to this script)
    from long_video import long_genai_dir

    from fastcar_compile.demo import data
    from fastcar_compile.demo.evaluate import load_tokenizer
    from fastcar_compile.demo.model import prompt

    tok = load_tokenizer()
    L = tok.tokens_per_frame
    n = a.frames * L
    src = long_genai_dir()
    prompts = []
    for clip in (int(c) for c in a.clips.split(",")):
        c = data.make_clip("eval", clip, 2, seed=0)
        prompts.append(prompt(c.motion) + [int(t) for t in tok.encode(c.frames[:1]).reshape(-1)])
    res: dict = {"command": "python benchmarks/experiments/genai_speculation.py " + " ".join(argv or sys.argv[1:]),
                 "frame_tokens": L, "tokens": n, "clips": a.clips, "threads": a.threads, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for name, draft in VARIANTS.items():
            if draft is None:
                folders[name] = Path(tmp) / "plain"
                write_speculation(src, folders[name], "ngram", None)  # the same files, speculation removed below
                cfg = json.loads((folders[name] / "genai_config.json").read_text())
                del cfg["speculative"]
                write_text(folders[name] / "genai_config.json", json.dumps(cfg, indent=4))
            else:
                folders[name] = Path(tmp) / draft.replace(":", "-")
                write_speculation(src, folders[name], draft, L)
            _threads(folders[name], a.threads)
        times = {name: [] for name in VARIANTS}
        stats = {name: [] for name in VARIANTS}
        same = dict.fromkeys(VARIANTS, True)
        for r in range(a.rounds):
            for ids in prompts:
                ref = None
                for name in VARIANTS:
                    toks, dt, st = _run(og, folders[name], ids, n)
                    ref = toks if ref is None else ref
                    same[name] &= bool(np.array_equal(toks, ref))
                    times[name].append(dt)
                    stats[name].append(st)
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{k} {1e3 * v[-1]:.0f} ms" for k, v in times.items()),
                  flush=True)
    plain = np.array(times["plain genai"])
    lines = [f"onnxruntime-genai {og.__version__}, long demo model (genai fp32 cpu graph), greedy, {a.frames} frames "
             f"({n} tokens) after prompt + given frame 0, clips {a.clips}, {a.threads} thread(s), {a.rounds} "
             "interleaved rounds, shared machine (ratios within the run).\n",
             "| variant | tokens/s | x plain genai | draft acceptance | tokens / target step | tokens identical |",
             "|---|---:|---:|---:|---:|---|"]
    for name in VARIANTS:
        t = np.array(times[name])
        st = [s for s in stats[name] if s]
        acc = np.mean([s["draft_tokens_accepted"] / max(s["draft_tokens_evaluated"], 1) for s in st]) if st else None
        per = np.mean([s["tokens_emitted"] / max(s["target_forward_passes"], 1) for s in st]) if st else 1.0
        row = {"tokens_per_s": float(n / np.median(t)), "x_plain": float(np.median(plain / t)),
               "acceptance": None if acc is None else float(acc), "tokens_per_target_step": float(per),
               "identical": same[name], "seconds": [float(x) for x in t]}
        res["variants"][name] = row
        lines.append(f"| {name} | {row['tokens_per_s']:.0f} | {row['x_plain']:.2f}x | "
                     f"{'-' if acc is None else f'{100 * acc:.0f}%'} | {per:.2f} | {'yes' if same[name] else 'NO'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_text(a.out.with_suffix(".md"), text)
    write_text(a.out.with_suffix(".json"), json.dumps(res, indent=1))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
