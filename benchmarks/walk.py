"""The README's five commands on the bundled video model written as a transformers folder: export,
inspect, compile with tau calibrated for 50% replay, eval against the input model and tau=+inf in one run,
report. Writes the eval.json of the run, with each command's seconds, to --out.

    python benchmarks/walk.py --out walk.json            # 64 calibration + 16 held-out prompts, 4 frames
    python benchmarks/walk.py --quick --out walk.json    # 16 + 4 prompts, 2 frames
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 + 4 prompts, 2 frames")
    ap.add_argument("--out", type=Path, default=Path("walk.json"))
    a = ap.parse_args(argv)
    calib, heldout, frames = (16, 4, 2) if a.quick else (64, 16, 4)
    cli = [sys.executable, "-m", "fastcar_compile"]
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="walk-") as tmp:
        d = Path(tmp)
        steps = {
            "model": [sys.executable, str(ROOT / "scripts" / "demo_as_user_model.py"), "--out", str(d / "my-model"),
                      "--calib", str(calib), "--heldout", str(heldout)],
            "export": [*cli, "export", str(d / "my-model"), "-o", str(d / "model.onnx")],
            "inspect": [*cli, str(d / "model.onnx"), "--inspect"],
            "compile": [*cli, str(d / "model.onnx"), "-o", str(d / "fast.onnx"), "--frame-tokens", "64",
                        "--calibrate-replay", "0.5", "--calib-data", str(d / "calib.npy"),
                        "--calib-frames", str(frames), "--given-video-tokens", "64"],
            "eval": [*cli, "eval", "--model", str(d / "fast.onnx"), "--dense", str(d / "model.onnx"), "--prompts",
                     str(d / "heldout.npy"), "--frames", str(frames), "--given-video-tokens", "64",
                     "--frame-shape", "8x8", "--threads", "1", "--out", str(d / "run")],
            "report": [*cli, "report", str(d / "run" / "fast.json"), str(d / "run" / "dense.json"),
                       str(d / "run" / "fast_inf.json"), "--frame-shape", "8x8", "--out-dir", str(d / "run")],
        }
        for name, cmd in steps.items():
            t0 = time.perf_counter()
            if subprocess.run(cmd, cwd=d, check=False).returncode != 0:
                print(f"error: the {name} step failed (its message is above)", file=sys.stderr)
                return 1
            seconds[name] = time.perf_counter() - t0
        result = json.loads((d / "run" / "eval.json").read_text())
    result.update(calib_prompts=calib, heldout_prompts=heldout, seconds=seconds)
    result.pop("files", None)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
