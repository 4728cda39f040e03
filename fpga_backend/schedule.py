"""Schedulers: the compile-time bundle emitter and the two run-time dispatch policies over its stream.

Compile time (both policies share the result): batch rows are bound to cores in blocks
(row r -> core r // ceil(batch / cores)); every task becomes one bundle per tile with one instruction per core
that owns rows, its ``arg`` the core's row mask. Per replayable layer the control slots carry DRS_SET (latch
the Index Register from the TAS unit, issued with the softmax after TAS), DRS_DISPATCH (with the first MLP
bundle) and BARRIER (with the layer's last bundle); the head ends with FINISH.

Run time, for the instructions flagged SKIP_ON_REPLAY:

* static: a core keeps its compile-time rows and drops the replayed ones (mask & Index Register); it idles
  when its rows replay while other cores still compute.
* DRS: the 32 Mapping Registers assign the compute rows (Index Register bit 1) round-robin to cores; the
  replayed rows' instructions are dropped. A remap costs ``board.drs_overhead`` cycles, so the dispatcher
  keeps the compile-time binding when remapping would not pay for itself (decided with the same cost
  model the simulator uses); with no replay the two policies therefore coincide.
"""

from __future__ import annotations

import numpy as np

from fastcar_compile.core.errors import FastCarError

from . import isa
from .drs import set_skip_spans
from .encode import Program
from .isa import ceil_div
from .kvbound import META_KEY as KV_META_KEY
from .partition import Partition, Task, live_activations


def block_binding(batch: int, cores: int) -> np.ndarray:
    """Compile-time row masks per core: rows in contiguous blocks of ceil(batch / cores)."""
    per = ceil_div(batch, cores)
    masks = np.zeros(cores, np.uint32)
    for r in range(batch):
        masks[r // per] |= np.uint32(1 << r)
    return masks


def mapping_registers(index_register: int, batch: int, cores: int) -> list[int]:
    """DRS Mapping Registers: the i-th compute row (bit set) goes to core i mod cores; others map to 0."""
    regs = [0] * isa.MAX_ROWS
    i = 0
    for r in range(batch):
        if index_register >> r & 1:
            regs[r] = i % cores
            i += 1
    return regs


def drs_masks(index_register: int, batch: int, cores: int) -> np.ndarray:
    """Per-core row masks after DRS remapping (round-robin over compute rows)."""
    masks = np.zeros(cores, np.uint32)
    regs = mapping_registers(index_register, batch, cores)
    for r in range(batch):
        if index_register >> r & 1:
            masks[regs[r]] |= np.uint32(1 << r)
    return masks


def static_masks(index_register: int, binding: np.ndarray) -> np.ndarray:
    """Per-core row masks under the compile-time binding, replayed rows dropped."""
    return binding & np.uint32(index_register & isa.ALL_ROWS)


def _task_bundles(task: Task, layer: int, binding: np.ndarray, context: int, slots: int, flags: int) -> np.ndarray:
    tiles = task.tiles or [(task.off_m, task.m, task.off_k, task.k)]
    out = np.zeros((len(tiles), slots), isa.INSTR_DTYPE)
    tiles_arr = np.asarray(tiles, dtype=np.int64)
    m = tiles_arr[:, 1]
    if task.flags & isa.Flag.CTX:
        m = np.full(len(tiles), context)
    for c, mask in enumerate(binding):
        if not mask and not task.replayable:  # replayable slots stay: DRS may map rows onto any core
            continue
        rec = out[:, c]
        rec["opcode"] = int(task.op)
        rec["flags"] = flags
        rec["sub"] = int(task.sub)
        rec["dst"] = task.dst
        rec["src"] = task.src
        rec["layer"] = layer
        rec["tensor"] = task.weight if task.weight is not None else task.src2
        rec["n"] = task.n
        rec["m"] = m
        rec["k"] = tiles_arr[:, 3]
        rec["off_m"] = tiles_arr[:, 0]
        rec["off_k"] = tiles_arr[:, 2]
        rec["arg"] = int(mask)
    return out


def emit_program(part: Partition, batch: int, context: int) -> Program:
    """Compile-time schedule: the bundle stream both run-time policies execute."""
    board, spec = part.board, part.spec
    if not 1 <= batch <= isa.MAX_ROWS:
        raise FastCarError(f"batch {batch} out of range: the Index Register holds 1..{isa.MAX_ROWS} rows")
    if context < 1:
        raise FastCarError(f"context {context} must be >= 1 (KV length including the new token)")
    slots = board.cores + 1
    binding = block_binding(batch, board.cores)
    rows_per_core = ceil_div(batch, board.cores)
    spilled: set[str] = set()
    ctl = slots - 1
    chunks: list[np.ndarray] = []
    first = np.zeros((1, slots), isa.INSTR_DTYPE)
    for c, mask in enumerate(binding):  # embedding rows of the new tokens
        if mask:
            first[0, c]["opcode"] = int(isa.Op.LOAD)
            first[0, c]["sub"] = int(isa.Space.ACT)
            first[0, c]["dst"] = isa.BUF["x"]
            first[0, c]["layer"] = isa.NO_LAYER
            first[0, c]["m"] = spec.hidden
            first[0, c]["arg"] = int(mask)
    chunks.append(first)
    for g in part.graphs:
        layer = int(g.graph["layer"])
        tasks = part.tasks(g)
        layer_chunks = []
        dispatched = False
        set_next = False
        for t in tasks:
            flags = int(t.flags)
            if t.op == isa.Op.GEMM and t.sub == isa.Space.WEIGHT and \
                    rows_per_core * live_activations(spec, t) * spec.dtype_bytes > board.act_buffer_kib * 1024:
                flags |= int(isa.Flag.SPILL)
                spilled.add(t.name)
            b = _task_bundles(t, layer, binding, context, slots, flags)
            if set_next:
                b[0, ctl]["opcode"] = int(isa.Op.DRS_SET)
                b[0, ctl]["flags"] = int(isa.Flag.FROM_TAS)
                b[0, ctl]["layer"] = layer
                set_next = False
            if t.op == isa.Op.TAS:
                set_next = True
            if t.replayable and not dispatched:
                b[0, ctl]["opcode"] = int(isa.Op.DRS_DISPATCH)
                b[0, ctl]["layer"] = layer
                dispatched = True
            layer_chunks.append(b)
        end = layer_chunks[-1][-1, ctl]
        end["opcode"] = int(isa.Op.FINISH if layer == isa.NO_LAYER else isa.Op.BARRIER)
        end["layer"] = layer
        chunks.extend(layer_chunks)
    bundles = np.concatenate(chunks)
    set_skip_spans(bundles)
    notes = list(part.notes)
    if spilled:
        notes.append(f"{rows_per_core} row(s) per core overflow the {board.act_buffer_kib} KiB act buffer in "
                     f"{sorted(spilled)}: those tiles move their input/output slices through DRAM (flag SPILL)")
    meta = {
        "model": spec.to_dict(),
        "spilled_tasks": sorted(spilled),
        "batch": batch,
        "context": context,
        "binding": "block",
        "binding_masks": [int(x) for x in binding],
        "tensors": part.tensors,
        "unsupported": part.unsupported,
        "notes": notes,
    }
    if part.kv:
        meta[KV_META_KEY] = {str(layer): b.to_dict() for layer, b in sorted(part.kv.items())}
    return Program(board=board, bundles=bundles, meta=meta)
