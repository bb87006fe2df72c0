"""Per-framework fast paths and autograd adapters.

The core (``slicedkern._scan``) only speaks the array API standard. What the standard lacks or does
slowly lives here, one small module per framework, imported only when an array of that framework
reaches us (so importing :mod:`slicedkern` imports no framework).
"""

from __future__ import annotations

import array_api_compat as compat

from . import _generic

__all__ = ["searchsorted_right", "take_rows", "prefix_table"]


def searchsorted_right(xp, sorted_keys, values, *, strict=False):
    """Batched ``#{j : sorted_keys[..., j] <= values[..., i]}`` (``<`` when ``strict``).

    Parameters
    ----------
    sorted_keys : array, shape (..., m)
        Sorted along the last axis.
    values : array, shape (..., n)
        Same leading shape as ``sorted_keys``.

    Returns
    -------
    array of the default integer dtype, shape (..., n)
    """
    if compat.is_torch_namespace(xp):
        from . import _torch
        return _torch.searchsorted_right(sorted_keys, values, strict)
    if compat.is_numpy_namespace(xp):
        from . import _numpy
        return _numpy.searchsorted_right(sorted_keys, values, strict)
    if compat.is_jax_namespace(xp):
        from . import _jax
        return _jax.searchsorted_right(sorted_keys, values, strict)
    return _generic.searchsorted_right(xp, sorted_keys, values, strict)


def take_rows(xp, table, index):
    """``out[..., i, :] = table[..., index[..., i], :]``: a batched row gather.

    Parameters
    ----------
    table : array, shape (..., m, c)
    index : integer array, shape (..., n), values in ``[0, m)``; same leading shape as ``table``.
    """
    if compat.is_torch_namespace(xp):
        from . import _torch
        return _torch.take_rows(table, index)
    return xp.take_along_axis(table, index[..., None], axis=-2)


def prefix_table(xp, keys, weights):
    """Exclusive prefix sums of ``[w, y w]`` along the keys, in the dtype of ``keys``.

    Parameters
    ----------
    keys : array, shape (..., m)
        Sorted keys ``y`` in the work dtype.
    weights : array, shape (..., m, c)
        Their weights, in any floating dtype (cast on the fly).

    Returns
    -------
    array, shape (..., m + 1, 2 c): row ``p`` holds ``[sum_{j<p} w_j, sum_{j<p} y_j w_j]``.
    """
    if compat.is_torch_namespace(xp):
        from . import _torch
        return _torch.prefix_table(keys, weights)
    wide = weights if weights.dtype == keys.dtype else xp.astype(weights, keys.dtype)
    table = xp.concat([wide, keys[..., None] * wide], axis=-1)
    return xp.cumulative_sum(table, axis=-2, include_initial=True)
