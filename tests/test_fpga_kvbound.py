"""Simulator with a bounded KV cache: counters equal totals from the dims and the attended lengths alone."""

from __future__ import annotations

import numpy as np
import pytest

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.fpga_backend import ModelSpec, build_program, load_board
from fastcar_compile.fpga_backend.kvbound import KVBound, kv_lengths
from fastcar_compile.fpga_backend.simulate import Simulator

SPEC = ModelSpec(layers=3, hidden=128, intermediate=352, heads=4, kv_heads=2, head_dim=32, vocab=200, frame_tokens=4,
                 replay_layers=(0, 2))


def _sim(batch: int) -> Simulator:
    cfg = load_board("u280").replace(weight_buffer_kib=16)
    return Simulator(build_program(SPEC, cfg, batch=batch, context=64))


def _attention_totals(kv: np.ndarray, batch: int) -> tuple[float, float]:
    """(attention MACs, KV DRAM bytes) of one step from the dims: QK and PV read `kv[l]` slots per layer,
    every layer appends one K and one V row."""
    kvd, dt = SPEC.kv_heads * SPEC.head_dim, SPEC.dtype_bytes
    macs = sum(batch * 2 * int(n) * SPEC.head_dim * SPEC.heads for n in kv)
    byts = sum(batch * (2 * int(n) * kvd + 2 * kvd) * dt for n in kv)
    return macs, byts


def test_window_bound_charges_min_of_context_and_capacity():
    bound = KVBound(sinks=4, window=28)
    ctx = np.array([5, 31, 32, 33, 200, 1000])
    got = kv_lengths(ctx, SPEC.layers, bound)
    want = [[c if c <= 32 else 32] * SPEC.layers for c in ctx]  # hand: 4 sinks + 28 recent = 32 slots
    np.testing.assert_array_equal(got, want)
    assert (kv_lengths(ctx, 2, KVBound(budget=100, sinks=4, window=28))[:, 0] == [5, 31, 32, 33, 100, 100]).all()


@pytest.mark.parametrize("batch,policy", [(1, "static"), (5, "drs")])
def test_bounded_counters_equal_analytic_totals(batch, policy):
    sim = _sim(batch)
    rng = np.random.default_rng(batch)
    steps = 4
    ctx = np.array([40, 90, 300, 1200])
    replay = rng.random((steps, SPEC.layers, batch)) < 0.5
    kv = np.stack([rng.integers(1, c + 1, size=SPEC.layers) for c in ctx])  # e.g. merged TempCache slots
    dense = sim.run(replay, ctx, policy=policy)
    bounded = sim.run(replay, ctx, policy=policy, kv_len=kv_lengths(ctx, SPEC.layers, slots=kv))
    d_macs = d_kv = b_macs = b_kv = 0.0
    for s in range(steps):
        m, b = _attention_totals(np.full(SPEC.layers, ctx[s]), batch)
        d_macs, d_kv = d_macs + m, d_kv + b
        m, b = _attention_totals(kv[s], batch)
        b_macs, b_kv = b_macs + m, b_kv + b
    assert dense.dram_bytes["kv"] == pytest.approx(d_kv, rel=1e-12)
    assert bounded.dram_bytes["kv"] == pytest.approx(b_kv, rel=1e-12)
    # everything but attention is untouched by the bound
    assert dense.macs - bounded.macs == pytest.approx(d_macs - b_macs, rel=1e-12)
    for k in ("weights", "replay_cache", "activations"):
        assert bounded.dram_bytes[k] == dense.dram_bytes[k], k
    assert bounded.cycles <= dense.cycles


def test_bound_at_or_above_context_is_dense_and_flat_after_it_fills():
    sim = _sim(2)
    ctx = np.array([50, 100, 400, 1600])
    none = np.zeros((4, SPEC.layers, 2), bool)
    dense = sim.run(none, ctx, policy="static")
    wide = sim.run(none, ctx, policy="static", kv_len=kv_lengths(ctx, SPEC.layers, KVBound(window=4096)))
    assert wide.cycles == dense.cycles and wide.dram_bytes == dense.dram_bytes
    per_step = [sim.run(none[:1], int(c), policy="static", kv_len=kv_lengths(np.array([c]), SPEC.layers,
                                                                             KVBound(sinks=2, window=62)))
                for c in (64, 100, 1600)]
    assert per_step[0].cycles == per_step[1].cycles == per_step[2].cycles  # flat once 64 slots are full


def test_bad_bounds_and_lengths_are_named():
    with pytest.raises(FastCarError, match="kv-window"):
        KVBound()
    with pytest.raises(FastCarError, match="budget"):
        KVBound(budget=10, sinks=4, window=8)
    with pytest.raises(FastCarError, match="1..context"):
        kv_lengths(np.array([10, 20]), 3, slots=np.array([11, 5]))
    sim = _sim(1)
    with pytest.raises(FastCarError, match="kv_len"):
        sim.run(np.zeros((2, SPEC.layers, 1), bool), 10, kv_len=np.full((2, SPEC.layers), 11))


def test_cli_sim_with_window_reads_the_bounded_cache(tmp_path, capsys):
    import json

    from fastcar_compile.cli import main
    from fastcar_compile.fpga_backend import encode

    fcb = tmp_path / "m.fcb"
    encode.save(build_program(SPEC, load_board("u280").replace(weight_buffer_kib=16), batch=2, context=64), fcb)
    assert main(["sim", str(fcb), "--replay-ratio", "0.5", "--context", "500", "--steps", "2", "--kv-window", "60",
                 "--kv-sinks", "4", "--policy", "static", "--batch", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    kvd, dt = SPEC.kv_heads * SPEC.head_dim, SPEC.dtype_bytes
    assert got["static"]["dram_bytes_per_step"]["kv"] == SPEC.layers * 2 * (2 * 64 * kvd + 2 * kvd) * dt
    assert "64 slots" in got["source"]
    assert main(["sim", str(fcb), "--kv-budget", "10", "--kv-window", "16"]) == 2
