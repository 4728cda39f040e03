"""FAST-AR and FastCar settings of the DiT stream, each declared once (options.Option, as the compiler's are).

`FastARSettings` (the runtime's), the `fastcar-compile stream` flags, the keywords of
`fastcar_compile.torch.apply_dit` and the record in stream.json all derive from `DIT_OPTIONS`: the compiler's
own entries (core/options.py: TempCache's SIM and match, AnnSA, AnnCA, their buckets; --threshold with one tau
and no default, --calibrate-replay) listed by reference, and the few the eager runtime alone has. Defaults are
all off: the stream is then the dense rollout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.options import BY_NAME as SHARED
from fastcar_compile.core.options import (
    CALIBRATE_REPLAY,
    DIT_THRESHOLD,
    RENAMED,
    SWITCH,
    Option,
)

GROUP = "FAST-AR and FastCar (eager runtime: give a DiT preset or folder; docs/dit.md)"

DIT_OPTIONS: tuple[Option, ...] = (
    dataclasses.replace(SHARED["tempcache"], group=SHARED["tempcache_match"].group),  # (listed with the DiT modes)
    SHARED["tempcache_match"],
    Option("tempcache_budget", int, 0, "TempCache's slot budget: per row and head at most FRAMES frames' worth of "
           "slots besides the sink frames; when a write exceeds it, the slots whose newest member is oldest leave "
           "first (a slot that keeps merging stays). With --window 0 the merges alone leave the cache growing "
           "with every new token; the budget holds it flat (0: none, default)", "--tempcache-budget",
           metavar="FRAMES", lo=0, hi=1 << 20, meaning="frames of slots", group=GROUP),
    SHARED["annsa"],
    SHARED["annsa_local"],
    SHARED["lsh_bits"],
    SHARED["int8_dirs"],
    SHARED["ann_tables"],
    SHARED["annca"],
    SHARED["ann_always"],
    DIT_THRESHOLD,
    dataclasses.replace(CALIBRATE_REPLAY, help="calibrate --threshold to this replay ratio on a first chunk pair "
                        "(the TAS quantile), instead of giving TAU", group=GROUP),
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
    if bad and RENAMED.get(bad[0]) in BY_NAME:
        raise FastCarError(f"FAST-AR setting {bad[0]!r}: renamed: use {RENAMED[bad[0]]}")
    if bad:
        raise FastCarError(f"unknown FAST-AR setting {bad[0]!r}; known: {', '.join(BY_NAME)}")
    s = FastARSettings(**{k: BY_NAME[k].check(v) for k, v in values.items()})
    if s.tempcache_budget and s.tempcache is None:
        raise FastCarError("--tempcache-budget bounds TempCache's slots: give --tempcache SIM too")
    if s.tempcache_match != "aligned" and s.tempcache is None:
        raise FastCarError(f"--tempcache-match {s.tempcache_match} needs --tempcache SIM (the cosine above which "
                           "keys merge)")
    from fastcar_compile.passes.dit_plan import refuse_unused_always

    refuse_unused_always(s.ann_always, s.annsa is not None or s.annca)
    if s.threshold is not None and s.calibrate_replay is not None:
        raise FastCarError("give --threshold or --calibrate-replay, not both")
    return s


def effective(s: Any, cfg: Any) -> tuple[Any, dict[str, str]]:
    """The settings the eager runtime runs on `cfg`'s blocks and the cost model's verdicts: AnnSA and AnnCA are
    dropped where they would not pay (passes/dit_cost.py, the compiler's decision too), unless `ann_always`."""
    from fastcar_compile.core.contract import AnnSARecord
    from fastcar_compile.passes.dit_plan import annca_mode, bucket_record, decisions

    opts = record(s)  # the compiler's records of these settings
    sa = None if s.annsa is None else AnnSARecord(**dataclasses.asdict(bucket_record(s.annsa, opts)),
                                                  annsa_local=s.annsa_local)
    (sa_kept, sa_verdict), (ca_kept, ca_verdict) = decisions(cfg, sa, annca_mode(opts), s.ann_always)
    verdicts = {k: v for k, v in (("annsa", sa_verdict), ("annca", ca_verdict)) if v}
    return dataclasses.replace(s, annsa=s.annsa if sa_kept else None, annca=ca_kept is not None), verdicts


def is_dense(s: Any) -> bool:
    """No mode on: the stream must equal the dense rollout."""
    return s.tempcache is None and s.annsa is None and not s.annca and s.threshold is None \
        and s.calibrate_replay is None


def record(s: Any) -> dict[str, Any]:
    """What stream.json records (every field, by its option name)."""
    return dataclasses.asdict(s)


def label(s: Any) -> str:
    """A short name of the mode combination (tables, figure legends)."""
    parts = [f"TempCache-{s.tempcache_match}"] * (s.tempcache is not None)
    parts += [f"AnnSA-{s.annsa}"] * (s.annsa is not None) + ["AnnCA"] * s.annca
    if s.threshold is not None or s.calibrate_replay is not None:
        parts.append("FastCar")
    return " + ".join(parts) or "dense"
