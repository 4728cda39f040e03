"""CompressedAttention's compressed mode at the benchmark LLaMA's head layout (16 query / 2 KV heads x 64 dims:
8 query heads per KV head take the kernel's grouped path, which scores all of a group's heads against each slot
together) and at an odd head size (12 dims: the dot product's 8-lane tail; 1 query head per KV head, as the
long demo model), against the NumPy reference fastcar_compile/fastar (run_trace) on the same q/k/v."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_driver import run_kernel

from fastcar_compile.fastar.attention import run_trace
from fastcar_compile.fastar.config import KVCompressConfig

L = 8
CASES = {  # (query heads, KV heads, head dim, settings)
    "16/2x64 window, mass": (16, 2, 64, dict(budget=40, sinks=3, window=12)),
    "16/2x64 window, oldest": (16, 2, 64, dict(budget=40, sinks=3, window=12, eviction="oldest")),
    "16/2x64 tempcache, mean": (16, 2, 64, dict(budget=16, sinks=2, window=6, tempcache_sim=0.9, eviction="mean")),
    "16/2x64 tempcache bounded": (16, 2, 64, dict(budget=16, sinks=2, window=6, tempcache_sim=0.9)),
    "16/2x64 tempcache + lsh": (16, 2, 64, dict(budget=18, sinks=2, window=6, tempcache_sim=0.95, lsh_bits=3,
                                                lsh_tables=2)),
    "2/2x12 window": (2, 2, 12, dict(budget=20, sinks=2, window=5)),
    "2/2x12 tempcache": (2, 2, 12, dict(budget=12, sinks=1, window=3, tempcache_sim=0.9)),
}


def _trace(rng, T: int, hq: int, hkv: int, d: int):
    """Pre-RoPE q [T, Hq, D], k/v [T, Hkv, D]; 70% of keys recur one frame later (TempCache merges them)."""
    q = rng.standard_normal((T, hq, d))
    k = rng.standard_normal((T, hkv, d))
    for t in range(L, T):
        if rng.random() < 0.7:
            k[t] = k[t - L] + 0.01 * rng.standard_normal((hkv, d))
    return q, k, rng.standard_normal((T, hkv, d))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_reference_at_benchmark_sizes(name):
    """Outputs over 72 tokens (a 6-token chunk, then single tokens and a 4-token chunk) within 1e-4 of the
    reference, and the final slots (latest KV index, member count) identical; eviction (and merging, where
    configured) is exercised."""
    hq, hkv, d, settings = CASES[name]
    cfg = KVCompressConfig(**settings, frame_tokens=L, video_start=0)
    q, k, v = _trace(np.random.default_rng(5), 72, hq, hkv, d)
    ref = run_trace(q, k, v, cfg)
    got, slots = run_kernel(cfg, q, k, v, [6] + [1] * 30 + [4] + [1] * 32)
    assert np.abs(got - ref.out).max() <= 1e-4, np.abs(got - ref.out).max()
    for h, cache in enumerate(ref.caches):
        live = slots[h, :, 0] > 0
        got_slots = sorted(zip(slots[h, live, 0].astype(int) - 1, slots[h, live, 1].astype(int), strict=True))
        assert got_slots == sorted(zip(cache.pos[cache.live].tolist(), cache.count[cache.live].tolist(), strict=True))
    assert ref.metrics.evicted > 0
    if cfg.tempcache_sim is not None:
        assert ref.metrics.merges > 0
