"""Fuzzing the `.fcb` reader and the simulator: hostile bundles raise FastCarError, never anything else.

Each input is a real compiled program with one hostile change, re-encoded with a valid CRC (and, for board
edits, the matching hardware hash), as `asm` or a hand edit could write it (tests/fcb_fuzz.py). CI runs a
few hundred; `pytest -m slow` runs 10,000.
"""

from __future__ import annotations

import json

import fcb_fuzz
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastcar_compile.errors import FastCarError
from fastcar_compile.fpga_backend import encode, isa
from fastcar_compile.fpga_backend.simulate import Simulator


def _report(res: dict) -> str:
    crashes = res["crash"][:5]
    return "; ".join(f"#{i}: {type(e).__name__}: {str(e)[:120]}" for i, e in crashes)


def _check(n: int, seed: int) -> None:
    res = fcb_fuzz.campaign(n, seed)
    assert not res["crash"], f"{len(res['crash'])} crashes: {_report(res)}"
    # the campaign must reach the simulator, not only bounce off the decoder's CRC/size checks
    assert len(res["sim"]) + len(res["ran"]) > n // 4, {k: len(v) for k, v in res.items()}
    assert res["ran"], "no mutated bundle ran at all (are valid ones refused?)"


def test_unmutated_programs_still_simulate():
    for p in fcb_fuzz.base_programs():
        stage, exc = fcb_fuzz.run_one(encode.encode(p))
        assert stage == "ran", exc


def test_fuzz_ci_sized():
    _check(300, seed=1)


@pytest.mark.slow
def test_fuzz_ten_thousand():
    _check(10_000, seed=2)


def _hostile(p: encode.Program, field: str, value) -> bytes:
    meta = json.loads(json.dumps(p.meta))
    meta["board"] = p.board.to_dict()
    meta[field] = value
    return fcb_fuzz.raw_encode(p.bundles, meta, p.board.structural_hash(), p.cores)


@pytest.mark.parametrize("field,value", [("batch", 0), ("batch", 33), ("batch", "4"), ("context", 0),
                                         ("context", 2**32), ("binding_masks", [1, 2]), ("binding_masks", None),
                                         ("model", {"layers": 2}), ("drs_weights", "x"), ("tensors", 5)])
def test_sim_refuses_hostile_metadata(field, value):
    p = fcb_fuzz.base_programs()[1]
    program = encode.decode(_hostile(p, field, value))  # the container is fine...
    with pytest.raises(FastCarError):  # ...the simulator refuses what it cannot run
        Simulator(program)


@pytest.mark.parametrize("field,value,word", [("layer", 40000, "layer"), ("tensor", 60000, "tensor"),
                                              ("dst", 200, "buffer"), ("arg", 0xFFFFFFFF, "row mask"),
                                              ("m", 2**32 - 1, "m x k")])
def test_sim_refuses_hostile_instruction_fields(field, value, word):
    p = fcb_fuzz.base_programs()[1]
    b = p.bundles.copy()
    gemm = np.argwhere((b[:, :-1]["opcode"] == isa.Op.GEMM) & (b[:, :-1]["sub"] == isa.Space.WEIGHT))[0]
    b[gemm[0], gemm[1]][field] = value
    if field == "m":
        b[gemm[0], gemm[1]]["k"] = 2**32 - 1
    program = encode.decode(fcb_fuzz.raw_encode(b, {**p.meta, "board": p.board.to_dict()},
                                                p.board.structural_hash(), p.cores))
    with pytest.raises(FastCarError, match=word):
        Simulator(program)


@settings(max_examples=150, deadline=None, database=None)
@given(field=st.sampled_from(isa.FIELDS), slot=st.integers(0, 10_000), value=st.integers(0, 2**32 - 1))
def test_any_single_instruction_field_is_run_or_refused(field, slot, value):
    p = fcb_fuzz.base_programs()[0]
    b = p.bundles.copy().reshape(-1)
    top = int(np.iinfo(isa.INSTR_DTYPE[field]).max)
    b[slot % b.size][field] = value & top
    data = fcb_fuzz.raw_encode(b.reshape(p.bundles.shape), {**p.meta, "board": p.board.to_dict()},
                               p.board.structural_hash(), p.cores)
    stage, exc = fcb_fuzz.run_one(data)
    assert stage != "crash", repr(exc)
