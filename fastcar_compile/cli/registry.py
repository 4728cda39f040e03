"""Where every `fastcar-compile` subcommand is registered (the one place to add one).

name -> (module, function, one-line help); each command is one module of this folder, its function takes argv
(list[str]) and returns an exit code. Modules are imported only when their command runs, so `--help` stays fast
and a missing optional dependency of one subcommand never breaks the others. `cli.main` dispatches; the
compiler's own help (cli/compile.py) lists them.
"""

from __future__ import annotations

SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "export": ("fastcar_compile.cli.export", "main", "transformers model folder (or --dit) -> ONNX with KV cache"),
    "stream": ("fastcar_compile.cli.stream", "main", "stream a video chunk by chunk with an exported DiT (export --dit)"),
    "generate": ("fastcar_compile.cli.generate", "main", "render one video per prompt row, in this process or on Ray "
                 "Data actors (--ray)"),
    "demo": ("fastcar_compile.cli.demo", "main", "compile the bundled video model and compare dense vs FastCar"),
    "eval": ("fastcar_compile.cli.eval", "main", "dense vs FastCar on your model (--model fast.onnx --prompts p.npy), "
             "or a tau sweep on the bundled one"),
    "genai-speculate": ("fastcar_compile.cli.genai_speculate", "main", "onnxruntime-genai folder verifying "
                        "previous-frame drafts (a draft ONNX model) or genai's n-gram lookup"),
    "report": ("fastcar_compile.cli.report", "main", "PNG pictures of run.json (replay, latency beside a dense run, "
               "per-token replay)"),
    "sim": ("fastcar_compile.cli.sim", "main", "simulate FPGA bundles (.fcb) on a replay trace or mask"),
    "disasm": ("fastcar_compile.cli.asm", "disasm_main", "print a .fcb bundle file as readable assembly"),
    "asm": ("fastcar_compile.cli.asm", "main", "assemble readable assembly back into a .fcb file"),
}
# Without a subcommand name the arguments are the compiler's own (`fastcar-compile model.onnx -o fast.onnx`).
DEFAULT = ("fastcar_compile.cli.compile", "main")


def lookup(argv: list[str]) -> tuple[str, str, list[str]]:
    """(module, function, remaining argv) for a command line."""
    if argv and argv[0] in SUBCOMMANDS:
        module, func, _ = SUBCOMMANDS[argv[0]]
        return module, func, argv[1:]
    return (*DEFAULT, argv)


def help_lines() -> str:
    return "\n".join(f"  fastcar-compile {name:<7} {text}" for name, (_, _, text) in SUBCOMMANDS.items())
