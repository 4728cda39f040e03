"""One-call FPGA compile: model -> partition -> schedule -> encode -> .fcb file, with a report."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import onnx

from fastcar_compile.core.errors import FastCarError

from . import isa
from .drs import fill_thresholds
from .encode import Program, save
from .hwspec import BoardConfig, load_board
from .modelspec import ModelSpec
from .partition import partition
from .schedule import emit_program


@dataclasses.dataclass
class FpgaCompileReport:
    output: str | None
    board: str
    hw_hash: str
    batch: int
    context: int
    model: dict[str, Any]
    bundles: int
    instructions: dict[str, int]
    file_bytes: int
    unsupported: list[str]
    notes: list[str]
    bundles_per_layer: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        return str(self)

    def __str__(self) -> str:
        m = self.model
        lines = [
            f"FPGA bundles for board {self.board} (hw hash {self.hw_hash}), batch {self.batch}, context {self.context}",
            f"  model: {m['layers']} layers, hidden {m['hidden']}, intermediate {m['intermediate']}, heads "
            f"{m['heads']}/{m['kv_heads']} x {m['head_dim']}, vocab {m['vocab']}",
            f"  {self.bundles} bundles, {sum(self.instructions.values())} instructions "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.instructions.items())),
            f"  {self.bundles_per_layer} bundles per decoder layer; "
            + ("dense baseline (no FastCar instructions)" if m.get("replay_layers") == [] else
               f"FastCar replay in layers {m['replay_layers'] if m.get('replay_layers') is not None else 'all'}")
            + f", video_start {m.get('video_start', 0)}",
        ]
        if self.output:
            lines.append(f"  wrote {self.output} ({self.file_bytes} bytes)")
        lines += [f"  note: {n}" for n in self.notes]
        if self.unsupported:
            lines.append(f"  UNSUPPORTED ops ({len(self.unsupported)}): " + "; ".join(self.unsupported))
        return "\n".join(lines)


def build_program(model: ModelSpec | str | Path | onnx.ModelProto, board: BoardConfig, batch: int = 1,
                  context: int | None = None, *, num_heads: int | None = None, strict: bool = True,
                  weights: str = "broadcast", dense: bool = False, video_start: int | None = None,
                  frame_tokens: int | None = None) -> Program:
    """partition -> schedule -> DRS thresholds (for the ``weights`` stream mode).

    dense: no FastCar instructions at all (no TAS, no replay exchange, nothing skippable): the baseline
    that "x dense" figures divide by (a plain export, without fastcar.* metadata, always compiles dense).
    video_start: KV index of the first video token the runtime used (run.json's video_start), encoded in the
    TAS/exchange instructions and recorded in the metadata. frame_tokens: tokens per frame of a plain export
    (a compiled model records its own; a different value is refused), used for the default context."""
    if weights not in isa.WEIGHT_STREAMS:
        raise FastCarError(f"weights {weights!r} must be one of {isa.WEIGHT_STREAMS}")
    from fastcar_compile.core.limits import UINT32_MAX, check_int

    check_int("--batch", batch, 1, isa.MAX_ROWS, "rows of the Index Register")
    if context is not None:
        check_int("--context", context, 1, UINT32_MAX, "KV length; the ISA's m field is 32-bit")
    overrides: dict[str, Any] = {}
    if dense:
        overrides["replay_layers"] = ()
    if video_start is not None:
        check_int("--video-start", video_start, 0, UINT32_MAX, "KV index; the TAS instruction's off_k is 32-bit")
        overrides["video_start"] = int(video_start)
    if frame_tokens is not None:
        check_int("--frame-tokens", frame_tokens, 1, UINT32_MAX, "tokens per video frame")
    part = partition(model, board, num_heads=num_heads, strict=strict, overrides=overrides,
                     frame_tokens=frame_tokens)
    if dense and part.spec.frame_tokens is not None:
        part.notes.append("dense baseline: no TAS, no replay exchange, every MLP computed")
    if part.kv:
        from .kvbound import describe

        part.notes.append(f"compressed KV cache of the model: {describe(part.kv)}; `sim` reads it (--kv-* override)")
    if context is None and part.spec.frame_tokens is None:
        raise FastCarError("the model records no tokens per frame (a plain export): pass --context N (the KV "
                           "length the attention tiles are sized for) or --frame-tokens L (context 2 x L)")
    ctx = context if context is not None else 2 * part.spec.frame_tokens
    check_int("--context", ctx, 1, UINT32_MAX, "KV length; the ISA's m field is 32-bit")
    program = fill_thresholds(emit_program(part, batch, ctx), weights)
    program.meta["video_start_known"] = bool(part.video_start_known)  # else `sim` takes a trace's without a note
    return program


def report_for(program: Program, output: str | Path | None, file_bytes: int) -> FpgaCompileReport:
    ops = program.bundles["opcode"]
    counts = Counter(isa.Op(int(o)).name for o in ops.ravel() if o != isa.Op.NOP)
    return FpgaCompileReport(
        output=str(output) if output else None, board=program.board.name,
        hw_hash=f"{program.board.structural_hash():016x}", batch=program.meta["batch"],
        context=program.meta["context"], model=program.meta["model"], bundles=len(program),
        instructions=dict(counts), file_bytes=file_bytes, unsupported=program.meta["unsupported"],
        notes=program.meta["notes"], bundles_per_layer=_bundles_per_layer(program),
    )


def _bundles_per_layer(program: Program) -> int:
    core = program.bundles[:, :-1]
    return int(((core["layer"] == 0) & (core["opcode"] != isa.Op.NOP)).any(axis=1).sum())


def compile_to_bundles(onnx_path: str | Path | ModelSpec, output_path: str | Path | None, board: str = "kv260",
                       board_file: str | Path | None = None, batch: int = 1, context: int | None = None, *,
                       num_heads: int | None = None, strict: bool = True,
                       weights: str = "broadcast", dense: bool = False,
                       video_start: int | None = None, frame_tokens: int | None = None) -> FpgaCompileReport:
    """Compile a fast.onnx (or plain decoder, or ModelSpec) to a `.fcb` bundle file for ``board``.

    ``context`` is the KV length the attention instructions are encoded with (the simulator substitutes the
    run-time length per step); default 2 x frame_tokens. ``weights`` is the weight-stream mode the DRS remap
    thresholds are computed for. Raises FastCarError on bad input.
    """
    if output_path is not None:
        from fastcar_compile.core.fileio import check_output_path, check_outputs, model_reads

        check_output_path(output_path, "-o")
        reads = dict(model_reads(onnx_path)) if isinstance(onnx_path, str | Path) else {}
        check_outputs({output_path: "-o"}, {**reads, board_file: "--board-file"})
    cfg = load_board(board, board_file)
    program = build_program(onnx_path, cfg, batch, context, num_heads=num_heads, strict=strict, weights=weights,
                            dense=dense, video_start=video_start, frame_tokens=frame_tokens)
    from .verify import check_program

    check_program(program)
    size = save(program, output_path) if output_path is not None else 0
    return report_for(program, output_path, size)
