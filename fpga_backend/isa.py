"""The FastCar accelerator ISA: every opcode, field, flag and constant is defined here once.

Instruction: 32 bytes, little-endian, fixed width (``INSTR_DTYPE`` is the layout; encoder, decoder, assembler,
disassembler and simulator all read it from here).

======  =======  ==========================================================================================
offset  type     field
======  =======  ==========================================================================================
0       u8       opcode (``Op``)
1       u8       flags (``Flag``; bits 4-7 reserved, must be 0)
2       u8       sub: memory space (``Space``) for LOAD/STORE/GEMM/XCHG, function (``Vec``) for VEC
3       u8       dst: activation buffer written
4       u8       src: activation buffer read
5       u8       reserved, must be 0
6       u16      layer (``NO_LAYER`` outside the decoder layers: final norm, LM head)
8       u16      tensor: weight id (GEMM/RMSNORM), second source buffer (ADD, SILU_MUL)
10      u16      n: columns per row (query heads per KV head for attention, heads for ROPE/SOFTMAX/RMSNORM, else 1)
12      u32      m: output extent (GEMM rows of W^T / context for attention; elements for VEC/LOAD/STORE)
16      u32      k: reduction extent (GEMM), frame tokens L (TAS)
20      u32      off_m: offset of the tile along m; TAS: threshold tau as float32 bits
24      u32      off_k: offset of the tile along k (> 0 accumulates); TAS: video_start
28      u32      arg: row mask (bit r = batch row r) for core slots; Index Register value for DRS_SET;
                 for DRS_DISPATCH the bundles of the layer's replayable phase, its own included (``drs.skip_span``)
======  =======  ==========================================================================================

DRS_SET and DRS_DISPATCH carry the layer's remap thresholds (``drs.py``): one byte per compute-row count
n = 1..32, four per field in m, k, off_m, off_k.

A bundle is ``cores`` core slots followed by one control slot. Core slots hold LOAD/STORE/GEMM/VEC/TAS/XCHG;
the control slot holds DRS_SET/DRS_DISPATCH/BARRIER/FINISH. NOP fills empty slots.

Replay: an instruction flagged ``SKIP_ON_REPLAY`` belongs to a row's replayable MLP. At run time the
dispatcher drops replayed rows from its row mask (static scheduler) or re-targets the compute rows to cores
through the Mapping Registers (DRS); an instruction whose mask becomes empty is dropped. ``XCHG`` on the
replay cache reads the cached MLP output for replayed rows and writes the fresh one for computed rows, so
its traffic is the same for every mask.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

MAX_ROWS = 32  # Index Register width: one bit per batch row
INSTR_BYTES = 32
NO_LAYER = 0xFFFF
ALL_ROWS = 0xFFFFFFFF

INSTR_DTYPE = np.dtype(
    [
        ("opcode", "<u1"),
        ("flags", "<u1"),
        ("sub", "<u1"),
        ("dst", "<u1"),
        ("src", "<u1"),
        ("reserved", "<u1"),
        ("layer", "<u2"),
        ("tensor", "<u2"),
        ("n", "<u2"),
        ("m", "<u4"),
        ("k", "<u4"),
        ("off_m", "<u4"),
        ("off_k", "<u4"),
        ("arg", "<u4"),
    ]
)
assert INSTR_DTYPE.itemsize == INSTR_BYTES

FIELDS: tuple[str, ...] = tuple(INSTR_DTYPE.names or ())
MAX_CONTEXT = int(np.iinfo(INSTR_DTYPE["m"]).max)  # KV length of the attention instructions (u32 m field)
MAX_FRAME_TOKENS = int(np.iinfo(INSTR_DTYPE["k"]).max)  # L in the TAS / XCHG instructions' k field
MAX_VIDEO_START = int(np.iinfo(INSTR_DTYPE["off_k"]).max)  # video_start in their off_k field
MAX_LAYERS = NO_LAYER - 1  # the layer field is u16 and NO_LAYER means "no layer"
# Weight stream modes of the bundle metadata's drs_weights (one broadcast stream, or one per core).
WEIGHT_STREAMS = ("broadcast", "per_core")
# Fields an assembler line may set (reserved is never written by the tools).
TEXT_FIELDS: tuple[str, ...] = tuple(f for f in FIELDS if f not in ("opcode", "flags", "sub", "reserved"))


class Op(enum.IntEnum):
    NOP = 0
    LOAD = 1  # DRAM -> SRAM, m elements per row of the mask (space in sub)
    STORE = 2  # SRAM -> DRAM, m elements per row (KV append, activations)
    GEMM = 3  # dst[r, off_m:+m] (+)= src[r, off_k:+k] @ W[off_k:+k, off_m:+m]; W streamed (WEIGHT) or KV
    VEC = 4  # vector / special-function op (function in sub)
    TAS = 5  # temporal attention score + threshold compare -> Index Register bit per row
    XCHG = 6  # replay cache exchange (see module doc)
    DRS_SET = 7  # control: latch the Index Register (arg; FROM_TAS = take it from the TAS unit); thr[1..16]
    DRS_DISPATCH = 8  # control: remap compute rows to cores via Mapping Registers when it pays; thr[17..32];
    # when no row computes, the dispatcher jumps over the arg bundles of the replayable phase
    BARRIER = 9  # control: all cores finish before the next bundle issues
    FINISH = 10  # control: end of program


CORE_OPS = frozenset({Op.NOP, Op.LOAD, Op.STORE, Op.GEMM, Op.VEC, Op.TAS, Op.XCHG})
CONTROL_OPS = frozenset({Op.NOP, Op.DRS_SET, Op.DRS_DISPATCH, Op.BARRIER, Op.FINISH})


class Space(enum.IntEnum):
    WEIGHT = 0
    ACT = 1
    KV_K = 2
    KV_V = 3
    REPLAY = 4


class Vec(enum.IntEnum):
    RMSNORM = 0  # dst = src / rms(src) * W[tensor], over n groups of m / n (n <= 1: one group; per-head q/k norm)
    ROPE = 1  # rotary embedding at the current position, n heads of m / n
    SOFTMAX = 2  # over the context, n heads (SFU)
    SILU_MUL = 3  # dst = silu(src) * buf[tensor] (SFU)
    ADD = 4  # dst = src + buf[tensor]


class Flag(enum.IntFlag):
    SKIP_ON_REPLAY = 1  # part of the replayable MLP: dropped for replayed rows
    CTX = 2  # m is the run-time context length (attention); the encoded m is the compile-time one
    FROM_TAS = 4  # DRS_SET: Index Register comes from the TAS unit at run time
    SPILL = 8  # GEMM tile whose rows' activations overflow the act buffer: input/output slices via DRAM


FLAG_MASK = int(Flag.SKIP_ON_REPLAY | Flag.CTX | Flag.FROM_TAS | Flag.SPILL)

# Which `sub` values are legal per opcode (others must have sub == 0).
SUB_ENUM: dict[Op, type[enum.IntEnum]] = {
    Op.LOAD: Space,
    Op.STORE: Space,
    Op.GEMM: Space,
    Op.XCHG: Space,
    Op.VEC: Vec,
}
VALID_SUB: dict[int, frozenset[int]] = {
    int(op): frozenset(int(v) for v in SUB_ENUM[op]) if op in SUB_ENUM else frozenset({0}) for op in Op
}


class Fault(enum.IntEnum):
    """Why the decoder refuses one instruction, checked in this order; of a stream's faulty instructions the
    first in stream order (bundle by bundle, slot by slot) is the one reported, as a streaming decoder (the
    RTL's ``fcar_decode``) meets them."""

    NONE = 0
    OPCODE = 1  # unknown opcode
    CONTROL_IN_CORE = 2  # a control opcode in a core slot
    CORE_IN_CONTROL = 3  # a core opcode in the control slot
    FLAGS = 4  # reserved flag bits set
    RESERVED = 5  # the reserved byte is not 0
    SUB = 6  # sub-function unknown for the opcode


FAULT_TEXT = {
    Fault.OPCODE: "unknown opcode in",
    Fault.CONTROL_IN_CORE: "control opcode in a core slot:",
    Fault.CORE_IN_CONTROL: "core opcode in the control slot:",
    Fault.FLAGS: "reserved flag bits set in",
    Fault.RESERVED: "reserved byte set in",
    Fault.SUB: "unknown sub-function for its opcode in",
}


def instruction_faults(bundles: np.ndarray) -> np.ndarray:
    """The ``Fault`` of every instruction of a (bundles, slots) array (uint8, 0 where it decodes)."""
    op, sub = bundles["opcode"], bundles["sub"]
    ctl = np.zeros(op.shape, bool)
    ctl[..., -1] = True
    fault = np.zeros(op.shape, np.uint8)
    sub_ok = np.zeros(op.shape, bool)
    for code, allowed in VALID_SUB.items():
        sel = op == code
        sub_ok[sel] = np.isin(sub[sel], list(allowed))
    checks = [  # later checks first: the earliest failing check of an instruction overwrites them
        (Fault.SUB, ~sub_ok),
        (Fault.RESERVED, bundles["reserved"] != 0),
        (Fault.FLAGS, (bundles["flags"] & ~np.uint8(FLAG_MASK)) != 0),
        (Fault.CORE_IN_CONTROL, ctl & ~np.isin(op, [int(o) for o in CONTROL_OPS])),
        (Fault.CONTROL_IN_CORE, ~ctl & ~np.isin(op, [int(o) for o in CORE_OPS])),
        (Fault.OPCODE, ~np.isin(op, [int(o) for o in Op])),
    ]
    for code, bad in checks:
        fault[bad] = int(code)
    return fault


# Activation buffer ids used by the compiler (the functional simulator keys its buffers by these).
BUF_NAMES = (
    "x", "xn", "q", "k", "v", "scores", "attn", "o", "gate", "up", "h", "mlp", "merged", "logits",
)
BUF = {name: i for i, name in enumerate(BUF_NAMES)}


@dataclasses.dataclass(frozen=True)
class Instr:
    """One instruction in Python form (the bulk path works on ``INSTR_DTYPE`` arrays instead)."""

    opcode: int = Op.NOP
    flags: int = 0
    sub: int = 0
    dst: int = 0
    src: int = 0
    reserved: int = 0
    layer: int = 0
    tensor: int = 0
    n: int = 0
    m: int = 0
    k: int = 0
    off_m: int = 0
    off_k: int = 0
    arg: int = 0

    def to_record(self) -> np.ndarray:
        rec = np.zeros((), dtype=INSTR_DTYPE)
        for f in FIELDS:
            rec[f] = getattr(self, f)
        return rec

    @classmethod
    def from_record(cls, rec: np.void | np.ndarray) -> Instr:
        return cls(**{f: int(rec[f]) for f in FIELDS})


def field_limits() -> dict[str, int]:
    """Largest value each field can hold."""
    return {f: int(np.iinfo(INSTR_DTYPE[f]).max) for f in FIELDS}


def popcount32(a: np.ndarray) -> np.ndarray:
    """Number of set bits of each uint32 (row counts of row masks)."""
    a = a.astype(np.uint32)
    a = a - ((a >> 1) & 0x55555555)
    a = (a & 0x33333333) + ((a >> 2) & 0x33333333)
    a = (a + (a >> 4)) & 0x0F0F0F0F
    return ((a * 0x01010101) & 0xFFFFFFFF) >> 24


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for the tiling and row-binding arithmetic (0 when b is 0)."""
    return -(-a // b) if b else 0


def ceil_div_array(a: np.ndarray | int, b: int) -> np.ndarray:
    """Element-wise ceil(a / b) in int64 (array passes per row in the cost model)."""
    return -(-np.asarray(a, dtype=np.int64) // b)


def tau_bits(tau: float) -> int:
    """The TAS instruction's off_m: tau as float32 bits."""
    return int(np.array([tau], np.float32).view(np.uint32)[0])


def tau_from_bits(bits: int) -> float:
    return float(np.array([int(bits)], np.uint32).view(np.float32)[0])
