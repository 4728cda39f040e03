"""Models compiled before the one TemporalGate op name its forms TemporalGatePackedRopeRows, TemporalGatePackedRows,
... (contract.LEGACY_GATE_OPS): such a model, written at test time from a fresh compile by tests/gate_models.py
(old op names, old input order, no form attributes), still loads and runs on the native kernel, equal to the eager
PyTorch FastCar reference (logits, replay decisions, TAS, state) when FastCarSession loads it with the kernels."""

from __future__ import annotations

from pathlib import Path

import onnx
import ort_driver
import pytest
import test_pass_reference as tpr
from gate_models import legacy

from fastcar_compile.core import contract

L = tpr.L


def _legacy_file(path: Path) -> tuple[Path, list[str]]:
    """The compiled model at `path` written as before the one gate op; its gate op names."""
    model = onnx.load(str(path))
    old = legacy(model)
    out = path.with_name("legacy.onnx")
    onnx.save(old, str(out))
    return out, [n.op_type for n in old.graph.node if n.domain == contract.DOMAIN and "Gate" in n.op_type]


@pytest.mark.parametrize("case,old_name", [
    (tpr.Case("llama", "dynamo20", "rope", max_replay=2, pad=(0, 2), video_start=3, per_layer=True, chunk=L + 2),
     "TemporalGatePackedRopeRows"),
    (tpr.Case("llama", "dynamo20", "raw", max_replay=0, pad=(2, 0), video_start=2, runtime_tau=True),
     "TemporalGatePackedRows"),
], ids=["rope-packed-rows", "raw-rows"])
def test_model_with_old_gate_names_matches_eager_reference(zoo_model, fc_compile, tmp_path, case, old_name):
    seen: list[list[str]] = []

    def session(path: Path):  # FastCarSession's own loading: the native library registered as users get it
        from fastcar_compile.runtime import FastCarSession

        old, names = _legacy_file(path)
        seen.append(names)
        ort_driver.make_session(old, native=True)  # skips where the kernels are not built
        fc = FastCarSession(old, native=True, threads=1)
        assert fc.native_library is not None
        return fc.session

    tpr.check_against_reference(zoo_model, fc_compile, tmp_path, case, session=session)
    assert seen == [[old_name, old_name]]  # both layers' gates under the old name
