"""The stream runtime's side of AnnSA compiled into a step graph (passes/dit_annsa.py): each cached key's bucket
ids, and once per chunk the graph's inputs naming what the chunk's queries attend to.

Keys are coded once, when their frame lands in the ring (RingCache's buffers: the post-RoPE keys attention
reads), by the NumPy hasher (fastar/lsh.py, fastar/int8.py: the eager runtime's). Per chunk (the denoising
steps share it): `annsa_dense` = the token positions of the resident sink frames and of the `annsa_local`
frames before the chunk; every other resident slot goes into the key blocks of each table: per (row, head,
table) the occupied buckets, each bucket's slot positions padded to the fullest (bias -inf), and those keys'
ids in every table (so the graph counts a pair once, in the first table where it meets).
"""

from __future__ import annotations

import itertools

import numpy as np

from fastcar_compile.core.contract import (
    ANNSA_DENSE,
    ANNSA_INPUTS,
    ANNSA_NATIVE,
    AnnSARecord,
    annsa_io,
)
from fastcar_compile.fastar.config import hasher_of


def blocks(codes: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, ...]:
    """Key blocks of the slots at `positions` [N] whose ids are `codes` [B, H, N, T]: (buckets [B, H, T, K]
    (-1: none), keys [B, H, T, K, M] (cache positions), bias [B, H, T, K, M] (0, -inf padding), kcodes
    [B, H, T, T, K, M] (the block keys' ids in each table; -1 padding)). K = the most occupied buckets of any (row, head, table), M = the fullest."""
    B, H, N, T = codes.shape
    if N == 0:
        return (np.full((B, H, T, 1), -1, np.int64), np.zeros((B, H, T, 1, 1), np.int64),
                np.full((B, H, T, 1, 1), -np.inf, np.float32), np.full((B, H, T, T, 1, 1), -1, np.int64))
    rows = B * H * T
    per = codes.reshape(B * H, N, T)
    flat = per.transpose(0, 2, 1).reshape(rows, N)  # row = (b * H + h) * T + t
    order = np.argsort(flat, axis=1, kind="stable")
    sc = np.take_along_axis(flat, order, 1)
    new = np.ones((rows, N), bool)
    new[:, 1:] = sc[:, 1:] != sc[:, :-1]
    bucket = np.cumsum(new, 1) - 1  # ordinal of the bucket in its row
    at = np.arange(N)
    rank = at - np.maximum.accumulate(np.where(new, at, 0), axis=1)
    K, M = int(bucket.max()) + 1, int(rank.max()) + 1
    r = np.repeat(np.arange(rows), N)
    bk, rk = bucket.ravel(), rank.ravel()
    ids = np.full((rows, K), -1, np.int64)
    ids[r, bk] = sc.ravel()
    keys = np.zeros((rows, K, M), np.int64)
    keys[r, bk, rk] = positions[order].ravel()
    bias = np.full((rows, K, M), -np.inf, np.float32)
    bias[r, bk, rk] = 0.0
    kcodes = np.full((rows, K, M, T), -1, np.int64)
    kcodes[r, bk, rk] = per[(np.arange(rows) // T)[:, None], order].reshape(rows * N, T)
    return (ids.reshape(B, H, T, K), keys.reshape(B, H, T, K, M), bias.reshape(B, H, T, K, M),
            np.ascontiguousarray(kcodes.reshape(B, H, T, K, M, T).transpose(0, 1, 2, 5, 3, 4)))


def slot_lists(codes: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, ...]:
    """The native form's inputs from every cache slot's ids `codes` [B, H, S, T] and the bucketed `positions`
    [N]: (key_codes [B, H, S, T], -1 outside `positions`; sorted_codes, sorted_slots [B, H, T, N]: per table the
    ids ascending and their positions, so each bucket's slots are one run the kernel finds by binary search)."""
    key_codes = np.full(codes.shape, -1, np.int64)
    key_codes[:, :, positions] = codes[:, :, positions]
    sel = codes[:, :, positions].transpose(0, 1, 3, 2)  # [B, H, T, N]
    order = np.argsort(sel, axis=-1, kind="stable")
    return (key_codes, np.ascontiguousarray(np.take_along_axis(sel, order, -1)),
            np.ascontiguousarray(positions[order]))


class AnnIndex:
    """One video's AnnSA state beside a RingCache: per layer the bucket ids of every cached key [B, H, slots*T, T]
    and the inputs built for the current chunk."""

    def __init__(self, mode: AnnSARecord, layers: int, tokens: int, sinks: int, head_dim: int):
        self.mode, self.layers, self.tokens, self.sinks = mode, layers, tokens, sinks
        self.hasher = hasher_of(mode, head_dim)
        self.codes: list[np.ndarray] = []
        self.coded: dict[int, int] = {}  # ring slot -> the frame whose keys' ids `codes` holds there
        self.built: tuple | None = None
        self.feed: dict[str, np.ndarray] = {}
        self.split: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int64), np.zeros(0, np.int64))

    def _code_new_frames(self, ring) -> None:
        size = ring.buffers[0].shape[2]
        if not self.codes or self.codes[0].shape[2] != size:  # first use, or the ring's buffers grew
            B, H = ring.buffers[0].shape[:2]
            grown = [np.full((B, H, size, self.hasher.tables), -1, np.int64) for _ in range(self.layers)]
            for old, new in zip(self.codes, grown, strict=False):
                new[:, :, :old.shape[2]] = old
            self.codes = grown
        t = self.tokens
        for slot, frame in ring.slot_frame.items():
            if self.coded.get(slot) != frame:
                for i in range(self.layers):
                    key = ring.buffers[2 * i][:, :, slot * t:(slot + 1) * t]
                    self.codes[i][:, :, slot * t:(slot + 1) * t] = self.hasher.codes(key)
                self.coded[slot] = frame

    def inputs(self, ring, frame_start: int) -> dict[str, np.ndarray]:
        """The graph's AnnSA inputs for a step of the chunk starting at `frame_start` (built once per chunk)."""
        if not ring.buffers:
            raise RuntimeError("AnnIndex.inputs before the ring's buffers exist")
        state = (frame_start, ring.buffers[0].shape[2], tuple(sorted(ring.slot_frame.items())))
        if state == self.built:
            return self.feed
        self._code_new_frames(ring)
        t, local = self.tokens, self.mode.annsa_local
        dense, sparse = [], []
        for slot, frame in sorted(ring.slot_frame.items()):
            span = np.arange(slot * t, (slot + 1) * t, dtype=np.int64)
            (dense if frame < self.sinks or frame >= frame_start - local else sparse).append(span)
        cat = [np.concatenate(x) if x else np.zeros(0, np.int64) for x in (dense, sparse)]
        self.split = (cat[0], cat[1])
        feed = {ANNSA_DENSE: cat[0]}
        form = self.mode.annsa_kernel
        for i in range(self.layers):
            names = annsa_io(i)
            if form == ANNSA_NATIVE:
                parts = slot_lists(self.codes[i], cat[1])
            else:
                parts = blocks(np.ascontiguousarray(self.codes[i][:, :, cat[1]]), cat[1])
            feed.update(zip((names[k] for k in ANNSA_INPUTS[form]), parts, strict=True))
        self.feed, self.built = feed, state
        return feed

    def executed_pairs(self, layer: int, query_codes: np.ndarray) -> int:
        """q.k pairs layer `layer`'s step computed with the chunk's query ids [B, H, Q, T] (the graph's
        `annsa_codes.N`): every query with the dense slots and the chunk, and with each bucketed slot sharing a
        bucket in some table (once)."""
        B, H, Q, _ = query_codes.shape
        dense, sparse = self.split
        return B * H * Q * (dense.size + Q) + shared_pairs(query_codes, self.codes[layer][:, :, sparse])


def shared_pairs(query_codes: np.ndarray, key_codes: np.ndarray) -> int:
    """How many (query, key) pairs of the same (row, head) share a bucket in at least one table: query_codes
    [B, H, Q, T], key_codes [B, H, N, T]. By inclusion-exclusion over the tables' subsets (a query's keys with
    equal ids on a subset, counted by sorting: O((Q + N) 2^T)), no query x key comparison; more than 3 tables
    compare every pair."""
    B, H, Q, T = query_codes.shape
    N = key_codes.shape[2]
    if N == 0 or Q == 0:
        return 0
    if T > 3:
        return int(sum((query_codes[b, h][:, None] == key_codes[b, h][None]).any(-1).sum()
                       for b in range(B) for h in range(H)))
    group = np.arange(B * H, dtype=np.int64)
    qc, kc = query_codes.reshape(B * H, Q, T), key_codes.reshape(B * H, N, T)
    total = 0
    for size in range(1, T + 1):
        for subset in itertools.combinations(range(T), size):
            qk, kk = group[:, None], group[:, None]
            for t in subset:  # ids < 2^16 (CODE_SPAN): the group and up to 3 ids in one int64
                qk, kk = (qk << 16) | qc[:, :, t], (kk << 16) | kc[:, :, t]
            keys = np.sort(kk.ravel())
            count = np.searchsorted(keys, qk.ravel(), "right") - np.searchsorted(keys, qk.ravel(), "left")
            total += (1 if size % 2 else -1) * int(count.sum())
    return total
