"""Further architectures (parallel residual, post-norms, sliding windows, MoE), end to end.

For every new family x exporter (tests/zoo.py NEW_FAMILIES x NEW_EXPORTERS), judged as the existing families
are (test_pass_equivalence.py, test_pass_reference.py): the export is the transformers model; tau = +inf
is the original export (logits <= 1e-5) with the eager reference's TAS; a finite tau equals the eager FastCar
reference (logits, replay decisions, TAS and final state within 1e-4). The full matrix is slow; the default
run keeps one exporter per family, finite tau only.

Reproduce the table in docs/patterns.md: FASTCAR_ZOO_DIR=/tmp/zoo pytest -m slow tests/test_pass_architectures.py
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import zoo
from reference import FastCarReference, plain_logits
from test_pass_equivalence import check_inf_equivalence
from test_pass_reference import Case, check_against_reference
from test_zoo import _check_export_matches_torch, _steps

ALL_COMBOS = [(f, e) for f in zoo.NEW_FAMILIES for e in zoo.NEW_EXPORTERS]
# TorchScript exports in a few seconds where dynamo takes tens: the default run keeps one per family.
DEFAULT_COMBOS = [(f, "torchscript17") for f in zoo.NEW_FAMILIES]
_ids = [f"{f}-{e}" for f, e in ALL_COMBOS]


@pytest.mark.slow
@pytest.mark.parametrize("family", zoo.NEW_FAMILIES)
def test_reference_at_inf_is_plain_model(family):
    """The hooks find each family's blocks, and tau = +inf leaves the model as it is (sliding windows too)."""
    model = zoo.build_model(family)
    with FastCarReference(model, frame_tokens=4, threshold=math.inf, tas_query="raw") as ref:
        run = ref.run(_steps(2, 5, 0), pad=[0, 2], greedy=12)  # 17 tokens: past the sliding window of 8
    want = plain_logits(model, run.steps, pad=[0, 2])  # eager both: padding is fine here
    for g, w in zip(run.logits[1:], want[1:], strict=True):
        np.testing.assert_array_equal(g, w)
    assert np.isfinite(run.tas[0][-1]).all()


def _pad(family: str) -> tuple[int, int]:
    """Left padding of the second row. Sliding-window exports (both exporters) differ from eager transformers
    on a left-padded row once the window truncates (docs/patterns.md), so those families decode unpadded."""
    return (0, 0) if family in zoo.SLIDING_FAMILIES else (0, 2)


@pytest.mark.parametrize("family,exporter", DEFAULT_COMBOS, ids=[f"{f}-{e}" for f, e in DEFAULT_COMBOS])
def test_new_family_matches_eager_reference(zoo_model, fc_compile, tmp_path, family, exporter):
    # GPT-J with the raw query: it rotates in [B, S, H, D] and then permutes (the raw layout differs from q's).
    query = "raw" if family == "gptj" else "rope"
    check_against_reference(zoo_model, fc_compile, tmp_path, Case(family, exporter, query, pad=_pad(family),
                                                                  per_layer=query == "raw"))


@pytest.mark.slow
@pytest.mark.parametrize("family,exporter", ALL_COMBOS, ids=_ids)
def test_new_family_export_matches_torch(zoo_model, family, exporter):
    _check_export_matches_torch(zoo_model, family, exporter, pad=list(_pad(family)))


@pytest.mark.slow
@pytest.mark.parametrize("family,exporter", ALL_COMBOS, ids=_ids)
def test_new_family_inf_threshold_is_the_original_model(zoo_model, fc_compile, tmp_path, family, exporter):
    check_inf_equivalence(zoo_model, fc_compile, tmp_path, family, exporter, pad=list(_pad(family)))


SLOW_CASES = [
    Case(f, e, q, max_replay=2, pad=_pad(f), video_start=3, per_layer=(q == "raw"), chunk=6 * (q == "rope"))
    for f, e in ALL_COMBOS
    for q in ("rope", "raw")
]


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=[c.id for c in SLOW_CASES])
def test_new_family_matches_eager_reference_all(zoo_model, fc_compile, tmp_path, case):
    check_against_reference(zoo_model, fc_compile, tmp_path, case)


def test_window_shorter_than_a_frame_is_refused(zoo_model, fc_compile, tmp_path):
    """Mistral keeps SLIDING_WINDOW - 1 = 7 positions: a frame of 8 would need a key the cache dropped."""
    from fastcar_compile.core.errors import FastCarError

    src = zoo_model("mistral", "torchscript17")
    with pytest.raises(FastCarError, match="sliding-window cache keeps 7 positions"):
        fc_compile(str(src), output=str(tmp_path / "fast.onnx"), frame_tokens=zoo.SLIDING_WINDOW)
    assert not (tmp_path / "fast.onnx").exists()


@pytest.mark.parametrize("family,words", [("neox", "(parallel residual)"), ("mistral", "(sliding window 7)")])
def test_inspect_names_the_pattern(zoo_model, family, words):
    """--inspect says which non-default form a layer matched (the parallel residual, the window it keeps)."""
    from fastcar_compile import inspect

    report = inspect(zoo_model(family, "torchscript17"))
    assert report.matched == [0, 1]
    assert all(words in line for line in report.format().splitlines()[1:3]), report.format()
