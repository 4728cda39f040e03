"""Hostile `.fcb` bundles for the fuzz tests: valid header and CRC, one hostile change each.

Three kinds of mutation, each re-encoded the way a hand-edited `asm` source or a buggy tool would write it:
raw byte flips in the instruction stream (CRC recomputed), a hostile value in one metadata entry (header
meta length, hardware hash and CRC recomputed), and a hostile value in one instruction field. ``run_one``
pushes a bundle through everything `sim` does (decode, Simulator, a short run of both policies) and returns
the exception it raised, or None.
"""

from __future__ import annotations

import functools
import json
import zlib

import numpy as np

from fastcar_compile.errors import FastCarError
from fastcar_compile.fpga_backend import encode, isa, masks
from fastcar_compile.fpga_backend.compiler import build_program
from fastcar_compile.fpga_backend.hwspec import load_board
from fastcar_compile.fpga_backend.modelspec import ModelSpec

SPEC = ModelSpec(layers=2, hidden=64, intermediate=96, heads=2, kv_heads=1, head_dim=32, vocab=50, frame_tokens=4)
HOSTILE_VALUES = [0, -1, 1, 2, 31, 32, 33, 255, 65535, 65536, 2**31, 2**32 - 1, 2**32, 2**63, -(2**63), 2**70,
                  1e308, float("inf"), float("nan"), 0.5, "x", "", None, True, [], [1, 2], {}, {"a": 1}]
META_KEYS = ["batch", "context", "binding_masks", "model", "tensors", "drs_weights", "notes", "unsupported",
             "spilled_tasks", "binding"]
MODEL_KEYS = ["layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "frame_tokens",
              "replay_layers", "dtype_bytes", "threshold"]
BOARD_KEYS = ["cores", "array_rows", "array_cols", "clock_mhz", "dram_gbps", "dram_efficiency", "weight_buffer_kib",
              "issue_latency", "drs_overhead", "dtype_bytes", "vector_lanes", "sfu_lanes", "name", "static_watts"]


@functools.lru_cache(maxsize=1)
def base_programs() -> tuple[encode.Program, ...]:
    """Two small real programs (batch 1 and 4) from the FPGA compiler (callers copy before editing)."""
    board = load_board("kv260")
    return tuple(build_program(SPEC, board, batch=b, context=8) for b in (1, 4))


def raw_encode(bundles: np.ndarray, meta: dict, hw_hash: int, cores: int) -> bytes:
    """encode.encode without any validation: header, JSON meta, bundles, CRC."""
    meta_bytes = json.dumps(meta, separators=(",", ":"), allow_nan=True).encode()
    head = encode.HEADER.pack(encode.MAGIC, encode.VERSION, encode.HEADER.size, hw_hash, cores, cores + 1,
                              isa.INSTR_BYTES, 0, bundles.shape[0], len(meta_bytes))
    body = head + meta_bytes + bundles.tobytes()
    return body + encode.CRC.pack(zlib.crc32(body))


def _full_meta(p: encode.Program) -> dict:
    meta = json.loads(json.dumps(p.meta))
    meta["board"] = p.board.to_dict()
    return meta


def mutate(p: encode.Program, rng: np.random.Generator) -> bytes:
    """One hostile bundle file derived from `p`."""
    kind = rng.integers(4)
    meta = _full_meta(p)
    bundles = p.bundles.copy()
    hw = p.board.structural_hash()
    if kind == 0:  # byte flips in the instruction stream
        raw = bytearray(bundles.tobytes())
        for _ in range(int(rng.integers(1, 4))):
            raw[int(rng.integers(len(raw)))] = int(rng.integers(256))
        bundles = np.frombuffer(bytes(raw), isa.INSTR_DTYPE).reshape(bundles.shape).copy()
    elif kind == 1:  # one hostile metadata value (top level, model or board)
        where = rng.integers(3)
        value = HOSTILE_VALUES[int(rng.integers(len(HOSTILE_VALUES)))]
        if where == 0:
            key = META_KEYS[int(rng.integers(len(META_KEYS)))]
            if rng.random() < 0.15:
                meta.pop(key, None)
            else:
                meta[key] = value
        elif where == 1:
            key = MODEL_KEYS[int(rng.integers(len(MODEL_KEYS)))]
            meta["model"][key] = value
        else:
            key = BOARD_KEYS[int(rng.integers(len(BOARD_KEYS)))]
            meta["board"][key] = value
            try:  # a consistent file: the header carries the edited board's hash, as asm would write it
                from fastcar_compile.fpga_backend.hwspec import board_from_dict

                hw = board_from_dict(meta["board"]).structural_hash()
            except Exception:  # noqa: BLE001 - an invalid board keeps the old hash
                pass
    elif kind == 2:  # one hostile instruction field
        b, s = int(rng.integers(bundles.shape[0])), int(rng.integers(bundles.shape[1]))
        field = isa.FIELDS[int(rng.integers(len(isa.FIELDS)))]
        top = int(np.iinfo(isa.INSTR_DTYPE[field]).max)
        bundles[b, s][field] = int(rng.choice([0, 1, top, top // 2 + 1, int(rng.integers(top + 1))]))
    else:  # structure: drop/duplicate/empty bundles, or a slot made a plain op of another layer
        choice = rng.integers(3)
        if choice == 0:
            bundles = bundles[: int(rng.integers(bundles.shape[0] + 1))]
        elif choice == 1:
            idx = rng.integers(bundles.shape[0], size=bundles.shape[0])
            bundles = bundles[np.sort(idx)]
        else:
            bundles = bundles[:0]
    return raw_encode(np.ascontiguousarray(bundles), meta, hw, p.cores)


def run_one(data: bytes) -> tuple[str, BaseException | None]:
    """Decode and simulate like `fastcar-compile sim` does: ("ran" | "decode" | "sim" | "crash", exception);
    "decode"/"sim" mean the project's own error was raised by the decoder / by the simulator's checks."""
    from fastcar_compile.fpga_backend.simulate import Simulator

    stage = "decode"
    try:
        program = encode.decode(data)
        stage = "sim"
        sim = Simulator(program)
        replay = masks.synthetic(0.5, sim.batch, sim.num_layers, 2, replayable=frozenset(sim.replayable_layers))
        ctx = int(program.meta["context"])
        for policy in ("static", "drs"):
            sim.run(replay, ctx, policy=policy, batch=sim.batch)
    except FastCarError as exc:
        return stage, exc
    except Exception as exc:  # noqa: BLE001 - what the fuzz test counts
        return "crash", exc
    return "ran", None


def campaign(n: int, seed: int = 0) -> dict[str, list]:
    """n mutated bundles (alternating the two base programs): outcome -> list of (index, exception)."""
    import warnings

    progs = base_programs()
    rng = np.random.default_rng(seed)
    out: dict[str, list] = {"ran": [], "decode": [], "sim": [], "crash": []}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a numpy overflow warning is a crash too (garbage figures)
        for i in range(n):
            stage, exc = run_one(mutate(progs[i % 2], rng))
            out[stage].append((i, exc))
    return out



def main(argv: list[str] | None = None) -> int:
    """`python tests/fcb_fuzz.py [N] [SEED]`: outcome counts of a campaign (the closing note's figures)."""
    import collections
    import sys
    import time

    args = sys.argv[1:] if argv is None else argv
    n, seed = (int(args[0]) if args else 10_000), (int(args[1]) if len(args) > 1 else 2)
    t0 = time.perf_counter()
    res = campaign(n, seed)
    kinds = collections.Counter(f"{type(e).__name__}: {str(e)[:90]}" for _, e in res["crash"])
    print(f"{n} mutated bundles in {time.perf_counter() - t0:.0f} s: ran {len(res['ran'])}, refused by the decoder "
          f"{len(res['decode'])}, decoded but refused by the simulator's checks {len(res['sim'])}, "
          f"crashes {len(res['crash'])}")
    for k, v in kinds.most_common(10):
        print(f"  {v} x {k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
