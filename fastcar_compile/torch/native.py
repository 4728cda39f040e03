"""The C++ CPU kernels of the fastcar::* torch ops (fastcar_torch_ops.cc), built on first use with the system
C++ compiler against the installed torch and loaded with torch.ops.load_library.

Built like the ONNX Runtime kernels (runtime/native): into the per-user cache
~/.cache/fastcar-compile/torch-native/<torch version>-<source hash>/, once per torch version and source, under a
lock, the library renamed into place. No ninja and no Python headers are needed (a plain g++ command against
torch's own include and lib folders). Without a compiler the ATen composite of ops.py runs (same results,
slower) and one line says so.

FASTCAR_TORCH_NATIVE: unset or 1 = use (build if needed); 0 = never (the composite; A/B timing).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from fastcar_compile.runtime.native.build import CACHE_ROOT, Skipped

ENV = "FASTCAR_TORCH_NATIVE"
SRC = Path(__file__).resolve().parent / "fastcar_torch_ops.cc"
LIB_NAME = "libfastcar_torch_ops.so"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-w")

_state: dict[str, object] = {}  # "lib": the loaded path, or "reason": why not (once per process)


def _flags() -> list[str]:
    from torch.utils import cpp_extension

    inc = [f"-I{p}" for p in cpp_extension.include_paths()]
    libdir = cpp_extension.library_paths()
    abi = int(torch.compiled_with_cxx11_abi())
    links = [f"-L{p}" for p in libdir] + [f"-Wl,-rpath,{p}" for p in libdir] + ["-lc10", "-ltorch_cpu"]
    return [*FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *inc, str(SRC), *links]


def lib_path() -> Path:
    """Where the library for this torch and this kernel source lives (built or not)."""
    h = hashlib.sha256(SRC.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:12]
    return CACHE_ROOT / "torch-native" / f"torch{torch.__version__}-{h}" / LIB_NAME


def build(log=lambda msg: None) -> Path:
    """Compile the library into the cache unless it is there. Raises Skipped (no compiler) or RuntimeError (the
    compiler failed); concurrent callers wait on a lock file."""
    lib = lib_path()
    if lib.is_file():
        return lib
    cxx = shutil.which(os.environ.get("CXX") or "g++") or (None if "CXX" in os.environ else shutil.which("clang++"))
    if cxx is None:
        raise Skipped(f"no C++ compiler found ({os.environ.get('CXX', 'g++')}; install g++ or set CXX)")
    lib.parent.mkdir(parents=True, exist_ok=True)
    with open(lib.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.is_file():  # another process built it while we waited
            return lib
        log(f"fastcar-compile: building the fastcar::* CPU kernels once into {lib.parent} ...")
        tmp = lib.parent / f".{LIB_NAME}.{os.getpid()}.tmp"
        r = subprocess.run([cxx, *_flags(), "-o", str(tmp)], capture_output=True, text=True)
        if r.returncode != 0:
            tmp.unlink(missing_ok=True)
            last = (r.stderr.strip().splitlines() or ["no output"])[-1][:200]
            raise RuntimeError(f"{cxx} failed (exit {r.returncode}: {last})")
        os.replace(tmp, lib)
    return lib


def _say(msg: str) -> None:
    if os.environ.get("FASTCAR_QUIET", "0") != "1":
        print(msg, file=sys.stderr, flush=True)


def load() -> Path | None:
    """Register the CPU kernels (building them on first use); None when they are off, with one line saying
    why (once per process). The ops work either way."""
    if "lib" in _state or "reason" in _state:
        return _state.get("lib")  # type: ignore[return-value]
    if os.environ.get(ENV) == "0":
        _state["reason"] = f"{ENV}=0"
        return None
    try:
        lib = build(log=_say)
        torch.ops.load_library(str(lib))
    except (Skipped, RuntimeError, OSError) as exc:
        _state["reason"] = str(exc)
        _say(f"fastcar-compile: fastcar::* C++ kernels OFF ({exc}); the ATen composite runs (slower)")
        return None
    _state["lib"] = lib
    return lib


def status() -> str:
    """One line: whether the CPU kernels are in use, and why not."""
    lib = _state.get("lib")
    return f"fastcar::* C++ CPU kernels in use ({lib})" if lib else \
        f"fastcar::* C++ CPU kernels off ({_state.get('reason', 'not loaded yet')})"
