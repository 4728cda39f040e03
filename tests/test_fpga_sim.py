"""Timing simulator: counters equal analytic totals from the model dims; scheduling properties."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from fastcar_compile.fpga_backend import LLAMA2_7B, ModelSpec, build_program, isa, load_board
from fastcar_compile.fpga_backend import masks as M
from fastcar_compile.fpga_backend.simulate import Simulator

SPEC = ModelSpec(layers=3, hidden=128, intermediate=352, heads=4, kv_heads=2, head_dim=32, vocab=200, frame_tokens=4,
                 replay_layers=(0, 2))
CTX = 37


def _sim(board: str, batch: int, weights: str = "broadcast", **over) -> Simulator:
    cfg = load_board(board).replace(weight_buffer_kib=16, **over)
    return Simulator(build_program(SPEC, cfg, batch=batch, context=CTX, weights=weights))


def _analytic(spec: ModelSpec, replay: np.ndarray, ctx: int, stream: str, cores: int) -> dict[str, float]:
    """Totals for one step from the dims alone; replay (layers, batch); static block binding for per-core."""
    h, i, v, dt = spec.hidden, spec.intermediate, spec.vocab, spec.dtype_bytes
    qd, kvd = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    batch = replay.shape[1]
    per = -(-batch // cores)
    core_of = np.arange(batch) // per
    used = len(set(core_of))
    attn_w = h * qd + 2 * h * kvd + qd * h
    mlp_w = 3 * h * i
    macs = batch * (h * v)
    wbytes = (h + 0) * v * dt * (used if stream == "per_core" else 1)
    kv = 0.0
    for layer in range(spec.layers):
        rep = replay[layer] if layer in spec.replay_layers else np.zeros(batch, bool)
        computing = ~rep
        macs += batch * (attn_w + 2 * ctx * spec.head_dim * spec.heads) + computing.sum() * mlp_w
        if stream == "broadcast":
            wbytes += attn_w * dt + (mlp_w * dt if computing.any() else 0)
        else:
            wbytes += attn_w * dt * used + mlp_w * dt * len(set(core_of[computing]))
        kv += batch * (2 * ctx * kvd + 2 * kvd) * dt
    return {"macs": macs, "weights": wbytes, "kv": kv,
            "replay_cache": len(spec.replay_layers) * batch * h * dt,
            "activations": batch * h * dt + batch * v * dt}  # embedding rows in, logits out


def _dram_floor(dram_bytes: dict[str, float], board) -> float:
    """Fewest cycles DRAM needs for these bytes: the weight stream at the stream rate, the rest at the mixed one."""
    rest = sum(v for k, v in dram_bytes.items() if k != "weights")
    return dram_bytes["weights"] / board.dram_stream_bytes_per_cycle + rest / board.dram_bytes_per_cycle


@pytest.mark.parametrize("board", ["kv260", "u280"])
def test_dram_cycles_charge_each_traffic_class_at_its_rate(board):
    """Every DRAM-bound bundle takes issue latency + ceil(W / stream rate + B / mixed rate) cycles, the rates
    worked out here as exact fractions of the board file's decimals (GB/s x efficiency / MHz)."""
    import json
    from fractions import Fraction

    from fastcar_compile.fpga_backend.hwspec import BOARDS_DIR

    raw = json.loads((BOARDS_DIR / f"{board}.json").read_text(), parse_float=Fraction)
    stream_rate = raw["dram_gbps"] * raw["dram_stream_efficiency"] * 1000 / raw["clock_mhz"]
    mixed_rate = raw["dram_gbps"] * raw["dram_efficiency"] * 1000 / raw["clock_mhz"]
    sim = _sim(board, 4)
    replay = np.zeros((SPEC.layers, 4), bool)
    replay[0, :2] = True
    ev = sim.step(replay, CTX, policy="static")
    bound = np.flatnonzero(ev["bw_bound"])
    assert len(bound) > 5
    for i in bound:
        w, b = Fraction(int(ev["wbytes"][i])), Fraction(int(ev["dram_slot"][i].sum()))
        want = math.ceil(w / stream_rate + b / mixed_rate) + sim.board.issue_latency
        assert ev["t"][i] == want, (i, w, b)


@pytest.mark.parametrize("board,batch,stream,policy", [
    ("kv260", 1, "broadcast", "static"), ("kv260", 6, "broadcast", "drs"), ("u280", 13, "per_core", "static"),
    ("zcu102", 32, "broadcast", "static"), ("zcu102", 5, "per_core", "static"),
])
def test_counters_equal_analytic_totals(board, batch, stream, policy):
    sim = _sim(board, batch)
    rng = np.random.default_rng(batch)
    replay = rng.random((4, SPEC.layers, batch)) < 0.6
    replay[1, 0, :] = True  # one layer where every row replays: the broadcast stream is skipped
    res = sim.run(replay, CTX, policy=policy, stream=stream)
    want = {k: 0.0 for k in ("macs", "weights", "kv", "replay_cache", "activations")}
    for s in range(replay.shape[0]):
        for k, val in _analytic(SPEC, replay[s], CTX, stream, sim.C).items():
            want[k] += val
    assert res.macs == pytest.approx(want["macs"], rel=1e-12)
    for k in ("weights", "kv", "replay_cache", "activations"):
        assert res.dram_bytes[k] == pytest.approx(want[k], rel=1e-12), k
    # time can never beat the DRAM or the MAC-array floor
    floor = max(_dram_floor(res.dram_bytes, sim.board), res.macs / sim.board.macs_per_cycle)
    assert res.cycles >= floor
    np.testing.assert_allclose(res.core_busy + res.core_stall + res.core_idle, res.cycles, rtol=1e-9)
    assert 0 < res.utilisation <= 1


def test_context_grows_kv_reads_and_replay_never_skips_them():
    sim = _sim("kv260", 4)
    none = np.zeros((1, SPEC.layers, 4), bool)
    allr = np.ones((1, SPEC.layers, 4), bool)
    a = sim.run(none, 10, policy="static")
    b = sim.run(none, 200, policy="static")
    c = sim.run(allr, 200, policy="static")
    kvd = SPEC.kv_heads * SPEC.head_dim
    assert b.dram_bytes["kv"] - a.dram_bytes["kv"] == SPEC.layers * 4 * 2 * 190 * kvd * 2
    assert c.dram_bytes["kv"] == b.dram_bytes["kv"]
    assert b.cycles > a.cycles


COMPUTE_BOUND = {"dram_gbps": 1e5}  # DRAM effectively free: the MAC arrays set the pace


@pytest.mark.parametrize("board,batch", [("kv260", 8), ("u280", 16), ("zcu102", 11), ("u280", 1)])
@pytest.mark.parametrize("policy", ["static", "drs"])
def test_more_replay_never_costs_more_when_compute_bound(board, batch, policy):
    sim = _sim(board, batch, **COMPUTE_BOUND)
    ratios = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    for seed in range(3):
        nested = M.nested(ratios, batch, SPEC.layers, steps=3, seed=seed)
        cycles = [sim.run(m, CTX, policy=policy).cycles for m in nested]
        assert all(b <= a for a, b in zip(cycles, cycles[1:], strict=False)), cycles
        assert cycles[-1] < cycles[0]


@pytest.mark.parametrize("board,batch,stream,over", [
    ("kv260", 8, "broadcast", {}), ("u280", 16, "broadcast", {}), ("u280", 16, "per_core", {}),
    ("zcu102", 32, "broadcast", COMPUTE_BOUND), ("kv260", 7, "per_core", COMPUTE_BOUND), ("u280", 3, "broadcast", {}),
])
def test_drs_never_slower_than_static_and_equal_without_replay(board, batch, stream, over):
    sim = _sim(board, batch, weights=stream, **over)
    for kind in M.MASK_KINDS:
        for ratio in (0.1, 0.5, 0.87):
            replay = M.synthetic(ratio, batch, SPEC.layers, 4, kind=kind, seed=3, replayable=frozenset(SPEC.replay_layers))
            s = sim.run(replay, CTX, policy="static", stream=stream)
            d = sim.run(replay, CTX, policy="drs", stream=stream)
            assert d.cycles <= s.cycles + 1e-6
            assert d.macs == s.macs
    none = np.zeros((2, SPEC.layers, batch), bool)
    s = sim.run(none, CTX, policy="static", stream=stream)
    d = sim.run(none, CTX, policy="drs", stream=stream)
    assert d.cycles == s.cycles and d.remaps == 0
    assert d.dram_bytes == s.dram_bytes and d.macs == s.macs
    np.testing.assert_array_equal(d.core_busy, s.core_busy)


def test_drs_rebalances_a_clustered_mask_when_compute_bound():
    batch = 16
    sim = _sim("u280", batch, drs_overhead=20, **COMPUTE_BOUND)  # tiny model: its MLP is only ~100s of cycles
    replay = np.zeros((1, SPEC.layers, batch), bool)
    replay[0, :, 8:] = True  # rows 8-15 replay: cores 4-7 of the block binding fall idle
    s = sim.run(replay, CTX, policy="static")
    d = sim.run(replay, CTX, policy="drs")
    assert d.remaps == len(SPEC.replay_layers)
    assert d.cycles < s.cycles
    assert d.drs_cycles == len(SPEC.replay_layers) * sim.board.drs_overhead
    # the busiest core carries half the MLP rows under DRS: idle spread is smaller
    assert np.ptp(d.core_busy) < np.ptp(s.core_busy)
    # a remap that costs more than it saves is not taken (the thresholds are compiled for the overhead)
    costly = _sim("u280", batch, drs_overhead=10**6, **COMPUTE_BOUND)
    assert costly.run(replay, CTX, policy="drs").cycles == costly.run(replay, CTX, policy="static").cycles


@pytest.mark.parametrize("board,batch,stream", [("u280", 16, "broadcast"), ("kv260", 12, "per_core"),
                                                ("kv260", 32, "broadcast"), ("zcu102", 24, "per_core")])
def test_compiled_remap_thresholds_take_exactly_the_remaps_that_pay(board, batch, stream):
    """Oracle from the public static simulation alone (no cost-model internals, no DRS table): a layer's gain
    from remapping is the static cost of the step minus the static cost of the same step with that layer's
    compute rows laid out under the block binding the way round-robin spreads them (per-core counts are all
    that cost depends on; the batches are multiples of the core count so the layout exists). DRS must take
    exactly the remaps whose gain beats the overhead (per-core streams: only those adding no stream). The
    overhead is then set just below and at the smallest gain, so both sides of the rule are exercised."""
    cores = load_board(board).cores
    per = batch // cores
    assert per * cores == batch
    rng = np.random.default_rng(batch)
    draws = [rng.random((SPEC.layers, batch)) < rng.random() for _ in range(12)]

    def round_robin_layout(computing: np.ndarray) -> np.ndarray:
        n = int(computing.sum())
        rows = np.ones(batch, bool)  # True = replays
        for core in range(cores):
            k = n // cores + (core < n % cores)  # round-robin deals the i-th compute row to core i mod cores
            rows[core * per: core * per + k] = False
        return rows

    def check(overhead: int) -> tuple[list[float], int]:
        cfg = load_board(board).replace(weight_buffer_kib=16, drs_overhead=overhead, **COMPUTE_BOUND)
        sim = Simulator(build_program(SPEC, cfg, batch=batch, context=CTX, weights=stream))
        static = lambda r: sim.run(r[None], CTX, policy="static", stream=stream).cycles  # noqa: E731
        gains, taken = [], 0
        for replay in draws:
            base, want = static(replay), 0.0
            for layer in SPEC.replay_layers:
                spread = replay.copy()
                spread[layer] = round_robin_layout(~replay[layer])
                gain = base - static(spread)
                busy_static = len({r // per for r in np.flatnonzero(~replay[layer])})
                adds_streams = min(int((~replay[layer]).sum()), cores) > busy_static
                if stream == "per_core" and adds_streams:
                    continue
                gains.append(gain)
                if gain > overhead:
                    want += gain - overhead
                    taken += 1
            got = base - sim.run(replay[None], CTX, policy="drs", stream=stream).cycles
            assert got == pytest.approx(want, abs=1e-6), overhead
        return gains, taken

    gains, taken = check(40)
    assert taken > 0, "test setup: no remap paid off"
    smallest = math.ceil(min(g for g in gains if g > 0))
    assert check(smallest - 1)[1] > 0  # just below the smallest gain: it pays
    assert check(smallest)[1] < taken  # at it: the remap no longer pays and must not be taken


def test_broadcast_saves_weight_traffic_only_when_every_row_skips():
    sim = _sim("kv260", 4)
    one = np.zeros((1, SPEC.layers, 4), bool)
    one[0, 0, :3] = True
    allr = one.copy()
    allr[0, 0, :] = True
    base = sim.run(np.zeros_like(one), CTX, policy="static")
    a = sim.run(one, CTX, policy="static")
    b = sim.run(allr, CTX, policy="static")
    mlp_bytes = 3 * SPEC.hidden * SPEC.intermediate * SPEC.dtype_bytes
    assert a.dram_bytes["weights"] == base.dram_bytes["weights"]
    assert base.dram_bytes["weights"] - b.dram_bytes["weights"] == mlp_bytes
    assert b.cycles < base.cycles  # batch 4 on a KV260 is bound by weight streaming


def test_board_override_must_keep_structure():
    sim = _sim("kv260", 2)
    faster = sim.board.replace(clock_mhz=600.0)
    Simulator(sim.program, faster)
    from fastcar_compile.core.errors import FastCarError

    with pytest.raises(FastCarError, match="recompile"):
        Simulator(sim.program, sim.board.replace(cores=2))
    with pytest.raises(FastCarError, match="exceeds"):
        sim.run(np.zeros((1, SPEC.layers, 4), bool), CTX, batch=4)


def test_activation_spill_traffic_matches_the_instruction_stream():
    """Rows whose activations overflow the act buffer: every weight tile moves its input and output slices."""
    from fastcar_compile.fpga_backend import isa

    batch = 8
    fits = _sim("kv260", batch)
    spills = Simulator(build_program(SPEC, fits.board.replace(act_buffer_kib=1), batch=batch, context=CTX))
    assert not fits.program.meta["spilled_tasks"] and spills.program.meta["spilled_tasks"]
    replay = M.synthetic(0.5, batch, SPEC.layers, 2, kind="random", seed=2, replayable=frozenset(SPEC.replay_layers))
    a = fits.run(replay, CTX, policy="static")
    b = spills.run(replay, CTX, policy="static")
    core = spills.program.bundles[:, :-1]
    w = (core["opcode"] == isa.Op.GEMM) & ((core["flags"] & isa.Flag.SPILL) != 0)
    want = 0
    for s in range(replay.shape[0]):
        for ins in core[w]:
            rows = [r for r in range(batch) if int(ins["arg"]) >> r & 1]
            if ins["flags"] & isa.Flag.SKIP_ON_REPLAY:
                rows = [r for r in rows if not replay[s, ins["layer"], r]]
            want += len(rows) * (int(ins["k"]) + int(ins["m"])) * SPEC.dtype_bytes
    assert b.dram_bytes["activations"] - a.dram_bytes["activations"] == want
    assert b.dram_bytes["weights"] == a.dram_bytes["weights"] and b.cycles > a.cycles
    # the rule: 2 rows per KV260 core of LLaMA-2-7B keep q/k/v/o on chip, the MLP and LM head spill
    big = build_program(LLAMA2_7B, load_board("kv260"), batch=8, context=64)
    assert big.meta["spilled_tasks"] == ["down_proj", "gate_proj", "lm_head", "up_proj"]


def test_double_buffering_overlaps_weight_loads_with_compute():
    """Without a double buffer a tile's load and compute serialise: cycles reach the sum of the DRAM and MAC
    floors; with it they overlap and stay below that sum (same tiles: the single buffer is half the size)."""
    cfg = load_board("u280").replace(weight_buffer_kib=16, issue_latency=1)
    replay = np.zeros((1, SPEC.layers, 16), bool)
    on = Simulator(build_program(SPEC, cfg, batch=16, context=CTX)).run(replay, CTX)
    off = Simulator(build_program(SPEC, cfg.replace(double_buffering=False, weight_buffer_kib=8), batch=16,
                                  context=CTX)).run(replay, CTX)
    assert on.macs == off.macs and on.dram_bytes == off.dram_bytes
    bd = cfg
    both_floors = _dram_floor(on.dram_bytes, bd) + on.macs / bd.macs_per_cycle
    assert off.cycles >= both_floors > on.cycles


@pytest.mark.parametrize("board,batch", [("kv260", 1), ("u280", 5)])
def test_qk_norm_costs_two_vector_bundles_per_layer(board, batch):
    """Per-head q/k norm (Qwen3) is priced, not dropped: per layer one RMSNORM over q_dim and one over kv_dim,
    each a bundle of max(ceil(2 m / vector lanes) cycles x rows, 3 m bytes x rows / SRAM bandwidth) + issue
    latency (simulate.py's execution model; the rows of the busiest core)."""
    import dataclasses

    cfg = load_board(board).replace(weight_buffer_kib=16)
    plain, qk = (Simulator(build_program(dataclasses.replace(SPEC, qk_norm=q), cfg, batch=batch, context=CTX))
                 for q in (False, True))
    replay = np.zeros((2, SPEC.layers, batch), bool)
    rows = -(-batch // cfg.cores)  # block binding: the busiest core's rows
    want = 0.0
    for m in (SPEC.heads * SPEC.head_dim, SPEC.kv_heads * SPEC.head_dim):
        compute = rows * math.ceil(2 * m / cfg.vector_lanes)
        sram = rows * 3 * m * cfg.dtype_bytes / cfg.sram_bytes_per_cycle
        want += max(compute, sram) + cfg.issue_latency
    got = qk.run(replay, CTX, policy="static").cycles_per_step - plain.run(replay, CTX, policy="static").cycles_per_step
    assert cfg.double_buffering and got == pytest.approx(SPEC.layers * want)


@pytest.mark.parametrize("board,batch", [("kv260", 1), ("u280", 6)])
def test_int4_weights_stream_half_a_byte_each(board, batch):
    """weight_bits=4: the weight stream is exactly half the fp16 one (the dims' weight elements / 2 bytes), tiles
    hold twice the weights in the same half buffer, and MACs and KV bytes do not change."""
    cfg = load_board(board).replace(weight_buffer_kib=16)
    dense = dataclasses.replace(SPEC, replay_layers=())
    fp16, int4 = (build_program(dense, cfg, batch=batch, context=CTX, weight_bits=w) for w in (None, 4))
    replay = np.zeros((2, SPEC.layers, batch), bool)
    a, b = (Simulator(p).run(replay, CTX, policy="static") for p in (fp16, int4))
    elems = sum(SPEC.layer_weight_elems().values()) * SPEC.layers + SPEC.hidden * SPEC.vocab
    assert a.dram_bytes["weights"] == 2 * elems * 2 and b.dram_bytes["weights"] == 2 * elems // 2
    assert a.macs == b.macs and a.dram_bytes["kv"] == b.dram_bytes["kv"]
    gemm = lambda p: p.bundles[:, 0][(p.bundles[:, 0]["opcode"] == isa.Op.GEMM) & (p.bundles[:, 0]["sub"] == isa.Space.WEIGHT)]  # noqa: E731
    assert (gemm(int4)["m"].astype(np.int64) * gemm(int4)["k"] * 4 // 8 <= cfg.weight_tile_bytes).all()
    assert len(gemm(int4)) < len(gemm(fp16)) and b.cycles < a.cycles
