"""Profile sums on the Triton kernels: the sorted keys with their tile carries, the sorted queries,
and one evaluation launch per profile and column range.

The same sums as the scan engine's :func:`~slicedkern.engines.sortscan.sums.profile_sums` (the same
shift by the median key, the same tie rules), computed by two kernels (:mod:`._kernels`): the tile
sums of the sorted keys (pass 1), and the evaluation at the sorted queries (pass 2), which re-reads
the weights instead of a stored prefix table. Arrays are torch tensors; the batch is flattened to
rows here and restored by the caller.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, NamedTuple

from ...kernels import Profile
from .._columns import ScaledRows
from .._vjp import Form, Inputs
from ._args import (
    Blocks,
    CarryArgs,
    Columns,
    DotArgs,
    KeyArgs,
    OutArgs,
    QueryArgs,
    WeightArgs,
    divisor_args,
    log_steps,
    no_profile,
    profile_record,
    tl_dtype,
)

__all__ = ["Table", "Queries", "build_table", "sort_queries", "profile_sum", "profile_sum_into",
           "profile_dots", "DotTerm", "SumTerm", "unit_rows",
           "attend", "attend_small", "loaded", "interpreted", "flat_rows", "row_view",
           "cotangent_rows", "per_key_rows", "as_int8"]

#: Keys per tile, queries per block and columns per block. With 16 keys a tile and pass 2 on 8 warps,
#: its float32 and bfloat16 forms hold every value in registers on an H100 (sm_90); 64 keys a tile on
#: 4 warps spilled 5.5 KB a thread (scripts/triton_resources.py; docs/benchmarks.rst, "On a GPU").
BLOCK_M = 16
BLOCK_N = 64
BLOCK_C = 32
#: rows and columns a program of the row-dot and column-sum reductions reads at a time
BLOCK_ROWS = 64
BLOCK_COLS = 32
#: Rows of float32 scores up to this length are sorted in one launch (:func:`._order.sort_rows`);
#: longer ones by ``torch.sort``. Its 64-bit bitonic network compiles once per power of two and
#: holds a row in registers: 112 a thread at 4096 on 8 warps (``sm_90``, no spill), 206 at 8192.
SMALL_SORT = 4096
#: The smallest block a row is sorted in: below 256 the 128 threads of 4 warps hold under two numbers
#: each. (Under Triton's interpreter, where every stage of the network is Python work, the tests
#: lower it so that short rows sort in short networks.)
SORT_MIN_BLOCK = 256
#: warps of a pass-2 program (:func:`._kernels.attend_eval`, ``sums_eval``, ``dots_eval``)
MERGE_WARPS = 8
_MODULE = "slicedkern.engines.triton._kernels"


def loaded():
    """The kernel module, imported on first use (it imports Triton, which ``import slicedkern`` must not)."""
    from . import _kernels  # a framework row (tests/test_architecture.py): imports Triton at its top
    return _kernels


def interpreted() -> bool:
    """Whether the kernels run (or, not built yet, will run) under Triton's interpreter."""
    kernels = sys.modules.get(_MODULE)
    if kernels is not None:
        return kernels.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def flat_rows(xp, a, core: int):
    """``a`` with its batch dims flattened to one: (R, *core dims), contiguous."""
    return row_view(xp, a, core).contiguous()


def row_view(xp, a, core: int):
    """``a`` as (R, *core dims) without a copy where its strides allow it (a (B, T, H, D) layout
    permuted to (B, H, T, D) with B = 1, say): the kernels read the weights through their strides."""
    shape = tuple(a.shape)
    batch = shape[:len(shape) - core]
    rows = 1
    for s in batch:
        rows *= s
    return xp.reshape(a, (rows,) + shape[len(shape) - core:])


def cotangent_rows(xp, g):
    """A cotangent as the kernels read it: ``(rows, scale, value_scale)``, ``rows`` (R, n, c) in
    its own dtype and strides, and for a :class:`~slicedkern.engines._columns.ScaledRows` its factors
    as (R, n) float64 (``value_scale`` None where it is ``scale``); a plain array has none."""
    if isinstance(g, ScaledRows):
        def per_row(a):
            return None if a is None else row_view(xp, xp.astype(a[..., 0], xp.float64, copy=False), 1)
        return row_view(xp, g.rows, 2), per_row(g.scale), per_row(g.value_scale)
    return row_view(xp, g, 2), None, None


class Table(NamedTuple):
    """Sorted keys and the float64 carries between tiles; the weights stay where they are."""
    keys: Any    # (R, m) sorted keys (float32 for float32 / half scores, float64 for float64 ones)
    perm: Any    # (R, m) int32: the original position of each sorted key
    shift: Any   # (R,) float64: the median key
    carry: Any   # (R, nb + 1, 2 C) float64 exclusive prefix sums of the tile sums; the last row the totals
    w: Any       # (R, m, c) the weights in their own order, dtype and strides (re-read by pass 2)
    take: Any    # (R, m) int8 the keys that take part, or None
    C: int       # columns of the sums (the weight columns, plus the indicator column)
    ones: bool   # whether column c is the indicator
    scale: Any = None   # (R, m) float64 per-key factors of the weights' rows, in the keys' own order, or None

    @property
    def totals(self):
        """(R, 2C) the sums over every key, float64."""
        return self.carry[:, -1, :]


class Queries(NamedTuple):
    """Queries sorted once per call and shared by every profile sum of the call."""
    sorted: Any  # (R, n) float64 sorted queries
    perm: Any    # (R, n) int32: the original position of each sorted query


def _wide(xp, w, scale) -> bool:
    """Whether a table's tile sums run in float64: for float64 weights, and for rows scaled per key
    (``scale``: the backward's cotangent rows times the quotient rule's ``1 / D``, huge where a
    normaliser sum ``D`` is tiny, whose terms then cancel against the normaliser's to a small
    gradient: in float32 the rounding of the huge terms is the gradient, 1e-1 against 1e-7 seen on
    the "relu" normaliser; tests/engines/test_triton.py, ``test_low_precision_gradients``)."""
    return w.dtype == xp.float64 or scale is not None


def _blocks(xp, w, scale=None) -> tuple[int, int, int]:
    """Keys per tile, queries per block and columns per block for the weights ``w`` (scaled by
    ``scale``): at most 16 each in float64 (:func:`_wide`), whose tile products are broadcast sums
    in registers rather than ``tl.dot`` (:func:`._device._below_sum`)."""
    if _wide(xp, w, scale):
        return min(BLOCK_M, 16), min(BLOCK_N, 16), min(BLOCK_C, 16)
    return BLOCK_M, BLOCK_N, BLOCK_C


def _acc_dtype(xp, w, scale=None):
    return xp.float64 if _wide(xp, w, scale) else xp.float32


def _sort(xp, a, narrow: bool = False):
    """Sorted values (float32 for float32 / half inputs, float64 for float64) and an int32 permutation.

    ``narrow``: ``a`` is float64 holding float32 numbers (scores lifted to the work dtype from
    float32 or narrower): sorted as float32, which is exact and moves half the bytes. A number
    that is not one (the NaN policy's fill of masked keys, a mean) is rounded first; the kernels
    then read that rounded key, so its place and its value agree (and a masked key weighs
    nothing)."""
    return _sorted(xp, a, xp.float64 if a.dtype == xp.float64 and not narrow else xp.float32)


def _sorted(xp, a, work, into=None):
    """``a`` (R, n) sorted as ``work`` numbers, the values in ``into`` (default ``work``): one
    :func:`._order.sort_rows` launch for float32 rows of at most :data:`SMALL_SORT`, else
    ``torch.sort`` and casts."""
    rows, n = a.shape
    into = into or work
    if work == xp.float32 and 0 < n <= SMALL_SORT and rows:
        values = xp.empty((rows, n), dtype=into, device=a.device)
        perm = xp.empty((rows, n), dtype=xp.int32, device=a.device)
        block = max(SORT_MIN_BLOCK, 1 << (n - 1).bit_length())
        loaded().sort_rows[(rows,)](a.contiguous(), values, perm, n, BLOCK=block, num_warps=8 if block > 1024 else 4)
        return values, perm
    values, perm = xp.astype(a, work).sort(dim=-1, stable=True)
    return xp.astype(values, into).contiguous(), xp.astype(perm, xp.int32).contiguous()


def sort_queries(xp, x, narrow: bool = False) -> Queries:
    """The queries ``x`` (R, n), sorted once (float64 values: the knots' arithmetic runs in float64);
    ``narrow`` as :func:`_sort` says."""
    work = xp.float64 if x.dtype == xp.float64 and not narrow else xp.float32
    return Queries(*_sorted(xp, x, work, xp.float64))


def as_int8(xp, a):
    """A bool or int8 array as int8: a bool array's bytes reinterpreted (a view, no copy)."""
    return a.view(xp.int8) if a.dtype == xp.bool else xp.astype(a, xp.int8, copy=False)


def per_key_rows(xp, *arrays):
    """(R, m) arrays of one number per key or query (``take``, ``scale``, ``factor``) as the
    kernels read them: unit steps along a row and, between those given together, the same row
    stride, which the kernels take (:func:`_rows_apart`); a causal level's blocks are strided views
    of the positions, passed as they are. Copies only an array that does not fit."""
    given = [a for a in arrays if a is not None]
    fits = all(a.stride(-1) == 1 for a in given) and len({a.stride(0) for a in given}) <= 1
    return tuple(a if a is None or fits else a.contiguous() for a in arrays)


def _rows_apart(default: int, *arrays) -> int:
    """The row stride of the (R, m) arrays given (made equal by :func:`per_key_rows`), else ``default``."""
    for a in arrays:
        if a is not None:
            return a.stride(0)
    return default


def build_table(xp, y, w, *, take=None, ones=False, scale=None, presorted: Queries | None = None,
                carry=None, narrow: bool = False) -> Table:
    """Sort the keys ``y`` (R, m) and sum ``[w, (y - shift) w]`` (R, m, c) per tile of sorted keys
    (pass 1); the tile sums' float64 prefix is the carry.

    ``take`` (R, m) bool or int8 zeroes the weights of the keys that take no part (``scale`` may be
    a strided view: :func:`per_key_rows`); ``ones`` adds the
    indicator column (``take``, or ones) without a concatenated copy of ``w``; ``scale`` (R, m)
    float64 multiplies each key's weight row (not the indicator), without a scaled copy of ``w``;
    ``presorted``: ``y`` sorted already (:func:`sort_queries` of it), so that an array is sorted once
    per call; ``carry``: the carry of this same table, kept from an earlier call (attention's forward
    for its backward), so that pass 1 is not run again; ``narrow`` as :func:`_sort` says.
    """
    rows, m = y.shape
    c = w.shape[-1]
    keys, perm = _sort(xp, y, narrow) if presorted is None else presorted
    shift = xp.astype(keys[:, m // 2], xp.float64).contiguous()
    C = c + (1 if ones else 0)
    # the kernels read take's rows m apart (a row stride for it too spills registers in pass 2 on
    # sm_90: tests/test_triton_compile.py) and scale's rows at any stride
    take_arg = None if take is None else as_int8(xp, take).contiguous()
    scale_arg = None if scale is None else per_key_rows(xp, xp.astype(scale, xp.float64, copy=False))[0]
    if carry is None:
        block_m, _, block_c = _blocks(xp, w, scale)
        nb = triton_cdiv(m, block_m)
        dev = y.device
        # pass 1 writes each tile's sums one row down and zeroes the first row; one cumulative sum
        # in place then makes them the exclusive prefix (no concatenated copy of the carry)
        carry = xp.empty((rows, nb + 1, 2 * C), dtype=xp.float64, device=dev)
        grid = (rows * nb, triton_cdiv(C, block_c))
        k = loaded()
        k.tile_sums[grid](_key_args(k, keys, perm, shift, take_arg, 1), _weight_args(k, xp, w, scale_arg, ones=ones),
                          CarryArgs(carry, nb, C), _block_args(k, xp, w, scale))
        carry.cumsum_(dim=1)
    return Table(keys, perm, shift, carry, w, take_arg, C, ones, scale_arg)


def triton_cdiv(a: int, b: int) -> int:
    return max(1, -(-a // b))


def _key_args(k, keys, perm, shift, take, log_m: int) -> KeyArgs:
    """The sorted keys as the kernels read them (``take`` None: every key takes part)."""
    return KeyArgs(keys, perm, shift, perm if take is None else take, keys.shape[-1], log_m,
                   k.tl.constexpr(take is not None))


def _weight_args(k, xp, w, scale, *, ones: bool) -> WeightArgs:
    """The weight rows as the kernels read them (``scale`` None: unscaled)."""
    acc = tl_dtype(k, _acc_dtype(xp, w, scale), xp)
    return WeightArgs(w, w if scale is None else scale, w.shape[-1], w.stride(0), w.stride(1), w.stride(2),
                      _rows_apart(w.shape[1], scale), k.tl.constexpr(ones), k.tl.constexpr(scale is not None),
                      k.tl.constexpr(acc))


def _block_args(k, xp, w, scale=None) -> Blocks:
    return Blocks(*(k.tl.constexpr(b) for b in _blocks(xp, w, scale)))


def _out_args(k, out, row_stride: int, offset: int, query_stride: int, *, add: bool = False) -> OutArgs:
    return OutArgs(out, row_stride, offset, query_stride, k.tl.constexpr(add))


def _pass2(k, xp, table: Table, queries: Queries, *, rows_apart: int):
    """The records every pass-2 launch over ``table`` at ``queries`` reads, and its block sizes."""
    keys = _key_args(k, table.keys, table.perm, table.shift, table.take, log_steps(table.keys.shape[-1]))
    weights = _weight_args(k, xp, table.w, table.scale, ones=table.ones)
    carry = CarryArgs(table.carry, table.carry.shape[1] - 1, table.C)
    rows, n = queries.sorted.shape
    return (QueryArgs(queries.sorted, queries.perm, n, rows_apart), keys, weights, carry,
            _block_args(k, xp, table.w, table.scale))


def _grid(rows: int, n: int, width: int, blocks: Blocks) -> tuple:
    """Pass 2's grid: every row's query blocks along the first axis (:func:`._device._row_block`)."""
    return rows * triton_cdiv(n, blocks.N.value), triton_cdiv(width, blocks.C.value)


class SumTerm(NamedTuple):
    """One profile sum over a table of keys: what :func:`profile_sum` and :func:`profile_sum_into`
    evaluate. ``queries``: :func:`sort_queries` of the (R, n) queries; ``cols`` the table columns
    summed; ``strict`` the tie rule of the steps (``H(0) = 0``); ``factor`` (R, n) float64 or None
    multiplies each query's sums, in the queries' original order; ``sub`` (R, len(cols)) float64 or
    None is subtracted first."""
    table: Any
    queries: Any
    profile: Profile
    cols: range
    strict: bool
    factor: Any = None
    sub: Any = None


def _launch_sums(xp, term: SumTerm, batch, out: OutArgs, *, norm_into=None):
    """:func:`._kernels.sums_eval` of ``term`` into ``out`` (an :class:`._args.OutArgs`); ``norm_into =
    (profile, raw)`` with an added ``out``: that profile over the indicator added to ``raw`` too."""
    k = loaded()
    rows, n = term.queries.sorted.shape
    (factor,) = per_key_rows(xp, term.factor)
    qa, keys, weights, carry, blocks = _pass2(k, xp, term.table, term.queries, rows_apart=_rows_apart(n, factor))
    dev = term.queries.sorted.device
    value = profile_record(k, xp, term.profile, batch, rows, dev, strict=term.strict)
    if norm_into is None:
        norm, raw = no_profile(k, value), None
    else:
        norm, raw = profile_record(k, xp, norm_into[0], batch, rows, dev, strict=term.strict), norm_into[1]
    cols = term.cols
    k.sums_eval[_grid(rows, n, len(cols), blocks)](qa, keys, weights, carry, value, factor, term.sub, out,
                                                   Columns(cols.start, len(cols)), blocks, norm, raw,
                                                   num_warps=MERGE_WARPS)


def _launch_dots(xp, term, batch, out: OutArgs):
    """:func:`._kernels.dots_eval` of one :class:`DotTerm` into ``out`` (its partial dots)."""
    k = loaded()
    rows, n = term.queries.sorted.shape
    factor, take = per_key_rows(xp, term.factor, None if term.take is None else as_int8(xp, term.take))
    qa, keys, weights, carry, blocks = _pass2(k, xp, term.table, term.queries, rows_apart=_rows_apart(n, factor, take))
    value = profile_record(k, xp, term.profile, batch, rows, term.queries.sorted.device, strict=term.strict)
    r = term.rows
    dot = DotArgs(r, r.stride(0), r.stride(1), r.stride(2), term.col0)
    k.dots_eval[_grid(rows, n, len(term.cols), blocks)](qa, keys, weights, carry, value, factor, dot, take, out,
                                                        Columns(term.cols.start, len(term.cols)), blocks,
                                                        num_warps=MERGE_WARPS)


def profile_sum(xp, term: SumTerm, batch, *, dtype=None):
    """``((sum over the profile of table columns cols) - sub) * factor`` of a :class:`SumTerm`,
    (R, n, len(cols)) in ``dtype`` (float64 by default), in the queries' original order (pass 2,
    one launch); ``batch`` the batch shape the profile's array parameters broadcast to.
    """
    rows, n = term.queries.sorted.shape
    width = len(term.cols)
    out = xp.empty((rows, n, width), dtype=dtype or xp.float64, device=term.queries.sorted.device)
    if width == 0 or rows == 0 or n == 0:
        return out
    _launch_sums(xp, term, batch, _out_args(loaded(), out, n * width, 0, width))
    return out


def profile_sum_into(xp, term: SumTerm, batch, into, row_stride: int, offset: int, query_stride: int | None = None,
                     *, norm_into=None):
    """:func:`profile_sum` added in place to ``into`` (contiguous; added in float64 and rounded once
    to its dtype): query ``i`` of row ``r`` to ``into.flat[offset + r row_stride + i query_stride +
    column]`` (``query_stride`` default ``len(cols)``; one launch, nothing allocated).
    ``norm_into = (normaliser profile, raw)``: that profile over the table's indicator added in
    the same launch to ``raw`` (contiguous, one number per position of ``into``)."""
    rows, n = term.queries.sorted.shape
    width = len(term.cols)
    if width and rows and n:
        out = _out_args(loaded(), into, row_stride, offset, width if query_stride is None else query_stride,
                        add=True)
        _launch_sums(xp, term, batch, out, norm_into=norm_into)
    return into


@functools.lru_cache(maxsize=16)
def _one(xp, dev):
    return xp.ones((1, 1, 1), dtype=xp.float32, device=dev)


def unit_rows(xp, shape, dev):
    """(R, n, 1) ones of stride 0 (one number per device), which a :class:`DotTerm` dots a column with."""
    return xp.broadcast_to(_one(xp, dev), tuple(shape) + (1,))


class DotTerm(NamedTuple):
    """One term of :func:`profile_dots`: ``sum over c of (profile sum of table columns cols)[..., c] *
    rows[..., col0 + c]``, (R, n), the backward's score gradients without an (n, len(cols)) array of
    sums. ``rows`` (R, n, ...) in the queries' original order, any strides and dtype (read by the
    kernel, not copied); ``take`` (R, n) bool or int8, or None: ``rows`` is read only where it is
    nonzero, as 0 elsewhere; ``factor`` (R, n) float64 or None multiplies each query's sums first."""
    table: Any
    queries: Any
    profile: Profile
    cols: range
    rows: Any
    col0: int
    strict: bool
    take: Any = None
    factor: Any = None


def profile_dots(xp, terms, batch):
    """The sum of several :class:`DotTerm` terms over the same (R, n) queries, (R, n) float64:
    one launch each, their column blocks' partial dots written side by side into one (R, n, blocks)
    array and summed once, in a fixed order (no array per term, no additions of them)."""
    rows, n = terms[0].queries.sorted.shape
    dev = terms[0].queries.sorted.device
    widths = [triton_cdiv(len(t.cols), _blocks(xp, t.table.w, t.table.scale)[2]) if len(t.cols) else 0
              for t in terms]
    total = sum(widths)
    if total == 0 or rows == 0 or n == 0:
        return xp.zeros((rows, n), dtype=xp.float64, device=dev)
    partial = xp.empty((rows, n, total), dtype=xp.float64, device=dev)
    at = 0
    for t, width in zip(terms, widths):
        if width:
            _launch_dots(xp, t, batch, _out_args(loaded(), partial, n * total, at, total))
        at += width
    return partial[..., 0] if total == 1 else xp.sum(partial, axis=-1)


def attend(xp, table: Table, queries: Queries, form: Form, batch, *, factor, dtype):
    """Attention's forward in one pass-2 launch: ``(out, relu_count, raw)``.

    ``table``: the keys with the values and the indicator column (``build_table(..., ones=True)``);
    ``form``: the value profile, the normaliser and the centring (:class:`~slicedkern.engines._vjp.Form`);
    ``out`` (R, n, dv) in ``dtype``: the profile sum of the values, centred when ``center``,
    divided by the normaliser's divisor and multiplied by ``factor`` (the NaN policy's, (R, n): 1 or
    NaN);
    ``relu_count`` (R, n) the profile summed over the valid keys, ``raw`` (R, n) the normaliser's
    profile sum (None unless ``normalizer.summed``), float64: the backward's residuals.
    """
    profile, normalizer, center = form
    rows, n = queries.sorted.shape
    dev = queries.sorted.device
    dv = table.w.shape[-1]
    width = max(dv, 1)          # one column block at least: it writes the residuals, even when dv == 0
    out = xp.empty((rows, n, width), dtype=dtype, device=dev)
    count = xp.empty((rows, n), dtype=xp.float64, device=dev)
    raw = xp.empty((rows, n), dtype=xp.float64, device=dev) if normalizer.summed else None
    if rows and n:
        k = loaded()
        (factor,) = per_key_rows(xp, factor)
        qa, keys, weights, carry, blocks = _pass2(k, xp, table, queries, rows_apart=_rows_apart(n, factor))
        value = profile_record(k, xp, profile, batch, rows, dev, strict=True)
        norm, divisor = divisor_args(k, xp, value, normalizer, batch, rows, dev, center=center, count=count, raw=raw)
        k.attend_eval[_grid(rows, n, width, blocks)](qa, keys, weights, carry, value, norm, divisor, factor,
                                                     _out_args(k, out, n * width, 0, width), Columns(0, width),
                                                     blocks, num_warps=MERGE_WARPS)
    return out[..., :dv], count, raw


#: Rows of at most this many queries and keys take attention's forward in one launch
#: (:func:`attend_small`); longer ones the sorts and the two passes. A guess until a GPU measures
#: the crossing (``scripts/gpu_check.sh`` times both sides of it).
SMALL_FUSED = 1024
#: query blocks each program of :func:`attend_small` evaluates
SMALL_BLOCKS = 2


def attend_small(xp, rows_: Inputs, form: Form, batch, *, factor, dtype):
    """Attention's forward on short rows in one launch (:func:`._order.small_attend`):
    ``(out, relu_count, raw, table, queries)``, the first three as :func:`attend` returns them and
    the last two what :func:`build_table` (``ones=True``, ``narrow=True``) and :func:`sort_queries`
    (``narrow=True``) would give, the backward's residuals. ``rows_``: the queries ``x`` (R, n) and
    keys ``y`` (R, m), float32 numbers (in any float dtype), each at most :data:`SMALL_FUSED`; the
    values ``w`` (R, m, c) narrower than float64; ``take`` (R, m) bool or None, the keys that take
    part. ``factor`` (R, n) float64, the NaN policy's verdicts on the scores: the kernel multiplies
    in the values' own, read off its carry's totals."""
    (x, y, w, take), (profile, normalizer, center) = rows_, form
    rows, m = y.shape
    n, c = x.shape[-1], w.shape[-1]
    dev = y.device
    block_m, block_n, block_c = _blocks(xp, w)
    nb, C, width = triton_cdiv(m, block_m), c + 1, max(c, 1)
    keys = xp.empty((rows, m), dtype=xp.float32, device=dev)
    perm = xp.empty((rows, m), dtype=xp.int32, device=dev)
    xs = xp.empty((rows, n), dtype=xp.float64, device=dev)
    xperm = xp.empty((rows, n), dtype=xp.int32, device=dev)
    shift = xp.empty((rows,), dtype=xp.float64, device=dev)
    carry = xp.empty((rows, nb + 1, 2 * C), dtype=xp.float64, device=dev)
    out = xp.empty((rows, n, width), dtype=dtype, device=dev)
    count = xp.empty((rows, n), dtype=xp.float64, device=dev)
    raw = xp.empty((rows, n), dtype=xp.float64, device=dev) if normalizer.summed else None
    take_arg = xp.astype(take, xp.int8).contiguous() if take is not None else None
    if rows and n and m:
        k = loaded()
        value = profile_record(k, xp, profile, batch, rows, dev, strict=True)
        norm, divisor = divisor_args(k, xp, value, normalizer, batch, rows, dev, center=center, count=count, raw=raw)
        query_blocks = triton_cdiv(n, block_n)
        grid = (rows, triton_cdiv(query_blocks, SMALL_BLOCKS), triton_cdiv(width, block_c))
        k.small_attend[grid](
            y.contiguous(), x.contiguous(), QueryArgs(xs, xperm, n, n), _key_args(k, keys, perm, shift, take_arg,
                                                                                  log_steps(m)),
            _weight_args(k, xp, w, None, ones=True), CarryArgs(carry, nb, C), value, norm, divisor, factor,
            _out_args(k, out, n * width, 0, width), Columns(0, width), (SMALL_BLOCKS, query_blocks),
            _block_args(k, xp, w), SORT=max(SORT_MIN_BLOCK, 1 << (max(m, n) - 1).bit_length()),
            num_warps=MERGE_WARPS)
    table = Table(keys, perm, shift, carry, w, take_arg, C, True)
    return out[..., :c], count, raw, table, Queries(xs, xperm)
