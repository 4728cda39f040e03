"""Speculative decoding in onnxruntime-genai's own loop (`fastcar-compile genai-speculate`), genai unpatched.

The previous-frame draft graph is checked against runtime/speculate.py's NumPy draft (`propose`: the token one
frame back, chained over its own proposals), in both KV layouts genai gives a draft (a growing cache, and the
shared in-place buffer of max_length); genai's generator with that draft, and with its n-gram lookup, must give
the tokens of plain greedy genai on the same model.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from fastcar_compile import cli
from fastcar_compile.core import contract
from fastcar_compile.runtime.genai_draft import ONE_HOT, temporal_draft
from fastcar_compile.runtime.speculate import DraftSpec, propose

VOCAB, L = 37, 5
TEMPORAL = DraftSpec(contract.DRAFT_TEMPORAL)


def _run_draft(sess: ort.InferenceSession, shared: bool, history: np.ndarray, cache: np.ndarray | None,
               new: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """One draft step over `new` tokens after `history` (cache: the layout's KV, None: built from history)."""
    T = len(history) + len(new)
    if cache is None:
        cache = np.full((1, 1, max_len if shared else len(history), 1), -7.0, np.float32)  # stale entries
        cache[0, 0, :len(history), 0] = history
    feed = {"input_ids": new[None].astype(np.int64), "attention_mask": np.ones((1, T), np.int64),
            "past_key_values.0.key": cache, "past_key_values.0.value": cache}
    logits, key, _ = sess.run(None, feed)
    return logits[0], key


@pytest.mark.parametrize("shared", [False, True], ids=["growing", "shared_buffer"])
def test_draft_graph_proposes_the_token_one_frame_back(shared):
    rng = np.random.default_rng(3)
    max_len = 40
    sess = ort.InferenceSession(temporal_draft(VOCAB, L, shared).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    hist = rng.integers(0, VOCAB, 23)
    for past in (0, 9, 17):  # a prefill and multi-token steps
        logits, key = _run_draft(sess, shared, hist[:past], None, hist[past:], max_len)
        assert logits.shape == (23 - past, VOCAB)
        np.testing.assert_array_equal(key[0, 0, :23, 0], hist)  # the history the next step reads
        for i, t in enumerate(range(past, 23)):
            assert sorted(np.unique(logits[i])) == [0.0, ONE_HOT]  # one-hot: genai's draft softmax is exact
            if t + 1 >= L:
                ref = propose(TEMPORAL, [hist[:t + 1]], t + 1, L, 1)[0, 0]
                assert logits[i].argmax() == ref
            else:  # before the first frame: the current token
                assert logits[i].argmax() == hist[t]
    # genai's draft loop: one token a step, each proposal fed back: the chained draft over 2 frames
    k = 2 * L + 3
    cache, h, got = None, hist[:12], []
    logits, cache = _run_draft(sess, shared, hist[:11], None, hist[11:12], max_len)
    for _ in range(k):
        got.append(int(logits[-1].argmax()))
        logits, cache = _run_draft(sess, shared, np.concatenate([h, got[:-1]]), cache if shared else None,
                                   np.array(got[-1:]), max_len)
    np.testing.assert_array_equal(got, propose(TEMPORAL, [h], len(h), L, k)[0])


og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install '.[genai]')")


def _greedy(folder, prompt: np.ndarray, n: int) -> tuple[np.ndarray, dict]:
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt.shape[1] + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt.astype(np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    stats = gen.get_speculative_stats() if json.loads((folder / "genai_config.json").read_text()).get(
        "speculative") else {}
    return np.array(gen.get_sequence(0))[prompt.shape[1]:], stats


@pytest.mark.parametrize("draft", ["temporal:4", "temporal", "ngram:8"])
def test_genai_speculation_gives_plain_greedy_tokens(genai_model, tmp_path, draft):
    src = genai_model("llama")
    genai_zoo = pytest.importorskip("genai_zoo")
    before = {p.name: p.read_bytes() for p in src.iterdir() if p.suffix == ".json"}
    out = tmp_path / "spec"
    assert cli.main(["genai-speculate", str(src), "-o", str(out), "--draft", draft, "--frame-tokens", "4"]) == 0
    assert {p.name: p.read_bytes() for p in src.iterdir() if p.suffix == ".json"} == before  # input untouched
    onnx.load(str(src / "model.onnx"))  # onnx refuses external data with several hard links: none were made
    # a prompt that repeats with period 4, so the drafts are accepted sometimes and rejected sometimes
    rng = np.random.default_rng(5)
    prompt = np.tile(rng.integers(3, genai_zoo.GENAI_VOCAB, 4), 3)[None]
    plain, _ = _greedy(src, prompt, 32)
    spec, stats = _greedy(out, prompt, 32)
    np.testing.assert_array_equal(spec, plain)
    assert stats["rounds"] > 0 and stats["target_forward_passes"] < 32  # genai verified drafts, not plain steps
    if draft.startswith("temporal"):
        assert stats["draft_tokens_proposed"] > 0 and stats["draft_forward_passes"] > 0


@pytest.mark.parametrize("args, message", [
    (["--draft", "temporal"], "--frame-tokens"),
    (["--draft", "temporal+ngram", "--frame-tokens", "4"], "cannot combine"),
    (["--draft", "temporal:17", "--frame-tokens", "4"], "at most 16"),
    (["--draft", "ngram", "--ngram-size", "1"], "--ngram-size"),
])
def test_genai_speculate_refuses_bad_options_in_one_line(genai_model, tmp_path, capsys, args, message):
    src = genai_model("llama")
    assert cli.main(["genai-speculate", str(src), "-o", str(tmp_path / "o"), *args]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
    assert cli.main(["genai-speculate", str(src), "-o", str(src), "--draft", "ngram"]) != 0  # never the input


def test_genai_speculate_refuses_a_fastcar_compiled_folder(genai_model, tmp_path, capsys):
    """genai cannot rewind FastCar's state (a RecurrentState to genai) after a rejected draft: refused in one line
    instead of genai's error at the first rejection."""
    src = genai_model("llama")
    fast = tmp_path / "fast" / "fast.onnx"
    assert cli.main([str(src / "model.onnx"), "-o", str(fast), "--frame-tokens", "4"]) == 0
    capsys.readouterr()
    assert cli.main(["genai-speculate", str(fast.parent), "-o", str(tmp_path / "o"), "--draft", "ngram"]) != 0
    err = capsys.readouterr().err.strip()
    assert "FastCar-compiled" in err and "\n" not in err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------ a broken genai folder
def _tree(root) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() and not p.is_symlink() else "dir")
            for p in sorted(root.rglob("*"))}


def _broken(src, d, kind: str):
    """A copy of the genai folder `src` at `d` with its genai_config.json (or model) broken one way."""
    import shutil

    shutil.copytree(src, d)
    cfg = json.loads((d / "genai_config.json").read_text())
    text = None
    if kind == "malformed JSON":
        text = (d / "genai_config.json").read_text()[:-20]
    elif kind == "a list":
        text = "[1, 2]"
    elif kind == "model is a string":
        cfg["model"] = "llama"
    elif kind == "no decoder":
        del cfg["model"]["decoder"]
    elif kind == "no filename":
        del cfg["model"]["decoder"]["filename"]
    elif kind == "filename a number":
        cfg["model"]["decoder"]["filename"] = 7
    elif kind == "filename absolute":
        cfg["model"]["decoder"]["filename"] = str((d / "model.onnx").resolve())
    elif kind == "filename outside":
        cfg["model"]["decoder"]["filename"] = "../elsewhere/model.onnx"
    elif kind == "filename missing":
        cfg["model"]["decoder"]["filename"] = "nope.onnx"
    elif kind == "inputs a list":
        cfg["model"]["decoder"]["inputs"] = ["input_ids"]
    elif kind == "share buffer a string":
        cfg.setdefault("search", {})["past_present_share_buffer"] = "yes"
    elif kind == "NaN number":
        text = json.dumps(cfg).replace('"context_length": ', '"context_length": NaN, "x": ', 1)
    elif kind == "unloadable model":
        (d / "model.onnx").write_bytes(b"not an onnx model" * 10)
    if text is None:
        text = json.dumps(cfg)
    (d / "genai_config.json").write_text(text)
    return d


BROKEN = {"malformed JSON": "not valid JSON", "a list": "JSON object", "model is a string": "'model' object",
          "no decoder": "'decoder' object", "no filename": "filename", "filename a number": "filename",
          "filename absolute": "outside the folder", "filename outside": "outside the folder",
          "filename missing": "does not exist", "inputs a list": "model.decoder.inputs",
          "share buffer a string": "past_present_share_buffer", "NaN number": "finite",
          "unloadable model": "not a readable ONNX model"}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_broken_genai_folder_is_one_line_and_leaves_nothing(genai_model, tmp_path, capsys, kind):
    """Each way of being broken: exit 2, one line naming it, the input folder byte for byte as it was, no output."""
    src = _broken(genai_model("llama"), tmp_path / "in", kind)
    before = _tree(src)
    rc = cli.main(["genai-speculate", str(src), "-o", str(tmp_path / "out"), "--draft", "temporal",
                   "--frame-tokens", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and BROKEN[kind] in err and "Traceback" not in err, err
    assert _tree(src) == before and not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_genai_speculate_never_writes_inside_its_input_folder(genai_model, tmp_path, capsys):
    import shutil

    src = tmp_path / "in"
    shutil.copytree(genai_model("llama"), src)
    before = _tree(src)
    for out in (src / "spec", src / "sub" / "deeper"):
        assert cli.main(["genai-speculate", str(src), "-o", str(out), "--draft", "ngram"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "outside the input" in err
        assert _tree(src) == before


def test_a_failed_write_leaves_no_draft_tokenizer_or_temp_file(genai_model, tmp_path, capsys, monkeypatch):
    """The disk fills while the model is copied (after draft.onnx and before genai_config.json): the output folder
    this command created is gone, with nothing of it left (no draft.onnx, no tokenizer, no temp file)."""
    import errno

    from fastcar_compile.core import fileio

    src = genai_model("llama")
    real, calls = fileio.copy_file, []

    def full(a, b, **kw):
        calls.append(a)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(b))
        return real(a, b, **kw)

    monkeypatch.setattr(fileio, "copy_file", full)
    rc = cli.main(["genai-speculate", str(src), "-o", str(tmp_path / "out" / "spec"), "--draft", "temporal",
                   "--frame-tokens", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "space" in err.lower() and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
