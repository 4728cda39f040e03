"""The long-video demo model beyond its training length, and its FastCar threshold.

    python benchmarks/experiments/long_video.py --hold            # teacher-forced loss/accuracy per frame, 64-frame clips
    python benchmarks/experiments/long_video.py --calibrate       # tau for ~80% replay along dense generations
    python benchmarks/experiments/long_video.py --op-modes --clips 2   # FastCar x TempCache/window through the op (native)
    python benchmarks/experiments/long_video.py --curve           # per-token time, decode-state bytes, RSS per frame, one clip
    python benchmarks/experiments/long_video.py --curve --frames 128 --only 0,1,6,7,8   # 128 frames (8195 positions)
    python benchmarks/experiments/long_video.py --genai           # frame 64 per-token time vs onnxruntime-genai's dense loop

--hold: the model was trained on 16-frame clips (1027 positions) with random position gaps; here it reads
64-frame held-out clips (4099 positions) teacher-forced, and the next-token loss and accuracy per frame index
show whether it holds past frame 15 (next to "same token as one frame back", the copy baseline, which
does not depend on the model). Writes demo-long-hold.{json,png} into --out-dir.
--calibrate: TAS values (post-RoPE, every layer) along dense greedy generations of train-split clips by a
never-replaying compiled model with diagnostics outputs; the (1 - target) quantile is the tau whose replay
ratio is ~target on dense trajectories (FastCar's own trajectories replay a little differently: demo --long
reports the real ratio). Prints the value to put in fastcar_compile/demo/longvideo.py DEFAULT_LONG_TAU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")


def hold(clips: int, frames: int, out: Path) -> dict:
    import torch

    from fastcar_compile.core.atomic import save_figure, write_text
    from fastcar_compile.demo import data
    from fastcar_compile.demo.evaluate import load_tokenizer
    from fastcar_compile.demo.export import LONG_CONFIG, LONG_WEIGHTS, load_model
    from fastcar_compile.demo.model import CODES, VIDEO_START
    from fastcar_compile.demo.train import tokenize_clips

    torch.set_num_threads(1)
    tok = load_tokenizer()
    L = tok.tokens_per_frame
    model = load_model(LONG_WEIGHTS, LONG_CONFIG)
    seqs = torch.from_numpy(tokenize_clips(tok, data.make_clips("eval", clips, frames, seed=0)))
    losses, accs = [], []
    with torch.no_grad():
        for s in seqs:
            logits = model(input_ids=s[None, :-1]).logits[0, VIDEO_START + L - 1:, :CODES]
            tgt = s[VIDEO_START + L:]
            losses.append(torch.nn.functional.cross_entropy(logits, tgt, reduction="none").reshape(-1, L).mean(1))
            accs.append((logits.argmax(-1) == tgt).float().reshape(-1, L).mean(1))
    loss = torch.stack(losses).mean(0).numpy()
    acc = torch.stack(accs).mean(0).numpy()
    v = seqs[:, VIDEO_START:].reshape(len(seqs), frames, L)
    copy = (v[:, 1:] == v[:, :-1]).float().mean((0, 2)).numpy()
    res = {"frames": frames, "clips": clips, "loss_per_frame": loss.tolist(), "acc_per_frame": acc.tolist(),
           "copy_acc_per_frame": copy.tolist(),
           "loss_frames_1_15": float(loss[:15].mean()), "loss_frames_16_end": float(loss[15:].mean()),
           "acc_frames_1_15": float(acc[:15].mean()), "acc_frames_16_end": float(acc[15:].mean()),
           "copy_acc_frames_1_15": float(copy[:15].mean()), "copy_acc_frames_16_end": float(copy[15:].mean())}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    x = np.arange(1, frames)
    ax[0].plot(x, loss)
    ax[0].set_ylabel("next-token loss (nats), teacher-forced")
    ax[1].plot(x, acc, label="model")
    ax[1].plot(x, copy, "--", label="copy one frame back")
    ax[1].set_ylabel("next-token accuracy")
    ax[1].legend(fontsize=8)
    for a in ax:
        a.axvline(15.5, color="grey", ls=":")
        a.set_xlabel("frame (trained on frames 0-15: dotted line)")
        a.grid(alpha=0.3)
    fig.suptitle(f"long-video model on {clips} held-out {frames}-frame clips ({3 + frames * L} positions)", fontsize=9)
    fig.tight_layout()
    save_figure(fig, out / "demo-long-hold.png", dpi=110)
    write_text(out / "demo-long-hold.json", json.dumps(res, indent=1))
    return res


def calibrate(clips: int, frames: int, target: float) -> dict:
    from fastcar_compile.demo import data
    from fastcar_compile.demo.evaluate import compile_bundled, load_tokenizer
    from fastcar_compile.demo.longvideo import long_onnx
    from fastcar_compile.demo.model import prompt
    from fastcar_compile.demo.video import generate_video, open_session

    tok = load_tokenizer()
    with tempfile.TemporaryDirectory() as d:
        diag = compile_bundled(Path(d) / "diag.onnx", float("inf"), "rope", 0, model=long_onnx(), diagnostics=True,
                               frame_tokens=tok.tokens_per_frame)
        sess = open_session(diag, 1)
        tas = [generate_video(sess, prompt(c.motion), tok.encode(c.frames)[0], frames - 1, threshold=float("inf")).tas
               for c in data.make_clips("train", clips, frames, seed=1)]
    t = np.concatenate(tas)  # [steps, layers]
    tau = float(np.quantile(t.reshape(-1), 1 - target))
    return {"tau": tau, "target": target, "per_layer_replay_on_dense": (t > tau).mean(0).tolist(),
            "clips": clips, "frames": frames}


# (name, fastcar tau or None = never replay, compiler KV options or None = plain dense export); compiled rows
# keep the export's norms and RoPE (--fusions off) so they differ from the dense row only by their mode
OP_MODES = [
    ("dense", None, None),
    ("FastCar", "tau", ["--fused-attention", "off"]),  # the exported attention (fused is the default now)
    ("dense, fused op (growing KV)", None, ["--fused-attention", "fastcar"]),
    ("FastCar, fused op (growing KV)", "tau", ["--fused-attention", "fastcar"]),
    ("TempCache 0.95", None, ["--kv-budget", "4100", "--kv-window", "64", "--tempcache", "0.95"]),
    ("FastCar + TempCache 0.95", "tau", ["--kv-budget", "4100", "--kv-window", "64", "--tempcache", "0.95"]),
    ("window S4+W124", None, ["--kv-budget", "129", "--kv-sinks", "4", "--kv-window", "124", "--kv-eviction",
                              "oldest"]),
    ("FastCar + window S4+W124", "tau", ["--kv-budget", "129", "--kv-sinks", "4", "--kv-window", "124",
                                         "--kv-eviction", "oldest"]),
    ("FastCar + TempCache 0.95 C256 (S4+W64)", "tau", ["--kv-budget", "256", "--kv-sinks", "4", "--kv-window", "64",
                                                      "--tempcache", "0.95"]),
    # per layer (--kv-layer): window on layer 0 (reads by position), TempCache on layers 1-3 (read by content)
    ("window L0 + TempCache 0.95 L1-3", None, ["--kv-layer", "0:budget=129,sinks=4,window=124,eviction=oldest",
                                                "--kv-layer", "1-3:budget=4100,window=64,tempcache=0.95"]),
    ("FastCar + window L0 + TempCache 0.95 C256 (S4+W64) L1-3", "tau",
     ["--kv-layer", "0:budget=129,sinks=4,window=124,eviction=oldest",
      "--kv-layer", "1-3:budget=256,sinks=4,window=64,tempcache=0.95"]),
]


def op_modes(clips: int, frames: int, tau: float, out: Path, only: list[int] | None = None) -> list[dict]:
    """Every OP_MODES row through the compiler and FastCarSession (ai.fastcar CompressedAttention's native
    kernel): PSNR/SSIM vs truth and vs dense, replay, runtime step time on frame 8 and on the last frame."""
    from fastcar_compile.cli import main as cli
    from fastcar_compile.core.atomic import write_text
    from fastcar_compile.demo import data
    from fastcar_compile.demo.evaluate import load_tokenizer
    from fastcar_compile.demo.longvideo import long_onnx
    from fastcar_compile.demo.metrics import psnr, ssim
    from fastcar_compile.demo.model import prompt
    from fastcar_compile.demo.video import generate_video, open_session

    tok = load_tokenizer()
    L = tok.tokens_per_frame
    src = long_onnx()
    cl = data.make_clips("eval", clips, frames, seed=0)
    rows, dense_vids = [], []
    with tempfile.TemporaryDirectory() as d:
        for i, (name, fc, kv) in enumerate(OP_MODES):
            if only and i and i not in only:
                continue  # row 0 (dense) always runs: the reference of "PSNR vs dense"
            path = src
            if fc or kv:
                path = Path(d) / "m.onnx"
                args = [str(src), "-o", str(path), "--frame-tokens", str(L), "--video-start", "3",
                        f"--threshold={tau if fc else float('inf')}", "--fusions", "off", *(kv or [])]
                if cli(args) != 0:
                    raise SystemExit(f"compile failed for {name}")
            sess = open_session(path, 1)
            vids, reps, f8, flast = [], [], [], []
            for c in cl:
                run = generate_video(sess, prompt(c.motion), tok.encode(c.frames)[0], frames - 1,
                                     threshold=tau if fc else None)
                vids.append(tok.decode(run.tokens)[1:])
                reps.append(run.replay_ratio)
                ms = np.asarray(run.step_ms)  # step k feeds token k: frame 1 + k // L
                f8.append(np.median(ms[7 * L - L:7 * L]))
                flast.append(np.median(ms[-L + 1:]))
            if not dense_vids:
                dense_vids = vids
            gt = [c.frames[1:] for c in cl]
            rows.append({"mode": name, "replay": float(np.mean(reps)),
                         "psnr_vs_gt": float(np.mean([psnr(g, v) for g, v in zip(gt, vids, strict=True)])),
                         "ssim_vs_gt": float(np.mean([ssim(g, v) for g, v in zip(gt, vids, strict=True)])),
                         "psnr_vs_dense": psnr(np.concatenate(dense_vids), np.concatenate(vids))
                         if name != "dense" else float("inf"),
                         "ms_frame8": float(np.mean(f8)), "ms_last": float(np.mean(flast))})
            print(rows[-1], flush=True)
    hold = float(np.mean([psnr(c.frames[1:], np.repeat(tok.decode(tok.encode(c.frames[:1])), frames - 1, axis=0))
                          for c in cl]))
    head = (f"Long-video model through the compiler and FastCarSession (ai.fastcar CompressedAttention native "
            f"kernel), {clips} held-out clips x {frames} frames, greedy, tau {tau}, 1 ORT thread; hold frame 0: "
            f"{hold:.2f} dB. ms = median runtime step (FastCarSession.step incl. Python) over frame 8 / the last "
            "frame (loaded machine: compare within a row and across rows only roughly).\n\n"
            "| mode | replay | PSNR vs GT | SSIM vs GT | PSNR vs dense | ms/token frame 8 | ms/token last frame | "
            "last / frame 8 |\n|---|---|---|---|---|---|---|---|\n")
    body = "".join(f"| {r['mode']} | {100 * r['replay']:.1f}% | {r['psnr_vs_gt']:.2f} | {r['ssim_vs_gt']:.3f} | "
                   f"{r['psnr_vs_dense']:.2f} | {r['ms_frame8']:.3f} | {r['ms_last']:.3f} | "
                   f"{r['ms_last'] / r['ms_frame8']:.2f} |\n" for r in rows)
    stem = "long_video_op_modes" + ("_" + "_".join(map(str, only)) if only else "")
    write_text(out / f"{stem}.md", head + body)
    write_text(out / f"{stem}.json", json.dumps({"rows": rows, "hold_psnr": hold}, indent=1))
    print(head + body)
    return rows


CURVE_MODES = (0, 1, 2, 4, 5, 6, 7, 8)  # OP_MODES rows drawn by --curve



def _mode_session(src: Path, work: Path, L: int, tau: float, fastcar: bool, kv: list[str] | None):
    """Compile `src` for one mode (FastCar at tau and/or KV options; neither: the export itself) into `work`
    and open it with one thread; returns the session and the threshold array to feed (None: none)."""
    from fastcar_compile.cli import main as cli
    from fastcar_compile.demo.video import open_session

    path = src
    if fastcar or kv:
        path = work / "m.onnx"
        cli([str(src), "-o", str(path), "--frame-tokens", str(L), "--video-start", "3",
             f"--threshold={tau if fastcar else float('inf')}", *(kv or [])])
    sess = open_session(path, 1)
    return sess, (sess.threshold_array(tau) if fastcar and sess.is_fastcar else None)

def _vm_rss() -> int:
    """This process's resident memory in bytes (/proc/self/status VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def curve_mode(i: int, frames: int, tau: float, clip: int = 0) -> dict:
    """One CURVE_MODES row of `curve`, run in a fresh process (so its RSS is its own): per-frame median step
    time, decode state bytes (the session's state arrays: KV buffers + slot state) and process VmRSS."""
    import time

    from fastcar_compile.demo import data
    from fastcar_compile.demo.evaluate import load_tokenizer
    from fastcar_compile.demo.longvideo import long_onnx
    from fastcar_compile.demo.model import CODES, VIDEO_START, prompt

    tok = load_tokenizer()
    L = tok.tokens_per_frame
    src = long_onnx(progress=False)
    c = data.make_clip("eval", clip, frames, seed=0)
    f0 = [int(t) for t in tok.encode(c.frames)[0]]
    name, fc, kv = OP_MODES[i]
    with tempfile.TemporaryDirectory() as d:
        sess, thr = _mode_session(src, Path(d), L, tau, fc, kv)
        st = sess.new_state(1, video_start=VIDEO_START)
        o = sess.step(st, np.asarray([prompt(c.motion) + f0], np.int64), threshold=thr)
        st = o.state
        nxt = int(o.logits[0, -1, :CODES].argmax())
        ms, mem, rss = [], [st.nbytes()], [_vm_rss()]
        for k in range((frames - 1) * L - 1):
            t0 = time.perf_counter()
            o = sess.step(st, np.asarray([[nxt]], np.int64), threshold=thr, check=False)
            ms.append(1e3 * (time.perf_counter() - t0))
            st = o.state
            nxt = int(o.logits[0, -1, :CODES].argmax())
            if (k + 1) % L == 0:
                mem.append(st.nbytes())
                rss.append(_vm_rss())
    per_frame = [float(np.median(ms[f * L:(f + 1) * L])) for f in range(len(ms) // L)]
    return {"name": name, "ms_per_frame": per_frame, "state_bytes_per_frame": [int(x) for x in mem],
            "rss_per_frame": rss}


def curve(frames: int, tau: float, out: Path, clip: int = 0, only: list[int] | None = None) -> dict:
    """Per-token time, resident decode state and process RSS per frame, for CURVE_MODES on one held-out clip:
    the long-video latency/memory picture (without onnxruntime-genai). One model at a time,
    each in a fresh child process (`curve_mode`); times on a shared machine are noisy. 64 frames write
    long_video_curve.*, other lengths long_video_curve_<frames>f.*."""
    import subprocess

    from tqdm import tqdm

    from fastcar_compile.core.atomic import write_text

    res: dict = {"frames": frames, "clip": clip, "tau": tau, "modes": {}}
    bar = tqdm([i for i in CURVE_MODES if not only or i in only], desc=f"curve, {frames} frames", unit="mode")
    for i in bar:
        bar.set_postfix_str(OP_MODES[i][0][:40])
        r = subprocess.run([sys.executable, __file__, "--curve-worker", json.dumps([i, frames, tau, clip])],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"curve mode {OP_MODES[i][0]} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
        m = json.loads(r.stdout.strip().splitlines()[-1])
        res["modes"][m.pop("name")] = m
        per_frame, mem, rss = m["ms_per_frame"], m["state_bytes_per_frame"], m["rss_per_frame"]
        ref = min(7, len(per_frame) - 1)  # frame 8, or the last whole frame of a shorter run
        bar.write(f"{OP_MODES[i][0]}: frame {ref + 1} {per_frame[ref]:.3f} ms, last {per_frame[-1]:.3f} ms; state "
                  f"{mem[1] / 1e6:.2f} -> {mem[-1] / 1e6:.2f} MB; RSS {rss[1] / 2**20:.0f} -> {rss[-1] / 2**20:.0f} MiB")
    stem = "long_video_curve" + ("" if frames == 64 else f"_{frames}f")
    plot_curve(res, out / f"{stem}.png")
    write_text(out / f"{stem}.json", json.dumps(res, indent=1))
    return res


def plot_curve(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastcar_compile.core.atomic import save_figure

    rss = any("rss_per_frame" in r for r in res["modes"].values())
    fig, ax = plt.subplots(1, 3 if rss else 2, figsize=(17 if rss else 12, 4.2))
    for name, r in res["modes"].items():
        ax[0].plot(np.arange(1, len(r["ms_per_frame"]) + 1), r["ms_per_frame"], label=name)
        ax[1].plot(np.arange(len(r["state_bytes_per_frame"])), np.asarray(r["state_bytes_per_frame"]) / 1e6,
                   label=name)
        if "rss_per_frame" in r:
            ax[2].plot(np.arange(len(r["rss_per_frame"])), np.asarray(r["rss_per_frame"]) / 2**20, label=name)
    if rss:
        ax[2].set_ylabel("process RSS (MiB; each mode in its own process)")
    ax[0].set_ylabel("ms/token (median per frame)")
    ax[1].set_ylabel("decode state held by the session (MB)")
    for a in ax:
        a.set_xlabel("frame")
        a.grid(alpha=0.3)
    ax[0].set_yscale("log")
    ax[1].set_yscale("log")
    ax[1].legend(fontsize=7)
    fig.suptitle(f"long-video model, eval clip {res['clip']}, {res['frames']} frames, FastCarSession.step, 1 ORT "
                 "thread (shared, loaded machine)", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


GENAI_MODES = {  # ours at frame 64, next to onnxruntime-genai's dense loop
    "dense (plain export, FastCarSession)": (None, None),
    "FastCar + window S4+W124": ("tau", OP_MODES[7][2]),
    "FastCar + TempCache 0.95 C256 (S4+W64)": ("tau", OP_MODES[8][2]),
    "FastCar + TempCache 0.95 + AnnSA lsh 8x4, C256 (S4+W64)": (
        "tau", ["--kv-budget", "256", "--kv-sinks", "4", "--kv-window", "64", "--tempcache", "0.95",
                "--sparse-attention", "lsh:8x4"]),
}


def long_genai_dir() -> Path:
    """The long model's onnxruntime-genai folder (the model builder's fp32 cpu graph of the shipped weights, with
    a one-word-per-id tokenizer), built once into the user cache."""
    import subprocess

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fastcar_compile.demo.export import LONG_CONFIG, LONG_WEIGHTS, load_model
    from fastcar_compile.demo.longvideo import cache_dir, long_onnx

    genai_dir = cache_dir() / f"genai-{long_onnx(progress=False).stem}"
    if not (genai_dir / "genai_config.json").is_file():
        hf = genai_dir.with_name(genai_dir.name + "-hf")
        m = load_model(LONG_WEIGHTS, LONG_CONFIG)
        m.save_pretrained(hf)
        tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(m.config.vocab_size)}, unk_token="t0"))
        tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", bos_token="t1", eos_token="t2",
                                pad_token="t0").save_pretrained(hf)
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o",
                        str(genai_dir), "-p", "fp32", "-e", "cpu", "-c", str(hf) + "-cache"], check=True,
                       stdout=subprocess.DEVNULL)
    return genai_dir


def genai_vs_ours(frames: int, tau: float, tokens: int, out: Path, clip: int = 0) -> dict:
    """Per-token time while generating frame `frames` (after a prefill of the prompt and frames 0..frames-2 of
    a real held-out clip): onnxruntime-genai's own loop (og.Generator, the model builder's fp32 cpu graph of the
    same weights) vs ours through FastCarSession. 1 intra-op thread each; median of `tokens` steps after one
    untimed step; models run one after the other (shared machine: ratios within this run)."""
    import time

    import onnxruntime_genai as og
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_genai
    from bench_genai import set_session

    from fastcar_compile.core.atomic import write_text
    from fastcar_compile.demo import data
    from fastcar_compile.demo.evaluate import load_tokenizer
    from fastcar_compile.demo.longvideo import long_onnx
    from fastcar_compile.demo.model import CODES, VIDEO_START, prompt

    tok = load_tokenizer()
    L = tok.tokens_per_frame
    c = data.make_clip("eval", clip, frames, seed=0)
    ids = prompt(c.motion) + [int(t) for t in tok.encode(c.frames[:-1]).reshape(-1)]
    res: dict = {"frames": frames, "prefill": len(ids), "tokens": tokens, "tau": tau, "ms": {}}
    genai_dir = long_genai_dir()
    set_session(genai_dir, 1, native=False, entries={})  # 1 thread, no ORT config entries, no custom ops
    model = og.Model(str(genai_dir))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + tokens + 4, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray([ids], np.int32))
    gen.generate_next_token()
    ts = []
    for _ in range(tokens):
        t0 = time.perf_counter()
        gen.generate_next_token()
        ts.append(1e3 * (time.perf_counter() - t0))
    res["ms"]["onnxruntime-genai dense (og.Generator)"] = float(np.median(ts))
    del gen, model
    src = long_onnx(progress=False)
    with tempfile.TemporaryDirectory() as d:
        for name, (fc, kv) in GENAI_MODES.items():
            sess, thr = _mode_session(src, Path(d), L, tau, fc, kv)
            o = sess.step(sess.new_state(1, video_start=VIDEO_START), np.asarray([ids], np.int64), threshold=thr)
            st, nxt, ts, rep = o.state, int(o.logits[0, -1, :CODES].argmax()), [], []
            for k in range(tokens + 1):
                t0 = time.perf_counter()
                o = sess.step(st, np.asarray([[nxt]], np.int64), threshold=thr, check=False)
                if k:
                    ts.append(1e3 * (time.perf_counter() - t0))
                st, nxt = o.state, int(o.logits[0, -1, :CODES].argmax())
                if o.replay is not None:
                    rep.append(float(o.replay.mean()))
            res["ms"][name] = float(np.median(ts))
            res.setdefault("replay", {})[name] = float(np.mean(rep)) if rep else 0.0
            print(f"{name}: {res['ms'][name]:.3f} ms/token", flush=True)
    g = res["ms"]["onnxruntime-genai dense (og.Generator)"]
    lines = [f"Per-token time generating frame {frames} of eval clip {clip} (prefill {len(ids)} tokens: prompt + "
             f"frames 0..{frames - 2}), median of {tokens} steps, 1 intra-op thread, tau {tau}, one model at a "
             "time on the shared machine.\n", "| model | replay | ms/token | x genai dense |", "|---|---|---|---|"]
    for name, ms in res["ms"].items():
        lines.append(f"| {name} | {100 * res.get('replay', {}).get(name, 0.0):.0f}% | {ms:.3f} | {g / ms:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_text(out / "long_video_genai.md", text)
    write_text(out / "long_video_genai.json", json.dumps(res, indent=1))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--op-modes", action="store_true", help="FastCar x KV modes through the compiler's op (native)")
    ap.add_argument("--tau", type=float, default=None, help="--op-modes: tau (default DEFAULT_LONG_TAU)")
    ap.add_argument("--curve", action="store_true", help="per-token time and decode-state bytes per frame")
    ap.add_argument("--genai", action="store_true",
                    help="per-token time at the last frame vs onnxruntime-genai's dense loop (--tokens steps)")
    ap.add_argument("--tokens", type=int, default=64, help="--genai: timed steps (default 64)")
    ap.add_argument("--only", default="", help="--op-modes (dense always runs) / --curve: comma-separated OP_MODES "
                                           "indices")
    ap.add_argument("--clips", type=int, default=8)
    ap.add_argument("--curve-worker", help=argparse.SUPPRESS)  # [mode index, frames, tau, clip]: one curve row
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--out-dir", type=Path, default=Path("fastcar-out/bench"))
    a = ap.parse_args(argv)
    if a.curve_worker:
        print(json.dumps(curve_mode(*json.loads(a.curve_worker))))
        return 0
    if not (a.hold or a.calibrate or a.op_modes or a.curve or a.genai):
        ap.error("give --hold, --calibrate, --op-modes, --curve and/or --genai")
    if a.frames < 3:
        ap.error(f"--frames {a.frames}: give at least 3 (frame 0 is the prompt; a curve needs whole frames)")
    if a.genai:
        from fastcar_compile.demo.longvideo import DEFAULT_LONG_TAU

        genai_vs_ours(a.frames, DEFAULT_LONG_TAU if a.tau is None else a.tau, a.tokens, a.out_dir)
    if a.curve:
        from fastcar_compile.demo.longvideo import DEFAULT_LONG_TAU

        curve(a.frames, DEFAULT_LONG_TAU if a.tau is None else a.tau, a.out_dir,
              only=[int(x) for x in a.only.split(",") if x.strip()] or None)
    if a.op_modes:
        from fastcar_compile.demo.longvideo import DEFAULT_LONG_TAU

        op_modes(a.clips, a.frames, DEFAULT_LONG_TAU if a.tau is None else a.tau, a.out_dir,
                 [int(x) for x in a.only.split(",") if x.strip()] or None)
    if a.hold:
        print(json.dumps({k: v for k, v in hold(a.clips, a.frames, a.out_dir).items() if "per_frame" not in k},
                         indent=1))
    if a.calibrate:
        print(json.dumps(calibrate(min(a.clips, 4), min(a.frames, 32), a.target), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
