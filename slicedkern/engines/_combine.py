"""The attention arithmetic, written once: from a query's sums to its output, and back.

Every engine reduces attention to sums over the keys a query sees (docs/mathematics.rst,
"Attention"): ``N`` (the profile over the values), ``R`` (the profile over the valid-key
indicator), ``D`` (the normaliser's profile over it), and the totals of the values and of the
indicator (the count). :func:`combine` turns them into the output, centring, normaliser and NaN rule
included; :func:`pullback` is its derivative, the quotient rule that turns the output's cotangent
into the sums' cotangents. The divisor's clamp rule is :meth:`slicedkern._spec.Normalizer.divisor`.

Who calls what: the scan's causal mode, :class:`~slicedkern.engines.scan._decode.Runs` and the
sharded engine combine explicit sums here; the scan's non-causal forward and the triton kernels fold
the centring into their gathers and take the divisor from the same rule; every backward but the
sweep's fused one (which the tests hold equal to it) pulls back here (:mod:`._vjp`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .._lib.namespace import array_device, clamp_min, scalar
from .._spec import Normalizer

__all__ = ["combine", "empty_attention", "pullback", "row_dot", "Cotangents"]


def empty_attention(xp, q, k, v, key_mask):
    """Attention with no query or no key (``Lq == 0`` or ``Lk == 0``), causal or not: a zero
    (..., Lq, Dv) output and the residuals of :meth:`~slicedkern.engines.Engine.aux_of`, the keys
    that take part, a zero ReLU count and a zero normaliser sum; every engine's forward returns this."""
    dt, dev = q.dtype, array_device(q)
    # a copy of the mask: torch's autograd refuses to save an input returned as it is
    take = xp.ones(k.shape, dtype=xp.bool, device=dev) if key_mask is None else xp.astype(key_mask, xp.bool, copy=True)
    zeros = xp.zeros(q.shape + (1,), dtype=dt, device=dev)
    return xp.zeros(q.shape + (v.shape[-1],), dtype=dt, device=dev), {"take": take, "relu_count": zeros, "den": zeros}


def combine(xp, ar, num_r, den_sum, totals, good, *, center: bool, normalizer: Normalizer, dv: int):
    """The attention of every query from its sums.

    Parameters
    ----------
    xp : namespace
    ar : wide arithmetic
        :func:`slicedkern.engines.sortscan.wide.arithmetic` of the work dtype (``Plain`` for plain arrays).
    num_r : wide (..., n, dv + 1)
        ``[N, R]``: the value sums and the indicator's.
    den_sum : wide (..., n, 1) or None
        The normaliser's profile over the indicator (``None`` unless ``normalizer.summed``).
    totals : wide (..., n, dv + 1)
        The values' sum and the count of the keys each query sees.
    good : bool array (..., n)
        False where the NaN rule makes the row NaN.
    center : bool
        Centre the values on the mean over the keys seen, as ``N - mean R`` (no centred copy).
    normalizer : Normalizer
    dv : int

    Returns
    -------
    out : (..., n, dv) plain, work dtype
    relu_count : (..., n, 1) plain, ``R``
    den : (..., n, 1) plain, the unclamped normaliser sum, or None
    """
    count = ar.value(totals[..., dv:dv + 1])[..., 0]                        # (..., n), exact integers
    raw_den = ar.value(den_sum) if normalizer.summed else None
    den = normalizer.divisor(xp, count, None if raw_den is None else raw_den[..., 0])
    num = num_r[..., :dv]
    relu_count = num_r[..., dv:dv + 1]
    if center:
        mean = ar.div(totals[..., :dv], clamp_min(xp, count, 1.0)[..., None])
        num = ar.sub(num, ar.mul(mean, relu_count))
    nan = scalar(xp, float("nan"), dtype=count.dtype, device=array_device(count))
    divisor = xp.where(good, xp.broadcast_to(den, count.shape), nan)
    return ar.value(ar.div(num, divisor[..., None])), ar.value(relu_count), raw_den


class Cotangents(NamedTuple):
    """The cotangents of the sums :func:`combine` read, from :func:`pullback`."""

    scale: Any              # (..., lq, 1): the cotangent of N is ``gout * scale`` (not materialised here)
    relu_count: Any         # (..., lq, 1): of R (centring), or None
    den: Any                # (..., lq, 1): of D (a summed normaliser), or None
    mean_weights: Any       # (..., lq, 1): R / count, what the centring mean's cotangent carries, or None


def row_dot(xp, a, b):
    """``<a_i, b_i>`` for every row ``i``: (..., lq, 1) in ``a``'s dtype, ``a`` (..., lq, dv) and ``b``
    (..., lq or 1, dv) (lifted to ``a``'s dtype). One ``b`` row for every query is a matrix product,
    which broadcasts no (lq, dv) copy of it."""
    b = xp.astype(b, a.dtype)
    return a @ xp.matrix_transpose(b) if b.shape[-2] == 1 else xp.vecdot(a, b)[..., None]


def pullback(xp, gout, out, *, relu_count, den, count, value_sums, good, center: bool,
             normalizer: Normalizer, dot=None, value_dots=None) -> Cotangents:
    """The quotient rule of :func:`combine` (docs/mathematics.rst, "The backward pass").

    ``gout`` and ``out`` (..., lq, dv); ``relu_count`` and ``den`` (..., lq, 1) the
    forward's ``R`` and unclamped ``D`` (``den`` read only when ``normalizer.summed``); ``count``
    (..., lq or 1, 1) the valid keys seen; ``value_sums`` (..., lq or 1, dv) the sum of their values
    (read only when centring; values are zero on the keys that take no part); ``good`` (..., lq, 1)
    bool, False on the rows the forward made NaN. A clamped normaliser (``D < eps``) is a constant:
    no cotangent reaches ``D`` there. ``dot(a, b)``: the row dots, (..., lq, 1) in the work dtype
    (``count``'s), :func:`row_dot` by default (``gout`` then in the work dtype); an engine passes
    its own to read ``gout`` and ``out`` in their dtypes (the triton engine's kernel).
    ``value_dots`` (..., lq, 1): ``dot(gout, value_sums)`` where an engine sums them as it reads the
    values (the triton engine's causal backward), ``value_sums`` then unread.

    The cotangent of ``N`` is ``gout`` times a per-query factor: it is returned as that factor
    (``scale``), so that an engine that reads ``gout`` in its kernels scales it there and no
    ``(lq, dv)`` array of it is written (the triton engine; docs/architecture.rst, "Engines").
    """
    work = count.dtype
    if dot is None:
        def dot(a, b):
            return row_dot(xp, a, b)
    zero = xp.zeros((), dtype=work, device=array_device(count))
    den_c = normalizer.divisor(xp, count, den)
    scale = xp.broadcast_to(xp.astype(good, work) / den_c, good.shape)
    count_c = clamp_min(xp, count, 1.0)
    cot_r = None
    if center:
        # the row dots of the sums, divided after: no (lq, dv) array of the means
        cot_r = -(scale * (dot(gout, value_sums) if value_dots is None else value_dots) / count_c)
    cot_den = None
    if normalizer.summed:
        cot_den = xp.where(good & (den >= normalizer.eps), -dot(gout, out) / den_c, zero)
    return Cotangents(scale, cot_r, cot_den, relu_count / count_c if center else None)
