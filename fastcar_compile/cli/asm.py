"""`fastcar-compile asm SOURCE -o model.fcb` and `fastcar-compile disasm model.fcb`: the FPGA bundle format as
readable assembly and back (fpga_backend/asm.py)."""

from __future__ import annotations

import argparse
import sys


def disasm_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fastcar-compile disasm", description="Print a .fcb file as assembly.")
    p.add_argument("fcb")
    p.add_argument("-o", "--output", help="write to this file (atomically) instead of stdout")
    args = p.parse_args(argv)
    from fastcar_compile.core.atomic import write_text
    from fastcar_compile.fpga_backend import asm, encode

    program = encode.load(args.fcb)
    if args.output:
        from fastcar_compile.core.fileio import check_output_path, check_outputs

        check_output_path(args.output, "-o")
        check_outputs({args.output: "-o"}, {args.fcb: "the bundle"})
        write_text(args.output, asm.disassemble(program))
        return 0
    try:
        for line in asm.disassemble_lines(program):
            sys.stdout.write(line + "\n")
    except BrokenPipeError:  # `| head`
        sys.stderr.close()
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fastcar-compile asm", description="Assemble text into a .fcb file.")
    p.add_argument("source", help="assembly text (as printed by disasm)")
    p.add_argument("-o", "--output", required=True, help="bundle file to write")
    args = p.parse_args(argv)
    from fastcar_compile.core.fileio import check_output_path, check_outputs, read_text
    from fastcar_compile.fpga_backend import asm, encode
    from fastcar_compile.fpga_backend.verify import check_program

    check_output_path(args.output, "-o")
    check_outputs({args.output: "-o"}, {args.source: "the assembly source"})
    program = asm.assemble(read_text(args.source, "assembly file"))
    check_program(program)  # what sim would refuse is never written
    size = encode.save(program, args.output)
    print(f"wrote {args.output} ({len(program)} bundles, {size} bytes)")
    return 0
