"""The package's layers, checked on its source: every import, those inside functions included.

The layers (docs/architecture.rst), bottom to top: ``_lib`` and ``kernels`` (import nothing of the
package) -> ``_spec`` and ``reference`` -> ``backends`` -> ``engines`` -> ``adapters`` -> ``ops`` ->
``sliced`` and the statistics -> ``nn`` / ``distributed`` -> ``bench``, ``__main__`` and ``__init__``.
A module imports only from lower layers or from its own group; nothing imports in a circle; imports
inside functions are only the lazy loaders of framework rows (a module that imports torch, JAX or
numba at its top);
framework checks (``array_api_compat.is_*``) live in ``backends/`` and ``adapters/`` only.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "slicedkern"

LAYERS = {"_lib": 0, "kernels": 0, "_spec": 1, "reference": 1, "backends": 2, "engines": 3, "_validate": 3,
          "adapters": 4, "ops": 5, "sliced": 6, "nn": 7, "distributed": 7,
          "bench": 8, "__main__": 9, "": 9}

#: Modules that import a framework at their top: the only package modules a function may import.
FRAMEWORK_ROWS = {"slicedkern.backends._numpy", "slicedkern.backends._torch", "slicedkern.backends._jax",
                  "slicedkern.backends._dask", "slicedkern.adapters._torch", "slicedkern.adapters._jax",
                  "slicedkern.engines.sweep._host", "slicedkern.engines.sweep._decode",
                  "slicedkern.engines.triton._kernels", "slicedkern.engines.triton._order",
                  "slicedkern.engines.triton._dense", "slicedkern.engines.triton._device",
                  "slicedkern.distributed._torch", "slicedkern.distributed._jax"}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: pathlib.Path):
    """``(target module, inside a function?, line)`` for every import of a package module."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    local = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            # ``from pkg import submodule`` depends on the submodule; on ``pkg`` only for other names
            candidates = submodules + ([target] if len(submodules) < len(node.names) else [])
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for cand in candidates:
            if cand in MODULES and cand != name:
                yield cand, id(node) in local, node.lineno


def _group(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


GRAPH = {name: {t for t, _, _ in _imports(name, path)} for name, path in MODULES.items()}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name):
    group = _group(name)
    bad = []
    for target, _, line in _imports(name, MODULES[name]):
        if name.startswith(target + "."):          # a package's own __init__ (implicit on import)
            continue
        other = _group(target)
        if other != group and LAYERS[other] >= LAYERS[group]:
            bad.append(f"line {line}: {target} (layer {LAYERS[other]}) from layer {LAYERS[group]}")
    assert not bad, f"{name} imports upward or sideways: {bad}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_package_import_inside_functions_but_framework_rows(name):
    bad = [f"line {line}: {t}" for t, inside, line in _imports(name, MODULES[name])
           if inside and t not in FRAMEWORK_ROWS]
    assert not bad, f"{name} imports package modules inside functions: {bad}"


def test_no_import_cycle():
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert cycles == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_framework_checks_only_in_backends_and_adapters(name):
    if _group(name) in ("backends", "adapters"):
        return
    source = MODULES[name].read_text()
    checks = re.findall(r"compat\.is_(?!array_api_obj)\w+", source)
    assert not checks, f"{name} tests frameworks itself ({checks}); ask the backend registry"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_small(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= 520, f"{name} has {lines} lines: split it by concern"


def test_layer_table_covers_every_group():
    assert {_group(name) for name in MODULES} <= set(LAYERS)


OPTIONAL_FRAMEWORKS = {"torch", "jax", "flax", "numba", "dask", "cupy", "triton", "distributed"}


def _top_level_framework_imports(path: pathlib.Path) -> set[str]:
    """Optional frameworks a file imports unconditionally at its top (not in a ``try`` or a function)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found & OPTIONAL_FRAMEWORKS


def test_modules_needing_a_framework_are_skipped_where_it_is_missing():
    """The README's test command collects on a venv with only ``[test]`` (issue 23, item 1): every
    package module and tests helper that imports a framework at its top is in the root conftest's
    table, so ``--doctest-modules`` leaves it out where that framework is missing."""
    import importlib.util

    repo = ROOT.parent
    spec = importlib.util.spec_from_file_location("_root_conftest", repo / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    table = conftest.OPTIONAL_MODULES
    files = list(ROOT.rglob("*.py")) + [p for p in (repo / "tests").rglob("_*.py") if p.name != "__init__.py"]
    missing = {}
    for path in files:
        needs = _top_level_framework_imports(path)
        rel = path.relative_to(repo).as_posix()
        if needs and not needs <= set(table.get(rel, ())):
            missing[rel] = sorted(needs)
    assert not missing, f"add to OPTIONAL_MODULES in conftest.py: {missing}"


def _load_counts():
    """scripts/architecture_counts.py: the spellings of the rules with one owner, which its counts
    and these tests read alike."""
    path = ROOT.parent / "scripts" / "architecture_counts.py"
    spec = importlib.util.spec_from_file_location("architecture_counts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COUNTS = _load_counts()


def _writers(pattern) -> list[str]:
    """The package modules whose executable code (comments and strings aside) matches ``pattern``."""
    return sorted(name for name, path in MODULES.items() if pattern.search(COUNTS.code_of(path)))


def test_the_divisor_rule_is_written_once():
    """The normaliser's clamp (``max(den, eps)``, 1 where no key is seen) lives in
    :meth:`slicedkern._spec.Normalizer.divisor`; engines, decoding and the sharded engine call it
    (it was once in six modules). Each compiled language has its twin: the sweep's numba
    ``divisor_of`` (which its ``normaliser_scale`` calls) and the triton engine's pass-2 epilogue,
    in registers (a kernel cannot call Python); tests/engines/ hold them to the reference for every
    normaliser."""
    spellings = {name: len(COUNTS.DIVISOR.findall(COUNTS.code_of(MODULES[name]))) for name in _writers(COUNTS.DIVISOR)
                 if name not in ("slicedkern.reference", "slicedkern.engines.triton._device")}
    assert spellings == {"slicedkern._spec": 1, "slicedkern.engines.sweep._kernels_common": 1}, spellings


def test_the_normaliser_coding_is_written_once():
    """The integer codes the compiled kernels receive for ``normalize`` (numba's options, Triton's
    ``NORM``) are :data:`slicedkern._spec.NORMALIZER_CODES`: no other module defines a table or a
    function of them or passes a literal code, no dict literal maps the names to integers, and the
    sweep's named constants are read from it."""
    assert _writers(COUNTS.CODING) == ["slicedkern._spec"]
    pairs = r"""["'](abs|relu|count)["'] *: *\d"""
    assert sorted(name for name, path in MODULES.items() if re.search(pairs, path.read_text())) == ["slicedkern._spec"]
    pytest.importorskip("numba")
    from slicedkern._spec import Normalizer
    from slicedkern.engines.sweep import _kernels_common as sweep

    codes = [Normalizer(name).code for name in (None, "abs", "relu", "count")]
    assert codes == [sweep.NO_NORMALIZER, sweep.ABS_NORMALIZER, sweep.RELU_NORMALIZER, sweep.COUNT_NORMALIZER]
    assert len(set(codes)) == 4


def test_the_causal_alignment_is_written_once():
    """Query ``i`` sees the keys ``j <= i + Lk - Lq``: the offset and the comparison live in
    :mod:`slicedkern._lib.causal`, which the reference, the causal grid of the engines, the layers'
    masks and positions and the triton host read; the compiled kernels take the offset as an
    argument."""
    assert _writers(COUNTS.ALIGNMENT) == ["slicedkern._lib.causal"]


def test_the_quotient_rule_is_written_once():
    """The attention backward's quotient rule (``-g . out / den`` where the normaliser is not clamped)
    lives in :func:`slicedkern.engines._combine.pullback` (issue 24: it was in three modules). The
    sweep's numba kernels fuse their own, per query inside the sweep; the tests hold it equal."""
    writers = sorted(name for name, path in MODULES.items()
                     if re.search(r">= *(normalizer\.|spec\.)?eps", path.read_text())
                     and not name.startswith("slicedkern.engines.sweep._kernels"))
    assert writers == ["slicedkern.engines._combine"], writers


def test_the_backward_has_no_hooks():
    """The backward is straight functions (``engines/_vjp.py``'s ``attention_bwd`` and ``causal_bwd``,
    the triton and sharded engines' own pairs) over named records: no class of the generic backward
    has methods for an engine to override (there were 37 such methods on the key views), and no
    engine subclasses one."""
    assert COUNTS.backward_hooks(ROOT) == []
    from slicedkern.engines import _vjp
    for name in ("attention_bwd", "causal_bwd", "sums_vjp", "silent_rows", "nan_scores"):
        assert callable(getattr(_vjp, name))


def test_the_backward_hooks_are_counted(tmp_path):
    """The hook count sees a class of the generic backward with a method, and an engine's subclass."""
    engines = tmp_path / "engines"
    engines.mkdir()
    (engines / "_vjp.py").write_text("class Keys:\n    def seen(self):\n        pass\n")
    (engines / "mine.py").write_text("from ._vjp import Keys\nclass MyKeys(Keys):\n    def seen(self):\n"
                                     "        pass\n    def to_keys(self):\n        pass\n")
    assert sorted(COUNTS.backward_hooks(tmp_path)) == ["Keys.seen", "MyKeys.seen", "MyKeys.to_keys"]


def test_distributed_imports_no_engine_internals():
    """Sequence parallelism is an engine wrapper (:class:`slicedkern.engines.ShardedEngine`) run by
    the adapters; ``distributed/`` reaches the engines through their package only."""
    private = sorted({(name, target) for name in MODULES if _group(name) == "distributed"
                      for target, _, _ in _imports(name, MODULES[name])
                      if target.startswith("slicedkern.engines.") or target.startswith("slicedkern.adapters.")})
    assert private == [], private


#: the engines' own packages (their shared pieces, sortscan/ and engines/_*.py, are not engines)
ENGINE_PACKAGES = ("scan", "sweep", "triton")


def test_no_engine_imports_another():
    """Each engine computes with the shared pieces (``engines/_*.py``, ``engines/sortscan/``) and its
    own modules, never another engine's: causal attention's divide and conquer is
    ``engines/_dyadic.py`` over each engine's level kernels, not the scan's code driven by triton's
    (the sharded engine wraps engines through the registry's base class)."""
    def package(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[1] == "engines" and parts[2] in ENGINE_PACKAGES else None

    crossing = sorted({(name, target) for name in MODULES if package(name)
                       for target, _, _ in _imports(name, MODULES[name])
                       if package(target) and package(target) != package(name)})
    assert crossing == [], crossing


def test_the_layers_above_the_engines_reach_them_through_the_registry():
    """The adapters, ops, layers and sequence parallelism reach the engines through
    ``slicedkern.engines`` (``select``, ``decoder``, ``get``), never a module of one engine: decoding
    too is chosen there, so ``use_engine`` applies to it."""
    private = sorted({(name, target) for name in MODULES if LAYERS[_group(name)] > LAYERS["engines"]
                      for target, _, _ in _imports(name, MODULES[name]) if target.startswith("slicedkern.engines.")})
    assert private == [], private


def test_no_layer_borrows_a_private_module_of_another_package():
    """The checks every op shares live in ``slicedkern._validate``, below the ops, so that ``sliced``,
    ``nn`` and ``distributed`` import no private module of ``slicedkern.ops`` (docs/architecture.rst)."""
    borrowed = sorted({(name, target) for name in MODULES if not name.startswith("slicedkern.ops")
                       for target, _, _ in _imports(name, MODULES[name])
                       if target.startswith("slicedkern.ops.") and target.split(".")[2].startswith("_")})
    assert borrowed == [], borrowed


def test_every_engine_provides_the_primitives_it_declares():
    """The Engine base declares the primitives (raising ``NotImplementedError``); each registered
    engine overrides those of its kind, and the registry's names are the classes' own."""
    from slicedkern.engines import ENGINE_NAMES, Engine, get

    assert ENGINE_NAMES == ("scan", "sweep", "triton")
    for name in ENGINE_NAMES:
        engine = get(name)
        needed = Engine.PRIMITIVES + (Engine.CAUSAL_PRIMITIVES if engine.supports_causal else ())
        needed += ("causal_profile_sums",) if engine.gives_causal_sums else ()
        missing = [p for p in needed if getattr(type(engine), p) is getattr(Engine, p)]
        assert engine.name == name and missing == [], (name, missing)
    bare = type("Bare", (Engine,), {"name": "bare"})()          # an engine that overrides nothing
    with pytest.raises(NotImplementedError, match="'bare' engine does not provide 'causal_attention'"):
        bare.causal_attention(None, None, xp=None)


@pytest.mark.parametrize("module", ["slicedkern", "slicedkern.distributed", "slicedkern.reference"])
def test_op_signatures_restate_the_one_table_of_defaults(module):
    """``_spec.OP_DEFAULTS`` is each attention op's defaults; every signature that restates them
    (the ops, their sequence-parallel and dense versions) agrees with it."""
    import importlib
    import inspect

    from slicedkern._spec import OP_DEFAULTS

    mod = importlib.import_module(module)
    for op, defaults in OP_DEFAULTS.items():
        fn = getattr(mod, "kernel_attention" if op == "kernel" else f"{op}_attention")
        params = inspect.signature(fn).parameters
        got = {name: params[name].default for name in defaults}
        assert got == defaults, (module, op, got)


@pytest.mark.parametrize("module", ["slicedkern.sliced.ops", "slicedkern.sliced.stats"])
def test_planners_take_their_ops_parameters(module):
    """A composite op's planner is called with the op's own arguments (``adapters.vjp.composite``):
    its parameters are the op's, names, kinds and defaults (scripts/architecture_counts.py counts it
    as a public signature)."""
    import importlib
    import inspect

    mod = importlib.import_module(module)
    ops = [getattr(mod, n) for n in mod.__all__ if hasattr(getattr(mod, n), "__slicedkern_planner__")]
    assert ops
    for op in ops:
        planner = op.__slicedkern_planner__
        mine = [(p.name, p.kind, p.default) for p in inspect.signature(op).parameters.values()]
        theirs = [(p.name, p.kind, p.default) for p in inspect.signature(planner).parameters.values()]
        assert mine == theirs, (op.__name__, mine, theirs)
