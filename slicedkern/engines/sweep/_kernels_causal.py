"""Compiled (numba) kernels of the sweep engine's causal mode: one sweep over positions per batch row.

docs/mathematics.rst, "Causal attention". *Targets* (queries) read sums over the *sources* (keys)
they see. Sources become visible in position order: at step ``k`` the target of index ``k`` sees the
first ``clip(k + 1 + lag, 0, n_s)`` sources (``lag = n_s - n_t``: bottom-right alignment). A Fenwick
(binary indexed) tree over the sources' score ranks (sources sorted once per row) holds the rows
``[u, (s - shift) u]`` (and ``[1, s - shift]``, the valid-key indicator, for attention) of the
visible sources; for each target and knot ``t`` the rank of ``x - t`` among the sorted sources (the
exact tie rule of :func:`._kernels_common.below`) gives the prefix sums ``P0, P1`` of the sources
below it, so that the knot's ReLU term is ``(x - t) P0 - P1``: ``O(n log n (c + 1))`` per knot, all
float64.

The same sweep serves the forward and every part of the backward (:func:`causal_rows`, ``mode``):

* ``ATTENTION``: queries read keys weighted by the values: the normalised, centred output, the
  per-query residuals ``relu_count`` and ``den``, the causal NaN rule and which keys take part;
* ``PULL_QUERIES``: queries read keys weighted by ``w``: ``dx_i = g_i . sum f'(x_i - y_j) w_j`` and
  the knot / coefficient gradients (the step sums with each knot's tie rule);
* ``PULL_KEYS``: *reflected*: keys (scores negated) read the queries (negated) that see them, in
  reverse position order, weighted by the cotangents: ``f(x - y) = f((-y) - (-x))``, so
  ``dw_j = sum f(x_i - y_j) g_i`` is a value sum and ``dy_j = -w_j . sum f'(x_i - y_j) g_i`` a
  derivative sum of the same profile; negation is exact, so ties stay ties.

Derivative sums count a tie ``x - y = t`` (``H(0) = 1``), value sums leave it out (``ReLU(0) = 0``),
as the non-causal engines do: both ranks come from one search, the tied run of visible sources
added to the strict prefix directly.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._kernels_common import (
    ABS_NORMALIZER,
    JIT,
    PARALLEL,
    _sort,
    below,
    claim,
    exact_sum,
    normaliser_scale,
)

__all__ = ["ATTENTION", "PULL_QUERIES", "PULL_KEYS", "causal_rows"]

ATTENTION, PULL_QUERIES, PULL_KEYS = 0, 1, 2


@njit(**JIT)
def _strict_rank(vals, n, su, se):
    """The number of ``vals[:n]`` (sorted) below ``su + se`` exactly."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if below(vals[mid], su, se, False):
            lo = mid + 1
        else:
            hi = mid
    return lo


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
    the others). Returns ``(count sorted, shift)``."""
    n_s = src_scores.shape[1]
    sv, so = svals[b], order[b]
    ns = 0
    for s in range(n_s):
        rank_of[b, s] = -1
        if has_mask and not src_mask[b, s]:
            continue
        val = src_scores[b, s]
        if np.isfinite(val):
            sv[ns] = -val if negate else val
            so[ns] = s
            ns += 1
    _sort(sv, so, ns)
    for r in range(ns):
        rank_of[b, so[r]] = r
    return ns, (sv[ns // 2] if ns > 0 else 0.0)


@njit(**JIT)
def _causal_row(b, tree, mode, src, tgt, profile, options, work, outs):
    """Sweep row ``b`` (see the module docstring); ``tree`` (n_s + 1, W) is the worker's Fenwick tree."""
    src_scores, src_w, src_mask, has_mask = src
    tgt_scores, tgt_vec = tgt
    knots, coeffs, slope, intercept, strict = profile
    center, normalizer, zero_knot, eps = options.center, options.normalizer, options.zero_knot, options.eps
    want_params = options.want_params
    svals, order, rank_of, inserted = work
    rows_out, scal_out, relu_out, den_out, take_out, dknots, dcoeffs = outs
    n_s, n_t, c = src_scores.shape[1], tgt_scores.shape[1], src_w.shape[2]
    n_knots = knots.shape[1]
    reverse = mode == PULL_KEYS
    ones = mode == ATTENTION
    lag = 0 if reverse else n_s - n_t
    width = 2 * c + (2 if ones else 0)
    ns, sh = _sort_sources(b, src_scores, src_mask, has_mask, reverse, svals, order, rank_of)
    sv, so, ins = svals[b], order[b], inserted[b]
    for r in range(ns + 1):
        for d in range(width):
            tree[r, d] = 0.0
    for r in range(ns):
        ins[r] = False
    a, bs = intercept[b], slope[b]
    t0 = np.zeros(c)                       # running totals of the visible sources: sum u, sum (s - sh) u
    t1 = np.zeros(c)
    n_seen, key_sum = 0.0, 0.0
    row = np.empty(width)
    acc = np.empty(width)
    p0s = np.zeros((n_knots, c))           # per knot: strict prefix sums, and the step sums with ties
    p1s = np.zeros((n_knots, c))
    p0n = np.zeros((n_knots, c))
    cnt = np.zeros(n_knots)
    ksm = np.zeros(n_knots)
    value = np.empty(c)
    deriv = np.empty(c)
    zvec = np.empty(c)
    poisoned = False
    n_in = 0
    for k in range(n_t):
        # 1. the sources that become visible at this step
        target_seen = min(max(k + 1 + lag, 0), n_s)
        while n_in < target_seen:
            s = n_s - 1 - n_in if reverse else n_in
            n_in += 1
            if has_mask and not src_mask[b, s]:
                if ones:
                    take_out[b, s] = False
                continue
            r = rank_of[b, s]
            ok = r >= 0
            if ok:
                ys = sv[r] - sh
                urow = src_w[b, s]
                for d in range(c):
                    val = np.float64(urow[d])
                    row[d] = val
                    row[c + d] = ys * val
                    ok = ok and np.isfinite(val)
            if ones:
                take_out[b, s] = ok
            if not ok:                         # a non-finite key or value: poisons what sees it
                poisoned = True
                continue
            if ones:
                row[2 * c] = 1.0
                row[2 * c + 1] = ys
                n_seen += 1.0
                key_sum += ys
            for d in range(c):
                t0[d] += row[d]
                t1[d] += row[c + d]
            ins[r] = True
            node = r + 1
            while node <= ns:
                dst = tree[node]
                for d in range(width):
                    dst[d] += row[d]
                node += node & -node

        # 2. the target: its prefix sums per knot
        t = n_t - 1 - k if reverse else k
        xu = tgt_scores[b, t]
        finite = np.isfinite(xu)
        if not finite:
            xu = 0.0
        if reverse:
            xu = -xu
        xs = xu - sh
        for m in range(n_knots):
            tm = knots[b, m]
            if coeffs[b, m] == 0.0 and not (want_params or (ones and m == zero_knot)):
                continue
            su, se = exact_sum(xu, -tm)
            rs = _strict_rank(sv, ns, su, se)
            _prefix(tree, rs, width, acc)
            p0m, p1m, pnm = p0s[m], p1s[m], p0n[m]
            for d in range(c):
                p0m[d] = acc[d]
                p1m[d] = acc[c + d]
                pnm[d] = acc[d]
            if ones:
                cnt[m] = acc[2 * c]
                ksm[m] = acc[2 * c + 1]
            rn = rs
            while rn < ns and below(sv[rn], su, se, True):      # the tied run: H(0) = 1
                if ins[rn]:
                    urow = src_w[b, so[rn]]
                    for d in range(c):
                        pnm[d] += np.float64(urow[d])
                rn += 1

        # 3. what the mode makes of them. Attention centres every prefix sum itself, P - mu [count,
        #    key sum] (docs, "Attention": N - mu R, taken knot by knot so that what cancels cancels
        #    exactly: a query that sees one key gets exactly 0)
        mean_div = n_seen if n_seen > 1.0 else 1.0
        for d in range(c):
            mu = t0[d] / mean_div if center else 0.0
            zvec[d] = mu
            c0 = t0[d] - mu * n_seen
            value[d] = a * c0 + bs * (xs * c0 - (t1[d] - mu * key_sum))
            deriv[d] = bs * t0[d]
        relu_count = a * n_seen + bs * (xs * n_seen - key_sum)
        for m in range(n_knots):
            cm = coeffs[b, m]
            if cm == 0.0:
                continue
            sm = xs - knots[b, m]
            p0m, p1m, pnm = p0s[m], p1s[m], p0n[m]
            if ones:
                cm_, km_ = cnt[m], ksm[m]
                for d in range(c):
                    mu = zvec[d]
                    value[d] += cm * (sm * (p0m[d] - mu * cm_) - (p1m[d] - mu * km_))
                relu_count += cm * (sm * cm_ - km_)
            else:
                for d in range(c):
                    value[d] += cm * (sm * p0m[d] - p1m[d])
                    deriv[d] += cm * pnm[d]
        if mode == ATTENTION:
            zc, zs = cnt[zero_knot], ksm[zero_knot]
            den = xs * zc - zs
            if normalizer == ABS_NORMALIZER:
                den = 2.0 * den - (xs * n_seen - key_sum)
            relu_out[b, t] = relu_count
            den_out[b, t] = den
            orow = rows_out[b, t]
            if poisoned or not finite:
                for d in range(c):
                    orow[d] = np.nan
                continue
            scale, _ = normaliser_scale(normalizer, xs, zc, zs, n_seen, key_sum, eps)
            if normalizer != 0 and n_seen == 0.0:
                scale = 1.0            # no key seen: an empty sum, 0 (not 0 / eps)
            for d in range(c):
                orow[d] = value[d] * scale
            continue
        zrow = tgt_vec[b, t]
        for d in range(c):
            zvec[d] = np.float64(zrow[d])
        dot = 0.0
        for d in range(c):
            dot += zvec[d] * deriv[d]
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
                for d in range(c):
                    step += zvec[d] * p0m[d]
                    relu += zvec[d] * (sm * p0s[m, d] - p1m[d])
                dknots[b, m] -= coeffs[b, m] * step
                dcoeffs[b, m] += relu
    if ones:                                   # keys past the last query's position: none when lq > 0
        for s in range(n_in, n_s):
            take_out[b, s] = (not has_mask or src_mask[b, s]) and rank_of[b, s] >= 0


@njit(**PARALLEL)
def causal_rows(mode, src, tgt, profile, options, work, outs, trees, n_workers):
    """Sweep every batch row (``mode``: ``ATTENTION``, ``PULL_QUERIES`` or ``PULL_KEYS``).

    ``src = (scores (B, n_s) float64, weights (B, n_s, c), mask (B, n_s) bool, has_mask)``;
    ``tgt = (scores (B, n_t) float64, vectors (B, n_t, c))`` (the cotangents for ``PULL_QUERIES``,
    the keys' weights for ``PULL_KEYS``; unread for ``ATTENTION``); ``profile = (knots (B, M),
    coeffs (B, M), slope (B,), intercept (B,), strict (M,) bool)``; ``options = (center, normalizer,
    zero_knot, eps, want_params)``; ``work = (svals (B, n_s), order (B, n_s) int64, rank_of (B, n_s)
    int64, inserted (B, n_s) bool)``; ``outs = (rows (B, n_t, c), scalars (B, n_t), relu_count
    (B, n_t), den (B, n_t), take (B, n_s) bool, dknots (B, M) zeros, dcoeffs (B, M) zeros)`` (unused
    ones may be (1, 1[, 1]) placeholders); ``trees (n_workers, n_s + 1, W)`` float64, one Fenwick
    tree per worker. Rows are claimed dynamically; ``n_workers == 1`` runs on the calling thread.
    """
    bsz = src[0].shape[0]
    if n_workers == 1:
        for b in range(bsz):
            _causal_row(b, trees[0], mode, src, tgt, profile, options, work, outs)
        return
    next_row = np.zeros(1, np.int64)
    for wid in prange(n_workers):
        b = claim(next_row)
        while b < bsz:
            _causal_row(b, trees[wid], mode, src, tgt, profile, options, work, outs)
            b = claim(next_row)
