"""Advisory locks (flock) that make replacing a model safe against concurrent readers, writers and killed runs.

* The output folder's lock: a save takes it exclusively while it renames the new model in, deletes the old
  model's data and sweeps what killed runs left; `FastCarSession` (any loader) takes it shared while it reads a
  model and its external data. So a loader never finds the .onnx of one generation without its data file,
  and a sweep never sees another save half-way through its renames.
* Ownership of a temp entry (a staging folder): its creator holds a lock on it as long as it lives. The kernel
  drops the lock when the process dies, however it dies (kill -9 included), so an entry whose lock is free is
  provably left behind by a dead run, and one whose lock is held belongs to a live run and is never touched.

flock is per open file: it works between processes and between threads alike. Where there is no flock
(not POSIX) these are no-ops: nothing is locked.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fastcar_compile.core.errors import FastCarError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

# Every temp entry the project makes in a user's folder starts with this (staging folders, atomic writes'
# temp files): a sweep touches nothing else.
TEMP_PREFIX = ".fastcar-"
# How long a save waits for loads of the model it replaces (or for another save into the same folder).
WAIT_S = 300.0


def _open(path: Path) -> int | None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0)
    try:
        return os.open(path, flags)
    except OSError:
        return None


def _try(fd: int, mode: int) -> bool | None:
    """True: locked; False: another holder has it; None: this file system has no flock (ENOLCK, EOPNOTSUPP...)."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError as exc:
        return False if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) else None
    return True


@contextmanager
def folder_lock(folder: str | os.PathLike, *, shared: bool, wait_s: float = WAIT_S,
                what: str = "") -> Iterator[None]:
    """Hold `folder`'s lock, shared (loading a model in it) or exclusive (replacing or sweeping files in it).
    A folder that cannot be opened (missing, no permission) is not locked: the operation itself reports it. Nor is
    one of our temp folders (TEMP_PREFIX): it is private to the run that made it, whose owner lock on it would
    conflict with this one (files written into a staging folder)."""
    folder = Path(folder)
    private = folder.name.startswith(TEMP_PREFIX)
    fd = _open(folder) if fcntl is not None and not private else None
    if fd is None:
        yield
        return
    try:
        mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        end = time.monotonic() + wait_s
        while _try(fd, mode) is False:  # (None: no flock here; go on unlocked, as before)
            if time.monotonic() > end:
                raise FastCarError(f"{what or folder}: another process has been loading or writing a model in "
                                   f"{folder} for {wait_s:.0f} s; run again when it is done (nothing was written)")
            time.sleep(0.01)
        yield
    finally:
        os.close(fd)


class Owned:
    """A temp entry (file or folder) with its creator's lock held until `release` (or the process's death)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fd = _open(self.path) if fcntl is not None else None
        if self._fd is not None and not _try(self._fd, fcntl.LOCK_EX):  # (just created: nobody else has it)
            os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def abandoned(path: str | os.PathLike) -> bool:
    """True when no live process holds `path`'s owner lock (its creator died); False while one does, or where
    it cannot be told (no flock, unreadable entry): then the entry is left alone."""
    if fcntl is None:
        return False
    fd = _open(Path(path))
    if fd is None:
        return False
    try:
        return _try(fd, fcntl.LOCK_EX) is True  # (no flock on this file system: cannot tell, keep it)
    finally:
        os.close(fd)  # (releases the probe's lock at once)


def owned_temp(folder: str | os.PathLike, make: Callable[[], str]) -> tuple[Path, Owned]:
    """Sweep `folder` of the temp entries dead runs left, then create one with `make` (mkstemp / mkdtemp with
    TEMP_PREFIX) and lock it as its owner; under the folder's exclusive lock, so no sweep meets an entry between
    its creation and its lock."""
    with folder_lock(folder, shared=False):
        if not Path(folder).name.startswith(TEMP_PREFIX):  # (nothing of a dead run inside a live run's folder)
            sweep(folder, TEMP_PREFIX)
        path = Path(make())
        return path, Owned(path)


def sweep(folder: str | os.PathLike, prefix: str) -> list[Path]:
    """Remove the entries of `folder` named `prefix*` that their dead creators left (`abandoned`); returns them.
    Call it holding the folder's exclusive lock, under which new entries are created and locked."""
    removed = []
    try:
        entries = [e for e in Path(folder).iterdir() if e.name.startswith(prefix)]
    except OSError:
        return removed
    for e in entries:
        if abandoned(e):
            if e.is_dir() and not e.is_symlink():
                shutil.rmtree(e, ignore_errors=True)
            else:
                e.unlink(missing_ok=True)
            removed.append(e)
    return removed
