"""Backend selection for the whole suite.

* ``xp`` fixture: one :class:`tests._helpers.Backend` per selected backend (numpy, array_api_strict,
  torch, jax, cupy, torch_cuda) and engine: NumPy and CPU torch run every test on the scan and on
  the sweep (``numpy-scan``, ``numpy-sweep``, ...), the engine being the default of the test's
  calls. A backend whose library is missing, or that needs a GPU there is
  none of, is skipped, never failed.
* ``xp_pair`` fixture: every unordered pair of selected backends (cross-backend tests).
* Selection: ``pytest --backend numpy,torch`` or ``SLICEDKERN_BACKENDS=numpy,torch`` (the option
  wins); default: all of them.
* JAX runs with ``jax_enable_x64`` switched on for the duration of each test (restored afterwards),
  so that float64 comparisons mean float64.
* JAX compiles every eager op once per input shape (seconds per new shape on CPU), so the suite
  shares a few canonical shapes (``_helpers.N, M, C``). Tests marked ``new_shapes`` use shapes of
  their own; JAX runs them only with ``--jax-all`` or ``SLICEDKERN_JAX_ALL=1``.
* Profiles. The default run (the README's ``python -m pytest``) is meant to pass in about ten
  minutes on two cores with torch and JAX installed (it took 21 on 2026-12-02: the README's table
  says where the time goes): every test function runs on every backend and
  engine, but JAX (60 % of the full suite's time, nearly all of it compiling) runs **one** case of
  each parametrised test function, a different one per function (a stable choice by the test's
  name), and the tests marked ``exhaustive`` (slow compiles, oversized cases) are left out, as are
  the JAX cases of the few functions in ``JAX_ONLY_EXHAUSTIVE`` (10-31 s of compiles each).
  The tests of Triton's kernels under its interpreter (``INTERPRETED_TRITON``) run one case of each
  parametrised function too.
  ``--exhaustive`` or ``SLICEDKERN_EXHAUSTIVE=1`` runs the whole matrix, and the fuzz suite's long
  profile (tests/fuzz/conftest.py) unless ``$SLICEDKERN_FUZZ`` names another. CI (``.ci/run``) runs
  the default profile; ``.ci/exhaustive``, run when an engine or a backend's dispatch changes, runs
  ``--exhaustive --rest`` (only what the default left out), then the fuzz suite with the long
  profile, time-boxed (``$SLICEDKERN_FUZZ``) and with a fixed seed so that a red run reproduces
  (``--hypothesis-seed``).
"""

from __future__ import annotations

import itertools
import os
import sys
import zlib

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _helpers import ALL_BACKENDS, ENV_VAR, assert_close, backend_context, backend_ids, make_backend, selected_backends  # noqa: E402

__all__ = ["assert_close"]


def pytest_addoption(parser):
    parser.addoption("--backend", action="store", default=None, metavar="NAME[,NAME]",
                     help=f"comma list of array backends to test, among {', '.join(ALL_BACKENDS)} "
                          f"(default: ${ENV_VAR} or all)")
    parser.addoption("--jax-all", action="store_true", default=False,
                     help="also run the tests marked new_shapes on JAX (slow: one compile per shape)")
    parser.addoption("--exhaustive", action="store_true", default=False,
                     help=f"the whole matrix: every JAX case, the tests marked exhaustive, and the fuzz "
                          f"suite's long profile (default: ${EXHAUSTIVE_ENV} or off)")
    parser.addoption("--rest", action="store_true", default=False,
                     help="with --exhaustive: only what the default profile leaves out (CI runs the default "
                          "profile first, then this, then the fuzz suite's long profile)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "new_shapes: compiles shapes no other test uses; on JAX only with --jax-all")
    config.addinivalue_line(
        "markers", "exhaustive: slow (compiles, oversized cases) beside tests that cover the same code; "
                   "runs only with --exhaustive")
    try:
        selected_backends(config)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_generate_tests(metafunc):
    names = selected_backends(metafunc.config)
    if "xp" in metafunc.fixturenames:
        ids = backend_ids(names)
        metafunc.parametrize("xp", ids, indirect=True, ids=ids)
    if "xp_pair" in metafunc.fixturenames:
        pairs = list(itertools.combinations(names, 2))
        metafunc.parametrize("xp_pair", pairs, indirect=True, ids=[f"{a}-{b}" for a, b in pairs])


EXHAUSTIVE_ENV = "SLICEDKERN_EXHAUSTIVE"


def exhaustive(config) -> bool:
    """Whether the whole matrix runs (``--exhaustive`` or ``$SLICEDKERN_EXHAUSTIVE``)."""
    return bool(config.getoption("--exhaustive")) or os.environ.get(EXHAUSTIVE_ENV, "") not in ("", "0")


def _jax_case(item) -> bool:
    """A JAX case of a parametrised test: the ``xp`` axis on JAX, or JAX's own x64 on / off axis."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return False
    backend = callspec.params.get("xp")
    return (isinstance(backend, str) and backend.split("-")[0] == "jax") or "x64" in callspec.params


def pytest_collection_modifyitems(config, items):
    """The default profile (module docstring): one JAX case and one interpreted Triton case per test
    function, no ``exhaustive``; with ``--exhaustive --rest``, only what the default profile leaves
    out."""
    left_out = _left_out_by_default(items)
    if exhaustive(config):
        if not config.getoption("--rest"):
            return
        left_out = {id(item) for item in items if id(item) not in left_out}
    if left_out:
        config.hook.pytest_deselected(items=[item for item in items if id(item) in left_out])
        items[:] = [item for item in items if id(item) not in left_out]


#: Test functions whose JAX case alone takes 10-31 s of compiles on the CI machine (measured in the
#: default profile's durations): on JAX they run only with --exhaustive; their other backends, and
#: JAX in the other functions that cover the same code, run by default.
JAX_ONLY_EXHAUSTIVE = frozenset({
    "tests/test_sliced_vjp.py::test_sliced_kernel_sum_vjp",
    "tests/test_sliced_vjp.py::test_sliced_attention_vjp",
    "tests/test_sliced_vjp.py::test_mmd_vjp",
    "tests/engines/test_sweep_jax.py::test_vmap_over_bandwidths",
    "tests/engines/test_sweep_jax.py::test_vmap_over_a_batch_of_qkv",
    "tests/test_causal.py::test_causal_edges_of_the_grid",
    "tests/test_causal.py::test_causal_matches_dense_reference",
    "tests/test_gradients.py::test_vjp_bandwidth_gradients",
    "tests/engines/test_sweep_jax.py::test_jit_grad_of_hat_bandwidth_matches_scan_and_reference",
    "tests/engines/test_sweep_jax.py::test_causal_through_the_host_callback",
})


#: Test modules that run Triton's kernels under its interpreter (TRITON_INTERPRET=1): a launch is
#: Python over every program of its grid, 10-39 s a case, and their cases together took 14 of the
#: default profile's 30 minutes (issue 49, item 16). By default they run one case of each
#: parametrised test function, as JAX does; --exhaustive runs every case.
INTERPRETED_TRITON = ("tests/engines/test_triton.py", "tests/fuzz/test_fuzz_triton.py")


def _interpreted_triton_case(item) -> bool:
    """A case of a parametrised test function of :data:`INTERPRETED_TRITON`."""
    return getattr(item, "callspec", None) is not None and item.nodeid.split("::")[0] in INTERPRETED_TRITON


def _left_out_by_default(items) -> set:
    """``id()`` of the items the default profile leaves out."""
    left_out = {id(item) for item in items if item.get_closest_marker("exhaustive") is not None
                or (_jax_case(item) and item.nodeid.split("[")[0] in JAX_ONLY_EXHAUSTIVE)}
    jax_cases: dict[str, list] = {}
    for item in items:
        if id(item) not in left_out and (_jax_case(item) or _interpreted_triton_case(item)):
            jax_cases.setdefault(item.nodeid.split("[")[0], []).append(item)
    for function, cases in jax_cases.items():
        kept = cases[zlib.crc32(function.encode()) % len(cases)]
        left_out |= {id(item) for item in cases if item is not kept}
    return left_out


@pytest.fixture
def xp(request):
    """The backend under test (see :class:`tests._helpers.Backend`)."""
    backend = make_backend(request.param)
    if backend.is_jax and request.node.get_closest_marker("new_shapes") is not None and not _jax_all(request):
        pytest.skip("new shapes: JAX compiles per shape; run with --jax-all or SLICEDKERN_JAX_ALL=1")
    with backend_context(backend.name, engine=backend.engine):
        yield backend


def _jax_all(request) -> bool:
    return bool(request.config.getoption("--jax-all")) or os.environ.get("SLICEDKERN_JAX_ALL", "") not in (
        "", "0")


@pytest.fixture
def xp_pair(request):
    """Two distinct backends, both available (JAX with x64 on)."""
    first, second = (make_backend(n) for n in request.param)
    with backend_context(first.name, second.name):
        yield first, second


@pytest.fixture
def rng(request):
    """A NumPy generator seeded from the test's name, so every test has its own fixed data."""
    import zlib

    import numpy as np
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
