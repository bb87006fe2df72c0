"""Compiled (numba) kernels of the sweep engine's causal mode: one sweep over positions per batch row.

docs/mathematics.rst, "Causal attention". *Targets* (queries) read sums over the *sources* (keys)
they see. Sources become visible in position order: at step ``k`` the target of index ``k`` sees the
first ``clip(k + 1 + lag, 0, n_s)`` sources (``lag = n_s - n_t``: bottom-right alignment). A Fenwick
(binary indexed) tree over the sources' score ranks (sources sorted once per row) holds the rows
``[u, (s - shift) u]`` (and ``[1, s - shift]``, the valid-key indicator, for attention) of the
visible sources (``shift``: the score of the first source to become visible, :func:`_sort_sources`);
for each target and knot ``t`` the rank of ``x - t`` among the sorted sources (the exact tie rule of
:func:`._kernels_common.below`) gives the prefix sums ``P0, P1`` of the sources below it, so that the
knot's ReLU term is ``(x - t) P0 - P1``: ``O(n log n (c + 1))`` per knot, all float64.

The same sweep serves the forward and every part of the backward (:func:`causal_rows`, ``mode``):

* ``ATTENTION``: queries read keys weighted by the values: the normalised, centred output, the
  per-query residuals ``relu_count`` and ``den``, the causal NaN rule and which keys take part;
* ``PULL_QUERIES``: queries read keys weighted by ``w``: ``dx_i = g_i . sum f'(x_i - y_j) w_j`` and
  the knot / coefficient gradients (the step sums with each knot's tie rule);
* ``PULL_KEYS``: *reflected*: keys (scores negated) read the queries (negated) that see them, in
  reverse position order, weighted by the cotangents: ``f(x - y) = f((-y) - (-x))``, so
  ``dw_j = sum f(x_i - y_j) g_i`` is a value sum and ``dy_j = -w_j . sum f'(x_i - y_j) g_i`` a
  derivative sum of the same profile; negation is exact, so ties stay ties;
* ``BACKWARD_QUERIES`` and ``BACKWARD_KEYS``: the fused backward of attention, two sweeps in all.
  The first is ``PULL_QUERIES`` over the columns ``[v | 1]`` whose target weights
  ``[g_i / D_i | cotangent of R_i]`` come from the quotient rule applied per query in the sweep
  (:func:`_query_cotangents`); it also writes five numbers per query for the second, which is
  ``PULL_KEYS`` over the columns ``[gnum | cotangent of R | cotangent of D]`` built as each query is
  inserted (nothing of size ``Lq x Dv`` is materialised), plus the centring's running sum. The
  normaliser's derivative sum is read at the zero knot of the indicator (first sweep) or of the
  cotangent of ``D`` (second).

Columns: a source adds ``[u, extra]`` and ``(s - shift) [u, extra]`` to the tree, ``u`` its weight
row (``c`` columns) and ``extra`` the valid-key indicator (``ATTENTION``, ``BACKWARD_QUERIES``) or the
two scalar cotangents (``BACKWARD_KEYS``); :func:`_source_row`.

Derivative sums count a tie ``x - y = t`` (``H(0) = 1``), value sums leave it out (``ReLU(0) = 0``),
as the non-causal engines do: both ranks come from one search, the tied run of visible sources
added to the strict prefix directly.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._kernels_common import (
    ABS_NORMALIZER,
    INLINE,
    JIT,
    PARALLEL,
    RELU_NORMALIZER,
    _sort,
    below,
    claim,
    divisor_of,
    exact_sum,
    normaliser_scale,
    strict_rank,
)

__all__ = ["ATTENTION", "PULL_QUERIES", "PULL_KEYS", "BACKWARD_QUERIES", "BACKWARD_KEYS", "causal_rows"]

ATTENTION, PULL_QUERIES, PULL_KEYS, BACKWARD_QUERIES, BACKWARD_KEYS = 0, 1, 2, 3, 4


@njit(**JIT)
def _prefix(tree, r, width, acc):
    """``acc[:width] = sum of the tree rows of the ranks < r`` (Fenwick prefix read)."""
    for d in range(width):
        acc[d] = 0.0
    while r > 0:
        row = tree[r]
        for d in range(width):
            acc[d] += row[d]
        r -= r & -r


@njit(**JIT)
def _sort_sources(b, src_scores, src_mask, has_mask, negate, svals, order, rank_of):
    """Sort the sources of row ``b`` that can take part (unmasked, finite score; negated when
    ``negate``) into ``svals[b]``/``order[b]``; ``rank_of[b, s]`` is the rank of source ``s`` (-1 for
    the others). Returns ``(count sorted, shift)``.

    The shift is the score of the first source to become visible (position order; reverse order
    when ``negate``): every target that sees a source sees that one, so a target's rounding depends
    on the sources it sees only (a shift taken among all of them, say their median, would let a
    later, far larger source erase a small score difference of an early target). It is one of the
    scores the target sees, so ``s P0 - P1`` still cancels no more than the scores' own spread.
    """
    n_s = src_scores.shape[1]
    sv, so = svals[b], order[b]
    ns = 0
    first = -1
    for s in range(n_s):
        rank_of[b, s] = -1
        if has_mask and not src_mask[b, s]:
            continue
        val = src_scores[b, s]
        if np.isfinite(val):
            if first < 0 or negate:        # reversed, the last one becomes visible first
                first = s
            sv[ns] = -val if negate else val
            so[ns] = s
            ns += 1
    shift = 0.0
    if first >= 0:
        shift = -src_scores[b, first] if negate else src_scores[b, first]
    _sort(sv, so, ns)
    for r in range(ns):
        rank_of[b, so[r]] = r
    return ns, shift


@njit(**INLINE)
def _source_row(mode, b, s, src_w, query_terms, c, row):
    """``row[:cw]``: what source ``s`` adds to the prefix sums (module docstring, "Columns")."""
    urow = src_w[b, s]
    if mode == BACKWARD_KEYS:
        scale = query_terms[b, s, 0]
        for d in range(c):
            row[d] = np.float64(urow[d]) * scale
        row[c] = query_terms[b, s, 1]
        row[c + 1] = query_terms[b, s, 2]
        return True
    ok = True
    for d in range(c):
        val = np.float64(urow[d])
        row[d] = val
        ok = ok and np.isfinite(val)
    if mode == ATTENTION or mode == BACKWARD_QUERIES:
        row[c] = 1.0
    return ok


@njit(**JIT)
def _causal_row(b, tree, mode, src, tgt, terms, profile, options, work, outs):
    """Sweep row ``b`` (see the module docstring); ``tree`` (n_s + 1, W) is the worker's Fenwick tree."""
    src_scores, src_w, src_mask, has_mask = src
    tgt_scores, tgt_vec, tgt_mask, has_tgt_mask = tgt
    relu_counts, dens, fwd_out, query_terms = terms
    knots, coeffs, slope, intercept, strict = profile
    normalizer, zero_knot = options.normalizer, options.zero_knot
    want_params = options.want_params
    svals, order, rank_of, inserted = work
    rows_out, scal_out, relu_out, den_out, take_out, dknots, dcoeffs = outs
    n_s, n_t, c = src_scores.shape[1], tgt_scores.shape[1], src_w.shape[2]
    n_knots = knots.shape[1]
    reverse = mode == PULL_KEYS or mode == BACKWARD_KEYS
    fused = mode == BACKWARD_QUERIES or mode == BACKWARD_KEYS
    summed = normalizer == ABS_NORMALIZER or normalizer == RELU_NORMALIZER
    extra = 2 if mode == BACKWARD_KEYS else (1 if mode == ATTENTION or mode == BACKWARD_QUERIES else 0)
    cw = c + extra                          # prefix-sum columns: the weights, then the extra ones
    width = 2 * cw                          # [P0 columns, P1 columns]
    need_zero = mode == ATTENTION or (fused and summed)
    lag = 0 if reverse else n_s - n_t
    ns, sh = _sort_sources(b, src_scores, src_mask, has_mask, reverse, svals, order, rank_of)
    sv, so, ins = svals[b], order[b], inserted[b]
    for r in range(ns + 1):
        for d in range(width):
            tree[r, d] = 0.0
    for r in range(ns):
        ins[r] = False
    a, bs = intercept[b], slope[b]
    t0 = np.zeros(cw)                      # running totals of the visible sources: sum u, sum (s - sh) u
    t1 = np.zeros(cw)
    centring = np.zeros(c)                 # BACKWARD_KEYS: sum of the mean weights times gnum
    row = np.empty(width)
    acc = np.empty(width)
    p0s = np.zeros((n_knots, cw))          # per knot: strict prefix sums, and the step sums with ties
    p1s = np.zeros((n_knots, cw))
    p0n = np.zeros((n_knots, cw))
    value = np.empty(cw)
    deriv = np.empty(cw)
    zvec = np.empty(cw)
    poisoned = False
    n_in = 0
    for k in range(n_t):
        # 1. the sources that become visible at this step
        target_seen = min(max(k + 1 + lag, 0), n_s)
        while n_in < target_seen:
            s = n_s - 1 - n_in if reverse else n_in
            n_in += 1
            if has_mask and not src_mask[b, s]:
                if mode == ATTENTION:
                    take_out[b, s] = False
                continue
            r = rank_of[b, s]
            ok = r >= 0
            if ok:
                ys = sv[r] - sh
                ok = _source_row(mode, b, s, src_w, query_terms, c, row)
                for d in range(cw):
                    row[cw + d] = ys * row[d]
            if mode == ATTENTION:
                take_out[b, s] = ok
            if not ok:                         # a non-finite key or value: poisons what sees it
                poisoned = True
                continue
            if mode == BACKWARD_KEYS:
                mean_weight = query_terms[b, s, 3]
                if mean_weight != 0.0:
                    for d in range(c):
                        centring[d] += mean_weight * row[d]
            for d in range(cw):
                t0[d] += row[d]
                t1[d] += row[cw + d]
            ins[r] = True
            node = r + 1
            while node <= ns:
                dst = tree[node]
                for d in range(width):
                    dst[d] += row[d]
                node += node & -node

        # 2. the target: its prefix sums per knot
        t = n_t - 1 - k if reverse else k
        if has_tgt_mask and not tgt_mask[b, t]:           # a masked key (BACKWARD_KEYS): no gradient
            orow = rows_out[b, t]
            for d in range(c):
                orow[d] = 0.0
            scal_out[b, t] = 0.0
            continue
        xu = tgt_scores[b, t]
        finite = np.isfinite(xu)
        if not finite:
            xu = 0.0
        if reverse:
            xu = -xu
        xs = xu - sh
        for m in range(n_knots):
            tm = knots[b, m]
            if coeffs[b, m] == 0.0 and not (want_params or (need_zero and m == zero_knot)):
                continue
            su, se = exact_sum(xu, -tm)
            rs = strict_rank(sv, ns, su, se)
            _prefix(tree, rs, width, acc)
            p0m, p1m, pnm = p0s[m], p1s[m], p0n[m]
            for d in range(cw):
                p0m[d] = acc[d]
                p1m[d] = acc[cw + d]
                pnm[d] = acc[d]
            rn = rs
            while rn < ns and below(sv[rn], su, se, True):      # the tied run: H(0) = 1
                if ins[rn]:
                    _source_row(mode, b, so[rn], src_w, query_terms, c, row)
                    for d in range(cw):
                        pnm[d] += row[d]
                rn += 1

        # 3. what the mode makes of them
        if mode == ATTENTION:
            _attention_output(b, t, c, xs, a, bs, t0, t1, p0s, p1s, coeffs, knots, options,
                              poisoned or not finite, value, zvec, outs)
            continue
        for d in range(cw):
            value[d] = a * t0[d] + bs * (xs * t0[d] - t1[d])
            deriv[d] = bs * t0[d]
        for m in range(n_knots):
            cm = coeffs[b, m]
            if cm == 0.0:
                continue
            sm = xs - knots[b, m]
            p0m, p1m, pnm = p0s[m], p1s[m], p0n[m]
            for d in range(cw):
                value[d] += cm * (sm * p0m[d] - p1m[d])
                deriv[d] += cm * pnm[d]
        # the normaliser's derivative sum, over column ``col``: |r|' = 2 H(r) - 1, ReLU' = H
        col = c + 1 if mode == BACKWARD_KEYS else c
        norm_deriv = 0.0
        if fused and summed:
            norm_deriv = p0n[zero_knot, col]
            if normalizer == ABS_NORMALIZER:
                norm_deriv = 2.0 * norm_deriv - t0[col]
        # (the sums in the generic backward's order, so that what cancels there cancels here: a
        # query that sees one key gives it exactly 0)
        if mode == BACKWARD_KEYS:
            vrow, orow = tgt_vec[b, t], rows_out[b, t]
            dot = 0.0
            for d in range(c):
                orow[d] = value[d] - centring[d]
                dot += np.float64(vrow[d]) * deriv[d]
            dot += deriv[c]
            scal_out[b, t] = -dot - norm_deriv
            continue
        if mode == BACKWARD_QUERIES:
            grad_norm = _query_cotangents(b, t, c, t0, tgt_vec, relu_counts, dens, fwd_out, query_terms,
                                          options, zvec)
        else:
            zrow = tgt_vec[b, t]
            for d in range(c):
                zvec[d] = np.float64(zrow[d])
            grad_norm = 0.0
        dot = 0.0
        for d in range(cw):
            dot += zvec[d] * deriv[d]
        dot += grad_norm * norm_deriv
        if mode == PULL_KEYS:
            orow = rows_out[b, t]
            for d in range(c):
                orow[d] = value[d]
            scal_out[b, t] = -dot
            continue
        scal_out[b, t] = dot
        if want_params:
            for m in range(n_knots):
                sm = xs - knots[b, m]
                p0m, p1m = (p0s[m] if strict[m] else p0n[m]), p1s[m]
                step, relu = 0.0, 0.0
                for d in range(cw):
                    step += zvec[d] * p0m[d]
                    relu += zvec[d] * (sm * p0s[m, d] - p1m[d])
                dknots[b, m] -= coeffs[b, m] * step
                dcoeffs[b, m] += relu
    if mode == ATTENTION:                      # keys past the last query's position: none when lq > 0
        for s in range(n_in, n_s):
            take_out[b, s] = (not has_mask or src_mask[b, s]) and rank_of[b, s] >= 0


@njit(**INLINE)
def _attention_output(b, t, c, xs, a, bs, t0, t1, p0s, p1s, coeffs, knots, options, bad, value, zvec, outs):
    """``ATTENTION``: the normalised, centred output of query ``t`` and its residuals. The centring
    is taken knot by knot, ``P - mu [count, key sum]`` (docs, "Attention": ``N - mu R``), so that what
    cancels cancels exactly: a query that sees one key gets exactly 0."""
    rows_out, _, relu_out, den_out, _, _, _ = outs
    center, normalizer, zero_knot, eps = options.center, options.normalizer, options.zero_knot, options.eps
    n_seen, key_sum = t0[c], t1[c]
    mean_div = n_seen if n_seen > 1.0 else 1.0
    for d in range(c):
        mu = t0[d] / mean_div if center else 0.0
        zvec[d] = mu
        c0 = t0[d] - mu * n_seen
        value[d] = a * c0 + bs * (xs * c0 - (t1[d] - mu * key_sum))
    relu_count = a * n_seen + bs * (xs * n_seen - key_sum)
    for m in range(knots.shape[1]):
        cm = coeffs[b, m]
        if cm == 0.0:
            continue
        sm = xs - knots[b, m]
        p0m, p1m = p0s[m], p1s[m]
        cm_, km_ = p0m[c], p1m[c]
        for d in range(c):
            mu = zvec[d]
            value[d] += cm * (sm * (p0m[d] - mu * cm_) - (p1m[d] - mu * km_))
        relu_count += cm * (sm * cm_ - km_)
    zc, zs = p0s[zero_knot, c], p1s[zero_knot, c]
    den = xs * zc - zs
    if normalizer == ABS_NORMALIZER:
        den = 2.0 * den - (xs * n_seen - key_sum)
    relu_out[b, t] = relu_count
    den_out[b, t] = den
    orow = rows_out[b, t]
    if bad:
        for d in range(c):
            orow[d] = np.nan
        return
    scale, _ = normaliser_scale(normalizer, xs, zc, zs, n_seen, key_sum, eps)
    if normalizer != 0 and n_seen == 0.0:
        scale = 1.0            # no key seen: an empty sum, 0 (not 0 / eps)
    for d in range(c):
        orow[d] = value[d] * scale


@njit(**INLINE)
def _query_cotangents(b, t, c, t0, cot, relu_counts, dens, fwd_out, query_terms, options, zvec):
    """``BACKWARD_QUERIES``: the quotient rule of query ``t`` (:func:`slicedkern.engines._combine.pullback`,
    docs "The backward pass"), from its cotangent, the forward's output and residuals and the totals
    of the keys it sees (``t0``: values, then count). Sets ``zvec = [gnum, cotangent of R]``, stores
    ``(1 / divisor, cotangent of R, cotangent of D, R / count, silent)`` in ``query_terms[b, t]`` for
    the keys' sweep and returns the cotangent of ``D``. ``silent`` (1.0) marks a row whose normaliser
    sum is exactly 0 while it sees a key, under a profile that vanishes there (engines/_vjp.py): the
    fused backward does not serve those, and the caller takes the generic one."""
    center, normalizer, eps = options.center, options.normalizer, options.eps
    count = t0[c]
    count_c = count if count > 1.0 else 1.0
    summed = normalizer == ABS_NORMALIZER or normalizer == RELU_NORMALIZER
    den = dens[b, t] if summed else 0.0
    scale = 1.0 / divisor_of(normalizer, count, den, eps)
    grow = cot[b, t]
    grad_count = 0.0
    for d in range(c):
        g = np.float64(grow[d]) * scale
        zvec[d] = g
        grad_count -= g * (t0[d] / count_c)
    grad_count = grad_count if center else 0.0
    zvec[c] = grad_count
    grad_norm = 0.0
    if summed and den >= eps:
        orow = fwd_out[b, t]
        for d in range(c):
            grad_norm -= np.float64(grow[d]) * np.float64(orow[d])
        grad_norm *= scale
    terms = query_terms[b, t]
    terms[0] = scale
    terms[1] = grad_count
    terms[2] = grad_norm
    terms[3] = relu_counts[b, t] / count_c if center else 0.0
    terms[4] = 1.0 if options.vanishes and count > 0.0 and den == 0.0 else 0.0
    return grad_norm


@njit(**PARALLEL)
def causal_rows(mode, src, tgt, terms, profile, options, work, outs, trees, n_workers):
    """Sweep every batch row (``mode``: one of the module's five).

    ``src = (scores (B, n_s) float64, weights (B, n_s, c), mask (B, n_s) bool, has_mask)``;
    ``tgt = (scores (B, n_t) float64, vectors (B, n_t, c), mask (B, n_t) bool, has_mask)`` (the
    vectors: the cotangents for ``PULL_QUERIES`` and ``BACKWARD_QUERIES``, the keys' weights for the
    key modes; unread for ``ATTENTION``; the mask: the key mask for ``BACKWARD_KEYS``);
    ``terms = (relu_count (B, n_q), den (B, n_q), out (B, n_q, c), query_terms (B, n_q, 5) float64)``
    (the forward's residuals and output, read by ``BACKWARD_QUERIES``, which writes ``query_terms``
    for ``BACKWARD_KEYS``); ``profile = (knots (B, M), coeffs (B, M), slope (B,), intercept (B,),
    strict (M,) bool)``; ``options``: a :class:`._kernels_common.CausalOptions`; ``work = (svals (B,
    n_s), order (B, n_s) int64, rank_of (B, n_s) int64, inserted (B, n_s) bool)``; ``outs = (rows (B,
    n_t, c), scalars (B, n_t), relu_count (B, n_t), den (B, n_t), take (B, n_s) bool, dknots (B, M)
    zeros, dcoeffs (B, M) zeros)`` (unused ones may be (1, 1[, 1]) placeholders); ``trees (n_workers,
    n_s + 1, W)`` float64, one Fenwick tree per worker. Rows are claimed dynamically;
    ``n_workers == 1`` runs on the calling thread.
    """
    bsz = src[0].shape[0]
    if n_workers == 1:
        for b in range(bsz):
            _causal_row(b, trees[0], mode, src, tgt, terms, profile, options, work, outs)
        return
    next_row = np.zeros(1, np.int64)
    for wid in prange(n_workers):
        b = claim(next_row)
        while b < bsz:
            _causal_row(b, trees[wid], mode, src, tgt, terms, profile, options, work, outs)
            b = claim(next_row)
