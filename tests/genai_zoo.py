"""onnxruntime-genai model-builder graphs of the zoo's tiny families, built offline in seconds.

The builder (`python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p PREC -e cpu`) reads a local
transformers folder with a tokenizer. The folder is the zoo's seeded random model (`zoo.build_model`) saved
with `save_pretrained`, plus a `tokenizers` WordLevel tokenizer (one word per id) saved through
`PreTrainedTokenizerFast`. The same transformers model drives the eager reference, so a genai graph and
the reference share their weights exactly (fp32).

The vocabulary is GENAI_VOCAB, not the zoo's 128: the builder takes any Linear with `vocab_size` outputs
for the LM head, and the zoo's MLP width is 128 too (the graph then computes logits from layer 0's MLP).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import zoo

FAMILIES = ("llama", "qwen2", "phi3")
PRECISIONS = ("fp32", "fp16", "int4")
# Families whose RMSNorm computes x * (1 + w): the builder stores 1 + w in the graph.
NORM_OFFSET_FAMILIES = frozenset({"gemma"})
GENAI_VOCAB = 160
# Builder precision and extra options per build name. The zoo's widths are 64/128: block 32 fits. "int4" is the
# CPU default (MatMulNBits accuracy_level 4: activations quantized to int8 inside the kernel); "int4-fp32a"
# keeps the same int4 weights with fp32 activations (accuracy_level 1), which a dequantized-weight fp32
# reference reproduces exactly.
BUILDS = {"fp32": ("fp32", []), "fp16": ("fp16", []), "int4": ("int4", ["int4_block_size=32"]),
          "int4-fp32a": ("int4", ["int4_block_size=32", "accuracy_level=1"])}


# Config fields a family's genai graph is built with. Mistral: no sliding window (the builder reads the window
# from `layer_types`, which MistralConfig lacks, so its graph attends to the whole context while transformers
# would mask beyond the window; Mistral 7B v0.2 and later have none either).
FAMILY_SIZES: dict[str, dict] = {"mistral": {"sliding_window": None}}


def build_model(family: str, sizes: dict | None = None):
    """The transformers model a genai graph of `family` is built from (fp32, random, seeded; `sizes`: config
    fields overridden, zoo.make_config)."""
    return zoo.build_model(family, vocab=GENAI_VOCAB, sizes={**FAMILY_SIZES.get(family, {}), **(sizes or {})} or None)


def _save_hf(family: str, out: Path, sizes: dict | None = None) -> None:
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    build_model(family, sizes).save_pretrained(out)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(GENAI_VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                                      pad_token="t0")
    fast.save_pretrained(out)


def build(family: str, precision: str, out_dir: str | os.PathLike, sizes: dict | None = None) -> Path:
    """Folder out_dir/genai-<family>-<precision> with model.onnx + genai_config.json (reused if present).

    precision: a key of BUILDS. sizes: config fields overridden (zoo.make_config), named in the folder."""
    tag = "".join(f"-{k}{v}" for k, v in sorted((sizes or {}).items()))
    out = Path(out_dir) / f"genai-{family}{tag}-{precision}"
    if (out / "genai_config.json").exists() and (out / "model.onnx").exists():
        return out
    hf = Path(out_dir) / f"hf-{family}{tag}"
    if not (hf / "config.json").exists():
        _save_hf(family, hf, sizes)
    tmp = Path(out_dir) / f".genai-{family}{tag}-{precision}.tmp"
    builder_precision, extra = BUILDS[precision]
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(tmp),
           "-p", builder_precision, "-e", "cpu", "-c", str(Path(out_dir) / "genai-cache")]
    if extra:
        cmd += ["--extra_options", *extra]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not (tmp / "model.onnx").exists():
        raise RuntimeError(f"genai builder failed for {family}/{precision}:\n{proc.stderr[-3000:]}")
    os.replace(tmp, out)
    return out


# --- the graph's own weights in the transformers model (independent reference for int4 / fp16 builds) -----

def dequantize_matmulnbits(packed: np.ndarray, scales: np.ndarray, k: int, n: int, bits: int = 4,
                           zero_points: np.ndarray | None = None) -> np.ndarray:
    """W [N, K] float32 of a com.microsoft.MatMulNBits weight, from the op's spec (NumPy, not ORT).

    packed: uint8 [N, blocks, block_size * bits / 8], low nibble first; scales: [N * blocks]; zero point 2^(bits-1)
    when absent (4-bit zero points are packed two per byte, low nibble first).
    """
    if bits != 4:
        raise ValueError(f"only 4-bit MatMulNBits weights are dequantized here, got bits={bits}")
    blocks = packed.shape[1]
    q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, blocks, -1).astype(np.float32)
    if zero_points is None:
        zp = np.full((n, blocks, 1), 8.0, np.float32)
    else:
        z = np.stack([zero_points & 0x0F, zero_points >> 4], -1).reshape(n, -1)[:, :blocks]
        zp = z.astype(np.float32)[..., None]
    w = (q - zp) * scales.reshape(n, blocks, 1).astype(np.float32)
    return w.reshape(n, -1)[:, :k]


def graph_weights(model_path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The builder graph's linear weights as [out, in] float32 (int4 dequantized, fp16 widened), norms and
    embeddings as float32, keyed by the builder's names without the `.MatMul.weight*` / `.Add.bias` suffix."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_path))
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out: dict[str, np.ndarray] = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        zp = init.get(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        name = node.input[1].rsplit(".MatMul.", 1)[0]
        out[name + ".weight"] = dequantize_matmulnbits(init[node.input[1]], init[node.input[2]], attrs["K"],
                                                       attrs["N"], attrs.get("bits", 4), zp)
    for key, arr in init.items():
        if key.endswith(".MatMul.weight"):  # MatMul B: [in, out]
            out[key.rsplit(".MatMul.", 1)[0] + ".weight"] = arr.astype(np.float32).T
        elif key.endswith(".Add.bias"):
            out[key.rsplit(".Add.", 1)[0] + ".bias"] = arr.astype(np.float32)
        elif key.endswith("layernorm.weight") or key.endswith("embed_tokens.weight"):
            out[key] = arr.astype(np.float32)
    return out


def reference_model(family: str, model_path: str | os.PathLike, sizes: dict | None = None):
    """The transformers model of `family` carrying the genai graph's weights (what an int4 / fp16 graph
    computes, in fp32): the eager FastCar reference then runs the same weights as the graph."""
    import torch

    model = build_model(family, sizes)
    state = model.state_dict()
    weights = graph_weights(model_path)
    new: dict[str, np.ndarray] = {}
    n_layers = model.config.num_hidden_layers
    for key, arr in weights.items():
        if f"layers.{n_layers}.final_norm" in key:
            new["model.norm.weight"] = arr - 1.0 if family in NORM_OFFSET_FAMILIES else arr
            continue
        key = key.replace(".attn.", ".self_attn.").replace("_norm.layernorm.", "_norm.")  # q_norm / k_norm
        if key.endswith("norm.weight") and family in NORM_OFFSET_FAMILIES:
            arr = arr - 1.0  # the builder stores (1 + w) for the norms that compute x * (1 + w)
        if ".qkv_proj." in key and key not in state:  # packed q|k|v -> q_proj, k_proj, v_proj
            parts = [key.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
            cuts = np.cumsum([state[p].shape[0] for p in parts])[:-1]
            new.update(zip(parts, np.split(arr, cuts), strict=True))
        else:
            new[key] = arr
    for packed, parts in ((".self_attn.qkv_proj.", ("q_proj", "k_proj", "v_proj")),
                          (".mlp.gate_up_proj.", ("gate_proj", "up_proj"))):  # Phi-3: separate -> packed
        for key in [k for k in state if packed in k]:
            pieces = [key.replace(packed.split(".")[-2], p) for p in parts]
            if all(p in new for p in pieces):
                new[key] = np.concatenate([new.pop(p) for p in pieces])
    missing = set(state) - set(new)
    extra = set(new) - set(state)
    if missing or extra:
        raise ValueError(f"graph weights do not map onto {family}: missing {sorted(missing)}, extra {sorted(extra)}")
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in new.items()})
    return model
