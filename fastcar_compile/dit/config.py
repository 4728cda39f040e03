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


def check_stream_memory(cfg: DiTConfig, capacity_frames: int, rows: int, where: str) -> None:
    """Refuse, before anything is allocated, a stream whose cache (`capacity_frames` frames of K/V in every
    layer, `rows` rows: 2 with CFG), chunk latents and activations this machine cannot hold now."""
    from fastcar_compile.core.limits import check_fits_memory

    kv = 2 * cfg.layers * rows * capacity_frames * cfg.tokens_per_frame * cfg.hidden * 4
    latents = 8 * rows * cfg.in_channels * cfg.chunk_frames * cfg.latent_h * cfg.latent_w * 4  # noise, steps
    acts = 16 * rows * cfg.chunk_frames * cfg.tokens_per_frame * max(cfg.hidden, cfg.ffn) * 4
    check_fits_memory(f"{where}: the stream ({capacity_frames} cached frames of {cfg.tokens_per_frame} tokens x "
                      f"{cfg.layers} layers x {cfg.hidden})", kv + latents + acts,
                      "lower --window / --sink or the config's sizes")


def check_model_memory(cfg: DiTConfig, where: str) -> None:
    """Refuse a model whose float32 weights this machine cannot hold now (before they are allocated)."""
    from fastcar_compile.core.limits import check_fits_memory

    check_fits_memory(f"{where}: {cfg.params / 1e6:.0f} M parameters", 4 * cfg.params, "check the config's sizes")
