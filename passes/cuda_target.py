"""The CUDA provider (`--provider cuda`, CudaProviderPass at the end of the finish stage): a compiled model whose every node ONNX Runtime's CUDAExecutionProvider runs.

The `ai.fastcar` ops' kernels are CPU C++ (runtime/native): under the CUDA provider each would be placed on the
CPU, a device round trip per layer and step. For CUDA the compiler inlines the ops' ONNX function bodies (the
model-local functions every compiled model carries, standard and `com.microsoft` ops), so nothing of
`ai.fastcar` is left, and checks each node (subgraphs included) against the provider's kernel registry
(`cuda_ep_kernels.txt`, ONNX Runtime's own generated table, its source named there): an op the provider has no
kernel for at the model's opset refuses the compile in one line naming it.
"""

from __future__ import annotations

import functools
from pathlib import Path

import onnx_ir as ir

from fastcar_compile.core import contract
from fastcar_compile.core.errors import FastCarError

TABLE = Path(__file__).with_name("cuda_ep_kernels.txt")
ONNX_DOMAINS = ("", "ai.onnx")
EXPANDED = "expanded"  # no kernel, but ONNX Runtime rewrites the node before placement
NO_FLOAT32 = "no float32"


@functools.cache
def kernels() -> dict[tuple[str, str], tuple[int, int | None, str]]:
    """(domain, op) -> (first opset, last opset or None, note) of the CUDA provider's kernels."""
    table = {}
    for line in TABLE.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        domain, op, first, last, *note = (line.split("\t") + [""])[:5]
        table[(domain, op)] = (int(first), int(last) if last else None, note[0] if note else "")
    return table


def _nodes(graph):
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.g.node:
                yield from _nodes(a.g)
            for g in a.graphs:
                yield from _nodes(g)


def _with_default_attributes(model):
    """A copy where every call of a local function states the attributes it leaves to the function's defaults
    (the inliner substitutes only attributes the call sets: a Constant reading a default would be left empty)."""
    import onnx

    defaults = {(f.domain, f.name): {a.name: a for a in f.attribute_proto} for f in model.functions}
    out = onnx.ModelProto()
    out.CopyFrom(model)

    def fill(graph):
        for node in graph.node:
            given = {a.name for a in node.attribute}
            for name, a in defaults.get((node.domain, node.op_type), {}).items():
                if name not in given:
                    node.attribute.append(a)
            for a in node.attribute:
                if a.g.node:
                    fill(a.g)

    fill(out.graph)
    for f in out.functions:
        fill(f)
    return out


def unsupported(model) -> list[str]:
    """'domain::Op (opset v)' of every op in `model` that the CUDA provider has no kernel for (sorted, unique);
    a float32 graph's GroupQueryAttention-style ops (kernels for float16/bfloat16 only) count as unsupported."""
    opsets = {d.domain or "ai.onnx": d.version for d in model.opset_import}
    table = kernels()
    bad = set()
    for node in _nodes(model.graph):
        domain = "ai.onnx" if node.domain in ONNX_DOMAINS else node.domain
        version = opsets.get(domain, 1)
        row = table.get((domain, node.op_type))
        ok = row is not None and row[0] <= version and (row[1] is None or version <= row[1]) and \
            row[2] != NO_FLOAT32
        if not ok:
            bad.add(f"{domain}::{node.op_type} (opset {version})")
    return sorted(bad)


def for_cuda(model):
    """`model` with its local functions inlined (nothing of `ai.fastcar` left) and marked for CUDA; raises
    FastCarError naming the ops the CUDA provider lacks."""
    import onnx
    import onnx.inliner

    model = _with_default_attributes(model)
    out = onnx.inliner.inline_local_functions(model)
    del out.functions[:]
    read = {i for n in _nodes(out.graph) for i in n.input} | {o.name for o in out.graph.output}
    kept = [t for t in out.graph.initializer if t.name in read]  # what only the unused functions read
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    used = {n.domain for n in _nodes(out.graph)}
    keep = [d for d in out.opset_import if d.domain in ONNX_DOMAINS or d.domain in used]
    del out.opset_import[:]
    out.opset_import.extend(keep)
    bad = unsupported(out)
    if bad:
        raise FastCarError(f"--provider cuda: ONNX Runtime's CUDA provider has no kernel for {', '.join(bad[:5])}"
                           f"{' ...' if len(bad) > 5 else ''}; compile for --provider cpu or without the "
                           "option that emits it (e.g. --native-attention off for a float32 GroupQueryAttention)")
    meta = [p for p in out.metadata_props if p.key != contract.PROVIDER_KEY]
    del out.metadata_props[:]
    out.metadata_props.extend(meta)
    out.metadata_props.add(key=contract.PROVIDER_KEY, value="cuda")
    return out


class CudaProviderPass(ir.passes.FunctionalPass):
    """For ONNX Runtime's CUDA provider: the ai.fastcar function bodies inlined, every op checked against its kernels."""

    def __init__(self, notes: list[str]):
        super().__init__()
        self.notes = notes

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values()):
            raise FastCarError("--provider cuda: the model keeps its weights in external data, which the CUDA "
                               "rewrite does not carry yet; compile a model under 2 GiB, or for --provider cpu")
        out = for_cuda(ir.to_proto(model))
        ops = {f"{n.domain or 'ai.onnx'}::{n.op_type}" for n in _nodes(out.graph)}
        self.notes.append(f"--provider cuda: ai.fastcar function bodies inlined; {len(ops)} op types, each with a "
                          "CUDA provider kernel")
        return ir.passes.PassResult(ir.from_proto(out), modified=True)
