"""Settings of the compressed KV cache; validated once here so the cache and attention code can trust them."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fastcar_compile.errors import FastCarError

EVICTION_POLICIES = ("mass", "oldest")
CORRESPONDENCE = ("aligned", "aligned+top1")


@dataclass(frozen=True)
class KVCompressConfig:
    """One layer's compressed-cache settings.

    budget: slots per KV head (None = unbounded). sinks/window: the first S tokens and the last W tokens are
    always resident. tempcache_sim: merge a new key into its temporal correspondent's slot when the pre-RoPE
    cosine similarity exceeds it (None = no merging). correspondence: 'aligned' compares with token p - L
    (frame_len); 'aligned+top1' also with the best pre-RoPE match among the previous frame's slots.
    eviction: which non-sink, non-window slot leaves when the budget is full ('mass' = least cumulative
    attention probability received, H2O-style; 'oldest' = smallest latest position). lsh_bits/lsh_tables:
    AnnSA (None = dense over resident slots). frame_len/video_start: the token layout (SPEC.md section 6).
    """

    budget: int | None = None
    sinks: int = 0
    window: int = 0
    tempcache_sim: float | None = None
    correspondence: str = "aligned"
    eviction: str = "mass"
    lsh_bits: int | None = None
    lsh_tables: int = 1
    frame_len: int = 64
    video_start: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.window < 0:
            raise FastCarError(f"kv sinks and window must be >= 0, got sinks={self.sinks} window={self.window}")
        if self.budget is not None and self.budget < self.sinks + self.window + 1:
            raise FastCarError(f"kv budget {self.budget} must exceed sinks + window = {self.sinks + self.window}"
                               "; raise --kv-budget or lower --kv-sinks/--kv-window")
        if self.tempcache_sim is not None and not -1.0 <= self.tempcache_sim <= 1.0:
            raise FastCarError(f"tempcache similarity must be a cosine in [-1, 1], got {self.tempcache_sim}")
        if self.correspondence not in CORRESPONDENCE:
            raise FastCarError(f"correspondence must be one of {CORRESPONDENCE}, got {self.correspondence!r}")
        if self.eviction not in EVICTION_POLICIES:
            raise FastCarError(f"eviction must be one of {EVICTION_POLICIES}, got {self.eviction!r}")
        if self.lsh_bits is not None and not (1 <= self.lsh_bits <= 62 and self.lsh_tables >= 1):
            raise FastCarError(f"lsh needs 1..62 bits and >= 1 table, got {self.lsh_bits}x{self.lsh_tables}")
        if self.frame_len < 1 or self.video_start < 0:
            raise FastCarError(f"frame_len must be >= 1 and video_start >= 0, got {self.frame_len}, {self.video_start}")

    @property
    def is_dense(self) -> bool:
        """No budget, no merging, no sparsity: attention must equal plain dense attention."""
        return self.budget is None and self.tempcache_sim is None and self.lsh_bits is None

    def to_dict(self) -> dict:
        return asdict(self)
