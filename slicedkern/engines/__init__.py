"""The engine registry: which engine computes a call, chosen once, in the public layer.

Three engines compute the same forward and backward (docs/architecture.rst): the array-API **scan**
(every backend, GPUs, JAX), the fused numba **sweep** (NumPy arrays, CPU torch tensors, CPU JAX arrays) and the
fused Triton kernels of **triton** (torch tensors; chosen automatically for CUDA tensors only).
:func:`select` resolves an op's ``engine=`` argument, else the :func:`use_engine` default of the
calling context, else the automatic rule (triton for CUDA tensors when Triton is installed, the
sweep wherever it can run, causal attention included, the scan elsewhere and for causal attention on
CUDA tensors, which triton declines), and returns the engine object the adapters then keep for the
backward. To add an engine: a subpackage with an :class:`~slicedkern.engines._base.Engine`
subclass, and one entry in :data:`_REGISTRY`.
"""

from __future__ import annotations

import contextlib
import contextvars

from ..backends import backend_of
from ._base import Engine
from .banded import BandedEngine, band_bounds
from .scan import ScanEngine
from .segmented import SegmentedEngine, segment_layout
from .sharded import ShardedEngine
from .sweep import SweepEngine
from .triton import TritonEngine

__all__ = ["Engine", "ShardedEngine", "SegmentedEngine", "segment_layout", "BandedEngine", "band_bounds",
           "ENGINE_NAMES", "use_engine", "engine_for", "select", "decoder", "get",
           "available"]

#: Engines in order of preference for the automatic rule, by the names their classes give.
_REGISTRY: dict[str, Engine] = {cls.name: cls() for cls in (TritonEngine, SweepEngine, ScanEngine)}
ENGINE_NAMES = tuple(sorted(_REGISTRY))
_CHOICES = ("auto",) + ENGINE_NAMES

#: The calling context's default: each thread and each asyncio task sees its own.
_default: contextvars.ContextVar[str] = contextvars.ContextVar("slicedkern_engine", default="auto")


def get(name: str) -> Engine:
    """The engine called ``name``."""
    return _REGISTRY[name]


def _check_name(name, argument: str) -> str:
    if name not in _CHOICES:
        raise ValueError(f"argument {argument!r} must be one of {_CHOICES}, got {name!r}")
    return name


@contextlib.contextmanager
def use_engine(name: str):
    """Make ``name`` ("auto", "scan", "sweep" or "triton") the default engine of the enclosed calls.

    The default belongs to the calling thread (and asyncio task): other threads keep theirs. It is
    read once per op call, so a backward runs on the engine its forward ran on wherever it is
    called, and by a ``DecodeCache`` at its first ``append``, which chooses the runs it keeps. An
    op's ``engine=`` argument wins over it. Under ``jax.jit`` it is read when the function is traced
    (a jitted function keeps the engine of its first trace, as with any Python state); inside
    ``torch.compile`` it is not read, and the automatic rule chooses (docs/compile.rst).

    Examples
    --------
    >>> import numpy as np, slicedkern
    >>> q, k, v = np.zeros((1, 3)), np.ones((1, 3)), np.ones((1, 3, 2))
    >>> with slicedkern.use_engine("scan"):
    ...     out = slicedkern.relu_attention(q, k, v)
    """
    _check_name(name, "name")
    if name == "sweep" and not SweepEngine.installed():
        raise ValueError("the 'sweep' engine needs numba: pip install numba")
    if name == "triton" and not TritonEngine.installed():
        raise ValueError("the 'triton' engine needs Triton: pip install triton")
    token = _default.set(name)
    try:
        yield
    finally:
        _default.reset(token)


def select(spec, arrays, requested: str | None = None, *, wrap=None) -> Engine:
    """The engine for one call: ``requested``, else the context's default, else the automatic rule.

    ``wrap`` (optional) maps each registered engine to the engine that would run the call (the
    sharded engine of :mod:`slicedkern.distributed`); its ``decline`` is the one consulted.

    Raises ``ValueError`` naming the ``engine`` argument when the requested engine cannot serve the
    arrays or the spec, with its reason (a CUDA tensor for the sweep, say, or ``causal=True`` for an
    engine without a causal mode): never a silent copy or fallback. The automatic rule skips the
    engines that decline.
    """
    backend = backend_of(arrays[0])
    if requested is None:
        # torch.compile cannot trace ContextVar.get: a compiled call uses the automatic rule (the
        # sweep or triton as a registered operator, docs/compile.rst); JAX reads it at trace time
        requested = _default.get() if backend.reads_context(arrays[0]) else "auto"
    _check_name(requested, "engine")
    candidates = {name: (e if wrap is None else wrap(e)) for name, e in _REGISTRY.items()}
    if requested != "auto":
        engine = candidates[requested]
        reason = engine.decline(spec, arrays, backend)
        if reason is not None:
            raise ValueError(f"argument 'engine': {reason}")
        return engine
    for engine in candidates.values():
        if engine.automatic(arrays) and engine.decline(spec, arrays, backend) is None:
            return engine
    raise ValueError("no engine serves these arrays")    # the scan serves every namespace


def decoder(k) -> Engine:
    """The engine whose runs hold a ``DecodeCache`` over keys like ``k``: the context's default
    (:func:`use_engine`) where it decodes them, else the first of the registry that does (triton
    for CUDA tensors, the sweep for host-readable arrays, the scan for every other namespace).

    The default engine may run the ops on these arrays and yet keep no runs of them (the sweep on
    JAX arrays, which it reaches through a host callback): the automatic rule then chooses, as it
    did before decoding went through the registry. Raises ``ValueError`` naming the engine when the
    default one would not run the ops on these arrays either (triton for NumPy arrays, say).
    """
    backend = backend_of(k)
    requested = _default.get() if backend.reads_context(k) else "auto"
    if requested != "auto":
        engine = _REGISTRY[requested]
        if engine.decodes(k):
            return engine
        reason = engine.decline(None, (k,), backend)
        if reason is not None:
            raise ValueError(f"the {requested!r} engine of slicedkern.use_engine cannot decode these keys: {reason}")
    return next(engine for engine in _REGISTRY.values() if engine.decodes(k))


def engine_for(array) -> str:
    """The name of the engine an op on ``array`` would run on in this context."""
    return select(None, (array,)).name


def available(library: str) -> list[str]:
    """Engines that serve CPU arrays of ``library`` ("numpy", "torch", "jax", ...) here."""
    return [name for name in ENGINE_NAMES if _REGISTRY[name].serves(library)]
