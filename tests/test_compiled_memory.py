"""A compiled model costs about as much process memory as the dense model it came from.

ONNX Runtime prepacks each MatMul weight once per consuming node and frees the plain copy only when every
consumer prepacked it; a consumer two If levels below the weight's graph never finds it, and an inline weight
read by an If branch is kept besides its prepacked copy. Compiled models held every MLP weight twice (+288 MiB
on the hidden-1024 LLaMA, docs/memory.md) until BranchPass ran each MLP once in one If level
(`shared_mlp`) and large outputs were written with external data. Measured in fresh child processes: inside
pytest other tests' allocations move VmRSS by MiBs.
"""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import genai_zoo
import numpy as np
import onnx
import ort_driver
import pytest
import test_pass_reference as tpr
import zoo

# A genai graph big enough for its MLP weights to stand out of VmRSS noise: 2 layers x 3 x 512 x 4096 fp32
# = 48 MiB of MLP weights, ~55 MiB in all; the builder makes it in seconds.
HIDDEN, INTER, LAYERS = 512, 4096, 2
MLP_BYTES = LAYERS * 3 * HIDDEN * INTER * 4

_CHILD = """
import json, sys
from pathlib import Path
import numpy as np
from fastcar_compile.runtime import FastCarSession

def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

before = rss()
sess = FastCarSession(sys.argv[1], threads=1)
loaded = rss()
out = sess.step(sess.new_state(1), np.arange(3, 11)[None, :])
for _ in range(3):
    out = sess.step(out.state, out.logits[:, -1].argmax(-1)[:, None], check=False)
print(json.dumps({"loaded": loaded - before, "decoded": rss() - before}))
"""


def _rss(path: Path) -> dict[str, int]:
    run = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _genai_graph(root: Path) -> Path:
    """onnxruntime-genai's fp32 cpu graph of the zoo's LLaMA at the sizes above (built once per zoo dir)."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install '.[genai]')")
    sizes = {"hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS}
    return genai_zoo.build("llama", "fp32", root, sizes) / "model.onnx"


def test_compiled_model_holds_its_weights_once(zoo_dir, fc_compile, tmp_path):
    """VmRSS after load and after a few decode steps: compiled - dense < 1/4 of the MLP weights, for a genai
    graph (external data, path (a)) and the same graph saved with inline weights (as dynamo exports are,
    path (b)). Before the fix the compiled ones held +1.0x the MLP weights (48 MiB here): +1.0x / +1.1x."""
    dense = _genai_graph(zoo_dir)
    inline = tmp_path / "inline" / "model.onnx"
    inline.parent.mkdir()
    onnx.save(onnx.load(str(dense)), str(inline))
    base = _rss(dense)
    for name, src in (("external", dense), ("inline", inline)):
        out = tmp_path / f"fast-{name}" / "fast.onnx"
        fc_compile(str(src), output=str(out), frame_tokens=4, threshold=math.inf, genai=False)
        got = _rss(out)
        for stage in ("loaded", "decoded"):
            extra = got[stage] - base[stage]
            assert extra < MLP_BYTES / 4, (
                f"{name} input: the compiled model's process holds {extra / 2**20:.1f} MiB more than the dense "
                f"one's {stage} ({base[stage] / 2**20:.1f} MiB); MLP weights are {MLP_BYTES / 2**20:.0f} MiB")


def test_shared_mlp_layout_equals_the_nested_one(zoo_model, fc_compile, tmp_path):
    """The one-MLP layout computes what the older nested layout (a second MLP copy for compacted rows) did:
    same logits (1e-5) and decisions over a batch-2 decode whose steps mix computing and replaying rows."""
    src = zoo_model("llama", "dynamo20")
    steps = [np.random.default_rng(1).integers(0, zoo.VOCAB, (2, 4))]
    steps += [np.random.default_rng(2 + k).integers(0, zoo.VOCAB, (2, 1)) for k in range(8)]
    steps.append(np.random.default_rng(20).integers(0, zoo.VOCAB, (2, 3)))
    probe = tmp_path / "probe.onnx"
    fc_compile(str(src), output=str(probe), frame_tokens=4, threshold=math.inf, emit_diagnostics=True)
    tas = np.concatenate([t.ravel() for k, t in enumerate(ort_driver.decode(probe, steps).tas[0]) if k >= 1])
    tau = float(np.median(tas[np.isfinite(tas)]))
    runs = {}
    for shared in (True, False):
        out = tmp_path / f"fast-{shared}.onnx"
        fc_compile(str(src), output=str(out), frame_tokens=4, threshold=tau, emit_diagnostics=True, shared_mlp=shared)
        runs[shared] = ort_driver.decode(out, steps)
    masks = [m for ms in runs[True].replay_mask.values() for m in ms]
    assert any(m.any() and not m.all() for m in masks), "no step mixed computing and replaying rows"
    assert any(not m.any() for m in masks), "no step where every row computed"
    assert any(m.all() for m in masks), "no step where every row replayed (the branch that skips the MLP)"
    for k, (a, b) in enumerate(zip(runs[True].logits, runs[False].logits, strict=True)):
        assert np.abs(a - b).max() <= 1e-5, f"step {k}: logits differ by {np.abs(a - b).max():.3g}"
    for layer, ms in runs[True].replay_mask.items():
        for a, b in zip(ms, runs[False].replay_mask[layer], strict=True):
            np.testing.assert_array_equal(a, b)


def test_nested_layout_matches_eager_reference(zoo_model, fc_compile, tmp_path):
    """The nested layout (shared_mlp=False), which the test above compares the shared one with, is itself checked
    against the eager PyTorch reference: logits, TAS, decisions and final state (a multi-token chunk, padding)."""
    tpr.check_against_reference(zoo_model, functools.partial(fc_compile, shared_mlp=False), tmp_path,
                                tpr.DEFAULT_CASES[0])
