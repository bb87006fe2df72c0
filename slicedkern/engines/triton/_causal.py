"""Causal attention on the triton engine's kernels: :class:`TritonLevels`, the level kernels
(:class:`~slicedkern.engines._dyadic.LevelKernels`) the divide and conquer of :mod:`.._dyadic` calls.

Every level is the left blocks' keys as rows of one pass 1 and the right blocks' queries as rows of
one pass 2, added in place into the running sums of the positions (:func:`level_sums_into`): two
launches, whatever the number of blocks (a summed normaliser's sums ride the values' pass 2). The
levels sort nothing: each score array is sorted once in runs of a leaf and merged bottom-up, one
merge launch per level (:func:`level_orders`). The pairs inside the leaves are summed densely, and
pulled back, by one launch per profile each (:func:`dense_leaves`, :func:`dense_leaves_vjp`), and
the output is combined from the running sums by one more (:func:`combine_output`). The backward is
the same levels' pull-backs over the same merges, on the engine's general pull-back (knot
gradients included). docs/architecture.rst, "Engines".
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ..._lib.causal import key_offset
from ...kernels import Profile, is_fixed
from .._columns import MaskedValues
from ..sortscan.pullback import column_range
from ._args import Blocks, Columns, Positions, float64_scalar, profile_record, strided, tl_dtype
from ._sums import (
    BLOCK_COLS,
    BLOCK_ROWS,
    Queries,
    SumTerm,
    _acc_dtype,
    _blocks,
    as_int8,
    build_table,
    cotangent_rows,
    flat_rows,
    loaded,
    profile_sum_into,
    row_view,
    sort_queries,
    triton_cdiv,
)

__all__ = ["TritonLevels", "running_dtype", "causal_dv", "level_sums_into", "level_orders", "level_table",
           "dense_leaves", "dense_leaves_vjp", "combine_output", "causal_epilogue", "merge_runs", "leaf_sums",
           "leaf_vjp", "position_carry", "causal_row_dots"]


#: the names of :func:`level_orders`' sorted runs, in the order the engine keeps them as residuals
RUN_NAMES = ("keys", "key_perm", "queries", "query_perm")


def running_dtype(xp, values):
    """The dtype of causal attention's running sums on the positions, forward and backward: the
    dtype of the values' tiles (float32 for values of float32 or narrower, float64 for float64), so
    that the (n, c) sums every level reads and writes move half the bytes of float64 ones. Each
    level adds its float64 sums to them and rounds once: about one rounding per level, log2(n /
    leaf) of them, on top of the tiles' (docs/architecture.rst, "Engines")."""
    return _acc_dtype(xp, values)


def level_table(xp, qs, keys, vals, kept, orders):
    """A level's table of the left blocks' keys (pass 1) and its sorted right blocks' queries, the
    block pairs as rows; ``orders`` from :func:`level_orders`, or None to sort them here."""
    key_order, key_perm, query_order, query_perm = orders if orders is not None else (None,) * 4
    presorted = None if orders is None else Queries(key_order, key_perm)
    # the indicator of a level's left blocks, as int8 (the table makes the strided view contiguous)
    table = build_table(xp, (row_view if orders is not None else flat_rows)(xp, keys, 1), row_view(xp, vals, 2),
                        take=as_int8(xp, row_view(xp, kept, 1)), ones=True, presorted=presorted)
    return table, sort_queries(xp, flat_rows(xp, qs, 1)) if orders is None else Queries(query_order, query_perm)


def level_sums_into(xp, qs, keys, vals, kept, profiles, accs, orders=None):
    """One level of causal attention added in place to the running sums ``accs`` (one contiguous
    (..., n, c_p) array per profile, on the positions, in :func:`running_dtype`;
    :meth:`TritonLevels.add_level`): pass 2 adds each right block's sums
    into its rows in float64 and rounds once, so no level's sums are written apart and no running
    sums are copied. A profile over the indicator alone (attention's summed
    normaliser) after one over the values rides that one's launch. Returns the arrays."""
    batch, s, c = tuple(qs.shape[:-1]), qs.shape[-1], vals.shape[-1]
    table, xr = level_table(xp, qs, keys, vals, kept, orders)
    spans = [column_range(p, c + 1) for p in profiles]
    fused = len(profiles) == 2 and spans[1] == range(c, c + 1) and spans[0].start < c
    for p, cols, acc in list(zip(profiles, spans, accs))[:1 if fused else None]:
        # block pair r's right block starts at position (2 r + 1) s of the flattened positions
        profile_sum_into(xp, SumTerm(table, xr, p, cols, True), batch, acc, 2 * s * len(cols), s * len(cols),
                         norm_into=(profiles[1], accs[1]) if fused else None)
    return list(accs)


def dense_leaves(xp, x, y, w, take, profiles, leaf: int):
    """Causal attention's dense leaves on the kernels (:meth:`TritonLevels.leaves`):
    one :func:`leaf_sums` launch per profile, the (positions, leaf) products in registers."""
    batch, n, c = tuple(x.shape[:-1]), x.shape[-1], w.shape[-1]
    xr, yr, wr, kept = flat_rows(xp, x, 1), flat_rows(xp, y, 1), row_view(xp, w, 2), flat_rows(xp, take, 1)
    out = []
    for p in profiles:
        cols = column_range(p, c + 1)
        out.append(xp.reshape(leaf_sums(xp, xr, yr, wr, kept, p, batch, cols, leaf), batch + (n, len(cols))))
    return out


def dense_leaves_vjp(xp, x, y, w, profiles, cotangents, leaf: int, *, param_grads: bool):
    """The pull-back of :func:`dense_leaves` (:meth:`TritonLevels.leaves_vjp`):
    one :func:`leaf_vjp` launch per profile, nothing of (positions, leaf) in memory. ``w`` an array
    or a :class:`~slicedkern.engines._columns.MaskedValues`, the cotangents arrays or
    :class:`~slicedkern.engines._columns.ScaledRows` (read as such: nothing formed)."""
    batch, n = tuple(x.shape[:-1]), x.shape[-1]
    masked = isinstance(w, MaskedValues)
    values = w.values if masked else w
    take = flat_rows(xp, w.take, 1) if masked else None
    # the leaves' kernel reads the factors of the positions as contiguous rows
    cots = [(rows, *(None if f is None else f.contiguous() for f in factors))
            for rows, *factors in (cotangent_rows(xp, g) for g in cotangents)]
    dx, dy, dw, params = leaf_vjp(xp, flat_rows(xp, x, 1), flat_rows(xp, y, 1), row_view(xp, values, 2),
                                  profiles, cots, batch, leaf, param_grads=param_grads, take=take)
    dw = xp.reshape(dw, batch + (n, values.shape[-1]))
    return xp.reshape(dx, batch + (n,)), xp.reshape(dy, batch + (n,)), dw, params


def combine_output(xp, grid, num, den, w, take, good, *, center: bool, normalizer, dtype, kept: dict | None = None):
    """Causal attention's combination on the kernels (:meth:`TritonLevels.combine`):
    one :func:`causal_epilogue` launch reads the running sums on the positions, sums the running
    totals of the values ``w`` and indicator ``take`` there, and writes the output in ``dtype``.
    ``kept``: a dict that gets the totals' block carry (:func:`position_carry`) as
    ``"position_carry"``, for the backward's row dots (the engine keeps it as a residual)."""
    batch, width = tuple(num.shape[:-2]), num.shape[-1]
    wr, take = row_view(xp, w, 2), xp.astype(flat_rows(xp, take, 1), xp.int8)
    carry = position_carry(xp, wr, take)
    if kept is not None:
        kept["position_carry"] = carry
    out = causal_epilogue(xp, flat_rows(xp, num, 2), None if den is None else flat_rows(xp, den[..., 0], 1), wr, take,
                          flat_rows(xp, good, 1), grid.before - grid.blind, carry, center=center,
                          normalizer=normalizer, dtype=dtype)
    return xp.reshape(out, batch + (grid.lq, width - 1))


def level_orders(xp, x, y, leaf: int, runs: dict | None = None, narrow: bool = False):
    """The sorted orders of every level of causal attention from one bottom-up merge sort per score
    array (:meth:`TritonLevels.orders`).

    ``x`` and ``y`` (..., n), the queries and keys on the positions, ``n`` a power of two: sorted
    once in runs of ``leaf`` positions (one segmented sort each), then per level the left blocks'
    keys (the even runs) and the right blocks' queries (the odd runs) are taken, as
    ``(key_order, key_perm, query_order, query_perm)`` with one row per block pair, and the runs
    merged in pairs (:func:`merge_runs`, one launch each) for the next level. Lazy: nothing
    is sorted unless a level asks.

    ``runs``: a dict that carries the sorted runs from a forward to its backward (the engine keeps
    them as residuals): empty, the runs sorted here are recorded in it (``"keys"``, ``"key_perm"``,
    ``"queries"``, ``"query_perm"``, (R, n) each); filled, they are taken from it and nothing is
    sorted. ``narrow``: the scores are float32 numbers (or narrower) lifted to float64, sorted as
    float32 (one :func:`._order.sort_rows` launch each instead of ``torch.sort`` and casts); the
    runs keep float64 values. (Float32 keys, as the non-causal tables keep them, would halve the
    keys' bytes in the merges, but the levels' evaluation kernel then spills 24 bytes a thread for
    bfloat16 values on ``sm_90``: ``tests/test_triton_compile.py``.)"""
    n = x.shape[-1]
    rows = 1
    for d in x.shape[:-1]:
        rows *= d

    def sorted_runs(a):
        values, perm = sort_queries(xp, xp.reshape(a, (rows * (n // leaf), leaf)), narrow)
        return xp.reshape(values, (rows, n)), xp.reshape(perm, (rows, n))

    def half(a, size, side):
        if a.ndim == 3:          # merged in the split layout: each side one contiguous array
            return xp.reshape(a[side], (rows * (n // (2 * size)), size))
        return xp.reshape(xp.reshape(a, (rows, n // (2 * size), 2, size))[:, :, side, :],
                          (rows * (n // (2 * size)), size)).contiguous()

    if runs:
        keys, key_perm, queries, query_perm = (runs[name] for name in RUN_NAMES)
    else:
        (keys, key_perm), (queries, query_perm) = sorted_runs(y), sorted_runs(x)
        if runs is not None:
            runs.update(zip(RUN_NAMES, (keys, key_perm, queries, query_perm)))
    size = leaf
    while size < n:
        yield (half(keys, size, 0), half(key_perm, size, 0), half(queries, size, 1), half(query_perm, size, 1))
        if 2 * size < n:
            # merged into the split layout, so that the next level's halves are not copied out
            split = keys.ndim == 3
            keys, key_perm = merge_runs(xp, keys, key_perm, size, split_in=split, split_out=True)
            queries, query_perm = merge_runs(xp, queries, query_perm, size, split_in=split, split_out=True)
        size *= 2


def causal_epilogue(xp, num, den, w, take, good, offset: int, carry, *, center: bool, normalizer, dtype):
    """Causal attention's output from its running sums (:func:`._dense.causal_epilogue`, one
    launch over the caller's :func:`position_carry`): ``num`` (R, n, dv + 1) the values' profile
    sums and the ReLU count, ``den`` (R, n) the normaliser's sums or None (in :func:`running_dtype`),
    ``w`` (R, n, dv) the values (own dtype and strides) and ``take`` (R, n) bool, on the positions;
    ``good`` (R, lq) bool the NaN rule's verdicts; query ``i`` at position ``i + offset``;
    ``carry``: their :func:`position_carry`. Returns (R, lq, dv) in ``dtype``."""
    rows, n, width = num.shape
    dv, lq = width - 1, good.shape[-1]
    out = xp.empty((rows, lq, dv), dtype=dtype, device=num.device)
    if rows and lq and dv:
        loaded().causal_epilogue[(rows, triton_cdiv(lq, BLOCK_ROWS), triton_cdiv(dv, BLOCK_COLS))](
            num, den if den is not None else num, _positions(xp, w, take, carry), xp.astype(good, xp.int8), out, lq,
            offset, float64_scalar(xp, normalizer.eps, num.device), CENTER=bool(center), NORM=normalizer.code,
            BLOCK_N=BLOCK_ROWS, BLOCK_C=BLOCK_COLS, num_warps=8)
    return out


def _positions(xp, w, take, carry) -> Positions:
    """The values on the positions as the dense kernels read them (:class:`._args.Positions`)."""
    return Positions(*strided(w), xp.astype(take, xp.int8, copy=False), carry, carry.shape[1], w.shape[1], w.shape[2])


def position_carry(xp, w, take):
    """The exclusive prefix over blocks of :data:`BLOCK_ROWS` positions of the sums of ``[w take |
    take]``: (R, nb + 1, c + 1) float64, the last row the totals (:func:`._dense.position_sums`,
    one launch, and one cumulative sum in place); ``w`` (R, n, c) in its own dtype and strides,
    ``take`` (R, n) int8. What :func:`._dense._running_totals` reads."""
    rows, n, c = w.shape
    blocks = triton_cdiv(n, BLOCK_ROWS)
    carry = xp.zeros((rows, blocks + 1, c + 1), dtype=xp.float64, device=w.device)
    if rows and blocks:
        loaded().position_sums[(rows, blocks, triton_cdiv(c + 1, BLOCK_COLS))](
            _positions(xp, w, take, carry), BLOCK_N=BLOCK_ROWS, BLOCK_C=BLOCK_COLS)
        carry.cumsum_(dim=1)
    return carry


def causal_row_dots(xp, g, w, take, offset: int, carry=None):
    """``<g[r, i], V[r, i + offset]>`` (R, lq) float64, ``V`` the running sums of the values ``w``
    (R, n, c) (own dtype and strides) over the positions where ``take`` (R, n) (0 before position
    0): the quotient rule's row dots with the value sums each query of causal attention sees
    (:func:`._dense.causal_row_dots`, one launch after :func:`position_carry`'s, or none with
    ``carry`` given: the forward's, over at least the ``n`` positions); ``g`` (R, lq, c) in its own
    dtype and strides."""
    rows, lq, c = g.shape
    out = xp.empty((rows, lq), dtype=xp.float64, device=g.device)
    if rows and lq:
        take = xp.astype(take, xp.int8, copy=False)
        carry = position_carry(xp, w, take) if carry is None else carry
        loaded().causal_row_dots[(rows, triton_cdiv(lq, BLOCK_ROWS))](
            strided(g), _positions(xp, w, take, carry), out, lq, offset, BLOCK_N=BLOCK_ROWS, BLOCK_C=BLOCK_COLS,
            num_warps=8)
    return out


def merge_runs(xp, values, perm, run: int, *, split_in: bool = False, split_out: bool = False):
    """``values`` (R, n), sorted in runs of ``run`` with ``perm`` (R, n) int32 each entry's index in
    its run, merged in adjacent pairs: sorted runs of ``2 run`` and their indices (one launch).
    ``split_in`` / ``split_out``: the input / the output in the split layout, (2, R, n / 2), the
    even runs of every row in the first half and the odd runs in the second
    (:func:`._order.merge_runs`)."""
    rows, n = (values.shape[1], 2 * values.shape[2]) if split_in else values.shape
    shape = (2, rows, n // 2) if split_out else (rows, n)
    merged = xp.empty(shape, dtype=values.dtype, device=values.device)
    merged_perm = xp.empty(shape, dtype=perm.dtype, device=perm.device)
    if rows and n:
        loaded().merge_runs[(rows, triton_cdiv(n, BLOCK_ROWS))](
            values, perm, merged, merged_perm, n, run, run.bit_length(), SPLIT_IN=split_in, SPLIT_OUT=split_out,
            BLOCK=BLOCK_ROWS)
    return merged, merged_perm


def leaf_sums(xp, x, y, w, take, profile: Profile, batch, cols: range, leaf: int):
    """Causal attention's dense leaves (:func:`._dense.leaf_eval`, one launch): per position ``i``
    of a row, ``sum over j <= i in i's block of leaf positions, take_j of f(x_i - y_j) [w_j | 1]``
    over the columns ``cols`` (column ``c`` the indicator), (R, n, len(cols)). ``x``, ``y``
    (R, n) float64 positions (``n`` a multiple of ``leaf``), ``w`` (R, n, c) in any dtype and
    strides, ``take`` (R, n) bool; ``batch`` the shape the profile's array parameters broadcast to.
    The sums are in :func:`running_dtype` (the running sums the levels then add to)."""
    rows, n = x.shape
    c, width = w.shape[-1], len(cols)
    out = xp.empty((rows, n, width), dtype=running_dtype(xp, w), device=x.device)
    if rows and n and width:
        block_c = _blocks(xp, w)[2]
        k = loaded()
        k.leaf_eval[(rows, n // leaf, triton_cdiv(width, block_c))](
            x, y, strided(w), xp.astype(take, xp.int8), profile_record(k, xp, profile, batch, rows, x.device,
                                                                        strict=True),
            out, Columns(cols.start, width), n, c, ACC=tl_dtype(k, _acc_dtype(xp, w), xp), LEAF=leaf,
            SUB=min(16, leaf), BLOCK_C=block_c)
    return out


#: keys and columns a :func:`._dense.leaf_pullback` program forms its float64 pair terms over at a time
LEAF_SUB = 8
LEAF_COLS = 8


def leaf_vjp(xp, x, y, w, profiles, cotangents, batch, leaf: int, *, param_grads: bool, take=None):
    """The pull-back of causal attention's dense leaves (:func:`._dense.leaf_pullback`, one launch
    per profile): ``(dx, dy (R, n), dw (R, n, c), [(dknots, dcoeffs)] per profile)``, float64 (``dw``
    in :func:`running_dtype`, the levels adding to it as the forward's add to its sums), as
    :func:`slicedkern.engines.sortscan.leaves.leaf_vjp` returns them (knot and coefficient gradients of
    the array parameters, shaped ``batch``; None for the fixed ones). ``x``, ``y`` (R, n) float64
    on the positions (``n`` a multiple of ``leaf``), ``w`` (R, n, c) in any dtype and strides;
    ``cotangents``: per profile ``(rows, scale, value_scale)`` as :func:`._sums.cotangent_rows` gives
    them, the rows (R, n, c_p) in any dtype and strides, the factors (R, n) float64 or None.
    ``take`` (R, n) bool, or None: the weights are ``[w take | take]`` (column ``c`` the indicator,
    a value read only where its key takes part), and a profile sums either the values' columns or
    the indicator's, whose gradient is not formed."""
    rows, n = x.shape
    c = w.shape[-1]
    dev = x.device
    dx = xp.zeros((rows, n), dtype=xp.float64, device=dev)
    dy = xp.zeros((rows, n), dtype=xp.float64, device=dev)
    dw = xp.zeros((rows, n, c), dtype=running_dtype(xp, w), device=dev)
    take8 = as_int8(xp, take) if take is not None else None         # take is contiguous: read as int8
    params = []
    k = loaded()
    for p, (g, scale, value_scale) in zip(profiles, cotangents):
        cols = range(c + int(take is not None))[p.columns]
        indicator = take is not None and cols.start >= c
        profile = profile_record(k, xp, p, batch, rows, dev, strict=True)
        K = profile.K.value
        # the kernel's knots are the profile's less those of fixed zero coefficient (_args._profile_arrays)
        kept = [i for i, cf in enumerate(p.coeffs) if not (is_fixed(cf) and cf == 0)]
        learned = param_grads and any(not (is_fixed(t) and is_fixed(cf)) for t, cf in zip(p.knots, p.coeffs))
        dpar = xp.zeros((rows, n // leaf, 2 * max(K, 1)), dtype=xp.float64, device=dev) if learned else None
        strict = _strict_knots(xp, tuple(bool(p.strict_knots[i]) for i in kept), dev)
        if rows and n and len(cols):
            blocks = Blocks(*(k.tl.constexpr(b) for b in (min(LEAF_SUB, leaf), leaf, LEAF_COLS)))
            k.leaf_pullback[(rows, n // leaf)](
                x, y, strided(w), take8, strided(g), scale, value_scale, profile, strict, (dx, dy, dw), dpar,
                Columns(cols.start, len(cols)), n, c, blocks, INDICATOR=indicator, num_warps=8)
        params.append(_leaf_params(xp, p, kept, dpar if learned else None, batch, param_grads))
    return dx, dy, dw, params


@functools.lru_cache(maxsize=64)
def _strict_knots(xp, strict: tuple, dev):
    """The tie side of each knot as :func:`._dense.leaf_pullback` reads it, (K,) int8: made once per
    device and pattern, as :func:`._args._fixed_profile_arrays` makes fixed profiles (no host-to-device copy
    per backward)."""
    return xp.asarray([int(s) for s in strict] or [0], dtype=xp.int8, device=dev)


def _leaf_params(xp, p: Profile, kept, dpar, batch, param_grads: bool):
    """Per knot of ``p``, its gradient and its coefficient's from the kernel's per-block sums
    ``dpar`` (R, blocks, 2 K), shaped ``batch``; None for a fixed parameter (or without
    ``param_grads``). A knot of fixed zero coefficient, left out of the kernel, has gradient 0."""
    totals = None if dpar is None else xp.sum(dpar, axis=1)
    K = len(kept)
    dknots, dcoeffs = [], []
    for i, (t, cf) in enumerate(zip(p.knots, p.coeffs)):
        if not param_grads or (is_fixed(t) and is_fixed(cf)):
            dknots.append(None)
            dcoeffs.append(None)
            continue
        if i not in kept:
            dknots.append(None if is_fixed(t) else xp.zeros(batch, dtype=xp.float64, device=totals.device))
            dcoeffs.append(None)
            continue
        slot = kept.index(i)
        dknots.append(None if is_fixed(t) else xp.reshape(totals[:, slot], batch))
        dcoeffs.append(None if is_fixed(cf) else xp.reshape(totals[:, K + slot], batch))
    return tuple(dknots), tuple(dcoeffs)


def causal_dv(xp, dw, g, weights, factor, dtype):
    """Causal attention's ``dv`` (R, lk, d) in ``dtype`` (:func:`._dense.causal_dv`, one launch):
    ``(dw - sub) * factor``, ``sub`` the reverse running sum over the positions of ``weights * g``
    (over the queries that see each key), or zero when ``g`` is None. ``dw`` (R, lk, d) and ``g``
    (R, lq, d) read in their own dtypes and strides, ``weights`` (R, lq) and ``factor`` (R, lk)."""
    rows, lk, d = dw.shape
    out = xp.empty((rows, lk, d), dtype=dtype, device=dw.device)
    if rows and lk and d:
        factor = xp.astype(factor, xp.float64).contiguous()
        sub = g is not None
        lq = g.shape[1] if sub else lk
        weights = xp.astype(weights, xp.float64).contiguous() if sub else factor
        loaded().causal_dv[(rows, triton_cdiv(d, BLOCK_COLS))](
            strided(dw), strided(g) if sub else None, weights, factor, out, lq, lk, d, -key_offset(lq, lk),
            BLOCK_N=BLOCK_ROWS, BLOCK_D=BLOCK_COLS, num_warps=8)
    return out


def _add_into(acc, part, core: int, right: bool):
    """``part`` (..., P, s, *core), a level's pull-backs, added in place into the right (``right``)
    or left block of every pair of ``acc`` (..., n, *core), the running gradients on the positions
    (``n = 2 P s``); returns ``acc``. Torch tensors (the engine's): no copy back."""
    shape = tuple(acc.shape)
    ndim = len(shape)
    lead, tail = shape[:ndim - 1 - core], shape[ndim - core:]
    pairs, size = part.shape[part.ndim - 2 - core], part.shape[part.ndim - 1 - core]
    paired = acc.reshape(lead + (pairs, 2, size) + tail)        # a view: acc is contiguous
    paired[(..., 1 if right else 0) + (slice(None),) * (1 + core)].add_(part)
    return acc


class TritonLevels:
    """The levels of causal attention on the kernels (:class:`~slicedkern.engines._dyadic.LevelKernels`).

    The running sums, and the backward's running gradients, are one contiguous array per profile on
    the positions, in :func:`running_dtype`; every level adds into them in place (its pass 2 in
    float64, rounded once; its pull-back's values' gradient by the pull-back itself), so that no
    level's sums are written apart. The levels sort nothing: :meth:`orders` merges each score array
    bottom-up. The values are read in their own dtype and only where their key takes part.

    Parameters
    ----------
    vjp : callable
        The engine's pull-back of profile sums (:meth:`~slicedkern.engines.triton.TritonEngine.profiles_vjp`,
        which takes ``orders=`` and ``dw_into=``).
    leaf : int
        Positions per dense leaf block.
    runs : dict or None
        :func:`level_orders`' sorted runs: recorded by a forward (empty; :meth:`combine` adds its
        block carry as ``"position_carry"``), read by its backward (filled), or None (sorted here).
    narrow : bool
        The scores are float32 numbers, sorted as such (:func:`level_orders`).
    """

    native_values = True
    masked_values = True

    def __init__(self, vjp: Callable, leaf: int, runs: dict | None = None, narrow: bool = False):
        self.vjp, self.leaf, self.runs, self.narrow = vjp, leaf, runs, narrow

    def orders(self, xp, at, leaf):
        return level_orders(xp, at.x, at.y, leaf, runs=self.runs, narrow=self.narrow)

    def leaves(self, xp, ar, at, profiles, leaf):
        return dense_leaves(xp, at.x, at.y, at.w, at.take, profiles, leaf)

    def add_level(self, xp, ar, sums, level, profiles, orders):
        return level_sums_into(xp, level.qs, level.keys, level.vals, level.kept, profiles, sums, orders)

    def position_sums(self, xp, ar, sums):
        return [ar.lift(acc) for acc in sums]

    def combine(self, xp, ar, grid, sums, at, good, form, dtype):
        dv, work = at.w.shape[-1], at.x.dtype
        den = sums[1] if len(sums) > 1 else None
        out = combine_output(xp, grid, sums[0], den, at.w, at.take, good, center=form.center,
                             normalizer=form.normalizer, dtype=dtype, kept=self.runs)
        # the running sums may be narrower than the work (float32 ones): the backward's residuals
        # are in the work dtype
        relu_count = xp.astype(grid.at_queries(xp, sums[0][..., dv:dv + 1], axis=-2), work, copy=False)
        raw_den = None if den is None else xp.astype(grid.at_queries(xp, den, axis=-2), work, copy=False)
        return out, relu_count, raw_den

    def leaves_vjp(self, xp, at, profiles, cotangents, leaf, *, param_grads):
        dx, dy, dw, params = dense_leaves_vjp(xp, at.x, at.y, at.w, profiles, cotangents, leaf,
                                              param_grads=param_grads)
        return (dx, dy, dw), params

    def add_level_vjp(self, xp, grads, level, profiles, cotangents, orders, *, param_grads):
        dx, dy, dw = grads
        # the left blocks' value gradients added into the leaves' by the pull-back itself: block
        # pair r's left block starts at position 2 r size of the flattened positions
        pdx, pdy, _, params = self.vjp(level.qs, level.keys, level.vals, profiles, cotangents, xp=xp,
                                       param_grads=param_grads, dw_into=(dw, 2 * level.size * dw.shape[-1], 0),
                                       orders=orders)
        return (_add_into(dx, pdx, 0, right=True), _add_into(dy, pdy, 0, right=False), dw), params

    def position_grads(self, xp, grads):
        return grads
