"""Readable text form of a bundle program: disassembler and assembler (each the inverse of the other).

Format::

    .version 1
    .meta {...one line of JSON, including the board...}
    bundle                       ; 0
      c0  GEMM.WEIGHT flags=SKIP_ON_REPLAY dst=gate src=xn layer=0 tensor=5 m=64 k=256 n=1 arg=0x0000000f
      ctl BARRIER

Slots not listed are NOP; fields not listed are 0. Buffers may be named (``isa.BUF_NAMES``) or numbered.
``;`` starts a comment.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

import numpy as np

from fastcar_compile.core.errors import FastCarError

from . import isa
from .encode import VERSION, Program, validate_bundles
from .hwspec import BoardConfig, board_from_dict

_BUF_FIELDS = ("dst", "src")
_HEX_FIELDS = ("arg",)


def _instr_text(rec: np.void) -> str:
    op = isa.Op(int(rec["opcode"]))
    name = op.name
    if op in isa.SUB_ENUM:
        name += "." + isa.SUB_ENUM[op](int(rec["sub"])).name
    parts = [name]
    flags = int(rec["flags"])
    if flags:
        parts.append("flags=" + "|".join(f.name for f in isa.Flag if flags & f))
    for f in isa.TEXT_FIELDS:
        v = int(rec[f])
        if v == 0:
            continue
        if f in _BUF_FIELDS and v < len(isa.BUF_NAMES):
            parts.append(f"{f}={isa.BUF_NAMES[v]}")
        elif f in _HEX_FIELDS:
            parts.append(f"{f}={v:#010x}")
        else:
            parts.append(f"{f}={v}")
    if op == isa.Op.TAS:
        parts.append(f"; tau={isa.tau_from_bits(int(rec['off_m'])):g}")
    return " ".join(parts)


def disassemble_lines(program: Program) -> Iterator[str]:
    """Yield the text form line by line (programs can hold 10^5 bundles)."""
    meta = dict(program.meta)
    meta["board"] = program.board.to_dict()
    yield f".version {VERSION}"
    yield ".meta " + json.dumps(meta, sort_keys=True, separators=(",", ":"))
    cores = program.cores
    for b, bundle in enumerate(program.bundles):
        yield f"bundle ; {b}"
        for s in range(cores + 1):
            if int(bundle[s]["opcode"]) == isa.Op.NOP and not bundle[s].tobytes().strip(b"\0"):
                continue  # an all-zero NOP is the default of an unlisted slot
            slot = "ctl" if s == cores else f"c{s}"
            yield f"  {slot:<3} {_instr_text(bundle[s])}"


def disassemble(program: Program) -> str:
    return "\n".join(disassemble_lines(program)) + "\n"


def _parse_int(text: str, what: str, lineno: int) -> int:
    try:
        if not text.isascii():  # int() also reads other scripts' digits ('٣' == 3)
            raise ValueError(text)
        return int(text, 0)
    except ValueError:
        raise FastCarError(f"line {lineno}: {what} {text!r} is not an integer") from None


def _parse_instr(tokens: list[str], lineno: int, limits: dict[str, int]) -> np.void:
    rec = np.zeros((), dtype=isa.INSTR_DTYPE)
    head, _, sub = tokens[0].partition(".")
    try:
        op = isa.Op[head.upper()]
    except KeyError:
        raise FastCarError(f"line {lineno}: unknown opcode {head!r}; known: {[o.name for o in isa.Op]}") from None
    rec["opcode"] = int(op)
    if op in isa.SUB_ENUM:
        enum_cls = isa.SUB_ENUM[op]
        if not sub:
            raise FastCarError(f"line {lineno}: {op.name} needs a sub-function, e.g. {op.name}.{list(enum_cls)[0].name}")
        try:
            rec["sub"] = int(enum_cls[sub.upper()])
        except KeyError:
            raise FastCarError(
                f"line {lineno}: unknown {op.name} sub-function {sub!r}; known: {[e.name for e in enum_cls]}"
            ) from None
    elif sub:
        raise FastCarError(f"line {lineno}: {op.name} takes no sub-function (got {sub!r})")
    for tok in tokens[1:]:
        key, eq, value = tok.partition("=")
        if not eq:
            raise FastCarError(f"line {lineno}: expected field=value, got {tok!r}")
        if key == "flags":
            flags = 0
            for name in value.split("|"):
                try:
                    flags |= int(isa.Flag[name.upper()])
                except KeyError:
                    raise FastCarError(
                        f"line {lineno}: unknown flag {name!r}; known: {[f.name for f in isa.Flag]}"
                    ) from None
            rec["flags"] = flags
            continue
        if key not in isa.TEXT_FIELDS:
            raise FastCarError(f"line {lineno}: unknown field {key!r}; known: flags, {', '.join(isa.TEXT_FIELDS)}")
        if key in _BUF_FIELDS and value in isa.BUF:
            v = isa.BUF[value]
        else:
            v = _parse_int(value, key, lineno)
        if not 0 <= v <= limits[key]:
            raise FastCarError(f"line {lineno}: {key}={v} out of range 0..{limits[key]}")
        rec[key] = v
    return rec


def assemble(lines: str | Iterable[str]) -> Program:
    """Parse the text form back into a Program (raises FastCarError with the line number on bad input)."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    meta: dict | None = None
    board: BoardConfig | None = None
    cores: int | None = None
    bundles: list[np.ndarray] = []
    current: np.ndarray | None = None
    limits = isa.field_limits()
    for lineno, raw in enumerate(lines, 1):
        stripped = raw.strip()
        # .meta carries JSON verbatim (it may contain ';'), every other line may end in a comment
        line = stripped if stripped.startswith(".meta") else raw.split(";", 1)[0].strip()
        if not line:
            continue
        if line.startswith(".version"):
            v = _parse_int(line.split()[1] if len(line.split()) > 1 else "", "version", lineno)
            if v != VERSION:
                raise FastCarError(f"line {lineno}: assembly version {v} is not supported (expected {VERSION})")
            continue
        if line.startswith(".meta"):
            try:
                meta = json.loads(line[len(".meta") :].strip())
            except json.JSONDecodeError as exc:
                raise FastCarError(f"line {lineno}: .meta is not valid JSON: {exc}") from None
            if not isinstance(meta, dict) or not isinstance(meta.get("board"), dict):
                raise FastCarError(f"line {lineno}: .meta must be a JSON object with a 'board' entry")
            board = board_from_dict(meta.pop("board"))  # the checks the decoder applies (cores 1..32, ...)
            cores = board.cores
            continue
        if line == "bundle":
            if cores is None:
                raise FastCarError(f"line {lineno}: 'bundle' before the .meta line (which names the board)")
            current = np.zeros(cores + 1, dtype=isa.INSTR_DTYPE)
            bundles.append(current)
            continue
        tokens = line.split()
        if current is None or cores is None:
            raise FastCarError(f"line {lineno}: instruction outside a bundle; start one with 'bundle'")
        slot_name = tokens[0]
        if slot_name == "ctl":
            slot = cores
        elif slot_name.startswith("c") and slot_name[1:].isdigit() and int(slot_name[1:]) < cores:
            slot = int(slot_name[1:])
        else:
            raise FastCarError(f"line {lineno}: unknown slot {slot_name!r}; use c0..c{cores - 1} or ctl")
        if len(tokens) < 2:
            raise FastCarError(f"line {lineno}: slot {slot_name} has no instruction")
        if current[slot].tobytes().strip(b"\0"):
            raise FastCarError(f"line {lineno}: slot {slot_name} given twice in one bundle")
        current[slot] = _parse_instr(tokens[1:], lineno, limits)
    if meta is None or cores is None or board is None:
        raise FastCarError("assembly lacks the .meta line with the board description")
    arr = np.stack(bundles) if bundles else np.zeros((0, cores + 1), dtype=isa.INSTR_DTYPE)
    validate_bundles(arr)
    return Program(board=board, bundles=arr, meta=meta)
