"""The argument records of the triton engine's sort-scan kernels (:mod:`._kernels`, :mod:`._order`):
what a kernel reads, grouped by what it describes, so that a kernel takes a dozen records rather than
sixty numbers and pointers (docs/architecture.rst, "Engines").

Triton passes a named tuple to a kernel field by field and a device function reads its fields by
name; a field holding a ``tl.constexpr`` is a compile-time constant (a mode of the record: its
fields' upper-case names). This module imports nothing of Triton: the host builds the records
with the ``constexpr`` of the kernel module it has loaded (``k`` below), and ``import slicedkern``
never imports Triton; the profile and divisor records are built here, the others where their arrays
are made (:mod:`._sums`, :mod:`._causal`).

Layout (the batch flattened to ``R`` rows) as :mod:`._kernels`' docstring describes it.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

from ...kernels import Profile, is_fixed

__all__ = ["QueryArgs", "KeyArgs", "WeightArgs", "CarryArgs", "ProfileArgs", "DivisorArgs", "OutArgs", "DotArgs",
           "Columns", "Blocks", "Strided", "Positions", "Runs", "strided", "given", "profile_record", "no_profile",
           "divisor_args", "float64_scalar", "log_steps", "tl_dtype"]


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
    eps: Any          # (1,) float64 the normaliser's floor (:func:`float64_scalar`)
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


class Strided(NamedTuple):
    """An (R, n, c) array read in its own dtype through its strides."""
    ptr: Any
    row: int
    item: int
    col: int


class Positions(NamedTuple):
    """Values on the positions of causal attention and the sums of their blocks: the values ``w``
    (R, n, c) at ``ptr`` with their strides (the fields of :class:`Strided`, which
    ``_dense._strided_at`` reads), ``take`` (R, n) int8, ``carry`` (R, carry_rows, c + 1) float64 the
    exclusive prefix of the sums of ``[w take | take]`` over blocks of positions
    (:func:`._dense.position_sums`).

    Flat rather than holding a :class:`Strided`: Triton 3.6 compiles a nested record's fields that
    are constants (a stride of 1) to None when a loop reads them (docs/benchmarks.rst, "On a GPU")."""
    ptr: Any
    row: int
    item: int
    col: int
    take: Any
    carry: Any
    carry_rows: int
    n: int
    c: int


class Runs(NamedTuple):
    """A ``DecodeCache``'s sorted runs on the device (:class:`._decode.DeviceRuns`), per batch row
    ``cap`` positions."""
    bounds: Any       # (2, n_runs) int64 the runs' [start, end)
    count: int        # n_runs
    keys: Any         # (B, cap) the runs' sorted keys
    prefix: Any       # (B, cap, 2 cw) the runs' inclusive prefix rows of [w, take, (y - shift) w, (y - shift) take]
    shifts: Any       # (B, cap) the run's median key at its first position
    totals: Any       # (B, cw) the values' sum and the count of the keys taken
    bad: Any          # (B,) int8 a row that took a non-finite key
    cap: int
    log_cap: int


def strided(a) -> Strided:
    """A torch tensor (R, n, c) as :class:`Strided`."""
    return Strided(a, a.stride(0), a.stride(1), a.stride(2))


def given(name: str):
    """A ``triton.heuristics`` rule: whether the kernel's optional array argument ``name`` was passed
    (not None), the flag that says so derived rather than passed."""
    return lambda args: args[name] is not None


def tl_dtype(k, dtype, xp):
    """The Triton dtype a kernel accumulates in for the torch ``dtype`` (float64, else float32)."""
    return k.tl.float64 if dtype == xp.float64 else k.tl.float32


def _per_row(xp, value, batch, rows, dev):
    """A profile parameter (float or batch-broadcastable array) as a (R,) float64 tensor."""
    if is_fixed(value):
        return xp.full((rows,), float(value), dtype=xp.float64, device=dev)
    value = xp.broadcast_to(xp.astype(value, xp.float64), batch)
    return xp.reshape(value, (rows,))


def _profile_arrays(xp, profile: Profile, batch, rows: int, dev):
    """A profile as the kernels read it: ``knots``, ``coeffs`` (R, K) and ``lin`` (R, 2) = slope,
    intercept, float64, the knots of zero fixed coefficient left out; and ``K``.

    A profile of fixed numbers (ReLU, |r|, a hat of fixed width) is made once per device and row
    count and reused: the kernels only read it, and on a GPU its dozen small operators would cost
    more host time than the kernels (docs/benchmarks.rst, "On a GPU").
    """
    pairs = tuple((t, cf) for t, cf in zip(profile.knots, profile.coeffs) if not (is_fixed(cf) and cf == 0))
    if profile.is_fixed:
        return _fixed_profile_arrays(xp, pairs, float(profile.slope), float(profile.intercept), rows, dev)
    return _build_profile_arrays(xp, pairs, profile.slope, profile.intercept, batch, rows, dev)


@functools.lru_cache(maxsize=64)
def _fixed_profile_arrays(xp, pairs, slope: float, intercept: float, rows: int, dev):
    return _build_profile_arrays(xp, pairs, slope, intercept, (rows,), rows, dev)


def _build_profile_arrays(xp, pairs, slope, intercept, batch, rows: int, dev):
    if pairs:
        knots = xp.stack([_per_row(xp, t, batch, rows, dev) for t, _ in pairs], axis=-1).contiguous()
        coeffs = xp.stack([_per_row(xp, cf, batch, rows, dev) for _, cf in pairs], axis=-1).contiguous()
    else:
        knots = coeffs = xp.zeros((rows, 1), dtype=xp.float64, device=dev)
    lin = xp.stack([_per_row(xp, slope, batch, rows, dev), _per_row(xp, intercept, batch, rows, dev)],
                   axis=-1).contiguous()
    return knots, coeffs, lin, len(pairs)


@functools.lru_cache(maxsize=64)
def float64_scalar(xp, value: float, dev):
    """``value`` as a (1,) float64 array on ``dev``, made once per value and device, for a kernel to
    load: Triton passes a Python float to a kernel as float32, which would round a float64 input's
    ``eps`` (and flush ``1e-300`` to 0) where the reference floors at the float64 number."""
    return xp.full((1,), float(value), dtype=xp.float64, device=dev)


def log_steps(m: int) -> int:
    """The steps of a rank search among ``m`` sorted keys: ceil(log2(m + 1)), a runtime argument (a
    constant would compile every kernel again for each power of two of the length)."""
    return max(1, math.ceil(math.log2(m + 1)))


def profile_record(k, xp, profile: Profile, batch, rows: int, dev, *, strict: bool) -> ProfileArgs:
    """``profile`` as a :class:`ProfileArgs` for ``rows`` rows (its array parameters broadcast to
    ``batch``); ``strict`` the tie rule at its knots (:func:`._device._rank`)."""
    knots, coeffs, lin, K = _profile_arrays(xp, profile, batch, rows, dev)
    const = k.tl.constexpr
    return ProfileArgs(knots, coeffs, lin, const(K), const(strict), const(bool(profile.derivative)))


def no_profile(k, like: ProfileArgs) -> ProfileArgs:
    """A profile of no knots standing in for an absent one (any three float64 arrays)."""
    const = k.tl.constexpr
    return like._replace(K=const(0), STRICT=const(True), DERIV=const(False))


def divisor_args(k, xp, value: ProfileArgs, normalizer, batch, rows: int, dev, *, center: bool, count, raw):
    """Attention's epilogue as the kernels read it: ``(norm, divisor)``, the normaliser's profile (a
    profile of no knots unless it is summed) and :class:`DivisorArgs`."""
    const = k.tl.constexpr
    if normalizer.summed:
        norm = profile_record(k, xp, normalizer.profile, batch, rows, dev, strict=True)
    else:
        norm = no_profile(k, value)
    return norm, DivisorArgs(count, count if raw is None else raw, float64_scalar(xp, normalizer.eps, dev),
                             const(bool(center)),
                             const(normalizer.code))
