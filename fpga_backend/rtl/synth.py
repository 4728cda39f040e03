"""Synthesis of the DRS unit (``fcar_drs``: loader, decoder, dispatcher) with yosys for a board's FPGA family.

yosys's ``synth_xilinx -family xcup`` (UltraScale+, the family of every preset) maps the control path onto
LUTs, flip-flops, block RAM, LUT RAM, carry chains and DSPs; the datapath (the MAC arrays, the DRAM
controller) is not part of it. The counts sit next to the device's capacity from its data sheet. yosys 0.23
(Debian bookworm) reads package names only qualified (``fcar_pkg::NAME``), so the sources are qualified on
the way in; the text is otherwise the one Verilator simulates.

    python -m fastcar_compile.fpga_backend.rtl.synth --board kv260 [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from fastcar_compile.core.errors import FastCarError

from ..hwspec import BoardConfig, load_board
from . import build

TOP = "fcar_drs"


@dataclasses.dataclass(frozen=True)
class Device:
    """Capacity of a board's FPGA, from its data sheet."""

    part: str
    document: str
    luts: int
    ffs: int
    bram36: int
    uram: int
    dsp: int


DEVICES = {
    "kv260": Device("XCK26", "AMD DS987 Kria K26 SOM", luts=117_120, ffs=234_240, bram36=144, uram=64, dsp=1_248),
    "zcu102": Device("XCZU9EG", "AMD DS891 Zynq UltraScale+ MPSoC", luts=274_080, ffs=548_160, bram36=912, uram=0,
                     dsp=2_520),
    "u280": Device("XCU280", "AMD DS963 Alveo U280", luts=1_303_680, ffs=2_607_360, bram36=2_016, uram=960,
                   dsp=9_024),
    "u55c": Device("XCU55C", "AMD DS978 Alveo U55C", luts=1_303_680, ffs=2_607_360, bram36=2_016, uram=960,
                   dsp=9_024),
}
CELL_CLASSES = {  # yosys Xilinx cell -> resource
    "luts": re.compile(r"LUT[1-6]$"),
    "ffs": re.compile(r"FD[RSCP]E$"),
    "bram36": re.compile(r"RAMB36E2$"),
    "bram18": re.compile(r"RAMB18E2$"),
    "lutram": re.compile(r"RAM(32|64|128|256)[MX0-9]*$|RAM32M16$|RAM64M8$"),
    "uram": re.compile(r"URAM288$"),
    "dsp": re.compile(r"DSP48E2$"),
    "carry": re.compile(r"CARRY[48]$"),
}


def qualified(text: str, package_text: str) -> str:
    """The source with ``import fcar_pkg::*;`` removed and every package name written ``fcar_pkg::NAME``."""
    names = set(re.findall(r"localparam\s+(?:int|bit|logic(?:\s*\[[^\]]*\])?)\s+(\w+)\s*=", package_text))
    names |= set(re.findall(r"function automatic \w+(?:\s*\[[^\]]*\])?\s+(\w+)\(", package_text))
    text = re.sub(r"^\s*import fcar_pkg::\*;\n", "", text, flags=re.M)
    return re.sub(r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b", r"fcar_pkg::\1", text)


def synthesize(board: BoardConfig, log=print) -> dict[str, int]:
    """Cell counts of the DRS unit for ``board`` (luts, ffs, bram36, bram18, lutram, uram, dsp, carry)."""
    yosys = shutil.which("yosys")
    if yosys is None:
        raise build.Unavailable("yosys is not installed (Debian/Ubuntu: apt-get install -y yosys)")
    src = build.sources(board)
    with tempfile.TemporaryDirectory(prefix="fcar-synth-") as tmp:
        files = ["fcar_pkg.sv"]
        Path(tmp, "fcar_pkg.sv").write_text(src["fcar_pkg.sv"])
        for name in build.SYNTH_SOURCES:
            Path(tmp, name).write_text(qualified(src[name], src["fcar_pkg.sv"]))
            files.append(name)
        script = (f"read_verilog -sv {' '.join(files)}\n"
                  f"synth_xilinx -family xcup -top {TOP} -flatten -noiopad\n"
                  "tee -o stat.txt stat\n")
        Path(tmp, "synth.ys").write_text(script)
        log(f"rtl: synthesising the DRS unit for {board.name} with yosys (minutes)")
        r = subprocess.run([yosys, "-q", "-l", "yosys.log", "synth.ys"], cwd=tmp, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"yosys failed (exit {r.returncode}): {(r.stderr or r.stdout)[-2000:]}")
        stat = Path(tmp, "stat.txt").read_text()
    counts = dict.fromkeys(CELL_CLASSES, 0)
    for cell, n in re.findall(r"^\s+(\w+)\s+(\d+)\s*$", stat, flags=re.M):
        for key, pattern in CELL_CLASSES.items():
            if pattern.match(cell):
                counts[key] += int(n)
    return counts


def table_rows(board: BoardConfig, counts: dict[str, int]) -> list[dict]:
    """Rows of the resource table: used, the device's capacity, the share."""
    dev = DEVICES.get(board.name)
    out = []
    for key, label in (("luts", "LUT"), ("ffs", "FF"), ("bram36", "BRAM36"), ("lutram", "LUT RAM cells"),
                       ("dsp", "DSP48E2"), ("uram", "URAM")):
        used = counts[key] + (counts["bram18"] / 2 if key == "bram36" else 0)
        cap = getattr(dev, key, None) if dev and key != "lutram" else None
        out.append({"board": board.name, "resource": label, "used": used, "capacity": cap,
                    "share": used / cap if cap else None})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--board", default="kv260")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    board = load_board(a.board)
    try:
        counts = synthesize(board, log=lambda m: print(m, file=sys.stderr))
    except (build.Unavailable, FastCarError) as exc:
        print(f"rtl: {exc}", file=sys.stderr)
        return 2
    rows = table_rows(board, counts)
    if a.json:
        print(json.dumps({"board": board.name, "counts": counts, "rows": rows}))
        return 0
    for r in rows:
        cap = f"{r['capacity']:,}" if r["capacity"] else "-"
        share = f"{r['share']:.2%}" if r["share"] is not None else "-"
        print(f"{r['board']:<8} {r['resource']:<14} {r['used']:>8,.0f} / {cap:>10}  {share}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
