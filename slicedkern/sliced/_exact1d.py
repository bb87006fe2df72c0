"""The exact 1-D energy distance: the CDF gap integrated over the pooled sample, error-free.

For samples ``x`` (weights ``a``) and ``y`` (weights ``b``), probability weights, the gap
``D = F - G`` between the empirical CDFs is a step function that jumps at the pooled, sorted sample
``z_1 <= ... <= z_N`` (``N = n + m``) by the signed weight of the point (``+a_i`` or ``-b_j``)::

    ED = 2 E|X - Y| - E|X - X'| - E|Y - Y'| = 2 int (F - G)^2 = 2 sum_k D_k^2 (z_{k+1} - z_k)

(docs/mathematics.rst, "Exact 1-D statistics"). Every term is non-negative, so the sum is as
accurate as its terms. The difficulty is ``D_k``: when the samples are alike, ``D_k`` is of order
``N^{-1/2}`` while ``F`` and ``G`` are of order 1, and an error *correlated* along ``k`` (a rounded
``1 / n``, a rounded normaliser ``sum a``, a running sum's rounding) is relative to ``F``, not to
``D``: a plain ``cumsum`` of normalised weights loses ``~ sqrt(N) eps`` (``1e-13`` at ``N = 2e7``).
Here ``D_k`` is formed without such errors:

* unweighted: ``D_k = (i_k m - j_k n) / (n m)`` with the counts ``i_k``, ``j_k`` of points of ``x``
  and ``y`` among the first ``k``: an integer numerator (exact below ``2^53``) and one common factor;
* weighted, with raw weight sums ``S``, ``T``: ``D_k = E_k / (S T)``, ``E_k = T A_k - S B_k`` the
  running sum of the cross-scaled weights ``a_i T`` and ``-b_j S``. ``S``, ``T`` are summed exactly
  (split on a common grid), the products are exact (Dekker's two-product), and each product is
  split into a part on the grid ``ulp(3 S T)`` (whose partial sums are exact in any order) and a
  remainder of the size of ``eps S T``. What is left are independent roundings of single terms.

NumPy float64 samples take the compiled merge of the backend registry
(``slicedkern/backends/_merge1d.py``, same arithmetic); every other case the array-API version
here, on the pooled sample sorted by a stable ``argsort``, which torch autograd and ``jax.grad``
differentiate (the permutation is a constant of the derivative).
"""

from __future__ import annotations

from .._lib.namespace import array_device, scalar
from .._lib.typing import Array, Namespace
from ..backends import accurate_sum, energy_distance_rows, is_traced

__all__ = ["energy_distance_1d", "finite_rows", "take", "two_sum"]

#: Dekker's splitting constant ``2^ceil(p/2) + 1`` for ``p`` bits of mantissa.
_SPLIT = {53: 134217729.0, 24: 4097.0}

#: Weights whose row sum leaves ``[2^-_SCALE_AT, 2^_SCALE_AT]`` are multiplied by ``2^-+_SCALE_BY``
#: first (exact: a power of two), so that ``S T`` and the split products neither overflow nor
#: underflow; the power of two cancels in ``a / S``.
_SCALE_AT = {53: 300, 24: 30}
_SCALE_BY = {53: 400, 24: 40}


# ----------------------------------------------------------------------- error-free arithmetic
def two_sum(a, b):
    """``(s, e)`` with ``s = fl(a + b)`` and ``s + e = a + b`` exactly (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _split(a, factor):
    """Veltkamp's split ``a = hi + lo`` into halves whose products with other halves are exact."""
    c = factor * a
    hi = c - (c - a)
    return hi, a - hi


def _two_prod(a, b, b_hi, b_lo, factor):
    """``(p, e)`` with ``p = fl(a b)`` and ``p + e = a b`` exactly (Dekker; ``b`` pre-split)."""
    p = a * b
    a_hi, a_lo = _split(a, factor)
    return p, ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo


def _on_grid(v, big):
    """``v`` rounded to a multiple of ``ulp(big)`` (``|v| <= big``): ``(v + big) - big`` is exact
    (Sterbenz), and ``v`` minus it is exact too."""
    return (v + big) - big


def _exact_sum(xp, w):
    """Sum of ``w >= 0`` along the last axis as a pair ``(s, e)``, ``s + e`` within ``~ L eps^2``.

    The parts of ``w`` on the grid ``ulp(3 sum w)`` add up exactly in any order (their partial sums
    stay below ``2^53`` grid units); the remainders are below one grid unit each.
    """
    big = 3.0 * xp.sum(w, axis=-1, keepdims=True)
    hi = _on_grid(w, big)
    return two_sum(xp.sum(hi, axis=-1, keepdims=True), xp.sum(w - hi, axis=-1, keepdims=True))


def _rescale(xp, w, bits):
    """``w`` times a power of two that brings its row sums into ``[2^-k, 2^k]`` (exact)."""
    k, by = _SCALE_AT[bits], _SCALE_BY[bits]
    total = xp.sum(w, axis=-1, keepdims=True)
    one = xp.ones_like(total)
    return w * xp.where(total > 2.0 ** k, 2.0 ** -by * one, xp.where(total < 2.0 ** -k, 2.0 ** by * one, one))


# ------------------------------------------------------------------------------ the pooled sample
def take(xp, a, idx):
    return xp.take_along_axis(a, idx, axis=-1)


def pooled(xp, x, y, batch):
    """The pooled sample broadcast to ``batch``, (..., N), and its stable sort permutation."""
    n, m = x.shape[-1], y.shape[-1]
    z = xp.concat([xp.broadcast_to(x, tuple(batch) + (n,)), xp.broadcast_to(y, tuple(batch) + (m,))], axis=-1)
    return z, xp.argsort(z, axis=-1, stable=True)


def _gap(xp, perm, a, b, *, n, m, batch, work):
    """The CDF gap ``D_k`` after each sorted pooled point, (..., N), on ``perm``'s device; the last
    entry is zero in exact arithmetic. ``a``, ``b``: raw weights or ``None`` (module docstring)."""
    device = array_device(perm)
    if a is None and b is None:
        i = xp.cumulative_sum(xp.astype(perm < n, work), axis=-1)
        k = xp.arange(1, n + m + 1, dtype=work, device=device)
        return (i * float(n + m) - k * float(n)) * (1.0 / (float(n) * float(m)))
    bits = 53 if work == xp.float64 else 24
    factor = _SPLIT[bits]
    a = xp.ones((n,), dtype=work, device=device) if a is None else _rescale(xp, a, bits)
    b = xp.ones((m,), dtype=work, device=device) if b is None else _rescale(xp, b, bits)
    s1, s2 = _exact_sum(xp, a)                      # S = s1 + s2, T = t1 + t2
    t1, t2 = _exact_sum(xp, b)
    big = 3.0 * (s1 * t1)                            # the grid of the exact running sum: ulp(big)

    def cross(w, c1, c2):
        """``w (c1 + c2)`` as an on-grid part and a small remainder."""
        c_hi, c_lo = _split(c1, factor)
        prod, err = _two_prod(w, c1, c_hi, c_lo, factor)
        on = _on_grid(prod, big)
        return on, (prod - on) + (err + w * c2)

    ax_on, ax_off = cross(a, t1, t2)
    by_on, by_off = cross(b, s1, s2)
    shape_x, shape_y = tuple(batch) + (n,), tuple(batch) + (m,)
    on = xp.concat([xp.broadcast_to(ax_on, shape_x), -xp.broadcast_to(by_on, shape_y)], axis=-1)
    off = xp.concat([xp.broadcast_to(ax_off, shape_x), -xp.broadcast_to(by_off, shape_y)], axis=-1)
    e = xp.cumulative_sum(take(xp, on, perm), axis=-1) + xp.cumulative_sum(take(xp, off, perm), axis=-1)
    st = (s1 * t1) * (1.0 + s2 / s1 + t2 / t1)      # S T to a few ulps: a common factor of every D_k
    return e * (1.0 / st)


def finite_rows(xp, batch, *arrays):
    """Whether every value of a batch row of the (..., L) ``arrays`` (``None`` skipped) is finite."""
    ok = None
    for a in arrays:
        if a is not None:
            flags = xp.all(xp.isfinite(a), axis=-1)
            ok = flags if ok is None else ok & flags
    return xp.broadcast_to(ok, tuple(batch))


def energy_distance_1d(xp: Namespace, x: Array, y: Array, a: Array | None, b: Array | None, *,
                       batch: tuple, device, work) -> Array:
    """``2 int (F - G)^2`` of the rows of ``x`` (..., n) and ``y`` (..., m) with raw non-negative
    weights ``a`` (..., n), ``b`` (..., m) or ``None`` (uniform), all in the work dtype; shape
    ``batch`` (the broadcast of the leading shapes), NaN on rows with a non-finite value."""
    if not any(is_traced(v) for v in (x, y, a, b) if v is not None):
        fast = energy_distance_rows(xp, x, y, a, b, batch)
        if fast is not None:
            return xp.asarray(fast)
    n, m = x.shape[-1], y.shape[-1]
    z, perm = pooled(xp, x, y, batch)
    zs = take(xp, z, perm)
    d = _gap(xp, perm, a, b, n=n, m=m, batch=batch, work=work)[..., :-1]
    ed = 2.0 * accurate_sum(xp, d * d * (zs[..., 1:] - zs[..., :-1]))
    nan = scalar(xp, float("nan"), dtype=work, device=device)
    return xp.where(finite_rows(xp, batch, x, y, a, b), ed, nan)
