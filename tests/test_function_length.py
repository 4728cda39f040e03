"""No product function over 100 lines: a longer one is steps that want names (split it into the functions it calls).
Counted with the ast module over the installed package's folders (benchmarks, scripts and tests are outside)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("fastcar_compile", "passes", "runtime", "fpga_backend")
MAX_LINES = 100


def long_functions(root: Path = ROOT) -> list[str]:
    found = []
    for folder in PRODUCT:
        for f in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_LINES:
                        found.append(f"{f.relative_to(root)}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_product_function_over_100_lines():
    assert long_functions() == []


def test_the_count_sees_a_long_function(tmp_path):
    """The check can fail: a 101-line function in a product folder is reported with its place and length."""
    pkg = tmp_path / "passes"
    pkg.mkdir()
    (pkg / "long.py").write_text("def f():\n" + "    x = 1\n" * 99 + "    return x\n")
    for folder in PRODUCT[:1] + PRODUCT[2:]:
        (tmp_path / folder).mkdir()
    assert long_functions(tmp_path) == ["passes/long.py:1 f: 101 lines"]
