"""Speculative decoding (generate(draft=...)): tokens/s against plain decoding of the same dense model, draft
acceptance, and whether greedy tokens stay identical; onnxruntime-genai's n-gram speculation beside it.

Models (`--models`, comma-separated):
- `video`: the conditioned video model of training/video_model (6 layers, hidden 256, frames of 8x8 tokens,
  its VQ-VAE tokenizer) on held-out scene clips (frame 0 given, labels as the prompt);
- `long`: the long demo model (4 layers, hidden 128, the bundled k-means tokenizer) on held-out demo clips;
- `llama1024`: the seeded random LLaMA of the other benchmarks (hidden 1024, 8 layers, 16 / 2 heads, MLP 3072,
  vocab 2048), prompted with the video model's clips' tokens: random weights carry no temporal redundancy, so
  it measures what a verify step costs at whatever acceptance such a model gives.
Modes: plain decoding, then drafts `temporal:K` for each `--k` plus adaptive `temporal`, greedy and sampled
(temperature 1, video tokens only); each clip runs every mode in turn (order rotating), and every ratio is
tokens/s of a mode over tokens/s of plain decoding in the same run, decode only (prefill excluded).
`genai`: the model builder's graph of the same weights in og.Generator, plain vs
`set_speculative_options(ngram_size=4, max_draft_tokens=16)`, greedy and sampled (genai 0.18 accepts the
options with sampling but falls back to plain steps for most of them: `genai_fallback_steps` of the json).

    python benchmarks/speculation.py                          # video + long, ~3.5 min on 2 cores (+ genai)
    python benchmarks/speculation.py --models llama1024 --clips 2 --frames 1   # ~4 min
    python benchmarks/speculation.py --models video --clips 8 --frames 8
    python benchmarks/speculation.py --quick                  # long model, 1 clip x 2 frames: smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_CACHE, LlamaShape, build_random_llama, cached_export, save_results  # noqa: E402

LLAMA = LlamaShape(hidden=1024, layers=8, heads=16, kv_heads=2, intermediate=3072, vocab=2048, max_pos=4608)


def _bundled(name: str, long: bool, clips: int):
    """(transformers model, ONNX, L, prompts with frame 0, uncond prompt, codes, recommended decoding) of a
    demo model (fastcar_compile/demo/bundled.py)."""
    from fastcar_compile.demo.bundled import spec

    sp = spec(name, long)
    tok = sp.tokenizer()
    cl = sp.clips(clips, 4, 0)
    prompts = [sp.prompt(c) + [int(t) for t in tok.encode(c.frames)[0]] for c in cl]
    return (lambda: _torch_model(name, long)), sp.onnx(), tok.tokens_per_frame, prompts, sp.uncond, sp.codes, \
        sp.decoding


def _torch_model(name: str, long: bool):
    from fastcar_compile.demo.bundled import VIDEO_MODEL_DIR
    from fastcar_compile.demo.export import LONG_CONFIG, LONG_WEIGHTS, load_model

    if name == "video":
        return load_model(VIDEO_MODEL_DIR / "video.safetensors", VIDEO_MODEL_DIR / "video.json")
    return load_model(LONG_WEIGHTS, LONG_CONFIG)


def _llama(clips: int):
    from fastcar_compile.demo.decoding import SAMPLED

    _, _, L, prompts, _, codes, _ = _bundled("video", False, clips)
    # no unconditional prompt: the random model has no trained conditioning
    return (lambda: build_random_llama(LLAMA)), cached_export(LLAMA, DEFAULT_CACHE), L, prompts, None, codes, \
        SAMPLED


MODELS = {"video": lambda n: _bundled("video", False, n), "long": lambda n: _bundled("small", True, n),
          "llama1024": _llama}


def _genai_folder(model, name: str, vocab: int) -> Path | None:
    """The genai model builder's fp32 cpu graph of `model` (cached); None when the builder fails."""
    import hashlib

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    h = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode()
                       + next(model.parameters()).detach().numpy().tobytes()[:4096]).hexdigest()[:12]
    out = DEFAULT_CACHE / f"spec-genai-{name}-{h}"
    if (out / "genai_config.json").is_file():
        return out
    with tempfile.TemporaryDirectory(dir=DEFAULT_CACHE) as tmp:
        hf = Path(tmp) / "hf"
        model.save_pretrained(hf)
        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                                pad_token="t0").save_pretrained(hf)
        print(f"building the genai graph of {name} ...", file=sys.stderr, flush=True)
        r = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o",
                            str(Path(tmp) / "out"), "-p", "fp32", "-e", "cpu", "-c", str(Path(tmp) / "c")],
                           capture_output=True, text=True)
        if r.returncode:
            print(f"genai builder failed on {name}: {(r.stderr or r.stdout).strip().splitlines()[-1:]}",
                  file=sys.stderr)
            return None
        (Path(tmp) / "out").rename(out)
    return out


def _genai_run(folder: Path, threads: int, prompt: list[int], n: int, ngram: bool, search: dict
               ) -> tuple[list[int], float, dict]:
    """One video in og.Generator: (generated tokens, decode seconds, speculative stats)."""
    import onnxruntime_genai as og

    cfg = json.loads((folder / "genai_config.json").read_text())
    opts = cfg["model"]["decoder"].setdefault("session_options", {})
    if opts.get("intra_op_num_threads") != threads:
        opts.update(intra_op_num_threads=threads, inter_op_num_threads=1)
        (folder / "genai_config.json").write_text(json.dumps(cfg, indent=1))
        _GENAI_MODELS.pop(folder, None)
    model = _GENAI_MODELS.get(folder) or _GENAI_MODELS.setdefault(folder, og.Model(str(folder)))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n, min_length=len(prompt) + n, **search)
    if ngram:
        params.set_speculative_options(ngram_size=4, max_draft_tokens=16)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray([prompt], np.int32))
    t0 = time.perf_counter()
    while not gen.is_done():
        gen.generate_next_token()
    dt = time.perf_counter() - t0
    stats = gen.get_speculative_stats() if ngram else {}
    return [int(t) for t in gen.get_sequence(0)[len(prompt):]], dt, stats


_GENAI_MODELS: dict = {}


def run_model(name: str, a) -> list[dict]:
    from fastcar_compile.demo.decoding import code_mask
    from fastcar_compile.runtime import FastCarSession

    model, onnx, L, prompts, uncond, codes, decoding = MODELS[name](a.clips)
    sess = FastCarSession(onnx, frame_tokens=L, threads=a.threads)
    modes = ["dense"] + [f"temporal:{k}" for k in a.k] + ["temporal"] + (["ngram"] if a.ngram else [])
    rows = []
    for sample in (False, True):
        kw: dict = dict(logits_processor=code_mask(codes), progress=False, given_video_tokens=L)
        if sample:  # the model's recommended sampling, CFG with its unconditional prompt where it has one
            kw.update(do_sample=True, temperature=decoding.temperature, top_k=decoding.top_k, top_p=decoding.top_p)
            if uncond is not None and decoding.cfg_scale is not None:
                kw.update(cfg_scale=decoding.cfg_scale)
        acc = {m: {"tokens": 0, "s": 0.0, "proposed": 0, "accepted": 0, "steps": 0, "same": 0} for m in modes}
        for i, p in enumerate(prompts):
            if "cfg_scale" in kw:  # the unconditional row: its prompt, then the same given frame 0
                kw["uncond_prompt_ids"] = [uncond + p[len(p) - L:]]
            got = {}
            for m in modes[i % len(modes):] + modes[: i % len(modes)]:
                t0 = time.perf_counter()
                res = sess.generate([p], a.frames, draft=None if m == "dense" else m, seed=i, **kw)
                dt = time.perf_counter() - t0 - res.stats.prefill_ms / 1e3
                st, r = res.stats, acc[m]
                r["tokens"] += res.tokens.shape[1] - 1
                r["s"] += dt
                r["proposed"] += st.draft_proposed
                r["accepted"] += st.draft_accepted
                r["steps"] += st.verify_steps or res.tokens.shape[1] - 1
                got[m] = res.tokens
            ref = got["dense"]
            for m in modes:
                acc[m]["same"] += int(np.array_equal(got[m], ref))
        base = acc["dense"]["tokens"] / acc["dense"]["s"]
        for m in modes:
            r = acc[m]
            tps = r["tokens"] / r["s"]
            rows.append({"model": name, "decoding": _describe(kw) if sample else "greedy", "mode": m,
                         "tokens_per_s": tps, "speedup": tps / base,
                         "acceptance": r["accepted"] / r["proposed"] if r["proposed"] else None,
                         "tokens_per_step": r["tokens"] / r["steps"],
                         "videos_identical_to_dense": f"{r['same']}/{len(prompts)}" if not sample else None})
            print(_line(rows[-1]), flush=True)
    if a.genai:
        rows += _genai_rows(name, model(), prompts, L * a.frames, a.threads, decoding)
    return rows


def _describe(kw: dict) -> str:
    cfg = f", CFG {kw['cfg_scale']:g}" if "cfg_scale" in kw else ""
    return f"sampled (T {kw['temperature']:g}, top-k {kw['top_k']}, top-p {kw['top_p']:g}{cfg})"


def _genai_rows(name: str, model, prompts: list[list[int]], n: int, threads: int, decoding) -> list[dict]:
    """genai plain vs its n-gram speculation (ngram_size 4, up to 16 draft tokens), greedy and sampled with the
    model's temperature / top-k / top-p (no CFG, no code mask: genai's loop has neither here)."""
    folder = _genai_folder(model, name, model.config.vocab_size)
    if folder is None:
        return []
    rows = []
    sampled = dict(do_sample=True, temperature=decoding.temperature, top_k=decoding.top_k, top_p=decoding.top_p)
    for label, search in (("greedy", dict(do_sample=False)), ("sampled, no CFG", sampled)):
        acc = {False: [0, 0.0, []], True: [0, 0.0, []]}
        stats = []
        for i, p in enumerate(prompts):
            for ngram in ((False, True) if i % 2 == 0 else (True, False)):
                toks, dt, st = _genai_run(folder, threads, p, n, ngram, search)
                acc[ngram][0] += len(toks)
                acc[ngram][1] += dt
                acc[ngram][2].append(toks)
                if st:
                    stats.append(st)
        same = sum(a == b for a, b in zip(acc[False][2], acc[True][2], strict=True))
        base = acc[False][0] / acc[False][1]
        for ngram in (False, True):
            tps = acc[ngram][0] / acc[ngram][1]
            prop = sum(st["draft_tokens_proposed"] for st in stats)
            rows.append({"model": name, "decoding": f"genai {label}", "mode": "genai n-gram 4/16" if ngram else
                         "genai plain", "tokens_per_s": tps, "speedup": tps / base,
                         "acceptance": sum(st["draft_tokens_accepted"] for st in stats) / prop if ngram and prop
                         else None, "tokens_per_step": None,
                         "videos_identical_to_dense": f"{same}/{len(prompts)} (vs genai plain)" if ngram and
                         label == "greedy" else None,
                         "genai_fallback_steps": sum(st["standard_fallback_steps"] for st in stats) if ngram else None,
                         "genai_rounds": sum(st["rounds"] for st in stats) if ngram else None})
            print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    acc = "" if r["acceptance"] is None else f"  accepted {100 * r['acceptance']:5.1f}%"
    tps = "" if r["tokens_per_step"] is None else f"  {r['tokens_per_step']:.2f} tok/step"
    same = f"  identical {r['videos_identical_to_dense']}" if r["videos_identical_to_dense"] else ""
    return (f"{r['model']:9s} {r['decoding'][:7]:7s} {r['mode']:18s} {r['tokens_per_s']:8.1f} tok/s  "
            f"{r['speedup']:.2f}x{acc}{tps}{same}")


def table(rows: list[dict]) -> str:
    head = "| model | decoding | mode | tokens/s | vs plain | draft accepted | tokens / step | greedy identical |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        acc = "" if r["acceptance"] is None else f"{100 * r['acceptance']:.1f}%"
        tps = "" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}"
        lines.append(f"| {r['model']} | {r['decoding']} | {r['mode']} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {acc} | {tps} | {r['videos_identical_to_dense'] or ''} |")
    return "\n".join(lines)


def _machine() -> str:
    import os

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    commit = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    return f"commit {commit}, {os.cpu_count()} cores, load average {load:.1f} at the end"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="video,long", help="comma-separated: video, long, llama1024")
    ap.add_argument("--clips", type=int, default=4)
    ap.add_argument("--frames", type=int, default=4, help="generated frames per clip (frame 0 is given)")
    ap.add_argument("--k", default="4,8,16", help="fixed draft lengths (adaptive is always run)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-genai", dest="genai", action="store_false")
    ap.add_argument("--ngram", action="store_true", help="also our n-gram draft")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/speculation"))
    ap.add_argument("--name", default="speculation_bench", help="file stem of the .md / .json written in --out")
    a = ap.parse_args(argv)
    a.k = [int(x) for x in a.k.split(",") if x]
    if a.quick:
        a.models, a.clips, a.frames, a.k, a.genai = "long", 1, 2, [4], False
    DEFAULT_CACHE.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rows = []
    names = [m for m in a.models.split(",") if m]
    for name in names:
        if name not in MODELS:
            ap.error(f"--models: {name!r} is not one of {', '.join(MODELS)}")
        rows += run_model(name, a)
    text = table(rows)
    print("\n" + text)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{a.name}.md").write_text(
        f"`python benchmarks/speculation.py --models {a.models} --clips {a.clips} --frames {a.frames} --k "
        f"{','.join(map(str, a.k))} --threads {a.threads}` ({time.time() - t0:.0f} s, {_machine()})\n\n{text}\n")
    return save_results(a.out / f"{a.name}.json", {"rows": rows, "clips": a.clips, "frames": a.frames,
                                                     "threads": a.threads, "models": names})


if __name__ == "__main__":
    raise SystemExit(main())
