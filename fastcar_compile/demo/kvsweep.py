"""FAST-AR modes on the long-video model: density, recall, KV bytes and video quality per mode (reference path).

Each mode generates the same held-out clips greedily with its compressed KV cache inside the model
(fastcar_compile/fastar/generate.py: NumPy reference attention, no ONNX op yet), so PSNR/SSIM measure what
the mode does to whole videos; density and recall are measured against dense attention over the same tokens.
Used by `fastcar-compile eval --kv-sweep`. Speed is not measured here: the reference path is NumPy; the
columns a kernel would change are density (q.k pairs) and KV bytes.

Mode grammar (';'-separated): `dense`; `window:S+W` (sinks + the last W tokens, oldest-first eviction);
`budget:S+W+C` (C slots, 'mass' eviction); `tempcache:SIM` (unbounded) or `tempcache:SIM@S+W+C`;
`lsh:BITSxTABLES` (AnnSA over sinks 4 + window 64); `int8[:DIRSxTABLES]` (AnnSA by 8-bit quantised buckets,
fastar/int8.py, over the same sinks and window); `prune:P` (prompt keys no query of the previous frame gave
softmax weight >= P are skipped: AnnCA's decoder-only counterpart).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.options import ascii_float, ascii_int
from fastcar_compile.core.progress import bar
from fastcar_compile.fastar.config import KVCompressConfig
from fastcar_compile.passes.context import parse_sparse_attention

DEFAULT_MODES = ("dense;window:4+124;budget:4+60+192;tempcache:0.99;tempcache:0.95;tempcache:0.9;"
                 "tempcache:0.95@4+60+192;lsh:6x4;lsh:8x4;int8:2x4;int8:4x8;prune:0.01;prune:0.1")
LSH_SINKS, LSH_WINDOW = 4, 64


def _ints(s: str, n: int, what: str) -> list[int]:
    parts = s.split("+")
    try:
        vals = [ascii_int(p) for p in parts]
    except ValueError:
        vals = []
    if len(vals) != n or any(v < 0 for v in vals):
        raise FastCarError(f"{what}: expected {n} non-negative integers joined by '+', got {s!r}")
    return vals


def parse_mode(spec: str, frame_tokens: int, video_start: int) -> KVCompressConfig | None:
    """One mode string -> its config (None = dense). Bad strings raise FastCarError naming the grammar."""
    spec = spec.strip()
    base = {"frame_tokens": frame_tokens, "video_start": video_start}
    kind, _, arg = spec.partition(":")
    if kind == "dense" and not arg:
        return None
    if kind == "window":
        s, w = _ints(arg, 2, spec)
        return KVCompressConfig(budget=s + w + 1, sinks=s, window=w, eviction="oldest", **base)
    if kind == "budget":
        s, w, c = _ints(arg, 3, spec)
        return KVCompressConfig(budget=c, sinks=s, window=w, **base)
    if kind == "tempcache":
        sim, _, bound = arg.partition("@")
        try:
            simf = ascii_float(sim)
        except ValueError:
            raise FastCarError(f"{spec}: tempcache takes a cosine, e.g. tempcache:0.95") from None
        if bound:
            s, w, c = _ints(bound, 3, spec)
            return KVCompressConfig(tempcache_sim=simf, budget=c, sinks=s, window=w, **base)
        return KVCompressConfig(tempcache_sim=simf, **base)
    if kind in ("lsh", "int8"):  # the compiler's --sparse-attention grammar (bare `int8` = its default)
        kw = parse_sparse_attention(spec, flag="--kv-modes")
        return KVCompressConfig(**kw, sinks=LSH_SINKS, window=LSH_WINDOW, **base)
    if kind == "prune":
        try:
            thr = ascii_float(arg)
        except ValueError:
            raise FastCarError(f"{spec}: prune takes a softmax weight, e.g. prune:0.01") from None
        return KVCompressConfig(prune_prompt=thr, **base)
    raise FastCarError(f"unknown KV mode {spec!r}; use dense, window:S+W, budget:S+W+C, tempcache:SIM[@S+W+C], "
                       "lsh:BITSxTABLES, int8[:DIRSxTABLES] or prune:P")


def parse_modes(specs: str, frame_tokens: int, video_start: int) -> list[tuple[str, KVCompressConfig | None]]:
    modes = [(s.strip(), parse_mode(s, frame_tokens, video_start)) for s in specs.split(";") if s.strip()]
    if not modes:
        raise FastCarError("--kv-modes is empty; e.g. 'dense;tempcache:0.95'")
    if modes[0][1] is not None:
        modes.insert(0, ("dense", None))  # every mode is compared with dense on the same path
    return modes


@dataclass
class ModeRow:
    mode: str
    density: float
    recall: float
    kept_mass: float
    kv_ratio: float  # resident KV bytes / dense KV bytes at the end of the video
    psnr_vs_dense: float
    ssim_vs_dense: float
    psnr_vs_gt: float
    ssim_vs_gt: float
    token_agreement: float
    per_layer: list[dict]
    ms_per_token_reference: float

    def to_dict(self) -> dict:
        return asdict(self)


def sweep(model, tok, clips, modes: list[tuple[str, KVCompressConfig | None]], progress: bool = True) -> list[dict]:
    """Generate every clip under every mode (dense first); rows of `ModeRow` as dicts."""
    from fastcar_compile.demo.metrics import psnr, ssim
    from fastcar_compile.demo.model import CODES, VIDEO_START, prompt
    from fastcar_compile.fastar.generate import generate

    layers = model.config.num_hidden_layers
    L = tok.tokens_per_frame
    dense_frames: list[np.ndarray] = []
    rows = []
    for name, cfg in bar(modes, desc="KV modes", enabled=progress):
        frames, stats, kv, kvd, secs, agree = [], [], 0, 0, 0.0, []
        for i, c in enumerate(clips):
            toks = tok.encode(c.frames)
            t0 = time.perf_counter()
            gen, ref = generate(model, prompt(c.motion) + [int(t) for t in toks[0]], (len(c.frames) - 1) * L,
                                [cfg] * layers, CODES, measure_from=VIDEO_START + L, prefix_len=VIDEO_START)
            secs += time.perf_counter() - t0
            video = np.concatenate([toks[0], gen]).reshape(len(c.frames), L)
            frames.append(video)
            stats.append([s.summary() for s in ref.stats])
            b, d = ref.kv_bytes()
            kv, kvd = kv + b, kvd + d
            if dense_frames:
                agree.append(float((video[1:] == dense_frames[i][1:]).mean()))
        if not dense_frames:
            dense_frames = frames
        per_layer = [{k: float(np.mean([s[li][k] for s in stats])) for k in stats[0][li]} for li in range(layers)]
        gt = [c.frames[1:] for c in clips]
        dec = [tok.decode(v)[1:] for v in frames]
        den = [tok.decode(v)[1:] for v in dense_frames]
        same = all(np.array_equal(a, b) for a, b in zip(dec, den, strict=True))
        steps = sum((len(c.frames) - 1) * L for c in clips)
        rows.append(ModeRow(
            mode=name, density=float(np.mean([p["density"] for p in per_layer])),
            recall=float(np.mean([p["recall"] for p in per_layer])),
            kept_mass=float(np.mean([p["kept_mass"] for p in per_layer])), kv_ratio=kv / kvd,
            psnr_vs_dense=float("inf") if same else psnr(np.concatenate(den), np.concatenate(dec)),
            ssim_vs_dense=float(np.mean([ssim(a, b) for a, b in zip(den, dec, strict=True)])),
            psnr_vs_gt=float(np.mean([psnr(g, v) for g, v in zip(gt, dec, strict=True)])),
            ssim_vs_gt=float(np.mean([ssim(g, v) for g, v in zip(gt, dec, strict=True)])),
            token_agreement=float(np.mean(agree)) if agree else 1.0, per_layer=per_layer,
            ms_per_token_reference=1e3 * secs / steps).to_dict())
    hold = [psnr(c.frames[1:], np.repeat(tok.decode(tok.encode(c.frames[:1])), len(c.frames) - 1, axis=0))
            for c in clips]
    for r in rows:
        r["psnr_hold_vs_gt"] = float(np.mean(hold))
    return rows


def table(rows: list[dict]) -> str:
    head = ("| mode | density | recall | KV vs dense | PSNR vs dense | SSIM vs dense | PSNR vs GT | SSIM vs GT | "
            "token agree | recall per layer | prompt mass per layer |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        pl = " / ".join(f"{100 * p['recall']:.0f}" for p in r["per_layer"])
        pm = " / ".join(f"{100 * p.get('prefix_mass', float('nan')):.1f}" for p in r["per_layer"])
        out.append(f"| {r['mode']} | {100 * r['density']:.1f}% | {100 * r['recall']:.1f}% | "
                   f"{100 * r['kv_ratio']:.1f}% | {r['psnr_vs_dense']:.2f} | {r['ssim_vs_dense']:.3f} | "
                   f"{r['psnr_vs_gt']:.2f} | {r['ssim_vs_gt']:.3f} | {100 * r['token_agreement']:.1f}% | {pl} | {pm} |")
    return "\n".join(out)


def plot(rows: list[dict], path, title: str = "") -> None:
    """Two panels: density vs recall (with the paper's points) and PSNR vs truth vs density."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastcar_compile.core.atomic import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    dense_gt = next(r["psnr_vs_gt"] for r in rows if r["mode"] == "dense")
    for r in rows:
        x = 100 * r["density"]
        axes[0].scatter(x, 100 * r["recall"], s=30)
        axes[0].annotate(r["mode"], (x, 100 * r["recall"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        axes[1].scatter(x, r["psnr_vs_gt"] - dense_gt, s=30)
        axes[1].annotate(r["mode"], (x, r["psnr_vs_gt"] - dense_gt), fontsize=7, xytext=(3, 3),
                         textcoords="offset points")
    axes[0].scatter([16, 28], [90, 92], marker="*", s=120, color="black", label="paper: TempCache / AnnSA")
    axes[0].set_xlabel("density (% of dense q.k pairs)")
    axes[0].set_ylabel("attention recall (%)")
    axes[0].legend(fontsize=7)
    axes[1].axhline(-0.5, color="grey", ls=":", label="-0.5 dB target")
    hold = rows[0]["psnr_hold_vs_gt"] - dense_gt
    axes[1].axhline(hold, color="red", ls="--", label="hold frame 0")
    axes[1].set_xlabel("density (% of dense q.k pairs)")
    axes[1].set_ylabel("PSNR vs truth: mode - dense (dB)")
    axes[1].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
