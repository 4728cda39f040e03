"""The C++ CPU kernels of the fastcar::* torch ops against their ATen composite (ops.py, the reference every
other device runs): decisions, TAS, slots, cache rows and ages, over batch > 1, prefill and decode steps, GQA,
strided queries, video_start before and inside the window, max_replay, half precision. The eager FastCar
reference checks of the whole model (test_torch_frontend.py) run on these kernels too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from fastcar_compile.torch import native, ops

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None, reason="no C++ compiler")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert native.load() is not None, native.status()


def _gate_inputs(B, H, Hkv, S, T, D, L, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g).to(dtype).transpose(1, 2)  # [B,H,S,D] strided, as attention has it
    k = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    age = torch.randint(-1, 4, (B, L), generator=g)
    return q, k, age


CASES = [  # B, H, Hkv, S, T, D, L, video_start, max_replay, dtype
    (1, 4, 2, 1, 40, 16, 8, 0, 0, torch.float32),
    (3, 8, 2, 1, 41, 16, 8, 5, 2, torch.float32),
    (2, 4, 4, 1, 12, 8, 8, 6, 0, torch.float32),  # aligned token before video_start: never eligible
    (2, 4, 2, 7, 30, 16, 8, 3, 0, torch.float32),  # prefill chunk: no replay, only the last L tokens written
    (2, 6, 3, 20, 20, 8, 8, 2, 1, torch.float32),  # prompt longer than a frame from an empty cache
    (2, 4, 2, 1, 33, 16, 8, 1, 3, torch.bfloat16),
]


@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}S{c[3]}T{c[4]}vs{c[7]}{str(c[9])[6:]}" for c in CASES])
def test_kernels_match_composite(case):
    B, H, Hkv, S, T, D, L, vs, mr, dtype = case
    q, k, age = _gate_inputs(B, H, Hkv, S, T, D, L, dtype, seed=T)
    video_start = torch.tensor(vs)
    mixed = S == 1 and B > 1 and T - 1 - L >= vs  # a decode step whose rows can decide both ways
    if mixed:
        age[0], age[1:] = -1, 0  # row 0 never written (never replays), the others eligible
    want_tas = ops.temporal_gate(q, k, age, torch.tensor(float("-inf")), video_start, L, mr)[1]
    tau = torch.tensor(float(want_tas.min()))  # every token but the lowest-TAS one above it
    want = ops.temporal_gate(q, k, age, tau, video_start, L, mr)
    got = torch.ops.fastcar.temporal_gate(q, k, age, tau, video_start, L, mr)
    for w, o, name in zip(want, got, ("replay", "tas", "slot", "write"), strict=True):
        assert o.dtype == w.dtype and o.shape == w.shape, name
        if name == "tas":
            torch.testing.assert_close(o, w, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-5)
        else:
            assert torch.equal(o, w), name
    if mixed:
        assert want[0].any() and not want[0].all()  # the case exercises both decisions
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(B, L, 24, generator=g).to(dtype)
    branch = torch.randn(B, S, 24, generator=g)  # float32 output stored into a cache of the model's dtype
    replay, _, slot, write = want
    assert torch.equal(torch.ops.fastcar.mlp_cache_read(cache, slot), ops.mlp_cache_read(cache, slot))
    w_cache, w_age = ops.mlp_cache_update(cache, age, branch, replay, slot, write)
    o_cache, o_age = torch.ops.fastcar.mlp_cache_update(cache, age, branch, replay, slot, write)
    assert torch.equal(o_cache, w_cache) and torch.equal(o_age, w_age)
    assert write.any() and not torch.equal(o_cache, cache)  # rows were written; the inputs are left as they were
    for update in (torch.ops.fastcar.mlp_cache_update_, ops.mlp_cache_update_):  # in place: kernel, composite
        for strided in (False, True):
            c = cache.transpose(0, 1).contiguous().transpose(0, 1) if strided else cache.clone()
            a = age.clone()
            update(c, a, branch, replay, slot, write)
            assert torch.equal(c, w_cache) and torch.equal(a, w_age), (update, strided)


def test_kernels_are_the_cpu_kernels():
    """A CPU call reaches the C++ kernel (the profiler sees no ATen op under it), not the composite."""
    from torch.profiler import ProfilerActivity, profile

    q, k, age = _gate_inputs(2, 4, 2, 1, 40, 16, 8, torch.float32, seed=0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ops.fastcar.temporal_gate(q, k, age, torch.tensor(0.0), torch.tensor(0), 8, 0)
    names = {e.name for e in prof.events()}
    assert "fastcar::temporal_gate" in names and "aten::index_select" not in names and "aten::remainder" not in names


def test_without_compiler_composite_runs_and_says_so(tmp_path):
    """No C++ compiler: one line on stderr says the kernels are off, and the ops give the composite's results."""
    code = ("import torch\nfrom fastcar_compile.torch import native, ops\nassert native.load() is None\n"
            "q = torch.randn(2, 4, 1, 8); k = torch.randn(2, 2, 20, 8); age = torch.zeros(2, 4, dtype=torch.long)\n"
            "a = torch.ops.fastcar.temporal_gate(q, k, age, torch.tensor(0.0), torch.tensor(0), 4, 0)\n"
            "b = ops.temporal_gate(q, k, age, torch.tensor(0.0), torch.tensor(0), 4, 0)\n"
            "assert all(torch.equal(x, y) for x, y in zip(a, b))\nprint('ok')\n")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CXX": str(tmp_path / "no-such-g++")}
    env.pop("FASTCAR_QUIET", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "C++ kernels OFF" in lines[0] and "ATen composite runs" in lines[0], r.stderr


def test_eager_steps_update_the_state_in_place():
    """FastCarDecoder's eager steps write the MLP caches into its own state (no copy per step) and give what
    the functional program gives from the same inputs, which it leaves as they were."""
    sys.path.insert(0, os.path.dirname(__file__))
    import zoo

    import fastcar_compile.torch as fct

    dec = fct.apply(zoo.build_model("llama"), frame_tokens=4, threshold=-1e9).fastcar
    g = torch.Generator().manual_seed(0)
    hkv, d = dec.kv_shape
    past = [torch.randn(2, hkv, 9, d, generator=g) for _ in range(dec.num_kv)]
    dec.reset(2)
    dec.state = [s.normal_(generator=g) if s.is_floating_point() else s.fill_(0) for s in dec.state]
    before = [s.clone() for s in dec.state]
    ids, mask, pos = torch.tensor([[3], [5]]), torch.ones(2, 10, dtype=torch.long), torch.full((2, 1), 9)
    with torch.no_grad():
        want = dec.program(ids, mask, pos, *past, torch.tensor(0), dec.threshold_tensor(), *before)
        state_ids = [s.data_ptr() for s in dec.state]
        got = dec(ids, mask, pos, *past)
    assert [s.data_ptr() for s in dec.state] == state_ids
    n = 1 + dec.num_kv
    for a, b in zip(want[:n], got, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    for a, b in zip(want[n:n + len(dec.state)], dec.state, strict=True):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(before, dec.state, strict=True))  # the step wrote state
