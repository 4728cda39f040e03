"""AnnSA compiled into a DiT step graph (`--annsa lsh|int8`) against the same graph compiled dense, on the DiT
trained here (training/dit_model), AnnSA in both compiled forms (the native AnnSAAttention op, the ONNX-op
graph: `--native-attention off`): self-attention time (ONNX Runtime's profile, summed over its nodes), ms per
frame of the stream, density and recall, at a cache of `--contexts` frames.

    python benchmarks/experiments/dit_annsa_compiled.py [--out DIR] [--contexts 16,64] [--late 8] [--forms native,graph]

Per context C: the model's 2 sink frames and a window of C - 2, so that from frame C on every chunk attends to C
cached frames. Every graph streams the same C + `--late` frames (prompt `camera=pan_right`, CFG 2, same noise,
1 thread each), the graphs interleaved chunk by chunk; ms per frame = the median chunk time over the chunks
starting at frame >= C. Then each graph's session is replaced by one with ORT's profiler on and runs
`--profile-chunks` more chunks over the cache its stream left: self-attention = the nodes of the in-place
rewrite and of AnnSA (their part tags: attention, cache, annsa) plus each block's softmax; density = executed
q.k pairs / dense pairs over those chunks (AnnSA's graph outputs: OrtDiT.self_pairs). Recall = the dense
softmax mass the selection keeps, from the eager runtime's --diagnostics over the same stream (the compiled
graph equals it within 1e-4 and executes the same pairs: tests/test_dit_annsa_compile.py), over its chunks
from frame C on.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from fastcar_compile.core.atomic import write_text
from fastcar_compile.core.contract import ANNSA_GRAPH, ANNSA_NATIVE


def self_attention_nodes(path: Path) -> set[str]:
    """Names of the self-attention's nodes in a compiled step graph: the rewrite's (attention, cache), AnnSA's
    (annsa; its bucket codes), and each block's softmax (the one reading the rewrite's score Concat)."""
    import onnx

    from fastcar_compile.core import contract

    m = onnx.load(str(path), load_external_data=False)
    part = {n.name: {p.key: p.value for p in n.metadata_props}.get(contract.TAG_PART) for n in m.graph.node}
    names = {n for n, p in part.items() if p in ("attention", "cache", "annsa") or n.startswith("fastcar/annsa/")}
    producer = {o: n for n in m.graph.node for o in n.output}
    for n in m.graph.node:
        if n.op_type == "Softmax" and producer.get(n.input[0]) is not None and producer[n.input[0]].name in names:
            names.add(n.name)
    return names


def profile(model, path: Path, settings, start: int, chunks: int, text) -> tuple[float, float]:
    """(self-attention ms per frame, all nodes ms per frame) of `chunks` more chunks of `model`'s stream from
    frame `start`, over the cache it holds, with ORT's profiler on (a second session of the same graph)."""
    import onnxruntime as ort

    from fastcar_compile.dit.stream import generate_chunk, prompt_rows
    from fastcar_compile.runtime.binding import StepBinding

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.enable_profiling, so.log_severity_level = 1, True, 3
    if (model.annsa or {}).get("annsa_kernel") == ANNSA_NATIVE:
        from fastcar_compile.runtime.native import library_path

        so.register_custom_ops_library(str(library_path()))
    pick = self_attention_nodes(path)
    with tempfile.TemporaryDirectory() as tmp:
        so.profile_file_prefix = str(Path(tmp) / "p")
        model.sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        model.binding = StepBinding(model.sess)
        cross = model.text_kv(prompt_rows(model.cfg, text, settings.cfg_scale != 1.0, settings.seed))
        rng = np.random.default_rng(settings.seed + 1)
        f = model.cfg.chunk_frames
        for i in range(chunks):
            generate_chunk(model, settings, start + i * f, model.cache, cross, rng)
        events = json.loads(Path(model.sess.end_profiling()).read_text())
    runs = sorted(e["ts"] + e["dur"] for e in events if e.get("name") == "model_run")
    # the first run of a new session allocates and packs weights: left out (the chunks' other steps count)
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] > runs[0]]
    frames = chunks * f * (len(runs) - 1) / len(runs)
    sa = sum(e["dur"] for e in nodes if e["name"][:-len("_kernel_time")] in pick)
    return sa / 1000 / frames, sum(e["dur"] for e in nodes) / 1000 / frames


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fastcar-out/dit_annsa", help="folder for the export, graphs and table.md")
    ap.add_argument("--contexts", default="16,64", help="cached frames each chunk attends to (sinks + window)")
    ap.add_argument("--late", type=int, default=8, help="frames streamed past the context (the timed chunks)")
    ap.add_argument("--profile-chunks", type=int, default=2)
    ap.add_argument("--bits", type=int, default=4, help="sign bits per LSH table")
    ap.add_argument("--dirs", type=int, default=2, help="int8 directions per int8 table")
    ap.add_argument("--tables", type=int, default=2)
    ap.add_argument("--local", type=int, default=1, help="--annsa-local")
    ap.add_argument("--no-recall", action="store_true", help="skip the eager runtime's recall runs")
    ap.add_argument("--forms", default="native,graph", help="AnnSA's compiled forms to measure (native: the "
                    "AnnSAAttention op, graph: the ONNX ops)")
    a = ap.parse_args()
    from fastcar_compile.api import compile as compile_dit
    from fastcar_compile.cli import main as cli
    from fastcar_compile.cli.demo_dit import MODEL_DIR, load_trained, parse_prompt
    from fastcar_compile.demo.dit_train import text_embeds
    from fastcar_compile.dit import modes
    from fastcar_compile.dit.fastar import FastARDiT, totals
    from fastcar_compile.dit.stream import OrtDiT, StreamSettings, rollout

    out = Path(a.out)
    src = out / "export" / "dit.onnx"
    if not src.is_file():
        assert cli(["export", "--dit", str(MODEL_DIR), "-o", str(src)]) == 0
    bucket = {"lsh_bits": a.bits, "int8_dirs": a.dirs, "ann_tables": a.tables, "annsa_local": a.local}
    forms = {ANNSA_GRAPH: ("ONNX ops", {"native_attention": False}), ANNSA_NATIVE: ("native op", {})}
    graphs = {"dense": {}}
    for kind, what in (("lsh", f"AnnSA-LSH ({a.bits} bits x {a.tables})"),
                       ("int8", f"AnnSA-Quant ({a.dirs} dirs x {a.tables})")):
        for form in a.forms.split(","):
            graphs[f"{what}, {forms[form][0]}"] = {"annsa": kind, **bucket, **forms[form][1]}
    paths = {}
    for i, (g, kw) in enumerate(graphs.items()):
        paths[g] = out / f"graph{i}" / "dit.onnx"
        compile_dit(src, paths[g], **kw)
        if "annsa" in kw and OrtDiT(paths[g]).annsa.annsa_kernel != (ANNSA_GRAPH if "native_attention" in kw
                                                                       else ANNSA_NATIVE):
            raise SystemExit(f"{g}: compiled as another form (is the native library built? "
                             "python -m fastcar_compile.runtime.native.build)")
    text = text_embeds(parse_prompt("camera=pan_right"))
    torch_model = load_trained(MODEL_DIR) if not a.no_recall else None
    sinks = OrtDiT(paths["dense"]).cfg.sink_frames
    lines = ["| context (frames) | graph | density | recall | self-attention ms/frame | x dense | ms per frame | "
             "x dense |", "|---|---|---|---|---|---|---|---|"]
    for ctx in (int(c) for c in a.contexts.split(",")):
        settings = StreamSettings(frames=ctx + a.late, seed=1, cfg_scale=2.0, window_frames=ctx - sinks)
        models = {g: OrtDiT(p, threads=1) for g, p in paths.items()}
        gens = {g: rollout(m, settings, text) for g, m in models.items()}
        late: dict[str, list[float]] = {g: [] for g in models}
        for _ in range(0, settings.frames, models["dense"].cfg.chunk_frames):
            for g, gen in gens.items():
                t0 = time.perf_counter()
                chunk = next(gen)
                if chunk.first_frame >= ctx:
                    late[g].append((time.perf_counter() - t0) / len(chunk.frames[0]))
        prof = {}
        for g, m in models.items():
            if m.annsa is not None:
                m.self_pairs = [0, 0]
            prof[g] = profile(m, paths[g], settings, settings.frames, a.profile_chunks, text)
        step = {g: 1000 * float(np.median(v)) for g, v in late.items()}
        recalls: dict[str, str] = {}  # per bucketing: both forms select the same pairs
        for g, m in models.items():
            density, recall = "100%", ("100%" if m.annsa is None else "-")
            if m.annsa is not None:
                density = f"{100 * m.self_pairs[0] / m.self_pairs[1]:.1f}%"
                recall = recalls.get(m.annsa.kind, recall)
                if torch_model is not None and m.annsa.kind not in recalls:
                    kw = {k: v for k, v in graphs[g].items() if k != "native_attention"}
                    ref = FastARDiT(torch_model, modes.settings(diagnostics=True, **kw), threads=1)
                    gen = rollout(ref, settings, text)
                    for chunk in gen:
                        if chunk.first_frame + len(chunk.frames[0]) == ctx:  # recall from here on
                            ref.stats = [type(s)() for s in ref.stats]
                    recall = f"{100 * totals(ref.stats)['self_recall']:.1f}%"
                    recalls[m.annsa.kind] = recall
            lines.append(f"| {ctx} | {g} | {density} | {recall} | {prof[g][0]:.2f} | "
                         f"{prof['dense'][0] / prof[g][0]:.2f}x | {step[g]:.1f} | {step['dense'] / step[g]:.2f}x |")
            print(lines[-1], flush=True)
    write_text(out / "table.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
