"""Board presets against their vendors' data sheets, and a preset used end to end (compile, `sim --board`).

The data-sheet figures below are the vendors' numbers, written here independently of the board files: the
test recomputes what the simulator derives from a board (MACs per cycle, peak MAC/s, bytes per cycle, buffer
bytes) from them by plain arithmetic, so a board file whose figures do not fit its device fails.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass

import numpy as np
import pytest

from fastcar_compile.cli import main as cli
from fastcar_compile.fpga_backend import LLAMA2_7B, ModelSpec, build_program, encode, load_board
from fastcar_compile.fpga_backend.simulate import Simulator

KIB = 1024
BRAM36_KIB = 36 / 8  # one 36 Kb block RAM
URAM_KIB = 288 / 8  # one 288 Kb UltraRAM block


@dataclass(frozen=True)
class DataSheet:
    document: str
    dsp: int  # DSP slices (one 16-bit MAC per slice per cycle)
    bram36: int
    uram: int
    memory_gbps: float  # peak off-chip bandwidth as the document composes it


DATA_SHEETS = {
    # 32 HBM2 pseudo channels x 14.375 GB/s (UG1393 'HBM Configuration and Use'); no DDR4 on this card
    "u55c": DataSheet("AMD DS978 Alveo U55C; UG1393", dsp=9024, bram36=2016, uram=960, memory_gbps=32 * 14.375),
    # DDR4-2400 on a 64-bit bus: 2400 MT/s x 8 bytes
    "kv260": DataSheet("AMD DS987 Kria K26 SOM", dsp=1248, bram36=144, uram=64, memory_gbps=2400e6 * 8 / 1e9),
    "zcu102": DataSheet("AMD DS891 Zynq UltraScale+ (XCZU9EG); UG1182 ZCU102", dsp=2520, bram36=912, uram=0,
                        memory_gbps=2400e6 * 8 / 1e9),
}


@pytest.mark.parametrize("name", sorted(DATA_SHEETS))
def test_board_fits_its_data_sheet(name):
    sheet, board = DATA_SHEETS[name], load_board(name)
    macs = board.cores * board.array_rows * board.array_cols
    assert board.macs_per_cycle == macs
    assert 0.8 * sheet.dsp <= macs <= sheet.dsp  # hwspec.ASSUMPTIONS: the arrays use ~80-95% of the DSPs
    on_chip_kib = sheet.bram36 * BRAM36_KIB + sheet.uram * URAM_KIB
    assert board.cores * (board.weight_buffer_kib + board.act_buffer_kib + board.kv_buffer_kib) <= on_chip_kib
    assert board.dram_gbps == pytest.approx(sheet.memory_gbps, rel=1e-12)
    per_cycle = sheet.memory_gbps * 1e9 * board.dram_efficiency / (board.clock_mhz * 1e6)
    assert board.dram_bytes_per_cycle == pytest.approx(per_cycle, rel=1e-12)
    stream = sheet.memory_gbps * 1e9 * board.dram_stream_efficiency / (board.clock_mhz * 1e6)
    assert board.dram_stream_bytes_per_cycle == pytest.approx(stream, rel=1e-12)
    assert board.dram_efficiency <= board.dram_stream_efficiency  # a sequential stream is never the slower class


def test_u55c_derived_figures():
    """The Alveo U55C preset: 8 x 32x32 arrays at 250 MHz = 2.048 TMAC/s; 460 GB/s x 0.8 = 1,472 B a cycle."""
    board = load_board("u55c")
    assert board.macs_per_cycle * board.clock_mhz * 1e6 == 8 * 32 * 32 * 250e6 == 2.048e12
    assert board.dram_bytes_per_cycle == pytest.approx(460e9 * 0.8 / 250e6) == 1472
    assert board.weight_tile_bytes == 3072 * KIB // 2  # double buffered: half the weight buffer is one tile
    assert board.structural_hash() != load_board("u280").structural_hash()  # u280 programs do not run on it


def _llama_bytes(spec: ModelSpec, context: int) -> float:
    """One batch-1 decode step's DRAM bytes from the dims: every weight once (q, k, v, o, gate, up, down and
    the LM head) plus the KV cache read and the new token's K and V written."""
    h, i, kvd = spec.hidden, spec.intermediate, spec.kv_heads * spec.head_dim
    weights = spec.layers * (2 * h * h + 2 * h * kvd + 3 * h * i) + h * spec.vocab
    kv = spec.layers * 2 * (context + 1) * kvd
    return (weights + kv) * spec.dtype_bytes


def test_u55c_simulates_a_7b_decode_step_at_its_hbm_bandwidth():
    """LLaMA-2-7B dims at batch 1 stream 13.5 GB of weights a step: bandwidth bound, so the step's modelled
    cycles are the data sheet's 460 GB/s (times the board's efficiency) expressed in clock cycles plus issue
    latencies, which stay under 25% here: the simulator's cycle count against the analytic bandwidth floor."""
    board, context = load_board("u55c"), 512
    sim = Simulator(build_program(LLAMA2_7B, board, batch=1, context=context))
    res = sim.run(np.zeros((1, LLAMA2_7B.layers, 1), bool), context, policy="static")
    sheet = DATA_SHEETS["u55c"]
    bytes_per_cycle = sheet.memory_gbps * 1e9 * board.dram_efficiency / (board.clock_mhz * 1e6)
    floor_cycles = _llama_bytes(LLAMA2_7B, context) / bytes_per_cycle
    assert res.bound == "bandwidth"
    assert floor_cycles <= res.cycles <= 1.25 * floor_cycles
    assert res.cycles >= res.macs / sheet.dsp  # never beats the DSPs (one MAC per DSP per cycle)


def test_every_preset_is_listed_by_the_command_line_help():
    """The help texts list the board files themselves: a new preset needs no edit in the CLI."""
    from fastcar_compile.cli.compile import build_parser
    from fastcar_compile.cli.sim import board_presets
    from fastcar_compile.fpga_backend.hwspec import PRESETS

    assert board_presets() == ", ".join(sorted(PRESETS)) and "u55c" in PRESETS
    assert board_presets() in " ".join(build_parser().format_help().split())


def test_u55c_from_the_command_line(zoo_model, tmp_path):
    """`--target fpga --board u55c` compiles a plain export, `sim --board u55c` runs it; a u280 program is
    refused on it (other buffers: the program was tiled for other tiles)."""
    plain = zoo_model("llama", "dynamo20")
    fcb = tmp_path / "dense.fcb"
    assert cli([str(plain), "--target", "fpga", "--board", "u55c", "--dense", "--context", "16", "--batch", "4",
                "-o", str(fcb)]) == 0
    assert encode.load(fcb).board.name == "u55c"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli(["sim", str(fcb), "--board", "u55c", "--policy", "static", "--json"]) == 0
    static = json.loads(buf.getvalue())["static"]
    assert static["board"] == "u55c" and static["cycles_per_step"] > 0
    other = tmp_path / "u280.fcb"
    assert cli([str(plain), "--target", "fpga", "--board", "u280", "--dense", "--context", "16", "-o",
                str(other)]) == 0
    assert cli(["sim", str(other), "--board", "u55c"]) != 0
