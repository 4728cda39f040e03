"""Checkpoints of Wan2.1-style DiTs trained elsewhere, mapped by name onto dit/model.ChunkDiT.

Two layouts besides our own: diffusers' `WanTransformer3DModel` (a folder with config.json and
diffusion_pytorch_model*.safetensors, sharded or not) and the original Wan parameter names that Self-Forcing,
CausVid and Wan's own release use (a `.pt` / `.pth` / `.safetensors` state dict, possibly under a `generator` /
`model` key, or a folder of such safetensors). One table (`TOP`, `BLOCK`) names each of our tensors in both;
every tensor of a checkpoint must be used and every one of ours found, or the load is refused in one line naming
them. Two tensors change layout: the patch embedding (a Conv3d kernel there, a Linear over the patch here, the
same (channel, ph, pw) order) and the head (rows ordered (pt, ph, pw, channel) there, (channel, ph, pw) here).

The shapes (layers, hidden, FFN, text and latent channels, patch, time frequencies) are read from the weights;
the head count from the checkpoint's config (diffusers' `num_attention_heads`, Wan's `num_heads`) or given; the
streaming geometry (latent size, chunk, sinks, window) is not in any of these checkpoints and comes from flags or
a small JSON (`OVERRIDABLE`), DiTConfig's Wan2.1-480p defaults otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastcar_compile.core.contract import DiTConfig
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.dit.config import PRESETS

LAYOUTS = ("fastcar", "diffusers", "wan")

# (ours, diffusers, original Wan): module prefixes outside the blocks; a parameter's suffix (.weight, .bias)
# carries over. Wan's head dim is 128 in every released size: the head count when a checkpoint does not say.
TOP = (
    ("patch_embed", "patch_embedding", "patch_embedding"),
    ("text_embed.0", "condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("text_embed.2", "condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("time_embed.0", "condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("time_embed.2", "condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("time_proj.1", "condition_embedder.time_proj", "time_projection.1"),
    ("head", "proj_out", "head.head"),
    ("head_modulation", "scale_shift_table", "head.modulation"),
)
# The same inside `blocks.N.` (the block prefix is the same in all three). Wan calls the cross-attention's
# LayerNorm norm3 and the FFN's norm2 (as we do); diffusers swaps the two names.
BLOCK = (
    ("q", "attn1.to_q", "self_attn.q"),
    ("k", "attn1.to_k", "self_attn.k"),
    ("v", "attn1.to_v", "self_attn.v"),
    ("o", "attn1.to_out.0", "self_attn.o"),
    ("norm_q", "attn1.norm_q", "self_attn.norm_q"),
    ("norm_k", "attn1.norm_k", "self_attn.norm_k"),
    ("cq", "attn2.to_q", "cross_attn.q"),
    ("ck", "attn2.to_k", "cross_attn.k"),
    ("cv", "attn2.to_v", "cross_attn.v"),
    ("co", "attn2.to_out.0", "cross_attn.o"),
    ("norm_cq", "attn2.norm_q", "cross_attn.norm_q"),
    ("norm_ck", "attn2.norm_k", "cross_attn.norm_k"),
    ("norm3", "norm2", "norm3"),
    ("ffn.0", "ffn.net.0.proj", "ffn.0"),
    ("ffn.2", "ffn.net.2", "ffn.2"),
    ("modulation", "scale_shift_table", "modulation"),
)
HEAD_DIM = 128
# DiTConfig fields a checkpoint does not fix (its shapes do the rest): given by flags or a small JSON.
OVERRIDABLE = ("heads", "latent_h", "latent_w", "chunk_frames", "sink_frames", "window_frames", "text_len",
               "eps", "rope_theta")
# Keys of diffusers' config.json this mapping reads or may ignore; any other is refused (a newer Wan variant).
DIFFUSERS_KEYS = {"patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels",
                  "text_dim", "freq_dim", "ffn_dim", "num_layers", "cross_attn_norm", "qk_norm", "eps",
                  "image_dim", "added_kv_proj_dim", "rope_max_seq_len", "pos_embed_seq_len"}
STATE_KEYS = ("generator", "model", "state_dict", "module")  # where a training checkpoint keeps the weights
PREFIXES = ("model.diffusion_model.", "_orig_mod.", "module.", "model.")  # wrappers' prefixes, stripped


def source_name(ours: str, layout: str) -> str:
    """The checkpoint's name of our tensor `ours` in `layout` (the table's row; KeyError if none)."""
    col = LAYOUTS.index(layout)
    if col == 0:
        return ours
    m = re.match(r"(blocks\.\d+\.)(.*)", ours)
    prefix, rest, rows = (m.group(1), m.group(2), BLOCK) if m else ("", ours, TOP)
    for row in rows:
        if rest == row[0] or rest.startswith(row[0] + "."):
            return prefix + row[col] + rest[len(row[0]):]
    raise KeyError(ours)


def to_ours(name: str, tensor, cfg: DiTConfig):
    """A checkpoint tensor in our layout: the Conv3d patch kernel [D, C, pt, ph, pw] -> [D, C*ph*pw]; the head's
    rows (pt, ph, pw, C) -> (C, ph, pw)."""
    if name == "patch_embed.weight":
        return tensor.reshape(tensor.shape[0], -1)
    if name in ("head.weight", "head.bias"):
        p = math.prod(cfg.patch)
        t = tensor.reshape(p, cfg.in_channels, *tensor.shape[1:]).transpose(0, 1)
        return t.reshape(tensor.shape)
    return tensor


@dataclass
class Checkpoint:
    """Where a checkpoint's tensors are: safetensors files or one torch file (its `key`), in `layout`."""

    layout: str
    files: tuple[Path, ...]
    key: str | None = None  # the torch file's entry holding the state dict (None: the top level)
    strip: str = ""  # a wrapper's prefix on every name
    state: dict | None = None  # the tensors themselves (a module in memory) instead of files

    def tensors(self) -> dict[str, Any]:
        """name -> torch tensor (memory-mapped where the format allows), the wrapper's prefix stripped."""
        state = self.state if self.state is not None else _read(self.files, self.key)[0]
        return {k[len(self.strip):]: v for k, v in state.items()}

    def state_dict(self, cfg: DiTConfig) -> dict[str, Any]:
        """Our float32 state dict (module-level state_dict; dit/model.build calls it)."""
        where = str(self.files[0].parent if len(self.files) != 1 else self.files[0]) if self.files else self.layout
        return state_dict(self, cfg, where)

    def describe(self) -> str:
        if self.state is not None:
            return f"{self.layout} layout (a module in memory)"
        where = self.files[0].name if len(self.files) == 1 else f"{len(self.files)} shards"
        return f"{self.layout} layout ({where}{f', key {self.key!r}' if self.key else ''})"


def _read(files: tuple[Path, ...], key: str | None) -> tuple[dict, str | None]:
    """The state dict of `files` (and the key it sat under)."""
    if files[0].suffix == ".safetensors":
        from safetensors.torch import load_file

        state: dict = {}
        for f in files:
            try:
                state.update(load_file(str(f)))
            except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a broken file
                raise FastCarError(f"{f}: cannot read it as safetensors ({type(exc).__name__})") from None
        return state, None
    import torch

    f = files[0]
    try:
        obj = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - not a zip checkpoint: no mmap
        try:
            obj = torch.load(str(f), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - pickle / zip errors of many types
            raise FastCarError(f"{f}: cannot read it as a PyTorch state dict ({type(exc).__name__}; only tensors "
                               "and plain containers load)") from None
    if not isinstance(obj, dict):
        raise FastCarError(f"{f}: holds a {type(obj).__name__}, not a state dict")
    if key is None and not any(hasattr(v, "shape") for v in obj.values()):
        key = next((k for k in STATE_KEYS if isinstance(obj.get(k), dict)), None)
        if key is None:
            raise FastCarError(f"{f}: no tensors at the top level nor under {list(STATE_KEYS)} (keys: "
                               f"{sorted(map(str, obj))[:6]}); name the entry with --state-key")
    if key is not None:
        if not isinstance(obj.get(key), dict):
            raise FastCarError(f"{f}: no state dict under key {key!r} (keys: {sorted(map(str, obj))[:6]})")
        obj = obj[key]
    return {k: v for k, v in obj.items()}, key


def load_config(source: str, overrides: dict | None = None, state_key: str | None = None):
    """A preset name, a DiT config .json, a folder with config.json (+ model.safetensors), a diffusers
    WanTransformer3DModel folder, or a checkpoint in Wan's original layout (a .pt / .pth / .safetensors file or
    folder: Self-Forcing, CausVid); `overrides`: geometry fields (dit/OVERRIDABLE) replacing the
    config's, `state_key`: the entry of a training checkpoint that holds the weights.

    Returns (config, weights: None (random), a model.safetensors Path, or a dit/Checkpoint)."""
    from fastcar_compile.core.fileio import read_json

    overrides = overrides or {}
    if source in PRESETS:
        return with_overrides(PRESETS[source], overrides, f"--dit {source}"), None
    src = Path(source)
    if not src.exists():
        raise FastCarError(f"--dit {source}: no such preset or path; give one of {sorted(PRESETS)}, a DiT "
                           "config .json, a folder with config.json (+ model.safetensors), a diffusers Wan "
                           "transformer folder or a Wan-layout checkpoint (.pt / .safetensors)")
    if src.is_file() and src.suffix != ".json":
        ckpt = open_checkpoint(src, state_key)
        if ckpt.layout == "fastcar":
            raise FastCarError(f"--dit {src}: weights in our own layout need their config.json: give the folder")
        return infer_config(ckpt, None, overrides, str(src)), ckpt
    cfg_file = src / "config.json" if src.is_dir() else src
    data = read_json(cfg_file, "the DiT config") if cfg_file.is_file() else None
    if data is not None and not isinstance(data, dict):
        raise FastCarError(f"{cfg_file}: the DiT config must be a JSON object")
    if src.is_dir() and (data is None or "layers" not in data):  # diffusers' or Wan's own folder
        ckpt = open_checkpoint(src, state_key)
        if ckpt.layout == "fastcar":
            raise FastCarError(f"--dit {src}: the folder has no config.json of ours (layers, hidden, ...)")
        return infer_config(ckpt, data, overrides, str(src)), ckpt
    if data is None:
        raise FastCarError(f"--dit {src}: the folder has no config.json")
    if state_key is not None:
        raise FastCarError("--state-key applies to a .pt / .pth checkpoint")
    cfg = with_overrides(DiTConfig.from_dict(data, str(cfg_file)), overrides, str(cfg_file))
    return cfg, weights_file(src, f"--dit {src}") if src.is_dir() else None


def weights_file(folder: Path, where: str) -> Path | None:
    """The folder's model.safetensors, None when there is none. A weights path that is a dangling link, a folder or
    a FIFO is refused, never read past into random weights (the callers say when random weights are allowed: a
    preset, or --random-weights)."""
    from fastcar_compile.core.fileio import refuse_special_input

    w = folder / "model.safetensors"
    if w.is_symlink() and not w.exists():
        raise FastCarError(f"{where}: {w} is a dangling link (to {w.readlink()}); point it at the weights")
    if w.is_dir():
        raise FastCarError(f"{where}: {w} is a folder, not a weights file")
    refuse_special_input(w, "the weights")
    return w if w.is_file() else None


def refuse_random(source: str, weights, random_weights: bool) -> None:
    """A DiT given as a config or folder without weights runs with random weights only when asked (a preset is
    random by definition): weights that were meant are never silently replaced."""
    from fastcar_compile.dit.config import PRESETS

    if weights is None and source not in PRESETS and not random_weights:
        raise FastCarError(f"--dit {source}: no weights (no model.safetensors beside the config); give the trained "
                           "weights, or --random-weights to try the tool chain with random ones (a preset such as "
                           "tiny has them)")


def layout_of(names) -> str | None:
    """Which layout a set of tensor names is in (None: none of ours)."""
    names = set(names)
    strip = _prefix(names)
    names = {n[len(strip):] for n in names}
    for layout in LAYOUTS:
        if source_name("time_embed.0.weight", layout) in names:
            return layout
    return None


def _prefix(names) -> str:
    strip = ""
    while True:
        p = next((p for p in PREFIXES if all(n.startswith(strip + p) for n in names)), None)
        if p is None or not names:
            return strip
        strip += p


def weight_files(folder: Path) -> tuple[Path, ...]:
    """A folder's weights: diffusers' (sharded: the index's files) or a lone model*.safetensors."""
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        from fastcar_compile.core.fileio import read_json

        doc = read_json(index, "the shard index")
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise FastCarError(f"{index}: no weight_map")
        files = tuple(folder / f for f in sorted(set(map(str, wm.values()))))
        lost = [f.name for f in files if not f.is_file()]
        if lost:
            raise FastCarError(f"{folder}: the shard index names {lost[:3]}, which are not there")
        return files
    return tuple(sorted(f for f in folder.glob("*.safetensors") if f.is_file()))


def open_checkpoint(source: Path, state_key: str | None = None) -> Checkpoint:
    """The checkpoint at `source` (a folder of safetensors, or a .safetensors / .pt / .pth file), its layout
    found from the tensor names."""
    if source.is_dir():
        files = weight_files(source)
        if not files:
            raise FastCarError(f"--dit {source}: the folder has no *.safetensors weights (diffusers' "
                               "diffusion_pytorch_model*.safetensors, or model.safetensors)")
        if state_key is not None:
            raise FastCarError("--state-key applies to a .pt / .pth checkpoint, not a safetensors folder")
    elif source.suffix in (".safetensors", ".pt", ".pth", ".ckpt"):
        files = (source,)
        if state_key is not None and source.suffix == ".safetensors":
            raise FastCarError("--state-key applies to a .pt / .pth checkpoint, not a safetensors file")
    else:
        raise FastCarError(f"--dit {source}: give a folder, a .safetensors or a .pt / .pth checkpoint")
    names = _names(files, state_key)
    layout = layout_of(names[0])
    if layout is None:
        raise FastCarError(f"{source}: the tensor names are neither diffusers' WanTransformer3DModel, Wan's "
                           f"original layout nor ours (first names: {sorted(names[0])[:4]})")
    return Checkpoint(layout, files, names[1], _prefix(names[0]))


def _names(files: tuple[Path, ...], key: str | None) -> tuple[set[str], str | None]:
    if files[0].suffix == ".safetensors":
        from safetensors import safe_open

        names: set[str] = set()
        for f in files:
            try:
                with safe_open(str(f), "pt") as fh:
                    names |= set(fh.keys())
            except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a broken file
                raise FastCarError(f"{f}: cannot read it as safetensors ({type(exc).__name__})") from None
        return names, None
    state, key = _read(files, key)
    return set(state), key


def infer_config(ckpt: Checkpoint, meta: dict | None, overrides: dict, where: str) -> DiTConfig:
    """DiTConfig from the weights' shapes, the head count from `meta` (the checkpoint's config) or
    `overrides`, the geometry from `overrides`."""
    layout = ckpt.layout
    shapes = {k: tuple(v.shape) for k, v in ckpt.tensors().items()}

    def shape(ours: str) -> tuple[int, ...]:
        name = source_name(ours, layout)
        if name not in shapes:
            raise FastCarError(f"{where}: no tensor {name!r}; it is not a complete {layout}-layout Wan transformer")
        return shapes[name]

    if meta:
        _refuse_variants(meta, where)
    conv = shape("patch_embed.weight")
    if len(conv) != 5:
        raise FastCarError(f"{where}: the patch embedding is {list(conv)}, not a Conv3d kernel [D, C, pt, ph, pw]")
    hidden, layers = conv[0], len({int(m.group(1)) for n in shapes for m in [re.match(r"blocks\.(\d+)\.", n)] if m})
    heads = (meta or {}).get("num_attention_heads") or (meta or {}).get("num_heads") or hidden // HEAD_DIM
    d = dict(layers=layers, hidden=hidden, heads=heads, ffn=shape("blocks.0.ffn.0.weight")[0],
             text_dim=shape("text_embed.0.weight")[1], in_channels=conv[1], patch=tuple(conv[2:]),
             freq_dim=shape("time_embed.0.weight")[1])
    if meta and "eps" in meta:
        d["eps"] = meta["eps"]
    d.update(overrides)
    try:
        return DiTConfig(**d).check(where)
    except TypeError as exc:
        raise FastCarError(f"{where}: {exc}") from None


def _refuse_variants(meta: dict, where: str) -> None:
    """What the mapping does not compute: image conditioning (I2V), other norms, other output channels."""
    unknown = sorted(k for k in meta if not k.startswith("_") and k not in DIFFUSERS_KEYS)
    if unknown and "num_attention_heads" in meta:
        raise FastCarError(f"{where}: config keys {unknown} of a WanTransformer3DModel variant this mapping does not "
                           "know; only Wan2.1-style text-to-video transformers map onto the chunk-causal module")
    for k in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
        if meta.get(k) is not None:
            raise FastCarError(f"{where}: {k}={meta[k]} is an image-conditioned (I2V / FLF2V) Wan; only "
                               "text-to-video transformers map onto the chunk-causal module")
    if meta.get("cross_attn_norm", True) is not True:
        raise FastCarError(f"{where}: cross_attn_norm={meta['cross_attn_norm']}: the chunk-causal module has the "
                           "cross-attention LayerNorm that every released Wan has")
    if meta.get("qk_norm", "rms_norm_across_heads") not in ("rms_norm_across_heads", True):
        raise FastCarError(f"{where}: qk_norm={meta['qk_norm']!r}: only 'rms_norm_across_heads' (Wan's) maps")
    if meta.get("model_type", "t2v") != "t2v":
        raise FastCarError(f"{where}: model_type {meta['model_type']!r}: only text-to-video Wan (t2v) maps onto "
                           "the chunk-causal module")
    out = meta.get("out_channels", meta.get("out_dim"))
    inp = meta.get("in_channels", meta.get("in_dim"))
    if out is not None and inp is not None and out != inp:
        raise FastCarError(f"{where}: out_channels {out} != in_channels {inp}: the chunk-causal module predicts "
                           "a velocity of the latent's own channels")


def state_dict(ckpt: Checkpoint, cfg: DiTConfig, where: str) -> dict[str, Any]:
    """Our float32 state dict from the checkpoint: every tensor of ours found (by the table), every tensor of
    the checkpoint used, each of our shape; otherwise one FastCarError naming the first few of each."""
    import torch

    from fastcar_compile.dit.model import ChunkDiT

    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in ChunkDiT(cfg).state_dict().items()}
    src = ckpt.tensors()
    names = {k: source_name(k, ckpt.layout) for k in want}
    missing = sorted(n for n in names.values() if n not in src)
    unused = sorted(set(src) - set(names.values()))
    if missing or unused:
        parts = [f"missing {len(missing)} ({', '.join(missing[:4])}{', ...' * (len(missing) > 4)})"] * bool(missing)
        parts += [f"unused {len(unused)} ({', '.join(unused[:4])}{', ...' * (len(unused) > 4)})"] * bool(unused)
        raise FastCarError(f"{where}: the {ckpt.layout}-layout weights do not map onto a {cfg.layers}-layer "
                           f"chunk-causal DiT: {'; '.join(parts)}")
    out = {}
    for ours, shape in want.items():
        t = src[names[ours]]
        if not t.is_floating_point():
            raise FastCarError(f"{where}: {names[ours]} is {t.dtype}, not a float tensor")
        t = t.to(torch.float32) if ckpt.layout == "fastcar" else to_ours(ours, t.to(torch.float32), cfg)
        if tuple(t.shape) != shape:
            raise FastCarError(f"{where}: {names[ours]} is {list(src[names[ours]].shape)}; a {cfg.layers}-layer "
                               f"DiT of this config needs {list(shape)} (check --heads and the config)")
        out[ours] = t.contiguous()
    return out


def read_overrides(path: str | None, flags: dict[str, Any]) -> dict[str, Any]:
    """The geometry of a checkpoint without one: the small JSON's fields (OVERRIDABLE), then the flags'."""
    d: dict[str, Any] = {}
    if path is not None:
        from fastcar_compile.core.fileio import read_json

        doc = read_json(path, "--dit-settings")
        if not isinstance(doc, dict):
            raise FastCarError(f"--dit-settings {path}: must be a JSON object of {list(OVERRIDABLE)}")
        bad = sorted(set(doc) - set(OVERRIDABLE))
        if bad:
            raise FastCarError(f"--dit-settings {path}: unknown keys {bad}; it takes {list(OVERRIDABLE)}")
        d.update(doc)
    d.update({k: v for k, v in flags.items() if v is not None})
    return d


def with_overrides(cfg: DiTConfig, overrides: dict[str, Any], where: str) -> DiTConfig:
    """`cfg` with the geometry overrides applied (and checked)."""
    return dataclasses.replace(cfg, **overrides).check(where) if overrides else cfg


def from_module(module, overrides: dict[str, Any]):
    """A diffusers `WanTransformer3DModel` in memory as a ChunkDiT that shares its tensors (float32 ones are not
    copied; the patch kernel and the head are re-laid). `overrides`: the geometry (OVERRIDABLE)."""
    import torch

    from fastcar_compile.dit.model import ChunkDiT

    where = type(module).__name__
    ckpt = Checkpoint("diffusers", (), state=dict(module.state_dict()))
    cfg = infer_config(ckpt, dict(getattr(module, "config", {}) or {}), overrides, where)
    with torch.device("meta"):
        model = ChunkDiT(cfg).eval()
    model.load_state_dict(state_dict(ckpt, cfg, where), strict=True, assign=True)
    return model
