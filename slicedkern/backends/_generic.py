"""Standard-only fallbacks for any array-API namespace."""

from __future__ import annotations

import array_api_compat as compat

from .._namespace import ceil_log2


def searchsorted_right(xp, sorted_keys, values):
    """Fixed-iteration batched binary search over ``take_along_axis``.

    The loop count depends on the static length ``m`` only, so the function is safe under JIT
    tracing; each iteration is one gather and one compare over ``values``.
    """
    m = sorted_keys.shape[-1]
    dev = compat.device(values)
    lo = xp.zeros(values.shape, dtype=xp.int64, device=dev)
    if m == 0:
        return lo
    hi = xp.full(values.shape, m, dtype=xp.int64, device=dev)
    for _ in range(ceil_log2(m + 1)):
        mid = (lo + hi) // 2
        probe = xp.take_along_axis(sorted_keys, xp.clip(mid, max=m - 1), axis=-1)
        go_right = (mid < hi) & (probe <= values)
        lo = xp.where(go_right, mid + 1, lo)
        hi = xp.where(go_right, hi, mid)
    return lo
