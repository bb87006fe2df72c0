"""Profile sums on the Triton kernels: the sorted-key table and the per-profile query launches.

The same sums as the scan engine's :func:`~slicedkern.engines.sortscan.sums.profile_sums` (the same
shift by the median key, the same tie rules), computed by two kernels (:mod:`._kernels`): one
blocked scan of the sorted value rows, one query pass per profile and column range. Arrays are
torch tensors; the batch is flattened to rows here and restored by the caller.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, NamedTuple

from ...kernels import Profile, is_fixed

__all__ = ["Table", "build_table", "profile_sum", "loaded", "interpreted"]

#: Rows per scan block: the float32 local sums run over at most this many rows before a float64 carry.
BLOCK_M = 64
BLOCK_N = 64
BLOCK_C = 32
_MODULE = "slicedkern.engines.triton._kernels"


def loaded():
    """The kernel module, imported on first use (it imports Triton, which ``import slicedkern`` must not)."""
    from . import _kernels  # a framework row (tests/test_architecture.py): imports Triton at its top
    _kernels.build()
    return _kernels


def interpreted() -> bool:
    """Whether the kernels run (or, not built yet, will run) under Triton's interpreter."""
    kernels = sys.modules.get(_MODULE)
    mode = kernels.interpreted() if kernels is not None else None
    if mode is None:
        mode = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    return mode


class Table(NamedTuple):
    keys: Any    # (R, m) sorted keys, work dtype
    shift: Any   # (R,) the median key
    local: Any   # (R, m, 2C) block-local inclusive sums [P0 | P1], accumulator dtype
    carry: Any   # (R, nb + 1, 2C) float64 exclusive block carries; the last row the totals
    C: int       # columns of the table (the weight columns, plus the indicator column)

    @property
    def totals(self):
        """(R, 2C) the sums over every key, float64."""
        return self.carry[:, -1, :]


def _acc_dtype(xp, w):
    return xp.float64 if w.dtype == xp.float64 else xp.float32


def build_table(xp, y, w, *, take=None, ones=False) -> Table:
    """Sort the keys ``y`` (R, m) and scan ``[w, (y - shift) w]`` (R, m, c) in blocks.

    ``take`` (R, m) bool zeroes the weights of the keys that take no part; ``ones`` appends the
    indicator column (``take``, or ones) to the table without a concatenated copy of ``w``.
    """
    rows, m = y.shape
    c = w.shape[-1]
    keys, perm = y.sort(dim=-1, stable=True)
    keys = keys.contiguous()
    shift = keys[:, m // 2].contiguous()
    C = c + (1 if ones else 0)
    nb = triton_cdiv(m, BLOCK_M)
    dev = y.device
    local = xp.empty((rows, m, 2 * C), dtype=_acc_dtype(xp, w), device=dev)
    totals = xp.empty((rows, nb, 2 * C), dtype=xp.float64, device=dev)
    take_arg = xp.astype(take, xp.int8).contiguous() if take is not None else keys
    grid = (rows, nb, triton_cdiv(C, BLOCK_C))
    k = loaded()
    k.block_scan[grid](keys, shift, perm.contiguous(), w, take_arg, local, totals,
                       m, c, C, nb, w.stride(0), w.stride(1), w.stride(2),
                       HAS_TAKE=take is not None, ONES=ones, ACC=_tl_dtype(k, local.dtype, xp),
                       BLOCK_M=BLOCK_M, BLOCK_C=BLOCK_C)
    zero = xp.zeros((rows, 1, 2 * C), dtype=xp.float64, device=dev)
    carry = xp.concat([zero, xp.cumulative_sum(totals, axis=1)], axis=1)
    return Table(keys, shift, local, carry, C)


def _tl_dtype(k, dtype, xp):
    return k.tl.float64 if dtype == xp.float64 else k.tl.float32


def triton_cdiv(a: int, b: int) -> int:
    return max(1, -(-a // b))


def _per_row(xp, value, batch, rows, dev):
    """A profile parameter (float or batch-broadcastable array) as a (R,) float64 tensor."""
    if is_fixed(value):
        return xp.full((rows,), float(value), dtype=xp.float64, device=dev)
    value = xp.broadcast_to(xp.astype(value, xp.float64), batch)
    return xp.reshape(value, (rows,))


def profile_sum(xp, table: Table, x, profile: Profile, batch, cols: range, *, strict: bool,
                alpha=None, divisor=None):
    """``(sum over the profile of table columns cols + alpha * totals) / divisor``, (R, n, len(cols)).

    ``x`` (R, n) float64 queries; ``alpha``, ``divisor`` (R, n) float64 or None; ``batch`` the batch
    shape the profile's array parameters broadcast to. Float64 result.
    """
    rows, n = x.shape
    m = table.keys.shape[-1]
    dev = x.device
    width = len(cols)
    out = xp.empty((rows, n, width), dtype=xp.float64, device=dev)
    if width == 0 or rows == 0 or n == 0:
        return out
    pairs = [(t, cf) for t, cf in zip(profile.knots, profile.coeffs) if not (is_fixed(cf) and cf == 0)]
    K = len(pairs)
    if K:
        knots = xp.stack([_per_row(xp, t, batch, rows, dev) for t, _ in pairs], axis=-1).contiguous()
        coeffs = xp.stack([_per_row(xp, cf, batch, rows, dev) for _, cf in pairs], axis=-1).contiguous()
    else:
        knots = coeffs = xp.zeros((rows, 1), dtype=xp.float64, device=dev)
    lin = xp.stack([_per_row(xp, profile.slope, batch, rows, dev),
                    _per_row(xp, profile.intercept, batch, rows, dev)], axis=-1).contiguous()
    nb = table.carry.shape[1] - 1
    grid = (rows, triton_cdiv(n, BLOCK_N), triton_cdiv(width, BLOCK_C))
    loaded().query_combine[grid](
        x, table.keys, table.shift, table.local, table.carry, knots, coeffs, lin,
        alpha if alpha is not None else x, divisor if divisor is not None else x, out,
        n, m, table.C, nb, cols.start, width,
        K=K, STRICT=strict, DERIV=bool(profile.derivative), HAS_ALPHA=alpha is not None,
        HAS_DIV=divisor is not None, LOG_M=max(1, math.ceil(math.log2(m + 1))), BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C)
    return out
