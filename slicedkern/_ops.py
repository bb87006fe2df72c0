"""Backend-neutral compositions on top of the sort-scan: kernel sums and attention.

Inputs arrive validated and in the work dtype; results leave in the work dtype (the public layer
casts back). The NaN policy (SPEC §4) is applied here once for every engine: a non-finite query
makes its row NaN, a non-finite (unmasked) key or value makes its whole batch row NaN. Offending
entries are replaced by zeros before any arithmetic, so no backend warns or traps on them.
"""

from __future__ import annotations

import array_api_compat as compat

from ._scan import Profile, profile_sums, sort_keys
from ._wide import arithmetic

__all__ = ["kernel_sum", "attention"]


def _row_ok(xp, keys, values, valid):
    """(...,) True where every key taking part (and its weights) is finite."""
    ok_k = xp.isfinite(keys)
    ok_v = xp.all(xp.isfinite(values), axis=-1)
    if valid is not None:
        ok_k = ok_k | ~valid
        ok_v = ok_v | ~valid
    return xp.all(ok_k & ok_v, axis=-1)


def _nan_where_bad(xp, out, q_ok, row_ok):
    good = q_ok[..., None] & row_ok[..., None, None]
    return xp.where(good, out, xp.asarray(float("nan"), dtype=out.dtype, device=compat.device(out)))


def sanitize_keys(xp, x, y, w, key_mask):
    """Zero the entries the NaN policy excludes; return ``(x, y, w, q_ok, row_ok)``.

    ``y`` is zeroed where masked (masked keys take no part) and on bad rows; ``w`` is zeroed on
    masked keys and bad rows (keeping its dtype); ``q_ok`` (..., n) marks finite queries, ``row_ok``
    (...) batch rows whose participating keys and weights are all finite.
    """
    q_ok = xp.isfinite(x)
    row_ok = _row_ok(xp, y, w, key_mask)
    take = xp.broadcast_to(row_ok[..., None], y.shape)
    if key_mask is not None:
        take = take & key_mask
    zero = xp.asarray(0.0, dtype=x.dtype, device=compat.device(x))
    w_zero = xp.asarray(0.0, dtype=w.dtype, device=compat.device(w))
    y = xp.where(take, y, zero)
    if key_mask is not None:
        # Masked keys sit at the mean of the valid ones: they stay out of the sums (zero weight)
        # and out of the way of the median shift, which keeps s P0 - P1 from cancelling.
        count = xp.sum(xp.astype(take, y.dtype), axis=-1, keepdims=True)
        fill = xp.sum(y, axis=-1, keepdims=True) / xp.clip(count, min=1.0)
        y = xp.where(take, y, fill)
    return xp.where(q_ok, x, zero), y, xp.where(take[..., None], w, w_zero), q_ok, row_ok


def kernel_sum(x, y, w, profile: Profile, *, xp):
    """``S[..., i, :] = sum_j f(x_i - y_j) w[..., j, :]``; x (..., n), y (..., m), w (..., m, c).

    Leading shapes must already be equal.
    """
    n, m, c = x.shape[-1], y.shape[-1], w.shape[-1]
    if m == 0 or n == 0:
        return xp.zeros(x.shape + (c,), dtype=x.dtype, device=compat.device(x))
    x, y, w, q_ok, row_ok = sanitize_keys(xp, x, y, w, None)
    ar = arithmetic(xp, x.dtype)
    sk = sort_keys(y, w, xp=xp, ar=ar)
    (out,) = profile_sums(ar.shift(x, sk.shift), sk, [profile], xp=xp, ar=ar)
    return _nan_where_bad(xp, ar.value(out), q_ok, row_ok)


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
    """
    lq, lk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    dt, dev = q.dtype, compat.device(q)
    take = xp.ones(k.shape, dtype=xp.bool, device=dev) if key_mask is None else key_mask
    if lq == 0 or lk == 0:
        zeros = xp.zeros(q.shape + (1,), dtype=dt, device=dev)
        return xp.zeros(q.shape + (dv,), dtype=dt, device=dev), {"take": take, "relu_count": zeros,
                                                                  "den": zeros}
    q, k, v, q_ok, row_ok = sanitize_keys(xp, q, k, v, key_mask)
    take = take & row_ok[..., None]
    w = xp.concat([v, xp.astype(take, v.dtype)[..., None]], axis=-1)

    ar = arithmetic(xp, dt)
    sk = sort_keys(k, w, xp=xp, ar=ar)
    profiles = [profile]
    if isinstance(normalizer, Profile):
        profiles.append(normalizer.with_(columns=slice(dv, dv + 1)))
    sums = profile_sums(ar.shift(q, sk.shift), sk, profiles, xp=xp, ar=ar)
    num = sums[0][..., :dv]
    relu_count = sums[0][..., dv:dv + 1]
    totals = sk.prefix[..., -1:, :]
    count = xp.clip(ar.value(totals[..., dv:dv + 1]), min=1.0)   # (..., 1, 1) valid keys, >= 1
    if center:
        num = ar.sub(num, ar.mul(relu_count, ar.div(totals[..., :dv], count)))
    num = ar.value(num)
    # A copy, not a view: a view would keep the whole (..., Lq, Dv + 1) sum alive for the backward.
    aux = {"take": take, "relu_count": xp.asarray(ar.value(relu_count), copy=True)}
    if normalizer is None:
        out = num
    elif isinstance(normalizer, Profile):
        aux["den"] = ar.value(sums[1])
        out = num / xp.clip(aux["den"], min=eps)
    else:
        out = num / count
    return _nan_where_bad(xp, out, q_ok, row_ok), aux
