"""Hostile `.fcb` bundles for the fuzz tests: valid header and CRC, one hostile change each.

Mutations, each re-encoded the way a hand-edited `asm` source or a buggy tool would write it: raw byte flips in
the instruction stream (CRC recomputed), a hostile value in one top-level, model or board metadata entry or at
any depth of the metadata tree (tensor table entries, binding masks, replay layers, KV settings; header meta
length, hardware hash and CRC recomputed), byte flips in the metadata's JSON text, a hostile value in one
instruction field, dropped/duplicated bundles, byte flips anywhere in the file (header included) and
truncations, both with the CRC recomputed so they reach the checks behind it. ``run_one`` pushes a bundle
through everything `sim` does (decode, Simulator, a short run of both policies) and through `disasm` + `asm`
(which must refuse exactly what `sim` refuses), and returns the exception it raised, or None.
"""

from __future__ import annotations

import functools
import json
import zlib

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.fpga_backend import encode, isa, masks
from fastcar_compile.fpga_backend.compiler import build_program
from fastcar_compile.fpga_backend.hwspec import load_board
from fastcar_compile.fpga_backend.modelspec import ModelSpec

SPEC = ModelSpec(layers=2, hidden=64, intermediate=96, heads=2, kv_heads=1, head_dim=32, vocab=50, frame_tokens=4)
HOSTILE_VALUES = [0, -1, 1, 2, 31, 32, 33, 255, 65535, 65536, 2**31, 2**32 - 1, 2**32, 2**63, -(2**63), 2**70,
                  1e308, float("inf"), float("nan"), 0.5, 4.0, "x", "", "4", "٣", None, True, [], [1, 2], {}, {"a": 1}]
# Hostile tokens for one field of an assembly line (`asm` input).
HOSTILE_TOKENS = ["-1", "0x", "0x1p3", "99999999999999999999", "4294967296", "65536", "٣", "1e3", "nan", "", "q",
                  "0x1_0", "1.5", "+7", "0b11", "SKIP_ON_REPLAY|", "x" * 300]
META_KEYS = ["batch", "context", "binding_masks", "model", "tensors", "drs_weights", "notes", "unsupported",
             "spilled_tasks", "binding", "kv"]
MODEL_KEYS = ["layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "frame_tokens",
              "replay_layers", "dtype_bytes", "threshold", "rms_eps", "rope_theta", "qk_norm", "video_start",
              "tas_query"]
BOARD_KEYS = ["cores", "array_rows", "array_cols", "clock_mhz", "dram_gbps", "dram_efficiency", "weight_buffer_kib",
              "issue_latency", "drs_overhead", "dtype_bytes", "vector_lanes", "sfu_lanes", "name", "static_watts"]


KINDS = 8  # mutation kinds of `mutate`


@functools.lru_cache(maxsize=1)
def base_programs() -> tuple[encode.Program, ...]:
    """Two small real programs (batch 1 and 4) from the FPGA compiler (callers copy before editing); the
    second records a compressed KV cache on layer 1, so its settings are mutated too."""
    board = load_board("kv260")
    first = build_program(SPEC, board, batch=1, context=8)
    second = build_program(SPEC, board, batch=4, context=8)
    second.meta["kv"] = {"1": {"budget": 6, "sinks": 1, "window": 2}}
    return first, second


def _paths(obj: object, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON tree (keys and list indices), the root excluded."""
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


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
    kind = rng.integers(KINDS)
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
    elif kind == 4:  # one hostile value at any depth of the metadata tree
        paths = _paths(meta)
        path = paths[int(rng.integers(len(paths)))]
        node = meta
        for key in path[:-1]:
            node = node[key]
        if rng.random() < 0.1 and isinstance(node, dict):
            del node[path[-1]]
        else:
            node[path[-1]] = HOSTILE_VALUES[int(rng.integers(len(HOSTILE_VALUES)))]
    elif kind == 5:  # byte flips in the metadata's JSON text (length, hash and CRC made consistent)
        text = bytearray(json.dumps(meta, separators=(",", ":")).encode())
        for _ in range(int(rng.integers(1, 4))):
            text[int(rng.integers(len(text)))] = int(rng.choice([ord(c) for c in '0123456789-.e,:[]{}"x '] + [0xFF]))
        return _with_meta_bytes(bytes(text), bundles, hw, p.cores)
    elif kind == 6:  # byte flips anywhere in the file, header included, CRC recomputed
        raw = bytearray(raw_encode(bundles, meta, hw, p.cores)[: -encode.CRC.size])
        for _ in range(int(rng.integers(1, 4))):
            raw[int(rng.integers(len(raw)))] = int(rng.integers(256))
        return bytes(raw) + encode.CRC.pack(zlib.crc32(bytes(raw)))
    elif kind == 7:  # truncated file: half with the CRC recomputed over what is left, half cut as it is
        full = raw_encode(bundles, meta, hw, p.cores)
        cut = full[: int(rng.integers(len(full)))]
        return cut + encode.CRC.pack(zlib.crc32(cut)) if rng.random() < 0.5 else cut
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


def _with_meta_bytes(meta_bytes: bytes, bundles: np.ndarray, hw_hash: int, cores: int) -> bytes:
    head = encode.HEADER.pack(encode.MAGIC, encode.VERSION, encode.HEADER.size, hw_hash, cores, cores + 1,
                              isa.INSTR_BYTES, 0, bundles.shape[0], len(meta_bytes))
    body = head + meta_bytes + np.ascontiguousarray(bundles).tobytes()
    return body + encode.CRC.pack(zlib.crc32(body))


class Asymmetry(Exception):
    """`asm` and `sim` disagree about a program (one accepts what the other refuses)."""


def _simulate(program: encode.Program) -> None:
    from fastcar_compile.fpga_backend.kvbound import kv_lengths, recorded_bounds
    from fastcar_compile.fpga_backend.simulate import Simulator

    sim = Simulator(program)
    replay = masks.synthetic(0.5, sim.batch, sim.num_layers, 2, replayable=frozenset(sim.replayable_layers))
    ctx = np.array([int(program.meta["context"])] * 2, np.int64)
    kv_len = kv_lengths(ctx, sim.num_layers, per_layer=recorded_bounds(program.meta))
    for policy in ("static", "drs"):
        sim.run(replay, ctx, policy=policy, batch=sim.batch, kv_len=kv_len)


def run_one(data: bytes) -> tuple[str, BaseException | None]:
    """Decode and simulate like `fastcar-compile sim` does: ("ran" | "decode" | "sim" | "crash", exception);
    "decode"/"sim" mean the project's own error was raised by the decoder / by the simulator's checks. A
    decoded program also goes through `disasm` and `asm`: asm must write it exactly when sim runs it."""
    from fastcar_compile.fpga_backend import asm
    from fastcar_compile.fpga_backend.verify import check_program

    stage = "decode"
    try:
        program = encode.decode(data)
        stage = "sim"
        try:
            back = asm.assemble(asm.disassemble(program))
            check_program(back)
            encode.decode(encode.encode(back))
            assembled = None
        except FastCarError as exc:
            assembled = exc
        try:
            _simulate(program)
        except FastCarError:
            if assembled is None:
                raise Asymmetry("asm wrote a program that sim refuses") from None
            raise
        if assembled is not None:
            raise Asymmetry(f"asm refuses a program that sim runs: {assembled}")
    except FastCarError as exc:
        return stage, exc
    except Exception as exc:  # noqa: BLE001 - what the fuzz test counts
        return "crash", exc
    return "ran", None


def mutate_text(p: encode.Program, rng: np.random.Generator) -> str:
    """One hostile assembly source derived from `p`'s disassembly: a hostile field value, a hostile value deep
    in the .meta JSON, a line dropped, duplicated or cut, or a stray character."""
    from fastcar_compile.fpga_backend import asm

    lines = asm.disassemble(p).splitlines()
    kind = rng.integers(4)
    if kind == 0:  # one field of one instruction
        idx = [i for i, line in enumerate(lines) if "=" in line and not line.startswith(".")]
        i = idx[int(rng.integers(len(idx)))]
        toks = lines[i].split(";")[0].split()
        j = int(rng.integers(2, len(toks))) if len(toks) > 2 else 1
        key = toks[j].partition("=")[0] if "=" in toks[j] else isa.TEXT_FIELDS[int(rng.integers(len(isa.TEXT_FIELDS)))]
        toks[j] = f"{key}={HOSTILE_TOKENS[int(rng.integers(len(HOSTILE_TOKENS)))]}"
        lines[i] = " ".join(toks)
    elif kind == 1:  # one value anywhere in the .meta JSON
        meta = json.loads(lines[1][len(".meta "):])
        paths = _paths(meta)
        path = paths[int(rng.integers(len(paths)))]
        node = meta
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = HOSTILE_VALUES[int(rng.integers(len(HOSTILE_VALUES)))]
        lines[1] = ".meta " + json.dumps(meta, separators=(",", ":"))
    elif kind == 2:  # structure: a line dropped, duplicated or cut short
        i = int(rng.integers(len(lines)))
        what = rng.integers(3)
        if what == 0:
            del lines[i]
        elif what == 1:
            lines.insert(i, lines[i])
        else:
            lines[i] = lines[i][: int(rng.integers(len(lines[i]) + 1))]
    else:  # a stray character anywhere
        i = int(rng.integers(len(lines)))
        pos = int(rng.integers(len(lines[i]) + 1))
        lines[i] = lines[i][:pos] + str(rng.choice(list("=|;.x0-\t\u00a0\u0663{}[]\"'"))) + lines[i][pos:]
    return "\n".join(lines) + "\n"


def run_text(text: str) -> tuple[str, BaseException | None]:
    """Assemble like `fastcar-compile asm` does, then decode and simulate what it would write: ("ran" |
    "asm" | "sim" | "crash", exception). Whatever asm writes, sim must run."""
    from fastcar_compile.fpga_backend import asm
    from fastcar_compile.fpga_backend.verify import check_program

    stage = "asm"
    try:
        program = asm.assemble(text)
        check_program(program)
        data = encode.encode(program)
        stage = "sim"
        try:
            _simulate(encode.decode(data))
        except FastCarError as exc:
            raise Asymmetry(f"asm wrote a program that sim refuses: {exc}") from None
    except FastCarError as exc:
        return stage, exc
    except Exception as exc:  # noqa: BLE001 - what the fuzz test counts
        return "crash", exc
    return "ran", None


def text_campaign(n: int, seed: int = 0) -> dict[str, list]:
    """n mutated assembly sources: outcome -> list of (index, exception)."""
    progs = base_programs()
    rng = np.random.default_rng(seed)
    out: dict[str, list] = {"ran": [], "asm": [], "sim": [], "crash": []}
    for i in range(n):
        stage, exc = run_text(mutate_text(progs[i % 2], rng))
        out[stage].append((i, exc))
    return out


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
    t0 = time.perf_counter()
    res = text_campaign(n // 10, seed)
    kinds = collections.Counter(f"{type(e).__name__}: {str(e)[:90]}" for _, e in res["crash"])
    print(f"{n // 10} mutated assembly sources in {time.perf_counter() - t0:.0f} s: written and run "
          f"{len(res['ran'])}, refused by asm {len(res['asm'])}, crashes {len(res['crash'])}")
    for k, v in kinds.most_common(10):
        print(f"  {v} x {k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
