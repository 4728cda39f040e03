"""Decode-step time of fast.onnx vs the dense model.onnx at forced replay ratios, against the bound 1/(1 - f r).

A seeded random LLaMA-style decoder (hidden 1024, 8 layers, 16/8 heads, intermediate 2816, vocab 2048) is
exported with torch.onnx.export (dynamo, opset 20; cached), compiled with frame_tokens L=256 and a per-layer
threshold, and run on ONNX Runtime CPU (2 intra-op threads, batch 1) after a ~2k-token prefill. The replay
ratio r is forced through the per-layer threshold: each step a chosen subset of layers gets tau=-inf (replay),
the others +inf (compute), so the average over a block of steps is exactly r; the realised ratio is read back
from `present_mlp_age.N` (age > 0 at the written slot = replayed).

f, the MLP's share of a dense step, is measured in the same run by timing a copy of the dense model whose MLP
branches are cut out (the closing residual Add gets a zero instead of the branch). All configurations are run
interleaved, block by block, so machine drift hits them alike. Prints a table, writes JSON + PNG.

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

FULL = dict(shape=LlamaShape(), context=2048, frame_tokens=256, rounds=20)
QUICK = dict(shape=LlamaShape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=704, vocab=512, max_pos=1024),
             context=512, frame_tokens=64, rounds=4)


def strip_mlp(model_path: Path, out_path: Path) -> int:
    """Write a copy of the dense model without MLP branches: each closing Add gets a zero for the branch
    (then unused nodes and weights are dropped). Returns the number of branches removed."""
    import onnx_ir as ir
    from fastcar_compile.passes.discover import discover
    from onnx_ir.passes.common import RemoveUnusedNodesPass

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
        self.block_ms: list[float] = []
        self.replayed = 0
        self.layer_steps = 0
        self.mismatch = 0

    def run_step(self) -> float:
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
        t0 = time.perf_counter()
        outs = self.sess.run(self.out_names, feeds)
        dt = time.perf_counter() - t0
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
        return dt

    def run_block(self, steps: int, record: bool) -> None:
        total = sum(self.run_step() for _ in range(steps))
        if record:
            self.block_ms.append(1e3 * total / steps)

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
    ax.plot([x * 100 for x in r], [row["speedup"] for row in rows], "o-", color="C0", label="fast.onnx measured")
    ax.plot(fine * 100, 0.95 / (1 - f * fine), ":", color="C3", label="95% of bound (target)")
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set_xlabel("replay ratio r (% of layer-steps whose MLP is replayed)")
    ax.set_ylabel("decode-step speedup vs dense model.onnx")
    ax.set_title(f"{results['model']}, ctx {results['context']}, ORT CPU {results['threads']} threads", fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model (hidden 256, 4 layers) and 512-token context")
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/bench"), help="folder for bench_pass.json/.png")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="folder for the cached export")
    ap.add_argument("--threads", type=int, default=2, help="ORT intra-op threads (default 2)")
    ap.add_argument("--context", type=int, help="prefill tokens (default 2048; --quick 512)")
    ap.add_argument("--frame-tokens", type=int, help="L (default 256; --quick 64)")
    ap.add_argument("--rounds", type=int, help="timed blocks per configuration (default 20; --quick 4)")
    ap.add_argument("--ratios", default="0,0.5,0.8,1", help="forced replay ratios (fractions of layer-steps)")
    ap.add_argument("--seed", type=int, default=0)
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
    _, report = fastcar_compile.compile(dense_path, fast_path, frame_tokens=L, threshold=math.inf,
                                        per_layer_threshold=True)
    compile_s = time.perf_counter() - t0
    layers = report.rewritten
    if len(layers) != shape.layers:
        print(f"warning: only layers {layers} of {shape.layers} were rewritten", file=sys.stderr)
    cut = strip_mlp(dense_path, nomlp_path)

    sessions = {n: make_session(p, a.threads) for n, p in
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
    for r in runners:  # warm-up block, not recorded
        r.run_block(period, record=False)
    for rd in tqdm(range(rounds), desc=f"timing {len(runners)} configs x {period}-step blocks", unit="round"):
        k = rd % len(runners)
        for r in runners[k:] + runners[:k]:  # rotate the order each round to cancel drift
            r.run_block(period, record=True)

    med = {r.name: float(np.median(r.block_ms)) for r in runners}
    t_dense, t_nomlp = med["dense"], med["noMLP"]
    iqr = {r.name: "-".join(f"{np.percentile(r.block_ms, q):.1f}" for q in (25, 75)) for r in runners}
    f = 1.0 - t_nomlp / t_dense
    rows = []
    for r, ratio in zip(runners[2:], ratios, strict=True):
        t = med[r.name]
        bound = 1.0 / (1.0 - f * float(ratio))
        rows.append({"ratio": float(ratio), "realised_ratio": r.realised, "decision_mismatches": r.mismatch,
                     "ms_per_step": t, "ms_p25": float(np.percentile(r.block_ms, 25)),
                     "ms_p75": float(np.percentile(r.block_ms, 75)), "speedup": t_dense / t, "bound": bound,
                     "speedup_over_bound": t_dense / t / bound})
    zero = next((row for row in rows if row["ratio"] == 0), None)
    results = {
        "model": f"Llama hidden {shape.hidden}, {shape.layers} layers, {shape.heads}/{shape.kv_heads} heads, "
                 f"inter {shape.intermediate}, vocab {shape.vocab}",
        "shape": shape.__dict__, "context": context, "frame_tokens": L, "threads": a.threads, "batch": 1,
        "rounds": rounds, "block_steps": period, "steps_per_config": period * (rounds + 1),
        "compile_s": compile_s, "mlp_branches_cut": cut,
        "dense_ms": t_dense, "nomlp_ms": t_nomlp, "block_ms": {r.name: r.block_ms for r in runners}, "mlp_share": f,
        "overhead_at_0": (zero["ms_per_step"] / t_dense - 1.0) if zero else None,
        "rows": rows, "command": " ".join(["python", "benchmarks/bench_pass.py", *(argv or sys.argv[1:])]),
    }
    lines = [f"{results['model']}; context {context}, L {L}, ORT CPU {a.threads} threads, batch 1; "
             f"median of {rounds} blocks x {period} steps per config",
             f"dense {t_dense:.2f} ms/step (IQR {iqr['dense']}), no-MLP {t_nomlp:.2f} ms/step (IQR {iqr['noMLP']}) "
             f"-> MLP share f = {f:.3f}",
             "", "| ratio | realised | ms/step (median) | IQR of blocks | speedup vs dense | bound 1/(1-f r) | "
             "speedup/bound |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['ratio']:.0%} | {row['realised_ratio']:.1%} | {row['ms_per_step']:.2f} | "
                     f"{row['ms_p25']:.1f}-{row['ms_p75']:.1f} | "
                     f"{row['speedup']:.3f} | {row['bound']:.3f} | {row['speedup_over_bound']:.1%} |")
    if zero:
        lines += ["", f"overhead at 0% replay: {results['overhead_at_0']:+.1%} (target <= +3%)"]
    worst = min((row["speedup_over_bound"] for row in rows if row["ratio"] > 0), default=float("nan"))
    lines.append(f"worst speedup/bound over r > 0: {worst:.1%} (target >= 95%)")
    bad = sum(row["decision_mismatches"] for row in rows)
    if bad:
        lines.append(f"WARNING: {bad} layer-steps replayed differently from the forced pattern")
    print("\n".join(lines))
    results["table"] = lines
    atomic_write_text(a.out / "bench_pass.json", json.dumps(results, indent=1))
    plot(results, a.out / "bench_pass.png")
    print(f"wrote {a.out / 'bench_pass.json'} and {a.out / 'bench_pass.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
