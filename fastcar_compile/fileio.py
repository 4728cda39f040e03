"""File safety for everything the project reads and writes: inputs are never touched, outputs appear whole.

* ``model_files`` lists every file an ONNX model reads (the model and each external-data location), so
  ``refuse_collisions`` can compare them with every file an output will write, through symlinks and hard
  links (same device and inode), before anything is written.
* ``copy_file`` copies external data for an output instead of hard-linking it (onnx >= 1.23 refuses to load a
  model whose data file has several links, and a later in-place write would change both models): a reflink
  (FICLONE) where the file system offers one, else a sparse-aware copy (SEEK_DATA/SEEK_HOLE +
  copy_file_range) with progress, so a sparse 27 GB weight file stays sparse and costs no time.
* ``staged_dir`` writes a set of files into a temporary folder beside the target and renames them in last;
  on failure nothing is left behind (no half output, no empty folder).
* ``os_errors`` turns file-system errors into one-line user errors (FastCarError, exit 2) that say what to do.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fastcar_compile.errors import FastCarError

FICLONE = 0x40049409  # linux/fs.h _IOW(0x94, 9, int)
PROGRESS_BYTES = 256 << 20  # copies larger than this show a progress bar
_CHUNK = 64 << 20

_HINTS = {
    errno.ENOSPC: "no space left on the device; free some space or write elsewhere",
    errno.EDQUOT: "disk quota exceeded; free some space or write elsewhere",
    errno.EACCES: "permission denied; choose a folder you can write to (or read)",
    errno.EPERM: "operation not permitted; choose a folder you can write to",
    errno.EROFS: "the file system is read-only; write elsewhere",
    errno.EISDIR: "it is a directory; give a file path",
    errno.ENOTDIR: "a parent in the path is a file, not a folder; fix the path",
    errno.ENOENT: "no such file or folder; check the path",
    errno.ENAMETOOLONG: "the file name is too long; use a shorter path",
    errno.EXDEV: "cannot move across file systems; write the output on the same file system",
}


def describe_os_error(exc: OSError, what: str = "") -> str:
    """One line: which path, what went wrong, what to do."""
    where = exc.filename if exc.filename is not None else what
    hint = _HINTS.get(exc.errno or -1, (exc.strerror or str(exc)).lower())
    prefix = f"{what}: " if what and str(where) != what else ""
    return f"{prefix}{where}: {hint}"


@contextmanager
def os_errors(what: str = "") -> Iterator[None]:
    """Re-raise OSError (not FastCarError) as a FastCarError with a one-line explanation."""
    try:
        yield
    except FastCarError:
        raise
    except OSError as exc:
        raise FastCarError(describe_os_error(exc, what)) from None


# ---------------------------------------------------------------------------------------------- identity
def identity(path: str | os.PathLike) -> tuple[int, int] | None:
    """(device, inode) of the file a path reaches through symlinks; None if nothing is there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True if both paths reach one file (symlinks, hard links, `..`), or one would be written over the other."""
    ia, ib = identity(a), identity(b)
    if ia is not None and ia == ib:
        return True
    return Path(os.path.realpath(a)) == Path(os.path.realpath(b))


def fingerprint(path: str | os.PathLike, full_limit: int = 64 << 20, window: int = 1 << 20) -> bytes:
    """Content identity of a file: its hash up to `full_limit` bytes, else its size and 16 windows spread
    over it (a 27 GB weight file costs 16 MiB of reading)."""
    import hashlib

    h = hashlib.sha1()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(str(size).encode())
        if size <= full_limit:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        else:
            for i in range(16):
                f.seek((size - window) * i // 15)
                h.update(f.read(window))
    return h.digest()


def model_fingerprint(path: str | os.PathLike) -> bytes:
    """Identity of a model: the .onnx file and every external-data file it reads."""
    import hashlib

    h = hashlib.sha1()
    for f in model_files(path):
        h.update(fingerprint(f) if f.is_file() else b"missing")
    return h.digest()


def model_files(path: str | os.PathLike) -> list[Path]:
    """The model file and every external-data file it references (paths relative to the model's folder)."""
    import onnx

    path = Path(path)
    files = [path]
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - an unreadable model is reported by the loader itself
        return files
    tensors = list(proto.graph.initializer)
    for node in proto.graph.node:  # Constant nodes may point at external data too
        tensors.extend(a.t for a in node.attribute if a.HasField("t"))
    seen = set()
    for tensor in tensors:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value not in seen:
                seen.add(entry.value)
                files.append(path.parent / entry.value)
    return files


def missing_external_data(path: str | os.PathLike) -> list[Path]:
    """External-data files a model names that do not exist (loading it would fail deep inside onnx)."""
    return [f for f in model_files(path)[1:] if not f.is_file()]


def refuse_collisions(reads: Iterable[str | os.PathLike], writes: Iterable[str | os.PathLike]) -> None:
    """Raise FastCarError if any output file would replace (or write into) a file the input reads."""
    reads = list(reads)
    for w in writes:
        for r in reads:
            if same_file(r, w):
                raise FastCarError(f"output {w} would overwrite {r}, which the input model reads; choose "
                                   "another -o path (inputs are never modified)")


def check_output_path(path: str | os.PathLike, what: str = "output") -> Path:
    """The target must be a file path whose nearest existing ancestor is a writable folder."""
    path = Path(path)
    if path.is_dir():
        raise FastCarError(f"{what} {path} is a directory; give a file path, not a folder")
    if str(path).endswith(os.sep):
        raise FastCarError(f"{what} {path} names a folder; give a file path")
    _check_writable_ancestor(path, path.parent, what)
    return path


def _check_writable_ancestor(path: Path, start: Path, what: str) -> None:
    """The nearest existing ancestor of `start` must be a writable folder (no file or dangling link in the way)."""
    parent = start
    while not parent.exists():
        if parent.is_symlink():
            raise FastCarError(f"{what} {path}: {parent} is a dangling symlink; fix the path")
        parent = parent.parent
    if not parent.is_dir():
        raise FastCarError(f"{what} {path}: {parent} is a file, not a folder; fix the path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise FastCarError(f"{what} {path}: cannot write in {parent} (permission denied); choose another folder")


def check_output_dir(path: str | os.PathLike, what: str = "output folder") -> Path:
    """The target folder exists as a folder or can be created (no file in its place or on its path)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FastCarError(f"{what} {path} is a file, not a folder; give a folder path")
    _check_writable_ancestor(path, path, what)
    return path


def check_input_file(path: str | os.PathLike, what: str) -> Path:
    """An existing regular file (a folder or a missing path is named as such)."""
    path = Path(path)
    if path.is_dir():
        raise FastCarError(f"{what} {path} is a directory; give the path of a file")
    if not path.exists():
        raise FastCarError(f"{what} {path} does not exist; check the path")
    if not os.access(path, os.R_OK):
        raise FastCarError(f"{what} {path} is not readable (permission denied)")
    return path


def read_text(path: str | os.PathLike, what: str) -> str:
    """A user-supplied text file, with missing/directory/binary files reported as user errors."""
    path = check_input_file(path, what)
    with os_errors(what):
        data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise FastCarError(f"{what} {path} is not a UTF-8 text file (binary?); give the text file") from None


# ---------------------------------------------------------------------------------------------- copying
def _reflink(src_fd: int, dst_fd: int) -> bool:
    import fcntl

    try:
        fcntl.ioctl(dst_fd, FICLONE, src_fd)
    except OSError:
        return False
    return True


def _data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """(offset, length) of the regions of a file that hold data (holes skipped); whole file if unsupported."""
    if not hasattr(os, "SEEK_DATA"):
        return [(0, size)]
    out, pos = [], 0
    try:
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only a hole remains
                    break
                raise
            end = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, end - start))
            pos = end
    except OSError:
        return [(0, size)]
    return out


def _copy_range(src_fd: int, dst_fd: int, offset: int, length: int, bar) -> None:
    done = 0
    use_cfr = hasattr(os, "copy_file_range")
    while done < length:
        n = min(_CHUNK, length - done)
        pos = offset + done
        written = 0
        if use_cfr:
            try:
                written = os.copy_file_range(src_fd, dst_fd, n, pos, pos)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                use_cfr = False
        if not use_cfr:
            chunk = os.pread(src_fd, n, pos)
            written = os.pwrite(dst_fd, chunk, pos) if chunk else 0
        if written <= 0:
            raise OSError(errno.EIO, "short copy (source file changed while copying?)")
        done += written
        bar.update(written)


def copy_file(src: str | os.PathLike, dst: str | os.PathLike, *, progress: bool | None = None) -> str:
    """Copy `src` to a new file `dst` (never a link); return how: "reflink", "sparse copy" or "copy".

    Holes stay holes (SEEK_DATA/SEEK_HOLE), data regions go through copy_file_range (in-kernel, and a
    server-side/CoW copy where the file system does that). Progress shows for large data.
    """
    from tqdm.auto import tqdm

    src, dst = Path(src), Path(dst)
    with open(src, "rb") as fs, open(dst, "wb") as fd:
        size = os.fstat(fs.fileno()).st_size
        if size and _reflink(fs.fileno(), fd.fileno()):
            return "reflink"
        extents = _data_extents(fs.fileno(), size)
        data = sum(n for _, n in extents)
        show = (data > PROGRESS_BYTES) if progress is None else progress
        with tqdm(total=data, unit="B", unit_scale=True, desc=f"copying {src.name}", disable=not show,
                  leave=False) as bar:
            for off, n in extents:
                _copy_range(fs.fileno(), fd.fileno(), off, n, bar)
        os.ftruncate(fd.fileno(), size)  # a trailing hole
    shutil.copymode(src, dst)
    return "sparse copy" if data < size else "copy"


# ---------------------------------------------------------------------------------------------- staging
def first_missing(path: Path) -> Path | None:
    """The top-most folder of `path` that does not exist yet (what a mkdir -p would create)."""
    top = None
    p = path
    while not p.exists():
        top = p
        p = p.parent
    return top


@contextmanager
def staged_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp folder beside `target`; on success move its files into `target` (renames, last step).

    On failure the temp folder is removed, and so is any folder this call created: no empty folders left.
    The moves themselves are renames within one file system (cheap and atomic per file).
    """
    target = Path(target)
    check_output_dir(target)
    created = first_missing(target)
    with os_errors(str(target)):
        target.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name or 'out'}.", dir=target))
    moved: list[Path] = []
    try:
        yield tmp
        entries = sorted(tmp.iterdir())
        for e in entries:
            if (target / e.name).is_dir() and not e.is_dir():
                raise FastCarError(f"{target / e.name} is a directory; remove it or write elsewhere")
        umask = os.umask(0)
        os.umask(umask)
        with os_errors(str(target)):
            for e in entries:
                if e.is_file() and (e.stat().st_mode & 0o777) == 0o600:
                    os.chmod(e, 0o666 & ~umask)
                os.replace(e, target / e.name)
                moved.append(target / e.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            for m in moved:  # a later rename failed: the folder we created must not keep a partial set
                m.unlink(missing_ok=True)
            shutil.rmtree(created, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
