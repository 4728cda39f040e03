"""One decode step of GroupQueryAttention alone: ORT's com.microsoft op vs ai.fastcar.GroupQueryAttention (the native
dense core, passes/native_gqa.py), same one-node model, same inputs, genai's binding (packed QKV, do_rotary, one KV
buffer [1, Hkv, max_length, D] bound as past and present). Interleaved in blocks, lower quartile per variant, so
machine load hits both alike; the ratio is the result.

    python benchmarks/bench_native_gqa.py                     # the bench_genai LLaMA's layer: 16/2 heads x 64, ctx 1024,4096
    python benchmarks/bench_native_gqa.py --threads 1 --contexts 4096
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleave, lower_quartile_ms, make_session, save_results  # noqa: E402


def _model(domain: str, heads: int, kv: int):
    from onnx import TensorProto, helper

    names = ["query", "", "", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache"]
    node = helper.make_node("GroupQueryAttention", names, ["output", "present_key", "present_value"], domain=domain,
                            num_heads=heads, kv_num_heads=kv, do_rotary=1, scale=0.125)
    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info(n, f, None) for n in ("query", "past_key", "past_value", "cos_cache",
                                                               "sin_cache")]
    ins += [helper.make_tensor_value_info(n, TensorProto.INT32, None) for n in ("seqlens_k", "total_sequence_length")]
    outs = [helper.make_tensor_value_info(n, f, None) for n in ("output", "present_key", "present_value")]
    return helper.make_model(helper.make_graph([node], "gqa", ins, outs), ir_version=10,
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])


def _step(kind: str, heads: int, kv: int, d: int, ctx: int, threads: int, prompt: bool = False):
    """A callable running one decode step at position ctx, or (prompt) the first prompt of ctx tokens (IO binding,
    KV buffer shared)."""
    import onnxruntime as ort

    from fastcar_compile.core import contract
    from fastcar_compile.runtime.native import library_path

    lib = library_path() if kind == "ours" else None
    if kind == "ours" and lib is None:
        raise SystemExit("the native ai.fastcar kernels are not built here")
    domain = contract.DOMAIN if kind == "ours" else contract.MS_DOMAIN
    sess = make_session(_model(domain, heads, kv).SerializeToString(), threads, library=lib)
    rng = np.random.default_rng(0)
    n = ctx + 8
    s, total = (ctx, ctx) if prompt else (1, ctx + 1)
    arrays = {"query": rng.standard_normal((1, s, (heads + 2 * kv) * d)).astype(np.float32),
              "seqlens_k": np.array([total - 1], np.int32), "total_sequence_length": np.array(total, np.int32),
              "cos_cache": np.cos(rng.uniform(0, 6, (n, d // 2))).astype(np.float32),
              "sin_cache": np.sin(rng.uniform(0, 6, (n, d // 2))).astype(np.float32)}
    key = rng.standard_normal((1, kv, n, d)).astype(np.float32)
    val = rng.standard_normal((1, kv, n, d)).astype(np.float32)
    io = sess.io_binding()
    keep = [ort.OrtValue.ortvalue_from_numpy(a) for a in (key, val)]
    for name, arr in arrays.items():
        io.bind_cpu_input(name, arr)
    io.bind_ortvalue_input("past_key", keep[0])
    io.bind_ortvalue_output("present_key", keep[0])
    io.bind_ortvalue_input("past_value", keep[1])
    io.bind_ortvalue_output("present_value", keep[1])
    io.bind_output("output")

    def run() -> None:
        sess.run_with_iobinding(io)

    run.keep = (sess, io, keep, arrays)  # type: ignore[attr-defined]
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--prompt", action="store_true", help="time the first prompt of ctx tokens instead of decode")
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/bench/bench_native_gqa.json"))
    a = ap.parse_args(argv)
    results = {"phase": "prompt" if a.prompt else "decode", "threads": a.threads, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
               "clock": "wall, lower quartile", "contexts": {}}
    print(f"GroupQueryAttention, {'the first prompt' if a.prompt else 'one decode step'}, {a.heads}/{a.kv_heads} heads x {a.head_dim}, {a.threads} threads, "
          f"{a.rounds} x {a.block} steps per variant, interleaved")
    print("| ctx | ORT com.microsoft GQA (ms) | ai.fastcar GQA (ms) | speed-up |")
    print("|---:|---:|---:|---:|")
    for ctx in [int(c) for c in a.contexts.split(",")]:
        steps = {k: _step(k, a.heads, a.kv_heads, a.head_dim, ctx, a.threads, a.prompt) for k in ("ort", "ours")}
        lq = lower_quartile_ms(interleave(steps, a.rounds, a.block))
        print(f"| {ctx} | {lq['ort']:.3f} | {lq['ours']:.3f} | {lq['ort'] / lq['ours']:.2f}x |")
        results["contexts"][str(ctx)] = {"ms": lq, "speedup": lq["ort"] / lq["ours"]}
    return save_results(a.out, results)


if __name__ == "__main__":
    sys.exit(main())
