"""The Triton kernels of the triton engine: two passes over the sorted keys, nothing stored per key
between them (docs/architecture.rst, "Engines").

This module imports Triton at its top: the engine loads it on the first call that runs on it, so
``import slicedkern`` never imports Triton (docs/architecture.rst, "Engines"). The functions are
jitted by :func:`build` on that first call, not at import, so that Triton's interpreter setting
(``TRITON_INTERPRET``) is read when the kernels are first needed: importing this module (doctest
collection does) fixes nothing.

Layout (the batch flattened to ``R`` rows):

* ``keys`` (R, m) the sorted keys (float32 for float32 / half scores, float64 for float64), ``perm``
  (R, m) int32 their original positions, ``shift`` (R,) float64 the median key (subtracted in the
  arithmetic, as in the scan engine);
* ``w`` (R, m, c) the weights in their own order, dtype and strides (gathered through ``perm`` by
  both passes), ``take`` (R, m) int8 the keys that take part (the others weigh zero, whatever they
  hold);
* pass 1, :func:`tile_sums`: per tile of ``BLOCK_M`` sorted keys the sums ``[w, (y - shift) w]``
  (``C = c + ONES`` columns, ``ONES`` the indicator column ``take``), float64; their exclusive prefix
  is the ``carry`` (R, nb + 1, 2 C), the last row the totals;
* pass 2, :func:`merge_eval`: per block of sorted queries and per knot, the carry at the block's
  first rank plus the sums of the tiles its ranks span, their terms formed pair by pair
  (:func:`_pairs`) and accumulated in the accumulator dtype (float32 for float32 / half weights)
  over the tiles a block of queries spans, in float64 in the carry (docs/mathematics.rst,
  "Numerics"); the output row is written through the query permutation.

The sorts (:mod:`._order`) and the dense kernels (:mod:`._dense`: causal leaves, the backward's row
reductions) live beside this module; :func:`build` jits them too and makes them attributes of this
one, which is what the engine launches (and what ``scripts/triton_traffic.py`` counts).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
    from triton import knobs
except ImportError:      # imported without Triton (doctest collection): the engine declines before build()
    triton = tl = knobs = None

__all__ = ["build", "interpreted", "tile_sums", "merge_eval", "decode_attend", "KERNELS"]

#: Every kernel the engine launches, as attributes of this module once built (:func:`build`): this
#: module's and those of :mod:`._order` and :mod:`._dense`
KERNELS = ("tile_sums", "merge_eval", "decode_attend", "sort_rows", "small_attend", "merge_runs", "leaf_eval",
           "leaf_pullback", "causal_epilogue", "row_dots", "column_sums", "causal_dv", "position_sums",
           "causal_row_dots")

_JITTED = ("_rank", "_key_tile", "_tile", "_tile_moments", "_knot_ranks", "_below_sum", "_indicator_carry", "_pairs",
           "_indicator_linear", "_indicator_profile", "_attention_epilogue", "tile_sums", "_eval_block", "merge_eval",
           "_run_profile", "decode_attend")
_mode: list = []     # [interpreted?] once built


def tile_sums(keys_ptr, shift_ptr, perm_ptr, w_ptr, take_ptr, scale_ptr, agg_ptr,
              m, c, C, nb, sw_r, sw_m, sw_c, sk_r,
              HAS_TAKE: tl.constexpr, ONES: tl.constexpr, SCALE: tl.constexpr, ACC: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """Pass 1: one tile of sorted keys x one block of columns: the tile's sums ``[w | (y - shift) w]``
    (float64), nothing per key, into row ``tile + 1`` of ``agg`` (R, nb + 1, 2 C); the first tile's
    programs zero row 0 (the caller's cumulative sum in place makes the exclusive prefix). ``scale``,
    one number per key in its original order, has rows ``sk_r`` apart (a causal level's blocks are
    strided views of the positions); ``take`` has them ``m`` apart."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cb = tl.program_id(2)
    j = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    wv, y, _ = _tile(keys_ptr, shift_ptr, perm_ptr, w_ptr, take_ptr, scale_ptr, row, j, cols, m, c, sw_r, sw_m,
                     sw_c, sk_r, HAS_TAKE, ONES, SCALE, ACC)
    base = row * (nb + 1) * 2 * C
    tot = base + (blk + 1) * 2 * C + cols
    cm = cols < C
    if blk == 0:
        zero = tl.zeros((BLOCK_C,), dtype=tl.float64)
        tl.store(agg_ptr + base + cols, zero, mask=cm)
        tl.store(agg_ptr + base + C + cols, zero, mask=cm)
    sum_w, sum_yw = _tile_moments(wv, y)
    tl.store(agg_ptr + tot, sum_w, mask=cm)
    tl.store(agg_ptr + tot + C, sum_yw, mask=cm)


def _tile_moments(wv, y):
    """A tile's column sums ``[sum w, sum (y - shift) w]`` in float64: pass 1's aggregates, for
    :func:`tile_sums` and :func:`._order.small_attend` alike. The products are formed in float64 with
    the exact shifted keys: the carry's sums of y w are the terms that cancel against s P0 in pass 2
    (docs/mathematics.rst, "Numerics")."""
    wide = wv.to(tl.float64)
    return tl.sum(wide, 0), tl.sum(wide * y[:, None], 0)


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


def _indicator_carry(carry_ptr, ind, first, C, shape):
    """The indicator's sums ``[count, sum of shifted keys]`` over the tiles before ``first``, float64."""
    i0 = tl.zeros(shape, dtype=tl.float64) + tl.load(carry_ptr + ind + first * 2 * C)
    i1 = tl.zeros(shape, dtype=tl.float64) + tl.load(carry_ptr + ind + first * 2 * C + C)
    return i0, i1


def _pairs(s, y, j, rank):
    """``s_i - y_j`` for the keys ``j`` of a tile below each query's ``rank`` (zero for the others),
    float64 (queries, keys): a tile's ReLU terms formed pair by pair, so that a query just above
    its keys gets its small sum from small terms rather than from ``s P0 - P1``, whose terms are
    as large as the scores (docs/mathematics.rst, "Numerics")."""
    return tl.where(j[None, :] < rank[:, None], s[:, None] - y[None, :], 0.0)


def _indicator_linear(carry_ptr, ind, nb, C, xs, slope, intercept):
    """The linear part ``intercept + slope r`` of a profile summed over the valid keys, and their
    number (the indicator's totals, the last row of the carry)."""
    valid = tl.load(carry_ptr + ind + nb * 2 * C)
    keysum = tl.load(carry_ptr + ind + nb * 2 * C + C)
    return (intercept + slope * xs) * valid - slope * keysum, valid


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


def merge_eval(xs_ptr, xperm_ptr, keys_ptr, shift_ptr, perm_ptr, w_ptr, take_ptr, scale_ptr, carry_ptr,
               knots_ptr, coeffs_ptr, lin_ptr, factor_ptr, sub_ptr, out_ptr,
               nknots_ptr, ncoeffs_ptr, nlin_ptr, count_ptr, raw_ptr, eps,
               dot_ptr, sd_r, sd_n, sd_c, dot_col0, dot_take_ptr, out_rs, out_off, out_qs,
               n, m, c, C, nb, col0, width, sw_r, sw_m, sw_c, sk_r, sq_r, log_m,
               K: tl.constexpr, STRICT: tl.constexpr, DERIV: tl.constexpr, HAS_FACTOR: tl.constexpr,
               SUB: tl.constexpr, ADD: tl.constexpr,
               HAS_TAKE: tl.constexpr, ONES: tl.constexpr, SCALE: tl.constexpr, ACC: tl.constexpr,
               ATTN: tl.constexpr, CENTER: tl.constexpr, NORM: tl.constexpr, KN: tl.constexpr, DOT: tl.constexpr,
               DOT_TAKE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Pass 2: ``out[perm_i, :] = (profile sum over columns col0 .. col0 + width) / div_i``
    for one block of *sorted* queries.

    Per knot the block's ranks are increasing (``x - t`` keeps the order of ``x``), so its queries
    read one contiguous range of sorted keys: the carry (float64 sums of the tiles before it) plus,
    tile by tile over the range, the profile's terms of the keys below each query as a product
    ``[(s_i - y_j) if j < rank_i else 0] @ rows_j`` (DERIV: ``[j < rank_i] @ rows_j``) in ACC
    (float32 over the span, float64 in the carry). The rows are
    re-gathered from ``w`` through the key permutation (times ``scale`` when SCALE, as pass 1 read
    them): nothing per key is stored between the passes.
    The profile ``intercept + slope r + sum_k coeffs[k] ReLU(r - knots[k])`` (per batch row:
    ``knots``, ``coeffs`` (R, K), ``lin`` (R, 2) = slope, intercept), or its derivative when DERIV.

    ATTN (attention's epilogue, one launch for the whole forward; the table carries the indicator
    in column ``c``): the same profile over the indicator, summed in the same tile loop, is the
    query's ``relu_count``; CENTER adds ``-relu_count / count`` times the totals; the divisor is
    NORM's (``Normalizer.code``: 0 none, 3 the count of valid keys, 1 or 2 the normaliser profile
    ``nknots``, ``ncoeffs``,
    ``nlin`` (KN knots) over the indicator, floored at ``eps``, 1 for a query that sees no key;
    docs/mathematics.rst, "Attention"). The first column block writes ``relu_count`` and the
    normaliser's sum (R, n), float64 in the queries' original order: the backward's residuals.
    Then SUB subtracts the row ``sub`` (R, width) float64 from every query's sums, and HAS_FACTOR
    multiplies them by the query's ``factor`` (R, n): the NaN policy's (1, or NaN on a bad query or
    row) in the forward, the key mask's and the NaN policy's on ``dv`` in the backward, whose SUB
    is the centring mean's term.

    The rows are written at ``out[out_off + row * out_rs + dest * out_qs + column]`` (``out_rs = n
    width``, ``out_off = 0``, ``out_qs = width`` for an (R, n, width) array); ADD adds them, in
    float64, to what ``out`` (float32 or float64) holds there, rounding once: a causal level's sums
    into the running sums of its right blocks, and its pull-back's value gradients into the
    leaves' of its left blocks, in place. ADD with a summed NORM (ATTN off): the first column block
    also adds the profile ``nknots``, ``ncoeffs``, ``nlin`` over the indicator (column ``c``) to
    ``raw``, the normaliser's running sums, query ``i`` at ``raw[(out_off + row out_rs) / out_qs + i]``.

    DOT (the backward's score gradients): instead of the rows, their dot product with the rows of
    ``dot`` (strides ``sd_*``, columns from ``dot_col0``) at the same queries, read in their own
    dtype; each column block ``cb`` writes its partial dot to ``out[out_off + row * out_rs + dest *
    out_qs + cb]``, float64 ((R, n, column blocks), or a slice of the blocks of several dots), so
    that no (n, width) array is written and the sum over the blocks keeps a fixed order. DOT_TAKE:
    those rows are read only where ``dot_take`` (R, n) int8 is nonzero, 0 elsewhere (the values of
    keys that take no part, which may hold anything).

    The per-key ``scale`` has rows ``sk_r`` apart (``take`` ``m``: a stride for it too spills
    registers on ``sm_90``) and the per-query ``factor`` and ``dot_take`` rows ``sq_r`` apart: a
    causal level's blocks are strided views of the positions, read without a copy.
    """
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cl = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    _eval_block(row, i, cl, tl.program_id(2), 1.0, xs_ptr, xperm_ptr, keys_ptr, shift_ptr,
                perm_ptr, w_ptr, take_ptr, scale_ptr, carry_ptr, knots_ptr, coeffs_ptr, lin_ptr, factor_ptr, sub_ptr,
                out_ptr, nknots_ptr, ncoeffs_ptr, nlin_ptr, count_ptr, raw_ptr, eps, dot_ptr, sd_r, sd_n, sd_c,
                dot_col0, dot_take_ptr, out_rs, out_off, out_qs, n, m, c, C, nb, col0, width, sw_r, sw_m, sw_c, sk_r,
                sq_r, log_m,
                K, STRICT, DERIV, HAS_FACTOR, SUB, ADD, HAS_TAKE, ONES, SCALE, ACC, ATTN, CENTER, NORM, KN, DOT,
                DOT_TAKE, BLOCK_M, BLOCK_N, BLOCK_C)


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


def decode_attend(q_ptr, bounds_ptr, n_runs, keys_ptr, prefix_ptr, shifts_ptr, totals_ptr, bad_ptr,
                  knots_ptr, coeffs_ptr, lin_ptr, nknots_ptr, ncoeffs_ptr, nlin_ptr, out_ptr,
                  M, cap, dv, eps, log_cap,
                  K: tl.constexpr, KN: tl.constexpr, CENTER: tl.constexpr, NORM: tl.constexpr,
                  BLOCK_Q: tl.constexpr, BLOCK_W: tl.constexpr):
    """Decoding's attention: one program per batch row and block of queries, over every sorted run of
    :class:`slicedkern.engines.triton._decode.DeviceRuns` (docs/mathematics.rst, "Decoding").

    Storage per row ``b`` (``cap`` positions): ``keys`` the runs' sorted keys, ``prefix`` (cap, 2 cw)
    the runs' inclusive prefix rows of ``[w, take, (y - shift) w, (y - shift) take]`` (``cw = dv +
    1``), ``shifts`` the run's median key at its first position; ``bounds`` (2, n_runs) int64 the
    runs' ``[start, end)``; ``totals`` (B, cw) the values' sum and the count of the keys taken;
    ``bad`` (B,) int8 a row that took a non-finite key. Per query the profile sums over the runs
    (values and indicator: ``knots``, ``coeffs``, ``lin``), NORM's divisor (0 none, 3 the count, 1 or 2 the
    normaliser profile ``nknots``... over the indicator, floored at ``eps``, 1 for a query that sees
    no key), CENTER's running mean, and NaN for a non-finite query or a ``bad`` row: the arithmetic
    of :func:`slicedkern.engines._combine.combine`. ``out`` (B, M, dv) float64.
    """
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    qm = i < M
    cw = dv + 1
    w = tl.arange(0, BLOCK_W)
    wm = w < cw
    x = tl.load(q_ptr + b * M + i, mask=qm, other=0.0).to(tl.float64)
    finite = x == x
    finite = finite & (x - x == 0.0)                      # neither NaN nor infinite
    x = tl.where(finite, x, 0.0)
    sums = tl.zeros((BLOCK_Q, BLOCK_W), dtype=tl.float64)
    den = tl.zeros((BLOCK_Q,), dtype=tl.float64)
    for r in range(n_runs):
        start = tl.load(bounds_ptr + r)
        size = tl.load(bounds_ptr + n_runs + r) - start
        run_base = b * cap + start
        xs = x - tl.load(shifts_ptr + run_base)
        sums += _run_profile(x, xs, qm, keys_ptr, prefix_ptr, run_base, size, knots_ptr, coeffs_ptr, lin_ptr, b,
                             w, wm, cw, log_cap, K)
        if NORM == 1 or NORM == 2:
            nsums = _run_profile(x, xs, qm, keys_ptr, prefix_ptr, run_base, size, nknots_ptr, ncoeffs_ptr,
                                 nlin_ptr, b, w, wm, cw, log_cap, KN)
            den += tl.sum(tl.where((w == dv)[None, :], nsums, 0.0), 1)
    totals = tl.load(totals_ptr + b * cw + w, mask=wm, other=0.0)
    count = tl.sum(tl.where(w == dv, totals, 0.0), 0)
    relu_count = tl.sum(tl.where((w == dv)[None, :], sums, 0.0), 1)
    acc = _attention_epilogue(sums, relu_count, count, totals[None, :], den, eps, CENTER, NORM)
    poisoned = tl.load(bad_ptr + b) != 0
    acc = tl.where((finite & ~poisoned)[:, None], acc, float("nan"))
    tl.store(out_ptr + b * M * dv + i[:, None] * dv + w[None, :], acc, mask=qm[:, None] & (w < dv)[None, :])


def build() -> None:
    """Jit the kernels once (in place of the plain functions above), in the mode Triton says now,
    and those of :mod:`._order` and :mod:`._dense`, which become attributes of this module too."""
    if not _mode:
        from . import _dense, _order
        scope = globals()
        for name in _JITTED:
            scope[name] = triton.jit(scope[name])
        _dense._below_sum = scope["_below_sum"]
        _dense._attention_epilogue = scope["_attention_epilogue"]
        _order._tile = scope["_tile"]
        _order._tile_moments = scope["_tile_moments"]
        _order._eval_block = scope["_eval_block"]
        for module in (_order, _dense):
            for name in module._JITTED:
                jitted = triton.jit(getattr(module, name))
                setattr(module, name, jitted)
                scope[name] = jitted
        _mode.append(bool(knobs.runtime.interpret))


def interpreted() -> bool | None:
    """Whether the built kernels run under the interpreter (``None``: not built yet)."""
    return _mode[0] if _mode else None
