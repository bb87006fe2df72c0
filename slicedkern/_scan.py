"""The array-API sort-scan engine (SPEC §2.2): backend-neutral, GPU- and JIT-friendly.

For queries ``x`` (..., n), keys ``y`` (..., m) and weights ``w`` (..., m, c), every sum
``S_i = sum_j f(x_i - y_j) w_j`` with a piecewise-linear ``f`` is assembled from

* one stable sort of the keys, carrying the weights along (``perm``);
* one exclusive prefix sum of ``[w, y * w]`` over the sorted keys, in the work dtype (float64
  where the backend has it, SPEC §4);
* per knot ``t``, one batched rank search ``r = #{j : y_j <= x_i - t}`` and one gather:
  ``sum_j ReLU(x_i - t - y_j) w_j = s P0[r] - P1[r]`` and ``sum_j H(x_i - t - y_j) w_j = P0[r]``.

Queries stay in their own order: there is no inverse permutation and no scatter. Keys and queries
are shifted by the median key first, so that ``s P0 - P1`` cancels as little as possible for
scores far from zero.

Every function here takes ``xp`` explicitly and touches no framework-specific API; rank search goes
through :func:`slicedkern.backends.searchsorted_right`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import array_api_compat as compat

from .backends import searchsorted_right, take_rows

__all__ = ["Profile", "SortedKeys", "sort_keys", "knot_sums", "profile_sums"]


@dataclass(frozen=True)
class Profile:
    """``intercept + slope r + sum_m coeffs[m] ReLU(r - knots[m])`` with float or array parameters.

    Array parameters have the leading (batch) shape of the problem, or one that broadcasts to it;
    this is how per-head bandwidths enter. ``columns`` selects the weight columns the profile is
    summed over (a ``slice``); ``derivative=True`` asks for ``sum_j f'(x_i - y_j) w_j`` instead.
    """

    knots: tuple
    coeffs: tuple
    slope: Any = 0.0
    intercept: Any = 0.0
    columns: slice = field(default_factory=lambda: slice(None))
    derivative: bool = False

    @classmethod
    def of(cls, kernel, **kw) -> "Profile":
        return cls(tuple(kernel.knots), tuple(kernel.coeffs), kernel.slope, kernel.intercept, **kw)

    def reflect(self, **kw) -> "Profile":
        """The profile ``r -> f(-r)`` (see :meth:`PiecewiseLinear.reflect`), float or array params."""
        total, moment = 0.0, 0.0
        for t, c in zip(self.knots, self.coeffs):
            total = total + c
            moment = moment + c * t
        return Profile(tuple(-t for t in self.knots), self.coeffs, -self.slope - total,
                       self.intercept - moment, **kw)

    def with_(self, **kw) -> "Profile":
        return Profile(self.knots, self.coeffs, self.slope, self.intercept,
                       kw.get("columns", self.columns), kw.get("derivative", self.derivative))


class SortedKeys(NamedTuple):
    keys: Any     # (..., m) sorted keys minus ``shift``, a wide value
    prefix: Any   # (..., m + 1, 2c): exclusive prefix sums [P0 | P1] over the sorted keys, wide
    perm: Any     # (..., m) the sorting permutation
    shift: Any    # (..., 1) the median key subtracted from keys and queries


def _is_zero(value) -> bool:
    return isinstance(value, (int, float)) and value == 0


def _is_one(value) -> bool:
    return isinstance(value, (int, float)) and value == 1




def _batch(value, extra_dims: int):
    """A float stays a float; an array parameter of batch shape gets ``extra_dims`` trailing axes."""
    if isinstance(value, (int, float)):
        return value
    for _ in range(extra_dims):
        value = value[..., None]
    return value


def sort_keys(y, w, *, xp, ar) -> SortedKeys:
    """Sort ``y`` (..., m) once and build the exclusive prefix sums of ``[w, y w]`` (..., m, c).

    ``y`` must already be in the work dtype; ``w`` may be narrower (it is widened while the table is
    built, so the gather moves the narrow values). Leading shapes must be equal.
    """
    m = y.shape[-1]
    perm = xp.argsort(y, axis=-1, stable=True)
    keys = xp.take_along_axis(y, perm, axis=-1)
    mid = m // 2
    shift = keys[..., mid:mid + 1]
    keys = ar.shift(keys, shift)
    prefix = ar.table(keys, take_rows(xp, w, perm))
    return SortedKeys(keys, prefix, perm, shift)


def knot_sums(sk: SortedKeys, xs, knot, *, xp, ar, strict=False):
    """``(relu, step, rank)`` for one knot ``t`` and shifted queries ``xs`` (..., n).

    ``relu[..., i, :] = sum_j ReLU(xs_i - t - y_j) w_j`` and ``step[..., i, :] = sum_j H(xs_i - t - y_j)
    w_j`` (with ``H(0) = 1``), both (..., n, c); ``rank`` (..., n) is the number of keys ``<= xs_i - t``.
    """
    s = xs if _is_zero(knot) else ar.sub(xs, _batch(knot, 1))
    rank = searchsorted_right(xp, ar.hi(sk.keys), ar.hi(s), strict=strict)
    gathered = ar.gather(sk.prefix, rank)
    c = gathered.shape[-1] // 2
    step = gathered[..., :c]
    relu = ar.sub(ar.mul(s[..., None], step), gathered[..., c:])
    return relu, step, rank


def _knot_id(knot):
    return ("value", float(knot)) if isinstance(knot, (int, float)) else ("array", id(knot))


def profile_sums(xs, sk: SortedKeys, profiles: Sequence[Profile], *, xp, ar, strict=False):
    """Evaluate several profiles over column slices of one sorted key set, sharing rank searches.

    Parameters
    ----------
    xs : wide value, shape (..., n)
        Queries already shifted by ``sk.shift``.
    sk : SortedKeys
    profiles : sequence of Profile
        Knots equal by value (floats) or identity (arrays) are searched once for all profiles.
    strict : bool
        Step sums count keys ``< x - t`` instead of ``<=`` (``H(0) = 0``).

    Returns
    -------
    list of wide values (see :mod:`slicedkern._wide`), one per profile, shape (..., n, c_profile).
    """
    totals = sk.prefix[..., -1:, :]                      # (..., 1, 2c)
    c = totals.shape[-1] // 2
    total0, total1 = totals[..., :c], totals[..., c:]
    def add(total, term):
        return term if total is None else ar.add(total, term)

    def times(part, coeff):
        return part if _is_one(coeff) else ar.scale(part, _batch(coeff, 2))

    outs = []
    for prof in profiles:
        cols = prof.columns
        out = None
        if prof.derivative:
            if not _is_zero(prof.slope):
                out = times(total0[..., cols], prof.slope)
        else:
            if not _is_zero(prof.intercept):
                out = times(total0[..., cols], prof.intercept)
            if not _is_zero(prof.slope):
                linear = ar.sub(ar.mul(xs[..., None], total0[..., cols]), total1[..., cols])
                out = add(out, times(linear, prof.slope))
        outs.append(out)

    order: dict = {}
    for p, prof in enumerate(profiles):
        for knot, coeff in zip(prof.knots, prof.coeffs):
            order.setdefault(_knot_id(knot), (knot, []))[1].append((p, coeff))
    for knot, users in order.values():
        relu, step, _ = knot_sums(sk, xs, knot, xp=xp, ar=ar, strict=strict)
        for p, coeff in users:
            prof = profiles[p]
            outs[p] = add(outs[p], times((step if prof.derivative else relu)[..., prof.columns], coeff))

    n = xs.shape[-1]
    for p, (out, prof) in enumerate(zip(outs, profiles)):
        width = total0[..., prof.columns].shape[-1]
        zeros = ar.lift(xp.zeros(tuple(xs.shape) + (width,), dtype=ar.hi(xs).dtype,
                                 device=compat.device(ar.hi(xs))))
        if out is None or out.shape[-2] != n or tuple(out.shape) != tuple(zeros.shape):
            outs[p] = zeros if out is None else ar.add(zeros, out)
    return outs
