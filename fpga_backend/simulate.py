"""Cycle-approximate simulator of a bundle program (timing, counters, energy, per-core timeline).

Execution model: bundles issue in order, the cores of a bundle in lock step (they share the broadcast weight
stream). For one bundle, with n_c the rows core c runs after dispatch:

    compute_c = n_c * array passes of its instruction      (GEMM: ceil(m/cols) * ceil(k/rows) * n)
    sram_c    = ceil(n_c * on-chip bytes / sram_bytes_per_cycle)
    dram      = ceil(weight stream bytes / (peak * stream efficiency per cycle)
                   + per-row bytes of all slots / (peak * efficiency per cycle))
    time      = max(max_c max(compute_c, sram_c), dram) + issue_latency      (double buffering)
              = max_c max(compute_c, sram_c) + dram + issue_latency         (without)

Every term is a whole number of cycles (the DRAM rates are the exact fractions ``BoardConfig.dram_terms``), so the
RTL of the dispatcher (`fpga_backend/rtl/`) reproduces the count cycle for cycle. A bundle whose slots were all
dropped costs nothing (a NOP slot has no rows). Weight streams: ``broadcast`` fetches a tile once
for every core (saved only when every row of the batch skips), ``per_core`` fetches one copy per core with
rows (saved when that core's rows all skip). KV reads grow with the context (or with the slots of a bounded
cache: `kvbound.py`) and are never skipped by replay.
Utilisation = array MACs / (cycles * board MACs per cycle).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.progress import bar as progress_bar

from . import isa
from .costmodel import CostModel
from .drs import table as drs_table
from .encode import Program
from .hwspec import ASSUMPTIONS, BoardConfig
from .isa import popcount32
from .schedule import drs_masks

POLICIES = ("static", "drs")
STREAMS = isa.WEIGHT_STREAMS
DRAM_CLASSES = ("weights", "kv", "replay_cache", "activations")


@dataclasses.dataclass
class SimResult:
    """Totals over the simulated steps (divide by ``steps`` for per-step figures)."""

    board: str
    policy: str
    weights: str
    batch: int
    steps: int
    cycles: float
    macs: float
    dram_bytes: dict[str, float]
    sram_bytes: float
    core_busy: np.ndarray
    core_stall: np.ndarray
    core_idle: np.ndarray
    bandwidth_bound_cycles: float
    remaps: int
    drs_cycles: float
    clock_mhz: float
    macs_per_cycle: int
    energy_j: dict[str, float]
    replay_ratio: float
    timeline: dict[str, Any] | None = None

    @property
    def cycles_per_step(self) -> float:
        return self.cycles / self.steps

    @property
    def seconds(self) -> float:
        return self.cycles / (self.clock_mhz * 1e6)

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.steps / self.seconds if self.cycles else 0.0

    @property
    def utilisation(self) -> float:
        return self.macs / (self.cycles * self.macs_per_cycle) if self.cycles else 0.0

    @property
    def bound(self) -> str:
        return "bandwidth" if self.bandwidth_bound_cycles > 0.5 * self.cycles else "compute"

    def to_dict(self) -> dict[str, Any]:
        total_dram = sum(self.dram_bytes.values())
        return {
            "board": self.board, "policy": self.policy, "weights": self.weights, "batch": self.batch,
            "steps": self.steps, "replay_ratio": self.replay_ratio,
            "cycles_per_step": self.cycles_per_step, "cycles_per_token": self.cycles_per_step / self.batch,
            "ms_per_step": 1e3 * self.seconds / self.steps, "tokens_per_s": self.tokens_per_s,
            "utilisation": self.utilisation, "bound": self.bound,
            "bandwidth_bound_share": self.bandwidth_bound_cycles / self.cycles if self.cycles else 0.0,
            "macs_per_step": self.macs / self.steps,
            "dram_bytes_per_step": {k: v / self.steps for k, v in self.dram_bytes.items()},
            "dram_gbps_used": total_dram / self.seconds / 1e9 if self.cycles else 0.0,
            "sram_bytes_per_step": self.sram_bytes / self.steps,
            "core_busy": (self.core_busy / self.cycles).tolist(),
            "core_stall": (self.core_stall / self.cycles).tolist(),
            "core_idle": (self.core_idle / self.cycles).tolist(),
            "drs_remaps": self.remaps, "drs_overhead_cycles": self.drs_cycles,
            "energy_j_per_step": {k: v / self.steps for k, v in self.energy_j.items()},
            "energy_assumptions": ASSUMPTIONS,
        }


class Simulator(CostModel):
    """Runs mask sets over a program: the cost model per step, plus the dispatcher's DRS decisions."""

    def __init__(self, program: Program, board: BoardConfig | None = None) -> None:
        from .verify import check_program  # a decoded file may hold values that index past arrays

        check_program(program)
        super().__init__(program, board)
        self.thr = drs_table(program)

    def step(self, replay: np.ndarray, ctx: int | np.ndarray, *, policy: str = "drs", stream: str = "broadcast",
             batch: int | None = None) -> dict[str, Any]:
        """One decode step. replay: (layers, batch) bool; ctx: KV length read, one or per layer.
        Returns per-bundle/per-slot figures and remaps."""
        batch = self.batch if batch is None else batch
        active = np.uint32((1 << batch) - 1 if batch < 32 else isa.ALL_ROWS)
        L = self.num_layers
        compute_rows = np.zeros(L + 1, np.uint32)
        for layer in range(L):
            bits = 0
            for r in range(batch):
                if not replay[layer, r]:
                    bits |= 1 << r
            compute_rows[layer] = bits
        compute_rows[L] = int(active)
        stat = np.stack([self.binding & compute_rows[i] for i in range(L + 1)])
        ev = self.evaluate(ctx, stat, active, stream)
        remapped = np.zeros(L + 2, bool)
        if policy == "drs":
            drs = np.stack([drs_masks(int(compute_rows[i]), batch, self.C) for i in range(L + 1)])
            ev_d = self.evaluate(ctx, drs, active, stream)
            rb = self.replayable_bundle
            # the dispatcher's rule (drs.py): thresholds from DRS_SET / DRS_DISPATCH, per compute-row count
            n = popcount32(compute_rows & active).astype(np.int64)
            s_max = popcount32(stat).max(axis=1).astype(np.int64)
            a_s, a_d = (stat != 0).sum(axis=1), (drs != 0).sum(axis=1)
            rule = (n > 0) & (s_max >= self.thr[np.arange(L + 1), n])
            if stream == "per_core":
                rule &= a_d <= a_s
            remapped = np.zeros(L + 2, bool)
            remapped[: L + 1] = rule & (stat != drs).any(axis=1)
            remapped[L] = False
            sel = rb & remapped[self.bundle_layer]
            for key, val in ev.items():
                if val.ndim == 1:
                    ev[key] = np.where(sel, ev_d[key], val)
                else:
                    ev[key] = np.where(sel[:, None], ev_d[key], val)
            overhead = np.where(self.dispatch & remapped[self.bundle_layer], float(self.board.drs_overhead), 0.0)
            ev["t"] = ev["t"] + overhead
            ev["drs"] = overhead
        else:
            ev["drs"] = np.zeros_like(ev["t"])
        ev["remaps"] = int(remapped.sum())
        return ev

    def run(self, replay: np.ndarray, context: np.ndarray | int, *, policy: str = "drs", stream: str = "broadcast",
            batch: int | None = None, timeline: bool = False, progress: bool = False,
            timeline_step: int = 0, kv_len: np.ndarray | None = None) -> SimResult:
        """Simulate every step of a mask set: replay (steps, layers, batch) bool, context per step or one int.

        kv_len: (steps, layers) KV slots attention reads (a bounded cache: `kvbound.kv_lengths`); default the
        context. With ``timeline`` the per-bundle figures of step ``timeline_step`` are kept for
        ``plot_timeline``."""
        if policy not in POLICIES:
            raise FastCarError(f"policy {policy!r} unknown; choose one of {POLICIES}")
        if stream not in STREAMS:
            raise FastCarError(f"weight stream {stream!r} unknown; choose one of {STREAMS}")
        batch = self.batch if batch is None else int(batch)
        if not 1 <= batch <= self.batch:
            raise FastCarError(
                f"batch {batch} exceeds the {self.batch} rows the program was compiled for; recompile with --batch {batch}"
            )
        replay = np.asarray(replay, bool)
        if replay.ndim != 3 or replay.shape[1] != self.num_layers or replay.shape[2] < batch:
            raise FastCarError(f"replay masks must have shape (steps, {self.num_layers}, >= {batch}), got {replay.shape}")
        steps = replay.shape[0]
        ctxs = np.broadcast_to(np.asarray(context, np.int64), (steps,))
        if (ctxs < 1).any():
            raise FastCarError("context lengths must be >= 1")
        if kv_len is None:
            kv = np.repeat(ctxs[:, None], self.num_layers, axis=1)
        else:
            kv = np.asarray(kv_len, np.int64)
            if kv.shape != (steps, self.num_layers):
                raise FastCarError(f"kv_len must have shape ({steps}, {self.num_layers}), got {kv.shape}")
            if (kv < 1).any() or (kv > ctxs[:, None]).any():
                raise FastCarError("kv_len must lie in 1..context of its step")
        bd = self.board
        tot = {"cycles": 0.0, "macs": 0.0, "sram": 0.0, "bw": 0.0, "drs": 0.0}
        dram = np.zeros(len(DRAM_CLASSES))
        busy, stall, idle = (np.zeros(self.C) for _ in range(3))
        remaps = 0
        tl = None
        it = progress_bar(range(steps), desc="simulate", unit="step", enabled=progress)
        for s in it:
            ev = self.step(replay[s, :, :batch], kv[s], policy=policy, stream=stream, batch=batch)
            t = ev["t"]
            tot["cycles"] += t.sum()
            tot["macs"] += ev["macs"].sum()
            tot["sram"] += ev["sram"].sum()
            tot["bw"] += t[ev["bw_bound"]].sum()
            tot["drs"] += ev["drs"].sum()
            dram += np.bincount(self.dram_class.ravel(), weights=ev["dram_slot"].ravel(), minlength=4)
            dram[0] += ev["wbytes"].sum()
            own = np.minimum(ev["own"], t[:, None])
            busy += np.minimum(ev["compute"], own).sum(axis=0)
            stall += (own - np.minimum(ev["compute"], own)).sum(axis=0)
            idle += (t[:, None] - own).sum(axis=0)
            remaps += ev["remaps"]
            if timeline and s == min(timeline_step, steps - 1):
                # a bundle's layer is its busy slots' (idle NOP slots carry layer 0)
                lay = np.where(self.op != isa.Op.NOP, self.layer_idx, -1).max(axis=1)
                tl = {"t": t, "busy": np.minimum(ev["compute"], own), "own": own,
                      "part": np.where(lay >= self.num_layers, 2, np.where(self.replayable_bundle, 1, 0)),
                      "layer": np.where(lay < 0, self.num_layers, lay)}
        dram_total = float(dram.sum())
        secs = tot["cycles"] / (bd.clock_mhz * 1e6)
        energy = {
            "mac": tot["macs"] * bd.pj_per_mac * 1e-12,
            "dram": dram_total * bd.pj_per_dram_byte * 1e-12,
            "sram": tot["sram"] * bd.pj_per_sram_byte * 1e-12,
            "static": secs * bd.static_watts,
        }
        energy["total"] = sum(energy.values())
        n_rep = sum(int(replay[:, layer, :batch].sum()) for layer in self.replayable_layers)
        n_all = steps * batch * max(1, len(self.replayable_layers))
        return SimResult(
            board=bd.name, policy=policy, weights=stream, batch=batch, steps=steps, cycles=tot["cycles"],
            macs=tot["macs"], dram_bytes=dict(zip(DRAM_CLASSES, dram.tolist(), strict=True)), sram_bytes=tot["sram"],
            core_busy=busy, core_stall=stall, core_idle=idle, bandwidth_bound_cycles=tot["bw"], remaps=remaps,
            drs_cycles=tot["drs"], clock_mhz=bd.clock_mhz, macs_per_cycle=bd.macs_per_cycle, energy_j=energy,
            replay_ratio=n_rep / n_all if self.replayable_layers else 0.0, timeline=tl,
        )


def plot_timeline(results: SimResult | list[SimResult], path: str | Path, title: str = "", layers: int = 3) -> None:
    """Per-core timeline of the recorded step (one panel per result, e.g. static and DRS).

    Each (layer, part) segment shows, per core, the share busy (colour), stalled on memory/latency (grey) and
    idle (blank). Only the first ``layers`` decoder layers are drawn (0: the whole step), so segments stay
    readable; the axis is in microseconds.
    """
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastcar_compile.core.atomic import write_bytes

    results = results if isinstance(results, list) else [results]
    cores = results[0].core_busy.shape[0]
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 0.6 + (0.4 * cores + 0.6) * len(results)), squeeze=False)
    colors = {0: "#4c72b0", 1: "#dd8452", 2: "#55a868"}
    names = {0: "attention/norms/TAS", 1: "replayable MLP", 2: "embedding / LM head"}
    xmax = 0.0
    for ax, result in zip(axes[:, 0], results, strict=True):
        tl = result.timeline
        if tl is None:
            raise FastCarError("no timeline recorded; run the simulator with timeline=True")
        keep = tl["t"] > 0
        if layers:
            keep &= (tl["layer"] < layers) & (tl["part"] != 2)
        t, busy, own = tl["t"][keep], tl["busy"][keep], tl["own"][keep]
        part, layer = tl["part"][keep], tl["layer"][keep]
        start = np.concatenate([[0.0], np.cumsum(t)[:-1]])
        key = part * 100000 + layer
        cut = np.flatnonzero(np.diff(key)) + 1
        us = 1.0 / result.clock_mhz
        for lo, hi in zip(np.concatenate([[0], cut]), np.concatenate([cut, [len(t)]]), strict=True):
            x0 = start[lo] * us
            for c in range(cores):
                b = busy[lo:hi, c].sum() * us
                st = (own[lo:hi, c] - busy[lo:hi, c]).sum() * us
                ax.broken_barh([(x0, b)], (c - 0.4, 0.8), color=colors[int(part[lo])])
                ax.broken_barh([(x0 + b, st)], (c - 0.4, 0.8), color="#bbbbbb")
            ax.axvline(x0, color="black", lw=0.3, alpha=0.3)
        xmax = max(xmax, float(t.sum() * us))
        starts = [(start[lo] * us, int(layer[lo])) for lo in np.concatenate([[0], cut])
                  if part[lo] == 0 and (lo == 0 or layer[lo - 1] != layer[lo])]
        every = max(1, len(starts) // 24)  # at most ~24 labels
        for i, (x0, ly) in enumerate(starts):
            if i % every == 0:
                ax.text(x0, cores - 0.35, f"L{ly}", fontsize=6, va="bottom")
        ax.set_yticks(range(cores), [f"core {c}" for c in range(cores)])
        ax.set_ylim(-0.6, cores + 0.4)
        ax.set_title(f"{result.policy}: {result.board}, batch {result.batch}", fontsize=9, loc="left")
    for ax in axes[:, 0]:
        ax.set_xlim(0, xmax * 1.01)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()] + [
        plt.Rectangle((0, 0), 1, 1, color="#bbbbbb")]
    axes[0, 0].legend(handles, [*names.values(), "stall (DRAM/latency)"], loc="upper center", fontsize=7, ncol=4,
                      bbox_to_anchor=(0.5, 1.35 if len(results) > 1 else 1.25))
    what = f"first {layers} layers of the step" if layers else "whole step"
    axes[-1, 0].set_xlabel(f"time (us), {what}; per segment and core: colour busy, grey stalled, blank idle")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes(path, buf.getvalue())
