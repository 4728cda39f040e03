"""scripts/demo_as_user_model.py: the conditioned video model as a transformers folder with its recommended decoding,
prompts and the held-out truth, checked against the clips and tokenizer recomputed here and against
transformers' own `generate` (sampled from generation_config.json: only image codes, and a video that moves)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.slow
def test_user_model_folder_truth_and_generate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fastcar_compile.demo import condition
    from fastcar_compile.demo.bundled import heldout_scene_clips, video_files
    from fastcar_compile.demo.vqvae import load_frame_tokenizer

    spec = importlib.util.spec_from_file_location("demo_as_user_model",
                                                  Path(__file__).parents[1] / "scripts" / "demo_as_user_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.chdir(tmp_path)
    assert mod.main(["--out", "m", "--calib", "2", "--heldout", "2", "--truth-frames", "3"]) == 0
    tok = load_frame_tokenizer(video_files()[2])
    clips = heldout_scene_clips(4, 4, 0)[2:]  # calibration takes the first two
    codes = [tok.encode(c.frames) for c in clips]
    held = np.load("heldout.npy")
    want = np.array([condition.prompt(c.labels) + list(k[0]) for c, k in zip(clips, codes, strict=True)])
    np.testing.assert_array_equal(held, want)
    truth = np.load("heldout_truth.npy")
    assert truth.dtype == np.int64 and truth.shape == (2, 3 * 64)
    np.testing.assert_array_equal(truth, np.stack([k[1:].reshape(-1) for k in codes]))
    assert json.loads(Path("frame_shape.json").read_text()) == {"frame_tokens": 64, "shape": [8, 8]}
    g = transformers.GenerationConfig.from_pretrained("m")
    assert g.do_sample and g.top_k == 256 and g.top_p == pytest.approx(0.96)
    assert sorted(g.suppress_tokens) == list(range(512, condition.VOCAB))
    model = transformers.AutoModelForCausalLM.from_pretrained("m").eval()
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(torch.from_numpy(held[:1]), max_new_tokens=2 * 64)[0, held.shape[1]:].numpy()
    assert out.shape == (128,) and out.max() < 512
    frames = np.concatenate([held[0, -64:], out]).reshape(3, 64)
    assert (frames[1:] == frames[:-1]).mean() < 0.9  # the sampled video moves (greedy copies ~99% here)
