"""The array-API sort-scan: backend-neutral, GPU- and JIT-friendly.

docs/mathematics.rst, "The kernel sum by sort-scan", has the derivation.

For queries ``x`` (..., n), keys ``y`` (..., m) and weights ``w`` (..., m, c), every sum
``S_i = sum_j f(x_i - y_j) w_j`` with a piecewise-linear ``f`` is assembled from

* one stable sort of the keys, carrying the weights along (``perm``);
* one exclusive prefix sum of ``[w, y * w]`` over the sorted keys, in the work dtype (float64
  where the backend has it: docs/mathematics.rst, "Numerics");
* per knot ``t``, one batched rank search ``r = #{j : y_j <= x_i - t}``:
  ``sum_j ReLU(x_i - t - y_j) w_j = s P0[r] - P1[r]`` and ``sum_j H(x_i - t - y_j) w_j = P0[r]``;
* per profile, one *combination*: ``sum_k a_k[i] * table[r_k[i]]``, the rows of every knot (and the
  totals row, for the linear part) gathered, weighted per query and summed in one step
  (:func:`combine_sums`, ``ar.combine``; on torch one ``embedding_bag``), so that the (n, c) result
  is written once, with any per-query factor (a normaliser) folded into the weights.

Queries stay in their own order: there is no inverse permutation and no scatter. Keys and queries
are shifted by the median key first, so that ``s P0 - P1`` cancels as little as possible for
scores far from zero.

Every function here takes ``xp`` explicitly and touches no framework-specific API; rank search goes
through the backend registry (:func:`slicedkern.backends.searchsorted_right`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from ..._lib.namespace import array_device, scalar
from ...backends import searchsorted_right
from ...kernels import Profile
from .wide import is_one, two_sum

__all__ = ["SortedKeys", "Queries", "sort_keys", "queries", "knot_sums", "profile_sums",
           "searches", "profile_terms", "combine_sums"]


class SortedKeys(NamedTuple):
    keys: Any     # (..., m) the sorted keys themselves (ties are decided on them, exactly)
    prefix: Any   # (..., m + 1, 2c): exclusive prefix sums [P0 | P1] over the sorted keys, wide
    shift: Any    # (..., 1) the median key, subtracted from keys and queries in the arithmetic


class Queries(NamedTuple):
    """Queries as the sort-scan uses them: ``raw`` to decide ties exactly, ``wide`` for arithmetic."""

    raw: Any      # (..., n) the queries, plain
    wide: Any     # (..., n) the queries minus the keys' ``shift``, a wide value

    @property
    def shape(self):
        return self.raw.shape


def queries(x, sk: SortedKeys, *, ar) -> Queries:
    """``x`` (..., n) prepared for :func:`profile_sums` against the keys ``sk``."""
    return Queries(x, ar.shift(x, sk.shift))


def _is_zero(value) -> bool:
    return isinstance(value, (int, float)) and value == 0


def _batch(value, extra_dims: int):
    """A float stays a float; an array parameter of batch shape gets ``extra_dims`` trailing axes."""
    if isinstance(value, (int, float)):
        return value
    for _ in range(extra_dims):
        value = value[..., None]
    return value


def sort_keys(y, w, *, xp, ar, take=None, ones=False) -> SortedKeys:
    """Sort ``y`` (..., m) once and build the exclusive prefix sums of ``[w, y w]`` (..., m, c).

    ``y`` must already be in the work dtype; ``w`` may be narrower (it is widened while the table is
    built, so the gather moves the narrow values). Leading shapes must be equal. ``ones`` appends a
    weight column of ones (the valid-key indicator of attention, without a concatenated copy of
    ``w``); ``take`` (..., m) zeroes the weights (that column included) of the keys that take no
    part, whatever they hold.
    """
    m = y.shape[-1]
    perm = xp.argsort(y, axis=-1, stable=True)
    keys = xp.take_along_axis(y, perm, axis=-1)
    mid = m // 2
    shift = keys[..., mid:mid + 1]
    prefix = ar.table(ar.shift(keys, shift), w, perm, take=take, ones=ones)
    return SortedKeys(keys, prefix, shift)


def knot_sums(sk: SortedKeys, xs: Queries, knot, *, xp, ar, strict=False):
    """``(relu, step, rank)`` for one knot ``t`` and queries ``xs`` (..., n).

    ``relu[..., i, :] = sum_j ReLU(xs_i - t - y_j) w_j`` and ``step[..., i, :] = sum_j H(xs_i - t - y_j)
    w_j`` (with ``H(0) = 1``), both (..., n, c); ``rank`` (..., n) is the number of keys ``<= xs_i - t``.
    """
    s, rank = _search(sk, xs, knot, xp=xp, ar=ar, strict=strict)
    gathered = ar.gather(sk.prefix, rank)
    c = gathered.shape[-1] // 2
    step = gathered[..., :c]
    relu = ar.sub(ar.mul(s[..., None], step), gathered[..., c:])
    return relu, step, rank


def _search(sk: SortedKeys, xs: Queries, knot, *, xp, ar, strict):
    """``(s, rank)``: the shifted queries ``s = x - t - shift`` and their rank among the sorted keys.

    The rank counts the keys ``y <= x - t`` (``<`` when ``strict``) exactly, whatever the rounding:
    it is decided on the unshifted values, with ``fl(x - t)`` moved down one ulp when the exact
    difference lies below it (its TwoSum error), so that a tie ``x - y = t`` is a tie in every
    engine and both passes of the backward count it on the same side.
    """
    s = xs.wide if _is_zero(knot) else ar.sub(xs.wide, _batch(knot, 1))
    x = xs.raw
    if _is_zero(knot):
        threshold = _next_below(xp, x) if strict else x
    else:
        rounded, error = two_sum(x, -_batch(knot, 1))      # x - t = rounded + error, exactly
        below = _next_below(xp, rounded)
        threshold = (xp.where(error > 0, rounded, below) if strict else
                     xp.where(error < 0, below, rounded))
    return s, searchsorted_right(xp, sk.keys, threshold)


def _next_below(xp, a):
    """The largest value below ``a``: ``nextafter(a, -inf)``, also where subnormals are flushed.

    XLA on CPU flushes subnormal results to zero, so ``nextafter(0, -inf)`` comes back as ``-0.0``
    there, and a strict count ``y < 0`` would count the keys equal to 0. Where that happens the
    subnormals themselves compare as zero too, so ``-smallest_normal`` is the next value below.
    """
    down = scalar(xp, -float("inf"), dtype=a.dtype, device=array_device(a))
    below = xp.nextafter(a, down)
    tiny = scalar(xp, -xp.finfo(a.dtype).smallest_normal, dtype=a.dtype, device=array_device(a))
    return xp.where(below == a, tiny, below)


def _knot_id(knot):
    return ("value", float(knot)) if isinstance(knot, (int, float)) else ("array", id(knot))


def searches(xs: Queries, sk: SortedKeys, profiles: Sequence[Profile], *, xp, ar, strict=False) -> dict:
    """One rank search per distinct knot of ``profiles`` (equal by value, or arrays by identity)."""
    found: dict = {}
    for prof in profiles:
        for knot in prof.knots:
            if _knot_id(knot) not in found:
                found[_knot_id(knot)] = (knot, _search(sk, xs, knot, xp=xp, ar=ar, strict=strict))
    return found


def profile_terms(prof: Profile, xs: Queries, found: dict, *, ar) -> list:
    """The profile sum as ``combine`` terms ``(rank or None, part, weight)``.

    Value: ``sum_m c_m (s_m P0[r_m] - P1[r_m]) + (intercept + slope xs) P0[m] - slope P1[m]``;
    derivative: ``sum_m c_m P0[r_m] + slope P0[m]`` (``[m]``: the totals row).
    """
    terms = []
    for knot, coeff in zip(prof.knots, prof.coeffs):
        if _is_zero(coeff):
            continue
        s, rank = found[_knot_id(knot)][1]
        coeff = _batch(coeff, 1)
        if prof.derivative:
            terms.append((rank, 0, coeff))
        else:
            terms.append((rank, 0, s if is_one(coeff) else ar.scale(s, coeff)))
            terms.append((rank, 1, -coeff))
    slope, intercept = _batch(prof.slope, 1), _batch(prof.intercept, 1)
    if prof.derivative:
        if not _is_zero(slope):
            terms.append((None, 0, slope))
    else:
        linear = None if _is_zero(slope) else (xs.wide if is_one(slope) else ar.scale(xs.wide, slope))
        if not _is_zero(intercept):
            linear = intercept if linear is None else ar.add(linear, intercept)
        if linear is not None:
            terms.append((None, 0, linear))
        if not _is_zero(slope):
            terms.append((None, 1, -slope))
    return terms


def combine_sums(xs: Queries, sk: SortedKeys, terms, columns, *, xp, ar, divisor=None, cache=None):
    """``sum(terms) / divisor`` over ``columns`` of the table: a wide (..., n, ncols) value.

    ``terms`` as :func:`profile_terms` makes them (zeros if there is none); ``divisor`` (..., n), plain.
    """
    width = len(range(sk.prefix.shape[-1] // 2)[columns])
    shape = tuple(xs.shape) + (width,)
    out = ar.combine(sk.prefix, terms, columns, divisor=divisor, cache=cache) if terms else None
    if out is None or tuple(out.shape) != shape:
        zeros = ar.lift(xp.zeros(shape, dtype=xs.raw.dtype, device=array_device(xs.raw)))
        if out is None and divisor is not None:
            out = ar.div(zeros, divisor[..., None])        # NaN where the divisor is
        out = zeros if out is None else ar.add(zeros, out)
    return out


def profile_sums(xs: Queries, sk: SortedKeys, profiles: Sequence[Profile], *, xp, ar, strict=False):
    """Evaluate several profiles over column slices of one sorted key set, sharing rank searches.

    Parameters
    ----------
    xs : Queries, shape (..., n)
        From :func:`queries`.
    sk : SortedKeys
    profiles : sequence of Profile
        Knots equal by value (floats) or identity (arrays) are searched once for all profiles.
    strict : bool
        Count keys ``< x - t`` instead of ``<=``: step sums get ``H(0) = 0``. Value sums do not depend
        on it (``ReLU(0) = 0``) except through rounding: the forward passes ``strict=True``, so a query
        on or below every key gets an exactly zero ReLU sum rather than a residue of ``s P0 - P1`` that
        an ``eps``-clamped normaliser would amplify (and both engines agree on it).

    Returns
    -------
    list of wide values (see :mod:`slicedkern.engines.sortscan.wide`), one per profile, shape (..., n, c_profile).
    """
    found = searches(xs, sk, profiles, xp=xp, ar=ar, strict=strict)
    cache: dict = {}
    return [combine_sums(xs, sk, profile_terms(prof, xs, found, ar=ar), prof.columns, xp=xp, ar=ar,
                         cache=cache) for prof in profiles]
