"""The Triton kernels of the triton engine: two passes over the sorted keys, nothing stored per key
between them (docs/architecture.rst, "Engines").

This module imports Triton at its top and jits its kernels as they are defined: the engine imports it
on the first call that runs on it (:func:`._sums.loaded`), so ``import slicedkern`` never imports
Triton, and Triton's interpreter setting (``TRITON_INTERPRET``), which ``triton.jit`` reads, is read
then (docs/architecture.rst, "Engines"; doctest collection leaves these modules out, the root
``conftest.py``). The device functions the kernels share live in :mod:`._device`.

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
reductions) live beside this module, which imports them: every kernel the engine launches is an
attribute of this one (:data:`KERNELS`, what ``scripts/triton_traffic.py`` counts).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

from ._dense import (
    causal_dv,
    causal_epilogue,
    causal_row_dots,
    column_sums,
    leaf_eval,
    leaf_pullback,
    position_sums,
    row_dots,
)
from ._device import _attention_epilogue, _eval_block, _run_profile, _tile, _tile_moments
from ._order import merge_runs, small_attend, sort_rows

__all__ = ["KERNELS", "INTERPRETED", "tile_sums", "merge_eval", "decode_attend", "sort_rows",
           "small_attend", "merge_runs", "leaf_eval", "leaf_pullback", "causal_epilogue", "row_dots", "column_sums",
           "causal_dv", "position_sums", "causal_row_dots"]

#: Every kernel the engine launches, as attributes of this module: this module's and those of
#: :mod:`._order` and :mod:`._dense`
KERNELS = ("tile_sums", "merge_eval", "decode_attend", "sort_rows", "small_attend", "merge_runs", "leaf_eval",
           "leaf_pullback", "causal_epilogue", "row_dots", "column_sums", "causal_dv", "position_sums",
           "causal_row_dots")
#: whether ``triton.jit`` made interpreted functions of the kernels (the setting when this module
#: was first imported)
INTERPRETED = bool(knobs.runtime.interpret)


@triton.jit
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


@triton.jit
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


@triton.jit
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
