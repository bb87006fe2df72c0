"""The causal alignment, once for every layer (docs/mathematics.rst, "Causal attention").

Query ``i`` of ``Lq`` is aligned with key ``i + Lk - Lq`` (bottom-right, as FlashAttention's
``causal=True``: the queries are the last ``Lq`` tokens of the keys' sequence, in self-attention,
chunked prefill and generation alike) and sees the keys ``j <= i + Lk - Lq``; with ``Lq > Lk`` the
first ``Lq - Lk`` queries sit before every key and see none. The compiled kernels (numba, Triton)
receive the offset from here and spell the comparison in their own language.
"""

from __future__ import annotations

__all__ = ["key_offset", "aligned_keys", "causal_visible"]


def key_offset(lq: int, lk: int) -> int:
    """``Lk - Lq``: the key that query ``i`` is aligned with is ``i + key_offset``."""
    return lk - lq


def aligned_keys(xp, lq: int, lk: int, device=None):
    """(lq,) integers: the last key each query sees, ``i + Lk - Lq`` (negative: it sees none).

    Examples
    --------
    >>> import numpy as np
    >>> aligned_keys(np, 2, 4)
    array([2, 3])
    """
    offset = key_offset(lq, lk)
    # NumPy before 2.0 takes no ``device`` (the Flax layer builds its masks in static NumPy)
    return xp.arange(offset, offset + lq) if device is None else xp.arange(offset, offset + lq, device=device)


def causal_visible(xp, lq: int, lk: int, device=None):
    """(lq, lk) bool: True where query ``i`` sees key ``j``, ``j <= i + Lk - Lq``.

    Examples
    --------
    >>> import numpy as np
    >>> causal_visible(np, 2, 3).astype(int)
    array([[1, 1, 0],
           [1, 1, 1]])
    """
    keys = xp.arange(lk) if device is None else xp.arange(lk, device=device)
    return keys[None, :] <= aligned_keys(xp, lq, lk, device)[:, None]
