"""Bounds on user-supplied numbers, each checked against what the model, ONNX Runtime and the ISA can hold.

Defined once here so the compiler, the FPGA backend and the CLI say the same limit in the same words.
"""

from __future__ import annotations

import numbers
import os

import numpy as np

from fastcar_compile.core.errors import FastCarError

INT64_MAX = 2**63 - 1
UINT32_MAX = 2**32 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
# L is a Slice/Gather offset and a slot count: ORT shape arithmetic is int64, the FPGA TAS field (k) is u32.
MAX_FRAME_TOKENS = UINT32_MAX
MAX_REPLAY = 2**31 - 1  # the age counters are stored as float32/int32: beyond this K is "unlimited" anyway
DEFAULT_ROTARY_POSITIONS = 16384  # --rotary-positions default: 64 frames of 256 tokens
MAX_ROTARY_POSITIONS = 1 << 20  # the packed attention's cos/sin table: 1M x 32 x 2 float32 = 256 MiB at head size 64
# KV slots per layer and KV head (--kv-budget): 1M tokens = 4096 frames of 256 tokens; the state a model needs at
# its sizes is checked against this machine's memory when the compressed cache is built (check_state_bytes)
MAX_KV_BUDGET = 1 << 20
MAX_KV_DIAGNOSTICS = 1 << 20  # tokens of --kv-diagnostics' dense side buffer
# ONNX Runtime threads of one session: ORT starts them all when the session opens (10**6 hung there); more than
# this is oversubscription on any machine this runs on. 0 = ORT's default (one per core).
MAX_THREADS = 1024
# The bounds of every bucketing, one set for every reader (the DiT modes' options: AnnSA, AnnCA, TempCache's ANN
# match; the decoders' --sparse-attention / --kv-layer sparse=; fastar.KVCompressConfig): sign bits per LSH table
# (a DiT's bucket bitmaps hold 2^bits ids per table, its bucket keys group x 2^16; the kernel's float-coded ids
# 2^24), int8 directions per table (each one's 8-bit code split into 8 / dirs bits: fastar/int8.py), tables
MAX_LSH_BITS = 16
INT8_DIRS = (1, 2, 4, 8)
MAX_ANN_TABLES = 64


def check_int(flag: str, value, lo: int, hi: int, meaning: str = "") -> int:
    """An integer (not bool, not float) in [lo, hi]; otherwise one clear FastCarError naming the flag."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise FastCarError(f"{flag} must be an integer{f' ({meaning})' if meaning else ''}, got {value!r}")
    value = int(value)
    if not lo <= value <= hi:
        raise FastCarError(f"{flag} must be in {lo}..{hi}{f' ({meaning})' if meaning else ''}, got {value}")
    return value


def check_finite(flag: str, value, meaning: str = "") -> float:
    """A real number (not bool), neither NaN nor infinite; otherwise one clear FastCarError naming the flag."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FastCarError(f"{flag} must be a number{f' ({meaning})' if meaning else ''}, got {value!r}")
    value = float(value)
    if not np.isfinite(value):
        raise FastCarError(f"{flag} must be a finite number{f' ({meaning})' if meaning else ''}, got {value}")
    return value


def memory_bytes() -> int:
    """Physical memory of this machine (what ONNX Runtime can allocate at most)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 40


def available_memory_bytes() -> int:
    """Memory a new allocation can get now (Linux MemAvailable; the physical size elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return memory_bytes()


def check_fits_memory(what: str, need: int, fix: str) -> None:
    """Refuse, before allocating, `need` bytes that this machine cannot provide now (a later MemoryError, or
    the kernel's OOM killer, would say neither which value nor which limit)."""
    have = available_memory_bytes()
    if need > have:
        raise FastCarError(f"{what} needs {need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB of memory "
                           f"available here; {fix}")


def check_state_bytes(flag: str, value: int, need: int, what: str) -> None:
    """State of one video (`need` bytes, set by `flag` = value) must fit in this machine's memory: refused at
    compile time rather than as a MemoryError when the runtime allocates it."""
    have = memory_bytes()
    if need > have:
        raise FastCarError(f"{flag} {value}: the state of one video would need {need / 2**30:.1f} GiB ({what}), more "
                           f"than this machine's {have / 2**30:.1f} GiB; lower {flag}")


def check_state_size(frame_tokens: int, hidden: int, layers: int, itemsize: int = 4) -> None:
    """The MLP cache of one video ([L, hidden] per rewritten layer) must fit in this machine's memory."""
    need = frame_tokens * hidden * itemsize * max(1, layers)
    have = memory_bytes()
    if need > have:
        raise FastCarError(f"--frame-tokens {frame_tokens}: the FastCar state of one video would need "
                           f"{need / 2**30:.1f} GiB ({layers} layers x L x hidden {hidden} x {itemsize} B), more than "
                           f"this machine's {have / 2**30:.1f} GiB; use the real tokens per frame")
