"""The DiT target's second file: the prompt graph (text embeddings -> cross-attention K/V) is copied beside the
compiled step graph under the output's name, with AnnCA's prompt-key codes appended where the plan has AnnCA.

Staged with the step graph and committed by the same save (passes/save.py), so the two files appear together.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir

from fastcar_compile.core import contract
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.fileio import copy_file
from fastcar_compile.fastar.config import hasher_of
from fastcar_compile.passes.context import DiTContext
from fastcar_compile.passes.dit_annca import prompt_codes
from fastcar_compile.passes.save import Staging


def prompt_source(step: Path, model: ir.Model) -> Path:
    """The prompt graph beside the input step graph (its metadata names it), which must exist."""
    name = model.metadata_props.get(contract.DIT_TEXT_GRAPH_KEY, "")
    if not name or Path(name).name != name or name in (".", ".."):
        raise FastCarError(f"{step}: its {contract.DIT_TEXT_GRAPH_KEY} metadata ({name!r}) is not a file name; "
                           "export the DiT again")
    path = step.with_name(name)
    if not path.is_file():
        raise FastCarError(f"{step}: its prompt graph {path} is missing; keep the export's two graphs together")
    return path


class StagePromptGraphPass(ir.passes.InPlacePass):
    """Stage the prompt graph (and its external data, holes kept) beside the model under the output's name."""

    def __init__(self, ctx: DiTContext, staging: Staging):
        super().__init__()
        self.ctx, self.staging = ctx, staging

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        ctx, source = self.ctx, self.ctx.prompt_source
        if source is None or ctx.prompt_name is None:
            raise FastCarError("an in-memory DiT step graph has no prompt graph to write beside it; compile the "
                               "exported file")
        self.staging.write(model)
        proto = onnx.load(str(source), load_external_data=False)
        data_name = ctx.prompt_name + ".data"
        old = set()
        for t in proto.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                for e in t.external_data:
                    if e.key == "location":
                        old.add(e.value)
                        e.value = data_name
        if len(old) > 1:
            raise FastCarError(f"{source}: its weights are in {len(old)} files; keep them in one")
        if old:
            copy_file(source.with_name(old.pop()), self.staging.add(data_name))
        annca = {ctx.plan[m.layer].annca for m in ctx.matches} - {None}
        if annca:  # AnnCA hashes the prompt keys once per prompt, in the prompt graph
            more = ir.to_proto(prompt_codes(ctx.cfg, hasher_of(annca.pop(), ctx.cfg.head_dim))).graph
            proto.graph.node.extend(more.node)
            proto.graph.initializer.extend(more.initializer)
            proto.graph.output.extend(more.output)
        onnx.save(proto, str(self.staging.add(ctx.prompt_name)))
        return ir.passes.PassResult(model, modified=False)
