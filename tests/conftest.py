"""Shared fixtures: the model zoo, exported once per test session (or reused from $FASTCAR_ZOO_DIR)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config: pytest.Config) -> None:
    try:  # torch is an optional extra: tests that need it import it themselves
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def dit_tiny_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`fastcar-compile export --dit tiny` once per session (random weights, seed 0; dit.onnx + dit.text.onnx),
    shared read-only by the DiT test modules."""
    from fastcar_compile.cli import main

    out = tmp_path_factory.mktemp("dit") / "dit.onnx"
    assert main(["export", "--dit", "tiny", "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def dit_tiny_eager():
    """The eager PyTorch DiT with the weights `export --dit tiny` drew (seed 0): the compiled DiT modes' reference
    (one per module: a test may wrap it in a stream runtime that keeps state on it)."""
    from fastcar_compile.dit.config import PRESETS
    from fastcar_compile.dit.model import build

    return build(PRESETS["tiny"], seed=0)


@pytest.fixture(scope="session")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where exported graphs live: $FASTCAR_ZOO_DIR (kept between runs) or a per-session temp dir."""
    env = os.environ.get("FASTCAR_ZOO_DIR")
    if env:
        Path(env).mkdir(parents=True, exist_ok=True)
        return Path(env)
    return tmp_path_factory.mktemp("zoo")


@pytest.fixture(scope="session")
def zoo_model(zoo_dir: Path) -> Callable[[str, str], Path]:
    """zoo_model(family, exporter, dtype="float32") -> path of the exported .onnx, exported at most once per session.

    A combination listed in zoo.KNOWN_EXPORT_FAILURES is skipped with its recorded reason when it fails the
    recorded way; any other export failure fails the test (a broken exporter must not pass silently).
    """
    zoo = pytest.importorskip(
        "zoo", reason="the model zoo needs torch and transformers (pip install '.[torch]')"
    )
    results: dict[tuple[str, str, str], Path | BaseException] = {}

    def get(family: str, exporter: str, dtype: str = "float32") -> Path:
        key = (family, exporter, dtype)
        if key not in results:
            try:
                results[key] = zoo.export(family, exporter, zoo_dir, dtype)
            except Exception as exc:  # remembered so the next test does not retry a 10 s export
                results[key] = exc
        got = results[key]
        if isinstance(got, BaseException):
            known = zoo.KNOWN_EXPORT_FAILURES.get((family, exporter))
            if known is not None and known[0] in str(got):
                pytest.skip(f"{family}/{exporter} cannot be exported here: {known[1]} ({known[0]})")
            raise got
        return got

    return get


@pytest.fixture(scope="session")
def genai_model(zoo_dir: Path) -> Callable[..., Path]:
    """genai_model(family, precision, sizes=None) -> folder of an onnxruntime-genai builder graph (built at most
    once; `sizes`: config fields overridden, genai_zoo.build)."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install '.[genai]')")
    genai_zoo = pytest.importorskip("genai_zoo", reason="the genai graphs need torch and transformers")
    results: dict[tuple, Path | BaseException] = {}

    def get(family: str, precision: str = "fp32", sizes: dict | None = None) -> Path:
        key = (family, precision, tuple(sorted((sizes or {}).items())))
        if key not in results:
            try:
                results[key] = genai_zoo.build(family, precision, zoo_dir, sizes)
            except Exception as exc:  # remembered: a failed build is not retried by every test
                results[key] = exc
        got = results[key]
        if isinstance(got, BaseException):
            raise got
        return got

    return get


@pytest.fixture(scope="session")
def fc_compile() -> Callable:
    """The API `fastcar_compile.compile`; the tests skip (only) while it does not exist yet."""
    mod = pytest.importorskip("fastcar_compile")
    fn = getattr(mod, "compile", None)
    if fn is None:
        pytest.skip("fastcar_compile.compile is not implemented yet")
    return fn


@pytest.fixture(scope="session")
def native_lib() -> Path:
    """The native kernels' library; the test is skipped where it cannot be built (no compiler or headers) and
    fails where a compiler exists but the build breaks."""
    from fastcar_compile.runtime.native import build

    try:
        return build.build(log=lambda *_: None)
    except build.Skipped as exc:
        pytest.skip(f"native kernels cannot be built here: {exc}")
    except RuntimeError as exc:
        pytest.fail(str(exc))
