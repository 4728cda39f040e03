"""Compressed-KV settings that would break FastCar are refused where the options are validated (the API and the
CLI alike): a window shorter than a frame on a FastCar layer (the gate's aligned key can be evicted and then
reads as zeros) and a compressed cache with `--fused-attention off` (the op holding it would be left out)."""

from __future__ import annotations

import numpy as np
import pytest
from session_driver import assert_cli_refuses

import fastcar_compile
from fastcar_compile.cli import main
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.fastar.cache import HeadCache
from fastcar_compile.fastar.config import KVCompressConfig
from fastcar_compile.passes.context import CompileOptions


def _aligned_lost(window: int, L: int = 6, budget: int = 12, eviction: str = "mass") -> int:
    """Steps of a 60-token video whose key one frame back (p - L) was no longer resident when token p came, in
    the NumPy reference cache (fastar.cache.HeadCache) under random keys and attention."""
    rng = np.random.default_rng(window)
    cfg = KVCompressConfig(budget=budget, sinks=1, window=window, eviction=eviction, frame_tokens=L, video_start=0)
    cache, lost, d = HeadCache(cfg, 8, 60, theta=None), 0, 8
    for p in range(60):
        lost += p >= L and cache.token_slot[p - L] < 0
        cache.append(rng.normal(size=d), rng.normal(size=d))
        cache.attend(rng.normal(size=d), cache.select(rng.normal(size=d)))
    return lost


def test_the_rule_on_the_reference_cache():
    """Why the rule is window >= L: with it the aligned key is always resident, whatever the eviction policy;
    with a shorter window mass eviction loses it, and so does oldest eviction once the budget beyond the sinks
    holds less than a frame (the window is the one setting that guarantees it)."""
    assert _aligned_lost(6) == _aligned_lost(10) == 0
    assert _aligned_lost(5) > 0 and _aligned_lost(0) > 0
    assert _aligned_lost(6, budget=8, eviction="oldest") == 0
    assert _aligned_lost(0, budget=6, eviction="oldest") > 0


@pytest.mark.parametrize("kw,msg", [
    (dict(kv_budget=200, kv_window=60), "--kv-window 60: window 60 is shorter than a frame (96 tokens"),
    (dict(kv_budget=200, kv_window=60, layers="1-2"), "--kv-window 60"),
    (dict(kv_layers=("1-3:budget=400,tempcache=0.9",)), "--kv-layer '1-3:budget=400,tempcache=0.9': window 0"),
    (dict(kv_budget=200, kv_window=96, kv_layers=("2:budget=300,window=95",)), "add window=96"),
    (dict(kv_budget=200, kv_window=96, fused_attention="off"), "--fused-attention off leaves out"),
    (dict(kv_budget=200, kv_window=96, fused_attention=None), "--fused-attention off leaves out"),
    (dict(kv_layers=("0:budget=200,window=96",), fused_attention="off"), "--fused-attention off leaves out"),
])
def test_options_refuse(kw, msg):
    with pytest.raises(FastCarError) as err:
        CompileOptions(frame_tokens=96, **kw)
    assert msg in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kw", [
    dict(kv_budget=200, kv_window=96),  # the window covers a frame
    dict(kv_budget=200, kv_window=60, kv_layers=("0-3:budget=200,window=96",), layers="0-3"),  # global reaches none
    dict(kv_layers=("0:budget=200",), layers="1-3"),  # the short-window layer is not rewritten
    dict(kv_budget=200, kv_window=60, kv_layers=("0:off",), layers="0"),
])
def test_options_accept(kw):
    CompileOptions(frame_tokens=96, **kw)


def test_cli_and_api_refuse_without_writing(zoo_model, tmp_path, capsys):
    """Exit 2, one stderr line naming the options, no output; the Python API raises the same and writes nothing."""
    src = str(zoo_model("llama", "dynamo20"))
    out = tmp_path / "o.onnx"
    for extra, msg in ((["--kv-budget", "200", "--kv-window", "60"], "--kv-window 60: window 60 is shorter than a "
                                                                      "frame (96 tokens, --frame-tokens)"),
                       (["--kv-layer", "0-1:budget=200"], "--kv-layer '0-1:budget=200': window 0"),
                       (["--kv-budget", "200", "--kv-window", "96", "--fused-attention", "off"],
                        "which --fused-attention off leaves out; use --fused-attention fastcar")):
        assert_cli_refuses(main, [src, "-o", str(out), "--frame-tokens", "96", *extra], msg, out, capsys)
    with pytest.raises(FastCarError, match="--kv-window 60: window 60 is shorter than a frame"):
        fastcar_compile.compile(src, str(out), frame_tokens=96, kv_budget=200, kv_window=60)
    with pytest.raises(FastCarError, match="--fused-attention off leaves out"):
        fastcar_compile.compile(src, str(out), frame_tokens=96, kv_budget=200, kv_window=96, fused_attention=None)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []
