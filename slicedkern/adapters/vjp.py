"""``slicedkern.vjp``: reverse mode for NumPy, CuPy, ``array_api_strict`` and any namespace.

The same engine backward the torch and JAX adapters use. An op call made inside :func:`vjp` is
recorded (spec, engine, arrays, output, residuals) instead of being handed to an autograd system;
the pullback replays it backwards. Composite ops (the sliced ones) are marked with
:func:`composite`: their *plan* runs chunk by chunk forward and backward, with bounded memory.
"""

from __future__ import annotations

import functools
import inspect

import array_api_compat as compat

from .._spec import sum_to
from . import recording

__all__ = ["vjp", "composite"]


def composite(planner):
    """Mark a public op as composite: :func:`vjp` calls ``planner`` (same signature as the op).

    ``planner(*args, **kwargs)`` returns a plan with ``xp``, ``work_dtype``, ``forward()`` (the op's
    output) and ``pullback(g) -> {argument name: gradient}``.
    """
    def mark(fn):
        @functools.wraps(fn)
        def op(*args, **kwargs):
            if recording.get() is not None:
                # inside vjp(wrapper): the plan's sort-scan calls run on projections of the points,
                # which no argument of the wrapper is; say so rather than fail on the records
                raise TypeError(f"vjp differentiates {fn.__name__} only when it is passed to vjp itself "
                                f"(slicedkern.vjp({fn.__name__}, ...)), not called inside a wrapper")
            return fn(*args, **kwargs)

        op.__slicedkern_planner__ = planner
        return op
    return mark


def _positions(fn, args, kwargs, rec) -> dict[str, list[int]]:
    """The positional arguments of ``fn`` each input of the op is: ``{name: [index, ...]}``.

    When ``fn`` is the op itself (or a wrapper with the op's parameter names, in place), by name: each
    position gets its own input's gradient, even where one array fills two (``kernel_sum(x, x, w)``).
    Otherwise by identity, so that a wrapper that renames or reorders the op's arguments
    (``lambda q, k, v: relu_attention(k, q, v)``) stays right, and an argument passed twice collects
    both gradients. A floating array argument of such a wrapper that reaches the op only after a
    computation (``relu_attention(2 * q, k, v)``) has a gradient :func:`vjp` cannot know: that is an
    error, never a silently missing term.
    """
    sources = {name: source for name, source in zip(rec.names, rec.sources)
               if source is not None and name != "key_mask"}
    try:
        bound = list(inspect.signature(fn).bind(*args, **kwargs).arguments)[:len(args)]
    except (TypeError, ValueError):
        bound = []
    by_name = {name: i for i, name in enumerate(bound)}
    if sources and all(name in by_name and args[by_name[name]] is source for name, source in sources.items()):
        return {name: [by_name[name]] for name in sources}
    positions = {name: [i for i, arg in enumerate(args) if arg is source] for name, source in sources.items()}
    used = {i for hits in positions.values() for i in hits}
    lost = [i for i, arg in enumerate(args) if i not in used and compat.is_array_api_obj(arg)
            and rec.xp.isdtype(arg.dtype, "real floating")]
    if lost:
        raise TypeError(f"vjp differentiates the arrays that {getattr(fn, '__name__', fn)!r} passes unchanged to "
                        f"one slicedkern op; its positional argument(s) {lost} do not reach the op as they are "
                        "(computed on first, or unused). Differentiate the computation with a framework's "
                        "autograd, or pass such arrays as keyword arguments (they get no gradient)")
    return positions


def _gradient_like(xp, grad, arg):
    """``grad`` in ``arg``'s dtype, an array as ``arg`` is: a NumPy reduction over every axis (the
    gradient of a 0-d parameter) gives a NumPy scalar, which ``asarray`` makes a 0-d array again."""
    return xp.asarray(xp.astype(grad, arg.dtype))


def _composite_vjp(fn, planner, args, kwargs):
    """vjp of a composite op: its plan's forward, and the plan's pullback mapped to the arguments."""
    plan = planner(*args, **kwargs)
    out = plan.forward()
    xp = plan.xp
    names = list(inspect.signature(fn).bind(*args, **kwargs).arguments)[:len(args)]

    def pullback(g):
        g = xp.asarray(g)
        if tuple(g.shape) != tuple(out.shape):
            raise ValueError(f"the cotangent must have the output's shape {tuple(out.shape)}, "
                             f"got {tuple(g.shape)}")
        grads = plan.pullback(xp.astype(g, plan.work_dtype))
        result = []
        for name, arg in zip(names, args):
            grad = grads.get(name)
            if grad is None or not compat.is_array_api_obj(arg) or not xp.isdtype(arg.dtype, "real floating"):
                result.append(None)
                continue
            result.append(_gradient_like(xp, sum_to(xp, grad, arg.shape), arg))
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
        with bounded memory), or a function that makes exactly one call of one of the five 1-D ops
        (the sliced ops are taken only themselves, not inside a wrapper).
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
        lambda, say), each of the op's inputs is found among ``fn``'s positional arguments by
        identity, so renaming or reordering is safe; a floating array argument that reaches the op
        only through a computation raises ``TypeError`` (its gradient would need that computation's).

    Examples
    --------
    >>> import numpy as np, slicedkern
    >>> q, k, v = np.array([[0.5]]), np.array([[0.0, 1.0]]), np.array([[[1.0], [3.0]]])
    >>> out, pullback = slicedkern.vjp(slicedkern.relu_attention, q, k, v)
    >>> dq, dk, dv = pullback(np.ones_like(out))
    >>> dv.shape
    (1, 2, 1)
    """
    planner = getattr(fn, "__slicedkern_planner__", None)
    if planner is not None:
        return _composite_vjp(fn, planner, args, kwargs)
    records: list = []
    token = recording.set(records)
    try:
        out = fn(*args, **kwargs)
    finally:
        recording.reset(token)
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
        grads = rec.engine.backward(rec.spec, rec.arrays, rec.out, rec.residuals, g, xp=xp)
        result = [None] * len(args)
        for name, grad in zip(rec.names, grads):
            if grad is None:
                continue
            if rec.squeeze and name == "w":
                grad = grad[..., 0]
            for index in positional.get(name, ()):
                original = args[index]
                term = _gradient_like(xp, sum_to(xp, grad, original.shape), original)
                result[index] = term if result[index] is None else result[index] + term
        return tuple(result)

    return out, pullback
