"""Write the bundled video model as a user would have theirs: a transformers folder (save_pretrained) plus
prompt files, for the README walk from "my transformers model" to "measured speed-up on my model".

    python scripts/demo_as_user_model.py --out my-model   # my-model/{config.json, model.safetensors},
                                                          # calib.npy (64 clips), heldout.npy (16 clips)

A prompt row is [BOS, motion, VIDEO_START, frame 0 (64 tokens)]: the first frame is given, so the
commands pass --given-video-tokens 64. Calibration clips and held-out clips are disjoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("my-model"))
    ap.add_argument("--calib", type=int, default=64)
    ap.add_argument("--heldout", type=int, default=16)
    a = ap.parse_args(argv)
    from fastcar_compile.core.atomic import atomic_path
    from fastcar_compile.demo import data
    from fastcar_compile.demo.evaluate import load_tokenizer
    from fastcar_compile.demo.export import load_model
    from fastcar_compile.demo.model import prompt

    load_model().save_pretrained(a.out)
    tok = load_tokenizer()
    for name, start, n in (("calib", 0, a.calib), ("heldout", a.calib, a.heldout)):
        clips = data.make_clips("eval", n, frames=2, start=start)
        rows = np.array([prompt(c.motion) + [int(t) for t in tok.encode(c.frames)[0]] for c in clips], np.int64)
        with atomic_path(Path(f"{name}.npy")) as tmp, open(tmp, "wb") as f:
            np.save(f, rows)
        print(f"wrote {name}.npy {list(rows.shape)}")
    print(f"wrote {a.out}/ (transformers LlamaForCausalLM, frames of 64 tokens = 8x8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
