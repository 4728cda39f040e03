"""The token world model: a LlamaForCausalLM over frames of 64 VQ tokens, one action token per frame.

Sequence = [BOS, action 0, frame 0 (64 tokens), action 1, frame 1, ...]: a frame is L = 65 tokens (its action, then
its 8x8 tokens in raster order), so the token at p - L is the same slot one frame earlier (FastCar's aligned token)
and `video_start` = 1. Frame 0 is given ("start"); each later frame is predicted from the action that moved the
camera and everything before it.

Why the init below: the model has to copy content from its past at two kinds of places, where the previous frame
showed it (one cell over, by the action) and where a frame long ago showed it (a revisit). Both are copies keyed by
content: the cell's left and upper neighbours, once seen next to it, say what it is (a 2-D induction head). On a
shared 2-core CPU a freshly initialised model does not find such heads within hours, so they are built into the
initial weights and then trained with everything else:

- the embedding writes a token's code (a random vector) into a subspace TOK; special tokens write into SPECIAL;
- layer 0's heads look a fixed distance back (bias-only queries and keys whose RoPE score peaks at the offset, as
  `model._init_copy_heads`) and copy the code found there into their own subspace: the token 1 back (left
  neighbour), 8 back (upper neighbour), 7 back (the upper neighbour of the token being predicted) and 64 back (the
  predicted slot one frame earlier);
- layer 1's heads match the query's (left, upper) neighbours of the token to predict against each key's own
  (left, upper) neighbours, both neighbours, the left one or the upper one alone, and copy the key's code into OUT;
- the output layer reads OUT as codes. Layers 2.. start as the usual random init (small output maps).

RoPE has a very large base (1e12): the content dimensions of the matching heads sit in rotary pairs that turn by
less than 0.4 rad over 65 k positions, so a revisit is recognised however long ago it was (1000 frames = 65 k
tokens), while the fast pairs still give the fixed-offset heads their aim. Training also shifts the positions of
the frames after a random frame by a random gap, so the model sees such distances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.demo import world
from fastcar_compile.demo.model import DemoConfig, build_model

CODES = 512  # VQ codes: token ids [0, CODES)
BOS = CODES
ACTION0 = CODES + 1  # action tokens ACTION0 + world.ACTIONS index
VOCAB = ACTION0 + len(world.ACTIONS)
FRAME_TOKENS = 1 + world.GRID * world.GRID  # L: the action token, then the frame's tokens
VIDEO_START = 1  # KV index of frame 0's action token
PATCHES = world.GRID * world.GRID

# 4 layers, hidden 256, 4 heads x 64, MLP 1024: 4.5 M parameters (9 MB as fp16).
WORLD_CONFIG = DemoConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=131072,
                          rope_theta=1e12, copy_offsets=(), copy_layers=None)


@dataclass(frozen=True)
class CircuitInit:
    """Sizes of the built-in copy circuit (see the module docstring)."""

    code_dim: int = 32
    gather_offsets: tuple[int, ...] = (1, 8, 7, 64)  # layer 0's heads, positions back
    aim_pairs: int = 8  # rotary pairs (fastest first) that aim the fixed-offset heads
    aim: float = 12.0  # their bias size: the score peak is aim^2 * aim_pairs / sqrt(head_dim)
    match_gain: float = 2.4  # layer 1's query / key gain on the codes
    out_gain: float = 1.5  # the output layer's gain on OUT
    free_scale: float = 0.1  # output maps (o_proj, down_proj) of the free parts start this much smaller
    seed: int = 0


def sequence(actions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """[1 + T * L] int64 from actions [T] (world.ACTIONS ids) and frame tokens [T, 64]."""
    actions, tokens = np.asarray(actions, np.int64), np.asarray(tokens, np.int64)
    if tokens.ndim != 2 or tokens.shape[1] != PATCHES or len(actions) != len(tokens):
        raise FastCarError(f"expected actions [T] and tokens [T, {PATCHES}], got {actions.shape} and {tokens.shape}")
    frames = np.concatenate([(ACTION0 + actions)[:, None], tokens], axis=1)
    return np.concatenate([[BOS], frames.reshape(-1)]).astype(np.int64)


def token_mask(seq_len: int) -> np.ndarray:
    """[seq_len] bool: the positions that hold frame tokens (not BOS, not action tokens)."""
    p = np.arange(seq_len)
    return (p >= VIDEO_START) & ((p - VIDEO_START) % FRAME_TOKENS != 0)


# ------------------------------------------------------------------------------------------------ the init
def _subspaces(cfg: DemoConfig, ci: CircuitInit) -> dict[str, slice]:
    k = ci.code_dim
    names = ["tok", "special", *[f"back{o}" for o in ci.gather_offsets], "out"]
    sizes = [k, 16, *[k] * len(ci.gather_offsets), k]
    if sum(sizes) > cfg.hidden_size:
        raise FastCarError(f"hidden size {cfg.hidden_size} cannot hold the circuit's {sum(sizes)} dimensions")
    out, start = {}, 0
    for n, s in zip(names, sizes, strict=True):
        out[n] = slice(start, start + s)
        start += s
    return out


def _content_dims(hd: int) -> np.ndarray:
    """Head dimensions of the slowest rotary pairs, slowest last: pair i is dims (i, i + hd/2)."""
    half = hd // 2
    pairs = np.arange(half)[::-1]  # slowest first
    return np.stack([pairs, pairs + half], 1).reshape(-1)


def init_circuit(model, cfg: DemoConfig, ci: CircuitInit) -> None:
    """Write the copy circuit of the module docstring into a freshly built model (in place)."""
    import torch

    if cfg.num_hidden_layers < 2 or cfg.num_attention_heads < max(len(ci.gather_offsets), 3):
        raise FastCarError("the circuit init needs >= 2 layers and a head per gather offset (and >= 3 heads)")
    hd = cfg.hidden_size // cfg.num_attention_heads
    sub = _subspaces(cfg, ci)
    rng = np.random.default_rng(ci.seed)
    k = ci.code_dim
    codes = rng.standard_normal((CODES, k))
    codes /= np.linalg.norm(codes, axis=1, keepdims=True)
    t = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.float32)  # noqa: E731
    m = model.model
    with torch.no_grad():
        for layer in m.layers:  # free parts start quiet so the circuit dominates the residual stream
            layer.self_attn.o_proj.weight.mul_(ci.free_scale)
            layer.mlp.down_proj.weight.mul_(ci.free_scale)
        emb = m.embed_tokens.weight
        emb.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(ci.seed))
        emb[:CODES, sub["tok"]] = t(codes)
        special = np.eye(16)[: VOCAB - CODES]
        emb[CODES:, sub["special"]] = t(special)
        # layer 0: fixed-offset gathers. With the embedding alone, rms(x) ~ |code| / sqrt(hidden), so the normed
        # code has norm ~sqrt(hidden); the output map scales it back to the embedding's size.
        theta = cfg.rope_theta ** (-np.arange(hd // 2) * 2 / hd)
        norm_in = math.sqrt(cfg.hidden_size)
        att = m.layers[0].self_attn
        for h, off in enumerate(ci.gather_offsets):
            rows = slice(h * hd, (h + 1) * hd)
            att.q_proj.weight[rows] = 0.0
            att.k_proj.weight[rows] = 0.0
            q = np.zeros(hd)
            kk = np.zeros(hd)
            p = np.arange(ci.aim_pairs)
            q[p] = ci.aim
            kk[p] = ci.aim * np.cos(off * theta[p])
            kk[p + hd // 2] = ci.aim * np.sin(off * theta[p])
            att.q_proj.bias[rows] = t(q)
            att.k_proj.bias[rows] = t(kk)
            att.v_proj.weight[rows] = 0.0
            att.v_proj.bias[rows] = 0.0
            att.v_proj.weight[h * hd: h * hd + k, sub["tok"]] = torch.eye(k)
            att.o_proj.weight[:, rows] = 0.0
            att.o_proj.weight[sub[f"back{off}"], h * hd: h * hd + k] = torch.eye(k) / norm_in
        # layer 1: content matches. After layer 0 about 1 + len(offsets) code subspaces of similar size share the
        # residual, so each normed code has norm ~sqrt(hidden / (1 + offsets)).
        norm1 = math.sqrt(cfg.hidden_size / (1 + len(ci.gather_offsets)))
        cdims = _content_dims(hd)
        left, up, up_next = sub["back1"], sub["back8"], sub["back7"]
        # (query sources, key sources): the token at the query is the left neighbour of the token it predicts,
        # `back7` its upper neighbour; a key's own left / upper neighbours are `back1` / `back8`
        matches = [((sub["tok"], up_next), (left, up)), ((sub["tok"],), (left,)), ((up_next,), (up,))]
        att = m.layers[1].self_attn
        for h, (qs, ks) in enumerate(matches):
            rows = slice(h * hd, (h + 1) * hd)
            per = len(cdims) // len(qs)
            use = min(per, k)
            for r in (att.q_proj, att.k_proj):
                r.weight[rows] = 0.0
                r.bias[rows] = 0.0
            for j, (qsrc, ksrc) in enumerate(zip(qs, ks, strict=True)):
                dims = cdims[j * per: j * per + use]
                for src, proj in ((qsrc, att.q_proj), (ksrc, att.k_proj)):
                    w = np.zeros((use, cfg.hidden_size))
                    w[np.arange(use), np.arange(src.start, src.start + use)] = ci.match_gain
                    proj.weight[h * hd + dims] = t(w)
            att.v_proj.weight[rows] = 0.0
            att.v_proj.bias[rows] = 0.0
            att.v_proj.weight[h * hd: h * hd + k, sub["tok"]] = torch.eye(k)
            att.o_proj.weight[:, rows] = 0.0
            att.o_proj.weight[sub["out"], h * hd: h * hd + k] = torch.eye(k) / (norm1 * len(matches))
        head = model.lm_head.weight
        head.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(ci.seed + 1))
        head[:CODES, sub["out"]] = t(codes) * ci.out_gain


def build_world_model(cfg: DemoConfig = WORLD_CONFIG, ci: CircuitInit | None = CircuitInit(), seed: int = 0):
    """A seeded LlamaForCausalLM with the copy circuit built in (ci=None: the plain random init)."""
    model = build_model(cfg, seed=seed)
    if ci is not None:
        init_circuit(model, cfg, ci)
    return model


# ------------------------------------------------------------------------------------------ data for training
@dataclass
class WorldBatch:
    """Training sequences [B, S], per-token loss weights [B, S] (0 where nothing is predicted), position ids
    [B, S], and the cell label of every frame token [B, S] (-1 elsewhere) for per-label accuracy."""

    seqs: np.ndarray
    weights: np.ndarray
    positions: np.ndarray
    labels: np.ndarray
    gaps: np.ndarray  # [B, S] frames since the target cell was last in view (0 elsewhere)


@dataclass(frozen=True)
class WorldData:
    """What a training step sees; every batch is a pure function of (seed, step)."""

    frames: int = 24
    batch: int = 4
    seed: int = 0
    label_weights: tuple[float, float, float] = (1.0, 4.0, 1.0)  # previous / revisit / new cells
    gap_prob: float = 0.5  # share of sequences whose later frames are shifted by a position gap
    max_gap: int = 65000


def encode_paths(tok, paths: list[world.WorldPath], data: WorldData, rng: np.random.Generator | None
                 ) -> WorldBatch:
    """Sequences, weights and labels of `paths`; rng draws the position gaps (None: no gaps)."""
    tokens = tok.encode(np.stack([p.frames for p in paths]))  # [B, T, 64]
    seqs = np.stack([sequence(p.actions, k) for p, k in zip(paths, tokens, strict=True)])
    b, s = seqs.shape
    labels = np.full((b, s), -1, np.int64)
    gaps = np.zeros((b, s), np.int64)
    mask = token_mask(s)
    labels[:, mask] = np.stack([p.cell_labels.reshape(-1) for p in paths])
    gaps[:, mask] = np.stack([p.gap.reshape(-1) for p in paths])
    lw = np.asarray(data.label_weights, np.float32)
    weights = np.where(labels >= 0, lw[np.maximum(labels, 0)], 0.0).astype(np.float32)
    weights[:, : VIDEO_START + FRAME_TOKENS] = 0.0  # frame 0 is given
    positions = np.broadcast_to(np.arange(s), (b, s)).copy()
    if rng is not None:
        for i in range(b):
            if rng.random() < data.gap_prob:
                cut = VIDEO_START + FRAME_TOKENS * int(rng.integers(1, data.frames))
                positions[i, cut:] += int(np.exp(rng.uniform(np.log(FRAME_TOKENS), np.log(data.max_gap))))
    return WorldBatch(seqs, weights, positions, labels, gaps)


def batch_for_step(tok, data: WorldData, step: int) -> WorldBatch:
    paths = world.make_paths("train", data.batch, data.frames, data.seed, start=step * data.batch)
    return encode_paths(tok, paths, data, np.random.default_rng([data.seed, 17, step]))


def heldout_batch(tok, data: WorldData, count: int = 16) -> WorldBatch:
    return encode_paths(tok, world.make_paths("eval", count, data.frames, data.seed), data, None)


def forward_loss(model, b: dict, bf16: bool):
    """(weighted cross-entropy, argmax predictions [B, S-1]) of a batch of torch tensors."""
    import torch

    with torch.autocast(b["seqs"].device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=b["seqs"][:, :-1], position_ids=b["positions"][:, :-1]).logits
    logits = logits.float()[..., :CODES]
    target = b["seqs"][:, 1:]
    w = b["weights"][:, 1:]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, CODES), target.clamp(max=CODES - 1).reshape(-1),
                                           reduction="none").reshape(target.shape)
    return (ce * w).sum() / w.sum(), logits.argmax(-1)


def accuracy_by_label(pred: np.ndarray, batch: WorldBatch, window_frames: int) -> dict[str, float]:
    """Teacher-forced token accuracy per cell label (frames 1..), revisits split at `window_frames`."""
    hit = pred == batch.seqs[:, 1:]
    lab, gap, w = batch.labels[:, 1:], batch.gaps[:, 1:], batch.weights[:, 1:] > 0
    out = {}
    for name, sel in (("previous", lab == world.PREVIOUS), ("revisit", lab == world.REVISIT),
                      ("revisit_far", (lab == world.REVISIT) & (gap > window_frames)),
                      ("new", lab == world.NEW), ("all", lab >= 0)):
        sel = sel & w
        out[name] = float(hit[sel].mean()) if sel.any() else float("nan")
    return out


def as_torch(b: WorldBatch, device: str = "cpu") -> dict:
    import torch

    return {"seqs": torch.from_numpy(b.seqs).to(device), "weights": torch.from_numpy(b.weights).to(device),
            "positions": torch.from_numpy(b.positions).to(device)}


@dataclass
class WorldTrainSettings:
    """The training run; `data` and `config` must match a checkpoint to resume it."""

    steps: int = 1500
    lr: float = 1e-3
    warmup: int = 30
    schedule_start: int = 0
    weight_decay: float = 0.01
    threads: int = 2
    bf16: bool = True
    eval_every: int = 25
    eval_paths: int = 16
    window_frames: int = 4  # revisits further back than this count as "far" in the evaluation
    checkpoint_seconds: float = 600.0
    tokenizer_sha256: str = ""
    data: WorldData = field(default_factory=WorldData)
    circuit: CircuitInit = field(default_factory=CircuitInit)
    config: DemoConfig = field(default_factory=lambda: WORLD_CONFIG)
