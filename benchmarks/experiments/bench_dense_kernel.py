"""Dense decode attention alone, per layer: the ai.fastcar CompressedAttention plain-mode kernel (one or two builds
of libfastcar_ops.so, A/B) vs ORT's com.microsoft.GroupQueryAttention, both on a shared KV buffer (bound as past
and present, written in place: how FastCarSession and onnxruntime-genai run them), in the same run.

The benchmark LLaMA's head layout (16 query / 2 KV heads x 64; --heads/--kv-heads/--head-dim change it), batch 1,
one decode token at context T. Each model holds --layers independent attention nodes with their own KV buffers
(8: the 32 MB of K/V a step of the 8-layer model streams at T = 4096, so the cache state matches the model's, not
a single layer's 4 MB left warm in L3); one ORT run = one token through every layer; time per layer = run / layers.
Variants run in turn, --block runs each per round (interleaved, so load hits them alike); per-layer time = lower
quartile (wall time; --cpu-time: process CPU time, which a loaded machine's time slicing does not inflate). Outputs of all variants at the same inputs are compared (max abs difference).

    python benchmarks/experiments/bench_dense_kernel.py                                   # the current build vs GQA
    python benchmarks/experiments/bench_dense_kernel.py --libs OLD.so,NEW.so --out fastcar-out/bench/   # A/B two builds + GQA, JSON + PNG
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common and the suite scripts
from _common import make_session, save_results  # noqa: E402


def _model(kind: str, layers: int, hq: int, hkv: int, d: int) -> bytes:
    """`layers` attention nodes on shared q/k/v inputs, each with its own past/present KV buffer."""
    from onnx import TensorProto, helper

    f, i32, i64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64
    scale = float(1 / np.sqrt(d))
    if kind == "gqa":
        ins = [helper.make_tensor_value_info("query", f, [1, 1, hq * d]),
               helper.make_tensor_value_info("key", f, [1, 1, hkv * d]),
               helper.make_tensor_value_info("value", f, [1, 1, hkv * d]),
               helper.make_tensor_value_info("seqlens_k", i32, [1]),
               helper.make_tensor_value_info("total_sequence_length", i32, [])]
    else:
        ins = [helper.make_tensor_value_info("q", f, [1, hq, 1, d]), helper.make_tensor_value_info("k", f, [1, hkv, 1, d]),
               helper.make_tensor_value_info("v", f, [1, hkv, 1, d]),
               helper.make_tensor_value_info("attention_mask", i64, [1, "T"]),
               helper.make_tensor_value_info("total_len", i32, [])]
    nodes, outs = [], []
    for n in range(layers):
        kv = [f"past_key_{n}", f"past_value_{n}"]
        ins += [helper.make_tensor_value_info(x, f, [1, hkv, "N", d]) for x in kv]
        names = [f"out_{n}", f"present_key_{n}", f"present_value_{n}"]
        outs += [helper.make_tensor_value_info(names[0], f, [1, 1, hq * d])]
        outs += [helper.make_tensor_value_info(x, f, [1, hkv, "N", d]) for x in names[1:]]
        if kind == "gqa":
            nodes.append(helper.make_node("GroupQueryAttention", ["query", "key", "value", *kv, "seqlens_k",
                                                                  "total_sequence_length"], names,
                                          domain="com.microsoft", num_heads=hq, kv_num_heads=hkv, scale=scale))
        else:
            nodes.append(helper.make_node("CompressedAttention", ["q", "k", "v", *kv, "attention_mask", "total_len"],
                                          names, domain="ai.fastcar", num_heads=hq, kv_num_heads=hkv, scale=scale))
    domain = "com.microsoft" if kind == "gqa" else "ai.fastcar"
    model = helper.make_model(helper.make_graph(nodes, "attn", ins, outs), ir_version=10,
                              opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(domain, 1)])
    return model.SerializeToString()


class Variant:
    """One session with its KV buffers and an IO binding made once (every run: one token through every layer)."""

    def __init__(self, kind: str, lib: str | None, ctx: int, a):
        import onnxruntime as ort

        self.clock = time.process_time if a.cpu_time else time.perf_counter
        # (no spinning under a CPU-time clock: spinning threads would bill their wait as work)
        self.sess = make_session(_model(kind, a.layers, a.heads, a.kv_heads, a.head_dim), a.threads,
                                 spin=not a.cpu_time, library=lib)
        rng = np.random.default_rng(0)  # every variant gets the same contents
        n_buf = ctx + 8
        q = rng.standard_normal((1, a.heads, 1, a.head_dim)).astype(np.float32)
        k, v = (rng.standard_normal((1, a.kv_heads, 1, a.head_dim)).astype(np.float32) for _ in range(2))
        self.kv = [ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((1, a.kv_heads, n_buf, a.head_dim))
                                                    .astype(np.float32)) for _ in range(2 * a.layers)]
        self.out = [np.empty((1, 1, a.heads * a.head_dim), np.float32) for _ in range(a.layers)]
        io = self.sess.io_binding()
        if kind == "gqa":
            feeds = {"query": q.reshape(1, 1, -1), "key": k.reshape(1, 1, -1), "value": v.reshape(1, 1, -1),
                     "seqlens_k": np.array([ctx - 1], np.int32), "total_sequence_length": np.array(ctx, np.int32)}
        else:
            feeds = {"q": q, "k": k, "v": v, "attention_mask": np.ones((1, ctx), np.int64),
                     "total_len": np.array(ctx, np.int32)}
        self.feeds = feeds  # kept alive: bound by pointer
        for name, x in feeds.items():
            io.bind_cpu_input(name, x)
        for n in range(a.layers):
            for j, part in enumerate(("key", "value")):
                io.bind_ortvalue_input(f"past_{part}_{n}", self.kv[2 * n + j])
                io.bind_ortvalue_output(f"present_{part}_{n}", self.kv[2 * n + j])
            io.bind_output(f"out_{n}", "cpu", 0, np.float32, self.out[n].shape, self.out[n].ctypes.data)
        self.io = io

    def run(self) -> float:
        t0 = self.clock()
        self.sess.run_with_iobinding(self.io)
        return self.clock() - t0


def measure(variants: dict[str, Variant], rounds: int, block: int, layers: int) -> dict[str, list[float]]:
    for v in variants.values():  # warm up (first-run allocations, page faults)
        for _ in range(3):
            v.run()
    times: dict[str, list[float]] = {n: [] for n in variants}
    for _ in range(rounds):
        for name, v in variants.items():
            for _ in range(block):
                times[name].append(v.run() / layers * 1e6)
    return times


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastcar_compile.core.atomic import save_figure

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    ctxs = [r["ctx"] for r in results["rows"]]
    base = results["variants"][-1] if "gqa" not in results["variants"] else "gqa"
    for name in results["variants"]:
        ax.plot(ctxs, [r["us"][name] for r in results["rows"]], "o-", label=name)
        bx.plot(ctxs, [r["us"][base] / r["us"][name] for r in results["rows"]], "o-", label=name)
    mb = [r["kv_mb_per_layer"] for r in results["rows"]]
    for gbs in (20, 40):
        ax.plot(ctxs, [x / gbs * 1e3 for x in mb], ":", color="grey", lw=1)
        ax.annotate(f"K+V at {gbs} GB/s", (ctxs[-1], mb[-1] / gbs * 1e3), fontsize=7, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("us per layer per decode token")
    bx.set_xscale("log", base=2)
    bx.set_xlabel("context (tokens)")
    bx.set_ylabel(f"speed vs {base} (x)")
    for a in (ax, bx):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(results["title"], fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--libs", help="comma-separated kernel libraries, A/B (default: the current build)")
    ap.add_argument("--names", help="comma-separated names for --libs (default: old,new for two; fastcar for one)")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--no-gqa", action="store_true", help="leave ORT's GroupQueryAttention out")
    ap.add_argument("--cpu-time", action="store_true", help="process CPU time instead of wall time (no spinning): "
                    "robust on a loaded machine, blind to how well the threads overlap")
    ap.add_argument("--out", type=Path, help="folder for bench_dense_kernel[_TAG].json / .png")
    ap.add_argument("--tag", default="", help="suffix of the output files")
    a = ap.parse_args(argv)
    from fastcar_compile.runtime.native import library_path

    libs = a.libs.split(",") if a.libs else [str(library_path())]
    names = a.names.split(",") if a.names else (["old", "new"] if len(libs) == 2 else
                                                ["fastcar"] if len(libs) == 1 else [f"lib{i}" for i in range(len(libs))])
    if len(names) != len(libs):
        ap.error("--names: give one name per --libs entry")
    rows = []
    for ctx in (int(x) for x in a.contexts.split(",")):
        variants = {n: Variant("fastcar", lib, ctx, a) for n, lib in zip(names, libs, strict=True)}
        if not a.no_gqa:
            variants["gqa"] = Variant("gqa", None, ctx, a)
        times = measure(variants, a.rounds, a.block, a.layers)
        us = {n: float(np.percentile(t, 25)) for n, t in times.items()}
        outs = {n: np.concatenate(v.out) for n, v in variants.items()}
        diff = max(float(np.abs(x - outs[names[0]]).max()) for x in outs.values())
        mb = 2 * a.kv_heads * ctx * a.head_dim * 4 / 1e6
        line = f"ctx {ctx}: " + ", ".join(f"{n} {x:.1f} us" for n, x in us.items()) + " per layer"
        ratios = {}
        if len(names) >= 2:
            ratios[f"{names[0]}/{names[-1]}"] = us[names[0]] / us[names[-1]]
        if "gqa" in us:
            ratios[f"gqa/{names[-1]}"] = us["gqa"] / us[names[-1]]
        line += "; " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
        line += f"; K+V {mb:.1f} MB/layer -> {mb / us[names[-1]] * 1e3:.1f} GB/s ({names[-1]}); max |diff| {diff:.1e}"
        print(line, flush=True)
        rows.append({"ctx": ctx, "us": us, "ratios": ratios, "kv_mb_per_layer": mb, "max_abs_diff": diff,
                     "us_all": {n: t for n, t in times.items()}})
        del variants
    clock = "CPU time" if a.cpu_time else "wall time"
    results = {"title": f"dense decode attention per layer: {a.heads}/{a.kv_heads} heads x {a.head_dim}, "
                        f"{a.layers} layers' buffers, {a.threads} threads ({clock}, lower quartile, interleaved)",
               "variants": [*names, *([] if a.no_gqa else ["gqa"])], "libs": dict(zip(names, libs, strict=True)),
               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "rows": rows}
    if a.out is None:
        return 0
    stem = "bench_dense_kernel" + (f"_{a.tag}" if a.tag else "")
    plot(results, a.out / f"{stem}.png")
    return save_results(a.out / f"{stem}.json", results)


if __name__ == "__main__":
    sys.exit(main())
