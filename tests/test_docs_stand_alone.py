"""The documentation stands alone in a clone: no reference to files outside the repository, every relative link
and every repository path a guide names (a script to run, a file to read) exists, and docs/genai.md's recipe for the tokenizer files onnxruntime-genai's builder needs runs as written."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]
TOP = ("docs", "results", "benchmarks", "scripts", "tests", "fastcar_compile", "passes", "runtime", "fpga_backend",
       "training")
# a path from the repository root as prose and commands write it (`python benchmarks/x.py`, docs/y.md, tests/test_*.py)
_PATH = rf"(?:{'|'.join(TOP)})/[\w./*-]*[\w*/]"
REPO_PATH = re.compile(rf"(?<![\w./-])({_PATH})")
# a file as it stood at a commit, git's COMMIT:PATH (`git show 08784a2:benchmarks/x.py`): history, not the tree
AT_COMMIT = re.compile(rf"(?<![\w./-])([0-9a-f]{{7,40}}):({_PATH})")
SOURCES = [p for d in ("fastcar_compile", "runtime", "passes", "fpga_backend", "benchmarks", "scripts", "tests")
           for p in sorted((ROOT / d).rglob("*.py"))]


def test_no_reference_outside_the_repository():
    outside = ("SPEC" + ".md", "../" + "shared", "/" + "work/notes")  # split: this file names them too
    bad = [str(p.relative_to(ROOT)) for p in DOCS + SOURCES
           if any(ref in p.read_text(encoding="utf-8") for ref in outside)]
    assert bad == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # http(s), mailto
            continue
        assert (path.parent / target).exists(), f"{path.name} links to {target}, which is not in the repository"


def _placeholder(target: str) -> bool:
    return any(part.split(".")[0].isupper() for part in target.split("/"))


def missing_paths(text: str) -> list[str]:
    """The repository paths `text` names that are not in the repository (globs must match something; a segment in
    capitals, such as results/SUITE, is a placeholder)."""
    missing = []
    for target in REPO_PATH.findall(AT_COMMIT.sub("", text)):
        target = target.rstrip("/.")
        if _placeholder(target):
            continue
        found = list(ROOT.glob(target)) if "*" in target else (ROOT / target).exists()
        if not found:
            missing.append(target)
    return missing


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_repository_paths_exist(path):
    assert missing_paths(path.read_text(encoding="utf-8")) == [], f"{path.name} names files the repository lacks"


def test_path_check_finds_a_moved_script():
    text = ("run `python benchmarks/quality.py --clips 16`, then read docs/demo.md and tests/test_fpga_*.py; "
            "results/SUITE/, benchmarks/NAME.py; `git show 08784a2:benchmarks/experiments/gone.py`")
    assert missing_paths(text) == ["benchmarks/quality.py"]
    assert AT_COMMIT.findall(text) == [("08784a2", "benchmarks/experiments/gone.py")]


def _git(*args: str) -> bool:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True).returncode == 0


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_at_a_commit_exist_there(path):
    """A study that left the tree is cited as COMMIT:PATH: the commit holds that file (checked where the clone has
    the commit's history; a shallow clone lacks it)."""
    missing = [f"{commit}:{target}" for commit, target in AT_COMMIT.findall(path.read_text(encoding="utf-8"))
               if not _placeholder(target)
               and _git("cat-file", "-e", f"{commit}^{{commit}}") and not _git("cat-file", "-e", f"{commit}:{target}")]
    assert missing == [], f"{path.name} cites files its commits lack"


def test_genai_tokenizer_recipe_runs(tmp_path, monkeypatch):
    """The snippet as docs/genai.md prints it, on a saved transformers model: the tokenizer files appear and
    transformers reads them back with one token per id of the model's vocabulary."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    text = (ROOT / "docs" / "genai.md").read_text(encoding="utf-8")
    section = text[text.index("The tokenizer the builder needs"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    model = tmp_path / "my-model"
    transformers.LlamaConfig(vocab_size=37, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                             num_attention_heads=2).save_pretrained(model)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/genai.md", "exec"), {})  # noqa: S102 - the documented recipe itself
    assert (model / "tokenizer.json").is_file() and (model / "tokenizer_config.json").is_file()
    tok = transformers.AutoTokenizer.from_pretrained(model)
    assert len(tok) == 37 and tok.convert_tokens_to_ids(["t5", "t36"]) == [5, 36]
    assert tok("t3 t9 t1")["input_ids"] == [3, 9, 1]
