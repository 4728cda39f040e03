"""Text of a co-simulation report (`fastcar-compile sim --rtl`)."""

from __future__ import annotations

from .cosim import CosimReport


def text(report: CosimReport, max_layers: int = 40) -> str:
    """Per policy the totals, per layer the cycles and per-core busy cycles of both sides, then the
    differences (every one; none is the target)."""
    pols = list(report.policies.values())
    lines = [f"RTL co-simulation ({report.board}, batch {report.batch}, {report.steps} steps, {report.stream} weights; "
             f"Verilator + cocotb, {report.rtl_seconds:.1f} s):",
             "  policy  cycles/step RTL  simulator    issued ops  remaps RTL/sim  MLP-cache reads/writes (B)  "
             "replayed rows  stall cycles"]
    for p in pols:
        n = max(1, len(p.rtl_cycles))
        lines.append(f"  {p.policy:<6}  {sum(p.rtl_cycles) / n:>15.0f}  {sum(p.sim_cycles) / n:>9.0f}  {p.issued:>12}  "
                     f"{p.remaps_rtl:>6}/{p.remaps_sim:<7}  {p.cache_reads:>12}/{p.cache_writes:<13}  "
                     f"{p.replayed_rows:>13}  {p.stall_cycles:>12}")
    lines.append("  per layer, all steps: cycles RTL / simulator; busy cycles per core (RTL; '=' where the simulator "
                 "agrees)")
    layers = [r["layer"] for r in pols[0].layer_rows] if pols else []
    for i, layer in enumerate(layers[:max_layers]):
        parts = []
        for p in pols:
            r = p.layer_rows[i] if i < len(p.layer_rows) else None
            if r is None:
                continue
            same = "=" if r["rtl_busy"] == r["sim_busy"] else "!="
            parts.append(f"{p.policy} {r['rtl_cycles']} / {r['sim_cycles']}, busy [{' '.join(map(str, r['rtl_busy']))}] "
                         f"{same}")
        lines.append(f"    layer {layer}: " + "; ".join(parts))
    if len(layers) > max_layers:
        lines.append(f"    ... {len(layers) - max_layers} more layers (--json lists them)")
    sp = report.speedup()
    if sp:
        lines.append(f"  DRS over static: {sp[0]:.3f}x on the RTL, {sp[1]:.3f}x in the simulator")
    lines.append(f"  {len(report.mismatches)} differences" + (":" if report.mismatches else ""))
    lines += [f"    {m}" for m in report.mismatches]
    return "\n".join(lines)
