"""NumPy fast paths (CPU)."""

from __future__ import annotations

import numpy as np


def searchsorted_right(sorted_keys, values):
    """``np.searchsorted`` is 1-D only: one C call per batch row."""
    lead = values.shape[:-1]
    keys2 = np.reshape(sorted_keys, (-1, sorted_keys.shape[-1]))
    vals2 = np.reshape(values, (-1, values.shape[-1]))
    out = np.empty(vals2.shape, dtype=np.intp)
    for row in range(vals2.shape[0]):
        out[row] = np.searchsorted(keys2[row], vals2[row], side="right")
    return np.reshape(out, lead + (values.shape[-1],))
