"""The adapter registry: run a validated op on its framework, with that framework's autograd.

torch tensors go through a ``torch.autograd.Function`` (:mod:`._torch`), JAX arrays through a
``jax.custom_vjp`` (:mod:`._jax`); every other namespace runs the engine's forward directly, and
:func:`slicedkern.vjp` (:mod:`.vjp`) gives it the same backward. An adapter never looks inside an
op: it keeps the spec, the engine and the engine's flat residuals, and hands them back to
``engine.backward``. To add an autograd system: a module with ``apply(spec, engine, arrays,
out_dtype)`` and one entry in :data:`_ROWS`.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

from ..backends import is_traced, ops_for

__all__ = ["run", "Record", "recording", "register_torch_operators"]

def _torch_apply():
    from ._torch import apply  # imports torch: only once a torch tensor has arrived
    return apply


def _jax_apply():
    from ._jax import apply  # imports jax: only once a JAX array has arrived
    return apply


def register_torch_operators() -> None:
    """Register the ``slicedkern::*`` torch operators (done by the first op call on a torch tensor, and
    by importing ``slicedkern.nn.torch``): a process that loads a ``torch.export``-ed program holding
    them needs them before it runs it (docs/compile.rst)."""
    _torch_apply()


#: registry row's library -> loader of its adapter's ``apply``; other libraries have no autograd system.
_ROWS = {"torch": _torch_apply, "jax": _jax_apply}


@dataclass
class Record:
    """One op call as :func:`slicedkern.vjp` replays it backwards."""

    xp: Any
    spec: Any
    engine: Any
    arrays: tuple
    names: tuple
    out: Any
    residuals: tuple
    squeeze: bool
    #: the objects the caller passed for each of ``names`` (before validation), or None
    sources: tuple


#: The records of the innermost :func:`slicedkern.vjp` of this thread / task, or None.
recording: contextvars.ContextVar[list | None] = contextvars.ContextVar("slicedkern_vjp", default=None)


def run(xp, spec, engine, arrays, names, out_dtype, *, squeeze=False, sources=None):
    """Forward of ``spec`` on ``engine`` over ``arrays`` (named ``names``), cast to ``out_dtype``.

    ``squeeze`` drops a trailing axis of size one (``kernel_sum`` with vector weights). ``sources``
    are the caller's objects behind ``arrays`` (what :func:`slicedkern.vjp` matches, by identity,
    with a wrapper's arguments).
    """
    records = None if is_traced(arrays[0]) else recording.get()
    if records is not None:
        out, residuals = engine.forward(spec, arrays, xp=xp, for_backward=True)
        if out.dtype != out_dtype:
            out = xp.astype(out, out_dtype)
        records.append(Record(xp, spec, engine, arrays, names, out, residuals, squeeze,
                              sources if sources is not None else (None,) * len(names)))
    else:
        load = _ROWS.get(ops_for(xp).library)
        if load is not None:
            out = load()(spec, engine, arrays, out_dtype)
        else:
            out, _ = engine.forward(spec, arrays, xp=xp)
    if out.dtype != out_dtype:
        out = xp.astype(out, out_dtype)
    return out[..., 0] if squeeze else out
