"""Compiled (numba) kernels of the sweep engine: the fused backward sweep (:func:`backward_rows`).

Argument groups and scheduling: see :mod:`._kernels_common`. Imported only by the host bridge, where
numba is installed.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._kernels_common import (
    ABS_NORMALIZER,
    JIT,
    PARALLEL,
    PREFETCH_AHEAD,
    RELU_NORMALIZER,
    below,
    claim,
    dot,
    dot_pair,
    exact_sum,
    fetch_row,
    normaliser_scale,
    sort_row,
    value_totals,
)

__all__ = ["backward_rows"]

@njit(**JIT)
def _backward_prepare_row(b, scores, sorted_rows, profile, options, tensors, terms, saved, dq_first):
    """Per-query and per-row terms of the backward pass of row ``b``; True when the row is bad.

    Writes, for every query ``i`` (original order; non-finite queries get ``scale = 0`` and
    ``dq = NaN``):

    * ``scale[b, i] = 1 / D_i``: the value cotangent is ``gnum_i = g_i / D_i``;
    * ``grad_count[b, i] = -mean . gnum_i``: the cotangent of ``R_i`` (centring, ``N - mean R``);
    * ``grad_norm[b, i] = -(g_i . out_i) / D_i`` where the normaliser was not clamped;
    * ``dq_first[b, i]``: the parts of ``dq_i`` that need no sweep (slope terms, the constant
      ``-n_keys`` of ``|r|' = 2 H(r) - 1``);

    and per row ``row_vectors[b] = (G0, G1, dmean)``: ``sum_i gnum_i``, ``sum_i (x_i - shift)
    gnum_i``, ``-sum_i R_i gnum_i``, and ``row_scalars[b] = (sum_i grad_count, sum_i grad_norm)``.
    The quotient rule and the centring are those of docs/mathematics.rst, "The backward pass".

    ``saved = (relu_sum, unclamped (B, n), totals (B, c), from_forward)``: with ``from_forward``,
    ``scale``, ``relu_sum``, ``unclamped`` and ``totals`` hold the forward's own values (see
    :func:`._kernels_forward.forward_rows`) and only the second step below runs; otherwise this
    function computes them.
    """
    x, keys_given, mask, has_mask = scores
    queries, query_order, keys, key_order, counts, shift = sorted_rows
    knots, coeffs, slope, intercept = profile
    center, normalizer, zero_knot, eps = options.center, options.normalizer, options.zero_knot, options.eps
    n_user_knots, want_coeffs, query_poisons_row = options.n_user_knots, options.want_coeffs, options.query_poisons_row
    values, cot, out = tensors
    scale, grad_count, grad_norm, row_vectors, row_scalars = terms
    n, c, n_knots = x.shape[1], values.shape[2], knots.shape[1]
    nq, nk = counts[b, 0], counts[b, 1]
    if counts[b, 2] != 0 or (query_poisons_row and nq < n):
        return True
    sh, a, bs = shift[b], intercept[b], slope[b]
    qrow, krow, qp = queries[b], keys[b], query_order[b]
    n_keys = np.float64(nk)
    nonzero_count = n_keys if n_keys > 1.0 else 1.0
    coeff_sum, any_active = 0.0, False
    for m in range(n_knots):
        coeff_sum += coeffs[b, m]
        any_active = any_active or coeffs[b, m] != 0.0 or (want_coeffs and m < n_user_knots)
    grad_normaliser = normalizer == ABS_NORMALIZER or normalizer == RELU_NORMALIZER

    relu_sums, unclamped_rows, value_sums, from_forward = saved
    relu_sum, unclamped, totals = relu_sums[b], unclamped_rows[b], value_sums[b]
    if center or bs != 0.0:
        if from_forward:
            for d in range(c):
                if not np.isfinite(totals[d]):
                    return True
        elif value_totals(b, 0, c, keys_given, mask, has_mask, sh, values, totals, np.zeros(c)):
            return True

    # 1. per query (sorted order): the centring sum R_i and the normaliser, strict value sums as in
    #    the forward pass, so that D_i and the eps test are the forward's own (given by the forward
    #    itself when it kept them)
    if not from_forward and (center or grad_normaliser):
        key_sum = 0.0
        for p in range(nk):
            key_sum += krow[p] - sh
        ptr = np.zeros(n_knots, np.int64)
        count = np.zeros(n_knots)
        key_part = np.zeros(n_knots)
        for pos in range(nq):
            xu = qrow[pos]
            xs = xu - sh
            r = a * n_keys + bs * (xs * n_keys - key_sum)
            for m in range(n_knots):
                cm = coeffs[b, m]
                if not ((center and cm != 0.0) or (grad_normaliser and m == zero_knot)):
                    continue
                su, se = exact_sum(xu, -knots[b, m])
                p = ptr[m]
                while p < nk and below(krow[p], su, se, False):
                    count[m] += 1.0
                    key_part[m] += krow[p] - sh
                    p += 1
                ptr[m] = p
                if cm != 0.0:
                    r += cm * ((xs - knots[b, m]) * count[m] - key_part[m])
            i = qp[pos]
            relu_sum[i] = r
            scale[b, i], unclamped[i] = normaliser_scale(normalizer, xs, count[zero_knot],
                                                          key_part[zero_knot], n_keys, key_sum, eps)
    elif not from_forward:
        constant, _ = normaliser_scale(normalizer, 0.0, 0.0, 0.0, n_keys, 0.0, eps)
        for pos in range(nq):
            scale[b, qp[pos]] = constant
            unclamped[qp[pos]] = True
    for pos in range(nq, n):
        dq_first[b, qp[pos]] = np.nan

    # 2. per query (original order: the rows of g and out are read sequentially), only when some
    #    term needs more than the sweep's own running sums
    linear_slope = bs + coeff_sum
    # (the affine part of f enters dv_j through the totals: a G0 + slope (G1 - (y_j - shift) G0))
    need_vectors = center or grad_normaliser or a != 0.0 or bs != 0.0 or linear_slope != 0.0 or not any_active
    g0, g1, dmean = row_vectors[b, 0], row_vectors[b, 1], row_vectors[b, 2]
    count_total, norm_total = 0.0, 0.0
    if need_vectors:
        for i in range(n):
            sc = scale[b, i]
            if sc == 0.0:
                continue
            grow = cot[b, i]
            xs = x[b, i] - sh
            dot_totals = dot(grow, totals) if center or bs != 0.0 else 0.0
            gc = -sc * dot_totals / nonzero_count if center else 0.0
            gn = -sc * dot(grow, out[b, i]) if grad_normaliser and unclamped[i] else 0.0
            grad_count[b, i] = gc
            grad_norm[b, i] = gn
            dq = sc * bs * dot_totals + gc * bs * n_keys
            if normalizer == ABS_NORMALIZER:
                dq -= gn * n_keys
            dq_first[b, i] = dq
            count_total += gc
            norm_total += gn
            r = relu_sum[i] if center else 0.0
            for d in range(c):
                gv = np.float64(grow[d]) * sc
                g0[d] += gv
                g1[d] += xs * gv
                dmean[d] -= r * gv
        for d in range(c):
            if not (np.isfinite(g0[d]) and np.isfinite(g1[d]) and np.isfinite(dmean[d])):
                return True
        if not (np.isfinite(count_total) and np.isfinite(norm_total)):
            return True
    row_scalars[b, 0] = count_total
    row_scalars[b, 1] = norm_total
    return False


@njit(**JIT)
def _value_gradients(b, c0, c1, sorted_rows, profile, scale, row_vectors, cot, dv, nonzero_count, last_coeff):
    """``dv_j = sum_i f(x_i - y_j) gnum_i + dmean / n_valid`` of row ``b``, columns ``c0:c1``.

    Keys in decreasing order; for each knot with a coefficient a pointer moves down through the
    sorted queries, absorbing those with ``x_i > y_j + t_m`` (exactly): the queries that key ``j``'s
    ReLU term sees (a tie adds ``ReLU(0) = 0``, so it is left out). With the suffix sums
    ``S0_m = sum gnum_i``, ``S1_m = sum (x_i - shift) gnum_i`` over them, the term is
    ``c_m (S1_m - (y_j - shift + t_m) S0_m)``. Suffix sums, not the row totals minus the prefix sums
    of the first pass: a query below every key (a "relu" normaliser clamped to ``eps``, so a large
    ``gnum``) would leave ``|x_i gnum_i| 2^-52`` of rounding in every ``dv_j`` it takes no part in.
    """
    queries, query_order, keys, key_order, counts, shift = sorted_rows
    knots, coeffs, slope, intercept = profile
    width, n_knots = c1 - c0, knots.shape[1]
    nq, nk = counts[b, 0], counts[b, 1]
    sh, a, bs = shift[b], intercept[b], slope[b]
    qrow, krow, qp, kp = queries[b], keys[b], query_order[b], key_order[b]
    g0, g1 = row_vectors[b, 0, c0:c1], row_vectors[b, 1, c0:c1]
    dmean = row_vectors[b, 2, c0:c1]
    # the affine part of f (all queries take part in it) and the centring's d mean / n_valid
    base = np.empty(width)
    for d in range(width):
        base[d] = a * g0[d] + bs * g1[d] + dmean[d] / nonzero_count
    s0 = np.zeros((n_knots, width))
    s1 = np.zeros((n_knots, width))
    ptr = np.full(n_knots, nq, np.int64)
    acc = np.empty(width)
    for p in range(min(PREFETCH_AHEAD, nk)):
        fetch_row(dv, b, kp[nk - 1 - p], c0, width, True)
    for p in range(nk - 1, -1, -1):
        yu = krow[p]
        ys = yu - sh
        if p >= PREFETCH_AHEAD:
            fetch_row(dv, b, kp[p - PREFETCH_AHEAD], c0, width, True)
        slope_ys = bs * ys
        for d in range(width):
            acc[d] = base[d] - slope_ys * g0[d]
        for m in range(last_coeff + 1):
            cm = coeffs[b, m]
            if cm == 0.0:
                continue
            tm = knots[b, m]
            su, se = exact_sum(yu, tm)
            s0m, s1m = s0[m], s1[m]
            pos = ptr[m]
            while pos > 0 and not below(qrow[pos - 1], su, se, True):
                pos -= 1
                if pos >= PREFETCH_AHEAD:
                    fetch_row(cot, b, qp[pos - PREFETCH_AHEAD], c0, width, False)
                i = qp[pos]
                sc = scale[b, i]
                xsc = (qrow[pos] - sh) * sc
                grow = cot[b, i, c0:c1]
                for d in range(width):
                    gd = np.float64(grow[d])
                    s0m[d] += gd * sc
                    s1m[d] += gd * xsc
            ptr[m] = pos
            u = ys + tm
            for d in range(width):
                acc[d] += cm * (s1m[d] - u * s0m[d])
        dvrow = dv[b, kp[p], c0:c1]
        for d in range(width):
            dvrow[d] = acc[d]


@njit(**JIT)
def _backward_task(b, ch, c0, c1, scores, sorted_rows, profile, options, tensors, terms, grads):
    """Columns ``c0:c1`` of the backward sweep of row ``b``; True when a value or cotangent is bad.

    Keys are visited in increasing order; for each knot ``t_m`` a pointer advances through the
    sorted queries, *absorbing* the queries with ``x_i < y_j + t_m`` (exactly) before key ``j`` is
    handled. At that moment:

    * a query absorbed by knot ``m`` sees the keys already passed, ``y <= x_i - t_m``: their value
      sum ``KP0`` is the forward's step sum ``P0[rank(x_i - t_m)]``, so
      ``dq_i += c_m gnum_i . KP0`` and ``dknots_m -= c_m gnum_i . KP0`` (right derivative, H(0) = 1);
    * key ``j`` sees the queries not yet absorbed, ``x_i >= y_j + t_m``: with the running sum
      ``P0_m = sum gnum_i`` over the absorbed ones and the row total ``G0``,
      ``dk_j = -v_j . sum_i f'(x_i - y_j) gnum_i`` (left derivative in the key).

    A second pass, keys in decreasing order (:func:`_value_gradients`), writes
    ``dv_j = sum_i f(x_i - y_j) gnum_i`` from suffix sums. Every sum is float64; ``dv`` is written
    once per key. Chunk 0 also carries the scalar (indicator) terms of centring and normaliser.
    docs/mathematics.rst, "The backward pass".
    """
    _, keys_given, mask, has_mask = scores
    queries, query_order, keys, key_order, counts, shift = sorted_rows
    knots, coeffs, slope, intercept = profile
    normalizer, zero_knot = options.normalizer, options.zero_knot
    n_user_knots, want_coeffs, strict = options.n_user_knots, options.want_coeffs, options.strict
    values, cot, _ = tensors
    scale, grad_count, grad_norm, row_vectors, row_scalars = terms
    dq_parts, dk_parts, dv, dknots_parts, dcoeffs_parts = grads
    m_all, width, n_knots = keys_given.shape[1], c1 - c0, knots.shape[1]
    nq, nk = counts[b, 0], counts[b, 1]
    sh, bs = shift[b], slope[b]
    qrow, krow, qp, kp = queries[b], keys[b], query_order[b], key_order[b]
    first = ch == 0
    grad_normaliser = first and (normalizer == ABS_NORMALIZER or normalizer == RELU_NORMALIZER)
    norm_weight = 2.0 if normalizer == ABS_NORMALIZER else 1.0     # |r|' = 2 H(r) - 1, ReLU' = H
    n_keys = np.float64(nk)

    active = np.zeros(n_knots, np.bool_)     # knots whose sums carry value columns
    moving = np.zeros(n_knots, np.bool_)     # knots whose pointer has to move at all
    coeff_sum, any_active = 0.0, False
    for m in range(n_knots):
        cm = coeffs[b, m]
        coeff_sum += cm
        active[m] = cm != 0.0 or (want_coeffs and m < n_user_knots)
        moving[m] = active[m] or (grad_normaliser and m == zero_knot)
        any_active = any_active or active[m]
    # a strict knot's own gradient counts a tie x_i - y_j = t_m below the knot (H(0) = 0, a hat's
    # +bandwidth edge: docs/mathematics.rst, "Bandwidths at ties"); the tied keys are the run of keys
    # equal to the last one passed, whose value sum is kp0 - run0
    track_runs = False
    for m in range(n_knots):
        track_runs = track_runs or (strict[m] and active[m] and want_coeffs)
    linear_slope = bs + coeff_sum
    nonzero_count = n_keys if n_keys > 1.0 else 1.0
    last_coeff = -1
    for m in range(n_knots):
        if coeffs[b, m] != 0.0:
            last_coeff = m
    g0 = row_vectors[b, 0, c0:c1]
    count_total, norm_total = row_scalars[b, 0], row_scalars[b, 1]

    p0 = np.zeros((n_knots, width))
    count_prefix = np.zeros(n_knots)        # sum of grad_count over the absorbed queries
    norm_prefix = 0.0                       # sum of grad_norm over those absorbed at knot 0
    ptr = np.zeros(n_knots, np.int64)
    knot_sums = np.zeros(n_knots)
    coeff_sums = np.zeros(n_knots)
    kp0 = np.zeros(width)
    kp1 = np.zeros(width)
    run0 = np.zeros(width)
    run_count = 0.0
    gnum = np.empty(width)
    vj = np.empty(width)
    dacc = np.empty(width)
    kcount, ksum = 0.0, 0.0                 # count and sum (shifted) of the keys passed
    yu, ys = 0.0, 0.0
    for p in range(min(PREFETCH_AHEAD, nk)):
        fetch_row(values, b, kp[p], c0, width, False)
    for m in range(n_knots):
        if active[m]:
            for pos in range(min(PREFETCH_AHEAD, nq)):
                fetch_row(cot, b, qp[pos], c0, width, False)

    for p in range(nk + 1):                 # p == nk: a last step absorbs every query left
        if p < nk:
            yu = krow[p]
            ys = yu - sh
            if p + PREFETCH_AHEAD < nk:
                fetch_row(values, b, kp[p + PREFETCH_AHEAD], c0, width, False)
        for m in range(n_knots):
            if not moving[m]:
                continue
            tm, cm = knots[b, m], coeffs[b, m]
            su, se = exact_sum(yu, tm) if p < nk else (np.inf, 0.0)
            p0m = p0[m]
            pos = ptr[m]
            while pos < nq and below(qrow[pos], su, se, False):
                i = qp[pos]
                xs = qrow[pos] - sh
                if active[m]:
                    if pos + PREFETCH_AHEAD < nq:
                        fetch_row(cot, b, qp[pos + PREFETCH_AHEAD], c0, width, False)
                    sc = scale[b, i]
                    grow = cot[b, i, c0:c1]
                    for d in range(width):
                        gv = np.float64(grow[d]) * sc
                        gnum[d] = gv
                        p0m[d] += gv
                    if want_coeffs:
                        step, moment = dot_pair(gnum, kp0, kp1)
                        coeff_sums[m] += (xs - tm) * step - moment
                    else:
                        step = dot(gnum, kp0)
                    gc = 0.0
                    if first:
                        gc = grad_count[b, i]
                        count_prefix[m] += gc
                        step += gc * kcount
                        if want_coeffs:
                            coeff_sums[m] += gc * ((xs - tm) * kcount - ksum)
                    knot_sums[m] += step
                    if track_runs and strict[m] and p > 0:
                        tu, te = exact_sum(krow[p - 1], tm)
                        if qrow[pos] == tu and te == 0.0:
                            tie = gc * (kcount - run_count)
                            for d in range(width):
                                tie += gnum[d] * (kp0[d] - run0[d])
                            knot_sums[m] -= tie
                    dq_parts[ch, b, i] += cm * step
                if grad_normaliser and m == zero_knot:
                    gn = grad_norm[b, i]
                    norm_prefix += gn
                    dq_parts[ch, b, i] += norm_weight * gn * kcount
                pos += 1
            ptr[m] = pos
        if p == nk:
            break

        # key j: dk_j from the running sums of the queries absorbed so far; the last knot with a
        # coefficient is folded into the loop that adds v_j to the key sums (one pass less per key)
        j = kp[p]
        vrow = values[b, j, c0:c1]
        for d in range(width):
            vj[d] = np.float64(vrow[d])
            dacc[d] = linear_slope * g0[d]
        for m in range(last_coeff):
            cm = coeffs[b, m]
            if cm == 0.0:
                continue
            p0m = p0[m]
            for d in range(width):
                dacc[d] -= cm * p0m[d]
        if track_runs and (p == 0 or krow[p] != krow[p - 1]):
            for d in range(width):
                run0[d] = kp0[d]
            run_count = kcount
        cl = coeffs[b, last_coeff] if last_coeff >= 0 else 0.0
        p0l = p0[max(last_coeff, 0)]
        for d in range(width):
            dacc[d] -= cl * p0l[d]
            kp0[d] += vj[d]
        dk = -dot(vj, dacc)
        if first:
            dk -= linear_slope * count_total
            for m in range(n_knots):
                dk += coeffs[b, m] * count_prefix[m]
            if grad_normaliser:
                dk -= norm_total - norm_weight * norm_prefix
        dk_parts[ch, b, j] = dk
        if want_coeffs:
            for d in range(width):
                kp1[d] += ys * vj[d]
        kcount += 1.0
        ksum += ys

    _value_gradients(b, c0, c1, sorted_rows, profile, scale, row_vectors, cot, dv, nonzero_count, last_coeff)
    if has_mask:  # masked keys take part in nothing: zero gradients
        for j in range(m_all):
            if not mask[b, j]:
                dvrow = dv[b, j, c0:c1]
                for d in range(width):
                    dvrow[d] = 0.0
                dk_parts[ch, b, j] = 0.0
    for m in range(n_knots):
        dknots_parts[ch, b, m] = -coeffs[b, m] * knot_sums[m]
        dcoeffs_parts[ch, b, m] = coeff_sums[m]
    # the values' totals (kp0) and, when the preparation skipped them, the cotangents' totals (P0
    # of an active knot, after the final step) decide whether the row is finite
    for d in range(width):
        if not np.isfinite(kp0[d]):
            return True
    if any_active:
        for m in range(n_knots):
            if active[m]:
                for d in range(width):
                    if not np.isfinite(p0[m, d]):
                        return True
                break
    return False


@njit(**JIT)
def _backward_row(b, scores, sorted_rows, profile, options, tensors, terms, saved, grads, schedule, c, bad):
    """Row ``b`` whole on the calling thread: its sort (unless kept by the forward), preparation and
    every column chunk's sweep; marks its tasks in ``bad``."""
    n_chunks, chunk_width, _ = schedule
    if not saved[3]:
        sort_row(b, scores, sorted_rows)
    row_bad = _backward_prepare_row(b, scores, sorted_rows, profile, options, tensors, terms, saved,
                                    grads[0][0])
    for ch in range(n_chunks):
        t = b * n_chunks + ch
        if row_bad:
            bad[t] = True
        else:
            c0 = ch * chunk_width
            bad[t] = _backward_task(b, ch, c0, min(c, c0 + chunk_width), scores, sorted_rows, profile,
                                    options, tensors, terms, grads)


@njit(**PARALLEL)
def backward_rows(scores, profile, options, tensors, grads, workspace, schedule):
    """The fused backward pass of every row, into ``grads``; returns ``bad (B * n_chunks,)``.

    ``options``: a :class:`._kernels_common.BackwardOptions` (``strict[m]``: knot ``m``'s own
    gradient counts an exact tie as below it);
    ``tensors = (values (B, m, c), cot (B, n, c), out (B, n, c))`` in one dtype (``out`` is read
    only for an "abs"/"relu" normaliser). ``grads = (dq_parts (n_chunks, B, n) zeros, dk_parts
    (n_chunks, B, m), dv (B, m, c) in the values' dtype, dknots_parts, dcoeffs_parts (n_chunks, B,
    M))``: per-chunk partial sums, added up by the caller. ``workspace = (sorted_rows, terms, saved)``
    with ``terms = (scale, grad_count, grad_norm (B, n), row_vectors (B, 3, c), row_scalars (B, 2))``
    and ``saved = (relu_sum, unclamped (B, n), totals (B, c), from_forward)``, all zeros; with
    ``from_forward``, ``sorted_rows``, ``scale`` and ``saved`` are the forward's (kept by
    :func:`._kernels_forward.forward_rows`) and are only read: no sort, no preparation sweep.
    ``bad`` marks tasks of rows with a non-finite valid key, value or cotangent (or query, under
    ``query_poisons_row``): the caller fills those rows with NaN.
    """
    x = scores[0]
    values = tensors[0]
    sorted_rows, terms, saved = workspace
    from_forward = saved[3]
    n_chunks, chunk_width, n_workers = schedule
    bsz, c = x.shape[0], values.shape[2]
    dq_first = grads[0][0]
    row_bad = np.zeros(bsz, np.bool_)
    n_tasks = bsz * n_chunks
    bad = np.zeros(n_tasks, np.bool_)
    if n_workers == 1:
        for b in range(bsz):
            _backward_row(b, scores, sorted_rows, profile, options, tensors, terms, saved, grads, schedule,
                          c, bad)
        return bad
    if n_chunks == 1:
        # a row's preparation and its sweep back to back on one worker: the cotangent rows that the
        # preparation reads (in order) are still in cache when the sweep reads them again
        next_row = np.zeros(1, np.int64)
        for _ in prange(n_workers):
            b = claim(next_row)
            while b < bsz:
                _backward_row(b, scores, sorted_rows, profile, options, tensors, terms, saved, grads,
                              schedule, c, bad)
                b = claim(next_row)
        return bad
    next_row = np.zeros(1, np.int64)
    for _ in prange(n_workers):
        b = claim(next_row)
        while b < bsz:
            if not from_forward:
                sort_row(b, scores, sorted_rows)
            row_bad[b] = _backward_prepare_row(b, scores, sorted_rows, profile, options, tensors, terms,
                                               saved, dq_first)
            b = claim(next_row)
    next_task = np.zeros(1, np.int64)
    for _ in prange(n_workers):
        t = claim(next_task)
        while t < n_tasks:
            b, ch = t // n_chunks, t % n_chunks
            if row_bad[b]:
                bad[t] = True
            else:
                c0 = ch * chunk_width
                bad[t] = _backward_task(b, ch, c0, min(c, c0 + chunk_width), scores, sorted_rows, profile,
                                        options, tensors, terms, grads)
            t = claim(next_task)
    return bad
