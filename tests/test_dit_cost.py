"""The plan keeps a DiT block's attention dense where AnnSA would not pay (passes/dit_cost.py, passes/dit_plan.py):
the predicted density against hand-computed values, and the compile / `--inspect -v` following the verdict."""

from __future__ import annotations

import dataclasses
import json

import pytest

pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from dit_modes_helpers import compile_cli, refusal  # noqa: E402

from fastcar_compile.cli import main  # noqa: E402
from fastcar_compile.core.contract import DIT_MODES_KEY, AnnSARecord  # noqa: E402
from fastcar_compile.dit.config import PRESETS  # noqa: E402
from fastcar_compile.passes import dit_cost  # noqa: E402

TINY = PRESETS["tiny"]  # 1 sink frame, a 4-frame window, chunks of 2 frames, 16 tokens per frame


def _lsh(bits: int, tables: int = 2, local: int = 1) -> AnnSARecord:
    return AnnSARecord("lsh", bits, 2, tables, 0, annsa_local=local)


@pytest.mark.parametrize("bits, tables, local, density", [
    # 5 cached frames + the 2-frame chunk attended: sinks + local + chunk dense, the rest shared w.p. 1-(1-2^-b)^T
    (1, 2, 1, (1 + 1 + 2 + 3 * 0.75) / 7),
    (4, 2, 1, (1 + 1 + 2 + 3 * (1 - (15 / 16) ** 2)) / 7),
    (4, 1, 3, (1 + 3 + 2 + 1 * (1 / 16)) / 7),
    (8, 3, 0, (1 + 0 + 2 + 4 * (1 - (255 / 256) ** 3)) / 7),
])
def test_predicted_density_is_the_dense_frames_plus_shared_buckets(bits, tables, local, density):
    cost = dit_cost.predict(TINY, _lsh(bits, tables, local))
    assert cost.density == pytest.approx(density, rel=1e-12)
    dense = (1 + local + 2) / 7  # the frames always attended, at a dense pair's cost
    coding = bits * tables / (2 * 7 * 16)  # the query's projections against 2 d MACs per attended key
    assert cost.ratio == pytest.approx(dense + max(dit_cost.ANNSA_PAIR_COST * (density - dense),
                                                   tables * 2 * (1 - dense) * dit_cost.MACHINE_BALANCE / 32) + coding)


def test_a_growing_cache_is_judged_at_its_limit():
    cfg = dataclasses.replace(PRESETS["wan2.1-1.3b"], window_frames=0)
    cost = dit_cost.predict(cfg, _lsh(4))
    assert cost.density == pytest.approx(1 - (15 / 16) ** 2, rel=1e-12) and cost.pays


def test_reading_the_keys_bounds_a_small_chunk():
    """With few queries per head, every table reading the bucketed keys once costs more than the pairs saved:
    the memory term (tables x 2 x bucketed share x balance / queries) sets the time."""
    cost = dit_cost.predict(TINY, _lsh(12, tables=8))
    queries = TINY.chunk_frames * TINY.tokens_per_frame
    assert cost.bound == "memory"
    assert cost.ratio == pytest.approx(4 / 7 + 8 * 2 * (3 / 7) * dit_cost.MACHINE_BALANCE / queries
                                       + 12 * 8 / (2 * 7 * 16))


def test_annca_over_a_short_prompt_never_pays():
    """AnnCA keeps a prompt token for a frame when any of the frame's queries shares a bucket with it: at 4 bits x
    2 tables every token is kept (1 - (1 - p)^64 ~ 1), and coding a query (8 projections of d MACs) costs more than
    attending to a 6-token prompt (2 d MACs a token); Wan2.1's 1560 queries a frame over its 512-token prompt with
    12-bit buckets keep about half the tokens, and pay."""
    from fastcar_compile.core.contract import BucketRecord

    short = dataclasses.replace(TINY, text_len=6, latent_h=16, latent_w=16)  # 64 tokens a frame
    p = 1 - (15 / 16) ** 2
    cost = dit_cost.predict_cross(short, BucketRecord("lsh", 4, 2, 2, 0))
    assert cost.density == pytest.approx(1 - (1 - p) ** 64)
    assert cost.ratio == pytest.approx(dit_cost.ANNSA_PAIR_COST * cost.density + 8 / 12) and not cost.pays
    wan = dit_cost.predict_cross(PRESETS["wan2.1-1.3b"], BucketRecord("lsh", 12, 2, 2, 0))
    d = 1 - (1 / 4096 * (2 - 1 / 4096) * -1 + 1) ** 1560  # p = 1 - (1 - 2^-12)^2
    assert wan.density == pytest.approx(d) and 0.4 < d < 0.6
    assert wan.ratio == pytest.approx(dit_cost.ANNSA_PAIR_COST * d + 24 / 1024) and wan.pays


def test_a_block_where_annsa_does_not_pay_compiles_dense(dit_tiny_export, tmp_path, capsys):
    """1-bit LSH buckets share a bucket for 3 of 4 pairs: kept dense (no AnnSA node, no AnnSA in the metadata),
    said by the compile and by --inspect -v; --annsa-always compiles it anyway."""
    flags = ["--annsa", "lsh", "--lsh-bits", "1"]
    assert main([str(dit_tiny_export), "--inspect", "-v", *flags]) == 0
    out = capsys.readouterr().out
    assert "AnnSA kept dense: predicted density 89%" in out and "AnnSAAttention" not in out
    path = compile_cli(dit_tiny_export, tmp_path, *flags)
    said = capsys.readouterr()
    assert "--annsa: every block kept dense" in said.out + said.err
    model = onnx.load(str(path))
    assert "AnnSAAttention" not in {n.op_type for n in model.graph.node}
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta[DIT_MODES_KEY])["annsa"] is None
    forced = compile_cli(dit_tiny_export, tmp_path, *flags, "--ann-always", name="forced.onnx")
    assert "AnnSAAttention" in {n.op_type for n in onnx.load(str(forced)).graph.node}


def test_annca_that_does_not_pay_keeps_the_dense_cross_attention(dit_tiny_export, tmp_path, capsys):
    """tiny's 32 queries a chunk over its prompt: AnnCA would cost more than the dense cross-attention, so the
    compile keeps it dense and says why (compile and --inspect -v); --ann-always compiles it anyway."""
    assert main([str(dit_tiny_export), "--inspect", "-v", "--annca"]) == 0
    assert "AnnCA kept dense: predicted density" in capsys.readouterr().out
    path = compile_cli(dit_tiny_export, tmp_path, "--annca")
    said = capsys.readouterr()
    assert "--annca: every block kept dense" in said.out + said.err
    meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert json.loads(meta[DIT_MODES_KEY])["annca"] is None
    forced = compile_cli(dit_tiny_export, tmp_path, "--annca", "--ann-always", name="forced.onnx")
    meta = {p.key: p.value for p in onnx.load(str(forced)).metadata_props}
    assert json.loads(meta[DIT_MODES_KEY])["annca"] is not None


def test_the_eager_runtime_follows_the_same_verdict(dit_tiny_eager):
    """The eager runtime drops AnnCA where the compiler would (same cost model) and then streams the dense
    rollout: equal to TorchDiT's; with ann_always it runs AnnCA and differs."""
    import numpy as np

    from fastcar_compile.dit import modes
    from fastcar_compile.dit.fastar import FastARDiT
    from fastcar_compile.dit.stream import StreamSettings, TorchDiT, rollout

    settings = StreamSettings(frames=6, seed=3)
    dense = np.concatenate([c.frames for c in rollout(TorchDiT(dit_tiny_eager), settings)], axis=1)
    kept = FastARDiT(dit_tiny_eager, modes.settings(annca=True))
    assert not kept.fa.annca and kept.verdicts["annca"].startswith("kept dense")
    same = np.concatenate([c.frames for c in rollout(kept, settings)], axis=1)
    np.testing.assert_allclose(same, dense, atol=1e-5)
    forced = FastARDiT(dit_tiny_eager, modes.settings(annca=True, ann_always=True))
    assert forced.fa.annca and forced.verdicts["annca"].startswith("compiled (--ann-always)")
    other = np.concatenate([c.frames for c in rollout(forced, settings)], axis=1)
    assert np.abs(other - dense).max() > 1e-3


def test_ann_always_needs_annsa_or_annca(dit_tiny_export, tmp_path, capsys):
    err = refusal([str(dit_tiny_export), "-o", str(tmp_path / "x.onnx"), "--ann-always"], capsys)
    assert "--ann-always is a setting of --annsa / --annca" in err
    err = refusal([str(dit_tiny_export), "-o", str(tmp_path / "x.onnx"), "--annsa", "lsh", "--annsa-always"], capsys)
    assert "renamed: use --ann-always" in err
