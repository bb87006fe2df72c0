"""The backward of ``kernel_sum`` and attention, written once over an engine's profile-sum VJPs.

An engine provides ``profiles_vjp(x, y, w, profiles, cotangents, *, xp, param_grads)`` (the pullback of
several profile sums of one ``(x, y, w)``) and ``indicator_sums(q, k, ones, profiles, *, xp)``, and an
engine with a causal mode ``causal_profiles_vjp`` (the same over the keys each query sees); this
module adds what every engine shares, written once for causal and non-causal attention: the NaN
policy, the quotient rule of the normaliser, the centering, and masks (docs/mathematics.rst, "The
backward pass" and "Causal attention").
"""

from __future__ import annotations

from .._lib.namespace import array_device, as_work
from .._spec import Normalizer
from ..backends import holds_everywhere
from ..kernels import Profile
from ._causal_grid import CausalGrid, running_sum, screen_causal
from ._columns import MaskedValues, ScaledRows
from ._combine import pullback, row_dot
from ._nanpolicy import sanitize_keys, screen

__all__ = ["kernel_sum_vjp", "attention_vjp", "attention_aux", "AllKeys", "SeenKeys", "add_params",
           "vanishes_where_normalizer_does"]


def kernel_sum_vjp(engine, x, y, w, profile: Profile, g, *, xp):
    """VJP of a kernel sum on ``engine``: ``(dx, dy, dw, (dknots, dcoeffs))``.

    A non-finite query contributes nothing to ``dy`` and ``dw`` (as in :func:`attention_vjp`).
    """
    x, y, w, q_ok, row_ok = sanitize_keys(xp, x, y, w, None)
    g = xp.where(q_ok[..., None], g, xp.zeros((), dtype=g.dtype, device=array_device(g)))
    dx, dy, dw, params = engine.profiles_vjp(x, y, w, [profile], [g], xp=xp)
    return (*_nan_rows(xp, dx, dy, dw, q_ok, row_ok), params[0])


def _nan_rows(xp, dx, dy, dw, q_ok, row_ok):
    nan = xp.asarray(float("nan"), dtype=dx.dtype, device=array_device(dx))
    return (xp.where(q_ok & row_ok[..., None], dx, nan), xp.where(row_ok[..., None], dy, nan),
            xp.where(row_ok[..., None, None], dw, nan))


class AllKeys:
    """Every query sees every valid key of its batch row (the non-causal ops).

    The NaN policy's screening (:func:`sanitize_keys`), the sums over the keys a query sees (one per
    batch row, (..., 1, c)), their adjoint, and the engine's profile-sum VJP. :class:`SeenKeys` is
    the same interface for causal attention, and :mod:`slicedkern.engines.sharded` has both over a
    shard of the keys.
    """

    #: whether the view's collectives need every rank to take the same branches (sharded views)
    collective = False
    #: whether the view's ``sums_vjp`` takes the silent rows (:func:`_silent_rows`) as a mask at the
    #: cost of one more pass 1, so that the backward reads nothing back to the host to skip them
    silent_as_mask = False
    #: whether the view's ``profiles_vjp`` takes attention's value columns and cotangent rows
    #: unevaluated (:class:`._columns.MaskedValues`, :class:`._columns.ScaledRows`), read by its
    #: engine's kernels in their own dtype, rather than as arrays formed by :func:`sums_vjp`
    lazy_columns = False

    def __init__(self, engine, q, k, v, key_mask, xp):
        sc = screen(xp, q, k, v, key_mask, defer=False)
        self.q, self.k, self.take, self.raw_v = sc.x, sc.y, sc.take, v
        self.good = sc.q_ok & sc.row_ok[..., None]    # (..., lq): the forward's row is not NaN
        self.row_bad = ~sc.row_ok                     # (...): every key's gradient is NaN
        self.engine, self.xp, self._v = engine, xp, None

    @property
    def v(self):
        """The values, zero on the keys that take no part (:func:`sanitize_keys`'s): made on first
        use, so that a view whose kernels skip those keys themselves never copies the values. (Not
        ``functools.cached_property``: its lock, before Python 3.12, stops ``torch.compile``.)"""
        if self._v is None:
            xp = self.xp
            zero = xp.asarray(0.0, dtype=self.raw_v.dtype, device=array_device(self.raw_v))
            self._v = xp.where(self.take[..., None], self.raw_v, zero)
        return self._v

    @v.setter
    def v(self, values):
        self._v = values

    def value_columns(self, xp, *, silent: bool):
        """``[v | take]`` (..., lk, Dv + 1), with ``silent`` ``[v | take | v]``: the columns whose
        profile sums attention's pull-back takes together (:func:`sums_vjp`), zero on the keys that
        take no part."""
        v = self.v
        return xp.concat([v, xp.astype(self.take, v.dtype)[..., None]] + ([v] if silent else []), axis=-1)

    def cotangent(self, xp, g):
        """The output's cotangent ``g`` (any float dtype) as this view's pull-back reads it: in the
        work dtype (an engine's view may read it in its own, :meth:`row_dot` and :meth:`to_keys`
        with it)."""
        return as_work(xp, g, self.q.dtype)

    def row_dot(self, xp, g, b):
        """``<g_i, b_i>`` per query, (..., lq, 1) in the work dtype: the quotient rule's row dots
        (:func:`._combine.row_dot`), ``g`` from :meth:`cotangent` and ``b`` (..., lq or 1, Dv)."""
        return row_dot(xp, g, b)

    def seen(self, xp, a):
        """``a`` (..., lk, c) summed over the keys each query sees: (..., 1, c) in the work dtype."""
        return xp.sum(a, axis=-2, keepdims=True, dtype=self.q.dtype)

    def totals(self, xp, *, values: bool):
        """``(count, value_sums)``: the valid keys each query sees and their values' sum (``None``
        unless ``values``), (..., lq or 1, 1) and (..., lq or 1, Dv) in the work dtype."""
        count = self.seen(xp, xp.astype(self.take, self.q.dtype)[..., None])
        return count, self.seen(xp, self.v) if values else None

    def to_keys(self, xp, weights, g):
        """The adjoint of :meth:`seen` applied to ``weights * g`` ((..., lq, 1) and (..., lq, c)), with
        no (lq, c) temporary: (..., 1, c). What :meth:`finish_dv` subtracts (an engine's view may
        return it unevaluated, for its ``finish_dv`` to fuse)."""
        return xp.matrix_transpose(weights) @ g

    def finish_dv(self, xp, dv, dv_sub, dv_factor):
        """``(dv - dv_sub) * dv_factor``: the pulled-back value sums ``dv`` (..., lk, Dv) less the
        centring mean's cotangent ``dv_sub`` (from :meth:`to_keys`, or None), times the keys'
        factor ``dv_factor`` (..., lk, 1) (0 on keys that take no part, NaN on bad rows)."""
        return (dv if dv_sub is None else dv - dv_sub) * dv_factor

    def profiles_vjp(self, x, y, w, profiles, cotangents, *, xp, param_grads=True):
        """The engine's pull-back of the profile sums over the keys each query sees."""
        return self.engine.profiles_vjp(x, y, w, profiles, cotangents, xp=xp, param_grads=param_grads)

    def finished_vjp(self, xp, w, profiles, cotangents, dv_sub, dv_factor):
        """:meth:`profiles_vjp` of this view's scores and the value columns ``w``, with the values'
        gradient (its first Dv columns) finished by :meth:`finish_dv`: ``(dq, dk, dv, params)``
        (an engine's view may fuse the finish into its pull-back)."""
        dq, dk, dw, params = self.profiles_vjp(self.q, self.k, w, profiles, cotangents, xp=xp)
        return dq, dk, self.finish_dv(xp, dw[..., :self.raw_v.shape[-1]], dv_sub, dv_factor), params

    def sums_vjp(self, profile, normalizer, gout, cot, silent, *, center: bool, dv_sub, dv_factor, xp):
        """The pull-back of attention's sums (:func:`sums_vjp`; an engine's view may fuse it)."""
        return sums_vjp(self, profile, normalizer, gout, cot, silent, center=center, dv_sub=dv_sub,
                        dv_factor=dv_factor, xp=xp)


class SeenKeys(AllKeys):
    """Query ``i`` sees the valid keys ``j <= i + lk - lq`` (causal attention; docs/mathematics.rst,
    "Causal attention"): the interface of :class:`AllKeys` with running sums over the positions, the
    causal NaN rule, and the engine's causal profile-sum VJP."""

    def __init__(self, engine, q, k, v, key_mask, xp):
        self.grid = CausalGrid(q.shape[-1], k.shape[-1])
        sc = screen_causal(xp, self.grid, q, k, v, key_mask, zero_values=False)
        self.q, self.k, self.take, self.good = sc.q, sc.k, sc.take, sc.good
        self.row_bad = sc.row_bad
        # the values zeroed on the keys that take no part are made on first use (AllKeys.v)
        self.raw_v, self.engine, self.xp, self._v = v, engine, xp, None

    def seen(self, xp, a):
        """Running sums of ``a`` (..., lk, c) read at each query's position: (..., lq, c), work dtype."""
        return self.grid.at_queries(xp, running_sum(xp, a, axis=-2, dtype=self.q.dtype), axis=-2)

    def to_keys(self, xp, weights, g):
        """The adjoint of :meth:`seen` applied to ``weights * g``: (..., lk, c)."""
        return self.rows_to_keys(xp, weights * g)

    def rows_to_keys(self, xp, rows):
        """The adjoint of :meth:`seen` on per-query ``rows`` (..., lq, c): a key receives the rows of
        every query at or after its position (a reverse running sum), (..., lk, c)."""
        return running_sum(xp, self.grid.queries_to_keys(xp, rows), axis=-2, reverse=True)

    def profiles_vjp(self, x, y, w, profiles, cotangents, *, xp, param_grads=True):
        return self.engine.causal_profiles_vjp(x, y, w, profiles, cotangents, xp=xp, param_grads=param_grads)


def attention_vjp(engine, q, k, v, profile: Profile, gout, out, aux, *, key_mask, center, normalizer: Normalizer,
                  causal=False, xp):
    """VJP of attention on ``engine``; with ``causal``, of causal attention (docs/mathematics.rst,
    "Causal attention"), on an engine that has ``causal_profiles_vjp``.

    ``gout`` is the output's cotangent in any float dtype (the view lifts it to the work dtype, or
    reads it in its own: :meth:`AllKeys.cotangent`), ``out`` the forward output and ``aux`` the
    per-query residuals it returned (``relu_count``:
    the profile summed over the valid-key indicator; ``den``: the unclamped normaliser sum), or
    ``None`` (the sweep keeps none): then they are recomputed here, one sort-scan of one column each.
    Returns ``(dq, dk, dv, (dknots, dcoeffs))``.

    The keys each query sees are the engine's :meth:`~slicedkern.engines._base.Engine.key_view`
    (every key, the causal prefix, or a shard of either); the quotient rule is :func:`._combine.pullback`,
    and the view pulls the sums back (:meth:`AllKeys.sums_vjp`: :func:`sums_vjp`, or an engine's fused
    form). The centring mean's cotangent goes back to the keys through the view's adjoint of its sums.
    NaN where the forward's output was: on bad queries, and on every key of a batch row with a bad key
    (causal: of a batch row in which some query saw a bad key).
    """
    work = q.dtype
    if q.shape[-1] == 0 or k.shape[-1] == 0:
        # no query or no key: causal and non-causal attention are the same (zero) map, as the causal
        # forwards' own early returns have it
        causal = False
    keys = engine.key_view(q, k, v, key_mask, aux, causal=causal, xp=xp)
    gout = keys.cotangent(xp, gout)
    if aux is None:
        if causal:
            raise ValueError("causal attention's backward needs the forward's residuals")
        aux = attention_aux(engine, keys.q, keys.k, profile, keys.take, normalizer, xp=xp)
    takef = xp.astype(keys.take, work)
    count, value_sums = keys.totals(xp, values=center)                  # (..., lq or 1, 1 | Dv)
    good = keys.good[..., None]                                         # (..., lq, 1)
    cot = pullback(xp, gout, out, relu_count=aux["relu_count"], den=aux.get("den"), count=count,
                   value_sums=value_sums, good=good, center=center, normalizer=normalizer,
                   dot=lambda a, b: keys.row_dot(xp, a, b))
    silent = _silent_rows(xp, profile, normalizer, aux.get("den"), good, uniform=keys.collective,
                          as_mask=keys.silent_as_mask)
    # mean_i = (sum of the values query i sees) / count_i, and R_i = relu_count_i multiplies it: its
    # cotangent reaches the values as a term subtracted from dv; keys not taken get no gradient, and
    # bad rows get NaN (the forward's NaN policy): a factor of dv
    mean_term = keys.to_keys(xp, cot.mean_weights * cot.scale, gout) if center else None
    nan = xp.asarray(float("nan"), dtype=work, device=array_device(q))
    key_factor = xp.where(keys.row_bad[..., None], nan, takef)[..., None]
    dq, dk, dv, param = keys.sums_vjp(profile, normalizer, gout, cot, silent, center=center, dv_sub=mean_term,
                                      dv_factor=key_factor, xp=xp)
    dq = xp.where(keys.good, dq, nan)
    dk = xp.where(keys.row_bad[..., None], nan, dk)
    return dq, dk, dv, param


def sums_vjp(keys, profile: Profile, normalizer: Normalizer, gout, cot, silent, *, center: bool, dv_sub, dv_factor,
             xp):
    """The pull-back of attention's sums over the keys each query sees (``keys``, a view): of the
    value sums ``N`` with the cotangent ``gout * cot.scale``, of ``R`` with ``cot.relu_count``
    (``center``) and of the normaliser's sum with ``cot.den``; ``(dq, dk, dv, (dknots, dcoeffs))``,
    with ``dv = (pulled-back value sums - dv_sub) * dv_factor`` (``dv_sub`` (..., 1 or lk, dv) or
    None, ``dv_factor`` (..., lk, 1)).

    The values and the valid-key indicator are pulled back together, in one profile-sum VJP of
    ``[v | indicator]``: one sort of the keys and one of the queries, and the rank searches of shared
    knots, serve both. ``silent`` (:func:`_silent_rows`): the rows whose cotangent reaches ``dq``
    and ``dk`` but not ``dv``.
    """
    indicator_profiles, indicator_cots = [], []
    if center:
        indicator_profiles.append(profile)
        indicator_cots.append(cot.relu_count)
    if normalizer.summed:
        indicator_profiles.append(normalizer.profile)
        indicator_cots.append(cot.den)
    if not indicator_profiles and not keys.lazy_columns:
        gnum = gout * cot.scale                                         # (..., lq, Dv), work dtype
        dq, dk, dv, params = keys.profiles_vjp(keys.q, keys.k, keys.v, [profile], [gnum], xp=xp)
        return dq, dk, keys.finish_dv(xp, dv, dv_sub, dv_factor), params[0]
    dv_cols = keys.raw_v.shape[-1]
    profiles = [profile.with_(columns=slice(0, dv_cols))] + [
        p.with_(columns=slice(dv_cols, dv_cols + 1)) for p in indicator_profiles]
    if keys.lazy_columns:
        # the view's engine reads the values where the keys take part and scales the cotangent rows
        # as it reads them (._columns): no (lq, Dv) or (lk, Dv + 1) array is formed here, and the
        # silent rows' share of the values' gradient (below) is scaled to 0, not split off
        rows = tuple(gout.shape[:-1]) + (1,)
        scale = xp.broadcast_to(cot.scale, rows)
        zero = xp.zeros((), dtype=scale.dtype, device=array_device(scale))
        cotangents = [ScaledRows(gout, scale, None if silent is None else xp.where(silent, zero, scale))]
        if indicator_cots:           # one (lq, 2) array at most: the pull-back reads them as one table
            joined = xp.concat([xp.broadcast_to(c, rows) for c in indicator_cots], axis=-1)
            cotangents += [joined[..., i:i + 1] for i in range(len(indicator_cots))]
        w, silent = MaskedValues(keys.raw_v, keys.take), None
    elif silent is None:
        cotangents = [gout * cot.scale, *indicator_cots]
        w = keys.value_columns(xp, silent=False)
    else:
        # Rows whose normaliser sum is exactly 0 while the profile vanishes wherever it does (ReLU
        # attention; ties, a first key): their output is 0 and their value gradient exactly 0,
        # but g / eps times the rounding of the sums over the queries (|q| 2^-52 a pair) would
        # reach dv: 1.7e10 for -0.9 at |q| = 1e20 (docs/changelog.rst). Their cotangent goes
        # through a copy of the value columns whose gradient is dropped: dq and dk keep its
        # tie-rule terms (H(0) = 1), dv gets none of it.
        gnum = gout * cot.scale
        zero = xp.zeros((), dtype=gnum.dtype, device=array_device(gnum))
        cotangents = [xp.where(silent, zero, gnum), *indicator_cots, xp.where(silent, gnum, zero)]
        w = keys.value_columns(xp, silent=True)
        profiles.append(profile.with_(columns=slice(dv_cols + 1, 2 * dv_cols + 1)))
    dq, dk, dv, params = keys.finished_vjp(xp, w, profiles, cotangents, dv_sub, dv_factor)
    if silent is not None:
        params = add_params(params[:1], params[-1:]) + params[1:-1]
    params = add_params(params[:1], params[1:2]) if center else params[:1]
    return dq, dk, dv, params[0]


def _silent_rows(xp, profile: Profile, normalizer: Normalizer, den, good, *, uniform: bool = False,
                 as_mask: bool = False):
    """``(..., lq, 1)`` True on the rows whose normaliser sum is exactly 0 and whose every term is
    then 0 (:func:`vanishes_where_normalizer_does`), or None when no row can be (or, traced, for
    the ``|r|`` normaliser, whose sum is 0 only when every key seen ties with the query).

    ``uniform``: the answer must not depend on the data (a collective engine: every rank must send
    the same columns), so it is the traced one. ``as_mask``: the view takes the mask whatever it
    holds (:attr:`AllKeys.silent_as_mask`), so it is returned without asking the host whether it
    holds any."""
    if not normalizer.summed or not vanishes_where_normalizer_does(profile, normalizer.profile):
        return None
    if as_mask:
        return good & (den == 0)
    none_zero = None if uniform else holds_everywhere(xp, den, lambda ns, a: a != 0)
    if none_zero or (none_zero is None and not _zero_below(normalizer.profile)):
        return None
    return good & (den == 0)


def _value(p: Profile, r: float) -> float:
    """A fixed profile at ``r``."""
    return p.intercept + p.slope * r + sum(c * max(r - t, 0.0) for t, c in zip(p.knots, p.coeffs))


def _zero_below(normalizer: Profile) -> bool:
    """Whether the normaliser is 0 for every ``r <= 0`` (ReLU), not only at 0 (``|r|``)."""
    return _value(normalizer, -1.0) == 0.0


def vanishes_where_normalizer_does(profile: Profile, normalizer: Profile) -> bool:
    """Whether the value profile ``f`` is 0 at every difference ``r = q - k`` of a row whose normaliser
    sum is exactly 0: ``r <= 0`` for the ReLU normaliser, ``r = 0`` for ``|r|`` (ReLU attention, say;
    not a hat, whose ``f(0) = 1``). Fixed profiles only; ``f`` is piecewise linear, so it is checked at
    its knots in the zero set and one step left of them."""
    if not (profile.is_fixed and normalizer.is_fixed):
        return False
    if not _zero_below(normalizer):             # |r|: zero only at r = 0
        return _value(profile, 0.0) == 0.0
    points = [0.0] + [t for t in profile.knots if t <= 0.0]
    # one step left of the leftmost knot, scaled with it: min - 1 rounds back to min past 2^53
    left = min(points) - (1.0 + abs(min(points)))
    return all(_value(profile, r) == 0.0 for r in points + [left])


def add_params(a, b):
    """Sum two ``profiles_vjp`` parameter-gradient lists (None where a parameter is a float)."""
    out = []
    for (ka, ca), (kb, cb) in zip(a, b):
        out.append((tuple(x if y is None else (y if x is None else x + y) for x, y in zip(ka, kb)),
                    tuple(x if y is None else (y if x is None else x + y) for x, y in zip(ca, cb))))
    return out


def attention_aux(engine, q, k, profile, take, normalizer: Normalizer, *, xp):
    """The per-query residuals of attention (``take``, ``relu_count``, ``den``), recomputed from the
    screened inputs and the keys that take part, for engines that keep none."""
    ones = xp.astype(take, q.dtype)[..., None]
    profiles = [profile] + ([normalizer.profile] if normalizer.summed else [])
    sums = engine.indicator_sums(q, k, ones, profiles, xp=xp)
    aux = {"take": take, "relu_count": sums[0]}
    if len(sums) > 1:
        aux["den"] = sums[1]
    return aux
