"""The architecture's counts on a source tree: executable copies of the rules that should have one
owner (the divisor, the quotient-rule backward, the causal alignment, the normaliser's integer
coding), imports of one engine's modules from the layers above the engines, the functions over
8 parameters (the sweep's numba kernels aside) and the backward's overridable hooks.
tests/test_architecture.py asserts the rules; this prints the counts, for a before / after of a
redesign.

Usage: ``python scripts/architecture_counts.py [PACKAGE_DIR] [--list]`` (default: ``slicedkern``
here; ``--list`` names the internal host functions over 8 parameters).
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import sys
import tokenize

#: every spelling of a profile normaliser's clamp at eps (array API, numba, Triton)
DIVISOR = re.compile(r"clamp_min\s*\([^()]*eps\s*\)|maximum\s*\([^()]*eps\b|\bif +\w+ *> *eps +else +eps\b"
                     r"|\bden *= *eps\b")
#: the quotient rule's test that the normaliser is not clamped
QUOTIENT = re.compile(r">= *(normalizer\.|spec\.)?eps")
#: the causal alignment's offset, Lk - Lq, in any of its names
ALIGNMENT = re.compile(r"\b(lk|k_len|n_keys)\s*-\s*(lq|q_len|n_queries)\b"
                       r"|\b(lq|q_len|n_queries)\s*-\s*(lk|k_len|n_keys)\b", re.IGNORECASE)
#: a table or function that maps the normalisers to integers, or a literal code (executable code)
CODING = re.compile(r"def norm_code\b|\bNORMALIZER_CODES *=|\bnorm *= *[0-9]\b|\bNORM *= *[0-9]\b")
ENGINE_MODULE = re.compile(r"from \.\.engines\.[a-z_]+|from \.\.engines import (?:scan|sweep|triton)\b")
ABOVE_ENGINES = ("adapters", "ops", "sliced", "nn", "distributed", "bench")


def code_of(path: pathlib.Path) -> str:
    """The source without comments and strings (docstrings state the rules they follow)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return tokenize.untokenize((t.type, t.string) for t in tokens if t.type not in (tokenize.COMMENT, tokenize.STRING))


def _parameters(node) -> int:
    a = node.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    return n - (1 if a.args and a.args[0].arg in ("self", "cls") else 0)


def _compiled(node) -> bool:
    """Whether a function is a kernel: jitted by Triton or numba."""
    return any(re.search(r"\b(jit|njit)\b", ast.unparse(d)) for d in node.decorator_list)


def _private(path: pathlib.Path, root: pathlib.Path) -> bool:
    """Whether a module is internal: a private part of its path, or the engines (which only compute,
    under the public functions that dispatch to them)."""
    parts = path.relative_to(root).with_suffix("").parts
    return parts[0] == "engines" or any(part.startswith("_") and part != "__init__" for part in parts)


def _exported(root: pathlib.Path, every) -> set[str]:
    """The names in the ``__all__`` of the public modules (a public class may live in a private one)."""
    names = set()
    for path in every:
        if _private(path, root):
            continue
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
                    and isinstance(node.value, (ast.List, ast.Tuple))):
                names |= {elt.value for elt in node.value.elts if isinstance(elt, ast.Constant)}
    return names


def _planners(tree) -> set[str]:
    """The functions a module passes to ``@composite(...)``: a public op's planner, which takes the
    op's own parameters (:func:`slicedkern.adapters.vjp.composite`; tests/test_architecture.py,
    ``test_planners_take_their_ops_parameters``)."""
    return {d.args[0].id for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
            for d in node.decorator_list if isinstance(d, ast.Call) and getattr(d.func, "id", None) == "composite"
            and d.args and isinstance(d.args[0], ast.Name)}


def internal_wide(root: pathlib.Path, every) -> list[str]:
    """The internal host functions over 8 parameters: neither a kernel (Triton, numba) nor a public
    signature (a public function, a public op's planner, or a method of a public class: of a public
    module, or exported by one), whose keyword options follow torch's SDPA and
    ``nn.MultiheadAttention``."""
    found, exported = [], _exported(root, every)
    for path in every:
        tree = ast.parse(path.read_text())
        private = _private(path, root)
        planners = _planners(tree)
        scopes = [(node, private and getattr(node, "name", None) not in exported) for node in tree.body]
        while scopes:
            node, inner = scopes.pop()
            if isinstance(node, ast.ClassDef):
                scopes += [(child, inner or node.name.startswith("_")) for child in node.body]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                named_private = node.name.startswith("_") and not (node.name.startswith("__")
                                                                    and node.name.endswith("__"))
                if (_parameters(node) > 8 and not _compiled(node) and (inner or named_private)
                        and node.name not in planners):
                    found.append(f"{path.relative_to(root.parent)}:{node.name}")
                scopes += [(child, True) for child in ast.walk(node) if child is not node
                           and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return found


def backward_hooks(root: pathlib.Path) -> list[str]:
    """The methods of the generic backward's classes (``engines/_vjp.py``, NamedTuple records aside)
    and of the engines' subclasses of them: the hooks an engine's backward overrides."""
    def classes(path):
        return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]

    def methods(node):
        return [m.name for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]

    generic = {c.name for c in classes(root / "engines" / "_vjp.py")
               if not any(getattr(b, "id", None) == "NamedTuple" for b in c.bases)}
    found = []
    for path in sorted((root / "engines").rglob("*.py")):
        for c in classes(path):
            bases = {getattr(b, "id", None) or getattr(b, "attr", None) for b in c.bases}
            if c.name in generic or bases & generic:
                found += [f"{c.name}.{m}" for m in methods(c)]
    return found


def main(root: pathlib.Path) -> None:
    every = sorted(root.rglob("*.py"))

    def copies(pattern, files=every, text=code_of):
        found = [(str(p.relative_to(root.parent)), len(pattern.findall(text(p)))) for p in files]
        return [f"{name} ({n})" for name, n in found if n]

    print("divisor rule:", copies(DIVISOR))
    print("quotient rule (numba kernels aside):", copies(QUOTIENT, [p for p in every if "_kernels_" not in p.name],
                                                             pathlib.Path.read_text))
    print("causal alignment:", copies(ALIGNMENT))
    print("normaliser codings:", copies(CODING))
    print("engine modules imported above the engines:",
          [f"{p.relative_to(root)}: {m}" for p in every if p.relative_to(root).parts[0] in ABOVE_ENGINES
           for m in ENGINE_MODULE.findall(p.read_text())])
    wide = [f"{p.relative_to(root.parent)}:{node.name}" for p in every if "_kernels_" not in p.name
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _parameters(node) > 8]
    print("functions over 8 parameters (numba kernels aside):", len(wide))
    internal = internal_wide(root, every)
    print("internal host functions over 8 parameters (kernels and public signatures aside):", len(internal))
    if "--list" in sys.argv:
        print("\n".join("  " + name for name in sorted(internal)))
    print("backward hooks (methods of the generic backward's classes and their subclasses):",
          len(backward_hooks(root)))


if __name__ == "__main__":
    paths = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    main(pathlib.Path(paths[0] if paths else "slicedkern").resolve())
