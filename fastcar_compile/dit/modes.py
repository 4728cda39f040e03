"""FAST-AR and FastCar settings of the DiT stream, each declared once (options.Option, as the compiler's are).

`FastARSettings` (the runtime's), the `fastcar-compile stream` flags and the record in stream.json all derive
from `DIT_OPTIONS`, so each can later become a compile option by moving its entry (those already moved,
e.g. AnnCA's and the bucket tables', are core.options' entries, listed here by reference). Defaults are all
off: the stream is then the dense rollout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.options import BY_NAME as SHARED
from fastcar_compile.core.options import SWITCH, TEMPCACHE_MATCHES, Option, check_quant_dirs

GROUP = "FAST-AR and FastCar (eager runtime: give a DiT preset or folder; docs/dit.md)"

DIT_OPTIONS: tuple[Option, ...] = (
    Option("tempcache", str | None, None, "TempCache at cache-write time: a written key merges into its temporal "
           "correspondent's slot when their pre-RoPE cosine exceeds --tempcache-sim (last key kept, running mean "
           "value, count, +log(count) on the logit). Correspondent: 'aligned' = the same (h, w) one frame back; "
           "'lsh' / 'quant' = the top-1 match among the previous frame's slots sharing a bucket",
           "--tempcache", choices=TEMPCACHE_MATCHES, group=GROUP),
    Option("tempcache_sim", float, 0.9, "TempCache's cosine threshold (default 0.9, the paper's)", "--tempcache-sim",
           metavar="SIM", lo=-1.0, hi=1.0, meaning="a cosine", group=GROUP),
    Option("tempcache_budget", int, 0, "TempCache's slot budget: per row and head at most FRAMES frames' worth of "
           "slots besides the sink frames; when a write exceeds it, the slots whose newest member is oldest leave "
           "first (a slot that keeps merging stays). With --window 0 the merges alone leave the cache growing "
           "with every new token; the budget holds it flat (0: none, default)", "--tempcache-budget",
           metavar="FRAMES", lo=0, hi=1 << 20, meaning="frames of slots", group=GROUP),
    SHARED["annsa"],
    SHARED["annsa_local"],
    SHARED["lsh_bits"],
    SHARED["quant_dirs"],
    SHARED["ann_tables"],
    SHARED["annca"],
    Option("fastcar_tau", float | None, None, "FastCar on DiT blocks: a token's FFN output is replayed from the "
           "same (h, w) one frame earlier at the same denoising step when its TAS (query vs the key one frame "
           "back, mean over heads, / sqrt(d)) exceeds TAU; the other rows alone go through the FFN",
           "--fastcar-tau", metavar="TAU", lo=-1e30, hi=1e30, meaning="a TAS threshold", group=GROUP),
    Option("fastcar_ratio", float | None, None, "calibrate --fastcar-tau to this replay ratio on a first chunk "
           "pair (the TAS quantile), instead of giving TAU", "--fastcar-ratio", metavar="R", lo=0.0, hi=1.0,
           meaning="a replay ratio", group=GROUP),
    Option("diagnostics", bool, False, "also attend densely on the side: recall per layer and mode in stream.json "
           "(costs a dense pass and an uncompressed copy of the cache)", "--diagnostics", cli=SWITCH, group=GROUP),
    SHARED["ann_seed"],
)
BY_NAME = {o.name: o for o in DIT_OPTIONS}


FastARSettings = dataclasses.make_dataclass(
    "FastARSettings", [(o.name, o.type, dataclasses.field(default=o.default)) for o in DIT_OPTIONS], frozen=True)
FastARSettings.__doc__ = "The FAST-AR / FastCar settings of one stream (fields: DIT_OPTIONS)."


def settings(**values: Any) -> Any:
    """A checked FastARSettings (each value through its Option; cross-field rules here)."""
    bad = sorted(set(values) - set(BY_NAME))
    if bad:
        raise FastCarError(f"unknown FAST-AR setting {bad[0]!r}; known: {', '.join(BY_NAME)}")
    out = {k: BY_NAME[k].check(v) for k, v in values.items()}
    s = FastARSettings(**out)
    check_quant_dirs(s.quant_dirs)
    if s.tempcache_budget and s.tempcache is None:
        raise FastCarError("--tempcache-budget bounds TempCache's slots: give --tempcache too")
    if s.fastcar_tau is not None and s.fastcar_ratio is not None:
        raise FastCarError("give --fastcar-tau or --fastcar-ratio, not both")
    return s


def is_dense(s: Any) -> bool:
    """No mode on: the stream must equal the dense rollout."""
    return s.tempcache is None and s.annsa is None and not s.annca and s.fastcar_tau is None \
        and s.fastcar_ratio is None


def record(s: Any) -> dict[str, Any]:
    """What stream.json records (every field, by its option name)."""
    return dataclasses.asdict(s)


def label(s: Any) -> str:
    """A short name of the mode combination (tables, figure legends)."""
    parts = [f"TempCache-{s.tempcache}"] * (s.tempcache is not None) + [f"AnnSA-{s.annsa}"] * (s.annsa is not None)
    parts += ["AnnCA"] * s.annca
    if s.fastcar_tau is not None or s.fastcar_ratio is not None:
        parts.append("FastCar")
    return " + ".join(parts) or "dense"
