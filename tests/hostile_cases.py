"""Hostile-but-fair inputs to the `fastcar-compile` CLI, as data, with one runner.

Each case builds its argv inside a sandbox folder holding real inputs (the bundled decoder with inline and
external weights, a compiled model, a `.fcb` program and its assembly, a run.json, board files, odd files).
``run_case`` runs `fastcar_compile.cli.main` (the console script's function) in this process, or the real
console script in a subprocess, and reports what happened: exit code, stderr, whether a traceback appeared,
which files were added, changed or now share an inode. tests/test_hostile_inputs.py asserts every case is
rejected (or accepted) cleanly; ``python tests/hostile_cases.py`` prints the totals of the closing note.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "fastcar_compile" / "demo" / "assets" / "decoder.onnx"
L = 64  # tokens per frame of the bundled decoder


@dataclass
class Case:
    name: str
    argv: Callable[[Path], list[str]]
    exit: int = 2
    message: str = ""  # a word the error line must contain (names the flag or the problem)
    outputs: tuple[str, ...] = ()  # files an accepted case may create (relative to the sandbox)
    patch: Callable[[], contextlib.AbstractContextManager] | None = None  # in-process fault injection
    subprocess: bool = False  # also run through the real console script
    timeout: float | None = None  # seconds before the case counts as hung (None: the runner's default)


@dataclass
class Outcome:
    rc: int | None  # None: killed or hung
    stderr: str
    traceback: bool
    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    shared_inodes: list[str] = field(default_factory=list)
    seconds: float = 0.0


# --------------------------------------------------------------------------------------------- sandbox
def build_sandbox(root: Path) -> Path:
    """Real inputs the cases read (built once; cases must leave every byte of it as it was)."""
    import onnx
    from onnx.external_data_helper import set_external_data

    import fastcar_compile as fc
    from fastcar_compile.fpga_backend import asm as fasm
    from fastcar_compile.fpga_backend.compiler import build_program
    from fastcar_compile.fpga_backend.encode import save as save_fcb
    from fastcar_compile.fpga_backend.hwspec import load_board
    from fastcar_compile.fpga_backend.modelspec import TINY

    root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(BUNDLED, root / "model.onnx")
    proto = onnx.load(str(BUNDLED))
    (root / "ext").mkdir()
    onnx.save_model(proto, str(root / "ext" / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=1024)
    # weights over two files, one of them named like the data file of another output (x.onnx -> x.onnx.data)
    multi = onnx.load(str(BUNDLED))
    big = [t for t in multi.graph.initializer if t.ByteSize() > 1024]
    for i, t in enumerate(big):
        set_external_data(t, "x.onnx.data" if i % 2 == 0 else "w2.bin")
    (root / "multi").mkdir()
    onnx.save_model(multi, str(root / "multi" / "y.onnx"))
    (root / "noext").mkdir()
    shutil.copyfile(root / "ext" / "model.onnx", root / "noext" / "model.onnx")  # its data file is missing
    fc.compile(root / "model.onnx", root / "fast.onnx", frame_tokens=L, threshold=0.0)
    program = build_program(TINY, load_board("kv260"), batch=4, context=8)
    save_fcb(program, root / "prog.fcb")
    text = fasm.disassemble(program)
    (root / "prog.s").write_text(text)
    lines = text.splitlines()
    first_instr = next(i for i, line in enumerate(lines) if line.strip().startswith("c0 "))
    (root / "badlayer.s").write_text("\n".join(lines[:first_instr] + [lines[first_instr] + " layer=40000"]
                                               + lines[first_instr + 1:]) + "\n")
    meta = json.loads(lines[1][len(".meta "):])
    (root / "empty.s").write_text(lines[0] + "\n" + lines[1] + "\n")
    meta0 = dict(meta, batch=0)
    (root / "batch0.s").write_text("\n".join([lines[0], ".meta " + json.dumps(meta0)] + lines[2:]) + "\n")
    data = (root / "prog.fcb").read_bytes()
    (root / "trunc.fcb").write_bytes(data[: len(data) // 2])
    (root / "random.bin").write_bytes(np.random.default_rng(0).bytes(4096))
    (root / "empty.txt").write_bytes(b"")
    (root / "notjson.json").write_text("{not json")
    (root / "list.json").write_text("[1, 2, 3]")
    (root / "adir").mkdir()
    (root / "afile").write_text("a file, not a folder\n")
    (root / "partial_board.json").write_text(json.dumps({"clock_mhz": 200.0}))
    run = {"model": "fast.onnx", "fastcar": True, "frame_tokens": 4, "layers": [0, 1], "batch": 1,
           "video_start": 0, "num_frames": 2, "frames_done": 2, "step_ms": [1.0] * 7, "frame_ms": [4.0, 4.0],
           "steps": [{"pos": 4 + i, "replay": [[i % 2], [0]]} for i in range(7)], "threshold": 0.0}
    (root / "run.json").write_text(json.dumps(run))
    (root / "run_badlayers.json").write_text(json.dumps(dict(run, layers=[0, 7])))
    (root / "run_badshape.json").write_text(json.dumps(dict(run, steps=[{"pos": 4, "replay": [[1, 1, 1]]}])))
    (root / "run_hugeframes.json").write_text(json.dumps(dict(run, frames_done=10**12)))
    (root / "run_types.json").write_text(json.dumps(dict(run, layers="abc", batch="x")))
    (root / "run_steps_str.json").write_text(json.dumps(dict(run, steps="none")))
    np.save(root / "floats.npy", np.zeros((2, 3), np.float32))
    os.symlink("model.onnx", root / "link.onnx")
    os.link(root / "model.onnx", root / "hard.onnx")
    _files_that_are_inputs(root, run)
    _genai_folders(root)
    _checkpoints(root)
    _special_files(root)
    _dit_folders(root)
    return root


def _dit_folders(root: Path) -> None:
    """DiT configs and folders: weights that are a dangling link, a folder or a FIFO, none at all, of other shapes
    than the config; configs whose sizes are absurd or need more memory than any machine has."""
    import dataclasses

    from fastcar_compile.demo.dit_train import DIT_PIXEL_CONFIG, save_weights
    from fastcar_compile.dit.config import PRESETS
    from fastcar_compile.dit.model import build

    cfg = dataclasses.asdict(PRESETS["tiny"])
    for name in ("dangling", "wdir", "wfifo", "noweights"):
        (root / f"dit_{name}").mkdir()
        (root / f"dit_{name}" / "config.json").write_text(json.dumps(cfg))
    os.symlink("nowhere.safetensors", root / "dit_dangling" / "model.safetensors")
    (root / "dit_wdir" / "model.safetensors").mkdir()
    (root / "dit_wdir" / "model.safetensors" / "part").write_text("a folder, not the weights")  # not empty
    os.mkfifo(root / "dit_wfifo" / "model.safetensors")
    (root / "dit_hidden.json").write_text(json.dumps(dict(cfg, hidden=10**9)))
    (root / "dit_big.json").write_text(json.dumps(dict(cfg, latent_h=4096, latent_w=4096, patch=[1, 1, 1])))
    small = dataclasses.replace(DIT_PIXEL_CONFIG, layers=1, hidden=24, heads=2, ffn=32, patch=(1, 8, 8), freq_dim=16)
    save_weights(build(dataclasses.replace(small, hidden=32), seed=2), root / "dit_shapes")
    (root / "dit_shapes" / "config.json").write_text(json.dumps(dataclasses.asdict(small)))


def _files_that_are_inputs(root: Path, run: dict) -> None:
    """Inputs named like an output of the same command and eval/report inputs."""
    rng = np.random.default_rng(1)
    np.save(root / "calib.npy", rng.integers(0, 64, (2, 6)).astype(np.int64))
    np.save(root / "prompts.npy", rng.integers(0, 64, (1, 6)).astype(np.int64))
    np.savez(root / "prompts.npz", ids=np.zeros((1, 6), np.int64))
    (root / "board.json").write_text(json.dumps({"base": "kv260"}))
    (root / "evalout").mkdir()
    shutil.copyfile(root / "fast.onnx", root / "evalout" / "fast.json")  # the model where eval writes fast.json
    dense = dict(run, fastcar=False, layers=[], steps=[{"pos": st["pos"], "replay": []} for st in run["steps"]])
    (root / "r.json").write_text(json.dumps(run))
    (root / "r.latency.png").write_text(json.dumps(dense))  # a dense run named like the FastCar run's picture
    (root / "run_deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (root / "run_tau_str.json").write_text(json.dumps(dict(run, threshold="abc")))
    (root / "run_ft31.json").write_text(json.dumps(dict(run, frame_tokens=2**31)))
    with open(root / "run_bigstring.json", "w") as f:  # a 100 MB JSON string
        f.write('"' + "a" * (100 << 20) + '"')
    (root / "run_batch8.json").write_text(json.dumps(dict(run, batch=8, steps=[
        {"pos": st["pos"], "replay": [[0] * 8, [1] * 8]} for st in run["steps"]])))
    (root / "cfg.onnx").write_text(json.dumps(_tiny_llama().to_dict()))  # a config.json by another name


def _special_files(root: Path) -> None:
    """A FIFO, a character device (root only: mknod) and links to them: outputs must never replace them."""
    import stat

    (root / "special").mkdir()
    os.mkfifo(root / "special" / "fifo")
    os.symlink("fifo", root / "special" / "to-fifo")
    os.mkfifo(root / "special" / "run.latency.png")  # where `report run.json -o special` would write
    os.mkfifo(root / "special" / "fast.json")  # where `eval --out special` would write
    os.mkfifo(root / "special" / "fifo.onnx")
    # inputs that are FIFOs: reading one waits forever for a writer
    (root / "fifo_ext").mkdir()
    shutil.copyfile(root / "ext" / "model.onnx", root / "fifo_ext" / "model.onnx")
    os.mkfifo(root / "fifo_ext" / "model.onnx.data")
    (root / "fifo_ckpt").mkdir()
    shutil.copyfile(root / "ckpt_ok" / "config.json", root / "fifo_ckpt" / "config.json")
    os.mkfifo(root / "fifo_ckpt" / "model.safetensors")
    if os.geteuid() == 0:
        os.mknod(root / "special" / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        os.symlink("null", root / "special" / "to-null")


GENAI_CONFIG = {"model": {"type": "llama", "decoder": {"filename": "model.onnx", "head_size": 16,
                                                          "hidden_size": 64, "num_attention_heads": 4,
                                                          "num_hidden_layers": 2, "num_key_value_heads": 4},
                          "vocab_size": 512, "context_length": 2048}}


def _genai_folders(root: Path) -> None:
    """An input model beside a broken genai_config.json, one folder per way of being broken."""
    cfg = json.dumps(GENAI_CONFIG).encode()
    broken = {"ok": cfg, "trunc": cfg[: len(cfg) // 2], "list": b"[1, 2]", "null": b"null",
              "bin": np.random.default_rng(2).bytes(300), "bom": b"\xef\xbb\xbf" + cfg,
              "deep": b"[" * 100_000 + b"]" * 100_000, "nodecoder": b'{"model": {"type": "llama"}}',
              "hugetok": cfg}
    for name, data in broken.items():
        d = root / f"genai_{name}"
        d.mkdir()
        os.symlink("../model.onnx", d / "model.onnx")
        (d / "genai_config.json").write_bytes(data)
        (d / "tokenizer.json").write_text('{"version": "1.0"}')
    with open(root / "genai_hugetok" / "tokenizer.model", "wb") as f:  # sparse: costs no disk
        f.truncate((1 << 30) + 1)
    for name, decoder in (("absfile", {"filename": str(root / "model.onnx")}), ("upfile", {"filename": "../model.onnx"}),
                          ("numfile", {"filename": 7}), ("nan", {}), ("badmodel", {})):
        d = root / f"genai_{name}"
        d.mkdir()
        config = json.loads(json.dumps(GENAI_CONFIG))
        config["model"]["decoder"].update(decoder)
        text = json.dumps(config)
        if name == "nan":
            text = text.replace('"context_length": 2048', '"context_length": NaN')
        (d / "genai_config.json").write_text(text)
        if name == "badmodel":
            (d / "model.onnx").write_bytes(np.random.default_rng(4).bytes(512))
        else:
            os.symlink("../model.onnx", d / "model.onnx")


def _tiny_llama():
    import transformers as tf

    return tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


def _checkpoints(root: Path) -> None:
    """Broken transformers checkpoints for `export`."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(_tiny_llama())
    model.save_pretrained(root / "ckpt_ok")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    model.save_pretrained(root / "ckpt_nan")
    half = tf.LlamaForCausalLM(tf.LlamaConfig(**dict(_tiny_llama().to_dict(), num_hidden_layers=1)))
    half.save_pretrained(root / "ckpt_half")
    shutil.copyfile(root / "ckpt_ok" / "config.json", root / "ckpt_half" / "config.json")  # says 2 layers
    (root / "ckpt_shape").mkdir()
    shutil.copyfile(root / "ckpt_ok" / "model.safetensors", root / "ckpt_shape" / "model.safetensors")
    (root / "ckpt_shape" / "config.json").write_text(json.dumps(dict(_tiny_llama().to_dict(), intermediate_size=48)))
    for name, weights, data in (("ckpt_random", "model.safetensors", np.random.default_rng(3).bytes(4096)),
                                ("ckpt_bin", "pytorch_model.bin", b"not a pickle" * 100)):
        (root / name).mkdir()
        shutil.copyfile(root / "ckpt_ok" / "config.json", root / name / "config.json")
        (root / name / weights).write_bytes(data)
    (root / "ckpt_vocab").mkdir()
    (root / "ckpt_vocab" / "config.json").write_text(json.dumps(dict(_tiny_llama().to_dict(), vocab_size=10**12)))


_HASHES: dict[tuple, str] = {}


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under root: (sha256, inode). A file is re-hashed whenever its size, mtime or ctime moved
    (any write changes ctime), so unchanged 12 MB inputs are not hashed again for every case."""
    import stat

    from fastcar_compile.core.fileio import fingerprint

    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):  # a link stays the same link
            out[str(p.relative_to(root))] = (f"link -> {os.readlink(p)}", st.st_ino)
        elif stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode):  # a special file stays itself
            out[str(p.relative_to(root))] = (f"special {st.st_mode:o} {st.st_rdev}", st.st_ino)
        elif stat.S_ISREG(st.st_mode):
            key = (str(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
            if key not in _HASHES:
                _HASHES[key] = (fingerprint(p).hex() if st.st_size > 64 << 20 else
                                hashlib.sha256(p.read_bytes()).hexdigest())
            out[str(p.relative_to(root))] = (_HASHES[key], st.st_ino)
    return out


# --------------------------------------------------------------------------------------------- faults
@contextlib.contextmanager
def _fault(target: str, err: int, nth: int = 1):
    """Make the `nth` and later calls of `target` (module.attr) raise OSError(err), as a disk that fills up
    or a read-only folder would; earlier calls go through."""
    import importlib
    from unittest import mock

    mod, attr = target.rsplit(".", 1)
    real = getattr(importlib.import_module(mod), attr)
    calls = [0]

    def boom(*a, **k):
        calls[0] += 1
        if calls[0] < nth:
            return real(*a, **k)
        raise OSError(err, os.strerror(err), str(a[0]) if a else None)

    with mock.patch.object(importlib.import_module(mod), attr, boom):
        yield


def disk_full():
    return _fault("fastcar_compile.core.fileio._copy_range", errno.ENOSPC)


def disk_full_save():
    return _fault("onnx_ir.save", errno.ENOSPC)


@contextlib.contextmanager
def _fault_unnamed(target: str, err: int):
    """Like `_fault`, but the OSError names no file, as a real full disk fails `write` (not `open`)."""
    import importlib
    from unittest import mock

    mod, attr = target.rsplit(".", 1)
    try:
        owner = importlib.import_module(mod)
    except ModuleNotFoundError:  # a class attribute: module.Class.attr
        mod, cls = mod.rsplit(".", 1)
        owner = getattr(importlib.import_module(mod), cls)

    def boom(*a, **k):
        raise OSError(err, os.strerror(err))

    with mock.patch.object(owner, attr, boom):
        yield


def disk_full_genai_files():
    """The disk fills while the tokenizer files are copied beside the output (whichever writer copies them)."""
    import importlib

    mod = importlib.import_module("fastcar_compile.passes.genai_state")
    name = "copy_file" if hasattr(mod, "copy_file") else "write_bytes"
    return _fault(f"fastcar_compile.passes.genai_state.{name}", errno.ENOSPC)


def read_only():
    return _fault("os.replace", errno.EROFS)


def no_permission():
    return _fault("tempfile.mkdtemp", errno.EACCES)


# --------------------------------------------------------------------------------------------- cases
def _c(name, argv, exit=2, message="", outputs=(), patch=None, subprocess=False,  # noqa: A002
       timeout=None) -> Case:
    return Case(name, argv, exit, message, outputs, patch, subprocess, timeout)


def cases() -> list[Case]:
    m, ft = "model.onnx", ["--frame-tokens", str(L)]

    def comp(*extra, model=m, out="out/fast.onnx"):
        return lambda d: [str(d / model), "-o", str(d / out), *ft, *extra]

    fpga = lambda *extra, out="out/p.fcb": lambda d: [str(d / "fast.onnx"), "--target", "fpga", "-o",  # noqa: E731
                                                      str(d / out), *extra]
    sim = lambda *extra, fcb="prog.fcb": lambda d: ["sim", str(d / fcb), *extra]  # noqa: E731
    rep = lambda name, *extra: lambda d: ["report", str(d / name), *extra]  # noqa: E731
    return [
        # 1. inputs are sacred
        _c("compile -o the input model", comp(out=m), message="input"),
        _c("compile -o a symlink to the input", comp(out="link.onnx"), message="input"),
        _c("compile -o a hard link of the input", comp(out="hard.onnx"), message="input"),
        _c("compile -o the input's external-data file", comp(model="ext/model.onnx", out="ext/model.onnx.data"),
           message="overwrite", subprocess=True),
        _c("compile -o x.onnx whose data file is one of the input's", comp(model="multi/y.onnx", out="multi/x.onnx"),
           message="overwrite"),
        _c("compile -o the input's second data file", comp(model="multi/y.onnx", out="multi/w2.bin"),
           message="overwrite"),
        _c("compile -o through .. to the input", comp(out="adir/../model.onnx"), message="input"),
        _c("compile --target fpga -o the input", fpga(out="fast.onnx"), message="input"),
        _c("disasm -o the bundle file it reads", lambda d: ["disasm", str(d / "prog.fcb"), "-o", str(d / "prog.fcb")],
           message="read"),
        _c("asm -o the source it reads", lambda d: ["asm", str(d / "prog.s"), "-o", str(d / "prog.s")],
           message="source"),
        # 2/3. all-or-nothing writes; file-system errors are user errors
        _c("compile -o an existing directory", comp(out="adir"), message="directory", subprocess=True),
        _c("compile -o below a file", comp(out="afile/fast.onnx"), message="not a folder"),
        _c("compile, external data, -o an existing directory", comp(model="ext/model.onnx", out="adir"),
           message="directory"),
        _c("compile, disk full while copying external data", comp(model="ext/model.onnx"), patch=disk_full,
           message="space"),
        _c("compile, disk full while saving", comp(), patch=disk_full_save, message="space"),
        _c("compile, read-only file system at rename", comp(model="ext/model.onnx"), patch=read_only,
           message="read-only"),
        _c("compile, external data into an existing folder, the model's rename fails after the data's",
           comp(model="ext/model.onnx", out="adir/fast.onnx"), patch=lambda: _fault("os.replace", errno.ENOSPC, nth=2),
           message="space"),
        _c("compile, no permission for the temp folder", comp(), patch=no_permission, message="permission"),
        _c("compile a directory", comp(model="adir"), message="directory", subprocess=True),
        _c("compile a missing file", comp(model="nosuch.onnx"), message="no such file"),
        _c("compile random bytes", comp(model="random.bin"), message="not a readable ONNX"),
        _c("compile an empty file", comp(model="empty.txt")),
        _c("compile with its external data missing", comp(model="noext/model.onnx"), message="missing"),
        _c("compile an already compiled model", comp(model="fast.onnx"), message="already compiled",
           subprocess=True),
        _c("inspect a directory", lambda d: [str(d / "adir"), "--inspect"], message="directory"),
        # 4. bounded, validated numbers
        _c("--layers 0-1000000000", comp("--layers", "0-1000000000"), message="--layers", subprocess=True),
        _c("--layers 7", comp("--layers", "7"), message="--layers"),
        _c("--layers -1", comp("--layers", "-1"), message="--layers"),
        _c("--layers 3-1", comp("--layers", "3-1"), message="--layers"),
        _c("--layers a-b", comp("--layers", "a-b"), message="--layers"),
        _c("--frame-tokens 0", lambda d: [str(d / m), "-o", str(d / "out/f.onnx"), "--frame-tokens", "0"],
           message="--frame-tokens"),
        _c("--frame-tokens -5", lambda d: [str(d / m), "-o", str(d / "out/f.onnx"), "--frame-tokens", "-5"],
           message="--frame-tokens"),
        _c("--frame-tokens 2**63", lambda d: [str(d / m), "-o", str(d / "out/f.onnx"), "--frame-tokens",
                                              str(2**63)], message="--frame-tokens"),
        _c("--frame-tokens 10**12", lambda d: [str(d / m), "-o", str(d / "out/f.onnx"), "--frame-tokens",
                                               str(10**12)], message="--frame-tokens"),
        _c("--frame-tokens 10**12 --no-validate", lambda d: [str(d / m), "-o", str(d / "out/f.onnx"),
                                                             "--frame-tokens", str(10**12), "--no-validate"],
           message="--frame-tokens"),
        _c("--frame-tokens 10**9 (state beyond memory)", lambda d: [str(d / m), "-o", str(d / "out/f.onnx"),
                                                                    "--frame-tokens", str(10**9)],
           message="GiB"),
        _c("--frame-tokens 1.5", lambda d: [str(d / m), "-o", str(d / "out/f.onnx"), "--frame-tokens", "1.5"],
           message="--frame-tokens"),
        _c("--max-replay -1", comp("--max-replay", "-1"), message="--max-replay"),
        _c("--max-replay 2**63", comp("--max-replay", str(2**63)), message="--max-replay"),
        _c("--threshold nan", comp("--threshold", "nan"), message="threshold"),
        _c("--threshold 1e39", comp("--threshold", "1e39"), message="float32"),
        _c("--threshold -1e39", comp("--threshold=-1e39"), message="float32"),
        _c("--threshold abc", comp("--threshold", "abc"), message="threshold"),
        _c("--threshold 1,2 without --per-layer-threshold", comp("--threshold", "1,2"), message="per-layer"),
        _c("--per-layer-threshold with 5 values", comp("--per-layer-threshold", "--threshold", "1,2,3,4,5"),
           message="threshold"),
        _c("--tas-query nope", comp("--tas-query", "nope"), message="tas-query"),
        # ASCII digits only (str.isdigit() and int() also take '²' and '٢'), sizes bounded before anything runs
        _c("--kv-layer with a superscript layer", comp("--kv-layer", "²:budget=16"), message="--kv-layer",
           subprocess=True),
        _c("--kv-layer with Arabic-Indic digits", comp("--kv-layer", "0:budget=٩٦,window=64"), message="--kv-layer"),
        _c("--kv-layer with an Arabic-Indic cosine", comp("--kv-layer", "0:budget=96,window=64,tempcache=٠.٥"),
           message="--kv-layer"),
        _c("--sparse-attention lsh:²x4", comp("--kv-budget", "96", "--kv-window", "64", "--sparse-attention",
                                              "lsh:²x4"), message="--sparse-attention"),
        _c("--sparse-attention int8:٢x٤", comp("--kv-budget", "96", "--kv-window", "64", "--sparse-attention",
                                               "int8:٢x٤"), message="--sparse-attention"),
        _c("--kv-budget in Arabic-Indic digits", comp("--kv-budget", "٩٦", "--kv-window", "64"), message="--kv-budget",
           subprocess=True),
        _c("--frame-tokens in Arabic-Indic digits", lambda d: [str(d / m), "-o", str(d / "out/f.onnx"),
                                                              "--frame-tokens", "٦٤"], message="--frame-tokens"),
        _c("--layers ٠ (Arabic-Indic zero)", comp("--layers", "٠"), message="--layers"),
        _c("--threshold in Arabic-Indic digits", comp("--threshold", "٠.٥"), message="--threshold"),
        _c("--calib-frames in Arabic-Indic digits", comp("--calibrate-replay", "0.5", "--calib-frames", "٣"),
           message="--calib-frames"),
        _c("--kv-budget 16777216 (2 GiB of state per video)", comp("--kv-budget", "16777216", "--kv-window", "64"),
           message="--kv-budget must be in 1..1048576", subprocess=True),
        _c("--kv-layer budget=16777216", comp("--kv-layer", "0:budget=16777216,window=64"), message="budget must be in"),
        _c("--kv-window 10**12", comp("--kv-budget", "96", "--kv-window", str(10**12)), message="--kv-window"),
        _c("--kv-diagnostics 10**9", comp("--kv-budget", "96", "--kv-window", "64", "--kv-diagnostics", str(10**9)),
           message="--kv-diagnostics"),
        _c("--rotary-positions 10**9", comp("--rotary-positions", str(10**9)), message="--rotary-positions"),
        _c("--calibrate-replay without --calib-data", comp("--calibrate-replay", "0.5"), message="calib-data"),
        _c("--calib-data a directory", comp("--calibrate-replay", "0.5", "--calib-data", "adir"),
           message="calib-data"),
        _c("--calib-data random bytes", lambda d: comp("--calibrate-replay", "0.5", "--calib-data",
                                                       str(d / "random.bin"))(d), message="calib-data"),
        _c("--calib-data float prompts", lambda d: comp("--calibrate-replay", "0.5", "--calib-data",
                                                        str(d / "floats.npy"))(d), message="integer"),
        _c("--target fpga --context 4294967301", fpga("--context", "4294967301"), message="--context",
           subprocess=True),
        _c("--target fpga --context 0", fpga("--context", "0"), message="--context"),
        _c("--target fpga --batch 0", fpga("--batch", "0"), message="--batch"),
        _c("--target fpga --batch 33", fpga("--batch", "33"), message="--batch"),
        _c("--target fpga --board nosuch", fpga("--board", "nosuch"), message="board"),
        _c("--board custom with missing fields", lambda d: fpga("--board", "custom", "--board-file",
                                                                str(d / "partial_board.json"))(d), message="lacks"),
        _c("--board-file a directory", lambda d: fpga("--board-file", str(d / "adir"))(d), message="directory"),
        _c("--board-file binary", lambda d: fpga("--board-file", str(d / "random.bin"))(d), message="board file"),
        _c("--board-file not JSON", lambda d: fpga("--board-file", str(d / "notjson.json"))(d), message="JSON"),
        _c("--board-file a JSON list", lambda d: fpga("--board-file", str(d / "list.json"))(d), message="object"),
        _c("--target fpga -o an existing directory", fpga(out="adir"), message="directory"),
        # 5. sim / asm / disasm
        _c("sim a missing file", sim(fcb="nosuch.fcb"), message="does not exist"),
        _c("sim a directory", sim(fcb="adir"), message="directory"),
        _c("sim random bytes", sim(fcb="random.bin"), message="bundle"),
        _c("sim a truncated bundle", sim(fcb="trunc.fcb"), message="bundle"),
        _c("sim --batch 0", sim("--batch", "0"), message="--batch", subprocess=True),
        _c("sim --batch 33", sim("--batch", "33"), message="--batch"),
        _c("sim --batch 5 (compiled for 4)", sim("--batch", "5"), message="batch"),
        _c("sim --context 0", sim("--context", "0"), message="--context"),
        _c("sim --context 2**32", sim("--context", str(2**32)), message="--context"),
        _c("sim --steps 0", sim("--steps", "0"), message="--steps"),
        _c("sim --steps 10**12", sim("--steps", str(10**12)), message="--steps"),
        _c("sim --replay-ratio 2", sim("--replay-ratio", "2"), message="ratio"),
        _c("sim --replay-ratio nan", sim("--replay-ratio", "nan"), message="ratio"),
        _c("sim --replay-trace a directory", lambda d: sim("--replay-trace", str(d / "adir"))(d),
           message="directory"),
        _c("sim --replay-trace binary", lambda d: sim("--replay-trace", str(d / "random.bin"))(d), message="trace"),
        _c("sim --replay-trace not JSON", lambda d: sim("--replay-trace", str(d / "notjson.json"))(d),
           message="JSON"),
        _c("sim --replay-trace a JSON list", lambda d: sim("--replay-trace", str(d / "list.json"))(d),
           message="trace"),
        _c("sim --replay-trace with layers beyond the program", lambda d: sim("--replay-trace",
                                                                              str(d / "run_badlayers.json"))(d),
           message="layers"),
        _c("sim --board-file a directory", lambda d: sim("--board-file", str(d / "adir"))(d), message="directory"),
        _c("sim --board u280 (other structure)", sim("--board", "u280"), message="board"),
        _c("sim --timeline a directory", lambda d: sim("--timeline", str(d / "adir"))(d), message="directory"),
        _c("disasm a directory", lambda d: ["disasm", str(d / "adir")], message="directory"),
        _c("disasm random bytes", lambda d: ["disasm", str(d / "random.bin")], message="bundle"),
        _c("asm a missing file", lambda d: ["asm", str(d / "nosuch.s"), "-o", str(d / "out/p.fcb")],
           message="does not exist"),
        _c("asm a directory", lambda d: ["asm", str(d / "adir"), "-o", str(d / "out/p.fcb")], message="directory"),
        _c("asm binary", lambda d: ["asm", str(d / "random.bin"), "-o", str(d / "out/p.fcb")], message="text"),
        _c("asm a layer index beyond the model", lambda d: ["asm", str(d / "badlayer.s"), "-o",
                                                            str(d / "out/p.fcb")], message="layer",
           subprocess=True),
        _c("asm an empty program", lambda d: ["asm", str(d / "empty.s"), "-o", str(d / "out/p.fcb")],
           message="empty"),
        _c("asm batch 0", lambda d: ["asm", str(d / "batch0.s"), "-o", str(d / "out/p.fcb")], message="batch"),
        _c("asm -o a directory", lambda d: ["asm", str(d / "prog.s"), "-o", str(d / "adir")], message="directory"),
        # report
        _c("report a missing run.json", rep("nosuch.json"), message="does not exist"),
        _c("report a directory", rep("adir"), message="directory"),
        _c("report binary", rep("random.bin"), message="run.json"),
        _c("report not JSON", rep("notjson.json"), message="run.json"),
        _c("report a JSON list", rep("list.json"), message="run.json"),
        _c("report replay of the wrong shape", rep("run_badshape.json"), message="replay"),
        _c("report frames_done 10**12", rep("run_hugeframes.json"), message="frames_done", subprocess=True),
        _c("report layers/batch of the wrong type", rep("run_types.json"), message="run.json"),
        _c("report steps not a list", rep("run_steps_str.json"), message="steps"),
        _c("report -o a file", lambda d: ["report", str(d / "run.json"), "-o", str(d / "afile")],
           message="not a folder"),
        _c("report -o below a file", lambda d: ["report", str(d / "run.json"), "-o", str(d / "afile/pics")],
           message="not a folder"),
        _c("report, second picture fails", lambda d: ["report", str(d / "run.json"), "-o", str(d / "out/pics")],
           patch=lambda: _fault("os.replace", errno.ENOSPC, nth=2), message="space"),
        # demo / eval (rejected before any work)
        _c("demo --threshold nan", lambda d: ["demo", "--threshold", "nan", "--out", str(d / "out/demo")],
           message="--threshold"),
        _c("demo --threshold 1e39", lambda d: ["demo", "--threshold", "1e39", "--out", str(d / "out/demo")],
           message="--threshold"),
        _c("demo --tau (renamed)", lambda d: ["demo", "--tau", "1", "--out", str(d / "out/demo")],
           message="renamed: use --threshold"),
        _c("demo --clips 0", lambda d: ["demo", "--clips", "0", "--out", str(d / "out/demo")], message="--clips"),
        _c("demo --max-replay -1", lambda d: ["demo", "--max-replay", "-1", "--out", str(d / "out/demo")],
           message="--max-replay"),
        _c("demo --out a file", lambda d: ["demo", "--out", str(d / "afile")], message="not a folder"),
        _c("demo --out below a file", lambda d: ["demo", "--out", str(d / "afile/demo")], message="not a folder"),
        _c("eval --targets 2", lambda d: ["eval", "--targets", "2", "--out", str(d / "out/eval")],
           message="--targets"),
        _c("eval --out a file", lambda d: ["eval", "--out", str(d / "afile")], message="not a folder"),
        # ASCII digits only in every command's numbers (int()/float() read '٢' as 2)
        _c("demo --clips in Arabic-Indic digits", lambda d: ["demo", "--clips", "٢", "--out", str(d / "out/demo")],
           message="--clips"),
        _c("sim --steps in Arabic-Indic digits", sim("--steps", "٨"), message="--steps"),
        _c("sim --replay-ratio in Arabic-Indic digits", sim("--replay-ratio", "٠.٥"), message="--replay-ratio"),
        _c("eval --frames in Arabic-Indic digits", lambda d: ["eval", "--frames", "٤", "--out", str(d / "out/eval")],
           message="--frames"),
        _c("eval --targets in Arabic-Indic digits", lambda d: ["eval", "--targets", "٠.٥", "--out",
                                                               str(d / "out/eval")], message="--targets"),
        _c("eval --kv-modes window:٤+١٢٤", lambda d: ["eval", "--kv-modes", "window:٤+١٢٤", "--out",
                                                      str(d / "out/eval")], message="window"),
        _c("report --frame-shape in Arabic-Indic digits", rep("run.json", "--frame-shape", "٢x٢"),
           message="--frame-shape"),
        *files_cases(comp, fpga, sim, rep),
        *runtime_cases(),
        *new_surface_cases(comp, fpga, sim, rep),
        # accepted: what must work, and leaves the inputs as they were
        _c("compile external data (accepted)", comp(model="ext/model.onnx"), exit=0,
           outputs=("out/fast.onnx", "out/fast.onnx.data"), subprocess=True),
        _c("compile weights in two files (accepted)", comp(model="multi/y.onnx", out="out/m.onnx"), exit=0,
           outputs=("out/m.onnx", "out/m.onnx.data")),
        _c("report (accepted)", lambda d: ["report", str(d / "run.json"), "-o", str(d / "out/pics")], exit=0,
           outputs=("out/pics/run.replay.png", "out/pics/run.latency.png")),
        _c("asm round trip (accepted)", lambda d: ["asm", str(d / "prog.s"), "-o", str(d / "out/p.fcb")], exit=0,
           outputs=("out/p.fcb",)),
    ]


def files_cases(comp, fpga, sim, rep) -> list[Case]:
    """Outputs that are inputs of the same command, special files as outputs,
    broken genai folders, broken checkpoints for export, eval/report files."""
    ev = lambda *extra, model="fast.onnx", prompts="prompts.npy", out="out/e": lambda d: [  # noqa: E731
        "eval", "--model", str(d / model), "--prompts", str(d / prompts), "--frames", "2", "--out", str(d / out),
        *extra]
    exp = lambda src, out="out/m.onnx", *extra: lambda d: ["export", str(d / src), "-o", str(d / out),  # noqa: E731
                                                           *extra]
    gen = lambda name: comp(model=f"genai_{name}/model.onnx", out="out/g/fast.onnx")  # noqa: E731
    special = [("fifo", "FIFO"), ("to-fifo", "FIFO")] + ([("null", "character device"), ("to-null",
                                                                                           "character device")]
                                                         if os.geteuid() == 0 else [])
    out: list[Case] = [
        # 2. an output that is another input of the same command
        _c("sim --timeline the bundle it simulates", lambda d: sim("--timeline", str(d / "prog.fcb"))(d),
           message="overwrite"),
        _c("sim --timeline the replay trace", lambda d: sim("--replay-trace", str(d / "run.json"), "--timeline",
                                                            str(d / "run.json"))(d), message="--replay-trace"),
        _c("compile -o the calibration data", lambda d: comp("--calibrate-replay", "0.3", "--calib-data",
                                                             str(d / "calib.npy"), out="calib.npy")(d),
           message="--calib-data", subprocess=True),
        _c("compile --target fpga -o the board file", lambda d: fpga("--board-file", str(d / "board.json"),
                                                                     out="board.json")(d), message="--board-file"),
        _c("eval --model OUT/fast.json (eval writes fast.json there)", ev(model="evalout/fast.json", out="evalout"),
           message="--model"),
        _c("eval --prompts OUT/fast.json", lambda d: ev(out="evalout")(d)[:4] + [
            str(d / "evalout" / "fast.json"), "--frames", "2", "--out", str(d / "evalout")], message="overwrite"),
        _c("report r.json r.latency.png (the picture is the dense run)", lambda d: [
            "report", str(d / "r.json"), str(d / "r.latency.png")], message="overwrite"),
        _c("export cfg.onnx -o cfg.onnx", exp("cfg.onnx", "cfg.onnx"), message="config"),
        # 3. special files as outputs (a rename would replace the device node or FIFO)
        *[_c(f"compile -o {name}", comp(out=f"special/{name}"), message=kind) for name, kind in special],
        *[_c(f"asm -o {name}", lambda d, n=name: ["asm", str(d / "prog.s"), "-o", str(d / "special" / n)],
             message=kind) for name, kind in special],
        *[_c(f"disasm -o {name}", lambda d, n=name: ["disasm", str(d / "prog.fcb"), "-o", str(d / "special" / n)],
             message=kind) for name, kind in special],
        *[_c(f"sim --timeline {name}", lambda d, n=name: sim("--timeline", str(d / "special" / n))(d),
             message=kind) for name, kind in special],
        *[_c(f"--target fpga -o {name}", fpga(out=f"special/{name}"), message=kind) for name, kind in special],
        _c("export -o a FIFO", exp("ckpt_ok", "special/fifo.onnx"), message="FIFO"),
        _c("report -o a folder whose picture name is a FIFO", lambda d: ["report", str(d / "run.json"), "-o",
                                                                         str(d / "special")], message="FIFO"),
        _c("eval --out a folder whose fast.json is a FIFO", ev(out="special"), message="FIFO"),
        # ... and as inputs: refused in one line instead of waiting forever for a writer
        *[_c(f"{name} a FIFO", argv, message="named pipe", timeout=30, subprocess=name == "report")
          for name, argv in (
            ("compile", comp(model="special/fifo")),
            ("compile --inspect", lambda d: [str(d / "special" / "to-fifo"), "--inspect"]),
            ("compile a model whose external data is", comp(model="fifo_ext/model.onnx")),
            ("compile --calib-data", lambda d: comp("--calibrate-replay", "0.3", "--calib-data",
                                                    str(d / "special" / "fifo"))(d)),
            ("compile --target fpga --board-file", lambda d: fpga("--board-file", str(d / "special" / "fifo"))(d)),
            ("eval --model", ev(model="special/fifo")),
            ("eval --model whose external data is", ev(model="fifo_ext/model.onnx")),
            ("eval --dense", lambda d: ev("--dense", str(d / "special" / "fifo"))(d)),
            ("eval --prompts", ev(prompts="special/fifo")),
            ("report", rep("special/fifo")),
            ("sim", sim(fcb="special/fifo")),
            ("sim --replay-trace", lambda d: sim("--replay-trace", str(d / "special" / "fifo"))(d)),
            ("disasm", lambda d: ["disasm", str(d / "special" / "fifo")]),
            ("asm", lambda d: ["asm", str(d / "special" / "fifo"), "-o", str(d / "out/p.fcb")]),
            ("export", exp("special/fifo")),
            ("export a checkpoint whose weight file is", exp("fifo_ckpt")))],
        # 4. a broken genai_config.json beside the input: refused before compiling, nothing written
        *[_c(f"compile beside a {what} genai_config.json", gen(name), message=word,
             subprocess=name == "deep") for name, what, word in (
            ("trunc", "truncated", "genai_config.json"), ("list", "JSON list", "object"),
            ("null", "null", "object"), ("bin", "binary", "UTF-8"), ("deep", "100,000-deep", "nests"),
            ("nodecoder", "decoder-less", "decoder"))],
        _c("compile beside a 1 GiB tokenizer file", gen("hugetok"), message="tokenizer.model"),
        _c("compile beside genai_config.json, disk full while copying the tokenizer", gen("ok"),
           patch=disk_full_genai_files, message="space"),
        # 5. export: broken checkpoints
        _c("export NaN weights", exp("ckpt_nan"), message="NaN", subprocess=True),
        _c("export random bytes as model.safetensors", exp("ckpt_random"), message="weights"),
        _c("export a garbage pytorch_model.bin", exp("ckpt_bin"), message="weights"),
        _c("export weights whose shapes contradict config.json", exp("ckpt_shape"), message="shape"),
        _c("export vocab_size 10**12", exp("ckpt_vocab"), message="GiB"),
        _c("export a checkpoint missing half its layers", exp("ckpt_half"), message="layers.1"),
        # 9. eval / report files
        _c("report a run.json nested 100,000 deep", rep("run_deep.json"), message="nests", subprocess=True),
        _c("report threshold 'abc'", rep("run_tau_str.json"), message="threshold"),
        _c("report frame_tokens 2**31", rep("run_ft31.json", "--frame-shape", f"{2**16}x{2**15}"),
           message="frame"),
        _c("report --frame-shape=-1x-4", rep("run.json", "--frame-shape=-1x-4"), message="--frame-shape"),
        _c("eval --frame-shape=-8x-8", ev("--frame-shape=-8x-8"), message="--frame-shape"),
        _c("eval --prompts an .npz", ev(prompts="prompts.npz"), message="npz"),
        _c("compile --calib-data an .npz", lambda d: comp("--calibrate-replay", "0.3", "--calib-data",
                                                          str(d / "prompts.npz"))(d), message="npz"),
        _c("report, disk full (the error names the folder)", lambda d: ["report", str(d / "run.json"), "-o",
                                                                         str(d / "out/pics")],
           patch=lambda: _fault_unnamed("pathlib.Path.write_bytes", errno.ENOSPC), message="out/pics"),
        _c("eval, disk full while writing its files (the error names the file)", ev(),
           patch=lambda: _fault_unnamed("os.replace", errno.ENOSPC), message="out/e"),
        # accepted
        _c("compile beside a genai_config.json with a byte-order mark (accepted)", gen("bom"), exit=0,
           outputs=genai_outputs()),
    ]
    return out


def new_surface_cases(comp, fpga, sim, rep) -> list[Case]:
    """The newer surfaces: video_start, the calibration's own flags, the output's name, genai-speculate's folder
    and output, sim's batch against a trace, report on a huge JSON string."""
    spec = lambda name, *extra, out="out/g": lambda d: ["genai-speculate", str(d / name), "-o",  # noqa: E731
                                                        str(d / out), "--draft", "ngram", *extra]
    cal = ("--calibrate-replay", "0.3", "--calib-data")
    return [
        _c("--video-start -1", comp("--video-start=-1"), message="--video-start"),
        _c("--video-start 2**32", comp("--video-start", str(2**32)), message="--video-start"),
        _c("--video-start with --required-video-inputs", comp("--video-start", "3", "--required-video-inputs"),
           message="--required-video-inputs"),
        _c("--video-start in Arabic-Indic digits", comp("--video-start", "٣"), message="--video-start"),
        _c("compile -o x.npy (a graph named as an array)", comp(out="out/x.npy"), message=".npy", subprocess=True),
        _c("compile -o x.json", comp(out="out/x.json"), message=".json"),
        _c("--target fpga -o x.onnx (a bundle named as a model)", fpga(out="out/p.onnx"), message=".fcb"),
        _c("--calibrate-replay with an explicit --threshold", lambda d: comp(*cal, str(d / "calib.npy"),
                                                                             "--threshold", "0.5")(d),
           message="--threshold"),
        _c("--calib-frames 0", lambda d: comp(*cal, str(d / "calib.npy"), "--calib-frames", "0")(d),
           message="--calib-frames"),
        _c("--calib-frames -1", lambda d: comp(*cal, str(d / "calib.npy"), "--calib-frames=-1")(d),
           message="--calib-frames"),
        _c("--calib-frames 10**9", lambda d: comp(*cal, str(d / "calib.npy"), "--calib-frames", str(10**9))(d),
           message="--calib-frames"),
        _c("--given-video-tokens -1", lambda d: comp(*cal, str(d / "calib.npy"), "--given-video-tokens=-1")(d),
           message="--given-video-tokens"),
        _c("report a 100 MB JSON string", rep("run_bigstring.json"), message="object", subprocess=True,
           timeout=300),
        _c("sim a trace of more rows than the bundle", lambda d: sim("--replay-trace",
                                                                     str(d / "run_batch8.json"))(d),
           message="--batch 8"),
        # genai-speculate: the folder and its genai_config.json, the output
        *[_c(f"genai-speculate a {what} genai_config.json", spec(f"genai_{name}"), message=word)
          for name, what, word in (("trunc", "truncated", "JSON"), ("list", "JSON list", "object"),
                                   ("null", "null", "object"), ("bin", "binary", "UTF-8"),
                                   ("deep", "100,000-deep", "nests"), ("nodecoder", "decoder-less", "decoder"),
                                   ("absfile", "absolute decoder filename", "outside"),
                                   ("upfile", "../ decoder filename", "outside"),
                                   ("nan", "NaN-holding", "finite"), ("numfile", "numeric decoder filename",
                                                                      "filename"),
                                   ("badmodel", "unloadable model's", "ONNX"))],
        _c("genai-speculate -o inside its input folder", spec("genai_ok", out="genai_ok/spec"), message="outside"),
        _c("genai-speculate -o its input folder", spec("genai_ok", out="genai_ok"), message="outside"),
        _c("genai-speculate -o a file", spec("genai_ok", out="afile"), message="not a folder"),
        _c("genai-speculate a missing folder", spec("nosuch"), message="genai_config.json"),
        _c("genai-speculate, disk full while copying the model", spec("genai_ok"),
           patch=lambda: _fault("fastcar_compile.core.fileio._copy_range", errno.ENOSPC), message="space"),
        _c("genai-speculate (accepted)", spec("genai_ok"), exit=0,
           outputs=("out/g/genai_config.json", "out/g/model.onnx", "out/g/tokenizer.json")),
        # the DiT path: its files, sizes and numbers
        *[_c(f"export --dit, {what}", lambda d, n=name: ["export", "--dit", str(d / n), "-o", str(d / "out/d.onnx")],
             message=word) for name, what, word in (
            ("dit_dangling", "model.safetensors a dangling link", "dangling"),
            ("dit_wdir", "model.safetensors a folder", "folder"),
            ("dit_wfifo", "model.safetensors a FIFO", "named pipe"),
            ("dit_noweights", "no weights and no --random-weights", "--random-weights"),
            ("dit_hidden.json", "hidden 10**9", "beyond"))],
        _c("stream, model.safetensors a dangling link", lambda d: ["stream", str(d / "dit_dangling"), "--frames", "2",
                                                                   "-o", str(d / "out/s")], message="dangling"),
        _c("stream, CFG 1e308 (NaN frames)", lambda d: ["stream", "tiny", "--frames", "4", "--cfg", "1e308", "-o",
                                                        str(d / "out/s"), "--threads", "1"], message="NaN",
           subprocess=True),
        _c("stream, a 4096x4096-token frame with a 100,000-frame window", lambda d: [
            "stream", str(d / "dit_big.json"), "--frames", "8", "--window", "100000", "--sink", "100000", "-o",
            str(d / "out/s"), "--random-weights"], message="GiB"),
        _c("demo --dit --weights of other shapes", lambda d: ["demo", "--dit", "--weights", str(d / "dit_shapes"),
                                                              "--frames", "2", "--out", str(d / "out/dd")],
           message="shapes"),
    ]


def runtime_cases() -> list[Case]:
    """Runtime values through the CLI: the session's own refusals reach the user as one
    line, exit 2 (the API's cases: tests/test_runtime_hostile.py)."""
    ev = lambda *extra: lambda d: ["eval", "--model", str(d / "fast.onnx"), "--prompts",  # noqa: E731
                                   str(d / "prompts.npy"), "--frames", "2", "--out", str(d / "out/e"), *extra]
    return [
        _c("eval --threads 1000000 (ORT started them all: a hang)", ev("--threads", "1000000"), message="threads",
           subprocess=True),
        _c("eval --threads 2000 (beyond the session's bound)", ev("--threads", "2000"), message="threads"),
    ]


def genai_outputs() -> tuple[str, ...]:
    """What a compile beside a genai folder writes into out/g (the native library when it is built)."""
    from fastcar_compile.passes import genai_state

    lib = getattr(genai_state, "_library_name", lambda: None)()
    return tuple(f"out/g/{n}" for n in ("fast.onnx", "genai_config.json", "tokenizer.json", *([lib] if lib else [])))


# --------------------------------------------------------------------------------------------- running
class _Hung(BaseException):
    """Raised by the in-process watchdog: the case ran past its time limit."""


def _in_process(argv: list[str], patch, timeout: float = 120) -> tuple[int | None, str]:
    import signal

    from fastcar_compile.cli import main

    def hung(signum, frame):
        raise _Hung

    old = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), (patch() if patch else
                                                                                contextlib.nullcontext()):
            try:
                rc = main(argv)
            except SystemExit as exc:  # argparse
                rc = exc.code if isinstance(exc.code, int) else 2
            except _Hung:
                rc = None
            except BaseException:  # noqa: BLE001 - a traceback the real CLI would print
                import traceback

                err.write(traceback.format_exc())
                rc = 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return rc, err.getvalue()


def _subprocess(argv: list[str], timeout: float) -> tuple[int | None, str]:
    exe = Path(sys.executable).with_name("fastcar-compile")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "fastcar_compile"]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    try:
        proc = subprocess.run(cmd + argv, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        return None, (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
    return (proc.returncode if proc.returncode >= 0 else None), proc.stderr


def run_case(case: Case, sandbox: Path, *, in_subprocess: bool = False, timeout: float = 120) -> Outcome:
    """Run one case against the sandbox; outputs it was allowed to create are removed afterwards."""
    before = snapshot(sandbox)
    t0 = time.perf_counter()
    argv = case.argv(sandbox)
    timeout = case.timeout or timeout
    rc, stderr = _subprocess(argv, timeout) if in_subprocess else _in_process(argv, case.patch, timeout)
    seconds = time.perf_counter() - t0
    after = snapshot(sandbox)
    added = sorted(set(after) - set(before))
    dirs_added = sorted(str(p.relative_to(sandbox)) for p in sandbox.rglob("*") if p.is_dir() and
                        not any(p.iterdir()) and p.name != "adir")
    changed = sorted(k for k in before if after.get(k, (None,))[0] != before[k][0])
    inodes: dict[int, list[str]] = {}
    for k, (_, ino) in after.items():
        inodes.setdefault(ino, []).append(k)
    shared = sorted(", ".join(v) for v in inodes.values() if len(v) > 1 and v != ["hard.onnx", "model.onnx"])
    out = Outcome(rc, stderr, "Traceback" in stderr, added + [d + "/" for d in dirs_added], changed, shared, seconds)
    shutil.rmtree(sandbox / "out", ignore_errors=True)
    return out


def problems(case: Case, o: Outcome) -> list[str]:
    """What is wrong with an outcome (empty: the case passed)."""
    bad = []
    if o.rc is None:
        bad.append("killed or hung")
    elif o.rc != case.exit:
        bad.append(f"exit {o.rc}, expected {case.exit}")
    if o.traceback:
        bad.append("traceback")
    if case.exit != 0 and case.message and case.message.lower() not in o.stderr.lower():
        bad.append(f"message lacks {case.message!r}")
    extra = [a for a in o.added if a not in case.outputs]
    if extra:
        bad.append(f"left files {extra}")
    if o.changed:
        bad.append(f"modified inputs {o.changed}")
    if o.shared_inodes:
        bad.append(f"files share an inode: {o.shared_inodes}")
    return bad


def main() -> int:
    """Totals for the closing note: every case in process, the `subprocess=True` ones also via the script.

    A case that modified the sandbox gets a fresh sandbox afterwards, so every case meets intact inputs.
    Problem counts overlap (one run can leave files and print a traceback); "clean" runs have none.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        sandbox = build_sandbox(Path(tmp) / "sandbox")
        keys = ("tried", "clean: rejected as expected", "clean: accepted as expected", "with a traceback",
                "accepted silently (exit 0 on bad input)", "killed or hung", "modified an input",
                "left files behind", "refused but the message does not name the problem",
                "wrong exit code otherwise")
        totals = dict.fromkeys(keys, 0)
        for case in cases():
            for sub in ([False, True] if case.subprocess else [False]):
                try:
                    o = run_case(case, sandbox, in_subprocess=sub, timeout=float(os.environ.get("CASE_TIMEOUT", 120)))
                except (ImportError, AttributeError) as exc:  # a fault-injection target this code lacks
                    o = Outcome(1, f"Traceback (harness): {exc}", True)
                bad = problems(case, o)
                totals["tried"] += 1
                if not bad:
                    totals["clean: rejected as expected" if case.exit else "clean: accepted as expected"] += 1
                if o.rc is None:
                    totals["killed or hung"] += 1
                elif o.rc == 0 and case.exit:
                    totals["accepted silently (exit 0 on bad input)"] += 1
                elif o.rc != case.exit and not o.traceback:
                    totals["wrong exit code otherwise"] += 1
                if o.traceback:
                    totals["with a traceback"] += 1
                if o.changed or o.shared_inodes:
                    totals["modified an input"] += 1
                if [a for a in o.added if a not in case.outputs]:
                    totals["left files behind"] += 1
                if any(b.startswith("message lacks") for b in bad) and o.rc == case.exit and not o.traceback:
                    totals["refused but the message does not name the problem"] += 1
                tag = "subprocess" if sub else "in-process"
                print(f"{'ok ' if not bad else 'BAD'} [{tag}] {case.name}: exit {o.rc}"
                      + (f" -- {'; '.join(bad)}" if bad else "") + f" | {o.stderr.strip().splitlines()[-1:]}",
                      flush=True)
                if o.changed or o.shared_inodes:
                    shutil.rmtree(sandbox)
                    build_sandbox(sandbox)
        print(json.dumps(totals, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
