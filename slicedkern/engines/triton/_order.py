"""The triton engine's sorting kernels: the small-L sort of a row of scores in one program, the
small-L forward of attention in one launch that starts with those sorts, and one step of the
bottom-up merge sort that gives causal attention's levels their sorted blocks
(docs/architecture.rst, "Engines").

Imports Triton at its top and jits these kernels as they are defined, as :mod:`._kernels` does (which
imports them: they are launched as its attributes, so that one patch point counts every launch);
pass 1's tile and pass 2's block are :mod:`._device`'s.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._device import _attend_block, _tile, _tile_moments

__all__ = ["sort_rows", "small_attend", "merge_runs"]


@triton.jit
def _sort_row(a_ptr, values_ptr, perm_ptr, row, n, BLOCK: tl.constexpr):
    """Row ``row`` of ``n <= BLOCK`` float32 numbers (``a`` in any float dtype holding them) sorted
    stably: each number's order-preserving 32-bit pattern (sign bit flipped for the positive
    numbers, every bit for the negative ones; -0 made +0 first, as a comparison has it) above its
    index, one 64-bit ``tl.sort``. Writes the sorted numbers (in ``values``' dtype) and their int32
    indices."""
    i = tl.arange(0, BLOCK)
    inside = i < n
    x = tl.load(a_ptr + row * n + i, mask=inside, other=0.0).to(tl.float32) + 0.0
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)
    key = tl.where(inside, key, 0xFFFFFFFF)             # past the row: last
    ordered = tl.sort((key.to(tl.uint64) << 32) | i.to(tl.uint64))
    key = (ordered >> 32).to(tl.uint32)
    bits = tl.where((key >> 31) != 0, key & 0x7FFFFFFF, ~key)
    tl.store(values_ptr + row * n + i, bits.to(tl.float32, bitcast=True).to(values_ptr.dtype.element_ty),
             mask=inside)
    tl.store(perm_ptr + row * n + i, (ordered & 0xFFFFFFFF).to(tl.int32), mask=inside)


@triton.jit
def sort_rows(a_ptr, values_ptr, perm_ptr, n, BLOCK: tl.constexpr):
    """Rows of ``n <= BLOCK`` float32 numbers sorted, one program a row (:func:`_sort_row`): the
    small-L sort, one launch instead of ``torch.sort`` and its casts."""
    _sort_row(a_ptr, values_ptr, perm_ptr, tl.program_id(0).to(tl.int64), n, BLOCK)


@triton.jit
def small_attend(y_ptr, x_ptr, queries, keys, weights, carry, profile, norm, divisor, factor, out, cols, schedule,
                 blocks, SORT: tl.constexpr):
    """Attention's forward on short rows in one launch: one program per row, slice of
    ``schedule = (per_program, query_blocks)`` blocks of sorted queries and block of output
    columns.

    Each program sorts its row's keys ``y`` into ``keys`` and queries ``x`` into ``queries``
    (:func:`_sort_row`, ``SORT`` at least both lengths), sums the tiles of sorted keys over **every**
    column of ``[w | take]`` into the float64 carry as a running sum (pass 1,
    :func:`._kernels.tile_sums`' sums added in the order of its cumulative sum), takes the NaN
    policy's verdict on the values off the carry's totals (a non-finite value makes the row NaN:
    ``factor`` times NaN, as the two-pass forward's deferred check has it), and evaluates its query
    blocks as pass 2 does (:func:`._device._attend_block`). The programs of a row compute the same
    sorts and carry and write them, all alike, as the backward's residuals (the sorted keys, their
    permutation and shift, the sorted queries and theirs, the carry); a block barrier orders each
    program's writes before its reads. Nothing but the output and the residuals is written.
    """
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cb = tl.program_id(2)
    m, n, C, c, nb = keys.m, queries.n, carry.C, weights.c, carry.nb
    _sort_row(y_ptr, keys.keys, keys.perm, row, m, SORT)
    _sort_row(x_ptr, queries.sorted, queries.perm, row, n, SORT)
    tl.debug_barrier()
    tl.store(keys.shift + row, tl.load(keys.keys + row * m + m // 2).to(tl.float64))
    tl.debug_barrier()
    base = carry.carry + row * (nb + 1) * 2 * C
    for cc in range(0, tl.cdiv(C, blocks.C)):
        tc = cc * blocks.C + tl.arange(0, blocks.C)
        cm = tc < C
        s0 = tl.zeros((blocks.C,), dtype=tl.float64)
        s1 = tl.zeros((blocks.C,), dtype=tl.float64)
        tl.store(base + tc, s0, mask=cm)
        tl.store(base + C + tc, s1, mask=cm)
        for blk in range(0, nb):
            j = blk * blocks.M + tl.arange(0, blocks.M)
            wv, y, _ = _tile(keys, weights, row, j, tc)
            sum_w, sum_yw = _tile_moments(wv, y)
            s0 += sum_w
            s1 += sum_yw
            tl.store(base + (blk + 1) * 2 * C + tc, s0, mask=cm)
            tl.store(base + (blk + 1) * 2 * C + C + tc, s1, mask=cm)
    tl.debug_barrier()
    # the values' verdict: float64 sums of narrower values cannot overflow, so the sum of their
    # totals is finite exactly when every value that takes part is (_nanpolicy's deferred check)
    totals = tl.zeros((blocks.C,), dtype=tl.float64)
    for cc in range(0, tl.cdiv(c, blocks.C)):
        tc = cc * blocks.C + tl.arange(0, blocks.C)
        totals += tl.load(base + nb * 2 * C + tc, mask=tc < c, other=0.0)
    verdict = tl.sum(totals, 0)
    row_factor = tl.where(verdict - verdict == 0.0, 1.0, float("nan"))
    cl = cb * blocks.C + tl.arange(0, blocks.C)
    per_program, query_blocks = schedule
    first = part * per_program
    last = tl.minimum(first + per_program, query_blocks)
    for qb in range(first, last):
        i = qb * blocks.N + tl.arange(0, blocks.N)
        _attend_block(row, i, cl, cb, row_factor, queries, keys, weights, carry, profile, norm, divisor, factor, out,
                      cols, blocks, True)


@triton.jit
def merge_runs(values_ptr, perm_ptr, merged_ptr, merged_perm_ptr, n, run, log_run, SPLIT_IN: tl.constexpr,
               SPLIT_OUT: tl.constexpr, BLOCK: tl.constexpr):
    """One step of a bottom-up merge sort: each row's sorted runs of ``run`` entries (``n`` a
    multiple of ``2 run``), merged in adjacent pairs into sorted runs of ``2 run``, stably (a left
    entry before an equal right one). Each entry finds its rank in its partner run by a binary
    search of ``log_run`` = log2(run) + 1 steps and is written at its own index plus that rank;
    ``perm`` (int32, the entry's index within its run) moves with it, plus ``run`` for the right
    run's entries. The causal levels' sorted blocks, each level's from the one below
    (docs/architecture.rst, "Engines").

    Layouts: natural, (R, n) with run ``p`` of a row at ``p run``; or, SPLIT_IN / SPLIT_OUT for
    the input / the output, split: (2, R, n / 2), the even runs of every row in the first half
    and the odd runs in the second, each half's row ``r`` holding its runs in order, so that a
    level's left (even) or right (odd) blocks are one contiguous (R n / 2) array, not a strided
    view copied per level."""
    row = tl.program_id(0).to(tl.int64)
    rows = tl.num_programs(0).to(tl.int64)
    half = n // 2
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    im = i < n
    if SPLIT_IN:
        side = i // half
        local = i - side * half
        run_of = 2 * (local // run) + side
        at = side * rows * half + row * half + local
        partner = (1 - side) * rows * half + row * half + (local // run) * run
    else:
        run_of = i // run
        at = row * n + i
        partner = row * n + (run_of + 1 - 2 * (run_of % 2)) * run
    v = tl.load(values_ptr + at, mask=im, other=0.0)
    p = tl.load(perm_ptr + at, mask=im, other=0)
    right = run_of % 2 == 1
    pos = tl.zeros((BLOCK,), dtype=tl.int64)
    for step in range(log_run):
        cand = pos + (1 << (log_run - 1 - step))
        inside = cand <= run
        other = tl.load(values_ptr + partner + cand - 1, mask=im & inside, other=0.0)
        below = (other < v) | (right & (other == v))
        pos = tl.where(inside & below, cand, pos)
    merged = run_of // 2
    if SPLIT_OUT:
        dest = (merged % 2) * rows * half + row * half + (merged // 2) * 2 * run + i % run + pos
    else:
        dest = row * n + merged * 2 * run + i % run + pos
    tl.store(merged_ptr + dest, v, mask=im)
    tl.store(merged_perm_ptr + dest, p + tl.where(right, run, 0).to(p.dtype), mask=im)
