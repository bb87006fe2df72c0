"""The argument records of the triton engine's sort-scan kernels (:mod:`._kernels`, :mod:`._order`):
what a kernel reads, grouped by what it describes, so that a kernel takes a dozen records rather than
sixty numbers and pointers (docs/architecture.rst, "Engines").

Triton passes a named tuple to a kernel field by field and a device function reads its fields by
name; a field holding a ``tl.constexpr`` is a compile-time constant (a mode of the record: its
fields' upper-case names). This module imports nothing of Triton: the host builds the records
(:mod:`._sums`) with the ``constexpr`` of the kernel module it has loaded, and ``import slicedkern``
never imports Triton.

Layout (the batch flattened to ``R`` rows) as :mod:`._kernels`' docstring describes it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["QueryArgs", "KeyArgs", "WeightArgs", "CarryArgs", "ProfileArgs", "DivisorArgs", "OutArgs", "DotArgs",
           "Columns", "Blocks"]


class QueryArgs(NamedTuple):
    """The sorted queries of each row."""
    sorted: Any       # (R, n) float64 sorted queries
    perm: Any         # (R, n) int32 the original position of each sorted query
    n: int
    rows_apart: int   # the row stride of the per-query arrays read beside them (the factor, a dot's take)


class KeyArgs(NamedTuple):
    """The sorted keys of each row, and which of them take part."""
    keys: Any         # (R, m) sorted keys (float32 for float32 / half scores, float64 for float64)
    perm: Any         # (R, m) int32 the original position of each sorted key
    shift: Any        # (R,) float64 the median key
    take: Any         # (R, m) int8 the keys that take part, rows m apart (any pointer unless HAS_TAKE)
    m: int
    log_m: int        # ceil(log2(m + 1)): the steps of a rank search
    HAS_TAKE: Any     # constexpr: whether ``take`` is read


class WeightArgs(NamedTuple):
    """The weight rows the sums read, in their own order, dtype and strides (gathered through the
    keys' permutation)."""
    w: Any            # (R, m, c)
    scale: Any        # (R, m) float64 per-key factors of the rows (any pointer unless SCALE)
    c: int
    row_stride: int
    key_stride: int
    col_stride: int
    scale_rows: int   # the row stride of ``scale`` (a causal level's blocks are strided views)
    ONES: Any         # constexpr: column ``c`` is the indicator of the keys that take part
    SCALE: Any        # constexpr: whether ``scale`` multiplies the rows
    ACC: Any          # constexpr: the dtype the tiles' products accumulate in (float32 or float64)


class CarryArgs(NamedTuple):
    """The float64 exclusive prefix of the tile sums, ``(R, nb + 1, 2 C)``, the last row the totals."""
    carry: Any
    nb: int           # tiles per row
    C: int            # columns of the sums: the weights' and, with ONES, the indicator


class ProfileArgs(NamedTuple):
    """A profile ``intercept + slope r + sum_k coeffs[k] ReLU(r - knots[k])`` per row, or its
    derivative (DERIV)."""
    knots: Any        # (R, K) float64
    coeffs: Any       # (R, K) float64
    lin: Any          # (R, 2) float64: slope, intercept
    K: Any            # constexpr: the number of knots
    STRICT: Any       # constexpr: a key exactly at a knot is below it (``<``) rather than ``<=``
    DERIV: Any        # constexpr: the derivative's sums (``[j < rank] @ rows``)


class DivisorArgs(NamedTuple):
    """Attention's epilogue: the residuals it writes and the divisor's rule."""
    count: Any        # (R, n) float64: the profile over the indicator (``relu_count``), written
    raw: Any          # (R, n) float64: the normaliser's sum, written when NORM is a summed one
    eps: float
    CENTER: Any       # constexpr: centring, ``- relu_count / count * totals``
    NORM: Any         # constexpr: ``Normalizer.code`` (0 none, 1 or 2 a summed normaliser, 3 the count)


class OutArgs(NamedTuple):
    """Where the rows go: query ``i`` of row ``r`` at ``out[offset + r row_stride + i query_stride +
    column]``."""
    out: Any
    row_stride: int
    offset: int
    query_stride: int
    ADD: Any          # constexpr: added (in float64, rounded once) to what ``out`` holds


class DotArgs(NamedTuple):
    """The rows a dot product reads at the queries (the backward's score gradients)."""
    rows: Any         # (R, n, ...) any strides and dtype
    row_stride: int
    query_stride: int
    col_stride: int
    col0: int         # the column of ``rows`` that sum column 0 meets


class Columns(NamedTuple):
    """The columns of the table a launch sums: ``start .. start + width``."""
    start: int
    width: int


class Blocks(NamedTuple):
    """constexpr block sizes: keys per tile, queries per block, columns per block."""
    M: Any
    N: Any
    C: Any
