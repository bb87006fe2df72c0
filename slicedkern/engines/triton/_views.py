"""The triton engine's views of the keys for attention's backward
(:class:`~slicedkern.engines._vjp.AllKeys`, :class:`~slicedkern.engines._vjp.SeenKeys`): the
quotient rule's reads of the cotangent on the kernels (:class:`KernelRows`), the non-causal
pull-back over the forward's residuals (:class:`SortedKeys`) and the causal one over the levels
(:class:`CausalKeys`), both on the engine's pull-back over the columns left unevaluated
(:mod:`.._columns`, :func:`cotangent_tables`); docs/architecture.rst, "Engines".
"""

from __future__ import annotations

from ..._lib.namespace import as_work
from ...kernels import Profile, is_fixed
from .._columns import ScaledRows
from .._vjp import AllKeys, SeenKeys
from ..scan._causal import causal_profiles_vjp
from ._causal import causal_dv, causal_row_dots
from ._sums import (
    BLOCK_COLS,
    BLOCK_ROWS,
    build_table,
    flat_rows,
    loaded,
    profile_dot,
    row_view,
    triton_cdiv,
)

__all__ = ["KernelRows", "CausalKeys", "SortedKeys", "SEEN_VALUE_SUMS", "adjacent_columns", "cotangent_tables",
           "kernel_knot_grads", "row_dots", "column_sums"]


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


class KernelRows:
    """The quotient rule's reads of the output's cotangent on the kernels, for the engine's views
    of the keys: the cotangent kept in its own dtype and strides (no float64 copy of it), its row
    dots one launch (:func:`row_dots`)."""

    def cotangent(self, xp, g):
        return g

    def row_dot(self, xp, g, b):
        batch, lq = tuple(g.shape[:-2]), g.shape[-2]
        b = xp.broadcast_to(b, batch + tuple(b.shape[-2:]))
        dots = row_dots(xp, row_view(xp, g, 2), row_view(xp, b, 2))
        return xp.reshape(dots, batch + (lq, 1))


#: the value sums each query of causal attention sees, as :meth:`CausalKeys.totals` hands them to
#: :meth:`CausalKeys.row_dot` (unevaluated: :func:`._causal.causal_row_dots` sums them as it reads)
SEEN_VALUE_SUMS = object()


class CausalKeys(KernelRows, SeenKeys):
    """The keys each query sees in causal attention (:class:`~slicedkern.engines._vjp.SeenKeys`),
    with the cotangent read by the kernels (:class:`KernelRows`) and ``dv`` finished in one launch
    (:func:`._causal.causal_dv`): the centring mean's cotangent is handed from :meth:`to_keys` to
    :meth:`finish_dv` unevaluated, so that neither its reverse running sum nor ``dv - sub`` is an
    (lk, dv) array. ``runs``: the forward's sorted runs of the levels (its
    residuals, :func:`._causal.level_orders`), or None: the levels' pull-backs merge from them and
    sort nothing; ``carry``: the forward's block carry of the running totals
    (:func:`._causal.position_carry`), or None: the row dots sum from it, not summing the values
    again."""

    # the levels' and leaves' kernels read the values where the keys take part and the cotangent in
    # its own dtype, scaled per row as they read it (._columns), and the silent rows' share of dv is
    # scaled to 0 there: no (n, D) array of either, and no host read to find silent rows
    lazy_columns = True
    silent_as_mask = True

    def __init__(self, engine, q, k, v, key_mask, xp, runs=None, carry=None):
        super().__init__(engine, q, k, v, key_mask, xp)
        self.runs, self.carry = runs, carry

    def totals(self, xp, *, values: bool):
        # the value sums each query sees are read only by the quotient rule's row dots (row_dot),
        # which sum them as they read the values: handed over unevaluated
        count = self.seen(xp, xp.astype(self.take, self.q.dtype)[..., None])
        return count, SEEN_VALUE_SUMS if values else None

    def row_dot(self, xp, g, b):
        if b is not SEEN_VALUE_SUMS:
            return super().row_dot(xp, g, b)
        batch, lq = tuple(g.shape[:-2]), g.shape[-2]
        v, take = row_view(xp, self.raw_v, 2), flat_rows(xp, self.take, 1)
        dots = causal_row_dots(xp, row_view(xp, g, 2), v, take, take.shape[-1] - lq, self.carry)
        return xp.reshape(dots, batch + (lq, 1))

    def profiles_vjp(self, x, y, w, profiles, cotangents, *, xp, param_grads=True):
        return causal_profiles_vjp(x, y, w, profiles, cotangents, xp=xp, param_grads=param_grads,
                                   levels=self.engine._levels(self.runs))

    def to_keys(self, xp, weights, g):
        return weights, g

    def finish_dv(self, xp, dv, dv_sub, dv_factor):
        batch, lk, d = tuple(dv.shape[:-2]), dv.shape[-2], dv.shape[-1]
        weights = g = None
        if dv_sub is not None:
            weights, g = dv_sub
            lq = g.shape[-2]
            weights = flat_rows(xp, xp.broadcast_to(weights, batch + (lq, 1))[..., 0], 1)
            g = row_view(xp, xp.broadcast_to(g, batch + (lq, d)), 2)
        factor = flat_rows(xp, xp.broadcast_to(dv_factor, batch + (lk, 1))[..., 0], 1)
        return xp.reshape(causal_dv(xp, row_view(xp, dv, 2), g, weights, factor, self.raw_v.dtype), batch + (lk, d))


class SortedKeys(KernelRows, AllKeys):
    """Every key of the row (:class:`~slicedkern.engines._vjp.AllKeys`), pulled back over the
    forward's residuals: its sorted orders, table of keys and NaN policy's verdicts, so that the
    backward of attention on the triton engine sorts and screens nothing, and allocates nothing of
    ``(n, dv)`` but ``dv`` itself.

    ``q`` and ``k`` are the unscreened scores, read for their shapes only; ``raw_v`` the values,
    read by kernels that skip the keys that take no part. The pull-back is the engine's
    (:meth:`~slicedkern.engines.triton.TritonEngine.profiles_vjp`) over the columns left
    unevaluated (:attr:`lazy_columns`): ``dq`` the derivative sums of the values over the forward's
    table of keys (its carry a residual: no pass 1), dotted with the cotangent in pass 2's epilogue
    and scaled by the quotient rule's factor per query; ``dv`` and ``dk`` the reflected profile over
    a table of the sorted queries whose rows are the cotangent times that factor, scaled as read,
    ``dk``'s dot with the values in pass 2's epilogue, and ``dv`` finished there (:meth:`finished_vjp`:
    the centring mean's term subtracted, the keys' factor, the values' dtype)."""

    silent_as_mask = True      # the silent rows scale the cotangent of dv's table: no host read of den
    lazy_columns = True

    def __init__(self, engine, q, k, v, key_mask, xp, aux):
        self.q, self.k, self.raw_v, self.key_mask = q, k, v, key_mask
        self.take, self.good, self.row_bad = aux["take"], aux["good"], ~aux["row_ok"]
        self.orders = (aux["key_order"], aux["key_perm"], aux["query_order"], aux["query_perm"])
        self.key_carry = aux["key_carry"]
        self.engine, self.xp, self._v = engine, xp, None

    def to_keys(self, xp, weights, g):
        batch, dv = tuple(g.shape[:-2]), g.shape[-1]
        weights = flat_rows(xp, xp.broadcast_to(weights, g.shape[:-1] + (1,))[..., 0], 1)
        return xp.reshape(column_sums(xp, weights, row_view(xp, g, 2)), batch + (1, dv))

    def totals(self, xp, *, values: bool):
        # the forward's table of [v | indicator] over the keys that take part: its last carry row
        batch, dv = tuple(self.k.shape[:-1]), self.raw_v.shape[-1]
        sums = xp.astype(xp.reshape(self.key_carry[:, -1, :dv + 1], batch + (1, dv + 1)), self.q.dtype)
        return sums[..., dv:], sums[..., :dv] if values else None

    def sums_vjp(self, profile, normalizer, gout, cot, silent, *, center: bool, dv_sub, dv_factor, xp):
        if normalizer.summed and not normalizer.profile.is_fixed:
            # a normaliser with array parameters (none of the named ones has them): the generic
            # pull-back over the scan's knot sums, in the work dtype, over screened keys
            keys = AllKeys(self.engine, self.q, self.k, self.raw_v, self.key_mask, xp)
            return keys.sums_vjp(profile, normalizer, as_work(xp, gout, self.q.dtype), cot, silent, center=center,
                                 dv_sub=dv_sub, dv_factor=dv_factor, xp=xp)
        return super().sums_vjp(profile, normalizer, gout, cot, silent, center=center, dv_sub=dv_sub,
                                dv_factor=dv_factor, xp=xp)

    def finished_vjp(self, xp, w, profiles, cotangents, dv_sub, dv_factor):
        batch, m, dv = tuple(self.q.shape[:-1]), self.k.shape[-1], self.raw_v.shape[-1]

        def per_row(a, shape):       # (..., 1, dv) or (..., m, 1) factors as (R, dv or m) float64
            return flat_rows(xp, xp.astype(xp.reshape(xp.broadcast_to(a, batch + shape), batch + (-1,)),
                                           xp.float64), 1)

        sub = None if dv_sub is None else per_row(dv_sub, (1, dv))
        return self.engine.profiles_vjp(self.q, self.k, w, profiles, cotangents, xp=xp, orders=self.orders,
                                        key_carry=self.key_carry,
                                        dv_finish=(sub, per_row(dv_factor, (m, 1)), self.raw_v.dtype))


def kernel_knot_grads(xp, keyed, xq, profile, batch, gr, cols: range, *, scale=None):
    """``(dknots, dcoeffs)`` of a profile over the table columns ``cols`` (None for its fixed numbers)
    on the kernels, over a table of keys: per array knot ``t`` its ReLU sums (for the coefficient)
    and step sums (for the knot, the tie as ``profile.strict_knots`` says) dotted with the
    cotangent rows ``gr`` (R, n, len(cols)) in pass 2's epilogue, times ``scale`` (R, n) when given
    (attention's quotient-rule factor, applied there too), summed over the queries: what
    :func:`~slicedkern.engines.sortscan.pullback.knot_grads` sums over materialised cotangents,
    with no sort and no (n, c) array here."""
    def summed(unit, strict):
        rows = profile_dot(xp, keyed, xq, unit, batch, cols, gr, 0, strict=strict, factor=scale)
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
        sb_n = 0 if b.shape[1] == 1 else b.stride(1)
        loaded().row_dots[(rows, triton_cdiv(n, BLOCK_ROWS))](
            a, b, out, n, d, a.stride(0), a.stride(1), a.stride(2), b.stride(0), sb_n, b.stride(2),
            BLOCK_N=BLOCK_ROWS, BLOCK_D=BLOCK_COLS)
    return out


def column_sums(xp, weights, g):
    """``sum over i of weights[r, i] g[r, i]``: (R, d) float64, from ``weights`` (R, n) and ``g``
    (R, n, d) read in its own dtype and strides (one launch; no float64 copy of ``g``)."""
    rows, n, d = g.shape
    weights = xp.astype(weights, xp.float64).contiguous()
    out = xp.zeros((rows, d), dtype=xp.float64, device=g.device)
    if rows and d and n:
        loaded().column_sums[(rows, triton_cdiv(d, BLOCK_COLS))](
            weights, g, out, n, d, g.stride(0), g.stride(1), g.stride(2), BLOCK_N=BLOCK_ROWS, BLOCK_D=BLOCK_COLS)
    return out
