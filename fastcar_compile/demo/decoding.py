"""How the demo's video models choose tokens: sampled by default (temperature / top-k / top-p, classifier-free
guidance with the unconditional prompt), greedy as an option; declared once for `demo`, `demo --long`, `eval`
and the transformers folder's `generation_config.json`.

Why sampling is the default: AR video models in use sample (VILA-U: top-k 900 of 16k codes, top-p 0.96,
CFG 3), and greedy decoding of small models freezes (every frame an exact copy of the previous one), so
quality and replay figures measured greedily describe stills. The choice itself is the runtime's
(`runtime.sampling`, NumPy float64 on the host), so a dense and a FastCar session given the same seed draw
the same uniforms: their videos differ only where replay changed the logits.

Only image codes may be drawn: the label / BOS / VIDEO_START tokens are masked before the choice, so every
generated frame decodes. Each clip gets its own seed, derived from the run's seed and the clip's index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.runtime.sampling import Sampler

DECODING_MODES = ("sample", "greedy")


@dataclass(frozen=True)
class Decoding:
    """Token choice of a demo video. cfg_scale None (or a model without an unconditional prompt): no guidance."""

    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    cfg_scale: float | None = None

    def __post_init__(self) -> None:
        Sampler(self.do_sample, self.temperature, self.top_k, self.top_p)  # the sampler's own argument checks
        if self.cfg_scale is not None and not np.isfinite(self.cfg_scale):
            raise FastCarError(f"cfg_scale must be a finite number, got {self.cfg_scale}")

    def greedy(self) -> Decoding:
        return replace(self, do_sample=False, cfg_scale=None)

    def describe(self) -> str:
        if not self.do_sample:
            return "greedy"
        parts = [f"sampled: temperature {self.temperature:g}", f"top-k {self.top_k or 'off'}", f"top-p {self.top_p:g}"]
        parts.append(f"CFG {self.cfg_scale:g}" if self.cfg_scale is not None else "no CFG")
        return ", ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)

    def generation_config(self, codes: int, vocab: int) -> dict:
        """transformers' GenerationConfig fields for this decoding (`generation_config.json`). transformers
        has no 'mask these ids' sampling knob besides `suppress_tokens`, which is what keeps non-code ids out;
        its CFG (`guidance_scale`) builds the unconditional rows itself, so it is recorded, not enabled."""
        cfg = {"do_sample": self.do_sample, "temperature": self.temperature, "top_k": self.top_k,
               "top_p": self.top_p, "suppress_tokens": list(range(codes, vocab))}
        if not self.do_sample:
            cfg = {"do_sample": False, "suppress_tokens": cfg["suppress_tokens"]}
        return cfg


# The recommended decoding of the conditioned video model: VILA-U's temperature and top-p, top-k scaled to a
# 512-code vocabulary, CFG 1.5 instead of VILA-U's 3: on 4 held-out clips x 16 frames (800-step weights) CFG 3 gave
# 16.4 dB vs truth and a copy rate 11 points under the truth's, CFG 1.5 17.5 dB and 7 points under; temperature
# 0.7 drifts toward copying (copy rate 0.82 vs the truth's 0.47), greedy freezes every clip (docs/demo.md).
SAMPLED = Decoding(do_sample=True, temperature=1.0, top_k=256, top_p=0.96, cfg_scale=1.5)
GREEDY = Decoding(do_sample=False)


def clip_seed(seed: int, index: int) -> int:
    """The sampler seed of clip `index` of a run seeded `seed` (independent streams per clip)."""
    return int(np.random.SeedSequence([int(seed), int(index)]).generate_state(1, np.uint64)[0])


def code_mask(codes: int) -> Callable[[np.ndarray], np.ndarray]:
    """A logits processor that leaves only the image codes [0, codes) choosable."""

    def mask(logits: np.ndarray) -> np.ndarray:
        out = np.array(logits, dtype=np.float64, copy=True)
        out[..., codes:] = -np.inf
        return out

    return mask


def add_decoding_args(ap) -> None:
    """The decoding options of `demo` and `eval` (unset: the model's recommended decoding)."""
    from fastcar_compile.core.options import ascii_float, ascii_int

    g = ap.add_argument_group("decoding (default: sampled with the model's recommended settings)")
    g.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling (no CFG)")
    g.add_argument("--temperature", type=ascii_float, default=None, help="sampling temperature (> 0)")
    g.add_argument("--top-k", type=ascii_int, default=None, help="sample among the k likeliest codes (0 = off)")
    g.add_argument("--top-p", type=ascii_float, default=None, help="nucleus sampling mass in (0, 1] (1 = off)")
    g.add_argument("--cfg-scale", type=ascii_float, default=None,
                   help="classifier-free guidance u + s (c - u) with the unconditional prompt (1 = off; models "
                        "trained without an unconditional prompt have none)")
    g.add_argument("--sample-seed", type=ascii_int, default=0,
                   help="sampler seed of the run (clip i draws from a stream of (seed, i); dense and FastCar share it)")


def decoding_from_args(a, default: Decoding) -> Decoding:
    """`default` with the options given on the command line (one-line errors for bad values)."""
    given = {k: getattr(a, k) for k in ("temperature", "top_k", "top_p", "cfg_scale") if getattr(a, k) is not None}
    if a.greedy:
        if given:
            raise FastCarError(f"--greedy takes no sampling options (got {', '.join('--' + k.replace('_', '-') for k in given)})")
        return GREEDY
    if a.sample_seed < 0:
        raise FastCarError(f"--sample-seed must be >= 0, got {a.sample_seed}")
    if given.get("cfg_scale") == 1.0:
        given["cfg_scale"] = None
    return replace(default, do_sample=True, **given)
