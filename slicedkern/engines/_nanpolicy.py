"""The NaN policy, applied once for every engine (docs/mathematics.rst, "Non-finite input").

A non-finite query makes its output row NaN; a non-finite key or value of a key that takes part makes
its whole batch row NaN. Offending scores are replaced by zeros before any arithmetic (so no backend
warns or traps on them), and the policy reaches the output as the per-query divisor of the final
combination (NaN where bad), not as a pass over the output.
"""

from __future__ import annotations

from .._lib.namespace import array_device, clamp_min, scalar
from ..backends import finite, finite_rows

__all__ = ["screen", "sanitize_keys"]


def _fill_masked(xp, y, take, key_mask):
    """Zero ``y`` where it takes no part; masked keys sit at the mean of the valid ones instead."""
    zero = scalar(xp, 0.0, dtype=y.dtype, device=array_device(y))
    y = xp.where(take, y, zero)
    if key_mask is not None:
        # Masked keys sit at the mean of the valid ones: they stay out of the sums (zero weight)
        # and out of the way of the median shift, which keeps s P0 - P1 from cancelling.
        count = xp.sum(xp.astype(take, y.dtype), axis=-1, keepdims=True)
        fill = xp.sum(y, axis=-1, keepdims=True) / clamp_min(xp, count, 1.0)
        y = xp.where(take, y, fill)
    return y


def sanitize_keys(xp, x, y, w, key_mask):
    """Zero the entries the NaN policy excludes; return ``(x, y, w, q_ok, row_ok)``.

    The backward's form of :func:`screen` (every weight checked now): ``y`` is made finite as there,
    ``w`` is zeroed on masked keys and bad rows (keeping its dtype); ``q_ok`` (..., n) marks finite
    queries, ``row_ok`` (...) batch rows whose participating keys and weights are all finite.
    """
    sc = screen(xp, x, y, w, key_mask, defer=False)
    w_zero = scalar(xp, 0.0, dtype=w.dtype, device=array_device(w))
    return sc.x, sc.y, xp.where(sc.take[..., None], w, w_zero), sc.q_ok, sc.row_ok


class _Screened:
    """The scores made finite, and how the NaN policy reaches the weights (see :func:`screen`)."""

    def __init__(self, x, y, q_ok, row_ok, take, table_take, deferred):
        self.x, self.y, self.q_ok, self.row_ok = x, y, q_ok, row_ok
        self.take, self.table_take, self.deferred = take, table_take, deferred

    def settle(self, xp, totals, c):
        """With the weights' check deferred: fold the finiteness of the row totals into ``row_ok``."""
        if self.deferred:
            self.row_ok = self.row_ok & finite(xp, xp.sum(totals[..., 0, :c], axis=-1))
            self.take = self.take & self.row_ok[..., None]

    def divisor(self, xp, den):
        """``den`` broadcast to (..., n), NaN on bad queries and bad rows: the one place the policy
        touches the output, as the factor the combination divides by."""
        good = self.q_ok & self.row_ok[..., None]
        nan = scalar(xp, float("nan"), dtype=self.x.dtype, device=array_device(self.x))
        if isinstance(den, (int, float)):
            den = scalar(xp, float(den), dtype=self.x.dtype, device=array_device(self.x))
        return xp.where(good, den, nan)


def screen(xp, x, y, w, key_mask, *, defer) -> _Screened:
    """The NaN policy's screening of queries ``x``, keys ``y`` and weights ``w`` (..., m, c).

    Scores are cheap to screen: non-finite queries and keys (taking part) are found and replaced
    by zeros here. The weights are ``m c`` values: where the backend lets non-finite values pass
    quietly and the weights are narrower than the work dtype (so that no sum of finite ones can
    overflow), their check is *deferred* to the totals of the prefix table, and only masked keys
    are kept out of it; otherwise every weight is checked now and bad rows are zeroed in the table.
    ``defer`` says which (see :func:`_can_defer`).
    """
    q_ok = finite(xp, x)
    k_ok = finite(xp, y)
    if key_mask is not None:
        k_ok = k_ok | ~key_mask
    row_ok = xp.all(k_ok, axis=-1)
    if not defer:
        row_ok = row_ok & finite_rows(xp, w, key_mask)
    take = xp.broadcast_to(row_ok[..., None], y.shape)
    if key_mask is not None:
        take = take & key_mask
    y = _fill_masked(xp, y, take, key_mask)
    zero = scalar(xp, 0.0, dtype=x.dtype, device=array_device(x))
    x = xp.where(q_ok, x, zero)
    return _Screened(x, y, q_ok, row_ok, take, key_mask if defer else take, defer)


