"""Named presets of a chunk-causal Wan2.1-style video DiT (where a config is read from, a preset or a checkpoint:
dit/checkpoints.load_config). The config itself (`DiTConfig`) and the step graph's I/O are the contract's
(core/contract.py): the compiler and the runtime read them from the graph."""

from __future__ import annotations

from fastcar_compile.core.contract import DiTConfig

# A config without a checkpoint above this size is exported without weights (zero-filled external data) and
# refused by the eager stream.
RANDOM_WEIGHTS_MAX_BYTES = 1 << 30

PRESETS: dict[str, DiTConfig] = {
    # Random weights, seconds to export: tests and the tool chain.
    "tiny": DiTConfig(layers=2, hidden=48, heads=2, ffn=96, text_dim=24, in_channels=4, latent_h=8, latent_w=8,
                      freq_dim=32, text_len=6, chunk_frames=2, sink_frames=1, window_frames=4),
    # Wan2.1-T2V-1.3B's shapes (480x832 video, 3-frame blocks, a 21-frame local window as in Self-Forcing).
    "wan2.1-1.3b": DiTConfig(layers=30, hidden=1536, heads=12, ffn=8960, text_dim=4096),
}
