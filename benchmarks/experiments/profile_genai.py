"""Where a compiled genai decode step spends its time beyond the Amdahl bound: ORT's per-op profile.

The step genai's generator runs, reproduced in plain ONNX Runtime with IO binding the way genai binds it:
one KV buffer per layer [1, Hkv, max_length, D] bound as past and present (GroupQueryAttention appends in
place), the FastCar state (`conv_state` / `recurrent_state`) bound as past and present, the context `--ctx`
tokens long. The KV content does not change the cost (attention reads all `ctx` positions either way), so
the buffers are zeros and no prefill is run. The replay state is filled (age 0 in every slot: every
decode token is eligible), so a variant compiled with tau = -inf replays every MLP and +inf none.

Variants (folders of benchmarks/bench_genai.py's variants, or any folder with model.onnx / fast.onnx):
`dense` and `noMLP` (every MLP branch zeroed: the bound's denominator), `denseN` / `noMLPN` (the same with
the native ai.fastcar.GroupQueryAttention), and compiled `rK` folders. Per
variant: ms per step (median of --steps after --warmup) and the summed kernel time per op type, so
(rK - noMLP) names what FastCar adds that the bound does not allow for.

    python benchmarks/experiments/profile_genai.py --quick                # small model, ctx 256
    python benchmarks/experiments/profile_genai.py --ctx 4096 --steps 40  # the bench_genai.py model
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common and the suite scripts
import bench_genai  # noqa: E402
from _common import DEFAULT_CACHE, ort_options  # noqa: E402

KERNELS: dict[str, dict[str, int]] = {}  # model path -> op type -> kernels run per step (from the profile)
CPU_TIME = False  # --cpu-time: process CPU seconds per step (1 thread, no spinning): robust to a loaded machine
KV_ZEROS = False  # --kv zeros: the old all-zero KV buffers (reads served by the kernel's shared zero page)


def _session(path: Path, threads: int, profile: bool, native: bool):
    """The model loaded as genai's generator loads it: from its file, the compiled defaults of `video_start` and
    `fastcar_threshold` staying initializers (make_session would make them inputs to feed, as FastCarSession
    feeds them, which _binding, binding genai's inputs only, leaves unbound)."""
    import onnxruntime as ort

    from fastcar_compile.runtime.native import library_path

    lib = library_path() if native else None  # (a model without ai.fastcar ops is not affected)
    so = ort_options(threads, spin=not CPU_TIME, library=lib,
                     profile=Path(tempfile.gettempdir()) / "fastcar_profile_genai" if profile else None)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _binding(sess, ctx: int, max_length: int, head_dim: int, vocab: int, zeros: bool | None = None):
    """IO binding of one decode step at position ctx, state buffers bound as their own outputs; zeros: KV buffers
    from np.zeros (default: `--kv`'s KV_ZEROS)."""
    zeros = KV_ZEROS if zeros is None else zeros
    import onnxruntime as ort

    io = sess.io_binding()
    keep = []

    def value(arr):
        v = ort.OrtValue.ortvalue_from_numpy(arr)
        keep.append((arr, v))
        return v

    io.bind_ortvalue_input("input_ids", value(np.array([[5]], np.int64 if _int64_ids(sess) else np.int32)))
    io.bind_ortvalue_input("attention_mask", value(np.ones((1, ctx + 1), np.int64)))
    inputs = {i.name: i for i in sess.get_inputs()}
    if "position_ids" in inputs:  # torch exports (the fused dynamo export of bench_genai's (b))
        io.bind_ortvalue_input("position_ids", value(np.array([[ctx]], np.int64)))
    outputs = {o.name for o in sess.get_outputs()}
    bound = set()
    for name, inp in inputs.items():
        if name.startswith("past_key_values."):
            out = "present." + name[len("past_key_values."):]
        elif name.startswith("past_"):  # FastCar state of a non-genai compile: past_mlp_cache.N / past_mlp_age.N
            out = "present_" + name[len("past_"):]
        else:
            continue
        if name.endswith((".key", ".value")):  # random, written: np.zeros' untouched pages all map the one zero
            # page, so attention would read them from L1 instead of DRAM (half the real cost at ctx 1024)
            shape = (1, inp.shape[1], max_length, head_dim)
            arr = (np.zeros(shape, np.float32) if zeros
                   else np.random.default_rng(len(bound)).standard_normal(shape).astype(np.float32))
        elif name.endswith(".recurrent_state"):  # age + 1 = 1: every slot written by a computed MLP
            arr = np.ones([1, *inp.shape[1:]], np.int64)
        elif inp.type == "tensor(int64)":  # age 0: every slot written by a computed MLP
            arr = np.zeros([1, *inp.shape[1:]], np.int64)
        else:
            arr = np.random.default_rng(0).standard_normal([1, *inp.shape[1:]]).astype(np.float32)
        v = value(arr)
        io.bind_ortvalue_input(name, v)
        if out in outputs:
            io.bind_ortvalue_output(out, v)
            bound.add(out)
    io.bind_ortvalue_output("logits", value(np.empty((1, 1, vocab), np.float32)))
    for o in outputs - {"logits"} - bound:
        io.bind_output(o)
    return io, keep


def _int64_ids(sess) -> bool:
    return next(i for i in sess.get_inputs() if i.name == "input_ids").type == "tensor(int64)"


def _fastcar_nodes(path: Path) -> set[str]:
    """Names of the main graph's ai.fastcar nodes: the table lists them as ai.fastcar.<op> (the profile names the op
    type only, and ai.fastcar.GroupQueryAttention must not pool with ORT's)."""
    import onnx

    from fastcar_compile.core import contract

    return {n.name for n in onnx.load(str(path), load_external_data=False).graph.node if n.domain == contract.DOMAIN}


def _branch_nodes(path: Path) -> set[str]:
    """Names of the nodes inside If branches (their kernel times are also inside the If's own time)."""
    import onnx

    names: set[str] = set()

    def walk(graph, inside: bool) -> None:
        for node in graph.node:
            if inside:
                names.add(node.name)
            for attr in node.attribute:
                for g in [attr.g] if attr.HasField("g") else list(attr.graphs):
                    walk(g, True)

    walk(onnx.load(str(path), load_external_data=False).graph, False)
    return names


def profile(path: Path, ctx: int, steps: int, warmup: int, threads: int, native: bool, head_dim: int,
            vocab: int) -> tuple[float, dict[str, float], float]:
    """(median ms per step, kernel ms per step by op type, kernel launches per step) over `steps` runs each.
    The step time comes from a session without profiling (ORT's profiler costs time per kernel, which would
    favour graphs with fewer nodes); the kernel table from a second, profiled session. Ops inside If branches
    are listed as `If/<op>`, and `If` itself as the If's time less its branch's kernels (its own overhead)."""
    branch, ours = _branch_nodes(path), _fastcar_nodes(path)
    clock = time.process_time if CPU_TIME else time.perf_counter
    times = []
    for profiled in (False, True):
        sess = _session(path, threads, profiled, native)
        io, _keep = _binding(sess, ctx, ctx + 8, head_dim, vocab)
        for _ in range(warmup):
            sess.run_with_iobinding(io)
        for _ in range(steps):
            t0 = clock()
            sess.run_with_iobinding(io)
            if not profiled:
                times.append(clock() - t0)
    trace_file = Path(sess.end_profiling())
    trace = json.loads(trace_file.read_text())
    trace_file.unlink()
    runs = [e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"]
    timed = runs[-steps:]
    start = timed[0]["ts"] if timed else 0
    by_op: dict[str, float] = collections.defaultdict(float)
    launches: dict[str, float] = collections.defaultdict(float)
    for e in trace:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= start:
            op, node = e["args"].get("op_name", "?"), e["name"][:-len("_kernel_time")]
            op = f"ai.fastcar.{op}" if node in ours else op
            ms = e["dur"] / 1e3 / steps
            if node in branch:
                by_op[f"If/{op}"] += ms
                by_op["If"] -= ms
                launches[f"If/{op}"] += 1 / steps
            else:
                by_op[op] += ms
                launches[op] += 1 / steps
    KERNELS.setdefault(str(path), {}).update({k: round(v) for k, v in launches.items()})
    return float(np.median(times)) * 1e3, dict(by_op), sum(launches.values())


def _model_path(folder: Path) -> Path:
    return folder / "fast.onnx" if (folder / "fast.onnx").is_file() else folder / "model.onnx"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ctx", type=int)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="dense,noMLP,r0,rall",
                    help="comma-separated variant names (rK: K layers replay; rall: every layer) or NAME=FOLDER")
    ap.add_argument("--no-native", action="store_true")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--rounds", type=int, default=2, help="variants are profiled in turn this many times")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time steps by process CPU time (use with --threads 1): preemption by other jobs on a "
                         "shared machine does not count; kernel times in the table stay wall-clock")
    ap.add_argument("--kv", choices=["random", "zeros"], default="random",
                    help="KV buffer contents: random (real memory traffic, as after a prefill) or zeros (untouched "
                         "zero pages: K/V reads hit one cached page, for comparison with older figures)")
    a = ap.parse_args(argv)
    global CPU_TIME, KV_ZEROS
    CPU_TIME = a.cpu_time
    KV_ZEROS = a.kv == "zeros"
    cfg = dict(bench_genai.QUICK if a.quick else bench_genai.FULL)
    shape = cfg["shape"]
    ctx = a.ctx or cfg["contexts"][-1]
    src = bench_genai.build_genai(shape, a.cache)
    work = a.cache / f"genai-variants-{shape.tag()}-L{cfg['frame_tokens']}"
    names = [n.strip() for n in a.variants.split(",")]
    # only NAME=FOLDER variants: nothing to build (variants() would recompile every rK when the compiler changed)
    folders = {} if all("=" in n for n in names) else bench_genai.variants(src, work, shape.layers,
                                                                           cfg["frame_tokens"])
    names = [f"r{shape.layers}" if n == "rall" else n for n in names]
    for spec in [n for n in names if "=" in n]:  # NAME=FOLDER: another build of a variant, e.g. for an A/B
        name, folder = spec.split("=", 1)
        folders[name] = Path(folder)
        names[names.index(spec)] = name
    results: dict[str, list[tuple[float, dict[str, float], float]]] = collections.defaultdict(list)
    for _ in range(a.rounds):
        for name in names:
            path = _model_path(folders[name])
            results[name].append(profile(path, ctx, a.steps, a.warmup, a.threads, not a.no_native,
                                         shape.head_dim, shape.vocab))
    ms = {n: min(r[0] for r in rs) for n, rs in results.items()}
    ops = {n: min(rs, key=lambda r: r[0])[1] for n, rs in results.items()}
    clock = "CPU" if a.cpu_time else "wall"
    print(f"ctx {ctx}, {a.threads} threads, {shape.tag()}: {clock} ms/step (best of {a.rounds} medians)")
    print("  " + ", ".join(f"{n} {v:.2f}" for n, v in ms.items()))
    if "dense" in ms and "noMLP" in ms:
        f = 1 - ms["noMLP"] / ms["dense"]
        print(f"  MLP share f = {f:.3f}")
        for n in names:
            k = n.split("-")[0]  # rK or rK-suffix
            if k.startswith("r") and k[1:].isdigit():
                r = int(k[1:]) / shape.layers
                bound_ms = ms["dense"] * (1 - f * r)
                print(f"  {n}: replay {r:.0%}: {ms[n]:.2f} ms vs bound {bound_ms:.2f} ms -> overhead "
                      f"{ms[n] / bound_ms:.3f}x (speed-up {ms['dense'] / ms[n]:.2f}x, bound {1 / (1 - f * r):.2f}x)")
    all_ops = sorted({o for d in ops.values() for o in d}, key=lambda o: -max(d.get(o, 0) for d in ops.values()))
    counts = {n: KERNELS.get(str(_model_path(folders[n])), {}) for n in names}
    print("kernel ms/step by op type (kernels per step):")
    print("| op | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for o in all_ops:
        print(f"| {o} | " + " | ".join(f"{ops[n].get(o, 0):.3f} ({counts[n].get(o, 0)})" for n in names) + " |")
    print("| sum of kernels | " + " | ".join(f"{sum(ops[n].values()):.3f}" for n in names) + " |")
    launches = {n: min(rs, key=lambda r: r[0])[2] for n, rs in results.items()}
    print("| kernel launches per step (If branches included) | "
          + " | ".join(f"{launches[n]:.0f}" for n in names) + " |")
    print("(If = the If's own time less its branch's kernels; If/<op> = kernels inside the branches)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
