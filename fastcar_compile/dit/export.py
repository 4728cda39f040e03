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

from fastcar_compile.dit.config import METADATA_KEY, TEXT_GRAPH_KEY, DiTConfig, step_io, text_io
from fastcar_compile.errors import FastCarError
from fastcar_compile.fileio import refuse_special, with_path

OPSET = 20
ALIGN = 4096  # external-data offsets page-aligned, so that ONNX Runtime can map them


def text_graph_path(step: str | os.PathLike) -> Path:
    """Where the prompt graph of step graph `dit.onnx` lives: `dit.text.onnx` beside it."""
    step = Path(step)
    return step.with_name(f"{step.stem}.text.onnx")


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


def _export(module, args: tuple, shapes, names: tuple[list[str], list[str]], meta: bool):
    import torch

    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)  # torchvision note
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return torch.onnx.export(module, args, input_names=names[0], output_names=names[1], dynamic_shapes=shapes,
                                 opset_version=OPSET, dynamo=True, optimize=not meta, verbose=False)


def _save(prog, path: Path, meta: bool, metadata: dict[str, str]) -> None:
    """Write the program; from the meta device, its initializers go to a sparse zero-filled `path.data`."""
    import onnx

    if not meta:
        prog.save(str(path))
        proto = onnx.load(str(path))
    else:
        inits = [(v.name, v.shape, v.dtype) for v in prog.model.graph.initializers.values()]
        prog.save(str(path), include_initializers=False)
        proto = onnx.load(str(path), load_external_data=False)
        data = path.with_name(path.name + ".data")
        offset = 0
        del proto.graph.initializer[:]
        for name, shape, dtype in inits:
            dims = [int(d) for d in shape]
            t = onnx.TensorProto(name=name, dims=dims, data_type=int(dtype))
            t.data_location = onnx.TensorProto.EXTERNAL
            length = math.ceil(dtype.itemsize * math.prod(dims))  # itemsize is fractional for 4-bit types
            for k, v in (("location", data.name), ("offset", str(offset)), ("length", str(length))):
                t.external_data.add(key=k, value=v)
            proto.graph.initializer.append(t)
            offset += -(-length // ALIGN) * ALIGN
        with open(data, "wb") as fh:  # a hole: zero bytes read back, no disk blocks, no memory
            fh.truncate(offset)
    for k, v in metadata.items():
        proto.metadata_props.add(key=k, value=v)
    onnx.save(proto, str(path))


def export_dit(model, output: str | os.PathLike, *, weights: str = "random") -> tuple[Path, Path]:
    """Export `model` (ChunkDiT, on CPU or the meta device) to `output` and its prompt graph beside it,
    atomically (data files first, then the graphs); checks the I/O names written."""
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
    metadata = {METADATA_KEY: cfg.to_json(), TEXT_GRAPH_KEY: text_out.name, "fastcar.dit_weights": weights}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmpdir = Path(tempfile.mkdtemp(dir=out.parent, prefix=".export-"))
    try:
        step = _export(model, ex, step_shapes, step_io(n), meta)
        prompt = _export(TextGraph(model), text_ex, ({0: batch, 1: text},), text_io(n), meta)
        _save(step, tmpdir / out.name, meta, metadata)
        _save(prompt, tmpdir / text_out.name, meta, {METADATA_KEY: cfg.to_json()})
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
