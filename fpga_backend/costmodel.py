"""The FPGA cost model: what one bundle of a program costs for given row masks (cycles, bytes, MACs).

One module, used by the simulator (fpga_backend/simulate.py, per step) and by the compiler's DRS table
(fpga_backend/drs.py, to find the row counts where a remap pays). Execution model: simulate.py's docstring.
"""

from __future__ import annotations

import numpy as np

from fastcar_compile.core.errors import FastCarError

from . import isa
from .encode import Program
from .hwspec import BoardConfig
from .isa import ceil_div_array, popcount32


class CostModel:
    """Per-instruction costs of a program, computed once; `evaluate` prices one step's row masks."""

    def __init__(self, program: Program, board: BoardConfig | None = None) -> None:
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
        passes = ceil_div_array(self.m, bd.array_cols) * ceil_div_array(self.k, bd.array_rows) * self.n
        vec_elems = self.m
        vec_cyc = np.select(
            [sub == isa.Vec.RMSNORM, sub == isa.Vec.ROPE, sub == isa.Vec.SOFTMAX, sub == isa.Vec.SILU_MUL],
            [ceil_div_array(2 * vec_elems, bd.vector_lanes), ceil_div_array(2 * vec_elems, bd.vector_lanes),
             ceil_div_array(self.m * self.n, bd.sfu_lanes), ceil_div_array(vec_elems, bd.sfu_lanes)],
            ceil_div_array(vec_elems, bd.vector_lanes),
        )
        self.cyc_row = np.select(
            [is_gemm, op == isa.Op.VEC, op == isa.Op.TAS], [passes, vec_cyc, ceil_div_array(self.m * self.n, bd.vector_lanes)], 0
        ).astype(np.float64)
        self.macs_row = np.where(is_gemm, self.m * self.k * self.n, 0).astype(np.float64)
        dma = (op == isa.Op.LOAD) | (op == isa.Op.STORE) | (op == isa.Op.XCHG)
        spill_row = np.where(flags & isa.Flag.SPILL, (self.k + self.m) * dt, 0)  # input slice in, output out
        self.dram_row = np.select([dma, self.kv_gemm, self.weight_gemm], [self.m * dt, self.m * self.k * dt, spill_row],
                                  0).astype(np.float64)
        # weights stream at the model's weight precision (int4: half a byte each, rounded up per tile)
        wbits = int(spec.get("weight_bits") or 8 * dt)
        tile = np.where(self.weight_gemm, (self.m * self.k * wbits + 7) // 8, self.m * self.k * dt)
        self.weight_bytes = np.where(self.weight_gemm, tile, 0).astype(np.float64)
        self.sram_row = np.select(
            [is_gemm, op == isa.Op.VEC, op == isa.Op.TAS, dma],
            [tile + (self.k + self.m * self.n) * dt, 3 * self.m * dt, 2 * self.m * self.n * dt,
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
        # segment labels for the timeline: (layer, part)
        self.part = np.where(self.layer_idx.min(axis=1) == self.num_layers, 2, np.where(self.replayable_bundle, 1, 0))

    # -------------------------------------------------------------------------------------------------
    def evaluate(self, ctx: int | np.ndarray, skip_masks: np.ndarray, active: np.uint32,
                 stream: str) -> dict[str, np.ndarray]:
        """Per-bundle time and per-slot figures for one step. skip_masks: (layers + 1, cores) row masks.

        ctx: the KV length attention reads, one int or one per layer (a bounded cache, fpga_backend/kvbound.py).
        """
        bd = self.board
        # a NOP slot carries no rows, whatever its arg says
        live = self.op != isa.Op.NOP
        mask = np.where(self.skip, skip_masks[np.minimum(self.layer_idx, self.num_layers), np.arange(self.C)[None, :]],
                        self.arg & active)
        mask = np.where(live, mask, 0).astype(np.uint32)  # the rows each slot runs after dispatch
        n_eff = popcount32(mask).astype(np.float64)
        ctx_l = np.broadcast_to(np.asarray(ctx, np.int64), (self.num_layers,))
        m_ctx = np.where(self.ctx, ctx_l[np.minimum(self.layer_idx, self.num_layers - 1)], self.m)
        cyc_row = np.where(
            self.ctx,
            np.where(
                self.op == isa.Op.GEMM,
                ceil_div_array(m_ctx, bd.array_cols) * ceil_div_array(self.k, bd.array_rows) * self.n,
                ceil_div_array(m_ctx * self.n, bd.sfu_lanes),
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
        sram = n_eff * sram_row + w_slot
        # whole cycles: a transfer ends on the first clock edge after its last byte (see ``BoardConfig.dram_terms``)
        slot_t = np.maximum(compute, np.ceil(sram / bd.sram_bytes_per_cycle))
        core_max = slot_t.max(axis=1)
        w_mul, o_mul, div = bd.dram_terms  # the weight stream and the rest at their own rates, in whole cycles
        held = wbytes.astype(np.int64) * w_mul + dram_slot.sum(axis=1).astype(np.int64) * o_mul
        dram_t = (-(-held // div)).astype(np.float64)
        active_b = (n_eff > 0).any(axis=1)
        lat = bd.issue_latency
        if bd.double_buffering:
            t = np.where(active_b, np.maximum(core_max, dram_t) + lat, 0.0)
            own = np.where(n_eff > 0, np.maximum(slot_t, dram_t[:, None]) + lat, 0.0)
        else:
            t = np.where(active_b, core_max + dram_t + lat, 0.0)
            own = np.where(n_eff > 0, slot_t + dram_t[:, None] + lat, 0.0)
        return {"t": t, "compute": compute, "own": own, "macs": n_eff * macs_row, "dram_slot": dram_slot,
                "wbytes": wbytes, "sram": sram, "bw_bound": active_b & (dram_t > core_max), "n": n_eff,
                "mask": mask}
