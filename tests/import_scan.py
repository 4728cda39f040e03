"""The project's first-party imports, read with ast (module level and inside functions alike).

Shared by the module-cycle check (test_import_cycles.py) and the folder-layer check (test_layers.py), so both
see the same edges: pyproject's package-dir maps the installed names (fastcar_compile.passes ...) back to the
repository folders (passes/ ...).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).parent.parent


def modules() -> dict[str, Path]:
    """Module name -> file, with passes/, runtime/, fpga_backend/ under fastcar_compile.* (pyproject's package-dir)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    mods: dict[str, Path] = {}
    for pkg, folder in sorted(package_dir.items(), key=lambda kv: -len(kv[0])):
        for f in (ROOT / folder).rglob("*.py"):
            parts = [p for p in f.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            mods.setdefault(".".join([pkg, *parts]), f)
    return mods


def _import_module_name(node: ast.AST) -> str | None:
    """The module a call `importlib.import_module("x.y")` / `import_module("x.y")` / `__import__("x.y")` names with
    a string literal (a string built at run time is invisible to any scan: the product has none)."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant) \
            or not isinstance(node.args[0].value, str):
        return None
    f = node.func
    called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    return node.args[0].value if called in ("import_module", "__import__") else None


def imported(name: str, f: Path, mods: dict[str, Path]) -> Iterator[tuple[str, ast.AST]]:
    """(first-party module, import statement or call) for each module that `name` (file `f`) names in an import:
    every `import` / `from ... import` anywhere in the file (functions included), relative ones resolved, `from pkg
    import sub` counted as importing both the package and the submodule, and `importlib.import_module("...")`
    with a literal name (a lazy import is still an edge)."""
    for node in ast.walk(ast.parse(f.read_text())):
        if (dynamic := _import_module_name(node)) is not None:
            targets = [dynamic]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name:
                yield t, node
