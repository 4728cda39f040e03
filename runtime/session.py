"""`FastCarSession`: one ONNX Runtime session plus the recurrent state a decoder carries between steps.

A compiled fast.onnx carries state that generic decode drivers do not know (MLP caches, age counters, the
threshold, `video_start`, docs/DESIGN.md). This class pairs every `past_*` input with its `present_*` output,
allocates the new-video state, and runs one step at a time. The same class runs the original, uncompiled
model (the dense baseline): it then simply has no FastCar state.
"""

from __future__ import annotations

import hashlib
import operator
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastcar_compile.core import contract
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.fileio import model_fingerprint, read_json
from fastcar_compile.core.limits import INT64_MAX, MAX_THREADS, check_fits_memory, check_int
from fastcar_compile.core.locks import folder_lock
from fastcar_compile.runtime import loader
from fastcar_compile.runtime.binding import StepBinding
from fastcar_compile.runtime.loader import DEFAULT_THREADS
from fastcar_compile.runtime.tokens import check_token_ids

_ORT_DTYPES: dict[str, np.dtype] = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(float16)": np.dtype(np.float16),
    "tensor(double)": np.dtype(np.float64),
    "tensor(int64)": np.dtype(np.int64),
    "tensor(int32)": np.dtype(np.int32),
    "tensor(bool)": np.dtype(np.bool_),
    "tensor(uint8)": np.dtype(np.uint8),
    "tensor(int8)": np.dtype(np.int8),
}


@dataclass(frozen=True)
class StateSpec:
    """One `past_*` input / `present_*` output pair and how to allocate it for a new video."""

    input: str
    output: str
    dtype: np.dtype
    shape: tuple[int | str, ...]  # ints, "batch", or the growing "past" axis of a KV cache
    fill: float
    kind: str  # "kv" or "fastcar"

    def empty(self, batch: int) -> np.ndarray:
        dims = [batch if d == "batch" else 0 if d == "past" else int(d) for d in self.shape]
        return np.full(dims, self.fill, dtype=self.dtype)


@dataclass
class DecodeState:
    """Everything a session carries between steps for one batch of rows (one video per row).

    `owner` identifies the model that made it, so state from another model is refused instead of silently
    producing garbage.
    """

    arrays: dict[str, np.ndarray]
    batch: int
    past_len: int
    video_start: int
    owner: str
    attention_mask: np.ndarray  # [batch, past_len] int64: 0 for left padding
    consumed: bool = False  # set when a step updated these arrays in place (native kernels)
    real_len: np.ndarray | None = None  # [batch] real (unpadded) tokens so far: the next position id
    mask_buffer: np.ndarray | None = None  # [batch, max_length] (shared KV): attention_mask is a view of it
    # this video's IO binding (native kernels / shared KV), handed on to the next state: per video, not per
    # session, so videos stepped from several threads never share one (runtime/binding.py)
    binding: StepBinding | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.real_len is None:
            self.real_len = self.attention_mask.sum(axis=1).astype(np.int64)

    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays.values()))


@dataclass(frozen=True)
class SlotSnapshot:
    """The FastCar state rows a step will write, copied before it (`FastCarSession.snapshot`)."""

    past_len: int  # KV length before the step
    slots: np.ndarray  # [seq] slot of each token of the step
    written: np.ndarray  # [seq] bool: the token is video (its slot is written)
    rows: dict[str, np.ndarray]  # state input -> its rows at `slots` ([batch, seq, ...])


@dataclass
class StepOutput:
    """Result of one step: last-position logits, the new state, and (FastCar models) what each layer did."""

    logits: np.ndarray  # [batch, seq, vocab]
    state: DecodeState
    # [num_rewritten_layers, batch] bool for a single-token decode step, [layers, batch, seq] for a multi-token one
    # (1 < seq <= L after the prefill, models that decide per token there); None for a prefill
    replay: np.ndarray | None = None
    tas: np.ndarray | None = None  # [num_rewritten_layers, batch, seq] float32, diagnostics models only
    extra: dict[str, np.ndarray] = field(default_factory=dict)


def _check_positions(position_ids: Any, shape: tuple[int, ...]) -> np.ndarray:
    """position_ids as int64 [batch, seq] (broadcast), refused when not integers, of another shape or negative
    (a negative position indexes RoPE's tables from their end: plausible logits, wrong model)."""
    p = np.asarray(position_ids)
    if p.dtype.kind not in "iu":
        raise FastCarError(f"position_ids must be integers, got {p.dtype} values")
    try:
        p = np.ascontiguousarray(np.broadcast_to(p.astype(np.int64), shape))
    except ValueError:
        raise FastCarError(f"position_ids must be {list(shape)} like input_ids, got {list(p.shape)}") from None
    if p.size and p.min() < 0:
        raise FastCarError(f"position_ids must be >= 0, got {int(p.min())}")
    return p


class FastCarSession:
    """Run a FastCar-compiled (or the original dense) decoder step by step in ONNX Runtime.

    `frame_tokens` is read from the model's metadata; pass it for a dense model so `generate` knows the
    frame size. The native `ai.fastcar` kernels are registered when built (see runtime/native) unless
    `native=False`; without them ORT runs the model-local function bodies.
    """

    def __init__(self, path: str | os.PathLike, providers: Sequence[str] | None = None,
                 session_options: Any = None, *, frame_tokens: int | None = None,
                 native: bool | None = None, threads: int = DEFAULT_THREADS, inplace: bool | None = None,
                 max_length: int | None = None):
        # the model folder's shared lock while the model and its external data are read: a compile replacing it
        # meanwhile waits to delete the data this load reads (fastcar_compile/core/locks.py, save.py)
        with folder_lock(Path(path).parent, shared=True):
            self._open(path, providers, session_options, frame_tokens=frame_tokens, native=native,
                       threads=threads, inplace=inplace, max_length=max_length)

    def _open(self, path: str | os.PathLike, providers: Sequence[str] | None, session_options: Any, *,
              frame_tokens: int | None, native: bool | None, threads: int, inplace: bool | None,
              max_length: int | None) -> None:
        threads = check_int("threads", threads, 0, MAX_THREADS, "ONNX Runtime threads; 0 = one per core")
        self.path = loader.check_model_path(path)
        so = session_options if session_options is not None else loader.session_options(threads)
        so.enable_mem_pattern = False  # also on a caller's options (loader.session_options: flat memory)
        self.session, self.native_library = loader.open_session(
            self.path, so, providers=list(providers) if providers else None, native=native)
        self._read_model(frame_tokens)
        self._read_state()
        self._prepare_steps(inplace)
        self._prepare_kv(max_length)

    def _read_model(self, frame_tokens: int | None) -> None:
        """The model's metadata and I/O: what FastCar compiled in (layers, L, tau), refusing a model that is no
        decoder with a KV cache, or a frame_tokens that contradicts the compiled one."""
        self.meta: dict[str, str] = dict(self.session.get_modelmeta().custom_metadata_map)
        self.fastcar: contract.FastCarMetadata | None = contract.FastCarMetadata.from_props(self.meta)
        self.is_fastcar = self.fastcar is not None
        self._inputs = {i.name: i for i in self.session.get_inputs()}
        self._outputs = {o.name: o for o in self.session.get_outputs()}
        self.output_names = list(self._outputs)
        self._kv_stats_names = [n for n in self.output_names if n.startswith(contract.KV_STATS_PREFIX)]
        if contract.INPUT_IDS not in self._inputs:
            raise FastCarError(f"{self.path} has no `{contract.INPUT_IDS}` input; is it a decoder exported with "
                               "KV cache?")
        if contract.LOGITS not in self._outputs:
            raise FastCarError(f"{self.path} has no `logits` output; export the causal LM head too")
        fc = self.fastcar
        meta_l = fc.frame_tokens if fc is not None else None
        if meta_l is not None and frame_tokens is not None and frame_tokens != meta_l:
            raise FastCarError(f"frame_tokens={frame_tokens} but {self.path.name} was compiled for "
                               f"L={meta_l}; drop the argument or recompile")
        self.frame_tokens: int | None = meta_l if meta_l is not None else frame_tokens
        self.layers: list[int] = list(fc.layers) if fc is not None else []
        self.num_layers = (fc.num_layers if fc is not None else 0) or self._count_kv_layers()
        self.per_layer_threshold = fc.per_layer_threshold if fc is not None else False
        self.default_threshold = fc.threshold if fc is not None else None
        # tau is a plain input (runtime/overridable.py): every run feeds one, the metadata's default unless the
        # caller's
        self._feed_tau = contract.THRESHOLD in self._inputs
        self.max_replay = fc.max_replay if fc is not None else 0
        logits_shape = self._outputs[contract.LOGITS].shape
        self.vocab: int | None = logits_shape[-1] if logits_shape and isinstance(logits_shape[-1], int) else None

    def _read_state(self) -> None:
        """The state the model carries between steps (past_* inputs paired with present_* outputs), what a
        rejected draft token must restore, and where each layer's replay decisions are read."""
        fc = self.fastcar
        self.specs: list[StateSpec] = self._pair_state()
        # the FastCar state indexed by slot ([batch, L] ages, [batch, L, hidden] MLP caches): what a verify step
        # writes per token, one slot each, and a rejected draft token must restore (snapshot / rewind)
        self._slot_specs = [s for s in self.specs if s.kind == "fastcar" and len(s.shape) in (2, 3)
                            and s.shape[1] == self.frame_tokens]
        # layer -> (age output, value of a slot just written by a computed MLP = the new-video fill + 1):
        # 0 normally (fill -1), 1 in onnxruntime-genai's zero-filled encoding (age + 1, passes/genai_state.py)
        # (read from the next state's arrays, where the age output lands under its input's name)
        ages: dict[int, tuple[str, int]] = {}
        for e in (fc.state if fc is not None else []):
            m = re.search(r"\.(\d+)(\.recurrent_state)?$", e.input)
            if e.dtype == "int64" and m:
                ages[int(m.group(1))] = (e.input, int(e.fill) + 1)
        self._replay_names = [contract.replay_mask_output(n) for n in self.layers]
        self._ages = [ages[n] for n in self.layers] if all(n in ages for n in self.layers) else None
        self.has_diagnostics = all(contract.tas_output(n) in self._outputs for n in self.layers) and bool(self.layers)
        self.signature = self._signature()

    def _prepare_steps(self, inplace: bool | None) -> None:
        """What the steps keep between calls: the IO binding's plan (made on the first bound step), the feeds the
        model takes, and whether the FastCar state is written in place."""
        if inplace and self.native_library is None:
            raise FastCarError("inplace=True needs the native kernels (the function bodies would read the "
                               "cache while overwriting it); build them or drop inplace")
        # in place: present_mlp_* are bound to the buffers of past_mlp_*, so the cache is never copied
        self._vocab: int | None = None
        self._logits_dtype = np.dtype(np.float32)
        # IO binding (_run_bound), kept between steps in each video's state: see runtime/binding.py
        self._tau_last: tuple[Any, np.ndarray] | None = None  # (the caller's threshold as a key, its array)
        self._plan_lock = threading.Lock()  # the plan below is made once, by whichever thread steps first
        self._ort_time = threading.local()  # last_ort_s of the calling thread
        # made once on the first bound step: each state spec with how its output is bound ("fast": to its input's
        # buffer; "shared": the fixed KV buffer, past and present; "kv": a new growing buffer), and the outputs
        # written into buffers bound once (logits, diagnostics); None: an output of unknown shape (plain runs)
        self._state_plan: list[tuple[StateSpec, str]] | None = None
        self._fresh: list[tuple[str, np.dtype]] = []
        self._all_inplace = False  # every state output is its input's buffer: the next state reuses the arrays
        self._planned = False
        self._feeds_mask = contract.ATTENTION_MASK in self._inputs
        self._ones_buffer = np.ones(0, np.int64)  # `_ones`
        self._feeds_positions = contract.POSITION_IDS in self._inputs
        self._feeds_video_start = contract.VIDEO_START in self._inputs
        self.inplace = bool(self.native_library is not None and self.layers if inplace is None else inplace)

    def _prepare_kv(self, max_length: int | None) -> None:
        """The KV cache's fixed buffers: max_length's shared buffer, the compressed cache's budgets, the packed
        rotary's table; refused when one video's fixed buffers cannot fit in memory."""
        fc = self.fastcar
        # max_length: one KV buffer per video, [batch, kv_heads, max_length, head_dim], bound as both past and
        # present of GroupQueryAttention, which then appends in place (no per-step cache copy)
        self.max_length = self._check_shared_kv(max_length)
        # packed q/k/v (--pack-qkv): the rotary is at the KV index (the export's positions plus the row's left
        # padding; equal scores, RoPE sees only differences), from a table of this many positions; None: the graph
        # rotates at the position_ids fed
        self.rotary_positions: int | None = fc.rotary_positions if fc is not None else None
        # compressed KV cache (kv_compress metadata): KV inputs hold `budget` slots per KV head, fixed size
        # (per layer: --kv-layer gives layers different budgets, or none; those layers grow as usual)
        budgets = {n: int(c["budget"]) for n, c in (fc.kv_layer_settings() if fc is not None else {}).items()
                   if c.get("budget")}
        self._kv_caps: dict[str, int] = {s.input: budgets[n] for s in self.specs if s.kind == "kv"
                                         and (n := contract.kv_layer_of(s.input)) is not None and n in budgets}
        self._kv_growing = any(s.kind == "kv" and s.input not in self._kv_caps for s in self.specs)
        self.kv_slots: int | None = max(self._kv_caps.values()) if self._kv_caps else None  # the largest budget
        if self.max_length is not None:
            self.check_video_length(self.max_length, "positions of max_length")
        if self.kv_slots is not None and self.native_library is None:
            raise FastCarError(loader.needs_native(self.path.name))
        if self.max_length is not None or self._kv_caps:  # one video's fixed buffers must fit
            self.check_memory(1, f"one video's state of {self.path.name}"
                              + (f" with max_length={self.max_length}" if self.max_length is not None else ""),
                              "give a smaller max_length" if self.max_length is not None else
                              "recompile with a smaller --kv-budget")

    @property
    def last_ort_s(self) -> float:
        """Seconds inside ONNX Runtime of this thread's last step, bound or plain (step time minus this =
        Python); per thread, so concurrent steps of other threads do not overwrite it."""
        return getattr(self._ort_time, "s", 0.0)

    def _check_shared_kv(self, max_length: int | None) -> int | None:
        if max_length is None:
            return None
        max_length = check_int("max_length", max_length, 1, INT64_MAX, "KV positions per video")
        import onnx

        graph = onnx.load(str(self.path), load_external_data=False).graph
        producer = {o: n.op_type for n in graph.node for o in n.output}
        kv = [s.output for s in self.specs if s.kind == "kv"]
        bad = [o for o in kv if producer.get(o) not in ("GroupQueryAttention", contract.COMPRESSED_ATTENTION)]
        if bad or not kv:
            raise FastCarError(f"max_length (a shared, preallocated KV buffer) needs every present key/value "
                               f"written by GroupQueryAttention or CompressedAttention; {bad[:2] or 'no KV'} is not. "
                               "Compile with --fused-attention, or use an onnxruntime-genai graph")
        if self.vocab is None:
            raise FastCarError(f"max_length needs a static vocabulary axis on {contract.LOGITS}")
        self._vocab = self.vocab
        self._logits_dtype = _ORT_DTYPES.get(self._outputs[contract.LOGITS].type, np.dtype(np.float32))
        return max_length

    def check_video_length(self, tokens: int, what: str = "tokens of KV cache (prompt included)") -> None:
        """Refuse, before ORT runs, a video of `tokens` KV positions longer than the packed rotary table or than
        the KV buffers of `max_length` (generate checks the whole video before its first step)."""
        if self.max_length is not None and self._kv_growing and tokens > self.max_length:
            raise FastCarError(f"{tokens} {what} but the session was created with max_length={self.max_length}; "
                               f"create it with max_length={tokens} or more")
        table = self.rotary_positions
        if table is not None and tokens > table:
            raise FastCarError(f"{tokens} {what} but {self.path.name}'s rotary table covers {table} positions; "
                               f"recompile with --rotary-positions {tokens} or more (or --pack-qkv off)")

    def _kv_index_fix(self) -> str:
        """The remedy named by _check_kv_index_positions' refusals (built only when one is raised)."""
        return f"; recompile with --pack-qkv off to run such feeds ({self.path.name} rotates at KV indices)"

    def _check_kv_index_positions(self, state: DecodeState, new_mask: np.ndarray | None,
                                  position_ids: np.ndarray | None, seq: int) -> None:
        """A packed-rotary model rotates token i of a row at its KV index; the export rotates at the count of real
        tokens before it (KV index minus the row's left padding). RoPE scores depend only on position differences,
        so the two agree while a row's padding is a constant offset: only before its first real token. Refuse
        feeds for which they differ (the graph has no position_ids input to honour them)."""
        self.check_video_length(state.past_len + seq)
        real = None if new_mask is None else new_mask != 0
        if real is not None and not real.all():
            after = np.any(real[:, :-1] & ~real[:, 1:], axis=1) | ((state.real_len > 0) & ~real.all(axis=1))
            if after.any():
                raise FastCarError(f"attention_mask row {int(np.argmax(after))} has a 0 after a real token "
                                   f"(only left padding before a row's first token is supported){self._kv_index_fix()}")
        if position_ids is None:
            return
        start = state.real_len[:, None]
        implied = start + np.arange(seq) if real is None else start + np.cumsum(real, axis=1) - 1
        try:
            given = np.broadcast_to(np.asarray(position_ids, np.int64), implied.shape)
        except ValueError:
            raise FastCarError(f"position_ids must be [{state.batch}, {seq}], got "
                               f"{list(np.shape(position_ids))}") from None
        differ = given != implied if real is None else (given != implied) & real
        if differ.any():
            b, i = map(int, np.argwhere(differ)[0])
            raise FastCarError(f"position_ids[{b}, {i}] = {int(given[b, i])} but the packed rotary rotates at "
                               f"{int(implied[b, i])} (the real tokens before it){self._kv_index_fix()}")

    # ------------------------------------------------------------------ I/O pairing
    def _count_kv_layers(self) -> int:
        return len({m.group(1) for n in self._inputs if (m := contract.KV_INPUT_RE.match(n))})

    def _pair_state(self) -> list[StateSpec]:
        """Pair each `past_*` input with its `present_*` output (metadata first, then the naming rule)."""
        fast_meta = {e.input: e for e in self.fastcar.state} if self.fastcar is not None else {}
        specs: list[StateSpec] = []
        for name, arg in self._inputs.items():
            if not name.startswith(contract.STATE_INPUT_PREFIX):
                continue
            m = contract.KV_INPUT_RE.match(name)
            out = fast_meta[name].output if name in fast_meta else contract.state_output_for(name)
            if out not in self._outputs:
                raise FastCarError(f"{self.path.name}: state input {name} has no matching output {out}; "
                                   "the model cannot carry its state between steps")
            dtype = _ORT_DTYPES.get(arg.type)
            if dtype is None:
                raise FastCarError(f"{self.path.name}: state {name} has unsupported type {arg.type}")
            if m:  # KV cache: [batch, heads, past, head_dim]; the past axis grows
                shape = tuple("batch" if i == 0 else "past" if i == 2 else self._fixed(name, d, i == 3)
                              for i, d in enumerate(arg.shape))
                specs.append(StateSpec(name, out, dtype, shape, 0.0, "kv"))
            else:
                info = fast_meta.get(name)
                if info is not None:
                    shape = tuple("batch" if d == "batch" else int(d) for d in info.shape)
                    fill = float(info.fill)
                else:  # state of a model compiled without metadata: batch first, other dims fixed
                    shape = tuple("batch" if i == 0 else self._fixed(name, d) for i, d in enumerate(arg.shape))
                    fill = float(contract.AGE_FILL if "age" in name else contract.CACHE_FILL)
                specs.append(StateSpec(name, out, dtype, shape, fill, "fastcar"))
        return specs

    def _fixed(self, name: str, d: Any, head_dim: bool = False) -> int:
        if isinstance(d, int):
            return d
        if head_dim:  # symbolic KV head size (onnxruntime-genai's builder): the compiler recorded it
            known = (self.fastcar.head_dim if self.fastcar is not None else None) or self._genai_head_size()
            if known:
                return int(known)
        raise FastCarError(f"{self.path.name}: state input {name} has a symbolic dimension {d!r} besides "
                           "batch/past; re-export with fixed head counts")

    def _genai_head_size(self) -> int | None:
        """head_size from a genai_config.json beside the model (a dense genai graph has no metadata)."""
        cfg = self.path.parent / "genai_config.json"
        if not cfg.is_file():
            return None
        config = read_json(cfg, "genai_config.json")  # bounded: a broken one is named, not a RecursionError
        try:
            return int(config["model"]["decoder"]["head_size"])
        except (KeyError, ValueError, TypeError):
            return None

    def _signature(self) -> str:
        h = hashlib.sha1()
        for s in self.specs:
            h.update(f"{s.input}:{s.dtype}:{s.shape};".encode())
        h.update((str(self.fastcar.frame_tokens) if self.fastcar is not None else "").encode())
        h.update(",".join(map(str, self.layers)).encode())
        h.update(model_fingerprint(self.path))  # the model's identity: same shapes from another model are refused
        return h.hexdigest()[:16]

    # ------------------------------------------------------------------ state
    def release(self, state: DecodeState | None = None) -> None:
        """Drop `state`'s IO binding (the buffers it keeps alive besides the state's own arrays) now rather than
        when the state is dropped; its next step binds again. Without a state there is nothing to do: bindings
        belong to the videos' states (runtime/binding.py), so a dropped video frees its memory by itself."""
        if state is not None and state.binding is not None:
            with state.binding.lock:
                state.binding.clear()
            state.binding = None

    def new_state(self, batch: int, video_start: int = 0) -> DecodeState:
        """Empty state for `batch` new videos: no KV, caches zero, ages -1 (per the model's `fill`)."""
        batch = check_int("batch", batch, 1, INT64_MAX, "videos in the state")
        video_start = check_int("video_start", video_start, 0, INT64_MAX, "KV index of the first video token")
        self.check_memory(batch, f"new_state(batch={batch})", "use a smaller batch")
        arrays = {s.input: s.empty(batch) for s in self.specs}
        for s in self.specs:  # allocated once per video, written in place by the fused attention
            cap = self._kv_capacity(s)
            if s.kind == "kv" and cap is not None:
                arrays[s.input] = np.zeros([cap if d == "past" else batch if d == "batch" else d
                                            for d in s.shape], dtype=s.dtype)
        buffer = np.ones((batch, self.max_length), np.int64) if self.max_length is not None else None
        return DecodeState(arrays, batch, 0, int(video_start), self.signature,
                           np.zeros((batch, 0), dtype=np.int64), mask_buffer=buffer)

    def _ones(self, batch: int, length: int) -> np.ndarray:
        """An all-ones attention mask [batch, length], contiguous, as a read-only view of one buffer the session
        grows by doubling: the mask's length is the KV position, so building it anew each step would cost O(video
        length) per token even when the KV cache itself is bounded."""
        need = batch * length
        if self._ones_buffer.size < need:
            self._ones_buffer = np.ones(max(need, 2 * self._ones_buffer.size), np.int64)
            self._ones_buffer.flags.writeable = False
        return self._ones_buffer[:need].reshape(batch, length)

    def _kv_capacity(self, spec: StateSpec) -> int | None:
        """A KV input's fixed past length: its layer's budget, else max_length; None = grows with the video."""
        return self._kv_caps.get(spec.input, self.max_length)

    def state_bytes(self, batch: int = 1, tokens: int = 0) -> int:
        """Bytes of `batch` videos' state at `tokens` KV positions: what new_state allocates (FastCar state,
        fixed KV buffers of a budget or max_length, the attention mask buffer) plus a growing KV cache."""
        total = batch * self.max_length * 8 if self.max_length is not None else 0
        for s in self.specs:
            row = int(np.prod([1 if d in ("batch", "past") else int(d) for d in s.shape])) * s.dtype.itemsize
            cap = self._kv_capacity(s) if s.kind == "kv" else 1
            total += batch * row * (tokens if cap is None else cap)
        return total

    def check_memory(self, batch: int, what: str, fix: str, tokens: int = 0) -> None:
        """Refuse `batch` videos of `tokens` KV positions whose state cannot fit in the memory available now,
        before anything is allocated (a raw MemoryError later names neither the value nor the limit)."""
        check_fits_memory(what, self.state_bytes(batch, tokens), fix)

    def state_nbytes(self, batch: int = 1) -> dict[str, int]:
        """Size of the fixed FastCar state and of the KV cache per token, in bytes, for `batch` rows."""
        fixed = sum(int(np.prod([batch if d == "batch" else d for d in s.shape])) * s.dtype.itemsize
                    for s in self.specs if s.kind == "fastcar")
        kv_tok = sum(int(np.prod([batch if d == "batch" else 1 if d == "past" else d for d in s.shape]))
                     * s.dtype.itemsize for s in self.specs if s.kind == "kv")
        return {"fastcar_state": fixed, "kv_per_token": kv_tok}

    def describe_memory(self, batch: int = 1, tokens: int | None = None) -> str:
        """One line a user reads before a long run: fixed state size and KV growth."""
        n = self.state_nbytes(batch)
        s = (f"state: FastCar {n['fastcar_state'] / 2**20:.2f} MiB fixed (batch {batch}), "
             f"KV cache {n['kv_per_token'] / 2**10:.1f} KiB per token")
        if tokens:
            s += f" -> {n['kv_per_token'] * tokens / 2**20:.1f} MiB at {tokens} tokens"
        return s

    def check_state(self, state: DecodeState) -> None:
        """Refuse state made by another model or with wrong shapes/dtypes (clear error, not an ORT crash)."""
        if not isinstance(state, DecodeState):
            raise FastCarError(f"state must be a DecodeState from FastCarSession.new_state, got {type(state)}")
        if state.consumed:
            raise FastCarError("this state was updated in place by a later step (native kernels); continue "
                               "from the newest state, or create the session with inplace=False")
        if state.owner != self.signature:
            raise FastCarError(f"this state was made by another model (signature {state.owner}, this model "
                               f"{self.signature}); call new_state() on this session")
        missing = [s.input for s in self.specs if s.input not in state.arrays]
        if missing:
            raise FastCarError(f"state lacks {missing}; call new_state() on this session")
        for s in self.specs:
            a = state.arrays[s.input]
            if a.dtype != s.dtype:
                raise FastCarError(f"state {s.input} has dtype {a.dtype}, model expects {s.dtype}")
            past = self._kv_capacity(s) or state.past_len
            want = [state.batch if d == "batch" else past if d == "past" else d for d in s.shape]
            if list(a.shape) != want:
                raise FastCarError(f"state {s.input} has shape {list(a.shape)}, model expects {want} "
                                   f"(batch {state.batch}, past {state.past_len})")

    def speculation_refusal(self) -> str | None:
        """Why this model cannot verify draft tokens exactly (one line), or None when it can.

        A verify step feeds several tokens at once. A FastCar graph decides replay per token in such a step
        only when compiled with that rule (`fastcar.multi_token_decode`; before, a multi-token step computed every
        MLP, unlike the sequential steps it stands for); its MLP cache rows and ages are rolled back by `rewind`.
        A compressed KV cache merges tokens into slots that cannot be taken back after a rejection."""
        if self.kv_slots is not None:
            return (f"draft= cannot run on {self.path.name}: its compressed KV cache cannot drop rejected draft "
                    "tokens; run draft= on a model without --kv-budget")
        if self.layers and not (self.fastcar is not None and self.fastcar.multi_token_decode):
            return (f"draft= cannot run on {self.path.name}: it was compiled before FastCar decided replay per "
                    "token in a multi-token step, so a verify step would not equal sequential steps; recompile it "
                    "with this version, or run draft= on the dense model")
        other = [s.input for s in self.specs if s.kind == "fastcar" and s not in self._slot_specs]
        if other:
            return (f"draft= cannot run on {self.path.name}: its state {other[0]} cannot be rolled back after a "
                    "rejected draft token; compile it without the KV diagnostics to use drafts")
        return None

    def snapshot(self, state: DecodeState, seq: int) -> SlotSnapshot | None:
        """Copies of the FastCar state rows a step of `seq` tokens from `state` will write (their slots), so
        `rewind` can restore those of rejected draft tokens; None for a model without FastCar state. A step of
        at most L tokens writes each slot once, so the rows before the step are all a rollback needs."""
        specs = self._slot_specs
        if not specs:
            return None
        L = int(self.frame_tokens or 1)
        if seq > L:
            raise FastCarError(f"a verify step of {seq} tokens is longer than a frame (L={L}); draft at most "
                               f"{L - 1} tokens per step on a FastCar model")
        p = np.arange(state.past_len, state.past_len + seq)
        slots = (p - state.video_start) % L
        return SlotSnapshot(state.past_len, slots, p >= state.video_start,
                            {s.input: state.arrays[s.input][:, slots] for s in specs})

    def rewind(self, state: DecodeState, past_len: int, snapshot: SlotSnapshot | None = None) -> DecodeState:
        """`state` as if only its first `past_len` KV positions had been decoded (speculative decoding drops
        the rejected draft tokens). A growing KV cache is cut to past_len; a fixed buffer (max_length) keeps its
        arrays and simply is not advanced past the accepted length: the next step writes over the rest. The
        FastCar MLP cache rows and ages the dropped tokens wrote get back their values from `snapshot` (taken
        before the step that fed them)."""
        if not 0 <= past_len <= state.past_len:
            raise FastCarError(f"cannot rewind a state of {state.past_len} positions to {past_len}")
        if past_len == state.past_len:
            return state
        if (why := self.speculation_refusal()) is not None:
            raise FastCarError(why)
        arrays = dict(state.arrays)
        if self._slot_specs:
            if snapshot is None or not snapshot.past_len <= past_len or \
                    snapshot.past_len + len(snapshot.slots) != state.past_len:
                raise FastCarError("rewinding a FastCar state needs the snapshot taken before the step that fed "
                                   "the dropped tokens (session.snapshot(state, seq))")
            drop = np.arange(past_len - snapshot.past_len, len(snapshot.slots))
            drop = drop[snapshot.written[drop]]
            for name, saved in snapshot.rows.items():
                a = arrays[name]
                if not a.flags.writeable:
                    a = arrays[name] = a.copy()
                a[:, snapshot.slots[drop]] = saved[:, drop]
        for s in self.specs:
            if s.kind == "kv" and self._kv_capacity(s) is None:
                arrays[s.input] = np.ascontiguousarray(arrays[s.input][:, :, :past_len])
        dropped = state.attention_mask[:, past_len:].sum(axis=1)
        return DecodeState(arrays, state.batch, past_len, state.video_start, state.owner,
                           state.attention_mask[:, :past_len], real_len=state.real_len - dropped,
                           mask_buffer=state.mask_buffer, binding=state.binding)

    # ------------------------------------------------------------------ one step
    def threshold_array(self, threshold: float | Sequence[float] | np.ndarray) -> np.ndarray:
        """The `fastcar_threshold` input for a user value: scalar, or one value per rewritten layer."""
        arg = self._inputs.get(contract.THRESHOLD)
        if arg is None:
            raise FastCarError(f"{self.path.name} has no {contract.THRESHOLD} input (a dense model has no tau)")
        t = contract.check_thresholds(threshold, "threshold").astype(np.float32)
        if self.per_layer_threshold:
            n = len(self.layers)
            if t.ndim == 0:
                t = np.full([n], t, dtype=np.float32)
            if t.shape != (n,):
                raise FastCarError(f"threshold has shape {list(t.shape)}; this model takes one per rewritten "
                                   f"layer ({n}) or a scalar")
        elif t.ndim != 0:
            raise FastCarError("this model takes one scalar threshold (compiled without --per-layer-threshold)")
        return t

    def _tau_feed(self, threshold: float | Sequence[float] | np.ndarray) -> np.ndarray:
        """threshold_array, reused (the same array object) while the caller passes the same values: a decode
        loop passes one tau, and an unchanged array is not bound again."""
        try:
            if isinstance(threshold, np.ndarray):
                key: Any = (threshold.dtype, threshold.shape, threshold.tobytes())
            elif isinstance(threshold, float | int | np.number):
                key = float(threshold)
            else:
                key = tuple(np.asarray(threshold, np.float64).ravel())
        except (TypeError, ValueError):  # not numbers: threshold_array says what is wrong
            return self.threshold_array(threshold)
        last = self._tau_last  # (read once: another thread may replace it meanwhile)
        if last is None or last[0] != key:
            last = self._tau_last = (key, self.threshold_array(threshold))
        return last[1]

    def model_feeds(self, video_start: int, threshold: float | Sequence[float] | None = None) -> dict[str, np.ndarray]:
        """The per-video inputs this model takes besides tokens and state (`video_start`, tau when given)."""
        feeds: dict[str, np.ndarray] = {}
        if contract.VIDEO_START in self._inputs:
            feeds[contract.VIDEO_START] = np.array(video_start, dtype=np.int64)
        if threshold is None and self._feed_tau:
            threshold = self.default_threshold
        if threshold is not None and self.is_fastcar:
            feeds[contract.THRESHOLD] = self.threshold_array(threshold)
        return feeds

    def run_feeds(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """One bare ONNX Runtime run of complete feeds, outputs in `output_names` order: no checks and no
        state bookkeeping, for measuring what ORT alone costs per token (`step` adds the Python driver)."""
        return self.session.run(self.output_names, feeds)

    def step(self, state: DecodeState, input_ids: np.ndarray, *, attention_mask: np.ndarray | None = None,
             position_ids: np.ndarray | None = None, threshold: float | np.ndarray | None = None,
             check: bool = True) -> StepOutput:
        """Run `seq` new tokens for every row and return logits plus the next state.

        `attention_mask` covers only the new tokens ([batch, seq], 1 = real, 0 = left padding); the
        session keeps the mask of the past. Position ids default to the count of real tokens before each.
        """
        if check:
            self.check_state(state)
            input_ids = check_token_ids(input_ids, self.vocab, "input_ids")
        if position_ids is not None:
            position_ids = _check_positions(position_ids, np.shape(input_ids))
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        if ids.ndim != 2 or ids.shape[0] != state.batch:
            raise FastCarError(f"input_ids must be [batch={state.batch}, seq], got {list(ids.shape)}")
        b, seq = ids.shape
        new_mask = None if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
        if new_mask is not None and new_mask.shape != (b, seq):
            raise FastCarError(f"attention_mask for the new tokens must be [{b}, {seq}], got {list(new_mask.shape)}")
        past = state.past_len
        if new_mask is None and bool((state.real_len == past).all()):  # no padding: every mask is all ones
            mask = self._ones(b, past + seq)
        elif state.mask_buffer is not None and past + seq <= state.mask_buffer.shape[1]:  # no per-step concat
            if new_mask is not None:
                state.mask_buffer[:, past:past + seq] = new_mask
            mask = state.mask_buffer[:, :past + seq]
        else:
            mask = np.concatenate([state.attention_mask, np.ones((b, seq), np.int64) if new_mask is None
                                   else new_mask], axis=1)
        if self.rotary_positions is not None:
            self._check_kv_index_positions(state, new_mask, position_ids, seq)
        if position_ids is None and new_mask is None:  # no padding: the next positions
            position_ids = state.real_len[:, None] + np.arange(seq, dtype=np.int64) if seq > 1 else \
                state.real_len[:, None]
        elif position_ids is None:  # HF convention: count of real tokens before this one (padding: 0)
            position_ids = np.maximum(state.real_len[:, None] + np.cumsum(new_mask, axis=1) - 1, 0)
        if threshold is None and self._feed_tau:
            threshold = self.default_threshold
        tau = None if threshold is None else self._tau_feed(threshold)
        if self.max_length is not None and self._kv_growing and state.past_len + seq > self.max_length:
            raise FastCarError(f"the video needs {state.past_len + seq} tokens of KV cache but the session was "
                               f"created with max_length={self.max_length}; create it with a larger max_length")
        res = None
        try:
            if self._vocab is not None and (self.inplace or self.max_length is not None or self.kv_slots is not None):
                res = self._run_bound(state, ids, mask, position_ids, tau, seq)
            if res is None:
                res = self._run_plain(state, ids, mask, position_ids, tau)
                arrays = {s.input: res[s.output] for s in self.specs}
            else:  # written in place: the next state holds the same arrays (this one is consumed)
                arrays = state.arrays if self._all_inplace else {s.input: res[s.output] for s in self.specs}
        except FastCarError:
            raise
        except Exception as exc:
            raise FastCarError(f"ONNX Runtime failed on {self.path.name}: {exc}") from exc
        new_state = DecodeState(arrays, b, state.past_len + seq, state.video_start, state.owner, mask,
                                real_len=state.real_len + (seq if new_mask is None else new_mask.sum(axis=1)),
                                mask_buffer=state.mask_buffer, binding=state.binding)
        out = StepOutput(res[contract.LOGITS], new_state)
        if self._kv_stats_names:  # --kv-diagnostics
            out.extra.update({k: res[k] for k in self._kv_stats_names})
        if self.layers:
            out.replay = self._replay_of(res, arrays, state, seq)
            if self.has_diagnostics:
                out.tas = np.stack([res[contract.tas_output(n)] for n in self.layers]).astype(np.float32)
        return out

    def _run_plain(self, state: DecodeState, ids: np.ndarray, mask: np.ndarray, position_ids: np.ndarray | None,
                   tau: np.ndarray | None) -> dict[str, np.ndarray]:
        """One ordinary session.run of complete feeds: every output by name (the first step of a session, and
        models whose outputs the bound path cannot preallocate)."""
        feeds: dict[str, np.ndarray] = {contract.INPUT_IDS: ids}
        if contract.ATTENTION_MASK in self._inputs:
            feeds[contract.ATTENTION_MASK] = mask
        if contract.POSITION_IDS in self._inputs:
            feeds[contract.POSITION_IDS] = np.ascontiguousarray(position_ids, dtype=np.int64)
        if contract.VIDEO_START in self._inputs:
            feeds[contract.VIDEO_START] = np.array(state.video_start, dtype=np.int64)
        if tau is not None:
            feeds[contract.THRESHOLD] = tau
        feeds.update(state.arrays)
        t0 = time.perf_counter()
        outs = self.session.run(self.output_names, feeds)
        self._ort_time.s = time.perf_counter() - t0
        res = dict(zip(self.output_names, outs, strict=True))
        self._vocab, self._logits_dtype = res[contract.LOGITS].shape[-1], res[contract.LOGITS].dtype
        return res

    def _plan(self) -> bool:
        """How each output is bound (made once, on the first bound step); False when one cannot be predicted.
        Under a lock, and published last (`_planned`), so a concurrent first step never sees half a plan."""
        with self._plan_lock:
            if not self._planned:
                self._make_plan()
                self._planned = True
        return self._state_plan is not None

    def _make_plan(self) -> None:
        kinds = {s.output: (s, "fast" if s.kind == "fastcar" else "shared" if self._kv_capacity(s) is not None
                            else "kv") for s in self.specs}
        diag = {**{contract.tas_output(n): np.dtype(np.float32) for n in self.layers},
                **{contract.replay_mask_output(n): np.dtype(np.bool_) for n in self.layers}}
        fresh = [(contract.LOGITS, self._logits_dtype)] + [(n, diag[n]) for n in self.output_names if n in diag]
        if any(n not in kinds and n not in diag and n != contract.LOGITS for n in self.output_names):
            return  # e.g. --kv-diagnostics statistics: shapes unknown before the run
        plan = [kinds[s.output] for s in self.specs]
        self._fresh = fresh
        self._all_inplace = all(kind != "kv" for _, kind in plan)
        self._state_plan = plan

    def _run_bound(self, state: DecodeState, ids: np.ndarray, mask: np.ndarray, position_ids: np.ndarray | None,
                   tau: np.ndarray | None, seq: int) -> dict[str, np.ndarray] | None:
        """Run through ORT's IO binding, every output preallocated; present_mlp_* / shared KV outputs bound to
        the buffers of their past inputs, so the native kernels write the state in place (no copy per step).

        Bindings persist between steps of a video (runtime/binding.py; each video's state carries its own, so
        threads stepping different videos share none): the state is bound again only when its arrays are not
        the ones bound (an array replaced); the token ids, position ids and attention
        mask (a view one column longer each step) are bound as given, video_start is copied into a buffer
        bound once, tau bound again only when its values change.
        Returns logits (a copy: the bound buffer serves the next step), the diagnostics outputs (the bound
        buffers: `step` stacks them at once) and, unless all were written in place, the state outputs; None
        when an output's shape cannot be predicted (the caller then runs normally).
        """
        if not (self._planned and self._state_plan is not None or self._plan()):
            return None
        bind = state.binding
        if bind is None:
            bind = state.binding = StepBinding(self.session)
        with bind.lock:
            return self._run_bound_locked(bind, state, ids, mask, position_ids, tau, seq)

    def _run_bound_locked(self, bind: StepBinding, state: DecodeState, ids: np.ndarray, mask: np.ndarray,
                          position_ids: np.ndarray | None, tau: np.ndarray | None, seq: int) -> dict[str, np.ndarray]:
        if (tau is not None) != bind.tau_bound:  # another set of inputs (tau fed, then not): start over
            bind.clear_inputs()
            bind.tau_bound, bind.state = tau is not None, None
        arrays, bound = state.arrays, bind.state
        if not (self._all_inplace and bound is not None and bound[0] == tuple(arrays)
                and all(map(operator.is_, arrays.values(), bound[1]))):
            self._bind_state(bind, state, seq)
        b = state.batch
        bind.bind_input(contract.INPUT_IDS, ids)
        if self._feeds_mask:  # (a view of one row of the mask buffer is contiguous: no check at batch 1)
            bind.bind_input(contract.ATTENTION_MASK, mask if b == 1 else np.ascontiguousarray(mask))
        if self._feeds_positions:
            bind.bind_input(contract.POSITION_IDS, np.ascontiguousarray(position_ids))
        if self._feeds_video_start and (contract.VIDEO_START not in bind.inputs
                                        or bind.video_start != state.video_start):
            bind.copy_input(contract.VIDEO_START, np.array(state.video_start, dtype=np.int64))
            bind.video_start = state.video_start
        if tau is not None:
            bind.bind_input(contract.THRESHOLD, tau)
        vocab = self._vocab
        res = {name: bind.output_buffer(name, (b, seq, vocab) if name == contract.LOGITS else (b, seq), dtype)
               for name, dtype in self._fresh}
        self._ort_time.s = bind.run()
        state.consumed = True
        res[contract.LOGITS] = res[contract.LOGITS].copy()  # the caller keeps it; the buffer serves the next step
        if not self._all_inplace:
            res.update({s.output: bind.outputs[s.output] for s in self.specs})
        return res

    def _bind_state(self, bind: StepBinding, state: DecodeState, seq: int) -> None:
        """Bind a state's arrays as inputs and, written in place, as their outputs (a growing KV cache gets a
        new output buffer one step longer). An array ORT may not write into (a view, read-only, not
        C-contiguous) is copied first and the copy put in the state, so the caller's own arrays are never
        written."""
        arrays, b = state.arrays, state.batch
        for s, kind in self._state_plan or []:
            a = arrays[s.input]
            if kind == "kv":
                bind.bind_output(s.output, np.empty([b if d == "batch" else state.past_len + seq if d == "past"
                                                     else d for d in s.shape], dtype=s.dtype))
                a = np.ascontiguousarray(a)
            else:
                if bind.inputs.get(s.input) is not a and not (a.flags.c_contiguous and a.flags.writeable
                                                              and (a.flags.owndata or kind == "shared")):
                    a = arrays[s.input] = np.array(a)
                bind.bind_output(s.output, a)
            bind.bind_input(s.input, a)
        bind.state = (tuple(arrays), list(arrays.values())) if self._all_inplace else None

    def _replay_of(self, res: dict[str, np.ndarray], arrays: dict[str, np.ndarray], state: DecodeState, seq: int
                   ) -> np.ndarray | None:
        """Which rows replayed the MLP of each rewritten layer this step: [layers, batch] for one token,
        [layers, batch, seq] for a multi-token decode step the model decides per token; None for a prefill.

        Read from the age counters (`arrays`: the next state's) so it works without diagnostics outputs: age > 0
        at the written slot means the value there was replayed (DESIGN.md).
        """
        p, L = state.past_len, int(self.frame_tokens or 1)
        if seq != 1 and not (p > 0 and seq <= L and self.fastcar is not None and self.fastcar.multi_token_decode):
            return None
        if seq == 1 and p < state.video_start:
            return np.zeros((len(self.layers), state.batch), dtype=bool)
        masks = self._replay_names
        if masks[0] in res and all(m in res for m in masks):
            out = np.stack([res[m] for m in masks]).astype(bool)
            return out[:, :, 0] if seq == 1 else out
        if self._ages is None:
            raise FastCarError(f"{self.path.name} has neither replay masks nor age counters for every layer")
        if seq == 1:
            slot = (p - state.video_start) % L
            if state.batch == 1:  # (one Python int per layer: a decode loop's common case, cheapest)
                flat = [arrays[name].item(0, slot) > written for name, written in self._ages]
                return np.array(flat, dtype=bool).reshape(len(flat), 1)
            out = np.empty((len(self.layers), state.batch), dtype=bool)
            for i, (name, written) in enumerate(self._ages):
                np.greater(arrays[name][:, slot], written, out=out[i])
            return out
        pos = np.arange(p, p + seq)
        video = pos >= state.video_start  # (a token before the video writes no slot and never replays)
        slots = (pos - state.video_start) % L
        return np.stack([(arrays[name][:, slots] > written) & video for name, written in self._ages])

    def __repr__(self) -> str:
        kind = f"FastCar layers={self.layers} L={self.frame_tokens}" if self.is_fastcar else "dense"
        return f"FastCarSession({self.path.name}, {kind})"

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids: Any, num_frames: int, **kwargs: Any):
        """Generate `num_frames` frames of video tokens; see `fastcar_compile.runtime.decode.generate`."""
        from fastcar_compile.runtime.decode import generate

        return generate(self, prompt_ids, num_frames, **kwargs)
