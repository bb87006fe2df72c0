"""The backward of ``kernel_sum`` and attention, written once over an engine's profile-sum VJPs.

An engine provides ``profiles_vjp(x, y, w, profiles, cotangents, *, xp, param_grads)`` (the pullback of
several profile sums of one ``(x, y, w)``) and ``indicator_sums(q, k, ones, profiles, *, xp)``, and an
engine with a causal mode ``causal_profiles_vjp`` (the same over the keys each query sees); this
module adds what every engine shares: the NaN policy, the quotient rule of the normaliser, the
centering, and masks (docs/mathematics.rst, "The backward pass" and "Causal attention").
"""

from __future__ import annotations

import array_api_compat as compat

from .._lib.namespace import clamp_min
from ..kernels import Profile
from ._causal_grid import CausalGrid, running_sum, screen_causal
from ._nanpolicy import sanitize_keys

__all__ = ["kernel_sum_vjp", "attention_vjp", "attention_aux", "causal_attention_vjp"]


def kernel_sum_vjp(engine, x, y, w, profile: Profile, g, *, xp):
    """VJP of a kernel sum on ``engine``: ``(dx, dy, dw, (dknots, dcoeffs))``.

    A non-finite query contributes nothing to ``dy`` and ``dw`` (as in :func:`attention_vjp`).
    """
    x, y, w, q_ok, row_ok = sanitize_keys(xp, x, y, w, None)
    g = xp.where(q_ok[..., None], g, xp.zeros((), dtype=g.dtype, device=compat.device(g)))
    dx, dy, dw, params = engine.profiles_vjp(x, y, w, [profile], [g], xp=xp)
    return (*_nan_rows(xp, dx, dy, dw, q_ok, row_ok), params[0])


def _nan_rows(xp, dx, dy, dw, q_ok, row_ok):
    nan = xp.asarray(float("nan"), dtype=dx.dtype, device=compat.device(dx))
    return (xp.where(q_ok & row_ok[..., None], dx, nan), xp.where(row_ok[..., None], dy, nan),
            xp.where(row_ok[..., None, None], dw, nan))


def attention_vjp(engine, q, k, v, profile: Profile, gout, out, aux, *, key_mask, center, normalizer,
                  eps, xp):
    """VJP of attention on ``engine``.

    ``out`` is the forward output and ``aux`` the per-query residuals it returned (``relu_count``:
    the profile summed over the valid-key indicator; ``den``: the unclamped normaliser sum), or
    ``None`` (the sweep keeps none): then they are recomputed here, one sort-scan of one column each.
    Returns ``(dq, dk, dv, (dknots, dcoeffs))``.

    The values and the valid-key indicator are pulled back separately: the (..., n, Dv) work is one
    kernel-sum VJP of ``v`` with the cotangent ``g / den`` (per-query factors, no copy of ``v``), and
    the centring and normaliser terms ride on a one-column VJP of the indicator.
    """
    work = q.dtype
    q, k, v, q_ok, row_ok = sanitize_keys(xp, q, k, v, key_mask)
    if aux is None:
        aux = attention_aux(engine, q, k, profile, key_mask, row_ok, normalizer, xp=xp)
    takef = xp.astype(aux["take"], work)
    valid = xp.sum(takef, axis=-1)[..., None, None]
    count = clamp_min(xp, valid, 1.0)
    good = (q_ok & row_ok[..., None])[..., None]                      # (..., n, 1)
    zero = xp.zeros((), dtype=work, device=compat.device(q))
    scale = xp.astype(good, work)
    if normalizer is not None:
        den = aux["den"] if isinstance(normalizer, Profile) else count
        den_c = clamp_min(xp, den, eps if isinstance(normalizer, Profile) else 1.0)
        den_c = xp.where(valid > 0, den_c, xp.ones_like(den_c))     # no valid key: as the forward
        scale = scale / den_c
    gnum = gout * scale                                               # (..., n, Dv), work dtype
    dq, dk, dv, params = engine.profiles_vjp(q, k, v, [profile], [gnum], xp=xp)

    indicator_profiles, indicator_cots = [], []
    if center:
        mean = xp.sum(v, axis=-2, keepdims=True, dtype=work) / count   # v is zero on masked keys
        indicator_profiles.append(profile)
        indicator_cots.append(-(gnum @ xp.matrix_transpose(mean)))       # (..., n, 1), no (n, Dv) temporary
    if isinstance(normalizer, Profile):
        dot = xp.astype(xp.vecdot(gout, xp.astype(out, gout.dtype))[..., None], work)
        gden = xp.where(good & (aux["den"] >= eps), -dot / den_c, zero)
        indicator_profiles.append(normalizer)
        indicator_cots.append(gden)
    if indicator_profiles:
        dq2, dk2, _, params2 = engine.profiles_vjp(q, k, takef[..., None], indicator_profiles,
                                                   indicator_cots, xp=xp)
        dq, dk = dq + dq2, dk + dk2
        params = _add_params(params, params2[:1]) if center else params

    # masked keys get no gradient; bad rows get NaN (the forward's NaN policy)
    nan = xp.asarray(float("nan"), dtype=work, device=compat.device(q))
    key_factor = xp.where(row_ok[..., None], takef, nan)[..., None]
    if center:
        g_mean = -(xp.matrix_transpose(aux["relu_count"]) @ gnum)             # (..., 1, Dv)
        dv = dv + g_mean / count
    dv = dv * key_factor
    dq = xp.where(q_ok & row_ok[..., None], dq, nan)
    dk = xp.where(row_ok[..., None], dk, nan)
    return dq, dk, dv, params[0]


def _add_params(a, b):
    """Sum two ``profiles_vjp`` parameter-gradient lists (None where a parameter is a float)."""
    out = []
    for (ka, ca), (kb, cb) in zip(a, b):
        out.append((tuple(x if y is None else (y if x is None else x + y) for x, y in zip(ka, kb)),
                    tuple(x if y is None else (y if x is None else x + y) for x, y in zip(ca, cb))))
    return out


def attention_aux(engine, q, k, profile, key_mask, row_ok, normalizer, *, xp):
    """The per-query residuals of attention (``take``, ``relu_count``, ``den``), recomputed from the
    inputs, for engines that keep none."""
    take = xp.broadcast_to(row_ok[..., None], k.shape)
    if key_mask is not None:
        take = take & key_mask
    ones = xp.astype(take, q.dtype)[..., None]
    profiles = [profile] + ([normalizer] if isinstance(normalizer, Profile) else [])
    sums = engine.indicator_sums(q, k, ones, profiles, xp=xp)
    aux = {"take": take, "relu_count": sums[0]}
    if len(sums) > 1:
        aux["den"] = sums[1]
    return aux


def causal_attention_vjp(engine, q, k, v, profile: Profile, gout, out, aux, *, key_mask, center, normalizer,
                         eps, xp):
    """VJP of causal attention on ``engine`` (which has ``causal_profiles_vjp``).

    As :func:`attention_vjp`, with every per-row quantity made per query over the keys it sees
    (docs/mathematics.rst, "Causal attention"): the count and the running mean are running sums over
    the positions, and the mean's cotangent reaches a key from every query at or after its position
    (a reverse running sum). ``aux`` holds the forward's ``take``, ``relu_count`` and ``den``.
    Returns ``(dq, dk, dv, (dknots, dcoeffs))``; NaN where the forward's output was: on bad queries,
    and on every key of a batch row in which some query saw a non-finite key.
    """
    work = q.dtype
    grid = CausalGrid(q.shape[-1], k.shape[-1])
    sc = screen_causal(xp, grid, q, k, v, key_mask)
    takef = xp.astype(sc.take, work)
    zero = xp.zeros((), dtype=work, device=compat.device(q))
    count = grid.at_queries(xp, running_sum(xp, takef, axis=-1))[..., None]        # (..., lq, 1)
    good = sc.good[..., None]
    scale = xp.astype(good, work)
    if normalizer is not None:
        if isinstance(normalizer, Profile):
            den_c = xp.where(count > 0, clamp_min(xp, aux["den"], eps), xp.ones_like(count))
        else:
            den_c = clamp_min(xp, count, 1.0)
        scale = scale / den_c
    gnum = gout * scale                                                            # (..., lq, dv)
    vw = xp.astype(sc.v, work)
    dq, dk, dv, params = engine.causal_profiles_vjp(sc.q, sc.k, vw, [profile], [gnum], xp=xp)

    indicator_profiles, indicator_cots = [], []
    if center:
        mean = grid.at_queries(xp, running_sum(xp, vw, axis=-2), axis=-2) / clamp_min(xp, count, 1.0)
        indicator_profiles.append(profile)
        indicator_cots.append(-xp.sum(gnum * mean, axis=-1, keepdims=True))
    if isinstance(normalizer, Profile):
        dot = xp.astype(xp.vecdot(gout, xp.astype(out, gout.dtype))[..., None], work)
        gden = xp.where(good & (aux["den"] >= eps), -dot / den_c, zero)
        indicator_profiles.append(normalizer)
        indicator_cots.append(gden)
    if indicator_profiles:
        dq2, dk2, _, params2 = engine.causal_profiles_vjp(sc.q, sc.k, takef[..., None], indicator_profiles,
                                                          indicator_cots, xp=xp)
        dq, dk = dq + dq2, dk + dk2
        params = _add_params(params, params2[:1]) if center else params
    if center:
        # mean_i = (sum of the values query i sees) / count_i: the key at position j receives the
        # cotangents of the means of every query at or after j
        g_mean = -(aux["relu_count"] * gnum) / clamp_min(xp, count, 1.0)           # (..., lq, dv)
        dv = dv + running_sum(xp, grid.queries_to_keys(xp, g_mean), axis=-2, reverse=True)

    nan = xp.asarray(float("nan"), dtype=work, device=compat.device(q))
    key_factor = xp.where(sc.row_bad[..., None], nan, takef)[..., None]
    dv = dv * key_factor
    dq = xp.where(sc.good, dq, nan)
    dk = xp.where(sc.row_bad[..., None], nan, dk)
    return dq, dk, dv, params[0]
