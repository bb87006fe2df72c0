"""The triton engine's backward of attention, as straight functions: :func:`attention_bwd` over the
forward's residuals (its sorted orders, table of keys and NaN policy's verdicts) and
:func:`causal_bwd` over the causal levels, both from the generic backward's pieces
(:mod:`.._vjp`: the screened :class:`~slicedkern.engines._vjp.Keys`, the quotient rule
:func:`.._combine.pullback`) with the reads of the cotangent, the values and ``dv``'s finish on the
kernels: the columns are handed to the pull-back unevaluated (:mod:`.._columns`,
:func:`lazy_terms`, :func:`cotangent_tables`); docs/architecture.rst, "Engines".
"""

from __future__ import annotations

import functools

from ..._lib.causal import key_offset
from ..._lib.namespace import as_work
from ...kernels import Profile, is_fixed
from .. import _vjp
from .._causal_grid import CausalGrid
from .._columns import MaskedValues, ScaledRows
from .._combine import pullback
from .._dyadic import causal_profiles_vjp
from ._args import strided
from ._causal import causal_dv, causal_row_dots
from ._sums import (
    BLOCK_COLS,
    BLOCK_ROWS,
    DotTerm,
    build_table,
    flat_rows,
    loaded,
    profile_dots,
    row_view,
    triton_cdiv,
)

__all__ = ["attention_bwd", "causal_bwd", "lazy_terms", "adjacent_columns", "cotangent_tables", "kernel_knot_grads",
           "row_dots", "column_sums"]


def adjacent_columns(arrays):
    """``arrays`` as one view when they are adjacent column ranges of one array (the same shape but
    the last axis, dtype and strides, each starting where the one before ends), else None."""
    first = arrays[0]
    at = first.data_ptr()
    for a in arrays:
        if (a.data_ptr() != at or a.dtype != first.dtype or a.stride() != first.stride()
                or a.shape[:-1] != first.shape[:-1]):
            return None
        at += a.shape[-1] * a.stride(-1) * a.element_size()
    return first.as_strided(first.shape[:-1] + (sum(a.shape[-1] for a in arrays),), first.stride())


def cotangent_tables(xp, xr, xq, cotangents, cots):
    """Per cotangent of a pull-back, ``(table, span, valued)``: the table of the sorted queries
    ``xq`` (R, n) that carries it (pass 1), its columns there, and the table whose rows reach the
    values' gradient (itself, unless a :class:`~slicedkern.engines._columns.ScaledRows` has a
    ``value_scale``). ``cots``: their :func:`._sums.cotangent_rows`. The plain cotangents share one
    table (adjacent column ranges of one array read as one, others joined); a ScaledRows has its
    own, its rows scaled as pass 1 reads them (no scaled copy)."""
    plain = [g for g in cotangents if not isinstance(g, ScaledRows)]
    shared = None
    if plain:
        stacked = adjacent_columns(plain)
        stacked = flat_rows(xp, xp.concat(plain, axis=-1), 2) if stacked is None else row_view(xp, stacked, 2)
        shared = build_table(xp, xr, stacked, presorted=xq)
    out, start = [], 0
    for g, (rows, scale, value_scale) in zip(cotangents, cots):
        if isinstance(g, ScaledRows):
            table = build_table(xp, xr, rows, scale=scale, presorted=xq)
            valued = table if value_scale is None else build_table(xp, xr, rows, scale=value_scale, presorted=xq)
            out.append((table, range(0, rows.shape[-1]), valued))
        else:
            out.append((shared, range(start, start + g.shape[-1]), shared))
            start += g.shape[-1]
    return out


def kernel_row_dot(xp, g, b):
    """The quotient rule's row dots (:func:`.._combine.row_dot`) on the kernels: ``g`` (..., lq, d)
    and ``b`` (..., lq or 1, d) read in their own dtypes and strides (one launch, float64)."""
    batch, lq = tuple(g.shape[:-2]), g.shape[-2]
    b = xp.broadcast_to(b, batch + tuple(b.shape[-2:]))
    dots = row_dots(xp, row_view(xp, g, 2), row_view(xp, b, 2))
    return xp.reshape(dots, batch + (lq, 1))


def lazy_terms(xp, keys: _vjp.Keys, gout, cot, silent, form: _vjp.Form):
    """``(w, profiles, cotangents)`` of attention's sums (:func:`.._vjp.sums_vjp`) left unevaluated for
    the kernels: the values read where the keys take part (:class:`.._columns.MaskedValues`), the
    cotangent rows scaled as they are read (:class:`.._columns.ScaledRows`), the silent rows'
    share of the values' gradient scaled to 0 there; no (lq, Dv) or (lk, Dv + 1) array is formed."""
    indicator_profiles, indicator_cots = _vjp.indicator_terms(form, cot)
    profiles = _vjp.column_profiles(form.profile, indicator_profiles, keys.values.shape[-1])
    rows = tuple(gout.shape[:-1]) + (1,)
    scale = xp.broadcast_to(cot.scale, rows)
    zero = xp.zeros((), dtype=scale.dtype, device=scale.device)
    cotangents = [ScaledRows(gout, scale, None if silent is None else xp.where(silent, zero, scale))]
    if indicator_cots:               # one (lq, 2) array at most: the pull-back reads them as one table
        joined = xp.concat([xp.broadcast_to(c, rows) for c in indicator_cots], axis=-1)
        cotangents += [joined[..., i:i + 1] for i in range(len(indicator_cots))]
    return MaskedValues(keys.values, keys.take), profiles, cotangents


def attention_bwd(engine, inputs: _vjp.Inputs, form: _vjp.Form, gout, out, aux, *, xp):
    """Attention's backward over the forward's residuals ``aux`` (:data:`._RESIDUALS`): it sorts and
    screens nothing, and allocates nothing of ``(n, dv)`` but ``dv`` itself.

    ``q`` and ``k`` are the unscreened scores, read for their shapes only; the values are read by
    kernels that skip the keys that take no part. The totals are the last carry row of the forward's
    table of ``[v | indicator]``; ``dq`` is the derivative sums of the values over that table (no
    pass 1), dotted with the cotangent in pass 2's epilogue and scaled by the quotient rule's factor
    per query; ``dv`` and ``dk`` the reflected profile over a table of the sorted queries whose rows
    are the cotangent times that factor, ``dk``'s dot with the values in pass 2's epilogue and ``dv``
    finished there (the centring mean's term subtracted, the keys' factor, the values' dtype). A
    call without those residuals (compiled, or empty) takes the generic backward.
    """
    if aux is None or "query_perm" not in aux:
        return _vjp.attention_bwd(engine, inputs, form, gout, out, aux, xp=xp)
    (q, k, v, key_mask), (profile, normalizer, center) = inputs, form
    keys = _vjp.Keys(q, k, v, aux["take"], aux["good"], ~aux["row_ok"])
    batch, m, dv = tuple(k.shape[:-1]), k.shape[-1], v.shape[-1]
    sums = xp.astype(xp.reshape(aux["key_carry"][:, -1, :dv + 1], batch + (1, dv + 1)), q.dtype)
    good = keys.good[..., None]
    cot = pullback(xp, gout, out, relu_count=aux["relu_count"], den=aux.get("den"), count=sums[..., dv:],
                   value_sums=sums[..., :dv] if center else None, good=good, center=center, normalizer=normalizer,
                   dot=functools.partial(kernel_row_dot, xp))
    # the silent rows scale the cotangent of dv's table: no host read of den
    silent = _vjp.silent_rows(xp, profile, normalizer, aux.get("den"), good, as_mask=True)
    mean_term = None
    if center:
        weights = cot.mean_weights * cot.scale
        weights = flat_rows(xp, xp.broadcast_to(weights, gout.shape[:-1] + (1,))[..., 0], 1)
        mean_term = xp.reshape(column_sums(xp, weights, row_view(xp, gout, 2)), tuple(gout.shape[:-2]) + (1, dv))
    if normalizer.summed and not normalizer.profile.is_fixed:
        # a normaliser with array parameters (none of the named ones has them): the generic
        # pull-back over the scan's knot sums, in the work dtype, over screened keys
        screened = _vjp.screened_keys(xp, q, k, v, key_mask)
        dq, dk, dw, param = _vjp.sums_vjp(xp, engine.profiles_vjp, screened, _vjp.zeroed_values(xp, screened),
                                          as_work(xp, gout, q.dtype), cot, silent, form)
        return (*_vjp.nan_scores(xp, keys, dq, dk), _vjp.finished_dv(xp, keys, dw, mean_term), param)

    def per_row(a, shape):           # (..., 1, dv) or (..., m, 1) factors as (R, dv or m) float64
        return flat_rows(xp, xp.astype(xp.reshape(xp.broadcast_to(a, batch + shape), batch + (-1,)), xp.float64), 1)

    w, profiles, cotangents = lazy_terms(xp, keys, gout, cot, silent, form)
    finish = (None if mean_term is None else per_row(mean_term, (1, dv)), per_row(_vjp.key_factor(xp, keys), (m, 1)),
              v.dtype)
    dq, dk, dw, params = engine.profiles_vjp(q, k, w, profiles, cotangents, xp=xp, key_carry=aux["key_carry"],
                                             orders=(aux["key_order"], aux["key_perm"], aux["query_order"],
                                                     aux["query_perm"]), dv_finish=finish)
    return (*_vjp.nan_scores(xp, keys, dq, dk), dw, _vjp.joined_params(params, silent_copy=False, center=center))


def causal_bwd(engine, inputs: _vjp.Inputs, form: _vjp.Form, gout, out, aux, *, xp):
    """Causal attention's backward (:func:`.._vjp.causal_bwd`) on the kernels: the levels'
    pull-backs merge from the forward's sorted runs (``aux["runs"]``, or None: they sort), the
    quotient rule's row dots with the value sums each query sees are summed as the values are read,
    from the forward's block carry of the running totals (``aux["position_carry"]``), and ``dv`` is
    finished in one launch (:func:`._causal.causal_dv`): neither the centring mean's reverse running
    sum nor ``dv - sub`` is an (lk, dv) array."""
    (q, k, v, _), (profile, normalizer, center) = inputs, form
    lq, lk = q.shape[-1], k.shape[-1]
    if lq == 0 or lk == 0:
        # no query or no key: causal and non-causal attention are the same (zero) map
        return attention_bwd(engine, inputs, form, gout, out, aux, xp=xp)
    if aux is None:
        raise ValueError("causal attention's backward needs the forward's residuals")
    grid = CausalGrid(lq, lk)
    keys = _vjp.screened_seen_keys(xp, grid, *inputs)
    work, batch, d = keys.q.dtype, tuple(k.shape[:-1]), v.shape[-1]
    count = grid.seen_sums(xp, xp.astype(keys.take, work)[..., None], work)
    value_dots = None
    if center:
        take = flat_rows(xp, keys.take, 1)
        dots = causal_row_dots(xp, row_view(xp, gout, 2), row_view(xp, v, 2), take, key_offset(lq, lk),
                               aux.get("position_carry"))
        value_dots = xp.reshape(dots, tuple(gout.shape[:-2]) + (lq, 1))
    good = keys.good[..., None]
    cot = pullback(xp, gout, out, relu_count=aux["relu_count"], den=aux.get("den"), count=count, value_sums=None,
                   value_dots=value_dots, good=good, center=center, normalizer=normalizer,
                   dot=functools.partial(kernel_row_dot, xp))
    silent = _vjp.silent_rows(xp, profile, normalizer, aux.get("den"), good, as_mask=True)
    w, profiles, cotangents = lazy_terms(xp, keys, gout, cot, silent, form)
    dq, dk, dw, params = causal_profiles_vjp(keys.q, keys.k, w, profiles, cotangents, xp=xp,
                                             levels=engine._levels(aux.get("runs")))
    weights = g = None
    if center:
        weights = flat_rows(xp, xp.broadcast_to(cot.mean_weights * cot.scale, batch + (lq, 1))[..., 0], 1)
        g = row_view(xp, xp.broadcast_to(gout, batch + (lq, d)), 2)
    factor = flat_rows(xp, xp.broadcast_to(_vjp.key_factor(xp, keys), batch + (lk, 1))[..., 0], 1)
    dv = xp.reshape(causal_dv(xp, row_view(xp, dw[..., :d], 2), g, weights, factor, v.dtype), batch + (lk, d))
    return (*_vjp.nan_scores(xp, keys, dq, dk), dv, _vjp.joined_params(params, silent_copy=False, center=center))


def kernel_knot_grads(xp, keyed, xq, profile, batch, gr, cols: range, *, scale=None):
    """``(dknots, dcoeffs)`` of a profile over the table columns ``cols`` (None for its fixed numbers)
    on the kernels, over a table of keys: per array knot ``t`` its ReLU sums (for the coefficient)
    and step sums (for the knot, the tie as ``profile.strict_knots`` says) dotted with the
    cotangent rows ``gr`` (R, n, len(cols)) in pass 2's epilogue, times ``scale`` (R, n) when given
    (attention's quotient-rule factor, applied there too), summed over the queries: what
    :func:`~slicedkern.engines.sortscan.pullback.knot_grads` sums over materialised cotangents,
    with no sort and no (n, c) array here."""
    def summed(unit, strict):
        rows = profile_dots(xp, [DotTerm(keyed, xq, unit, cols, gr, 0, strict, factor=scale)], batch)
        return xp.reshape(xp.sum(rows, axis=-1), batch)

    dknots, dcoeffs = [], []
    for knot, coeff, strict in zip(profile.knots, profile.coeffs, profile.strict_knots):
        unit = Profile([knot], [1.0])
        dcoeffs.append(None if is_fixed(coeff) else summed(unit, True))
        dknots.append(None if is_fixed(knot) else -coeff * summed(unit.with_(derivative=True), strict))
    return tuple(dknots), tuple(dcoeffs)


def row_dots(xp, a, b):
    """``<a[r, i], b[r, i]>`` for every row ``i``: (R, n) float64, from ``a`` (R, n, d) and ``b``
    (R, n or 1, d) read in their own dtypes and strides (one launch; no float64 copy of either)."""
    rows, n, d = a.shape
    out = xp.empty((rows, n), dtype=xp.float64, device=a.device)
    if rows and n:
        one = strided(b)
        loaded().row_dots[(rows, triton_cdiv(n, BLOCK_ROWS))](
            strided(a), one._replace(item=0) if b.shape[1] == 1 else one, out, n, d, BLOCK_N=BLOCK_ROWS,
            BLOCK_D=BLOCK_COLS)
    return out


def column_sums(xp, weights, g):
    """``sum over i of weights[r, i] g[r, i]``: (R, d) float64, from ``weights`` (R, n) and ``g``
    (R, n, d) read in its own dtype and strides (one launch; no float64 copy of ``g``)."""
    rows, n, d = g.shape
    weights = xp.astype(weights, xp.float64).contiguous()
    out = xp.zeros((rows, d), dtype=xp.float64, device=g.device)
    if rows and d and n:
        loaded().column_sums[(rows, triton_cdiv(d, BLOCK_COLS))](
            weights, strided(g), out, n, d, BLOCK_N=BLOCK_ROWS, BLOCK_D=BLOCK_COLS)
    return out
