"""Semantic checks of a bundle program: what `asm` refuses to write and `sim` refuses to run.

`encode.decode` checks the container (magic, CRC, sizes, opcodes, flags); a file can pass it and still name
layer 40000 of a 2-layer model, weight tensor 9999, row 7 of a batch of 1, or a batch of 0. Every such value
would index an array out of bounds, allocate without bound, or overflow int64 inside the simulator, so each
is refused here with one line saying where.
"""

from __future__ import annotations

import numbers

import numpy as np

from fastcar_compile.core.errors import FastCarError

from . import isa
from .encode import Program
from .kvbound import recorded_bounds
from .modelspec import ModelSpec

MAX_WORK = 2**53  # m * k * n of one instruction: beyond this the cost model loses integer precision


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
        if key in ("dtype_bytes", "frame_tokens") and model.get(key) is None:
            continue  # optional: the board's element size; no frames in a dense program
        _int(model, key, 1, isa.MAX_LAYERS if key == "layers" else 2**31 - 1)
    rl = model.get("replay_layers")
    if rl is not None and (not isinstance(rl, list) or
                           any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in rl)):
        raise FastCarError(f"bundle metadata: model.replay_layers={rl!r} must be a list of layer indices")
    for key in ("threshold", "rms_eps", "rope_theta"):
        if key in model and (isinstance(model[key], bool) or not isinstance(model[key], numbers.Real)):
            raise FastCarError(f"bundle metadata: model.{key}={model[key]!r} must be a number")
    if rl is not None and any(not 0 <= x < model["layers"] for x in rl):
        raise FastCarError(f"bundle metadata: model.replay_layers={str(rl)[:60]} names layers outside "
                           f"0..{model['layers'] - 1}")
    try:
        return ModelSpec.from_dict(model)
    except (TypeError, ValueError, OverflowError) as exc:
        raise FastCarError(f"bundle metadata: invalid model description ({exc})") from None


def check_program(program: Program) -> None:
    """Raise FastCarError naming the first value a simulator could not run."""
    meta = program.meta
    if not isinstance(meta, dict):
        raise FastCarError("bundle metadata must be a JSON object")
    spec = model_spec(meta)
    batch = _int(meta, "batch", 1, isa.MAX_ROWS)
    _int(meta, "context", 1, isa.MAX_CONTEXT)
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
    if weights not in isa.WEIGHT_STREAMS:
        raise FastCarError(f"bundle metadata: drs_weights={str(weights)[:40]} must be one of {isa.WEIGHT_STREAMS}")
    ids = _tensor_ids(meta.get("tensors", []))
    recorded_bounds(meta, spec.layers)
    b = program.bundles
    if len(b) == 0:
        raise FastCarError("the program is empty (no bundles); it must end with a FINISH bundle")
    if int(b[-1, -1]["opcode"]) != isa.Op.FINISH:
        raise FastCarError(f"the program does not end with FINISH (last control slot: "
                           f"{isa.Op(int(b[-1, -1]['opcode'])).name}); it is truncated")
    _check_bundles(b, spec.layers, batch, ids)
    _check_control(b)


def _is_int(v: object, lo: int, hi: int) -> bool:
    return not isinstance(v, bool) and isinstance(v, numbers.Integral) and lo <= v <= hi


def _tensor_ids(tensors: object) -> set[int]:
    """The weight ids of the tensor table, each entry checked: {id = its index, name, layer, shape, source}."""
    if not isinstance(tensors, list) or any(not isinstance(t, dict) for t in tensors):
        raise FastCarError("bundle metadata: tensors must be a list of objects")
    if len(tensors) > isa.NO_LAYER:
        raise FastCarError(f"bundle metadata: {len(tensors)} tensors exceed the 16-bit tensor field")
    for i, t in enumerate(tensors):
        shape = t.get("shape")
        if t.get("id") != i or not _is_int(t.get("id"), 0, isa.NO_LAYER):
            raise FastCarError(f"bundle metadata: tensors[{i}].id={str(t.get('id'))[:40]} must be {i}")
        if not isinstance(t.get("name"), str) or not _is_int(t.get("layer"), 0, isa.NO_LAYER):
            raise FastCarError(f"bundle metadata: tensors[{i}] needs a name (text) and a layer (0..{isa.NO_LAYER})")
        if not isinstance(shape, list) or not 1 <= len(shape) <= 2 or \
                not all(_is_int(d, 1, 2**31 - 1) for d in shape):
            raise FastCarError(f"bundle metadata: tensors[{i}].shape={str(shape)[:40]} must list 1 or 2 sizes "
                               "in 1..2^31-1")
        if t.get("source") is not None and not isinstance(t["source"], str):
            raise FastCarError(f"bundle metadata: tensors[{i}].source must be an initializer name or null")
    return set(range(len(tensors)))


def _where(bad: np.ndarray, what: str) -> FastCarError:
    bundle, slot = (int(x[0]) for x in np.nonzero(bad))
    return FastCarError(f"bundle {bundle} slot {slot}: {what}")


def _check_bundles(b: np.ndarray, layers: int, batch: int, tensor_ids: set[int]) -> None:
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
    known = core["tensor"].astype(np.int64) < len(tensor_ids)
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
    norm = live & (op == isa.Op.VEC) & (sub == isa.Vec.RMSNORM)
    groups = np.maximum(core["n"], 1).astype(np.int64)
    bad = norm & (core["m"].astype(np.int64) % groups != 0)
    if bad.any():
        raise _where(bad, "RMSNORM over n groups needs m divisible by n")
    work = core["m"].astype(np.float64) * core["k"].astype(np.float64) * np.maximum(core["n"], 1)
    bad = live & (work > MAX_WORK)
    if bad.any():
        raise _where(bad, "m x k x n is beyond what one instruction can describe (> 2^53)")


def _check_control(b: np.ndarray) -> None:
    """Control slots the dispatcher would act on wrongly: a FINISH before the end (the bundles after it never
    issue) and a DRS_DISPATCH whose jump (arg) is not its layer's replayable phase (``drs.skip_span``: with
    every row replaying, the dispatcher would skip what still runs, or run what is dropped)."""
    from .drs import skip_span

    ctl = b[:, -1]
    early = np.flatnonzero(ctl["opcode"][:-1] == isa.Op.FINISH)
    if early.size:
        raise FastCarError(f"bundle {int(early[0])} control slot: FINISH before the last bundle "
                           f"({len(b) - 1}); the bundles after it would never issue")
    for i in np.flatnonzero(ctl["opcode"] == isa.Op.DRS_DISPATCH):
        span = skip_span(b, int(i))
        if int(ctl[i]["arg"]) != span:
            raise FastCarError(f"bundle {int(i)} control slot: DRS_DISPATCH jumps {int(ctl[i]['arg'])} bundles "
                               f"but its layer's replayable phase has {span}; recompile")
