"""Co-simulation: the bundles through the RTL (Verilator + cocotb) and through the Python simulator, compared.

``cosimulate`` runs a program's decode steps on the RTL model of its board (``build.py``) and, step by step,
on ``simulate.Simulator`` with the same replay masks, contexts, policy and weight streams, then compares what
each did: the bundles issued and their cycles, the order of issued operations (bundle, core, opcode, layer,
row mask), per core the busy and occupied cycles, DRAM bytes per class and MACs, the remaps, the rows each
layer replayed (the RTL's Index Register against the trace) and the MLP-cache reads and writes. Every
difference is a line of ``CosimReport.mismatches``.

The RTL takes its replay decisions from its own TAS comparison: the testbench feeds, per step, layer and row,
a TAS score on the side of the layer's tau that the trace's decision needs (a trace records decisions, not
scores), so a replayed row is one whose score the comparator found above tau.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from fastcar_compile.core.errors import FastCarError

from .. import encode, isa
from ..encode import Program
from ..hwspec import BoardConfig
from . import build

FILE_W, ADDR_W, STEP_W = 23, 20, 16  # tb_top's memories (words of the image, instructions, steps x layers)
DRAM_CLASSES = ("weights", "kv", "replay_cache", "activations")  # simulate.DRAM_CLASSES; class ids 1..3
ERR_BITS = ("SKIP_ON_REPLAY slot of a layer without DRS_DISPATCH", "DRS_DISPATCH without its DRS_SET",
            "DRS_SET FROM_TAS without a TAS of its layer", "jump beyond the program", "MLP-cache port overrun")


def preconditions(program: Program) -> list[str]:
    """What the RTL dispatcher needs of a program beyond what `sim` checks (compiled programs meet all):
    replayable layers are latched and dispatched before their replayable slots, one layer at a time."""
    problems: list[str] = []
    b = program.bundles
    core, ctl = b[:, :-1], b[:, -1]
    set_layer = dispatch_layer = tas_layer = None
    for i in range(len(b)):
        op = int(ctl[i]["opcode"])
        tas = core[i]["opcode"] == isa.Op.TAS
        if tas.any():
            tas_layer = int(core[i]["layer"][tas][0])
        if op == isa.Op.DRS_SET:
            if int(ctl[i]["flags"]) & isa.Flag.FROM_TAS and tas_layer != int(ctl[i]["layer"]):
                problems.append(f"bundle {i}: DRS_SET of layer {int(ctl[i]['layer'])} takes the Index Register from "
                                "a TAS of another layer")
            set_layer = int(ctl[i]["layer"])
        elif op == isa.Op.DRS_DISPATCH:
            if set_layer != int(ctl[i]["layer"]):
                problems.append(f"bundle {i}: DRS_DISPATCH of layer {int(ctl[i]['layer'])} without its DRS_SET")
            if int(ctl[i]["arg"]) == 0:
                problems.append(f"bundle {i}: DRS_DISPATCH with no replayable phase to jump (arg 0)")
            dispatch_layer = int(ctl[i]["layer"])
        skip = (core[i]["opcode"] != isa.Op.NOP) & ((core[i]["flags"] & isa.Flag.SKIP_ON_REPLAY) != 0)
        if skip.any() and (core[i]["layer"][skip] != dispatch_layer).any():
            problems.append(f"bundle {i}: a SKIP_ON_REPLAY slot of a layer whose DRS_DISPATCH has not issued")
        if len(problems) >= 5:
            break
    if len(b) * program.bundles.shape[1] > 2**ADDR_W:
        problems.append(f"{len(b)} bundles exceed the model's program memory ({2**ADDR_W} instructions)")
    return problems


# ------------------------------------------------------------------------------------------------- running
def _hex_words(data: bytes) -> list[str]:
    pad = data + b"\0" * (-len(data) % 4)
    return [f"{w:08x}" for w in np.frombuffer(pad, "<u4")]


def run_bench(board: BoardConfig, files: list[bytes], *, runs: list[dict] | None = None, job: dict | None = None,
              kvlen: np.ndarray | None = None, scores: np.ndarray | None = None, valid: np.ndarray | None = None,
              workdir: Path, log=print) -> tuple[dict, Path]:
    """Run the testbench once: load ``files`` in turn (verdicts), then the ``runs`` of decode steps on the last
    one. Returns (the bench's JSON output, the monitor log)."""
    binary = build.build(board, log=log)
    words: list[str] = []
    offsets = []
    for data in files:
        offsets.append([len(words), len(data)])
        words += _hex_words(data)
    if len(words) > 2**FILE_W:
        raise FastCarError(f"bundle images of {4 * len(words)} bytes exceed the co-simulation's {4 * 2**FILE_W}")
    (workdir / "file.hex").write_text("\n".join(words) + "\n")
    plus = [f"+FILE={workdir / 'file.hex'}", f"+LOG={workdir / 'monitor.log'}"]
    if kvlen is not None:
        if kvlen.size > 2**STEP_W:
            raise FastCarError(f"{kvlen.size} (step, layer) pairs exceed the co-simulation's {2**STEP_W}")
        (workdir / "kvlen.hex").write_text("\n".join(f"{int(v):08x}" for v in kvlen.ravel()) + "\n")
        rows = scores.reshape(-1, isa.MAX_ROWS)
        (workdir / "scores.hex").write_text("\n".join("".join(f"{int(x):08x}" for x in r[::-1]) for r in rows) + "\n")
        (workdir / "valid.hex").write_text("\n".join(f"{int(v):08x}" for v in valid.ravel()) + "\n")
        plus += [f"+KVLEN={workdir / 'kvlen.hex'}", f"+SCORES={workdir / 'scores.hex'}",
                 f"+VALID={workdir / 'valid.hex'}"]
    spec = {"files": offsets, "runs": runs or [], "result": str(workdir / "result.json"), **(job or {})}
    (workdir / "job.json").write_text(json.dumps(spec))
    from find_libpython import find_libpython

    env = dict(os.environ)
    # the bench is imported as a top-level module: importing it through the package would load the whole
    # compiler (onnx, networkx) into the simulator's interpreter first
    bench_path = os.pathsep.join([str(Path(__file__).parent), *sys.path])
    env.update({"MODULE": "cosim_bench", "TOPLEVEL": build.TOP,
                "TOPLEVEL_LANG": "verilog", "FCAR_JOB": str(workdir / "job.json"),
                "COCOTB_RESULTS_FILE": str(workdir / "results.xml"), "PYTHONPATH": bench_path,
                "LIBPYTHON_LOC": find_libpython() or "", "COCOTB_REDUCED_LOG_FMT": "1"})
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    r = subprocess.run([str(binary), *plus], cwd=workdir, env=env, capture_output=True, text=True)
    result = workdir / "result.json"
    if r.returncode != 0 or not result.is_file():
        tail = (r.stdout + r.stderr)[-2500:]
        raise RuntimeError(f"RTL co-simulation failed (exit {r.returncode}); its output ends:\n{tail}")
    return json.loads(result.read_text()), workdir / "monitor.log"


def reference_verdict(data: bytes, board: BoardConfig) -> tuple[int, int, int] | None:
    """What the RTL loader built for ``board`` must answer for ``data``: ``encode.decode``'s refusal as (refusal,
    fault, instruction index), (HASH, 0, 0) for a valid program of another board (the RTL runs its own), (NONE,
    0, 0) for one it runs; None when decode refuses the JSON metadata, which only the host reads (invalid JSON,
    no board, or a board other than the one the header's hash names)."""
    try:
        program = encode.decode(data)
    except encode.DecodeError as exc:
        if exc.refusal == encode.Refusal.META:
            return None
        if exc.refusal == encode.Refusal.HASH:
            _, _, _, hw_hash, cores, *_ = encode.HEADER.unpack_from(data, 0)
            if hw_hash == board.structural_hash() and cores == board.cores:
                return None  # the header names the RTL's board; the metadata's board disagrees: the host's to refuse
        return int(exc.refusal), int(exc.fault), max(exc.index, 0)
    if program.board.structural_hash() != board.structural_hash():
        return int(encode.Refusal.HASH), 0, 0
    return int(encode.Refusal.NONE), 0, 0


def loader_verdicts(board: BoardConfig, files: list[bytes], log=print) -> list[tuple[int, int, int]]:
    """The RTL loader's (refusal, fault, instruction index) of each file (``encode.Refusal`` codes; 15: more
    instructions than the model's program memory)."""
    with tempfile.TemporaryDirectory(prefix="fcar-rtl-") as tmp:
        out, _ = run_bench(board, files, workdir=Path(tmp), log=log)
    return [tuple(v) for v in out["loads"]]


# ------------------------------------------------------------------------------------------------- inputs
def _layer_tau(program: Program, layers: int) -> dict[int, float]:
    core = program.bundles[:, :-1]
    tas = core[core["opcode"] == isa.Op.TAS]
    out: dict[int, float] = {}
    for rec in tas:
        out.setdefault(int(rec["layer"]), isa.tau_from_bits(int(rec["off_m"])))
    return {k: v for k, v in out.items() if k < layers}


def tas_scores(program: Program, replay: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per (step, layer, row) a float32 score and a valid bit that make the RTL's comparison (valid and score >
    tau) reproduce ``replay``: replayed rows score above tau (down to the next float), computed rows at or below
    it or hold no valid score. Raises FastCarError when tau admits no replay (+inf, NaN) and the trace has one."""
    steps, layers, batch = replay.shape
    scores = np.zeros((steps, layers, isa.MAX_ROWS), np.float32)
    valid = np.zeros((steps, layers, isa.MAX_ROWS), bool)
    for layer, tau in _layer_tau(program, layers).items():
        t = np.float32(tau)
        rep = replay[:, layer, :]
        if rep.any() and (np.isnan(t) or t == np.inf):
            raise FastCarError(f"layer {layer}'s tau is {tau}: no TAS score exceeds it, but the trace replays it")
        scale = np.float32(max(1.0, abs(float(t)))) if np.isfinite(t) else np.float32(1.0)
        jitter = np.abs(rng.standard_normal((steps, batch))).astype(np.float32) * scale
        with np.errstate(over="ignore", invalid="ignore"):
            up = np.where(rng.random((steps, batch)) < 0.3, np.nextafter(t, np.float32(np.inf)), t + jitter)
            up = np.where(up > t, up, np.nextafter(t, np.float32(np.inf)))
            down = np.where(rng.random((steps, batch)) < 0.3, t, t - jitter)
            down = np.where(down <= t, down, t)
        invalid = ~rep & (rng.random((steps, batch)) < 0.2)  # no valid score: computes, whatever the value
        scores[:, layer, :batch] = np.where(rep, up, np.where(invalid, up, down))
        valid[:, layer, :batch] = ~invalid
    return scores, valid


# ------------------------------------------------------------------------------------------------- monitor log
@dataclasses.dataclass
class RtlStep:
    """What the RTL did in one step, from the monitor."""

    pcs: list[int]  # bundles in issue order
    starts: list[int]
    remap: list[int]
    end: int
    slots: list[tuple]  # (bundle position, core, op, sub, layer, rows, compute, dram, w, macs, class)
    cores: dict[tuple[int, int], tuple[int, int]]  # (bundle position, core) -> (busy, own)
    latched: list[tuple[int, int]]  # (layer, Index Register)
    cache: list[tuple[int, int, int, int]]  # (core, read, row, bytes)
    stall: int
    err: int

    @property
    def cycles(self) -> int:
        return self.end - self.starts[0] if self.starts else 0

    def durations(self) -> np.ndarray:
        edges = np.asarray([*self.starts, self.end], np.int64)
        return np.diff(edges)


def parse_log(path: Path) -> dict[tuple[int, int], RtlStep]:
    """(run tag, step) -> RtlStep."""
    steps: dict[tuple[int, int], RtlStep] = {}
    cur: RtlStep | None = None
    key = None
    layers = 1
    with open(path) as f:
        for line in f:
            t = line.split()
            if not t:
                continue
            kind = t[0]
            if kind == "P":
                cur = RtlStep([], [], [], 0, [], {}, [], [], 0, 0)
                key = (int(t[1]), int(t[2]))
            elif cur is None:
                continue
            elif kind == "B":
                cur.starts.append(int(t[1]))
                cur.pcs.append(int(t[2]))
                cur.remap.append(int(t[3]))
            elif kind == "S":
                pos = len(cur.pcs) - 1
                cur.slots.append((pos, int(t[1]), int(t[2]), int(t[3]), int(t[4]), int(t[5], 16),
                                  *(int(x) for x in t[6:11])))
            elif kind == "C":
                cur.cores[(len(cur.pcs) - 1, int(t[1]))] = (int(t[2]), int(t[3]))
            elif kind == "R":
                cur.latched.append((int(t[1]), int(t[2], 16)))
            elif kind == "X":
                cur.cache.append((int(t[1]), int(t[2]), int(t[3]), int(t[4])))
            elif kind == "E":
                cur.end, cur.stall, cur.err = int(t[1]), int(t[2]), int(t[3])
                steps[key] = cur
                cur = None
    del layers
    return steps


# ------------------------------------------------------------------------------------------------- comparison
@dataclasses.dataclass
class PolicyResult:
    policy: str
    rtl_cycles: list[int]
    sim_cycles: list[float]
    layer_rows: list[dict[str, Any]]  # per layer: sim and RTL cycles, per-core busy
    issued: int  # operations issued (RTL)
    remaps_rtl: int
    remaps_sim: int
    cache_reads: int
    cache_writes: int
    replayed_rows: int
    stall_cycles: int


@dataclasses.dataclass
class CosimReport:
    board: str
    batch: int
    steps: int
    stream: str
    policies: dict[str, PolicyResult]
    mismatches: list[str]
    rtl_seconds: float

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def speedup(self) -> tuple[float, float] | None:
        """DRS over static on (RTL, simulator), when both ran."""
        if {"static", "drs"} <= set(self.policies):
            s, d = self.policies["static"], self.policies["drs"]
            return sum(s.rtl_cycles) / sum(d.rtl_cycles), sum(s.sim_cycles) / sum(d.sim_cycles)
        return None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        sp = self.speedup()
        out["drs_speedup_rtl"], out["drs_speedup_sim"] = sp if sp else (None, None)
        return out


def _bundle_layers(program: Program, layers: int) -> np.ndarray:
    core = program.bundles[:, :-1]
    lay = np.where(core["layer"] == isa.NO_LAYER, layers, core["layer"].astype(np.int64))
    lay = np.where(core["opcode"] != isa.Op.NOP, lay, -1).max(axis=1)
    return np.where(lay < 0, layers, lay)


def _compare_step(sim, ev: dict, rtl: RtlStep, replay: np.ndarray, active: int, bl: np.ndarray, tag: str,
                  acc: dict) -> list[str]:
    """Mismatches of one step; accumulates per-layer figures into acc."""
    out: list[str] = []
    C = sim.C
    prog = sim.program.bundles
    t = ev["t"]
    want_pcs = [int(b) for b in np.flatnonzero(t > 0)]
    if rtl.err:
        out.append(f"{tag}: RTL error flags {rtl.err:#x}: " +
                   "; ".join(e for i, e in enumerate(ERR_BITS) if rtl.err >> i & 1))
    if rtl.stall:
        out.append(f"{tag}: the RTL dispatcher stalled {rtl.stall} cycles waiting for a fetch or a mapping")
    if rtl.pcs != want_pcs:
        extra = sorted(set(rtl.pcs) - set(want_pcs))[:5]
        missing = sorted(set(want_pcs) - set(rtl.pcs))[:5]
        out.append(f"{tag}: issued bundles differ ({len(rtl.pcs)} RTL, {len(want_pcs)} simulator; RTL only "
                   f"{extra}, simulator only {missing})")
        return out
    dur = rtl.durations()
    sim_t = t[want_pcs].astype(np.int64)
    if (t[want_pcs] != sim_t).any():
        out.append(f"{tag}: the simulator's bundle times are not whole cycles")
    bad = np.flatnonzero(dur != sim_t)
    for i in bad[:5]:
        out.append(f"{tag}: bundle {want_pcs[i]} takes {dur[i]} cycles in the RTL, {sim_t[i]} in the simulator")
    if len(bad) > 5:
        out.append(f"{tag}: ... {len(bad)} bundles differ in cycles")
    # issue order: (bundle, core, op, sub, layer, rows)
    mask = ev["mask"]
    want = [(b, c, int(prog[b, c]["opcode"]), int(prog[b, c]["sub"]), int(prog[b, c]["layer"]), int(mask[b, c]))
            for b in want_pcs for c in range(C) if mask[b, c]]
    got = [(rtl.pcs[s[0]], s[1], s[2], s[3], s[4], s[5]) for s in rtl.slots]
    if got != want:
        n = next((i for i, (a, w) in enumerate(zip(got, want, strict=False)) if a != w), min(len(got), len(want)))
        out.append(f"{tag}: issued operations differ at #{n} of {len(want)}: RTL "
                   f"{got[n] if n < len(got) else 'nothing'}, simulator {want[n] if n < len(want) else 'nothing'}")
        acc["order_mismatches"] += 1
    # per-slot figures and per-core cycles
    figs = {(rtl.pcs[s[0]], s[1]): s[6:] for s in rtl.slots}
    bad_slots = 0
    for b in want_pcs:
        for c in range(C):
            if not mask[b, c]:
                continue
            compute, dram, _w, macs, cls = figs.get((b, c), (None,) * 5)
            ref = (int(ev["compute"][b, c]), int(ev["dram_slot"][b, c]), int(ev["macs"][b, c]), int(sim.dram_class[b, c]))
            if (compute, dram, macs, cls) != ref:
                bad_slots += 1
                if bad_slots <= 3:
                    out.append(f"{tag}: bundle {b} core {c}: RTL compute/DRAM/MACs/class {(compute, dram, macs, cls)}, "
                               f"simulator {ref}")
    if bad_slots > 3:
        out.append(f"{tag}: ... {bad_slots} slots differ")
    for i, b in enumerate(want_pcs):
        for c in range(C):
            busy, own = rtl.cores.get((i, c), (0, 0))
            s_own = int(ev["own"][b, c])
            s_busy = int(min(ev["compute"][b, c], s_own))
            if (busy, own) != (s_busy, s_own):
                acc["core_mismatches"] += 1
                if acc["core_mismatches"] <= 3:
                    out.append(f"{tag}: bundle {b} core {c}: RTL busy/occupied {busy}/{own} cycles, simulator "
                               f"{s_busy}/{s_own}")
            lay = int(bl[b])
            acc["busy_rtl"][lay][c] += busy
            acc["busy_sim"][lay][c] += s_busy
        acc["cycles_rtl"][int(bl[b])] += int(dur[i])
        acc["cycles_sim"][int(bl[b])] += int(sim_t[i])
    out += _compare_traffic(sim, ev, rtl, replay, active, want_pcs, tag, acc)
    acc["issued"] += len(rtl.slots)
    acc["stall"] += rtl.stall
    if rtl.cycles != int(t.sum()):
        out.append(f"{tag}: step takes {rtl.cycles} cycles in the RTL, {t.sum():.0f} in the simulator")
    return out


def _compare_traffic(sim, ev: dict, rtl: RtlStep, replay: np.ndarray, active: int, want_pcs: list[int], tag: str,
                     acc: dict) -> list[str]:
    """_compare_step's traffic part: the weight stream, the remaps, the rows each layer replayed and the MLP-cache
    reads and writes; mismatches, and the figures accumulated into acc."""
    out: list[str] = []
    C, prog, mask = sim.C, sim.program.bundles, ev["mask"]
    # weight stream of each bundle (broadcast: the largest tile once; per core: each), as the simulator counts it
    w = defaultdict(list)
    for s in rtl.slots:
        w[rtl.pcs[s[0]]].append(s[8])
    per_core = acc["stream"] == "per_core"
    got_w = np.asarray([(sum(w[b]) if per_core else max(w[b], default=0)) for b in want_pcs], np.float64)
    bad = np.flatnonzero(got_w != ev["wbytes"][want_pcs])
    if bad.size:
        b = want_pcs[int(bad[0])]
        out.append(f"{tag}: weight stream of bundle {b}: {int(got_w[bad[0]])} bytes in the RTL, "
                   f"{int(ev['wbytes'][b])} in the simulator ({bad.size} bundles differ)")
    acc["weights"] += float(got_w.sum())
    # remaps
    remaps = int(sum(rtl.remap))
    if remaps != ev["remaps"]:
        out.append(f"{tag}: {remaps} remaps in the RTL, {ev['remaps']} in the simulator")
    acc["remaps_rtl"] += remaps
    acc["remaps_sim"] += int(ev["remaps"])
    # replayed rows: the Index Register each layer latched against the trace
    for layer, idx in rtl.latched:
        if layer < replay.shape[0] and layer in sim.replayable_layers:
            want_rep = sum(1 << r for r in range(replay.shape[1]) if replay[layer, r])
            got_rep = ~idx & active
            acc["replayed"] += bin(got_rep).count("1")
            if got_rep != want_rep:
                out.append(f"{tag}: layer {layer} replays rows {got_rep:#x} in the RTL, {want_rep:#x} in the trace")
    # MLP-cache traffic: per XCHG slot, reads are its replayed rows, reads + writes its DRAM bytes
    reads = sum(x[3] for x in rtl.cache if x[1])
    writes = sum(x[3] for x in rtl.cache if not x[1])
    xchg = [(b, c) for b in want_pcs for c in range(C) if mask[b, c] and prog[b, c]["opcode"] == isa.Op.XCHG]
    want_total = sum(int(ev["dram_slot"][b, c]) for b, c in xchg)
    want_reads = 0
    for b, c in xchg:
        lay = int(prog[b, c]["layer"])
        rows = int(mask[b, c])
        rep = [r for r in range(replay.shape[1]) if rows >> r & 1 and lay < replay.shape[0] and replay[lay, r]
               and lay in sim.replayable_layers]
        want_reads += len(rep) * int(prog[b, c]["m"]) * sim.board.dtype_bytes
    if (reads, reads + writes) != (want_reads, want_total):
        out.append(f"{tag}: MLP-cache reads/total {reads}/{reads + writes} bytes in the RTL, {want_reads}/{want_total} "
                   "from the trace and the simulator")
    acc["reads"] += reads
    acc["writes"] += writes
    return out


def cosimulate(program: Program, replay: np.ndarray, context: np.ndarray | int, *, policies=("static", "drs"),
               stream: str = "broadcast", batch: int | None = None, kv_len: np.ndarray | None = None,
               board: BoardConfig | None = None, seed: int = 0, tas: tuple[np.ndarray, np.ndarray] | None = None,
               log=print) -> CosimReport:
    """Run ``replay`` (steps, layers, >= batch) through the RTL and the simulator under each policy; compare.

    tas: the TAS datapath's (scores float32, valid bool), each (steps, layers, MAX_ROWS), instead of scores made
    up to match ``replay`` (``tas_scores``); the RTL's decisions are then checked against ``replay`` as given."""
    from ..simulate import Simulator

    sim = Simulator(program, board)
    bd = sim.board
    problems = preconditions(program)
    if problems:
        raise FastCarError("the RTL cannot run this program: " + "; ".join(problems[:3]))
    batch = sim.batch if batch is None else int(batch)
    replay = np.asarray(replay, bool)[:, :, :batch]
    steps, layers = replay.shape[0], sim.num_layers
    ctxs = np.broadcast_to(np.asarray(context, np.int64), (steps,))
    kv = np.repeat(ctxs[:, None], layers, axis=1) if kv_len is None else np.asarray(kv_len, np.int64)
    if kv.max() >= 2**32:
        raise FastCarError("context beyond the ISA's 32-bit length")
    active = (1 << batch) - 1
    rng = np.random.default_rng(seed)
    scores, valid = tas_scores(program, replay, rng) if tas is None else (np.asarray(tas[0], np.float32),
                                                                         np.asarray(tas[1], bool))
    valid_words = (valid.astype(np.uint64) << np.arange(isa.MAX_ROWS, dtype=np.uint64)).sum(axis=2)
    refs: dict[str, list[dict]] = {}
    runs = []
    for pol in policies:
        refs[pol] = [sim.step(replay[s], kv[s], policy=pol, stream=stream, batch=batch) for s in range(steps)]
        runs.append({"policy": pol, "stream": stream,
                     "budgets": [int(2 * ev["t"].sum() + 10 * len(program) + 100_000) for ev in refs[pol]]})
    data = encode.encode(program)
    wbits = program.meta["model"].get("weight_bits") or 8 * bd.dtype_bytes
    if not 1 <= wbits <= 255:
        raise FastCarError(f"weight_bits {wbits} is beyond the RTL's 8-bit register")
    job = {"active": active, "binding": [int(m) for m in sim.binding], "layers": layers, "wbits": int(wbits)}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fcar-rtl-") as tmp:
        out, logp = run_bench(bd, [data], runs=runs, job=job, kvlen=kv.astype(np.uint32),
                              scores=scores.view(np.uint32), valid=valid_words, workdir=Path(tmp), log=log)
        if out["loads"][0][0] != 0:
            raise FastCarError(f"the RTL loader refused the program (refusal {out['loads'][0]})")
        rtl = parse_log(logp)
    secs = time.perf_counter() - t0
    bl = _bundle_layers(program, layers)
    mismatches: list[str] = []
    results = {}
    for tag, pol in enumerate(policies):
        acc: dict[str, Any] = {"busy_rtl": defaultdict(lambda: [0] * sim.C), "busy_sim": defaultdict(lambda: [0] * sim.C),
                               "cycles_rtl": defaultdict(int), "cycles_sim": defaultdict(int), "remaps_rtl": 0,
                               "remaps_sim": 0, "reads": 0, "writes": 0, "replayed": 0, "issued": 0, "stall": 0,
                               "order_mismatches": 0, "core_mismatches": 0,
                               "stream": stream, "weights": 0.0}
        rc, sc = [], []
        for s in range(steps):
            got = rtl.get((tag, s * layers))
            if got is None:
                mismatches.append(f"{pol} step {s}: the RTL did not finish the step")
                continue
            ev = refs[pol][s]
            mismatches += _compare_step(sim, ev, got, replay[s], active, bl, f"{pol} step {s}", acc)
            rc.append(got.cycles)
            sc.append(float(ev["t"].sum()))
        rows = [{"layer": "head" if lay == layers else lay, "sim_cycles": acc["cycles_sim"][lay],
                 "rtl_cycles": acc["cycles_rtl"][lay], "sim_busy": acc["busy_sim"][lay], "rtl_busy": acc["busy_rtl"][lay]}
                for lay in sorted(set(acc["cycles_sim"]) | set(acc["cycles_rtl"]))]
        results[pol] = PolicyResult(pol, rc, sc, rows, acc["issued"], acc["remaps_rtl"], acc["remaps_sim"],
                                    acc["reads"], acc["writes"], acc["replayed"], acc["stall"])
    return CosimReport(bd.name, batch, steps, stream, results, mismatches, secs)
