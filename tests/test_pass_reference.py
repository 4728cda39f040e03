"""Acceptance tests of the compiler pass at finite tau: fast.onnx equals the eager FastCar reference.

The reference (tests/reference.py, hooks on the transformers model) decodes greedily; ONNX Runtime is fed the
same tokens. Logits, replay decisions, TAS and the final replay state must agree within 1e-4. tau is chosen
in a gap of the reference's TAS values (no TAS within 1e-3 of tau, so float noise cannot flip a decision)
and so that both replay and compute happen and the two batch rows decide differently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ort_driver
import pytest
import zoo
from reference import FastCarReference, RefRun

L = 4
MARGIN = 1e-3
TOL = 1e-4


@dataclass(frozen=True)
class Case:
    family: str
    exporter: str
    tas_query: str = "rope"
    max_replay: int = 2
    pad: tuple[int, int] = (0, 2)
    video_start: int = 3
    layers: tuple[int, ...] | None = None
    per_layer: bool = False
    runtime_tau: bool = False  # feed tau through the `fastcar_threshold` input instead of compiling it in
    chunk: int = 0  # > 0: after the greedy decode, one multi-token step of this many tokens, then L + 1 more

    @property
    def id(self) -> str:
        bits = [
            self.family,
            self.exporter,
            self.tas_query,
            f"K{self.max_replay}",
            f"pad{self.pad[0]}{self.pad[1]}",
        ]
        bits.append(f"vs{self.video_start}")
        if self.layers is not None:
            bits.append("layers" + "".join(map(str, self.layers)))
        if self.per_layer:
            bits.append("perlayer")
        if self.runtime_tau:
            bits.append("rttau")
        if self.chunk:
            bits.append(f"chunk{self.chunk}")
        return "-".join(bits)


DEFAULT_CASES = [
    Case("llama", "dynamo20", "rope", max_replay=2, pad=(0, 2), video_start=3, chunk=L + 2),
    Case("llama", "dynamo20", "raw", max_replay=0, pad=(2, 0), video_start=2, layers=(1,), runtime_tau=True),
    Case("qwen2", "torchscript17", "raw", max_replay=1, pad=(1, 0), video_start=2, per_layer=True),
    Case("phi3", "ortfusions20", "rope", max_replay=2, pad=(0, 1), video_start=3, layers=(0,)),
    Case(
        "gpt2", "dynamo18", "raw", max_replay=3, pad=(0, 2), video_start=2, per_layer=True, runtime_tau=True
    ),
]
SLOW_CASES = [
    Case(
        f,
        e,
        q,
        max_replay=2,
        pad=(0, 2),
        video_start=3,
        per_layer=(q == "raw"),
        chunk=(L + 2) * (q == "rope"),
    )
    for f in zoo.FAMILIES
    for e in zoo.EXPORTERS
    for q in ("rope", "raw")
]


def _prompt(case: Case, seed: int = 11) -> np.ndarray:
    """Left-padded prompt: text, then the first 2 video tokens at KV index video_start."""
    assert max(case.pad) <= case.video_start
    rng = np.random.default_rng(seed)
    return rng.integers(0, zoo.VOCAB, (2, case.video_start + 2))


def _eligible(run: RefRun, video_start: int) -> np.ndarray:
    """[decode tokens] True where a token may replay by position: single-token step, p - L >= video_start.

    Same for every row (KV indices are aligned across rows); concatenated over the steps after the prompt.
    """
    out, p = [], run.steps[0].shape[1]
    for ids in run.steps[1:]:
        s = ids.shape[1]
        out.append((p + np.arange(s) - L >= video_start) & (s == 1))
        p += s
    return np.concatenate(out)


def _eligible_tas(run: RefRun, layer: int, video_start: int) -> np.ndarray:
    """TAS of the tokens whose decision depends on it."""
    tas = np.concatenate(run.tas[layer][1:], axis=1)
    return tas[:, _eligible(run, video_start)].ravel()


def _gap_candidates(values: np.ndarray, quantile: float) -> list[float]:
    """Midpoints of gaps wider than 2 x MARGIN in the sorted values, nearest to the quantile first."""
    v = np.sort(values)
    mids = [(a + b) / 2 for a, b in zip(v[:-1], v[1:], strict=True) if b - a > 2 * MARGIN]
    target = np.quantile(v, quantile)
    return sorted(mids, key=lambda m: abs(m - target))


def _decisions(run: RefRun, layers: list[int], video_start: int) -> np.ndarray:
    """[B, eligible tokens x layers] replay decisions of the decode steps."""
    el = _eligible(run, video_start)
    return np.concatenate([np.concatenate(run.replay[i][1:], axis=1)[:, el] for i in layers], axis=1)


def _decisions_ok(run: RefRun, layers: list[int], taus: list[float], video_start: int) -> bool:
    """Mixed decisions, rows differ, and no eligible token's TAS within MARGIN of its layer's tau."""
    dec = _decisions(run, layers, video_start)
    if not (dec.any() and not dec.all() and (dec[0] != dec[1]).any()):
        return False
    return all(
        np.abs(_eligible_tas(run, i, video_start) - t).min() > MARGIN
        for i, t in zip(layers, taus, strict=True)
    )


def reference_run(case: Case, n_decode: int) -> tuple[RefRun, list[float], list[int]]:
    """Pick per-layer taus in TAS gaps so that decisions are mixed, then decode greedily with them.

    Greedy decoding makes the tokens depend on the decisions; a tau is accepted only after the run with it.
    """
    model = zoo.build_model(case.family)
    layers = (
        list(case.layers) if case.layers is not None else list(range(zoo.model_info(case.family).num_layers))
    )
    prompt = _prompt(case)
    kw = dict(
        frame_tokens=L,
        tas_query=case.tas_query,
        max_replay=case.max_replay,
        layers=layers,
        video_start=case.video_start,
    )
    with FastCarReference(model, threshold=math.inf, **kw) as ref:
        probe = ref.run([prompt], pad=case.pad, greedy=n_decode)
        feed, greedy = [prompt], n_decode
        if case.chunk:  # teacher-forced from here: greedy tokens, a whole chunk at once, then single tokens
            rng = np.random.default_rng(5)
            feed = probe.steps + [rng.integers(0, zoo.VOCAB, (2, case.chunk))]
            feed += [rng.integers(0, zoo.VOCAB, (2, 1)) for _ in range(L + 1)]
            probe, greedy = ref.run(feed, pad=case.pad), 0
    # Per-layer taus sit at different quantiles so a per-layer model cannot pass with one shared tau.
    quantiles = (
        [0.35 + 0.3 * j / max(1, len(layers) - 1) for j in range(len(layers))] if case.per_layer else None
    )
    cands = {
        i: _gap_candidates(_eligible_tas(probe, i, case.video_start), quantiles[j] if quantiles else 0.45)
        for j, i in enumerate(layers)
    }
    for attempt in range(12):
        if case.per_layer:
            taus = [cands[i][min(attempt, len(cands[i]) - 1)] for i in layers]
        else:
            taus = [cands[layers[0]][min(attempt, len(cands[layers[0]]) - 1)]] * len(layers)
        with FastCarReference(model, threshold=taus, **kw) as ref:
            run = ref.run(feed, pad=case.pad, greedy=greedy)
            run.final_age = {i: ref.mlp_age[i].numpy().copy() for i in layers}  # type: ignore[attr-defined]
            run.final_cache = {i: ref.mlp_cache[i].numpy().copy() for i in layers}  # type: ignore[attr-defined]
        if _decisions_ok(run, layers, taus, case.video_start):
            return run, taus, layers
    pytest.fail(
        f"{case.id}: no tau found with mixed decisions, differing rows and a {MARGIN} margin (reference)"
    )


def _real(run: RefRun, pad: tuple[int, int], k: int, aligned: bool) -> np.ndarray:
    start = sum(s.shape[1] for s in run.steps[:k])
    p = start + np.arange(run.steps[k].shape[1])[None, :]
    padc = np.asarray(pad)[:, None]
    return (p >= padc) & (p - L >= padc) if aligned else p >= padc


def check_against_reference(zoo_model, fc_compile, tmp_path: Path, case: Case, session=None) -> None:
    """`session`: path -> ort.InferenceSession to run the compiled model with, taking `video_start` and
    `fastcar_threshold` as inputs (as FastCarSession's session does; default: stock ORT, the function bodies)."""
    run, taus, layers = reference_run(case, n_decode=5 * L - 1)
    src = zoo_model(case.family, case.exporter)
    out = tmp_path / "fast.onnx"
    tau_arg = taus if case.per_layer else taus[0]
    compiled_tau = ([100.0] * len(taus) if case.per_layer else 100.0) if case.runtime_tau else tau_arg
    fc_compile(
        str(src),
        output=str(out),
        frame_tokens=L,
        threshold=compiled_tau,
        tas_query=case.tas_query,
        max_replay=case.max_replay,
        layers=list(case.layers) if case.layers is not None else None,
        per_layer_threshold=case.per_layer,
        emit_diagnostics=True,
    )
    got = ort_driver.decode(
        out if session is None else session(out),
        run.steps,
        pad=list(case.pad),
        video_start=case.video_start,
        threshold=tau_arg if case.runtime_tau or session is not None else None,
    )
    n_layers = zoo.model_info(case.family).num_layers
    assert sorted(got.replay_mask) == layers, (
        f"diagnostics for layers {sorted(got.replay_mask)}, want {layers}"
    )
    assert all(f"past_mlp_cache.{i}" not in got.final_state for i in set(range(n_layers)) - set(layers))
    for k in range(len(run.steps)):
        real = _real(run, case.pad, k, aligned=False)
        diff = np.abs(got.logits[k] - run.logits[k])[real].max()
        assert diff <= TOL, f"step {k}: logits differ from the reference by {diff:.3g}"
        for i in layers:
            want_r, got_r = run.replay[i][k], got.replay_mask[i][k].astype(bool)
            assert np.array_equal(got_r, want_r), (
                f"step {k} layer {i}: replay {got_r.tolist()} != {want_r.tolist()}"
            )
            m = _real(run, case.pad, k, aligned=True)
            if m.any():
                tdiff = np.abs(got.tas[i][k].astype(np.float64) - run.tas[i][k])[m].max()
                assert tdiff <= TOL, f"step {k} layer {i}: TAS differs from the reference by {tdiff:.3g}"
    for i in layers:
        np.testing.assert_array_equal(got.final_state[f"past_mlp_age.{i}"], run.final_age[i])
        np.testing.assert_allclose(
            got.final_state[f"past_mlp_cache.{i}"], run.final_cache[i], atol=TOL, rtol=0
        )
    # The case exercised what it claims: replay happened, compute happened, rows decided differently.
    dec = _decisions(run, layers, case.video_start)
    assert dec.any() and not dec.all() and (dec[0] != dec[1]).any()
    if case.max_replay:
        assert max(run.final_age[i].max() for i in layers) <= case.max_replay


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=[c.id for c in DEFAULT_CASES])
def test_matches_eager_reference(zoo_model, fc_compile, tmp_path, case):
    check_against_reference(zoo_model, fc_compile, tmp_path, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=[c.id for c in SLOW_CASES])
def test_matches_eager_reference_all(zoo_model, fc_compile, tmp_path, case):
    check_against_reference(zoo_model, fc_compile, tmp_path, case)


def test_drift_guard_binds(zoo_model, fc_compile, tmp_path):
    """tau = -inf with max_replay 1: every other frame recomputes, exactly as the reference says."""
    case = Case("llama", "dynamo20", "rope", max_replay=1, pad=(0, 0), video_start=1)
    src = zoo_model(case.family, case.exporter)
    out = tmp_path / "fast.onnx"
    fc_compile(
        str(src), output=str(out), frame_tokens=L, threshold=-math.inf, max_replay=1, emit_diagnostics=True
    )
    with FastCarReference(
        zoo.build_model("llama"), frame_tokens=L, threshold=-math.inf, max_replay=1, video_start=1
    ) as ref:
        run = ref.run([_prompt(case)], greedy=4 * L)
    got = ort_driver.decode(out, run.steps, video_start=1)
    for i in (0, 1):
        want = np.concatenate(run.replay[i][1:], axis=1)
        assert want.any() and not want.all()
        np.testing.assert_array_equal(np.concatenate(got.replay_mask[i][1:], axis=1), want)
    for a, b in zip(got.logits, run.logits, strict=True):
        assert np.abs(a - b).max() <= TOL
