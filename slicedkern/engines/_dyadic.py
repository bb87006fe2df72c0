"""Causal attention as a divide and conquer over positions, written once for every engine that has one.

docs/mathematics.rst, "Causal attention" has the derivation. Queries and keys sit on the positions
``0 .. n - 1`` (:class:`~slicedkern.engines._causal_grid.CausalGrid`, ``n`` a power of two). The set of
keys a query at position ``p`` sees, ``{j <= p}``, splits into dyadic blocks: at level ``l`` the
positions pair into blocks ``(2c, 2c + 1)`` of ``2**l`` positions, and the queries of every right
block see all the keys of its left block. So

* at each level, the keys of all left blocks are sorted and scanned and the queries of the right
  blocks search them: **one** call of non-causal machinery with the blocks as an extra batch axis,
  ``O(n log n)`` work;
* the pairs inside the blocks of the lowest levels (``leaf`` positions, the key at or before the
  query) are summed densely, cheaper there than sorting a few keys;
* per query, the sums of every level add up to the sums over the keys it sees; the running totals of
  the values and of the valid-key indicator (for the running mean and the count) are one cumulative
  sum.

``O(n log^2 n)`` work in all, static shapes and ``log2 n`` Python steps (no loop over tokens), so it
traces under ``jax.jit``. The backward is the same decomposition over the levels' pull-backs.

This module owns the decomposition: which positions form a level's blocks, which queries see which
keys, and how the parameters' gradients of the levels add up. What sums one level, and pulls it back,
is a :class:`LevelKernels`: :data:`ARRAY_LEVELS` (the sort-scan of :mod:`.sortscan` with the blocks as
a batch axis, and the dense leaves of :mod:`.sortscan.leaves`; every backend, the scan engine's), or
an engine's own kernels (:class:`slicedkern.engines.triton._causal.TritonLevels`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Protocol

from .._lib.namespace import array_device, as_work
from ..kernels import Profile, is_fixed
from ._causal_grid import CausalGrid, running_sum, screen_causal
from ._columns import map_parts
from ._combine import combine, empty_attention
from ._vjp import Form, Inputs
from .sortscan.leaves import blocks, leaf_sums, leaf_vjp, unblock
from .sortscan.pullback import profiles_vjp
from .sortscan.sums import profile_sums, queries, sort_keys
from .sortscan.wide import Pair, Plain, arithmetic, power_of_two_scaled, unscaled

__all__ = ["ARRAY_LEVELS", "ArrayLevels", "Level", "LevelKernels", "Positions", "causal_attention",
           "causal_profile_sums", "causal_profiles_vjp"]


class Positions(NamedTuple):
    """A causal call's inputs on the positions of its :class:`CausalGrid`: the queries ``x`` and keys
    ``y`` (..., n), the values ``w`` (..., n, c) (or, in a backward, a
    :class:`~slicedkern.engines._columns.MaskedValues`) and the valid-key indicator ``take`` (..., n)
    bool (None in a backward)."""

    x: Any
    y: Any
    w: Any
    take: Any


class Level(NamedTuple):
    """One level's inputs, blocks of ``size`` positions paired as ``P`` left-right pairs: the right
    blocks' queries ``qs`` and the left blocks' keys ``keys`` (..., P, size), values ``vals``
    (..., P, size, c) and indicator ``kept`` (..., P, size) (None in a backward)."""

    size: int
    qs: Any
    keys: Any
    vals: Any
    kept: Any


class LevelKernels(Protocol):
    """What sums and pulls back the levels of the divide and conquer: one engine's kernels.

    The running sums (forward) and gradients (backward) on the positions are the kernels' own state,
    passed from call to call: the array-API kernels keep them in blocks and join the pairs as the
    blocks grow, the triton kernels keep one array on the positions and add into it in place. The
    decomposition never looks inside. Profiles given to a level have their array parameters with a
    trailing block axis; the parameters' gradients a level returns have it too (summed here).
    Double-float work (a backend without float64) always runs on :data:`ARRAY_LEVELS`.
    """

    #: positions per dense leaf block in float64 work (double-float work has leaves of one)
    leaf: int
    #: the forward's values reach :meth:`leaves` and :meth:`add_level` in their own dtype (kernels
    #: that sum float32 / half tiles into float64 carries), the backward's likewise
    native_values: bool
    #: the kernels read a value only where ``take`` is True, so the forward hands them the values
    #: as given, with no copy zeroed on the keys that take no part
    masked_values: bool

    def orders(self, xp, at: Positions, leaf: int) -> Iterator[Any]:
        """Per level, smallest blocks first, what :meth:`add_level` / :meth:`add_level_vjp` take as
        ``orders``: the level's sorted keys and queries, or None (each level sorts its own)."""

    def leaves(self, xp, ar, at: Positions, profiles: Sequence[Profile], leaf: int) -> Any:
        """The running sums after the dense leaves: per position ``p``, ``sum_{j <= p in p's block,
        take_j} f(x_p - y_j) [w_j | 1]`` over each profile's columns (column ``c`` the indicator)."""

    def add_level(self, xp, ar, sums, level: Level, profiles: Sequence[Profile], orders) -> Any:
        """The running sums with one level's added: each right block's queries over its left block."""

    def position_sums(self, xp, ar, sums) -> list:
        """The running sums as one wide (..., n, c_p) value of ``ar`` per profile, on the positions."""

    def combine(self, xp, ar, grid: CausalGrid, sums, at: Positions, good, form: Form, dtype) -> tuple:
        """``(out (..., lq, dv), relu_count (..., lq, 1), den (..., lq, 1) or None)`` from the running
        sums, as :func:`slicedkern.engines._combine.combine` gives them from the sums read at the
        queries and the running totals of ``[w take | take]`` (the counts and ``den`` in the work
        dtype; ``out`` in the work dtype or, where the kernels write it so, in ``dtype``)."""

    def leaves_vjp(self, xp, at: Positions, profiles, cotangents, leaf: int, *, param_grads: bool) -> tuple:
        """``(grads, params)``: the running gradients after the pull-back of the dense leaves, and
        per profile ``(dknots, dcoeffs)`` as
        :func:`slicedkern.engines.sortscan.pullback.profiles_vjp` returns them."""

    def add_level_vjp(self, xp, grads, level: Level, profiles, cotangents, orders, *, param_grads: bool) -> tuple:
        """``(grads, params)``: the running gradients with one level's pull-back added (the queries'
        into the right blocks, the keys' and values' into the left), and the level's parameter
        gradients; ``cotangents`` the right blocks' (..., P, size, c_p)."""

    def position_grads(self, xp, grads) -> tuple:
        """``(dx, dy (..., n), dw (..., n, c))`` on the positions from the running gradients."""


def each(ar, fn, value):
    """``fn`` applied to a wide value: to both parts of a double-float pair."""
    if isinstance(value, Pair):
        return Pair(fn(value.hi), fn(value.lo))
    return fn(value)


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
    count, size = shape[ndim - 2 - core], shape[ndim - 1 - core]
    axis = len(lead) + 1
    rest = (slice(None),) * (1 + core)
    paired = each(ar, lambda a: xp.reshape(a, lead + (count // 2, 2, size) + tail), acc)
    first = each(ar, lambda a: a[(..., slice(0, 1)) + rest], paired)
    second = each(ar, lambda a: a[(..., slice(1, 2)) + rest], paired)
    part = each(ar, lambda a: xp.expand_dims(a, axis=axis), part)
    if right:
        second = ar.add(second, part)
    else:
        first = ar.add(first, part)

    def join(a, b):
        return xp.reshape(xp.concat([a, b], axis=axis), lead + (count // 2, 2 * size) + tail)

    if isinstance(first, Pair) or isinstance(second, Pair):
        first, second = (v if isinstance(v, Pair) else ar.lift(v) for v in (first, second))
        return Pair(join(first.hi, second.hi), join(first.lo, second.lo))
    return join(first, second)


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


class ArrayLevels:
    """The levels on the array API (:class:`LevelKernels`): each level one call of the sort-scan
    (:mod:`.sortscan.sums`, :mod:`.sortscan.pullback`) with the blocks as a batch axis, the leaves
    dense (:mod:`.sortscan.leaves`), the running sums kept in blocks and joined in pairs as the
    blocks grow (no in-place update, so that it traces under ``jax.jit``)."""

    #: a (16, 16) block product costs less than sorting four levels of blocks of 1 to 8 keys
    leaf = 16
    native_values = False
    masked_values = False

    def orders(self, xp, at, leaf):
        while True:
            yield None

    def leaves(self, xp, ar, at, profiles, leaf):
        work = at.x.dtype
        weights = xp.concat([xp.astype(at.w, work), xp.astype(at.take, work)[..., None]], axis=-1)
        return [ar.lift(blocks(xp, s, leaf, 1)) for s in leaf_sums(xp, at.x, at.y, weights, profiles, leaf)]

    def add_level(self, xp, ar, sums, level, profiles, orders):
        sk = sort_keys(level.keys, level.vals, xp=xp, ar=ar, take=level.kept, ones=True)
        parts = profile_sums(queries(level.qs, sk, ar=ar), sk, profiles, xp=xp, ar=ar, strict=True)
        return [_add_level(xp, ar, acc, part, 1, right=True) for acc, part in zip(sums, parts)]

    def position_sums(self, xp, ar, sums):
        return [each(ar, lambda a: unblock(xp, a, 1), acc) for acc in sums]

    def combine(self, xp, ar, grid, sums, at, good, form, dtype):
        sums = self.position_sums(xp, ar, sums) + [_running_totals(xp, ar, at.w, at.take, at.x.dtype)]
        num_r, *den, totals = [each(ar, lambda a: grid.at_queries(xp, a, axis=-2), s) for s in sums]
        return combine(xp, ar, num_r, den[0] if den else None, totals, good, center=form.center,
                       normalizer=form.normalizer, dv=at.w.shape[-1])

    def leaves_vjp(self, xp, at, profiles, cotangents, leaf, *, param_grads):
        dx, dy, dw, params = leaf_vjp(xp, at.x, at.y, at.w, profiles, cotangents, leaf, param_grads=param_grads)
        return (blocks(xp, dx, leaf, 0), blocks(xp, dy, leaf, 0), blocks(xp, dw, leaf, 1)), params

    def add_level_vjp(self, xp, grads, level, profiles, cotangents, orders, *, param_grads):
        pdx, pdy, pdw, params = profiles_vjp(level.qs, level.keys, level.vals, profiles, cotangents, xp=xp,
                                             param_grads=param_grads)
        plain = Plain(xp)          # the pull-backs are plain arrays, whatever the work arithmetic
        dx, dy, dw = grads
        return (_add_level(xp, plain, dx, pdx, 0, right=True), _add_level(xp, plain, dy, pdy, 0, right=False),
                _add_level(xp, plain, dw, pdw, 1, right=False)), params

    def position_grads(self, xp, grads):
        dx, dy, dw = grads
        return unblock(xp, dx, 0), unblock(xp, dy, 0), unblock(xp, dw, 1)


#: the levels of every backend: the scan engine's, and every engine's in double-float work
ARRAY_LEVELS = ArrayLevels()


def _levels_for(ar, levels: LevelKernels) -> LevelKernels:
    """An engine's kernels keep float64 carries: double-float work takes :data:`ARRAY_LEVELS`."""
    return ARRAY_LEVELS if ar.wide else levels


def _leaf_size(ar, n: int, levels: LevelKernels) -> int:
    """Double-float work keeps every sum in wide arithmetic: its leaves are the single positions."""
    return 1 if ar.wide else min(levels.leaf, n)


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


def _level(xp, at: Positions, size: int) -> Level:
    """The level of blocks of ``size`` positions: the right blocks' queries over the left blocks'
    keys, values (an array, or its unevaluated parts, :mod:`._columns`) and indicator (None in a
    backward)."""
    keys, _ = _halves(xp, at.y, size, 0)
    _, qs = _halves(xp, at.x, size, 0)
    vals = map_parts(lambda a, core: _halves(xp, a, size, core)[0], at.w, 1)
    kept = None if at.take is None else _halves(xp, at.take, size, 0)[0]
    return Level(size, qs, keys, vals, kept)


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


def _causal_sums(xp, ar, at: Positions, profiles, levels: LevelKernels):
    """The running sums of ``at`` over every level (the kernels' state; :meth:`LevelKernels.leaves`)."""
    n = at.x.shape[-1]
    leaf = _leaf_size(ar, n, levels)
    sums = levels.leaves(xp, ar, at, profiles, leaf)
    expand = _per_block({})
    blocked = [expand(p) for p in profiles]
    orders = levels.orders(xp, at, leaf)
    for size in _block_sizes(n, leaf):
        sums = levels.add_level(xp, ar, sums, _level(xp, at, size), blocked, next(orders))
    return sums


def causal_attention(inputs: Inputs, form: Form, *, xp, levels: LevelKernels = ARRAY_LEVELS):
    """Causal normalised kernel attention on ``levels``: ``(out, aux)`` as
    :func:`slicedkern.engines.scan._compose.attention` returns them, per query over the keys it sees.

    Parameters
    ----------
    inputs : Inputs
        ``q`` (..., lq) and ``k`` (..., lk) in the work dtype, ``v`` (..., lk, dv) in any float
        dtype, ``key_mask`` (..., lk) bool or None; query ``i`` sees the valid keys ``j <= i + lk - lq``.
    form : Form
        The value profile, the normaliser and the centring.

    Examples
    --------
    >>> import numpy as np
    >>> from array_api_compat import numpy as xp
    >>> from slicedkern._spec import Normalizer
    >>> from slicedkern.engines._vjp import Form, Inputs
    >>> from slicedkern.kernels import Profile
    >>> relu = Profile([0.0], [1.0])
    >>> q = k = np.array([0.0, 1.0, 2.0])
    >>> v = np.array([[1.0], [2.0], [4.0]])
    >>> out, aux = causal_attention(Inputs(q, k, v, None), Form(relu, Normalizer("count"), False), xp=xp)
    >>> out[:, 0].tolist()         # query 1 sees keys 0, 1: (1 * 1 + 0 * 2) / 2; query 2: (2 + 2 + 0) / 3
    [0.0, 0.5, 1.3333333333333333]
    """
    (q, k, v, key_mask), (profile, normalizer, _) = inputs, form
    lq, lk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    if lq == 0 or lk == 0:
        return empty_attention(xp, q, k, v, key_mask)
    ar = arithmetic(xp, q.dtype)
    levels = _levels_for(ar, levels)
    v, unscale = power_of_two_scaled(xp, ar, v)
    grid = CausalGrid(lq, lk)
    sc = screen_causal(xp, grid, q, k, v, key_mask, zero_values=not levels.masked_values)
    fill = sc.k[..., -1:]
    at = Positions(grid.queries(xp, sc.q, fill), grid.keys(xp, sc.k, fill),
                   grid.keys(xp, sc.v if levels.native_values else xp.astype(sc.v, q.dtype), 0.0, axis=-2),
                   grid.keys(xp, sc.take, False))
    profiles = [profile.with_(columns=slice(0, dv + 1))]
    if normalizer.summed:
        profiles.append(normalizer.profile.with_(columns=slice(dv, dv + 1)))
    sums = _causal_sums(xp, ar, at, profiles, levels)
    out, relu_count, raw_den = levels.combine(xp, ar, grid, sums, at, sc.good, form, v.dtype)
    aux = {"take": sc.take, "relu_count": relu_count}
    if raw_den is not None:
        aux["den"] = raw_den
    return unscaled(out, unscale), aux


def causal_profile_sums(x, y, w, profiles, *, xp, levels: LevelKernels = ARRAY_LEVELS):
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
    levels = _levels_for(ar, levels)
    w, unscale = power_of_two_scaled(xp, ar, w)
    grid = CausalGrid(lq, lk)
    fill = y[..., -1:]
    at = Positions(grid.queries(xp, x, fill), grid.keys(xp, y, fill),
                   grid.keys(xp, as_work(xp, w, x.dtype), 0.0, axis=-2),
                   grid.keys(xp, xp.ones(y.shape, dtype=xp.bool, device=array_device(y)), False))
    sums = levels.position_sums(xp, ar, _causal_sums(xp, ar, at, profiles, levels))
    return [unscaled(grid.at_queries(xp, ar.value(s), axis=-2), unscale) for s in sums]


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


def causal_profiles_vjp(x, y, w, profiles, cotangents, *, xp, param_grads=True,
                        levels: LevelKernels = ARRAY_LEVELS):
    """The pull-back of causal profile sums ``S_i = sum_{j <= p_i} f(x_i - y_j) w_j``.

    Parameters
    ----------
    x : array, shape (..., lq); y : array, shape (..., lk); w : array, shape (..., lk, c)
        Finite, in the work dtype, ``w`` zero on the keys that take no part; query ``i`` sits at
        position ``i + lk - lq``. Levels that read the values in their own dtype
        (:attr:`LevelKernels.native_values`) may take ``w`` as a
        :class:`~slicedkern.engines._columns.MaskedValues` (then ``dw`` has its values' columns).
    profiles : sequence of Profile
    cotangents : sequence of arrays, shapes (..., lq, c_p)
        Or, on such levels, :class:`~slicedkern.engines._columns.ScaledRows`.

    Returns
    -------
    ``(dx (..., lq), dy (..., lk), dw (..., lk, c), [(dknots, dcoeffs)] per profile)`` as
    :func:`slicedkern.engines.sortscan.pullback.profiles_vjp` returns them: the levels' pull-backs
    (each one call with the blocks as a batch axis) and the leaves', added on the positions.
    """
    lq, lk = x.shape[-1], y.shape[-1]
    grid = CausalGrid(lq, lk)
    ar = arithmetic(xp, x.dtype)
    levels = _levels_for(ar, levels)
    fill = y[..., -1:]
    # weights and cotangents left unevaluated (._columns) are padded and halved part by part
    wk = map_parts(lambda a, core: grid.keys(xp, a, 0.0 if core else False, axis=-1 - core),
                   w if levels.native_values else as_work(xp, w, x.dtype), 1)
    gq = [map_parts(lambda a, core: grid.queries(xp, a, 0.0, axis=-2), g, 1) for g in cotangents]
    at = Positions(grid.queries(xp, x, fill), grid.keys(xp, y, fill), wk, None)
    leaf = _leaf_size(ar, grid.n, levels)
    grads, params = levels.leaves_vjp(xp, at, profiles, gq, leaf, param_grads=param_grads)
    params = _add_params(None, params, lambda a: a)
    expand = _per_block({})
    blocked = [expand(p) for p in profiles]
    orders = levels.orders(xp, at, leaf)
    for size in _block_sizes(grid.n, leaf):
        gs = [map_parts(lambda a, core: _halves(xp, a, size, core)[1], g, 1) for g in gq]
        grads, part = levels.add_level_vjp(xp, grads, _level(xp, at, size), blocked, gs, next(orders),
                                           param_grads=param_grads)
        params = _add_params(params, part, lambda a: xp.sum(a, axis=-1))
    dx, dy, dw = levels.position_grads(xp, grads)
    return grid.at_queries(xp, dx), dy[..., :lk], dw[..., :lk, :], params
