"""The device functions the triton engine's kernels share (:mod:`._kernels`, :mod:`._order`,
:mod:`._dense`): a tile of sorted keys and its moments, the exact rank search, the pair terms of the
sort-scan, the indicator's profile, attention's epilogue, and pass 2's block evaluation, jitted as
they are defined (docs/architecture.rst, "Engines"; the layout is :mod:`._kernels`' docstring).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_block(n, BLOCK: tl.constexpr):
    """This program's row and block of ``BLOCK`` items of its row (``n`` per row): the grid's first
    axis runs over every row's blocks, ``row * blocks + block``, because CUDA runs at most 65535
    programs along the second and third (pass 1 has one per 16 keys: 2^20 keys; docs/benchmarks.rst,
    "On a GPU"). The row is int64 (its offsets pass 2^31), the block int32 (as ``tl.program_id``:
    int64 item indices cost pass 2 registers and spills)."""
    blocks = tl.cdiv(n, BLOCK)
    pid = tl.program_id(0)
    return (pid // blocks).to(tl.int64), pid % blocks


@triton.jit
def _tile_moments(wv, y):
    """A tile's column sums ``[sum w, sum (y - shift) w]`` in float64: pass 1's aggregates, for
    :func:`tile_sums` and :func:`._order.small_attend` alike. The products are formed in float64 with
    the exact shifted keys: the carry's sums of y w are the terms that cancel against s P0 in pass 2
    (docs/mathematics.rst, "Numerics")."""
    wide = wv.to(tl.float64)
    return tl.sum(wide, 0), tl.sum(wide * y[:, None], 0)


@triton.jit
def _key_tile(keys, row, j):
    """The sorted keys ``j`` (a :class:`._args.KeyArgs`): their original positions, their shifted keys
    in float64 (exact for float32 keys: the shift is one of them; zero for the keys that take no
    part) and whether they take part."""
    jm = j < keys.m
    p = tl.load(keys.perm + row * keys.m + j, mask=jm, other=0).to(tl.int64)
    shift = tl.load(keys.shift + row)
    y = tl.load(keys.keys + row * keys.m + j, mask=jm, other=0.0).to(tl.float64) - shift
    ok = jm
    if keys.HAS_TAKE:
        ok = ok & (tl.load(keys.take + row * keys.m + p, mask=jm, other=0) != 0)
    return p, tl.where(ok, y, 0.0), ok


@triton.jit
def _tile(keys, weights, row, j, cols):
    """The weight rows (:class:`._args.WeightArgs`) of the sorted keys ``j``, gathered through the
    keys' permutation (zero for the keys that take no part, times the key's ``scale`` when SCALE,
    the indicator in column ``c`` when ONES), their shifted keys in float64 and whether they take
    part."""
    p, y, ok = _key_tile(keys, row, j)
    c = weights.c
    wm = ok[:, None] & (cols[None, :] < c)
    wv = tl.load(weights.w + row * weights.row_stride + p[:, None] * weights.key_stride
                 + cols[None, :] * weights.col_stride, mask=wm, other=0.0)
    # ``where``, not a product: a masked key's weight may be NaN and must not reach the sums
    wv = tl.where(wm, wv.to(weights.ACC), 0.0)
    if weights.SCALE:
        # the backward's cotangent rows g_i times the quotient rule's factor of query i: the scaled
        # rows are never written (docs/architecture.rst, "Engines")
        wv = wv * tl.load(weights.scale + row * weights.scale_rows + p, mask=ok, other=0.0).to(weights.ACC)[:, None]
    if weights.ONES:
        wv = tl.where(ok[:, None] & (cols[None, :] == c), 1.0, wv).to(weights.ACC)
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
def _knot_ranks(x, t, nm, keys, row, STRICT: tl.constexpr, BLOCK_M: tl.constexpr):
    """The ranks of ``x - t`` among the sorted keys (exact ties, see :func:`_rank`) and the tiles a
    block of sorted queries reads for them: ``first`` up to ``last`` (exclusive)."""
    d = x - t
    bb = d - x
    e = (x - (d - bb)) + (-t - bb)          # x - t = d + e exactly (TwoSum)
    rank = _rank(keys.keys, row, keys.m, d, e, keys.log_m, STRICT)
    first = tl.min(tl.where(nm, rank, keys.m)) // BLOCK_M
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
def _indicator_carry(carry, ind, first, shape):
    """The indicator's sums ``[count, sum of shifted keys]`` over the tiles before ``first``, float64."""
    at = carry.carry + ind + first * 2 * carry.C
    i0 = tl.zeros(shape, dtype=tl.float64) + tl.load(at)
    i1 = tl.zeros(shape, dtype=tl.float64) + tl.load(at + carry.C)
    return i0, i1


@triton.jit
def _pairs(s, y, j, rank):
    """``s_i - y_j`` for the keys ``j`` of a tile below each query's ``rank`` (zero for the others),
    float64 (queries, keys): a tile's ReLU terms formed pair by pair, so that a query just above
    its keys gets its small sum from small terms rather than from ``s P0 - P1``, whose terms are
    as large as the scores (docs/mathematics.rst, "Numerics")."""
    return tl.where(j[None, :] < rank[:, None], s[:, None] - y[None, :], 0.0)


@triton.jit
def _indicator_linear(carry, ind, xs, slope, intercept):
    """The linear part ``intercept + slope r`` of a profile summed over the valid keys, and their
    number (the indicator's totals, the last row of the carry)."""
    at = carry.carry + ind + carry.nb * 2 * carry.C
    valid = tl.load(at)
    keysum = tl.load(at + carry.C)
    return (intercept + slope * xs) * valid - slope * keysum, valid


@triton.jit
def _indicator_profile(x, xs, nm, keys, carry, profile, row, c, BLOCK_M: tl.constexpr):
    """A profile (:class:`._args.ProfileArgs`) summed over the keys that take part (the indicator,
    column ``c`` of the carry) at a block of sorted queries, float64: the normaliser's sum. Reads
    the keys only, never a weight."""
    ind = row * (carry.nb + 1) * 2 * carry.C + c
    total = tl.zeros(x.shape, dtype=tl.float64)
    for k in range(profile.K):
        t = tl.load(profile.knots + row * profile.K + k)
        cf = tl.load(profile.coeffs + row * profile.K + k)
        rank, first, last = _knot_ranks(x, t, nm, keys, row, profile.STRICT, BLOCK_M)
        i0, i1 = _indicator_carry(carry, ind, first, x.shape)
        s = xs - t
        span = tl.zeros(x.shape, dtype=tl.float64)
        for blk in range(first, last):
            j = blk * BLOCK_M + tl.arange(0, BLOCK_M)
            _, y, ok = _key_tile(keys, row, j)
            span += tl.sum(tl.where(ok[None, :], _pairs(s, y, j, rank), 0.0), 1)
        total += cf * (s * i0 - i1 + span)
    linear, _ = _indicator_linear(carry, ind, xs, tl.load(profile.lin + row * 2), tl.load(profile.lin + row * 2 + 1))
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
def _block_sums(row, i, cl, queries, keys, weights, carry, profile, cols, blocks, COUNT: tl.constexpr):
    """Pass 2's sums on the sorted queries ``i`` of row ``row`` and the columns ``cl`` of a column
    block (:mod:`._kernels`' docstring): ``(acc, relu_count, x, xs, nm, cm, dest, t0, valid)``, the
    profile's sums (BLOCK_N, BLOCK_C) float64 over the table columns ``cols.start + cl``; with COUNT
    the same profile over the indicator (column ``c``), summed in the same tile loop
    (``relu_count``), and the number of valid keys (``valid``); the sorted queries ``x``, shifted
    ``xs``, the masks of the queries and columns, the queries' original positions ``dest`` and the
    columns' totals ``t0``.

    Per knot the block's ranks are increasing (``x - t`` keeps the order of ``x``), so its queries
    read one contiguous range of sorted keys: the carry (float64 sums of the tiles before it) plus,
    tile by tile over the range, the terms of the keys below each query as a product ``[(s_i - y_j)
    if j < rank_i else 0] @ rows_j`` (DERIV: ``[j < rank_i] @ rows_j``) in ACC.
    """
    n = queries.n
    nm = i < n
    cm = cl < cols.width
    tc = cols.start + cl
    C, c = carry.C, weights.c
    x = tl.load(queries.sorted + row * n + i, mask=nm, other=0.0)
    xs = x - tl.load(keys.shift + row)
    acc = tl.zeros((blocks.N, blocks.C), dtype=tl.float64)
    ind = row * (carry.nb + 1) * 2 * C + c                # the indicator's column of the carry (COUNT)
    relu_count = tl.zeros((blocks.N,), dtype=tl.float64)
    for k in range(profile.K):
        t = tl.load(profile.knots + row * profile.K + k)
        cf = tl.load(profile.coeffs + row * profile.K + k)
        rank, first, last = _knot_ranks(x, t, nm, keys, row, profile.STRICT, blocks.M)
        s = xs - t
        # the span's sums in ACC (float32 for float32 / half weights): a block's span is a few
        # tiles when the queries and keys are alike, and float64 tiles here spill registers on an
        # H100 (scripts/triton_resources.py; docs/benchmarks.rst, "On a GPU"). The profile's
        # terms are formed pair by pair (_pairs, in float64, then rounded once): the span's sum
        # is then accurate to ACC's rounding of itself, not of the scores' size
        q = tl.zeros((blocks.N, blocks.C), dtype=weights.ACC)
        if COUNT:
            i0, i1 = _indicator_carry(carry, ind, first, (blocks.N,))
            ispan = tl.zeros((blocks.N,), dtype=tl.float64)
        for blk in range(first, last):
            j = blk * blocks.M + tl.arange(0, blocks.M)
            wv, y, ok = _tile(keys, weights, row, j, tc)
            if profile.DERIV:
                q = _below_sum((j[None, :] < rank[:, None]).to(weights.ACC), wv, q, weights.ACC)
            else:
                pairs = _pairs(s, y, j, rank)
                q = _below_sum(pairs.to(weights.ACC), wv, q, weights.ACC)
                if COUNT:
                    ispan += tl.sum(tl.where(ok[None, :], pairs, 0.0), 1)
        # then the float64 carry: the sums of the tiles before the span
        base = carry.carry + row * (carry.nb + 1) * 2 * C + first * 2 * C + tc
        p0 = tl.load(base, mask=cm, other=0.0)[None, :]
        if profile.DERIV:
            acc += cf * (p0 + q.to(tl.float64))
        else:
            p1 = tl.load(base + C, mask=cm, other=0.0)[None, :]
            acc += cf * (s[:, None] * p0 - p1 + q.to(tl.float64))
            if COUNT:
                relu_count += cf * (s * i0 - i1 + ispan)
    slope = tl.load(profile.lin + row * 2)
    intercept = tl.load(profile.lin + row * 2 + 1)
    total = carry.carry + row * (carry.nb + 1) * 2 * C + carry.nb * 2 * C + tc
    t0 = tl.load(total, mask=cm, other=0.0)
    t1 = tl.load(total + C, mask=cm, other=0.0)
    if profile.DERIV:
        acc += slope * t0[None, :]
    else:
        acc += (intercept + slope * xs)[:, None] * t0[None, :] - slope * t1[None, :]
    dest = tl.load(queries.perm + row * n + i, mask=nm, other=0).to(tl.int64)
    valid = tl.zeros((blocks.N,), dtype=tl.float64)
    if COUNT:
        linear, valid = _indicator_linear(carry, ind, xs, slope, intercept)
        relu_count += linear
    return acc, relu_count, x, xs, nm, cm, dest, t0, valid


@triton.jit
def _store_rows(acc, out, row, dest, cl, nm, cm):
    """Write (or with ``out.ADD`` add, in float64, rounding once) a block's rows (:class:`._args.OutArgs`)."""
    where = out.out + out.offset + row * out.row_stride + dest[:, None] * out.query_stride + cl[None, :]
    result = acc
    if out.ADD:
        # added in float64 and rounded once: a float32 running sum gains one rounding per level
        result += tl.load(where, mask=nm[:, None] & cm[None, :], other=0.0).to(tl.float64)
    if out.out.dtype.element_ty != tl.float64:
        # through float32: the interpreter casts float64 to bfloat16 wrongly (Triton 3.x); the
        # double rounding moves a 16-bit result by one unit only when the float32 value falls on
        # a midpoint
        result = result.to(tl.float32)
    tl.store(where, result.to(out.out.dtype.element_ty), mask=nm[:, None] & cm[None, :])


@triton.jit
def _attend_block(row, i, cl, cb, row_factor, queries, keys, weights, carry, profile, norm, divisor, factor, out,
                  cols, blocks, HAS_FACTOR: tl.constexpr):
    """Attention's forward on a block of sorted queries (:func:`._kernels.attend_eval`, which see;
    :func:`._order.small_attend` too): the sums, the epilogue of :func:`_attention_epilogue`, the
    NaN policy's ``factor`` times ``row_factor`` (1, or NaN: the values' verdict of a fused call),
    and the first column block writes the residuals ``relu_count`` and the normaliser's sum."""
    acc, relu_count, x, xs, nm, cm, dest, t0, valid = _block_sums(row, i, cl, queries, keys, weights, carry,
                                                                   profile, cols, blocks, True)
    n = queries.n
    first_block = cb == 0
    if first_block:
        tl.store(divisor.count + row * n + dest, relu_count, mask=nm)
    raw = relu_count                  # read by _attention_epilogue only for a summed normaliser
    if divisor.NORM == 1 or divisor.NORM == 2:
        raw = _indicator_profile(x, xs, nm, keys, carry, norm, row, weights.c, blocks.M)
        if first_block:
            tl.store(divisor.raw + row * n + dest, raw, mask=nm)
    acc = _attention_epilogue(acc, relu_count, valid, t0[None, :], raw, tl.load(divisor.eps), divisor.CENTER,
                              divisor.NORM)
    if HAS_FACTOR:
        acc = acc * (tl.load(factor + row * queries.rows_apart + dest, mask=nm, other=1.0) * row_factor)[:, None]
    _store_rows(acc, out, row, dest, cl, nm, cm)


@triton.jit
def _run_profile(x, xs, qm, runs, run_base, size, profile, b, w, wm, cw):
    """One run's profile sums at the queries ``x`` (BLOCK_Q,) over the prefix columns ``w``
    (BLOCK_W,): the linear part on the run's totals, then per knot one exact rank search (the strict
    tie rule of :func:`_rank`) and one prefix row; (BLOCK_Q, BLOCK_W) float64. ``runs`` a
    :class:`._args.Runs`, ``profile`` a :class:`._args.ProfileArgs`."""
    prefix = runs.prefix
    tot = prefix + (run_base + size - 1) * 2 * cw
    t0 = tl.load(tot + w, mask=wm, other=0.0)
    t1 = tl.load(tot + cw + w, mask=wm, other=0.0)
    slope = tl.load(profile.lin + b * 2)
    intercept = tl.load(profile.lin + b * 2 + 1)
    sums = (intercept + slope * xs)[:, None] * t0[None, :] - slope * t1[None, :]
    K: tl.constexpr = profile.K
    for k in range(K):
        t = tl.load(profile.knots + b * K + k)
        cf = tl.load(profile.coeffs + b * K + k)
        d = x - t
        bb = d - x
        e = (x - (d - bb)) + (-t - bb)          # x - t = d + e exactly (TwoSum)
        rank = _rank(runs.keys + run_base, 0, size, d, e, runs.log_cap, True)
        row = prefix + (run_base + rank - 1) * 2 * cw
        seen = qm & (rank > 0)
        p0 = tl.load(row[:, None] + w[None, :], mask=seen[:, None] & wm[None, :], other=0.0)
        p1 = tl.load(row[:, None] + cw + w[None, :], mask=seen[:, None] & wm[None, :], other=0.0)
        sums += cf * ((xs - t)[:, None] * p0 - p1)
    return sums
