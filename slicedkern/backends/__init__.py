"""Per-framework fast paths and autograd adapters.

The core (``slicedkern._scan``) only speaks the array API standard. What the standard lacks or does
slowly lives here, one small module per framework, imported only when an array of that framework
reaches us (so importing :mod:`slicedkern` imports no framework).
"""

from __future__ import annotations

import array_api_compat as compat

from . import _generic

__all__ = ["searchsorted_right"]


def searchsorted_right(xp, sorted_keys, values):
    """Batched ``#{j : sorted_keys[..., j] <= values[..., i]}``.

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
        return _torch.searchsorted_right(sorted_keys, values)
    if compat.is_numpy_namespace(xp):
        from . import _numpy
        return _numpy.searchsorted_right(sorted_keys, values)
    if compat.is_jax_namespace(xp):
        from . import _jax
        return _jax.searchsorted_right(sorted_keys, values)
    return _generic.searchsorted_right(xp, sorted_keys, values)
