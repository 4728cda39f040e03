"""Writing a compiled model: staged in a temp folder beside the output, renamed into place when done.

`Staging` writes the model once (weights of an external-data input are copied as files, not parsed); the
validation pass checks that very file, and `SavePass` renames it into place, so a model that fails
validation never reaches the output path and nothing is serialised twice.

Replacing an earlier output: renaming the .onnx is the single commit point. New external data goes to a file
name no current file has (`<name>.data`, or `<name>.<token>.data` while that one is in use), so until the
.onnx rename the old model still pairs with its own data; afterwards the data files the old output owned
(`owned_data`) are deleted. A crash between the steps leaves the old pair loadable plus, at worst, one
unreferenced new data file.

Concurrency and killed runs (fastcar_compile/core/locks.py): `commit` runs under the output folder's exclusive lock,
which loaders (`FastCarSession`) take shared while they read a model, so none reads an .onnx whose data was just
deleted. Under the same lock each save sweeps what killed runs left: `.fastcar-*` staging folders whose
creator's lock is free, and `<name>.<token>.data` files the current output does not name.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir

from fastcar_compile.core.errors import FastCarError
from fastcar_compile.core.fileio import copy_file, first_missing, model_files, refuse_special
from fastcar_compile.core.locks import TEMP_PREFIX, Owned, folder_lock, sweep
from fastcar_compile.passes.context import weight_bytes

# Above this many bytes of weights the model is written with external data (protobuf's 2 GiB limit).
EXTERNAL_DATA_LIMIT = 2 << 30
# ...and above this many, too: ONNX Runtime (1.31) keeps the plain copy of an inline initializer that an If
# branch reads even after prepacking it, so a compiled model saved inline held its MLP weights twice (+288 MiB
# on the hidden-1024 LLaMA); weights in an external-data file are memory-mapped and unmapped once prepacked
# (docs/memory.md). Small models (tests, the demo) stay one file.
INLINE_WEIGHTS_MAX = 16 << 20


def has_external(model: ir.Model) -> bool:
    """Were the input's weights in an external-data file? (Read off the loaded model: no second parse.)"""
    return any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())


def _save_linked(model: ir.Model, tmp_model: Path, data_name: str, source: Path | None) -> bool:
    """Save without parsing the weights: the input's external-data file is copied next to the output under
    the output's name, at unchanged offsets (a reflink or a sparse copy where possible, fileio.copy_file; never
    a hard link: onnx refuses to load hard-linked data and an in-place write would change both models); the
    few new tensors are stored inline. Returns False when the weights live in several files (ir.save copies)."""
    if source is None:
        return False
    locations = {v.const_value.location for v in model.graph.initializers.values()
                 if isinstance(v.const_value, ir.ExternalTensor)}
    if len(locations) != 1:
        return False
    (location,) = locations
    src = source.parent / location
    if not src.is_file():
        return False
    proto = ir.to_proto(model)
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = data_name
    copy_file(src, tmp_model.parent / data_name)
    with open(tmp_model, "wb") as f:
        f.write(proto.SerializeToString())
    return True


def owned_data(output: str | os.PathLike) -> list[Path]:
    """Data files a save to `output` replaces: `<name>.data` (the default name) and the `<name>.*.data` files
    beside it that the current output names. Data the current output reads under any other name (weights
    shared with other models) is never deleted."""
    output = Path(output)
    default = output.parent / f"{output.name}.data"
    owned = [default] if default.is_file() else []
    if output.is_file():
        for f in model_files(output)[1:]:
            name = os.path.relpath(f, output.parent)
            if (os.sep not in name and name.startswith(f"{output.name}.") and name.endswith(".data")
                    and f.is_file() and f not in owned):
                owned.append(f)
    return owned


STAGING_PREFIX = TEMP_PREFIX + "stage-"


def _free_data_name(output: Path, busy: bool = False) -> str:
    """`<name>.data` unless a file has that name or another save into the folder is under way (`busy`; it may
    take that name first), then `<name>.<token>.data`: never the old model's data, nor a concurrent save's."""
    name = f"{output.name}.data"
    while busy or (output.parent / name).exists():
        name, busy = f"{output.name}.{secrets.token_hex(4)}.data", False
    return name


def sweep_data(output: Path) -> list[Path]:
    """Delete the `<name>.<token>.data` files (the names `_free_data_name` makes) that the current output does
    not read: left by a save killed between its data rename and its model rename, or by one whose deletion of
    the old data was cut short. Only under the folder's exclusive lock, when no save is half-way."""
    token = re.compile(re.escape(output.name) + r"\.[0-9a-f]{8}\.data")
    used = {f.name for f in model_files(output)[1:] if f.parent == output.parent} if output.is_file() else set()
    removed = []
    for f in output.parent.iterdir():
        if token.fullmatch(f.name) and f.name not in used and f.is_file() and not f.is_symlink():
            f.unlink(missing_ok=True)
            removed.append(f)
    return removed


class Staging:
    """A temp folder beside `output` holding the written model until `commit` renames it into place."""

    def __init__(self, output: str | os.PathLike, *, source: Path | None = None, external: bool | None = None):
        self.output = Path(output)
        self.source = source
        self.external = external
        self.data_name = self.output.name + ".data"  # chosen in write: a name no current file has
        self.tmp: Path | None = None
        self.path: Path | None = None  # the written model, once written
        self.created: Path | None = None
        self.big = False
        self.extra: list[str] = []  # files committed with the model (genai_config.json, tokenizer copies)
        self._owner: Owned | None = None  # this run's lock on its staging folder (a free one = a dead run's)

    @functools.cached_property
    def owned(self) -> list[Path]:
        """The current output's data files this save replaces (owned_data): read once, so the collision check
        before compiling (`files`, api) and `commit` parse the previous output once between them."""
        return owned_data(self.output)

    def files(self) -> list[Path]:
        """Every file this save may write or delete: the model, `<name>.data` and the data files the current
        output owns (a new data file always gets a name no file has)."""
        default = self.output.parent / (self.output.name + ".data")
        return [self.output, default, *(f for f in self.owned if f != default)]

    def write(self, model: ir.Model) -> Path:
        if self.path is not None:
            return self.path
        if self.external is None:
            self.external = has_external(model)
        self.created = first_missing(self.output.parent)  # removed again if nothing gets committed
        self.output.parent.mkdir(parents=True, exist_ok=True)
        weights = weight_bytes(model)
        self.big = weights > EXTERNAL_DATA_LIMIT
        self.external = bool(self.external) or self.big or weights > INLINE_WEIGHTS_MAX
        with folder_lock(self.output.parent, shared=False, what=str(self.output)):
            sweep(self.output.parent, TEMP_PREFIX)  # killed runs' staging folders and temp files (locks free)
            sweep_data(self.output)
            busy = any(True for _ in self.output.parent.glob(STAGING_PREFIX + "*"))  # a live save's
            self.tmp = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.output.parent))
            self._owner = Owned(self.tmp)
            self.data_name = _free_data_name(self.output, busy)
        tmp_model = self.tmp / self.output.name
        if not self.external:
            ir.save(model, tmp_model)
        elif not _save_linked(model, tmp_model, self.data_name, self.source):
            ir.save(model, tmp_model, external_data=self.data_name)
        self.path = tmp_model
        return tmp_model

    def add(self, name: str) -> Path:
        """Where to write a file that goes beside the model as part of the same output (write() first): it is
        renamed into the output folder just before the model, and taken back if the model's rename fails."""
        assert self.tmp is not None, "write() first"
        if name in self.extra or name in (self.output.name, self.data_name):
            raise FastCarError(f"{self.output.parent / name}: two files of the output would have this name; "
                               "rename the input's companion file")
        self.extra.append(name)
        return self.tmp / name

    def commit(self) -> Path:
        """New data under its fresh name, then the .onnx rename (the commit point), then the old output's data
        files are deleted (a failure before the rename takes the new data back and leaves the old pair). All
        under the folder's exclusive lock: no loader is between reading the old .onnx and its data meanwhile."""
        assert self.tmp is not None and self.path is not None, "write() first"
        with folder_lock(self.output.parent, shared=False, what=str(self.output)):
            return self._commit()

    def _commit(self) -> Path:
        data = self.output.parent / self.data_name
        if self.output.is_dir() or data.is_dir():
            raise FastCarError(f"{data if data.is_dir() else self.output} is a directory; remove it or choose "
                               "another -o (nothing was written)")
        if data.exists():  # taken since write() (a concurrent save): never overwrite what a model may read
            raise FastCarError(f"{data} appeared while compiling; run again (nothing was written)")
        stale = [f for f in self.owned if f != data]
        moved = False
        extras: list[tuple[Path, Path | None]] = []  # (placed file, the earlier file it replaced, kept aside)
        try:
            if (self.tmp / self.data_name).exists():
                os.replace(self.tmp / self.data_name, data)
                moved = True
            for name in self.extra:
                dst = self.output.parent / name
                refuse_special(dst)
                old = None
                if dst.is_file():
                    old = self.tmp / f".previous.{name}"
                    os.link(dst, old)
                os.replace(self.tmp / name, dst)
                extras.append((dst, old))
            os.replace(self.path, self.output)
        except BaseException:  # all or nothing: a data file or companion without its model is taken back
            if moved:
                data.unlink(missing_ok=True)
            for dst, old in reversed(extras):
                if old is not None:
                    os.replace(old, dst)
                else:
                    dst.unlink(missing_ok=True)
            raise
        self.created = None
        for f in stale:  # the old model is gone: its data would be stale (or mis-paired) beside the new one
            f.unlink(missing_ok=True)
        sweep_data(self.output)  # and what a concurrent save's model (replaced since `owned` was read) named
        return self.output

    def cleanup(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if self.created is not None:  # a folder made for an output that never came: no empty folders
            shutil.rmtree(self.created, ignore_errors=True)
        if self._owner is not None:
            self._owner.release()
        self.tmp = self.path = self.created = self._owner = None


class SavePass(ir.passes.InPlacePass):
    """Write the model (unless the validation pass already staged it) and rename it into place."""

    def __init__(self, staging: Staging):
        super().__init__()
        self.staging = staging

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.staging.write(model)
        self.staging.commit()
        return ir.passes.PassResult(model, modified=False)

    def __str__(self) -> str:
        return f"SavePass(-> {self.staging.output})"
