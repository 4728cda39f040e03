"""Command line: `fastcar-compile model.onnx -o fast.onnx ...` and subcommands.

Subcommands live in their own modules and are imported lazily so `--help` stays fast and a
missing optional dependency of one subcommand never breaks the others.
"""

from __future__ import annotations

import importlib
import sys

from fastcar_compile.errors import FastCarError

# name -> (module, function, one-line help). Each function takes argv (list[str]) and returns an exit code.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "export": ("fastcar_compile.cmd_export", "main", "transformers model folder -> ONNX decoder with KV cache"),
    "demo": ("fastcar_compile.cmd_demo", "main", "compile the bundled video model and compare dense vs FastCar"),
    "eval": ("fastcar_compile.cmd_eval", "main", "sweep tau on the bundled model: replay, PSNR/SSIM, speedup"),
    "report": ("fastcar_compile.cmd_report", "main", "turn a run.json from the runtime into PNG pictures"),
    "sim": ("fastcar_compile.fpga_cmds", "sim_main", "simulate FPGA bundles (.fcb) on a replay trace or mask"),
    "disasm": ("fastcar_compile.fpga_cmds", "disasm_main", "print a .fcb bundle file as readable assembly"),
    "asm": ("fastcar_compile.fpga_cmds", "asm_main", "assemble readable assembly back into a .fcb file"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in SUBCOMMANDS:
            module, func, _ = SUBCOMMANDS[argv[0]]
            return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)
        from fastcar_compile.cmd_compile import main as compile_main

        return int(compile_main(argv) or 0)
    except FastCarError as exc:
        print(f"fastcar-compile: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("fastcar-compile: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
