"""fileio: sparse-aware copies, collision checks through links, staged all-or-nothing folders."""

from __future__ import annotations

import os

import pytest

from fastcar_compile import fileio
from fastcar_compile.errors import FastCarError


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
            fileio.refuse_collisions([a], [tmp_path / alias])
    fileio.refuse_collisions([a], [tmp_path / "other.onnx"])


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
