"""Packed sequences: flash-attention's ``cu_seqlens`` as the segment ids the attention ops take."""

from __future__ import annotations

import numpy as np

from .._lib.namespace import array_device, shape_str
from .._lib.typing import Array
from ..backends import array_namespace, is_array, is_traced, to_host

__all__ = ["segment_ids_from_cu_seqlens"]


def segment_ids_from_cu_seqlens(cu_seqlens: Array, total: int | None = None) -> Array:
    """Segment ids of a packed row from the cumulative sequence lengths of its documents.

    ``cu_seqlens = [0, n_0, n_0 + n_1, ..., total]`` (flash-attention's ``flash_attn_varlen_func``
    convention; Hugging Face's ``cu_seq_lens_q``) gives document ``d`` the tokens
    ``cu_seqlens[d] .. cu_seqlens[d + 1] - 1``; the result gives every token its document's index,
    ready for ``segment_ids=`` of the attention ops (docs/getting_started.rst, "Packed sequences and
    windows"). Empty documents (equal consecutive entries) are allowed and get no token.

    Parameters
    ----------
    cu_seqlens : integer array, shape (D + 1,)
        Starts at 0, non-decreasing. Must be concrete (not traced): it fixes the packed layout.
    total : int, optional
        The number of tokens of the packed row; ``cu_seqlens[-1]`` must equal it.

    Returns
    -------
    integer array, shape (cu_seqlens[-1],)
        Same namespace, device and dtype as ``cu_seqlens``.

    Examples
    --------
    >>> import numpy as np, slicedkern
    >>> slicedkern.segment_ids_from_cu_seqlens(np.array([0, 3, 3, 5]))
    array([0, 0, 0, 2, 2])
    """
    if not is_array(cu_seqlens):
        raise TypeError(f"argument 'cu_seqlens' must be an integer array of shape (D + 1,), got "
                        f"{type(cu_seqlens).__name__}")
    xp = array_namespace(cu_seqlens)
    if cu_seqlens.dtype == xp.bool or not xp.isdtype(cu_seqlens.dtype, "integral"):
        raise TypeError(f"argument 'cu_seqlens' must have an integer dtype, got {shape_str(cu_seqlens)}")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"argument 'cu_seqlens' must have shape (D + 1,), D >= 0, got {shape_str(cu_seqlens)}")
    if is_traced(cu_seqlens):
        raise ValueError("argument 'cu_seqlens' must be concrete (known when the call is made, not traced)")
    host = np.asarray(to_host(cu_seqlens)).astype(np.int64)
    if host[0] != 0:
        raise ValueError(f"argument 'cu_seqlens' must start at 0, got {int(host[0])}")
    if np.any(np.diff(host) < 0):
        first = int(np.flatnonzero(np.diff(host) < 0)[0])
        raise ValueError(f"argument 'cu_seqlens' must be non-decreasing, got {int(host[first])} then "
                         f"{int(host[first + 1])} at entries {first} and {first + 1}")
    if total is not None and int(host[-1]) != total:
        raise ValueError(f"argument 'cu_seqlens' must end at total = {total}, got {int(host[-1])}")
    ids = np.searchsorted(host[1:], np.arange(int(host[-1])), side="right")
    return xp.asarray(ids, dtype=cu_seqlens.dtype, device=array_device(cu_seqlens))
