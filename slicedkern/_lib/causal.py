"""The causal alignment, once for every layer (docs/mathematics.rst, "Causal attention").

Query ``i`` of ``Lq`` is aligned with key ``i + Lk - Lq`` (bottom-right, as FlashAttention's
``causal=True``: the queries are the last ``Lq`` tokens of the keys' sequence, in self-attention,
chunked prefill and generation alike) and sees the keys ``j <= i + Lk - Lq``; with ``Lq > Lk`` the
first ``Lq - Lk`` queries sit before every key and see none. The compiled kernels (numba, Triton)
receive the offset from here and spell the comparison in their own language.

Packed sequences (docs/mathematics.rst, "Packed sequences"): a query sees a key only when both carry
the same segment id. Inside a segment ``s`` with ``Lq_s`` queries and ``Lk_s`` keys the tokens are
numbered by their order in the row (their *rank* in the segment), and the alignment above holds per
segment: the query of rank ``a`` is aligned with the key of rank ``a + Lk_s - Lq_s``, as
flash-attention's ``flash_attn_varlen_func`` aligns each sequence of a packed batch. Without segment
ids the ranks are the positions.

A *window* ``(left, right)`` (flash-attention's ``window_size``) keeps the keys whose rank ``b``
satisfies ``p - left <= b <= p + right`` for the query aligned with ``p``; ``-1`` leaves a side
unbounded, and ``right`` may be negative (the keys older than a window, ``(-1, -(w + 1))``).
:func:`visible` spells the whole rule densely for the reference and the layers; the engines receive
segments as a layout (:mod:`slicedkern.engines.segmented`).
"""

from __future__ import annotations

from .namespace import array_device

__all__ = ["key_offset", "aligned_keys", "causal_visible", "segment_ranks", "aligned_ranks", "visible"]


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
    return visible(xp, lq, lk, device, causal=True)


def segment_ranks(xp, ids):
    """(..., L) integers: the number of earlier tokens of the row that carry the same id as each.

    Examples
    --------
    >>> import numpy as np
    >>> segment_ranks(np, np.array([3, 3, 1, 3, 1]))
    array([0, 1, 0, 2, 1])
    """
    n = ids.shape[-1]
    same = ids[..., :, None] == ids[..., None, :]
    position = xp.arange(n, device=array_device(ids))
    earlier = position[None, :] < position[:, None]                 # (L, L): token j before token i
    return xp.sum(xp.astype(same & earlier, xp.int64), axis=-1)


def aligned_ranks(xp, q_ids, k_ids):
    """(..., Lq) integers: the rank, among its segment's keys, of the key each query is aligned with,
    ``a + Lk_s - Lq_s`` (negative: the query sits before every key of its segment).

    Examples
    --------
    >>> import numpy as np
    >>> aligned_ranks(np, np.array([0, 0, 1]), np.array([0, 0, 0, 1, 1]))   # segment 0: 3 keys, 2 queries
    array([1, 2, 1])
    """
    count = xp.int64
    lq_s = xp.sum(xp.astype(q_ids[..., :, None] == q_ids[..., None, :], count), axis=-1)
    lk_s = xp.sum(xp.astype(q_ids[..., :, None] == k_ids[..., None, :], count), axis=-1)
    return segment_ranks(xp, q_ids) + lk_s - lq_s


def visible(xp, lq: int, lk: int, device=None, *, q_ids=None, k_ids=None, causal: bool = False, window=None):
    """(..., Lq, Lk) bool: True where query ``i`` sees key ``j`` (the module docstring's rule, causal or not).

    ``q_ids`` (..., Lq) and ``k_ids`` (..., Lk) are integer segment ids or both None (one segment);
    ``window`` a pair ``(left, right)`` of ints or None.

    Examples
    --------
    >>> import numpy as np
    >>> ids = np.array([0, 0, 1, 1])
    >>> visible(np, 4, 4, q_ids=ids, k_ids=ids, causal=True).astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [0, 0, 1, 0],
           [0, 0, 1, 1]])
    >>> visible(np, 4, 4, window=(1, 0)).astype(int)          # each query and the key before it
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [0, 1, 1, 0],
           [0, 0, 1, 1]])
    """
    if q_ids is None:
        key_rank = xp.arange(lk) if device is None else xp.arange(lk, device=device)
        query_rank = aligned_keys(xp, lq, lk, device)
        keep = xp.ones((lq, lk), dtype=xp.bool) if device is None else xp.ones((lq, lk), dtype=xp.bool,
                                                                                 device=device)
    else:
        key_rank = segment_ranks(xp, k_ids)
        query_rank = aligned_ranks(xp, q_ids, k_ids)
        keep = q_ids[..., :, None] == k_ids[..., None, :]
    # offset of key j from the key query i is aligned with, in ranks of their (common) segment
    offset = key_rank[..., None, :] - query_rank[..., :, None]
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0 if right == -1 else min(right, 0)
    if left != -1:
        keep = keep & (offset >= -left)
    if right != -1:
        keep = keep & (offset <= right)
    return keep
