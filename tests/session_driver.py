"""Drive a `FastCarSession` (the code under test) through a prompt and decode steps, for tests that compare the
result with an independent reference (tests/ort_driver.py, tests/reference.py), and the CLI through its refusals."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SessionRun:
    logits: list[np.ndarray]  # prompt step first, then one per decode step
    replay: list[np.ndarray]  # replay decisions of the steps that report them
    state: object  # the DecodeState after the last step
    arrays: dict[str, np.ndarray]  # copies of its arrays (a later step may update the live ones in place)


def run_session(sess, prompt: np.ndarray, mask: np.ndarray | None, steps: list[np.ndarray],
                video_start: int = 0) -> SessionRun:
    """Prefill `prompt` (with `mask`, e.g. from ort_driver.left_pad_masks), then feed each of `steps`."""
    out = sess.step(sess.new_state(prompt.shape[0], video_start=video_start), prompt, attention_mask=mask)
    logits, replay = [out.logits], []
    for ids in steps:
        out = sess.step(out.state, ids)
        logits.append(out.logits)
        if out.replay is not None:
            replay.append(out.replay)
    return SessionRun(logits, replay, out.state, {k: np.array(v) for k, v in out.state.arrays.items()})


def assert_cli_refuses(main, argv: list[str], message: str, output, capsys) -> None:
    """`fastcar-compile ARGV` exits 2 with one stderr line containing `message`, no traceback, no `output` file."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err
    assert not output.exists()
