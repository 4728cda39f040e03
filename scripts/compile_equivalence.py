"""Two compilers, the same exports: equal logits, decisions and state, and the same nodes?

    python scripts/compile_equivalence.py --old OLD/.venv/bin/fastcar-compile --new .venv/bin/fastcar-compile \
        --zoo $FASTCAR_ZOO_DIR [--models llama-dynamo20,genai-llama] [--options default,kv]

For a refactoring of the compiler (e.g. an older checkout of the repository with its own venv as --old): every
export of the zoo folder (tests/zoo.py, tests/genai_zoo.py) found there is compiled by both with each option set;
both compiled models decode the same prompt (two rows, one left-padded) and 16 single-token steps with the native
kernels, at tau = the median TAS of the old model (mixed decisions) and at tau = -inf (every eligible MLP
replays); compressed-KV models run in FastCarSession, which starts their slot state. Per case: the largest
logit and state difference, whether every replay decision is equal, and the main graph's node count (op types
compared). Exit 1 when a difference exceeds 1e-5, a decision or an op count differs, or only one side compiles.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' drivers
import ort_driver  # noqa: E402
import session_driver  # noqa: E402

EXPORTS = {"llama-dynamo20": "llama-dynamo20.onnx", "qwen2-dynamo20": "qwen2-dynamo20.onnx",
           "gpt2-dynamo20": "gpt2-dynamo20.onnx", "phi3-ortfusions20": "phi3-ortfusions20.onnx",
           "mistral-torchscript17": "mistral-torchscript17.onnx", "neox-torchscript17": "neox-torchscript17.onnx",
           "genai-llama": "genai-llama-fp32/model.onnx", "genai-qwen3": "genai-qwen3-fp32/model.onnx"}
OPTIONS = {"default": [], "raw": ["--tas-query", "raw"], "gqa": ["--fused-attention", "gqa"],
           "kv": ["--kv-budget", "16", "--kv-sinks", "2", "--kv-window", "8"],
           "kvtemp": ["--kv-budget", "12", "--kv-sinks", "1", "--kv-window", "4", "--tempcache", "0.5"],
           "perlayer": ["--per-layer-threshold", "--threshold", "0.3,0.6"], "nofusions": ["--fusions", "off"],
           "nopack": ["--pack-qkv", "off"]}
GENAI_HEAD_DIM = 16  # the zoo's genai graphs leave the head size symbolic
TOL = 1e-5


def _compile(exe: str, src: Path, out: Path, frame_tokens: int, flags: list[str]) -> Path | str:
    out.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([exe, str(src), "-o", str(out), "--frame-tokens", str(frame_tokens), "--emit-diagnostics",
                        *flags], capture_output=True, text=True)
    return out if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


def _compare_ort(paths: dict[str, Path], steps, frame_tokens: int, head_dim: int | None) -> tuple[float, bool, str]:
    sess = {s: ort_driver.make_session(p, native=True, inputs=frozenset({"fastcar_threshold"}))
            for s, p in paths.items()}
    shape = next(i.shape for i in sess["old"].get_inputs() if i.name == "fastcar_threshold")
    kw = dict(pad=[0, 2], frame_tokens=frame_tokens, head_dim=head_dim)
    probe = ort_driver.decode(sess["old"], steps, threshold=np.full(shape, np.inf, np.float32), **kw)
    tas = np.concatenate([t.reshape(-1) for n in probe.tas for t in probe.tas[n][1:]])
    worst, same, text = 0.0, True, []
    for name, tau in (("median", float(np.median(tas[np.isfinite(tas)]))), ("-inf", -np.inf)):
        th = np.full(shape, tau, np.float32)
        a, b = (ort_driver.decode(sess[s], steps, threshold=th, **kw) for s in ("old", "new"))
        d = max(float(np.abs(x - y).max()) for x, y in zip(a.logits, b.logits, strict=True))
        st = max((float(np.abs(a.final_state[k] - b.final_state[k]).max()) for k in a.final_state), default=0.0)
        dec = all(np.array_equal(x, y) for n in a.replay_mask
                  for x, y in zip(a.replay_mask[n], b.replay_mask[n], strict=True))
        replayed = sum(int(x.sum()) for n in a.replay_mask for x in a.replay_mask[n])
        total = sum(x.size for n in a.replay_mask for x in a.replay_mask[n])
        worst, same = max(worst, d, st), same and dec
        text.append(f"tau {name}: logits {d:.0e} state {st:.0e} decisions {'=' if dec else 'DIFFER'} "
                    f"({replayed}/{total} replayed)")
    return worst, same, "; ".join(text)


def _compare_session(paths: dict[str, Path], steps) -> tuple[float, bool, str]:
    from fastcar_compile.runtime import FastCarSession

    mask = ort_driver.left_pad_masks([0, 2], steps[0].shape[1])[0]
    a, b = (session_driver.run_session(FastCarSession(str(paths[s])), steps[0], mask, steps[1:])
            for s in ("old", "new"))
    d = max(float(np.abs(x - y).max()) for x, y in zip(a.logits, b.logits, strict=True))
    st = max(float(np.abs(a.arrays[k] - b.arrays[k]).max()) for k in a.arrays)
    dec = all(np.array_equal(x, y) for x, y in zip(a.replay, b.replay, strict=True))
    return max(d, st), dec, f"FastCarSession: logits {d:.0e} state {st:.0e} decisions {'=' if dec else 'DIFFER'}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="fastcar-compile executable of the reference compiler")
    ap.add_argument("--new", required=True, help="fastcar-compile executable of the compiler under test")
    ap.add_argument("--zoo", type=Path, required=True, help="folder of zoo exports ($FASTCAR_ZOO_DIR)")
    ap.add_argument("--out", type=Path, default=Path("compile-equivalence"), help="where both compile to")
    ap.add_argument("--models", default=",".join(EXPORTS))
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--frame-tokens", type=int, default=4)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    steps = [rng.integers(0, 90, (2, 6))] + [rng.integers(0, 90, (2, 1)) for _ in range(4 * a.frame_tokens)]
    worst, failed = 0.0, []
    for model in a.models.split(","):
        src = a.zoo / EXPORTS[model]
        if not src.exists():
            print(f"{model:22} not in {a.zoo} (export it with tests/zoo.py or tests/genai_zoo.py)")
            continue
        for option in a.options.split(","):
            paths = {s: _compile(exe, src, a.out / s / f"{model}-{option}" / "fast.onnx", a.frame_tokens,
                                 OPTIONS[option]) for s, exe in (("old", a.old), ("new", a.new))}
            if not all(isinstance(p, Path) for p in paths.values()):
                both = not any(isinstance(p, Path) for p in paths.values())
                print(f"{model:22} {option:9} {'both refuse' if both else 'ONE SIDE REFUSES'}: {paths}"[:200])
                if not both:
                    failed.append(f"{model} {option}")
                continue
            ops = {s: collections.Counter(n.op_type for n in onnx.load(str(p), load_external_data=False).graph.node)
                   for s, p in paths.items()}
            compressed = option.startswith("kv")
            diff, same, text = (_compare_session(paths, steps) if compressed else
                                _compare_ort(paths, steps, a.frame_tokens,
                                             GENAI_HEAD_DIM if model.startswith("genai") else None))
            nodes = f"nodes {sum(ops['old'].values())} -> {sum(ops['new'].values())}"
            if ops["old"] != ops["new"]:
                nodes += f" (+{dict(ops['new'] - ops['old'])} -{dict(ops['old'] - ops['new'])})"
            print(f"{model:22} {option:9} {text}; {nodes}", flush=True)
            worst = max(worst, diff)
            if diff > TOL or not same or ops["old"] != ops["new"]:
                failed.append(f"{model} {option}")
    print(f"largest difference {worst:.1e}; " + (f"DIFFER: {', '.join(failed)}" if failed else "all equal"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
