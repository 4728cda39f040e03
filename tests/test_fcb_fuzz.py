"""Fuzzing the `.fcb` reader, the assembler and the simulator: hostile bundles and assembly sources raise
FastCarError (one line at the CLI, exit 2), never anything else, and `asm` writes exactly what `sim` runs.

Each input is a real compiled program with one hostile change, re-encoded with a valid CRC (and, for board
edits, the matching hardware hash), as `asm` or a hand edit could write it (tests/fcb_fuzz.py). CI runs a
few hundred; `pytest -m slow` runs 10,000 bundles and 2,000 assembly sources.
"""

from __future__ import annotations

import json

import fcb_fuzz
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastcar_compile.core.errors import FastCarError
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


def _check_text(n: int, seed: int) -> None:
    res = fcb_fuzz.text_campaign(n, seed)
    assert not res["crash"], f"{len(res['crash'])} crashes: {_report(res)}"
    assert res["ran"] and res["asm"], {k: len(v) for k, v in res.items()}


def test_asm_fuzz_ci_sized():
    _check_text(200, seed=1)


@pytest.mark.slow
def test_asm_fuzz_two_thousand():
    _check_text(2_000, seed=2)


def test_every_mutation_kind_is_drawn():
    """The campaign's mix: every kind of `mutate` (byte flips, metadata at any depth, truncations, ...)."""
    import numpy as np

    rng = np.random.default_rng(0)
    kinds = {int(rng.integers(fcb_fuzz.KINDS)) for _ in range(200)}
    assert kinds == set(range(fcb_fuzz.KINDS))


def _cli(argv, capsys):
    from fastcar_compile.cli import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture()
def fcb(tmp_path):
    path = tmp_path / "m.fcb"
    encode.save(fcb_fuzz.base_programs()[1], path)
    return path


@pytest.mark.parametrize("args,flag", [(["--timeline-layers=-3", "--timeline", "t.png"], "--timeline-layers"),
                                       (["--seed=-1"], "--seed"), (["--kv-budget", str(2**70)], "--kv-budget"),
                                       (["--kv-window=-1"], "--kv-window"), (["--batch", "0"], "--batch"),
                                       (["--context", str(2**32)], "--context")])
def test_sim_refuses_out_of_range_options(fcb, tmp_path, capsys, args, flag):
    args = [str(tmp_path / a) if a.endswith(".png") else a for a in args]
    rc, _, err = _cli(["sim", str(fcb), *args], capsys)
    assert rc == 2 and flag in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "t.png").exists()


@pytest.mark.parametrize("trace", [
    {"layers": [0], "batch": -1, "steps": [{"pos": 1, "replay": [[]]}]},
    {"layers": [0], "batch": 10**11, "steps": [{"pos": 1, "replay": [[1]]}]},
    {"layers": [0], "batch": 1, "steps": [{"pos": 1e300, "replay": [[1]]}]},
    {"layers": [0], "batch": 1, "steps": [{"pos": 10**23, "replay": [[1]]}]},
    {"layers": [0.5], "batch": 1, "steps": [{"pos": 1, "replay": [[1]]}]},
    {"layers": [0, 0], "batch": 1, "steps": [{"pos": 1, "replay": [[1], [0]]}]},
    {"layers": [0], "batch": 1, "steps": [{"pos": 1, "replay": [[7]]}]},
    {"layers": [0], "batch": 1, "steps": [{"pos": 1, "replay": [[1]]}], "video_start": "abc"},
    {"layers": [0], "batch": 1, "steps": [{"pos": 1, "replay": [[1]]}], "video_start": 1e400},
    {"layers": [0], "batch": 1, "steps": [1]},
    [1],
])
def test_sim_refuses_hostile_traces(fcb, tmp_path, capsys, trace):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(trace))
    before = path.read_bytes()
    rc, _, err = _cli(["sim", str(fcb), "--replay-trace", str(path)], capsys)
    assert rc == 2 and "replay trace" in err and len(err.strip().splitlines()) == 1, err
    assert path.read_bytes() == before


@pytest.mark.parametrize("old,new", [('"cores":4', '"cores":1000000000000'), ('"cores":4', '"cores":"abc"'),
                                     ('"cores":4', '"cores":[1]'), ('"cores":4', '"cores":-3'),
                                     ('"cores":4', '"cores":1e400'), (" n=1 ", " n=\u0663 ")])
def test_asm_refuses_hostile_sources_and_writes_nothing(fcb, tmp_path, capsys, old, new):
    text = tmp_path / "m.s"
    assert _cli(["disasm", str(fcb), "-o", str(text)], capsys)[0] == 0
    src = text.read_text()
    assert old in src
    text.write_text(src.replace(old, new, 1))
    out = tmp_path / "out.fcb"
    rc, _, err = _cli(["asm", str(text), "-o", str(out)], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not out.exists()


def test_asm_refuses_a_layer_the_model_lacks(fcb, tmp_path, capsys):
    """The decoder's semantic checks run before asm writes: layer=40000 of a 2-layer model never reaches a file."""
    text = tmp_path / "m.s"
    _cli(["disasm", str(fcb), "-o", str(text)], capsys)
    src = text.read_text()
    text.write_text(src.replace(" layer=1 ", " layer=40000 ", 1))
    rc, _, err = _cli(["asm", str(text), "-o", str(tmp_path / "out.fcb")], capsys)
    assert rc == 2 and "layer 40000" in err and not (tmp_path / "out.fcb").exists()


def test_cli_on_mutated_bundles_exits_cleanly(tmp_path, capsys):
    """`sim` and `disasm` driven through the CLI on mutated files: exit 0 or 2, never a traceback."""
    import numpy as np

    rng = np.random.default_rng(7)
    progs = fcb_fuzz.base_programs()
    codes = set()
    for i in range(40):
        path = tmp_path / f"m{i}.fcb"
        path.write_bytes(fcb_fuzz.mutate(progs[i % 2], rng))
        for argv in (["sim", str(path), "--steps", "2", "--replay-ratio", "0.5"], ["disasm", str(path)]):
            rc, _, err = _cli(argv, capsys)
            assert rc in (0, 2) and "Traceback" not in err, (argv, err)
            assert rc == 0 or len(err.strip().splitlines()) == 1, err
            codes.add(rc)
    assert codes == {0, 2}


def test_isa_constants_are_defined_once():
    """The ISA's limits live in isa.py: no other FPGA module spells a field width or the stream modes."""
    import ast
    from pathlib import Path

    import fastcar_compile.fpga_backend as fb

    root = Path(fb.__file__).parent
    import fastcar_compile.cli.asm as asm_cmds
    import fastcar_compile.cli.sim as cmds

    files = [f for f in root.glob("*.py") if f.name != "isa.py"] + [Path(cmds.__file__), Path(asm_cmds.__file__)]
    bad = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and node.value in (0xFFFF, 0xFFFFFFFF, 2**32 - 1) and \
                    not isinstance(node.value, bool):
                bad.append(f"{f.name}:{node.lineno} {node.value}")
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and \
                    isinstance(node.right, ast.Constant) and node.right.value in (16, 32):
                bad.append(f"{f.name}:{node.lineno} 2**{node.right.value}")
            if isinstance(node, ast.Tuple) and [getattr(e, "value", None) for e in node.elts] == \
                    list(isa.WEIGHT_STREAMS):
                bad.append(f"{f.name}:{node.lineno} {isa.WEIGHT_STREAMS}")
    assert not bad, bad

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
