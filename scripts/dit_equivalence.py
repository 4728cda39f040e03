"""Two checkouts, the same DiT rollouts: equal latents for every DiT mode, compiled and eager?

    python scripts/dit_equivalence.py --old OLD/.venv/bin/python --new .venv/bin/python \
        [--frames 12] [--modes dense,tempcache-lsh,...] [--out dit-equivalence]

For a refactoring of the DiT runtimes (e.g. an older checkout of the repository with its own venv as --old): each
side, in its own interpreter, exports the tiny DiT preset (seed 0) with its own exporter and rolls out `--frames`
latent frames (seed 3, CFG 3) in every mode on every path that runs it:
- compiled: `fastcar-compile dit.onnx -o fast.onnx FLAGS` then the stream runtime (dit/stream.OrtDiT) on it;
- eager: the FAST-AR stream runtime (dit/fastar.FastARDiT) on the eager model;
- torch: fastcar_compile.torch.apply_dit (the modes the PyTorch DiT takes).
Per (mode, path): the largest latent difference between the sides and the mode counters (replayed FFN rows,
merged keys, resident slots). Exit 1 when a difference exceeds --tol, a counter differs, or one side runs a case
the other refuses. Modes are written in this checkout's option names; a side whose stream settings still carry
the names of the options before they were unified (`tempcache` the match kind, `tempcache_sim`, `fastcar_tau`,
`quant`) gets them translated.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import numpy as np

SIM, TAU = 0.3, 0.0  # a cosine at which the tiny random model's keys merge, a tau at which some FFN rows replay
# mode -> (settings in option names; the paths that run it[; StreamSettings fields])
MODES: dict[str, tuple] = {
    "dense": ({}, ("compiled", "eager", "torch")),
    "tempcache-aligned": ({"tempcache": SIM, "tempcache_match": "aligned"}, ("compiled", "eager", "torch")),
    "tempcache-lsh": ({"tempcache": SIM, "tempcache_match": "lsh"}, ("compiled", "eager")),
    "tempcache-int8": ({"tempcache": SIM, "tempcache_match": "int8"}, ("compiled", "eager")),
    "tempcache-lsh-window0": ({"tempcache": SIM, "tempcache_match": "lsh"}, ("compiled", "eager"),
                              {"window_frames": 0}),
    "tempcache-budget": ({"tempcache": SIM, "tempcache_match": "lsh", "tempcache_budget": 1}, ("eager",),
                         {"window_frames": 0}),
    "annsa-lsh": ({"annsa": "lsh"}, ("compiled", "eager")),
    "annsa-int8": ({"annsa": "int8", "int8_dirs": 4}, ("compiled", "eager")),
    "annca": ({"annca": True}, ("compiled", "eager")),
    "fastcar": ({"threshold": TAU}, ("compiled", "eager", "torch")),
    "tempcache-aligned+fastcar": ({"tempcache": SIM, "tempcache_match": "aligned", "threshold": TAU},
                                  ("compiled", "eager", "torch")),
    "fastcar+tempcache-lsh+annca": ({"threshold": TAU, "tempcache": SIM, "tempcache_match": "lsh", "annca": True},
                                    ("compiled", "eager")),
    "all-eager": ({"threshold": TAU, "tempcache": SIM, "tempcache_match": "lsh", "annsa": "lsh", "annca": True},
                  ("eager",)),
}
EAGER_ONLY = ("tempcache_budget",)  # stream settings without a compile option


# ------------------------------------------------------------------------------------------ worker (either side)
def _names(modes) -> str:
    """'new' when this side's stream settings use the unified option names, else 'old'."""
    return "old" if "tempcache_sim" in modes.BY_NAME else "new"


def _settings_kw(kw: dict, names: str) -> dict:
    if names == "new":
        return dict(kw)
    out = {k: v for k, v in kw.items() if k not in ("tempcache", "tempcache_match", "threshold", "int8_dirs")}
    if "tempcache" in kw:
        out["tempcache"], out["tempcache_sim"] = kw["tempcache_match"].replace("int8", "quant"), kw["tempcache"]
    if "threshold" in kw:
        out["fastcar_tau"] = kw["threshold"]
    if "int8_dirs" in kw:
        out["quant_dirs"] = kw["int8_dirs"]
    if out.get("annsa") == "int8":
        out["annsa"] = "quant"
    return out


def _compile_flags(kw: dict, names: str) -> list[str]:
    flags = []
    for k, v in kw.items():
        if k == "int8_dirs" and names == "old":
            k = "quant_dirs"
        if v is True:
            flags.append("--" + k.replace("_", "-"))
        else:
            val = "quant" if (names == "old" and v == "int8") else v
            flags += ["--" + k.replace("_", "-"), str(val)]
    return flags


def _run(model, frames: int, stream: dict) -> np.ndarray:
    from fastcar_compile.dit.stream import StreamSettings, rollout

    settings = StreamSettings(frames=frames, seed=3, **stream)
    return np.concatenate([r.frames for r in rollout(model, settings)], axis=1)


def worker(out: Path, frames: int, which: list[str]) -> None:
    import torch

    from fastcar_compile.cli import main
    from fastcar_compile.dit import modes
    from fastcar_compile.dit.config import PRESETS
    from fastcar_compile.dit.fastar import FastARDiT
    from fastcar_compile.dit.model import build
    from fastcar_compile.dit.stream import OrtDiT

    torch.set_num_threads(1)
    names = _names(modes)
    out.mkdir(parents=True, exist_ok=True)
    export = out / "dit.onnx"
    if not export.exists():
        assert main(["export", "--dit", "tiny", "-o", str(export)]) == 0
    result: dict[str, dict] = {}
    arrays: dict[str, np.ndarray] = {}
    for mode in which:
        kw, paths, stream = (*MODES[mode], {})[:3]
        for path in paths:
            key = f"{mode}/{path}"
            try:
                if path == "compiled":
                    fast = out / f"{mode}.onnx"
                    flags = _compile_flags({k: v for k, v in kw.items() if k not in EAGER_ONLY}, names)
                    if main([str(export), "-o", str(fast), *flags]) != 0:
                        raise RuntimeError(f"compile {flags} failed")
                    rt = OrtDiT(fast, threads=1)
                    rt.self_pairs = [0, 0] if getattr(rt, "annsa", None) is not None else None
                    arrays[key] = _run(rt, frames, stream)
                    result[key] = {"replayed": list(rt.replayed), "merges": list(rt.cache.merges)
                                   if hasattr(rt, "cache") else None, "cross_pairs": list(rt.cross_pairs),
                                   "self_pairs": rt.self_pairs}
                elif path == "eager":
                    rt = FastARDiT(build(PRESETS["tiny"], seed=0), modes.settings(**_settings_kw(kw, names)))
                    arrays[key] = _run(rt, frames, stream)
                    result[key] = {"layers": rt.layer_summary()}
                else:
                    from fastcar_compile.torch import apply_dit

                    rt = apply_dit(build(PRESETS["tiny"], seed=0), **_settings_kw(kw, names))
                    arrays[key] = _run(rt, frames, stream)
                    result[key] = {"stats": rt.stats}
            except Exception as exc:  # noqa: BLE001 - recorded; the comparison reports it
                result[key] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    np.savez(out / "latents.npz", **{k.replace("/", "__"): v for k, v in arrays.items()})
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))


# ------------------------------------------------------------------------------------------------ comparison
def _close(a, b) -> bool:
    """Counters equal; ratios (floats) equal to float noise."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-9 * max(1.0, abs(a))
    return a == b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="python of the reference checkout's venv")
    ap.add_argument("--new", required=True, help="python of the checkout under test")
    ap.add_argument("--frames", type=int, default=12)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", type=Path, default=Path("dit-equivalence"))
    ap.add_argument("--tol", type=float, default=0.0, help="largest latent difference accepted (default 0: equal)")
    ap.add_argument("--worker", nargs=2, metavar=("OUT", "FRAMES"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(Path(a.worker[0]), int(a.worker[1]), a.modes.split(","))
        return 0
    for side, py in (("old", a.old), ("new", a.new)):
        (a.out / side).mkdir(parents=True, exist_ok=True)
        with open(a.out / side / "log.txt", "w") as log:  # the compiles' reports
            subprocess.run([py, __file__, "--old", a.old, "--new", a.new, "--modes", a.modes,
                            "--worker", str(a.out / side), str(a.frames)], check=True, stdout=log)
    res = {s: json.loads((a.out / s / "result.json").read_text()) for s in ("old", "new")}
    lat = {s: np.load(a.out / s / "latents.npz") for s in ("old", "new")}
    worst, failed = 0.0, []
    for key in res["old"]:
        o, n = res["old"][key], res["new"].get(key, {"error": "not run"})
        if "error" in o or "error" in n:
            both = "error" in o and "error" in n
            print(f"{key:40} {'both refuse' if both else 'ONE SIDE FAILS'}: old {o.get('error')}, new {n.get('error')}")
            if not both:
                failed.append(key)
            continue
        x, y = lat["old"][key.replace("/", "__")], lat["new"][key.replace("/", "__")]
        d = float(np.abs(x - y).max())
        same = _close(o, n)
        worst = max(worst, d)
        print(f"{key:40} latents {d:.1e}, counters {'=' if same else 'DIFFER'}"
              + ("" if same else f" (old {json.dumps(o)[:200]} new {json.dumps(n)[:200]})"), flush=True)
        if d > a.tol or not same:
            failed.append(key)
    print(f"largest difference {worst:.1e}; " + (f"DIFFER: {', '.join(failed)}" if failed else "all equal"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
