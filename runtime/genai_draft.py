"""The genai folder `fastcar-compile genai-speculate` writes: speculative decoding in onnxruntime-genai's own loop,
genai unpatched (docs/speculation.md).

genai (0.18) verifies the proposals of a *draft model* (`model.draft` in genai_config.json: any decoder-only ONNX
graph with genai's decoder I/O and the target's vocabulary) or of its stock n-gram lookup (`speculative.ngram_size`).
A draft model sees only what genai feeds a decoder: `input_ids` of this step, `attention_mask` (its width is the
total length) and its own KV cache, which genai grows, rewinds after a rejection and hands back every step. The
previous-frame draft keeps the token history in that cache: its one layer's "key" is the token ids (one channel,
one head), and the logits of position t are one-hot at the token of position t + 1 - L, i.e. it proposes for
position p the token at p - L (chained by genai beyond one frame: it feeds the draft its own proposals).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fastcar_compile.core import contract
from fastcar_compile.core.atomic import write_bytes, write_text
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.runtime.speculate import ADAPTIVE_MAX, ADAPTIVE_START, parse_draft

DRAFT_FILE = "draft.onnx"
GENAI_MAX_DRAFT = 16  # genai: speculative.max_draft_tokens in [1, 16]
NGRAM_SIZE = 4  # genai's n-gram order (it matches the last N - 1 tokens)
ONE_HOT = 1e4  # draft logit of the proposed token (0 elsewhere): softmax is exactly one-hot in fp32
DRAFT_KEY, DRAFT_VALUE = "past_key_values.%d.key", "past_key_values.%d.value"
DRAFT_PRESENT_KEY, DRAFT_PRESENT_VALUE = "present.%d.key", "present.%d.value"
_ONNX_TYPES = {np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32}


def temporal_draft(vocab: int, frame_tokens: int, shared_buffer: bool, ids_type: int = TensorProto.INT64,
                   opset: int = 17) -> onnx.ModelProto:
    """The previous-frame draft graph. Inputs input_ids [B, S], attention_mask [B, T], past key/value [B, 1, P, 1]
    (the token ids so far, as float32: exact up to 2^24); outputs logits [B, S, vocab] and the present key/value.
    `shared_buffer` (genai's `past_present_share_buffer`): past and present are one [B, 1, max_length, 1]
    buffer and this step's ids are scattered at T - S .. T - 1; otherwise present = past ++ ids (length T).
    Positions before the first frame (t + 1 - L < 0) propose the current token."""
    f = TensorProto.FLOAT
    L = frame_tokens
    inputs = [helper.make_tensor_value_info("input_ids", ids_type, ["batch", "sequence"]),
              helper.make_tensor_value_info("attention_mask", ids_type, ["batch", "total"]),
              helper.make_tensor_value_info(DRAFT_KEY % 0, f, ["batch", 1, "past", 1]),
              helper.make_tensor_value_info(DRAFT_VALUE % 0, f, ["batch", 1, "past", 1])]
    outputs = [helper.make_tensor_value_info("logits", f, ["batch", "sequence", vocab]),
               helper.make_tensor_value_info(DRAFT_PRESENT_KEY % 0, f, ["batch", 1, "present", 1]),
               helper.make_tensor_value_info(DRAFT_PRESENT_VALUE % 0, f, ["batch", 1, "present", 1])]

    def const(name: str, value) -> onnx.TensorProto:
        return numpy_helper.from_array(np.asarray(value, np.int64), name)

    inits = [const("one", 1), const("zero", 0), const("L_minus_1", L - 1), const("ax1", [1]),
             const("col_shape", [0, 1, -1, 1]), const("pos_shape", [1, 1, -1, 1]), const("row_shape", [0, -1]),
             numpy_helper.from_array(np.asarray([0.0, ONE_HOT], np.float32), "onehot_values"),
             const("depth", vocab)]
    n = helper.make_node
    nodes = [
        n("Shape", ["attention_mask"], ["T1"], start=1, end=2), n("Squeeze", ["T1"], ["T"]),
        n("Shape", ["input_ids"], ["S1"], start=1, end=2), n("Squeeze", ["S1"], ["S"]),
        n("Sub", ["T", "S"], ["start"]),
        n("Range", ["start", "T", "one"], ["pos"]),  # [S]: the absolute positions of this step's tokens
        n("Cast", ["input_ids"], ["ids_f"], to=f),
        n("Reshape", ["ids_f", "col_shape"], ["new_col"]),  # [B, 1, S, 1]
    ]
    if shared_buffer:
        nodes += [n("Reshape", ["pos", "pos_shape"], ["pos_col"]),
                  n("Shape", ["new_col"], ["new_shape"]), n("Expand", ["pos_col", "new_shape"], ["scatter_at"])]
        for past, present in ((DRAFT_KEY, DRAFT_PRESENT_KEY), (DRAFT_VALUE, DRAFT_PRESENT_VALUE)):
            nodes.append(n("ScatterElements", [past % 0, "scatter_at", "new_col"], [present % 0], axis=2))
    else:
        for past, present in ((DRAFT_KEY, DRAFT_PRESENT_KEY), (DRAFT_VALUE, DRAFT_PRESENT_VALUE)):
            nodes.append(n("Concat", [past % 0, "new_col"], [present % 0], axis=2))
    nodes += [
        n("Sub", ["pos", "L_minus_1"], ["src_raw"]),  # the token proposed after position t sits at t + 1 - L
        n("Less", ["src_raw", "zero"], ["before"]),
        n("Where", ["before", "pos", "src_raw"], ["src"]),
        n("Gather", [DRAFT_PRESENT_KEY % 0, "src"], ["picked"], axis=2),  # [B, 1, S, 1]
        n("Reshape", ["picked", "row_shape"], ["picked_row"]),  # [B, S]
        n("Cast", ["picked_row"], ["proposal"], to=TensorProto.INT64),
        n("OneHot", ["proposal", "depth", "onehot_values"], ["logits"], axis=-1),
    ]
    graph = helper.make_graph(nodes, "previous_frame_draft", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="fastcar-compile")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _draft_block(target: dict) -> dict:
    """genai's decoder description of the draft graph (the target's session options: genai requires the same EP)."""
    return {"session_options": target.get("session_options", {"provider_options": []}), "filename": DRAFT_FILE,
            "head_size": 1, "hidden_size": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
            "num_hidden_layers": 1,
            "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                       "past_key_names": DRAFT_KEY, "past_value_names": DRAFT_VALUE},
            "outputs": {"logits": "logits", "present_key_names": DRAFT_PRESENT_KEY,
                        "present_value_names": DRAFT_PRESENT_VALUE}}


def _target_io(model_path: Path, config: dict) -> tuple[int, int]:
    """(vocab, input_ids ONNX type) of the target graph: genai needs a static vocabulary dim equal to the draft's."""
    try:
        m = onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - onnx raises DecodeError, OSError, ValueError ... for a bad file
        raise FastCarError(f"{model_path} (genai_config.json's decoder filename) is not a readable ONNX model "
                           f"({type(exc).__name__}); rebuild the folder with the model builder") from None
    dec = config["model"]["decoder"]
    names = {v.name: v for v in [*m.graph.input, *m.graph.output]}
    logits, ids = names.get(dec.get("outputs", {}).get("logits", "logits")), names.get(
        dec.get("inputs", {}).get("input_ids", "input_ids"))
    if logits is None or ids is None:
        raise FastCarError(f"{model_path}: no logits / input_ids as genai_config.json names them")
    if any(o.domain == contract.DOMAIN for o in m.opset_import):
        raise FastCarError(f"{model_path} is FastCar-compiled: genai rewinds a rejected draft's KV but not the FastCar "
                           "state (its recurrent_state), so a rejected token's MLP cache row would stay; give the "
                           "dense model's genai folder (FastCar with drafts: FastCarSession.generate(draft=...))")
    dims = logits.type.tensor_type.shape.dim
    if not dims or not dims[-1].HasField("dim_value") or dims[-1].dim_value < 1:
        raise FastCarError(f"{model_path}: the logits' vocabulary dim is symbolic; genai's speculation needs it static")
    return dims[-1].dim_value, ids.type.tensor_type.elem_type


def _non_finite(value, where: str = "") -> str | None:
    """The path of the first NaN / Infinity number in a JSON value (Python's json reads those literals)."""
    import math

    if isinstance(value, float) and not math.isfinite(value):
        return where or "(top)"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if (found := _non_finite(v, f"{where}.{k}" if where else str(k))) is not None:
            return found
    return None


def read_config(src: Path) -> tuple[dict, Path]:
    """GENAI_DIR's genai_config.json and the target model it names, each field this command reads checked as it
    is read: one FastCarError per problem (malformed JSON, a wrong type, a missing key, a decoder file outside
    the folder, a NaN), never a traceback."""
    from fastcar_compile.core.fileio import check_input_file, read_json

    cfg_path = src / "genai_config.json"
    if not src.is_dir() or not (cfg_path.exists() or cfg_path.is_symlink()):
        raise FastCarError(f"{src} has no genai_config.json; give the folder the onnxruntime-genai model builder wrote")
    config = read_json(cfg_path, "genai_config.json")
    if (bad := _non_finite(config)) is not None:
        raise FastCarError(f"{cfg_path}: {bad} is not a finite number (NaN or Infinity); fix or rebuild the folder")
    model = config.get("model")
    decoder = model.get("decoder") if isinstance(model, dict) else None
    if not isinstance(decoder, dict):
        raise FastCarError(f"{cfg_path}: needs a 'model' object holding a 'decoder' object (genai's layout); rebuild "
                           "the folder with the model builder")
    name = decoder.get("filename")
    if not isinstance(name, str) or not name:
        raise FastCarError(f"{cfg_path}: model.decoder.filename must be the decoder's file name (a string)")
    if Path(name).is_absolute() or os.path.normpath(name).split(os.sep)[0] == "..":  # a link inside may lead out
        raise FastCarError(f"{cfg_path}: model.decoder.filename {name!r} lies outside the folder; genai reads a "
                           "model only from below its config's folder")
    for key in ("inputs", "outputs", "session_options"):
        if key in decoder and not isinstance(decoder[key], dict):
            raise FastCarError(f"{cfg_path}: model.decoder.{key} must be an object")
    for key in ("inputs", "outputs"):
        if any(not isinstance(v, str) for v in decoder.get(key, {}).values()):
            raise FastCarError(f"{cfg_path}: model.decoder.{key} must map names to strings")
    search = config.get("search", {})
    if not isinstance(search, dict) or not isinstance(search.get("past_present_share_buffer", False), bool):
        raise FastCarError(f"{cfg_path}: search must be an object and search.past_present_share_buffer true/false")
    return config, check_input_file(src / name, "genai_config.json's model.decoder.filename")


def speculation_config(config: dict, draft: str, k: int | None, ngram: int) -> dict:
    """The target's genai_config with the speculation block (plus the draft model's block for the temporal
    draft)."""
    out = json.loads(json.dumps(config))
    spec: dict = {"max_draft_tokens": k} if k is not None else {"max_draft_tokens": ADAPTIVE_MAX,
                                                                "min_adaptive_k": ADAPTIVE_START}
    if draft == contract.DRAFT_TEMPORAL:
        out["model"]["draft"] = _draft_block(config["model"]["decoder"])
    else:
        spec["ngram_size"] = ngram
    out["speculative"] = spec
    return out


def write(genai_dir: str | os.PathLike, out_dir: str | os.PathLike, draft: str, frame_tokens: int | None,
          ngram: int = NGRAM_SIZE) -> list[Path]:
    """Write OUT: genai_config.json, draft.onnx for the temporal draft, and copies of GENAI_DIR's other files
    (genai 0.18 reads a model only from below its config's folder: no '..', no absolute path). GENAI_DIR is
    left as is and never written into; OUT's files appear together or not at all (staged beside them, then
    renamed). Returns the files written."""
    from fastcar_compile.core.fileio import check_output_dir, copy_file, staged_dir

    src, dst = Path(genai_dir), Path(out_dir)
    spec = parse_draft(draft)
    if spec.kind == contract.DRAFT_BOTH:
        raise FastCarError("genai cannot combine a draft model with its n-gram lookup; give --draft temporal[:K] "
                           "or --draft ngram[:K]")
    if spec.tokens is not None and spec.tokens > GENAI_MAX_DRAFT:
        raise FastCarError(f"--draft {draft}: genai verifies at most {GENAI_MAX_DRAFT} draft tokens a step")
    if not 2 <= ngram <= GENAI_MAX_DRAFT:
        raise FastCarError(f"--ngram-size {ngram}: genai takes 2 to {GENAI_MAX_DRAFT}")
    if spec.kind == contract.DRAFT_TEMPORAL and (frame_tokens is None or frame_tokens < 1):
        raise FastCarError("--draft temporal needs --frame-tokens L (tokens per frame, >= 1)")
    config, target = read_config(src)
    if dst.resolve().is_relative_to(src.resolve()):
        raise FastCarError(f"-o {dst}: write into a folder outside the input {src} (it is left as is: nothing is "
                           "written inside it)")
    check_output_dir(dst, "-o")
    vocab, ids_type = _target_io(target, config)
    cfg = speculation_config(config, spec.kind, spec.tokens, ngram)
    names: list[str] = []
    with staged_dir(dst) as tmp:
        if spec.kind == contract.DRAFT_TEMPORAL:
            shared = bool(config.get("search", {}).get("past_present_share_buffer", False))
            write_bytes(tmp / DRAFT_FILE, temporal_draft(vocab, frame_tokens, shared, ids_type).SerializeToString())
            names.append(DRAFT_FILE)
        for f in sorted(src.iterdir()):  # the model, its weights, the tokenizer: genai reads only below its folder
            if f.is_file() and f.name not in ("genai_config.json", DRAFT_FILE):
                copy_file(f, tmp / f.name, progress=False)  # a copy, not a link (onnx refuses linked data files)
                names.append(f.name)
        write_text(tmp / "genai_config.json", json.dumps(cfg, indent=4) + "\n")
        names.append("genai_config.json")
    return [dst / n for n in names]

