"""Settings of the compressed KV cache; validated once here so the cache and attention code can trust them."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fastcar_compile.core import options
from fastcar_compile.core.contract import BucketRecord
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.limits import INT8_DIRS, MAX_ANN_TABLES, MAX_LSH_BITS
from fastcar_compile.fastar import int8, lsh  # noqa: F401 - their bucketings register themselves (buckets.KINDS)
from fastcar_compile.fastar.buckets import KINDS, Buckets

CORRESPONDENCE = ("aligned", "aligned+top1")


def make_hasher(kind: str, dim: int, bits: int, dirs: int, tables: int, seed: int) -> Buckets:
    """The bucketing registered as `kind` (buckets.KINDS: 'lsh' sign bits, 'int8' int8-quantised directions, ...)
    drawn from the bucket settings: the reference bucketings, one definition for every runtime that buckets DiT
    keys (the eager one in PyTorch, the compiled one's cache writes in NumPy)."""
    return KINDS[kind].from_settings(dim, bits, dirs, tables, seed)


def hasher_of(record: BucketRecord, dim: int) -> Buckets:
    """The bucketing a compiled step graph records (contract.BucketRecord): the same seeded projections."""
    return make_hasher(record.kind, dim, record.lsh_bits, record.int8_dirs, record.ann_tables, record.ann_seed)


def check_buckets(lsh_bits: int | None = None, lsh_tables: int = 1, int8_dirs: int | None = None,
                  int8_tables: int = 1) -> None:
    """The AnnSA bucket settings' limits (core/limits.py's, the same for every bucketing of every runtime):
    KVCompressConfig's own, and the --sparse-attention reader's (which checks its part before a whole config
    exists, so the config is then built, and checked, once)."""
    if lsh_bits is not None and not (1 <= lsh_bits <= MAX_LSH_BITS and 1 <= lsh_tables <= MAX_ANN_TABLES):
        raise FastCarError(f"lsh needs 1..{MAX_LSH_BITS} bits and 1..{MAX_ANN_TABLES} tables, got "
                           f"{lsh_bits}x{lsh_tables}")
    if int8_dirs is not None and not (int8_dirs in INT8_DIRS and 1 <= int8_tables <= MAX_ANN_TABLES):
        raise FastCarError(f"int8 buckets need {'/'.join(map(str, INT8_DIRS))} directions per table and "
                           f"1..{MAX_ANN_TABLES} tables, got {int8_dirs}x{int8_tables}")
    if int8_dirs is not None and lsh_bits is not None:
        raise FastCarError("choose one AnnSA bucketing: lsh or int8, not both")


@dataclass(frozen=True)
class KVCompressConfig:
    """One layer's compressed-cache settings.

    budget: slots per KV head (None = unbounded). sinks/window: the first S tokens and the last W tokens are
    always resident. tempcache_sim: merge a new key into its temporal correspondent's slot when the pre-RoPE
    cosine similarity exceeds it (None = no merging). correspondence: 'aligned' compares with token p - L
    (frame_tokens); 'aligned+top1' also with the best pre-RoPE match among the previous frame's slots.
    eviction: which non-sink, non-window slot leaves when the budget is full ('mass' = least cumulative
    attention probability received, H2O-style; 'oldest' = smallest latest position; 'mean' = least mass per
    member token, so a slot TempCache merged many tokens into is not kept for its count alone). lsh_bits/lsh_tables:
    AnnSA by sign random projections (None = dense over resident slots). int8_dirs/int8_tables: AnnSA by 8-bit
    quantised buckets instead (fastar/int8.py; exclusive with lsh). prune_prompt: AnnCA's decoder-only
    counterpart: a prompt-prefix key (position < video_start) that no query of the previous frame gave softmax
    weight >= this value is skipped for the current frame (None = off; 0 keeps every prefix key).
    frame_tokens/video_start: the token layout (docs/semantics.md section 6).
    """

    budget: int | None = None
    sinks: int = 0
    window: int = 0
    tempcache_sim: float | None = None
    correspondence: str = "aligned"
    eviction: str = "mass"
    lsh_bits: int | None = None
    lsh_tables: int = 1
    int8_dirs: int | None = None
    int8_tables: int = 1
    prune_prompt: float | None = None
    frame_tokens: int = 64
    video_start: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        """Every bound is its compile option's (core/options.py: --kv-budget, --kv-sinks, --kv-window,
        --tempcache, --kv-eviction, --prune-prompt, the buckets'), whichever way the settings came in (the global
        flags, a --kv-layer, the Python API, the reference's sweeps)."""
        o = options.BY_NAME
        for name, value in (("kv_budget", self.budget), ("kv_sinks", self.sinks), ("kv_window", self.window),
                            ("tempcache", self.tempcache_sim), ("kv_eviction", self.eviction),
                            ("prune_prompt", self.prune_prompt)):
            if value is not None:
                o[name].check(value)
        if self.budget is not None and self.budget < self.sinks + self.window + 1:
            raise FastCarError(f"kv budget {self.budget} must exceed sinks + window = {self.sinks + self.window}"
                               "; raise --kv-budget or lower --kv-sinks/--kv-window")
        if self.correspondence not in CORRESPONDENCE:
            raise FastCarError(f"correspondence must be one of {CORRESPONDENCE}, got {self.correspondence!r}")
        check_buckets(self.lsh_bits, self.lsh_tables, self.int8_dirs, self.int8_tables)
        if self.frame_tokens < 1 or self.video_start < 0:
            raise FastCarError(f"frame_tokens must be >= 1 and video_start >= 0, got {self.frame_tokens}, {self.video_start}")

    def check_fastcar_window(self, where: str, fix: str) -> None:
        """Refuse these settings on a FastCar layer when the window is shorter than a frame. The gate of a
        compressed layer reads the key of token p - frame_tokens from this cache (CompressedAttention hands it
        over, zeros once evicted), and only the last `window` tokens are safe from eviction: with a shorter
        window the aligned key can be gone, reads as zeros and replay silently collapses (51% -> 14% seen).
        `where` names the setting, `fix` says what to change."""
        if self.window < self.frame_tokens:
            raise FastCarError(f"{where}: window {self.window} is shorter than a frame ({self.frame_tokens} tokens, "
                               f"--frame-tokens) on a FastCar layer, so the key one frame back that the gate "
                               f"reads can be evicted and read as zeros; {fix}, or keep FastCar off these layers "
                               "with --layers")

    @property
    def is_dense(self) -> bool:
        """No budget, no merging, no sparsity: attention must equal plain dense attention."""
        return self.budget is None and self.tempcache_sim is None and self.sparse_tables == 0 and \
            self.prune_prompt is None

    @property
    def sparse_tables(self) -> int:
        """Bucket tables of the AnnSA mode (lsh or int8); 0 = no AnnSA."""
        return self.lsh_tables if self.lsh_bits is not None else self.int8_tables if self.int8_dirs is not None else 0

    def to_dict(self) -> dict:
        return asdict(self)
