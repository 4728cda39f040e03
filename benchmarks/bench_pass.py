"""Decode-step time of fast.onnx vs the dense model.onnx at forced replay ratios, against the bound 1/(1 - f r).

A seeded random LLaMA-style decoder (hidden 1024, 8 layers, 16/8 heads, intermediate 2816, vocab 2048) is
exported with torch.onnx.export (dynamo, opset 20; cached), compiled with frame_tokens L=256 and a per-layer
threshold, and run on ONNX Runtime CPU (2 intra-op threads, batch 1) after a ~2k-token prefill. The replay
ratio r is forced through the per-layer threshold: each step a chosen subset of layers gets tau=-inf (replay),
the others +inf (compute), so the average over a window of steps is exactly r; the realised ratio is read back
from `present_mlp_age.N` (age > 0 at the written slot = replayed).

f, the MLP's share of a dense step, is measured in the same run by timing a copy of the dense model whose MLP
branches are cut out (the closing residual Add gets a zero instead of the branch). All configurations are run
interleaved step by step and compared window by window, so machine drift hits them alike. Prints a table, writes JSON + PNG.

    python benchmarks/bench_pass.py            # full (several minutes on 2 cores)
    python benchmarks/bench_pass.py --quick    # small model and context, smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_CACHE,
    LlamaShape,
    atomic_write_text,
    cached_export,
    empty_state,
    make_session,
    past_name_for,
)

from fastcar_compile.core.atomic import save_figure  # noqa: E402

FULL = dict(shape=LlamaShape(), context=2048, frame_tokens=256, rounds=40)
QUICK = dict(shape=LlamaShape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=704, vocab=512, max_pos=1024),
             context=512, frame_tokens=64, rounds=4)


def strip_mlp(model_path: Path, out_path: Path) -> int:
    """Write a copy of the dense model without MLP branches: each closing Add gets a zero for the branch
    (then unused nodes and weights are dropped). Returns the number of branches removed."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    from fastcar_compile.passes.discover import discover

    model = ir.load(model_path)
    matches = [m for m in discover(model) if m.ok]
    if not matches:
        raise RuntimeError(f"{model_path}: no decoder layer matched; cannot measure the MLP share")
    for m in matches:
        if m.mlp.fused_norm:
            raise RuntimeError(f"layer {m.layer}: the MLP norm is fused with the residual Add; cannot cut it out")
        closing = m.mlp.closing
        idx = [i for i, v in enumerate(closing.inputs) if v is m.mlp.output]
        if len(idx) != 1:
            raise RuntimeError(f"layer {m.layer}: the closing Add does not take the MLP output exactly once")
        dtype = m.mlp.output.dtype or ir.DataType.FLOAT
        zero = ir.Value(name=f"bench.zero_mlp.{m.layer}", const_value=ir.tensor(np.zeros((), dtype.numpy())))
        model.graph.register_initializer(zero)
        closing.replace_input_with(idx[0], zero)
    RemoveUnusedNodesPass()(model)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    ir.save(model, tmp)
    tmp.replace(out_path)
    return len(matches)


def replay_pattern(ratio: Fraction, layers: int, step: int) -> list[int]:
    """Layers (positions in the threshold vector) forced to replay at `step`: Bresenham count, rotating
    start, so any `period` consecutive steps replay exactly ratio * layers * period layer-steps."""
    done = math.floor(step * ratio * layers)
    n = math.floor((step + 1) * ratio * layers) - done
    return [(done + j) % layers for j in range(n)]


def period_of(ratios: list[Fraction], layers: int) -> int:
    """Smallest block length whose per-layer replay count is an integer for every ratio."""
    p = 1
    for r in ratios:
        p = math.lcm(p, (r * layers).denominator)
    return p


class Runner:
    """One configuration: a session, its own carried state and its per-step feeds."""

    def __init__(self, name: str, sess, state: dict[str, np.ndarray], past_len: int, rng: np.random.Generator,
                 vocab: int, ratio: Fraction | None = None, fast_layers: list[int] | None = None,
                 frame_tokens: int = 0):
        self.name, self.sess, self.state, self.past = name, sess, dict(state), past_len
        self.rng, self.vocab, self.ratio = rng, vocab, ratio
        self.fast_layers = fast_layers or []
        self.L = frame_tokens
        self.out_names = [o.name for o in sess.get_outputs()]
        self.inputs = {i.name for i in sess.get_inputs()} | {i.name for i in sess.get_overridable_initializers()}
        self.step = 0
        self.wall_ms: list[float] = []  # per recorded step
        self.cpu_ms: list[float] = []  # process CPU time (all ORT threads) per recorded step
        self.replayed = 0
        self.layer_steps = 0
        self.mismatch = 0

    def run_step(self, record: bool = True) -> None:
        ids = self.rng.integers(0, self.vocab, size=(1, 1), dtype=np.int64)
        feeds = {"input_ids": ids,
                 "attention_mask": np.ones((1, self.past + 1), dtype=np.int64),
                 "position_ids": np.full((1, 1), self.past, dtype=np.int64), **self.state}
        expect: set[int] = set()
        if self.ratio is not None:
            expect = set(replay_pattern(self.ratio, len(self.fast_layers), self.step))
            tau = np.full(len(self.fast_layers), np.inf, dtype=np.float32)
            tau[list(expect)] = -np.inf
            feeds["fastcar_threshold"] = tau
            feeds["video_start"] = np.asarray(0, dtype=np.int64)
        feeds = {k: v for k, v in feeds.items() if k in self.inputs}
        c0, t0 = time.process_time(), time.perf_counter()
        outs = self.sess.run(self.out_names, feeds)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if record:
            self.wall_ms.append(1e3 * dt)
            self.cpu_ms.append(1e3 * dc)
        outs = dict(zip(self.out_names, outs, strict=True))
        for name, val in outs.items():
            nxt = past_name_for(name)
            if nxt is not None:
                self.state[nxt] = val
        if self.ratio is not None:
            slot = self.past % self.L  # (p - video_start) mod L, video_start = 0
            for pos, layer in enumerate(self.fast_layers):
                replayed = bool(outs[f"present_mlp_age.{layer}"][0, slot] > 0)
                self.replayed += replayed
                self.mismatch += replayed != (pos in expect)
            self.layer_steps += len(self.fast_layers)
        self.past += 1
        self.step += 1

    @property
    def realised(self) -> float:
        return self.replayed / self.layer_steps if self.layer_steps else float("nan")


def prefill(sess, ids: np.ndarray, frame_tokens: int, extra: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One multi-token step from an empty state; returns the state to carry."""
    n = ids.shape[1]
    state = empty_state(sess, 1, frame_tokens)
    names = {i.name for i in sess.get_inputs()} | {i.name for i in sess.get_overridable_initializers()}
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, n), dtype=np.int64),
             "position_ids": np.arange(n, dtype=np.int64)[None], **state, **extra}
    out_names = [o.name for o in sess.get_outputs()]
    outs = sess.run(out_names, {k: v for k, v in feeds.items() if k in names})
    return {past_name_for(k): v for k, v in zip(out_names, outs, strict=True) if past_name_for(k)}


def _kernel_times(profile_json: Path) -> tuple[dict[str, float], dict[str, str]]:
    """Total kernel microseconds per node name, and each node's op type, from an ORT profile."""
    times: dict[str, float] = {}
    ops: dict[str, str] = {}
    events = json.loads(profile_json.read_text())
    runs = sorted((ev["ts"], ev["ts"] + ev["dur"]) for ev in events if ev.get("name") == "model_run")
    after_warmup = runs[0][1] if runs else 0  # the first run of a session pays one-off allocations
    for ev in events:
        if ev.get("cat") == "Node" and ev["name"].endswith("_kernel_time") and ev["ts"] >= after_warmup:
            name = ev["name"][: -len("_kernel_time")]
            times[name] = times.get(name, 0.0) + ev["dur"]
            ops[name] = ev["args"]["op_name"]
    return times, ops


def profile_ops(fast_path: Path, nomlp_path: Path, threads: int, spin: bool, st_fast: dict, st_nomlp: dict,
                context: int, L: int, layers: list[int], vocab: int, out_dir: Path, steps: int = 10) -> dict:
    """ORT-profile `steps` decode steps of fast.onnx at 100% replay and of the no-MLP model; the kernel time
    of the nodes only fast.onnx has is what replay costs beyond skipping the MLP (by op type, per step)."""

    files = {}
    for name, path, state, ratio in (("fast100", fast_path, st_fast, Fraction(1)),
                                     ("noMLP", nomlp_path, st_nomlp, None)):
        sess = make_session(path, threads, spin=spin, profile=out_dir / f"ortprofile_{name}")
        r = Runner(name, sess, state, context, np.random.default_rng(2), vocab, ratio=ratio,
                   fast_layers=layers if ratio is not None else None, frame_tokens=L)
        for _ in range(steps + 1):  # + the warm-up run, left out of the sums
            r.run_step(record=False)
        files[name] = Path(sess.end_profiling())
    fast_t, fast_op = _kernel_times(files["fast100"])
    base_t, _ = _kernel_times(files["noMLP"])
    added = {n: t for n, t in fast_t.items() if n not in base_t}
    by_op: dict[str, float] = {}
    for n, t in added.items():
        by_op[fast_op[n]] = by_op.get(fast_op[n], 0.0) + t / steps / 1e3
    for f in files.values():
        f.unlink(missing_ok=True)
    return {"added_nodes": len(added), "added_ms_per_step": sum(added.values()) / steps / 1e3,
            "fast100_kernel_ms_per_step": sum(fast_t.values()) / steps / 1e3,
            "nomlp_kernel_ms_per_step": sum(base_t.values()) / steps / 1e3,
            "added_ms_by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1]))}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    r = [row["ratio"] for row in rows]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    fine = np.linspace(0, 1, 101)
    f = results["mlp_share"]
    ax.plot(fine * 100, 1 / (1 - f * fine), "--", color="gray", label=f"bound 1/(1 - f r), f = {f:.3f}")
    sp = [row["speedup"] for row in rows]
    err = [[s - row["speedup_iqr"][0] for s, row in zip(sp, rows, strict=True)],
           [row["speedup_iqr"][1] - s for s, row in zip(sp, rows, strict=True)]]
    ax.errorbar([x * 100 for x in r], sp, yerr=err, fmt="o-", color="C0", capsize=3,
                label="fast.onnx measured (median, IQR of windows)")
    ax.plot([x * 100 for x in r], [row["cpu_speedup"] for row in rows], "s--", color="C2", ms=4,
            label="same, CPU time")
    ax.plot(fine * 100, 0.95 / (1 - f * fine), ":", color="C3", label="95% of bound (target)")
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set_xlabel("replay ratio r (% of layer-steps whose MLP is replayed)")
    ax.set_ylabel("decode-step speedup vs dense model.onnx")
    ax.set_title(f"{results['model']}, ctx {results['context']}, ORT CPU {results['threads']} threads", fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model (hidden 256, 4 layers) and 512-token context")
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/bench"), help="folder for bench_pass.json/.png")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="folder for the cached export")
    ap.add_argument("--threads", type=int, default=2, help="ORT intra-op threads (default 2)")
    ap.add_argument("--context", type=int, help="prefill tokens (default 2048; --quick 512)")
    ap.add_argument("--frame-tokens", type=int, help="L (default 256; --quick 64)")
    ap.add_argument("--rounds", type=int, help="timed blocks per configuration (windows of 5 steps; default 40, --quick 4)")
    ap.add_argument("--ratios", default="0,0.5,0.8,1", help="forced replay ratios (fractions of layer-steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-ops", action="store_true",
                    help="also ORT-profile 10 steps at 100%% replay vs the no-MLP model: cost of the added nodes")
    ap.add_argument("--spin", action="store_true",
                    help="let ORT worker threads spin between ops (ORT's default; off here so that CPU time "
                         "measures work and a shared machine is not burnt by idle spinning)")
    a = ap.parse_args(argv)

    from tqdm import tqdm

    import fastcar_compile

    preset = QUICK if a.quick else FULL
    shape: LlamaShape = preset["shape"]
    context = a.context or preset["context"]
    L = a.frame_tokens or preset["frame_tokens"]
    rounds = a.rounds or preset["rounds"]
    ratios = [Fraction(x).limit_denominator(1000) for x in a.ratios.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)

    dense_path = cached_export(shape, a.cache, a.seed)
    work = dense_path.parent
    fast_path, nomlp_path = work / f"fast-L{L}.onnx", work / "nomlp.onnx"
    t0 = time.perf_counter()
    # fused_attention=None, fusions=False: the exported attention and ops kept, as in the dense model it is timed
    # against, so the ratios are FastCar's alone (the fused op's own gain: benchmarks/experiments/bench_attention.py).
    _, report = fastcar_compile.compile(dense_path, fast_path, frame_tokens=L, threshold=math.inf,
                                        per_layer_threshold=True, fused_attention=None, fusions=False)
    compile_s = time.perf_counter() - t0
    layers = report.rewritten
    if len(layers) != shape.layers:
        print(f"warning: only layers {layers} of {shape.layers} were rewritten", file=sys.stderr)
    cut = strip_mlp(dense_path, nomlp_path)

    sessions = {n: make_session(p, a.threads, spin=a.spin) for n, p in
                (("dense", dense_path), ("fast", fast_path), ("noMLP", nomlp_path))}
    rng = np.random.default_rng(a.seed)
    ids = rng.integers(0, shape.vocab, size=(1, context), dtype=np.int64)
    print(f"prefill {context} tokens x 3 models ...", file=sys.stderr)
    st_dense = prefill(sessions["dense"], ids, L, {})
    st_nomlp = prefill(sessions["noMLP"], ids, L, {})
    st_fast = prefill(sessions["fast"], ids, L, {"video_start": np.asarray(0, np.int64),
                                                 "fastcar_threshold": np.full(len(layers), np.inf, np.float32)})
    written = [int((st_fast[f"past_mlp_age.{n}"] >= 0).sum()) for n in layers]
    if min(written) < L:
        print(f"warning: prefill wrote only {min(written)} of {L} slots", file=sys.stderr)

    runners = [Runner("dense", sessions["dense"], st_dense, context, np.random.default_rng(1), shape.vocab),
               Runner("noMLP", sessions["noMLP"], st_nomlp, context, np.random.default_rng(1), shape.vocab)]
    runners += [Runner(f"fast r={float(r):.0%}", sessions["fast"], st_fast, context, np.random.default_rng(1),
                       shape.vocab, ratio=r, fast_layers=layers, frame_tokens=L) for r in ratios]
    period = period_of(ratios, len(layers))
    for _ in range(period):  # warm-up period, not recorded
        for r in runners:
            r.run_step(record=False)
    order = list(range(len(runners)))
    for _ in tqdm(range(rounds * period), desc=f"timing {len(runners)} configs, {rounds} x {period}-step windows",
                  unit="step"):
        order = order[1:] + order[:1]  # rotate who goes first: no config always follows another
        for i in order:
            runners[i].run_step()

    def windows(r: Runner, kind: str) -> np.ndarray:
        """Time per step of each window of `period` consecutive steps (each holds the exact ratio)."""
        return np.asarray(getattr(r, kind)).reshape(rounds, period).mean(axis=1)

    stats = {}
    for kind in ("wall_ms", "cpu_ms"):
        dense_w = windows(runners[0], kind)
        stats[kind] = {}
        for r in runners:
            w = windows(r, kind)
            q = w / dense_w  # paired with the dense steps run in the same window: drift cancels
            stats[kind][r.name] = {"ms": float(np.median(w)), "ms_iqr": [float(np.percentile(w, x)) for x in (25, 75)],
                                   "rel": float(np.median(q)), "rel_iqr": [float(np.percentile(q, x)) for x in (25, 75)]}
    wall, cpu = stats["wall_ms"], stats["cpu_ms"]
    t_dense, t_nomlp = wall["dense"]["ms"], wall["noMLP"]["ms"]
    f, f_cpu = 1.0 - wall["noMLP"]["rel"], 1.0 - cpu["noMLP"]["rel"]
    rows = []
    for r, ratio in zip(runners[2:], ratios, strict=True):
        x, xc = wall[r.name], cpu[r.name]
        bound, bound_cpu = 1.0 / (1.0 - f * float(ratio)), 1.0 / (1.0 - f_cpu * float(ratio))
        rows.append({"ratio": float(ratio), "realised_ratio": r.realised, "decision_mismatches": r.mismatch,
                     "ms_per_step": x["ms"], "ms_iqr": x["ms_iqr"], "speedup": 1.0 / x["rel"],
                     "speedup_iqr": [1.0 / x["rel_iqr"][1], 1.0 / x["rel_iqr"][0]], "bound": bound,
                     "speedup_over_bound": 1.0 / x["rel"] / bound,
                     "cpu_ms_per_step": xc["ms"], "cpu_speedup": 1.0 / xc["rel"], "cpu_bound": bound_cpu,
                     "cpu_speedup_over_bound": 1.0 / xc["rel"] / bound_cpu})
    zero = next((row for row in rows if row["ratio"] == 0), None)
    results = {
        "model": f"Llama hidden {shape.hidden}, {shape.layers} layers, {shape.heads}/{shape.kv_heads} heads, "
                 f"inter {shape.intermediate}, vocab {shape.vocab}",
        "shape": shape.__dict__, "context": context, "frame_tokens": L, "threads": a.threads, "batch": 1,
        "rounds": rounds, "window_steps": period, "steps_per_config": period * (rounds + 1),
        "compile_s": compile_s, "mlp_branches_cut": cut,
        "dense_ms": t_dense, "nomlp_ms": t_nomlp, "mlp_share": f,
        "overhead_at_0": (1.0 / zero["speedup"] - 1.0) if zero else None,
        "overhead_at_0_cpu": (1.0 / zero["cpu_speedup"] - 1.0) if zero else None,
        "mlp_share_cpu": f_cpu, "spinning": a.spin, "stats": stats,
        "steps_ms": {r.name: {"wall": r.wall_ms, "cpu": r.cpu_ms} for r in runners},
        "rows": rows, "command": " ".join(["python", "benchmarks/bench_pass.py", *(argv or sys.argv[1:])]),
    }
    lines = [f"{results['model']}; context {context}, L {L}, ORT CPU {a.threads} threads, batch 1",
             f"{rounds} windows x {period} steps per config, configs interleaved step by step; speedups are medians "
             "of per-window time ratios to the dense steps of the same window",
             f"dense {t_dense:.1f} ms/step (IQR {wall['dense']['ms_iqr'][0]:.1f}-{wall['dense']['ms_iqr'][1]:.1f}), "
             f"no-MLP {t_nomlp:.1f} ms/step -> MLP share f = {f:.3f} (CPU time: f = {f_cpu:.3f})",
             "", "| ratio | realised | ms/step (median) | speedup vs dense [IQR] | bound 1/(1-f r) | speedup/bound "
             "| CPU-time speedup | CPU bound | CPU speedup/bound |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['ratio']:.0%} | {row['realised_ratio']:.1%} | {row['ms_per_step']:.1f} | "
                     f"{row['speedup']:.3f} [{row['speedup_iqr'][0]:.2f}-{row['speedup_iqr'][1]:.2f}] | "
                     f"{row['bound']:.3f} | {row['speedup_over_bound']:.1%} | {row['cpu_speedup']:.3f} | "
                     f"{row['cpu_bound']:.3f} | {row['cpu_speedup_over_bound']:.1%} |")
    if zero:
        lines += ["", f"overhead at 0% replay: {results['overhead_at_0']:+.1%} wall, "
                      f"{results['overhead_at_0_cpu']:+.1%} CPU time (target <= +3%)"]
    worst = min((row["speedup_over_bound"] for row in rows if row["ratio"] > 0), default=float("nan"))
    worst_cpu = min((row["cpu_speedup_over_bound"] for row in rows if row["ratio"] > 0), default=float("nan"))
    lines.append(f"worst speedup/bound over r > 0: {worst:.1%} wall, {worst_cpu:.1%} CPU time (target >= 95%)")
    bad = sum(row["decision_mismatches"] for row in rows)
    if bad:
        lines.append(f"WARNING: {bad} layer-steps replayed differently from the forced pattern")
    if a.profile_ops:
        prof = profile_ops(fast_path, nomlp_path, a.threads, a.spin, st_fast, st_nomlp, context, L, layers,
                           shape.vocab, a.out)
        results["profile_ops"] = prof
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(prof["added_ms_by_op"].items())[:8])
        lines += ["", f"ORT profile, 10 steps at 100% replay: the {prof['added_nodes']} nodes fast.onnx adds cost "
                      f"{prof['added_ms_per_step']:.2f} ms/step of {prof['fast100_kernel_ms_per_step']:.1f} ms kernel "
                      f"time (no-MLP model: {prof['nomlp_kernel_ms_per_step']:.1f}); by op (ms/step): {top}"]
    print("\n".join(lines))
    results["table"] = lines
    atomic_write_text(a.out / "bench_pass.json", json.dumps(results, indent=1))
    plot(results, a.out / "bench_pass.png")
    print(f"wrote {a.out / 'bench_pass.json'} and {a.out / 'bench_pass.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
