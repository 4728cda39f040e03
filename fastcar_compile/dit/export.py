"""Export a chunk-causal DiT to two ONNX graphs: the denoiser step (cache as graph I/O) and the prompt graph.

Step `dit.onnx`: latent [B, C, F, H, W], timestep [B, F], frame_start int64 [1], past.N.key|value
[B, heads, P, d] (P = cached tokens, may be 0), cross.N.key|value [B, heads, L, d] -> velocity
[B, C, F, H, W], present.N.key|value [B, heads, F*T, d] (the chunk's own K/V; the runtime owns the cache).
Prompt `dit.text.onnx`: text_embeds [B, L, text_dim] -> cross.N.key|value, run once per video.

A large config is exported from the meta device: the graph is traced without weights, and its initializers
are written as external data into a sparse, zero-filled file (no weight is ever materialised in memory).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from fastcar_compile.core.contract import (
    DIT_CONFIG_KEY,
    DIT_TEXT_GRAPH_KEY,
    DiTConfig,
    step_io,
    text_graph_path,
    text_io,
)
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.fileio import refuse_special, with_path

OPSET = 20
ALIGN = 4096  # external-data offsets page-aligned, so that ONNX Runtime can map them


def example_inputs(cfg: DiTConfig, device: str = "cpu", batch: int = 2, past_frames: int = 2,
                   text_len: int = 5, seed: int = 0) -> tuple:
    """Step inputs with distinct batch / past / prompt sizes, so that the exporter specialises none of them."""
    import torch

    g = torch.Generator().manual_seed(seed)
    f = cfg.chunk_frames

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device)

    kv = [rnd(batch, cfg.heads, past_frames * cfg.tokens_per_frame, cfg.head_dim) for _ in range(2 * cfg.layers)]
    kv += [rnd(batch, cfg.heads, text_len, cfg.head_dim) for _ in range(2 * cfg.layers)]
    timestep = torch.rand(batch, f, generator=g).to(device) * 1000
    return (rnd(batch, cfg.in_channels, f, cfg.latent_h, cfg.latent_w), timestep,
            torch.tensor([past_frames], dtype=torch.int64, device=device), *kv)


def _export(module, args: tuple, shapes, names: tuple[list[str], list[str]], optimize: bool):
    import torch

    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)  # torchvision note
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return torch.onnx.export(module, args, input_names=names[0], output_names=names[1], dynamic_shapes=shapes,
                                 opset_version=OPSET, dynamo=True, optimize=optimize, verbose=False)


def _save(prog, path: Path, meta: bool, metadata: dict[str, str]) -> None:
    """Write the program (or a composed (proto, stubs) pair); from the meta device, the initializers go to a
    sparse zero-filled `path.data`."""
    import onnx

    if isinstance(prog, tuple):
        proto, inits = prog
    elif not meta:
        prog.save(str(path))
        proto = onnx.load(str(path))
    else:
        inits = [(v.name, [int(d) for d in v.shape], int(v.dtype)) for v in prog.model.graph.initializers.values()]
        prog.save(str(path), include_initializers=False)
        proto = onnx.load(str(path), load_external_data=False)
    if meta:
        data = path.with_name(path.name + ".data")
        offset = 0
        del proto.graph.initializer[:]
        for name, shape, dtype in inits:
            dims = list(shape)
            t = onnx.TensorProto(name=name, dims=dims, data_type=dtype)
            t.data_location = onnx.TensorProto.EXTERNAL
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(dtype).itemsize
            length = math.ceil(itemsize * math.prod(dims))
            for k, v in (("location", data.name), ("offset", str(offset)), ("length", str(length))):
                t.external_data.add(key=k, value=v)
            proto.graph.initializer.append(t)
            offset += -(-length // ALIGN) * ALIGN
        with open(data, "wb") as fh:  # a hole: zero bytes read back, no disk blocks, no memory
            fh.truncate(offset)
    for k, v in metadata.items():
        proto.metadata_props.add(key=k, value=v)
    onnx.save(proto, str(path))


def export_dit(model, output: str | os.PathLike, *, weights: str = "random", compose: bool = True
               ) -> tuple[Path, Path]:
    """Export `model` (ChunkDiT, on CPU or the meta device) to `output` and its prompt graph beside it,
    atomically (data files first, then the graphs); checks the I/O names written.

    compose: trace the embedding, ONE block and the head, and chain the block's graph `layers` times with
    each block's own weights (export time independent of depth: 30 traced blocks cost minutes); False
    traces the whole model."""
    import onnx
    import torch

    from fastcar_compile.dit.model import TextGraph

    cfg = model.cfg
    meta = next(model.parameters()).device.type == "meta"
    device = "meta" if meta else "cpu"
    n = cfg.layers
    out, text_out = Path(output), text_graph_path(output)
    batch, past, text = (torch.export.Dim("batch", min=1, max=64), torch.export.Dim("past", min=0),
                         torch.export.Dim("text", min=1))
    step_shapes = ({0: batch}, {0: batch}, None,
                   tuple([{0: batch, 2: past}] * (2 * n) + [{0: batch, 2: text}] * (2 * n)))
    ex = example_inputs(cfg, device)
    text_ex = (torch.randn(2, 5, cfg.text_dim, generator=torch.Generator().manual_seed(1)).to(device),)
    metadata = {DIT_CONFIG_KEY: cfg.to_json(), DIT_TEXT_GRAPH_KEY: text_out.name, "fastcar.dit_weights": weights}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmpdir = Path(tempfile.mkdtemp(dir=out.parent, prefix=".export-"))
    try:
        step = _compose_step(model, ex, (batch, past, text), meta) if compose else _export(model, ex, step_shapes,
                                                                                      step_io(n), not meta)
        prompt = _export(TextGraph(model), text_ex, ({0: batch, 1: text},), text_io(n), not meta)
        _save(step, tmpdir / out.name, meta, metadata)
        _save(prompt, tmpdir / text_out.name, meta, {DIT_CONFIG_KEY: cfg.to_json()})
        for path, names in ((tmpdir / out.name, step_io(n)), (tmpdir / text_out.name, text_io(n))):
            proto = onnx.load(str(path), load_external_data=False)
            got = ([i.name for i in proto.graph.input], [o.name for o in proto.graph.output])
            if got != (list(names[0]), list(names[1])):
                raise FastCarError(f"the exporter broke the I/O contract of {path.name}: inputs {got[0][:5]}..., "
                                   f"outputs {got[1][:3]}...")
        for f in (out, text_out):
            refuse_special(f)
        models = {out.name, text_out.name}
        for f in sorted(tmpdir.iterdir(), key=lambda p: p.name in models):  # data files before the graphs
            os.replace(f, out.parent / f.name)
    except OSError as exc:
        raise with_path(exc, out) from None
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return out, text_out


def check_step(model, step_path: str | os.PathLike, text_path: str | os.PathLike) -> float:
    """Max |difference| between ONNX Runtime and the eager model over the prompt graph's K/V and two steps
    (an empty cache, then two cached frames; CFG batch of 2). NaN or infinity on either side is an error."""
    import numpy as np
    import torch

    from fastcar_compile.dit.stream import OrtDiT

    cfg = model.cfg
    ort_model = OrtDiT(step_path, text_path)
    g = torch.Generator().manual_seed(2)
    text = torch.randn(2, 7, cfg.text_dim, generator=g)
    worst = 0.0
    with torch.no_grad():
        want_cross = [t.numpy() for t in model.text_kv(text)]
        got_cross = ort_model.text_kv(text.numpy())
        pairs = list(zip(got_cross, want_cross, strict=True))
        for past_frames in (0, 2):
            ex = list(example_inputs(cfg, batch=2, past_frames=past_frames, seed=3 + past_frames))
            ex = ex[:3 + 2 * cfg.layers] + [torch.from_numpy(c) for c in want_cross]
            want = [t.numpy() for t in model(*ex)]
            got = ort_model.step(ex[0].numpy(), ex[1].numpy(), int(ex[2]), [t.numpy() for t in ex[3:3 + 2 * cfg.layers]],
                                 want_cross)
            pairs += list(zip(got, want, strict=True))
    for got, want in pairs:
        if not (np.isfinite(want).all() and np.isfinite(got).all()):  # NaN - NaN is no match
            raise FastCarError(f"{step_path}: the outputs hold NaN or infinity (eager: "
                               f"{int((~np.isfinite(want)).sum())}, ONNX Runtime: {int((~np.isfinite(got)).sum())} "
                               "values); the model is broken")
        worst = max(worst, float(np.abs(got - want).max()))
    return worst


def _part(module, args: tuple, shapes, names: tuple[list[str], list[str]], meta: bool, tmp: Path):
    """One traced part (unoptimised, so that its initializers keep their parameter names): its graph and
    initializers as {name: (dims, onnx dtype, array or None on the meta device)}."""
    import onnx

    prog = _export(module, args, shapes, names, optimize=False)
    inits = {v.name: ([int(d) for d in v.shape], int(v.dtype), None if meta else v.const_value.numpy())
             for v in prog.model.graph.initializers.values()}
    prog.save(str(tmp), include_initializers=False)
    proto = onnx.load(str(tmp), load_external_data=False)
    for node in proto.graph.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise FastCarError(f"the traced {type(module).__name__} holds a subgraph ({node.op_type}); export "
                               "with compose=False")
    return proto, inits


def _compose_step(model, ex: tuple, dims: tuple, meta: bool):
    """The step graph from three traces (embedding, one block, head): the block's nodes are copied once per
    layer with renamed values, wired x -> x, and given that layer's weights (`blocks.i.` + the block's own
    parameter names). Returns (proto, initializer stubs) for _save; real weights are embedded."""
    n = model.cfg.layers
    (pre, pre_w), (blk, blk_w), (head, head_w) = _trace_parts(model, ex, dims, meta)
    out = _Composed(meta)
    out.add(pre, {name: name for name in _EMBED_INPUTS} | {o.name: o.name for o in pre.graph.output}, "embed/", pre_w)
    params = {name for name, _ in model.blocks[0].named_parameters()}
    for i in range(n):
        rename = dict(zip(_BLOCK_INPUTS, [f"tokens_{i}", "modulation", "rope_cos", "rope_sin", f"past.{i}.key",
                                          f"past.{i}.value", f"cross.{i}.key", f"cross.{i}.value"], strict=True))
        rename.update(x_out=f"tokens_{i + 1}", k=f"present.{i}.key", v=f"present.{i}.value")
        state = {k: v.detach().numpy() for k, v in model.blocks[i].named_parameters()} if not meta else {}
        out.add(blk, rename, f"blocks.{i}/", blk_w,
                lambda k, i=i: f"blocks.{i}.{k}" if k in params else f"blocks.{i}/{k}",
                lambda k, a, state=state: state[k] if k in state else a)
    out.add(head, {"x": f"tokens_{n}", "t": "time_embedding", "velocity": "velocity"}, "head/", head_w)
    _wire_io(out.graph, pre, blk, head, n)
    return _model(out.graph, (pre, blk, head)), out.stubs


_EMBED_INPUTS = ["latent", "timestep", "frame_start"]
_BLOCK_INPUTS = ["x", "e", "cos", "sin", "past_k", "past_v", "cross_k", "cross_v"]


def _trace_parts(model, ex: tuple, dims: tuple, meta: bool) -> tuple:
    """The three traced parts ((graph, initializers) each, _part): the embedding, block 0 (every block's
    graph: the blocks differ in weights only) and the head, traced on the example inputs `ex`."""
    import torch

    from fastcar_compile.dit.model import ChunkDiT

    cfg, n = model.cfg, model.cfg.layers
    batch, past, text = dims

    class Embed(torch.nn.Module):
        patchify, rope, embed = ChunkDiT.patchify, ChunkDiT.rope, ChunkDiT.embed

        def __init__(self):
            super().__init__()
            self.cfg, self.parts = cfg, model.parts
            self.patch_embed, self.time_embed, self.time_proj = model.patch_embed, model.time_embed, model.time_proj

        def forward(self, latent, timestep, frame_start):
            return self.embed(latent, timestep, frame_start)

    class Final(torch.nn.Module):
        unpatchify, final = ChunkDiT.unpatchify, ChunkDiT.final

        def __init__(self):
            super().__init__()
            self.cfg, self.norm_out, self.head = cfg, model.norm_out, model.head
            self.head_modulation = model.head_modulation

        def forward(self, x, t):
            return self.final(x, t)

    with torch.no_grad():
        x, t, e, cos, sin = model.embed(*ex[:3])
    kv = ex[3:]
    tmpdir = Path(tempfile.mkdtemp(prefix=".dit-parts-"))
    try:
        return (_part(Embed(), ex[:3], ({0: batch}, {0: batch}, None),
                      (_EMBED_INPUTS, ["tokens_0", "time_embedding", "modulation", "rope_cos", "rope_sin"]), meta,
                      tmpdir / "pre.onnx"),
                _part(model.blocks[0], (x, e, cos, sin, kv[0], kv[1], kv[2 * n], kv[2 * n + 1]),
                      ({0: batch}, {0: batch}, None, None, {0: batch, 2: past}, {0: batch, 2: past},
                       {0: batch, 2: text}, {0: batch, 2: text}), (_BLOCK_INPUTS, ["x_out", "k", "v"]), meta,
                      tmpdir / "block.onnx"),
                _part(Final(), (x, t), ({0: batch}, {0: batch}), (["x", "t"], ["velocity"]), meta,
                      tmpdir / "head.onnx"))
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


class _Composed:
    """The step graph being composed from the parts, and the initializer stubs of a weightless (meta) export."""

    def __init__(self, meta: bool):
        import onnx

        self.meta = meta
        self.graph = onnx.GraphProto(name="dit_step")
        self.stubs: list[tuple[str, list[int], int]] = []

    def add(self, part, rename: dict[str, str], prefix: str, weights: dict, weight_name=lambda k: k,
            weight_of=lambda k, a: a) -> None:
        """Copy `part`'s nodes and value infos with its values renamed (`rename`, else `prefix` + name) and its
        initializers named weight_name(name) holding weight_of(name, traced array)."""
        from onnx import numpy_helper

        def r(name: str) -> str:
            return name and rename.get(name, prefix + name)

        for name, (shape, dtype, arr) in weights.items():
            rename[name] = final = weight_name(name)
            if self.meta:
                self.stubs.append((final, shape, dtype))
            else:
                self.graph.initializer.append(numpy_helper.from_array(weight_of(name, arr), final))
        for node in part.graph.node:
            new = self.graph.node.add()
            new.CopyFrom(node)
            new.name = prefix + node.name
            new.input[:] = [r(v) for v in node.input]
            new.output[:] = [r(v) for v in node.output]
        for vi in part.graph.value_info:
            new = self.graph.value_info.add()
            new.CopyFrom(vi)
            new.name = r(vi.name)


def _wire_io(graph, pre, blk, head, n: int) -> None:
    """The step graph's inputs (the embedding's, then past.N.* and cross.N.* as the block takes them) and
    outputs (the velocity, then present.N.*), in the order the runtime binds them (config.step_io)."""
    import onnx

    def named(vi, name: str):
        out = onnx.ValueInfoProto()
        out.CopyFrom(vi)
        out.name = name
        return out

    for name in _EMBED_INPUTS:
        graph.input.append(next(i for i in pre.graph.input if i.name == name))
    for name in ("past", "cross"):
        for i in range(n):
            for kv_name, src in (("key", f"{name}_k"), ("value", f"{name}_v")):
                graph.input.append(named(next(x for x in blk.graph.input if x.name == src), f"{name}.{i}.{kv_name}"))
    graph.output.append(next(o for o in head.graph.output if o.name == "velocity"))
    for i in range(n):
        for kv_name, src in (("key", "k"), ("value", "v")):
            graph.output.append(named(next(x for x in blk.graph.output if x.name == src), f"present.{i}.{kv_name}"))


def _model(graph, parts: tuple):
    """The model of `graph`, with the block's opset and producer and the parts' functions, each once."""
    import onnx

    blk = parts[1]
    proto = onnx.helper.make_model(graph, opset_imports=list(blk.opset_import), ir_version=blk.ir_version,
                                   producer_name=blk.producer_name, producer_version=blk.producer_version)
    seen = set()
    for part in parts:
        for f in part.functions:
            if (f.domain, f.name) not in seen:
                seen.add((f.domain, f.name))
                proto.functions.append(f)
    return proto
