"""CompressedAttention's compressed mode alone: per decode token of one layer at a full budget of C slots, with the
benchmark LLaMA's head layout (16 query / 2 KV heads x 64), in place (past and present bound to one buffer, as
FastCarSession runs it), 1 intra-op thread; optionally two kernel libraries A/B in the same run (interleaved).

    python benchmarks/experiments/bench_compressed_kernel.py                       # the current build, C 1024 and 2048
    python benchmarks/experiments/bench_compressed_kernel.py --libs OLD.so,NEW.so  # A/B two builds of libfastcar_ops.so
    python benchmarks/experiments/bench_compressed_kernel.py --libs OLD.so,NEW.so --evict 64  # cold slots, as in a model

Each config fills C + 256 tokens in 64-token chunks through the kernel (timed: "prefill"), then 10 rounds of 20
single-token steps per library in turn; per-token time = lower quartile; the outputs of the two libraries are
compared (max abs difference).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common and the suite scripts
from _common import make_session  # noqa: E402

HQ, HKV, D = 16, 2, 64
EVICT = np.zeros(0, np.float32)  # --evict MB: read before each timed step, so the slots are cold as in a model


def configs(C: int) -> dict:
    from fastcar_compile.fastar.config import KVCompressConfig

    return {"window (all slots)": KVCompressConfig(budget=C, sinks=4, window=C // 2, eviction="oldest"),
            "TempCache 0.95 (all slots)": KVCompressConfig(budget=C, sinks=4, window=128, tempcache_sim=0.95),
            "TempCache 0.95 + AnnSA lsh 8x4": KVCompressConfig(budget=C, sinks=4, window=128, tempcache_sim=0.95,
                                                               lsh_bits=8, lsh_tables=4)}


def run(libs: list[str], C: int) -> None:
    import onnxruntime as ort
    from test_compressed_attention import _model  # the single-op graph the kernel tests use

    from fastcar_compile.passes.fused_attention import compressed_attributes, slot_width

    T0 = C + 256
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, h, T0 + 400, D)).astype(np.float32) for h in (HQ, HKV, HKV))
    for name, cfg in configs(C).items():
        tc = cfg.tempcache_sim is not None
        attrs = {**compressed_attributes(cfg, D), "num_heads": HQ, "kv_num_heads": HKV, "scale": 1 / np.sqrt(D)}
        F = slot_width(cfg)
        runs = []
        for lib in libs:
            sess = make_session(_model(n_in=10 if tc else 8, n_out=6 if tc else 5, **attrs), 1, library=lib)
            state = {n: np.zeros((1, HKV, C, F if n == "slots" else D), np.float32)
                     for n in ("key", "value", "slots", "key_raw")}
            runs.append((sess, {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in state.items()}))

        def step(i: int, p: int, n: int, times: list | None = None, runs=runs, tc=tc) -> np.ndarray:
            sess, ov = runs[i]
            io = sess.io_binding()
            feeds = {"q": q[:, :, p:p + n], "k": k[:, :, p:p + n], "v": v[:, :, p:p + n],
                     "attention_mask": np.ones((1, p + n), np.int64), "total_len": np.array(p + n, np.int32)}
            if tc:
                feeds["k_raw"] = feeds["k"]
            for key, a in feeds.items():
                io.bind_cpu_input(key, np.ascontiguousarray(a))
            out = np.empty((1, n, HQ * D), np.float32)
            aligned = np.empty((1, HKV, n, D), np.float32)
            io.bind_output("out", "cpu", 0, np.float32, out.shape, out.ctypes.data)
            io.bind_output("aligned_key", "cpu", 0, np.float32, aligned.shape, aligned.ctypes.data)
            for key in ("key", "value", "slots") + (("key_raw",) if tc else ()):
                io.bind_ortvalue_input("past_" + key, ov[key])
                io.bind_ortvalue_output("present_" + key, ov[key])
            if times is not None and EVICT.size:  # the model's weights stream between a layer's steps
                EVICT.sum()
            t0 = time.perf_counter()
            sess.run_with_iobinding(io)
            if times is not None:
                times.append(time.perf_counter() - t0)
            return out

        pre = []
        for i in range(len(runs)):
            t0 = time.perf_counter()
            for p in range(0, T0, 64):
                step(i, p, 64)
            pre.append(time.perf_counter() - t0)
        times, outs = [[] for _ in runs], [[] for _ in runs]
        for rnd in range(10):
            for i in range(len(runs)):
                for j in range(20):
                    outs[i].append(step(i, T0 + rnd * 20 + j, 1, times[i]))
        ms = [np.percentile(t, 25) * 1e3 for t in times]
        line = f"C={C} {name}: " + " / ".join(f"{x:.3f}" for x in ms) + " ms per token; prefill " + \
            " / ".join(f"{x:.2f}" for x in pre) + f" s for {T0} tokens"
        if len(runs) > 1:
            diff = max(float(np.abs(a - b).max()) for a, b in zip(outs[0], outs[-1], strict=True))
            line += f"; A/B = {ms[0] / ms[-1]:.2f}x, max |out A - out B| {diff:.1e}"
        print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--libs", help="comma-separated kernel libraries (default: the current build)")
    ap.add_argument("--budgets", default="1024,2048", help="comma-separated C")
    ap.add_argument("--evict", type=int, default=0, help="MB read before every timed step (0: none), so the slots "
                    "are as cold as in a model, where the weights stream between one layer's steps")
    a = ap.parse_args(argv)
    global EVICT
    EVICT = np.ones(a.evict << 18, np.float32)  # MB -> floats
    from fastcar_compile.runtime.native import library_path

    libs = a.libs.split(",") if a.libs else [str(library_path())]
    for C in (int(x) for x in a.budgets.split(",")):
        run(libs, C)
    return 0


if __name__ == "__main__":
    sys.exit(main())
