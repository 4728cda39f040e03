"""FAST-AR reference: decode attention over a compressed KV cache, in NumPy (docs/semantics.md sections 3, 6).

Runtime-independent on purpose: this is the oracle that a later ONNX op / native kernel is checked against,
and the tool that measures density and recall on captured attention traces. Nothing here imports ORT.

- `config`: the settings (`KVCompressConfig`: budget, sinks, window, TempCache, eviction, AnnSA).
- `rope`: LLaMA's rotate-half RoPE (keys are stored post-RoPE at their true positions).
- `lsh`: sign-random-projection hashing for AnnSA.
- `cache`: one KV head's fixed-capacity cache with TempCache merging and eviction.
- `attention`: decode attention over a whole trace, against dense on the side; the metrics.

The q/k/v capture from the bundled demo model (needs torch) is the demo's: `fastcar_compile/demo/trace.py`.
"""
