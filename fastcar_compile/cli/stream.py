"""`fastcar-compile stream dit.onnx --frames N -o OUT`: a video chunk by chunk with an exported DiT step graph
(compiled or not), or with the DiT itself in eager PyTorch (the FAST-AR and FastCar modes)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.limits import check_finite, check_int
from fastcar_compile.core.options import add_arguments, ascii_float, ascii_int

MAX_FRAMES = 100_000


def build_stream_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="fastcar-compile stream", description="Generate a video chunk by chunk with an exported DiT step "
        "graph (few-step flow matching, KV cache with sink frames and a rolling window, CFG); writes "
        "OUT/video.gif (latent preview), OUT/stream.json and OUT/stream.png.")
    ap.add_argument("model", help="the step graph written by `fastcar-compile export --dit` (its .text.onnx beside), "
                    "or the DiT itself (a preset such as tiny, a config .json or a folder with config.json + "
                    "model.safetensors; random weights of seed 0 without one) run in eager PyTorch: the FAST-AR "
                    "and FastCar modes need it")
    ap.add_argument("--frames", type=ascii_int, required=True, help="latent frames to generate")
    ap.add_argument("-o", "--output", required=True, help="output folder")
    ap.add_argument("--text", help="prompt embeddings .npy [tokens, text_dim] (default: seeded random)")
    ap.add_argument("--cfg", type=ascii_float, default=3.0, help="classifier-free guidance scale (1: none, one row)")
    ap.add_argument("--seed", type=ascii_int, default=0, help="seed of the noise (and of the default prompt)")
    ap.add_argument("--sink", type=ascii_int, help="sink frames kept for ever (default: the model's)")
    ap.add_argument("--window", type=ascii_int, help="recent frames kept in the cache, 0 = all (default: the model's)")
    ap.add_argument("--threads", type=ascii_int, default=0, help="ONNX Runtime / PyTorch threads (0: one per core)")
    ap.add_argument("--random-weights", action="store_true", help="a DiT config or folder without model.safetensors "
                    "runs with random weights (seed 0) to try the tool chain; without this flag it is refused")
    from fastcar_compile.dit.modes import DIT_OPTIONS

    add_arguments(ap, DIT_OPTIONS)
    return ap


def read_text_embeds(path: str, text_dim: int):
    """A prompt's embeddings .npy [tokens, text_dim] (--text, --calib-data), checked."""
    import numpy as np

    from fastcar_compile.core.fileio import check_input_file

    p = check_input_file(path, "--text")
    try:
        arr = np.load(p, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - numpy raises ValueError/OSError/EOFError for a bad file
        raise FastCarError(f"--text {p}: not a readable .npy file ({type(exc).__name__})") from None
    if not isinstance(arr, np.ndarray) or arr.ndim != 2 or arr.shape[1] != text_dim or not 1 <= arr.shape[0] <= 4096 \
            or arr.dtype.kind not in "fiu":
        raise FastCarError(f"--text {p}: need a numeric array [tokens (1..4096), {text_dim}], got "
                           f"{getattr(arr, 'dtype', '?')} {list(getattr(arr, 'shape', []))}")
    arr = arr.astype(np.float32)
    if not np.isfinite(arr).all():
        raise FastCarError(f"--text {p}: holds NaN or infinity")
    return arr


def check_rollout_args(a, frames_what: str, min_threads: int) -> None:
    """--frames, --cfg, --seed and --threads of a streaming command, each refused in one line when out of range."""
    from fastcar_compile.core.limits import MAX_THREADS

    check_int("--frames", a.frames, 1, MAX_FRAMES, frames_what)
    check_finite("--cfg", a.cfg)
    if a.cfg <= 0:
        raise FastCarError(f"--cfg must be > 0 (1 = no guidance), got {a.cfg}")
    check_int("--seed", a.seed, 0, 2**32 - 1)
    check_int("--threads", a.threads, min_threads, MAX_THREADS)


def main(argv: list[str]) -> int:
    a = build_stream_parser().parse_args(argv)
    check_rollout_args(a, "latent frames", min_threads=0)
    for flag, v in (("--sink", a.sink), ("--window", a.window)):
        if v is not None:
            check_int(flag, v, 0, MAX_FRAMES)
    from fastcar_compile.core.fileio import check_input_file, check_output_dir, check_outputs, staged_dir
    from fastcar_compile.dit import modes

    fa = modes.settings(**{o.name: getattr(a, o.name) for o in modes.DIT_OPTIONS})
    eager = not a.model.endswith(".onnx")
    if not eager and (not modes.is_dense(fa) or fa.diagnostics):
        raise FastCarError(f"the FAST-AR / FastCar modes and --diagnostics run in the eager runtime: give the DiT "
                           f"itself (a preset such as tiny, a config .json or a folder), not {a.model}")
    model_path = Path(a.model) if eager else check_input_file(a.model, "the model")
    out = check_output_dir(a.output, "-o")
    names = ("video.gif", "stream.json", "stream.png") + (("fastar.png",) if eager else ())
    files = {out / n: f"-o's {n}" for n in names}
    reads = ({model_path: "the model"} if model_path.exists() else {}) | ({Path(a.text): "--text"} if a.text else {})
    check_outputs(files, reads)
    from fastcar_compile.dit.stream import StreamSettings

    model = _eager_model(a.model, fa, a.threads, a.random_weights) if eager else _ort_model(model_path, a.threads)
    if not eager:
        check_outputs(files, {model.text_path: "the prompt graph"})
    for name, verdict in getattr(model, "verdicts", {}).items():  # a mode asked for but not run: say why
        if not getattr(model.fa, name):
            print(f"--{name}: {verdict}")
    text = read_text_embeds(a.text, model.cfg.text_dim) if a.text else None
    settings = StreamSettings(frames=a.frames, seed=a.seed, cfg_scale=a.cfg, sink_frames=a.sink,
                              window_frames=a.window)
    if fa.calibrate_replay is not None:
        from fastcar_compile.dit.fastar import calibrate_tau

        tau = calibrate_tau(model.model, fa, settings, text)
        print(f"calibrated --threshold {tau:.4g} for replay ratio {fa.calibrate_replay:g} (TAS quantile over the "
              "first two chunks)")
        model.tau = tau
        model.fa = dataclasses.replace(model.fa, threshold=tau)  # (the record keeps the ratio it came from)
    if getattr(model, "annsa", None) is not None:  # AnnSA compiled in: count its executed pairs
        model.self_pairs = [0, 0]
    result = run_stream(model, settings, text)
    if eager:
        from fastcar_compile.dit.fastar import totals

        result["fastar"] = {"mode": modes.label(model.fa), "settings": modes.record(model.fa),
                            "cost_model": model.verdicts, "totals": totals(model.stats),
                            "layers": model.layer_summary()}
    elif getattr(model, "modes", None) is not None and not model.modes.dense:  # compiled in (the graph's metadata)
        result["compiled_modes"] = {**dataclasses.asdict(model.modes), "replay_ratio": model.replayed[0] / max(model.replayed[1], 1),
                                    "merge_ratio": model.cache.merges[0] / max(model.cache.merges[1], 1),
                                    "cross_density": model.cross_pairs[0] / max(model.cross_pairs[1], 1),
                                    "kv_density": model.cache.kv_density,
                                    "self_density": model.self_pairs[0] / max(model.self_pairs[1], 1)
                                    if model.self_pairs is not None else None}
    with staged_dir(out) as tmp:
        write_outputs(tmp, result, model_path)
    fps = 1000 / (sum(result["frame_ms"]) / len(result["frame_ms"]))
    print(f"wrote {out}/video.gif, stream.json, stream.png{', fastar.png' * eager}: {a.frames} frames, "
          f"{fps:.1f} frames/s, last RSS {result['rss_mib'][-1]:.0f} MiB")
    if eager:
        print(_describe(result["fastar"]))
    elif "compiled_modes" in result:
        done = result["compiled_modes"]
        if model.tau is not None:
            print(f"FastCar compiled in (tau {model.tau:g}): {100 * done['replay_ratio']:.1f}% of the FFN rows "
                  "replayed")
        if model.sim is not None:
            print(f"TempCache compiled in (SIM {model.sim:g}, {model.match} match): {100 * done['merge_ratio']:.1f}% "
                  f"of the written keys merged, {100 * done['kv_density']:.1f}% of a dense cache's slots resident")
        if model.annca is not None:
            print(f"AnnCA compiled in ({model.annca.kind} buckets x {model.annca.ann_tables} tables): "
                  f"{100 * done['cross_density']:.1f}% of the query x prompt pairs executed")
        if model.annsa is not None:
            print(f"AnnSA compiled in ({model.annsa.kind} buckets x {model.annsa.ann_tables} tables, "
                  f"{model.annsa.annsa_local} local frames): {100 * done['self_density']:.1f}% of the query x "
                  "cache-and-chunk pairs executed")
    return 0


def _ort_model(model_path: Path, threads: int):
    from fastcar_compile.dit.stream import OrtDiT

    try:
        return OrtDiT(model_path, threads=threads)
    except FastCarError:
        raise
    except Exception as exc:  # noqa: BLE001 - onnx / onnxruntime raise many types for a bad file
        raise FastCarError(f"{model_path}: cannot load it as a DiT step graph ({type(exc).__name__}: "
                           f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''})") from None


def _eager_model(source: str, fa, threads: int, random_weights: bool = False):
    """The DiT (preset, config or folder) in eager PyTorch behind the FAST-AR runtime."""
    from fastcar_compile.dit.checkpoints import load_config, refuse_random
    from fastcar_compile.dit.config import PRESETS, RANDOM_WEIGHTS_MAX_BYTES, check_model_memory
    from fastcar_compile.dit.fastar import FastARDiT
    from fastcar_compile.dit.model import build

    if source not in PRESETS and not Path(source).exists():
        raise FastCarError(f"the model {source}: no such file or preset; give a step graph .onnx, a preset "
                           f"({', '.join(sorted(PRESETS))}), a DiT config .json or a folder with config.json")
    cfg, weights = load_config(source)
    if 4 * cfg.params > RANDOM_WEIGHTS_MAX_BYTES and weights is None:
        raise FastCarError(f"{source}: {cfg.params / 1e9:.2f} B parameters and no weights; the eager stream needs "
                           "a folder with model.safetensors (or a small config)")
    refuse_random(source, weights, random_weights)
    check_model_memory(cfg, source)
    return FastARDiT(build(cfg, weights), fa, threads)


def _describe(fa: dict) -> str:
    t = fa["totals"]

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    return (f"{fa['mode']}: self density {pct(t['self_density'])} (recall {pct(t['self_recall'])}), cross density "
            f"{pct(t['cross_density'])} (recall {pct(t['cross_recall'])}), FFN replayed {pct(t['replay_ratio'])}, "
            f"resident KV {pct(t['kv_density'])} of dense")


def run_stream(model, settings, text=None, progress: bool = True) -> dict:
    """Roll out and record per-frame latency (a chunk's time shared by its frames) and RSS after each chunk."""
    import numpy as np
    from tqdm import tqdm

    from fastcar_compile.dit.stream import rollout, rss_mib

    frame_ms: list[float] = []
    rss: list[float] = []
    chunks = []
    resident: list[int] = []
    with tqdm(total=settings.frames, unit="frame", disable=None if progress else True, leave=False) as bar:
        for res in rollout(model, settings, text):
            n = min(res.frames.shape[1], settings.frames - res.first_frame)
            frame_ms += [1000 * res.seconds / res.frames.shape[1]] * n
            rss += [rss_mib()] * n
            chunks.append(res.frames[:, :n])
            resident = res.resident
            bar.update(n)
    cfg = model.cfg
    return {"frames": settings.frames, "frame_ms": frame_ms, "rss_mib": rss,
            "latent": np.concatenate(chunks, axis=1),
            "settings": {"seed": settings.seed, "cfg_scale": settings.cfg_scale, "steps": list(settings.steps),
                         "chunk_frames": cfg.chunk_frames,
                         "sink_frames": cfg.sink_frames if settings.sink_frames is None else settings.sink_frames,
                         "window_frames": cfg.window_frames if settings.window_frames is None
                         else settings.window_frames, "tokens_per_frame": cfg.tokens_per_frame},
            "resident_frames": resident}


def write_outputs(folder: Path, result: dict, model_path: Path) -> None:
    """video.gif (latent preview), stream.json, stream.png into `folder`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from fastcar_compile.core.atomic import save_figure, write_text
    from fastcar_compile.dit.stream import preview

    pics = [Image.fromarray(p) for p in preview(result["latent"])]
    pics[0].save(folder / "video.gif", save_all=True, append_images=pics[1:], duration=62, loop=0)
    doc = {k: v for k, v in result.items() if k != "latent"}
    doc["model"] = str(model_path)
    doc["video"] = "video.gif: the latent frames' first three channels (no VAE decoder), 8x upsampled"
    write_text(folder / "stream.json", json.dumps(doc, indent=1) + "\n")
    ms = result["frame_ms"]
    x = list(range(len(ms)))
    fig, ax = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    ax[0].plot(x, ms)
    ax[0].set_ylabel("latency per frame (ms)")
    ax[1].plot(x, [1000 / m if m > 0 else math.nan for m in ms])
    ax[1].set_ylabel("frames per second")
    ax[2].plot(x, result["rss_mib"])
    ax[2].set_ylabel("RSS (MiB)")
    ax[2].set_xlabel("latent frame")
    s = result["settings"]
    ax[0].set_title(f"{model_path.name}: {len(ms)} frames, chunk {s['chunk_frames']}, sinks {s['sink_frames']}, "
                    f"window {s['window_frames'] or 'all'}, CFG {s['cfg_scale']}")
    fig.tight_layout()
    save_figure(fig, folder / "stream.png")
    if "fastar" in result:
        _plot_fastar(result["fastar"], folder / "fastar.png", f"{model_path.name}: {len(ms)} frames")


def _plot_fastar(fa: dict, path: Path, title: str) -> None:
    """Per layer: self- and cross-attention density and recall, FFN replay and merge ratios, resident KV."""
    import matplotlib.pyplot as plt

    from fastcar_compile.core.atomic import save_figure

    layers = fa["layers"]
    x = list(range(len(layers)))

    def col(key):
        return [math.nan if r[key] is None else r[key] for r in layers]

    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    for key, lab in (("self_density", "self density"), ("self_recall", "self recall"),
                     ("cross_density", "cross density"), ("cross_recall", "cross recall")):
        ax[0].plot(x, col(key), marker="o", label=lab)
    ax[0].set_ylim(0, 1.05)
    ax[0].set_title("attention (recall needs --diagnostics)")
    for key, lab in (("replay_ratio", "FFN replay ratio"), ("merge_ratio", "TempCache merges / written")):
        ax[1].plot(x, col(key), marker="o", label=lab)
    ax[1].set_ylim(0, 1.05)
    ax[1].set_title("FastCar and TempCache")
    ax[2].bar([i - 0.2 for i in x], [r["dense_kv_bytes"] / 2**20 for r in layers], 0.4, label="dense")
    ax[2].bar([i + 0.2 for i in x], [r["resident_kv_bytes"] / 2**20 for r in layers], 0.4, label="resident")
    ax[2].set_ylabel("KV after the last chunk (MiB)")
    for a in ax:
        a.set_xticks(x)
        a.set_xlabel("layer")
        a.legend(fontsize=8)
    fig.suptitle(f"{title}, {fa['mode']}")
    fig.tight_layout()
    save_figure(fig, path)
