"""`CompileReport`: what discovery found per layer and what the rewrite did (what `--inspect` prints)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastcar_compile.passes.discover import LayerMatch


@dataclass
class LayerReport:
    layer: int
    matched: bool
    rewritten: bool
    summary: str
    trace: list[str] = field(default_factory=list)


@dataclass
class CompileReport:
    """Per-layer discovery results, notes, the metadata written and the passes that ran."""

    layers: list[LayerReport]
    notes: list[str] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    passes: list[str] = field(default_factory=list)
    plan: list[str] = field(default_factory=list)  # passes/plan.py Plan.lines(): per layer, what is built
    unit: str = "decoder layers"  # what a layer is ("DiT blocks" for a video DiT's step graph)

    @classmethod
    def from_matches(cls, matches: list[LayerMatch]) -> CompileReport:
        return cls([LayerReport(m.layer, m.ok, False, summary(m), m.trace) for m in matches])

    @classmethod
    def from_dit_matches(cls, matches: list) -> CompileReport:
        """The DiT target's blocks (passes/dit_discover.DiTBlockMatch: each says its own summary)."""
        return cls([LayerReport(m.layer, m.ok, False, m.summary(), m.trace) for m in matches], unit="DiT blocks")

    @property
    def rewritten(self) -> list[int]:
        return [r.layer for r in self.layers if r.rewritten]

    @property
    def matched(self) -> list[int]:
        return [r.layer for r in self.layers if r.matched]

    def __str__(self) -> str:  # print(report) reads like --inspect
        return self.format()

    def format(self, verbose: bool = False) -> str:
        lines = [f"{len(self.matched)}/{len(self.layers)} {self.unit} matched"]
        for r in self.layers:
            state = "rewritten" if r.rewritten else ("matched" if r.matched else "NOT MATCHED")
            lines.append(f"  layer {r.layer:>3}: {state:<11} {r.summary}")
            if verbose or not r.matched:
                lines.extend(f"               {t}" for t in r.trace)
        if verbose and self.plan:
            lines.append("plan:")
            lines.extend(f"  {p}" for p in self.plan)
        lines.extend(f"note: {n}" for n in self.notes)
        if verbose and self.passes:
            lines.append("passes:")
            lines.extend(f"  {i + 1}. {p}" for i, p in enumerate(self.passes))
        return "\n".join(lines)


def summary(m: LayerMatch) -> str:
    """One line per layer: the blocks found, or the anchor that is missing and where the search stopped."""
    if m.failure is not None:
        where = f" (search stopped at {m.failure.where})" if m.failure.where else ""
        return f"missing anchor '{m.failure.anchor}': {m.failure.reason}{where}"
    a, b = m.attention, m.mlp
    extra = "".join([" (fused norm)" if b.fused_norm else "", " (parallel residual)" if b.form == "parallel residual"
                     else "", f" (sliding window {a.window or '?'})" if a.sliding_window else "",
                     f" (rope TAS refused: {a.rope_refusal})" if a.rope_refusal else ""])
    return (f"heads {a.num_heads}/{a.num_kv_heads}x{a.head_dim}, rotary {a.rope}, "
            f"MLP {len(b.nodes)} nodes {b.weights}{extra}")
