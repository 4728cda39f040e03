"""FastCar on the compiled DiT step graph: a token's FFN output replayed from the same (h, w) one frame earlier
at the same denoising step when its TAS exceeds tau, with the replay cache as graph I/O.

Per block N planned with a tau (ReplayPass), on the nodes discovery found (passes/dit_discover.py):
    TAS [B, S]   = mean over heads of scores(q, k_back): the attention's own scaled query times the key one
                   frame back (the chunk's `present.N.key` shifted by a frame, `past_replay.N.key` [B, H, T, d]
                   for its first frame), times the export's key scale factors, summed over the head dimension
    replay       = TAS > tau and (the frame is not the chunk's first, or `replay_first`)
    FFN          = the FFN's own nodes on the rows that do not replay only (NonZero -> Gather -> FFN ->
                   ScatterND): real row skipping
    output       = per frame in order, replayed rows take the previous frame's output (`past_replay.N.ffn`
                   [B, T, D] for the first frame): the chain of dit/fastar.replay_ffn
and outputs the chunk's last frame's FFN output and key as `present_replay.N.ffn|key` (the runtime keeps them
per denoising step, dit/stream.OrtDiT), the decision as `replay.N` [B, S] and the TAS as `tas.N` [B, S]
(`--calibrate-replay` reads it).
The chunk's frame count is the export's (static): the chain is unrolled over it.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir

from fastcar_compile.core.contract import REPLAY_FIRST, DiTConfig, replay_io, tas_name
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.passes.build import Builder, const
from fastcar_compile.passes.context import DiTContext
from fastcar_compile.passes.dit_discover import DiTBlockMatch


def _clear_shapes(up: ir.Node, out: ir.Value) -> None:
    """The FFN's values now hold only the computed rows: drop the export's [B, S, ...] shape annotations."""
    seen, queue = set(), [up]
    while queue:
        node = queue.pop()
        if node in seen:
            continue
        seen.add(node)
        for v in node.outputs:
            v.shape = None
            if v is not out:
                queue.extend(v.consumers())


def add_replay(model: ir.Model, matches: list[DiTBlockMatch], cfg: DiTConfig, tau: float) -> None:
    """FastCar replay on the blocks `matches` (module docstring): new inputs `replay_first` and `past_replay.N.*`,
    new outputs `present_replay.N.*` and `replay.N`."""
    graph = model.graph
    T, F, D = cfg.tokens_per_frame, cfg.chunk_frames, cfg.hidden
    H, d = cfg.heads, cfg.head_dim
    S = F * T
    first = ir.Value(name=REPLAY_FIRST, type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([1]))
    graph.inputs.append(first)

    def c(name, array):
        return const(graph, f"fastcar.dit.replay.{name}", np.asarray(array))

    tau_v = c("tau", np.float32(tau))
    later = c("later_frames", np.arange(S) >= T)  # [S]: positions past the chunk's first frame
    ids = itertools.count()
    for m in matches:
        i = m.layer
        (in_ffn, in_key), (out_ffn, out_key), mask_name = replay_io(i)
        prev_ffn = ir.Value(name=in_ffn, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", T, D]))
        prev_key = ir.Value(name=in_key, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", H, T, d]))
        graph.inputs.extend([prev_ffn, prev_key])
        a = m.attention
        up, ffn_out = m.ffn_io
        present_key = next(v for v in graph.outputs if v.name == f"present.{i}.key")
        users = [(n, j) for n, j in ffn_out.uses()]
        before: list[ir.Node] = []
        b = Builder(i, before, ids, graph=graph)
        q = a.query
        for f in a.key_factors:
            q = b("Mul", [q, f], part="gate")
        axis2 = c("axis2", np.array([2], np.int64))
        if F > 1:
            shifted = b("Slice", [present_key, c("zero", np.array([0], np.int64)),
                                  c("shift_end", np.array([(F - 1) * T], np.int64)), axis2])
            back = b("Concat", [prev_key, shifted], {"axis": 2})
        else:
            back = prev_key
        per_head = b("ReduceSum", [b("Mul", [q, back]), c("last_axis", np.array([-1], np.int64))], {"keepdims": 0})
        tas = b("ReduceMean", [per_head, c("heads_axis", np.array([1], np.int64))], {"keepdims": 0},
                names=[tas_name(i)])  # [B, S]
        replay = b("And", [b("Greater", [tas, tau_v]), b("Or", [later, first])], names=[mask_name])
        x = up.inputs[0]
        flat = b("Reshape", [x, c("rows_shape", np.array([-1, D], np.int64))])
        rows = b("NonZero", [b("Not", [b("Reshape", [replay, c("flat", np.array([-1], np.int64))])])])  # [1, n]
        up.replace_input_with(0, b("Gather", [flat, b("Reshape", [rows, c("flat", np.array([-1], np.int64))])],
                                   {"axis": 0}))
        graph.insert_before(up, before)
        _clear_shapes(up, ffn_out)
        after: list[ir.Node] = []
        b = Builder(i, after, ids, graph=graph)
        full = b("ScatterND", [b("Mul", [flat, c("zero_f", np.float32(0))]),
                               b("Transpose", [rows], {"perm": [1, 0]}), ffn_out])
        frames = b("Reshape", [full, c("frames_shape", np.array([-1, F, T, D], np.int64))])
        marks = b("Reshape", [replay, c("marks_shape", np.array([-1, F, T, 1], np.int64))])
        axis1 = c("axis1", np.array([1], np.int64))
        src = b("Unsqueeze", [prev_ffn, axis1])
        outs = []
        for j in range(F):
            lo, hi = c(f"at{j}", np.array([j], np.int64)), c(f"at{j + 1}", np.array([j + 1], np.int64))
            src = b("Where", [b("Slice", [marks, lo, hi, axis1]), src, b("Slice", [frames, lo, hi, axis1])])
            outs.append(src)
        joined = b("Concat", outs, {"axis": 1}) if F > 1 else outs[0]
        result = b("Reshape", [joined, c("tokens_shape", np.array([0, S, D], np.int64))])
        b("Squeeze", [outs[-1], axis1], names=[out_ffn])
        b("Slice", [present_key, c("last_start", np.array([(F - 1) * T], np.int64)),
                    c("last_end", np.array([S], np.int64)), axis2], names=[out_key])
        graph.insert_after(ffn_out.producer(), after)
        for node, j in users:
            node.replace_input_with(j, result)
        types = {out_ffn: (ir.DataType.FLOAT, ["batch", T, D]), out_key: (ir.DataType.FLOAT, ["batch", H, T, d]),
                 mask_name: (ir.DataType.BOOL, ["batch", S]), tas_name(i): (ir.DataType.FLOAT, ["batch", S])}
        for name, (dtype, dims) in types.items():
            v = next(n.outputs[0] for n in before + after if n.outputs[0].name == name)
            v.type, v.shape = ir.TensorType(dtype), ir.Shape(dims)
            graph.outputs.append(v)


class ReplayPass(ir.passes.InPlacePass):
    """FastCar's FFN replay on every block planned with a tau (TAS and the replay cache as graph I/O)."""

    def __init__(self, ctx: DiTContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        taus = {self.ctx.plan[m.layer].replay_tau for m in self.ctx.matches} - {None}
        if not taus:
            return ir.passes.PassResult(model, modified=False)
        if len(taus) > 1:  # one `replay_first` input and tau constant serve every block
            raise FastCarError(f"the plan gives the DiT blocks {len(taus)} different taus; one tau serves every block")
        tau = taus.pop()
        add_replay(model, [m for m in self.ctx.matches if self.ctx.plan[m.layer].replay_tau == tau], self.ctx.cfg, tau)
        return ir.passes.PassResult(model, modified=True)
