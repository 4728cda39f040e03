"""The compiler's options, each declared once: name, type, default, bounds or choices, help, command-line form,
the metadata field that records it and whether the PyTorch front end takes it.

Everything else is derived from `OPTIONS`: the fields of `passes.context.CompileOptions` (and its per-option
checks), the keywords of `fastcar_compile.compile`, the `fastcar-compile` flags (and the keywords every compile
of one command line uses: the calibration's probe and final compile included), the checks of
`fastcar_compile.torch.apply` and the option table of README.md (tests/test_compile_options.py fails on drift).
A new option is one entry here plus the code that acts on it. This module imports nothing heavy: `--help`
builds its parser from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastcar_compile.core import contract
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.limits import (
    DEFAULT_ROTARY_POSITIONS,
    INT8_DIRS,
    MAX_ANN_TABLES,
    MAX_FRAME_TOKENS,
    MAX_KV_BUDGET,
    MAX_KV_DIAGNOSTICS,
    MAX_LSH_BITS,
    MAX_REPLAY,
    MAX_ROTARY_POSITIONS,
    UINT32_MAX,
    check_int,
)

REQUIRED = dataclasses.MISSING  # an option without a default (frame_tokens)

# Command-line forms (argparse): a value; a switch (store_true); on|off; --no-X (store_false); --X/--no-X with an
# unset default; repeatable; a value that may be left out (`--fused-attention` alone = its `const`).
VALUE, SWITCH, ON_OFF, NEGATE, TRISTATE, REPEAT, OPTIONAL = "value", "switch", "on|off", "negate", "tristate", \
    "repeat", "optional"
EVICTION_POLICIES = ("mass", "oldest", "mean")  # which slot leaves a full compressed KV cache (fastar/cache.py)
# The bucketings (sign random projections: fastar/lsh.py, or 8-bit quantised ones: fastar/int8.py; everywhere by
# these words: --sparse-attention lsh:BxT|int8:DxT, --kv-layer sparse=, --annsa, --tempcache-match) and TempCache's
# correspondents on a DiT (the compiled step graph records them): the contract's
TEMPCACHE_MATCHES, BUCKETINGS = contract.TEMPCACHE_MATCHES, contract.BUCKETINGS
KV_GROUP = "compressed KV cache (FAST-AR, in the fastcar attention op; docs/fastar.md)"
DIT_GROUP = "FAST-AR on video DiTs (compiled into a step graph, or the stream runtime; docs/dit.md)"
DIT_ONLY = ("tempcache_match", "annsa", "annsa_local", "ann_always", "annca", "lsh_bits", "int8_dirs",
            "ann_tables", "ann_seed")  # options of DiTs alone (step graphs, the stream)
# Option names (keywords and flags) that were replaced by another one, refused with a line naming it
RENAMED = {"fastcar_tau": "threshold", "tau": "threshold", "fastcar_ratio": "calibrate_replay",
           "tempcache_sim": "tempcache", "quant_dirs": "int8_dirs", "annsa_always": "ann_always"}


class NotANumber(ValueError, argparse.ArgumentTypeError):
    """A value that does not read as a number; argparse prints its text after the flag's name."""


def ascii_int(text: str) -> int:
    """An integer written in ASCII digits (int() also reads '٢' as 2, and '1_000'): the CLI's integer reader."""
    body = text[1:] if text[:1] in "+-" else text
    if not body or not (body.isascii() and body.isdigit()):
        raise NotANumber(f"not an integer in ASCII digits: {text!r}")
    return int(text)


def ascii_float(text: str) -> float:
    """A number written in ASCII (float() also reads Arabic-Indic digits): the CLI's number reader."""
    try:
        if not text.isascii():
            raise ValueError
        return float(text)
    except ValueError:
        raise NotANumber(f"not a number in ASCII digits: {text!r}") from None


LAYER_LIST_FORM = "use indices and ranges like 0,2-5"


def parse_layer_ranges(text: str, flag: str, form: str = LAYER_LIST_FORM) -> list[tuple[int, int]]:
    """'0,2-5' -> [(0, 0), (2, 5)]: the one reader of a layer list (--layers, --kv-layer's LAYERS), in ASCII
    digits; the ranges stay unexpanded, so that a caller bounds them (the model's layers) before expanding."""
    out = []
    for part in str(text).split(","):
        lo, dash, hi = (x.strip() for x in part.partition("-"))
        if not _digits(lo) or (dash and not _digits(hi)) or (dash and int(hi) < int(lo)):
            raise FastCarError(f"{flag}: cannot read layers {part.strip()!r} in {str(text)!r}; {form}")
        out.append((int(lo), int(hi or lo)))
    return out


def _digits(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes '²' (which int() refuses) and '٢' (which int() reads as 2)."""
    return text.isascii() and text.isdigit()


@dataclass(frozen=True)
class Option:
    """One compile option. `lo`/`hi` bound numbers (ints checked as integers), `choices` bound words; `convert`
    replaces those checks for options with their own grammar (value -> stored value, FastCarError when bad)."""

    name: str
    type: Any
    default: Any
    help: str
    flag: str | None = None  # None: a Python keyword only
    cli: str = VALUE
    metavar: str | None = None
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] | None = None
    convert: Callable[[Any], Any] | None = None
    parse: Callable[[str], Any] | None = None  # the CLI's reader of a VALUE (default: by type)
    const: Any = None  # OPTIONAL: the value of the bare flag
    group: str | None = None  # CLI help group (None: the main one)
    record: str | None = None  # the contract.FastCarMetadata field that records it
    torch: bool = False  # also an option of fastcar_compile.torch.apply
    meaning: str = ""  # said in range errors

    def check(self, value: Any, name: str | None = None) -> Any:
        """The value as stored, or one FastCarError naming the option (`name`: how the caller spells it)."""
        name = name or self.flag or self.name
        if self.convert is not None:
            return self.convert(value)
        if value is None and self.default is None:
            return None
        if self.type is bool or self.cli in (SWITCH, ON_OFF, NEGATE, TRISTATE):
            return bool(value)
        if self.choices is not None:
            if value not in self.choices:
                raise FastCarError(f"{name} must be one of {', '.join(self.choices)}, got {value!r}")
            return value
        if _is_int(self):
            return check_int(name, value, int(self.lo), int(self.hi), self.meaning)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or \
                not self.lo <= value <= self.hi:
            raise FastCarError(f"{name} must be {self.meaning or 'a number'} in [{self.lo:g}, {self.hi:g}], "
                               f"got {value!r}")
        return float(value)


def _is_int(o: Option) -> bool:
    return o.lo is not None and o.type in (int, int | None)


def _threshold(value) -> tuple[float, ...]:
    return tuple(float(t) for t in contract.check_thresholds(value).reshape(-1))


def check_int8_dirs(value, name: str = "--int8-dirs") -> int:
    """int8 directions per bucket table: one of INT8_DIRS."""
    if isinstance(value, bool) or value not in INT8_DIRS:
        raise FastCarError(f"{name} must be one of {', '.join(map(str, INT8_DIRS))} (int8 directions per table), "
                           f"got {value!r}")
    return int(value)


def _one_threshold(value) -> float | None:
    """One tau for every layer (None: not given)."""
    if value is None:
        return None
    taus = _threshold(value)
    if len(taus) != 1:
        raise FastCarError(f"--threshold gives {len(taus)} values: one tau for every layer is taken here")
    return taus[0]


def _cli_tempcache(text: str) -> float:
    """--tempcache's reader: SIM, with a refusal naming --tempcache-match for a correspondent given instead."""
    if text in TEMPCACHE_MATCHES:
        raise argparse.ArgumentTypeError(f"renamed: --tempcache takes SIM (the cosine above which keys merge); give "
                                         f"the correspondent as --tempcache-match {text}")
    return ascii_float(text)


def _tas_query(value) -> str:
    contract.check_tas_query(value)
    return value


FUSED_ATTENTION = ("gqa", "fastcar")


def check_fused_attention(value: str | bool | None) -> str | None:
    """--fused-attention's value: 'gqa' | 'fastcar' | None ('off'/False); True means 'gqa' (the first one built)."""
    if value is None or value is False or value == "off":
        return None
    if value is True:
        return "gqa"
    if value not in FUSED_ATTENTION:
        raise FastCarError(f"--fused-attention must be one of {', '.join(FUSED_ATTENTION)} or off, got {value!r}")
    return value


def _layers(value) -> str | tuple[int, ...] | None:
    """Read against the model's layers by discovery (passes/analysis.parse_layers); a list becomes a tuple."""
    return value if value is None or isinstance(value, str) else tuple(value)


def _kv_layers(value) -> tuple[str, ...]:
    return tuple(value or ())  # each read with the model's frame_tokens (passes/context.parse_kv_layer)


OPTIONS: tuple[Option, ...] = (
    Option("frame_tokens", int, REQUIRED, "tokens per video frame L (aligned token is L positions back)",
           "--frame-tokens", lo=1, hi=MAX_FRAME_TOKENS, meaning="tokens per video frame", record="frame_tokens",
           torch=True, metavar="L"),
    Option("threshold", float | Sequence[float], (-4.0,),
           "tau: replay when TAS > tau (default -4; inf never replays). With --per-layer-threshold a "
           "comma-separated list, one per rewritten layer. Stored as the default of "
           "'fastcar_threshold', which FastCarSession can override per run", "--threshold", convert=_threshold, record="threshold", torch=True,
           metavar="TAU"),
    Option("tas_query", str, contract.TAS_ROPE,
           "query for TAS: 'rope' = as attention uses it (default); 'raw' = before RoPE, as the published FastCar "
           "code does, so its thresholds (-1/-4/-8) carry over", "--tas-query", choices=contract.TAS_QUERIES,
           convert=_tas_query, record="tas_query", torch=True),
    Option("max_replay", int, 0, "drift guard: recompute a slot replayed K frames in a row (0 = unlimited, the "
           "paper)", "--max-replay", metavar="K", lo=0, hi=MAX_REPLAY, meaning="0 = unlimited", record="max_replay",
           torch=True),
    Option("layers", str | Sequence[int] | None, None, "rewrite only these decoder layers, e.g. 0,2-5 (default: "
           "all matched)", "--layers", convert=_layers, torch=True),
    Option("per_layer_threshold", bool, False, "make fastcar_threshold a [layers] input, one tau per rewritten "
           "layer", "--per-layer-threshold", cli=SWITCH, record="per_layer_threshold", torch=True),
    Option("emit_diagnostics", bool, False, "add outputs replay_mask.N and tas.N per rewritten layer",
           "--emit-diagnostics", cli=SWITCH, record="diagnostics"),
    Option("fused_attention", str | bool | None, "fastcar",
           "replace exported attention cores (cache Concat, K transpose, MatMul/Softmax) by an attention that "
           "writes the KV cache in place: 'fastcar' (default) = the ai.fastcar CompressedAttention op (native "
           "kernel; exact with left padding, batch > 1, multi-token steps); 'gqa' (the bare flag) = "
           "com.microsoft.GroupQueryAttention (batch > 1 multi-token steps after the prompt are refused by ORT's "
           "kernel); 'off' = keep the exported attention", "--fused-attention", cli=OPTIONAL, const="gqa",
           metavar="fastcar|gqa|off", convert=check_fused_attention),
    Option("fusions", bool, True, "before discovery, fuse the export's RMSNorm chains into "
           "(Skip)SimplifiedLayerNormalization and rotate-half RoPE into RotaryEmbedding (same values, fewer "
           "kernels per step; default on)", "--fusions", cli=ON_OFF),
    Option("native_attention", bool, True, "com.microsoft.GroupQueryAttention (genai graphs, --fused-attention "
           "gqa) -> the ai.fastcar op with the native dense attention core: same semantics, faster; its function "
           "body is the original op, so without the native library nothing changes; on a DiT step graph, "
           "--annsa's form: the ai.fastcar AnnSAAttention op where the native library builds, off = the ONNX-op "
           "graph (default on)",
           "--native-attention", cli=ON_OFF),
    Option("pack_qkv", bool, True, "with --fusions and --fused-attention fastcar or gqa: one packed q/k/v MatMul "
           "per layer, RoPE inside the attention op (CompressedAttention or GroupQueryAttention) and the gate, at "
           "KV-index positions (the export's up to rounding when position_ids count each row's real tokens, as "
           "FastCarSession feeds them; padding only before a row's first real token; default on)", "--pack-qkv",
           cli=ON_OFF),
    Option("rotary_positions", int, DEFAULT_ROTARY_POSITIONS,
           f"KV positions the packed attention's rotary table covers (default {DEFAULT_ROTARY_POSITIONS}); "
           "FastCarSession refuses a longer video", "--rotary-positions", metavar="N", lo=1,
           hi=MAX_ROTARY_POSITIONS, meaning="KV positions the packed attention's rotary table covers"),
    Option("kv_budget", int | None, None, "fixed KV slots per layer and KV head (memory stays flat)", "--kv-budget",
           metavar="C", lo=1, hi=MAX_KV_BUDGET, meaning="KV slots per layer and KV head", group=KV_GROUP),
    Option("kv_sinks", int, 0, "first S tokens always kept (attention sinks)", "--kv-sinks", metavar="S", lo=0,
           hi=MAX_KV_BUDGET, meaning="tokens always kept, below --kv-budget", group=KV_GROUP),
    Option("kv_window", int, 0, "last W tokens always kept (local window; on FastCar layers at least a frame)", "--kv-window", metavar="W", lo=0,
           hi=MAX_KV_BUDGET, meaning="tokens always kept, below --kv-budget", group=KV_GROUP),
    Option("kv_eviction", str, "mass", "which slot leaves a full cache: least attention mass received (default), "
           "oldest, or mean (least mass per token the slot holds: TempCache merges do not protect a slot)", "--kv-eviction", choices=EVICTION_POLICIES, group=KV_GROUP),
    Option("tempcache", float | None, None, "TempCache: merge a key into the slot of its temporal correspondent when "
           "their pre-RoPE cosine exceeds SIM (mean value, count, +log(count) on the logit); a decoder's "
           "correspondent is its aligned token (p - L), a DiT's --tempcache-match's", "--tempcache", metavar="SIM",
           lo=-1.0, hi=1.0, meaning="a cosine", parse=_cli_tempcache, group=KV_GROUP),
    Option("tempcache_match", str, "aligned", "TempCache's correspondent on a DiT (a step graph from export --dit, "
           "or the stream): 'aligned' = the same (h, w) one frame back; another = the top-1 pre-RoPE cosine among the "
           "previous frame's slots sharing a bucket of that bucketing ('lsh', 'int8': --lsh-bits, --int8-dirs, "
           "--ann-tables, --ann-seed), matched when the frame is written; DiTs only", "--tempcache-match", choices=TEMPCACHE_MATCHES,
           group=DIT_GROUP),
    Option("sparse_attention", str | None, None, "AnnSA: a decode query attends only to slots sharing a bucket "
           "(plus sinks, window): sign random projections (lsh) or 8-bit quantised projections (int8 = int8:2x4)",
           "--sparse-attention", metavar="lsh:BITSxTABLES|int8[:DIRSxTABLES]", parse=str, group=KV_GROUP,
           convert=lambda v: v if v is None else str(v)),  # read by passes/context.parse_sparse_attention
    Option("prune_prompt", float | None, None, "AnnCA for decoder-only models: prompt keys (before video_start) "
           "that no query of the previous frame gave softmax weight >= P are skipped for the current frame",
           "--prune-prompt", metavar="P", lo=0.0, hi=1.0, meaning="a softmax weight", group=KV_GROUP),
    Option("kv_diagnostics", int | None, None, "also run dense attention on the side (up to M tokens) and output "
           "kv_stats.N per layer: density and recall against dense, in the run stats (RunStats.kv_diagnostics)",
           "--kv-diagnostics", metavar="M", lo=1, hi=MAX_KV_DIAGNOSTICS, meaning="tokens the dense side buffer "
           "holds", group=KV_GROUP),
    Option("kv_layers", Sequence[str], (), "per-layer settings instead of the ones above, repeatable: e.g. "
           "0:budget=129,sinks=4,window=124,eviction=oldest (a window where a layer reads by position) "
           "1-3:budget=4100,window=64,tempcache=0.95 (TempCache where it reads by content), 2:off (uncompressed); settings: "
           "budget, sinks, window, eviction, tempcache, sparse (lsh:BxT, int8:DxT), prune (P)", "--kv-layer",
           cli=REPEAT, metavar="LAYERS:SETTINGS", convert=_kv_layers, group=KV_GROUP),
    # FAST-AR on a video DiT: compiled into its step graph (passes/dit_plan.py) and run by the eager stream runtime
    # (dit/modes.DIT_OPTIONS holds these same entries): one declaration for both.
    Option("annsa", str | None, None, "AnnSA: the chunk's queries attend only to cached slots sharing a bucket "
           "(any table), plus the sink frames, the --annsa-local most recent frames and the chunk itself; "
           "computed block-sparse, bucket by bucket; DiTs only", "--annsa", choices=BUCKETINGS,
           group=DIT_GROUP),
    Option("annsa_local", int, 1, "cached frames before the chunk that AnnSA always attends (default 1)",
           "--annsa-local", metavar="FRAMES", lo=0, hi=contract.MAX_ANNSA_LOCAL, meaning="frames", group=DIT_GROUP),
    Option("ann_always", bool, False, "compile AnnSA / AnnCA into every block even where the cost model predicts "
           "they would not pay (by default such a block keeps its dense attention, and --inspect -v says why)",
           "--ann-always", cli=SWITCH, group=DIT_GROUP),
    Option("annca", bool, False, "AnnCA: per frame, a prompt token is kept in the cross-attention only if a query "
           "of that frame shares a bucket with it (--annsa's bucketing, lsh without it); DiTs only",
           "--annca", cli=SWITCH, group=DIT_GROUP),
    Option("lsh_bits", int, 4, "sign bits per LSH table (default 4)", "--lsh-bits", metavar="BITS", lo=1,
           hi=MAX_LSH_BITS, meaning="bits per table", group=DIT_GROUP),
    Option("int8_dirs", int, 2, "int8-quantised directions per 'int8' table (1/2/4/8; default 2: 16 x 16 "
           "levels)", "--int8-dirs", metavar="DIRS", convert=check_int8_dirs, parse=ascii_int, group=DIT_GROUP),
    Option("ann_tables", int, 2, "bucket tables of AnnSA / AnnCA / TempCache's ANN match (default 2)",
           "--ann-tables", metavar="T", lo=1, hi=MAX_ANN_TABLES, meaning="tables", group=DIT_GROUP),
    Option("ann_seed", int, 0, "seed of the bucket projections", "--ann-seed", metavar="SEED", lo=0, hi=2**32 - 1,
           meaning="a seed", group=DIT_GROUP),
    Option("genai", bool | None, None, "name the state for onnxruntime-genai's generator and write "
           "genai_config.json beside the output (default: when the input sits beside one)", "--genai", cli=TRISTATE,
           convert=lambda v: v if v is None else bool(v)),
    Option("required_video_inputs", bool, False, "make video_start and fastcar_threshold plain inputs without "
           "defaults, fed every run (onnxruntime-genai's generator.set_model_input then sets them per video)",
           "--required-video-inputs", cli=SWITCH),
    Option("provider", str, "cpu", "the ONNX Runtime execution provider the model is compiled for: cpu (the "
           "ai.fastcar ops, their native kernels when built) or cuda (only ops the CUDA provider has kernels for: the "
           "ai.fastcar ops' function bodies inlined, every op checked against its kernel table; docs/scale.md)",
           "--provider", choices=contract.PROVIDERS),
    Option("video_start", int | None, None, "KV index of the first video token, compiled in as the default of the "
           "video_start input (e.g. 0 when every prompt is video, the prompt's length when a fixed-length text "
           "prompt precedes the video). Without it video_start is an input every run must feed (FastCarSession "
           "sets it from the prompt; a plain ONNX Runtime session that leaves it out is refused) instead of a "
           "silent 0, with which a text prompt's last MLP outputs would be replayed into frame 0. With --target "
           "fpga: recorded in the bundle (default 0)", "--video-start", metavar="N", lo=0, hi=UINT32_MAX,
           meaning="a KV index"),
    Option("validate", bool, True, "skip the onnx.checker + ONNX Runtime check of the result before it is written",
           "--no-validate", cli=NEGATE),
    Option("shared_mlp", bool, True, "each MLP's nodes once in the compute branch (ONNX Runtime then keeps only "
           "the prepacked MLP weights: docs/memory.md); False keeps the older nested layout with a second MLP copy "
           "for compacted rows"),
)
BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}
# A compile option's value picked by the runtime instead (threshold calibration: cmd_compile, and the DiT stream)
CALIBRATE_REPLAY = Option("calibrate_replay", float | None, None, "pick tau so that the replay ratio reaches RATIO "
                          "(0-1; a decoder: on --calib-data, a DiT: the TAS quantile of a first stream)",
                          "--calibrate-replay", metavar="RATIO", lo=0.0, hi=1.0, meaning="a replay ratio")
# --threshold as one tau for every layer, no default (None: a caller's own default): the demo's, and FastCar on DiT
# blocks (the stream's eager runtime, fastcar_compile.torch.apply_dit), where the decoders' default does not apply
ONE_THRESHOLD = dataclasses.replace(BY_NAME["threshold"], type=float | None, default=None, convert=_one_threshold)
DIT_THRESHOLD = dataclasses.replace(
    ONE_THRESHOLD, group=DIT_GROUP,
    help="tau: a DiT token's FFN output is replayed from the same (h, w) one frame earlier at the same denoising "
         "step when its TAS (query vs the key one frame back, mean over heads, / sqrt(d)) exceeds TAU; the other "
         "rows alone go through the FFN (default: no replay)")
CLI_OPTIONS: tuple[Option, ...] = tuple(o for o in OPTIONS if o.flag is not None)
TORCH_OPTIONS: tuple[Option, ...] = tuple(o for o in OPTIONS if o.torch)


def fields() -> list[tuple[str, Any, Any]]:
    """(name, type, dataclasses.field) of each option, for the options dataclass."""
    return [(o.name, o.type, dataclasses.field(default=o.default)) for o in OPTIONS]


def check_all(values: dict[str, Any], spell: Callable[[Option], str] | None = None) -> dict[str, Any]:
    """Each value checked and converted by its option (errors name it as `spell(option)` says)."""
    return {name: BY_NAME[name].check(v, spell(BY_NAME[name]) if spell else None) for name, v in values.items()}


def unknown(keywords: Sequence[str], func: str, declared: Sequence[Option] = OPTIONS) -> None:
    """A TypeError, as Python's, for a keyword that is not one of `declared` (with the list of those that are)."""
    names = [o.name for o in declared]
    bad = [k for k in keywords if k not in names]
    if bad and RENAMED.get(bad[0]) in names:
        raise TypeError(f"{func}() got an unexpected keyword argument {bad[0]!r}: renamed: use {RENAMED[bad[0]]}")
    if bad:
        raise TypeError(f"{func}() got an unexpected keyword argument {bad[0]!r}; its options: " + ", ".join(names))


def signature(func: Callable, leading: int, declared: Sequence[Option] = OPTIONS) -> inspect.Signature:
    """`func`'s signature with its first `leading` parameters followed by the options as keywords."""
    params = list(inspect.signature(func).parameters.values())[:leading]
    params += [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, annotation=o.type,
                                 **({} if o.default is REQUIRED else {"default": o.default})) for o in declared]
    return inspect.Signature(params, return_annotation=inspect.signature(func).return_annotation)


# ------------------------------------------------------------------------------------------------ command line
def _cli_reader(o: Option) -> Callable[[str], Any]:
    if o.parse is not None:
        return o.parse
    if o.name == "threshold":
        return _cli_threshold
    if o.choices is not None or o.convert is not None:
        return str
    return ascii_int if _is_int(o) else ascii_float


def _cli_threshold(text: str) -> list[float]:
    values = read_thresholds(text)
    if values is None:
        raise argparse.ArgumentTypeError(f"not a number or comma-separated list of numbers: {text!r}")
    try:
        return list(_threshold(values))
    except FastCarError as exc:  # NaN, or beyond float32 (where the model stores tau)
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--threshold ")) from None


def read_thresholds(text: str) -> list[float] | None:
    """A --threshold value's numbers, or None when it does not read as numbers (negative values need joining)."""
    try:
        return [ascii_float(t) for t in text.split(",")]
    except ValueError:
        return None


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


class _Renamed(argparse.Action):
    """A flag that was replaced by another: refused naming the one to use."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: renamed: use {self.metavar}")


def add_arguments(parser: argparse.ArgumentParser, declared: Sequence[Option] | None = None) -> None:
    """Every option with a flag, in declaration order, in its help group (what `fastcar-compile` accepts;
    `declared`: another command's options, e.g. the DiT stream's); a renamed flag of one of them (RENAMED) is
    refused with the flag to use."""
    groups: dict[str | None, Any] = {None: parser}
    chosen = CLI_OPTIONS if declared is None else [o for o in declared if o.flag is not None]
    for old, new in RENAMED.items():
        if any(o.name == new for o in chosen):
            parser.add_argument(flag_of(old), action=_Renamed, nargs="?", metavar=flag_of(new), help=argparse.SUPPRESS)
    for o in chosen:
        if o.group not in groups:
            groups[o.group] = parser.add_argument_group(o.group)
        add = groups[o.group].add_argument
        if o.cli == SWITCH:
            add(o.flag, dest=o.name, action="store_true", help=o.help)
        elif o.cli == NEGATE:
            add(o.flag, dest=o.name, action="store_false", help=o.help)
        elif o.cli == TRISTATE:
            add(o.flag, dest=o.name, action=argparse.BooleanOptionalAction, default=None, help=o.help)
        elif o.cli == ON_OFF:
            add(o.flag, dest=o.name, choices=["on", "off"], default="on" if o.default else "off", help=o.help)
        elif o.cli == REPEAT:
            add(o.flag, dest=o.name, action="append", default=[], metavar=o.metavar, help=o.help)
        elif o.cli == OPTIONAL:
            add(o.flag, dest=o.name, nargs="?", const=o.const, default=o.default, metavar=o.metavar, help=o.help)
        else:
            default = None if o.default is REQUIRED else list(o.default) if isinstance(o.default, tuple) \
                else o.default
            add(o.flag, dest=o.name, type=_cli_reader(o), default=default, help=o.help, metavar=o.metavar,
                **({"choices": list(o.choices)} if o.choices else {}))


def from_args(args: argparse.Namespace, **overrides) -> dict[str, Any]:
    """The `fastcar_compile.compile` keywords a parsed command line sets (every option with a flag), with
    `overrides`: each compile of one command line (the calibration's probe and final one too) starts here."""
    out = {o.name: (getattr(args, o.name) == "on" if o.cli == ON_OFF else getattr(args, o.name)) for o in CLI_OPTIONS}
    out.update(overrides)
    return out
