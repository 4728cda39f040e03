"""The native kernels built for one x86-64 level only (build.py --isa; the default build picks AVX-512 / AVX2 clones
at load time, so on a modern CPU the SSE fallback never runs unless built alone): the dense core's cases and one
compressed-mode trace against the same NumPy references as the default build's tests."""

from __future__ import annotations

import os

import numpy as np
import pytest
import test_compressed_attention_sizes as sizes
import test_dense_kernel as dense
from kernel_driver import run_kernel

from fastcar_compile.fastar.attention import run_trace
from fastcar_compile.fastar.config import KVCompressConfig
from fastcar_compile.runtime.native import build

pytestmark = pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="x86-64 ISA levels")


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(flag in line.split() for line in f if line.startswith("flags"))
    except OSError:
        return False


@pytest.fixture(scope="module", params=["x86-64-v2", "x86-64-v3"])
def isa_lib(request, monkeypatch_module):
    if request.param == "x86-64-v3" and not (_cpu_has("avx2") and _cpu_has("fma")):
        pytest.skip("this CPU has no AVX2 + FMA")
    try:
        lib = build.build(log=lambda *_: None, isa=request.param)
    except build.Skipped as exc:
        pytest.skip(f"native kernels cannot be built here: {exc}")
    monkeypatch_module.setenv("FASTCAR_NATIVE", str(lib))  # library_path() (the tests' sessions) loads it
    return lib


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.parametrize("name", list(dense.CASES))
def test_dense_core_at_one_isa(isa_lib, name):
    dense.test_dense_core_equals_numpy(name)


def test_compressed_trace_at_one_isa(isa_lib):
    """The grouped (GroupAttend) path with eviction and TempCache merging: outputs within 1e-4 of run_trace."""
    hq, hkv, d, settings = sizes.CASES["16/2x64 tempcache bounded"]
    cfg = KVCompressConfig(**settings, frame_tokens=sizes.L, video_start=0)
    q, k, v = sizes._trace(np.random.default_rng(5), 72, hq, hkv, d)
    ref = run_trace(q, k, v, cfg)
    got, _ = run_kernel(cfg, q, k, v, [6] + [1] * 30 + [4] + [1] * 32)
    assert np.abs(got - ref.out).max() <= 1e-4


def test_default_library_exports_only_the_entry_point(native_lib):
    """The default build's ifunc-dispatched kernels (DenseItem, CompressedItem, GroupAttend) have internal linkage:
    GCC exports a target_clones ifunc despite -fvisibility=hidden, and an older cached library loaded RTLD_GLOBAL
    would then interpose its own (other struct layouts). nm lists the dynamic symbols independently of the build."""
    import shutil
    import subprocess

    # the default build itself (conftest's native_lib: build.build() with no ISA), not library_path(): the isa_lib
    # fixture above points FASTCAR_NATIVE at a single-ISA build (no clones, nothing to leak) for this whole module
    lib = native_lib
    if shutil.which("nm") is None:
        pytest.skip("no nm here")
    syms = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    ours = [line.split()[-1] for line in syms.splitlines() if "fastcar" in line or "RegisterCustomOps" in line]
    assert ours == ["RegisterCustomOps"], ours


@pytest.mark.parametrize("undef,clones", [([], True), (["-U__x86_64__"], False)])
def test_clones_only_where_the_compiler_knows_the_arches(undef, clones):
    """FASTCAR_CLONES names x86-64 arch levels only for GCC >= 12 on x86-64 (elsewhere, e.g. aarch64, the header
    must still compile): the preprocessor's view of dense_attention.h with and without __x86_64__."""
    import shutil
    import subprocess

    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++")
    text = (build.HERE / "dense_attention.h").read_text()  # the guard block alone (system headers need x86)
    start = text.index("#ifndef FASTCAR_CLONES")
    block = text[start:text.index("#endif\n#endif", start) + len("#endif\n#endif")] + "\n"
    out = subprocess.run([cxx, "-std=c++17", "-E", "-dM", *undef, "-x", "c++", "-"], input=block,
                         capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("#define FASTCAR_CLONES"))
    assert ("target_clones" in line) == clones, line
