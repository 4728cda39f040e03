"""Draw the block diagram of the DRS unit's RTL (docs/fpga-drs.png, shown in docs/fpga.md).

    python scripts/draw_drs_diagram.py [--out docs/fpga-drs.png]

Boxes are the SystemVerilog modules of fpga_backend/rtl/sv/ (names in brackets); the datapath boxes on the right
are the latency models behind the issue / done interface; arrows are the signals between them.
"""

from __future__ import annotations

import argparse
import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

from fastcar_compile.core.atomic import write_bytes  # noqa: E402

CONTROL, DATAPATH, HOST, MEMORY = "#dbe8f6", "#f6e3cf", "#e2f0d9", "#eeeeee"


def box(ax, x, y, w, h, title, lines=(), color=CONTROL, size=8.5):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec="#333333",
                                lw=1.0))
    ax.text(x + w / 2, y + h - 0.12, title, ha="center", va="top", fontsize=size, weight="bold")
    for i, line in enumerate(lines):
        ax.text(x + w / 2, y + h - 0.42 - 0.24 * i, line, ha="center", va="top", fontsize=size - 1.5)


def arrow(ax, a, b, label="", style="-|>", color="#222222", off=(0, 0.08), rad=0.0, size=6.5):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=11, lw=1.1, color=color,
                                 connectionstyle=f"arc3,rad={rad}"))
    if label:
        ax.text((a[0] + b[0]) / 2 + off[0], (a[1] + b[1]) / 2 + off[1], label, ha="center", va="bottom",
                fontsize=size, color=color)


def draw() -> bytes:
    fig, ax = plt.subplots(figsize=(13.5, 8.2))
    ax.set_xlim(0, 16.5)
    ax.set_ylim(0, 10)
    ax.axis("off")
    # the DRS unit frame
    ax.add_patch(FancyBboxPatch((2.55, 0.35), 9.2, 9.2, boxstyle="round,pad=0.02,rounding_size=0.15", fc="none",
                                ec="#1f4e79", lw=1.8, ls="--"))
    ax.text(7.15, 9.38, "DRS unit  [fcar_drs]  - synthesised with yosys", ha="center", va="top", fontsize=10,
            weight="bold", color="#1f4e79")
    # host and memory
    box(ax, 0.1, 7.3, 2.2, 1.9, "Host (cocotb)", [".fcb file -> 4-byte beats", "JSON metadata: board,", "binding, batch",
                                          "registers: active rows,", "policy, weight streams"], HOST)
    box(ax, 0.1, 4.1, 2.2, 1.6, "Program memory", ["(DRAM; one 256-bit", "instruction a cycle)"], MEMORY)
    box(ax, 0.1, 1.0, 2.2, 2.0, "TAS datapath", ["q . K[p-L] / sqrt(d)", "score + valid per row", "(per step, layer)"],
        DATAPATH)
    # control path
    box(ax, 2.9, 7.2, 3.3, 1.9, "Loader  [fcar_loader]", ["header: magic, version, sizes,", "slots, hardware hash",
                                                           "CRC-32 over the file", "verdict = encode.Refusal"])
    box(ax, 6.6, 7.2, 2.1, 1.9, "Decoder  [fcar_decode]", ["opcode, slot kind,", "flags, reserved, sub",
                                                            "-> isa.Fault"])
    box(ax, 2.9, 4.3, 3.3, 2.3, "Fetch  [fcar_dispatch]", ["next bundle fetched while", "the current one runs",
                                                            "DRS_DISPATCH, no compute", "row: jump its arg bundles"])
    box(ax, 2.9, 1.0, 3.3, 2.7, "TAS compare + Index Register", ["score > tau (IEEE-754 single)", "TAS register per layer",
                                                                 "DRS_SET latches it (FROM_TAS)", "or its immediate arg",
                                                                 "thresholds thr[1..16]"])
    box(ax, 6.6, 1.0, 2.4, 2.7, "Row queues  [fcar_rowq]", ["compute queue -> allocator", "-> 32 Mapping Registers",
                                                            "(round-robin)", "skip queue -> replay mask",
                                                            "n, s, A_s, A_d"])
    box(ax, 6.6, 4.3, 4.9, 2.3, "Issue / barrier  [fcar_dispatch]", ["SKIP_ON_REPLAY slot: the layer's mapping",
                                                                      "remap iff n > 0, s >= thr[n] (drs.py)",
                                                                      "  (+ DRS_OVERHEAD cycles)",
                                                                      "other slots: arg & active rows",
                                                                      "next bundle when every core + DRAM done"])
    box(ax, 9.3, 1.0, 2.2, 2.7, "MLP-cache ports", ["[fcar_cacheport], per core", "XCHG: replayed row ->", "read,",
                                                    "computed row -> write"])
    # datapath latency models
    box(ax, 12.3, 6.0, 4.0, 3.3, "Cores 0..C-1  (latency models)", ["[fcar_datapath_model]", "MAC array: rows x passes",
                                                                      "vector unit / SFU lanes", "SRAM port bytes/cycle",
                                                                      "issue latency", "-> done, busy"], DATAPATH)
    box(ax, 12.3, 2.6, 4.0, 2.6, "DRAM stream", ["weight tiles (broadcast or per core)",
                                                  "at the stream rate, per-row bytes", "at the mixed rate", "-> done"], DATAPATH)
    box(ax, 12.3, 0.4, 4.0, 1.6, "Replay cache (DRAM)", ["cached MLP outputs per", "layer, row, frame slot"], MEMORY)
    # arrows
    arrow(ax, (2.3, 8.2), (2.9, 8.2), "file")
    arrow(ax, (6.2, 8.15), (6.6, 8.15), "")
    arrow(ax, (2.9, 7.45), (1.2, 5.7), "instructions", off=(-0.55, -0.1), rad=0.1)
    arrow(ax, (2.3, 4.9), (2.9, 4.9), "fetch")
    arrow(ax, (6.2, 5.45), (6.6, 5.45), "bundle")
    arrow(ax, (2.3, 2.0), (2.9, 2.0), "scores")
    arrow(ax, (6.2, 2.35), (6.6, 2.35), "latched")
    arrow(ax, (7.8, 3.7), (7.8, 4.3), "masks", off=(0.35, -0.05))
    arrow(ax, (4.55, 4.3), (4.55, 3.7), "DRS_SET", off=(0.45, -0.05))
    arrow(ax, (10.4, 4.3), (10.4, 3.7), "XCHG", off=(0.35, -0.05))
    arrow(ax, (11.5, 5.8), (12.3, 7.2), "issue: slot + rows", off=(-0.1, 0.15))
    arrow(ax, (12.3, 6.5), (11.5, 5.2), "done", off=(0.15, -0.3), color="#8b0000")
    arrow(ax, (12.3, 3.6), (11.5, 4.6), "done", off=(0.2, -0.05), color="#8b0000")
    arrow(ax, (11.5, 1.9), (12.3, 1.3), "read / write", off=(0.0, 0.05))
    arrow(ax, (14.3, 6.0), (14.3, 5.2), "bytes", off=(0.35, -0.05))
    arrow(ax, (2.3, 7.9), (6.6, 6.1), "registers", off=(1.4, -0.55), rad=-0.05, color="#555555")
    ax.text(8.25, 0.05, "blue: control path (RTL, synthesised)   orange: datapath latency models (co-simulation)   "
            "grey: memories   green: host", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/fpga-drs.png")
    a = p.parse_args(argv)
    write_bytes(a.out, draw())
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
