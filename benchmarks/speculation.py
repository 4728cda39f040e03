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
FastCar (`--fastcar 50,80`, the default; replay targets in percent): the model compiled (cached), tau calibrated per target on
the same clips (greedy, runtime.calibrate_threshold), then FastCar alone and FastCar with the adaptive temporal
draft (`--fastcar-k` adds fixed K); "vs best alone" is FastCar + draft over the faster of FastCar alone at that tau
and the adaptive temporal draft on the dense model, and greedy FastCar + draft must give FastCar's own tokens.
`genai`: the model builder's graph of the same weights in og.Generator, plain vs
`set_speculative_options(ngram_size=4, max_draft_tokens=16)`, greedy and sampled (genai 0.18 accepts the
options with sampling but falls back to plain steps for most of them: `genai_fallback_steps` of the json).

    python benchmarks/speculation.py                          # video + long with FastCar 50/80%, + genai
    python benchmarks/speculation.py --models llama1024 --clips 2 --frames 1 --fastcar ''   # ~4 min
    python benchmarks/speculation.py --models video --clips 8 --frames 8
    python benchmarks/speculation.py --quick                  # long model, 1 clip x 2 frames: smoke run
    python benchmarks/speculation.py --models video --k 4 --no-genai   # drafts and FastCar + drafts, ~5 min
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Mode:
    """One decoding of the benchmark: which session, which draft, which tau, and the mode its greedy tokens must
    equal (plain decoding of the same model: dense, or FastCar at the same tau)."""

    label: str
    fast: bool = False
    draft: str | None = None
    tau: float | None = None
    base: str = "dense"


def _fastcar_model(onnx: Path, L: int) -> Path:
    """The FastCar compile of `onnx` (cached beside the other benchmark artefacts, keyed by the file's content)."""
    import hashlib

    import fastcar_compile

    h = hashlib.sha256(onnx.read_bytes()).hexdigest()[:12]
    out = DEFAULT_CACHE / f"spec-fastcar-{h}-L{L}" / "fast.onnx"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"compiling {onnx.name} with FastCar ...", file=sys.stderr, flush=True)
        fastcar_compile.compile(onnx, out, frame_tokens=L)
    return out


def _fastcar_modes(name: str, fast: Path, prompts: list[list[int]], L: int, a, kw: dict) -> list[Mode]:
    """FastCar alone and with drafts at the tau of each replay target (calibrated on these clips, greedy)."""
    from fastcar_compile.runtime import calibrate_threshold

    modes = []
    for t in a.fastcar:
        r = calibrate_threshold(fast, prompts, num_frames=a.frames, target_replay=t / 100, batch_size=1,
                                progress=False, method="search", tolerance=0.02, max_probes=12, **kw)
        print(f"{name}: tau {r.tau:.4g} for {t}% replay (calibrated: {100 * r.replay_calib:.1f}%)", flush=True)
        alone = f"FastCar {t}%"
        modes.append(Mode(alone, True, None, r.tau, alone))
        modes += [Mode(f"{alone} + temporal{f':{k}' if k else ''}", True, f"temporal:{k}" if k else "temporal",
                       r.tau, alone) for k in [0, *a.fastcar_k]]
    return modes


def run_model(name: str, a) -> list[dict]:
    from fastcar_compile.demo.decoding import code_mask
    from fastcar_compile.runtime import FastCarSession

    model, onnx, L, prompts, uncond, codes, decoding = MODELS[name](a.clips)
    sessions = {False: FastCarSession(onnx, frame_tokens=L, threads=a.threads)}
    modes = [Mode("dense")] + [Mode(f"temporal:{k}", draft=f"temporal:{k}") for k in a.k] + \
        [Mode("temporal", draft="temporal")] + ([Mode("ngram", draft="ngram")] if a.ngram else [])
    if a.fastcar:
        fast = _fastcar_model(Path(onnx), L)
        sessions[True] = FastCarSession(fast, threads=a.threads)
        modes += _fastcar_modes(name, fast, prompts, L, a,
                                dict(logits_processor=code_mask(codes), given_video_tokens=L))
    rows = []
    for sample in (False, True):
        kw: dict = dict(logits_processor=code_mask(codes), progress=False, given_video_tokens=L)
        if sample:  # the model's recommended sampling, CFG with its unconditional prompt where it has one
            kw.update(do_sample=True, temperature=decoding.temperature, top_k=decoding.top_k, top_p=decoding.top_p)
            if uncond is not None and decoding.cfg_scale is not None:
                kw.update(cfg_scale=decoding.cfg_scale)
        acc = {m.label: {"tokens": 0, "s": 0.0, "proposed": 0, "accepted": 0, "steps": 0, "same": 0, "replay": 0.0}
               for m in modes}
        for i, p in enumerate(prompts):
            if "cfg_scale" in kw:  # the unconditional row: its prompt, then the same given frame 0
                kw["uncond_prompt_ids"] = [uncond + p[len(p) - L:]]
            got = {}
            for m in modes[i % len(modes):] + modes[: i % len(modes)]:
                extra = {"threshold": m.tau} if m.fast else {}
                t0 = time.perf_counter()
                res = sessions[m.fast].generate([p], a.frames, draft=m.draft, seed=i, **extra, **kw)
                dt = time.perf_counter() - t0 - res.stats.prefill_ms / 1e3
                st, r = res.stats, acc[m.label]
                n = res.tokens.shape[1] - 1
                r["tokens"] += n
                r["s"] += dt
                r["proposed"] += st.draft_proposed
                r["accepted"] += st.draft_accepted
                r["steps"] += st.verify_steps or n
                r["replay"] += st.replay_ratio * n
                got[m.label] = res.tokens
            for m in modes:
                acc[m.label]["same"] += int(np.array_equal(got[m.label], got[m.base]))
        tps = {m.label: acc[m.label]["tokens"] / acc[m.label]["s"] for m in modes}
        for m in modes:
            r = acc[m.label]
            best = max(tps["temporal"], tps[m.base]) if m.fast and m.draft else None
            rows.append({"model": name, "decoding": _describe(kw) if sample else "greedy", "mode": m.label,
                         "output": _output(m), "tokens_per_s": tps[m.label], "speedup": tps[m.label] / tps["dense"],
                         "x_base": tps[m.label] / tps[m.base],
                         "acceptance": r["accepted"] / r["proposed"] if r["proposed"] else None,
                         "tokens_per_step": r["tokens"] / r["steps"],
                         "replay": r["replay"] / r["tokens"] if m.fast else None, "tau": m.tau,
                         "vs_best_alone": tps[m.label] / best if best else None,
                         "videos_identical_to_dense": f"{r['same']}/{len(prompts)}"
                         + ("" if m.base == "dense" else f" (vs {m.base})") if not sample else None})
            print(_line(rows[-1]), flush=True)
    if a.genai:
        rows += _genai_rows(name, model(), prompts, L * a.frames, a.threads, decoding)
    return rows


def _output(m: Mode) -> str:
    """What a mode's tokens are, so no speed-up reads as lossless when it is not: a draft verified against the
    model it speeds up reproduces that model's decoding (greedy: its tokens; sampled: its distribution), while
    FastCar's replay changes the logits, so FastCar (and FastCar + drafts) is lossy against the dense model."""
    if not m.fast:
        return "lossless (the dense model's decoding)"
    return f"lossy vs dense; {'lossless vs ' + m.base if m.draft else 'its own tokens'}"


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
    rep = f"  replay {100 * r['replay']:.1f}%" if r.get("replay") is not None else ""
    best = f"  {r['vs_best_alone']:.2f}x best alone" if r.get("vs_best_alone") else ""
    return (f"{r['model']:9s} {r['decoding'][:7]:7s} {r['mode']:24s} {r['tokens_per_s']:8.1f} tok/s  "
            f"{r['speedup']:.2f}x{acc}{tps}{rep}{best}{same}")


def table(rows: list[dict]) -> str:
    fast = any(r.get("replay") is not None for r in rows)
    head = "| model | decoding | mode | tokens/s | vs plain | draft accepted | tokens / step | greedy identical |"
    head += " replay | vs best alone |" if fast else ""
    lines = [head, "|" + "---|" * (10 if fast else 8)]
    for r in rows:
        acc = "" if r["acceptance"] is None else f"{100 * r['acceptance']:.1f}%"
        tps = "" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}"
        line = (f"| {r['model']} | {r['decoding']} | {r['mode']} | {r['tokens_per_s']:.1f} | "
                f"{r['speedup']:.2f}x | {acc} | {tps} | {r['videos_identical_to_dense'] or ''} |")
        if fast:
            rep = "" if r.get("replay") is None else f"{100 * r['replay']:.1f}%"
            best = "" if not r.get("vs_best_alone") else f"{r['vs_best_alone']:.2f}x"
            line += f" {rep} | {best} |"
        lines.append(line)
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
    ap.add_argument("--clips", type=int, default=16, help="held-out clips (the first N; clip i sampled with seed i)")
    ap.add_argument("--frames", type=int, default=4, help="generated frames per clip (frame 0 is given)")
    ap.add_argument("--k", default="4,8,16", help="fixed draft lengths (adaptive is always run)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-genai", dest="genai", action="store_false")
    ap.add_argument("--ngram", action="store_true", help="also our n-gram draft")
    ap.add_argument("--fastcar", default="50,80", help="FastCar replay targets in percent, e.g. 50,80 (compiled, tau "
                                                 "calibrated): FastCar alone and with the adaptive temporal draft; '' for none")
    ap.add_argument("--fastcar-k", default="", help="fixed draft lengths also run with FastCar (< L)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/speculation"))
    ap.add_argument("--name", default="speculation_bench", help="file stem of the .md / .json written in --out")
    a = ap.parse_args(argv)
    a.k = [int(x) for x in a.k.split(",") if x]
    a.fastcar = [int(x) for x in a.fastcar.split(",") if x]
    a.fastcar_k = [int(x) for x in a.fastcar_k.split(",") if x]
    if a.quick:
        a.models, a.clips, a.frames, a.k, a.genai, a.fastcar = "long", 1, 2, [4], False, [50]
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
        f"{','.join(map(str, a.k))} --threads {a.threads}"
        + (f" --fastcar {','.join(map(str, a.fastcar))}" if a.fastcar else "")
        + (f" --fastcar-k {','.join(map(str, a.fastcar_k))}" if a.fastcar_k else "")
        + ("" if a.genai else " --no-genai") + f"` ({time.time() - t0:.0f} s, {_machine()})\n\n{text}\n")
    return save_results(a.out / f"{a.name}.json", {"rows": rows, "clips": a.clips, "frames": a.frames,
                                                     "threads": a.threads, "models": names, "fastcar": a.fastcar})


if __name__ == "__main__":
    raise SystemExit(main())
