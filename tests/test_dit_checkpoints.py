"""Checkpoints trained elsewhere onto the chunk-causal DiT: a diffusers `WanTransformer3DModel` folder (sharded,
random weights that diffusers itself saves) and a Self-Forcing-style state dict in Wan's original names. The
reference is diffusers' own forward: the exported step with an empty cache on one chunk equals
`WanTransformer3DModel`'s output on that chunk (per-frame timesteps as per-token ones), and the original names
reach diffusers through diffusers' own conversion (`convert_wan_transformer_to_diffusers`). `apply_dit` on the
diffusers module rolls out as the exported graph does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
diffusers = pytest.importorskip("diffusers")

from dit_modes_helpers import refusal  # noqa: E402

from fastcar_compile.cli import main  # noqa: E402
from fastcar_compile.dit.stream import OrtDiT, StreamSettings, rollout  # noqa: E402
from fastcar_compile.torch import apply_dit  # noqa: E402

# A small Wan2.1-style transformer: 2 heads of 24, 2 layers, 4 latent channels; 8x8 latents, 2-frame chunks.
WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=24, in_channels=4, out_channels=4,
           text_dim=24, freq_dim=32, ffn_dim=96, num_layers=2, rope_max_seq_len=64)
GEOMETRY = ["--latent", "8x8", "--chunk-frames", "2", "--sink-frames", "1", "--window-frames", "4"]


def wan_transformer(seed: int = 0):
    """diffusers' module with every tensor perturbed (norm weights and biases are not left at 1 and 0)."""
    torch.manual_seed(seed)
    m = diffusers.WanTransformer3DModel(**WAN).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def original_wan_state(seed: int) -> dict[str, torch.Tensor]:
    """Random tensors under Wan's original parameter names (wan/modules/model.py's WanModel), as a
    Self-Forcing generator holds them; diffusers' conversion must load them strictly."""
    g = torch.Generator().manual_seed(seed)
    d, f, c, t, fr = 48, 96, 4, 24, 32
    shapes = {"patch_embedding.weight": (d, c, 1, 2, 2), "patch_embedding.bias": (d,),
              "text_embedding.0.weight": (d, t), "text_embedding.0.bias": (d,),
              "text_embedding.2.weight": (d, d), "text_embedding.2.bias": (d,),
              "time_embedding.0.weight": (d, fr), "time_embedding.0.bias": (d,),
              "time_embedding.2.weight": (d, d), "time_embedding.2.bias": (d,),
              "time_projection.1.weight": (6 * d, d), "time_projection.1.bias": (6 * d,),
              "head.head.weight": (4 * c, d), "head.head.bias": (4 * c,), "head.modulation": (1, 2, d)}
    for i in range(2):
        b = f"blocks.{i}."
        for att in ("self_attn", "cross_attn"):
            for p in "qkvo":
                shapes |= {f"{b}{att}.{p}.weight": (d, d), f"{b}{att}.{p}.bias": (d,)}
            shapes |= {f"{b}{att}.norm_q.weight": (d,), f"{b}{att}.norm_k.weight": (d,)}
        shapes |= {f"{b}norm3.weight": (d,), f"{b}norm3.bias": (d,), f"{b}ffn.0.weight": (f, d),
                   f"{b}ffn.0.bias": (f,), f"{b}ffn.2.weight": (d, f), f"{b}ffn.2.bias": (d,),
                   f"{b}modulation": (1, 6, d)}
    return {k: 0.3 * torch.randn(*s, generator=g) for k, s in shapes.items()}


def diffusers_from_original(state: dict[str, torch.Tensor]):
    """The reference module: the original names through diffusers' own conversion, loaded strictly."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    m = diffusers.WanTransformer3DModel(**WAN).eval()
    m.load_state_dict(convert_wan_transformer_to_diffusers(dict(state)), strict=True)
    return m


def step_error(onnx_path: Path, reference, seed: int) -> float:
    """Max |exported step - diffusers' forward| on one 2-frame chunk with an empty cache: a CFG-sized batch of
    2, per-frame timesteps (as diffusers' per-token timesteps), a 5-token prompt."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(2, 4, 2, 8, 8, generator=g)
    timestep = torch.tensor([[900.0, 310.0], [500.0, 0.0]])
    text = torch.randn(2, 5, 24, generator=g)
    with torch.no_grad():
        want = reference(latent, timestep.repeat_interleave(16, 1), text).sample.numpy()
    ort = OrtDiT(onnx_path)
    cross = ort.text_kv(text.numpy())
    past = [np.zeros((2, 2, 0, 24), np.float32)] * 4
    got = ort.step(latent.numpy(), timestep.numpy(), 0, past, cross)[0]
    assert got.shape == want.shape
    return float(np.abs(got - want).max())


@pytest.fixture(scope="module")
def diffusers_module():
    return wan_transformer()


@pytest.fixture(scope="module")
def diffusers_folder(diffusers_module, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wan-diffusers")
    diffusers_module.save_pretrained(str(folder), max_shard_size="40KB")  # sharded, with an index
    assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    return folder


@pytest.fixture(scope="module")
def diffusers_export(diffusers_folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wan-export") / "dit.onnx"
    assert main(["export", "--dit", str(diffusers_folder), "-o", str(out), *GEOMETRY]) == 0
    return out


def test_diffusers_folder_export_equals_diffusers_forward(diffusers_module, diffusers_folder, diffusers_export):
    before = {f.name: f.read_bytes() for f in diffusers_folder.iterdir()}
    err = step_error(diffusers_export, diffusers_module, seed=1)
    assert err < 1e-4, err
    assert {f.name: f.read_bytes() for f in diffusers_folder.iterdir()} == before  # the input is never modified
    cfg = OrtDiT(diffusers_export).cfg
    assert (cfg.heads, cfg.hidden, cfg.layers, cfg.latent_h, cfg.chunk_frames, cfg.window_frames) == (2, 48, 2, 8, 2, 4)


@pytest.mark.parametrize("wrap", ["generator", "model", "plain"])
def test_self_forcing_checkpoint_equals_diffusers_conversion(tmp_path, wrap, capsys):
    """A .pt whose state dict sits under 'generator' (or 'model') with the wrapper's 'model.' prefix, the
    geometry and head count from a small JSON."""
    state = original_wan_state(seed=3)
    wrapped = {f"model.{k}": v for k, v in state.items()}
    ckpt = tmp_path / "self_forcing.pt"
    torch.save(wrapped if wrap == "plain" else {wrap: wrapped, "step": 7}, ckpt)
    settings = tmp_path / "geometry.json"
    settings.write_text(json.dumps({"heads": 2, "latent_h": 8, "latent_w": 8, "chunk_frames": 2, "sink_frames": 1,
                                    "window_frames": 4}))
    out = tmp_path / "dit.onnx"
    assert main(["export", "--dit", str(ckpt), "--dit-settings", str(settings), "-o", str(out)]) == 0
    assert "wan layout" in capsys.readouterr().out
    err = step_error(out, diffusers_from_original(state), seed=2)
    assert err < 1e-4, err


def test_apply_dit_on_diffusers_rolls_out_as_the_exported_graph(diffusers_module, diffusers_export):
    """The diffusers module wrapped for chunk-by-chunk rollout (KV cache, 4-frame window evicting, CFG) equals
    the exported graph's rollout over 5 chunks at tau=+inf, and the module is left as it was."""
    module = diffusers_module
    before = {k: v.clone() for k, v in module.state_dict().items()}
    fast = apply_dit(module, latent=(8, 8), chunk_frames=2, sinks=1, window=4, threshold=1e30)  # no TAS exceeds it: replay off
    settings = StreamSettings(frames=10, seed=4)
    got = list(rollout(fast, settings))
    want = list(rollout(OrtDiT(diffusers_export), settings))
    for a, b in zip(got, want, strict=True):
        assert a.resident == b.resident
        np.testing.assert_allclose(a.frames, b.frames, atol=1e-4, rtol=0)
    assert fast.stats["replay_ratio"] == 0.0
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())


def _folder_with(tmp_path: Path, edit) -> Path:
    folder = tmp_path / "edited"
    m = wan_transformer()
    m.save_pretrained(str(folder))
    from safetensors.torch import load_file, save_file

    f = folder / "diffusion_pytorch_model.safetensors"
    state = load_file(str(f))
    edit(state, folder)
    save_file(state, str(f))
    return folder


@pytest.mark.parametrize("edit, words", [
    (lambda s, f: s.update({"blocks.0.attn1.extra.weight": torch.zeros(3)}), "unused 1 (blocks.0.attn1.extra.weight)"),
    (lambda s, f: s.pop("blocks.1.ffn.net.2.bias"), "missing 1 (blocks.1.ffn.net.2.bias)"),
    (lambda s, f: (f / "config.json").write_text(json.dumps(
        {**json.loads((f / "config.json").read_text()), "image_dim": 1280})), "image-conditioned"),
])
def test_checkpoints_that_do_not_map_are_refused_in_one_line(tmp_path, capsys, edit, words):
    folder = _folder_with(tmp_path, edit)
    err = refusal(["export", "--dit", str(folder), "-o", str(tmp_path / "x.onnx"), *GEOMETRY], capsys)
    assert words in err


def test_a_pt_without_weights_is_refused(tmp_path, capsys):
    ckpt = tmp_path / "opt.pt"
    torch.save({"optimizer": {"lr": 0.1}}, ckpt)
    err = refusal(["export", "--dit", str(ckpt), "-o", str(tmp_path / "x.onnx")], capsys)
    assert "--state-key" in err
