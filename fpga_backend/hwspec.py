"""Board descriptions for the FastCar FPGA accelerator model.

A board is a frozen :class:`BoardConfig`. The presets are the JSON files in ``fpga_backend/boards/`` (the one
place for every hardware figure; their ``_doc`` says where the figures come from, docs/semantics.md section 2). Where
the paper gives no number (core count, array shape, clock, latencies, energy) the figure is our assumption,
named in ``ASSUMPTIONS``. Every field can be overridden from a JSON file (``load_board``).

Two hashes: ``config_hash`` covers every field; ``structural_hash`` covers only the fields the encoded program
depends on (cores, array, buffers, dtype). Bundle files carry the structural hash, so a program can be
re-simulated with other timing/energy figures (clock, bandwidth, efficiency, latency) but never on a board
whose cores or buffers differ from the one it was tiled for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.fileio import read_json

from .isa import MAX_ROWS

KIB = 1024
MAX_FIGURE = 2**31 - 1  # largest value any board figure may take


@dataclasses.dataclass(frozen=True)
class BoardConfig:
    """Hardware figures of one board; units are in the field names."""

    name: str
    cores: int  # matrix cores (one bundle slot each)
    array_rows: int  # MAC array per core: reduction lanes
    array_cols: int  # MAC array per core: output lanes
    clock_mhz: float
    dram_gbps: float  # peak DRAM/HBM bandwidth, GB/s (1e9 bytes)
    dram_efficiency: float  # achieved / peak for mixed traffic: KV, activations, spills, cache writes (0.6-0.9)
    dram_stream_efficiency: float  # achieved / peak for the weight stream: long sequential read bursts
    weight_buffer_kib: int  # per core; half of it is one weight tile (double buffering)
    act_buffer_kib: int  # per core
    kv_buffer_kib: int  # per core
    sram_bytes_per_cycle: int  # per core on-chip buffer bandwidth (array reads rows*cols weights a cycle)
    vector_lanes: int  # per core vector unit (norm, add, act), elements per cycle
    sfu_lanes: int  # per core special-function unit (exp in softmax, silu), elements per cycle
    issue_latency: int  # fixed cycles per bundle (issue + DMA setup), docs/semantics.md: ~100-150
    drs_overhead: int  # cycles for one DRS remap (Index -> Mapping Registers -> dispatch)
    dtype_bytes: int  # weights, activations, KV
    pj_per_mac: float
    pj_per_dram_byte: float
    pj_per_sram_byte: float
    static_watts: float
    double_buffering: bool = True

    # ---- derived figures -------------------------------------------------------------------------
    @property
    def macs_per_cycle_core(self) -> int:
        return self.array_rows * self.array_cols

    @property
    def macs_per_cycle(self) -> int:
        return self.cores * self.macs_per_cycle_core

    @property
    def dram_bytes_per_cycle(self) -> float:
        """Effective DRAM bytes per accelerator clock for mixed traffic (KV, activations, cache, spills)."""
        return self.dram_gbps * 1e9 * self.dram_efficiency / (self.clock_mhz * 1e6)

    @property
    def dram_stream_bytes_per_cycle(self) -> float:
        """Effective DRAM bytes per accelerator clock for the weight stream (long sequential reads)."""
        return self.dram_gbps * 1e9 * self.dram_stream_efficiency / (self.clock_mhz * 1e6)

    def _cycles_per_byte(self, efficiency: float) -> Fraction:
        return Fraction(repr(float(self.clock_mhz))) / (
            Fraction(repr(float(self.dram_gbps))) * Fraction(repr(float(efficiency))) * 1000)

    @property
    def dram_terms(self) -> tuple[int, int, int]:
        """(weight multiplier, other multiplier, divisor): a bundle moving W weight-stream bytes and B other bytes
        holds DRAM for ceil((W * first + B * second) / divisor) whole cycles, exactly the sum of both at their
        rates (19.2 GB/s at 300 MHz: x 0.9 streams 57.6 B a cycle, x 0.75 the rest 48). One definition for the
        simulator (costmodel.py) and the RTL's package (rtl/pkg.py)."""
        w, o = self._cycles_per_byte(self.dram_stream_efficiency), self._cycles_per_byte(self.dram_efficiency)
        div = math.lcm(w.denominator, o.denominator)
        return int(w * div), int(o * div), div

    @property
    def weight_tile_bytes(self) -> int:
        return self.weight_buffer_kib * KIB // (2 if self.double_buffering else 1)

    @property
    def kv_tile_bytes(self) -> int:
        return self.kv_buffer_kib * KIB // (2 if self.double_buffering else 1)

    # ---- hashing -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def config_hash(self) -> int:
        """64-bit hash of every field (stable across runs and Python versions)."""
        return _hash64(self.to_dict())

    def structural_hash(self) -> int:
        """64-bit hash of the fields an encoded program depends on."""
        return _hash64({k: getattr(self, k) for k in STRUCTURAL_FIELDS})

    def replace(self, **changes: Any) -> BoardConfig:
        return _validated(dataclasses.replace(self, **changes))


STRUCTURAL_FIELDS = (
    "cores",
    "array_rows",
    "array_cols",
    "weight_buffer_kib",
    "act_buffer_kib",
    "kv_buffer_kib",
    "dtype_bytes",
    "double_buffering",
)


def _hash64(obj: dict[str, Any]) -> int:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


# The fields a board description must give (the rest have defaults).
REQUIRED = frozenset(f.name for f in dataclasses.fields(BoardConfig) if f.default is dataclasses.MISSING)
BOARDS_DIR = Path(__file__).with_name("boards")


def _board_from_json(data: dict[str, Any], where: str) -> BoardConfig:
    """A full board from a JSON object; keys starting with "_" are comments."""
    names = {f.name for f in dataclasses.fields(BoardConfig)}
    fields = {k: v for k, v in data.items() if not k.startswith("_")}
    unknown, missing = sorted(set(fields) - names), sorted(REQUIRED - set(fields))
    if unknown or missing:
        raise FastCarError(f"{where}: unknown fields {unknown}, missing fields {missing}")
    return BoardConfig(**fields)


def _load_presets() -> dict[str, BoardConfig]:
    """The shipped presets: one JSON file per board in fpga_backend/boards/ (the single source of figures)."""
    out = {}
    for path in sorted(BOARDS_DIR.glob("*.json")):
        out[path.stem] = _board_from_json(json.loads(path.read_text()), str(path))
    return out


PRESETS: dict[str, BoardConfig] = _load_presets()


# Stated assumptions behind the presets (printed by reports next to energy figures). The per-board figures are
# read from the presets, so a new board file is described here without an edit.
ASSUMPTIONS = {
    "mac": "one 16-bit MAC per DSP slice per cycle; arrays use ~80-95% of the DSPs",
    "energy_mac": "~1 pJ per 16-bit MAC in a 16 nm UltraScale+ DSP48E2 (incl. local routing)",
    "energy_dram": "DDR4 ~20 pJ/bit (160 pJ/B incl. PHY); HBM2 ~7 pJ/bit (56 pJ/B)",
    "energy_sram": "BRAM/URAM ~0.6 pJ/B per access",
    "static_power": "board static power (FPGA + memory idle): "
                    + ", ".join(f"{b.name} ~{b.static_watts:g} W" for b in PRESETS.values()),
    "clock": ", ".join(f"{b.name} {b.clock_mhz:g} MHz" for b in PRESETS.values())
             + " (docs/semantics.md: ~225-300 MHz)",
    "dram": "DRAM efficiency per traffic class: the weight stream (long sequential read bursts) at "
            + ", ".join(f"{b.name} {b.dram_stream_efficiency:g}" for b in PRESETS.values())
            + "; mixed traffic (KV, activations, replay cache, spills; reads and writes) at "
            + ", ".join(f"{b.name} {b.dram_efficiency:g}" for b in PRESETS.values())
            + ". DDR4 streams: a Xilinx PS DDR controller measures 97% on sequential reads, 79-87% on mixed "
              "reads and writes (UG585 'DDR Efficiency'); 0.9 leaves DDR4's refresh (tRFC 350 ns of every "
              "7.8 us, 4.5%) on top. HBM presets keep one figure for both (no measured stream figure)",
    "drs": "DRS remap cost: docs/semantics.md 'hundreds to thousands of cycles'",
}


# Figures that count things or cycles: whole numbers, so every bundle takes a whole number of cycles.
INTEGER_FIELDS = ("cores", "array_rows", "array_cols", "weight_buffer_kib", "act_buffer_kib", "kv_buffer_kib",
                  "dtype_bytes", "issue_latency", "drs_overhead", "sram_bytes_per_cycle", "vector_lanes", "sfu_lanes")


def _validated(cfg: BoardConfig) -> BoardConfig:
    problems = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.name in ("name", "double_buffering"):
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            problems.append(f"{f.name}={v!r} must be a positive number")
        elif v > MAX_FIGURE:  # beyond this the cycle arithmetic overflows or divides by ~0
            problems.append(f"{f.name}={v!r} is beyond {MAX_FIGURE}")
    if not isinstance(cfg.name, str) or not isinstance(cfg.double_buffering, bool):
        problems.append("name must be a string and double_buffering true/false")
    if not problems:
        if cfg.cores > MAX_ROWS:
            problems.append(f"cores must be <= {MAX_ROWS} (Mapping Registers address at most {MAX_ROWS} rows)")
        for name in ("dram_efficiency", "dram_stream_efficiency"):
            if not 0 < getattr(cfg, name) <= 1:
                problems.append(f"{name} must be in (0, 1]")
        for f in INTEGER_FIELDS:
            if int(getattr(cfg, f)) != getattr(cfg, f):
                problems.append(f"{f} must be an integer")
        if cfg.weight_tile_bytes < cfg.array_rows * cfg.array_cols * cfg.dtype_bytes:
            problems.append("weight_buffer_kib too small to hold one array-sized tile")
    if problems:
        raise FastCarError(f"board {str(cfg.name)[:40]!r}: " + "; ".join(problems))
    # whole numbers written as 4.0 in a JSON file become ints: they size arrays and pack into the header
    return dataclasses.replace(cfg, **{f: int(getattr(cfg, f)) for f in INTEGER_FIELDS})


def load_board(board: str | BoardConfig = "kv260", board_file: str | Path | None = None) -> BoardConfig:
    """A preset by name, optionally with fields overridden from a JSON file.

    The JSON file is an object of BoardConfig fields; it may name a preset in ``"base"`` (default: ``board``).
    """
    if isinstance(board, BoardConfig):
        cfg = board
    else:
        key = str(board).lower()
        if key not in PRESETS and board_file is None:
            raise FastCarError(f"unknown board {board!r}; choose one of {sorted(PRESETS)} or pass --board-file")
        cfg = PRESETS.get(key, PRESETS["kv260"])
    if board_file is None:
        return _validated(cfg)
    path = Path(board_file)
    data = read_json(path, "board file", kind=None)
    if not isinstance(data, dict):
        raise FastCarError(f"board file {path} must hold a JSON object of board fields")
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    base = data.pop("base", None)
    names = {f.name: f for f in dataclasses.fields(BoardConfig)}
    if base is not None:
        if base not in PRESETS:
            raise FastCarError(f"board file {path}: unknown base {base!r}; choose one of {sorted(PRESETS)}")
        cfg = PRESETS[base]
    elif not isinstance(board, BoardConfig) and str(board).lower() not in PRESETS:
        # a custom board: no preset to fill gaps from, so every figure must be given
        missing = sorted(REQUIRED - set(data) - {"name"})
        if missing:
            raise FastCarError(f"board file {path} describes a custom board {board!r} but lacks {missing}; give "
                               f"every field, or \"base\": one of {sorted(PRESETS)} to start from a preset")
        data.setdefault("name", str(board))
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise FastCarError(f"board file {path}: unknown fields {unknown}; known: {sorted(names)}")
    changes: dict[str, Any] = {}
    for key, value in data.items():
        current = getattr(cfg, key)
        if isinstance(current, bool):
            if not isinstance(value, bool):
                raise FastCarError(f"board file {path}: {key} must be true/false")
        elif isinstance(current, int) and not isinstance(current, bool):
            if not isinstance(value, int) or isinstance(value, bool):
                raise FastCarError(f"board file {path}: {key} must be an integer")
        elif isinstance(current, float):
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise FastCarError(f"board file {path}: {key} must be a number")
            value = float(value)
        elif not isinstance(value, str):
            raise FastCarError(f"board file {path}: {key} must be a string")
        changes[key] = value
    if "name" not in changes:
        changes["name"] = f"{cfg.name}+{path.stem}"
    return cfg.replace(**changes)


def board_from_dict(data: dict[str, Any]) -> BoardConfig:
    """Rebuild a board stored in a bundle file's metadata."""
    names = {f.name for f in dataclasses.fields(BoardConfig)}
    missing = sorted(REQUIRED - set(data))
    if missing:
        raise FastCarError(f"bundle file holds an incomplete board description (no {', '.join(missing)}); "
                           "recompile it with this fastcar-compile")
    return _validated(BoardConfig(**{k: v for k, v in data.items() if k in names}))
