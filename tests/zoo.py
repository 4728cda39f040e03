"""Model zoo for the compiler tests: tiny transformers decoders exported to ONNX by every exporter we support.

Each family is built from a transformers config in code with seeded random weights, scaled so attention
logits are spread (TAS values then differ across tokens, which the finite-tau tests need). A wrapper
module takes flat KV tensors, so every export has the same I/O contract:

    inputs : input_ids, attention_mask, position_ids, past_key_values.N.key, past_key_values.N.value
    outputs: logits, present.N.key, present.N.value
    KV     : [batch, kv_heads, past_len, head_dim]; batch, sequence and past length are dynamic.

Run `python tests/zoo.py --out DIR` to write every family x exporter graph (and `status.json`) to DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

FAMILIES = ("llama", "qwen2", "phi3", "gpt2")
# Further architectures (parallel residual, norms after attention/MLP, sliding windows, MoE). They are
# tested with the two exporter paths users take (dynamo opset 20 and TorchScript) by test_pass_architectures.py.
NEW_FAMILIES = ("neox", "phi2", "gptj", "falcon", "olmo2", "gemma2", "gemma3", "mistral", "mixtral", "qwen2moe")
# Families only the onnxruntime-genai builder tests use (tests/genai_zoo.py): per-head q/k norms before RoPE
# (Qwen3), scaled embeddings, offset norms and a GELU MLP (Gemma).
GENAI_ONLY_FAMILIES = ("qwen3", "gemma")
NEW_EXPORTERS = ("dynamo20", "torchscript17")
# A sliding window wider than the frame (L = 4 in the tests) but shorter than the test decodes (~30 tokens),
# so the KV cache really is truncated.
SLIDING_WINDOW = 8
EAGER_ONLY = frozenset({"gemma2", "gptj"})
MOE_FAMILIES = frozenset({"mixtral", "qwen2moe"})
SLIDING_FAMILIES = frozenset({"mistral", "gemma2", "gemma3"})
EXPORTERS = (
    "dynamo18",
    "dynamo20",
    "dynamo23",
    "dynamo24",
    "torchscript17",
    "ortfusions20",
    "ortfusions20sdpa",
)
# ortfusions20: model with eager attention -> dynamo opset 20 -> optimize_for_ort (fuses MultiHeadAttention and
# SkipSimplifiedLayerNormalization). ortfusions20sdpa: the same from the SDPA model (only the norms fuse).
ATTN_IMPL = {"ortfusions20": "eager"}
SEED = 1234

# Shared tiny sizes: hidden 64, 4 query heads, 2 kv heads (GQA where the family supports it), 2 layers.
HIDDEN, HEADS, KV_HEADS, LAYERS, INTER, VOCAB, MAX_POS = 64, 4, 2, 2, 128, 128, 256


# (family, exporter) -> (substring of the error, why). Combinations that fail on torch 2.13 / transformers 5.23 /
# onnxscript 0.7.2 / onnxruntime 1.31; tests skip them with this reason only when they fail exactly this way.
KNOWN_EXPORT_FAILURES: dict[tuple[str, str], tuple[str, str]] = {
    ("gpt2", "ortfusions20"): (
        "Op (Gemm) [ShapeInferenceError] Input 0 expected to have rank 2 but has rank 3",
        "onnxscript 0.7.2 optimize_for_ort fuses GPT-2's eager attention into MultiHeadAttention and drops the "
        "Reshape before attn.c_proj's Gemm, so ORT 1.31 rejects the graph (gpt2/ortfusions20sdpa covers "
        "GPT-2 after the ORT fusions)",
    ),
}


@dataclass(frozen=True)
class ModelInfo:
    """Shape facts a driver needs for one family."""

    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    vocab: int


def make_config(family: str, attn_implementation: str = "sdpa", vocab: int = VOCAB, sizes: dict | None = None):
    """The transformers config of one tiny family model (`sizes`: config fields overridden, e.g. a wider
    hidden_size for a test whose weights must stand out of process-memory noise).

    Exports use "sdpa" (what users export; it becomes ONNX Attention at opset 23/24); the eager reference
    swaps in its own attention function.
    """
    import transformers as tf

    common = dict(vocab_size=vocab, tie_word_embeddings=False)
    if family == "llama":
        cfg = tf.LlamaConfig(
            hidden_size=HIDDEN,
            intermediate_size=INTER,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            max_position_embeddings=MAX_POS,
            rms_norm_eps=1e-5,
            **common,
        )
    elif family == "qwen2":
        cfg = tf.Qwen2Config(
            hidden_size=HIDDEN,
            intermediate_size=INTER,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            max_position_embeddings=MAX_POS,
            rms_norm_eps=1e-5,
            use_sliding_window=False,
            **common,
        )
    elif family == "phi3":
        cfg = tf.Phi3Config(
            hidden_size=HIDDEN,
            intermediate_size=INTER,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            max_position_embeddings=MAX_POS,
            original_max_position_embeddings=MAX_POS,
            rms_norm_eps=1e-5,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            **common,
        )
    elif family == "gpt2":
        cfg = tf.GPT2Config(
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            n_inner=INTER,
            n_positions=MAX_POS,
            vocab_size=vocab,
            tie_word_embeddings=False,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=1,
            eos_token_id=2,
        )
    elif family in NEW_FAMILIES + GENAI_ONLY_FAMILIES:
        cfg = _new_family_config(family, vocab)
    else:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES + NEW_FAMILIES}")
    if sizes:  # rebuilt, so derived fields (head_dim = hidden / heads) follow the new sizes
        fields = {k: v for k, v in cfg.to_dict().items() if k != "head_dim" or "head_dim" in sizes}
        if "partial_rotary_factor" in sizes and isinstance(fields.get("rope_parameters"), dict):
            # transformers 5 rotates by rope_parameters' factor (the top-level field is what the genai builder reads)
            fields["rope_parameters"] = {**fields["rope_parameters"],
                                         "partial_rotary_factor": sizes["partial_rotary_factor"]}
        cfg = type(cfg)(**{**fields, **sizes})
    # Gemma2 (soft-capping) and GPT-J have no SDPA path in transformers: they are exported with eager attention.
    cfg._attn_implementation = "eager" if family in EAGER_ONLY else attn_implementation
    if family in MOE_FAMILIES:
        # transformers' default experts kernel (grouped_mm) is a custom op neither exporter converts, and the
        # eager loop over the experts hit is data-dependent (TorchScript would bake one routing in): use the
        # batched one (every token gathers its top-k experts' weights), the same function of the inputs.
        cfg._experts_implementation = "batched_mm"
    return cfg


def _new_family_config(family: str, vocab: int = VOCAB):
    """Configs of the issue-8 families (same tiny sizes; head_dim 16)."""
    import transformers as tf

    common = dict(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        vocab_size=vocab,
        max_position_embeddings=MAX_POS,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    gqa = dict(num_key_value_heads=KV_HEADS)
    if family == "neox":  # parallel residual: x + attn(ln1(x)) + mlp(ln2(x)); partial rotary (half the dims)
        return tf.GPTNeoXConfig(**common, use_parallel_residual=True, rotary_pct=0.5, hidden_dropout=0.0,
                                attention_dropout=0.0, tie_word_embeddings=False)
    if family == "phi2":  # shared-norm parallel block: x + attn(ln(x)) + mlp(ln(x)); partial rotary
        return tf.PhiConfig(**common, **gqa, partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0,
                            attention_dropout=0.0, tie_word_embeddings=False)
    if family == "gptj":  # shared-norm parallel block, interleaved (rotate-every-two) partial rotary
        return tf.GPTJConfig(n_embd=HIDDEN, n_inner=INTER, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB,
                             n_positions=MAX_POS, rotary_dim=HIDDEN // HEADS // 2, resid_pdrop=0.0, embd_pdrop=0.0,
                             attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                             tie_word_embeddings=False)
    if family == "falcon":  # parallel attention + MLP on one shared norm, multi-query (1 kv head) fused QKV
        return tf.FalconConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                               vocab_size=VOCAB, max_position_embeddings=MAX_POS, parallel_attn=True,
                               multi_query=True, new_decoder_architecture=False, alibi=False, bias=False,
                               hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
                               pad_token_id=0, tie_word_embeddings=False)
    if family == "olmo2":  # no pre-norm: x + norm(attn(x)), then h + norm(mlp(h)); q/k norms
        return tf.Olmo2Config(**common, **gqa, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if family == "gemma2":  # pre- and post-norms around attention and MLP, sliding layers, soft-capping
        return tf.Gemma2Config(**common, **gqa, head_dim=HIDDEN // HEADS, sliding_window=SLIDING_WINDOW,
                               rms_norm_eps=1e-6)
    if family == "gemma3":  # per-head q/k RMSNorm after the head transpose, before RoPE; a sliding and a full layer
        return tf.Gemma3TextConfig(**common, **gqa, head_dim=HIDDEN // HEADS, sliding_window=SLIDING_WINDOW,
                                   layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-6,
                                   tie_word_embeddings=False)
    if family == "qwen3":  # RMSNorm on each q/k head before RoPE
        return tf.Qwen3Config(**common, **gqa, head_dim=HIDDEN // HEADS, rms_norm_eps=1e-6,
                              use_sliding_window=False, tie_word_embeddings=False)
    if family == "gemma":  # embeddings scaled by sqrt(hidden), norms weighted (1 + w), GELU (tanh) MLP
        return tf.GemmaConfig(**common, **gqa, head_dim=HIDDEN // HEADS, rms_norm_eps=1e-6,
                              hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=False)
    if family == "mistral":
        return tf.MistralConfig(**common, **gqa, sliding_window=SLIDING_WINDOW, rms_norm_eps=1e-5,
                                tie_word_embeddings=False)
    if family == "mixtral":  # MoE: 4 experts, top-2
        return tf.MixtralConfig(**common, **gqa, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
                                tie_word_embeddings=False)
    if family == "qwen2moe":  # MoE with a gated shared expert
        return tf.Qwen2MoeConfig(**common, **gqa, moe_intermediate_size=INTER // 2,
                                 shared_expert_intermediate_size=INTER, num_experts=4, num_experts_per_tok=2,
                                 decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-5,
                                 use_sliding_window=False, tie_word_embeddings=False)
    raise ValueError(family)


def model_info(family: str) -> ModelInfo:
    """Head counts and sizes of a family model (GPT-2 has no GQA: kv heads = heads)."""
    kv = {"gpt2": HEADS, "neox": HEADS, "gptj": HEADS, "falcon": 1}.get(family, KV_HEADS)
    return ModelInfo(family, LAYERS, HEADS, kv, HIDDEN // HEADS, HIDDEN, VOCAB)


def build_model(family: str, seed: int = SEED, attn_implementation: str = "sdpa", vocab: int = VOCAB,
                sizes: dict | None = None) -> nn.Module:
    """A seeded random tiny causal LM in float32, eval mode, with weights scaled to spread attention logits.

    The weights depend only on (family, seed, vocab), not on the attention implementation.
    """
    import transformers as tf

    cfg = make_config(family, attn_implementation, vocab, sizes)
    torch.manual_seed(seed)
    cls = {
        "llama": tf.LlamaForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "phi3": tf.Phi3ForCausalLM,
        "gpt2": tf.GPT2LMHeadModel,
    }.get(family, tf.AutoModelForCausalLM)
    model = (cls.from_config(cfg) if cls is tf.AutoModelForCausalLM else cls(cfg)).eval().float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                # std 0.02 (the default init) makes q.k ~ 1e-3: every TAS equal. Use ~1/sqrt(fan_in) x 1.5.
                std = 1.5 / (p.shape[-1] ** 0.5) if "wte" not in name and "embed" not in name else 1.0
                if "wpe" in name:
                    std = 0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:  # norm weights: around 1 but not all equal
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    return model


class FlatKVWrapper(nn.Module):
    """Flat-tensor front of a transformers causal LM: builds a DynamicCache, returns flat presents."""

    def __init__(self, model: nn.Module, num_layers: int):
        super().__init__()
        self.model = model
        self.num_layers = num_layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(self.num_layers)]
        cache = DynamicCache(pairs, config=self.model.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            return_dict=True,
        )
        pkv = out.past_key_values
        flat = []
        for i in range(self.num_layers):
            layer = pkv.layers[i]
            flat += [layer.keys, layer.values]
        return (out.logits, *flat)


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Graph input and output names of the contract."""
    ins = ["input_ids", "attention_mask", "position_ids"]
    outs = ["logits"]
    for i in range(num_layers):
        ins += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outs += [f"present.{i}.key", f"present.{i}.value"]
    return ins, outs


def example_inputs(
    info: ModelInfo, batch: int = 2, seq: int = 3, past: int = 5, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    """Example inputs with distinct batch/seq/past sizes (so the exporter cannot specialise them)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, info.vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    pos = torch.arange(past, past + seq, dtype=torch.int64).unsqueeze(0).expand(batch, seq).contiguous()
    kv = []
    for _ in range(info.num_layers):
        kv += [
            torch.randn(batch, info.num_kv_heads, past, info.head_dim, generator=g).to(dtype)
            for _ in range(2)
        ]
    return (ids, mask, pos, *kv)


def _kv_axis(info: ModelInfo, name: str, layer: int) -> str:
    """The KV length axis name: shared by every layer, except in sliding-window families where a window layer's
    cache is shorter than a full layer's (Gemma2 alternates them), so each layer gets its own."""
    return f"{name}_{layer}" if info.family in SLIDING_FAMILIES else name


def _export_dynamo(wrapper: nn.Module, info: ModelInfo, path: Path, opset: int) -> None:
    ins, outs = io_names(info.num_layers)
    # String axis names: torch.onnx turns them into Dim.DYNAMIC and names the ONNX axes after them.
    kv_shapes = tuple({0: "batch", 2: _kv_axis(info, "past", i // 2)} for i in range(2 * info.num_layers))
    # forward(input_ids, attention_mask, position_ids, *past): the varargs form one tuple in dynamic_shapes.
    shapes = ({0: "batch", 1: "seq"}, {0: "batch", 1: "total"}, {0: "batch", 1: "seq"}, kv_shapes)
    prog = torch.onnx.export(
        wrapper,
        example_inputs(info, dtype=next(wrapper.parameters()).dtype),
        input_names=ins,
        output_names=outs,
        dynamic_shapes=shapes,
        opset_version=opset,
        dynamo=True,
        optimize=True,
        verbose=False,
    )
    prog.save(str(path))


def _export_torchscript(wrapper: nn.Module, info: ModelInfo, path: Path, opset: int = 17) -> None:
    ins, outs = io_names(info.num_layers)
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "total"},
        "position_ids": {0: "batch", 1: "seq"},
        "logits": {0: "batch", 1: "seq"},
    }
    for i, n in enumerate(ins[3:]):
        axes[n] = {0: "batch", 2: _kv_axis(info, "past", i // 2)}
    for i, n in enumerate(outs[1:]):
        axes[n] = {0: "batch", 2: _kv_axis(info, "total", i // 2)}
    torch.onnx.export(
        wrapper,
        example_inputs(info, dtype=next(wrapper.parameters()).dtype),
        str(path),
        input_names=ins,
        output_names=outs,
        dynamic_axes=axes,
        opset_version=opset,
        dynamo=False,
        do_constant_folding=True,
    )


def _export_ortfusions(wrapper: nn.Module, info: ModelInfo, path: Path) -> dict[str, int]:
    """Dynamo opset 20, then onnxscript's ORT fusions; returns the fusion counts (which fusions fired)."""
    import onnx_ir as ir
    from onnxscript.rewriter import ort_fusions

    tmp = path.with_suffix(".pre.onnx")
    _export_dynamo(wrapper, info, tmp, 20)
    model = ir.load(str(tmp))
    model, fusion_counts = ort_fusions.optimize_for_ort(model)
    ir.save(model, str(path))
    tmp.unlink(missing_ok=True)
    return {k: int(v) for k, v in fusion_counts.items()}


def export(family: str, exporter: str, out_dir: str | os.PathLike, dtype: str = "float32") -> Path:
    """Export one family with one exporter into out_dir/<family>-<exporter>[-<dtype>].onnx (reused if present).

    dtype "float16"/"bfloat16" casts the whole model (weights, KV cache, logits) for the dtype-keeping checks.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{family}-{exporter}" + ("" if dtype == "float32" else f"-{dtype}")
    path = out / f"{stem}.onnx"
    if path.exists():
        return path
    info = model_info(family)
    model = build_model(family, attn_implementation=ATTN_IMPL.get(exporter, "sdpa")).to(getattr(torch, dtype))
    wrapper = FlatKVWrapper(model, info.num_layers).eval()
    tmp = out / f".{stem}.tmp.onnx"
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            if exporter.startswith("dynamo"):
                _export_dynamo(wrapper, info, tmp, int(exporter[len("dynamo") :]))
            elif exporter == "torchscript17":
                _export_torchscript(wrapper, info, tmp, 17)
            elif exporter.startswith("ortfusions20"):
                counts = _export_ortfusions(wrapper, info, tmp)
                (out / f"{stem}.fusions.json").write_text(json.dumps(counts, indent=1))
            else:
                raise ValueError(f"unknown exporter {exporter!r}; choose from {EXPORTERS}")
        _check_contract(tmp, info)
        # One self-contained file (tiny models: no external data), then publish atomically.
        import onnx

        onnx.save(onnx.load(str(tmp)), str(tmp))
        os.replace(tmp, path)
    finally:
        for side in out.glob(f".{stem}.tmp*"):
            side.unlink(missing_ok=True)
    return path


def _check_contract(path: Path, info: ModelInfo) -> None:
    """Fail loudly if an exporter renamed or dropped an I/O, or wrote a graph ORT cannot open."""
    import onnx
    import onnxruntime as ort

    m = onnx.load(str(path), load_external_data=False)
    ins, outs = io_names(info.num_layers)
    got_in = [i.name for i in m.graph.input]
    got_out = [o.name for o in m.graph.output]
    if got_in != ins or got_out != outs:
        raise RuntimeError(f"I/O contract broken: inputs {got_in}, outputs {got_out}")
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 4
    try:
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise RuntimeError(f"ONNX Runtime cannot open the exported graph: {exc}") from exc


def export_all(
    out_dir: str | os.PathLike,
    families=FAMILIES,
    exporters=EXPORTERS,
    progress: Callable[[str], None] | None = print,
) -> dict[str, dict[str, str]]:
    """Export every combination; return {family: {exporter: "ok" | "FAIL: <error>"}} and write status.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    status_path = out / "status.json"
    status: dict[str, dict[str, str]] = json.loads(status_path.read_text()) if status_path.exists() else {}
    for fam in families:
        for exp in exporters:
            try:
                export(fam, exp, out)
                status.setdefault(fam, {})[exp] = "ok"
            except Exception as exc:  # record, never hide
                msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                status.setdefault(fam, {})[exp] = f"FAIL: {msg}"
                (out / f"{fam}-{exp}.error.txt").write_text(traceback.format_exc())
            if progress:
                progress(f"{fam:6s} {exp:14s} {status[fam][exp]}")
            status_path.write_text(json.dumps(status, indent=1))
    return status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for <family>-<exporter>.onnx and status.json")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--exporters", default=",".join(EXPORTERS))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    status = export_all(a.out, a.families.split(","), a.exporters.split(","))
    bad = sum(v != "ok" for row in status.values() for v in row.values())
    print(f"{bad} combination(s) failed; details in {a.out}/*.error.txt" if bad else "all exported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
