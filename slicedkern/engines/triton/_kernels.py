"""The Triton kernels of the triton engine: two passes over the sorted keys, nothing stored per key
between them (docs/architecture.rst, "Engines").

This module imports Triton at its top and jits its kernels as they are defined: the engine imports it
on the first call that runs on it (:func:`._sums.loaded`), so ``import slicedkern`` never imports
Triton, and Triton's interpreter setting (``TRITON_INTERPRET``), which ``triton.jit`` reads, is read
then (docs/architecture.rst, "Engines"; doctest collection leaves these modules out, the root
``conftest.py``). The device functions the kernels share live in :mod:`._device`.

Layout (the batch flattened to ``R`` rows; the kernels take it as the records of :mod:`._args`):

* ``keys`` (R, m) the sorted keys (float32 for float32 / half scores, float64 for float64), ``perm``
  (R, m) int32 their original positions, ``shift`` (R,) float64 the median key (subtracted in the
  arithmetic, as in the scan engine), ``take`` (R, m) int8 the keys that take part (the others
  weigh zero, whatever they hold): :class:`._args.KeyArgs`;
* ``w`` (R, m, c) the weights in their own order, dtype and strides (gathered through ``perm`` by
  both passes): :class:`._args.WeightArgs`;
* pass 1, :func:`tile_sums`: per tile of ``BLOCK_M`` sorted keys the sums ``[w, (y - shift) w]``
  (``C = c + ONES`` columns, ``ONES`` the indicator column ``take``), float64; their exclusive prefix
  is the ``carry`` (R, nb + 1, 2 C), the last row the totals (:class:`._args.CarryArgs`);
* pass 2, one kernel per job over the same block sums (:func:`._device._block_sums`): per block of
  sorted queries and per knot, the carry at the block's first rank plus the sums of the tiles its
  ranks span, their terms formed pair by pair (:func:`._device._pairs`) and accumulated in the
  accumulator dtype (float32 for float32 / half weights) over the tiles a block of queries spans,
  in float64 in the carry (docs/mathematics.rst, "Numerics"); then attention's epilogue
  (:func:`attend_eval`), a sum written or added in place (:func:`sums_eval`), or its dot products
  with rows at the queries (:func:`dots_eval`), through the query permutation. Their optional
  arrays are ``None`` when absent, the kernel's flags derived from them (``triton.heuristics``).

The sorts (:mod:`._order`) and the dense kernels (:mod:`._dense`: causal leaves, the backward's row
reductions) live beside this module, which imports them: every kernel the engine launches is an
attribute of this one (:data:`KERNELS`, what ``scripts/triton_traffic.py`` counts).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

from ._args import given
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
from ._device import (
    _attend_block,
    _attention_epilogue,
    _block_sums,
    _indicator_profile,
    _row_block,
    _run_profile,
    _store_rows,
    _tile,
    _tile_moments,
)
from ._order import merge_runs, small_attend, sort_rows

__all__ = ["KERNELS", "INTERPRETED", "tile_sums", "attend_eval", "sums_eval", "dots_eval", "decode_attend",
           "sort_rows", "small_attend", "merge_runs", "leaf_eval", "leaf_pullback", "causal_epilogue", "row_dots",
           "column_sums", "causal_dv", "position_sums", "causal_row_dots"]

#: Every kernel the engine launches, as attributes of this module: this module's and those of
#: :mod:`._order` and :mod:`._dense`
KERNELS = ("tile_sums", "attend_eval", "sums_eval", "dots_eval", "decode_attend", "sort_rows", "small_attend",
           "merge_runs", "leaf_eval", "leaf_pullback", "causal_epilogue", "row_dots", "column_sums", "causal_dv",
           "position_sums", "causal_row_dots")
#: whether ``triton.jit`` made interpreted functions of the kernels (the setting when this module
#: was first imported)
INTERPRETED = bool(knobs.runtime.interpret)


@triton.jit
def tile_sums(keys, weights, carry, blocks):
    """Pass 1: one tile of sorted keys x one block of columns: the tile's sums ``[w | (y - shift) w]``
    (float64), nothing per key, into row ``tile + 1`` of the carry (R, nb + 1, 2 C); the first
    tile's programs zero row 0 (the caller's cumulative sum in place makes the exclusive prefix).
    The weights' per-key ``scale`` has its rows ``scale_rows`` apart (a causal level's blocks are
    strided views of the positions); ``take`` has them ``m`` apart. Grid: (rows x tiles, column
    blocks) (:func:`._device._row_block`)."""
    row, blk = _row_block(keys.m, blocks.M)
    cb = tl.program_id(1)
    j = blk * blocks.M + tl.arange(0, blocks.M)
    cols = cb * blocks.C + tl.arange(0, blocks.C)
    wv, y, _ = _tile(keys, weights, row, j, cols)
    C = carry.C
    base = carry.carry + row * (carry.nb + 1) * 2 * C
    tot = base + (blk + 1) * 2 * C + cols
    cm = cols < C
    if blk == 0:
        zero = tl.zeros((blocks.C,), dtype=tl.float64)
        tl.store(base + cols, zero, mask=cm)
        tl.store(base + C + cols, zero, mask=cm)
    sum_w, sum_yw = _tile_moments(wv, y)
    tl.store(tot, sum_w, mask=cm)
    tl.store(tot + C, sum_yw, mask=cm)


@triton.heuristics({"HAS_FACTOR": given("factor")})
@triton.jit
def attend_eval(queries, keys, weights, carry, profile, norm, divisor, factor, out, cols, blocks,
                HAS_FACTOR: tl.constexpr):
    """Pass 2 of attention's forward, one launch for all of it: per block of sorted queries the
    profile sums of the values (:func:`._device._block_sums`), and over the indicator (the table's
    column ``c``) the query's ``relu_count``; CENTER subtracts ``relu_count / count`` times the
    totals; the divisor is NORM's (``Normalizer.code``: 0 none, 3 the count of valid keys, 1 or 2
    the normaliser profile ``norm`` over the indicator, floored at ``eps``, 1 for a query that sees
    no key; docs/mathematics.rst, "Attention"); ``factor`` (R, n), when given, the NaN policy's (1,
    or NaN on a bad query or row). The first column block writes ``relu_count`` and the
    normaliser's sum (R, n), float64 in the queries' original order: the backward's residuals.
    The rows are written through the query permutation (:class:`._args.OutArgs`). Grid: (rows x
    query blocks, column blocks) (:func:`._device._row_block`)."""
    row, blk = _row_block(queries.n, blocks.N)
    i = blk * blocks.N + tl.arange(0, blocks.N)
    cl = tl.program_id(1) * blocks.C + tl.arange(0, blocks.C)
    _attend_block(row, i, cl, tl.program_id(1), 1.0, queries, keys, weights, carry, profile, norm, divisor, factor,
                  out, cols, blocks, HAS_FACTOR)


@triton.heuristics({"HAS_FACTOR": given("factor"), "SUB": given("sub"), "NORM_INTO": given("raw")})
@triton.jit
def sums_eval(queries, keys, weights, carry, profile, factor, sub, out, cols, blocks, norm, raw,
              HAS_FACTOR: tl.constexpr, SUB: tl.constexpr, NORM_INTO: tl.constexpr):
    """Pass 2 of a profile sum: ``out[perm_i, :] = (profile sum over columns cols - sub) * factor_i``
    for one block of *sorted* queries (:func:`._device._block_sums`). ``sub`` (R, width) float64
    (the centring mean's term of the backward's ``dv``) and ``factor`` (R, n) (the key mask's and
    the NaN policy's on ``dv``) when given. With ``out.ADD`` the rows are added in place, in
    float64, rounding once: a causal level's sums into the running sums of its right blocks, and
    its pull-back's value gradients into the leaves' of its left blocks; ``raw`` given (with ADD):
    the first column block also adds the profile ``norm`` over the indicator (column ``c``) to
    ``raw``, the normaliser's running sums, query ``i`` at ``raw[(out.offset + row out.row_stride)
    / out.query_stride + i]`` (one launch per level, not two). Grid: as :func:`attend_eval`'s."""
    row, blk = _row_block(queries.n, blocks.N)
    cb = tl.program_id(1)
    i = blk * blocks.N + tl.arange(0, blocks.N)
    cl = cb * blocks.C + tl.arange(0, blocks.C)
    acc, _, x, xs, nm, cm, dest, _, _ = _block_sums(row, i, cl, queries, keys, weights, carry, profile, cols,
                                                    blocks, False)
    if NORM_INTO:
        if cb == 0:
            den = _indicator_profile(x, xs, nm, keys, carry, norm, row, weights.c, blocks.M)
            at = raw + (out.offset + row * out.row_stride) // out.query_stride + dest
            den += tl.load(at, mask=nm, other=0.0).to(tl.float64)
            tl.store(at, den.to(raw.dtype.element_ty), mask=nm)
    if SUB:
        acc = acc - tl.load(sub + row * cols.width + cl, mask=cm, other=0.0)[None, :]
    if HAS_FACTOR:
        acc = acc * tl.load(factor + row * queries.rows_apart + dest, mask=nm, other=1.0)[:, None]
    _store_rows(acc, out, row, dest, cl, nm, cm)


@triton.heuristics({"HAS_FACTOR": given("factor"), "DOT_TAKE": given("take")})
@triton.jit
def dots_eval(queries, keys, weights, carry, profile, factor, dot, take, out, cols, blocks,
              HAS_FACTOR: tl.constexpr, DOT_TAKE: tl.constexpr):
    """Pass 2 of the backward's score gradients: per block of sorted queries the profile sums
    (:func:`._device._block_sums`, times ``factor`` (R, n) when given) dotted with the rows of
    ``dot`` (:class:`._args.DotArgs`, read in their own dtype) at the same queries; each column
    block ``cb`` writes its partial dot to ``out[offset + row row_stride + dest query_stride + cb]``,
    float64 ((R, n, column blocks), or a slice of the blocks of several dots), so that no (n, width)
    array is written and the sum over the blocks keeps a fixed order. ``take`` (R, n) int8, when
    given: the rows are read only where it is nonzero, 0 elsewhere (the values of keys that take no
    part, which may hold anything). Grid: as :func:`attend_eval`'s."""
    row, blk = _row_block(queries.n, blocks.N)
    cb = tl.program_id(1)
    i = blk * blocks.N + tl.arange(0, blocks.N)
    cl = cb * blocks.C + tl.arange(0, blocks.C)
    acc, _, _, _, nm, cm, dest, _, _ = _block_sums(row, i, cl, queries, keys, weights, carry, profile, cols,
                                                   blocks, False)
    if HAS_FACTOR:
        acc = acc * tl.load(factor + row * queries.rows_apart + dest, mask=nm, other=1.0)[:, None]
    dm = nm
    if DOT_TAKE:
        dm = dm & (tl.load(take + row * queries.rows_apart + dest, mask=nm, other=0) != 0)
    gv = tl.load(dot.rows + row * dot.row_stride + dest[:, None] * dot.query_stride
                 + (dot.col0 + cl)[None, :] * dot.col_stride, mask=dm[:, None] & cm[None, :], other=0.0).to(tl.float64)
    prod = tl.where(cm[None, :], acc * gv, 0.0)        # columns past the range hold other sums
    tl.store(out.out + out.offset + row * out.row_stride + dest * out.query_stride + cb, tl.sum(prod, 1), mask=nm)


@triton.jit
def decode_attend(q_ptr, runs, profile, norm, out_ptr, M, dv, eps_ptr, CENTER: tl.constexpr, NORM: tl.constexpr,
                  BLOCK_Q: tl.constexpr, BLOCK_W: tl.constexpr):
    """Decoding's attention: one program per batch row and block of queries, over every sorted run of
    :class:`slicedkern.engines.triton._decode.DeviceRuns` (docs/mathematics.rst, "Decoding").

    Storage (:class:`._args.Runs`) per row ``b`` (``cap`` positions): ``keys`` the runs' sorted
    keys, ``prefix`` (cap, 2 cw) the runs' inclusive prefix rows of ``[w, take, (y - shift) w, (y -
    shift) take]`` (``cw = dv + 1``), ``shifts`` the run's median key at its first position;
    ``bounds`` (2, n_runs) int64 the runs' ``[start, end)``; ``totals`` (B, cw) the values' sum and
    the count of the keys taken; ``bad`` (B,) int8 a row that took a non-finite key. Per query the
    profile sums over the runs (values and indicator: ``profile``), NORM's divisor (0 none, 3 the
    count, 1 or 2 the normaliser profile ``norm`` over the indicator, floored at ``eps``, (1,)
    float64 at ``eps_ptr``, 1 for a query that sees no key), CENTER's running mean, and NaN for a
    non-finite query or a ``bad`` row: the arithmetic of :func:`slicedkern.engines._combine.combine`.
    ``out`` (B, M, dv) float64.
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
    for r in range(runs.count):
        start = tl.load(runs.bounds + r)
        size = tl.load(runs.bounds + runs.count + r) - start
        run_base = b * runs.cap + start
        xs = x - tl.load(runs.shifts + run_base)
        sums += _run_profile(x, xs, qm, runs, run_base, size, profile, b, w, wm, cw)
        if NORM == 1 or NORM == 2:
            nsums = _run_profile(x, xs, qm, runs, run_base, size, norm, b, w, wm, cw)
            den += tl.sum(tl.where((w == dv)[None, :], nsums, 0.0), 1)
    totals = tl.load(runs.totals + b * cw + w, mask=wm, other=0.0)
    count = tl.sum(tl.where(w == dv, totals, 0.0), 0)
    relu_count = tl.sum(tl.where((w == dv)[None, :], sums, 0.0), 1)
    acc = _attention_epilogue(sums, relu_count, count, totals[None, :], den, tl.load(eps_ptr), CENTER, NORM)
    poisoned = tl.load(runs.bad + b) != 0
    acc = tl.where((finite & ~poisoned)[:, None], acc, float("nan"))
    tl.store(out_ptr + b * M * dv + i[:, None] * dv + w[None, :], acc, mask=qm[:, None] & (w < dv)[None, :])
