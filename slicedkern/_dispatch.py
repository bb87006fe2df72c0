"""Run a validated op on its framework, with gradients, and :func:`vjp` for everything else.

torch tensors go through a ``torch.autograd.Function`` and JAX arrays through a ``jax.custom_vjp``
(``slicedkern/backends``); NumPy, CuPy, ``array_api_strict`` and any other namespace run the forward
directly, and :func:`vjp` gives them the same backward.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import array_api_compat as compat

from . import _diff

__all__ = ["execute", "vjp"]

# Stack of active vjp() recorders: a plain list, because torch.compile cannot trace ContextVar.
_recorders: list = []


@dataclass
class _Record:
    xp: Any
    spec: Any
    arrays: tuple
    names: tuple
    residuals: Any
    squeeze: bool


def execute(xp, spec, arrays, names, out_dtype, *, squeeze=False):
    """Forward of ``spec`` on ``arrays`` (named ``names``), cast to ``out_dtype``.

    ``squeeze`` drops a trailing axis of size one (``kernel_sum`` with vector weights).
    """
    recorder = _recorders[-1] if _recorders else None
    if recorder is not None:
        out, residuals = _diff.forward(spec, arrays, xp=xp)
        recorder.append(_Record(xp, spec, arrays, names, residuals, squeeze))
    elif compat.is_torch_namespace(xp):
        from .backends import _torch
        out = _torch.apply(spec, arrays, out_dtype)
    elif compat.is_jax_namespace(xp):
        from .backends import _jax
        out = _jax.apply(spec, arrays, out_dtype)
    else:
        out, _ = _diff.forward(spec, arrays, xp=xp)
    if out.dtype != out_dtype:
        out = xp.astype(out, out_dtype)
    return out[..., 0] if squeeze else out


def _positions(fn, args, kwargs, rec) -> dict:
    """Which positional argument of ``fn`` each differentiable input of the op came from.

    By name when ``fn`` is the op itself (or shares its parameter names); otherwise (a wrapper such
    as a lambda) the op's array inputs are matched, in order, with ``fn``'s positional arrays.
    """
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
        by_name = {name: i for i, name in enumerate(list(bound.arguments)[:len(args)])}
    except (TypeError, ValueError):
        by_name = {}
    wanted = [name for name in rec.names if name != "key_mask"]
    if any(name in by_name for name in wanted):
        return by_name
    array_positions = [i for i, a in enumerate(args) if compat.is_array_api_obj(a)]
    return dict(zip(wanted, array_positions))


def _composite_vjp(fn, args, kwargs):
    """vjp of a sliced op: its plan's forward, and the plan's pullback mapped to the arguments."""
    plan, to_args = fn(*args, _planning=True, **kwargs)
    out = plan.forward()
    xp = plan.xp
    names = list(inspect.signature(fn).bind(*args, **kwargs).arguments)[:len(args)]

    def pullback(g):
        g = xp.asarray(g)
        if tuple(g.shape) != tuple(out.shape):
            raise ValueError(f"the cotangent must have the output's shape {tuple(out.shape)}, "
                             f"got {tuple(g.shape)}")
        work = plan.theta.dtype
        grads = to_args(plan.pullback(xp.astype(g, work)))
        result = []
        for name, arg in zip(names, args):
            grad = grads.get(name)
            if grad is None or not compat.is_array_api_obj(arg) or not xp.isdtype(arg.dtype, "real floating"):
                result.append(None)
                continue
            result.append(xp.astype(_diff._sum_to(xp, grad, arg.shape), arg.dtype))
        return tuple(result)

    return out, pullback


def vjp(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` and return ``(out, pullback)``, on any array namespace.

    The explicit reverse mode for NumPy, CuPy, ``array_api_strict`` and anything without an
    autograd: the same sort-scan backward the torch and JAX adapters use.

    Parameters
    ----------
    fn : callable
        One of slicedkern's ops: ``kernel_sum``, ``relu_attention``, ``hat_attention``,
        ``hat_mixture_attention``, ``kernel_attention``, or the sliced ``sliced_kernel_sum``,
        ``sliced_attention``, ``energy_distance``, ``mmd`` (pulled back slice chunk by slice chunk,
        with bounded memory), or a function that makes exactly one call of the former.
    *args, **kwargs
        Its arguments.

    Returns
    -------
    out : array
        ``fn(*args, **kwargs)``.
    pullback : callable
        ``pullback(g)`` with ``g`` shaped like ``out`` returns a tuple with one entry per positional
        argument: the gradient of ``sum(g * out)`` with respect to it (same shape and dtype), or
        ``None`` where the argument is not a differentiable array. When ``fn`` wraps an op (a
        lambda, say), the op's array inputs are matched in order with ``fn``'s positional arrays.

    Examples
    --------
    >>> import numpy as np, slicedkern
    >>> q, k, v = np.array([[0.5]]), np.array([[0.0, 1.0]]), np.array([[[1.0], [3.0]]])
    >>> out, pullback = slicedkern.vjp(slicedkern.relu_attention, q, k, v)
    >>> dq, dk, dv = pullback(np.ones_like(out))
    >>> dv.shape
    (1, 2, 1)
    """
    if getattr(fn, "_slicedkern_plan", False):
        return _composite_vjp(fn, args, kwargs)
    records: list = []
    _recorders.append(records)
    try:
        out = fn(*args, **kwargs)
    finally:
        _recorders.pop()
    if len(records) != 1:
        raise TypeError(f"vjp supports slicedkern's sort-scan ops, called once; {getattr(fn, '__name__', fn)!r} "
                        f"made {len(records)} such calls")
    rec = records[0]
    positional = _positions(fn, args, kwargs, rec)
    xp = rec.xp

    def pullback(g):
        g = xp.asarray(g)
        if g.shape != out.shape:
            raise ValueError(f"the cotangent must have the output's shape {tuple(out.shape)}, "
                             f"got {tuple(g.shape)}")
        g = xp.astype(g, rec.arrays[0].dtype)
        if rec.squeeze:
            g = g[..., None]
        grads = _diff.backward(rec.spec, rec.arrays, rec.residuals, g, xp=xp)
        result = [None] * len(args)
        for name, grad in zip(rec.names, grads):
            if grad is None or name not in positional:
                continue
            index = positional[name]
            original = args[index]
            if rec.squeeze and name == "w":
                grad = grad[..., 0]
            grad = _diff._sum_to(xp, grad, original.shape)
            result[index] = xp.astype(grad, original.dtype)
        return tuple(result)

    return out, pullback
