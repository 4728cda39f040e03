"""The benchmark suites `python -m benchmarks` runs: for each, the measuring script, its arguments per size, and
how its JSON becomes the table and the plot of results/SUITE/.

Sizes: `default` is what the results/ tables publish: a speed suite finishes within about 15 minutes on 2 cores once its
model is exported (the first run exports into ~/.cache/fastcar-bench), a quality suite measures 16 held-out clips or
paths (30-60 minutes idle); `quick` is a smoke run of the same code on a
smaller model or fewer steps. The scripts do the timing (interleaved variants, lower quartiles: _common.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness import Column

MiB = 1 << 20


@dataclass(frozen=True)
class Suite:
    name: str
    title: str
    script: str  # benchmarks/<script>.py
    sizes: dict[str, list[str]]  # size -> arguments
    output: Callable[[Path], list[str]]  # temp folder -> the arguments that make the script write there
    columns: list[Column]
    rows: Callable[[object], list[dict]]  # the script's JSON -> table rows
    plot: tuple[str, list[str], str] | None  # (label key, value keys, y label) of the bar chart; None: the script's
    notes: list[str] = field(default_factory=list)
    sections: Callable[[object], list[str]] | None = None  # the script's JSON -> more markdown tables
    artifacts: tuple[str, ...] = ()  # files the script writes beside its JSON, copied into results/SUITE/


def _genai_rows(raw: dict) -> list[dict]:
    rows = []
    for ctx, c in raw["contexts"].items():
        dense = c["ms"].get("dense")
        for name in ("dense", "denseN"):
            if c["ms"].get(name) and dense:
                rows.append({"context": int(ctx), "variant": name, "ms": c["ms"][name], "speedup": dense / c["ms"][name],
                             "label": f"{name} @{ctx}"})
        for r in c["rows"]:
            rows.append({"context": int(ctx), **r, "label": f"{r['variant']} {r['replay']:.0%} @{ctx}"})
    return rows


def _long_rows(raw: dict) -> list[dict]:
    return [{**r, "rss_mib": r["rss_decoded"] / MiB, "label": f"{r['mode']} f{r['frame']}"} for r in raw["rows"]]


def _memory_rows(raw: dict) -> list[dict]:
    return [{**r, **{f"{k}_mib": r[k] / MiB for k in ("loaded", "decoded", "peak")}, "label": r["variant"]}
            for r in raw["rows"]]


def _fastar_rows(raw: list) -> list[dict]:
    return [{**r, "label": f"{r['source']}: {r['mode']}", "density_pm": _pm(r, "density", "{:.1%}"),
             "recall_pm": _pm(r, "recall", "{:.1%}")} for r in raw]


def _torch_rows(raw: dict) -> list[dict]:
    return [{**r, "label": f"{r['runtime']} {r['config']}"} for r in raw["rows"]]


def _kernel_rows(raw: dict) -> list[dict]:
    return [{"context": int(ctx), **{f"{k}_ms": v for k, v in c["ms"].items()}, "speedup": c["speedup"],
             "label": f"ctx {ctx}"} for ctx, c in raw["contexts"].items()]


def _walk_rows(raw: dict) -> list[dict]:
    ms = [("input model", raw["dense_ms_per_token"]), ("compiled, tau=+inf", raw["inf_ms_per_token"]),
          (f"FastCar, tau={raw['tau']:.4g}", raw["fast_ms_per_token"])]
    rows = [{"label": name, "ms": v, "x_input": raw["dense_ms_per_token"] / v} for name, v in ms]
    def rng(key: str) -> str:  # eval's lowest-highest over its interleaved rounds
        r = raw.get(f"{key}_range")
        return f" ({r[0]:.2f}-{r[1]:.2f} over {raw['rounds']} rounds)" if r and raw.get("rounds", 1) > 1 else ""

    rows[1]["factor"] = f"graph/attention {raw['speedup_graph']:.2f}x{rng('speedup_graph')}"
    rows[2]["factor"] = f"replay {raw['speedup_replay']:.2f}x{rng('speedup_replay')} ({raw['replay_ratio']:.1%} replayed)"
    rows[2]["agree"] = raw["token_agreement"]
    rows[1]["agree"] = raw["inf_token_agreement"]
    return rows


def _speculation_rows(raw: dict) -> list[dict]:
    return [{**r, "label": f"{r['model']} {r['decoding']} {r['mode']}"} for r in raw["rows"]]


def _dit_fastar_rows(raw: dict) -> list[dict]:
    return [{**r, "label": r["mode"]} for r in raw["rows"]]


def _pm(r: dict, key: str, fmt: str) -> str | None:
    """'mean +- half width' of a quality figure over the held-out paths (the mean alone without an interval)."""
    if r.get(key) is None:
        return None
    ci = r.get(f"{key}_ci")
    return fmt.format(r[key]) + (f" +- {fmt.format(ci)}" if ci is not None else "")


def _dit_table1_rows(raw: dict) -> list[dict]:
    out = []
    for r in raw["rows"]:
        met = [k for k, v in r["targets"].items() if v]
        missed = [k for k, v in r["targets"].items() if not v]
        shown = {f"{k}_pm": _pm(r, k, f) for k, f in (("psnr_vs_dense", "{:.1f}"), ("ssim_vs_dense", "{:.3f}"),
                                                        ("self_density", "{:.1%}"), ("self_recall", "{:.1%}"),
                                                        ("cross_density", "{:.1%}"), ("cross_recall", "{:.1%}"))}
        out.append({**r, **shown, "label": r["mode"], "met": "; ".join(met), "missed": "; ".join(missed)})
    return out


def _dit_stream_rows(raw: dict) -> list[dict]:
    import numpy as np

    rows = []
    for window, r in raw.items():
        eager = float(np.median(r["eager"]["frame_ms"][-50:]))
        for backend in ("compiled", "export", "eager"):
            ms = float(np.median(r[backend]["frame_ms"][-50:]))
            rows.append({"window": window, "backend": backend, "ms": ms, "x_eager": eager / ms,
                         "cache_mib": r[backend]["cache_mib"][-1], "label": f"{backend}, window {window}"})
    return rows


# The attention suite's targets (ratios in one run): time per executed pair / dense pair; AnnSA at this density or
# less, at Wan's shape over this many frames or more, this much faster than the fastest dense; TempCache with this
# share of the keys resident or less, this much faster
PAIR_COST_TARGET = 1.5
ANNSA_TARGET = (0.28, 64, 2.5)  # density at most, context frames at least (shape wan), x fastest dense at least
TEMPCACHE_TARGET = (0.16, 4.0)  # resident keys at most, x fastest dense at least


def _attention_targets(r: dict) -> str:
    """The targets a row of a sparse mode is held to, each met or MISSED (dense rows: none)."""
    if r["mode"] == "dense":
        return ""
    out = [f"pair <= {PAIR_COST_TARGET:g}x: {_met(r['pair_cost'] <= PAIR_COST_TARGET)}"]
    density, frames, speedup = ANNSA_TARGET
    if r["mode"].startswith("AnnSA") and r["shape"] == "wan" and r["context_frames"] >= frames \
            and r["density"] <= density:
        out.append(f">= {speedup:g}x dense: {_met(r['speedup'] >= speedup)}")
    resident, speedup = TEMPCACHE_TARGET
    if r["mode"].startswith("TempCache") and r.get("resident") is not None and r["resident"] <= resident:
        out.append(f">= {speedup:g}x dense: {_met(r['speedup'] >= speedup)}")
    return "; ".join(out)


def _attention_rows(raw: dict) -> list[dict]:
    return [{**r, "label": f"{r['shape']} C={r['context_frames']}: {r['variant']}", "targets": _attention_targets(r)}
            for r in raw["rows"]]


def _fpga_rows(raw: list) -> list[dict]:
    return [{**r, "label": r["config"]} for r in raw]


def _rtl_rows(raw: dict) -> list[dict]:
    return [{**r, "identical": "yes" if r["mismatches"] == 0 else f"NO ({r['mismatches']})"} for r in raw["matrix"]]


def _synth_row(r: dict) -> str:
    cap = "" if r["capacity"] is None else f"{r['capacity']:,}"
    share = "" if r["share"] is None else f"{r['share']:.2%}"
    return f"| {r['board']} | {r['resource']} | {r['used']:,.0f} | {cap} | {share} |\n"


def _speedup_row(r: dict) -> str:
    return (f"| {r['replay']:.0%} | {r['static_rtl']:,} / {r['static_sim']:,.0f} | {r['drs_rtl']:,} / "
            f"{r['drs_sim']:,.0f} | {r['remaps']} | {r['speedup_rtl']:.3f} | {r['speedup_sim']:.3f} | "
            f"{r['mismatches']} |\n")


def _rtl_sections(raw: dict) -> list[str]:
    """The RTL suite's other tables: loader vs decoder, the 7B DRS speed-up, the dense bound, synthesis."""
    ld = raw["loader"]
    out = [f"## Loader vs decoder on fuzzed bundles\n\n{ld['files']} files (tests/fcb_fuzz.py's mutations of two "
           f"compiled programs, and both unmutated): {ld['compared']} reach the RTL loader ({ld['refused']} of them "
           f"refused), whose verdict (refusal, instruction fault, instruction index) equals encode.decode's on "
           f"{ld['agree']} / {ld['compared']}; {ld['host_side']} are refused for their JSON metadata, which only the "
           "host reads."]
    if raw.get("speedup"):
        out.append("## DRS over static on the RTL: LLaMA-2-7B dims, U280, batch 32, context 1152\n\n"
                   "| replay (clustered) | static cycles RTL / sim | DRS cycles RTL / sim | remaps | DRS / static RTL | "
                   "DRS / static simulator | mismatches |\n|---:|---:|---:|---:|---:|---:|---:|\n"
                   + "".join(_speedup_row(r) for r in raw["speedup"]))
    if raw.get("dense"):
        d = raw["dense"]
        out.append("## Dense int4 LLaMA-2-7B-shaped decode (VILA-U-7B backbone), KV260, batch 1, context "
                   f"{d['context']}\n\n| tokens/s | bound at 19.2 GB/s | share of the bound | share of the bound at "
                   f"the preset's DRAM efficiencies (weight stream {d['dram_stream_efficiency']:.2f}, the rest "
                   f"{d['dram_efficiency']:.2f}) | weights GB/step | KV GB/step | cycles "
                   "RTL / simulator |\n|---:|---:|---:|---:|---:|---:|---:|\n"
                   f"| {d['tokens_per_s']:.2f} | {d['bound_tokens_per_s']:.2f} | {d['share_of_bound']:.1%} | "
                   f"{d['share_of_effective_bound']:.1%} | {d['weights_gb']:.3f} | {d['kv_gb']:.3f} | "
                   f"{d['rtl_cycles']:,} / {d['sim_cycles']:,.0f} |")
    if raw.get("synth"):
        out.append("## yosys synthesis of the DRS unit (fcar_drs: loader, decoder, dispatcher), UltraScale+\n\n"
                   "| board | resource | used | device capacity | share |\n|---|---|---:|---:|---:|\n"
                   + "".join(_synth_row(r) for r in raw["synth"]))
    return out


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _video_rows(raw: dict) -> list[dict]:
    """The closing table of the conditioned video model: size and cost, dense vs repeat-frame, copy rates,
    FastCar at ~50/80% replay, FAST-AR density / recall per mode."""
    from fastcar_compile.demo.quality import TARGET_COPY_POINTS, TARGET_FAST_DROP_DB, TARGET_GAIN_DB

    m, d = raw["model"], raw["dense"]
    c = m["config"]
    rows = [{"quantity": "model", "value": f"{c['num_hidden_layers']} layers x {c['hidden_size']} (MLP "
             f"{c['intermediate_size']}), {m['params'] / 1e6:.1f} M parameters, {m['weights_mb']:.1f} MB fp16"},
            {"quantity": "training cost", "value": f"{m['steps']} steps, {m['cpu_hours']:.2f} CPU h "
             f"({m['cpu_s_per_step']:.1f} CPU s/step, median), {m['wall_hours']:.1f} h wall"
             + (f", then {g['steps']} steps x {g['batch']} clips on {g['device']} ({g['step_minutes']:.1f} min of "
                "steps)" if (g := m.get("gpu")) else "") + "; held-out loss "
             f"{m['eval']['eval_loss']:.3f}, token accuracy {m['eval']['eval_acc']:.3f} (copying: "
             f"{m['eval']['copy_acc']:.3f})"}]
    n, ci = len(raw["clips"]), d.get("ci95", {})

    def pm(value: float, key: str, sign: str = "") -> str:  # mean +- the 95% interval's half width
        return f"{value:{sign}.2f}" + (f" +- {ci[key]:.2f}" if ci.get(key) == ci.get(key) and key in ci else "")

    gain = d["dense_minus_repeat_db"]
    rows.append({"quantity": f"dense vs repeat-last-frame (PSNR vs truth, mean +- 95% interval over {n} held-out clips)",
                 "value": f"{pm(d['psnr_dense_vs_truth'], 'psnr_dense_vs_truth')} vs "
                 f"{pm(d['psnr_repeat_last_vs_truth'], 'psnr_repeat_last_vs_truth')} dB = "
                 f"{pm(gain, 'dense_minus_repeat_db', '+')} dB (paired; dense above on "
                 f"{d['dense_minus_repeat_db_clips_above']} of {n} clips)", "target": f">= +{TARGET_GAIN_DB:g} dB",
                 "status": _met(gain >= TARGET_GAIN_DB)})
    gap = abs(d["copy_rate_dense"] - d["copy_rate_truth"])
    rows.append({"quantity": "copy rate dense / truth", "value": f"{d['copy_rate_dense']:.3f} / {d['copy_rate_truth']:.3f}",
                 "target": f"within {100 * TARGET_COPY_POINTS:.0f} points", "status": _met(gap <= TARGET_COPY_POINTS)})
    rows.append({"quantity": "frozen clips (dense)", "value": f"{d['frozen_fraction_dense']:.0%}", "target": "0",
                 "status": _met(d["frozen_fraction_dense"] == 0)})
    if d["pan_match_truth"] == d["pan_match_truth"]:  # not NaN: a clean pan among the clips
        rows.append({"quantity": "pan shift recovered (dense / truth)",
                     "value": f"{d['pan_match_dense']:.0%} / {d['pan_match_truth']:.0%} of frame pairs"})
    for r in raw["curve"]:
        drop = -r["fast_minus_dense_db"]
        rci = r.get("ci95", {})
        bound = next((b for t, b in TARGET_FAST_DROP_DB.items() if f"{t:.0%}" in r["config"]), None)
        lossy = "" if r["config"].startswith("tau=+inf") else " (lossy)"  # tau=+inf never replays
        rows.append({"quantity": f"FastCar {r['config']}{lossy}", "value": f"replay {r['replay']:.1%}; vs truth "
                     f"{r['psnr_fast_vs_truth']:.2f} +- {rci.get('psnr_fast_vs_truth', float('nan')):.2f} dB "
                     f"({-drop:+.2f} +- {rci.get('fast_minus_dense_db', float('nan')):.2f} vs dense, paired); copy "
                     f"rate {r['copy_rate_fast']:.3f}; {r['x_dense']:.2f}x dense (graph {r['x_graph']:.2f} x replay "
                     f"{r['x_replay']:.2f})",
                     "target": f"within {bound:g} dB of dense" if bound else "",
                     "status": _met(drop <= bound) if bound else ""})
    for f in raw["fastar"]:
        fci = f.get("ci95", {})
        rows.append({"quantity": f"FAST-AR {f['mode']}", "value": f"density {f['density']:.1%}, recall {f['recall']:.1%}"
                     f" (mean of {len(f['per_layer'])} layers, {f['clips']} clips); vs truth {f['psnr_vs_truth']:.2f} +- "
                     f"{fci.get('psnr_fast_vs_truth', float('nan')):.2f} dB ({f['psnr_vs_dense_truth_diff']:+.2f} +- "
                     f"{fci.get('fast_minus_dense_db', float('nan')):.2f} vs dense on the same clips, paired), copy rate "
                     f"{f['copy_rate']:.3f}", "target": "paper: TempCache 16% at 90%, AnnSA 28% at 92%"})
    return rows


def _video_sections(raw: dict) -> list[str]:
    """Further tables: the tau curve with replay per layer, FAST-AR per layer and mode, the FPGA simulation."""
    n = len(raw["curve"][0]["replay_per_layer"])
    out = ["## tau / quality / speed, replay per layer\n\n| configuration | tau per layer | replay | "
           + " | ".join(f"L{i}" for i in range(n)) + " | x dense (bare ORT) | vs truth dB | vs dense dB | copy rate | "
           "token agreement |\n|---|---|---:|" + "---:|" * n + "---:|---:|---:|---:|---:|\n" + "".join(
               f"| {r['config']} | {' '.join(f'{t:.3g}' for t in r['taus'])} | {r['replay']:.1%} | "
               + " | ".join(f"{x:.0%}" for x in r["replay_per_layer"]) + f" | {r['x_dense']:.2f} | "
               f"{r['psnr_fast_vs_truth']:.2f} | {r['psnr_fast_vs_dense']:.2f} | {r['copy_rate_fast']:.3f} | "
               f"{r['token_agreement']:.1%} |\n" for r in raw["curve"])
           + "\nTAS (post-RoPE) per layer along the calibration clips' dense videos, median: "
           + " / ".join(f"{x:.2f}" for x in raw["tas"]["median_per_layer"]) + "."]
    layers = len(raw["fastar"][0]["per_layer"]) if raw["fastar"] else 0
    out.append("## FAST-AR density / recall per layer (measured by the op, inside sampled generation)\n\n| mode | "
               + " | ".join(f"L{i}" for i in range(layers)) + " | mean | vs truth dB | copy rate |\n|---|"
               + "---:|" * (layers + 3) + "\n" + "".join(
                   f"| {f['mode']} | " + " | ".join(f"{p['density']:.0%} / {p['recall']:.0%}" for p in f["per_layer"])
                   + f" | {f['density']:.1%} / {f['recall']:.1%} | {f['psnr_vs_truth']:.2f} | {f['copy_rate']:.3f} |\n"
                   for f in raw["fastar"]) + "\nCells: density / recall. Paper (AR video diffusion): "
               + ", ".join(f"{k} {d:.0%} at {r:.0%}" for k, (d, r) in raw["paper"].items()) + ".")
    out.append("## FPGA simulation (U280) fed with the recorded replay decisions\n\n| configuration | replay | "
               "us/step | dense us/step | x dense | bound |\n|---|---:|---:|---:|---:|---|\n" + "".join(
                   f"| {r['config']} | {r['replay']:.1%} | {r['us_per_step']:.1f} | {r['dense_us_per_step']:.1f} | "
                   f"{r['x_dense']:.2f} | {r['bound']} |\n" for r in raw["fpga"]))
    out.append("![tau curve](plot.png)\n![replay per layer](replay_layers.png)\n![FAST-AR](fastar.png)\n"
               "![truth, dense, FastCar, FAST-AR](video-demo.gif)\n![strip](strip.png)\n"
               "![replay heatmap](replay_heatmap.png)")
    return out


def _world_rows(raw: dict) -> list[dict]:
    rows = []
    for r in raw["rows"]:
        row = dict(r)
        for k in ("revisit", "revisit_far", "new", "previous", "revisit_far_minus_window", "new_minus_shift"):
            v = r.get(k)
            row[k] = f"{v:+.3f} ± {r[k + '_ci']:.3f}" if k.endswith(("window", "shift")) and v is not None \
                else f"{v:.3f} ± {r[k + '_ci']:.3f}" if v is not None and v == v else ""
        rows.append(row)
    return rows


def _world_sections(raw: dict) -> list[str]:
    """The long-video speed run: the bounded caches against the sink + window cache."""
    if not raw.get("long_rows"):
        return []
    (e0, e1), (l0, l1) = raw["speed_windows"]
    head = (f"## Long videos: {raw['paths']} held-out paths x {raw['speed_frames']} frames, the bounded caches\n\n"
            f"| variant | FPS frames {e0}-{e1} | FPS frames {l0}-{l1} | late / early | late x window | cache MiB "
            "| revisited > window | MLP replay |\n|---|---:|---:|---:|---:|---:|---|---:|\n")
    body = "".join(
        f"| {r['variant']} | {r['fps_early']:.2f} | {r['fps_late']:.2f} | {r['late_over_early']:.2f} | "
        f"{r['x_window_late']:.2f} | {r['cache_mib_late']:.1f} | {r['revisit_far']:.3f} ± {r['revisit_far_ci']:.3f} "
        f"| {'' if r.get('replay') is None else format(r['replay'], '.1%')} |\n" for r in raw["long_rows"])
    return [head + body + "\nThe variants advance one frame each in turn (lockstep), so their speeds share the machine's "
            "load."]


WORLD_NOTE = ("Token accuracy vs the truth on the generated frames' cells the truth labels revisited (seen before, "
              "not in the previous frame), revisited beyond the window, new (never seen) and in the previous frame: "
              "mean over the held-out paths with a 95% Student-t interval (n paths: result.json); the paired columns: the "
              "per-path difference to the window's accuracy on revisits beyond the window (the memory's gain) and to "
              "the shift baseline's on new cells, mean and 95% interval. FPS: frames per "
              "second of the paths batched, median over the early frames (5-15% of the video) and the last 10%; "
              "cache: the state the video holds (KV slots written so far; a bounded cache its budget). 'agree' = "
              "share of tokens equal to the full-context rollout's. Variants run one after another on a shared machine: speed ratios are indicative.")
VIDEO_PICTURES = ("plot.png", "video-demo.gif", "strip.png", "replay_heatmap.png", "replay_layers.png", "fastar.png")

SUITES: dict[str, Suite] = {s.name: s for s in [
    Suite("many-videos", "Many videos: generate's in-process loop against Ray Data actor pools (tiny DiT, 1 thread each)",
          "many_videos.py", {"default": ["--videos", "24", "--frames", "24"], "quick": ["--quick"]},
          lambda d: ["--out", str(d / "many_videos.json")],
          [Column("variant", "run"), Column("videos", "videos"), Column("wall_s", "wall s", "{:.1f}"),
           Column("videos_per_min", "videos/min", "{:.1f}"), Column("x_loop", "x loop", "{:.2f}"),
           Column("p50_s", "video p50 s", "{:.3f}"), Column("p90_s", "video p90 s", "{:.3f}"),
           Column("max_s", "video max s", "{:.3f}"), Column("load_s", "model load s", "{:.2f}"),
           Column("worker_rss_mib", "worker RSS MiB", "{:.0f}")],
          lambda raw: [{**r, "label": r["variant"]} for r in raw["rows"]], ("label", ["videos_per_min"], "videos per minute"),
          ["Wall time includes Ray's actor start-up and each actor's model load (a one-time cost per actor); a "
           "video's own time is its trace's. The machine has 2 cores shared with other jobs: 2 actors of 1 thread "
           "each use both."]),
    Suite("walk", "The README's five commands on the bundled video model as a transformers folder (64-token frames, 1 thread)",
          "walk.py", {"default": [], "quick": ["--quick"]}, lambda d: ["--out", str(d / "walk.json")],
          [Column("label", "model"), Column("ms", "decode ms/token", "{:.3f}"), Column("x_input", "x input model",
           "{:.2f}"), Column("factor", "factor"), Column("agree", "tokens equal to the input model's", "{:.1%}")],
          _walk_rows, ("label", ["x_input"], "speed-up over the input model"),
          ["tau calibrated on the calibration prompts for 50% replay, measured on the held-out ones; the three "
           "models run the same prompts, interleaved prompt batch by prompt batch (`fastcar-compile eval`)."]),
    Suite("genai", "Decode per token against onnxruntime-genai's own loop (LLaMA-style decoder, forced replay)",
          "bench_genai.py", {"default": ["--contexts", "4096"], "quick": ["--quick"]},
          lambda d: ["--out", str(d / "bench_genai.json")],
          [Column("context", "ctx"), Column("variant", "variant"), Column("replay", "replay", "{:.1%}"),
           Column("ms", "ms/token", "{:.2f}"), Column("speedup", "x genai dense", "{:.2f}"),
           Column("speedup_vs_fastest_dense", "x fastest dense", "{:.2f}"), Column("bound", "bound", "{:.2f}")],
          _genai_rows, ("label", ["speedup", "speedup_vs_fastest_dense"], "speed-up"),
          ["Variants: `rK` = (a) genai's builder graph compiled, in og.Generator, K layers replaying; `fcK` / "
           "`fusedK` = (b) / (b') the dynamo export compiled with the fastcar / gqa attention, in FastCarSession; "
           "`@80` = a per-step layer schedule replaying 80%. `dense` = genai dense, `denseN` = genai dense with "
           "the native attention core (the fastest dense decode); bound = Amdahl's bound from denseN's MLP share."]),
    Suite("long-video", "Long videos: FastCar + FAST-AR modes against onnxruntime-genai's dense loop, per frame",
          "long_video_llama.py", {"default": ["--frames", "8,64", "--modes", "2,3"], "quick": ["--quick"]},
          lambda d: ["--out", str(d / "long_video_llama")],
          [Column("mode", "mode"), Column("frame", "frame"), Column("ctx", "positions"),
           Column("ms_q25", "ms/token (q25)", "{:.2f}"), Column("rss_mib", "RSS after decode (MiB)", "{:.0f}")],
          _long_rows, ("label", ["ms_q25"], "ms per token")),
    Suite("memory", "Process memory of compiled and dense models (each in a fresh process)",
          "memory_footprint.py", {"default": [], "quick": ["--quick"]},
          lambda d: ["--out", str(d / "memory_footprint.json")],
          [Column("variant", "model"), Column("loaded_mib", "after load (MiB)", "{:.0f}"),
           Column("decoded_mib", "after prompt + steps (MiB)", "{:.0f}"), Column("peak_mib", "peak (MiB)", "{:.0f}")],
          _memory_rows, ("label", ["loaded_mib", "decoded_mib"], "MiB")),
    Suite("torch", "PyTorch front end: decode step against transformers eager at forced replay",
          "bench_torch.py", {"default": [], "quick": ["--quick"]}, lambda d: ["--out", str(d)],
          [Column("runtime", "runtime"), Column("config", "program"), Column("ratio", "replay", "{:.0%}"),
           Column("ms", "ms/step", "{:.2f}"), Column("x_transformers", "x transformers eager", "{:.3f}")],
          _torch_rows, ("label", ["x_transformers"], "x transformers eager")),
    Suite("kernels", "Native dense attention core against ONNX Runtime's GroupQueryAttention (one decode step)",
          "bench_native_gqa.py", {"default": [], "quick": ["--contexts", "1024", "--rounds", "10"]},
          lambda d: ["--out", str(d / "bench_native_gqa.json")],
          [Column("context", "ctx"), Column("ort_ms", "ORT GQA ms", "{:.3f}"), Column("ours_ms", "native ms", "{:.3f}"),
           Column("speedup", "speed-up", "{:.2f}")],
          _kernel_rows, ("label", ["speedup"], "speed-up")),
    Suite("fastar", "FAST-AR modes on the demo model's attention: density against recall (NumPy reference)",
          "fastar_recall.py", {"default": [], "quick": ["--quick", "--clips", "2"]}, lambda d: ["--out-dir", str(d)],
          [Column("source", "trace"), Column("mode", "mode"), Column("density_pm", "density"),
           Column("recall_pm", "recall"), Column("kv_ratio", "KV vs dense", "{:.1%}")],
          _fastar_rows, ("label", ["density", "recall"], "share"),
          ["Each figure: the mean over held-out eval clips 0-15 (12 frames each; the clip's first frame seeds the "
           "generated trace) +- the half width of its 95% interval (Student t)."]),
    Suite("dit-fastar", "FAST-AR and FastCar modes on the chunk-causal video DiT stream (eager runtime, random weights)",
          "bench_dit_fastar.py", {"default": ["--frames", "120", "--diag-frames", "40"],
                                  "quick": ["--frames", "16", "--diag-frames", "8"]},
          lambda d: ["--json", str(d / "bench_dit_fastar.json")],
          [Column("mode", "mode"), Column("ms_late", "ms/frame, last quarter", "{:.1f}"),
           Column("speedup_late", "x dense eager", "{:.2f}"), Column("psnr_vs_dense", "PSNR vs dense (dB)", "{:.1f}"),
           Column("self_density", "self density", "{:.2f}"), Column("self_recall", "self recall", "{:.2f}"),
           Column("cross_density", "cross density", "{:.2f}"), Column("replay_ratio", "FFN replay", "{:.2f}"),
           Column("kv_density", "KV / dense", "{:.2f}"), Column("self_attention_speedup", "self-attn x", "{:.2f}"),
           Column("ffn_speedup", "FFN x", "{:.2f}")],
          _dit_fastar_rows, ("label", ["speedup_late", "self_density", "self_recall"], "ratio"),
          ["Random weights: density, recall and PSNR say how far each mode moves an untrained model, not quality. "
           "Speed-ups vs the dense eager model (TorchDiT) at the video's last quarter; component speed-ups vs the "
           "FAST-AR runtime's own dense pass; FastCar at the tau calibrated for 50% replay (docs/dit.md)."]),
    Suite("dit-table1", "FAST-AR's Table 1 on the causal video DiT trained here (training/dit_model, eager runtime), "
          "against the model's capped dense rollout and the full-context one", "bench_dit_table1.py",
          {"default": ["--diag-frames", "24", "--frames", "1000"],
           "full": ["--diag-frames", "48", "--frames", "1000", "--dense-frames", "1000", "--long-modes", "every"],
           "quick": ["--diag-frames", "4", "--frames", "12", "--paths", "2"]},
          lambda d: ["--json", str(d / "bench_dit_table1.json"), "--png", str(d / "frames.png")],
          [Column("mode", "mode"), Column("speedup_late_vs_capped", "x capped dense (late; the model's default)",
                                          "{:.2f}"),
           Column("speedup_late", "x full-context dense (late)", "{:.2f}"),
           Column("psnr_vs_dense_pm", "PSNR vs full-context dense (dB)"), Column("ssim_vs_dense_pm", "SSIM"),
           Column("self_density_pm", "self density"), Column("self_recall_pm", "self recall"),
           Column("cross_density_pm", "cross density"), Column("cross_recall_pm", "cross recall"),
           Column("replay_ratio", "FFN replay", "{:.1%}"),
           Column("kv_density", "KV / dense", "{:.1%}"), Column("self_attention_speedup", "self-attn x", "{:.2f}"),
           Column("cross_attention_speedup", "cross-attn x", "{:.2f}"), Column("ffn_speedup", "FFN x", "{:.2f}"),
           Column("fps_early", "FPS early", "{:.2f}"), Column("fps_late", "FPS late", "{:.2f}"),
           Column("fps_late_over_early", "FPS late / early", "{:.2f}"),
           Column("cache_mib_early", "cache MiB early", "{:.2f}"), Column("cache_mib_late", "cache MiB late", "{:.2f}"),
           Column("missed", "targets missed")],
          _dit_table1_rows, ("label", ["speedup_late_vs_capped", "speedup_late"], "x dense, late"),
          ["Headline: speed-up against the model's default rollout, its own capped context (sink + window cache: "
           "flat; its PSNR against the full-context one: the 'dense, capped context' row), beside the paper's baseline, the dense "
           "rollout over the full context (every frame cached, the cache growing to 500 MiB at frame 1000). The "
           "modes run on the full context, TempCache with its slot budget. Quality, density and recall from the "
           "quality run over 16 held-out paths (a camera label and a noise seed each; mean +- the half width of the "
           "95% interval over the paths; --diag-frames frames, the dense attention on the side; PSNR / SSIM vs the "
           "same path's full-context dense video). Speed from the timed run, frame by frame in lockstep: early = frames 50-150, late = the last "
           "100 reached (frames.png: ms per frame over the video). The capped dense rollout and 'all' run to the "
           "last frame (the 'full' size: every mode), the other modes to frame 150. The full-context dense rollout runs for real to "
           "frame 150 (the 'full' size: to the end); late, it is timed on a few chunks (Settings) each over a "
           "cache holding the K/V of every earlier frame as the capped rollout's clean pass wrote them (the dense "
           "step's cost depends on the cache's length, not on its values). Component speed-ups over the first 150 "
           "frames vs the FAST-AR runtime's own dense pass. Targets (FAST-AR's Table 1): TempCache density <= 16% "
           "at recall >= 90%, AnnSA density <= 28% at recall >= 92%, >= 5x vs the full-context dense rollout late "
           "with FPS flat (late >= 0.9x early) and memory flat (the mode's cache late <= 1.1x early), PSNR vs "
           "dense >= 24 dB; docs/dit.md discusses each miss."], artifacts=("frames.png",)),
    Suite("attention", "One attention layer at real shapes: the fastest dense attention against AnnSA and TempCache "
          "at their density", "bench_attention.py",
          {"quick": ["--shapes", "dit,token", "--contexts", "16,64", "--rounds", "3"],
           "default": ["--shapes", "dit,token,wan", "--contexts", "dit:16,64,200;token:16,64,200;wan:16,64",
                       "--rounds", "5"],
           "full": ["--shapes", "dit,token,wan", "--contexts", "dit:16,64,128,200;token:16,64,128,200;wan:16,64,128",
                    "--rounds", "5"]},
          lambda d: ["--out", str(d / "attention.json")],
          [Column("shape", "shape"), Column("context_frames", "context (frames)"), Column("variant", "attention"),
           Column("density", "density", "{:.1%}"), Column("recall", "recall", "{:.1%}"),
           Column("ms", "ms", "{:.2f}"), Column("ms_dense", "fastest dense ms", "{:.2f}"),
           Column("speedup", "x fastest dense", "{:.2f}"), Column("bound", "bound 1/d", "{:.2f}"),
           Column("pair_cost", "time per pair / dense", "{:.2f}"),
           Column("speedup_with_index", "x dense with index", "{:.2f}"), Column("resident", "resident keys", "{:.1%}"),
           Column("targets", "targets")],
          _attention_rows, ("label", ["speedup", "bound"], "x the fastest dense attention"),
          ["`dit` / `wan`: a chunk's queries over C cached frames (every frame kept) and the chunk itself, one layer; "
           "keys and queries from the causal DiT trained here (training/dit_model: its rollout's own q/k/v), tiled to "
           "Wan2.1-1.3B's shape for `wan`. `token`: one decode step of the token world model's shape (4 heads x 64, "
           "65-token frames) over C frames, the bundled long-video decoder's q/k/v tiled, through CompressedAttention "
           "as a compiled decoder runs it (AnnSA keeps the first and the last frame). Times are thread CPU time, 1 thread, lower quartile of interleaved rounds (the machine "
           "is shared: wall times are in result.json). Dense: PyTorch SDPA, ONNX Runtime's MultiHeadAttention and "
           "Attention-23 (`wan`: one (row, head) per call; not run where one head's score matrix passes 1 GiB), the "
           "compiled step graph's in-place form where its score matrix fits, and for `token` GroupQueryAttention and "
           "CompressedAttention's dense core; 'fastest dense' is the fastest of them. "
           "AnnSA: sinks + 1 local frame + the chunk dense, ai.fastcar AnnSAAttention; TempCache: the stream "
           "runtime's aligned merge over the C frames, ai.fastcar SlotAttention over the resident slots. "
           "time per pair / dense = ms / (fastest dense ms x density); bound 1/d = the speed-up at dense cost per "
           "pair; with index: + the query codes per step and a fifth of the per-chunk index (5 steps per chunk). "
           f"Targets: time per pair <= {PAIR_COST_TARGET:g}x dense for every sparse row; AnnSA at <= "
           f"{ANNSA_TARGET[0]:.0%} density >= {ANNSA_TARGET[2]:g}x the fastest dense at `wan` over "
           f"{ANNSA_TARGET[1]}+ frames; TempCache with <= {TEMPCACHE_TARGET[0]:.0%} of the keys resident >= "
           f"{TEMPCACHE_TARGET[1]:g}x."]),
    Suite("fpga", "FPGA simulator: DRS schedule and KV-bounded modes on a VILA-U-7B-shaped decoder (U280)",
          "fpga_table2.py", {"default": [], "quick": ["--frames", "4"]}, lambda d: ["--out-dir", str(d)],
          [Column("config", "configuration"), Column("replay", "replay", "{:.0%}"),
           Column("ms_per_step", "ms/step", "{:.1f}"), Column("x_dense", "x dense", "{:.2f}"),
           Column("bound", "bound"), Column("paper", "paper")],
          _fpga_rows, ("label", ["x_dense"], "x dense")),
    Suite("fpga-rtl", "The DRS dispatcher's RTL (Verilator + cocotb) against the FPGA simulator, its yosys "
          "resources, and the dense int4 bandwidth bound", "fpga_rtl.py", {"default": [], "quick": ["--quick"]},
          lambda d: ["--out", str(d)],
          [Column("board", "board"), Column("batch", "batch"), Column("replay", "replay", "{:.0%}"),
           Column("static_rtl", "static cycles RTL", "{:,.0f}"), Column("static_sim", "static simulator", "{:,.0f}"),
           Column("drs_rtl", "DRS cycles RTL", "{:,.0f}"), Column("drs_sim", "DRS simulator", "{:,.0f}"),
           Column("remaps", "remaps RTL/sim"), Column("issued", "ops issued"), Column("identical", "identical")],
          _rtl_rows, ("label", ["drs_speedup_rtl", "drs_speedup_sim"], "DRS / static"),
          ["Every co-simulated step is compared bundle by bundle: the bundles issued and their cycles, the order "
           "of issued operations (bundle, core, opcode, layer, row mask), per core busy and occupied cycles, "
           "DRAM bytes per class, MACs, remaps, the rows each layer replayed (the RTL's Index Register from its "
           "own TAS comparison) and the MLP-cache reads and writes; 'identical' means none of them differed. "
           "The matrix decoder is modelspec.SMALL_LLAMA (2 layers, hidden 512, MLP 1408, GQA 8/4), clustered "
           "masks, 2 steps per cell, both policies. Cycles are the accelerator's clock (simulated), not "
           "measured hardware."], sections=_rtl_sections),
    Suite("speculation", "Speculative decoding with temporal drafts, alone and with FastCar: tokens per second "
          "against plain decoding",
          "speculation.py", {"default": [], "quick": ["--quick"]}, lambda d: ["--out", str(d)],
          [Column("model", "model"), Column("decoding", "decoding"), Column("mode", "mode"), Column("output", "output"),
           Column("tokens_per_s", "tokens/s", "{:.0f}"), Column("speedup", "x dense plain", "{:.2f}"),
           Column("x_base", "x its own plain decoding", "{:.2f}"),
           Column("acceptance", "acceptance", "{:.1%}"), Column("tokens_per_step", "tokens/step", "{:.2f}"),
           Column("videos_identical_to_dense", "videos identical"), Column("replay", "MLP replay", "{:.1%}"),
           Column("vs_best_alone", "FastCar + draft vs best alone", "{:.2f}")],
          _speculation_rows, ("label", ["speedup"], "x plain decoding of the dense model"),
          ["Lossless = the tokens (greedy) or their distribution (sampled) of the model the draft is verified "
           "against. FastCar replays MLPs, so every FastCar row is lossy against the dense model: FastCar + drafts "
           "is lossless only against FastCar alone at the same tau ('x its own plain decoding'). The lossless "
           "speed-ups against the dense model are the temporal-draft rows. 'x dense plain': tokens/s over plain "
           "decoding of the dense model in the same run. Greedy videos identical: of the held-out clips run."]),
    Suite("dit-stream", "The DiT stream per frame: compiled ONNX, the export and eager PyTorch (tiny preset)",
          "bench_dit_stream.py", {"default": [], "quick": ["--frames", "30"]},
          lambda d: ["--json", str(d / "dit_stream.json")],
          [Column("window", "window"), Column("backend", "backend"), Column("ms", "ms/frame (last 50)", "{:.2f}"),
           Column("x_eager", "x eager", "{:.2f}"), Column("cache_mib", "cache MiB", "{:.2f}")],
          _dit_stream_rows, ("label", ["x_eager"], "x eager PyTorch")),
    Suite("torch-dit", "TempCache on the PyTorch DiT (apply_dit, trained DiT): dead slots compacted out vs kept",
          "bench_torch_dit.py", {"default": ["--frames", "64"], "quick": ["--frames", "8"]},
          lambda d: ["--json", str(d / "bench_torch_dit.json")],
          [Column("window", "window"), Column("variant", "cache"), Column("ms_per_chunk", "ms/chunk (2nd half, q1)", "{:.1f}"),
           Column("cache_mib", "cache MiB (last)", "{:.2f}"), Column("keys", "self-attention keys", "{}"),
           Column("kv_density", "live / dense slots", "{:.3f}")],
          lambda raw: [{**r, "label": f"{r['variant']} w{r['window']}"} for r in raw["rows"]],
          ("label", ["ms_per_chunk"], "ms per chunk"),
          ["training/dit_model, SIM 0.9, CFG 2, 1 thread, both variants interleaved chunk by chunk in one process; "
           "keys: per query, summed over layers (the compacted cache pads each (row, head) to the fullest)."]),
    Suite("video-model", "The conditioned video model (6 layers, sampled with CFG): dense, FastCar and FAST-AR against "
          "the truth and repeat-last-frame", "video_model.py",
          {"default": [], "quick": ["--quick"]}, lambda d: ["--out", str(d)],
          [Column("quantity", "quantity"), Column("value", "measured"), Column("target", "target"),
           Column("status", "status")],
          _video_rows, None,
          ["Held-out scene clips 0-15 (every 4th a clean pan), frame 0 given, sampled (temperature 1, top-k 256, "
           "top-p 0.96, CFG 1.5); held-out clip k is sampled with the seed of k (its index in the held-out split) by "
           "every model. Quality: mean over the clips +- the half width of its 95% interval (Student t); differences "
           "of two videos of the same clip (dense - repeat last frame, FastCar - dense): the interval of the paired "
           "per-clip differences. FastCar rows replaying any MLP are lossy (the video differs from dense). Taus "
           "calibrated on a training-split clip's dense video; speed = bare ORT per token, each model on its own, "
           "1 thread (clip 0); FAST-AR through the compiled op with --kv-diagnostics. Clip counts and frames: "
           "result.json."],
          _video_sections, VIDEO_PICTURES),
    Suite("world-memory", "The token world model on held-out revisit paths: full context, sink + window, FAST-AR, "
          "FastCar and shift-by-action against the truth", "world_memory.py",
          {"default": [], "quick": ["--quick"]}, lambda d: ["--out", str(d)],
          [Column("variant", "variant"), Column("revisit", "revisited"), Column("revisit_far", "revisited > window"),
           Column("new", "new"), Column("previous", "previous"),
           Column("revisit_far_minus_window", "> window: - window (paired)"),
           Column("new_minus_shift", "new: - shift (paired)"), Column("agree_full", "agree full", "{:.3f}"),
           Column("fps_early", "FPS early", "{:.2f}"), Column("fps_late", "FPS late", "{:.2f}"),
           Column("cache_mib_early", "cache MiB early", "{:.1f}"), Column("cache_mib_late", "cache MiB late", "{:.1f}"),
           Column("replay", "MLP replay", "{:.1%}")],
          _world_rows, None, [WORLD_NOTE], _world_sections, artifacts=("plot.png",)),
]}
