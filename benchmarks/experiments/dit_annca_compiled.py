"""AnnCA compiled into a DiT step graph (`--annca`) against the same graph compiled dense: the cross-attention's
time (ONNX Runtime's profile, summed over its nodes), ms per frame of the stream, density and recall.

    python benchmarks/experiments/dit_annca_compiled.py [--out DIR] [--frames 8] [--reps 3] [--bits 4,8]

First the op alone (passes/dit_annca.standalone) against the export's cross-attention alone over random prompts
of `--op-prompts` lengths (min ms per call). Then two models: the DiT trained here (training/dit_model: a 6-token prompt, `camera=pan_right`) and a random-weight
DiT with a 512-token prompt (Wan's text length) at the same sizes otherwise (hidden 128, 4 heads, 4 layers, 64
tokens per frame, 2-frame chunks), which shows how the op scales with the prompt. Per model and `--bits` entry
(sign-LSH bits per table, 2 tables), AnnCA gathered (the kept tokens' K/V gathered per frame) and masked (the
whole prompt, dropped tokens at -inf). Timing: every graph streams the same `--frames` frames (CFG 2, same
seed, 1 thread each), the graphs in turn, `--reps` rounds (interleaved); the fastest round's ms per frame and
its ratio to dense (on a shared machine the slower rounds measure the load). Cross-attention: one more stream per graph with ORT's profiler on; the nodes of the export's
cross-attention (key layout and scale, scores, softmax, context) in the dense graph against AnnCA's nodes, each
node's median run times its runs.
Density = executed query x prompt pairs / dense (the graph's annca.N outputs); recall = the dense softmax mass on
the kept tokens, from the eager runtime's --diagnostics on the same stream (the compiled graph equals it within
1e-4, tests/test_dit_annca_compile.py).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from fastcar_compile.core.atomic import write_text

RANDOM_512 = {"layers": 4, "hidden": 128, "heads": 4, "ffn": 512, "text_dim": 64, "in_channels": 3, "latent_h": 32,
              "latent_w": 32, "patch": [1, 4, 4], "freq_dim": 64, "text_len": 512, "chunk_frames": 2,
              "sink_frames": 2, "window_frames": 14}


def cross_nodes(path: Path) -> set[str]:
    """Names of the nodes of each block's cross-attention as exported (key path, scores, softmax, context)."""
    import onnx_ir as ir

    from fastcar_compile.passes.dit_discover import attention_chain

    m = ir.load(str(path))
    ins = {v.name: v for v in m.graph.inputs}
    names: set[str] = set()
    for i in range(sum(1 for n in ins if n.startswith("cross.") and n.endswith(".key"))):
        scores, softmax, context, _ = attention_chain(ins[f"cross.{i}.key"], ins[f"cross.{i}.value"], "x")
        names |= {scores.name, softmax.name, context.name}
        v = scores.inputs[1]
        while v.name != f"cross.{i}.key":  # the key's layout and scale nodes (their data input) back to the input
            p = v.producer()
            names.add(p.name)
            v = p.inputs[0]
    return names


def profiled_ms(path: Path, settings, text, pick) -> float:
    """ms per frame of the nodes `pick(name)` selects, over one stream with ORT's profiler."""
    import onnxruntime as ort

    from fastcar_compile.dit.stream import OrtDiT, rollout

    m = OrtDiT(path, threads=1)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.enable_profiling, so.log_severity_level = 1, True, 3
    with tempfile.TemporaryDirectory() as tmp:
        so.profile_file_prefix = str(Path(tmp) / "p")
        m.sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        if m.in_place:
            from fastcar_compile.runtime.binding import StepBinding

            m.binding = StepBinding(m.sess)
        for _ in rollout(m, settings, text):
            pass
        events = json.loads(Path(m.sess.end_profiling()).read_text())
    runs: dict[str, list[int]] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and pick(e["name"][:-len("_kernel_time")]):
            runs.setdefault(e["name"], []).append(e["dur"])
    # each node's median run times its runs: a run the shared machine preempted does not count
    return sum(float(np.median(d)) * len(d) for d in runs.values()) / 1000 / settings.frames


def run_model(name: str, src: Path, torch_model, text, a, out: Path) -> list[str]:
    from fastcar_compile.api import compile as compile_dit
    from fastcar_compile.dit import modes
    from fastcar_compile.dit.fastar import FastARDiT, totals
    from fastcar_compile.dit.stream import OrtDiT, StreamSettings, rollout
    from fastcar_compile.passes import dit_annca as annca_graph

    graphs = {"dense": {}}
    for bits in (int(b) for b in a.bits.split(",")):
        for gather in (True, False):
            graphs[f"AnnCA lsh {bits}x2 {'gathered' if gather else 'masked'}"] = {"annca": True, "lsh_bits": bits,
                                                                                  "gather": gather}
    paths = {}
    for i, (g, kw) in enumerate(graphs.items()):
        path = out / name / f"graph{i}" / "dit.onnx"
        kw = dict(kw)
        gather = kw.pop("gather", True)
        saved = annca_graph.GATHER_FROM
        annca_graph.GATHER_FROM = 0 if gather else 1 << 30
        try:
            compile_dit(src, path, **kw)
        finally:
            annca_graph.GATHER_FROM = saved
        paths[g] = path
    settings = StreamSettings(frames=a.frames, seed=1, cfg_scale=2.0)
    models = {g: OrtDiT(p, threads=1) for g, p in paths.items()}
    times: dict[str, list[float]] = {g: [] for g in models}
    for _ in range(a.reps):
        for g, m in models.items():
            m.cross_pairs = [0, 0]
            t0 = time.perf_counter()
            for _ in rollout(m, settings, text):
                pass
            times[g].append(time.perf_counter() - t0)
    dense_cross = cross_nodes(paths["dense"])
    ca_ms = {g: profiled_ms(p, settings, text, (lambda n: n in dense_cross) if g == "dense"
                            else (lambda n: n.startswith("fastcar/annca/"))) for g, p in paths.items()}
    dense = min(times["dense"])
    lines = [f"### {name}", "", "| graph | density | recall | cross-attention ms/frame | x dense | ms per frame | "
             "x dense |", "|---|---|---|---|---|---|---|"]
    for g, m in models.items():
        med = min(times[g])
        density, recall = "100%", "100%"
        if g != "dense":
            density = f"{100 * m.cross_pairs[0] / m.cross_pairs[1]:.1f}%"
            kw = graphs[g]
            ref = FastARDiT(torch_model, modes.settings(annca=True, lsh_bits=kw["lsh_bits"], diagnostics=True),
                            threads=1)
            for _ in rollout(ref, StreamSettings(frames=min(a.frames, 8), seed=1, cfg_scale=2.0), text):
                pass
            recall = f"{100 * totals(ref.stats)['cross_recall']:.1f}%"
        lines.append(f"| {g} | {density} | {recall} | {ca_ms[g]:.2f} | {ca_ms['dense'] / ca_ms[g]:.2f}x | "
                     f"{1000 * med / a.frames:.1f} | {dense / med:.2f}x |")
    return lines


def dense_op(head_dim: int):
    """The export's cross-attention alone: softmax(q k^T / sqrt(d)) v over the whole prompt."""
    import onnx
    from onnx import TensorProto, helper

    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "h", n_, head_dim])
          for n, n_ in (("q", "s"), ("k", "l"), ("v", "l"))]
    nodes = [helper.make_node("Mul", ["q", "scale"], ["qs"]), helper.make_node("Transpose", ["k"], ["kt"],
                                                                                perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["qs", "kt"], ["s"]), helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["ctx"])]
    scale = onnx.numpy_helper.from_array(np.array(head_dim ** -0.5, np.float32), "scale")
    out = helper.make_tensor_value_info("ctx", TensorProto.FLOAT, None)
    return helper.make_model(helper.make_graph(nodes, "dense", io, [out], [scale]),
                             opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


def op_table(a) -> list[str]:
    """The op alone at the trained model's attention shapes (CFG rows 2, 4 heads, 2 frames of 64 queries,
    head size 32) over random prompts of several lengths: min ms per call over interleaved rounds."""
    import onnx_ir as ir
    import onnxruntime as ort

    from fastcar_compile.fastar.lsh import SignLSH
    from fastcar_compile.passes.dit_annca import standalone

    B, H, F, T, d = 2, 4, 2, 64, 32
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = 1, 3
    rng = np.random.default_rng(0)
    lines = ["### the op alone (random q, k, v; B 2, heads 4, 2 frames x 64 queries, d 32)", "",
             "| prompt tokens | LSH bits x tables | density | dense ms | gathered ms | x dense | masked ms | x dense |",
             "|---|---|---|---|---|---|---|---|"]
    dense = ort.InferenceSession(dense_op(d).SerializeToString(), so, providers=["CPUExecutionProvider"])
    for length in (int(x) for x in a.op_prompts.split(",")):
        for bits in (int(b) for b in a.bits.split(",")):
            hasher = SignLSH(d, bits, 2, seed=0)
            sess = {"dense": dense}
            for gather in (True, False):
                sess[gather] = ort.InferenceSession(ir.to_proto(standalone(hasher, F, d, gather)).SerializeToString(),
                                                    so, providers=["CPUExecutionProvider"])
            feed = {"q": rng.standard_normal((B, H, F * T, d)).astype(np.float32),
                    "k": rng.standard_normal((B, H, length, d)).astype(np.float32),
                    "v": rng.standard_normal((B, H, length, d)).astype(np.float32)}
            feed_dense = {k: feed[k] for k in ("q", "k", "v")}
            feed["kc"] = hasher.codes(feed["k"])  # once per prompt, in the prompt graph
            best = dict.fromkeys(sess, np.inf)
            for _ in range(a.op_rounds):
                for name, s in sess.items():
                    for _ in range(10):
                        t0 = time.perf_counter()
                        s.run(None, feed_dense if name == "dense" else feed)
                        best[name] = min(best[name], time.perf_counter() - t0)
            kept = sess[True].run(None, feed)[1]
            ms = {k: 1000 * v for k, v in best.items()}
            lines.append(f"| {length} | {bits} x 2 | {100 * kept.mean():.1f}% | {ms['dense']:.3f} | {ms[True]:.3f} | "
                         f"{ms['dense'] / ms[True]:.2f}x | {ms[False]:.3f} | {ms['dense'] / ms[False]:.2f}x |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fastcar-out/dit_annca", help="folder for the exports, graphs and table.md")
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bits", default="4,8", help="sign-LSH bits per table, one AnnCA graph pair each")
    ap.add_argument("--models", default="trained,random-512", help="streamed models ('' = the op table only)")
    ap.add_argument("--op-prompts", default="6,64,512", help="prompt lengths of the op-alone table")
    ap.add_argument("--op-rounds", type=int, default=20)
    a = ap.parse_args()
    from fastcar_compile.cli import main as cli
    from fastcar_compile.cli.demo_dit import MODEL_DIR, parse_prompt
    from fastcar_compile.demo.dit_train import text_embeds
    from fastcar_compile.dit.checkpoints import load_config
    from fastcar_compile.dit.model import build

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = op_table(a) + [""]
    print("\n".join(lines), flush=True)
    for name in filter(None, a.models.split(",")):
        if name == "trained":
            folder, text = Path(MODEL_DIR), text_embeds(parse_prompt("camera=pan_right"))
        else:
            folder, text = out / "random-512" / "model", None
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "config.json").write_text(json.dumps(RANDOM_512))
        src = out / name / "export" / "dit.onnx"
        if not src.is_file():
            assert cli(["export", "--dit", str(folder), "-o", str(src)]) == 0
        cfg, weights = load_config(str(folder))
        table = run_model(name, src, build(cfg, weights), text, a, out) + [""]
        print("\n".join(table), flush=True)
        lines += table
    write_text(out / "table.md", "\n".join(lines))


if __name__ == "__main__":
    main()
