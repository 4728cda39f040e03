"""DRS remap thresholds: the compile-time table that lets the dispatcher decide when a remap pays.

A remap costs ``board.drs_overhead`` cycles. At DRS_DISPATCH the dispatcher knows, from the Index Register and
the compile-time binding: n (compute rows), s (rows on the busiest core if it keeps the binding),
d = ceil(n / cores) (busiest core after round-robin), and the active core counts A_s, A_d. A layer's MLP phase
time depends only on (busiest-core rows j, n) for a broadcast weight stream, and on (j, n, A) for per-core
streams, so the compiler tabulates, per n = 1..32, the smallest s for which the phase under the binding is
slower than under round-robin by more than the overhead:

    remap  iff  n > 0  and  s >= thr[n]  (and, for per-core streams, A_d <= A_s)

``thr[n]`` is a byte (0xFF: never). DRS_SET carries thr[1..16] and DRS_DISPATCH thr[17..32], four per
32-bit field in m, k, off_m, off_k (little-endian bytes). Thresholds hold for the compile-time board figures
and stream mode (``meta["drs_weights"]``): with those the rule is exact, so DRS is never slower than static.
"""

from __future__ import annotations

import numpy as np

from . import isa
from .costmodel import CostModel
from .encode import Program
from .isa import ceil_div

NEVER = 0xFF
FIELDS = ("m", "k", "off_m", "off_k")
PER_INSTR = 16


def pack(thr: list[int], rec: np.void) -> None:
    """Write 16 thresholds into an instruction's m, k, off_m, off_k."""
    b = np.asarray(thr, np.uint8)
    for i, f in enumerate(FIELDS):
        rec[f] = int(b[4 * i : 4 * i + 4].view("<u4")[0])


def unpack(rec: np.void) -> list[int]:
    out: list[int] = []
    for f in FIELDS:
        out += list(np.array([int(rec[f])], "<u4").view(np.uint8))
    return [int(x) for x in out]


def skip_span(bundles: np.ndarray, start: int) -> int:
    """Bundles from ``start`` (a DRS_DISPATCH bundle) that hold only its layer's replayable instructions and no
    further control op: what the dispatcher jumps over, at no cost, when every row of the layer replays (the
    simulator prices those bundles 0 cycles: all their slots are dropped)."""
    core, ctl = bundles[:, :-1], bundles[:, -1]
    layer = int(ctl[start]["layer"])
    end = start
    while end < len(bundles):
        live = core[end]["opcode"] != isa.Op.NOP
        skip = (core[end]["flags"] & isa.Flag.SKIP_ON_REPLAY) != 0
        if not live.any() or (live & ~(skip & (core[end]["layer"] == layer))).any() or \
                (end > start and int(ctl[end]["opcode"]) != isa.Op.NOP):
            break
        end += 1
    return end - start


def set_skip_spans(bundles: np.ndarray) -> None:
    """Write every DRS_DISPATCH's jump length (``skip_span``) into its arg."""
    for i in np.flatnonzero(bundles[:, -1]["opcode"] == isa.Op.DRS_DISPATCH):
        bundles[i, -1]["arg"] = skip_span(bundles, int(i))


def table(program: Program) -> np.ndarray:
    """thr[layer, n] for n = 0..32 from the DRS_SET/DRS_DISPATCH instructions (column n = 0 unused); layers
    without them never remap."""
    layers = int(program.meta["model"]["layers"])
    thr = np.full((layers + 1, isa.MAX_ROWS + 1), NEVER, np.int64)
    ctl = program.bundles[:, -1]
    for rec in ctl[ctl["opcode"] == isa.Op.DRS_SET]:
        if int(rec["layer"]) < layers:
            thr[int(rec["layer"]), 1 : 1 + PER_INSTR] = unpack(rec)
    for rec in ctl[ctl["opcode"] == isa.Op.DRS_DISPATCH]:
        if int(rec["layer"]) < layers:
            thr[int(rec["layer"]), 1 + PER_INSTR :] = unpack(rec)
    return thr


def _masks(j: int, n: int, a: int, cores: int) -> np.ndarray | None:
    """Row masks with j rows on core 0, n rows on exactly a cores, none above j (None if impossible)."""
    if not (1 <= a <= cores and j >= 1 and n >= j + (a - 1) and n <= j * a):
        return None
    counts = [j] + [0] * (cores - 1)
    rest = n - j
    for c in range(1, a):  # at least one each, then fill up to j
        counts[c] = 1
        rest -= 1
    c = 1
    while rest > 0:
        if counts[c] < j:
            counts[c] += 1
            rest -= 1
        c = c % (a - 1) + 1 if a > 1 else 1
    masks = np.zeros(cores, np.uint32)
    bit = 0
    for c, k in enumerate(counts):
        for _ in range(k):
            masks[c] |= np.uint32(1 << bit)
            bit += 1
    return masks


def fill_thresholds(program: Program, weights: str = "broadcast") -> Program:
    """Compute every replayable layer's thresholds with the FPGA cost model and write them in place."""
    board, cores = program.board, program.cores
    batch = int(program.meta["batch"])
    per = ceil_div(batch, cores)
    sim = CostModel(program)
    ctl = program.bundles[:, -1]
    sets = {int(r["layer"]): i for i, r in zip(np.flatnonzero(ctl["opcode"] == isa.Op.DRS_SET),
                                                  ctl[ctl["opcode"] == isa.Op.DRS_SET], strict=True)}
    disp = {int(r["layer"]): i for i, r in zip(np.flatnonzero(ctl["opcode"] == isa.Op.DRS_DISPATCH),
                                                  ctl[ctl["opcode"] == isa.Op.DRS_DISPATCH], strict=True)}
    cache: dict[bytes, list[int]] = {}
    for layer in sim.replayable_layers:
        rows = np.flatnonzero(sim.replayable_bundle & (sim.bundle_layer == layer))
        phase = Program(board, program.bundles[rows], program.meta)
        key = phase.bundles[:, :-1][["opcode", "flags", "sub", "n", "m", "k", "arg"]].tobytes()
        if key not in cache:
            cache[key] = _thresholds(CostModel(phase), layer, batch, per, cores, weights, board.drs_overhead)
        thr = cache[key]
        pack(thr[1 : 1 + PER_INSTR], program.bundles[sets[layer], -1])
        pack(thr[1 + PER_INSTR :], program.bundles[disp[layer], -1])
    program.meta["drs_weights"] = weights
    return program


def _thresholds(sim: CostModel, layer: int, batch: int, per: int, cores: int, weights: str, overhead: int) -> list[int]:
    active = np.uint32((1 << batch) - 1 if batch < 32 else isa.ALL_ROWS)
    L = sim.num_layers
    thr = [NEVER] * (isa.MAX_ROWS + 1)

    def phase(j: int, n: int, a: int) -> float | None:
        masks = _masks(j, n, a, cores)
        if masks is None:
            return None
        tab = np.zeros((L + 1, cores), np.uint32)
        tab[layer] = masks
        return float(sim.evaluate(1, tab, active, weights)["t"].sum())

    for n in range(1, batch + 1):
        d = ceil_div(n, cores)
        a_d = min(n, cores)
        for s in range(d + 1, min(n, per) + 1):
            a = a_d if weights == "per_core" else ceil_div(n, s)
            t_static, t_drs = phase(s, n, a), phase(d, n, a_d if weights == "per_core" else ceil_div(n, d))
            if t_static is None or t_drs is None:
                continue
            if t_static - t_drs > overhead:
                thr[n] = s
                break
    return thr

