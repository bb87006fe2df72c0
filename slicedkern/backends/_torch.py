"""PyTorch fast paths (CPU and CUDA)."""

from __future__ import annotations

import torch


def searchsorted_right(sorted_keys, values):
    """torch's native batched ``searchsorted`` (leading shapes must match exactly)."""
    return torch.searchsorted(sorted_keys.contiguous(), values.contiguous(), right=True)


def take_rows(table, index):
    """``torch.gather`` with the index expanded over the columns (a view, no copy).

    ``take_along_dim`` would also do it, but it wraps negative indices first (a full extra pass).
    """
    return torch.gather(table, -2, index[..., None].expand(*index.shape, table.shape[-1]))


def prefix_table(keys, weights):
    """One allocation: write ``[w, y w]`` below a zero row, then an in-place cumulative sum."""
    m, c = weights.shape[-2], weights.shape[-1]
    table = torch.empty((*weights.shape[:-2], m + 1, 2 * c), dtype=keys.dtype, device=keys.device)
    table[..., 0, :] = 0
    table[..., 1:, :c] = weights
    torch.mul(table[..., 1:, :c], keys[..., None], out=table[..., 1:, c:])
    return table.cumsum_(-2)
