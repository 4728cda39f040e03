"""Shapes of a chunk-causal Wan2.1-style video DiT, declared once as named presets, and the ONNX I/O names.

A "frame" here is a latent frame (Wan's VAE: 4x temporal, 8x8 spatial compression); the patch (1, 2, 2)
makes `tokens_per_frame` = (latent_h / 2) * (latent_w / 2) tokens, 1560 for 480x832 video.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from fastcar_compile.core.errors import FastCarError


@dataclass(frozen=True)
class DiTConfig:
    layers: int
    hidden: int
    heads: int
    ffn: int
    text_dim: int
    in_channels: int = 16
    patch: tuple[int, int, int] = (1, 2, 2)
    latent_h: int = 60
    latent_w: int = 104
    freq_dim: int = 256
    text_len: int = 512
    chunk_frames: int = 3  # latent frames denoised together (Self-Forcing's block)
    sink_frames: int = 3  # first frames kept in the cache for ever (attention sinks)
    window_frames: int = 18  # most recent non-sink frames kept; 0 = keep every frame (the cache grows)
    eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def grid(self) -> tuple[int, int]:
        return self.latent_h // self.patch[1], self.latent_w // self.patch[2]

    @property
    def tokens_per_frame(self) -> int:
        h, w = self.grid
        return h * w

    @property
    def patch_dim(self) -> int:
        p = self.patch
        return self.in_channels * p[0] * p[1] * p[2]

    def check(self, where: str = "the DiT config") -> DiTConfig:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("eps", "rope_theta"):
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                    raise FastCarError(f"{where}: {f.name}={v!r} must be a positive number")
            elif f.name == "patch":
                if len(v) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v):
                    raise FastCarError(f"{where}: patch={list(v)!r} must be three positive integers")
            elif isinstance(v, bool) or not isinstance(v, int) or v < (0 if f.name in (
                    "window_frames", "sink_frames") else 1):
                raise FastCarError(f"{where}: {f.name}={v!r} must be a {'non-negative' if f.name in ('window_frames', 'sink_frames') else 'positive'} integer")
        if self.hidden % self.heads or self.head_dim % 2 or self.head_dim < 6:
            raise FastCarError(f"{where}: hidden {self.hidden} / heads {self.heads} must give an even head size "
                               ">= 6 (3D RoPE splits it over frame, h, w)")
        if self.patch[0] != 1:
            raise FastCarError(f"{where}: patch {list(self.patch)}: only a temporal patch of 1 is supported")
        if self.latent_h % self.patch[1] or self.latent_w % self.patch[2]:
            raise FastCarError(f"{where}: latent {self.latent_h}x{self.latent_w} is not a multiple of the patch "
                               f"{self.patch[1]}x{self.patch[2]}")
        if self.freq_dim % 2:
            raise FastCarError(f"{where}: freq_dim {self.freq_dim} must be even")
        return self

    @property
    def params(self) -> int:
        """Parameter count (for messages and the memory check)."""
        d, f, t = self.hidden, self.ffn, self.text_dim
        block = 8 * d * d + 2 * d * f + 6 * d + 4 * d + 2 * d
        return (self.layers * block + self.patch_dim * d + t * d + d * d + self.freq_dim * d + 7 * d * d
                + d * self.patch_dim)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


PRESETS: dict[str, DiTConfig] = {
    # Random weights, seconds to export: tests and the tool chain.
    "tiny": DiTConfig(layers=2, hidden=48, heads=2, ffn=96, text_dim=24, in_channels=4, latent_h=8, latent_w=8,
                      freq_dim=32, text_len=6, chunk_frames=2, sink_frames=1, window_frames=4),
    # Wan2.1-T2V-1.3B's shapes (480x832 video, 3-frame blocks, a 21-frame local window as in Self-Forcing).
    "wan2.1-1.3b": DiTConfig(layers=30, hidden=1536, heads=12, ffn=8960, text_dim=4096),
}


def from_dict(d: dict, where: str) -> DiTConfig:
    names = {f.name for f in dataclasses.fields(DiTConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise FastCarError(f"{where}: unknown DiT config keys {unknown}; known: {sorted(names)}")
    missing = sorted(k for k in ("layers", "hidden", "heads", "ffn", "text_dim") if k not in d)
    if missing:
        raise FastCarError(f"{where}: the DiT config lacks {missing}")
    d = dict(d)
    if "patch" in d:
        if not isinstance(d["patch"], list):
            raise FastCarError(f"{where}: patch must be a list of three integers")
        d["patch"] = tuple(d["patch"])
    return DiTConfig(**d).check(where)


# The ONNX I/O of the denoiser step (stream.py and export.py derive from these).
STEP_INPUTS = ("latent", "timestep", "frame_start")
STEP_OUTPUT = "velocity"
TEXT_INPUT = "text_embeds"


def past_names(layers: int) -> list[str]:
    return [f"past.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def cross_names(layers: int) -> list[str]:
    return [f"cross.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def present_names(layers: int) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def step_io(layers: int) -> tuple[list[str], list[str]]:
    """(inputs, outputs) of the step graph: the noisy chunk, per-frame timesteps, its first frame's index, the
    cache (past K/V per layer), the prompt's cross-attention K/V -> velocity, the chunk's own K/V."""
    return ([*STEP_INPUTS, *past_names(layers), *cross_names(layers)],
            [STEP_OUTPUT, *present_names(layers)])


def text_io(layers: int) -> tuple[list[str], list[str]]:
    """(inputs, outputs) of the prompt graph: text embeddings -> cross-attention K/V per layer, once a video."""
    return [TEXT_INPUT], cross_names(layers)


# The compiled step graph (dit/compile.py): `past.N.key|value` are the runtime's preallocated cache buffers
# [B, heads, capacity, d], written in place between chunks; their first `past_length` tokens hold K/V (the rest
# is masked out). Its metadata names this form; stream.OrtDiT binds the buffers instead of concatenating them.
PAST_LENGTH = "past_length"
CACHE_FORM_KEY = "fastcar.dit_cache"
CACHE_IN_PLACE = "in-place"
METADATA_KEY = "fastcar.dit_config"  # the step graph's metadata: the config it was exported from
TEXT_GRAPH_KEY = "fastcar.dit_text_graph"  # file name of the prompt graph beside the step graph
# The modes compiled into the step graph (dit/compile.py), recorded as JSON under MODES_KEY and read back by
# stream.OrtDiT: {"threshold": tau or null (FastCar replay, dit/replay.py), "tempcache": SIM or null (TempCache
# at cache-write time: the runtime merges, the graph adds each slot's log(count), dit/compile.py),
# "tempcache_match": its correspondent ("aligned", "lsh", "quant"; null when off) and "tempcache_buckets": the
# buckets of a top-1 match (dit/tempcache.py), "annca": its buckets {"kind", "lsh_bits", "quant_dirs",
# "ann_tables", "ann_seed"} or null (dit/annca_graph.py),
# "annsa": the same buckets, "annsa_local" and "annsa_kernel" (ANNSA_KERNELS), or null (dit/annsa_graph.py)}.
MODES_KEY = "fastcar.dit_modes"
REPLAY_FIRST = "replay_first"  # bool [1]: the chunk's first frame may replay (the runtime holds its predecessor)


def replay_io(layer: int) -> tuple[tuple[str, str], tuple[str, str], str]:
    """Block `layer`'s replay cache: (inputs (FFN output, key) of the frame before the chunk), (outputs: the
    chunk's last frame's), and its replay decision output [B, S]."""
    return ((f"past_replay.{layer}.ffn", f"past_replay.{layer}.key"),
            (f"present_replay.{layer}.ffn", f"present_replay.{layer}.key"), f"replay.{layer}")


def tempcache_io(layer: int) -> tuple[str, str]:
    """Block `layer`'s TempCache I/O: the input log(count) per cache slot [B, heads, capacity] (-inf: empty)
    and the output pre-RoPE keys of the chunk [B, heads, F x T, d] (what the runtime compares)."""
    return f"past_bias.{layer}", f"present_pre.{layer}.key"


def tas_name(layer: int) -> str:
    """Block `layer`'s TAS output [B, S] (FastCar compiled in): what `--calibrate-replay` reads."""
    return f"tas.{layer}"


def annca_io(layer: int) -> tuple[str, str]:
    """Block `layer`'s AnnCA I/O (AnnCA compiled in): the prompt keys' bucket codes [B, heads, L, tables] int64
    (an output of the prompt graph, an input of the step graph) and the prompt tokens each frame kept
    [B, heads, F, L] bool (an output of the step graph)."""
    return f"cross.{layer}.codes", f"annca.{layer}"


ANNSA_DENSE = "annsa_dense"  # int64 [Nd]: the cache's token positions AnnSA attends densely (sinks + local frames)
# AnnSA's compiled forms: "native" = the ai.fastcar AnnSAAttention op (each query scores its buckets' slots, no
# padding; without the native library its function body runs, masked dense), "graph" = block-sparse ONNX ops
ANNSA_NATIVE, ANNSA_GRAPH = "native", "graph"
ANNSA_KERNELS = (ANNSA_NATIVE, ANNSA_GRAPH)
# each form's per-block inputs (annsa_io's keys), after ANNSA_DENSE
ANNSA_INPUTS = {ANNSA_NATIVE: ("key_codes", "sorted_codes", "sorted_slots"),
                ANNSA_GRAPH: ("buckets", "keys", "bias", "kcodes")}


def annsa_io(layer: int) -> dict[str, str]:
    """Block `layer`'s AnnSA I/O (dit/annsa_graph.py): inputs `buckets` (the occupied bucket ids per table
    [B, heads, T, K]), `keys` (their cache positions [B, heads, T, K, M]), `bias` (0, -inf for padding), `kcodes`
    (those keys' ids in every table [B, heads, T, T, K, M]); output `codes` (the chunk's query ids [B, heads, S, T]).
    The native form's inputs instead: `key_codes` (every cache slot's ids [B, heads, capacity, T], -1 where not
    bucketed), `sorted_codes` and `sorted_slots` (per table the bucketed slots' ids ascending and their positions
    [B, heads, T, N]: each bucket's slots are one run)."""
    return {"buckets": f"annsa_buckets.{layer}", "keys": f"annsa_keys.{layer}", "bias": f"annsa_bias.{layer}",
            "kcodes": f"annsa_kcodes.{layer}", "codes": f"annsa_codes.{layer}",
            "key_codes": f"annsa_key_codes.{layer}", "sorted_codes": f"annsa_sorted_codes.{layer}",
            "sorted_slots": f"annsa_sorted_slots.{layer}"}
