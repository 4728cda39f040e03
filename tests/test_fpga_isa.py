"""ISA, .fcb container and assembler: round trips (property-based) and every corruption rejected."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.fpga_backend import TINY, build_program, isa, load_board
from fastcar_compile.fpga_backend.asm import assemble, disassemble
from fastcar_compile.fpga_backend.encode import HEADER, Program, decode, encode
from fastcar_compile.fpga_backend.hwspec import PRESETS

BOARD = load_board("kv260")
LIMITS = isa.field_limits()


@st.composite
def instructions(draw, control: bool):
    ops = sorted(isa.CONTROL_OPS if control else isa.CORE_OPS)
    op = draw(st.sampled_from(ops))
    rec = {"opcode": int(op), "flags": draw(st.integers(0, isa.FLAG_MASK)),
           "sub": draw(st.sampled_from(sorted(isa.VALID_SUB[int(op)])))}
    for f in isa.TEXT_FIELDS:
        rec[f] = draw(st.integers(0, LIMITS[f]))
    return isa.Instr(**rec)


@st.composite
def programs(draw):
    cores = BOARD.cores
    n = draw(st.integers(0, 6))
    arr = np.zeros((n, cores + 1), isa.INSTR_DTYPE)
    for b in range(n):
        for s in range(cores + 1):
            arr[b, s] = draw(instructions(control=s == cores)).to_record()
    meta = {"batch": draw(st.integers(1, 32)), "note": draw(st.text(max_size=20))}
    return Program(board=BOARD, bundles=arr, meta=meta)


@settings(max_examples=60, deadline=None, database=None)
@given(programs())
def test_encode_decode_round_trip(prog):
    data = encode(prog)
    back = decode(data)
    assert back.board == prog.board
    assert back.meta == prog.meta
    np.testing.assert_array_equal(back.bundles, prog.bundles)
    assert encode(back) == data


@settings(max_examples=40, deadline=None, database=None)
@given(programs())
def test_asm_disasm_round_trip(prog):
    text = disassemble(prog)
    back = assemble(text)
    np.testing.assert_array_equal(back.bundles, prog.bundles)
    assert back.meta == prog.meta and back.board == prog.board
    assert disassemble(back) == text


def test_instruction_layout_is_little_endian_and_fixed_width():
    ins = isa.Instr(opcode=isa.Op.GEMM, flags=isa.Flag.SKIP_ON_REPLAY, sub=isa.Space.KV_V, dst=3, src=4, layer=0x0102,
                    tensor=0x0304, n=5, m=0x0A0B0C0D, k=7, off_m=8, off_k=9, arg=0x80000001)
    raw = ins.to_record().tobytes()
    assert len(raw) == isa.INSTR_BYTES == 32
    want = struct.pack("<BBBBBBHHHIIIII", 3, 1, 3, 3, 4, 0, 0x0102, 0x0304, 5, 0x0A0B0C0D, 7, 8, 9, 0x80000001)
    assert raw == want
    assert isa.Instr.from_record(np.frombuffer(raw, isa.INSTR_DTYPE)[0]) == ins


@pytest.fixture(scope="module")
def image() -> bytes:
    return encode(build_program(TINY, BOARD, batch=4, context=8))


def _recrc(data: bytearray) -> bytes:
    body = bytes(data[:-4])
    return body + struct.pack("<I", zlib.crc32(body))


def _patch_instr(data: bytes, bundle: int, slot: int, field: str, value: int) -> bytes:
    meta_len = HEADER.unpack_from(data, 0)[-1]
    start = HEADER.size + meta_len + (bundle * (BOARD.cores + 1) + slot) * isa.INSTR_BYTES
    rec = np.frombuffer(data[start : start + isa.INSTR_BYTES], isa.INSTR_DTYPE).copy()
    rec[field] = value
    out = bytearray(data)
    out[start : start + isa.INSTR_BYTES] = rec.tobytes()
    return _recrc(out)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda d: b"XXXX" + d[4:], "magic"),
        (lambda d: _recrc(bytearray(d[:4] + struct.pack("<H", 99) + d[6:])), "version"),
        (lambda d: d[:100] + bytes([d[100] ^ 1]) + d[101:], "CRC"),
        (lambda d: d[:-40] + d[-4:], "CRC"),
        (lambda d: d[:10], "shorter than the header"),
        (lambda d: _patch_instr(d, 2, 0, "opcode", 0xEE), "unknown opcode"),
        (lambda d: _patch_instr(d, 2, 0, "opcode", int(isa.Op.BARRIER)), "control opcode in a core slot"),
        (lambda d: _patch_instr(d, 2, BOARD.cores, "opcode", int(isa.Op.GEMM)), "core opcode in the control slot"),
        (lambda d: _patch_instr(d, 2, 1, "flags", 0x80), "reserved flag bits"),
        (lambda d: _patch_instr(d, 2, 1, "reserved", 1), "reserved byte"),
        (lambda d: _patch_instr(d, 1, 0, "sub", 9), "sub-function"),
    ],
)
def test_corruption_rejected(image, mutate, message):
    bad = mutate(image)
    with pytest.raises(FastCarError, match=message):
        decode(bad)


def test_hardware_hash_mismatch_rejected(image):
    meta_len = HEADER.unpack_from(image, 0)[-1]
    meta = json.loads(image[HEADER.size : HEADER.size + meta_len])
    meta["board"]["weight_buffer_kib"] = 1024  # a different board than the one hashed in the header
    new_meta = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    fields = list(HEADER.unpack_from(image, 0))
    fields[-1] = len(new_meta)
    rebuilt = bytearray(HEADER.pack(*fields) + new_meta + image[HEADER.size + meta_len :])
    with pytest.raises(FastCarError, match="hardware hash"):
        decode(_recrc(rebuilt))


def test_assembler_rejects_bad_text():
    text = disassemble(build_program(TINY, BOARD, batch=2, context=4))
    bad_cases = {
        "FOO.BAR m=1": "unknown opcode",
        "GEMM.NOPE m=1": "sub-function",
        "GEMM.WEIGHT zz=1": "unknown field",
        "GEMM.WEIGHT m=-1": "out of range",
        "GEMM.WEIGHT n=70000": "out of range",
        "GEMM.WEIGHT flags=WHATEVER": "unknown flag",
    }
    for instr, msg in bad_cases.items():
        broken = text.replace("  c0  VEC.RMSNORM", f"  c0  {instr} ;", 1)
        with pytest.raises(FastCarError, match=msg):
            assemble(broken)
    with pytest.raises(FastCarError, match="control opcode"):
        assemble(text.replace("  c0  VEC.RMSNORM", "  c0  BARRIER ;", 1))


def test_board_overrides_and_hashes(tmp_path):
    f = tmp_path / "fast.json"
    f.write_text(json.dumps({"base": "u280", "clock_mhz": 300, "dram_efficiency": 0.9}))
    b = load_board("kv260", f)
    assert b.cores == PRESETS["u280"].cores and b.clock_mhz == 300.0 and b.dram_efficiency == 0.9
    assert b.structural_hash() == PRESETS["u280"].structural_hash()  # timing changes keep programs valid
    assert b.config_hash() != PRESETS["u280"].config_hash()
    assert len({p.structural_hash() for p in PRESETS.values()}) == len(PRESETS)
    for content, msg in [({"cores": 0}, "positive"), ({"nope": 1}, "unknown fields"), ({"cores": 2.5}, "integer"),
                         ({"dram_efficiency": 1.5}, r"\(0, 1\]"), ({"cores": 64}, "<= 32"),
                         ({"dram_stream_efficiency": 1.5}, r"dram_stream_efficiency must be in \(0, 1\]")]:
        f.write_text(json.dumps(content))
        with pytest.raises(FastCarError, match=msg):
            load_board("kv260", f)
    with pytest.raises(FastCarError, match="unknown board"):
        load_board("vu9p")
