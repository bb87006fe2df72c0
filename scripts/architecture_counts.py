"""Counts of issue 24's closing note, on a source tree: the copies of the divisor rule and of the
quotient-rule backward, the engine internals ``distributed/`` imports, and the functions over 8
parameters (the sweep's numba kernels aside).

Usage: ``python scripts/architecture_counts.py [PACKAGE_DIR]`` (default: ``slicedkern`` here).
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

#: a profile normaliser's clamp at eps; the quotient rule's test that the normaliser is not clamped
DIVISOR = re.compile(r"clamp_min\([^()]*eps\)")
QUOTIENT = re.compile(r">= *(normalizer\.|spec\.)?eps")
ENGINE_IMPORT = re.compile(r"from \.\.engines\.[a-z_]+")


def _parameters(node) -> int:
    a = node.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    return n - (1 if a.args and a.args[0].arg in ("self", "cls") else 0)


def main(root: pathlib.Path) -> None:
    files = sorted(p for p in root.rglob("*.py") if "_kernels_" not in p.name)
    def where(pattern):
        return [str(p.relative_to(root.parent)) for p in files if pattern.search(p.read_text())]
    print("divisor rule:", where(DIVISOR))
    print("quotient rule:", where(QUOTIENT))
    print("distributed/ imports of engine submodules:",
          [f"{p.name}: {m}" for p in files if p.parent.name == "distributed"
           for m in ENGINE_IMPORT.findall(p.read_text())])
    wide = [f"{p.relative_to(root.parent)}:{node.name}" for p in files
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _parameters(node) > 8]
    print("functions over 8 parameters (numba kernels aside):", len(wide))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "slicedkern").resolve())
