"""The repository speaks of the product only: no development history in any text file or file name (who built or
reran what, in which round, session or under which load). A figure's provenance is its command, commit and
machine (results/). Each pattern below is a way history was once written; a hit names the file and line."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BINARY = {".png", ".onnx", ".npz", ".npy", ".safetensors", ".so", ".gif", ".data", ".bin"}

# (what it is, pattern); compiled case-insensitively
TEXT = [
    ("a work session's tag", r"\bs\d+-[a-z][a-z0-9]{2,}\b"),
    ("a numbered work session", r"\bsessions? (s)?\d+\b"),
    ("another work session", r"\b(previous|earlier|next|first) session\b"),
    ("a team role", r"\b(engineers?|worktrees?|the lead|lead's)\b"),
    ("a work or review round", r"\b(review|work) rounds?\b|\bround \d+\b"),
    ("an issue-tracker number", r"\bissues? #?\d+"),
    ("an earlier run told as history", r"\b(earlier|previous) runs?\b|\breran\b|\bwe ran\b"),
    ("a path on a development machine", r"/work/(wt|main|ckpt|notes|shared)\b|/tmp/lead\b"),
]
NAMES = [("a run-tagged file name", r"_(idle|loaded|nearidle)\d*(_|\.)|_run\d+\.|_s\d+_")]


def _files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        paths = [ROOT / p for p in out.splitlines()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file but the usual build folders
        skip = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache", "fastcar-out"}
        paths = [p for p in ROOT.rglob("*") if not skip & set(p.relative_to(ROOT).parts)]
    return [p for p in paths if p.is_file()]


def test_no_history_in_file_names():
    hits = [f"{p.relative_to(ROOT)}: {what}" for p in _files() for what, rx in NAMES
            if re.search(rx, p.name, re.IGNORECASE)]
    assert hits == []


def test_no_history_in_text():
    me = Path(__file__).resolve()
    rules = [(what, re.compile(rx, re.IGNORECASE)) for what, rx in TEXT]
    hits = []
    for path in _files():
        if path.suffix.lower() in BINARY or path.resolve() == me:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for what, rx in rules:
                if m := rx.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {what}: {m.group(0)!r}")
    assert hits == [], "\n".join(hits[:60]) + (f"\n... {len(hits) - 60} more" if len(hits) > 60 else "")


def test_the_check_finds_history():
    """Each pattern matches what it is for (so a typo cannot disable it) and not product text."""
    samples = {"a work session's tag": "measured in s5-packed", "a numbered work session": "Session 4 (superseded)",
               "another work session": "from the previous session", "a team role": "asked the lead",
               "a work or review round": "after review round 2", "an issue-tracker number": "(issue 12)",
               "an earlier run told as history": "an earlier run read 1.94x",
               "a path on a development machine": "/work/wt/s2-long/x"}
    for what, rx in TEXT:
        assert re.search(rx, samples[what], re.IGNORECASE), what
    product = "FastCarSession(path) runs 5 sessions; each round trip; ORT's InferenceSession; the first run exports"
    assert not any(re.search(rx, product, re.IGNORECASE) for _, rx in TEXT)
    assert re.search(NAMES[0][1], "bench_genai_s5_idle1.json") and not re.search(NAMES[0][1], "bench_genai.json")
