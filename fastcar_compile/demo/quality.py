"""Is the generated video video? Per held-out clip (prompt = frame 0 + conditioning, truth = the generator's
next frames): PSNR / SSIM vs the truth and vs the dense video, token accuracy vs the truth's tokens, the copy
rate (tokens equal one frame back) against the truth's, whether the clip freezes, and for pans the camera
shift recovered from the generated pixels against the known one; the baseline "repeat the last given frame".

Why these: a decoder that copies the previous frame scores well on PSNR of slow clips and gives FastCar an
easy 100% replay; the copy rate, the freeze test and the pan shift tell a still from a video.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fastcar_compile.demo.metrics import copy_rate, psnr, ssim
from fastcar_compile.runtime.calib_stats import ci95

# Targets of a video model worth measuring (dense vs truth over the generated frames).
TARGET_GAIN_DB = 2.0  # dense beats repeating the last given frame by at least this
TARGET_COPY_POINTS = 0.10  # |copy rate of the generated video - the truth's| at most this
TARGET_FAST_DROP_DB = {0.5: 0.5, 0.8: 1.0}  # FastCar at this replay ratio loses at most this vs dense (vs truth)
PSNR_CAP = 100.0  # identical frames: PSNR is infinite; means use this instead
# paired differences (dB, vs the truth) a summary reports with their own interval: name -> (minuend, subtrahend)
PAIRED = {"dense_minus_repeat_db": ("psnr_dense_vs_truth", "psnr_repeat_last_vs_truth"),
          "fast_minus_dense_db": ("psnr_fast_vs_truth", "psnr_dense_vs_truth")}
PANS = ("pan_left", "pan_right", "pan_up", "pan_down", "pan_up_left", "pan_up_right", "pan_down_left",
        "pan_down_right")


def freeze_frame(tokens: np.ndarray, min_copies: int = 2) -> int | None:
    """First frame f >= 1 from which every frame is a token-exact copy of frame f - 1 (the video froze), when
    at least `min_copies` frames are copies; else None. tokens [T, L]."""
    t = np.asarray(tokens)
    same = np.all(t[1:] == t[:-1], axis=1)  # same[k]: frame k + 1 equals frame k
    k = len(same)
    while k > 0 and same[k - 1]:
        k -= 1
    return k + 1 if len(same) - k >= min_copies else None


def _grey(frames: np.ndarray) -> np.ndarray:
    return np.asarray(frames, np.float64) @ np.array([0.299, 0.587, 0.114])


def recovered_shifts(frames: np.ndarray) -> np.ndarray:
    """[T - 1, 2] (x, y) displacement of the view in frame pixels between consecutive frames, by
    scikit-image's phase correlation (Hann-windowed, 1/10 pixel)."""
    from skimage.filters import window
    from skimage.registration import phase_cross_correlation

    g = _grey(frames)
    w = window("hann", g.shape[1:])
    return np.array([phase_cross_correlation(g[t] * w, g[t + 1] * w, upsample_factor=10)[0][::-1]
                     for t in range(len(g) - 1)])


def true_shifts(camera: np.ndarray) -> np.ndarray:
    """[T - 1, 2] (x, y) displacement of the view in frame pixels between consecutive frames (camera path)."""
    return np.diff(camera[:, :2], axis=0) / camera[:-1, 2:3]


def pan_match(true: np.ndarray, got: np.ndarray) -> float:
    """Share of frame pairs whose recovered shift is the true one (within half a pixel)."""
    return float(np.mean(np.hypot(*(got - true).T) <= 0.5))


def is_clean_pan(labels: dict, cut_at: int, frames: int) -> bool:
    """A pan at constant speed, no object, no occluder, no cut: its view shift is the whole frame's motion (moving
    objects and occluders pull phase correlation off the camera's shift; a still video would match the still
    phases of a stop-and-go camera)."""
    return (labels.get("camera") in PANS and labels.get("speed") in ("slow", "fast") and
            labels.get("objects") == "objects_0" and labels.get("occluder") == "no_occluder" and cut_at >= frames)


def clip_quality(gt: np.ndarray, truth_tokens: np.ndarray, dense_tokens: np.ndarray, fast_tokens: np.ndarray,
                 decode, clip=None, given: int = 1) -> dict:
    """Figures of one clip; frames [given:] are generated (the first `given` frames are the prompt)."""
    dv, fv = decode(dense_tokens), decode(fast_tokens)
    last = decode(truth_tokens[given - 1:given])  # the last given frame, as the model saw it (tokenized)
    g, n = gt[given:], len(gt) - given
    out = {"frames_generated": n,
           "psnr_dense_vs_truth": psnr(g, dv[given:]), "ssim_dense_vs_truth": ssim(g, dv[given:]),
           "psnr_fast_vs_truth": psnr(g, fv[given:]), "ssim_fast_vs_truth": ssim(g, fv[given:]),
           "psnr_fast_vs_dense": psnr(dv[given:], fv[given:]), "ssim_fast_vs_dense": ssim(dv[given:], fv[given:]),
           "psnr_repeat_last_vs_truth": psnr(g, np.repeat(last, n, axis=0)),
           "psnr_tokenizer": psnr(g, decode(truth_tokens)[given:]),
           "token_acc_dense": float((dense_tokens[given:] == truth_tokens[given:]).mean()),
           "token_acc_fast": float((fast_tokens[given:] == truth_tokens[given:]).mean()),
           "token_acc_repeat_last": float((truth_tokens[given - 1] == truth_tokens[given:]).mean()),
           "copy_rate_truth": copy_rate(truth_tokens[given - 1:]),
           "copy_rate_dense": copy_rate(dense_tokens[given - 1:]),
           "copy_rate_fast": copy_rate(fast_tokens[given - 1:]),
           "freeze_frame_dense": freeze_frame(dense_tokens[given - 1:]),
           "freeze_frame_fast": freeze_frame(fast_tokens[given - 1:]),
           "freeze_frame_truth": freeze_frame(truth_tokens[given - 1:])}
    labels = getattr(clip, "labels", None)
    if labels is not None:
        out["labels"] = dict(labels)
        if is_clean_pan(labels, clip.cut_at, len(gt)):
            # pairs from the last given frame on: the generated motion
            true = true_shifts(clip.camera[given - 1:])
            got = {k: recovered_shifts(v[given - 1:]) for k, v in (("truth", gt), ("dense", dv), ("fast", fv))}
            out["pan"] = {"true": true.sum(0).tolist(), **{k: v.sum(0).tolist() for k, v in got.items()},
                          **{f"{k}_match": pan_match(true, v) for k, v in got.items()}}
    return out


def _mean(xs: list[float]) -> float:
    return float(np.mean([min(x, PSNR_CAP) for x in xs])) if xs else float("nan")


def summarize_quality(clips: list[dict], replay_ratio: float | None = None) -> dict:
    """Means over clips with their 95% intervals (`ci95`: half widths; paired differences in `PAIRED`), the
    freeze fractions, the pan check, and each target met or missed (on the mean)."""
    keys = [k for k in clips[0] if isinstance(clips[0][k], float)]
    s: dict = {k: _mean([c[k] for c in clips]) for k in keys}
    s["clips"] = len(clips)
    s["frames_generated"] = clips[0]["frames_generated"]
    for who in ("dense", "fast", "truth"):
        s[f"frozen_fraction_{who}"] = float(np.mean([c[f"freeze_frame_{who}"] is not None for c in clips]))
    pans = [c["pan"] for c in clips if "pan" in c]
    s["pan_clips"] = len(pans)
    for who in ("truth", "dense", "fast"):
        s[f"pan_match_{who}"] = float(np.mean([p[f"{who}_match"] for p in pans])) if pans else float("nan")
    s["ci95"] = {k: ci95([min(c[k], PSNR_CAP) for c in clips]) for k in keys}
    # differences between two videos of the same clip: the interval of the paired per-clip differences
    for name, (x, y) in PAIRED.items():
        diff = [min(c[x], PSNR_CAP) - min(c[y], PSNR_CAP) for c in clips]
        s[name], s["ci95"][name] = float(np.mean(diff)), ci95(diff)
        s[f"{name}_clips_above"] = int(np.sum(np.asarray(diff) > 0))
    gain = s["dense_minus_repeat_db"]
    gap = abs(s["copy_rate_dense"] - s["copy_rate_truth"])
    drop = -s["fast_minus_dense_db"]
    s["targets"] = {
        "dense_vs_repeat_last_db": {"value": gain, "target": f">= {TARGET_GAIN_DB}", "met": gain >= TARGET_GAIN_DB},
        "copy_rate_gap": {"value": gap, "target": f"<= {TARGET_COPY_POINTS}", "met": gap <= TARGET_COPY_POINTS},
        "frozen_clips": {"value": s["frozen_fraction_dense"], "target": "0", "met": s["frozen_fraction_dense"] == 0},
    }
    if replay_ratio is not None:
        s["replay_ratio"] = float(replay_ratio)
        s["fast_drop_db"] = drop
        for r, bound in TARGET_FAST_DROP_DB.items():
            if abs(replay_ratio - r) <= 0.1:  # a run near one of the targeted replay ratios
                s["targets"][f"fast_drop_at_{int(100 * r)}pct_db"] = {
                    "value": drop, "target": f"<= {bound} (replay {100 * replay_ratio:.0f}%)", "met": drop <= bound}
    return s


def db(s: dict, key: str, sign: str = "") -> str:
    """'mean +- half width dB (95%, n clips)' of a summary's figure; the interval is absent below 2 clips."""
    ci = s["ci95"].get(key, float("nan"))
    return f"{s[key]:{sign}.2f} dB" + ("" if ci != ci else f" +- {ci:.2f} (95%, {s['clips']} clips)")


def quality_lines(s: dict) -> list[tuple[str, str]]:
    """Table rows (name, text) of a summary, for the demo's printout."""
    n = s["clips"]
    rows = [("dense vs truth", f"PSNR {db(s, 'psnr_dense_vs_truth')}  SSIM {s['ssim_dense_vs_truth']:.3f}  "
                               f"token acc {s['token_acc_dense']:.3f}"),
            ("FastCar vs truth", f"PSNR {db(s, 'psnr_fast_vs_truth')}  SSIM {s['ssim_fast_vs_truth']:.3f}  "
                                 f"token acc {s['token_acc_fast']:.3f}"),
            ("FastCar vs dense", f"PSNR {s['psnr_fast_vs_dense']:.2f} dB  SSIM {s['ssim_fast_vs_dense']:.3f}"),
            ("repeat last frame", f"PSNR {db(s, 'psnr_repeat_last_vs_truth')}  token acc "
                                  f"{s['token_acc_repeat_last']:.3f} (baseline)"),
            ("dense - repeat last", f"{db(s, 'dense_minus_repeat_db', '+')} ({s['dense_minus_repeat_db_clips_above']}"
                                    f" of {n} clips above)"),
            ("FastCar - dense", f"{db(s, 'fast_minus_dense_db', '+')} vs truth ({s['fast_minus_dense_db_clips_above']}"
                                f" of {n} clips above)"),
            ("tokenizer ceiling", f"PSNR {s['psnr_tokenizer']:.2f} dB"),
            ("copy rate", f"dense {s['copy_rate_dense']:.3f}  FastCar {s['copy_rate_fast']:.3f}  truth "
                          f"{s['copy_rate_truth']:.3f}"),
            ("frozen clips", f"dense {100 * s['frozen_fraction_dense']:.0f}%  FastCar "
                             f"{100 * s['frozen_fraction_fast']:.0f}%  truth {100 * s['frozen_fraction_truth']:.0f}%")]
    if s["pan_clips"]:
        rows.append(("pan shift recovered", f"dense {100 * s['pan_match_dense']:.0f}%  FastCar "
                                            f"{100 * s['pan_match_fast']:.0f}%  truth {100 * s['pan_match_truth']:.0f}% "
                                            f"of frame pairs ({s['pan_clips']} pan clips)"))
    for name, t in s["targets"].items():
        rows.append((f"target {name}", f"{t['value']:.3f} (target {t['target']}): {'met' if t['met'] else 'MISSED'}"))
    return rows


def write_quality_plot(clips: list[dict], s: dict, path: Path, title: str = "") -> Path:
    """PNG, labelled: per clip PSNR vs truth (dense, FastCar, repeat last frame); copy rate generated vs truth;
    for pan clips, the recovered shift against the true one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastcar_compile.core.atomic import save_figure

    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    x = np.arange(len(clips))
    for k, (key, lab) in enumerate((("psnr_dense_vs_truth", "dense"), ("psnr_fast_vs_truth", "FastCar"),
                                    ("psnr_repeat_last_vs_truth", "repeat last frame"))):
        ax[0].bar(x + (k - 1) * 0.27, [min(c[key], PSNR_CAP) for c in clips], 0.27,
                  label=f"{lab} (mean {s[key]:.2f} dB)")
    ax[0].set_xlabel("held-out clip")
    ax[0].set_ylabel("PSNR vs truth (dB)")
    ax[0].legend(fontsize=7)
    ax[0].set_title("quality vs truth", fontsize=9)
    ax[1].scatter([c["copy_rate_truth"] for c in clips], [c["copy_rate_dense"] for c in clips], label="dense")
    ax[1].scatter([c["copy_rate_truth"] for c in clips], [c["copy_rate_fast"] for c in clips], marker="x",
                  label="FastCar")
    ax[1].plot([0, 1], [0, 1], "k--", lw=0.8, label="= truth")
    ax[1].fill_between([0, 1], [-TARGET_COPY_POINTS, 1 - TARGET_COPY_POINTS], [TARGET_COPY_POINTS,
                       1 + TARGET_COPY_POINTS], color="grey", alpha=0.15, label=f"target +-{TARGET_COPY_POINTS:g}")
    ax[1].set_xlim(0, 1)
    ax[1].set_ylim(0, 1)
    ax[1].set_xlabel("copy rate of the truth's tokens")
    ax[1].set_ylabel("copy rate of the generated tokens")
    ax[1].legend(fontsize=7)
    ax[1].set_title(f"tokens equal one frame back; frozen clips: dense {100 * s['frozen_fraction_dense']:.0f}%",
                    fontsize=9)
    pans = [c["pan"] for c in clips if "pan" in c]
    for who, m in (("true", "o"), ("truth", "+"), ("dense", "s"), ("fast", "x")):
        if pans:
            p = np.array([q[who] for q in pans])
            ax[2].scatter(p[:, 0], p[:, 1], marker=m, label={"true": "camera path", "truth": "from truth pixels",
                                                             "fast": "FastCar"}.get(who, who))
    ax[2].axhline(0, color="grey", lw=0.5)
    ax[2].axvline(0, color="grey", lw=0.5)
    ax[2].set_xlabel("x shift over the clip (px)")
    ax[2].set_ylabel("y shift (px)")
    if pans:
        ax[2].legend(fontsize=7)
    else:
        ax[2].text(0.5, 0.5, "no clean pan clip in this run", ha="center", va="center", transform=ax[2].transAxes)
    ax[2].set_title(f"pan clips: recovered shift ({s['pan_clips']} clips)", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)
