"""Build the native ai.fastcar kernels (libfastcar_ops.so) from fastcar_ops.cc; skip cleanly when impossible.

The runtime calls `build()` lazily on first use (FastCarSession), so the README's install command is all a
user runs; this script only forces or inspects that build. The library goes into a per-user cache,
~/.cache/fastcar-compile/native/<ORT version>-<source hash>/ (XDG_CACHE_HOME is honoured), so an installed
package folder is never written and a new onnxruntime or kernel source gets its own build.

ONNX Runtime's Python wheel ships no C headers. Searched in order:
  1. $ORT_INCLUDE_DIR (a folder holding onnxruntime_c_api.h),
  2. Debian/Ubuntu `libonnxruntime-dev` (/usr/include/onnxruntime; Debian trixie has 1.21),
  3. a header cache (~/.cache/fastcar-compile/ort-include), filled once from the npm registry package
     `com.github.asus4.onnxruntime` (MIT; ships ORT 1.2x headers) with `npm pack` when npm exists and
     FASTCAR_NATIVE_FETCH is not 0. Only the header files are kept.
The kernels use no symbol from libonnxruntime (the API table arrives at registration), so nothing is
linked. Exit code 0 both when built and when skipped (the function bodies then run); 1 only when a
compiler was found and the build failed.

    python -m fastcar_compile.runtime.native.build [--force] [--quiet] [--isa x86-64-v2|v3|v4]   (prints the path)

The hot loops carry GCC target_clones (x86-64-v4 / v3 / baseline, chosen per CPU when the library loads), so a
cache shared by hosts of different CPUs stays correct; --isa builds a single level (tests of the fallback, A/B).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE / "fastcar_ops.cc"  # includes the headers beside it (compressed_attention.h)
LIB_NAME = "libfastcar_ops.so"
NPM_PACKAGE = "com.github.asus4.onnxruntime@0.4.9"
CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastcar-compile"
CACHE = CACHE_ROOT / "ort-include"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden")
NEEDED = ("onnxruntime_c_api.h", "onnxruntime_cxx_api.h", "onnxruntime_cxx_inline.h", "onnxruntime_float16.h",
          "onnxruntime_lite_custom_op.h")
MIN_API = 21


def _has_headers(d: Path) -> bool:
    return all((d / h).is_file() for h in NEEDED)


def _api_version(d: Path) -> int:
    m = re.search(r"#define ORT_API_VERSION (\d+)", (d / "onnxruntime_c_api.h").read_text(errors="replace"))
    return int(m.group(1)) if m else 0


def _fetch_npm(log) -> Path | None:
    """Unpack only the ORT headers from the npm package into the cache (one download, ~150 MB)."""
    npm = shutil.which("npm")
    if npm is None or os.environ.get("FASTCAR_NATIVE_FETCH", "1") == "0":
        return None
    with tempfile.TemporaryDirectory() as tmp:
        log(f"fetching ORT headers: npm pack {NPM_PACKAGE}")
        r = subprocess.run([npm, "pack", NPM_PACKAGE, "--silent"], cwd=tmp, capture_output=True, text=True,
                           timeout=600)
        tgz = [p for p in Path(tmp).glob("*.tgz")]
        if r.returncode != 0 or not tgz:
            log(f"npm pack failed: {r.stderr.strip()[-300:]}")
            return None
        part = CACHE.with_name(CACHE.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        with tarfile.open(tgz[0]) as tf:
            members = [m for m in tf.getmembers() if m.isfile() and "ios-arm64_x86_64-simulator/" in m.name
                       and "/Headers/" in m.name and m.name.endswith(".h")]
            lic = [m for m in tf.getmembers() if m.name == "package/LICENSE"]
            for m in members + lic:
                f = tf.extractfile(m)
                if f is not None:
                    (part / Path(m.name).name).write_bytes(f.read())
        if not _has_headers(part):
            shutil.rmtree(part, ignore_errors=True)
            log("npm package did not contain the ORT headers")
            return None
        shutil.rmtree(CACHE, ignore_errors=True)
        os.replace(part, CACHE)
    return CACHE


def find_headers(log=print, fetch: bool = True) -> Path | None:
    """The folder of onnxruntime_c_api.h and friends, or None."""
    cands = [os.environ.get("ORT_INCLUDE_DIR"), "/usr/include/onnxruntime",
             "/usr/include/onnxruntime/core/session", "/usr/local/include/onnxruntime", str(CACHE)]
    for c in cands:
        if c and _has_headers(Path(c)):
            return Path(c)
    return _fetch_npm(log) if fetch else None


def _ort_api_supported() -> int:
    """Highest C API version the installed onnxruntime serves (1.N -> N)."""
    import onnxruntime

    m = re.match(r"1\.(\d+)", onnxruntime.__version__)
    return int(m.group(1)) if m else 0


BASELINE_ISA = "x86-64-v2"  # what every x86-64 host this cache may serve runs; faster levels are ifunc clones
ISAS = ("x86-64-v2", "x86-64-v3", "x86-64-v4")


def _isa_flags(isa: str | None) -> list[str]:
    """-march for x86-64: the baseline plus runtime-picked clones (default), or exactly one level (`isa`, for
    tests and A/B: FASTCAR_CLONES empty)."""
    if os.uname().machine not in ("x86_64", "AMD64"):
        return []
    if isa is None:
        return [f"-march={BASELINE_ISA}"]
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {', '.join(ISAS)}, not {isa!r}")
    return [f"-march={isa}", "-DFASTCAR_CLONES="]


def lib_path(isa: str | None = None) -> Path:
    """Where the library for this onnxruntime and this kernel source lives (built or not)."""
    import onnxruntime

    sources = b"".join(f.read_bytes() for f in sorted(HERE.glob("*.cc")) + sorted(HERE.glob("*.h")))
    h = hashlib.sha256(sources + " ".join([*FLAGS, *_isa_flags(isa)]).encode()).hexdigest()[:12]
    return CACHE_ROOT / "native" / f"ort{onnxruntime.__version__}-{h}{'-' + isa if isa else ''}" / LIB_NAME


class Skipped(Exception):
    """The kernels cannot be built here; the message says why and what to install (one line)."""


def build(force: bool = False, log=print, isa: str | None = None) -> Path:
    """Compile the library into the cache if it is not there; return its path. `isa`: one x86-64 level only
    (ISAS) instead of the baseline with per-CPU clones.

    Raises Skipped (no compiler, no headers: ORT then runs the function bodies) or RuntimeError (a compiler
    was found and failed). Concurrent callers serialise on a lock file; the library appears atomically.
    """
    lib = lib_path(isa)
    if lib.is_file() and not force:
        return lib
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise Skipped("no C++ compiler found (install g++ or set CXX)")
    lib.parent.mkdir(parents=True, exist_ok=True)
    with open(lib.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.is_file() and not force:  # another process built it while we waited
            return lib
        inc = find_headers(log)
        if inc is None:
            raise Skipped("ONNX Runtime C headers not found (set ORT_INCLUDE_DIR, install libonnxruntime-dev, "
                          "or install npm so they can be fetched once)")
        api, have = _api_version(inc), _ort_api_supported()
        if api < MIN_API or api > have:
            raise Skipped(f"headers in {inc} are C API {api}; the installed onnxruntime serves "
                          f"{MIN_API}..{have}")
        tmp = lib.parent / f".{LIB_NAME}.{os.getpid()}.tmp"
        cmd = [cxx, *_isa_flags(isa), *FLAGS, f"-I{inc}", str(SRC), "-o", str(tmp)]
        log(" ".join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            tmp.unlink(missing_ok=True)
            log(r.stderr[-4000:])
            raise RuntimeError(f"native build failed ({cxx} exit {r.returncode}; rerun "
                               "`python -m fastcar_compile.runtime.native.build --force` to see why)")
        os.replace(tmp, lib)
    log(f"built {lib} (ORT C API {api})")
    return lib


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--isa", choices=ISAS, help="build for this x86-64 level only (default: the baseline with "
                    "AVX2 and AVX-512 clones picked at load time)")
    a = ap.parse_args(argv)
    log = (lambda *_: None) if a.quiet else (lambda m: print(f"native: {m}", file=sys.stderr))
    try:
        print(build(a.force, log, a.isa))
    except Skipped as exc:
        log(f"skipped: {exc}; ORT will run the function bodies")
    except RuntimeError as exc:
        print(f"native: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
