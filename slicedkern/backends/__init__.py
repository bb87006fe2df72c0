"""Per-framework fast paths and autograd adapters.

The core (``slicedkern._scan``) only speaks the array API standard. What the standard lacks or does
slowly lives here, one small module per framework, imported only when an array of that framework
reaches us (so importing :mod:`slicedkern` imports no framework).
"""

from __future__ import annotations

import array_api_compat as compat

from . import _generic

__all__ = ["materialize", "searchsorted_right", "take_rows", "sorted_weights", "prefix_table", "combine_rows",
           "quiet_nonfinite", "finite_rows"]


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


def materialize(xp, *arrays):
    """The arrays unchanged, computed in full before anything that uses them.

    Identity everywhere but under JAX, where it is an ``optimization_barrier``: in a loop whose steps
    each read the previous step's result twice (the Hillis-Steele scan), XLA would otherwise fuse the
    steps and recompute each one exponentially often.
    """
    if compat.is_jax_namespace(xp):
        import jax
        return jax.lax.optimization_barrier(arrays)
    return arrays


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


def quiet_nonfinite(xp) -> bool:
    """Whether NaN and infinities may flow through this backend's arithmetic unnoticed.

    Where they do (torch: no warnings, no traps), the core may let a non-finite value into the
    prefix sums of its batch row and detect it from the row's totals, instead of screening and
    zeroing every weight beforehand (two full passes over the values); the row's outputs are NaN
    either way (SPEC §4). NumPy warns on ``inf - inf``, so everything else is screened first.
    """
    return compat.is_torch_namespace(xp)


def finite_rows(xp, values, valid=None):
    """(...) True where every entry of ``values`` (..., m, c) on a valid key (``valid`` (..., m)) is finite."""
    if valid is None and compat.is_torch_namespace(xp):
        from . import _torch
        return _torch.finite_rows(values)
    ok = xp.all(xp.isfinite(values), axis=-1)
    if valid is not None:
        ok = ok | ~valid
    return xp.all(ok, axis=-1)


def sorted_weights(xp, weights, perm, dtype, *, take=None, ones=False):
    """``weights`` (..., m, c) in the key order ``perm``, cast to ``dtype``; ``(..., m, c + ones)``.

    ``ones`` appends a column of ones; ``take`` (..., m) (in the original key order) zeroes the rows
    (that column included) of the keys that take no part, whatever they hold.
    """
    wide = take_rows(xp, weights, perm)
    if wide.dtype != dtype:
        wide = xp.astype(wide, dtype)
    if ones:
        one = xp.ones(tuple(perm.shape) + (1,), dtype=dtype, device=compat.device(wide))
        wide = xp.concat([wide, one], axis=-1)
    if take is not None:
        keep = xp.take_along_axis(take, perm, axis=-1)
        wide = xp.where(keep[..., None], wide, xp.asarray(0.0, dtype=dtype, device=compat.device(wide)))
    return wide


def prefix_table(xp, keys, weights, perm, *, take=None, ones=False):
    """Exclusive prefix sums of ``[w, y w]`` along the sorted keys, in the dtype of ``keys``.

    Parameters
    ----------
    keys : array, shape (..., m)
        Sorted keys ``y`` in the work dtype.
    weights : array, shape (..., m, c)
        Their weights in the original key order (``perm`` sorts them), in any floating dtype.
    perm : integer array, shape (..., m)
    take, ones
        As in :func:`sorted_weights`.

    Returns
    -------
    array, shape (..., m + 1, 2 C), ``C = c + ones``: row ``p`` holds
    ``[sum_{j<p} w_j, sum_{j<p} y_j w_j]`` over the sorted keys.
    """
    if compat.is_torch_namespace(xp):
        from . import _torch
        return _torch.prefix_table(keys, weights, perm, take, ones)
    wide = sorted_weights(xp, weights, perm, keys.dtype, take=take, ones=ones)
    table = xp.concat([wide, keys[..., None] * wide], axis=-1)
    return xp.cumulative_sum(table, axis=-2, include_initial=True)


def combine_rows(xp, table, indices, parts, weights, columns, *, cache=None):
    """``sum_k weights[k][..., i] * table[..., indices[k][..., i], part_k * c + columns]``.

    The one fused step of the scan that touches (queries x columns): gathers of prefix-table rows
    at the query ranks, each scaled by a per-query factor, summed.

    Parameters
    ----------
    table : array, shape (..., M, 2 c)
        A prefix table (:func:`prefix_table`).
    indices : list of integer arrays (..., n), or ``None`` for the last row (the totals)
    parts : list of 0 / 1
        Which half of the row: the ``w`` sums (0) or the ``y w`` sums (1).
    weights : list of arrays broadcastable to (..., n), or floats, in the table's dtype
        At least one array of shape (..., n).
    columns : slice
        Of the ``c`` weight columns.
    cache : dict, optional
        Row gathers keyed by ``id(index)``, shared between calls on one table (where a backend
        gathers whole rows).

    Returns
    -------
    array, shape (..., n, len(columns))
    """
    cache = {} if cache is None else cache
    if compat.is_torch_namespace(xp):
        from . import _torch
        out = _torch.combine_rows(table, indices, parts, weights, columns, cache)
        if out is not None:
            return out
    c = table.shape[-1] // 2
    acc = None
    for index, part, weight in zip(indices, parts, weights):
        if index is None:
            rows = table[..., -1:, :]
        else:
            rows = cache.get(id(index))
            if rows is None:
                rows = cache[id(index)] = (index, take_rows(xp, table, index))
            rows = rows[1]
        block = rows[..., part * c:(part + 1) * c][..., columns]
        term = block * (weight if isinstance(weight, (int, float)) else weight[..., None])
        acc = term if acc is None else acc + term
    return acc
