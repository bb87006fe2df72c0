"""Causal attention on the scan: a divide and conquer over positions, every level one batched call.

docs/mathematics.rst, "Causal attention" has the derivation. Queries and keys sit on the positions
``0 .. n - 1`` (:class:`~slicedkern.engines._causal_grid.CausalGrid`, ``n`` a power of two). The set of
keys a query at position ``p`` sees, ``{j <= p}``, splits into dyadic blocks: at level ``l`` the
positions pair into blocks ``(2c, 2c + 1)`` of ``2**l`` positions, and the queries of every right
block see all the keys of its left block. So

* at each level, the keys of all left blocks are sorted and scanned and the queries of the right
  blocks search them: **one** call of the non-causal machinery
  (:mod:`slicedkern.engines.sortscan.sums`) with the blocks as an extra batch axis, ``O(n log n)``
  work;
* the pairs inside the blocks of the lowest levels (``leaf`` positions, the key at or before the
  query) are summed densely (:mod:`._leaf`), cheaper there than sorting a few keys;
* per query, the sums of every level add up (in the wide arithmetic of
  :mod:`slicedkern.engines.sortscan.wide`) to the sums over the keys it sees; the running
  totals of the values and of the valid-key indicator (for the running mean and the count) are one
  cumulative sum.

``O(n log^2 n)`` work in all, static shapes and ``log2 n`` Python steps (no loop over tokens), so it
traces under ``jax.jit``. The backward is the same decomposition over the levels' VJPs.

The decomposition is written once here; what sums a level (and pulls it back) is a :class:`Levels`:
the scan's own (:data:`SCAN_LEVELS`), or another engine's non-causal kernels with the blocks as
rows (the triton engine's, :mod:`slicedkern.engines.triton`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from ..._lib.namespace import array_device, as_work
from ..._spec import Normalizer
from ...kernels import Profile, is_fixed
from .._causal_grid import CausalGrid, running_sum, screen_causal
from .._columns import map_parts
from .._combine import combine
from ..sortscan.pullback import profiles_vjp
from ..sortscan.sums import profile_sums, queries, sort_keys
from ..sortscan.wide import Pair, Plain, arithmetic
from ._compose import _power_of_two_scaled, _unscaled
from ._compose import attention as noncausal_attention
from ._leaf import blocks, leaf_sums, leaf_vjp, unblock

__all__ = ["Levels", "SCAN_LEVELS", "causal_attention", "causal_profile_sums", "causal_profiles_vjp", "each"]

#: Positions per dense leaf block in float64 work (a (16, 16) block product costs less than sorting
#: four levels of blocks of 1 to 8 keys). Double-float work keeps every sum in wide arithmetic: its
#: leaves are the single positions (a query and the key at its own position).
LEAF = 16


def each(ar, fn, value):
    """``fn`` applied to a wide value: to both parts of a double-float pair."""
    if isinstance(value, Pair):
        return Pair(fn(value.hi), fn(value.lo))
    return fn(value)


def _scan_level_sums(xp, ar, qs, keys, vals, kept, profiles):
    """One level on the scan: the left blocks' keys sorted and scanned, the right blocks' queries
    searched, the blocks a batch axis; one wide (..., P, s, c_p) value per profile."""
    sk = sort_keys(keys, vals, xp=xp, ar=ar, take=kept, ones=True)
    return profile_sums(queries(qs, sk, ar=ar), sk, profiles, xp=xp, ar=ar, strict=True)


class Levels(NamedTuple):
    """The non-causal machinery a causal call runs at each level of its divide and conquer.

    ``sums(xp, ar, qs, keys, vals, kept, profiles)``: the profile sums of the queries ``qs`` (..., P,
    s) over the keys ``keys`` (..., P, s) with weights ``vals`` (..., P, s, c) and the indicator column
    ``kept`` (..., P, s) appended as column ``c``, block ``p`` over block ``p``, strict; one wide
    value of ``ar`` (..., P, s, c_p) per profile (profiles with their array parameters given a
    trailing block axis). ``vjp(x, y, w, profiles, cotangents, *, xp, param_grads)``: the pull-back
    of such sums without the indicator, as ``Engine.profiles_vjp``. ``leaf``: positions per dense
    leaf block in float64 work (None: :data:`LEAF`); double-float work always has leaves of one.
    ``native_values``: attention's forward gives ``sums`` the values in their own dtype (kernels
    that sum float32 / half tiles into float64 carries), not cast to the work dtype, and the
    backward gives ``vjp`` and ``leaves_vjp`` its weights so.
    ``orders(xp, x, y, leaf)``: an iterator over the levels, smallest blocks first, of the sorted
    orders each level's ``sums`` and ``vjp`` then take as ``orders=`` (the left blocks' sorted keys
    and the right blocks' sorted queries, with their permutations), so that the levels sort
    nothing themselves (the triton engine's bottom-up merge sort); None: each level sorts its own.
    ``leaves(xp, x, y, w, take, profiles, leaf)``: the dense leaves' sums (as :func:`._leaf.leaf_sums`
    of ``[w | take]``, ``w`` in its own dtype), one plain (..., n, c_p) array per profile, float64
    or (for values of float32 or narrower) float32 (float64 work only; None: :func:`._leaf.leaf_sums`).
    ``sums_into(xp, qs, keys, vals, kept, profiles, accs, orders=None)``: ``sums`` added in place to
    the running sums ``accs`` (one plain (..., n, c_p) array per profile on the positions, as
    ``leaves`` gives them; float64 work only), returning them, so that no level's sums are written
    apart (the triton engine's); None: ``sums``, added to copies.
    ``leaves_vjp(xp, x, y, w, profiles, cotangents, leaf, *, param_grads)``: the pull-back of the
    dense leaves' sums, as :func:`._leaf.leaf_vjp` (its ``dw`` float32 for values of float32 or
    narrower; float64 work only; None: that function).
    ``combine(xp, grid, num, den, w, take, good, *, center, normalizer, dtype)``: attention's output
    (..., lq, dv) in ``dtype`` from the plain running sums on the positions and the values ``w``
    and indicator ``take`` there, whose running totals it sums itself, as
    :func:`slicedkern.engines._combine.combine` gives it from those sums and totals read at the
    queries (float64 work only; None: that function).
    ``mutable``: the engine's arrays take in-place additions (torch's), so that the backward adds
    each level's pull-backs into the leaves' gradients on the positions rather than joining copies
    of them (:func:`_add_level_into`; float64 work only); its ``vjp`` then also takes ``dw_into =
    (acc, row_stride, offset)`` and adds the values' gradient there itself (as
    :meth:`slicedkern.engines.triton.TritonEngine.profiles_vjp` says), returning None for it.
    ``masked_values``: ``leaves``, ``sums_into`` and ``combine`` read a value only where ``take`` is
    True (masked loads), so attention's forward hands them the values as given, with no copy
    zeroed on the keys that take no part (float64 work only).
    """

    sums: Callable
    vjp: Callable
    leaf: int | None = None
    native_values: bool = False
    orders: Callable | None = None
    sums_into: Callable | None = None
    leaves: Callable | None = None
    leaves_vjp: Callable | None = None
    combine: Callable | None = None
    mutable: bool = False
    masked_values: bool = False


def _level_orders(xp, levels: Levels, x, y, leaf: int):
    """Per level, the keyword arguments that pass it its sorted orders (:attr:`Levels.orders`)."""
    if levels.orders is None:
        while True:
            yield {}
    for orders in levels.orders(xp, x, y, leaf):
        yield {"orders": orders}


#: The scan's own levels: :mod:`slicedkern.engines.sortscan` with the blocks as a batch axis.
SCAN_LEVELS = Levels(_scan_level_sums, profiles_vjp)


def _leaf_size(ar, n: int, levels: Levels) -> int:
    return 1 if ar.wide else min(levels.leaf or LEAF, n)


def _block_sizes(n: int, leaf: int):
    """Block sizes ``2**l`` of the levels above the leaves, smallest first."""
    size = leaf
    while size < n:
        yield size
        size *= 2


def _halves(xp, a, size: int, core: int):
    """(..., n, *core) -> the left and right blocks of ``size`` positions: (..., n / 2size, size, *core)."""
    lead = tuple(a.shape[:a.ndim - 1 - core])
    n = a.shape[a.ndim - 1 - core]
    tail = tuple(a.shape[a.ndim - core:])
    paired = xp.reshape(a, lead + (n // (2 * size), 2, size) + tail)
    index = (slice(None),) * (1 + core)
    return paired[(..., 0) + index], paired[(..., 1) + index]


def _add_level(xp, ar, acc, part, core: int, right: bool):
    """Add a level's sums to the running sums of its blocks, and join the blocks in pairs.

    ``acc`` (..., 2P, s, *core) holds the sums of the blocks of ``s`` positions; ``part`` (..., P, s,
    *core) the level's sums for the right (``right``) or the left block of every pair; both wide
    values of ``ar`` (plain arrays for the backward). Returns (..., P, 2s, *core). Only the receiving
    half is added to, and the pairs are joined by one concatenation: no zero-filled half is written.
    """
    shape = (acc.hi if isinstance(acc, Pair) else acc).shape
    ndim = len(shape)
    lead, tail = tuple(shape[:ndim - 2 - core]), tuple(shape[ndim - core:])
    blocks, size = shape[ndim - 2 - core], shape[ndim - 1 - core]
    axis = len(lead) + 1
    rest = (slice(None),) * (1 + core)
    paired = each(ar, lambda a: xp.reshape(a, lead + (blocks // 2, 2, size) + tail), acc)
    first = each(ar, lambda a: a[(..., slice(0, 1)) + rest], paired)
    second = each(ar, lambda a: a[(..., slice(1, 2)) + rest], paired)
    part = each(ar, lambda a: xp.expand_dims(a, axis=axis), part)
    if right:
        second = ar.add(second, part)
    else:
        first = ar.add(first, part)

    def join(a, b):
        return xp.reshape(xp.concat([a, b], axis=axis), lead + (blocks // 2, 2 * size) + tail)

    if isinstance(first, Pair) or isinstance(second, Pair):
        first, second = (v if isinstance(v, Pair) else ar.lift(v) for v in (first, second))
        return Pair(join(first.hi, second.hi), join(first.lo, second.lo))
    return join(first, second)


def _add_level_into(acc, part, core: int, right: bool):
    """:func:`_add_level` in place, on plain arrays that take in-place additions: ``part`` (..., P,
    s, *core) added into the right (``right``) or left block of every pair of ``acc`` (..., n,
    *core), the running gradients on the positions (``n = 2 P s``); returns ``acc``."""
    shape = tuple(acc.shape)
    ndim = len(shape)
    lead, tail = shape[:ndim - 1 - core], shape[ndim - core:]
    pairs, size = part.shape[part.ndim - 2 - core], part.shape[part.ndim - 1 - core]
    paired = acc.reshape(lead + (pairs, 2, size) + tail)        # a view: acc is contiguous
    paired[(..., 1 if right else 0) + (slice(None),) * (1 + core)].add_(part)     # in place: no copy back
    return acc


def _per_block(cache: dict):
    """Profiles with their array parameters given a trailing axis (the blocks are a batch axis);
    the same array gets the same expansion, so that knots shared by two profiles are searched once."""
    def expand(value):
        if is_fixed(value):
            return value
        if id(value) not in cache:
            cache[id(value)] = (value, value[..., None])
        return cache[id(value)][1]

    def profile(p: Profile) -> Profile:
        return Profile([expand(t) for t in p.knots], [expand(c) for c in p.coeffs], expand(p.slope),
                       expand(p.intercept), p.columns, p.derivative, p.strict_knots)

    return profile


def _level_inputs(xp, x, y, w, take, size: int):
    """A level's ``(qs, keys, vals, kept)``: the right blocks' queries, the left blocks' keys,
    values and valid-key indicator, (..., P, size[, c])."""
    keys, _ = _halves(xp, y, size, 0)
    _, qs = _halves(xp, x, size, 0)
    vals, _ = _halves(xp, w, size, 1)
    kept, _ = _halves(xp, take, size, 0)
    return qs, keys, vals, kept


def causal_sums(xp, ar, x, y, w, take, profiles, levels: Levels = SCAN_LEVELS):
    """Per position ``p``, ``sum_{j <= p, take_j} f(x_p - y_j) [w_j, 1]`` for each profile (its columns).

    x, y (..., n) finite on the positions; w (..., n, c) zero where ``take`` (..., n) is False (any
    value there with ``levels.masked_values``), in the work dtype (or the values' own with
    ``levels.native_values``; the leaves cast it). Returns one wide (..., n, c_p) value per
    profile, the column of ones being column ``c``.
    """
    n = x.shape[-1]
    leaf = _leaf_size(ar, n, levels)
    work = x.dtype
    if levels.leaves is not None and not ar.wide:
        leaves = levels.leaves(xp, x, y, w, take, profiles, leaf)
    else:
        weights = xp.concat([xp.astype(w, work), xp.astype(take, work)[..., None]], axis=-1)
        leaves = leaf_sums(xp, x, y, weights, profiles, leaf)
    expand = _per_block({})
    blocked = [expand(p) for p in profiles]
    orders = _level_orders(xp, levels, x, y, leaf)
    if levels.sums_into is not None and not ar.wide:
        for size in _block_sizes(n, leaf):
            leaves = levels.sums_into(xp, *_level_inputs(xp, x, y, w, take, size), blocked, leaves, **next(orders))
        return [ar.lift(acc) for acc in leaves]
    sums = [ar.lift(blocks(xp, s, leaf, 1)) for s in leaves]
    for size in _block_sizes(n, leaf):
        level = levels.sums(xp, ar, *_level_inputs(xp, x, y, w, take, size), blocked, **next(orders))
        sums = [_add_level(xp, ar, acc, part, 1, right=True) for acc, part in zip(sums, level)]
    return [each(ar, lambda a: unblock(xp, a, 1), acc) for acc in sums]


def _running_totals(xp, ar, w, take, work):
    """Inclusive running sums of ``[w * take, take]`` over the positions: a wide (..., n, c + 1) in
    the ``work`` dtype, ``w`` in any float dtype (cast as it is summed)."""
    if not ar.wide:
        return running_sum(xp, xp.concat([w, xp.astype(take, w.dtype)[..., None]], axis=-1), axis=-2, dtype=work)
    w = as_work(xp, w, work)
    rows = xp.concat([w, xp.astype(take, work)[..., None]], axis=-1)
    # double-float: the scan's prefix table of a zero key gives the wide running sums of the weights
    zero = xp.zeros(take.shape, dtype=work, device=array_device(w))
    perm = xp.broadcast_to(xp.arange(take.shape[-1], device=array_device(w)), take.shape)
    table = ar.table(ar.lift(zero), rows, perm)
    return table[..., 1:, :rows.shape[-1]]


def causal_attention(q, k, v, profile: Profile, *, key_mask, center: bool, normalizer: Normalizer, xp,
                     levels: Levels = SCAN_LEVELS):
    """Causal normalised kernel attention: the scan engine's causal forward (another engine's with its
    ``levels``); ``(out, aux)`` as :func:`slicedkern.engines.scan._compose.attention` returns them,
    per query over the keys it sees."""
    lq, lk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    if lq == 0 or lk == 0:
        return noncausal_attention(q, k, v, profile, key_mask=key_mask, center=center, normalizer=normalizer,
                                   xp=xp)
    ar = arithmetic(xp, q.dtype)
    v, unscale = _power_of_two_scaled(xp, ar, v)
    grid = CausalGrid(lq, lk)
    sc = screen_causal(xp, grid, q, k, v, key_mask, zero_values=not (levels.masked_values and not ar.wide))
    fill = sc.k[..., -1:]
    x, y = grid.queries(xp, sc.q, fill), grid.keys(xp, sc.k, fill)
    w = grid.keys(xp, sc.v if levels.native_values else xp.astype(sc.v, q.dtype), 0.0, axis=-2)
    take = grid.keys(xp, sc.take, False)
    profiles = [profile.with_(columns=slice(0, dv + 1))]
    if normalizer.summed:
        profiles.append(normalizer.profile.with_(columns=slice(dv, dv + 1)))
    sums = causal_sums(xp, ar, x, y, w, take, profiles, levels)
    if levels.combine is not None and not ar.wide:
        den_sum = sums[1] if len(sums) > 1 else None
        out = levels.combine(xp, grid, sums[0], den_sum, w, take, sc.good, center=center, normalizer=normalizer,
                             dtype=v.dtype)
        # the running sums may be narrower than the work (the triton engine's float32 ones): the
        # backward's residuals are in the work dtype, as the scan's
        relu_count = xp.astype(grid.at_queries(xp, sums[0][..., dv:dv + 1], axis=-2), q.dtype, copy=False)
        raw_den = None if den_sum is None else xp.astype(grid.at_queries(xp, den_sum, axis=-2), q.dtype, copy=False)
    else:
        totals = _running_totals(xp, ar, w, take, q.dtype)
        on_queries = [each(ar, lambda a: grid.at_queries(xp, a, axis=-2), s) for s in sums + [totals]]
        num_r, den_sum, totals = on_queries[0], on_queries[1] if len(sums) > 1 else None, on_queries[-1]
        out, relu_count, raw_den = combine(xp, ar, num_r, den_sum, totals, sc.good, center=center,
                                           normalizer=normalizer, dv=dv)
    aux = {"take": sc.take, "relu_count": relu_count}
    if raw_den is not None:
        aux["den"] = raw_den
    return _unscaled(out, unscale), aux


def causal_profile_sums(x, y, w, profiles, *, xp, levels: Levels = SCAN_LEVELS):
    """Per query ``i`` of ``lq``, ``sum_{j <= i + lk - lq} f(x_i - y_j) w_j`` over each profile's columns.

    The forward of :func:`causal_profiles_vjp` (same arguments): ``x`` (..., lq) and ``y`` (..., lk)
    finite, ``w`` (..., lk, c) in the work dtype and zero on the keys that take no part. Returns one
    plain (..., lq, c_p) array per profile, in the work dtype. Unlike :func:`causal_attention` it
    combines nothing: the sums are additive over key ranges, so :mod:`slicedkern.distributed` adds
    them to other ranks' partial sums before combining.
    """
    lq, lk, c = x.shape[-1], y.shape[-1], w.shape[-1]
    spans = [range(c)[p.columns] for p in profiles]
    profiles = [p.with_(columns=slice(r.start, r.stop, r.step)) for p, r in zip(profiles, spans)]
    if lq == 0 or lk == 0:
        return [xp.zeros(x.shape + (len(r),), dtype=x.dtype, device=array_device(x)) for r in spans]
    ar = arithmetic(xp, x.dtype)
    w, unscale = _power_of_two_scaled(xp, ar, w)
    grid = CausalGrid(lq, lk)
    fill = y[..., -1:]
    xq, yk = grid.queries(xp, x, fill), grid.keys(xp, y, fill)
    wk = grid.keys(xp, as_work(xp, w, x.dtype), 0.0, axis=-2)
    take = grid.keys(xp, xp.ones(y.shape, dtype=xp.bool, device=array_device(y)), False)
    sums = causal_sums(xp, ar, xq, yk, wk, take, profiles, levels)
    return [_unscaled(grid.at_queries(xp, ar.value(s), axis=-2), unscale) for s in sums]


def _add_params(total, part, reduce):
    """Sum per-profile ``(dknots, dcoeffs)`` lists; ``reduce`` maps a part's entries first."""
    def plus(a, b):
        if b is None:
            return a
        b = reduce(b)
        return b if a is None else a + b
    if total is None:
        return [(tuple(plus(None, d) for d in dk), tuple(plus(None, d) for d in dc)) for dk, dc in part]
    return [(tuple(plus(a, b) for a, b in zip(tk, pk)), tuple(plus(a, b) for a, b in zip(tc, pc)))
            for (tk, tc), (pk, pc) in zip(total, part)]


def causal_profiles_vjp(x, y, w, profiles, cotangents, *, xp, param_grads=True, levels: Levels = SCAN_LEVELS):
    """The pull-back of causal profile sums ``S_i = sum_{j <= p_i} f(x_i - y_j) w_j``.

    Parameters
    ----------
    x : array, shape (..., lq); y : array, shape (..., lk); w : array, shape (..., lk, c)
        Finite, in the work dtype, ``w`` zero on the keys that take no part; query ``i`` sits at
        position ``i + lk - lq``. Levels that read the values in their own dtype
        (:attr:`Levels.native_values`) may take ``w`` as a
        :class:`~slicedkern.engines._columns.MaskedValues` (then ``dw`` has its values' columns).
    profiles : sequence of Profile
    cotangents : sequence of arrays, shapes (..., lq, c_p)
        Or, on such levels, :class:`~slicedkern.engines._columns.ScaledRows`.

    Returns
    -------
    ``(dx (..., lq), dy (..., lk), dw (..., lk, c), [(dknots, dcoeffs)] per profile)`` as
    :func:`slicedkern.engines.sortscan.pullback.profiles_vjp` returns them: the levels' pull-backs
    (each one call with the blocks as a batch axis) and the leaves' dense one, added on the positions.
    """
    lq, lk = x.shape[-1], y.shape[-1]
    grid = CausalGrid(lq, lk)
    ar = arithmetic(xp, x.dtype)
    n = grid.n
    fill = y[..., -1:]
    xq, yk = grid.queries(xp, x, fill), grid.keys(xp, y, fill)
    # the levels that read the values in their own dtype read the weights so (no work-dtype copy);
    # weights and cotangents left unevaluated (._columns) are padded and halved part by part
    native = levels.native_values and not ar.wide
    wk = map_parts(lambda a, core: grid.keys(xp, a, 0.0 if core else False, axis=-1 - core),
                   w if native else as_work(xp, w, x.dtype), 1)
    gq = [map_parts(lambda a, core: grid.queries(xp, a, 0.0, axis=-2), g, 1) for g in cotangents]
    leaf = _leaf_size(ar, n, levels)
    pullback = levels.leaves_vjp if levels.leaves_vjp is not None and not ar.wide else leaf_vjp
    dx, dy, dw, params = pullback(xp, xq, yk, wk, profiles, gq, leaf, param_grads=param_grads)
    mutable = levels.mutable and not ar.wide
    if not mutable:
        dx, dy, dw = blocks(xp, dx, leaf, 0), blocks(xp, dy, leaf, 0), blocks(xp, dw, leaf, 1)
    params = _add_params(None, params, lambda a: a)
    expand = _per_block({})
    blocked = [expand(p) for p in profiles]
    plain = Plain(xp)          # the pull-backs come back as plain arrays, whatever the work arithmetic
    orders = _level_orders(xp, levels, xq, yk, leaf)
    for size in _block_sizes(n, leaf):
        keys, _ = _halves(xp, yk, size, 0)
        _, qs = _halves(xp, xq, size, 0)
        vals = map_parts(lambda a, core: _halves(xp, a, size, core)[0], wk, 1)
        gs = [map_parts(lambda a, core: _halves(xp, a, size, core)[1], g, 1) for g in gq]
        if mutable:
            # the left blocks' value gradients added into the leaves' by the pull-back itself: block
            # pair r's left block starts at position 2 r size of the flattened positions
            pdx, pdy, _, pparams = levels.vjp(qs, keys, vals, blocked, gs, xp=xp, param_grads=param_grads,
                                              dw_into=(dw, 2 * size * dw.shape[-1], 0), **next(orders))
            dx, dy = _add_level_into(dx, pdx, 0, right=True), _add_level_into(dy, pdy, 0, right=False)
        else:
            pdx, pdy, pdw, pparams = levels.vjp(qs, keys, vals, blocked, gs, xp=xp, param_grads=param_grads,
                                                **next(orders))
            dx = _add_level(xp, plain, dx, pdx, 0, right=True)
            dy = _add_level(xp, plain, dy, pdy, 0, right=False)
            dw = _add_level(xp, plain, dw, pdw, 1, right=False)
        params = _add_params(params, pparams, lambda a: xp.sum(a, axis=-1))
    if not mutable:
        dx, dy, dw = unblock(xp, dx, 0), unblock(xp, dy, 0), unblock(xp, dw, 1)
    return (grid.at_queries(xp, dx), dy[..., :lk], dw[..., :lk, :], params)
