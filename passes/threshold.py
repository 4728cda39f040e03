"""Bake a threshold into a compiled model: the default of `fastcar_threshold` and `fastcar.threshold`.

Compiler-side (it edits the graph); the runtime's calibration picks tau and calls `fastcar_compile.api.
bake_threshold`, which runs this pass. A model written before the defaults left the graph inputs
(contract.OVERRIDABLE) comes out in today's form, so ONNX Runtime no longer warns when it loads it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from fastcar_compile.core import contract
from fastcar_compile.core.errors import FastCarError


class BakeThresholdPass(ir.passes.InPlacePass):
    """Set tau; a scalar fills every layer of a per-layer-threshold model."""

    def __init__(self, tau, where: str = "the model"):
        super().__init__()
        self.tau = contract.check_thresholds(tau, "tau")
        self.where = where

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        value = graph.initializers.get(contract.THRESHOLD)
        meta = contract.FastCarMetadata.from_props(model.metadata_props)
        if value is None or value.const_value is None or meta is None:
            raise FastCarError(f"{self.where} has no default {contract.THRESHOLD}; is it a "
                               "FastCar-compiled model?")
        old = value.const_value.numpy()
        new = self.tau.astype(np.float32)
        if new.ndim == 0 and old.ndim == 1:
            new = np.full(old.shape, new, dtype=np.float32)
        if new.shape != old.shape:
            raise FastCarError(f"tau has shape {list(new.shape)} but {contract.THRESHOLD} has shape {list(old.shape)}")
        value.const_value = ir.tensor(new, name=contract.THRESHOLD)
        baked = float(new) if new.ndim == 0 else [float(x) for x in new]
        model.metadata_props.update(dataclasses.replace(meta, threshold=baked).to_props())
        keep = [v for v in graph.inputs if not (v.name in contract.OVERRIDABLE and v.const_value is not None)]
        if len(keep) != len(graph.inputs):
            graph.inputs.clear()
            graph.inputs.extend(keep)
        return ir.passes.PassResult(model, modified=True)
