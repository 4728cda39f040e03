"""What every discovery matcher shares: the failure type, the per-model context, and "try these in order".

A matcher is a small function that either returns what it found or raises `MatchFailure` with the reason
(as onnxscript's `MatchResult().fail(reason)`); `first_match` tries the forms of one anchor in order and,
when none fits, fails with every form's reason, so `--inspect` can say what each form expected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import onnx_ir as ir

T = TypeVar("T")


class MatchFailure(Exception):
    """A layer did not match; `anchor` is what was missing, `where` where the search stopped."""

    def __init__(self, anchor: str, reason: str, where: str = "", applies: bool = True):
        super().__init__(reason)
        self.anchor = anchor
        self.reason = reason
        self.where = where
        # False when the form does not apply at all (wrong op kind): its reason is kept out of the summary
        # when another form got further.
        self.applies = applies


@dataclass
class MatchContext:
    """Per-model facts the matchers share: the graph, its node order, and the trace of the current layer."""

    graph: ir.Graph
    order: dict[ir.Node, int] = field(default_factory=dict)
    nodes: list[ir.Node] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, graph: ir.Graph) -> MatchContext:
        nodes = list(graph)
        return cls(graph, {n: i for i, n in enumerate(nodes)}, nodes)


def first_match(anchor: str, forms: Sequence[tuple[str, Callable[[], T]]], trace: list[str]) -> tuple[str, T]:
    """The first form that matches, as (form name, result); else a MatchFailure naming every form's reason."""
    failures: list[tuple[str, MatchFailure]] = []
    for name, matcher in forms:
        try:
            result = matcher()
        except MatchFailure as exc:
            failures.append((name, exc))
            continue
        if failures:
            trace.append(f"{anchor}: {name} (after " + ", ".join(f"{n}: no" for n, _ in failures) + ")")
        return name, result
    if len(failures) == 1:
        raise failures[0][1]
    for name, exc in failures:
        where = f" (search stopped at {exc.where})" if exc.where else ""
        trace.append(f"{anchor} as {name}: {exc.reason}{where}")
    relevant = [(name, exc) for name, exc in failures if exc.applies] or failures
    first = relevant[0][1]
    reason = "; ".join(f"{name}: {exc.reason}" for name, exc in relevant)
    raise MatchFailure(anchor, reason, first.where)
