"""Per-token decode time of FastCar in PyTorch (eager and torch.compile) next to the ONNX path, at forced replay.

One seeded random LLaMA-style decoder (benchmarks/_common.py) is run three ways, batch 1, on CPU:
- PyTorch eager: the model's captured program without FastCar ("dense", with the same graph rewrites as the
  FastCar program: fastcar_compile.torch.optimize) and with it (`fastcar_compile.torch.build`, the step as
  FastCarDecoder runs it), and at 0% and the next ratio with the ops' ATen composite instead of their C++
  kernels ("composite": what runs where no compiler exists); then the models as generate() runs them, each
  stepping its own DynamicCache through its forward: the transformers model itself ("transformers") and the
  FastCar model from `fastcar_compile.torch.apply` ("model N%");
- torch.compile (inductor, dynamic shapes) of the same two programs;
- ONNX Runtime: the dense export and its `fastcar-compile` output.
Replay is forced per layer through a per-layer threshold (tau = -inf replays, +inf computes; a Bresenham
pattern, `replay_pattern`), so every window of `period` steps holds exactly the ratio; the realised
ratio is read back from the replay decisions. All configurations run interleaved step by step after a
prefill of `--context` tokens; a ratio compares each configuration with its own runtime's dense step in the
same window (medians over windows; the lower quartile of each configuration's window times too). Prints a
table, writes bench_torch.json and bench_torch.png.

    python benchmarks/bench_torch.py            # hidden 1024, 8 layers, context 1024 (several minutes: compiles)
    python benchmarks/bench_torch.py --quick    # small model, smoke run
    python benchmarks/bench_torch.py --threads 1 --no-compile --no-ort --ratios 0,0.4,0.5,1   # the targets below

Targets (printed as met / missed): the FastCar model at 0% replay within 3% of the transformers model itself,
and faster than it at >= 40% replay (both through forward + DynamicCache, torch eager, same windows).
"""

from __future__ import annotations

import argparse
import copy
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
    build_random_llama,
    cached_export,
    empty_state,
    make_session,
    past_name_for,
)

FULL = dict(shape=LlamaShape(max_pos=2048), context=1024, frame_tokens=256, rounds=20)
QUICK = dict(shape=LlamaShape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=704, vocab=512, max_pos=1024),
             context=256, frame_tokens=64, rounds=4)


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
    """One configuration: its step, carried state, per-step times (wall and process CPU, all threads) and, at a
    forced ratio, the replay decisions counted against the forced pattern. Subclasses say how a step runs."""

    def __init__(self, name: str, fn, past: int, vocab: int, *, ratio: Fraction | None = None, layers: int = 0):
        self.name, self.fn, self.past, self.vocab, self.ratio, self.layers = name, fn, past, vocab, ratio, layers
        self.rng = np.random.default_rng(1)
        self.step = 0
        self.wall_ms: list[float] = []
        self.cpu_ms: list[float] = []
        self.replayed = self.layer_steps = self.mismatch = 0

    def forced(self) -> set[int]:
        """The layers (positions) this step forces to replay; empty without a ratio."""
        return set(replay_pattern(self.ratio, self.layers, self.step)) if self.ratio is not None else set()

    def timed(self, call, record: bool):
        c0, t0 = time.process_time(), time.perf_counter()
        out = call()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if record:
            self.wall_ms.append(1e3 * dt)
            self.cpu_ms.append(1e3 * dc)
        return out

    def count(self, decisions, expect: set[int]) -> None:
        """Tally one step's replay decisions (one bool per forced position) against the forced pattern."""
        for pos, replayed in enumerate(decisions):
            self.replayed += replayed
            self.mismatch += replayed != (pos in expect)
        self.layer_steps += self.layers

    def run_step(self, record: bool = True) -> None:
        self._step(self.forced(), record)
        self.past += 1
        self.step += 1

    def _step(self, expect: set[int], record: bool) -> None:
        raise NotImplementedError

    @property
    def realised(self) -> float:
        return self.replayed / self.layer_steps if self.layer_steps else float("nan")


def _no_grad(fn, *args, **kw):
    import torch

    with torch.no_grad():
        return fn(*args, **kw)


class TorchRunner(Runner):
    """A PyTorch program with the flat contract, its carried KV (and FastCar) state."""

    def __init__(self, name: str, fn, kv: list, past: int, vocab: int, *, state: list | None = None,
                 ratio: Fraction | None = None, layers: int = 0):
        super().__init__(name, fn, past, vocab, ratio=ratio, layers=layers)
        self.kv = list(kv)
        # own copies: the eager FastCar step updates its state in place (as FastCarDecoder runs it)
        self.state = [s.clone() for s in state or []]

    def _step(self, expect: set[int], record: bool) -> None:
        import torch

        ids = torch.as_tensor(self.rng.integers(0, self.vocab, (1, 1)))
        args = [ids, torch.ones(1, self.past + 1, dtype=torch.int64), torch.full((1, 1), self.past), *self.kv]
        if self.ratio is not None:
            tau = torch.full((self.layers,), math.inf)
            tau[list(expect)] = -math.inf
            args += [torch.tensor(0), tau, *self.state]
        outs = self.timed(lambda: _no_grad(self.fn, *args), record)
        n_kv = len(self.kv)
        self.kv = list(outs[1:1 + n_kv])
        if self.ratio is not None:
            k = 2 * self.layers
            self.state = list(outs[1 + n_kv:1 + n_kv + k])
            self.count((bool(rep.item()) for rep in outs[1 + n_kv + k::2]), expect)


class ModelRunner(TorchRunner):
    """A transformers model (the plain one, or the FastCar one from `apply` with its own replay state) stepped
    through its forward with the DynamicCache it keeps, as generate() runs it."""

    def __init__(self, name: str, model, cache, past: int, vocab: int, *, state: list | None = None,
                 ratio: Fraction | None = None, layers: int = 0):
        super().__init__(name, model, [], past, vocab, state=state, ratio=ratio, layers=layers)
        self.cache = copy.deepcopy(cache)

    def _step(self, expect: set[int], record: bool) -> None:
        import torch

        ids = torch.as_tensor(self.rng.integers(0, self.vocab, (1, 1)))
        kw = {"input_ids": ids, "attention_mask": torch.ones(1, self.past + 1, dtype=torch.int64),
              "past_key_values": self.cache, "use_cache": True}
        if self.ratio is not None:
            tau = torch.full((self.layers,), math.inf)
            tau[list(expect)] = -math.inf
            kw.update(fastcar_threshold=tau, video_start=0)
            self.fn.fastcar.state = self.state  # several runners share one FastCar model: each its own state
        self.timed(lambda: _no_grad(self.fn, **kw), record)
        if self.ratio is not None:
            dec = self.fn.fastcar
            self.state = dec.state
            self.count((bool(dec.last_replay[layer].item()) for layer in dec.layers), expect)


class OrtRunner(Runner):
    """An ONNX Runtime session with its own carried state (outputs fed back as the next step's past)."""

    def __init__(self, name: str, sess, state: dict[str, np.ndarray], past: int, vocab: int, *,
                 ratio: Fraction | None = None, layers: int = 0, frame_tokens: int = 0):
        super().__init__(name, sess, past, vocab, ratio=ratio, layers=layers)
        self.state, self.L = dict(state), frame_tokens
        self.out_names = [o.name for o in sess.get_outputs()]
        self.inputs = {i.name for i in sess.get_inputs()} | {i.name for i in sess.get_overridable_initializers()}

    def _step(self, expect: set[int], record: bool) -> None:
        ids = self.rng.integers(0, self.vocab, size=(1, 1), dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, self.past + 1), dtype=np.int64),
                 "position_ids": np.full((1, 1), self.past, dtype=np.int64), **self.state}
        if self.ratio is not None:
            tau = np.full(self.layers, np.inf, dtype=np.float32)
            tau[list(expect)] = -np.inf
            feeds["fastcar_threshold"] = tau
            feeds["video_start"] = np.asarray(0, dtype=np.int64)
        feeds = {k: v for k, v in feeds.items() if k in self.inputs}
        outs = dict(zip(self.out_names, self.timed(lambda: self.fn.run(self.out_names, feeds), record), strict=True))
        for name, val in outs.items():
            nxt = past_name_for(name)
            if nxt is not None:
                self.state[nxt] = val
        if self.ratio is not None:
            slot = self.past % self.L  # (p - video_start) mod L, video_start = 0
            self.count((bool(outs[f"present_mlp_age.{layer}"][0, slot] > 0) for layer in range(self.layers)), expect)


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

    from fastcar_compile.core.atomic import save_figure

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    for runtime, color in zip(results["runtimes"], ("C0", "C1", "C2"), strict=False):
        rows = [r for r in results["rows"] if r["runtime"] == runtime and r["ratio"] is not None
                and r["config"][0].isdigit()]
        x = [100 * r["ratio"] for r in rows]
        ax.plot(x, [r["ms"] for r in rows], "o-", color=color, label=f"{runtime} FastCar")
        ax.axhline(results["dense_ms"][runtime], color=color, ls=":", lw=1, label=f"{runtime} dense")
        for r in results["rows"]:
            if r["runtime"] == runtime and r["config"] == "transformers":
                ax.axhline(r["ms"], color="black", ls="--", lw=1, label="transformers model (eager)")
        whole = [r for r in results["rows"] if r["runtime"] == runtime and r["config"].startswith("model")]
        if whole:
            ax.plot([100 * r["ratio"] for r in whole], [r["ms"] for r in whole], "+", color=color, ms=9,
                    label=f"{runtime} FastCar model (forward + DynamicCache)")
        comp = [r for r in results["rows"] if r["runtime"] == runtime and r["config"].startswith("composite")]
        if comp:
            ax.plot([100 * r["ratio"] for r in comp], [r["ms"] for r in comp], "x", color=color,
                    label=f"{runtime} FastCar, ATen composite ops")
        bx.plot(x, [r["speedup"] for r in rows], "o-", color=color, label=runtime)
    ax.set_xlabel("forced replay (% of layer-steps)")
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=7)
    bx.axhline(1.0, color="black", lw=0.5)
    bx.set_xlabel("forced replay (% of layer-steps)")
    bx.set_ylabel("speedup vs the same runtime's dense step")
    bx.legend(fontsize=7)
    for a in (ax, bx):
        a.grid(alpha=0.3)
    fig.suptitle(results["title"], fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model (hidden 256, 4 layers), context 256")
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/bench"), help="folder for bench_torch.json/.png")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="folder for the cached ONNX export")
    ap.add_argument("--threads", type=int, default=2, help="torch and ORT intra-op threads (default 2)")
    ap.add_argument("--context", type=int)
    ap.add_argument("--rounds", type=int, help="timed windows per configuration")
    ap.add_argument("--ratios", default="0,0.5,0.8,1")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (it takes minutes on 2 cores)")
    ap.add_argument("--no-ort", action="store_true", help="skip ONNX Runtime (its export takes minutes once)")
    a = ap.parse_args(argv)

    import torch
    from tqdm import tqdm
    from transformers import DynamicCache

    import fastcar_compile.torch as fct
    from fastcar_compile.torch import capture, ops, optimize

    torch.set_num_threads(a.threads)
    preset = QUICK if a.quick else FULL
    shape: LlamaShape = preset["shape"]
    context, L = a.context or preset["context"], preset["frame_tokens"]
    rounds = a.rounds or preset["rounds"]
    ratios = [Fraction(x).limit_denominator(1000) for x in a.ratios.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    n = shape.layers

    model = build_random_llama(shape)
    front, _ = capture.flat_front(model)
    dense_prog = fct.build(model, frame_tokens=L, threshold=math.inf, per_layer_threshold=True)
    plain = capture.capture(front, capture.example_inputs(model)).module(check_guards=False)
    plain._forward_pre_hooks.clear()
    optimize.sdpa_gqa(plain)  # the form the FastCar program runs in (grouped KV heads read in place)
    optimize.drop_metadata_asserts(plain)
    optimize.drop_empty_cats(plain)
    optimize.sdpa_float_mask(plain)
    optimize.skip_full_masks(plain)  # as the FastCar program's eager form (optimize.inplace_state)
    composite = optimize.copy_program(dense_prog.program)  # the ops' ATen composites, called directly
    for node in composite.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == ops.NAMESPACE:
            node.target = ops.COMPOSITES.get(node.target._opname, node.target)
    composite.recompile()
    rng = np.random.default_rng(0)
    ids = torch.as_tensor(rng.integers(0, shape.vocab, (1, context)))
    print(f"prefill {context} tokens in PyTorch ...", file=sys.stderr)
    with torch.no_grad():
        empty = dense_prog.empty_past(1)
        dense_out = front(ids, torch.ones(1, context, dtype=torch.int64), torch.arange(context)[None], *empty)
        dense_prog.reset(1)
        fast_out = dense_prog.program(ids, torch.ones(1, context, dtype=torch.int64), torch.arange(context)[None],
                                      *empty, torch.tensor(0), torch.full((n,), math.inf), *dense_prog.state)
        # the models themselves, each with the DynamicCache it keeps (what generate() runs)
        fast_model = fct.apply(model, frame_tokens=L, threshold=math.inf, per_layer_threshold=True)
        hf_cache, fm_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
        model(input_ids=ids, attention_mask=torch.ones(1, context, dtype=torch.int64), past_key_values=hf_cache)
        fast_model(input_ids=ids, attention_mask=torch.ones(1, context, dtype=torch.int64), past_key_values=fm_cache,
                   fastcar_threshold=torch.full((n,), math.inf), video_start=0)
        fm_state0 = [t.clone() for t in fast_model.fastcar.state]
    kv0 = list(dense_out[1:])
    fkv0, fstate0 = list(fast_out[1:1 + 2 * n]), list(fast_out[1 + 2 * n:1 + 4 * n])
    # eager: the program as FastCarDecoder runs it (MLP state updated in place); compiled: the functional one
    runtimes = {"torch eager": (front, plain, optimize.inplace_state(dense_prog.program))}
    if not a.no_compile:
        runtimes["torch.compile"] = (None, torch.compile(plain, dynamic=True),
                                     torch.compile(dense_prog.program, dynamic=True))
    runners: list = []
    for rt, (hf, dense_fn, fast_fn) in runtimes.items():
        if hf is not None:
            runners.append(ModelRunner(f"{rt}|transformers", model, hf_cache, context, shape.vocab))
            runners += [ModelRunner(f"{rt}|model {float(r):.0%}", fast_model, fm_cache, context, shape.vocab,
                                    state=fm_state0, ratio=r, layers=n) for r in ratios]
        runners.append(TorchRunner(f"{rt}|dense", dense_fn, kv0, context, shape.vocab))
        runners += [TorchRunner(f"{rt}|{float(r):.0%}", fast_fn, fkv0, context, shape.vocab, state=fstate0, ratio=r,
                                layers=n) for r in ratios]
        if hf is not None:
            runners += [TorchRunner(f"{rt}|composite {float(r):.0%}", composite, fkv0, context, shape.vocab,
                                    state=fstate0, ratio=r, layers=n) for r in ratios[:2]]
    if not a.no_ort:
        runners += ort_runners(shape, a, L, ids, ratios)
    period = period_of(ratios, n)
    for _ in tqdm(range(period), desc="warm-up (torch.compile compiles here)", unit="step"):
        for r in runners:
            r.run_step(record=False)
    order = list(range(len(runners)))
    for _ in tqdm(range(rounds * period), desc=f"timing {len(runners)} configs", unit="step"):
        order = order[1:] + order[:1]
        for i in order:
            runners[i].run_step()
    report(runners, list(runtimes) + ([] if a.no_ort else ["ORT"]), shape, n, context, L, a, rounds, period)
    return 0


def ort_runners(shape, a, L, ids, ratios) -> list:
    """The dense export and its fastcar-compile output in ONNX Runtime, prefilled like the PyTorch runners."""
    import fastcar_compile

    n = shape.layers
    dense_path = cached_export(shape, a.cache)
    fast_path = dense_path.parent / f"fast-L{L}.onnx"
    # Exported attention and ops kept (as in the dense export and the PyTorch programs): FastCar's ratio alone.
    fastcar_compile.compile(dense_path, fast_path, frame_tokens=L, threshold=math.inf, per_layer_threshold=True,
                            fused_attention=None, fusions=False)
    sess_d, sess_f = make_session(dense_path, a.threads, spin=False), make_session(fast_path, a.threads, spin=False)
    ids_np = ids.numpy()
    st_d = prefill(sess_d, ids_np, L, {})
    st_f = prefill(sess_f, ids_np, L, {"video_start": np.asarray(0, np.int64),
                                       "fastcar_threshold": np.full(n, np.inf, np.float32)})
    context = ids.shape[1]
    runners = [OrtRunner("ORT|dense", sess_d, st_d, context, shape.vocab)]
    runners += [OrtRunner(f"ORT|{float(r):.0%}", sess_f, st_f, context, shape.vocab, ratio=r, layers=n,
                          frame_tokens=L) for r in ratios]
    return runners


def report(runners, names, shape, n, context, L, a, rounds, period) -> None:
    """Print the table and the targets; write bench_torch.json / .png."""
    from fastcar_compile.core.atomic import write_text
    from fastcar_compile.torch import native

    def windows(r) -> np.ndarray:
        return np.asarray(r.wall_ms).reshape(rounds, period).mean(axis=1)

    by_name = {r.name: r for r in runners}
    rows, dense_ms = [], {}
    hf = by_name.get("torch eager|transformers")
    hw = windows(hf) if hf is not None else None
    for rt in names:
        dw = windows(by_name[f"{rt}|dense"])
        dense_ms[rt] = float(np.median(dw))
        for r in runners:
            if not r.name.startswith(rt + "|"):
                continue
            w = windows(r)
            ratio = r.ratio
            rows.append({"runtime": rt, "config": r.name.split("|", 1)[1], "ratio": None if ratio is None else float(ratio),
                         "realised": None if ratio is None else r.realised, "mismatch": r.mismatch,
                         "ms": float(np.median(w)), "ms_q25": float(np.percentile(w, 25)),
                         "speedup": float(np.median(dw / w)),
                         "x_transformers": float(np.median(hw / w)) if rt == "torch eager" and hw is not None else None})
    ort_ms = {row["config"]: row["ms"] for row in rows if row["runtime"] == "ORT"}
    print(f"\nLLaMA-style hidden {shape.hidden}, {n} layers, context {context}, L {L}, batch 1, CPU {a.threads} threads"
          f" ({rounds} windows of {period} steps, interleaved)")
    print(f"{'runtime':<14} {'config':<14} {'ms/step':>8} {'q25 ms':>8} {'x own dense':>11} {'x transformers':>14} "
          f"{'x ORT same':>10} {'realised':>8}")
    for row in rows:
        vs_ort = ort_ms.get(row["config"])
        xt = row["x_transformers"]
        print(f"{row['runtime']:<14} {row['config']:<14} {row['ms']:8.2f} {row['ms_q25']:8.2f} "
              f"{row['speedup']:11.3f} "
              f"{'' if xt is None else format(xt, '.3f'):>14} {(vs_ort / row['ms'] if vs_ort else float('nan')):10.3f} "
              f"{'' if row['realised'] is None else format(row['realised'], '.0%'):>8}")
        if row["mismatch"]:
            print(f"  warning: {row['mismatch']} layer-steps replayed differently from the forced pattern")
    targets = []
    for row in rows:  # the FastCar model against the transformers model, both as generate() runs them
        if row["runtime"] != "torch eager" or not row["config"].startswith("model"):
            continue
        if row["ratio"] == 0:
            cost = 1 / row["x_transformers"] - 1
            targets.append(f"0% replay costs {cost:+.1%} vs transformers (target <= +3%): "
                           f"{'met' if cost <= 0.03 else 'missed'}")
        elif row["ratio"] >= 0.4:
            targets.append(f"{row['ratio']:.0%} replay runs at {row['x_transformers']:.3f}x transformers "
                           f"(target > 1): {'met' if row['x_transformers'] > 1 else 'missed'}")
    print(native.status())
    for line in targets:
        print("target: " + line)
    results = {"title": f"LLaMA-style h{shape.hidden} x{n}, ctx {context}, L {L}, CPU {a.threads} threads, batch 1",
               "shape": vars(shape) if hasattr(shape, "__dict__") else str(shape), "context": context,
               "frame_tokens": L, "threads": a.threads, "rounds": rounds, "period": period,
               "runtimes": names, "dense_ms": dense_ms, "rows": rows, "kernels": native.status(), "targets": targets}
    write_text(a.out / "bench_torch.json", json.dumps(results, indent=1, default=str))
    plot(results, a.out / "bench_torch.png")
    print(f"wrote {a.out / 'bench_torch.json'} and {a.out / 'bench_torch.png'}")


if __name__ == "__main__":
    sys.exit(main())
