"""FastCarSession's IO-bound decode (bindings kept from step to step, runtime/session.py `_run_bound`) against
stock ONNX Runtime runs of complete feeds (tests/ort_driver.py: function bodies, a growing cache, no binding)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import ort_driver
import pytest
import zoo

from fastcar_compile.runtime import FastCarSession

L = 4


@pytest.fixture(scope="module")
def fused(native_lib, zoo_model, tmp_path_factory):
    import fastcar_compile

    out = tmp_path_factory.mktemp("binding") / "fast.onnx"
    fastcar_compile.compile(str(zoo_model("llama", "dynamo20")), output=str(out), frame_tokens=L, threshold=0.0,
                            fused_attention="fastcar")
    return out


def test_bound_steps_equal_plain_runs(fused):
    """Two videos stepped in turn on one session (every step rebinds the other video's buffers), tau fed on some
    steps and left to the graph's default (equal) on others (the bound input set changes), a 3-token step after
    the prompt (new output shapes), batch 2 with left padding: logits equal the stock runs, replay happens, and
    logits returned earlier are not overwritten by later steps."""
    sess = FastCarSession(fused, max_length=64)
    assert sess.native_library is not None and sess.max_length == 64
    rng = np.random.default_rng(7)
    pads = {"a": [0, 2], "b": [3, 0]}
    steps = {v: [rng.integers(0, zoo.VOCAB, (2, 6))] + [rng.integers(0, zoo.VOCAB, (2, 3))]
             + [rng.integers(0, zoo.VOCAB, (2, 1)) for _ in range(5 * L)] for v in pads}
    want = {v: ort_driver.decode(fused, steps[v], pad=pads[v]).logits for v in pads}
    got: dict[str, list[np.ndarray]] = {v: [] for v in pads}
    states, replayed = {}, 0
    for k in range(len(steps["a"])):
        for v in pads:
            tau = 0.0 if k % 3 else None  # None: the compiled default (0.0) from the graph
            if k == 0:
                mask, _ = ort_driver.left_pad_masks(pads[v], 6)
                out = sess.step(sess.new_state(2), steps[v][0], attention_mask=mask, threshold=tau)
            else:
                out = sess.step(states[v], steps[v][k], threshold=tau, check=k % 2 == 0)
                replayed += int(out.replay.sum()) if out.replay is not None else 0
            states[v] = out.state
            got[v].append(out.logits)
    assert replayed > 0
    for v in pads:
        real = ort_driver.left_pad_masks(pads[v], 6)[0].astype(bool)
        assert np.abs(got[v][0] - want[v][0])[real].max() <= 1e-4
        for k in range(1, len(steps[v])):
            assert got[v][k].shape == want[v][k].shape
            assert np.abs(got[v][k] - want[v][k]).max() <= 1e-4, f"video {v} step {k}"


def test_unpadded_batch_mask_is_not_rebuilt_per_step(fused):
    """A growing cache (no max_length), batch 3, no padding: logits equal the stock runs, and every step's attention
    mask is a contiguous all-ones view of one buffer (building a [batch, position] mask anew each step costs
    O(video length) per token, which a bounded cache would otherwise pay as the video grows)."""
    sess = FastCarSession(fused)
    rng = np.random.default_rng(3)
    steps = [rng.integers(0, zoo.VOCAB, (3, 5))] + [rng.integers(0, zoo.VOCAB, (3, 1)) for _ in range(4 * L)]
    want = ort_driver.decode(fused, steps).logits
    state, masks = sess.new_state(3), []
    for k, ids in enumerate(steps):
        out = sess.step(state, ids)
        state = out.state
        masks.append(state.attention_mask)
        assert np.abs(out.logits - want[k]).max() <= 1e-4, f"step {k}"
    assert all(m.flags.c_contiguous and (m == 1).all() and m.shape == (3, 5 + k) for k, m in enumerate(masks))
    buffers = 1 + sum(not np.shares_memory(a, b) for a, b in zip(masks[:-1], masks[1:], strict=True))
    assert buffers <= 4 < len(masks)  # one buffer grown by doubling (15 -> 63 tokens), not a new mask a step


def test_batch_changes_between_bound_steps(fused):
    """Three videos of batch 2, 1 and 3 stepped in turn on one session, so consecutive bound steps change batch
    (and the bound feeds, state and output buffers their shapes) with no new_state in between, with 2- and
    1-token steps: every step's logits equal the stock runs."""
    sess = FastCarSession(fused, max_length=64)
    rng = np.random.default_rng(11)
    batches = (2, 1, 3)
    steps = {b: [rng.integers(0, zoo.VOCAB, (b, 5))] + [rng.integers(0, zoo.VOCAB, (b, 2 if k % 3 == 0 else 1))
                                                         for k in range(3 * L)] for b in batches}
    want = {b: ort_driver.decode(fused, steps[b]).logits for b in batches}
    states = {b: sess.new_state(b) for b in batches}
    for k in range(len(steps[1])):
        for b in batches:
            out = sess.step(states[b], steps[b][k], check=k % 2 == 0)
            states[b] = out.state
            assert out.logits.shape == want[b][k].shape
            assert np.abs(out.logits - want[b][k]).max() <= 1e-4, f"batch {b} step {k}"


def test_dropped_video_buffers_are_freed(fused):
    """After a video's state is dropped, the session's IO bindings no longer keep its arrays (state and shared
    KV buffers) alive: new_state for the next video, or release(), lets them be freed."""
    sess = FastCarSession(fused, max_length=64)
    rng = np.random.default_rng(3)
    for start_next in (lambda: sess.new_state(1), lambda: sess.release()):
        out = sess.step(sess.new_state(2), rng.integers(0, zoo.VOCAB, (2, 5)))
        for _ in range(3):
            out = sess.step(out.state, rng.integers(0, zoo.VOCAB, (2, 1)))
        refs = [weakref.ref(a) for a in out.state.arrays.values()]
        assert refs and all(r() is not None for r in refs)
        del out
        start_next()
        gc.collect()
        alive = [r for r in refs if r() is not None]
        assert not alive, f"{len(alive)} of {len(refs)} state arrays still alive after the video was dropped"


@pytest.fixture(scope="module")
def fused_diag(native_lib, zoo_model, tmp_path_factory):
    import fastcar_compile

    out = tmp_path_factory.mktemp("binding-diag") / "fast.onnx"
    fastcar_compile.compile(str(zoo_model("llama", "dynamo20")), output=str(out), frame_tokens=L, threshold=0.0,
                            fused_attention="fastcar", emit_diagnostics=True)
    return out


def test_bound_diagnostics_equal_plain_runs(fused_diag):
    """With diagnostics outputs (tas.N, replay_mask.N written into buffers bound once and stacked by `step`),
    every step's TAS and replay bits equal the stock runs', and those of earlier steps are not overwritten by
    later ones."""
    sess = FastCarSession(fused_diag, max_length=64)
    assert sess.has_diagnostics
    rng = np.random.default_rng(5)
    steps = [rng.integers(0, zoo.VOCAB, (2, 6))] + [rng.integers(0, zoo.VOCAB, (2, 1)) for _ in range(4 * L)]
    want = ort_driver.decode(fused_diag, steps)
    outs = [sess.step(sess.new_state(2), steps[0])]
    for ids in steps[1:]:
        outs.append(sess.step(outs[-1].state, ids, check=False))
    layers = sess.layers
    replayed = 0
    for k, out in enumerate(outs):
        tas = np.stack([want.tas[n][k] for n in layers])
        assert np.abs(out.tas - tas).max() <= 1e-4, f"step {k}"
        if k:
            ref = np.stack([want.replay_mask[n][k][:, 0] for n in layers])
            assert np.array_equal(out.replay, ref), f"step {k}"
            replayed += int(ref.sum())
    assert replayed > 0


def test_replaced_state_arrays_are_bound(fused):
    """A caller who swaps the arrays of a state for copies between steps gets them used (the session must not
    keep writing into the buffers it bound before): the logits and the final state equal the stock runs."""
    sess = FastCarSession(fused, max_length=64)
    rng = np.random.default_rng(9)
    steps = [rng.integers(0, zoo.VOCAB, (1, 5))] + [rng.integers(0, zoo.VOCAB, (1, 1)) for _ in range(3 * L)]
    want = ort_driver.decode(fused, steps)
    out = sess.step(sess.new_state(1), steps[0])
    for k, ids in enumerate(steps[1:], start=1):
        if k % 3 == 0:
            for name in list(out.state.arrays):
                out.state.arrays[name] = out.state.arrays[name].copy()
        out = sess.step(out.state, ids, check=False)
        assert np.abs(out.logits - want.logits[k]).max() <= 1e-4, f"step {k}"
    past = out.state.past_len
    for name, ref in want.final_state.items():
        got = out.state.arrays[name]
        got = got[:, :, :past] if name.startswith("past_key_values.") else got
        assert np.allclose(got, ref, atol=1e-4), name


def test_threshold_array_changed_in_place_takes_effect(fused):
    """The same tau array object, rewritten in place between steps (+inf: never replay, then -inf: replay
    every eligible layer), is read anew: the session does not keep the values it bound first."""
    sess = FastCarSession(fused, max_length=64)
    rng = np.random.default_rng(2)
    tau = np.array(np.inf, np.float32)
    out = sess.step(sess.new_state(1), rng.integers(0, zoo.VOCAB, (1, 2 * L)), threshold=tau)
    seen = []
    for k in range(2 * L):
        if k == L:
            tau[...] = -np.inf
        out = sess.step(out.state, rng.integers(0, zoo.VOCAB, (1, 1)), threshold=tau, check=False)
        seen.append(bool(out.replay.all()) if k >= L else bool(out.replay.any()))
    assert seen == [False] * L + [True] * L
