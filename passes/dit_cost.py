"""Whether AnnSA / AnnCA pay on a DiT block: predicted density and time against the dense attention, from the
block's shapes and the bucketing alone (the plan's decision, passes/dit_plan.py, and the eager runtime's,
dit/fastar.py; `--inspect -v` prints it).

AnnSA's native kernel (runtime/native/bucket_attention.h) attends to the dense frames (sinks, --annsa-local frames,
the chunk) as one dense block and multiplies each bucket's queries with the bucket's keys as dense blocks, so per
executed pair it costs about what a dense pair does (ANNSA_PAIR_COST) while the blocks hold enough queries; with few
queries per bucket it is bound by reading the keys instead: every table streams the bucketed keys and values once
per step, which a dense step of Q queries amortises Q times. Predicted time / dense:

    dense share + max(ANNSA_PAIR_COST x p x bucketed share, tables x 2 x bucketed share x MACHINE_BALANCE / Q)
        + projections / (2 x attended keys)

the shares being the dense and the bucketed frames / the attended frames; density = dense share + p x bucketed
share, p = 1 - (1 - 1 / ids)^tables the chance a query and a key share a bucket in some table if ids were drawn
uniformly. Real queries and keys share buckets more often than uniform ones (the trained DiT's 4-bit LSH: ~2x), so
the prediction is optimistic for AnnSA: a block it keeps dense would not have paid. The last term codes the queries:
each projects onto every table's directions (LSH: bits x tables, int8: directions x tables), d MACs each, where a
dense query costs 2 d MACs per attended key; it is negligible against a cache of frames, and decides AnnCA over a
short prompt (6 tokens: coding a query costs more than attending to all of them). The cache's context is the
config's window; without one (the cache grows) the limit of a long video. The per-chunk index costs a few percent
more (benchmarks/bench_attention.py measures every term). AnnCA: predict_cross.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastcar_compile.core.contract import AnnSARecord, BucketRecord, DiTConfig

# Time per executed pair / per dense pair of the native kernel where buckets hold enough queries to fill its
# vector lanes (`python -m benchmarks attention`: 0.94-1.05 at Wan2.1-1.3B's shape, 4680 queries per head).
ANNSA_PAIR_COST = 1.05
# Flop per byte: a core's dense attention throughput over the bandwidth it streams scattered key rows at (the same
# benchmark where AnnSA is bound by reading the keys, the trained DiT's shape with 128 queries per head: 12-22 over
# 16-200 cached frames, LSH and int8).
MACHINE_BALANCE = 16.0
QUANT_IDS = 256  # the int8 bucketing packs 8 bits per table whatever its directions (fastar/int8.py)


@dataclass(frozen=True)
class AnnSACost:
    """The prediction for one block: density, time / dense, and whether it pays (time / dense < 1)."""

    density: float
    ratio: float
    bound: str  # "pairs" or "memory": the term that sets the time
    context: str  # the cache the prediction is for

    @property
    def pays(self) -> bool:
        return self.ratio < 1.0

    def __str__(self) -> str:
        return (f"predicted density {self.density:.0%} at {self.context}, time {self.ratio:.2f}x dense "
                f"({'executed pairs' if self.bound == 'pairs' else 'reading the bucketed keys once per table'})")


def _share_of_a_bucket(mode: BucketRecord) -> float:
    """p: the chance a query and a key share a bucket in some table, were their ids uniform."""
    ids = 2 ** mode.lsh_bits if mode.kind == "lsh" else QUANT_IDS
    return 1.0 - (1.0 - 1.0 / ids) ** mode.ann_tables


def projections(mode: BucketRecord) -> int:
    """Directions a vector is projected on to code it in every table (d MACs each)."""
    return (mode.lsh_bits if mode.kind == "lsh" else mode.int8_dirs) * mode.ann_tables


def _cost(share: float, p: float, mode: BucketRecord, queries: int, keys: float, context: str) -> AnnSACost:
    memory = mode.ann_tables * 2 * share * MACHINE_BALANCE / queries
    pairs = ANNSA_PAIR_COST * p * share
    coding = projections(mode) / (2 * keys)
    return AnnSACost(1.0 - share + p * share, 1.0 - share + max(pairs, memory) + coding,
                     "pairs" if pairs >= memory else "memory", context)


def predict(cfg: DiTConfig, mode: AnnSARecord) -> AnnSACost:
    """AnnSA's predicted density and time against the dense in-place attention of `cfg`'s blocks."""
    always = cfg.sink_frames + mode.annsa_local
    if cfg.window_frames:
        cached = cfg.sink_frames + cfg.window_frames
        bucketed = max(0, cached - always)
        attended = cached + cfg.chunk_frames
        share = bucketed / attended
        context = f"the {cached}-frame cache (sinks + window)"
    else:  # the cache grows: the limit of a long video
        share, context, attended = 1.0, "a growing cache's limit", float("inf")
    return _cost(share, _share_of_a_bucket(mode), mode, cfg.chunk_frames * cfg.tokens_per_frame,
                 attended * cfg.tokens_per_frame, context)


def predict_cross(cfg: DiTConfig, mode: BucketRecord) -> AnnSACost:
    """AnnCA's predicted density and time against the dense cross-attention to `cfg`'s prompt. AnnCA keeps a prompt
    token for a whole frame when any of the frame's queries shares a bucket with it, and the frame's queries attend
    the kept tokens densely: density = 1 - (1 - p)^(tokens per frame), time = that share at a dense pair's cost plus
    coding the queries (few bits leave every token kept: only many bits per table prune)."""
    density = 1.0 - (1.0 - _share_of_a_bucket(mode)) ** cfg.tokens_per_frame
    return AnnSACost(density, ANNSA_PAIR_COST * density + projections(mode) / (2 * cfg.text_len), "pairs",
                     f"a {cfg.text_len}-token prompt")
