"""Per-layer compressed-KV settings (--kv-layer LAYERS:SETTINGS): each layer behaves as the single-setting model
with that layer's setting, budget >= context in every layer (with different budgets) equals the original export,
and a bad spec is one line with exit 2."""

from __future__ import annotations

import json

import numpy as np
import onnx
import ort_driver
import pytest
import zoo
from session_driver import assert_cli_refuses, run_session

from fastcar_compile.cli import main
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.passes.context import CompileOptions

WINDOW = dict(kv_budget=10, kv_sinks=2, kv_window=5, kv_eviction="oldest")
WINDOW_SPEC = "budget=10,sinks=2,window=5,eviction=oldest"


def _inputs(seed: int, steps: int):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, zoo.VOCAB, (2, 6))
    mask, _ = ort_driver.left_pad_masks([0, 3], 6)
    return prompt, mask, [rng.integers(0, zoo.VOCAB, (2, 3 if k == 4 else 1)) for k in range(steps)]


def _run(path, prompt, mask, steps):
    """Logits per step and the final state arrays."""
    from fastcar_compile.runtime import FastCarSession

    run = run_session(FastCarSession(path), prompt, mask, steps)
    return run.logits, run.arrays


def test_each_layer_is_its_single_setting_model(zoo_model, fc_compile, tmp_path):
    """Layer 0 windowed (evicting: 10 slots, ~40 tokens), layer 1 uncompressed: layer 0's slots equal those of the
    model windowed everywhere (same input, same setting); layer 1 uncompressed gives the logits of the model whose
    layer 1 has a budget above the context (which equals the export, test_kv_compress); layer 1 grows."""
    src = zoo_model("llama", "dynamo20")
    paths = {k: tmp_path / f"{k}.onnx" for k in ("mixed", "window", "wide1")}
    common = dict(frame_tokens=4, threshold=float("inf"))
    fc_compile(str(src), output=str(paths["mixed"]), kv_layers=[f"0:{WINDOW_SPEC}", "1:off"], **common)
    fc_compile(str(src), output=str(paths["window"]), **WINDOW, **common)
    fc_compile(str(src), output=str(paths["wide1"]), kv_layers=[f"0:{WINDOW_SPEC}", "1:budget=64,window=4"], **common)
    prompt, mask, steps = _inputs(3, 30)
    got, st = _run(paths["mixed"], prompt, mask, steps)
    _, st_w = _run(paths["window"], prompt, mask, steps)
    want, st_wide = _run(paths["wide1"], prompt, mask, steps)
    for name in ("past_key_values.0.key", "past_key_values.0.value", "past_kv_slots.0"):
        assert st[name].shape == st_w[name].shape and np.abs(st[name] - st_w[name]).max() <= 1e-5, name
    assert st["past_key_values.0.key"].shape[2] == 10 and "past_kv_slots.1" not in st
    tokens = 6 + sum(s.shape[1] for s in steps)
    assert st["past_key_values.1.key"].shape[2] == tokens  # uncompressed: one row per token
    real = mask.astype(bool)
    assert np.abs(got[0] - want[0])[real].max() <= 1e-4
    assert max(np.abs(a - b).max() for a, b in zip(got[1:], want[1:], strict=True)) <= 1e-4
    # and layer 0 did evict: the windowed layer changes the logits against the export
    dense = ort_driver.decode(src, [prompt, *steps], pad=[0, 3]).logits
    assert np.abs(got[-1] - dense[-1]).max() > 1e-3
    meta = json.loads({p.key: p.value for p in onnx.load(str(paths["mixed"]), load_external_data=False)
                       .metadata_props}["fastcar.kv_compress"])
    assert meta["layers"] == [0] and meta["budget"] == 10 and meta["window"] == 5


def test_budgets_above_context_everywhere_equal_the_export(zoo_model, fc_compile, tmp_path):
    """Two layers, two different budgets >= the video (and sinks/window/TempCache-free settings): per-layer
    capacities in the session, `per_layer` metadata, logits equal the original export within 1e-4."""
    from fastcar_compile.runtime import FastCarSession

    src = zoo_model("llama", "dynamo20")
    comp = tmp_path / "comp.onnx"
    fc_compile(str(src), output=str(comp), frame_tokens=4, threshold=float("inf"),
               kv_layers=["0:budget=64,sinks=2,window=8,eviction=oldest", "1:budget=80,window=4"])
    prompt, mask, steps = _inputs(4, 30)
    got, st = _run(comp, prompt, mask, steps)
    want = ort_driver.decode(src, [prompt, *steps], pad=[0, 3]).logits
    real = mask.astype(bool)
    assert np.abs(got[0] - want[0])[real].max() <= 1e-4
    for k in range(1, len(want)):
        assert np.abs(got[k] - want[k]).max() <= 1e-4, f"step {k}"
    assert st["past_key_values.0.key"].shape == (2, 2, 64, 16) and st["past_key_values.1.value"].shape == (2, 2, 80, 16)
    fc = FastCarSession(comp).fastcar
    settings = fc.kv_layer_settings()
    assert (settings[0]["budget"], settings[0]["window"], settings[1]["budget"], settings[1]["window"]) == (64, 8, 80, 4)
    assert "budget" not in fc.kv_compress  # no shared top-level setting that an old runtime would apply to all


def test_old_single_setting_metadata_reads_per_layer():
    """kv_compress written by older compilers (one flat setting + layers) reads as that setting per layer."""
    from fastcar_compile.core.contract import FastCarMetadata

    flat = {"budget": 12, "sinks": 1, "window": 3, "tempcache_sim": None, "layers": [0, 2], "diagnostics_tokens": None}
    meta = FastCarMetadata("0", 4, 0.0, False, [0], 3, "rope", 0, 8, 2, 2, 4, [], [], False, kv_compress=flat)
    assert meta.kv_layer_settings() == {n: {"budget": 12, "sinks": 1, "window": 3, "tempcache_sim": None}
                                        for n in (0, 2)}


@pytest.mark.parametrize("per_layer", [False, True])
def test_old_frame_len_key_reads_as_frame_tokens(per_layer):
    """Models compiled before the rename recorded tokens per frame as `frame_len` in kv_compress; they read as
    this version's `frame_tokens`, the name the settings and KVCompressConfig use."""
    from fastcar_compile.core.contract import FastCarMetadata
    from fastcar_compile.fastar.config import KVCompressConfig

    old = {"budget": 12, "sinks": 1, "window": 4, "frame_len": 4, "video_start": 0}
    kvc = {"layers": [0], "diagnostics_tokens": None, **({"per_layer": {"0": old}} if per_layer else old)}
    meta = FastCarMetadata("0", 4, 0.0, False, [0], 1, "rope", 0, 8, 2, 2, 4, [], [], False, kv_compress=kvc)
    settings = meta.kv_layer_settings()[0]
    assert "frame_len" not in settings and KVCompressConfig(**settings).frame_tokens == 4


@pytest.mark.parametrize("spec,msg", [
    ("0", "no settings"),
    ("x:budget=8", "cannot read layers"),
    ("0:budget=8,foo=1", "cannot read 'foo=1'"),
    ("0:sinks=2", "needs budget=C"),
    ("0:budget=4,sinks=2,window=2", "must exceed sinks \\+ window"),
    ("0:budget=8,tempcache=2", "cosine in \\[-1, 1\\]"),
    ("0:budget=8,sparse=lsh8", "lsh:BITSxTABLES"),
    ("0:budget=8,eviction=lru", "eviction must be one of"),
])
def test_bad_kv_layer_specs_are_one_line(spec, msg):
    with pytest.raises(FastCarError, match=msg):
        CompileOptions(frame_tokens=4, kv_layers=(spec,))


def test_bad_kv_layer_cli_exit_2(zoo_model, tmp_path, capsys):
    """On the command line: a bad setting, a layer given twice, a layer the model lacks: one line, exit 2."""
    src = str(zoo_model("llama", "dynamo20"))
    for extra, msg in ((["--kv-layer", "0:budget=ten"], "must be integers"),
                       (["--kv-layer", "0:off", "--kv-layer", "0-1:budget=8"], "layer 0 already has settings"),
                       (["--kv-layer", "5:budget=8,window=4"], "names layer 5")):
        assert_cli_refuses(main, [src, "-o", str(tmp_path / "o.onnx"), "--frame-tokens", "4", *extra], msg,
                           tmp_path / "o.onnx", capsys)


def test_layers_without_an_entry_take_the_global_settings():
    """--kv-layer overrides only the layers it names; the rest keep --kv-budget's setting ('off' = uncompressed)."""
    opts = CompileOptions(frame_tokens=4, kv_budget=20, kv_window=4, kv_layers=("0:off", "2-3:budget=9,window=4,tempcache=0.9"))
    assert opts.kv_config(0) is None
    assert (opts.kv_config(1).budget, opts.kv_config(1).window, opts.kv_config(1).tempcache_sim) == (20, 4, None)
    assert (opts.kv_config(3).budget, opts.kv_config(3).window, opts.kv_config(3).tempcache_sim) == (9, 4, 0.9)
    # parsed once at construction: every read hands back the same settings objects
    assert opts.kv_config(1) is opts.kv_compress and opts.kv_config(2) is opts.kv_config(3)
    with pytest.raises(FastCarError, match="--fused-attention fastcar"):
        CompileOptions(frame_tokens=4, fused_attention="gqa", kv_layers=("0:budget=8",))
