"""Long videos on the issue's LLaMA-style decoder: per-token decode time and process memory at frames 8 .. 128,
onnxruntime-genai's dense loop vs ours dense vs FastCar + bounded KV caches.

The seeded random LLaMA of benchmarks/bench_genai.py (hidden 1024, 8 layers, 16 heads / 2 KV heads, MLP 3072,
vocab 2048), here with 33280 positions (genai's builder sizes its rotary cache by max_position_embeddings),
frames of 256 tokens: frame 64 = 16384 positions, frame 128 = 32768. Modes:
- `genai dense`: the model builder's fp32 cpu graph in `og.Generator` (GroupQueryAttention, shared KV buffer of
  max_length), prefilled with repeated `append_tokens` chunks;
- ours: the dynamo export of the same weights compiled with the fused ai.fastcar attention (the compiler's
  default) and a per-layer tau input, run by FastCarSession (max_length: one KV buffer per video, in place):
  `dense` (tau +inf everywhere), and FastCar at a forced replay ratio (K of the 8 layers at tau -inf: they
  replay every decode token) with a bounded KV cache: sinks + window (StreamingLLM), or TempCache + AnnSA
  (`--tempcache 0.95 --sparse-attention lsh:8x4`) under the same budget.
Random weights and random tokens carry no temporal redundancy, so FastCar's replay ratio is forced (75%, the
nearest whole-layer ratio to 80%, and 50%, about what the trained long demo model replays on frame 64:
docs/fastar.md), TempCache finds nothing to merge and AnnSA's buckets select ~1/256 of the keys per table: these
rows measure cost, not quality (quality of the same modes on the trained demo model: the study
`08784a2:benchmarks/experiments/long_video.py --op-modes`, in history).

Every (mode, frame) runs in a fresh child process: load, prefill the first `frame x 256` tokens of one random
token stream in chunks through the same model (the KV state at frame N really holds N frames), then greedy
single-token decode steps. The modes of one frame are alive together and decode in turn, `--block` tokens at a
time after one untimed step, until each has `--tokens` timed steps (machine load hits them alike; per-token time
= lower quartile); then each child's VmRSS and peak VmHWM from /proc/self/status. Ratios are within one run.

    python benchmarks/long_video_llama.py                    # frames 8,16,32,64, every mode: prefill dominates
    python benchmarks/long_video_llama.py --frames 8,64 --modes 2,3   # `python -m benchmarks long-video`: 15 min on
                                                             # the 2-core machine at load ~10 once exported
    python benchmarks/long_video_llama.py --frames 8,128 --modes 0,2,3 --tokens 32 --out fastcar-out/bench/long_video_llama_128
                                                             # frame 128 (32768 positions): ~35 min loaded
    python benchmarks/long_video_llama.py --quick            # small model, frames 2,4,8: smoke run (~20 s)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_CACHE, LlamaShape, cached_export, ort_options  # noqa: E402
from bench_genai import build_genai, mark_fresh, parse_entries, set_session, stale  # noqa: E402

FULL = dict(shape=LlamaShape(hidden=1024, layers=8, heads=16, kv_heads=2, intermediate=3072, vocab=2048,
                             max_pos=33280), frame_tokens=256, frames=(8, 16, 32, 64), block=8, tokens=48, chunk=512)
QUICK = dict(shape=LlamaShape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=704, vocab=512,
                              max_pos=2304), frame_tokens=64, frames=(2, 4, 8), block=4, tokens=16, chunk=128)


@dataclass(frozen=True)
class Mode:
    """One benchmarked configuration: genai's loop or ours with `replay` of the layers forced to replay and
    the compiler's KV options `kv` (budgets in frames of tokens, resolved by `kv_args`)."""

    name: str
    engine: str  # "genai" or "ours"
    replay: float = 0.0  # share of layers at tau -inf
    kv: dict = field(default_factory=dict)

    def tag(self) -> str:
        return "kv-" + "-".join(f"{k}{v}" for k, v in sorted(self.kv.items())) if self.kv else "dense"


def kv_args(kv: dict, frame_tokens: int) -> dict:
    """Mode.kv (budget/window in frames, sinks in tokens) -> fastcar_compile.compile keyword arguments."""
    if not kv:
        return {}
    out = {"kv_budget": int(kv["budget_frames"] * frame_tokens), "kv_sinks": int(kv.get("sinks", 4)),
           "kv_window": int(kv["window_frames"] * frame_tokens), "kv_eviction": kv.get("eviction", "mass")}
    if "tempcache" in kv:
        out["tempcache"] = float(kv["tempcache"])
    if "lsh" in kv:
        out["sparse_attention"] = f"lsh:{kv['lsh']}"
    return out


WINDOW = dict(budget_frames=4, window_frames=2, sinks=4, eviction="oldest")
# the window covers a frame: the gate of a FastCar layer reads the key one frame back from this cache
TEMPCACHE_ANNSA = dict(budget_frames=4, window_frames=1, sinks=4, tempcache=0.95, lsh="8x4")
MODES = [
    Mode("genai dense (og.Generator)", "genai"),
    Mode("dense (fused op)", "ours"),
    Mode("FastCar 75% + window S4+W2f, C4f", "ours", 0.75, WINDOW),
    Mode("FastCar 75% + TempCache 0.95 + AnnSA 8x4, C4f (S4+W1f)", "ours", 0.75, TEMPCACHE_ANNSA),
    Mode("FastCar 50% + TempCache 0.95 + AnnSA 8x4, C4f (S4+W1f)", "ours", 0.5, TEMPCACHE_ANNSA),
]
GENAI = MODES[0].name


def _proc_status() -> dict[str, int]:
    """VmRSS / VmHWM of this process in bytes (Linux /proc)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def taus(layers: int, replay: float) -> np.ndarray:
    """Per-layer tau: round(replay x layers) layers, spread out, at -inf (always replay), the rest +inf."""
    k = round(replay * layers)
    spread = {round(i * layers / k) for i in range(k)} if k else set()
    return np.array([-np.inf if i in spread else np.inf for i in range(layers)], np.float32)


def prepare(cfg: dict, modes: list[Mode], cache: Path, threads: int, entries: dict[str, str]) -> dict[str, str]:
    """Build (once, cached) the genai folder and our compiled models; returns mode name -> model path."""
    import fastcar_compile

    shape: LlamaShape = cfg["shape"]
    L = cfg["frame_tokens"]
    paths: dict[str, str] = {}
    for m in modes:
        if m.engine == "genai":
            folder = build_genai(shape, cache)
            set_session(folder, threads, native=False, entries=entries)
            paths[m.name] = str(folder)
            continue
        out = cache / f"longvideo-{shape.tag()}-L{L}" / m.tag() / "fast.onnx"
        if stale(out):  # missing, or compiled by other compiler sources (bench_genai's stamp)
            print(f"compiling {m.tag()} ...", file=sys.stderr)
            fastcar_compile.compile(cached_export(shape, cache), out, frame_tokens=L,
                                    threshold=[np.inf] * shape.layers, per_layer_threshold=True,
                                    **kv_args(m.kv, L))
            mark_fresh(out)
        paths[m.name] = str(out)
    return paths


def worker(job: dict) -> None:
    """One (mode, frame) in this fresh process: load, prefill frame x L tokens in chunks, print a JSON line;
    then per `block` line on stdin one untimed + `block` timed greedy decode steps (a JSON line of ms), and at
    `end` the process's VmRSS / VmHWM."""
    mode = Mode(**job["mode"])
    n_ctx, block, chunk = job["ctx"], job["block"], job["chunk"]
    max_length = n_ctx + job["steps"] + 2
    stream = np.random.default_rng(0).integers(3, job["vocab"], n_ctx)
    res: dict = {"mode": mode.name, "frame": job["frame"], "ctx": n_ctx, "rss_start": _proc_status()["VmRSS"]}
    if mode.engine == "genai":
        import onnxruntime_genai as og

        model = og.Model(job["path"])
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=max_length, do_sample=False)
        gen = og.Generator(model, params)
        res["rss_loaded"] = _proc_status()["VmRSS"]
        t0 = time.perf_counter()
        for a in range(0, n_ctx, chunk):
            gen.append_tokens(stream[None, a:a + chunk].astype(np.int32))
        res["prefill_s"] = time.perf_counter() - t0
        step = gen.generate_next_token
        # genai's shared KV buffer (fp32) of max_length
        res["state_bytes"] = 2 * job["layers"] * job["kv_heads"] * max_length * job["head_dim"] * 4
    else:
        from fastcar_compile.runtime import FastCarSession

        so = ort_options(job["threads"], job["entries"])
        sess = FastCarSession(job["path"], session_options=so, max_length=max_length)
        thr = taus(job["layers"], mode.replay)
        res["rss_loaded"] = _proc_status()["VmRSS"]
        st = sess.new_state(1)
        t0 = time.perf_counter()
        for a in range(0, n_ctx, chunk):
            out = sess.step(st, stream[None, a:a + chunk], threshold=thr, check=False)
            st = out.state
        res["prefill_s"] = time.perf_counter() - t0
        box = {"st": st, "nxt": out.logits[:, -1:].argmax(-1)}

        def step() -> None:
            o = sess.step(box["st"], box["nxt"], threshold=thr, check=False)
            box["st"], box["nxt"] = o.state, o.logits[:, -1:].argmax(-1)

        res["state_bytes"] = st.nbytes()
    step()  # the first call of genai only samples the token its prefill computed
    res["rss_prefilled"] = _proc_status()["VmRSS"]
    print(json.dumps(res), flush=True)
    for line in sys.stdin:
        if line.strip() != "block":
            break
        step()  # untimed: brings this model's working set back after the others ran
        ms = []
        for _ in range(block):
            t1 = time.perf_counter()
            step()
            ms.append(1e3 * (time.perf_counter() - t1))
        print(json.dumps(ms), flush=True)
    st_ = _proc_status()
    print(json.dumps({"rss_decoded": st_["VmRSS"], "rss_peak": st_["VmHWM"]}), flush=True)


def _measure_frame(f: int, modes: list[Mode], jobs: dict[str, dict], rounds: int, bar) -> list[dict]:
    """All modes of one frame alive at once (one process each, prefilled one after the other), then decoded in
    turn, a block at a time, `rounds` times: machine load hits every mode alike (bench_genai's interleaving)."""
    import tempfile

    procs, rows = {}, {}
    with tempfile.TemporaryDirectory() as d:
        for m in modes:
            bar.set_postfix_str(f"frame {f}: prefill {m.name[:40]}")
            err = open(Path(d) / f"{len(procs)}.err", "w+")  # noqa: SIM115 - read back on failure
            p = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(jobs[m.name])], text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                 env={**os.environ, "OMP_NUM_THREADS": str(jobs[m.name]["threads"])})
            line = p.stdout.readline()
            if not line:
                p.wait()
                err.seek(0)
                tail = (err.read().strip().splitlines() or ["(no output)"])[-1]
                bar.write(f"frame {f} {m.name}: failed: {tail}")
                rows[m.name] = {"mode": m.name, "frame": f, "error": tail}
                continue
            rows[m.name] = {**json.loads(line), "ms": []}
            procs[m.name] = p
            bar.update(1)
        bar.set_postfix_str(f"frame {f}: decoding {len(procs)} modes in turn")
        for _ in range(rounds):
            for name, p in procs.items():
                p.stdin.write("block\n")
                p.stdin.flush()
                rows[name]["ms"] += json.loads(p.stdout.readline())
        for name, p in procs.items():
            p.stdin.write("end\n")
            p.stdin.flush()
            rows[name].update(json.loads(p.stdout.readline()))
            p.wait()
    for name in procs:
        r = rows[name]
        r.update(ms_median=float(np.median(r["ms"])), ms_q25=float(np.percentile(r["ms"], 25)))
        bar.write(f"frame {f:4d} {name}: {r['ms_q25']:.2f} ms/token (q25), RSS {r['rss_decoded'] / 2**20:.0f} MiB "
                  f"(peak {r['rss_peak'] / 2**20:.0f}), prefill {r['prefill_s']:.1f} s")
    return [rows[m.name] for m in modes]


def run_all(cfg: dict, modes: list[Mode], frames: list[int], threads: int, cache: Path,
            entries: dict[str, str]) -> list[dict]:
    from tqdm import tqdm

    shape: LlamaShape = cfg["shape"]
    L = cfg["frame_tokens"]
    paths = prepare(cfg, modes, cache, threads, entries)
    rounds = max(1, cfg["tokens"] // cfg["block"])
    rows = []
    bar = tqdm(total=len(frames) * len(modes), desc="long-video configurations (prefilled)", unit="config")
    for f in frames:
        jobs = {m.name: {"mode": asdict(m), "frame": f, "ctx": f * L, "block": cfg["block"], "chunk": cfg["chunk"],
                         "steps": 1 + rounds * (cfg["block"] + 1), "path": paths[m.name], "threads": threads,
                         "entries": entries, "vocab": shape.vocab, "layers": shape.layers,
                         "kv_heads": shape.kv_heads, "head_dim": shape.head_dim} for m in modes}
        rows += _measure_frame(f, modes, jobs, rounds, bar)
    bar.close()
    return rows


def table(rows: list[dict], frames: list[int], modes: list[Mode]) -> str:
    ok = {(r["mode"], r["frame"]): r for r in rows if "error" not in r}
    g = {f: ok[(GENAI, f)]["ms_q25"] for f in frames if (GENAI, f) in ok}
    head = ("| mode | " + " | ".join(f"frame {f}" for f in frames) + " | last / first frame |\n|---|"
            + "---|" * (len(frames) + 1) + "\n")
    out = ["**ms per decode token (lower quartile of the timed steps); x = genai dense at the same frame / this**\n\n" + head]
    for m in modes:
        cells = []
        for f in frames:
            r = ok.get((m.name, f))
            cells.append("failed" if r is None else f"{r['ms_q25']:.2f}" +
                         (f" ({g[f] / r['ms_q25']:.2f}x)" if f in g and m.name != GENAI else ""))
        a, b = ok.get((m.name, frames[0])), ok.get((m.name, frames[-1]))
        ratio = f"{b['ms_q25'] / a['ms_q25']:.2f}" if a and b else "-"
        out.append(f"| {m.name} | " + " | ".join(cells) + f" | {ratio} |\n")
    out.append("\n**process memory after decode: VmRSS MiB (+ growth over the loaded model) / decode state MiB** "
               "(peaks, VmHWM incl. model load and prefill: JSON)\n\n" + head)
    for m in modes:
        cells = []
        for f in frames:
            r = ok.get((m.name, f))
            cells.append("failed" if r is None else f"{r['rss_decoded'] / 2**20:.0f} "
                         f"(+{(r['rss_decoded'] - r['rss_loaded']) / 2**20:.0f}) / {r['state_bytes'] / 2**20:.1f}")
        a, b = ok.get((m.name, frames[0])), ok.get((m.name, frames[-1]))
        ratio = f"{b['rss_decoded'] / a['rss_decoded']:.2f}" if a and b else "-"
        out.append(f"| {m.name} | " + " | ".join(cells) + f" | {ratio} |\n")
    return "".join(out)


def plot(rows: list[dict], modes: list[Mode], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastcar_compile.core.atomic import save_figure

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.4))
    for m in modes:
        rs = sorted((r for r in rows if r["mode"] == m.name and "error" not in r), key=lambda r: r["frame"])
        if not rs:
            continue
        x = [r["frame"] for r in rs]
        style = "--" if m.engine == "genai" else "-"
        ax[0].plot(x, [r["ms_q25"] for r in rs], style, marker="o", label=m.name)
        ax[1].plot(x, [r["rss_decoded"] / 2**20 for r in rs], style, marker="o", label=m.name)
    ax[0].set_ylabel("ms per decode token (lower quartile)")
    ax[1].set_ylabel("process RSS after decode (MiB)")
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xlabel("frame (video length so far)")
        a.grid(alpha=0.3)
    ax[0].set_yscale("log")
    ax[1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, frames 2,4,8 (smoke run)")
    ap.add_argument("--frames", help="comma-separated frame counts (default 8,16,32,64; quick 2,4,8)")
    ap.add_argument("--modes", default="", help="comma-separated indices into MODES (default: all)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads of every model")
    ap.add_argument("--tokens", type=int, help="timed decode tokens per configuration (default 48; quick 16)")
    ap.add_argument("--block", type=int, help="tokens timed per mode before the next mode's turn (default 8)")
    ap.add_argument("--session-config", action="append", metavar="session.KEY=VALUE",
                    help="ORT config entries of every model, genai's included (default: "
                         "session.intra_op.allow_spinning=0: on a shared machine a spinning pool thread that loses "
                         "its core stalls every step; give session.intra_op.allow_spinning=1 for ORT's default)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/bench/long_video_llama"),
                    help="output stem: writes STEM.json, STEM.md, STEM.png")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(json.loads(a.worker))
        return 0
    from fastcar_compile.core.atomic import write_text
    from fastcar_compile.core.errors import FastCarError

    cfg = dict(QUICK if a.quick else FULL)
    cfg.update({k: v for k, v in (("block", a.block), ("tokens", a.tokens)) if v})
    try:
        frames = sorted({int(x) for x in a.frames.split(",")}) if a.frames else list(cfg["frames"])
        picked = [int(x) for x in a.modes.split(",") if x.strip()]
    except ValueError:
        raise FastCarError(f"--frames/--modes take comma-separated integers, got {a.frames!r} / {a.modes!r}") \
            from None
    shape: LlamaShape = cfg["shape"]
    L = cfg["frame_tokens"]
    max_frames = (shape.max_pos - 2 * cfg["tokens"] - 4) // L  # prefill + the decoded tokens must fit
    if not frames or frames[0] < 1 or frames[-1] > max_frames:
        raise FastCarError(f"--frames {a.frames}: give frame counts from 1 to {max_frames} "
                           f"(the model has {shape.max_pos} positions of {L}-token frames)")
    if bad := [i for i in picked if not 0 <= i < len(MODES)]:
        raise FastCarError(f"--modes {bad}: indices are 0..{len(MODES) - 1} ({', '.join(m.name for m in MODES)})")
    modes = [MODES[i] for i in picked] if picked else MODES
    if GENAI not in {m.name for m in modes}:
        modes = [MODES[0], *modes]  # the reference of every ratio
    entries = parse_entries(a.session_config) if a.session_config else {"session.intra_op.allow_spinning": "0"}
    rows = run_all(cfg, modes, frames, a.threads, a.cache, entries)
    load = os.getloadavg()
    title = (f"random LLaMA {shape.hidden}x{shape.layers} ({shape.heads}/{shape.kv_heads} heads), {L}-token frames, "
             f"{a.threads} threads, {' '.join(f'{k}={v}' for k, v in entries.items()) or 'ORT defaults'}, lower quartile of "
             f"{cfg['tokens']} decode tokens (modes in turn, {cfg['block']} at a time); load avg at end {load[0]:.1f}")
    text = (f"# Long videos on a LLaMA-style decoder\n\n{title}.\n\n`python benchmarks/long_video_llama.py"
            f"{' --quick' if a.quick else ''} --frames {','.join(map(str, frames))}`\n\n" + table(rows, frames, modes))
    print("\n" + text)
    res = {"shape": shape.tag(), "frame_tokens": L, "threads": a.threads, "block": cfg["block"], "tokens": cfg["tokens"], "session_config": entries,
           "frames": frames, "modes": [asdict(m) for m in modes], "loadavg_end": load, "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_text(a.out.with_suffix(".json"), json.dumps(res, indent=1))
    write_text(a.out.with_suffix(".md"), text)
    plot(rows, modes, a.out.with_suffix(".png"), title)
    print(f"wrote {a.out}.json/.md/.png")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # one line for the user's mistakes, a traceback for ours
        from fastcar_compile.core.errors import FastCarError

        if isinstance(exc, FastCarError):
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
        raise
