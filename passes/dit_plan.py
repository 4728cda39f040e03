"""The DiT target's plan: the compiler's options a DiT step graph takes, checked into the modes compiled in
(contract.DiTModes), and per block what discovery found and what the emission builds from it (DiTBlockPlan).

The emission passes (dit_cache, dit_replay, dit_annca) read each block's plan, never the options: the plan is
where a mode is decided, and `--inspect -v` / `--verbose` print it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fastcar_compile.core import contract, options
from fastcar_compile.core.contract import AnnSARecord, BucketRecord, DiTConfig, DiTModes
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.passes import dit_cost
from fastcar_compile.passes.context import DiTContext
from fastcar_compile.passes.dit_discover import DiTBlockMatch
from fastcar_compile.passes.plan import BlockPlan, KvPlan, Plan

REPLAY_FEATURE = "FastCar FFN replay on DiT blocks"
KV_FEATURE = "the decoders' compressed KV cache (a fixed budget, eviction, their AnnSA and prompt pruning) on DiT blocks"
ANNSA_FEATURE = "AnnSA (bucketed self-attention over the cache) on DiT blocks"
IN_PLACE_OP = "FusedMatMul over the cache buffer (transB, past_length mask) + MatMul over the chunk, one softmax"
ANNSA_GRAPH_OP = ("AnnSA: dense over sinks + local frames (Gather), bucket blocks of queries x keys (GatherND, "
                  "batched MatMul), one softmax")
ANNSA_NATIVE_OP = ("AnnSA: ai.fastcar AnnSAAttention (each query scores its buckets' slots, the dense slots and the "
                   "chunk)")
TEMPCACHE_SLOTS_OP = ("ai.fastcar SlotAttention over the resident slots the runtime lists (tempcache_slots.N) with "
                      "log(count) (past_bias.N): merged-away positions cost nothing")
IN_PLACE_KV = "dense, read in place (the runtime's buffers: sink frames + a ring of window frames)"
REPLAY_OP = "TAS (scaled query . key one frame back, mean over heads) > tau -> FFN on the other rows only " \
    "(NonZero/Gather/ScatterND), replayed rows chained frame by frame"
ANNCA_OP = "per frame, prompt tokens sharing a bucket with a query of the frame (bucket bitmap, no query x " \
    "prompt map) gathered, attention over them only"
BUCKET_SETTINGS = ("lsh_bits", "int8_dirs", "ann_tables", "ann_seed")  # what draws a bucketing, besides its kind
# Options that ask for features a DiT does not have (any value but the default), and those checked on their own.
_REPLAY_OPTIONS = ("tas_query", "max_replay", "per_layer_threshold", "emit_diagnostics", "required_video_inputs")
_KV_OPTIONS = ("kv_budget", "kv_sinks", "kv_window", "kv_eviction", "sparse_attention", "prune_prompt",
               "kv_diagnostics", "kv_layers")
_OWN = ("frame_tokens", "threshold", "tempcache", "validate", "native_attention", "provider", *options.DIT_ONLY)


def _given(opts: dict, name: str):
    """Option `name`'s checked value in `opts`, its declared default (core/options.py) where not given."""
    o = options.BY_NAME[name]
    return o.check(opts.get(name, o.default))


def bucket_record(kind: str, opts: dict) -> BucketRecord:
    """A bucketing as the metadata records it, from the compile's option values (each checked, its default where
    not given); the runtime redraws it (fastar.config.hasher_of)."""
    return BucketRecord(kind, **{k: _given(opts, k) for k in BUCKET_SETTINGS})


def annca_mode(opts: dict) -> BucketRecord | None:
    """`--annca`'s bucketing (None: off): --annsa's, lsh without it (the eager runtime draws the same)."""
    return bucket_record(opts.get("annsa") or "lsh", opts) if opts.get("annca") else None


def native_forms(opts: dict) -> bool:
    """Whether the DiT modes compile to their native ops: `--native-attention` on (default) and the native library
    builds here (else their ONNX-op forms)."""
    if not _given(opts, "native_attention"):
        return False
    from fastcar_compile.runtime.native import library_path

    return library_path() is not None


def annsa_kernel(opts: dict) -> str:
    """AnnSA's compiled form: the native op (native_forms), else the ONNX-op graph."""
    return contract.ANNSA_NATIVE if native_forms(opts) else contract.ANNSA_GRAPH


def annsa_mode(opts: dict) -> AnnSARecord | None:
    """`--annsa lsh|int8` (None: off): its buckets, the local frames and the compiled form."""
    kind = options.BY_NAME["annsa"].check(opts.get("annsa"))
    if kind is None:
        return None
    return AnnSARecord(**dataclasses.asdict(bucket_record(kind, opts)), annsa_local=_given(opts, "annsa_local"),
                       annsa_kernel=annsa_kernel(opts))


def _refuse_foreign(opts: dict) -> None:
    """One line naming the feature for an option a DiT step graph cannot be compiled with."""
    for name, value in opts.items():
        o = options.BY_NAME.get(name)
        if o is None or name in _OWN or value == o.default or (value is None and o.default is None):
            continue
        if isinstance(value, (list, tuple)) and tuple(value) == tuple(o.default or ()):
            continue
        flag = o.flag or name
        if name in _REPLAY_OPTIONS:
            raise FastCarError(f"{flag}: {flag} is not supported with {REPLAY_FEATURE} yet; leave {flag} out (one "
                               "--threshold for every block, TAS from the query as attention uses it)")
        if name in _KV_OPTIONS:
            raise FastCarError(f"{flag}: {KV_FEATURE} is not supported yet; leave {flag} out (a DiT's own modes: "
                               "--annsa, --annca, --tempcache, --threshold)")
        raise FastCarError(f"{flag} does not apply to a DiT step graph (it compiles dense, with the cache read in "
                           f"place); leave {flag} out")


def refuse_unused_always(always: bool, bucketed: bool) -> None:
    """--ann-always without --annsa / --annca would change nothing (the compile's and the stream's check)."""
    if always and not bucketed:
        raise FastCarError("--ann-always is a setting of --annsa / --annca: give one of them with it, or leave "
                           "--ann-always out")


def _refuse_unused_settings(opts: dict, modes: DiTModes) -> None:
    """A bucket or AnnSA setting that no mode compiled in reads would change nothing: refused."""
    annsa_only = ("annsa_local",)
    if "native_attention" in opts and opts["native_attention"] != options.BY_NAME["native_attention"].default and \
            modes.annsa is None and modes.tempcache is None:  # on a DiT it picks AnnSA's and TempCache's forms
        raise FastCarError("--native-attention picks the compiled form of --annsa / --tempcache: give one of them "
                           "with it, or leave --native-attention out")
    refuse_unused_always(bool(opts.get("ann_always")), modes.annsa is not None or modes.annca is not None)
    for name in (*annsa_only, *BUCKET_SETTINGS):
        used = modes.annsa is not None or (name not in annsa_only and (
            modes.annca is not None or modes.tempcache_buckets is not None))
        if not used and name in opts and opts[name] != options.BY_NAME[name].default:
            flag = options.BY_NAME[name].flag
            modes_of = "--annsa" if name in annsa_only else \
                "--annsa / --annca / --tempcache-match " + "|".join(options.BUCKETINGS)
            raise FastCarError(f"{flag} is a setting of {modes_of}: give one of them with it, or leave {flag} out")


def check_options(opts: dict, frame_tokens: int) -> tuple[list[str], DiTModes]:
    """Refuse (one line, naming the feature) what a DiT step graph cannot be compiled with; returns notes and the
    modes to build. The decoders' default tau compiles dense: a DiT takes an explicit one."""
    _refuse_foreign(opts)
    given = opts.get("frame_tokens")
    if given is not None and given != frame_tokens:
        raise FastCarError(f"--frame-tokens {given}: this DiT has {frame_tokens} tokens per latent frame (its "
                           "config); leave --frame-tokens out")
    sim = opts.get("tempcache")
    match = _given(opts, "tempcache_match")
    if sim is None and match != "aligned":
        raise FastCarError(f"--tempcache-match {match} needs --tempcache SIM (the cosine above which keys merge)")
    modes = DiTModes(tempcache=None if sim is None else float(sim), tempcache_match=None if sim is None else match,
                     tempcache_buckets=None if sim is None or match == "aligned" else bucket_record(match, opts),
                     tempcache_kernel=None if sim is None else (contract.TEMPCACHE_SLOTS if native_forms(opts) else
                                                                contract.TEMPCACHE_MASKED),
                     annca=annca_mode(opts), annsa=annsa_mode(opts))
    if modes.annsa is not None and sim is not None:
        raise FastCarError(f"--annsa with --tempcache: {ANNSA_FEATURE} over merged slots is not compiled yet; "
                           "give one of them")
    _refuse_unused_settings(opts, modes)
    taus = [float(t) for t in np.atleast_1d(opts.get("threshold", (np.inf,)))]
    default = tuple(options.BY_NAME["threshold"].default)
    if tuple(taus) == default:
        done = "compiled dense" if modes.dense else "no FFN replay"
        return [f"the decoders' default tau ({default[0]:g}) does not apply to DiT blocks: {done}; give "
                f"--threshold TAU for {REPLAY_FEATURE}"], modes
    if len(taus) != 1:
        raise FastCarError(f"--threshold gives {len(taus)} values: {REPLAY_FEATURE} takes one tau for every block")
    return [], dataclasses.replace(modes, threshold=None if taus[0] == np.inf else taus[0])


@dataclass(frozen=True)
class DiTBlockPlan(BlockPlan):
    """A chunk-causal video DiT block: self-attention over [frame cache; chunk], cross-attention to the prompt,
    FFN, AdaLN modulation. The first fields are discovery's forms, the rest the decisions the emission reads:
    the cache's part of the self-attention (`annsa`: AnnSA's buckets, None: dense in place), TempCache's merge
    (`tempcache` SIM, its match and buckets), AnnCA's buckets and FastCar's tau (None: off)."""

    self_attention: str = ""
    rotary: str = ""
    qk_norm: str = ""
    cross_attention: str = ""
    ffn: str = ""
    modulation: str = ""
    annsa: AnnSARecord | None = None
    annsa_cost: str = ""  # with --annsa: the cost model's verdict (passes/dit_cost.py), also when kept dense
    tempcache: float | None = None
    tempcache_match: str | None = None
    tempcache_kernel: str | None = None
    annca: BucketRecord | None = None
    annca_cost: str = ""  # with --annca: the cost model's verdict, also when kept dense
    replay_tau: float | None = None

    def shown(self) -> list[tuple[str, object]]:
        if not self.matched:
            return []
        a = self.annsa
        op = IN_PLACE_OP if a is None else (
            f"{ANNSA_NATIVE_OP if a.annsa_kernel == contract.ANNSA_NATIVE else ANNSA_GRAPH_OP}; {a.kind} buckets x "
            f"{a.ann_tables} tables, {a.annsa_local} local frames")
        if self.annsa_cost:
            op = f"{op}; AnnSA {self.annsa_cost}"
        cross = self.cross_attention if self.annca is None else (
            f"{self.cross_attention}; AnnCA ({self.annca.kind} buckets x {self.annca.ann_tables} tables): {ANNCA_OP}")
        if self.annca_cost:
            cross = f"{cross}; AnnCA {self.annca_cost}"
        kv = KvPlan(IN_PLACE_KV if self.tempcache is None else
                    f"{IN_PLACE_KV}; TempCache {self.tempcache_match} at SIM {self.tempcache:g} (the runtime merges on "
                    "write; " + (TEMPCACHE_SLOTS_OP if self.tempcache_kernel == contract.TEMPCACHE_SLOTS else
                                 "the graph adds log(count) per slot: past_bias.N") + ")")
        if self.tempcache is not None and self.tempcache_kernel == contract.TEMPCACHE_SLOTS and a is None:
            op = TEMPCACHE_SLOTS_OP
        replay = "none (--threshold TAU replays FFN rows)" if self.replay_tau is None else \
            f"tau {self.replay_tau:g}: {REPLAY_OP}"
        return [("self attention", self.self_attention), ("attention op", op), ("rotary", self.rotary),
                ("qk norm", self.qk_norm), ("cross attention", cross), ("ffn", self.ffn),
                ("modulation", self.modulation), ("kv", kv), ("replay", replay)]


def decision(mode: BucketRecord | None, cost: Callable[[], dit_cost.AnnSACost], always: bool,
             ) -> tuple[BucketRecord | None, str]:
    """A bucketed attention as a block compiles it (None: the dense attention) and the verdict to show: the cost
    model's prediction (passes/dit_cost.py) keeps a block dense where it would not pay, unless `always`."""
    if mode is None:
        return None, ""
    c = cost()
    if c.pays:
        return mode, f"compiled: {c}"
    if always:
        return mode, f"compiled (--ann-always) though it does not pay: {c}"
    return None, f"kept dense: {c}, not below 1 (--ann-always compiles it anyway)"


def decisions(cfg: DiTConfig, annsa: AnnSARecord | None, annca: BucketRecord | None, always: bool,
              ) -> tuple[tuple[AnnSARecord | None, str], tuple[BucketRecord | None, str]]:
    """AnnSA's and AnnCA's decisions on `cfg`'s blocks: what the compiler emits and the eager runtime runs."""
    return (decision(annsa, lambda: dit_cost.predict(cfg, annsa), always),
            decision(annca, lambda: dit_cost.predict_cross(cfg, annca), always))


def plan(matches: list[DiTBlockMatch], modes: DiTModes, rewrite: bool = True, cfg: DiTConfig | None = None,
         ann_always: bool = False) -> Plan:
    """Every block's plan: what discovery found and, for a matched block, the modes compiled into it (AnnSA and
    AnnCA where the cost model says they pay on `cfg`'s shapes, or `ann_always`)."""
    (annsa, sa_verdict), (annca, ca_verdict) = decisions(cfg, modes.annsa, modes.annca, ann_always) \
        if cfg is not None else ((modes.annsa, ""), (modes.annca, ""))
    blocks: list[BlockPlan] = []
    for m in matches:
        if not m.ok:
            blocks.append(DiTBlockPlan(m.layer, False, False))
            continue
        a = m.attention
        blocks.append(DiTBlockPlan(
            m.layer, True, rewrite,
            self_attention=f"Concat(past.{m.layer}.*, chunk) -> MatMul -> Softmax -> MatMul, heads {a.heads}x{a.head_dim}",
            rotary=m.rope, qk_norm=m.qk_norm, cross_attention=m.cross, ffn=m.ffn, modulation=m.modulation,
            annsa=annsa, annsa_cost=sa_verdict, tempcache=modes.tempcache, tempcache_match=modes.tempcache_match,
            tempcache_kernel=modes.tempcache_kernel, annca=annca, annca_cost=ca_verdict, replay_tau=modes.threshold))
    return Plan(tuple(blocks))


def refuse_unmatched(matches: list[DiTBlockMatch]) -> None:
    """Every block must match: the cache inputs change for all of them."""
    failed = [m for m in matches if not m.ok]
    if not matches or failed:
        head = (f"DiT block {failed[0].layer} did not match ({failed[0].summary()})" if failed
                else "no DiT block found (no past.N.key inputs)")
        raise FastCarError(f"{head}; every block must match, since the cache inputs change for all of them "
                           "(run with --inspect to see each block)")


def check_compilable(model: ir.Model) -> None:
    """A step graph not compiled yet (the compile rewrites the export's attention)."""
    if contract.DIT_CACHE_FORM_KEY in model.metadata_props or any(v.name == contract.PAST_LENGTH
                                                                   for v in model.graph.inputs):
        raise FastCarError("the DiT step graph is already compiled (its cache is read in place); compile the "
                           "export")


class DiTPlanPass(ir.passes.InPlacePass):
    """Decide per DiT block what the emission builds (the modes the options asked for), once, from discovery."""

    def __init__(self, ctx: DiTContext):
        super().__init__()
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        refuse_unmatched(self.ctx.matches)
        ctx = self.ctx
        ctx.plan = plan(ctx.matches, ctx.modes, cfg=ctx.cfg, ann_always=bool(ctx.options.get("ann_always")))
        blocks = [b for b in ctx.plan.blocks if isinstance(b, DiTBlockPlan) and b.matched]
        if ctx.modes.annsa is not None and all(b.annsa is None for b in blocks):  # the metadata names what is built
            ctx.modes = dataclasses.replace(ctx.modes, annsa=None)
            ctx.notes.append(f"--annsa: every block {blocks[0].annsa_cost}")
        if ctx.modes.annca is not None and all(b.annca is None for b in blocks):
            ctx.modes = dataclasses.replace(ctx.modes, annca=None)
            ctx.notes.append(f"--annca: every block {blocks[0].annca_cost}")
        return ir.passes.PassResult(model, modified=False)
