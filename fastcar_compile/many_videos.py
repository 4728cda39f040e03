"""Many videos from one model: in this process, or on a Ray cluster with Ray Data (`fastcar-compile generate`).

Each worker holds one model, loaded once: a FastCarSession for a decoder (token ids in, video tokens out) or an
OrtDiT stream runtime for a DiT step graph (prompt embeddings in, latent frames out). Video i's seed is
`seed + i`, so a video rendered twice (a retry) is the same video. Its output, `OUT/videos/NNNNN.npz` (the
tokens or latents and `trace`, the run's statistics as JSON), is committed with a hard link from a complete
temp file: the link fails if the file exists, so a video is never written twice, even when a killed actor's
batch is retried after it had written; a resumed run skips the videos whose file exists. On Ray the videos are
rows of a Ray Data dataset mapped by an actor pool (`actors` actors of `threads` CPUs each, restarted and their
rows retried when one dies); without Ray the same renderer runs them in turn here.
"""

from __future__ import annotations

import io
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastcar_compile.core.errors import FastCarError

VIDEOS = "videos"  # OUT/videos/NNNNN.npz
SUMMARY = "generate.json"
PART = ".part"  # a complete video not yet committed (left by a process killed between the two steps)
MAX_VIDEOS = 10_000_000
_LOADS = [0]  # models loaded by this process (the traces show that each actor loads its model once)


@dataclass(frozen=True)
class RenderSpec:
    """What every worker needs to render a video: the model and the per-video settings."""

    model: str
    out: str
    frames: int
    threads: int = 1
    seed: int = 0
    cfg_scale: float = 3.0  # a DiT's classifier-free guidance (1: none)
    frame_tokens: int | None = None  # a dense decoder's frame size (a compiled one has it in its metadata)
    threshold: float | None = None  # a FastCar decoder's tau for this run (None: the compiled one)


def video_path(out: str | os.PathLike, index: int) -> Path:
    return Path(out) / VIDEOS / f"{index:05d}.npz"


def is_dit(model: str | os.PathLike) -> bool:
    """A DiT step graph (export --dit) rather than a decoder (contract.model_kind, off its metadata alone)."""
    import onnx

    from fastcar_compile.core import contract

    try:
        proto = onnx.load(str(model), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - onnx raises several types for a bad file
        raise FastCarError(f"{model}: cannot read it as an ONNX model ({type(exc).__name__})") from None
    return contract.model_kind({p.key: p.value for p in proto.metadata_props}) != contract.DECODER


class VideoRenderer:
    """One model, loaded once, rendering videos on request (a Ray Data actor's callable, or called here)."""

    def __init__(self, spec: RenderSpec):
        self.spec = spec
        t0 = time.perf_counter()
        self.dit = is_dit(spec.model)
        if self.dit:
            from fastcar_compile.dit.stream import OrtDiT

            self.model = OrtDiT(spec.model, threads=spec.threads)
        else:
            from fastcar_compile.runtime import FastCarSession

            self.model = FastCarSession(spec.model, frame_tokens=spec.frame_tokens, threads=spec.threads)
        _LOADS[0] += 1
        self.load_s = time.perf_counter() - t0

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        """Ray Data's batch form: columns `index` and `prompt` -> one record per video."""
        recs = [self.render(int(i), np.asarray(p)) for i, p in zip(batch["index"], batch["prompt"], strict=True)]
        return {k: [r[k] for r in recs] for k in ("index", "status", "seconds", "pid")}

    def render(self, index: int, prompt: np.ndarray) -> dict[str, Any]:
        """Render video `index` unless its file exists; commit it once. Returns its record."""
        path = video_path(self.spec.out, index)
        if path.exists():
            return {"index": index, "status": "skipped", "seconds": 0.0, "pid": os.getpid()}
        t0 = time.perf_counter()
        arrays, trace = self._dit(index, prompt) if self.dit else self._decoder(index, prompt)
        seconds = time.perf_counter() - t0
        trace.update(video=index, seed=self.spec.seed + index, seconds=seconds, model=str(self.spec.model),
                     worker={"pid": os.getpid(), "host": os.uname().nodename, "model_loads": _LOADS[0],
                             "load_s": self.load_s, "rss_mib": _rss_mib(), "threads": self.spec.threads})
        buf = io.BytesIO()
        np.savez(buf, **arrays, trace=np.array(json.dumps(trace)))
        written = commit(path, buf.getvalue())
        return {"index": index, "status": "written" if written else "exists", "seconds": seconds,
                "pid": os.getpid()}

    def _decoder(self, index: int, prompt: np.ndarray) -> tuple[dict, dict]:
        res = self.model.generate(prompt.reshape(1, -1).astype(np.int64), num_frames=self.spec.frames,
                                  threshold=self.spec.threshold, seed=self.spec.seed + index, progress=False)
        return {"tokens": res.tokens[0]}, res.stats.to_dict()

    def _dit(self, index: int, prompt: np.ndarray) -> tuple[dict, dict]:
        from fastcar_compile.dit.stream import StreamSettings, rollout

        settings = StreamSettings(frames=self.spec.frames, seed=self.spec.seed + index, cfg_scale=self.spec.cfg_scale)
        chunks, ms = [], []
        for res in rollout(self.model, settings, prompt.astype(np.float32)):
            n = min(res.frames.shape[1], settings.frames - res.first_frame)
            chunks.append(res.frames[:, :n])
            ms += [1000 * res.seconds / res.frames.shape[1]] * n
        trace = {"frames": settings.frames, "frame_ms": ms, "cfg_scale": settings.cfg_scale,
                 "steps": list(settings.steps)}
        if getattr(self.model, "tau", None) is not None:
            trace["replay_ratio"] = self.model.replayed[0] / max(self.model.replayed[1], 1)
        return {"latent": np.concatenate(chunks, axis=1)}, trace


def _rss_mib() -> float | None:
    """This worker's resident memory (Linux), MiB: what one more actor costs."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def commit(path: Path, data: bytes) -> bool:
    """Write `data` to `path` unless it exists: a complete temp file, then a hard link (which fails if another
    worker committed first). True when this call wrote it."""
    from fastcar_compile.core.atomic import write_bytes

    part = path.with_name(f"{path.name}.{os.getpid()}{PART}")
    write_bytes(part, data)
    try:
        os.link(part, path)
        return True
    except FileExistsError:
        return False
    finally:
        part.unlink(missing_ok=True)


def read_prompts(path: str | os.PathLike, dit: bool, text_dim: int | None = None) -> np.ndarray:
    """A decoder's int token ids [videos, prompt_len] or a DiT's embeddings [videos, tokens, text_dim]."""
    from fastcar_compile.core.fileio import check_input_file

    p = check_input_file(path, "--prompts")
    try:
        arr = np.load(p, allow_pickle=False, mmap_mode="r")
    except Exception as exc:  # noqa: BLE001 - numpy raises ValueError/OSError/EOFError for a bad file
        raise FastCarError(f"--prompts {p}: not a readable .npy file ({type(exc).__name__})") from None
    want = (f"float embeddings [videos, tokens, {text_dim}]" if dit else "int token ids [videos, prompt_len]")
    ok = (arr.ndim == 3 and arr.shape[2] == text_dim and arr.dtype.kind == "f" and arr.shape[1] >= 1) if dit else \
        (arr.ndim == 2 and arr.dtype.kind in "iu" and arr.shape[1] >= 1)
    if not ok or not 1 <= arr.shape[0] <= MAX_VIDEOS:
        raise FastCarError(f"--prompts {p}: need {want} for this model, got {arr.dtype} {list(arr.shape)}")
    arr = np.asarray(arr)
    if dit and not np.isfinite(arr).all():
        raise FastCarError(f"--prompts {p}: holds NaN or infinity")
    return arr


def generate_many(model: str | os.PathLike, prompts: np.ndarray, frames: int, out: str | os.PathLike, *,
                  ray: str | bool | None = None, actors: int = 1, threads: int = 1, seed: int = 0,
                  cfg_scale: float = 3.0, frame_tokens: int | None = None, threshold: float | None = None,
                  object_store_memory: int | None = None) -> dict[str, Any]:
    """Render one video per prompt row into `out`/videos/ and write `out`/generate.json (the records, videos per
    minute, the per-video latency). `ray`: None/False = in this process; True = a Ray cluster started here (or
    the one already initialised); an address ("auto", "ray://host:10001", "host:6379") = that cluster.
    Videos whose file exists are skipped (a resumed run)."""
    spec = RenderSpec(str(model), str(out), int(frames), int(threads), int(seed), float(cfg_scale),
                      frame_tokens, threshold)
    folder = Path(out) / VIDEOS
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(f"*{PART}"):  # a worker killed between its temp file and its commit
        stale.unlink(missing_ok=True)
    todo = [i for i in range(len(prompts)) if not video_path(out, i).exists()]
    t0 = time.perf_counter()
    if ray in (None, False):
        records = _in_process(spec, prompts, todo)
        where = "in-process"
    else:
        records = _on_ray(spec, prompts, todo, ray, actors, object_store_memory)
        where = f"ray ({actors} actor(s) x {threads} thread(s))"
    wall = time.perf_counter() - t0
    done = [r for r in records if r["status"] == "written"]
    lat = sorted(r["seconds"] for r in done)
    summary = {"model": str(model), "videos": len(prompts), "rendered": len(done),
               "skipped": len(prompts) - len(todo), "already_written": sum(r["status"] == "exists" for r in records),
               "frames": frames, "where": where, "wall_s": wall,
               "videos_per_min": 60 * len(done) / wall if done and wall > 0 else None,
               "latency_s": {q: float(np.quantile(lat, p)) for q, p in (("p50", 0.5), ("p90", 0.9), ("max", 1.0))}
               if lat else None,
               "spec": asdict(spec), "records": sorted(records, key=lambda r: r["index"])}
    from fastcar_compile.core.atomic import write_text

    write_text(Path(out) / SUMMARY, json.dumps(summary, indent=1) + "\n")
    return summary


def _in_process(spec: RenderSpec, prompts: np.ndarray, todo: list[int]) -> list[dict]:
    if not todo:
        return []
    renderer = VideoRenderer(spec)
    return [renderer.render(i, prompts[i]) for i in todo]


def ray_module():
    """Ray, or one line saying how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401 - Ray Data is the `data` extra of ray
    except ImportError:
        raise FastCarError("--ray needs Ray Data: pip install 'fastcar-compile[ray]' (or 'ray[data]')") from None
    return ray


def _on_ray(spec: RenderSpec, prompts: np.ndarray, todo: list[int], address, actors: int,
            object_store_memory: int | None) -> list[dict]:
    if not todo:
        return []
    ray = ray_module()
    import logging

    started = False
    if not ray.is_initialized():
        kw: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR, "include_dashboard": False}
        if address is True:
            kw.update(num_cpus=max(actors * spec.threads, os.cpu_count() or 1))
            if object_store_memory:
                kw["object_store_memory"] = object_store_memory
        else:
            kw["address"] = address
        ray.init(**kw)
        started = True
    try:
        from ray.data import DataContext

        ctx = DataContext.get_current()
        ctx.enable_progress_bars = bool(os.isatty(2))
        ctx.print_on_execution_start = False
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        ds = ray.data.from_items([{"index": i, "prompt": np.asarray(prompts[i])} for i in todo],
                                 override_num_blocks=len(todo))
        # the spec rides in the class (pickled by value), not as constructor arguments in the object store, which
        # a restarted actor could find gone; Ray Data restarts a dead actor and retries its rows by default
        bound = type("VideoRenderer", (VideoRenderer,), {"__init__": lambda self: VideoRenderer.__init__(self, spec)})
        ds = ds.map_batches(bound, batch_size=1, compute=ray.data.ActorPoolStrategy(size=actors),
                            num_cpus=spec.threads)
        return [{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()} for row in ds.iter_rows()]
    finally:
        if started:
            ray.shutdown()
