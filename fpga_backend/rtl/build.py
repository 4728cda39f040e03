"""Verilator build of the co-simulation model (``tb_top``, cocotb's VPI library, ``sv/fcar_main.cpp``), cached per board.

One build per board description and source: ~/.cache/fastcar-compile/rtl/<board>-<hash>/Vtop, the hash over
the generated package, every SystemVerilog source, the Verilator and cocotb versions and the flags (the
runtime's native kernels use the same cache root). A build takes a few minutes on two cores; later calls find
it. Concurrent callers serialise on a lock file; the build directory appears atomically.

    python -m fastcar_compile.fpga_backend.rtl.build [--board kv260]     (prints the binary's path)
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from fastcar_compile.runtime.native.build import CACHE_ROOT

from ..hwspec import BoardConfig, load_board
from .pkg import package

SV_DIR = Path(__file__).resolve().parent / "sv"
# dependency order: package first (generated), then leaf modules up to the top
SOURCES = ("fcar_decode.sv", "fcar_loader.sv", "fcar_rowq.sv", "fcar_cacheport.sv",
           "fcar_dispatch.sv", "fcar_drs.sv", "fcar_datapath_model.sv", "tb_top.sv")
SYNTH_SOURCES = SOURCES[:6]  # the DRS unit: loader, decoder, dispatcher (fcar_drs is the top)
TOP = "tb_top"
MAIN = "fcar_main.cpp"  # the simulation loop: cocotb's VPI callback regions, the clock driven from C++
# time unit = precision = 1 ns: the main loop runs a clock cycle every 2 ns (cosim_bench.CLOCK_NS)
FLAGS = ("-cc", "--exe", "--vpi", "--timescale", "1ns/1ns", "-DCOCOTB_SIM=1", "--top-module", TOP,
         "--prefix", "Vtop", "-o", "Vtop", "-Wno-fatal", "-Wno-lint", "-Wno-style", "-O3")
MAKE_FLAGS = ("OPT_FAST=-O2", "OPT_SLOW=-O1", "OPT_GLOBAL=-O2")


class Unavailable(Exception):
    """The co-simulation cannot run here (no Verilator, no C++ compiler, no cocotb); the message says what to
    install, in one line."""


def tool_versions() -> dict[str, str]:
    """Versions of the tools a build depends on; raises Unavailable naming what is missing."""
    verilator = shutil.which("verilator")
    if verilator is None:
        raise Unavailable("verilator is not installed (Debian/Ubuntu: apt-get install -y verilator)")
    if shutil.which("make") is None or (shutil.which("g++") is None and not os.environ.get("CXX")):
        raise Unavailable("make and a C++ compiler are needed to build the Verilator model (apt-get install -y "
                          "build-essential)")
    try:
        import cocotb
        from find_libpython import find_libpython
    except ImportError:
        raise Unavailable("cocotb is not installed (pip install -c constraints.txt -e '.[fpga]')") from None
    if not find_libpython():
        raise Unavailable("cocotb embeds Python through its shared library, which this Python lacks (Debian: "
                          "apt-get install -y libpython3-dev)")
    out = subprocess.run([verilator, "--version"], capture_output=True, text=True).stdout.split()
    return {"verilator": out[1] if len(out) > 1 else "?", "cocotb": cocotb.__version__,
            "cocotb_libs": str(Path(cocotb.__file__).parent / "libs")}


def sources(board: BoardConfig) -> dict[str, str]:
    """File name -> text of everything the model is built from (the package generated for ``board``)."""
    out = {"fcar_pkg.sv": package(board)}
    for name in (*SOURCES, MAIN):
        out[name] = (SV_DIR / name).read_text()
    return out


def build_dir(board: BoardConfig) -> Path:
    """Where the model for this board and these sources lives (built or not)."""
    h = hashlib.sha256()
    for name, text in sources(board).items():
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    h.update(repr(sorted(tool_versions().items())).encode() + " ".join(FLAGS + MAKE_FLAGS).encode())
    safe = "".join(ch if ch.isalnum() else "_" for ch in board.name)[:40]
    return CACHE_ROOT / "rtl" / f"{safe}-{h.hexdigest()[:12]}"


def build(board: BoardConfig, log=print) -> Path:
    """The Vtop binary of ``board``'s model, built into the cache when absent. Raises Unavailable, or
    RuntimeError when Verilator or the compiler fails."""
    import cocotb

    final = build_dir(board)
    binary = final / "Vtop"
    if binary.is_file():
        return binary
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if binary.is_file():
            return binary
        tmp = final.parent / f".{final.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        files = []
        for name, text in sources(board).items():
            (tmp / name).write_text(text)
            files.append(str(tmp / name))
        libs = Path(cocotb.__file__).parent / "libs"
        cmd = ["verilator", *FLAGS, "-Mdir", str(tmp / "obj"), "-LDFLAGS",
               f"-Wl,-rpath,{libs} -L{libs} -lcocotbvpi_verilator", *files]
        log(f"rtl: building the {board.name} model with Verilator (once per board and source; a few minutes)")
        for step in (cmd, ["make", "-s", "-C", str(tmp / "obj"), "-f", "Vtop.mk", f"-j{min(4, os.cpu_count() or 1)}",
                           *MAKE_FLAGS]):
            r = subprocess.run(step, capture_output=True, text=True)
            if r.returncode != 0:
                shutil.rmtree(tmp, ignore_errors=True)
                raise RuntimeError(f"RTL model build failed ({step[0]} exit {r.returncode}): "
                                   + (r.stderr or r.stdout)[-3000:])
        os.replace(tmp / "obj" / "Vtop", tmp / "Vtop")
        shutil.rmtree(tmp / "obj", ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    log(f"rtl: built {binary}")
    return binary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--board", default="kv260", help="board preset or name of a board file's board")
    ap.add_argument("--board-file", help="JSON file overriding board figures")
    a = ap.parse_args(argv)
    try:
        print(build(load_board(a.board, a.board_file), log=lambda m: print(m, file=sys.stderr)))
    except Unavailable as exc:
        print(f"rtl: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
