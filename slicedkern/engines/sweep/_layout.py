"""The shapes and dtypes of the sweep's row groups, without numba: what the compiled kernels
allocate (:func:`._kernels_common.allocate_sorted`, :func:`._kernels_common.allocate_saved`) and,
kept by a forward, what its backward reads back, so that a registered torch operator can declare
its residuals before it runs (slicedkern/adapters/_torch_ops.py). dtypes are NumPy's names.
"""

from __future__ import annotations

import math

__all__ = ["sorted_rows", "saved", "empty_call", "attention_residuals"]


def sorted_rows(bsz: int, n: int, m: int) -> tuple:
    """The ``sorted_rows`` group of ``bsz`` rows of ``n`` queries and ``m`` keys: sorted query scores
    and their order, sorted key scores and theirs, the per-row counts (finite queries, valid keys,
    a flag) and the per-row shift."""
    return (((bsz, n), "float64"), ((bsz, n), "int64"), ((bsz, m), "float64"), ((bsz, m), "int64"),
            ((bsz, 3), "int64"), ((bsz,), "float64"))


def saved(bsz: int, n: int, c: int) -> tuple:
    """The forward's ``saved`` group: per-query scale and ReLU sum, whether the divisor was unclamped,
    and the per-row value totals (``c`` columns)."""
    return ((bsz, n), "float64"), ((bsz, n), "float64"), ((bsz, n), "bool"), ((bsz, c), "float64")


def empty_call(batch: tuple, lq: int, lk: int, dv: int) -> bool:
    """Whether attention has nothing to sweep (:func:`._host.attention` returns zeros and no residuals)."""
    return lq == 0 or lk == 0 or dv == 0 or 0 in batch


def attention_residuals(batch: tuple, lq: int, lk: int, dv: int) -> tuple:
    """What :func:`._host.attention` with ``keep=True`` returns besides the output: both groups,
    or nothing for an empty call."""
    if empty_call(batch, lq, lk, dv):
        return ()
    bsz = math.prod(batch)
    return sorted_rows(bsz, lq, lk) + saved(bsz, lq, dv)
