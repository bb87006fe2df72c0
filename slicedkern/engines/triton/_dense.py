"""The triton engine's dense kernels, no sort involved: the dense leaves of causal attention's
divide and conquer, and the backward's row dots and column sums of the quotient rule
(docs/architecture.rst, "Engines").

Imports Triton at its top and jits these kernels as they are defined, as :mod:`._kernels` does (which
imports them: they are launched as its attributes); the shared device functions are :mod:`._device`'s.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._args import given
from ._device import _attention_epilogue, _below_sum

__all__ = ["leaf_eval", "leaf_pullback", "causal_epilogue", "row_dots", "column_sums", "causal_dv", "position_sums",
           "causal_row_dots"]


@triton.jit
def _strided_at(s, row, i, cols):
    """The addresses of the items ``i`` and columns ``cols`` of row ``row`` of an :class:`._args.Strided`
    array (or a record with its fields, :class:`._args.Positions`): (len(i), len(cols)) pointers."""
    return s.ptr + row * s.row + i[:, None] * s.item + cols[None, :] * s.col


@triton.jit
def leaf_eval(x_ptr, y_ptr, w, take_ptr, profile, out_ptr, cols, n, c, ACC: tl.constexpr, LEAF: tl.constexpr,
              SUB: tl.constexpr, BLOCK_C: tl.constexpr):
    """The dense leaves of causal attention's divide and conquer: for one block of ``LEAF``
    positions of one row, ``out[i] = sum over j <= i in the block, take_j of f(x_i - y_j) [w_j | 1]``
    over the columns ``cols`` (:class:`._args.Columns`; column ``c`` the indicator), (R, n, width) in
    ``out``'s dtype; ``w`` a :class:`._args.Strided`. ``f`` (a :class:`._args.ProfileArgs`, as pass 2
    reads it) is formed pair by pair in float64 and rounded once to ACC for the product with the
    weights, in sub-tiles of ``SUB`` keys (no (positions, leaf) array in memory)."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * LEAF + tl.arange(0, LEAF)
    col0, width, K = cols.start, cols.width, profile.K
    tc = col0 + tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = tc < col0 + width
    x = tl.load(x_ptr + row * n + i)
    slope = tl.load(profile.lin + row * 2)
    intercept = tl.load(profile.lin + row * 2 + 1)
    acc = tl.zeros((LEAF, BLOCK_C), dtype=ACC)
    for start in range(0, LEAF, SUB):
        j = tl.program_id(1) * LEAF + start + tl.arange(0, SUB)
        y = tl.load(y_ptr + row * n + j)
        ok = tl.load(take_ptr + row * n + j) != 0
        r = x[:, None] - y[None, :]
        f = intercept + slope * r
        for k in range(K):
            f += tl.load(profile.coeffs + row * K + k) * tl.maximum(r - tl.load(profile.knots + row * K + k), 0.0)
        f = tl.where((j[None, :] <= i[:, None]) & ok[None, :], f, 0.0)
        wm = ok[:, None] & (tc[None, :] < c)
        wv = tl.load(_strided_at(w, row, j, tc), mask=wm, other=0.0)
        wv = tl.where(wm, wv.to(ACC), 0.0)
        wv = tl.where(ok[:, None] & (tc[None, :] == c), 1.0, wv).to(ACC)
        acc = _below_sum(f.to(ACC), wv, acc, ACC)
    tl.store(out_ptr + row * n * width + i[:, None] * width + (tc - col0)[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=cm[None, :])


@triton.heuristics({"HAS_TAKE": given("take_ptr"), "SCALE": given("scale_ptr"), "VALUE_SCALE": given("vscale_ptr"),
                    "PARAMS": given("dpar_ptr")})
@triton.jit
def leaf_pullback(x_ptr, y_ptr, w, take_ptr, g, scale_ptr, vscale_ptr, profile, strict_ptr, grads, dpar_ptr, cols, n,
                  c, blocks, INDICATOR: tl.constexpr, HAS_TAKE: tl.constexpr, SCALE: tl.constexpr,
                  VALUE_SCALE: tl.constexpr, PARAMS: tl.constexpr):
    """The pull-back of :func:`leaf_eval` for one profile, one block of ``LEAF`` positions of one
    row, added to ``grads = (dx, dy, dw)``, ``dx``, ``dy`` (R, n) float64 and ``dw`` (R, n, c) (in
    float64, rounded to its dtype): with ``A_ij = s_i g_i . w_j[cols]`` on the pairs ``j <= i`` of the
    block, ``dx_i += sum_j f'(x_i - y_j) A_ij`` (``H(0) = 1``), ``dy_j -= sum_i f'(x_i - y_j)
    A_ij`` and ``dw_j += sum_i f(x_i - y_j) u_i g_i`` on those columns; with PARAMS, per knot
    ``k`` the sums ``-c_k sum H(r - t_k) A`` (the tie on the side ``strict`` (K,) int8 says) and
    ``sum ReLU(r - t_k) A`` added to ``dpar`` (R, n / LEAF, 2 K) (docs/mathematics.rst, "The
    backward pass").

    ``s_i``: ``scale`` (R, n) float64 when given, else 1; ``u_i``: ``vscale`` when given, else
    ``s_i`` (the quotient rule's factors, read here rather than multiplied into a copy of ``g``).
    ``take`` (R, n) int8 given: the weights are ``w_j take_j`` (a value is read only where its key
    takes part) and, with INDICATOR, the one column ``take_j`` itself, whose ``dw`` is not formed.
    ``w`` and ``g`` are :class:`._args.Strided`; ``blocks`` (:class:`._args.Blocks`): ``SUB`` keys
    (``M``) of the ``LEAF`` positions (``N``) of a block and ``C`` columns at a time.

    Every pair of a block is inside the block, so a program owns the rows it adds to: no atomics.
    The pairs' terms are formed in float64 in registers, ``SUB`` keys at a time, and no (positions,
    leaf) array is written."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    LEAF: tl.constexpr = blocks.N
    SUB: tl.constexpr = blocks.M
    BLOCK_C: tl.constexpr = blocks.C
    K: tl.constexpr = profile.K
    col0, width = cols.start, cols.width
    dx_ptr, dy_ptr, dw_ptr = grads
    i = blk * LEAF + tl.arange(0, LEAF)
    x = tl.load(x_ptr + row * n + i).to(tl.float64)
    slope = tl.load(profile.lin + row * 2)
    intercept = tl.load(profile.lin + row * 2 + 1)
    if SCALE:
        s = tl.load(scale_ptr + row * n + i)
        if VALUE_SCALE:
            u = tl.load(vscale_ptr + row * n + i)
        else:
            u = s
    dx = tl.zeros((LEAF,), dtype=tl.float64)
    for start in range(0, LEAF, SUB):
        j = blk * LEAF + start + tl.arange(0, SUB)
        r = x[:, None] - tl.load(y_ptr + row * n + j).to(tl.float64)[None, :]
        seen = j[None, :] <= i[:, None]
        if HAS_TAKE:
            taken = tl.load(take_ptr + row * n + j) != 0
        else:
            taken = j >= 0
        a = tl.zeros((LEAF, SUB), dtype=tl.float64)
        for c0 in range(0, width, BLOCK_C):
            cl = c0 + tl.arange(0, BLOCK_C)
            cm = cl < width
            gv = tl.load(_strided_at(g, row, i, cl), mask=cm[None, :], other=0.0)
            if INDICATOR:
                wv = tl.where(taken[:, None] & cm[None, :], 1.0, 0.0)
            else:
                wv = tl.load(_strided_at(w, row, j, col0 + cl),
                             mask=taken[:, None] & cm[None, :], other=0.0)
            a += tl.sum(gv.to(tl.float64)[:, None, :] * wv.to(tl.float64)[None, :, :], 2)
        if SCALE:
            a = a * s[:, None]
        a = tl.where(seen, a, 0.0)
        f = intercept + slope * r
        slope_r = slope + tl.zeros((LEAF, SUB), dtype=tl.float64)
        for k in range(K):
            t = tl.load(profile.knots + row * K + k)
            cf = tl.load(profile.coeffs + row * K + k)
            f += cf * tl.maximum(r - t, 0.0)
            slope_r += tl.where(r >= t, cf, 0.0)
            if PARAMS:
                strict = tl.load(strict_ptr + k) != 0
                step = (r > t) | ((r == t) & ~strict)
                par = dpar_ptr + (row * tl.num_programs(1) + blk) * 2 * K + k
                tl.store(par, tl.load(par) - cf * tl.sum(tl.sum(tl.where(step, a, 0.0), 1), 0))
                tl.store(par + K, tl.load(par + K) + tl.sum(tl.sum(tl.maximum(r - t, 0.0) * a, 1), 0))
        da = slope_r * a
        dx += tl.sum(da, 1)
        tl.store(dy_ptr + row * n + j, tl.load(dy_ptr + row * n + j) - tl.sum(da, 0))
        if not INDICATOR:
            f = tl.where(seen, f, 0.0)
            if SCALE:
                f = f * u[:, None]
            for c0 in range(0, width, BLOCK_C):
                cl = c0 + tl.arange(0, BLOCK_C)
                cm = cl < width
                gv = tl.load(_strided_at(g, row, i, cl), mask=cm[None, :],
                             other=0.0)
                part = tl.sum(f[:, :, None] * gv.to(tl.float64)[:, None, :], 0)
                where = dw_ptr + row * n * c + j[:, None] * c + (col0 + cl)[None, :]
                total = tl.load(where, mask=cm[None, :], other=0.0).to(tl.float64) + part
                tl.store(where, total.to(dw_ptr.dtype.element_ty), mask=cm[None, :])
    tl.store(dx_ptr + row * n + i, tl.load(dx_ptr + row * n + i) + dx)


@triton.jit
def _position_rows(pos, row, j, jm, cols):
    """The rows ``[w_j take_j | take_j]`` of the positions ``j`` of one row over the columns ``cols``
    (column ``c`` the indicator), float64, zero where ``jm`` is False (:class:`._args.Positions`)."""
    c = pos.c
    ok = (tl.load(pos.take + row * pos.n + j, mask=jm, other=0) != 0) & jm
    wv = tl.load(_strided_at(pos, row, j, cols),
                 mask=ok[:, None] & (cols < c)[None, :], other=0.0).to(tl.float64)
    return tl.where(ok[:, None] & (cols == c)[None, :], 1.0, wv)


@triton.jit
def _running_totals(pos, row, p0, cols, BLOCK_N: tl.constexpr):
    """The running totals ``sum over j <= p of [w_j take_j | take_j]`` at the positions ``p = p0 ..
    p0 + BLOCK_N - 1`` of one row, over the columns ``cols``, (BLOCK_N, len(cols)) float64 (0 before
    position 0), from the positions' ``carry`` (R, carry_rows, c + 1) float64 (``carry_rows`` at
    least ``nb + 1``: a forward's carry over more positions serves its backward), the exclusive
    prefix of the sums of blocks of ``BLOCK_N`` positions (:func:`position_sums`), the rows of the
    block that holds ``p0`` before it, and a running sum in registers of the rows from ``p0``: no
    (n, c) array of the totals."""
    start = tl.maximum(p0, 0)
    first = start // BLOCK_N
    a = first * BLOCK_N + tl.arange(0, BLOCK_N)
    before = tl.sum(_position_rows(pos, row, a, a < start, cols), 0)
    carry = tl.load(pos.carry + (row * pos.carry_rows + first) * (pos.c + 1) + cols, mask=cols <= pos.c, other=0.0)
    p = p0 + tl.arange(0, BLOCK_N)
    rows = _position_rows(pos, row, p, (p >= 0) & (p < pos.n), cols)
    return (carry + before)[None, :] + tl.cumsum(rows, axis=0)


@triton.jit
def position_sums(pos, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """The sums of ``[w_j take_j | take_j]`` over each block of ``BLOCK_N`` positions of a row,
    float64, written to ``carry[r, b + 1]`` (R, nb + 1, c + 1) (row 0 left zero): one cumulative sum
    makes it the exclusive prefix that :func:`_running_totals` reads."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = _position_rows(pos, row, j, j < pos.n, cols)
    tl.store(pos.carry + (row * tl.num_programs(1) + row + blk + 1) * (pos.c + 1) + cols, tl.sum(rows, 0),
             mask=cols <= pos.c)


@triton.jit
def causal_row_dots(g, pos, out_ptr, lq, offset, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """``out[r, i] = <g[r, i], V[r, i + offset]>`` (R, lq) float64, ``V`` the running sums of the
    values of ``pos`` (R, n, c) over the positions (:func:`_running_totals`): the quotient rule's row
    dots with the value sums each query of causal attention sees, with no (lq, c) array of them;
    ``g`` (R, lq, c) a :class:`._args.Strided`."""
    c = pos.c
    row = tl.program_id(0).to(tl.int64)
    i0 = tl.program_id(1) * BLOCK_N
    i = i0 + tl.arange(0, BLOCK_N)
    im = i < lq
    acc = tl.zeros((BLOCK_N,), dtype=tl.float64)
    for c0 in range(0, c, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cm = cols < c
        totals = _running_totals(pos, row, i0 + offset, cols, BLOCK_N)
        gv = tl.load(_strided_at(g, row, i, cols), mask=im[:, None] & cm[None, :],
                     other=0.0)
        acc += tl.sum(tl.where(cm[None, :], totals, 0.0) * gv.to(tl.float64), 1)
    tl.store(out_ptr + row * lq + i, acc, mask=im)


@triton.jit
def causal_epilogue(num_ptr, den_ptr, pos, good_ptr, out_ptr, lq, offset, eps_ptr, CENTER: tl.constexpr,
                    NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Causal attention's output from its running sums, in one pass (the arithmetic of
    :func:`._device._attention_epilogue`): query ``i`` of a row sits at position ``i + offset``
    (none before 0: a query that sees no key) and reads there ``num`` (R, n, dv + 1) float64, the
    profile sums of the values and of the indicator (its ReLU count), and with a summed NORM the
    normaliser sums ``den`` (R, n) float64; the totals of the values and the count it sees are
    summed here from the values on the positions ``pos`` (:class:`._args.Positions`, ``c = dv``;
    :func:`_running_totals`); ``good`` (R, lq) int8 False makes its row NaN (the causal NaN rule);
    the normaliser's floor ``eps`` (1,) float64 at ``eps_ptr``. Writes ``out`` (R, lq, dv) in its
    own dtype: no float64 output, no (n, dv) array of the totals and no temporaries of the
    centring and the division (docs/architecture.rst, "Engines")."""
    row = tl.program_id(0).to(tl.int64)
    n, dv = pos.n, pos.c
    i0 = tl.program_id(1) * BLOCK_N
    i = i0 + tl.arange(0, BLOCK_N)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    p = i + offset
    seen = (i < lq) & (p >= 0)
    cm = cols < dv
    base = row * n * (dv + 1) + p * (dv + 1)
    acc = tl.load(num_ptr + base[:, None] + cols[None, :], mask=seen[:, None] & cm[None, :], other=0.0).to(tl.float64)
    relu_count = tl.load(num_ptr + base + dv, mask=seen, other=0.0).to(tl.float64)
    totals = acc                              # read by the epilogue only with CENTER
    if CENTER:
        totals = _running_totals(pos, row, i0 + offset, cols, BLOCK_N)
    # the count is the indicator's column dv (the pair's second column is past the carry: zero)
    count = tl.sum(_running_totals(pos, row, i0 + offset, dv + tl.arange(0, BLOCK_C), BLOCK_N), 1)
    den = relu_count                          # read by the epilogue only for a summed normaliser
    if NORM == 1 or NORM == 2:
        den = tl.load(den_ptr + row * n + p, mask=seen, other=0.0).to(tl.float64)
    acc = _attention_epilogue(acc, relu_count, count, totals, den, tl.load(eps_ptr), CENTER, NORM)
    good = tl.load(good_ptr + row * lq + i, mask=i < lq, other=0) != 0
    acc = tl.where(good[:, None], acc, float("nan"))
    if out_ptr.dtype.element_ty != tl.float64:
        acc = acc.to(tl.float32)              # through float32, as pass 2 writes (_device._store_rows)
    tl.store(out_ptr + row * lq * dv + i[:, None] * dv + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(i < lq)[:, None] & cm[None, :])


@triton.jit
def row_dots(a, b, out_ptr, n, d, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """``out[r, i] = <a[r, i], b[r, i]>`` (R, n) float64, each operand (:class:`._args.Strided`) read
    in its own dtype and strides (``b.item = 0``: one ``b`` row for every ``i``): the quotient rule's row dots without a
    float64 copy of either (docs/architecture.rst, "Engines")."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    im = i < n
    acc = tl.zeros((BLOCK_N,), dtype=tl.float64)
    for start in range(0, d, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = im[:, None] & (cols < d)[None, :]
        av = tl.load(_strided_at(a, row, i, cols), mask=mask, other=0.0)
        bv = tl.load(_strided_at(b, row, i, cols), mask=mask, other=0.0)
        acc += tl.sum(av.to(tl.float64) * bv.to(tl.float64), 1)
    tl.store(out_ptr + row * n + i, acc, mask=im)


@triton.jit
def column_sums(weights_ptr, g, out_ptr, n, d, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """``out[r, c] = sum over i of weights[r, i] g[r, i, c]`` (R, d) float64, ``weights`` (R, n)
    float64 and ``g`` (:class:`._args.Strided`) read in its own dtype and strides: the centring
    mean's cotangent taken to the keys without a float64 copy of ``g``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = cols < d
    acc = tl.zeros((BLOCK_D,), dtype=tl.float64)
    for start in range(0, n, BLOCK_N):
        i = start + tl.arange(0, BLOCK_N)
        im = i < n
        w = tl.load(weights_ptr + row * n + i, mask=im, other=0.0)
        gv = tl.load(_strided_at(g, row, i, cols),
                     mask=im[:, None] & cm[None, :], other=0.0)
        acc += tl.sum(w[:, None] * gv.to(tl.float64), 0)
    tl.store(out_ptr + row * d + cols, acc, mask=cm)


@triton.heuristics({"SUB": given("g")})
@triton.jit
def causal_dv(dw, g, weights_ptr, factor_ptr, out_ptr, lq, lk, d, shift, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              SUB: tl.constexpr):
    """Causal attention's ``dv``, finished in one pass: ``out[r, j] = (dw[r, j] - sub[r, j]) *
    factor[r, j]`` (R, lk, d) in ``out``'s dtype, where ``sub[r, j]`` is the sum over the queries
    ``i`` that see key ``j`` (position ``i - shift >= j``, ``shift = lq - lk``) of ``weights[r, i]
    g[r, i]`` (zero when ``g`` is None): the centring mean's cotangent taken back to the keys by a
    reverse running sum over the positions, carried in float64 from block to block, so that neither
    it nor ``dw - sub`` is written as an (lk, d) array (docs/architecture.rst, "Engines").

    ``dw`` (R, lk, >= d) float64 the pulled-back value sums, ``g`` (R, lq, d) the output's cotangent,
    both :class:`._args.Strided`, read in their own dtypes and strides; ``weights`` (R, lq) and
    ``factor`` (R, lk) float64.
    One program per (row, column block) walks the key blocks from the last."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = cols < d
    carry = tl.zeros((BLOCK_D,), dtype=tl.float64)
    blocks = tl.cdiv(lk, BLOCK_N)
    for b in range(0, blocks):
        j = (blocks - 1 - b) * BLOCK_N + tl.arange(0, BLOCK_N)
        jm = j < lk
        mask = jm[:, None] & cm[None, :]
        acc = tl.load(_strided_at(dw, row, j, cols), mask=mask,
                      other=0.0).to(tl.float64)
        if SUB:
            # the query at key j's position; queries before position 0 see no key and are never read
            t = j + shift
            tm = jm & (t >= 0) & (t < lq)
            w = tl.load(weights_ptr + row * lq + t, mask=tm, other=0.0)
            gv = tl.load(_strided_at(g, row, t, cols),
                         mask=tm[:, None] & cm[None, :], other=0.0)
            rows = w[:, None] * gv.to(tl.float64)
            acc -= carry[None, :] + tl.cumsum(rows, axis=0, reverse=True)
            carry += tl.sum(rows, 0)
        factor = tl.load(factor_ptr + row * lk + j, mask=jm, other=0.0)
        acc = acc * factor[:, None]
        if out_ptr.dtype.element_ty != tl.float64:
            acc = acc.to(tl.float32)           # through float32, as pass 2's _device._store_rows says why
        tl.store(out_ptr + row * lk * d + j[:, None] * d + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
