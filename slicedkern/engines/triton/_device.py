"""The device functions the triton engine's kernels share (:mod:`._kernels`, :mod:`._order`,
:mod:`._dense`): a tile of sorted keys and its moments, the exact rank search, the pair terms of the
sort-scan, the indicator's profile, attention's epilogue, and pass 2's block evaluation, jitted as
they are defined (docs/architecture.rst, "Engines"; the layout is :mod:`._kernels`' docstring).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_moments(wv, y):
    """A tile's column sums ``[sum w, sum (y - shift) w]`` in float64: pass 1's aggregates, for
    :func:`tile_sums` and :func:`._order.small_attend` alike. The products are formed in float64 with
    the exact shifted keys: the carry's sums of y w are the terms that cancel against s P0 in pass 2
    (docs/mathematics.rst, "Numerics")."""
    wide = wv.to(tl.float64)
    return tl.sum(wide, 0), tl.sum(wide * y[:, None], 0)


@triton.jit
def _key_tile(keys_ptr, shift_ptr, perm_ptr, take_ptr, row, j, m, sk_r, HAS_TAKE: tl.constexpr):
    """The sorted keys ``j``: their original positions, their shifted keys in float64 (exact for
    float32 keys: the shift is one of them; zero for the keys that take no part) and whether they
    take part."""
    jm = j < m
    p = tl.load(perm_ptr + row * m + j, mask=jm, other=0).to(tl.int64)
    shift = tl.load(shift_ptr + row)
    y = tl.load(keys_ptr + row * m + j, mask=jm, other=0.0).to(tl.float64) - shift
    ok = jm
    if HAS_TAKE:
        ok = ok & (tl.load(take_ptr + row * m + p, mask=jm, other=0) != 0)
    return p, tl.where(ok, y, 0.0), ok


@triton.jit
def _tile(keys_ptr, shift_ptr, perm_ptr, w_ptr, take_ptr, scale_ptr, row, j, cols, m, c, sw_r, sw_m, sw_c, sk_r,
          HAS_TAKE: tl.constexpr, ONES: tl.constexpr, SCALE: tl.constexpr, ACC: tl.constexpr):
    """The weight rows of the sorted keys ``j`` (gathered through ``perm``, zero for the keys that
    take no part, times the key's ``scale`` (R, m) float64 when SCALE, the indicator in column ``c``
    when ONES), their shifted keys in float64 and whether they take part."""
    p, y, ok = _key_tile(keys_ptr, shift_ptr, perm_ptr, take_ptr, row, j, m, sk_r, HAS_TAKE)
    wm = ok[:, None] & (cols[None, :] < c)
    wv = tl.load(w_ptr + row * sw_r + p[:, None] * sw_m + cols[None, :] * sw_c, mask=wm, other=0.0)
    # ``where``, not a product: a masked key's weight may be NaN and must not reach the sums
    wv = tl.where(wm, wv.to(ACC), 0.0)
    if SCALE:
        # the backward's cotangent rows g_i times the quotient rule's factor of query i: the scaled
        # rows are never written (docs/architecture.rst, "Engines")
        wv = wv * tl.load(scale_ptr + row * sk_r + p, mask=ok, other=0.0).to(ACC)[:, None]
    if ONES:
        wv = tl.where(ok[:, None] & (cols[None, :] == c), 1.0, wv).to(ACC)
    return wv, y, ok


@triton.jit
def _rank(keys_ptr, row, m, d, e, log_m, STRICT: tl.constexpr):
    """The number of keys below the exact difference ``d + e`` (``<`` when STRICT, else ``<=``).

    ``d = fl(x - t)`` and ``e`` its rounding error (TwoSum), so a tie ``x - y = t`` is decided on the
    exact values, as the scan engine decides it. Binary search with ``log_m`` = ceil(log2(m + 1))
    steps, a runtime argument: a constant would compile every kernel again for each power of two of
    the length (tens of seconds each on an H100; docs/benchmarks.rst, "On a GPU").
    """
    pos = tl.zeros(d.shape, dtype=tl.int64)
    for i in range(log_m):
        step = 1 << (log_m - 1 - i)
        cand = pos + step
        inside = cand <= m
        key = tl.load(keys_ptr + row * m + cand - 1, mask=inside, other=0.0)
        if STRICT:
            below = (key < d) | ((key == d) & (e > 0))
        else:
            below = (key < d) | ((key == d) & (e >= 0))
        pos = tl.where(inside & below, cand, pos)
    return pos


@triton.jit
def _knot_ranks(x, t, nm, keys_ptr, row, m, log_m, STRICT: tl.constexpr, BLOCK_M: tl.constexpr):
    """The ranks of ``x - t`` among the sorted keys (exact ties, see :func:`_rank`) and the tiles a
    block of sorted queries reads for them: ``first`` up to ``last`` (exclusive)."""
    d = x - t
    bb = d - x
    e = (x - (d - bb)) + (-t - bb)          # x - t = d + e exactly (TwoSum)
    rank = _rank(keys_ptr, row, m, d, e, log_m, STRICT)
    first = tl.min(tl.where(nm, rank, m)) // BLOCK_M
    last = tl.cdiv(tl.max(tl.where(nm, rank, 0)), BLOCK_M)
    return rank, first, last


@triton.jit
def _below_sum(below, wv, into, ACC: tl.constexpr):
    """``into + below @ wv`` in ACC: one tile's sums of the rows below each query, added to the
    block's running span sums (``tl.dot``'s own accumulator, so that no second tile is live).

    A float64 product is a broadcast sum, not ``tl.dot``: Triton 3.6 fails to lower a float64 dot on
    Hopper (ConvertTritonGPUToLLVM, seen on an H100; docs/benchmarks.rst, "On a GPU"). Float64 serves
    the exact-arithmetic checks, not speed, in blocks of 16 (``_sums._blocks``).
    """
    if ACC == tl.float64:
        return into + tl.sum(below[:, :, None] * wv[None, :, :], 1)
    return tl.dot(below, wv, acc=into, input_precision="ieee", out_dtype=ACC)


@triton.jit
def _indicator_carry(carry_ptr, ind, first, C, shape):
    """The indicator's sums ``[count, sum of shifted keys]`` over the tiles before ``first``, float64."""
    i0 = tl.zeros(shape, dtype=tl.float64) + tl.load(carry_ptr + ind + first * 2 * C)
    i1 = tl.zeros(shape, dtype=tl.float64) + tl.load(carry_ptr + ind + first * 2 * C + C)
    return i0, i1


@triton.jit
def _pairs(s, y, j, rank):
    """``s_i - y_j`` for the keys ``j`` of a tile below each query's ``rank`` (zero for the others),
    float64 (queries, keys): a tile's ReLU terms formed pair by pair, so that a query just above
    its keys gets its small sum from small terms rather than from ``s P0 - P1``, whose terms are
    as large as the scores (docs/mathematics.rst, "Numerics")."""
    return tl.where(j[None, :] < rank[:, None], s[:, None] - y[None, :], 0.0)


@triton.jit
def _indicator_linear(carry_ptr, ind, nb, C, xs, slope, intercept):
    """The linear part ``intercept + slope r`` of a profile summed over the valid keys, and their
    number (the indicator's totals, the last row of the carry)."""
    valid = tl.load(carry_ptr + ind + nb * 2 * C)
    keysum = tl.load(carry_ptr + ind + nb * 2 * C + C)
    return (intercept + slope * xs) * valid - slope * keysum, valid


@triton.jit
def _indicator_profile(x, xs, nm, keys_ptr, shift_ptr, perm_ptr, take_ptr, carry_ptr, knots_ptr, coeffs_ptr,
                       lin_ptr, row, m, sk_r, C, c, nb, log_m, K: tl.constexpr, STRICT: tl.constexpr,
                       HAS_TAKE: tl.constexpr, ACC: tl.constexpr, BLOCK_M: tl.constexpr):
    """A profile summed over the keys that take part (the indicator, column ``c`` of the carry) at
    a block of sorted queries, float64: the normaliser's sum. Reads the keys only, never a weight."""
    ind = row * (nb + 1) * 2 * C + c
    total = tl.zeros(x.shape, dtype=tl.float64)
    for k in range(K):
        t = tl.load(knots_ptr + row * K + k)
        cf = tl.load(coeffs_ptr + row * K + k)
        rank, first, last = _knot_ranks(x, t, nm, keys_ptr, row, m, log_m, STRICT, BLOCK_M)
        i0, i1 = _indicator_carry(carry_ptr, ind, first, C, x.shape)
        s = xs - t
        span = tl.zeros(x.shape, dtype=tl.float64)
        for blk in range(first, last):
            j = blk * BLOCK_M + tl.arange(0, BLOCK_M)
            _, y, ok = _key_tile(keys_ptr, shift_ptr, perm_ptr, take_ptr, row, j, m, sk_r, HAS_TAKE)
            span += tl.sum(tl.where(ok[None, :], _pairs(s, y, j, rank), 0.0), 1)
        total += cf * (s * i0 - i1 + span)
    linear, _ = _indicator_linear(carry_ptr, ind, nb, C, xs, tl.load(lin_ptr + row * 2), tl.load(lin_ptr + row * 2 + 1))
    return total + linear


@triton.jit
def _attention_epilogue(acc, relu_count, count, totals, den, eps, CENTER: tl.constexpr, NORM: tl.constexpr):
    """Attention's arithmetic on a block of profile sums ``acc`` (queries, columns), the compiled twin
    of :func:`slicedkern.engines._combine.combine`: CENTER subtracts ``relu_count`` (queries,) times
    the mean value ``totals / count`` (``totals`` (1 or queries, columns): the row's, or each
    query's own in causal attention); the divisor is NORM's (``Normalizer.code``: 0 none, 3 the
    ``count`` of valid keys (a scalar, or (queries,)), at least 1, 1 or 2 (a summed normaliser) the
    normaliser sums ``den`` (queries,) floored at ``eps``, and 1 for a query that sees no key:
    Normalizer.divisor)."""
    count = count + tl.zeros_like(relu_count)
    if CENTER:
        acc = acc - (relu_count / tl.maximum(count, 1.0))[:, None] * totals
    if NORM == 3:
        acc = acc / tl.maximum(count, 1.0)[:, None]
    if NORM == 1 or NORM == 2:
        acc = acc / tl.where(count > 0, tl.maximum(den, eps), 1.0)[:, None]
    return acc


@triton.jit
def _eval_block(row, i, cl, cb, row_factor, xs_ptr, xperm_ptr, keys_ptr, shift_ptr, perm_ptr, w_ptr, take_ptr,
                scale_ptr, carry_ptr, knots_ptr, coeffs_ptr, lin_ptr, factor_ptr, sub_ptr, out_ptr, nknots_ptr,
                ncoeffs_ptr, nlin_ptr, count_ptr, raw_ptr, eps, dot_ptr, sd_r, sd_n, sd_c, dot_col0, dot_take_ptr,
                out_rs, out_off, out_qs, n, m, c, C, nb, col0, width, sw_r, sw_m, sw_c, sk_r, sq_r, log_m,
                K: tl.constexpr,
                STRICT: tl.constexpr, DERIV: tl.constexpr, HAS_FACTOR: tl.constexpr, SUB: tl.constexpr,
                ADD: tl.constexpr, HAS_TAKE: tl.constexpr, ONES: tl.constexpr, SCALE: tl.constexpr, ACC: tl.constexpr,
                ATTN: tl.constexpr, CENTER: tl.constexpr, NORM: tl.constexpr, KN: tl.constexpr, DOT: tl.constexpr,
                DOT_TAKE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Pass 2 on the sorted queries ``i`` of row ``row`` and the columns ``cl`` of column block
    ``cb``: :func:`merge_eval`'s body (which see), shared with :func:`small_attend`; the
    NaN policy's ``factor`` times ``row_factor`` (1, or NaN: the values' verdict of a fused call)."""
    nm = i < n
    cm = cl < width
    cols = col0 + cl
    x = tl.load(xs_ptr + row * n + i, mask=nm, other=0.0)
    shift = tl.load(shift_ptr + row)
    xs = x - shift
    acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float64)
    ind = row * (nb + 1) * 2 * C + c                # the indicator's column of the carry (ATTN)
    relu_count = tl.zeros((BLOCK_N,), dtype=tl.float64)
    for k in range(K):
        t = tl.load(knots_ptr + row * K + k)
        cf = tl.load(coeffs_ptr + row * K + k)
        rank, first, last = _knot_ranks(x, t, nm, keys_ptr, row, m, log_m, STRICT, BLOCK_M)
        s = xs - t
        # the span's sums in ACC (float32 for float32 / half weights): a block's span is a few
        # tiles when the queries and keys are alike, and float64 tiles here spill registers on an
        # H100 (scripts/triton_resources.py; docs/benchmarks.rst, "On a GPU"). The profile's
        # terms are formed pair by pair (_pairs, in float64, then rounded once): the span's sum
        # is then accurate to ACC's rounding of itself, not of the scores' size
        q = tl.zeros((BLOCK_N, BLOCK_C), dtype=ACC)
        if ATTN:
            i0, i1 = _indicator_carry(carry_ptr, ind, first, C, (BLOCK_N,))
            ispan = tl.zeros((BLOCK_N,), dtype=tl.float64)
        for blk in range(first, last):
            j = blk * BLOCK_M + tl.arange(0, BLOCK_M)
            wv, y, ok = _tile(keys_ptr, shift_ptr, perm_ptr, w_ptr, take_ptr, scale_ptr, row, j, cols, m, c, sw_r,
                              sw_m, sw_c, sk_r, HAS_TAKE, ONES, SCALE, ACC)
            if DERIV:
                q = _below_sum((j[None, :] < rank[:, None]).to(ACC), wv, q, ACC)
            else:
                pairs = _pairs(s, y, j, rank)
                q = _below_sum(pairs.to(ACC), wv, q, ACC)
                if ATTN:
                    ispan += tl.sum(tl.where(ok[None, :], pairs, 0.0), 1)
        # then the float64 carry: the sums of the tiles before the span
        base = row * (nb + 1) * 2 * C + first * 2 * C + cols
        p0 = tl.load(carry_ptr + base, mask=cm, other=0.0)[None, :]
        if DERIV:
            acc += cf * (p0 + q.to(tl.float64))
        else:
            p1 = tl.load(carry_ptr + base + C, mask=cm, other=0.0)[None, :]
            acc += cf * (s[:, None] * p0 - p1 + q.to(tl.float64))
            if ATTN:
                relu_count += cf * (s * i0 - i1 + ispan)
    slope = tl.load(lin_ptr + row * 2)
    intercept = tl.load(lin_ptr + row * 2 + 1)
    total = row * (nb + 1) * 2 * C + nb * 2 * C + cols
    t0 = tl.load(carry_ptr + total, mask=cm, other=0.0)
    t1 = tl.load(carry_ptr + total + C, mask=cm, other=0.0)
    if DERIV:
        acc += slope * t0[None, :]
    else:
        acc += (intercept + slope * xs)[:, None] * t0[None, :] - slope * t1[None, :]
    dest = tl.load(xperm_ptr + row * n + i, mask=nm, other=0).to(tl.int64)
    if ATTN:
        linear, valid = _indicator_linear(carry_ptr, ind, nb, C, xs, slope, intercept)
        relu_count += linear
        first_block = cb == 0
        if first_block:
            tl.store(count_ptr + row * n + dest, relu_count, mask=nm)
        raw = relu_count                  # read by _attention_epilogue only for a summed normaliser
        if NORM == 1 or NORM == 2:
            raw = _indicator_profile(x, xs, nm, keys_ptr, shift_ptr, perm_ptr, take_ptr, carry_ptr, nknots_ptr,
                                     ncoeffs_ptr, nlin_ptr, row, m, sk_r, C, c, nb, log_m, KN, STRICT, HAS_TAKE, ACC,
                                     BLOCK_M)
            if first_block:
                tl.store(raw_ptr + row * n + dest, raw, mask=nm)
        acc = _attention_epilogue(acc, relu_count, valid, t0[None, :], raw, eps, CENTER, NORM)
    elif ADD:
        if NORM == 1 or NORM == 2:
            # a causal level: the normaliser's sums ride the values' launch (one launch per level, not two)
            if cb == 0:
                den = _indicator_profile(x, xs, nm, keys_ptr, shift_ptr, perm_ptr, take_ptr, carry_ptr, nknots_ptr,
                                         ncoeffs_ptr, nlin_ptr, row, m, sk_r, C, c, nb, log_m, KN, STRICT, HAS_TAKE,
                                         ACC, BLOCK_M)
                at = raw_ptr + (out_off + row * out_rs) // out_qs + dest
                den += tl.load(at, mask=nm, other=0.0).to(tl.float64)
                tl.store(at, den.to(raw_ptr.dtype.element_ty), mask=nm)
    if SUB:
        acc = acc - tl.load(sub_ptr + row * width + cl, mask=cm, other=0.0)[None, :]
    if HAS_FACTOR:
        acc = acc * (tl.load(factor_ptr + row * sq_r + dest, mask=nm, other=1.0) * row_factor)[:, None]
    if DOT:
        dm = nm
        if DOT_TAKE:
            dm = dm & (tl.load(dot_take_ptr + row * sq_r + dest, mask=nm, other=0) != 0)
        gv = tl.load(dot_ptr + row * sd_r + dest[:, None] * sd_n + (dot_col0 + cl)[None, :] * sd_c,
                     mask=dm[:, None] & cm[None, :], other=0.0).to(tl.float64)
        prod = tl.where(cm[None, :], acc * gv, 0.0)        # columns past the range hold other sums
        tl.store(out_ptr + out_off + row * out_rs + dest * out_qs + cb, tl.sum(prod, 1), mask=nm)
    else:
        result = acc
        where = out_ptr + out_off + row * out_rs + dest[:, None] * out_qs + cl[None, :]
        if ADD:
            # added in float64 and rounded once: a float32 running sum gains one rounding per level
            result += tl.load(where, mask=nm[:, None] & cm[None, :], other=0.0).to(tl.float64)
        if out_ptr.dtype.element_ty != tl.float64:
            # through float32: the interpreter casts float64 to bfloat16 wrongly (Triton 3.x); the
            # double rounding moves a 16-bit result by one unit only when the float32 value falls on
            # a midpoint
            result = result.to(tl.float32)
        tl.store(where, result.to(out_ptr.dtype.element_ty), mask=nm[:, None] & cm[None, :])


@triton.jit
def _run_profile(x, xs, qm, keys_ptr, prefix_ptr, run_base, size, knots_ptr, coeffs_ptr, lin_ptr, b, w, wm,
                 cw, log_cap, K: tl.constexpr):
    """One run's profile sums at the queries ``x`` (BLOCK_Q,) over the prefix columns ``w``
    (BLOCK_W,): the linear part on the run's totals, then per knot one exact rank search (the strict
    tie rule of :func:`_rank`) and one prefix row; (BLOCK_Q, BLOCK_W) float64."""
    tot = prefix_ptr + (run_base + size - 1) * 2 * cw
    t0 = tl.load(tot + w, mask=wm, other=0.0)
    t1 = tl.load(tot + cw + w, mask=wm, other=0.0)
    slope = tl.load(lin_ptr + b * 2)
    intercept = tl.load(lin_ptr + b * 2 + 1)
    sums = (intercept + slope * xs)[:, None] * t0[None, :] - slope * t1[None, :]
    for k in range(K):
        t = tl.load(knots_ptr + b * K + k)
        cf = tl.load(coeffs_ptr + b * K + k)
        d = x - t
        bb = d - x
        e = (x - (d - bb)) + (-t - bb)          # x - t = d + e exactly (TwoSum)
        rank = _rank(keys_ptr + run_base, 0, size, d, e, log_cap, True)
        row = prefix_ptr + (run_base + rank - 1) * 2 * cw
        seen = qm & (rank > 0)
        p0 = tl.load(row[:, None] + w[None, :], mask=seen[:, None] & wm[None, :], other=0.0)
        p1 = tl.load(row[:, None] + cw + w[None, :], mask=seen[:, None] & wm[None, :], other=0.0)
        sums += cf * ((xs - t)[:, None] * p0 - p1)
    return sums
