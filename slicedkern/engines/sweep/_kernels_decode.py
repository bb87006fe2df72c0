"""Compiled (numba) kernels of decoding on the host: the binary counter of sorted runs of
:mod:`slicedkern.engines.scan._decode`, with each run's sort, prefix table and rank searches compiled.

docs/mathematics.rst, "Decoding". The keys appended so far occupy positions ``0..n-1`` of per-row
storage; a run is a range ``[s, e)`` of positions, kept sorted in ``sorted_keys[:, s:e]`` with the
inclusive prefix rows of ``[w, 1, (y - shift) w, y - shift]`` (``shift``: the run's median key,
stored at ``shifts[:, s]``) in ``prefix[:, s:e]``. A query sums, over the runs and the knots, one
exact rank search (the tie rule of :func:`._kernels_common.below`, strict: a key at ``x - t`` is
not below) and one prefix row, all in float64, and combines them into attention as
:func:`slicedkern.engines._combine.combine` does.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ._kernels_common import ABS_NORMALIZER, JIT, RELU_NORMALIZER, _sort, divisor_of, exact_sum, strict_rank

__all__ = ["admit", "build_run", "attend_rows"]


@njit(**JIT)
def admit(k, v, mask, start, keys, values, taken, totals, bad):
    """Write the keys ``k`` (B, t) and values ``v`` (B, t, dv) at positions ``start...`` of the storage.

    The NaN rule: a key that takes part (``mask``) but is not finite (score or value) is stored as
    a zero key that takes no part, and marks its row ``bad``; ``totals`` (B, dv + 1) gathers the
    values' sum and the count of the keys that take part."""
    bsz, t, dv = v.shape
    for b in range(bsz):
        for i in range(t):
            y = np.float64(k[b, i])
            ok = np.isfinite(y)
            for d in range(dv):
                ok = ok and np.isfinite(v[b, i, d])
            take = ok and mask[b, i]
            if mask[b, i] and not ok:
                bad[b] = True
            p = start + i
            keys[b, p] = y if np.isfinite(y) else 0.0
            taken[b, p] = take
            for d in range(dv):
                u = np.float64(v[b, i, d]) if take else 0.0
                values[b, p, d] = u
                totals[b, d] += u
            if take:
                totals[b, dv] += 1.0


@njit(**JIT)
def build_run(s, e, keys, values, taken, sorted_keys, prefix, shifts):
    """Sort the keys of positions ``[s, e)`` of every row and write their prefix table (module docstring)."""
    bsz, dv = values.shape[0], values.shape[2]
    cw = dv + 1
    n = e - s
    vals = np.empty(n)
    order = np.empty(n, np.int64)
    acc = np.empty(2 * cw)
    for b in range(bsz):
        for i in range(n):
            vals[i] = keys[b, s + i]
            order[i] = i
        _sort(vals, order, n)
        sh = vals[n // 2]
        shifts[b, s] = sh
        for d in range(2 * cw):
            acc[d] = 0.0
        for r in range(n):
            j = s + order[r]
            sorted_keys[b, s + r] = vals[r]
            if taken[b, j]:
                ys = vals[r] - sh
                for d in range(dv):
                    u = values[b, j, d]
                    acc[d] += u
                    acc[cw + d] += ys * u
                acc[dv] += 1.0
                acc[cw + dv] += ys
            row = prefix[b, s + r]
            for d in range(2 * cw):
                row[d] = acc[d]


@njit(**JIT)
def attend_rows(q, starts, ends, sorted_keys, prefix, shifts, totals, bad, profile, options, out):
    """Attention of the queries ``q`` (B, M) over the runs ``[starts[r], ends[r])`` into ``out`` (B, M, dv).

    Per query the profile sums ``[N, R]`` over the values and the valid-key indicator and the
    "abs"/"relu" normaliser's sum ``D`` over the indicator, each run's with one rank search per
    knot; then the attention arithmetic of :func:`slicedkern.engines._combine.combine` (centring as
    ``N - mean R``, the divisor of :func:`._kernels_common.divisor_of`, NaN for a non-finite query
    and for every query of a ``bad`` row). ``options = (center, normalizer, zero_knot, eps)``;
    ``totals`` (B, dv + 1): the values' sum and the count of the keys taken.
    """
    knots, coeffs, slope, intercept = profile
    center, normalizer, zero_knot, eps = options
    bsz, n_q = q.shape
    dv = out.shape[2]
    cw = dv + 1
    n_knots = knots.shape[1]
    summed = normalizer == ABS_NORMALIZER or normalizer == RELU_NORMALIZER
    sums = np.empty(cw)
    for b in range(bsz):
        a, bs = intercept[b], slope[b]
        count = totals[b, dv]
        count_c = count if count > 1.0 else 1.0
        for i in range(n_q):
            x = np.float64(q[b, i])
            orow = out[b, i]
            if bad[b] or not np.isfinite(x):
                for d in range(dv):
                    orow[d] = np.nan
                continue
            for d in range(cw):
                sums[d] = 0.0
            relu_den, linear = 0.0, 0.0
            for run in range(starts.shape[0]):
                s, e = starts[run], ends[run]
                xs = x - shifts[b, s]
                total = prefix[b, e - 1]
                for d in range(cw):
                    sums[d] += a * total[d] + bs * (xs * total[d] - total[cw + d])
                linear += xs * total[dv] - total[cw + dv]
                for m in range(n_knots):
                    cm = coeffs[b, m]
                    norm_knot = summed and m == zero_knot
                    if cm == 0.0 and not norm_knot:
                        continue
                    su, se = exact_sum(x, -knots[b, m])
                    r = strict_rank(sorted_keys[b, s:e], e - s, su, se)
                    if r == 0:
                        continue
                    row = prefix[b, s + r - 1]
                    sm = xs - knots[b, m]
                    if cm != 0.0:
                        for d in range(cw):
                            sums[d] += cm * (sm * row[d] - row[cw + d])
                    if norm_knot:
                        relu_den += sm * row[dv] - row[cw + dv]
            den = 2.0 * relu_den - linear if normalizer == ABS_NORMALIZER else relu_den   # |r| = 2 ReLU(r) - r
            scale = 1.0 / divisor_of(normalizer, count, den, eps)
            for d in range(dv):
                num = sums[d] - (totals[b, d] / count_c) * sums[dv] if center else sums[d]
                orow[d] = num * scale
