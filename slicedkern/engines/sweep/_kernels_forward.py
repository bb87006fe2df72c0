"""Compiled (numba) kernels of the sweep engine: the forward sweep (:func:`forward_rows`).

Argument groups and scheduling: see :mod:`._kernels_common`. Imported only by the host bridge, where
numba is installed.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._kernels_common import (
    JIT,
    PARALLEL,
    PREFETCH_AHEAD,
    below,
    claim,
    exact_sum,
    fetch_row,
    normaliser_scale,
    sort_row,
    value_totals,
)

__all__ = ["forward_rows"]

@njit(**JIT)
def _forward_task(b, c0, c1, scores, sorted_rows, profile, options, values, out, saved):
    """Columns ``c0:c1`` of row ``b`` of the (normalised, centred) kernel sum; True on a bad value.

    ``options``: a :class:`._kernels_common.SumOptions`; a plain kernel sum is
    ``SumOptions.plain()``. ``knots[b, zero_knot] == 0`` carries the "abs"/"relu" normaliser.
    Queries are visited in increasing order, a pointer per knot advancing through the sorted keys
    (merge-style) with float64 running sums ``P0 = sum w_j``, ``P1 = sum (y_j - shift) w_j``; the
    output row is assembled in float64 and written once (docs, "The kernel sum by sort-scan").
    With ``saved = (scale, relu_sum, unclamped, totals, keep)`` and ``keep``, the task also writes
    what the backward would otherwise recompute (see :func:`forward_rows`).
    """
    _, keys_given, mask, has_mask = scores
    saved_scale, saved_relu, saved_unclamped, saved_totals, keep = saved
    keep_queries = keep and c0 == 0         # one chunk writes the per-query terms
    queries, query_order, keys, key_order, counts, shift = sorted_rows
    knots, coeffs, slope, intercept = profile
    center, normalizer, zero_knot, eps = options.center, options.normalizer, options.zero_knot, options.eps
    n_all = query_order.shape[1]
    width = c1 - c0
    n_knots = knots.shape[1]
    nq, nk = counts[b, 0], counts[b, 1]
    sh, a, bs = shift[b], intercept[b], slope[b]
    qrow, krow, qp, kp = queries[b], keys[b], query_order[b], key_order[b]

    # the knot with the furthest reach among those with a non-zero coefficient: when nothing else
    # needs the column totals, its pointer is finished after the sweep and its P0 is the totals
    far = -1
    for m in range(n_knots):
        if coeffs[b, m] != 0.0 and (far < 0 or knots[b, m] < knots[b, far]):
            far = m
    need_totals = a != 0.0 or bs != 0.0 or center or far < 0
    t0 = np.zeros(width)
    t1 = np.zeros(width)
    if need_totals and value_totals(b, c0, c1, keys_given, mask, has_mask, sh, values, t0, t1):
        return True
    if keep and need_totals:
        for d in range(width):
            saved_totals[b, c0 + d] = t0[d]
    n_keys = np.float64(nk)
    key_sum = 0.0
    for p in range(nk):
        key_sum += krow[p] - sh
    mean = np.zeros(width)
    if center:  # centring folded in as N - mean R (docs, "Attention")
        for d in range(width):
            mean[d] = t0[d] / (n_keys if n_keys > 1.0 else 1.0)

    p0 = np.zeros((n_knots, width))
    p1 = np.zeros((n_knots, width))
    count = np.zeros(n_knots)
    key_part = np.zeros(n_knots)
    ptr = np.zeros(n_knots, np.int64)
    acc = np.empty(width)
    for m in range(n_knots):
        if coeffs[b, m] != 0.0:
            for p in range(min(PREFETCH_AHEAD, nk)):
                fetch_row(values, b, kp[p], c0, width, False)
    for pos in range(min(PREFETCH_AHEAD, nq)):
        fetch_row(out, b, qp[pos], c0, width, True)

    # the last knot with a non-zero coefficient is folded into the store loop (no extra pass)
    last = 0
    for m in range(n_knots):
        if coeffs[b, m] != 0.0:
            last = m
    linear = a != 0.0 or bs != 0.0
    for pos in range(nq):
        i = qp[pos]
        xu = qrow[pos]          # as given: ties are decided on it
        x = xu - sh             # shifted: what the sums use
        if pos + PREFETCH_AHEAD < nq:
            fetch_row(out, b, qp[pos + PREFETCH_AHEAD], c0, width, True)
        if linear:
            for d in range(width):
                acc[d] = a * t0[d] + bs * (x * t0[d] - t1[d])
        else:
            for d in range(width):
                acc[d] = 0.0
        relu_count = a * n_keys + bs * (x * n_keys - key_sum) if linear else 0.0
        s_last = 0.0
        for m in range(n_knots):
            tm = knots[b, m]
            s = x - tm
            su, se = exact_sum(xu, -tm)
            cm = coeffs[b, m]
            p0m, p1m = p0[m], p1[m]
            p = ptr[m]
            # value sums leave tied keys out (ReLU(0) = 0): a query on or below every key gets an
            # exactly zero sum, not a rounding residue that an eps-clamped normaliser would amplify
            while p < nk and below(krow[p], su, se, False):
                yk = krow[p] - sh
                if cm != 0.0:
                    if p + PREFETCH_AHEAD < nk:
                        fetch_row(values, b, kp[p + PREFETCH_AHEAD], c0, width, False)
                    vrow = values[b, kp[p], c0:c1]
                    for d in range(width):
                        val = np.float64(vrow[d])
                        p0m[d] += val
                        p1m[d] += yk * val
                count[m] += 1.0
                key_part[m] += yk
                p += 1
            ptr[m] = p
            if cm != 0.0:
                if m != last:
                    for d in range(width):
                        acc[d] += cm * (s * p0m[d] - p1m[d])
                relu_count += cm * (s * count[m] - key_part[m])
            if m == last:
                s_last = s
        scale, unclamped = normaliser_scale(normalizer, x, count[zero_knot], key_part[zero_knot], n_keys,
                                            key_sum, eps)
        if keep_queries:
            saved_scale[b, i] = scale
            saved_relu[b, i] = relu_count
            saved_unclamped[b, i] = unclamped
        orow = out[b, i, c0:c1]
        cl = coeffs[b, last]
        p0l, p1l = p0[last], p1[last]
        for d in range(width):
            orow[d] = (acc[d] + cl * (s_last * p0l[d] - p1l[d]) - mean[d] * relu_count) * scale

    if not need_totals:
        # finish the furthest pointer: its P0 becomes the column totals, finite iff every value is
        p0f = p0[far]
        for p in range(ptr[far], nk):
            if p + PREFETCH_AHEAD < nk:
                fetch_row(values, b, kp[p + PREFETCH_AHEAD], c0, width, False)
            vrow = values[b, kp[p], c0:c1]
            for d in range(width):
                p0f[d] += np.float64(vrow[d])
        for d in range(width):
            if not np.isfinite(p0f[d]):
                return True
    for pos in range(nq, n_all):  # non-finite queries: NaN rows
        orow = out[b, qp[pos], c0:c1]
        for d in range(width):
            orow[d] = np.nan
    return False


@njit(**PARALLEL)
def forward_rows(scores, profile, options, values, out, sorted_rows, saved, schedule):
    """Sort every row into ``sorted_rows``, then sweep every (row, column chunk) into ``out``.

    ``out (B, n, c)`` has the dtype of ``values``. Returns ``bad (B * n_chunks,)``:
    ``bad[b * n_chunks + ch]`` marks a task whose row has a non-finite valid key or value (the
    caller fills those rows with NaN). ``saved = (scale (B, n), relu_sum (B, n), unclamped (B, n)
    bool, totals (B, c), keep)``, zeros: with ``keep``, every finite query's ``1 / D_i``, ``R_i``
    and whether ``D_i`` escaped the ``eps`` clamp, and the value column totals (where the sweep
    needs them), for the backward pass to reuse with ``sorted_rows`` (no second sort, no
    preparation sweep); dummies without ``keep``.
    """
    x = scores[0]
    n_chunks, chunk_width, n_workers = schedule
    bsz, c = x.shape[0], values.shape[2]
    n_tasks = bsz * n_chunks
    bad = np.zeros(n_tasks, np.bool_)
    if n_workers == 1:
        for b in range(bsz):
            sort_row(b, scores, sorted_rows)
        for t in range(n_tasks):
            b, ch = t // n_chunks, t % n_chunks
            if sorted_rows[4][b, 2] != 0:
                bad[t] = True
            else:
                c0 = ch * chunk_width
                bad[t] = _forward_task(b, c0, min(c, c0 + chunk_width), scores, sorted_rows, profile,
                                       options, values, out, saved)
        return bad
    next_row = np.zeros(1, np.int64)
    for _ in prange(n_workers):
        b = claim(next_row)
        while b < bsz:
            sort_row(b, scores, sorted_rows)
            b = claim(next_row)
    next_task = np.zeros(1, np.int64)
    for _ in prange(n_workers):
        t = claim(next_task)
        while t < n_tasks:
            b, ch = t // n_chunks, t % n_chunks
            if sorted_rows[4][b, 2] != 0:
                bad[t] = True
            else:
                c0 = ch * chunk_width
                bad[t] = _forward_task(b, c0, min(c, c0 + chunk_width), scores, sorted_rows, profile,
                                       options, values, out, saved)
            t = claim(next_task)
    return bad


