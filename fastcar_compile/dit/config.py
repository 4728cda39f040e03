"""Named presets of a chunk-causal Wan2.1-style video DiT and where a config is read from (a preset, a .json, a
folder with its weights). The config itself (`DiTConfig`) and the step graph's I/O are the contract's
(core/contract.py): the compiler and the runtime read them from the graph."""

from __future__ import annotations

from pathlib import Path

from fastcar_compile.core.contract import DiTConfig
from fastcar_compile.core.errors import FastCarError

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


def load_config(source: str) -> tuple[DiTConfig, Path | None]:
    """A preset name, a DiT config .json, or a folder with config.json (+ model.safetensors).

    Returns (config, weights file or None: random weights)."""
    from fastcar_compile.core.fileio import read_json

    if source in PRESETS:
        return PRESETS[source], None
    src = Path(source)
    if not src.exists():
        raise FastCarError(f"--dit {source}: no such preset or path; give one of {sorted(PRESETS)}, a DiT "
                           "config .json, or a folder with config.json (+ model.safetensors)")
    cfg_file = src / "config.json" if src.is_dir() else src
    if not cfg_file.is_file():
        raise FastCarError(f"--dit {src}: the folder has no config.json")
    data = read_json(cfg_file, "the DiT config")
    if not isinstance(data, dict):
        raise FastCarError(f"{cfg_file}: the DiT config must be a JSON object")
    cfg = DiTConfig.from_dict(data, str(cfg_file))
    weights = src / "model.safetensors" if src.is_dir() else None
    return cfg, weights if weights is not None and weights.is_file() else None
