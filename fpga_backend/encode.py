"""The `.fcb` bundle container: encode and decode, symmetric, with every check in ``validate_bundles``.

Layout (little-endian)::

    header  (``HEADER``)  magic "FCAR", version, header bytes, structural hardware hash (u64), cores,
                          slots per bundle (= cores + 1), instruction bytes, reserved (0), bundles, meta bytes
    meta    UTF-8 JSON    board figures, model dims, tensor table, batch, context, binding
    bundles n_bundles x slots x 32-byte instructions (``isa.INSTR_DTYPE``)
    crc     u32           CRC32 of every byte before it
"""

from __future__ import annotations

import dataclasses
import enum
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from fastcar_compile.core.atomic import write_bytes
from fastcar_compile.core.errors import FastCarError

from . import isa
from .hwspec import BoardConfig, board_from_dict

MAGIC = b"FCAR"
VERSION = 1
HEADER = struct.Struct("<4sHHQHHHHII")
CRC = struct.Struct("<I")
CRC32_POLY = 0xEDB88320  # zlib's CRC-32 (reflected IEEE 802.3): what the RTL loader computes bit by bit


class Refusal(enum.IntEnum):
    """Why ``decode`` refuses a file, in the order it checks (the RTL loader ``fcar_loader`` reports the same
    codes; META is the host's: the JSON metadata never reaches the accelerator)."""

    NONE = 0
    SHORT = 1  # shorter than header + CRC
    MAGIC = 2
    VERSION = 3
    CRC = 4
    HEADER = 5  # header size, instruction size or reserved field wrong
    SLOTS = 6  # slots != cores + 1, or cores outside 1..MAX_ROWS
    SIZE = 7  # file length disagrees with the header
    META = 8  # metadata not JSON / no board (host side)
    HASH = 9  # hardware hash or cores differ from the board
    INSTRUCTION = 10  # an instruction the decoder refuses (``isa.Fault``)


class DecodeError(FastCarError):
    """A refused bundle file: the message, plus what the RTL loader is compared on."""

    def __init__(self, message: str, refusal: Refusal, fault: isa.Fault = isa.Fault.NONE, index: int = -1):
        super().__init__(message)
        self.refusal, self.fault, self.index = refusal, fault, index  # index: instruction in stream order


@dataclasses.dataclass
class Program:
    """A bundle stream plus what is needed to run it: the board it was tiled for and the metadata."""

    board: BoardConfig
    bundles: np.ndarray  # shape (n_bundles, cores + 1), dtype isa.INSTR_DTYPE
    meta: dict[str, Any]

    @property
    def cores(self) -> int:
        return self.bundles.shape[1] - 1

    def __len__(self) -> int:
        return self.bundles.shape[0]


def encode(program: Program) -> bytes:
    """Serialise a program; raises FastCarError if it holds an invalid instruction."""
    bundles = np.ascontiguousarray(program.bundles, dtype=isa.INSTR_DTYPE)
    if bundles.ndim != 2 or bundles.shape[1] != program.board.cores + 1:
        raise FastCarError(
            f"bundles must have shape (n, cores + 1 = {program.board.cores + 1}), got {bundles.shape}"
        )
    validate_bundles(bundles)
    meta = dict(program.meta)
    meta["board"] = program.board.to_dict()
    meta_bytes = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    head = HEADER.pack(
        MAGIC, VERSION, HEADER.size, program.board.structural_hash(), program.board.cores,
        program.board.cores + 1, isa.INSTR_BYTES, 0, bundles.shape[0], len(meta_bytes),
    )
    body = head + meta_bytes + bundles.tobytes()
    return body + CRC.pack(zlib.crc32(body))


def decode(data: bytes) -> Program:
    """Parse and check a `.fcb` image; every defect raises FastCarError naming it."""
    if len(data) < HEADER.size + CRC.size:
        raise DecodeError(f"not a FastCar bundle file: {len(data)} bytes is shorter than the header", Refusal.SHORT)
    magic, version, header_bytes, hw_hash, cores, slots, instr_bytes, reserved, n_bundles, meta_len = (
        HEADER.unpack_from(data, 0)
    )
    if magic != MAGIC:
        raise DecodeError(f"not a FastCar bundle file: magic {magic!r}, expected {MAGIC!r}", Refusal.MAGIC)
    if version != VERSION:
        raise DecodeError(f"bundle file version {version} is not supported (this tool reads {VERSION}); recompile",
                          Refusal.VERSION)
    (crc,) = CRC.unpack_from(data, len(data) - CRC.size)
    if zlib.crc32(data[: -CRC.size]) != crc:
        raise DecodeError("bundle file is corrupt: CRC32 mismatch (file truncated or modified); recompile it",
                          Refusal.CRC)
    if header_bytes != HEADER.size or instr_bytes != isa.INSTR_BYTES or reserved != 0:
        raise DecodeError(
            f"bundle header is malformed (header {header_bytes} B, instruction {instr_bytes} B, reserved {reserved})",
            Refusal.HEADER,
        )
    if slots != cores + 1 or not 1 <= cores <= isa.MAX_ROWS:
        raise DecodeError(f"bundle header is malformed: {slots} slots for {cores} cores (expected cores + 1)",
                          Refusal.SLOTS)
    expected = HEADER.size + meta_len + n_bundles * slots * isa.INSTR_BYTES + CRC.size
    if expected != len(data):
        raise DecodeError(f"bundle file size {len(data)} does not match its header (expected {expected})",
                          Refusal.SIZE)
    try:
        meta = json.loads(data[HEADER.size : HEADER.size + meta_len].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DecodeError(f"bundle metadata is not valid JSON: {exc}", Refusal.META) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("board"), dict):
        raise DecodeError("bundle metadata lacks the board description", Refusal.META)
    try:
        board = board_from_dict(meta.pop("board"))
    except FastCarError as exc:
        raise DecodeError(str(exc), Refusal.META) from None
    if board.structural_hash() != hw_hash or board.cores != cores:
        raise DecodeError(
            f"bundle file hardware hash {hw_hash:016x} does not match its board {board.name!r} "
            f"({board.structural_hash():016x}); the file was edited or mixed from two builds",
            Refusal.HASH,
        )
    start = HEADER.size + meta_len
    bundles = np.frombuffer(data, dtype=isa.INSTR_DTYPE, count=n_bundles * slots, offset=start)
    bundles = bundles.reshape(n_bundles, slots).copy()
    validate_bundles(bundles)
    return Program(board=board, bundles=bundles, meta=meta)


def _where(bundles: np.ndarray, b: int, s: int) -> str:
    slot = "ctl" if s == bundles.shape[1] - 1 else f"c{s}"
    rec = bundles[b, s]
    return f"bundle {b} slot {slot} (opcode {int(rec['opcode'])}, flags {int(rec['flags']):#04x}, sub {int(rec['sub'])})"


def validate_bundles(bundles: np.ndarray) -> None:
    """Reject unknown opcodes, ops in the wrong slot kind, unknown sub-functions and non-zero reserved bits:
    the first faulty instruction in stream order, with its first failing check (``isa.Fault``)."""
    if bundles.size == 0:
        return
    faults = isa.instruction_faults(bundles)
    bad = np.flatnonzero(faults.ravel())
    if bad.size:
        b, s = divmod(int(bad[0]), bundles.shape[1])
        fault = isa.Fault(int(faults[b, s]))
        raise DecodeError(f"{isa.FAULT_TEXT[fault]} {_where(bundles, b, s)}", Refusal.INSTRUCTION, fault,
                          int(bad[0]))


def save(program: Program, path: str | Path) -> int:
    data = encode(program)
    write_bytes(path, data)
    return len(data)


def load(path: str | Path) -> Program:
    from fastcar_compile.core.fileio import check_input_file, os_errors

    path = check_input_file(path, "bundle file")
    with os_errors("bundle file"):
        data = path.read_bytes()
    return decode(data)
