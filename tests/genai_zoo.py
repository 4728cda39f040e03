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

import zoo

FAMILIES = ("llama", "qwen2", "phi3")
PRECISIONS = ("fp32", "fp16", "int4")
GENAI_VOCAB = 160


def build_model(family: str):
    """The transformers model a genai graph of `family` is built from (fp32, random, seeded)."""
    return zoo.build_model(family, vocab=GENAI_VOCAB)


def _save_hf(family: str, out: Path) -> None:
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    build_model(family).save_pretrained(out)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(GENAI_VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                                      pad_token="t0")
    fast.save_pretrained(out)


def build(family: str, precision: str, out_dir: str | os.PathLike) -> Path:
    """Folder out_dir/genai-<family>-<precision> with model.onnx + genai_config.json (reused if present)."""
    out = Path(out_dir) / f"genai-{family}-{precision}"
    if (out / "genai_config.json").exists() and (out / "model.onnx").exists():
        return out
    hf = Path(out_dir) / f"hf-{family}"
    if not (hf / "config.json").exists():
        _save_hf(family, hf)
    tmp = Path(out_dir) / f".genai-{family}-{precision}.tmp"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(tmp),
           "-p", precision, "-e", "cpu", "-c", str(Path(out_dir) / "genai-cache")]
    if precision == "int4":  # the zoo's widths are 64/128: the default block 32 fits, accuracy 4 = int8 A
        cmd += ["--extra_options", "int4_block_size=32"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not (tmp / "model.onnx").exists():
        raise RuntimeError(f"genai builder failed for {family}/{precision}:\n{proc.stderr[-3000:]}")
    os.replace(tmp, out)
    return out
