"""PyTorch fast paths (CPU and CUDA)."""

from __future__ import annotations

import torch


def searchsorted_right(sorted_keys, values):
    """torch's native batched ``searchsorted`` (leading shapes must match exactly)."""
    return torch.searchsorted(sorted_keys.contiguous(), values.contiguous(), right=True)
