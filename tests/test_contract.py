"""The contract in code (fastcar_compile/core/contract.py) against docs/DESIGN.md and against hand-written values."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from fastcar_compile.core import contract
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.passes.fastcar_ops import function_proto

DESIGN = (Path(__file__).parent.parent / "docs" / "DESIGN.md").read_text()


def _section(title: str) -> str:
    start = DESIGN.index(title)
    end = DESIGN.find("\n## ", start + 1)
    return DESIGN[start:end if end >= 0 else None]


def test_design_metadata_table_is_the_generated_one():
    """DESIGN.md's metadata table is contract.metadata_table(): editing either alone fails here."""
    block = re.search(r"<!-- metadata table: generated -->\n(.*?)\n<!-- end metadata table -->", DESIGN, re.S)
    assert block is not None, "DESIGN.md lost its generated metadata table markers"
    assert block.group(1) == contract.metadata_table()
    keys = re.findall(r"^\| `(fastcar\.[a-z_]+)` \|", block.group(1), re.M)
    assert tuple(keys) == contract.META_KEYS


def test_design_ops_match_the_function_bodies():
    """Per op: the attributes DESIGN.md names equal those the shipped ONNX function declares."""
    text = _section("## Custom ops")
    assert f"domain `{contract.DOMAIN}`, version {contract.OPSET_VERSION}" in text
    for op in contract.OP_NAMES:
        entry = re.search(rf"- `{op}\(.*?(?=\n- `|\Z)", text, re.S)
        assert entry is not None, f"DESIGN.md does not describe {op}"
        body = entry.group(0).replace("\n", " ")
        fn = function_proto(op, 17)
        declared = set(fn.attribute) | {a.name for a in fn.attribute_proto}  # attribute_proto: those with defaults
        every = set().union(*contract.OP_ATTRIBUTES.values())
        named = set(re.findall(r"`([a-z][a-z0-9_]*)`", body.split("->", 1)[1].split(". ", 1)[0])) & every
        if "no attributes" in body:
            named = set()
        assert named == declared == set(contract.OP_ATTRIBUTES[op]), op


def test_design_io_table_names_are_the_contract_names():
    table = _section("## Graph inputs/outputs added by the compiler")
    names = set(re.findall(r"^\| `([a-z_.N]+)` \|", table, re.M))
    expected = {contract.VIDEO_START, contract.THRESHOLD, contract.mlp_cache_input("N"), contract.mlp_cache_output("N"),
                contract.mlp_age_input("N"), contract.mlp_age_output("N"), contract.replay_mask_output("N"),
                contract.tas_output("N"), contract.kv_slots_input("N"), contract.kv_slots_output("N"),
                contract.kv_rawkey_input("N"), contract.kv_rawkey_output("N"), contract.kv_dense_input("N"),
                contract.kv_dense_output("N"), contract.kv_stats_output("N")}
    assert names == expected


def _props_by_hand() -> dict[str, str]:
    """The metadata as a compiled two-layer model carries it, written out literally (the independent side)."""
    state = [{"input": "past_mlp_cache.1", "output": "present_mlp_cache.1", "shape": ["batch", 4, 64],
              "dtype": "float", "fill": 0},
             {"input": "past_mlp_age.1", "output": "present_mlp_age.1", "shape": ["batch", 4], "dtype": "int64",
              "fill": -1}]
    kv = [{"input": f"past_key_values.{n}.{k}", "output": f"present.{n}.{k}"} for n in (0, 1) for k in ("key", "value")]
    return {"fastcar.version": "0.1.0", "fastcar.frame_tokens": "4", "fastcar.threshold": "[0.5, Infinity]",
            "fastcar.per_layer_threshold": "true", "fastcar.layers": "[1]", "fastcar.num_layers": "2",
            "fastcar.tas_query": "raw", "fastcar.max_replay": "3", "fastcar.hidden_size": "64",
            "fastcar.num_heads": "4", "fastcar.num_kv_heads": "2", "fastcar.head_dim": "16",
            "fastcar.state": json.dumps(state), "fastcar.kv": json.dumps(kv), "fastcar.diagnostics": "false"}


def test_from_props_reads_hand_written_metadata_and_writes_it_back():
    props = _props_by_hand()
    meta = contract.FastCarMetadata.from_props(props)
    assert meta.frame_tokens == 4 and meta.layers == [1] and meta.num_layers == 2 and meta.max_replay == 3
    assert meta.threshold == [0.5, float("inf")] and meta.per_layer_threshold is True
    assert meta.tas_query == "raw" and meta.diagnostics is False
    assert meta.state[1] == contract.StateEntry("past_mlp_age.1", "present_mlp_age.1", ("batch", 4), "int64", -1)
    assert meta.kv[3] == contract.KVEntry("past_key_values.1.value", "present.1.value")
    back = meta.to_props()
    assert back.keys() == props.keys()
    assert {k: json.loads(v) if k not in ("fastcar.version", "fastcar.tas_query") else v for k, v in back.items()} \
        == {k: json.loads(v) if k not in ("fastcar.version", "fastcar.tas_query") else v for k, v in props.items()}


def test_from_props_refuses_broken_metadata():
    assert contract.FastCarMetadata.from_props({"other": "x"}) is None  # a dense model
    props = _props_by_hand()
    del props["fastcar.kv"]
    with pytest.raises(FastCarError, match="lacks fastcar.kv"):
        contract.FastCarMetadata.from_props(props)
    props = _props_by_hand() | {"fastcar.layers": "[1,"}
    with pytest.raises(FastCarError, match="not valid JSON"):
        contract.FastCarMetadata.from_props(props)


def test_names_and_tau_validation():
    ins, outs = contract.io_names(2)
    assert ins == ["input_ids", "attention_mask", "position_ids", "past_key_values.0.key", "past_key_values.0.value",
                   "past_key_values.1.key", "past_key_values.1.value"]
    assert outs[1:] == ["present.0.key", "present.0.value", "present.1.key", "present.1.value"]
    assert contract.state_output_for("past_key_values.3.value") == "present.3.value"
    assert contract.state_output_for("past_mlp_age.7") == "present_mlp_age.7"
    assert contract.KV_OUTPUT_RE.match("present_2_key").groups() == ("2", "key")
    np.testing.assert_array_equal(contract.check_thresholds([-np.inf, 1e30, np.inf]), [-np.inf, 1e30, np.inf])
    with pytest.raises(FastCarError, match="NaN"):
        contract.check_thresholds([0.0, float("nan")])
    with pytest.raises(FastCarError, match="tas-query"):
        contract.check_tas_query("post")
    assert [f.name for f in dataclasses.fields(contract.FastCarMetadata)] == [k[len("fastcar."):] for k in contract.META_KEYS]
