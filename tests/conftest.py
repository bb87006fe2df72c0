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
"""

from __future__ import annotations

import itertools
import os
import sys

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


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "new_shapes: compiles shapes no other test uses; on JAX only with --jax-all")
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
