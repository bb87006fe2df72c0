"""Vector-Jacobian products of the sort-scan ops, written once against the array API (SPEC §2.4).

For ``S = K w`` with ``K_ij = f(x_i - y_j)`` and cotangent ``g``:

* ``dx_i = sum_c g_ic sum_j f'(x_i - y_j) w_jc``: derivative sums over the forward sort of the keys;
* ``dw_j = sum_i f(x_i - y_j) g_i``: a kernel sum with the roles swapped (keys <- queries) and the
  reflected profile ``r -> f(-r)``, over one sort of the queries;
* ``dy_j = -sum_c w_jc sum_i f'(x_i - y_j) g_ic``: derivative sums of the reflected profile over
  that same sort of the queries;
* for an array knot ``t_m`` (a differentiable bandwidth): ``-c_m sum g P0[rank(x - t_m)]``, and for
  an array coefficient ``c_m`` the ReLU sum at that knot contracted with ``g``.

Every step is a sort-scan: ``O((n + m) log(n + m))`` per knot. Nothing of the forward's prefix sums is
kept: the backward needs only the inputs (and, for attention, a few per-query scalars).
At exact ties both ``dx`` and ``dy`` use ``f'(0^+)`` (``H(0) = 1``, SPEC §2.4): the right derivative
in a query, the left one in a key, and exact for self-sums where queries and keys are one set.
"""

from __future__ import annotations

from typing import Sequence

import array_api_compat as compat

from ._scan import Profile, knot_sums, profile_sums, sort_keys, queries
from ._namespace import clamp_min
from ._wide import arithmetic

__all__ = ["profiles_vjp", "kernel_sum_vjp", "attention_vjp"]


def _width(profile: Profile, c: int) -> range:
    cols = range(c)[profile.columns]
    if cols.step != 1:
        raise ValueError("profile columns must be a contiguous slice")
    return cols


def _accumulate_columns(xp, total, part, cols: range, c: int):
    """``total`` (..., m, c) plus ``part`` placed in the columns ``cols`` (zeros elsewhere)."""
    if len(cols) != c:
        left = xp.zeros(part.shape[:-1] + (cols.start,), dtype=part.dtype, device=compat.device(part))
        right = xp.zeros(part.shape[:-1] + (c - cols.stop,), dtype=part.dtype, device=compat.device(part))
        part = xp.concat([left, part, right], axis=-1)
    return part if total is None else total + part


def profiles_vjp(x, y, w, profiles: Sequence[Profile], cotangents, *, xp, param_grads=True,
                 engine="scan"):
    """Pull cotangents of several profile sums of one ``(x, y, w)`` back to the inputs.

    Parameters
    ----------
    x : array, shape (..., n); y : array, shape (..., m); w : array, shape (..., m, c)
        As in the forward (finite, equal leading shapes; x and y in the work dtype).
    profiles : sequence of Profile
        Each summed over its column slice of ``w`` (``derivative=False``).
    cotangents : sequence of arrays, shapes (..., n, c_p)
        One per profile, in the work dtype.
    param_grads : bool
        Also return gradients for array knots and coefficients.
    engine : {"scan", "sweep"}
        The sweep runs one fused backward per profile; parameter gradients always use the scan.

    Returns
    -------
    dx (..., n), dy (..., m), dw (..., m, c), and a list (one per profile) of
    ``(dknots, dcoeffs)`` tuples aligned with ``profile.knots`` / ``profile.coeffs`` (``None`` for
    float parameters), each of the batch shape.
    """
    work = x.dtype
    ar = arithmetic(xp, work)
    c = w.shape[-1]
    if engine == "sweep":
        return _sweep_profiles_vjp(x, y, w, profiles, cotangents, xp=xp, ar=ar, param_grads=param_grads)

    # dx: derivative sums over the forward sort of the keys.
    sk = sort_keys(y, w, xp=xp, ar=ar)
    xs = queries(x, sk, ar=ar)
    derivs = profile_sums(xs, sk, [p.with_(derivative=True) for p in profiles], xp=xp, ar=ar)
    dx = None
    for d, g in zip(derivs, cotangents):
        term = xp.sum(ar.value(d) * g, axis=-1)
        dx = term if dx is None else dx + term

    # dw and dy: one sort of the queries carrying every cotangent.
    stacked = xp.concat(list(cotangents), axis=-1)
    skx = sort_keys(x, stacked, xp=xp, ar=ar)
    ys = queries(y, skx, ar=ar)
    offsets, start = [], 0
    for g in cotangents:
        offsets.append(slice(start, start + g.shape[-1]))
        start += g.shape[-1]
    reflected = [p.reflect(columns=o) for p, o in zip(profiles, offsets)]
    # strict: a tie x_i = y_j + t_m counts on the query side, H(x_i - y_j - t_m) = H(0) = 1, the
    # convention dx uses too, so that in self-sums (x and y the same points) the two cancel.
    sums = profile_sums(ys, skx, reflected + [r.with_(derivative=True) for r in reflected], xp=xp, ar=ar,
                        strict=True)
    values, slopes = sums[:len(profiles)], sums[len(profiles):]
    dw = dy = None
    for p, val, slope in zip(profiles, values, slopes):
        cols = _width(p, c)
        dw = _accumulate_columns(xp, dw, ar.value(val), cols, c)
        term = xp.sum(w[..., cols.start:cols.stop] * ar.value(slope), axis=-1)
        dy = term if dy is None else dy + term
    return dx, dy, dw, _param_grads(sk, xs, profiles, cotangents, xp=xp, ar=ar, param_grads=param_grads)


def _sweep_profiles_vjp(x, y, w, profiles, cotangents, *, xp, ar, param_grads):
    """:func:`profiles_vjp` by the fused sweep: one backward sweep pair per profile."""
    from . import _sweep
    from ._diff import _sweep_profile
    batch = tuple(x.shape[:-1])
    c = w.shape[-1]
    dx = dy = dw = None
    for p, g in zip(profiles, cotangents):
        cols = _width(p, c)
        px, py, pw = _sweep.kernel_sum_vjp(x, y, w[..., cols.start:cols.stop], g=g,
                                           **_sweep_profile(p, batch))
        dx = px if dx is None else dx + px
        dy = py if dy is None else dy + py
        dw = _accumulate_columns(xp, dw, pw, cols, c)
    needs_params = param_grads and any(not (isinstance(t, float) and isinstance(c_, float))
                                       for p in profiles for t, c_ in zip(p.knots, p.coeffs))
    if needs_params:
        sk = sort_keys(y, w, xp=xp, ar=ar)
        params = _param_grads(sk, queries(x, sk, ar=ar), profiles, cotangents, xp=xp, ar=ar,
                              param_grads=True)
    else:
        params = [(tuple(None for _ in p.knots), tuple(None for _ in p.coeffs)) for p in profiles]
    return dx, dy, dw, params


def _param_grads(sk, xs, profiles, cotangents, *, xp, ar, param_grads):
    """``(dknots, dcoeffs)`` per profile for its array knots and coefficients (None for floats)."""
    params = []
    for p, g in zip(profiles, cotangents):
        dknots, dcoeffs = [], []
        for knot, coeff in zip(p.knots, p.coeffs):
            if not param_grads or (isinstance(knot, float) and isinstance(coeff, float)):
                dknots.append(None)
                dcoeffs.append(None)
                continue
            relu, step, _ = knot_sums(sk, xs, knot, xp=xp, ar=ar)
            step = ar.value(step)[..., p.columns]
            relu = ar.value(relu)[..., p.columns]
            dknots.append(None if isinstance(knot, float) else
                          -coeff * xp.sum(xp.sum(g * step, axis=-1), axis=-1))
            dcoeffs.append(None if isinstance(coeff, float) else
                           xp.sum(xp.sum(g * relu, axis=-1), axis=-1))
        params.append((tuple(dknots), tuple(dcoeffs)))
    return params


def kernel_sum_vjp(x, y, w, profile: Profile, g, *, xp, engine="scan"):
    """VJP of :func:`slicedkern._ops.kernel_sum`: ``(dx, dy, dw, (dknots, dcoeffs))``.

    A non-finite query contributes nothing to ``dy`` and ``dw`` (as in :func:`attention_vjp`).
    """
    from ._ops import sanitize_keys
    x, y, w, q_ok, row_ok = sanitize_keys(xp, x, y, w, None)
    g = xp.where(q_ok[..., None], g, xp.zeros((), dtype=g.dtype, device=compat.device(g)))
    dx, dy, dw, params = profiles_vjp(x, y, w, [profile], [g], xp=xp, engine=engine)
    return (*_nan_rows(xp, dx, dy, dw, q_ok, row_ok), params[0])


def _nan_rows(xp, dx, dy, dw, q_ok, row_ok):
    nan = xp.asarray(float("nan"), dtype=dx.dtype, device=compat.device(dx))
    return (xp.where(q_ok & row_ok[..., None], dx, nan), xp.where(row_ok[..., None], dy, nan),
            xp.where(row_ok[..., None, None], dw, nan))


def attention_vjp(q, k, v, profile: Profile, gout, out, aux, *, key_mask, center, normalizer, eps,
                  xp, engine="scan"):
    """VJP of :func:`slicedkern._ops.attention`.

    ``out`` is the forward output and ``aux`` the per-query residuals it returned (``relu_count``:
    the profile summed over the valid-key indicator; ``den``: the unclamped normaliser sum), or
    ``None`` (the sweep keeps none): then they are recomputed here, one sort-scan of one column each.
    Returns ``(dq, dk, dv, (dknots, dcoeffs))``.

    The values and the valid-key indicator are pulled back separately: the (..., n, Dv) work is one
    kernel-sum VJP of ``v`` with the cotangent ``g / den`` (per-query factors, no copy of ``v``), and
    the centring and normaliser terms ride on a one-column VJP of the indicator.
    """
    from ._ops import sanitize_keys
    work = q.dtype
    q, k, v, q_ok, row_ok = sanitize_keys(xp, q, k, v, key_mask)
    if aux is None:
        aux = _attention_aux(q, k, profile, key_mask, row_ok, normalizer, xp=xp, engine=engine)
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
    dq, dk, dv, params = profiles_vjp(q, k, v, [profile], [gnum], xp=xp, engine=engine)

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
        dq2, dk2, _, params2 = profiles_vjp(q, k, takef[..., None], indicator_profiles, indicator_cots,
                                            xp=xp, engine=engine)
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


def _attention_aux(q, k, profile, key_mask, row_ok, normalizer, *, xp, engine):
    """The per-query residuals of :func:`slicedkern._ops.attention`, recomputed from the inputs."""
    take = xp.broadcast_to(row_ok[..., None], k.shape)
    if key_mask is not None:
        take = take & key_mask
    ones = xp.astype(take, q.dtype)[..., None]
    profiles = [profile] + ([normalizer] if isinstance(normalizer, Profile) else [])
    if engine == "sweep":
        from . import _sweep
        from ._diff import _sweep_profile
        sums = [_sweep.kernel_sum(q, k, ones, **_sweep_profile(p, tuple(q.shape[:-1]))) for p in profiles]
    else:
        ar = arithmetic(xp, q.dtype)
        sk = sort_keys(k, ones, xp=xp, ar=ar)
        sums = [ar.value(s) for s in profile_sums(queries(q, sk, ar=ar), sk, profiles, xp=xp, ar=ar,
                                                  strict=True)]
    aux = {"take": take, "relu_count": sums[0]}
    if len(sums) > 1:
        aux["den"] = sums[1]
    return aux
