"""Fixtures of the fuzz suite: the engine under test, and a runner with the selected profile.

Profiles (Hypothesis settings profiles, chosen with ``$SLICEDKERN_FUZZ``)
-----------------------------------------------------------------------
* ``ci`` (default): a bounded, derandomised run (the same examples every time, so a CI failure
  reproduces anywhere), sized for the whole fuzz suite to take about a minute on two shared cores
  with NumPy, torch, JAX and array_api_strict. JAX gets fewer examples than the others (every new
  shape or dtype compiles) and a few fixed shapes (``_cases.FEW_LAYOUTS``).
* ``long`` (``SLICEDKERN_FUZZ=long``): many more examples per test, no deadline, a fresh random
  seed each run, failures remembered in Hypothesis's example database (``.hypothesis/``) and
  replayed first next time.
* ``SLICEDKERN_FUZZ=<N>``: the long profile with ``N`` examples per test (for time-boxed runs).

Backends and engines
--------------------
The ``xp`` fixture of ``tests/conftest.py`` is the axis: one test per backend and engine
(``numpy-scan``, ``numpy-sweep``, ``torch-scan``, ``torch-sweep``, ``jax``, ``array_api_strict``;
``--backend`` / ``$SLICEDKERN_BACKENDS`` narrow it). The ``engine`` fixture is its engine half,
made explicit so that reports name it and gradients run their backward on it too.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import numpy as np
import pytest
from _helpers import jax_x64, make_backend, require_selected
from hypothesis import HealthCheck, Phase, given, settings

import slicedkern

from ._cases import FEW_LAYOUTS

with warnings.catch_warnings():
    # Hypothesis imports this module only to report a failure, and the import warns (a deprecated
    # TypedDict of mypy_extensions): with warnings as errors that would turn a failing example into
    # a pytest INTERNALERROR. Import it now, quietly.
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import hypothesis.extra._patching  # noqa: F401
    except ImportError:  # pragma: no cover
        pass

ENV_VAR = "SLICEDKERN_FUZZ"

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
           HealthCheck.large_base_example]

settings.register_profile(
    "slicedkern-fuzz-ci", max_examples=8, deadline=None, derandomize=True, database=None,
    print_blob=True, suppress_health_check=_HEALTH,
    # no explicit phase: generation and shrinking, as usual; "explain" costs time for nothing here
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink))
settings.register_profile(
    "slicedkern-fuzz-long", max_examples=1000, deadline=None, derandomize=False, print_blob=True,
    suppress_health_check=_HEALTH,
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink))

#: Share of a profile's examples each backend gets: JAX compiles every new shape and dtype
#: (seconds each), array_api_strict is slow on small arrays.
BACKEND_SHARE = {"jax": 0.2, "array_api_strict": 0.5}


#: ``--exhaustive`` (tests/conftest.py) chooses the long profile where ``$SLICEDKERN_FUZZ`` is unset
_EXHAUSTIVE = {"on": False}


def fuzz_profile() -> tuple[str, int | None]:
    """``(profile name, examples per test or None)`` from ``$SLICEDKERN_FUZZ`` (``--exhaustive``:
    the long profile when it is unset)."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value == "" and _EXHAUSTIVE["on"]:
        value = "long"
    if value in ("", "ci", "0"):
        return "slicedkern-fuzz-ci", None
    if value == "long":
        return "slicedkern-fuzz-long", None
    if value.isdigit():
        return "slicedkern-fuzz-long", int(value)
    raise pytest.UsageError(f"${ENV_VAR} must be 'ci', 'long' or a number of examples, got {value!r}")


def pytest_configure(config):
    # the rule of tests/conftest.py's exhaustive(): the option, or $SLICEDKERN_EXHAUSTIVE
    _EXHAUSTIVE["on"] = bool(config.getoption("--exhaustive")) or os.environ.get(
        "SLICEDKERN_EXHAUSTIVE", "") not in ("", "0")
    fuzz_profile()       # a bad $SLICEDKERN_FUZZ is a usage error before anything runs


def pytest_report_header(config):
    name, examples = fuzz_profile()
    count = examples if examples is not None else settings.get_profile(name).max_examples
    return f"slicedkern fuzz profile: {name} ({count} examples per test before backend shares)"


# --------------------------------------------------------------------------------------- engines
@dataclass(frozen=True)
class Engine:
    """The engine under test, as the tests see it: ``engine.call(fn, *args, **kwargs)`` runs
    ``fn`` (an op, ``slicedkern.vjp`` or a function computing gradients) with ``name`` chosen for
    every slicedkern op inside, forward and backward (the engine is a context default each op
    reads when it runs, the backward too)."""

    name: str

    def call(self, fn, /, *args, **kwargs):
        with slicedkern.use_engine(self.name):
            return fn(*args, **kwargs)


def _engine_of(backend) -> Engine:
    """The backend's engine of the suite's axis (``numpy-sweep``: the sweep), else the one the
    library picks for its arrays (the scan, today)."""
    return Engine(backend.engine or slicedkern.engine_for(backend.asarray(np.zeros(1))))


@pytest.fixture
def engine(xp) -> Engine:
    """The engine under test: the engine half of the ``xp`` axis (``tests/conftest.py``)."""
    return _engine_of(xp)


@pytest.fixture
def jax_without_x64(request):
    """``(backend, engine)``: JAX with ``jax_enable_x64`` off for the test (float32 work dtype)."""
    require_selected(request.config, "jax")
    backend = make_backend("jax")
    with jax_x64(False):
        yield backend, _engine_of(backend)


# ------------------------------------------------------------------------------------------ runner
@dataclass(frozen=True)
class Fuzzer:
    """Runs a property over examples of a strategy with the selected profile.

    The property is wrapped in ``@given`` at run time, so that the strategy and the number of
    examples may depend on the backend; the node id is added to Hypothesis's key of the property
    (its seed when derandomised, its place in the example database otherwise), so every test has
    its own examples.
    """

    profile: settings
    node_id: str
    bounded: bool = True

    def layouts_for(self, backend) -> tuple:
        """The shapes ``backend`` is given (``_cases.layouts``' ``few_shapes``): any (an empty tuple)
        but on JAX, which compiles every new shape: :data:`_cases.FEW_LAYOUTS`, and in the bounded
        profile the first of them only (batched, broadcast, masked: compiled once for the suite)."""
        if not backend.is_jax:
            return ()
        return FEW_LAYOUTS[:1] if self.bounded else FEW_LAYOUTS

    def one_dtype_on(self, backend) -> bool:
        """Whether ``backend`` gets one dtype combination only: JAX in the bounded (CI) profile,
        where every new dtype combination compiles the op anew (seconds each); the long profile
        mixes dtypes on JAX too."""
        return self.bounded and backend.is_jax

    def run(self, strategy, check, *, backend: str, weight: float = 1.0):
        """Check ``check(example)`` on ``max_examples * weight`` examples times the backend's share
        (at least 2)."""
        count = max(2, round(self.profile.max_examples * BACKEND_SHARE.get(backend, 1.0) * weight))

        @settings(self.profile, max_examples=count)
        @given(strategy)
        def property_holds(example):
            check(example)

        # the hook Hypothesis's own pytest plugin uses to tell parametrised tests apart
        property_holds.hypothesis.inner_test._hypothesis_internal_add_digest = self.node_id.encode()
        property_holds()


@pytest.fixture
def fuzz(request) -> Fuzzer:
    """A :class:`Fuzzer` with the selected profile."""
    name, examples = fuzz_profile()
    profile = settings.get_profile(name)
    if examples is not None:
        profile = settings(profile, max_examples=examples)
    return Fuzzer(profile, request.node.nodeid, bounded=name == "slicedkern-fuzz-ci")
