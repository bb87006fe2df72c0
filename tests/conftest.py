"""Backend selection for the whole suite.

* ``xp`` fixture: one :class:`tests._helpers.Backend` per selected backend (numpy, array_api_strict,
  torch, jax, cupy, torch_cuda). A backend whose library is missing, or that needs a GPU there is
  none of, is skipped, never failed.
* ``xp_pair`` fixture: every unordered pair of selected backends (cross-backend tests).
* Selection: ``pytest --backend numpy,torch`` or ``SLICEDKERN_BACKENDS=numpy,torch`` (the option
  wins); default: all of them.
* JAX runs with ``jax_enable_x64`` switched on for the duration of each test (restored afterwards),
  so that float64 comparisons mean float64.
"""

from __future__ import annotations

import itertools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _helpers import (ALL_BACKENDS, ENV_VAR, assert_close, backend_context,  # noqa: E402
                      make_backend, selected_backends)

__all__ = ["assert_close"]


def pytest_addoption(parser):
    parser.addoption("--backend", action="store", default=None, metavar="NAME[,NAME]",
                     help=f"comma list of array backends to test, among {', '.join(ALL_BACKENDS)} "
                          f"(default: ${ENV_VAR} or all)")


def pytest_configure(config):
    try:
        selected_backends(config)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_generate_tests(metafunc):
    names = selected_backends(metafunc.config)
    if "xp" in metafunc.fixturenames:
        metafunc.parametrize("xp", names, indirect=True, ids=names)
    if "xp_pair" in metafunc.fixturenames:
        pairs = list(itertools.combinations(names, 2))
        metafunc.parametrize("xp_pair", pairs, indirect=True, ids=[f"{a}-{b}" for a, b in pairs])


@pytest.fixture
def xp(request):
    """The backend under test (see :class:`tests._helpers.Backend`)."""
    backend = make_backend(request.param)
    with backend_context(backend.name):
        yield backend


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
