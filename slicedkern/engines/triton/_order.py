"""The triton engine's sorting kernels: the small-L sort of a row of scores in one program, and one
step of the bottom-up merge sort that gives causal attention's levels their sorted blocks (issue 26,
items 3 and 4; docs/architecture.rst, "Engines").

Imports Triton at its top, as :mod:`._kernels` does, which jits these functions in its ``build``
(they are launched as attributes of that module, so that one patch point counts every launch).
"""

from __future__ import annotations

try:
    import triton.language as tl
except ImportError:      # imported without Triton (doctest collection): the engine declines before build()
    tl = None

__all__ = ["sort_rows", "merge_runs"]

_JITTED = ("sort_rows", "merge_runs")


def sort_rows(a_ptr, values_ptr, perm_ptr, n, BLOCK: tl.constexpr):
    """A row of ``n <= BLOCK`` float32 numbers (``a`` in any float dtype holding them) sorted in one
    program, stably: each number's order-preserving 32-bit pattern (sign bit flipped for the
    positive numbers, every bit for the negative ones; -0 made +0 first, as a comparison has it)
    above its index, one 64-bit ``tl.sort``. Writes the sorted numbers (in ``values``' dtype) and
    their int32 indices: the small-L sort (issue 26, item 3), one launch instead of ``torch.sort``
    and its casts."""
    row = tl.program_id(0).to(tl.int64)
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


def merge_runs(values_ptr, perm_ptr, merged_ptr, merged_perm_ptr, n, run, log_run, BLOCK: tl.constexpr):
    """One step of a bottom-up merge sort: each row's sorted runs of ``run`` entries (``n`` a
    multiple of ``2 run``), merged in adjacent pairs into sorted runs of ``2 run``, stably (a left
    entry before an equal right one). Each entry finds its rank in its partner run by a binary
    search of ``log_run`` = log2(run) + 1 steps and is written at its own index plus that rank;
    ``perm`` (int32, the entry's index within its run) moves with it, plus ``run`` for the right
    run's entries. The causal levels' sorted blocks, each level's from the one below
    (docs/architecture.rst, "Engines")."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    im = i < n
    v = tl.load(values_ptr + row * n + i, mask=im, other=0.0)
    p = tl.load(perm_ptr + row * n + i, mask=im, other=0)
    pair = i // (2 * run)
    right = (i // run) % 2 == 1
    base = pair * 2 * run
    partner = base + tl.where(right, 0, run)
    pos = tl.zeros((BLOCK,), dtype=tl.int64)
    for step in range(log_run):
        cand = pos + (1 << (log_run - 1 - step))
        inside = cand <= run
        other = tl.load(values_ptr + row * n + partner + cand - 1, mask=im & inside, other=0.0)
        below = (other < v) | (right & (other == v))
        pos = tl.where(inside & below, cand, pos)
    dest = base + i % run + pos
    tl.store(merged_ptr + row * n + dest, v, mask=im)
    tl.store(merged_perm_ptr + row * n + dest, p + tl.where(right, run, 0).to(p.dtype), mask=im)
