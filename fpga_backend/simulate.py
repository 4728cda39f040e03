"""Cycle-approximate simulator of a bundle program (timing, counters, energy, per-core timeline).

Execution model: bundles issue in order, the cores of a bundle in lock step (they share the broadcast weight
stream). For one bundle, with n_c the rows core c runs after dispatch:

    compute_c = n_c * array passes of its instruction      (GEMM: ceil(m/cols) * ceil(k/rows) * n)
    sram_c    = n_c * on-chip bytes / sram_bytes_per_cycle
    dram      = (per-row bytes of all slots + weight stream bytes) / (peak * efficiency) per cycle
    time      = max(max_c max(compute_c, sram_c), dram) + issue_latency      (double buffering)
              = max_c max(compute_c, sram_c) + dram + issue_latency         (without)

A bundle whose slots were all dropped costs nothing. Weight streams: ``broadcast`` fetches a tile once
for every core (saved only when every row of the batch skips), ``per_core`` fetches one copy per core with
rows (saved when that core's rows all skip). KV reads grow with the context and are never skipped.
Utilisation = array MACs / (cycles * board MACs per cycle).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from fastcar_compile.errors import FastCarError

from . import isa
from .drs import table as drs_table
from .encode import Program
from .hwspec import ASSUMPTIONS, BoardConfig
from .isa import popcount32
from .schedule import drs_masks

POLICIES = ("static", "drs")
STREAMS = ("broadcast", "per_core")
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


class Simulator:
    """Precomputes per-instruction costs of a program once; ``run`` then evaluates mask sets quickly."""

    def __init__(self, program: Program, board: BoardConfig | None = None, *, check: bool = True) -> None:
        if check:  # a decoded file may hold values that index past arrays (verify.py); fragments skip it
            from .verify import check_program

            check_program(program)
        self.program = program
        self.board = board or program.board
        if self.board.structural_hash() != program.board.structural_hash():
            raise FastCarError(
                f"board {self.board.name!r} differs from the program's board {program.board.name!r} in cores, "
                "array or buffers; recompile for it (only timing/energy figures may be overridden)"
            )
        missing = [k for k in ("batch", "binding_masks", "model") if k not in program.meta]
        if missing:
            raise FastCarError(f"bundle metadata lacks {missing}: simulate programs made by the FPGA compiler "
                               "(or keep the .meta line of a disassembled one)")
        self.batch = int(program.meta["batch"])
        self.binding = np.asarray(program.meta["binding_masks"], np.uint32)
        spec = program.meta["model"]
        self.num_layers = int(spec["layers"])
        b = program.bundles
        C = program.cores
        core = b[:, :C]
        self.C = C
        g = lambda f: core[f].astype(np.int64)  # noqa: E731
        op, sub, flags = g("opcode"), g("sub"), g("flags")
        self.m, self.k, self.n = g("m"), g("k"), np.maximum(g("n"), 1)
        self.arg = core["arg"].astype(np.uint32)
        lay = g("layer")
        self.layer_idx = np.where(lay == isa.NO_LAYER, self.num_layers, lay)
        self.skip = (flags & isa.Flag.SKIP_ON_REPLAY) != 0
        self.ctx = (flags & isa.Flag.CTX) != 0
        bd = self.board
        dt = bd.dtype_bytes
        is_gemm = op == isa.Op.GEMM
        self.weight_gemm = is_gemm & (sub == isa.Space.WEIGHT)
        self.kv_gemm = is_gemm & (sub != isa.Space.WEIGHT)
        self.op, self.sub = op, sub
        # per-row costs for the context-independent instructions (ctx ones are filled per step)
        passes = _ceil(self.m, bd.array_cols) * _ceil(self.k, bd.array_rows) * self.n
        vec_elems = self.m
        vec_cyc = np.select(
            [sub == isa.Vec.RMSNORM, sub == isa.Vec.ROPE, sub == isa.Vec.SOFTMAX, sub == isa.Vec.SILU_MUL],
            [_ceil(2 * vec_elems, bd.vector_lanes), _ceil(2 * vec_elems, bd.vector_lanes),
             _ceil(self.m * self.n, bd.sfu_lanes), _ceil(vec_elems, bd.sfu_lanes)],
            _ceil(vec_elems, bd.vector_lanes),
        )
        self.cyc_row = np.select(
            [is_gemm, op == isa.Op.VEC, op == isa.Op.TAS], [passes, vec_cyc, _ceil(self.m * self.n, bd.vector_lanes)], 0
        ).astype(np.float64)
        self.macs_row = np.where(is_gemm, self.m * self.k * self.n, 0).astype(np.float64)
        dma = (op == isa.Op.LOAD) | (op == isa.Op.STORE) | (op == isa.Op.XCHG)
        spill_row = np.where(flags & isa.Flag.SPILL, (self.k + self.m) * dt, 0)  # input slice in, output out
        self.dram_row = np.select([dma, self.kv_gemm, self.weight_gemm], [self.m * dt, self.m * self.k * dt, spill_row],
                                  0).astype(np.float64)
        self.weight_bytes = np.where(self.weight_gemm, self.m * self.k * dt, 0).astype(np.float64)
        self.sram_row = np.select(
            [is_gemm, op == isa.Op.VEC, op == isa.Op.TAS, dma],
            [(self.m * self.k + self.k + self.m * self.n) * dt, 3 * self.m * dt, 2 * self.m * self.n * dt,
             self.m * dt],
            0,
        ).astype(np.float64)
        # per-row bytes by class (weight streams are counted per bundle, into "weights"; a weight GEMM's
        # per-row bytes are activation spill)
        self.dram_class = np.select(
            [self.kv_gemm | (sub == isa.Space.KV_K) & dma | (sub == isa.Space.KV_V) & dma, op == isa.Op.XCHG],
            [1, 2],
            3,
        )
        ctl = b[:, C]
        self.dispatch = ctl["opcode"] == isa.Op.DRS_DISPATCH
        self.replayable_bundle = self.skip.any(axis=1)
        blay = np.where(self.replayable_bundle, self.layer_idx.max(axis=1, where=self.skip, initial=0), -1)
        self.bundle_layer = np.where(self.replayable_bundle, blay, self.num_layers + 1)
        self.replayable_layers = sorted({int(x) for x in self.layer_idx[self.skip]})
        self.thr = drs_table(program)
        # segment labels for the timeline: (layer, part)
        self.part = np.where(self.layer_idx.min(axis=1) == self.num_layers, 2, np.where(self.replayable_bundle, 1, 0))

    # -------------------------------------------------------------------------------------------------
    def _eval(self, ctx: int, skip_masks: np.ndarray, active: np.uint32, stream: str) -> dict[str, np.ndarray]:
        """Per-bundle time and per-slot figures for one step. skip_masks: (layers + 1, cores) row masks."""
        bd = self.board
        base = popcount32(self.arg & active).astype(np.float64)
        tab = popcount32(skip_masks).astype(np.float64)
        n_eff = np.where(self.skip, tab[np.minimum(self.layer_idx, self.num_layers), np.arange(self.C)[None, :]], base)
        m_ctx = np.where(self.ctx, ctx, self.m)
        cyc_row = np.where(
            self.ctx,
            np.where(
                self.op == isa.Op.GEMM,
                _ceil(m_ctx, bd.array_cols) * _ceil(self.k, bd.array_rows) * self.n,
                _ceil(m_ctx * self.n, bd.sfu_lanes),
            ),
            self.cyc_row,
        )
        dt = bd.dtype_bytes
        macs_row = np.where(self.ctx & (self.op == isa.Op.GEMM), m_ctx * self.k * self.n, self.macs_row)
        dram_row = np.where(self.ctx & self.kv_gemm, m_ctx * self.k * dt, self.dram_row)
        sram_row = np.where(self.ctx, (m_ctx * self.k + m_ctx * self.n) * dt, self.sram_row)
        compute = n_eff * cyc_row
        w_on = self.weight_gemm & (n_eff > 0)
        if stream == "broadcast":
            wbytes = np.where(w_on, self.weight_bytes, 0.0).max(axis=1)
            w_slot = np.where(w_on, self.weight_bytes, 0.0)  # each core's buffer receives the broadcast
        else:
            w_slot = np.where(w_on, self.weight_bytes, 0.0)
            wbytes = w_slot.sum(axis=1)
        dram_slot = n_eff * dram_row
        dram = dram_slot.sum(axis=1) + wbytes
        sram = n_eff * sram_row + w_slot
        slot_t = np.maximum(compute, sram / bd.sram_bytes_per_cycle)
        core_max = slot_t.max(axis=1)
        dram_t = dram / bd.dram_bytes_per_cycle
        active_b = (n_eff > 0).any(axis=1)
        lat = bd.issue_latency
        if bd.double_buffering:
            t = np.where(active_b, np.maximum(core_max, dram_t) + lat, 0.0)
            own = np.where(n_eff > 0, np.maximum(slot_t, dram_t[:, None]) + lat, 0.0)
        else:
            t = np.where(active_b, core_max + dram_t + lat, 0.0)
            own = np.where(n_eff > 0, slot_t + dram_t[:, None] + lat, 0.0)
        return {"t": t, "compute": compute, "own": own, "macs": n_eff * macs_row, "dram_slot": dram_slot,
                "wbytes": wbytes, "sram": sram, "bw_bound": active_b & (dram_t > core_max), "n": n_eff}

    def step(self, replay: np.ndarray, ctx: int, *, policy: str = "drs", stream: str = "broadcast",
             batch: int | None = None) -> dict[str, Any]:
        """One decode step. replay: (layers, batch) bool. Returns per-bundle/per-slot figures and remaps."""
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
        ev = self._eval(ctx, stat, active, stream)
        remapped = np.zeros(L + 2, bool)
        if policy == "drs":
            drs = np.stack([drs_masks(int(compute_rows[i]), batch, self.C) for i in range(L + 1)])
            ev_d = self._eval(ctx, drs, active, stream)
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
            timeline_step: int = 0) -> SimResult:
        """Simulate every step of a mask set: replay (steps, layers, batch) bool, context per step or one int.

        With ``timeline`` the per-bundle figures of step ``timeline_step`` are kept for ``plot_timeline``."""
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
        bd = self.board
        tot = {"cycles": 0.0, "macs": 0.0, "sram": 0.0, "bw": 0.0, "drs": 0.0}
        dram = np.zeros(len(DRAM_CLASSES))
        busy, stall, idle = (np.zeros(self.C) for _ in range(3))
        remaps = 0
        tl = None
        it = tqdm(range(steps), desc="simulate", unit="step", disable=not progress)
        for s in it:
            ev = self.step(replay[s, :, :batch], int(ctxs[s]), policy=policy, stream=stream, batch=batch)
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
                tl = {"t": t, "busy": np.minimum(ev["compute"], own), "own": own, "part": self.part,
                      "layer": np.where(self.bundle_layer <= self.num_layers, self.bundle_layer,
                                        self.layer_idx.min(axis=1))}
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


def _ceil(a: np.ndarray | int, b: int) -> np.ndarray:
    return -(-np.asarray(a, dtype=np.int64) // b)


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

    from .encode import write_atomic

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
    write_atomic(path, buf.getvalue())
