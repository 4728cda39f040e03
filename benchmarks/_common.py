"""Shared pieces of the benchmarks: a LLaMA-style decoder from a config, its dynamo export with the I/O contract
of the compiler (input_ids, attention_mask, position_ids, past_key_values.N.key|value -> logits,
present.N.key|value), and ONNX Runtime sessions.

Kept here (not imported from tests/) so `python benchmarks/<script>.py` runs from any checkout.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from fastcar_compile.core.atomic import write_text

K = TypeVar("K")  # the key naming a timed variant (a string, or a tuple of its parts)
T = TypeVar("T")

DEFAULT_CACHE = Path(os.environ.get("FASTCAR_BENCH_CACHE", Path.home() / ".cache" / "fastcar-bench"))


@dataclass(frozen=True)
class LlamaShape:
    """The sizes that define the benchmark decoder (the cache key of its export)."""

    hidden: int = 1024
    layers: int = 8
    heads: int = 16
    kv_heads: int = 8
    intermediate: int = 2816
    vocab: int = 2048
    max_pos: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tag(self) -> str:
        return "llama-" + "-".join(f"{k}{v}" for k, v in asdict(self).items())


def llama_config(shape: LlamaShape):
    """transformers LlamaConfig with SDPA attention (what a user exports)."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        vocab_size=shape.vocab,
        max_position_embeddings=shape.max_pos,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def build_random_llama(shape: LlamaShape, seed: int = 0):
    """Seeded random float32 LlamaForCausalLM (weights ~ 1/sqrt(fan_in), so activations stay O(1))."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(llama_config(shape)).eval().float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                std = 1.0 if "embed" in name else 1.0 / (p.shape[-1] ** 0.5)
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    return model


def cached_export(shape: LlamaShape, cache_dir: Path, seed: int = 0) -> Path:
    """Export the seeded model once (`fastcar_compile.export.export_decoder`: dynamo, opset 20, one self-contained
    file) into cache_dir/<tag>/model.onnx; reuse it afterwards."""
    import torch

    from fastcar_compile.export import export_decoder

    folder = Path(cache_dir) / f"{shape.tag()}-seed{seed}"
    path = folder / "model.onnx"
    if path.is_file():
        return path
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    print(f"exporting {shape} (cached in {folder}) ...", file=sys.stderr)
    return export_decoder(build_random_llama(shape, seed), path)


def ort_options(threads: int, entries: dict[str, str] | None = None, *, spin: bool = True,
                library: str | Path | None = None, profile: str | Path | None = None):
    """The SessionOptions every benchmark runs with: `threads` intra-op threads (the calling thread among them),
    one inter-op thread, sequential execution, warnings off. spin=False: pool threads sleep instead of spinning between parallel sections (CPU-time clocks,
    where a spinning thread bills its wait as work); entries: ORT config entries (session.KEY -> VALUE);
    library: a custom-op library (the native ai.fastcar kernels); profile: ORT's profiler on, files named
    with this prefix."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    for key, value in (entries or {}).items():
        so.add_session_config_entry(key, value)
    if library is not None:
        so.register_custom_ops_library(str(library))
    if profile is not None:
        so.enable_profiling = True
        so.profile_file_prefix = str(profile)
    return so


def make_session(path: str | Path | bytes, threads: int, spin: bool = True, **options):
    """An ORT CPU session of a model file (or serialized bytes) with `ort_options(threads, spin=..., **options)`;
    a compiled model's `video_start` / `fastcar_threshold` are inputs to feed, as in FastCarSession."""
    import onnxruntime as ort

    from fastcar_compile.runtime.overridable import model_source

    so = ort_options(threads, spin=spin, **options)
    model = path if isinstance(path, bytes) else model_source(Path(path), so)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


HUGEPAGE_TUNABLE_NAME = "glibc.malloc.hugetlb"
HUGEPAGE_TUNABLE = f"{HUGEPAGE_TUNABLE_NAME}=1"
HUGEPAGE_GLIBC = (2, 35)  # older glibc ignores the tunable without a word
NO_HUGEPAGES = "--no-hugepages"  # the flag that keeps 4 KiB pages (add_hugepage_flag)
REEXEC_SENTINEL = "FASTCAR_BENCH_REEXEC"  # set in the re-exec'd child: never exec twice


def add_hugepage_flag(ap) -> None:
    """The `--no-hugepages` option of a script that calls reexec_with_hugepage_malloc (its parser needs
    allow_abbrev=False: the re-exec matches the whole token before argparse runs)."""
    ap.add_argument(NO_HUGEPAGES, action="store_true",
                    help=f"keep glibc malloc's default 4 KiB pages (by default the script runs itself again with "
                         f"GLIBC_TUNABLES={HUGEPAGE_TUNABLE}: without it the session created first in the process "
                         "runs 6-26%% slower, so results follow the variants' creation order)")


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the running glibc, None when this is no glibc process."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):
        return None


def hugepage_malloc_record() -> dict[str, object]:
    """What a results file records about the tunable: requested (in this process's GLIBC_TUNABLES) is not
    applied when glibc is older than 2.35, which ignores it silently."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    version = glibc_version()
    requested = HUGEPAGE_TUNABLE in tunables.split(":")
    return {"glibc_tunables": tunables, "glibc": ".".join(map(str, version)) if version else None,
            "hugetlb_requested": requested,
            "hugetlb_supported": version is not None and version >= HUGEPAGE_GLIBC}


def reexec_with_hugepage_malloc(argv: list[str]) -> None:
    """Run this process again (sys.orig_argv: interpreter options and `-m` kept) with glibc's malloc backing its
    large blocks by transparent huge pages, unless `argv` holds --no-hugepages, that is already so, this process
    is a re-exec already, or this is no glibc >= 2.35 Linux process.

    Why: with THP in `madvise` mode and plain malloc, the ~0.4 GB of prepacked weights per ORT session lie in
    4 KiB pages, and in one process the session created first then ran 6-26% more CPU time per decode step at
    ctx 1024 than an identical one created after it (gone with prepacking off, or with this tunable: 0.95-1.05),
    so bench_genai's comparisons followed the variants' creation order. The tunable is read at process start, so
    it must be in the environment before Python starts: hence the exec. The sentinel stops a loop when the
    child loses GLIBC_TUNABLES (glibc drops it in AT_SECURE processes; launchers may clean the environment)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    version = glibc_version()
    if (NO_HUGEPAGES in argv or os.environ.get(REEXEC_SENTINEL) or not sys.platform.startswith("linux")
            or version is None or version < HUGEPAGE_GLIBC or HUGEPAGE_TUNABLE_NAME in tunables):
        return
    env = dict(os.environ, GLIBC_TUNABLES=":".join(t for t in (tunables, HUGEPAGE_TUNABLE) if t))
    env[REEXEC_SENTINEL] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


@contextlib.contextmanager
def gc_paused():
    """Python's garbage collector off (and the objects alive so far frozen out of its generations) while
    timing: a collection would land inside whichever step crossed its allocation threshold. The decode
    drivers measured create no cyclic garbage, so nothing accumulates meanwhile."""
    was = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was:
            gc.enable()


def interleave(steps: dict[K, Callable[[], object]], rounds: int, block: int | dict[K, int], *,
               clock: Callable[[], float] = time.perf_counter, warmup: int = 1,
               warm: dict[K, Callable[[], object]] | None = None) -> dict[K, list[float]]:
    """Time every step function in turn, `block` (or block[name]) calls at a time, for `rounds` rounds; the
    seconds of each call by `clock`.

    Interleaved, so load from other jobs hits every variant alike; in blocks, so no variant runs with a working
    set the others just evicted (caches, prepacked weights, KV buffers); each block starts with `warmup`
    untimed calls (warm[name] instead of the step itself where given, e.g. to restart a replay schedule after
    it), so every timed call follows a call of the same model, as in a real decode loop. The garbage
    collector is paused throughout (gc_paused)."""
    times: dict[K, list[float]] = {n: [] for n in steps}
    with gc_paused():
        for _ in range(rounds):
            for name, step in steps.items():
                first = (warm or {}).get(name, step)
                for _ in range(warmup):
                    first()
                for _ in range(block if isinstance(block, int) else block[name]):
                    t0 = clock()
                    step()
                    times[name].append(clock() - t0)
    return times


def interleave_cpu_wall(steps: dict[K, Callable[[], object]], rounds: int, block: int = 1
                        ) -> tuple[dict[K, float], dict[K, float]]:
    """interleave's schedule (one untimed call first, then per round `block` timed calls of each step in turn),
    timed by two clocks at once: the lower quartile in ms of the calling thread's CPU time and of the wall time.
    CPU time suits 1-thread steps on a shared machine (it leaves out the time other jobs held the core); the wall
    time is kept alongside."""
    cpu: dict[K, list[float]] = {n: [] for n in steps}
    wall: dict[K, list[float]] = {n: [] for n in steps}
    with gc_paused():
        for f in steps.values():
            f()
        for _ in range(rounds):
            for name, f in steps.items():
                for _ in range(block):
                    t0, w0 = time.thread_time(), time.perf_counter()
                    f()
                    cpu[name].append(time.thread_time() - t0)
                    wall[name].append(time.perf_counter() - w0)
    return lower_quartile_ms(cpu), lower_quartile_ms(wall)


def in_turn(gens: dict[K, Iterator[T]]) -> Iterator[tuple[K, T]]:
    """(name, item) from each generator in turn, one item at a time, until the first one ends: the streams
    (e.g. dit/stream.rollout's chunks) advance interleaved, so machine load hits them alike."""
    while True:
        for name, g in gens.items():
            item = next(g, None)
            if item is None:
                return
            yield name, item


def lower_quartile_ms(times: dict[K, list[float]]) -> dict[K, float]:
    """Per-step seconds -> the lower quartile in milliseconds: on a shared machine other jobs preempt whole
    steps (x50 outliers), which a median still feels in short runs."""
    return {n: float(np.percentile(t, 25)) * 1e3 for n, t in times.items()}


def past_name_for(output_name: str) -> str | None:
    """present.N.key -> past_key_values.N.key; present_X -> past_X (the FastCar state pairs of DESIGN.md)."""
    if output_name.startswith("present."):
        return "past_key_values." + output_name[len("present."):]
    if output_name.startswith("present_"):
        return "past_" + output_name[len("present_"):]
    return None


_ORT_TO_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}


def empty_state(sess, batch: int, frame_tokens: int) -> dict[str, np.ndarray]:
    """Empty KV cache and a new video's FastCar state (caches 0, ages -1)."""
    state: dict[str, np.ndarray] = {}
    for inp in sess.get_inputs():
        name, shp, dtype = inp.name, list(inp.shape), _ORT_TO_NP[inp.type]
        if name.startswith("past_key_values."):
            state[name] = np.zeros((batch, shp[1], 0, shp[3]), dtype=dtype)
        elif name.startswith("past_mlp_cache."):
            state[name] = np.zeros((batch, frame_tokens, shp[2]), dtype=dtype)
        elif name.startswith("past_mlp_age."):
            state[name] = np.full((batch, frame_tokens), -1, dtype=dtype)
    return state


def ms_lists(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per-step times in seconds -> milliseconds, for the raw steps a benchmark's JSON keeps."""
    return {n: [x * 1e3 for x in t] for n, t in times.items()}


def save_results(path: Path, results: dict) -> int:
    """Write a benchmark's results as JSON (atomically), say where, and return the exit code 0."""
    write_text(path, json.dumps(results, indent=1))
    print(f"\nwrote {path}")
    return 0
