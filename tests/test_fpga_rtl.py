"""The RTL of the DRS dispatcher against the Python side: Verilator + cocotb co-simulation of real compiled
bundles (every bundle's cycles, the issued operations, per-core cycles, DRAM bytes, remaps, replayed rows and
MLP-cache traffic equal the simulator's), the loader's verdicts on fuzzed files equal the decoder's, and the
TAS comparator equals NumPy's float32 `>` on adversarial scores. The default suite co-simulates one small
bundle (the kv260 model is built once, ~1-2 min on two cores, then cached); `pytest -m slow` runs the matrix
of board presets x replay 0/50/100% x batch 1/16, the 7B-shaped U280 DRS speed-up and the synthesis."""

from __future__ import annotations

import dataclasses
import json
import re
import struct
import zlib

import fcb_fuzz
import numpy as np
import pytest

from fastcar_compile.fpga_backend import SMALL_LLAMA, TINY, build_program, encode, isa, load_board, masks
from fastcar_compile.fpga_backend.hwspec import PRESETS
from fastcar_compile.fpga_backend.rtl import build, cosim
from fastcar_compile.fpga_backend.rtl.pkg import package

try:
    build.tool_versions()
    UNAVAILABLE = None
except build.Unavailable as exc:
    UNAVAILABLE = str(exc)
needs_rtl = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"RTL co-simulation unavailable: {UNAVAILABLE}")

KV260 = load_board("kv260")
MATRIX_SPEC = SMALL_LLAMA


def test_package_is_generated_from_the_python_definitions():
    """The SV package carries every opcode, flag, fault and refusal under its Python name and the header layout
    of encode.HEADER; the hand-written sources spell none of those numbers (they use the package's names)."""
    text = package(KV260)
    for op in isa.Op:
        assert f"OP_{op.name} = 8'd{int(op)};" in text
    for fault in isa.Fault:
        assert f"FAULT_{fault.name} = 3'd{int(fault)};" in text
    for r in encode.Refusal:
        assert f"REFUSE_{r.name} = 4'd{int(r)};" in text
    # the header offsets, checked against struct.pack of a header with distinct field values
    fields = [b"FCAR", 2, 3, 0x0807060504030201, 5, 6, 7, 8, 9, 10]
    head = encode.HEADER.pack(*fields)
    for name, value in zip(("MAGIC", "VERSION", "HEADER_BYTES", "HW_HASH", "CORES", "SLOTS", "INSTR_BYTES",
                            "RESERVED", "BUNDLES", "META_BYTES"), fields, strict=True):
        lsb = int(re.search(rf"H_{name}_LSB = (\d+);", text).group(1))
        width = int(re.search(rf"H_{name}_W = (\d+);", text).group(1))
        want = int.from_bytes(value, "little") if isinstance(value, bytes) else value
        assert int.from_bytes(head, "little") >> lsb & ((1 << width) - 1) == want, name
    assert f"STRUCT_HASH = 64'h{KV260.structural_hash():016x};" in text
    # 19.2 GB/s / 300 MHz: the weight stream x 0.9 = 57.6 B a cycle (5/288 cycles a byte), the rest x 0.75 = 48
    assert all(f"{n} = 64'd{v};" in text for n, v in (("DRAM_W_MUL", 5), ("DRAM_O_MUL", 6), ("DRAM_DIV", 288)))
    for name in build.SOURCES:
        src = (build.SV_DIR / name).read_text()
        src = re.sub(r"//.*", "", src)
        assert not re.search(r"\bOP_\w+\s*=|localparam\s+logic\s*\[7:0\]\s+(OP|FLAG|SPACE|VEC)_", src), name
        assert "8'd7" not in src and "8'd8" not in src, name  # DRS_SET / DRS_DISPATCH by number


@pytest.fixture(scope="module")
def kv260_model():
    if UNAVAILABLE:
        pytest.skip(f"RTL co-simulation unavailable: {UNAVAILABLE}")
    return build.build(KV260, log=lambda m: None)


@needs_rtl
def test_small_bundle_cycle_for_cycle(kv260_model):
    """A real compiled program (TINY, kv260, batch 4) over steps with 0 / 50 / 100% clustered replay, both
    policies: every bundle, operation, per-core cycle count, byte and replayed row as the simulator has it."""
    program = build_program(TINY, KV260, batch=4, context=8)
    replay = np.concatenate([masks.synthetic(r, 4, TINY.layers, 2, kind="clustered", seed=3) for r in (0, 0.5, 1)])
    report = cosim.cosimulate(program, replay, np.arange(8, 14), log=lambda m: None)
    assert report.ok, "\n".join(report.mismatches)
    for pol in ("static", "drs"):
        p = report.policies[pol]
        assert p.rtl_cycles == [int(c) for c in p.sim_cycles] and len(p.rtl_cycles) == 6
        assert p.stall_cycles == 0
    # replay is real: the 100% steps issue fewer operations than the 0% ones, and the cache served reads
    assert report.policies["drs"].cache_reads > 0 and report.policies["drs"].replayed_rows == 2 * 4 * 2 + 2 * 2 * 2


@needs_rtl
def test_tas_comparator_equals_numpy_float32(kv260_model):
    """The RTL's replay decisions from adversarial TAS scores (NaN, +-0, +-inf, subnormals, tau's neighbours,
    invalid scores) equal NumPy's `valid & (score > tau)` in float32, for tau 0, -0 and a random value."""
    rng = np.random.default_rng(11)
    for tau in (0.0, -0.0, float(np.float32(rng.standard_normal()))):
        program = build_program(dataclasses.replace(TINY, threshold=tau), KV260, batch=4, context=8)
        t = np.float32(tau)
        pool = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4028235e38, -3.4028235e38,
                         np.nextafter(t, np.float32(np.inf)), np.nextafter(t, np.float32(-np.inf)), t], np.float32)
        steps = 4
        pick = rng.integers(len(pool) + 1, size=(steps, TINY.layers, isa.MAX_ROWS))
        scores = np.where(pick < len(pool), pool[np.minimum(pick, len(pool) - 1)],
                          rng.standard_normal(pick.shape).astype(np.float32))
        valid = rng.random(scores.shape) < 0.8
        with np.errstate(invalid="ignore"):
            replay = (valid & (scores > t))[:, :, :4]
        report = cosim.cosimulate(program, replay, 8, policies=("drs",), tas=(scores, valid), log=lambda m: None)
        assert report.ok, (tau, report.mismatches[:3])
        assert report.policies["drs"].replayed_rows == int(replay.sum())


def _recrc(data: bytes) -> bytes:
    return data[:-4] + struct.pack("<I", zlib.crc32(data[:-4]))


def _targeted(image: bytes) -> list[bytes]:
    """One file per refusal the loader can meet (header fields, CRC, size, hash, each instruction fault)."""
    meta_len = encode.HEADER.unpack_from(image, 0)[-1]
    base = encode.HEADER.size + meta_len
    slots = KV260.cores + 1

    def field(off: int, fmt: str, value: int) -> bytes:
        out = bytearray(image)
        struct.pack_into(fmt, out, off, value)
        return _recrc(bytes(out))

    def instr(index: int, name: str, value: int) -> bytes:
        out = bytearray(image)
        off = base + index * isa.INSTR_BYTES + isa.INSTR_DTYPE.fields[name][1]
        struct.pack_into("<" + isa.INSTR_DTYPE[name].str[1:].replace("u1", "B").replace("u2", "H").replace("u4", "I"),
                         out, off, value)
        return _recrc(bytes(out))

    files = [image, image[:20], b"XXXX" + image[4:], field(4, "<H", 2), image[:-5] + image[-4:],
             field(6, "<H", 31), field(20, "<H", 16), field(22, "<H", 1), field(16, "<H", 5), field(18, "<H", 9),
             _recrc(image[:-4] + b"\0" * 32 + image[-4:]), field(8, "<Q", 12345),
             instr(2 * slots, "opcode", 0xEE), instr(2 * slots + 1, "opcode", int(isa.Op.BARRIER)),
             instr(3 * slots - 1, "opcode", int(isa.Op.GEMM)), instr(7, "flags", 0x80), instr(9, "reserved", 1),
             instr(10, "sub", 9), encode.encode(build_program(TINY, load_board("u280"), batch=2, context=8))]
    # two faults: the decoder names the first in stream order, with its first failing check
    two = bytearray(instr(40, "opcode", 0xEE))
    struct.pack_into("<B", two, base + 12 * isa.INSTR_BYTES + 1, 0xF0)
    struct.pack_into("<B", two, base + 12 * isa.INSTR_BYTES + 5, 3)
    files.append(_recrc(bytes(two)))
    return files


@needs_rtl
def test_loader_refuses_exactly_where_the_decoder_does(kv260_model):
    """Fuzzed bundles (tests/fcb_fuzz.py's mutation modes) and one file per refusal: the RTL loader's verdict
    (refusal, instruction fault, instruction index) equals encode.decode's on every file whose bytes it reads;
    files decode refuses for their JSON metadata are the host's to refuse (counted, never sent)."""
    rng = np.random.default_rng(5)
    progs = fcb_fuzz.base_programs()
    files = _targeted(encode.encode(progs[1])) + [fcb_fuzz.mutate(progs[i % 2], rng) for i in range(240)]
    want = [cosim.reference_verdict(f, KV260) for f in files]
    sent = [f for f, w in zip(files, want, strict=True) if w is not None]
    got = cosim.loader_verdicts(KV260, sent, log=lambda m: None)
    expected = [w for w in want if w is not None]
    diffs = [(i, g, w) for i, (g, w) in enumerate(zip(got, expected, strict=True)) if tuple(g) != w]
    assert not diffs, diffs[:5]
    codes = {w[0] for w in expected}
    assert codes >= {int(r) for r in encode.Refusal if r != encode.Refusal.META}, codes
    assert {w[1] for w in expected} >= {int(f) for f in isa.Fault}
    assert len(sent) > len(files) // 2


@needs_rtl
def test_sim_rtl_cli(kv260_model, tmp_path, capsys):
    """`fastcar-compile sim MODEL.fcb --replay-trace run.json --rtl` co-simulates and says so; a program the
    dispatcher cannot run is refused in one line."""
    from fastcar_compile.cli import main

    fcb = tmp_path / "m.fcb"
    encode.save(build_program(TINY, KV260, batch=4, context=8), fcb)
    steps = [{"pos": 8 + i, "replay": [[int((i + r) % 3 == 0) for r in range(4)] for _ in range(2)]} for i in range(3)]
    trace = tmp_path / "run.json"
    trace.write_text(json.dumps({"layers": [0, 1], "batch": 4, "steps": steps}))
    assert main(["sim", str(fcb), "--replay-trace", str(trace), "--rtl", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rtl"]["mismatches"] == [] and out["rtl"]["policies"]["drs"]["rtl_cycles"] == \
        [int(c) for c in out["rtl"]["policies"]["drs"]["sim_cycles"]]
    assert out["rtl"]["policies"]["drs"]["replayed_rows"] == sum(map(sum, (s["replay"][0] for s in steps))) * 2
    # a DRS_DISPATCH stripped of its DRS_SET: the dispatcher has no Index Register to map
    from fastcar_compile.fpga_backend import asm

    text = asm.disassemble(encode.load(fcb)).replace("ctl DRS_SET flags=FROM_TAS", "ctl NOP", 1)
    src = tmp_path / "m.s"
    src.write_text(re.sub(r"ctl NOP m=\d+ k=\d+ off_m=\d+ off_k=\d+", "", text))
    bad = tmp_path / "bad.fcb"
    assert main(["asm", str(src), "-o", str(bad)]) == 0
    capsys.readouterr()
    assert main(["sim", str(bad), "--steps", "1", "--rtl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "RTL cannot run" in err[0] and "DRS_SET" in err[0]


# ---------------------------------------------------------------------------------------------------- slow
@needs_rtl
@pytest.mark.slow
@pytest.mark.parametrize("board", sorted(PRESETS))
@pytest.mark.parametrize("batch", [1, 16])
def test_matrix_presets_replay_batches(board, batch):
    """Every preset x batch 1 / 16 x replay 0 / 50 / 100% (random and clustered masks), both policies, and
    per-core weight streams on top: identical cycles per bundle, layer and core, no operation out of order."""
    cfg = load_board(board)
    for stream in ("broadcast", "per_core"):
        program = build_program(MATRIX_SPEC, cfg, batch=batch, context=48, weights=stream)
        replay = np.concatenate([masks.synthetic(r, batch, MATRIX_SPEC.layers, 2, kind=k, seed=7)
                                 for r in (0.0, 0.5, 1.0) for k in masks.MASK_KINDS])
        report = cosim.cosimulate(program, replay, 48 + np.arange(len(replay)), stream=stream, log=lambda m: None)
        assert report.ok, "\n".join(report.mismatches[:10])
        for p in report.policies.values():
            assert p.rtl_cycles == [int(c) for c in p.sim_cycles]


@needs_rtl
@pytest.mark.slow
def test_u280_drs_speedup_on_the_rtl_equals_the_simulator():
    """LLaMA-2-7B dims on the U280 at batch 32 (the docs' compute-bound case), clustered 50% / 80% replay: the
    DRS-over-static speed-up measured on the RTL is the simulator's, and DRS gains there (>= 1.10x)."""
    from fastcar_compile.fpga_backend import LLAMA2_7B

    program = build_program(LLAMA2_7B, load_board("u280"), batch=32, context=1152)
    for ratio in (0.5, 0.8):
        replay = masks.synthetic(ratio, 32, LLAMA2_7B.layers, 1, kind="clustered", seed=0)
        report = cosim.cosimulate(program, replay, 1152, log=lambda m: None)
        assert report.ok, "\n".join(report.mismatches[:10])
        rtl, sim = report.speedup()
        assert rtl == sim and rtl >= 1.10, (ratio, rtl)


@needs_rtl
@pytest.mark.slow
def test_dense_int4_7b_kv260_streams_at_the_dram_rate():
    """A dense LLaMA-2-7B-shaped (VILA-U-7B backbone) int4 decode on the KV260 preset, batch 1, context 256: the
    simulator keeps the DRAM stream busy >= 95% of the step (cycles vs the bytes it moves over the board's
    effective rates, from the dims: 3.3 GB of int4 weights at the stream rate + fp16 KV at the mixed one), and
    the RTL runs the same schedule to the cycle; that is 80-90% of the bound at the peak 19.2 GB/s."""
    from fastcar_compile.fpga_backend import LLAMA2_7B

    board = load_board("kv260")
    program = build_program(LLAMA2_7B, board, batch=1, context=256, dense=True, weight_bits=4)
    s = LLAMA2_7B
    weights = (sum(s.layer_weight_elems().values()) * s.layers + s.hidden * s.vocab) // 2
    kv = s.layers * (2 * 256 * s.kv_dim + 2 * s.kv_dim) * s.dtype_bytes
    acts = (s.hidden + s.vocab) * s.dtype_bytes
    floor = weights / board.dram_stream_bytes_per_cycle + (kv + acts) / board.dram_bytes_per_cycle
    report = cosim.cosimulate(program, np.zeros((1, s.layers, 1), bool), 256, policies=("static",),
                              log=lambda m: None)
    assert report.ok, "\n".join(report.mismatches[:10])
    cycles = report.policies["static"].rtl_cycles[0]
    assert cycles == report.policies["static"].sim_cycles[0]
    assert floor <= cycles <= floor / 0.95
    peak_floor = (weights + kv + acts) / (board.dram_gbps * 1e9 / (board.clock_mhz * 1e6))
    assert 0.8 <= peak_floor / cycles <= 0.9
