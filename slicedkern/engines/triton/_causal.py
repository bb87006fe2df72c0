"""Causal attention on the triton engine's kernels: the functions the scan's divide and conquer
(:mod:`..scan._causal`) calls at each level (its :class:`~slicedkern.engines.scan._causal.Levels`).

Every level is the left blocks' keys as rows of one pass 1 and the right blocks' queries as rows of
one pass 2, added in place into the running sums of the positions (:func:`level_sums_into`): two
launches per profile, whatever the number of blocks. The levels sort nothing: each score array is
sorted once in runs of a leaf and merged bottom-up, one merge launch per level
(:func:`level_orders`). The pairs inside the leaves are summed densely, and pulled back, by one
launch per profile each (:func:`dense_leaves`, :func:`dense_leaves_vjp`), and the output is combined from
the running sums by one more (:func:`combine_output`). The backward is the same levels' pull-backs over
the same merges, on the engine's general pull-back (knot gradients included). Issue 26, item 4;
docs/architecture.rst, "Engines".
"""

from __future__ import annotations

from ..._lib.namespace import as_work
from ..sortscan.pullback import column_range
from ._sums import (
    Queries,
    build_table,
    causal_epilogue,
    flat_rows,
    leaf_sums,
    leaf_vjp,
    merge_runs,
    profile_sum,
    profile_sum_into,
    row_view,
    sort_queries,
)

__all__ = ["level_sums", "level_sums_into", "level_orders", "level_table", "dense_leaves", "dense_leaves_vjp",
           "combine_output"]


def level_table(xp, qs, keys, vals, kept, orders):
    """A level's table of the left blocks' keys (pass 1) and its sorted right blocks' queries, the
    block pairs as rows; ``orders`` from :func:`level_orders`, or None to sort them here."""
    key_order, key_perm, query_order, query_perm = orders if orders is not None else (None,) * 4
    presorted = None if orders is None else Queries(key_order, key_perm)
    table = build_table(xp, flat_rows(xp, keys, 1), row_view(xp, vals, 2), take=flat_rows(xp, kept, 1), ones=True,
                        presorted=presorted)
    return table, sort_queries(xp, flat_rows(xp, qs, 1)) if orders is None else Queries(query_order, query_perm)


def level_sums_into(xp, qs, keys, vals, kept, profiles, accs, orders=None):
    """One level of causal attention added in place to the running sums ``accs`` (one (..., n, c_p)
    float64 array per profile, on the positions; :attr:`~slicedkern.engines.scan._causal.Levels.sums_into`):
    pass 2 adds each right block's sums into its rows, so no level's sums are written apart and no
    running sums are copied (issue 26, item 4). Returns the arrays, made contiguous float64 once."""
    batch, s, c = tuple(qs.shape[:-1]), qs.shape[-1], vals.shape[-1]
    table, xr = level_table(xp, qs, keys, vals, kept, orders)
    out = []
    for p, acc in zip(profiles, accs):
        cols = column_range(p, c + 1)
        acc = xp.astype(acc, xp.float64, copy=False).contiguous()
        # block pair r's right block starts at position (2 r + 1) s of the flattened positions
        out.append(profile_sum_into(xp, table, xr, p, batch, cols, acc, 2 * s * len(cols), s * len(cols),
                                    strict=True))
    return out


def dense_leaves(xp, x, y, w, take, profiles, leaf: int):
    """Causal attention's dense leaves on the kernels (:attr:`~slicedkern.engines.scan._causal.Levels.leaves`):
    one :func:`._sums.leaf_sums` launch per profile, the (positions, leaf) products in registers."""
    batch, n, c = tuple(x.shape[:-1]), x.shape[-1], w.shape[-1]
    xr, yr, wr, kept = flat_rows(xp, x, 1), flat_rows(xp, y, 1), row_view(xp, w, 2), flat_rows(xp, take, 1)
    out = []
    for p in profiles:
        cols = column_range(p, c + 1)
        out.append(xp.reshape(leaf_sums(xp, xr, yr, wr, kept, p, batch, cols, leaf), batch + (n, len(cols))))
    return out


def dense_leaves_vjp(xp, x, y, w, profiles, cotangents, leaf: int, *, param_grads: bool):
    """The pull-back of :func:`dense_leaves` (:attr:`~slicedkern.engines.scan._causal.Levels.leaves_vjp`):
    one :func:`._sums.leaf_vjp` launch per profile, nothing of (positions, leaf) in memory."""
    batch, n, c = tuple(x.shape[:-1]), x.shape[-1], w.shape[-1]
    dx, dy, dw, params = leaf_vjp(xp, flat_rows(xp, x, 1), flat_rows(xp, y, 1), row_view(xp, w, 2),
                                  profiles, [row_view(xp, g, 2) for g in cotangents], batch, leaf,
                                  param_grads=param_grads)
    return xp.reshape(dx, batch + (n,)), xp.reshape(dy, batch + (n,)), xp.reshape(dw, batch + (n, c)), params


def combine_output(xp, grid, num, den, totals, good, *, center: bool, normalizer, dtype):
    """Causal attention's combination on the kernels (:attr:`~slicedkern.engines.scan._causal.Levels.combine`):
    one :func:`._sums.causal_epilogue` launch reads the running sums on the positions and writes the
    output in ``dtype``."""
    batch, width = tuple(num.shape[:-2]), num.shape[-1]
    out = causal_epilogue(xp, flat_rows(xp, num, 2), None if den is None else flat_rows(xp, den[..., 0], 1),
                          flat_rows(xp, totals, 2), flat_rows(xp, good, 1), grid.before - grid.blind, center=center,
                          normalizer=normalizer, dtype=dtype)
    return xp.reshape(out, batch + (grid.lq, width - 1))


def level_sums(xp, ar, qs, keys, vals, kept, profiles, orders=None):
    """One level of causal attention (:class:`~slicedkern.engines.scan._causal.Levels`): every
    block pair a row of one pass 1 and one pass 2 per profile; ``vals`` in the values' own dtype (the
    float32 tiles of the non-causal forward, float64 carries); float64 sums, lifted into ``ar``.
    ``orders``: the level's sorted keys and queries (:func:`level_orders`), or None to sort them."""
    batch, s, c = tuple(qs.shape[:-1]), qs.shape[-1], vals.shape[-1]
    table, xr = level_table(xp, qs, keys, vals, kept, orders)
    sums = []
    for p in profiles:
        cols = column_range(p, c + 1)
        part = profile_sum(xp, table, xr, p, batch, cols, strict=True)
        sums.append(ar.lift(as_work(xp, xp.reshape(part, batch + (s, len(cols))), qs.dtype)))
    return sums


def level_orders(xp, x, y, leaf: int):
    """The sorted orders of every level of causal attention from one bottom-up merge sort per score
    array (:attr:`~slicedkern.engines.scan._causal.Levels.orders`; issue 26, item 4).

    ``x`` and ``y`` (..., n), the queries and keys on the positions, ``n`` a power of two: sorted
    once in runs of ``leaf`` positions (one segmented sort each), then per level the left blocks'
    keys (the even runs) and the right blocks' queries (the odd runs) are taken, as
    ``(key_order, key_perm, query_order, query_perm)`` with one row per block pair, and the runs
    merged in pairs (:func:`._sums.merge_runs`, one launch each) for the next level. Lazy: nothing
    is sorted unless a level asks."""
    n = x.shape[-1]
    rows = 1
    for d in x.shape[:-1]:
        rows *= d

    def runs(a):
        values, perm = sort_queries(xp, xp.reshape(a, (rows * (n // leaf), leaf)))
        return xp.reshape(values, (rows, n)), xp.reshape(perm, (rows, n))

    def half(a, size, side):
        return xp.reshape(xp.reshape(a, (rows, n // (2 * size), 2, size))[:, :, side, :],
                          (rows * (n // (2 * size)), size)).contiguous()

    (keys, key_perm), (queries, query_perm) = runs(y), runs(x)
    size = leaf
    while size < n:
        yield (half(keys, size, 0), half(key_perm, size, 0), half(queries, size, 1), half(query_perm, size, 1))
        if 2 * size < n:
            keys, key_perm = merge_runs(xp, keys, key_perm, size)
            queries, query_perm = merge_runs(xp, queries, query_perm, size)
        size *= 2
