"""Atomic file output: every file the project writes goes through here.

A temp file in the destination folder is written, given the usual permissions (mkstemp creates 0600), and
renamed onto the target; on any failure it is removed, so a crash never leaves a half-written output. Its
creator holds its lock (fastcar_compile/core/locks.py): a temp file a killed run left is removed by the next write
into that folder. A write
error that names no file (a full disk fails `write`, not `open`) is re-raised naming the target.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastcar_compile.core.fileio import refuse_special, with_path
from fastcar_compile.core.locks import TEMP_PREFIX, owned_temp


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str | None = None) -> Iterator[Path]:
    """Yield a temp path beside `path` (same suffix, so writers that infer a format from it work)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def make() -> str:
        fd, name = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{path.name}.",
                                    suffix=path.suffix if suffix is None else suffix, dir=path.parent)
        os.close(fd)
        return name

    tmp, owner = owned_temp(path.parent, make)
    try:
        yield Path(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        refuse_special(path)  # last look before the rename: never replace a device, FIFO or socket
        os.replace(tmp, path)
    except OSError as exc:
        raise with_path(exc, path) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        owner.release()


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def save_figure(fig, path: str | os.PathLike, **savefig_kwargs) -> Path:
    """Save a matplotlib figure atomically and close it."""
    import matplotlib.pyplot as plt

    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, **savefig_kwargs)
    finally:
        plt.close(fig)
    return Path(path)
