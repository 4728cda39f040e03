"""Semantic checks of a bundle program: what `asm` refuses to write and `sim` refuses to run.

`encode.decode` checks the container (magic, CRC, sizes, opcodes, flags); a file can pass it and still name
layer 40000 of a 2-layer model, weight tensor 9999, row 7 of a batch of 1, or a batch of 0. Every such value
would index an array out of bounds, allocate without bound, or overflow int64 inside the simulator, so each
is refused here with one line saying where.
"""

from __future__ import annotations

import numbers

import numpy as np

from fastcar_compile.errors import FastCarError

from . import isa
from .encode import Program
from .modelspec import ModelSpec

MAX_CONTEXT = 2**32 - 1  # the m field (u32) holds the compile-time context
MAX_LAYERS = isa.NO_LAYER - 1  # the layer field is u16 and 0xFFFF means "no layer"
MAX_WORK = 2**53  # m * k * n of one instruction: beyond this the cost model loses integer precision
STREAMS = ("broadcast", "per_core")


def _int(meta: dict, key: str, lo: int, hi: int) -> int:
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not lo <= v <= hi:
        raise FastCarError(f"bundle metadata: {key}={v!r} must be an integer in {lo}..{hi}")
    return int(v)


def model_spec(meta: dict) -> ModelSpec:
    model = meta.get("model")
    if not isinstance(model, dict):
        raise FastCarError("bundle metadata lacks the model description ('model'); recompile the program")
    for key in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "frame_tokens",
                "dtype_bytes"):
        if key in model or key not in ("dtype_bytes", "frame_tokens"):
            _int(model, key, 1, MAX_LAYERS if key == "layers" else 2**31 - 1)
    rl = model.get("replay_layers")
    if rl is not None and (not isinstance(rl, list) or
                           any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in rl)):
        raise FastCarError(f"bundle metadata: model.replay_layers={rl!r} must be a list of layer indices")
    for key in ("threshold", "rms_eps", "rope_theta"):
        if key in model and (isinstance(model[key], bool) or not isinstance(model[key], numbers.Real)):
            raise FastCarError(f"bundle metadata: model.{key}={model[key]!r} must be a number")
    try:
        return ModelSpec.from_dict(model)
    except (TypeError, ValueError) as exc:
        raise FastCarError(f"bundle metadata: invalid model description ({exc})") from None


def check_program(program: Program) -> None:
    """Raise FastCarError naming the first value a simulator could not run."""
    meta = program.meta
    if not isinstance(meta, dict):
        raise FastCarError("bundle metadata must be a JSON object")
    spec = model_spec(meta)
    batch = _int(meta, "batch", 1, isa.MAX_ROWS)
    _int(meta, "context", 1, MAX_CONTEXT)
    cores = program.cores
    active = (1 << batch) - 1
    masks = meta.get("binding_masks")
    if not isinstance(masks, list) or len(masks) != cores or any(
            isinstance(m, bool) or not isinstance(m, numbers.Integral) or not 0 <= m <= active for m in masks):
        raise FastCarError(f"bundle metadata: binding_masks must list {cores} row masks within batch {batch} "
                           f"(0..{active:#x}), got {str(masks)[:80]}")
    union = 0
    for m in masks:
        if union & m:
            raise FastCarError("bundle metadata: binding_masks bind one row to two cores")
        union |= m
    if union != active:
        raise FastCarError(f"bundle metadata: binding_masks cover rows {union:#x}, not every row of batch {batch}")
    weights = meta.get("drs_weights", "broadcast")
    if weights not in STREAMS:
        raise FastCarError(f"bundle metadata: drs_weights={weights!r} must be one of {STREAMS}")
    tensors = meta.get("tensors", [])
    if not isinstance(tensors, list) or any(not isinstance(t, dict) for t in tensors):
        raise FastCarError("bundle metadata: tensors must be a list of objects")
    ids = {t.get("id") for t in tensors}
    b = program.bundles
    if len(b) == 0:
        raise FastCarError("the program is empty (no bundles); it must end with a FINISH bundle")
    if int(b[-1, -1]["opcode"]) != isa.Op.FINISH:
        raise FastCarError(f"the program does not end with FINISH (last control slot: "
                           f"{isa.Op(int(b[-1, -1]['opcode'])).name}); it is truncated")
    _check_bundles(b, spec.layers, batch, ids)


def _where(bad: np.ndarray, what: str) -> FastCarError:
    bundle, slot = (int(x[0]) for x in np.nonzero(bad))
    return FastCarError(f"bundle {bundle} slot {slot}: {what}")


def _check_bundles(b: np.ndarray, layers: int, batch: int, tensor_ids: set) -> None:
    core, ctl = b[:, :-1], b[:, -1:]
    live = core["opcode"] != isa.Op.NOP
    lay = core["layer"].astype(np.int64)
    bad = live & (lay >= layers) & (lay != isa.NO_LAYER)
    if bad.any():
        raise _where(bad, f"layer {int(lay[bad][0])} is not a layer of this {layers}-layer model")
    bad = live & ((core["flags"] & isa.Flag.SKIP_ON_REPLAY) != 0) & (lay == isa.NO_LAYER)
    if bad.any():
        raise _where(bad, "SKIP_ON_REPLAY outside a decoder layer (layer NO_LAYER has no MLP to replay)")
    clay = ctl["layer"].astype(np.int64)
    drs = np.isin(ctl["opcode"], [int(isa.Op.DRS_SET), int(isa.Op.DRS_DISPATCH)])
    bad = drs & (clay >= layers)
    if bad.any():
        bundle = int(np.nonzero(bad)[0][0])
        raise FastCarError(f"bundle {bundle} control slot: DRS for layer {int(clay[bad][0])}, which this "
                           f"{layers}-layer model does not have")
    nbuf = len(isa.BUF_NAMES)
    for f in ("dst", "src"):
        bad = live & (core[f] >= nbuf)
        if bad.any():
            raise _where(bad, f"{f} buffer {int(core[f][bad][0])} does not exist (0..{nbuf - 1})")
    op, sub = core["opcode"], core["sub"]
    weight = ((op == isa.Op.GEMM) & (sub == isa.Space.WEIGHT)) | ((op == isa.Op.VEC) & (sub == isa.Vec.RMSNORM))
    known = np.isin(core["tensor"], np.array(sorted(i for i in tensor_ids if isinstance(i, int)), dtype=np.int64))
    bad = weight & ~known
    if bad.any():
        raise _where(bad, f"weight tensor {int(core['tensor'][bad][0])} is not in the program's tensor table")
    second = (op == isa.Op.VEC) & np.isin(sub, [int(isa.Vec.ADD), int(isa.Vec.SILU_MUL)])
    bad = second & (core["tensor"] >= nbuf)
    if bad.any():
        raise _where(bad, f"second source buffer {int(core['tensor'][bad][0])} does not exist")
    rows = np.uint32((1 << batch) - 1 if batch < 32 else isa.ALL_ROWS)
    bad = live & ((core["arg"] & ~rows) != 0)
    if bad.any():
        raise _where(bad, f"row mask {int(core['arg'][bad][0]):#x} names rows beyond batch {batch}")
    work = core["m"].astype(np.float64) * core["k"].astype(np.float64) * np.maximum(core["n"], 1)
    bad = live & (work > MAX_WORK)
    if bad.any():
        raise _where(bad, "m x k x n is beyond what one instruction can describe (> 2^53)")
