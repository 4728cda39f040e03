"""Write a demo video model as a user would have theirs: a transformers folder (save_pretrained, with the
recommended decoding in its generation_config.json) plus prompt files and the held-out truth, for the README walk
from "my transformers model" to "measured speed-up on my model", and for evaluating it with one's own code.

    python scripts/demo_as_user_model.py --out my-model   # my-model/{config.json, model.safetensors,
                                                          #   generation_config.json, tokenizer files (one word
                                                          #   per token id)}; in the current folder:
                                                          # calib.npy (64 prompts), heldout.npy (16 prompts),
                                                          # heldout_truth.npy, frame_shape.json

A prompt row is the model's text prompt (video model: [BOS, 6 label tokens, VIDEO_START]; small model: [BOS,
motion, VIDEO_START]) then frame 0 (64 tokens): the first frame is given, so the commands pass
--given-video-tokens 64. heldout_truth.npy is int64 [clips, F x L]: the ground-truth token ids of the F frames
after each held-out prompt (--truth-frames, default 16). frame_shape.json: {"frame_tokens": L, "shape": [h, w]}.
`model.generate(prompt, max_new_tokens=F * L)` of transformers then samples as recommended (its
`suppress_tokens` keep the label tokens out). Calibration clips and held-out clips are disjoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def write_id_tokenizer(folder: Path, vocab: int) -> None:
    """A tokenizer with one word per token id (t0, t1, ...) beside the weights: onnxruntime-genai's model builder
    reads the folder offline and fails without tokenizer files; token ids go in and come out unchanged
    (docs/genai.md)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                            pad_token="t0").save_pretrained(folder)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("my-model"))
    ap.add_argument("--demo-model", choices=("video", "small"), default="video")
    ap.add_argument("--calib", type=int, default=64)
    ap.add_argument("--heldout", type=int, default=16)
    ap.add_argument("--truth-frames", type=int, default=16, help="frames of truth after each held-out prompt")
    a = ap.parse_args(argv)
    from fastcar_compile.core.atomic import atomic_path, write_text
    from fastcar_compile.demo.bundled import spec as demo_spec
    from fastcar_compile.demo.bundled import video_files
    from fastcar_compile.demo.export import load_model

    spec = demo_spec(a.demo_model)
    model = load_model(*video_files()[:2]) if a.demo_model == "video" else load_model()
    for k, v in spec.decoding.generation_config(spec.codes, model.config.vocab_size).items():
        setattr(model.generation_config, k, v)
    model.generation_config.bos_token_id = None
    from fastcar_compile.core.progress import hf_bars_on_terminal_only

    hf_bars_on_terminal_only()
    model.save_pretrained(a.out)
    write_id_tokenizer(a.out, model.config.vocab_size)
    tok = spec.tokenizer()
    L = tok.tokens_per_frame
    clips = spec.clips(a.calib + a.heldout, 1 + a.truth_frames, 0)
    for name, sel in (("calib", clips[:a.calib]), ("heldout", clips[a.calib:])):
        codes = [tok.encode(c.frames) for c in sel]
        rows = np.array([spec.prompt(c) + [int(t) for t in k[0]] for c, k in zip(sel, codes, strict=True)], np.int64)
        files = {f"{name}.npy": rows}
        if name == "heldout":
            files["heldout_truth.npy"] = np.stack([k[1:].reshape(-1) for k in codes]).astype(np.int64)
        for fname, arr in files.items():
            with atomic_path(Path(fname)) as tmp, open(tmp, "wb") as f:
                np.save(f, arr)
            print(f"wrote {fname} {list(arr.shape)}")
    g = int(round(np.sqrt(L)))
    write_text(Path("frame_shape.json"), json.dumps({"frame_tokens": L, "shape": [g, g]}))
    print("wrote frame_shape.json")
    cfg = f" (CFG needs the unconditional prompt {spec.uncond}: rows of your own loop)" if spec.uncond else ""
    print(f"wrote {a.out}/ (transformers LlamaForCausalLM, frames of {L} tokens = {g}x{g}; recommended decoding in "
          f"generation_config.json: {spec.decoding.describe()}{cfg})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
