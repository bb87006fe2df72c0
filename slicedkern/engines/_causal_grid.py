"""Causal attention's position grid and NaN rule, shared by every engine's causal mode.

docs/mathematics.rst, "Causal attention": query ``i`` of ``Lq`` sits at position ``p_i = i + Lk - Lq``
(bottom-right alignment) and sees the keys ``j <= p_i``. Positions run over ``0 .. n - 1`` with ``n``
the power of two at or above ``Lk``, so that they split into the dyadic blocks of the scan's levels;
a position holds at most one query, the keys past ``Lk`` are padding that takes no part, and the
``Lq - Lk`` first queries (when ``Lq > Lk``) sit before position 0 and see nothing.

The NaN rule of causal attention (docs/mathematics.rst, "Non-finite input"): a non-finite query makes
its own row NaN; a non-finite key or value of a key that takes part makes NaN exactly the queries that
see it, the positions from its own onwards.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .._lib.causal import key_offset
from .._lib.namespace import array_device, ceil_log2, clamp_min, scalar
from ..backends import finite, finite_keys

__all__ = ["CausalGrid", "CausalScreen", "screen_causal", "running_sum"]


def _pad(xp, a, before: int, after: int, fill, axis: int):
    """``a`` with ``before`` / ``after`` entries equal to ``fill`` (a float, a bool, or an array of
    ``a``'s shape with ``axis`` of length one) around ``axis`` (a negative axis)."""
    if before == 0 and after == 0:
        return a
    parts = []
    for count in (before, after):
        shape = list(a.shape)
        shape[axis] = count
        if count == 0:
            parts.append(None)
        elif isinstance(fill, (bool, int, float)):
            parts.append(xp.full(tuple(shape), fill, dtype=a.dtype, device=array_device(a)))
        else:
            parts.append(xp.broadcast_to(xp.astype(fill, a.dtype), tuple(shape)))
    pieces = [p for p in (parts[0], a, parts[1]) if p is not None]
    return xp.concat(pieces, axis=axis)


def _take_range(a, start: int, stop: int, axis: int):
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, stop)
    return a[tuple(index)]


class CausalGrid:
    """Where the queries and keys of a causal call sit on the positions ``0 .. n - 1``.

    Parameters
    ----------
    lq, lk : int
        Numbers of queries and keys.

    Attributes
    ----------
    n : int
        The power of two at or above ``lk`` (1 when ``lk <= 1``).
    before : int
        ``max(lk - lq, 0)``: the first positions, which hold keys but no query.
    blind : int
        ``max(lq - lk, 0)``: the first queries, which sit before every key and see none.
    """

    def __init__(self, lq: int, lk: int):
        self.lq, self.lk = lq, lk
        self.n = 1 << ceil_log2(max(lk, 1))
        self.before = max(key_offset(lq, lk), 0)
        self.blind = max(-key_offset(lq, lk), 0)

    def keys(self, xp, a, fill, axis: int = -1):
        """Keys (..., lk, ...) laid on the positions: (..., n, ...), padded at the end with ``fill``."""
        return _pad(xp, a, 0, self.n - self.lk, fill, axis)

    def queries(self, xp, a, fill, axis: int = -1):
        """Queries (..., lq, ...) laid on the positions: (..., n, ...); empty positions hold ``fill``."""
        seen = _take_range(a, self.blind, self.lq, axis)
        return _pad(xp, seen, self.before, self.n - self.lk, fill, axis)

    def at_queries(self, xp, a, axis: int = -1):
        """A per-position array (..., >= lk, ...) read at every query's position: (..., lq, ...);
        the blind queries get zeros (``False``)."""
        seen = _take_range(a, self.before, self.lk, axis)
        return _pad(xp, seen, self.blind, 0, False if seen.dtype == xp.bool else 0.0, axis)

    def queries_to_keys(self, xp, a, axis: int = -2):
        """Per-query rows (..., lq, ...) moved to their positions among the keys: (..., lk, ...); the
        positions without a query get zeros and the blind queries are dropped."""
        seen = _take_range(a, self.blind, self.lq, axis)
        return _pad(xp, seen, self.before, 0, 0.0, axis)

    def sees_any(self, xp, flags):
        """(..., lq) bool: whether each query sees a key whose ``flags`` (..., lk) bool is True."""
        # one position past a flagged key is enough: the running count is positive from there
        return self.at_queries(xp, running_sum(xp, xp.astype(flags, xp.int32), axis=-1) > 0)

    def seen_sums(self, xp, a, dtype):
        """Per-key rows ``a`` (..., lk, c) summed over the keys each query sees: (..., lq, c) in
        ``dtype`` (running sums read at the queries' positions)."""
        return self.at_queries(xp, running_sum(xp, a, axis=-2, dtype=dtype), axis=-2)

    def seen_sums_adjoint(self, xp, rows):
        """The adjoint of :meth:`seen_sums` on per-query ``rows`` (..., lq, c): a key receives the rows
        of every query at or after its position (a reverse running sum), (..., lk, c)."""
        return running_sum(xp, self.queries_to_keys(xp, rows), axis=-2, reverse=True)


def running_sum(xp, a, axis: int = -1, *, reverse: bool = False, dtype=None):
    """Inclusive cumulative sum of ``a`` along ``axis`` (from the end when ``reverse``), in
    ``dtype`` (None: ``a``'s), to which ``a`` is cast as it is summed: no cast copy of it first."""
    if not reverse:
        return xp.cumulative_sum(a, axis=axis, dtype=dtype)
    return xp.flip(xp.cumulative_sum(xp.flip(a, axis=axis), axis=axis, dtype=dtype), axis=axis)


class CausalScreen(NamedTuple):
    """Inputs of a causal call made finite, and what the NaN rule says about them."""

    q: Any            # (..., lq) non-finite queries replaced by 0
    k: Any            # (..., lk) keys that take no part replaced by the mean of those that do
    v: Any            # (..., lk, dv) zero on the keys that take no part (or as given: zero_values)
    take: Any         # (..., lk) bool: the key takes part (unmasked and finite)
    good: Any         # (..., lq) bool: the query is finite and sees no non-finite key
    row_bad: Any      # (...) bool: some query of the batch row sees a non-finite key


def screen_causal(xp, grid: CausalGrid, q, k, v, key_mask, *, zero_values: bool = True) -> CausalScreen:
    """Apply the causal NaN rule: find the bad queries and keys and make every input finite.

    ``grid`` says which queries see which keys (:meth:`CausalGrid.sees_any`; a band's grid too).

    A key is *bad* when it takes part (``key_mask``) and its score or any entry of its value is not
    finite; the queries whose positions are at or past a bad key's position see it and are NaN.
    Everything is replaced by finite numbers before any arithmetic, so that no backend warns; with
    ``zero_values`` False, the values are returned as given, for kernels that read a value only
    where ``take`` is True (no copy of them).
    """
    q_ok = finite(xp, q)
    bad = ~(finite(xp, k) & finite_keys(xp, v))
    take = ~bad
    if key_mask is not None:
        bad = bad & key_mask
        take = take & key_mask
    poisoned = grid.sees_any(xp, bad)
    good = q_ok & ~poisoned
    zero = scalar(xp, 0.0, dtype=k.dtype, device=array_device(k))
    takef = xp.astype(take, k.dtype)
    # keys that take no part sit at the mean of those that do, out of the way of each block's median
    # shift (docs/mathematics.rst, "Numerics"), as in the non-causal screening
    fill = xp.sum(xp.where(take, k, zero), axis=-1, keepdims=True) / clamp_min(
        xp, xp.sum(takef, axis=-1, keepdims=True), 1.0)
    k = xp.where(take, k, fill)
    if zero_values:
        v = xp.where(take[..., None], v, scalar(xp, 0.0, dtype=v.dtype, device=array_device(v)))
    q = xp.where(q_ok, q, zero)
    return CausalScreen(q, k, v, take, good, xp.any(poisoned, axis=-1))
