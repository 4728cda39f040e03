"""File safety for everything the project reads and writes: inputs are never touched, outputs appear whole.

* ``check_outputs`` is the one check every command runs before any work, with all the files it will write
  (derived ones too: external data, pictures, files written beside) and all it reads (``model_files``: the
  model and each external-data location; calibration data, board files, traces, prompts): no output may be
  an input (through symlinks, hard links, ``./x`` vs ``x``), and none may be a device, FIFO or socket
  (renaming a file over ``/dev/null`` would replace the device node).
* ``read_json`` is the one reader of user-supplied JSON: size and nesting bounded before parsing.
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
import stat
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.locks import TEMP_PREFIX, owned_temp

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
    return f"{prefix}{where}: {hint}" if where else hint


def with_path(exc: OSError, path: str | os.PathLike) -> OSError:
    """`exc`, naming `path` when it names no file (a full disk fails a write, not the open: no file name)."""
    if exc.filename is not None or exc.errno is None:
        return exc
    return OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path))


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
    if not path.is_file():  # missing, a folder, or a FIFO that onnx.load would wait on forever
        return files
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


def model_reads(path: str | os.PathLike, what: str = "the input model") -> dict[Path, str]:
    """model_files, labelled for check_outputs."""
    files = model_files(path)
    return {files[0]: what, **{f: f"{what}'s external data" for f in files[1:]}}


def missing_external_data(path: str | os.PathLike) -> list[Path]:
    """External-data files a model names that do not exist (loading it would fail deep inside onnx); one that
    is a FIFO or device is refused (onnx would wait on it forever)."""
    files = model_files(path)[1:]
    for f in files:
        refuse_special_input(f, f"{path}'s external data")
    return [f for f in files if not f.is_file()]


Paths = Mapping[str | os.PathLike, str] | Iterable[str | os.PathLike]

_SPECIAL = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
            (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _labelled(paths: Paths, default: str) -> list[tuple[Path, str]]:
    items = paths.items() if isinstance(paths, Mapping) else ((p, default) for p in paths)
    return [(Path(p), what) for p, what in items if p is not None]


def _special_kind(path: str | os.PathLike) -> tuple[str, bool] | None:
    """What a path that exists but is no regular file is, also where a symlink leads ("a FIFO (named pipe)
    (through the link to ...)"), and whether it is a folder; None for a regular file or nothing there."""
    try:
        st = os.stat(path)
    except OSError:  # nothing there (a new path, or a dangling link)
        return None
    if stat.S_ISREG(st.st_mode):
        return None
    kind = next((k for test, k in _SPECIAL if test(st.st_mode)), "not a regular file")
    via = f" (through the link to {os.path.realpath(path)})" if os.path.islink(path) else ""
    return kind + via, stat.S_ISDIR(st.st_mode)


def refuse_special(path: str | os.PathLike, what: str = "output") -> None:
    """An output must be a new path or a regular file, also where a symlink leads: a rename over a device,
    FIFO or socket would replace that node (as root, `-o /dev/null` would replace the system's)."""
    if (found := _special_kind(path)) is None:
        return
    kind, folder = found
    hint = "give a file path, not a folder" if folder else \
        "give a regular file or a new path (special files are never replaced)"
    raise FastCarError(f"{what} {path} is {kind}; {hint}")


def refuse_special_input(path: str | os.PathLike, what: str = "input") -> None:
    """An input that exists must be a regular file (folders are left to the caller, which names what it wants
    instead): reading a FIFO waits forever for a writer, a device such as /dev/zero never ends."""
    found = _special_kind(path)
    if found is not None and not found[1]:
        raise FastCarError(f"{what} {path} is {found[0]}; give a regular file (a pipe or device is never read)")


def check_outputs(writes: Paths, reads: Paths = ()) -> None:
    """Run by every command before any work, with every file it writes and every file it reads: an input that
    exists must be a regular file (refuse_special_input), each output must be a regular file or a new path, and
    none may be an input (same path, symlink, hard link: an atomic
    rename would replace the input, and a picture or model would take the place of a bundle or prompt file).
    Mappings name each path ({path: "--timeline"}); plain lists are "output" / "input"."""
    outs, ins = _labelled(writes, "output"), _labelled(reads, "input")
    for r, r_what in ins:
        refuse_special_input(r, r_what)
    for w, w_what in outs:
        refuse_special(w, w_what)
    for w, w_what in outs:
        for r, r_what in ins:
            if same_file(r, w):
                same = "" if str(r) == str(w) else f" {r}"
                raise FastCarError(f"{w_what} {w} would overwrite {r_what}{same}, which this command reads; "
                                   "choose another output path (inputs are never modified)")


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
    """An existing regular file (a folder, a missing path or a FIFO/device is named as such)."""
    path = Path(path)
    if path.is_dir():
        raise FastCarError(f"{what} {path} is a directory; give the path of a file")
    if not path.exists():
        raise FastCarError(f"{what} {path} does not exist; check the path")
    refuse_special_input(path, what)
    if not os.access(path, os.R_OK):
        raise FastCarError(f"{what} {path} is not readable (permission denied)")
    return path


MAX_JSON_BYTES = 256 << 20  # a run.json of a long batched run stays far below; a board or genai config is KBs
MAX_JSON_DEPTH = 64  # run.json nests 4 deep, genai_config.json 5: deeper is not one of ours


def _json_depth(data: bytes, chunk: int = 1 << 22) -> int:
    """The deepest [ / { nesting of a JSON text (UTF-8 bytes: brackets and quotes are ASCII, never inside a
    multi-byte sequence), counted without recursion and without a regex (which needs memory per character of a
    long string), chunk by chunk in NumPy: a bracket inside a string does not count, a quote preceded by an odd
    run of backslashes does not end one."""
    import numpy as np

    inside, run, depth, deepest = False, 0, 0, 0
    for off in range(0, len(data), chunk):
        b = np.frombuffer(data, np.uint8, count=min(chunk, len(data) - off), offset=off)
        quote = b == 34
        if run or (b == 92).any():  # escaped quotes: a quote after an odd run of backslashes
            idx = np.arange(len(b), dtype=np.int64)
            last = np.maximum.accumulate(np.where(b != 92, idx, -1))  # last non-backslash at or before i
            before = np.empty(len(b), np.int64)  # backslashes right before position i
            before[0] = run
            before[1:] = idx[:-1] - last[:-1] + np.where(last[:-1] < 0, run, 0)
            quote &= before % 2 == 0
            run = run + len(b) if last[-1] < 0 else len(b) - 1 - int(last[-1])
        ins = ((np.cumsum(quote, dtype=np.int64) - quote) % 2 == 1) ^ inside  # in a string (a quote: before it)
        bracket = (b | 32) == 123  # '{' or '['
        step = (bracket & ~ins).astype(np.int8) - (((b | 32) == 125) & ~ins)  # '}' or ']'
        if step.any():
            level = np.cumsum(step, dtype=np.int64) + depth
            deepest, depth = max(deepest, int(level.max())), int(level[-1])
        inside = bool(ins[-1] ^ quote[-1])
    return deepest


def read_json(path: str | os.PathLike, what: str, *, max_bytes: int = MAX_JSON_BYTES,
              max_depth: int = MAX_JSON_DEPTH, kind: type | None = dict):
    """A user-supplied JSON file, bounded in size and depth before it is parsed (the parser recurses: 100,000
    levels crash it), as `kind` (None: any value). Every problem is one FastCarError naming the file."""
    import json

    path = check_input_file(path, what)
    with os_errors(what):
        size = path.stat().st_size
        if size > max_bytes:
            raise FastCarError(f"{what} {path} is {size / 2**20:.0f} MiB, more than the {max_bytes >> 20} MiB a "
                               f"{what} can be; give the right file")
        data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark is harmless
    except UnicodeDecodeError:
        raise FastCarError(f"{what} {path} is not a UTF-8 text file (binary?); give the JSON file") from None
    if (depth := _json_depth(data)) > max_depth:
        raise FastCarError(f"{what} {path} nests {depth} levels deep (at most {max_depth}); give the right file")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FastCarError(f"{what} {path} is not valid JSON ({exc}); fix or regenerate it") from None
    except RecursionError:
        raise FastCarError(f"{what} {path} nests too deeply; give the right file") from None
    if kind is not None and not isinstance(value, kind):
        want = {dict: "a JSON object", list: "a JSON list"}.get(kind, kind.__name__)
        raise FastCarError(f"{what} {path} must hold {want}, not {type(value).__name__ if value is not None else 'null'}")
    return value


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
    from fastcar_compile.core.progress import bar as progress_bar

    src, dst = Path(src), Path(dst)
    with open(src, "rb") as fs, open(dst, "wb") as fd:
        size = os.fstat(fs.fileno()).st_size
        if size and _reflink(fs.fileno(), fd.fileno()):
            return "reflink"
        extents = _data_extents(fs.fileno(), size)
        data = sum(n for _, n in extents)
        show = (data > PROGRESS_BYTES) if progress is None else progress
        with progress_bar(total=data, unit="B", unit_scale=True, desc=f"copying {src.name}", enabled=show,
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
    tmp, owner = owned_temp(target, lambda: tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{target.name or 'out'}.",
                                                             dir=target))  # (a killed run's: swept)
    moved: list[Path] = []
    try:
        yield tmp
        entries = sorted(tmp.iterdir())
        for e in entries:
            if (target / e.name).is_dir() and not e.is_dir():
                raise FastCarError(f"{target / e.name} is a directory; remove it or write elsewhere")
        umask = os.umask(0)
        os.umask(umask)
        for e in entries:
            refuse_special(target / e.name)
        with os_errors(str(target)):
            for e in entries:
                if e.is_file() and (e.stat().st_mode & 0o777) == 0o600:
                    os.chmod(e, 0o666 & ~umask)
                os.replace(e, target / e.name)
                moved.append(target / e.name)
    except OSError as exc:
        _undo(tmp, created, moved)
        if exc.filename is not None and str(exc.filename).startswith(str(tmp)):  # name the file it was for
            exc = OSError(exc.errno, exc.strerror, str(target) + str(exc.filename)[len(str(tmp)):])
        raise with_path(exc, target) from None
    except BaseException:
        _undo(tmp, created, moved)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        owner.release()


def _undo(tmp: Path, created: Path | None, moved: list[Path]) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    if created is not None:
        for m in moved:  # a later rename failed: the folder we created must not keep a partial set
            m.unlink(missing_ok=True)
        shutil.rmtree(created, ignore_errors=True)
