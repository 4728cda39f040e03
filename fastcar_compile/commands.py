"""Where every `fastcar-compile` subcommand is registered (the one place to add one).

name -> (module, function, one-line help). Each function takes argv (list[str]) and returns an exit code.
Modules are imported only when their command runs, so `--help` stays fast and a missing optional
dependency of one subcommand never breaks the others. `cli.main` dispatches; `cmd_compile` lists them
in its help.
"""

from __future__ import annotations

SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "export": ("fastcar_compile.cmd_export", "main", "transformers model folder -> ONNX decoder with KV cache"),
    "stream": ("fastcar_compile.dit.cli", "stream_main", "stream a video chunk by chunk with an exported DiT (export --dit)"),
    "generate": ("fastcar_compile.cmd_generate", "main", "render one video per prompt row, in this process or on Ray "
                 "Data actors (--ray)"),
    "demo": ("fastcar_compile.demo.cmd_demo", "main", "compile the bundled video model and compare dense vs FastCar"),
    "eval": ("fastcar_compile.demo.cmd_eval", "main", "dense vs FastCar on your model (--model fast.onnx --prompts p.npy), or a tau sweep "
             "on the bundled one"),
    "genai-speculate": ("fastcar_compile.genai_speculate", "main", "onnxruntime-genai folder verifying previous-frame "
                        "drafts (a draft ONNX model) or genai's n-gram lookup"),
    "report": ("fastcar_compile.cmd_report", "main", "PNG pictures of run.json (replay, latency beside a dense run, per-token replay)"),
    "sim": ("fastcar_compile.fpga_cmds", "sim_main", "simulate FPGA bundles (.fcb) on a replay trace or mask"),
    "disasm": ("fastcar_compile.fpga_cmds", "disasm_main", "print a .fcb bundle file as readable assembly"),
    "asm": ("fastcar_compile.fpga_cmds", "asm_main", "assemble readable assembly back into a .fcb file"),
}
# `export --dit`: the video DiT's export, in the layer above (fastcar_compile/dit), imported only when used.
DIT_EXPORT = ("fastcar_compile.dit.cli", "export_main")
# `demo --dit`: the trained causal video DiT's stream demo, in the layer above (fastcar_compile/dit).
DIT_DEMO = ("fastcar_compile.demo.dit_demo", "main")
# A DiT step graph given to the compiler (`fastcar-compile dit.onnx -o out.onnx`, `--inspect`): compiled there too.
DIT_COMPILE = ("fastcar_compile.dit.cli", "compile_main")
DIT_API = "fastcar_compile.dit.compile"  # compile_dit, inspect_dit, is_dit_step (fastcar_compile.api routes to it)
# Without a subcommand name the arguments are the compiler's own (`fastcar-compile model.onnx -o fast.onnx`).
DEFAULT = ("fastcar_compile.cmd_compile", "main")


def lookup(argv: list[str]) -> tuple[str, str, list[str]]:
    """(module, function, remaining argv) for a command line."""
    if argv and argv[0] in SUBCOMMANDS:
        module, func, _ = SUBCOMMANDS[argv[0]]
        return module, func, argv[1:]
    return (*DEFAULT, argv)


def help_lines() -> str:
    return "\n".join(f"  fastcar-compile {name:<7} {text}" for name, (_, _, text) in SUBCOMMANDS.items())
