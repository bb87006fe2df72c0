"""Backend-neutral compositions on top of the sort-scan: kernel sums and attention.

Inputs arrive validated and in the work dtype; results leave in the work dtype (the public layer
casts back). The NaN policy (SPEC §4) is applied here once for every engine: a non-finite query
makes its row NaN, a non-finite (unmasked) key or value makes its whole batch row NaN. Offending
scores are replaced by zeros before any arithmetic, and so are offending weights, so that no backend
warns or traps on them -- except where the backend lets them pass quietly (torch): there a weight's
check is deferred to its row's totals (see :func:`_screen`). The policy reaches the output as the
per-query divisor of the final combination (NaN where bad), not as a pass over the output.
"""

from __future__ import annotations

import array_api_compat as compat

from ._scan import Profile, combine_sums, profile_terms, searches, sort_keys, queries
from ._namespace import clamp_min
from ._wide import arithmetic
from .backends import finite_rows, quiet_nonfinite

__all__ = ["kernel_sum", "attention"]


def _fill_masked(xp, y, take, key_mask):
    """Zero ``y`` where it takes no part; masked keys sit at the mean of the valid ones instead."""
    zero = xp.asarray(0.0, dtype=y.dtype, device=compat.device(y))
    y = xp.where(take, y, zero)
    if key_mask is not None:
        # Masked keys sit at the mean of the valid ones: they stay out of the sums (zero weight)
        # and out of the way of the median shift, which keeps s P0 - P1 from cancelling.
        count = xp.sum(xp.astype(take, y.dtype), axis=-1, keepdims=True)
        fill = xp.sum(y, axis=-1, keepdims=True) / clamp_min(xp, count, 1.0)
        y = xp.where(take, y, fill)
    return y


def sanitize_keys(xp, x, y, w, key_mask):
    """Zero the entries the NaN policy excludes; return ``(x, y, w, q_ok, row_ok)``.

    The backward's form of :func:`_screen` (every weight checked now): ``y`` is made finite as there,
    ``w`` is zeroed on masked keys and bad rows (keeping its dtype); ``q_ok`` (..., n) marks finite
    queries, ``row_ok`` (...) batch rows whose participating keys and weights are all finite.
    """
    sc = _screen(xp, x, y, w, key_mask, defer=False)
    w_zero = xp.asarray(0.0, dtype=w.dtype, device=compat.device(w))
    return sc.x, sc.y, xp.where(sc.take[..., None], w, w_zero), sc.q_ok, sc.row_ok


class _Screened:
    """The scores made finite, and how the NaN policy reaches the weights (see :func:`_screen`)."""

    def __init__(self, x, y, q_ok, row_ok, take, table_take, deferred):
        self.x, self.y, self.q_ok, self.row_ok = x, y, q_ok, row_ok
        self.take, self.table_take, self.deferred = take, table_take, deferred

    def settle(self, xp, totals, c):
        """With the weights' check deferred: fold the finiteness of the row totals into ``row_ok``."""
        if self.deferred:
            self.row_ok = self.row_ok & xp.isfinite(xp.sum(totals[..., 0, :c], axis=-1))
            self.take = self.take & self.row_ok[..., None]

    def divisor(self, xp, den):
        """``den`` broadcast to (..., n), NaN on bad queries and bad rows (SPEC §4): the one place
        the policy touches the output, as the factor the combination divides by."""
        good = self.q_ok & self.row_ok[..., None]
        nan = xp.asarray(float("nan"), dtype=self.x.dtype, device=compat.device(self.x))
        if isinstance(den, (int, float)):
            den = xp.asarray(float(den), dtype=self.x.dtype, device=compat.device(self.x))
        return xp.where(good, den, nan)


def _screen(xp, x, y, w, key_mask, *, defer) -> _Screened:
    """The NaN policy's screening of queries ``x``, keys ``y`` and weights ``w`` (..., m, c).

    Scores are cheap to screen: non-finite queries and keys (taking part) are found and replaced
    by zeros here. The weights are ``m c`` values: where the backend lets non-finite values pass
    quietly and the weights are narrower than the work dtype (so that no sum of finite ones can
    overflow), their check is *deferred* to the totals of the prefix table, and only masked keys
    are kept out of it; otherwise every weight is checked now and bad rows are zeroed in the table.
    ``defer`` says which (see :func:`_can_defer`).
    """
    q_ok = xp.isfinite(x)
    k_ok = xp.isfinite(y)
    if key_mask is not None:
        k_ok = k_ok | ~key_mask
    row_ok = xp.all(k_ok, axis=-1)
    if not defer:
        row_ok = row_ok & finite_rows(xp, w, key_mask)
    take = xp.broadcast_to(row_ok[..., None], y.shape)
    if key_mask is not None:
        take = take & key_mask
    y = _fill_masked(xp, y, take, key_mask)
    zero = xp.asarray(0.0, dtype=x.dtype, device=compat.device(x))
    x = xp.where(q_ok, x, zero)
    return _Screened(x, y, q_ok, row_ok, take, key_mask if defer else take, defer)


def _can_defer(xp, ar, x, w) -> bool:
    """Whether the weights' finiteness check can wait for the row totals (see :func:`_screen`)."""
    return (quiet_nonfinite(xp) and not ar.wide
            and xp.finfo(w.dtype).bits < xp.finfo(x.dtype).bits)


def kernel_sum(x, y, w, profile: Profile, *, xp):
    """``S[..., i, :] = sum_j f(x_i - y_j) w[..., j, :]``; x (..., n), y (..., m), w (..., m, c).

    Leading shapes must already be equal.
    """
    n, m, c = x.shape[-1], y.shape[-1], w.shape[-1]
    if m == 0 or n == 0:
        return xp.zeros(x.shape + (c,), dtype=x.dtype, device=compat.device(x))
    ar = arithmetic(xp, x.dtype)
    sc = _screen(xp, x, y, w, None, defer=_can_defer(xp, ar, x, w))
    sk = sort_keys(sc.y, w, xp=xp, ar=ar, take=sc.table_take)
    sc.settle(xp, ar.value(sk.prefix[..., -1:, :]), c)
    xs = queries(sc.x, sk, ar=ar)
    found = searches(xs, sk, [profile], xp=xp, ar=ar, strict=True)
    out = combine_sums(xs, sk, profile_terms(profile, xs, found, ar=ar), profile.columns, xp=xp, ar=ar,
                       divisor=sc.divisor(xp, 1.0))
    return ar.value(out)


def attention(q, k, v, profile: Profile, *, key_mask, center: bool, normalizer, eps: float, xp):
    """Normalised kernel attention, SPEC §2.3; returns ``(out, aux)``.

    Parameters
    ----------
    q : (..., Lq), k : (..., Lk), v : (..., Lk, Dv), key_mask : (..., Lk) bool or None
        Equal leading shapes; q and k in the work dtype, v in any floating dtype.
    profile : Profile
        The value kernel ``f``.
    center : bool
        Use ``v_j - mean_valid(v)``; folded in as ``N - mu R`` (``R`` = kernel sum of the valid-key
        indicator) so that no centred copy of ``v`` is rounded.
    normalizer : Profile, "count" or None
        A profile is summed over the valid-key indicator and clamped below by ``eps``; "count" divides
        by ``max(n_valid, 1)``.

    Returns
    -------
    out : (..., Lq, Dv) in the work dtype
    aux : dict
        What the backward needs besides the inputs: ``take`` (..., Lk) the keys that took part,
        ``relu_count`` (..., Lq, 1) the profile summed over them, ``den`` (..., Lq, 1) the
        unclamped normaliser sum (profile normalisers only).

    Notes
    -----
    One prefix table of ``[v, 1]`` (the indicator column is written into the table, not concatenated
    to ``v``); the per-query sums of the indicator column (``R``, the normaliser) come first, then the
    whole numerator is one combination of gathered rows: ``(sum_m c_m (s_m P0 - P1) - (R / n_valid)
    P0[total]) / den``, the centring being the last term and the normaliser and the NaN policy one
    divisor per query. Everything of size (Lq, Dv) is written once, in the work dtype.
    """
    lq, lk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    dt, dev = q.dtype, compat.device(q)
    if lq == 0 or lk == 0:
        take = xp.ones(k.shape, dtype=xp.bool, device=dev) if key_mask is None else key_mask
        zeros = xp.zeros(q.shape + (1,), dtype=dt, device=dev)
        return xp.zeros(q.shape + (dv,), dtype=dt, device=dev), {"take": take, "relu_count": zeros,
                                                                  "den": zeros}
    ar = arithmetic(xp, dt)
    sc = _screen(xp, q, k, v, key_mask, defer=_can_defer(xp, ar, q, v))
    sk = sort_keys(sc.y, v, xp=xp, ar=ar, take=sc.table_take, ones=True)
    totals = ar.value(sk.prefix[..., -1:, :])                    # (..., 1, 2 (Dv + 1))
    sc.settle(xp, totals, dv)
    count = clamp_min(xp, totals[..., dv:dv + 1], 1.0)           # (..., 1, 1) valid keys, >= 1

    xs = queries(sc.x, sk, ar=ar)
    profiles = [profile] + ([normalizer] if isinstance(normalizer, Profile) else [])
    found = searches(xs, sk, profiles, xp=xp, ar=ar, strict=True)
    cache: dict = {}
    indicator = slice(dv, dv + 1)
    terms = profile_terms(profile, xs, found, ar=ar)
    relu_count = combine_sums(xs, sk, terms, indicator, xp=xp, ar=ar, cache=cache)   # (..., Lq, 1)
    aux = {"take": sc.take, "relu_count": ar.value(relu_count)}
    if normalizer is None:
        den = 1.0
    elif isinstance(normalizer, Profile):
        aux["den"] = ar.value(combine_sums(xs, sk, profile_terms(normalizer, xs, found, ar=ar), indicator,
                                           xp=xp, ar=ar, cache=cache))
        den = clamp_min(xp, aux["den"][..., 0], eps)
        # a row with no valid key: its numerator is an empty sum, and its attention 0; dividing by 1
        # rather than a tiny eps keeps the folded 1 / den finite (a huge coefficient times 1 / eps
        # would overflow to inf, and inf times an empty prefix sum is NaN)
        den = xp.where(totals[..., dv] > 0, den, xp.ones_like(den))
    else:
        den = count[..., 0]
    if center:
        terms = terms + [(None, 0, ar.scale(ar.div(relu_count[..., 0], count[..., 0]), -1.0))]
    out = combine_sums(xs, sk, terms, slice(0, dv), xp=xp, ar=ar, divisor=sc.divisor(xp, den), cache=cache)
    return ar.value(out), aux
