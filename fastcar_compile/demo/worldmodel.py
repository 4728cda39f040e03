"""The token world model: a LlamaForCausalLM over frames of 64 VQ tokens, one action token per frame.

Sequence = [BOS, action 0, frame 0 (64 tokens), action 1, frame 1, ...]: a frame is L = 65 tokens (its action, then
its 8x8 tokens in raster order), so the token at p - L is the same slot one frame earlier (FastCar's aligned token)
and `video_start` = 1. Frame 0 is given ("start"); each later frame is predicted from the action that moved the
camera and everything before it.

Why the init below: the model has to copy content from its past at two kinds of places, where the previous frame
showed it (one cell over, by the action) and where a frame long ago showed it (a revisit, keyed by content: the
cell's left and upper neighbours, once seen next to it, say what it is: a 2-D induction head). On a shared 2-core
CPU a freshly initialised model does not find such heads within hours, so they are built into the initial weights
and then trained with everything else. Every head that must find a distance is built from RoPE scores, which are
sums of cos / sin of the distance times the rotary frequencies: a linear program (`position_kernel`) picks the
weights that best separate the wanted distances from all others up to 1000 frames back.

- the embedding writes a token's code (a random unit vector) into a subspace TOK, special tokens a one-hot;
- layer 0 gathers: the codes 1, 8 and 7 tokens back (left neighbour, upper neighbour, upper neighbour of the token
  being predicted) into their own subspaces, and the frame's action (the nearest action token) as a one-hot;
- layer 1 marks the entering strip: per move, a head that attends to the frame's action token only from the
  positions whose predicted token lies where that move's new content enters, so the sum is 1 exactly there;
- layer 2 copies: outside the strip, from the slot one frame back the action moved this content from (its query
  aimed by the action one-hot); inside the strip, recall heads match the left / upper neighbour codes of the token
  to predict against every earlier key's own neighbours (non-rotating dimensions: any distance) and copy the key's
  code, with BOS as a sink that an exact match beats and a near miss does not;
- the output layer reads OUT as codes. Layer 3 starts as the usual random init (small output maps).

RoPE frequencies are chosen per rotary pair (`ROPE_FREQUENCIES`): the harmonics of a frame row, a geometric ladder
and zeros (content compared however far apart, 1000 frames = 65 k positions). Training also shifts the positions of
the frames after a random frame by a random gap, so the model sees such distances.
"""

from __future__ import annotations

import functools
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

# RoPE frequencies (radians per position), one per rotary pair of a 64-wide head: the harmonics of a frame row (period
# 8: which column a token is in), a geometric ladder from 1 to 1e-5 (where in the frame, how far back) and zeros (no
# rotation: content compared however far apart, 1000 frames = 65 k positions).
ROW_HARMONICS = tuple(2 * math.pi * k / world.GRID for k in range(1, world.GRID // 2 + 1))
NOPE_PAIRS = 12  # the last pairs: frequency 0
ROPE_FREQUENCIES = (*ROW_HARMONICS, *np.geomspace(1.0, 1e-5, 16).tolist(), *[0.0] * NOPE_PAIRS)
# 4 layers, hidden 256, 4 heads x 64, MLP 1024: 4.5 M parameters (9 MB as fp16).
WORLD_CONFIG = DemoConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=131072,
                          copy_offsets=(), copy_layers=None, rope_frequencies=ROPE_FREQUENCIES)


@dataclass(frozen=True)
class CircuitInit:
    """Sizes of the built-in circuit (see the module docstring). Scores are in logits (after 1/sqrt(head))."""

    code_dim: int = 32
    aim: float = 60.0  # the fixed-offset heads' score margin between their offset and any other distance
    detect: float = 40.0  # the action and strip heads' margin between hit and miss
    match: float = 40.0  # a recall head's score for an exact code match
    copy_gate: float = 90.0  # the copy head's sink rises by this in the entering strip (above its aim)
    recall_gate: float = 100.0  # the recall heads' sink outside the entering strip
    recall_sink: float = 25.0  # ... and inside it: an exact match beats it, a near miss does not
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
    names = ["tok", "special", "action", "strip", "back1", "back8", "back7", "out"]
    sizes = [k, 8, 8, 1, k, k, k, k]
    if sum(sizes) > cfg.hidden_size:
        raise FastCarError(f"hidden size {cfg.hidden_size} cannot hold the circuit's {sum(sizes)} dimensions")
    out, start = {}, 0
    for n, s in zip(names, sizes, strict=True):
        out[n] = slice(start, start + s)
        start += s
    return out


def _features(freqs: np.ndarray, d: np.ndarray) -> np.ndarray:
    d = np.atleast_1d(d).astype(np.float64)
    return np.concatenate([np.cos(d[:, None] * freqs), np.sin(d[:, None] * freqs)], 1)


@functools.lru_cache(maxsize=16)
def position_kernel(freqs: tuple[float, ...], hit: tuple[int, ...], miss: tuple[int, ...]) -> tuple[np.ndarray, float]:
    """(weights [2, pairs] of K(d) = sum_i c_i cos(d w_i) + s_i sin(d w_i), |c|, |s| <= 1, margin t): the largest t
    with K >= t at the distances `hit` and K <= -t at `miss`.

    Why a linear program: RoPE scores are such sums, so a head that should find one distance (or a set, e.g. the
    columns of a frame) among all others must be built from them; the LP says whether and how well it can."""
    from scipy.optimize import linprog

    f = np.asarray(freqs, np.float64)
    n = 2 * len(f)
    a_hit, a_miss = -_features(f, np.asarray(hit)), _features(f, np.asarray(miss))
    a_ub = np.concatenate([np.concatenate([a_hit, np.ones((len(a_hit), 1))], 1),
                           np.concatenate([a_miss, np.ones((len(a_miss), 1))], 1)])
    c = np.zeros(n + 1)
    c[-1] = -1.0
    r = linprog(c, A_ub=a_ub, b_ub=np.zeros(len(a_ub)), bounds=[(-1, 1)] * n + [(None, None)], method="highs")
    if r.status != 0 or r.x[-1] <= 1e-6:
        raise FastCarError(f"no RoPE kernel separates these distances with frequencies {freqs[:6]}...")
    return r.x[:-1].reshape(2, len(f)), float(r.x[-1])


LOOKBACK = 1000  # frames the action and strip heads are built to see past (the benchmark's longest path)


def _older(deltas) -> tuple[int, ...]:
    """Distances to the action tokens of earlier frames from a token `deltas` after its own frame's action."""
    k = np.arange(1, LOOKBACK + 1)[:, None] * FRAME_TOKENS
    return tuple(int(x) for x in np.unique((np.asarray(deltas)[None, :] + k).reshape(-1)))


def _kernels(freqs: tuple[float, ...]) -> dict[str, tuple[np.ndarray, float]]:
    """The RoPE kernels the circuit uses: a sharp peak (fixed offsets), the nearest action token, and per move the
    distances from the frame's action token at which the predicted token lies in the strip that enters view."""
    inframe = np.arange(FRAME_TOKENS - 1)  # distance from the action token of the token that predicts index d
    out = {"peak": position_kernel(freqs, (0,), tuple(int(x) for x in range(-80, 65001) if x != 0)),
           "nearest": position_kernel(freqs, tuple(range(FRAME_TOKENS)), _older(np.arange(FRAME_TOKENS)))}
    g = world.GRID
    strips = {"right": inframe[inframe % g == g - 1], "left": inframe[inframe % g == 0],
              "down": inframe[inframe >= g * (g - 1)], "up": inframe[inframe < g]}
    for name, hit in strips.items():
        miss = tuple(int(x) for x in inframe if x not in set(hit)) + _older(np.arange(FRAME_TOKENS))
        out[name] = position_kernel(freqs, tuple(int(x) for x in hit), miss)
    return out


def _shifted(w: np.ndarray, freqs: np.ndarray, shift: int) -> np.ndarray:
    """Weights of K(d - shift) from those of K(d)."""
    c, s = w
    cs, sn = np.cos(shift * freqs), np.sin(shift * freqs)
    return np.stack([c * cs - s * sn, c * sn + s * cs])


def _qk(w: np.ndarray, margin: float, score: float, hd: int) -> tuple[np.ndarray, np.ndarray]:
    """(query [hd], key [hd]) whose RoPE score at distance d (query position - key position), divided by
    sqrt(hd), is score / margin * K(d): with the key (a, 0) per pair and the query (c, -s) / a * g2."""
    half = hd // 2
    a = math.sqrt(score / margin * math.sqrt(hd))
    k = np.zeros(hd)
    k[:half] = a
    q = np.concatenate([w[0], -w[1]]) * a
    return q, k


def _t(a):
    import torch

    return torch.as_tensor(np.asarray(a), dtype=torch.float32)


@dataclass
class _Heads:
    """Writes single attention heads of the circuit: hd wide, RoPE `freqs`, the LP kernels `ker`."""

    hd: int
    freqs: np.ndarray
    ker: dict

    def clear(self, att, h: int) -> slice:
        rows = slice(h * self.hd, (h + 1) * self.hd)
        for r in (att.q_proj, att.k_proj, att.v_proj):
            r.weight[rows] = 0.0
            r.bias[rows] = 0.0
        att.o_proj.weight[:, rows] = 0.0
        return rows

    def positional(self, att, h: int, name: str, score: float, shift: int = 0, key_from=None, norm: float = 1.0):
        """Head h scores distances with kernel `name` (moved by `shift`); keys on every token (a bias) or only
        on the tokens whose special dims `key_from` are set."""
        rows = slice(h * self.hd, (h + 1) * self.hd)
        w, margin = self.ker[name]
        q, kv = _qk(_shifted(w, self.freqs, shift) if shift else w, margin, score, self.hd)
        att.q_proj.bias[rows] = _t(q)
        if key_from is None:
            att.k_proj.bias[rows] = _t(kv)
        else:
            for col in key_from:
                att.k_proj.weight[rows, col] = _t(kv) / norm

    def copy_to(self, att, h: int, src: slice | list, dst: slice, norm: float, share: float = 1.0):
        import torch

        idx = list(range(src.start, src.stop)) if isinstance(src, slice) else list(src)
        n, hd = len(idx), self.hd
        att.v_proj.weight[h * hd: h * hd + n, idx] = torch.eye(n)
        att.o_proj.weight[dst.start: dst.start + n, h * hd: h * hd + n] = torch.eye(n) * share / norm


def _write_copy_layer(att, hw: _Heads, cfg: DemoConfig, ci: CircuitInit, sub: dict[str, slice], bos: int,
                      sink_dim: int, content: np.ndarray, used: list[int]) -> None:
    """Layer 2 (module docstring): the copy head and the recall heads, BOS their sink."""
    hd, k = hw.hd, ci.code_dim
    kc = min(k, len(content))
    norm0 = math.sqrt(cfg.hidden_size)
    # copy from the slot one frame back the action moved this content from, unless in the strip; recall by the
    # left or the upper neighbour's code, only in the strip
    norm2 = math.sqrt(cfg.hidden_size / 7)
    back = {a: FRAME_TOKENS - 1 - dx - world.GRID * dy for a, (dx, dy) in world.MOVES.items()}
    rows = hw.clear(att, 0)
    w, margin = hw.ker["peak"]
    for name, off in back.items():
        q, kv = _qk(_shifted(w, hw.freqs, off), margin, ci.aim, hd)
        att.q_proj.weight[rows, sub["action"].start + world.ACTIONS.index(name)] = _t(q) / norm2
    att.k_proj.bias[rows] = _t(kv)
    # the sink: BOS's key on a non-rotating dimension (BOS's residual is its one-hot alone: normed, sqrt(hidden))
    sink = math.sqrt(math.sqrt(hd))
    to_q = math.sqrt(hd) / sink  # a query of value * to_q scores `value` logits on the sink
    att.k_proj.weight[sink_dim, bos] = sink / norm0
    att.q_proj.bias[sink_dim] = (ci.aim - ci.copy_gate / 2) * to_q
    att.q_proj.weight[sink_dim, sub["strip"].start] = ci.copy_gate * to_q / norm2
    hw.copy_to(att, 0, sub["tok"], sub["out"], norm2)
    gain = math.sqrt(ci.match * math.sqrt(hd) * k / kc) / norm2  # an exact match of unit codes scores `match`
    for h, (qsrc, ksrc) in ((1, ("tok", "back1")), (2, ("back7", "back8"))):
        rows = hw.clear(att, h)
        for j in range(kc):
            att.q_proj.weight[h * hd + content[j], sub[qsrc].start + j] = gain
            att.k_proj.weight[h * hd + content[j], sub[ksrc].start + j] = gain
        att.k_proj.weight[h * hd + sink_dim, bos] = sink / norm0
        att.q_proj.bias[h * hd + sink_dim] = ci.recall_gate * to_q
        att.q_proj.weight[h * hd + sink_dim, sub["strip"].start] = (ci.recall_sink - ci.recall_gate) * to_q / norm2
        hw.copy_to(att, h, sub["tok"], sub["out"], norm2)
    att.o_proj.weight[used, 3 * hd:] = 0.0


def init_circuit(model, cfg: DemoConfig, ci: CircuitInit) -> None:
    """Write the circuit of the module docstring into a freshly built model (in place)."""
    import torch

    if cfg.num_hidden_layers < 3 or cfg.num_attention_heads < 4 or cfg.rope_frequencies is None:
        raise FastCarError("the circuit init needs >= 3 layers, >= 4 heads and the world model's rope_frequencies")
    hd = cfg.hidden_size // cfg.num_attention_heads
    half = hd // 2
    freqs = np.asarray(cfg.rope_frequencies, np.float64)
    nope = np.nonzero(freqs == 0)[0]
    if len(nope) < 2 or 2 * len(freqs) != hd:
        raise FastCarError("rope_frequencies must give one frequency per rotary pair, some of them 0")
    sub = _subspaces(cfg, ci)
    rng = np.random.default_rng(ci.seed)
    k = ci.code_dim
    codes = rng.standard_normal((CODES, k))
    codes /= np.linalg.norm(codes, axis=1, keepdims=True)
    ker = _kernels(tuple(cfg.rope_frequencies))
    m = model.model
    acts = {name: sub["special"].start + 1 + i for i, name in enumerate(world.ACTIONS)}  # special row 0 is BOS
    bos = sub["special"].start
    sink_dim = int(nope[0])  # a pair that never turns: the sink's score is the same at any distance
    content = np.concatenate([nope[1:], nope[1:] + half])  # the other non-rotating dimensions: codes
    with torch.no_grad():
        used = list(range(sub["out"].stop))  # the circuit's subspaces: nothing else writes there at the start
        for i, layer in enumerate(m.layers):  # free parts start quiet so the circuit dominates the residual stream
            layer.self_attn.o_proj.weight.mul_(ci.free_scale)
            layer.mlp.down_proj.weight.mul_(ci.free_scale)
            if i < 3:
                layer.mlp.down_proj.weight[used] = 0.0
        emb = m.embed_tokens.weight
        emb.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(ci.seed))
        emb[:, used] = 0.0
        emb[:CODES, sub["tok"]] = _t(codes)
        emb[CODES:, sub["special"]] = _t(np.eye(sub["special"].stop - sub["special"].start)[: VOCAB - CODES])

        hw = _Heads(hd, freqs, ker)
        # layer 0: rms(x) ~ |code| / sqrt(hidden), so a normed code or one-hot has norm ~sqrt(hidden)
        norm0 = math.sqrt(cfg.hidden_size)
        att = m.layers[0].self_attn
        for h, off in enumerate((1, 8, 7)):  # the token `off` back: left neighbour, upper, upper of the next
            hw.clear(att, h)
            hw.positional(att, h, "peak", ci.aim, shift=off)
            hw.copy_to(att, h, sub["tok"], sub[f"back{off}"], norm0)
        hw.clear(att, 3)  # the frame's action: the nearest action token
        hw.positional(att, 3, "nearest", ci.detect, key_from=[acts[a] for a in world.ACTIONS], norm=norm0)
        hw.copy_to(att, 3, [acts[a] for a in world.ACTIONS], sub["action"], norm0)
        # layer 1: the entering strip. Head h attends to the frame's action token only when the predicted token
        # lies where move h's new content enters, and copies that action's one-hot entry: their sum is 1 exactly in
        # the strip of the frame's own move
        norm1 = math.sqrt(cfg.hidden_size / 6)  # tok, action, back1/8/7 (+ special on action tokens)
        att = m.layers[1].self_attn
        for h, move in enumerate(("right", "left", "down", "up")):
            hw.clear(att, h)
            hw.positional(att, h, move, ci.detect, key_from=[acts[a] for a in world.ACTIONS], norm=norm1)
            att.v_proj.weight[h * hd, acts[move]] = 1.0
            att.o_proj.weight[sub["strip"].start, h * hd] = 1.0 / norm1
        _write_copy_layer(m.layers[2].self_attn, hw, cfg, ci, sub, bos, sink_dim, content, used)
        head = model.lm_head.weight
        head.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(ci.seed + 1))
        head[:CODES, sub["out"]] = _t(codes) * ci.out_gain


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
