"""Repository-level pytest configuration: modules whose framework is missing are not collected, nor
the triton engine's kernels (:data:`JIT_AT_IMPORT`).

``pytest`` collects ``slicedkern/`` for its doctests (``--doctest-modules``), which imports every
module of the package; the modules below import an optional framework at their top, so where it is
not installed they are left out (their tests skip through ``pytest.importorskip``). The README's
test command must collect on a venv with only the ``[test]`` extra: ``.ci/run`` runs it there first,
and ``tests/test_architecture.py`` checks that every module importing a framework at its top is in
this table.
"""

import importlib.util

#: path (relative to the repository root) -> the top-level modules it needs
OPTIONAL_MODULES = {
    "slicedkern/adapters/_torch.py": ("torch",),
    "slicedkern/adapters/_torch_ops.py": ("torch",),
    "slicedkern/adapters/_jax.py": ("jax",),
    "slicedkern/backends/_torch.py": ("torch",),
    "slicedkern/backends/_jax.py": ("jax",),
    "slicedkern/backends/_dask.py": ("dask",),
    "slicedkern/distributed/_torch.py": ("torch",),
    "slicedkern/distributed/_jax.py": ("jax",),
    "slicedkern/nn/torch.py": ("torch",),
    "slicedkern/nn/_torch_generate.py": ("torch",),
    "slicedkern/nn/_torch_convert.py": ("torch",),
    "slicedkern/nn/_torch_attention.py": ("torch",),
    "slicedkern/nn/flax.py": ("flax", "jax"),
    "slicedkern/engines/sweep/_causal_host.py": ("numba",),
    "slicedkern/engines/sweep/_convert.py": ("numba",),
    "slicedkern/engines/sweep/_kernels_backward.py": ("numba",),
    "slicedkern/engines/sweep/_kernels_forward.py": ("numba",),
    "slicedkern/engines/sweep/_kernels_causal.py": ("numba",),
    "slicedkern/engines/sweep/_kernels_common.py": ("numba",),
    "slicedkern/engines/sweep/_kernels_decode.py": ("numba",),
    "slicedkern/engines/sweep/_decode.py": ("numba",),
    "tests/_distributed_jax.py": ("jax",),
    "slicedkern/engines/triton/_device.py": ("triton",),
    "slicedkern/engines/triton/_kernels.py": ("triton",),
    "slicedkern/engines/triton/_order.py": ("triton",),
    "slicedkern/engines/triton/_dense.py": ("triton",),
}

#: modules never collected: the triton engine's kernels are jitted as they are defined, and
#: ``triton.jit`` fixes then whether they run under the interpreter (``TRITON_INTERPRET``), which a
#: test module sets before it imports them (tests/engines/test_triton.py); they hold no doctest
JIT_AT_IMPORT = [path for path in OPTIONAL_MODULES if path.startswith("slicedkern/engines/triton/")]


def _missing(modules: tuple[str, ...]) -> bool:
    return any(importlib.util.find_spec(name) is None for name in modules)


collect_ignore = [path for path, modules in OPTIONAL_MODULES.items() if _missing(modules) or path in JIT_AT_IMPORT]
