"""The README's commands work as shown: every command line names an existing subcommand, script or suite and only
flags its --help lists; the runtime snippet runs as printed on the test zoo's tiny model; the PyTorch snippet's
calls exist with the keywords it passes; the five-command walk runs as printed (slow)."""

from __future__ import annotations

import inspect
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
EXTERNAL = ("python3 -m pip", "python3 -m pytest", "python -m onnxruntime_genai.models.builder")


def shell_blocks() -> list[list[str]]:
    """Indented (4-space) code blocks, each as its command lines: continuations joined, comments dropped,
    `a && b` split."""
    blocks, cur = [], []
    for line in README.splitlines() + [""]:
        if line.startswith("    ") and line.strip():
            cur.append(line[4:])
        elif cur:
            blocks.append(cur)
            cur = []
    out = []
    for block in blocks:
        text = re.sub(r"\\\n\s*", " ", "\n".join(block))
        cmds = []
        for line in text.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            cmds += [c.strip() for c in line.split("&&") if c.strip()]
        out.append(cmds)
    return out


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


@cache
def output(*args: str) -> str:
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(args)} failed: {r.stderr[-500:]}"
    return r.stdout


def help_text(*prog: str) -> str:
    return output(*prog, "--help")


def unknown_flags(prog: tuple[str, ...], args: list[str]) -> list[str]:
    text = help_text(*prog)
    return [f for f in (a.split("=")[0] for a in args if a.startswith("-"))
            if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]


def program(words: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """(how to ask for its --help, its arguments) for a README command."""
    from fastcar_compile.cli.registry import SUBCOMMANDS

    if words[0] == "fastcar-compile":
        if len(words) > 1 and words[1] in SUBCOMMANDS:
            return ("-m", "fastcar_compile", words[1]), words[2:]
        return ("-m", "fastcar_compile"), words[1:]
    if words[0].startswith("python") and words[1] == "-m" and words[2] == "benchmarks":
        return ("-m", "benchmarks"), words[3:]
    if words[0].startswith("python") and words[1].endswith(".py"):
        assert (ROOT / words[1]).is_file(), f"README runs {words[1]}, which is not in the repository"
        return (words[1],), words[2:]
    raise AssertionError(f"README command {' '.join(words)!r} is neither fastcar-compile, a script nor a suite")


COMMANDS = [c for block in shell_blocks() for c in block if not c.startswith(EXTERNAL)]


def test_readme_within_limits():
    assert len(README.splitlines()) <= 150
    assert len(COMMANDS) >= 10 and len(python_blocks()) >= 2


@pytest.mark.parametrize("command", COMMANDS)
def test_command_flags_exist(command):
    prog, args = program(shlex.split(command))
    assert unknown_flags(prog, args) == [], f"not options of {' '.join(prog)}"
    if prog == ("-m", "benchmarks"):  # every suite it names exists
        suites = {line.split()[0] for line in output("-m", "benchmarks", "--list").splitlines() if line.strip()}
        assert {a for a in args if not a.startswith("-")} <= suites, args


def test_flag_check_catches_what_the_cli_lacks():
    prog, args = program(["fastcar-compile", "eval", "--model", "f.onnx", "--frames", "4", "--frame", "2"])
    assert unknown_flags(prog, args) == ["--frame"]
    assert unknown_flags(*program(["fastcar-compile", "m.onnx", "--kv-budget", "8", "--kv-budgets", "8"])) == ["--kv-budgets"]


def test_runtime_snippet_runs(zoo_model, tmp_path, monkeypatch):
    """The FastCarSession block as printed, in a folder holding the tiny zoo Llama as model.onnx and its compile
    as fast.onnx (frame_tokens 16, tau 0, the values the snippet's comments assume)."""
    import shutil

    import fastcar_compile as fc

    block = next(b for b in python_blocks() if "FastCarSession" in b)
    shutil.copy(zoo_model("llama", "dynamo20"), tmp_path / "model.onnx")
    fc.compile(str(tmp_path / "model.onnx"), str(tmp_path / "fast.onnx"), frame_tokens=16, threshold=0.0)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})  # noqa: S102 - the documented snippet itself
    assert (tmp_path / "run.json").is_file()


def test_pytorch_snippet_calls_exist():
    """Each call of the PyTorch block exists and takes the keywords the block passes (running it needs a
    transformers model and 2048 generated tokens: tests/test_torch_frontend.py runs these calls)."""
    import fastcar_compile.torch as fct

    block = next(b for b in python_blocks() if "fastcar_compile.torch" in b)
    for name, kwargs in re.findall(r"fastcar_compile\.torch\.(\w+)\(([^)]*)\)", block):
        params = inspect.signature(getattr(fct, name)).parameters
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for kw in re.findall(r"(\w+)=", kwargs):
            assert kw in params or has_var_kw, f"fastcar_compile.torch.{name} takes no {kw}="


@pytest.mark.slow
def test_five_commands_run(tmp_path):
    """The walk block as printed, from a folder where `scripts/demo_as_user_model.py` wrote the stand-in model."""
    run = [sys.executable, str(ROOT / "scripts" / "demo_as_user_model.py"), "--out", "my-model"]
    assert subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=600).returncode == 0
    block = next(b for b in shell_blocks() if any("--inspect" in c for c in b))
    for command in block:
        words = shlex.split(command)
        assert words[0] == "fastcar-compile"
        r = subprocess.run([sys.executable, "-m", "fastcar_compile", *words[1:]], cwd=tmp_path, capture_output=True,
                           text=True, timeout=1200)
        assert r.returncode == 0, f"{command}: {r.stderr[-800:]}"
    assert (tmp_path / "run" / "eval.json").is_file() and list((tmp_path / "run").glob("*.png"))


@pytest.mark.slow
def test_genai_lines_run_on_the_stand_in(tmp_path):
    """The onnxruntime-genai block as printed, on the stand-in the walk uses (the script writes the tokenizer the
    builder needs): the builder builds, the compiler compiles, and og.Generator generates from a held-out prompt
    the tokens FastCarSession gives on the same file at the video start the prompt has (greedy)."""
    import numpy as np

    pytest.importorskip("onnxruntime_genai")
    run = [sys.executable, str(ROOT / "scripts" / "demo_as_user_model.py"), "--out", "my-model"]
    assert subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=600).returncode == 0
    block = next(b for b in shell_blocks() if any(c.startswith("python -m onnxruntime_genai") for c in b))
    for command in block:
        words = shlex.split(command)
        argv = [sys.executable, *words[1:]] if words[0] == "python" else [sys.executable, "-m", "fastcar_compile",
                                                                           *words[1:]]
        r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, f"{command}: {r.stderr[-800:]}"
    from test_genai_speculate import _greedy  # genai's own loop, greedy

    from fastcar_compile.runtime import FastCarSession

    prompt = np.load(tmp_path / "heldout.npy")[:1]
    n = 70  # past the first generated frame: replay decides
    got, _ = _greedy(tmp_path / "genai-fast", prompt, n)

    want = FastCarSession(tmp_path / "genai-fast" / "fast.onnx", threads=1).generate(
        prompt, num_frames=2, given_video_tokens=prompt.shape[1] - 8, progress=False).tokens.reshape(-1)
    np.testing.assert_array_equal(got, want[:n])


def test_every_guide_is_linked():
    """A user finds every guide from the README (a new docs/*.md page needs its link)."""
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)\)", README))
    assert {p.name for p in (ROOT / "docs").glob("*.md")} <= linked


def test_every_board_preset_is_named():
    """The FPGA section names every board preset the compiler accepts (fpga_backend/boards/*.json)."""
    boards = [p.stem.upper() for p in (ROOT / "fpga_backend" / "boards").glob("*.json")]
    assert boards and [b for b in boards if b not in README] == []
