"""fileio: sparse-aware copies, collision checks through links, staged all-or-nothing folders."""

from __future__ import annotations

import os

import pytest

from fastcar_compile.core import fileio
from fastcar_compile.core.errors import FastCarError


def test_copy_keeps_holes_and_bytes(tmp_path):
    src, dst = tmp_path / "sparse.bin", tmp_path / "copy.bin"
    size, chunks = 256 << 20, {0: b"head" * 1024, 100 << 20: os.urandom(8192), (256 << 20) - 5: b"tail!"}
    with open(src, "wb") as f:
        f.truncate(size)
        for off, data in chunks.items():
            f.seek(off)
            f.write(data)
    how = fileio.copy_file(src, dst, progress=False)
    assert os.stat(dst).st_size == size and os.stat(dst).st_ino != os.stat(src).st_ino
    with open(dst, "rb") as f:
        for off, data in chunks.items():
            f.seek(off)
            assert f.read(len(data)) == data
        f.seek(50 << 20)
        assert f.read(4096) == b"\0" * 4096
    if how != "reflink" and os.stat(src).st_blocks * 512 < size // 2:  # the file system keeps holes
        assert os.stat(dst).st_blocks * 512 < size // 2, how


def test_collisions_through_symlinks_and_hard_links(tmp_path):
    a = tmp_path / "a.onnx"
    a.write_bytes(b"x")
    os.symlink(a, tmp_path / "s.onnx")
    os.link(a, tmp_path / "h.onnx")
    for alias in ("s.onnx", "h.onnx", "sub/../a.onnx"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        with pytest.raises(FastCarError, match="overwrite"):
            fileio.check_outputs([tmp_path / alias], [a])
    fileio.check_outputs([tmp_path / "other.onnx"], [a])


def test_outputs_are_regular_files_or_new_paths(tmp_path):
    """A FIFO, a character device (as root) and a link to either are refused; a regular file, a link to one,
    a dangling link and a new path are fine. Nothing is touched."""
    import stat

    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "fifo", tmp_path / "to-fifo")
    (tmp_path / "f").write_bytes(b"x")
    os.symlink(tmp_path / "f", tmp_path / "to-f")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    bad = ["fifo", "to-fifo"]
    if os.geteuid() == 0:
        os.mknod(tmp_path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        bad.append("null")
    for name in bad:
        with pytest.raises(FastCarError, match="FIFO|character device"):
            fileio.check_outputs({tmp_path / name: "-o"})
    fileio.check_outputs([tmp_path / n for n in ("f", "to-f", "dangling", "new")])
    assert stat.S_ISFIFO(os.stat(tmp_path / "fifo").st_mode) and (tmp_path / "f").read_bytes() == b"x"


@pytest.mark.parametrize("text, problem", [("{\"a\": 1", "not valid JSON"), ("[1]", "JSON object"),
                                           ("null", "JSON object"), ("[" * 100_000 + "]" * 100_000, "nests"),
                                           ('{"s": "' + "[" * 1000 + '"}', None)])
def test_read_json_bounds(tmp_path, text, problem):
    """The one JSON reader: malformed, wrong kind and 100,000 levels deep are one-line errors; brackets inside
    strings do not count as nesting; a byte-order mark is accepted."""
    import json

    p = tmp_path / "x.json"
    p.write_bytes(b"\xef\xbb\xbf" + text.encode())
    if problem is None:
        assert fileio.read_json(p, "run.json") == json.loads(text)
    else:
        with pytest.raises(FastCarError, match=problem):
            fileio.read_json(p, "run.json")
    with pytest.raises(FastCarError, match="MiB"):
        fileio.read_json(p, "run.json", max_bytes=4)


def _depth_reference(text: str) -> int:
    """Nesting of [ and { outside strings, character by character (a backslash escapes the next character)."""
    depth = deepest = 0
    inside = escaped = False
    for ch in text:
        if ch == "\\":
            escaped = not escaped
            continue
        was, escaped = escaped, False
        if ch == '"' and not was:
            inside = not inside
        elif not inside and ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif not inside and ch in "]}":
            depth -= 1
    return deepest


def test_json_depth_counts_like_a_character_scan_at_any_chunk_size():
    import random

    rng = random.Random(0)
    pieces = ["[", "{", "]", "}", '"', "\\", "a", ":", ",", "\\\\", '\\"', "\u00e9", "\u00e9"]
    for _ in range(1500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        for chunk in (1, 3, 7, 1 << 22):
            assert fileio._json_depth(text.encode(), chunk=chunk) == _depth_reference(text), (text, chunk)


def test_json_depth_of_a_long_string_needs_bounded_memory():
    """A 40 MB JSON string: the depth check's peak allocation stays near its chunk's few arrays (a regex over the
    text, or arrays over all of it, took memory per character: a MemoryError on a 100 MB string)."""
    import tracemalloc

    data = b'"' + b"a\\" * (20 << 20) + b'"'
    tracemalloc.start()
    try:
        assert fileio._json_depth(data) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 << 20, f"{peak / 2**20:.0f} MiB"


def test_staged_dir_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "new" / "deeper"
    with pytest.raises(RuntimeError), fileio.staged_dir(target) as tmp:
        (tmp / "one.png").write_bytes(b"1")
        raise RuntimeError("second picture failed")
    assert not (tmp_path / "new").exists()
    with fileio.staged_dir(target) as tmp:
        (tmp / "one.png").write_bytes(b"1")
        (tmp / "two.png").write_bytes(b"2")
    assert sorted(os.listdir(target)) == ["one.png", "two.png"]


def test_os_errors_become_one_line_user_errors(tmp_path):
    import errno

    with pytest.raises(FastCarError, match="no space left") as info, fileio.os_errors("output"):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))
    assert "\n" not in str(info.value)
