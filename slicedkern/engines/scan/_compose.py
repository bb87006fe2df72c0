"""Backend-neutral compositions on top of the sort-scan: kernel sums and attention.

Inputs arrive validated and in the work dtype; results leave in the work dtype (the public layer
casts back). The NaN policy (docs/mathematics.rst, "Non-finite input") is applied here: a non-finite query
makes its row NaN, a non-finite (unmasked) key or value makes its whole batch row NaN. Offending
scores are replaced by zeros before any arithmetic, and so are offending weights, so that no backend
warns or traps on them -- except where the backend lets them pass quietly (torch): there a weight's
check is deferred to its row's totals (see :func:`_screen`). The policy reaches the output as the
per-query divisor of the final combination (NaN where bad), not as a pass over the output.
"""

from __future__ import annotations

from ..._lib.namespace import array_device, clamp_min
from ...backends import quiet_nonfinite
from ...kernels import Profile
from .._combine import empty_attention
from .._nanpolicy import screen
from .._vjp import Form, Inputs
from ..sortscan.sums import combine_sums, profile_terms, queries, searches, sort_keys
from ..sortscan.wide import arithmetic, power_of_two_scaled, unscaled

__all__ = ["kernel_sum", "attention"]


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
        return xp.zeros(x.shape + (c,), dtype=x.dtype, device=array_device(x))
    ar = arithmetic(xp, x.dtype)
    w, unscale = power_of_two_scaled(xp, ar, w)
    sc = screen(xp, x, y, w, None, defer=_can_defer(xp, ar, x, w))
    sk = sort_keys(sc.y, w, xp=xp, ar=ar, take=sc.table_take)
    sc.settle(xp, ar.value(sk.prefix[..., -1:, :]), c)
    xs = queries(sc.x, sk, ar=ar)
    found = searches(xs, sk, [profile], xp=xp, ar=ar, strict=True)
    out = combine_sums(xs, sk, profile_terms(profile, xs, found, ar=ar), profile.columns, xp=xp, ar=ar,
                       divisor=sc.divisor(xp, 1.0))
    return unscaled(ar.value(out), unscale)


def attention(inputs: Inputs, form: Form, *, xp):
    """Normalised kernel attention, docs/mathematics.rst, "Attention"; returns ``(out, aux)``.

    Parameters
    ----------
    inputs : Inputs
        ``q`` (..., Lq), ``k`` (..., Lk), ``v`` (..., Lk, Dv), ``key_mask`` (..., Lk) bool or None:
        equal leading shapes; q and k in the work dtype, v in any floating dtype.
    form : Form
        ``profile`` the value kernel ``f``; ``normalizer``: a profile normaliser is summed over the
        valid-key indicator, the divisor's rule is :meth:`~slicedkern._spec.Normalizer.divisor`;
        ``center``: use ``v_j - mean_valid(v)``, folded in as ``N - mu R`` (``R`` = kernel sum of
        the valid-key indicator) so that no centred copy of ``v`` is rounded.

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
    (q, k, v, key_mask), (profile, normalizer, center) = inputs, form
    lq, lk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    dt = q.dtype
    if lq == 0 or lk == 0:
        return empty_attention(xp, q, k, v, key_mask)
    ar = arithmetic(xp, dt)
    v, unscale = power_of_two_scaled(xp, ar, v)
    sc = screen(xp, q, k, v, key_mask, defer=_can_defer(xp, ar, q, v))
    sk = sort_keys(sc.y, v, xp=xp, ar=ar, take=sc.table_take, ones=True)
    totals = ar.value(sk.prefix[..., -1:, :])                    # (..., 1, 2 (Dv + 1))
    sc.settle(xp, totals, dv)
    count = clamp_min(xp, totals[..., dv:dv + 1], 1.0)           # (..., 1, 1) valid keys, >= 1

    xs = queries(sc.x, sk, ar=ar)
    profiles = [profile] + ([normalizer.profile] if normalizer.summed else [])
    found = searches(xs, sk, profiles, xp=xp, ar=ar, strict=True)
    cache: dict = {}
    indicator = slice(dv, dv + 1)
    terms = profile_terms(profile, xs, found, ar=ar)
    relu_count = combine_sums(xs, sk, terms, indicator, xp=xp, ar=ar, cache=cache)   # (..., Lq, 1)
    aux = {"take": sc.take, "relu_count": ar.value(relu_count)}
    if normalizer.summed:
        aux["den"] = ar.value(combine_sums(xs, sk, profile_terms(normalizer.profile, xs, found, ar=ar),
                                           indicator, xp=xp, ar=ar, cache=cache))
    den = normalizer.divisor(xp, totals[..., dv], aux["den"][..., 0] if normalizer.summed else None)
    if center:
        terms = terms + [(None, 0, ar.scale(ar.div(relu_count[..., 0], count[..., 0]), -1.0))]
    out = combine_sums(xs, sk, terms, slice(0, dv), xp=xp, ar=ar, divisor=sc.divisor(xp, den), cache=cache)
    return unscaled(ar.value(out), unscale), aux
