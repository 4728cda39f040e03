"""`fastcar-compile genai-speculate GENAI_DIR -o OUT --draft temporal:K --frame-tokens L`: speculative decoding in
onnxruntime-genai's own loop (the folder runtime/genai_draft.py writes; docs/speculation.md)."""

from __future__ import annotations

import argparse

from fastcar_compile.core import contract
from fastcar_compile.core.options import ascii_int
from fastcar_compile.runtime.genai_draft import GENAI_MAX_DRAFT, NGRAM_SIZE, write
from fastcar_compile.runtime.speculate import ADAPTIVE_START


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="fastcar-compile genai-speculate", description="Speculative decoding in onnxruntime-genai's generator: "
        "write a genai folder that reads GENAI_DIR's model and verifies previous-frame drafts (a draft ONNX model) "
        "or genai's own n-gram lookup. Greedy output is the model's (docs/speculation.md).")
    ap.add_argument("genai_dir", help="the dense model's genai folder (genai_config.json + model.onnx), left as is")
    ap.add_argument("-o", "--output", required=True, help="output folder (genai_config.json, draft.onnx, tokenizer)")
    ap.add_argument("--draft", default=contract.DRAFT_TEMPORAL,
                    help="temporal[:K] (the token one frame back, a draft model) or ngram[:K] (genai's lookup); "
                    f"K fixed draft tokens per step (1-{GENAI_MAX_DRAFT}), else genai's adaptive K from "
                    f"{ADAPTIVE_START}")
    ap.add_argument("--frame-tokens", type=ascii_int, help="tokens per frame (the temporal draft's offset)")
    ap.add_argument("--ngram-size", type=ascii_int, default=NGRAM_SIZE,
                    help=f"ngram: genai's n-gram order (matches the last N - 1 tokens; default {NGRAM_SIZE})")
    return ap


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    files = write(a.genai_dir, a.output, a.draft, a.frame_tokens, a.ngram_size)
    print(f"wrote {', '.join(p.name for p in files)} to {a.output}")
    return 0
