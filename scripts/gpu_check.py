"""The GPU checks of `--provider cuda` and the PyTorch DiT path, for a machine with an NVIDIA GPU, onnxruntime-gpu and a
CUDA build of torch (not run in CI: there is no GPU there; tests/test_cuda_target.py checks the op set against the
CUDA provider's registry and the tokens against the CPU compile on the CPU).

1. Placement: the bundled decoder compiled with `--provider cuda` (dense, and FastCar at taus calibrated for 50% and
   80% replay) loads with the CPU fallback disabled (`session.disable_cpu_ep_fallback`): session creation fails
   unless every node is placed on the CUDA provider.
2. Tokens: each GPU run's greedy tokens equal the CPU compile's on the CPU (native kernels).
3. Speed: FastCar's replay speed-up at 50% / 80% against the plain (dense) model on the GPU, the three sessions
   interleaved prompt by prompt, medians of per-token decode times.
4. PyTorch: `apply_dit` on the tiny DiT moved to CUDA rolls out as on the CPU (within 1e-3).

    python scripts/gpu_check.py --out gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--frames", type=int, default=8)
    a = ap.parse_args()
    import onnxruntime as ort

    from fastcar_compile.demo.export import ONNX
    from fastcar_compile.runtime import FastCarSession

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print("no CUDAExecutionProvider: install onnxruntime-gpu on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    report: dict = {"device": ort.get_device(), "providers": ort.get_available_providers()}
    rng = np.random.default_rng(0)
    calib, held = rng.integers(0, 100, (8, 6)), rng.integers(0, 100, (a.prompts, 6))
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        np.save(t / "calib.npy", calib)
        fc = [sys.executable, "-m", "fastcar_compile", str(ONNX), "--frame-tokens", "64"]
        models = {"dense": [], "fastcar50": ["--calibrate-replay", "0.5"], "fastcar80": ["--calibrate-replay", "0.8"]}
        for name, extra in models.items():
            for target in ("cpu", "cuda"):
                if not extra:  # the plain model: the export itself (standard ops only)
                    (t / f"{name}.{target}.onnx").write_bytes(Path(ONNX).read_bytes())
                    continue
                subprocess.run([*fc, "-o", str(t / f"{name}.{target}.onnx"), *extra, "--calib-data",
                                str(t / "calib.npy"), "--calib-frames", "3", "--provider", target],
                               check=True, capture_output=True)
        so = ort.SessionOptions()
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")  # any CPU-placed node: load fails
        gpu, cpu = {}, {}
        for name in models:
            ft = {"frame_tokens": 64} if name == "dense" else {}
            gpu[name] = FastCarSession(t / f"{name}.cuda.onnx", providers=["CUDAExecutionProvider"],
                                       session_options=so, native=False, **ft)
            cpu[name] = FastCarSession(t / f"{name}.cpu.onnx", threads=2, **ft)
        report["all_nodes_on_cuda"] = True  # the sessions above loaded with the CPU fallback disabled
        ms = {name: [] for name in models}
        equal = {name: True for name in models}
        replay = {}
        for i in range(a.prompts):
            for name in models:
                t0 = time.perf_counter()
                g = gpu[name].generate(held[i:i + 1], num_frames=a.frames, progress=False)
                ms[name].append(1000 * (time.perf_counter() - t0) / g.tokens.size)
                c = cpu[name].generate(held[i:i + 1], num_frames=a.frames, progress=False)
                equal[name] &= bool((g.tokens == c.tokens).all())
                replay[name] = g.stats.replay_ratio
        med = {name: float(np.median(v)) for name, v in ms.items()}
        report["decoder"] = {name: {"ms_per_token": med[name], "x_dense": med["dense"] / med[name],
                                    "replay_ratio": replay[name], "tokens_equal_cpu": equal[name]} for name in models}

    from fastcar_compile.dit.config import PRESETS
    from fastcar_compile.dit.model import build
    from fastcar_compile.dit.stream import StreamSettings, rollout
    from fastcar_compile.torch import apply_dit

    model = build(PRESETS["tiny"])
    settings = StreamSettings(frames=8, seed=1)
    on_cpu = np.concatenate([r.frames for r in rollout(apply_dit(model, threshold=0.0), settings)], 1)
    on_gpu = np.concatenate([r.frames for r in rollout(apply_dit(model.to("cuda"), threshold=0.0), settings)], 1)
    report["torch_dit_cuda_max_abs_diff"] = float(np.abs(on_gpu - on_cpu).max())
    report["torch_dit_cuda_ok"] = report["torch_dit_cuda_max_abs_diff"] < 1e-3
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    ok = report["all_nodes_on_cuda"] and all(r["tokens_equal_cpu"] for r in report["decoder"].values()) \
        and report["torch_dit_cuda_ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
