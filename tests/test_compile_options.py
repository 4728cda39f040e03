"""Options declared once (fastcar_compile/core/options.py): the CLI flags, `compile`'s and `torch.apply`'s keywords,
their checks, the metadata and the option tables of docs/compile.md and docs/pytorch.md follow the declaration; a calibrated compile keeps every
option, each one alone (the declaration's list) and in combinations (its output equals a plain compile with the
same options and the calibrated tau: metadata, graph inputs/outputs and their defaults, ops, genai_config.json)."""

from __future__ import annotations

import collections
import inspect
import json
import re
import typing
from pathlib import Path

import numpy as np
import onnx
import pytest
import zoo

from fastcar_compile.cli import main
from fastcar_compile.core import options
from fastcar_compile.core.errors import FastCarError

ROOT = Path(__file__).resolve().parent.parent
# `fastcar-compile` flags that are not compile options: what to read and write, what to print, calibration, FPGA
COMMAND_FLAGS = {"-h", "--help", "-o", "--output", "--inspect", "--verbose", "-v", "--calibrate-replay",
                 "--calibrate-quality", "--calib-data", "--calib-frames", "--given-video-tokens", "--target", "--board",
                 "--board-file", "--batch", "--context", "--weights", "--dense", "--video-start"}

L = 4
# Non-default values of options given together (each option alone: test_calibrated_compile_keeps_each_option).
GROUPS = {
    "kv": ["--kv-budget", "16", "--kv-sinks", "2", "--kv-window", "8", "--kv-eviction", "oldest", "--tempcache",
           "0.9", "--sparse-attention", "lsh:4x2", "--prune-prompt", "0.1", "--kv-diagnostics", "64"],
    "kv-layer": ["--kv-layer", "0:budget=12,sinks=1,window=4,eviction=oldest", "--kv-layer", "1:off"],
    "gate": ["--tas-query", "raw", "--max-replay", "2", "--layers", "1", "--emit-diagnostics",
             "--required-video-inputs", "--rotary-positions", "4096", "--no-validate"],
    "off": ["--fused-attention", "off", "--fusions", "off"],
}


def _ops(graph: onnx.GraphProto, out: collections.Counter) -> collections.Counter:
    for node in graph.node:
        out[f"{node.domain}.{node.op_type}"] += 1
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _ops(attr.g, out)
    return out


def _signature(path: Path) -> dict:
    """What an option changes in a compiled model, for comparing two of them."""
    m = onnx.load(str(path), load_external_data=False)
    g = m.graph
    defaults = {i.name: onnx.numpy_helper.to_array(i).tolist() for i in g.initializer
                if i.name in {x.name for x in g.input} and not i.external_data}
    genai = path.parent / "genai_config.json"
    return {"metadata": {p.key: p.value for p in m.metadata_props},
            "inputs": [(x.name, str(x.type)) for x in g.input], "outputs": [(x.name, str(x.type)) for x in g.output],
            "defaults": defaults, "ops": _ops(g, collections.Counter()),
            "functions": sorted(f"{f.domain}.{f.name}" for f in m.functions),
            "genai": json.loads(genai.read_text()) if genai.exists() else None}


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    d = tmp_path_factory.mktemp("copts")
    np.save(d / "p.npy", np.random.default_rng(3).integers(0, zoo.VOCAB, (12, 4)))
    return d / "p.npy"


def _compare(src: Path, calib_data: Path, tmp_path: Path, args: list[str]) -> float:
    """Calibrated vs plain compile at the calibrated tau (returned), both with `args`: the same model."""
    cal, plain = tmp_path / "cal" / "fast.onnx", tmp_path / "plain" / "fast.onnx"
    cal.parent.mkdir()
    plain.parent.mkdir()
    assert main([str(src), "-o", str(cal), "--frame-tokens", str(L), "--calibrate-replay", "0.5",
                 "--calib-data", str(calib_data), *args]) == 0
    meta = {p.key: p.value for p in onnx.load(str(cal), load_external_data=False).metadata_props}
    tau = json.loads(meta["fastcar.threshold"])
    tau = tau[0] if isinstance(tau, list) else tau
    assert main([str(src), "-o", str(plain), "--frame-tokens", str(L), f"--threshold={tau!r}", *args]) == 0
    assert _signature(cal) == _signature(plain)
    return tau


@pytest.mark.parametrize("group", list(GROUPS))
def test_calibrated_compile_keeps_every_option(group, zoo_model, calib, tmp_path, capsys):
    _compare(zoo_model("llama", "dynamo20"), calib, tmp_path, GROUPS[group])


def test_calibrated_compile_keeps_genai(genai_model, calib, tmp_path, capsys):
    """The builder's graph beside its genai_config.json: genai files by default (--no-genai: the per-option test)."""
    _compare(genai_model("llama", "fp32") / "model.onnx", calib, tmp_path, [])


def _cli_flags() -> dict[str, str]:
    """flag -> dest of every `fastcar-compile` option."""
    from fastcar_compile.cli.compile import build_parser

    return {f: a.dest for a in build_parser()._actions for f in a.option_strings}


def test_cli_flags_are_the_declared_options_and_the_command_flags():
    flags = _cli_flags()
    declared = {o.flag for o in options.CLI_OPTIONS}
    renamed = {options.flag_of(old) for old in options.RENAMED}  # refused, naming the flag to use
    assert set(flags) - {"--no-genai"} - renamed == declared | COMMAND_FLAGS
    assert {flags[o.flag] for o in options.CLI_OPTIONS} == {o.name for o in options.CLI_OPTIONS}
    assert all(o.help for o in options.OPTIONS)


# Options the calibration sets itself (tau) or every compile is given (L), and those of DiT step graphs, which a
# decoder refuses (tests/test_dit_annca_compile.py): not compared one by one.
CALIBRATION_SETS = {"frame_tokens", "threshold", *options.DIT_ONLY}
# A non-default value for an option whose value the declaration cannot suggest (a grammar, a size that must fit
# the others, a value that depends on the input model).
VALUES = {"layers": ["--layers", "1"], "fused_attention": ["--fused-attention", "gqa"],
          "kv_budget": ["--kv-budget", "16", "--kv-window", "8"], "kv_window": ["--kv-window", "12"],
          "kv_diagnostics": ["--kv-diagnostics", "64"], "sparse_attention": ["--sparse-attention", "lsh:4x2"],
          "kv_layers": ["--kv-layer", "0:budget=12,sinks=1,window=4,eviction=oldest", "--kv-layer", "1:off"],
          "genai": ["--no-genai"], "video_start": ["--video-start", "0"]}
# What an option needs to act on, given before it: --native-attention acts on GroupQueryAttention nodes, the
# compressed-cache settings on a cache (a budget, and a window of at least a frame on FastCar layers).
KV_CACHE = ["--kv-budget", "16", "--kv-window", "8"]
NEEDS = {"native_attention": ["--fused-attention", "gqa"]}
OWN_CACHE = {"kv_budget", "kv_layers"}  # compressed-cache options that set the cache themselves
GENAI_INPUT = {"genai"}  # compiled from the builder's graph, which sits beside genai_config.json
NO_EFFECT_ON_OUTPUT = {"validate"}  # --no-validate skips a check of the written model, which it leaves as it is


def _non_default(o: options.Option) -> tuple[list[str], list[str]]:
    """(what option `o` needs to act, command-line arguments giving it a valid non-default value): the value
    from its declaration where the form says it (a switch, on|off, a choice, a number next to its default or
    inside its bounds), else from VALUES."""
    if o.name in VALUES:
        args = VALUES[o.name]
    elif o.cli in (options.SWITCH, options.NEGATE):
        args = [o.flag]
    elif o.cli == options.ON_OFF:
        args = [o.flag, "off" if o.default else "on"]
    elif o.choices is not None:
        args = [o.flag, next(c for c in o.choices if c != o.default)]
    elif isinstance(o.default, int) and o.hi is not None and o.default < o.hi:
        args = [o.flag, str(o.default + 1)]
    elif o.default is None and o.lo is not None and o.hi is not None and float in typing.get_args(o.type):
        args = [o.flag, repr((o.lo + o.hi) / 2)]
    else:
        pytest.fail(f"{o.flag}: give it a non-default value in VALUES")
    needs = KV_CACHE if o.group == options.KV_GROUP and o.name not in OWN_CACHE else NEEDS.get(o.name, [])
    return needs, args


@pytest.mark.parametrize("name", [o.name for o in options.CLI_OPTIONS if o.name not in CALIBRATION_SETS])
def test_calibrated_compile_keeps_each_option(name, zoo_model, genai_model, calib, tmp_path, capsys):
    """Every option the CLI has, one at a time (the list is the declaration's: a new option gets a case): with
    --calibrate-replay the written model equals a plain compile given the option and the calibrated tau
    (metadata, graph inputs/outputs, ops, genai files), and that plain compile differs from one without the
    option, so the option acted (the calibration's compiles once dropped --kv-budget silently)."""
    o = options.BY_NAME[name]
    needs, args = _non_default(o)
    src = genai_model("llama", "fp32") / "model.onnx" if name in GENAI_INPUT else zoo_model("llama", "dynamo20")
    tau = _compare(src, calib, tmp_path, needs + args)
    if name in NO_EFFECT_ON_OUTPUT:
        return
    base = tmp_path / "base" / "fast.onnx"
    base.parent.mkdir()
    assert main([str(src), "-o", str(base), "--frame-tokens", str(L), f"--threshold={tau!r}", *needs]) == 0
    assert _signature(tmp_path / "plain" / "fast.onnx") != _signature(base), f"{' '.join(args)} changed nothing"


def test_api_keywords_are_the_declared_options():
    import fastcar_compile as fc
    from fastcar_compile.passes.context import CompileOptions

    params = inspect.signature(fc.compile).parameters
    assert list(params) == ["model", "output", *options.BY_NAME]
    assert params["frame_tokens"].default is inspect.Parameter.empty
    assert {n: p.default for n, p in list(params.items())[3:]} == \
        {f.name: f.default for f in __import__("dataclasses").fields(CompileOptions)[1:]}
    with pytest.raises(TypeError, match="'bogus'"):
        fc.compile("x.onnx", frame_tokens=4, bogus=1)


# Out of range / not of the option's kind, for every option with bounds or choices (a new one needs a case).
BAD = {"frame_tokens": 0, "threshold": float("nan"), "tas_query": "post", "max_replay": 2**70,
       "fused_attention": "dense", "rotary_positions": 2**21, "kv_budget": 2**24, "kv_sinks": -1, "kv_window": 2**40,
       "kv_eviction": "newest", "tempcache": 1.5, "tempcache_match": "nearest", "prune_prompt": -0.5,
       "kv_diagnostics": 0, "lsh_bits": 17, "int8_dirs": 0, "ann_tables": 65, "ann_seed": -1, "annsa": "hash",
       "annsa_local": -1, "provider": "tpu", "video_start": -1}


def test_every_bounded_option_refuses_out_of_range_through_api_and_cli(tmp_path, capsys):
    import fastcar_compile as fc

    bounded = {o.name for o in options.OPTIONS if o.lo is not None or o.choices is not None} | {
        "threshold", "fused_attention", "int8_dirs"}
    assert set(BAD) == bounded
    src = tmp_path / "in.onnx"
    src.write_bytes(b"")  # never read: the options are checked first
    for name, bad in BAD.items():
        o = options.BY_NAME[name]
        kw = {"frame_tokens": 4, name: bad} | ({"kv_budget": 8} if name.startswith(("kv_", "tempcache", "prune"))
                                               and name != "kv_budget" else {})
        with pytest.raises(FastCarError) as err:
            fc.compile(str(src), **kw)
        assert o.flag in str(err.value) and "\n" not in str(err.value), (name, str(err.value))
        argv = [str(src), "-o", str(tmp_path / "o.onnx"), *(f"--{k.replace('_', '-')}={v}" for k, v in kw.items()
                                                            if k != name), f"{o.flag}={bad}"]
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse's own refusal (a value it cannot read)
            rc = exc.code
        assert rc == 2, name
        err_lines = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
        assert len(err_lines) == 1 and o.flag in err_lines[0], (name, err_lines)


def test_torch_apply_options_are_the_declared_ones():
    fct = pytest.importorskip("fastcar_compile.torch")
    for func in (fct.apply, fct.build):
        params = inspect.signature(func).parameters
        # apply's own video_start (every call may pass one; the program's start) is not the compile option
        assert [n for n in params if n in options.BY_NAME and n != "video_start"] == \
            [o.name for o in options.TORCH_OPTIONS]
    guide = (ROOT / "docs" / "pytorch.md").read_text()
    said = re.search(r"Options are `fastcar-compile`'s\s+\(([^)]*)\)", guide).group(1)
    assert set(re.findall(r"`(\w+)`", said)) == {o.name for o in options.TORCH_OPTIONS} - {"frame_tokens",
                                                                                              "threshold"}


@pytest.mark.parametrize("kw,msg", [
    (dict(frame_tokens=10**12), "frame_tokens must be in 1..4294967295"),
    (dict(frame_tokens=4, max_replay=2**70), "max_replay must be in 0..2147483647"),
    (dict(frame_tokens=4, tas_query="post"), "tas-query"),
    (dict(frame_tokens=4, threshold=float("nan")), "NaN"),
    (dict(frame_tokens=4, kv_budget=16), "unexpected keyword argument 'kv_budget'"),
])
def test_torch_apply_refuses_before_capturing(kw, msg):
    fct = pytest.importorskip("fastcar_compile.torch")
    with pytest.raises((FastCarError, TypeError), match=msg):
        fct.apply(object(), **kw)  # refused before the model is looked at


def test_recorded_options_are_in_the_metadata(zoo_model, tmp_path):
    import fastcar_compile as fc

    values = {"frame_tokens": 4, "threshold": [0.25, 0.5], "tas_query": "raw", "max_replay": 3,
              "per_layer_threshold": True, "emit_diagnostics": True}
    assert set(values) == {o.name for o in options.OPTIONS if o.record}
    fc.compile(str(zoo_model("llama", "dynamo20")), str(tmp_path / "f.onnx"), **values)
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "f.onnx"), load_external_data=False).metadata_props}
    for name, value in values.items():
        text = meta[f"fastcar.{options.BY_NAME[name].record}"]
        assert (text if isinstance(value, str) else json.loads(text)) == value, name


def test_compile_guide_option_table_lists_the_declared_flags():
    guide = (ROOT / "docs" / "compile.md").read_text()
    table = guide[guide.index("| option | meaning |"):]
    table = table[:table.index("\n\n")]
    named = {f for row in table.splitlines()[2:] for f in re.findall(r"--[a-z][a-z0-9-]*", row.split(" | ")[0])}
    assert named - {"--no-genai"} == {o.flag for o in options.CLI_OPTIONS} | (named & COMMAND_FLAGS)


def test_compressed_state_beyond_memory_is_refused_at_compile_time(zoo_model, tmp_path, monkeypatch):
    """The K/V slots of one video (2 x layers x kv heads x budget x head size x 4 B, from the model's sizes) must
    fit in memory: refused while compiling, naming --kv-budget, not a MemoryError when a session allocates."""
    import fastcar_compile as fc
    from fastcar_compile.core import limits

    src = str(zoo_model("llama", "dynamo20"))
    plain = fc.compile(src, frame_tokens=L)[1].metadata
    layers, kv_heads, head_dim = (json.loads(plain[f"fastcar.{k}"]) for k in ("num_layers", "num_kv_heads",
                                                                               "head_dim"))
    budget = 4096
    kv_bytes = 2 * layers * kv_heads * budget * head_dim * 4
    kw = dict(frame_tokens=L, kv_budget=budget, kv_window=L)
    monkeypatch.setattr(limits, "memory_bytes", lambda: kv_bytes - 1)
    with pytest.raises(FastCarError, match=f"--kv-budget {budget}: the state of one video would need .* GiB"):
        fc.compile(src, str(tmp_path / "f.onnx"), **kw)
    assert not (tmp_path / "f.onnx").exists()
    monkeypatch.setattr(limits, "memory_bytes", lambda: 2 * kv_bytes)
    fc.compile(src, **kw)
