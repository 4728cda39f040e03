"""Per-token decode time in onnxruntime-genai's own loop (`og.Generator`): a genai graph compiled by us at
forced replay ratios vs genai's dense model on the same weights.

A seeded random LLaMA (hidden 1024, 8 layers, 16 heads / 2 KV heads, MLP 3072; `_common.build_random_llama`)
is saved with save_pretrained plus a WordLevel tokenizer and built by genai's model builder (fp32, cpu;
cached). Variants, each a folder genai loads (compiled ones get genai_config.json from the compiler):
- `dense`: the builder's graph;
- `noMLP`: the same graph with every MLP branch replaced by zeros (for f, the MLP share of a dense step);
- `denseN`, `noMLPN`: the same two with genai's GroupQueryAttention swapped for the native ai.fastcar op
  (`fastcar_compile.native_attention`, passes/native_gqa.py): the fastest dense decode a user can get here, so
  every speed-up is printed against it as well as against genai dense;
- `rK`: compiled with frame_tokens L and per-layer tau, K of the layers at tau=-inf (always replay: every
  decode token here is past frame 0) and the rest +inf (never), so the replay ratio is exactly K / layers;
  compiled with the native GroupQueryAttention (the compiler's default; `--native-attention off`: ORT's op).
(b) the same weights exported by torch.onnx (dynamo, opset 20; `_common.cached_export`), compiled with
fused attention (`--fused-kinds`: the compiler's default `fastcar` = ai.fastcar.CompressedAttention's native
kernel -> variants `fcK`; `gqa` = com.microsoft.GroupQueryAttention -> `fusedK`) and a per-layer tau input,
run by FastCarSession with a shared KV buffer (max_length) and tau fed per step, K layers at -inf; its
Python cost per step (step time - time inside ORT) is reported too. `fc@80` (`--fractions`): (b) at 80% replay,
which is no whole number of the 8 layers per step: a 5-step schedule replaying 6, 6, 7, 6, 7 layers (32 of 40),
timed in whole cycles, the per-cycle mean step time taken (og.Generator variants are compiled per count, so (a)
has no such row: its 80% lies between r6 and r7).
For each context, one generator (or session) per variant is prefilled with `ctx` tokens, then the variants
decode in turn, `--block` tokens at a time after one untimed step (interleaved, so machine load hits them alike;
blocks, so no model runs with a working set the others evicted), `--tokens` timed steps each; per-token time is
the lower quartile (robust to steps preempted by other jobs). genai session threads: --threads (intra-op), set in each folder's genai_config.json.

    python benchmarks/bench_genai.py                       # ctx 1024 and 4096 (several minutes on 2 cores)
    python benchmarks/bench_genai.py --quick               # small model, ctx 256: smoke run
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_CACHE,
    LlamaShape,
    add_hugepage_flag,
    build_random_llama,
    cached_export,
    hugepage_malloc_record,
    interleave,
    lower_quartile_ms,
    ms_lists,
    ort_options,
    reexec_with_hugepage_malloc,
    save_results,
)

from fastcar_compile.core.atomic import write_text  # noqa: E402

FULL = dict(shape=LlamaShape(hidden=1024, layers=8, heads=16, kv_heads=2, intermediate=3072, vocab=2048,
                             max_pos=4608), contexts=(1024, 4096), frame_tokens=256, tokens=48)
QUICK = dict(shape=LlamaShape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=704, vocab=512,
                              max_pos=1024), contexts=(256,), frame_tokens=64, tokens=16)


def build_genai(shape: LlamaShape, cache: Path) -> Path:
    """The builder's fp32 cpu graph of the seeded model (cached)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = cache / f"genai-{shape.tag()}"
    if (out / "genai_config.json").is_file():
        return out
    hf = cache / f"hf-{shape.tag()}"
    if not (hf / "config.json").is_file():
        build_random_llama(shape).save_pretrained(hf)
        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(shape.vocab)}, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                                pad_token="t0").save_pretrained(hf)
    tmp = cache / f".genai-{shape.tag()}.tmp"
    print(f"building the genai graph of {shape} ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(tmp),
                    "-p", "fp32", "-e", "cpu", "-c", str(cache / "genai-cache")], check=True,
                   stdout=subprocess.DEVNULL)
    tmp.rename(out)
    return out


def strip_mlp(src: Path, out: Path) -> None:
    """The dense genai graph with each MLP branch output replaced by zeros (entry * 0): the step without MLPs."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    from fastcar_compile.passes.discover import discover

    model = ir.load(src / "model.onnx")
    zero = ir.Value(name="bench.zero", const_value=ir.tensor(np.array(0.0, np.float32), name="bench.zero"))
    zero.type, zero.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape([])
    model.graph.register_initializer(zero)
    for m in discover(model):
        if not m.ok:
            raise RuntimeError(f"layer {m.layer} did not match: {m.failure}")
        node = ir.node("Mul", [m.mlp.entry, zero], name=f"bench/{m.layer}/nomlp")
        model.graph.insert_before(m.mlp.closing, node)
        m.mlp.closing.replace_input_with(list(m.mlp.closing.inputs).index(m.mlp.output), node.outputs[0])
    RemoveUnusedNodesPass()(model)
    out.mkdir(parents=True, exist_ok=True)
    ir.save(model, out / "model.onnx", external_data="model.onnx.data")
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model.onnx"):
            shutil.copyfile(f, out / f.name)


# ORT session config entries every variant runs with (dense included: the baseline is the fastest dense decode).
# genai 0.18 hands any unknown string key of `session_options` to AddConfigEntry (checked: a bad
# "session.load_model_format" makes og.Model fail). Which entries are faster: the A/B study
# 08784a2:benchmarks/experiments/ab_genai_session_config.py (in history, `git show` it).
SESSION_CONFIG: dict[str, str] = {}


def parse_entries(items: list[str] | None) -> dict[str, str]:
    """KEY=VALUE strings -> {KEY: VALUE}."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("session."):
            raise SystemExit(f"--session-config: expected session.KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def _uses_fastcar(folder: Path) -> bool:
    """The folder's model imports the ai.fastcar domain (compiled variants, denseN): it wants the native library."""
    import onnx

    from fastcar_compile.core import contract

    cfg = json.loads((folder / "genai_config.json").read_text())
    model = onnx.load(str(folder / cfg["model"]["decoder"]["filename"]), load_external_data=False)
    return any(o.domain == contract.DOMAIN for o in model.opset_import)


def set_session(folder: Path, threads: int, native: bool, entries: dict[str, str] | None = None) -> None:
    """Threads, ORT config entries (replacing earlier ones), and the native ai.fastcar kernels (genai's
    `custom_ops_library`) when built and wanted."""
    from fastcar_compile.runtime.native import library_path

    cfg_path = folder / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    so = cfg["model"]["decoder"].setdefault("session_options", {})
    for key in [k for k in so if k.startswith("session.")]:
        del so[key]
    so.update(SESSION_CONFIG if entries is None else entries)
    so["intra_op_num_threads"], so["inter_op_num_threads"] = threads, 1
    lib = library_path()
    if native and lib is not None and _uses_fastcar(folder):
        local = folder / lib.name  # genai loads custom-op libraries only from the model folder (or the cwd)
        shutil.copyfile(lib, local)
        so["custom_ops_library"] = str(local.resolve())
    else:
        so.pop("custom_ops_library", None)
    write_text(cfg_path, json.dumps(cfg, indent=4))


def compiler_stamp() -> str:
    """A hash of the compiler's sources: a cached compiled variant is rebuilt when the compiler changed (an old
    compile would otherwise be measured silently)."""
    import hashlib

    import fastcar_compile
    from fastcar_compile import passes
    from fastcar_compile.runtime import native

    h = hashlib.sha1()
    for root in (Path(fastcar_compile.__file__).parent, Path(passes.__file__).parent):
        for f in sorted(root.rglob("*.py")):
            h.update(f.read_bytes())
    # compiled genai folders carry a copy of the native library: kernel sources count as the compiler too
    for f in sorted(Path(native.__file__).parent.glob("*.[ch]*")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def stale(out: Path) -> bool:
    """`out` (a compiled model) is missing or was compiled by other compiler sources."""
    stamp = out.parent / (out.name + ".compiler")
    return not out.is_file() or not stamp.is_file() or stamp.read_text() != compiler_stamp()


def mark_fresh(out: Path) -> None:
    write_text(out.parent / (out.name + ".compiler"), compiler_stamp())


def replay_counts(layers: int, only: list[int] | None = None) -> list[int]:
    """How many layers replay in the measured variants: 0, half, 3/4, all but one, all (or `only` of them)."""
    ks = list(dict.fromkeys(k for k in (0, layers // 2, (3 * layers) // 4, layers - 1, layers)))
    return [k for k in ks if only is None or k in only]


def variants(src: Path, work: Path, layers: int, frame_tokens: int, only: list[int] | None = None,
             native_attention: str = "on") -> dict[str, Path]:
    """Folders per variant name. native_attention: "on" = rK compiled with the swap, "off" = without, "both" = rK
    with and oK without (same run, so the swap's effect on (a) is a same-run ratio)."""
    import fastcar_compile

    out = {"dense": src}
    nomlp = work / "noMLP"
    if not (nomlp / "model.onnx").is_file():
        strip_mlp(src, nomlp)
    out["noMLP"] = nomlp
    dense_n, nomlp_n = work / "denseN", work / "noMLPN"
    if stale(dense_n / "model.onnx"):
        fastcar_compile.native_attention(src / "model.onnx", dense_n / "model.onnx")
        strip_mlp(dense_n, nomlp_n)
        mark_fresh(dense_n / "model.onnx")
    out["denseN"], out["noMLPN"] = dense_n, nomlp_n
    kinds = {"on": [("r", True)], "off": [("r", False)], "both": [("r", True), ("o", False)]}[native_attention]
    for k in replay_counts(layers, only):
        spread = {round(i * layers / k) for i in range(k)} if k else set()  # replaying layers, spread out
        taus = [-np.inf if i in spread else np.inf for i in range(layers)]
        for prefix, swap in kinds:
            folder = work / (f"r{k}" if swap else f"r{k}-ortgqa")
            if stale(folder / "fast.onnx"):
                fastcar_compile.compile(src / "model.onnx", folder / "fast.onnx", frame_tokens=frame_tokens,
                                        threshold=taus, per_layer_threshold=True, native_attention=swap,
                                        video_start=0)  # og.Generator feeds no video_start: prompts are video
                mark_fresh(folder / "fast.onnx")
            out[f"{prefix}{k}"] = folder
    return out


class FusedStepper:
    """FastCarSession on the fused dynamo export with the per-layer tau of one forced replay ratio.

    `taus` is one per-layer tau array, or a list of them used in turn, one per step (a replay ratio that is
    not a whole number of layers per step, e.g. 80% of 8 layers = 6, 6, 7, 6, 7 replaying layers over 5
    steps); `restart()` goes back to the first one, so a timed block covers whole cycles."""

    def __init__(self, sess, taus, prompt: np.ndarray):
        self.sess, self.cycle = sess, taus if isinstance(taus, list) else [taus]
        self.phase = 0
        out = sess.step(sess.new_state(1), prompt.astype(np.int64), threshold=self.cycle[0])
        self.state, self.ids, self.python_s = out.state, out.logits[:, -1].argmax(-1)[:, None], []

    def restart(self) -> None:
        self.phase = 0

    def generate_next_token(self) -> None:
        taus = self.cycle[self.phase % len(self.cycle)]
        self.phase += 1
        t0 = time.perf_counter()
        out = self.sess.step(self.state, self.ids, threshold=taus, check=False)
        self.python_s.append(time.perf_counter() - t0 - self.sess.last_ort_s)
        self.state, self.ids = out.state, out.logits[:, -1].argmax(-1)[:, None]



def replay_schedule(layers: int, ratio: float, max_cycle: int = 20) -> list[np.ndarray]:
    """Per-step tau arrays whose replaying layers average exactly `ratio` over one cycle (the shortest c with
    ratio x layers x c whole): step t replays floor((t+1) r L) - floor(t r L) layers, spread over the depth and
    rotated so every layer replays about the same share of steps."""
    per_step = ratio * layers
    cycle = next((c for c in range(1, max_cycle + 1) if abs(per_step * c - round(per_step * c)) < 1e-9), None)
    if cycle is None:
        raise ValueError(f"replay ratio {ratio} x {layers} layers repeats over more than {max_cycle} steps")
    out = []
    for t in range(cycle):
        k = round((t + 1) * per_step) - round(t * per_step)
        spread = {(round(i * layers / k) + t) % layers for i in range(k)} if k else set()
        out.append(np.array([-np.inf if i in spread else np.inf for i in range(layers)], np.float32))
    return out


def fused_export(shape: LlamaShape, cache: Path, frame_tokens: int, kind: str | None = "gqa") -> Path:
    """(b): the dynamo export of the same seeded weights, compiled with fused attention (`kind`: gqa or
    fastcar, --fused-attention; None: the exported attention kept) and per-layer tau. The export fusions
    (RMSNorm, RoPE; --fusions) are on, as by default, except for `KIND-nofusions` and the unfused export (whose
    role is the plain export's step)."""
    import fastcar_compile

    base, fusions = (kind[:-len(NO_FUSIONS)], False) if kind and kind.endswith(NO_FUSIONS) else (kind, kind is not None)
    name = {"gqa": "fused", None: "unfused"}.get(base, f"fused-{base}")
    # compiles cached before the fusions existed must not stand in for either setting
    tag = "-fz" if fusions else "-nofz" if base is not None else ""
    out = cache / f"{name}-{shape.tag()}-L{frame_tokens}{tag}" / "fast.onnx"
    if stale(out):
        fastcar_compile.compile(cached_export(shape, cache), out, frame_tokens=frame_tokens,
                                threshold=[np.inf] * shape.layers, per_layer_threshold=True, fused_attention=base,
                                fusions=fusions)
        mark_fresh(out)
    return out


NO_FUSIONS = "-nofusions"
# fused-attention kind -> variant name prefix in (b); "-nofusions": the same without the export fusions
FUSED_PREFIX = {"fastcar": "fc", "gqa": "fused", "fastcar" + NO_FUSIONS: "fcn", "gqa" + NO_FUSIONS: "fusedn"}


def measure(folders: dict[str, Path], ctx: int, tokens: int, vocab: int, fused: dict[str, Path] | None = None,
            layers: int = 0, threads: int = 2, block: int = 8,
            entries: dict[str, str] | None = None, only: list[int] | None = None,
            clock=time.perf_counter, fractions: tuple[float, ...] = ()) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Prefill every variant with the same ctx tokens, then time them in turn, `block` tokens at a time.

    Blocks, not single steps: stepping a dozen ~0.4 GB models in lockstep evicts each one's working set
    (caches, prepacked weights, KV/state buffers) before its next step, which made a FastCar step at 0%
    replay look 3x slower than the same step timed alone (48 vs 17 ms at ctx 1024). Each block starts with
    one untimed step, so every timed step follows a step of the same model, as in a real decode loop.
    `fractions`: replay ratios of (b) that are no whole number of layers (variant `<prefix>@<percent>`, per-step
    layer schedules from replay_schedule); their blocks are whole cycles and their times are per-cycle means.
    """
    import onnxruntime_genai as og

    block = max(1, min(block, tokens))
    rounds = -(-tokens // block)
    schedules = {r: replay_schedule(layers, r) for r in fractions} if fused else {}
    cycled = {r: len(c) * -(-block // len(c)) for r, c in schedules.items()}  # whole cycles per block
    steps = rounds * (max([block, *cycled.values()]) + 1)  # timed + one warm-up step per block

    prompt = np.random.default_rng(0).integers(3, vocab, (1, ctx)).astype(np.int32)
    gens, keep = {}, []
    for kind, path in (fused or {}).items():
        from fastcar_compile.runtime import FastCarSession

        so = ort_options(threads, entries=SESSION_CONFIG if entries is None else entries)
        sess = FastCarSession(path, session_options=so, threads=threads, max_length=ctx + steps + 2)
        for k in replay_counts(layers, only):
            spread = {round(i * layers / k) for i in range(k)} if k else set()
            taus = np.array([-np.inf if i in spread else np.inf for i in range(layers)], np.float32)
            t0 = time.perf_counter()
            name = f"{FUSED_PREFIX[kind]}{k}"
            gens[name] = FusedStepper(sess, taus, prompt)
            print(f"  ctx {ctx}: {name} prefilled in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for r, cycle in schedules.items():
            name = f"{FUSED_PREFIX[kind]}@{round(100 * r)}"
            gens[name] = FusedStepper(sess, cycle, prompt)
            print(f"  ctx {ctx}: {name} ({len(cycle)}-step layer schedule) prefilled", file=sys.stderr)
    for name, folder in folders.items():
        model = og.Model(str(folder))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=ctx + steps + 2, do_sample=False)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(prompt)
        print(f"  ctx {ctx}: {name} prefilled in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        gens[name] = gen
        keep.append(model)
    for gen in gens.values():  # the first call only samples the token the prefill computed
        gen.generate_next_token()
    cycled_gens = {n: g for n, g in gens.items() if isinstance(g, FusedStepper) and len(g.cycle) > 1}
    # a schedule's block is whole cycles from its first step: restarted after the untimed step
    warm = {n: (lambda g=g: (g.generate_next_token(), g.restart())) for n, g in cycled_gens.items()}
    sizes = {n: len(g.cycle) * -(-block // len(g.cycle)) if n in cycled_gens else block for n, g in gens.items()}
    times = interleave({n: g.generate_next_token for n, g in gens.items()}, rounds, sizes, clock=clock, warm=warm)
    for name, gen in gens.items():  # a schedule's statistic is over whole cycles: per-cycle mean step times
        if isinstance(gen, FusedStepper) and len(gen.cycle) > 1:
            c = len(gen.cycle)
            times[name] = [float(np.mean(times[name][i:i + c])) for i in range(0, len(times[name]), c)]
    python = {n: float(np.median(g.python_s)) * 1e3 for n, g in gens.items() if isinstance(g, FusedStepper)}
    return times, python


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # NO_HUGEPAGES whole
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--contexts", help="comma-separated contexts (default: 1024,4096; quick: 256)")
    ap.add_argument("--tokens", type=int, help="decode tokens timed per variant")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block", type=int, default=8, help="tokens timed per variant before moving to the next")
    ap.add_argument("--no-native", action="store_true", help="run the ai.fastcar function bodies, not the kernels")
    ap.add_argument("--no-fused", action="store_true", help="skip (b), the fused dynamo export")
    ap.add_argument("--native-attention", choices=["on", "off", "both"], default="on",
                    help="compile (a) with genai's GroupQueryAttention swapped for the native ai.fastcar op (on, the "
                         "default), without (off), or both in one run (variants rK and oK)")
    ap.add_argument("--fused-kinds", default="fastcar,gqa",
                    help="fused-attention kinds measured in (b), comma-separated (fastcar, gqa; KIND-nofusions: "
                         "compiled with --fusions off)")
    ap.add_argument("--ratios", help="comma-separated numbers of replaying layers to measure (default: 0, half, "
                                     "3/4, all but one, all)")
    ap.add_argument("--fractions", default="0.8",
                    help="comma-separated replay ratios of (b) that are no whole number of layers, measured with a "
                         "per-step layer schedule (default 0.8, the issue's 80%%; '' for none). (a)'s og.Generator "
                         "variants are compiled per replay count, so they have no such row")
    add_hugepage_flag(ap)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--out", type=Path, default=Path("fastcar-out/bench/bench_genai.json"))
    ap.add_argument("--cpu-time", action="store_true",
                    help="time steps by process CPU time (a loaded machine: use with --threads 1 --no-fused; "
                         "genai's ORT threads spin, so at 2 threads CPU time is not the step time)")
    ap.add_argument("--session-config", action="append", metavar="session.KEY=VALUE",
                    help="ORT config entry for every variant, dense included (repeatable; replaces the default "
                         f"{SESSION_CONFIG or 'none'})")
    a = ap.parse_args(argv)
    entries = SESSION_CONFIG if a.session_config is None else parse_entries(a.session_config)
    cfg = dict(QUICK if a.quick else FULL)
    contexts = [int(c) for c in a.contexts.split(",")] if a.contexts else list(cfg["contexts"])
    tokens = a.tokens or cfg["tokens"]
    shape: LlamaShape = cfg["shape"]
    src = build_genai(shape, a.cache)
    work = a.cache / f"genai-variants-{shape.tag()}-L{cfg['frame_tokens']}"
    only = [int(k) for k in a.ratios.split(",")] if a.ratios else None
    folders = variants(src, work, shape.layers, cfg["frame_tokens"], only, a.native_attention)
    for f in folders.values():
        set_session(f, a.threads, not a.no_native, entries)
    try:
        fractions = tuple(float(x) for x in a.fractions.split(",") if x.strip())
        for r in fractions:
            if not 0 < r < 1:
                raise ValueError(f"{r} is not between 0 and 1")
            replay_schedule(shape.layers, r)
    except ValueError as e:
        ap.error(f"--fractions: {e}; give ratios such as 0.8")
    kinds = [k.strip() for k in a.fused_kinds.split(",") if k.strip()]
    if bad := [k for k in kinds if k not in FUSED_PREFIX]:
        ap.error(f"--fused-kinds: unknown kind(s) {', '.join(bad)}; use {' or '.join(FUSED_PREFIX)}")
    fused = {} if a.no_fused else {k: fused_export(shape, a.cache, cfg["frame_tokens"], k) for k in kinds}
    results = {"shape": shape.tag(), "threads": a.threads,
               **hugepage_malloc_record(), "tokens": tokens, "session_config": entries,
               "clock": "cpu" if a.cpu_time else "wall",
               "contexts": {}}
    for ctx in contexts:
        times, python = measure(folders, ctx, tokens, shape.vocab, fused, shape.layers, a.threads, a.block, entries,
                                only, time.process_time if a.cpu_time else time.perf_counter, fractions)
        med = lower_quartile_ms(times)
        f = 1 - med["noMLP"] / med["dense"]
        # the fastest dense decode measured in this run: the baseline a speed-up counts against
        fastest = min(("dense", "denseN"), key=lambda n: med.get(n, float("inf")))
        f_fast = 1 - med[{"dense": "noMLP", "denseN": "noMLPN"}[fastest]] / med[fastest]
        rows = []
        print(f"\nctx {ctx}: genai dense {med['dense']:.2f} ms/token, without MLPs {med['noMLP']:.2f} "
              f"(MLP share f = {f:.3f}); {a.threads} threads, {tokens} tokens, lower quartiles"
              f"{' of process CPU time' if a.cpu_time else ''}; "
              f"ORT config entries {entries or 'none'}")
        if "denseN" in med:
            print(f"genai dense with our attention (denseN) {med['denseN']:.2f} ms/token = "
                  f"{med['dense'] / med['denseN']:.3f}x genai dense; without MLPs {med['noMLPN']:.2f} "
                  f"(f = {1 - med['noMLPN'] / med['denseN']:.3f})")
        print(f"fastest dense: {fastest} {med[fastest]:.2f} ms/token (f = {f_fast:.3f}); the bound below is "
              "1/(1 - f r) with that f, the speed-up / bound vs the fastest dense")
        print("| replay | ms/token | speed-up vs genai dense | speed-up vs fastest dense | bound 1/(1-f r) | "
              "speed-up / bound | o = bound / speed-up |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for prefix, what in (("r", "(a) genai graph compiled by us, in og.Generator"),
                             ("o", "(a) without the native GroupQueryAttention (--native-attention off)"),
                             ("fc", "(b) dynamo export, fused attention (ai.fastcar op), FastCarSession shared KV"),
                             ("fcn", "(b) without the export fusions (--fusions off)"),
                             ("fused", "(b') dynamo export, fused attention (GQA; the native ai.fastcar one unless "
                                       "--native-attention off), FastCarSession shared KV"),
                             ("fusedn", "(b') without the export fusions (--fusions off)")):
            replay = {n: int(n[len(prefix):]) / shape.layers for n in med
                      if n.startswith(prefix) and n[len(prefix):].isdigit()}
            replay |= {n: int(n[len(prefix) + 1:]) / 100 for n in med
                       if n.startswith(prefix + "@") and n[len(prefix) + 1:].isdigit()}
            if replay:
                print(f"| {what} | | | | | | |")
            for name, r in sorted(replay.items(), key=lambda nr: nr[1]):
                sp, sp_fast, bound = med["dense"] / med[name], med[fastest] / med[name], 1 / (1 - f_fast * r)
                rows.append({"variant": name, "replay": r, "ms": med[name], "speedup": sp,
                             "speedup_vs_fastest_dense": sp_fast, "bound": bound, "python_ms": python.get(name)})
                extra = f" (Python {python[name]:.2f} ms)" if name in python else ""
                print(f"| {r:.1%} | {med[name]:.2f}{extra} | {sp:.3f} | {sp_fast:.3f} | {bound:.3f} | "
                      f"{sp_fast / bound:.1%} | {bound / sp_fast:.3f} |")
        results["contexts"][str(ctx)] = {"ms": med, "f": f, "fastest_dense": fastest, "f_fastest": f_fast,
                                         "rows": rows,
                                         "raw_ms": ms_lists(times)}
    return save_results(a.out, results)


if __name__ == "__main__":
    # every variant's weights in huge pages: otherwise the session created first runs slower (_common)
    reexec_with_hugepage_malloc(sys.argv[1:])
    sys.exit(main())
