"""Progress bars only on a terminal: through a pipe or into a log a redrawn bar is thousands of characters of
noise (every bar of the package goes through fastcar_compile.core.progress.bar)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from fastcar_compile.core.progress import bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_draws_on_a_terminal_and_not_into_a_pipe():
    tty, pipe = _Terminal(), io.StringIO()
    assert sum(bar(range(5), file=tty, desc="work")) == 10 and "work" in tty.getvalue()
    assert sum(bar(range(5), file=pipe, desc="work")) == 10 and pipe.getvalue() == ""
    assert sum(bar(range(5), file=_Terminal(), enabled=False)) == 10


def test_cli_prints_no_bar_into_a_pipe(tmp_path):
    """`sim` over 100 synthetic steps shows a bar on a terminal (more than 64 steps); into a pipe it prints its
    report alone."""
    from fastcar_compile.fpga_backend.compiler import build_program
    from fastcar_compile.fpga_backend.encode import save
    from fastcar_compile.fpga_backend.hwspec import load_board
    from fastcar_compile.fpga_backend.modelspec import TINY

    save(build_program(TINY, load_board("kv260"), batch=2, context=8), tmp_path / "p.fcb")
    exe = Path(sys.executable).with_name("fastcar-compile")
    r = subprocess.run([str(exe), "sim", str(tmp_path / "p.fcb"), "--replay-ratio", "0.5", "--steps", "100"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr + r.stdout and "simulate" not in r.stderr and "it/s" not in r.stderr, r.stderr


def test_export_prints_no_transformers_bar_into_a_pipe(tmp_path):
    """`export` of a transformers folder: transformers' own 'Loading weights' bar stays off when stderr is a pipe."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    exe = Path(sys.executable).with_name("fastcar-compile")
    r = subprocess.run([str(exe), "export", str(tmp_path / "m"), "-o", str(tmp_path / "m.onnx")], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr + r.stdout and "Loading weights" not in r.stderr, r.stderr
