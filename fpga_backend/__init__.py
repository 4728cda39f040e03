"""fastcar_compile.fpga_backend: FastCar accelerator compiler (partition -> schedule -> encode) and simulator.

Data flows one way: ``partition`` (task graphs) -> ``schedule.emit_program`` (bundles) -> ``encode`` (.fcb)
-> ``simulate.Simulator`` (timing) / ``functional.FunctionalSim`` (numbers). See docs/fpga.md.
"""

from __future__ import annotations

from .compiler import FpgaCompileReport, build_program, compile_to_bundles
from .hwspec import PRESETS, BoardConfig, load_board
from .modelspec import LLAMA2_7B, SMALL_LLAMA, TINY, ModelSpec

__all__ = [
    "BoardConfig", "FpgaCompileReport", "LLAMA2_7B", "ModelSpec", "PRESETS", "SMALL_LLAMA", "TINY", "build_program",
    "compile_to_bundles", "load_board",
]
