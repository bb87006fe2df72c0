"""Helpers shared by the benchmark modules: backends, engines, data, synchronisation.

Self-contained on purpose: it uses only slicedkern's public functions, its engine switch and its
lists of backends and engines, and skips (``NotImplementedError``) what a given commit or
environment does not have, so that the same suite runs on older commits (``asv continuous``) and
in environments without torch, JAX or numba.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util

import numpy as np

# The package's own lists where this version has them, so that asv, the bench command and the tests
# agree. asv also builds older commits (``asv continuous``), from before those lists existed: there
# the same values are spelt out. Changing either list changes the benchmarks' parameters, and asv
# compares results only between commits whose parameters match.
try:
    from slicedkern.bench.backends import BACKEND_NAMES  # the bench's members of Backend
except ImportError:
    BACKENDS = ["numpy", "torch", "jax"]
else:
    BACKENDS = list(BACKEND_NAMES)
try:
    from slicedkern.engines import ENGINE_NAMES
except ImportError:
    ENGINES = ["scan", "sweep"]
else:
    # the benchmarks build CPU arrays, which the triton engine serves only under Triton's interpreter:
    # its GPU benchmark is scripts/gpu_bench.py
    ENGINES = [e for e in ENGINE_NAMES if e != "triton"]

#: Batch rows and value columns of the attention and kernel-sum benchmarks.
BATCH = 4
DIM = 32


def backend_module(backend):
    """Import and return the framework of ``backend``; ``NotImplementedError`` if not installed."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}")
    if importlib.util.find_spec(backend) is None:
        raise NotImplementedError(f"{backend} is not installed")
    return importlib.import_module(backend)


def to_backend(backend, array):
    """``array`` (NumPy) on ``backend``'s default CPU device."""
    if backend == "numpy":
        return array
    if backend == "torch":
        import torch
        return torch.from_numpy(np.ascontiguousarray(array))
    import jax
    return jax.device_put(array, jax.devices("cpu")[0])


def to_numpy(array):
    """A NumPy float64 copy of a NumPy, torch or JAX array."""
    if hasattr(array, "detach"):
        array = array.detach().cpu().numpy()
    return np.asarray(array, dtype=np.float64)


def sync(backend, out):
    """Wait until ``out`` is computed (JAX dispatches asynchronously)."""
    if backend == "jax":
        import jax
        return jax.block_until_ready(out)
    return out


def random_inputs(n, *, batch=BATCH, dim=DIM, seed=0, dtype=np.float32):
    """``q, k`` of shape (batch, n), ``v`` and a cotangent ``g`` of shape (batch, n, dim)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, n)).astype(dtype)
    k = rng.standard_normal((batch, n)).astype(dtype)
    v = rng.standard_normal((batch, n, dim)).astype(dtype)
    g = rng.standard_normal((batch, n, dim)).astype(dtype)
    return q, k, v, g


def engine_context(engine, like):
    """A context manager running slicedkern with ``engine`` on arrays like ``like``.

    Raises ``NotImplementedError`` where the engine cannot serve ``like`` here: numba missing, the
    engine not wired in yet, a JAX or GPU array for "sweep", no engine switch in this version.
    """
    try:                                # public, else where this version keeps them
        use = public("use_engine", "engines", "_engine")
        engine_for = public("engine_for", "engines", "_engine")
    except NotImplementedError:         # a version with one engine: the scan
        if engine == "scan":
            return contextlib.nullcontext()
        raise NotImplementedError("no engine selection in this version") from None
    if engine == "scan":
        return use("scan")
    try:
        with use(engine):
            if engine_for(like) != engine:
                raise NotImplementedError(f"engine {engine!r} does not serve these arrays")
    except ValueError as exc:           # numba missing, or arrays it does not serve
        raise NotImplementedError(str(exc)) from None
    if engine == "sweep" and importlib.util.find_spec("slicedkern.engines") is None:
        # Before the engine registry, a version could accept "sweep" before the engine was wired
        # in, or without checking for numba; the registry's use_engine / engine_for refuse both.
        try:
            sweep = importlib.import_module("slicedkern._sweep")
        except ImportError:
            raise NotImplementedError("the sweep engine is not in this version") from None
        if not getattr(sweep, "AVAILABLE", True):
            raise NotImplementedError("the sweep engine needs numba")
    return use(engine)


def public(name, *modules):
    """``slicedkern.<name>``, else the first of ``slicedkern.<module>.<name>``; else skip."""
    import slicedkern
    found = getattr(slicedkern, name, None)
    for module in modules:
        if found is not None:
            break
        try:
            found = getattr(importlib.import_module(f"slicedkern.{module}"), name, None)
        except ImportError:
            pass
    if found is None:
        raise NotImplementedError(f"slicedkern.{name} is not in this version")
    return found


class Benchmark:
    """Base class: enters the engine context in ``setup`` and leaves it in ``teardown``.

    Subclasses call :meth:`enter_engine` at the end of their own ``setup`` (an engine context set
    there stays set for the timed calls, which run in the same thread).
    """

    timeout = 120
    _engine_ctx = None

    def enter_engine(self, engine, like):
        """Enter the engine context (skips the benchmark where the engine is not available)."""
        ctx = engine_context(engine, like)
        ctx.__enter__()
        self._engine_ctx = ctx

    def teardown(self, *params):
        """Leave the engine context entered by :meth:`enter_engine`."""
        if self._engine_ctx is not None:
            self._engine_ctx.__exit__(None, None, None)
            self._engine_ctx = None


def relative_error(approx, exact):
    """Normwise relative error ``||approx - exact|| / ||exact||`` in float64."""
    approx, exact = to_numpy(approx), to_numpy(exact)
    return float(np.linalg.norm(approx - exact) / np.linalg.norm(exact))
