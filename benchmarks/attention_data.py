"""Queries and keys with the structure of a trained model, for the attention kernel benchmark (bench_attention.py):
the causal video DiT trained here (training/dit_model) rolled out on a labelled prompt, its self-attention's
q / k / v recorded at every chunk (tiled to other models' shapes by the benchmark), and the bundled long-video
token decoder's q / k / v teacher-forced on a real clip (capture_tokens).

Recorded per chunk (hooks on the eager model's blocks, the rollout itself unchanged): the chunk's queries, keys
and values at one denoising step (post-RoPE, as attention reads them), and from the clean pass the keys (post- and
pre-RoPE) and values each frame leaves in the cache. The rollout uses the model's own capped context (sinks + its
window), so the capture is fast; the benchmark then attends a chunk to every earlier frame's keys (a full
context), as FAST-AR's modes do. Cached in FASTCAR_BENCH_CACHE (the model's weights and the settings in the key).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastcar_compile.core.atomic import write_bytes

PROMPT = "camera=pan_right"
CFG = 2.0  # the dit-table1 benchmark's guidance: two rows (prompt, empty prompt)
STEP = 2  # the denoising step whose queries are recorded (t = 500 of the 4-step sampler)
# the AnnSA rows' names per bucketing (4 sign bits x 2 tables; 2 int8 directions x 2 tables), both shapes' suites
ANNSA_ROWS = {"lsh": "AnnSA-LSH 4x2", "int8": "AnnSA-int8 2x2"}


@dataclass
class Capture:
    """One rollout's self-attention tensors, every layer: float32 arrays [layers, frames|chunks, B, H, tokens, d]."""

    q: np.ndarray       # [L, chunks, B, H, chunk tokens, d] the chunk's queries at the recorded step
    k: np.ndarray       # [L, chunks, B, H, chunk tokens, d] its keys at that step (post-RoPE)
    v: np.ndarray       # [L, chunks, B, H, chunk tokens, d]
    ck: np.ndarray      # [L, frames, B, H, T, d] each frame's keys as the clean pass writes them (post-RoPE)
    cv: np.ndarray      # [L, frames, B, H, T, d]
    ck_pre: np.ndarray  # [L, frames, B, H, T, d] the same keys before RoPE (TempCache compares these)
    tokens: int         # per frame
    chunk: int          # frames per chunk
    sinks: int          # the model's sink frames


def _key(folder: Path, frames: int) -> str:
    h = hashlib.sha256((folder / "model.safetensors").read_bytes() + (folder / "config.json").read_bytes())
    h.update(f"{frames} {PROMPT} {CFG} {STEP}".encode())
    return h.hexdigest()[:12]


def capture_dit(frames: int, cache_dir: Path) -> Capture:
    """The trained DiT's q/k/v over a `frames`-frame rollout (cached)."""
    from fastcar_compile.cli.demo_dit import MODEL_DIR

    path = Path(cache_dir) / f"attention-dit-{_key(MODEL_DIR, frames)}.npz"
    if path.is_file():
        with np.load(path) as z:
            arrays = {k: z[k].astype(np.float32) for k in ("q", "k", "v", "ck", "cv", "ck_pre")}
            meta = z["meta"]
        return Capture(**arrays, tokens=int(meta[0]), chunk=int(meta[1]), sinks=int(meta[2]))
    cap = _record(MODEL_DIR, frames)
    import io

    buf = io.BytesIO()
    np.savez(buf, **{k: getattr(cap, k).astype(np.float16) for k in ("q", "k", "v", "ck", "cv", "ck_pre")},
             meta=np.array([cap.tokens, cap.chunk, cap.sinks]))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(path, buf.getvalue())
    return capture_dit(frames, cache_dir)  # as stored (float16), so a first run and a cached one see the same


def _record(folder: Path, frames: int) -> Capture:
    import torch

    from fastcar_compile.cli.demo_dit import load_trained, parse_prompt
    from fastcar_compile.demo.dit_train import text_embeds
    from fastcar_compile.dit.model import apply_rope
    from fastcar_compile.dit.stream import STEPS, StreamSettings, TorchDiT, rollout

    torch.set_num_threads(1)
    model = load_trained(folder)
    cfg = model.cfg
    state: dict = {"t": None}
    rec: dict[str, dict] = {"step": {}, "clean": {}}

    def on_block(i):
        def pre(_, args):
            state["rope"] = (args[2], args[3])
        return pre

    def on_proj(i, name):
        def hook(_, __, out):
            t = state["t"]
            if t not in (STEPS[STEP], 0.0):
                return
            x = out.unflatten(-1, (cfg.heads, -1))  # [B, S, H, d]
            cos, sin = state["rope"]
            where = rec["step" if t else "clean"].setdefault(state["start"], {})
            if name == "v":
                where[(i, "v")] = x.transpose(1, 2).numpy().copy()
                return
            where[(i, name)] = apply_rope(x, cos, sin).transpose(1, 2).numpy().copy()
            if name == "k":
                where[(i, "k_pre")] = x.transpose(1, 2).numpy().copy()
        return hook

    handles = []
    for i, blk in enumerate(model.blocks):
        handles += [blk.register_forward_pre_hook(on_block(i)), blk.norm_q.register_forward_hook(on_proj(i, "q")),
                    blk.norm_k.register_forward_hook(on_proj(i, "k")), blk.v.register_forward_hook(on_proj(i, "v"))]

    class Recording(TorchDiT):
        def step(self, latent, timestep, frame_start, past, cross):
            state["t"], state["start"] = float(timestep.flat[0]), frame_start
            return super().step(latent, timestep, frame_start, past, cross)

    settings = StreamSettings(frames=frames, seed=0, cfg_scale=CFG)
    try:
        for _ in rollout(Recording(model), settings, text_embeds(parse_prompt(PROMPT))):
            pass
    finally:
        for h in handles:
            h.remove()
    starts = sorted(rec["step"])
    T, L = cfg.tokens_per_frame, cfg.layers

    def stacked(kind, name):
        return np.stack([np.stack([rec[kind][s][(i, name)] for s in starts]) for i in range(L)])

    def per_frame(name):
        x = stacked("clean", name)  # [L, chunks, B, H, F*T, d]
        Lc, C, B, H, _, d = x.shape
        x = x.reshape(Lc, C, B, H, cfg.chunk_frames, T, d).transpose(0, 1, 4, 2, 3, 5, 6)
        return x.reshape(Lc, C * cfg.chunk_frames, B, H, T, d)

    return Capture(q=stacked("step", "q"), k=stacked("step", "k"), v=stacked("step", "v"), ck=per_frame("k"),
                   cv=per_frame("v"), ck_pre=per_frame("k_pre"), tokens=T, chunk=cfg.chunk_frames,
                   sinks=cfg.sink_frames)


TOKEN_FRAMES = 64  # the long-video decoder's positions hold 64 frames of 64 tokens after its 3-token prompt


@dataclass
class TokenCapture:
    """The bundled long-video decoder (fastcar_compile/demo/assets/long.*) on an eval clip, teacher-forced: per
    layer its video tokens' pre-RoPE q / k and v [L, frames * 64, heads, d]."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    frame_tokens: int
    rope_theta: float


def capture_tokens(cache_dir: Path) -> TokenCapture:
    """The decoder's q/k/v over TOKEN_FRAMES frames of eval clip 0 (cached)."""
    from fastcar_compile.demo.export import LONG_CONFIG, LONG_WEIGHTS

    h = hashlib.sha256(Path(LONG_WEIGHTS).read_bytes() + Path(LONG_CONFIG).read_bytes())
    h.update(f"clip 0 {TOKEN_FRAMES}".encode())
    path = Path(cache_dir) / f"attention-tokens-{h.hexdigest()[:12]}.npz"
    if not path.is_file():
        import io

        from fastcar_compile.demo.trace import demo_trace

        tr = demo_trace(frames=TOKEN_FRAMES, clip=0, source="clip", long=True)
        video = slice(tr.video_start, tr.video_start + TOKEN_FRAMES * tr.frame_tokens)
        buf = io.BytesIO()
        np.savez(buf, **{n: np.stack([getattr(x, n)[video] for x in tr.layers]).astype(np.float16)
                         for n in ("q", "k", "v")}, meta=np.array([tr.frame_tokens, tr.rope_theta]))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, buf.getvalue())
    with np.load(path) as z:
        return TokenCapture(z["q"].astype(np.float32), z["k"].astype(np.float32), z["v"].astype(np.float32),
                            int(z["meta"][0]), float(z["meta"][1]))
