"""The backward of ``kernel_sum`` and attention, as straight functions over an engine's profile-sum VJPs.

An engine provides ``profiles_vjp(x, y, w, profiles, cotangents, *, xp, param_grads)`` (the pullback of
several profile sums of one ``(x, y, w)``) and ``indicator_sums(q, k, ones, profiles, *, xp)``, and an
engine with a causal mode ``causal_profiles_vjp`` (the same over the keys each query sees).
:func:`attention_bwd` and :func:`causal_bwd` are the generic backwards over them: the NaN policy, the
quotient rule of the normaliser (:func:`._combine.pullback`), the centring and masks
(docs/mathematics.rst, "The backward pass" and "Causal attention"). An engine that fuses parts of
them (triton, sharded) writes its own ``attention_bwd`` / ``causal_bwd`` from the same pieces here:
:class:`Keys` (the screened inputs), :func:`silent_rows`, :func:`indicator_terms`,
:func:`joined_params` and :func:`nan_scores`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .._lib.namespace import array_device, as_work, scalar
from .._spec import Normalizer
from ..backends import holds_everywhere
from ..kernels import Profile
from ._causal_grid import CausalGrid, screen_causal
from ._combine import Cotangents, pullback
from ._nanpolicy import sanitize_keys, screen

__all__ = ["kernel_sum_vjp", "attention_bwd", "causal_bwd", "seen_bwd", "attention_aux", "Inputs", "Form", "Keys",
           "screened_keys", "screened_seen_keys", "zeroed_values", "sums_vjp", "silent_rows", "indicator_terms",
           "column_profiles", "joined_params", "key_factor", "finished_dv", "nan_scores", "add_params",
           "vanishes_where_normalizer_does"]


def kernel_sum_vjp(engine, x, y, w, profile: Profile, g, *, xp):
    """VJP of a kernel sum on ``engine``: ``(dx, dy, dw, (dknots, dcoeffs))``.

    A non-finite query contributes nothing to ``dy`` and ``dw`` (as in :func:`attention_bwd`).
    """
    x, y, w, q_ok, row_ok = sanitize_keys(xp, x, y, w, None)
    g = xp.where(q_ok[..., None], g, xp.zeros((), dtype=g.dtype, device=array_device(g)))
    dx, dy, dw, params = engine.profiles_vjp(x, y, w, [profile], [g], xp=xp)
    return (*_nan_rows(xp, dx, dy, dw, q_ok, row_ok), params[0])


def _nan_rows(xp, dx, dy, dw, q_ok, row_ok):
    nan = scalar(xp, float("nan"), dtype=dx.dtype, device=array_device(dx))
    return (xp.where(q_ok & row_ok[..., None], dx, nan), xp.where(row_ok[..., None], dy, nan),
            xp.where(row_ok[..., None, None], dw, nan))


class Inputs(NamedTuple):
    """Attention's inputs as the op passed them to the engine."""

    q: Any          # (..., lq) query scores, the work dtype
    k: Any          # (..., lk) key scores
    v: Any          # (..., lk, dv) values
    key_mask: Any   # (..., lk) bool, True where a key takes part, or None


class Form(NamedTuple):
    """Which attention a backward pulls back: its value profile, its divisor and its centring."""

    profile: Profile
    normalizer: Normalizer
    center: bool


class Keys(NamedTuple):
    """Attention's inputs as the NaN policy screened them, what every backward reads."""

    q: Any          # (..., lq) scores, finite (an engine reading its forward's orders may keep them as given)
    k: Any          # (..., lk) scores, the keys that take no part moved out of the way
    values: Any     # (..., lk, dv) as given: read only where ``take``
    take: Any       # (..., lk) bool: the key takes part
    good: Any       # (..., lq) bool: the forward's row is not NaN
    row_bad: Any    # (...) bool: every key's gradient is NaN


def screened_keys(xp, q, k, v, key_mask) -> Keys:
    """Every query sees every valid key of its batch row (the non-causal NaN policy)."""
    sc = screen(xp, q, k, v, key_mask, defer=False)
    return Keys(sc.x, sc.y, v, sc.take, sc.q_ok & sc.row_ok[..., None], ~sc.row_ok)


def screened_seen_keys(xp, grid: CausalGrid, q, k, v, key_mask) -> Keys:
    """Query ``i`` sees the valid keys ``j <= i + lk - lq`` (the causal NaN rule, :func:`screen_causal`),
    or those of another grid's rule (a band)."""
    sc = screen_causal(xp, grid, q, k, v, key_mask, zero_values=False)
    return Keys(sc.q, sc.k, v, sc.take, sc.good, sc.row_bad)


def zeroed_values(xp, keys: Keys):
    """The values, zero on the keys that take no part."""
    zero = scalar(xp, 0.0, dtype=keys.values.dtype, device=array_device(keys.values))
    return xp.where(keys.take[..., None], keys.values, zero)


def key_factor(xp, keys: Keys):
    """(..., lk, 1): the values' gradient's factor per key, 1 where the key takes part, 0 where it
    does not, NaN on a bad row (the forward's NaN policy), in the scores' dtype."""
    nan = scalar(xp, float("nan"), dtype=keys.q.dtype, device=array_device(keys.q))
    return xp.where(keys.row_bad[..., None], nan, xp.astype(keys.take, keys.q.dtype))[..., None]


def nan_scores(xp, keys: Keys, dq, dk):
    """``(dq, dk)`` NaN where the forward's output was: on bad queries, on every key of a bad row."""
    nan = scalar(xp, float("nan"), dtype=keys.q.dtype, device=array_device(dq))
    return xp.where(keys.good, dq, nan), xp.where(keys.row_bad[..., None], nan, dk)


def finished_dv(xp, keys: Keys, dv, mean_term):
    """The pulled-back value sums less the centring mean's cotangent (or None), times the keys' factor."""
    return (dv if mean_term is None else dv - mean_term) * key_factor(xp, keys)


def attention_bwd(engine, inputs: Inputs, form: Form, gout, out, aux, *, xp):
    """VJP of attention on ``engine``: ``(dq, dk, dv, (dknots, dcoeffs))``.

    ``gout`` is the output's cotangent in any float dtype, ``out`` the forward output and ``aux`` the
    per-query residuals it returned (``relu_count``: the profile summed over the valid-key
    indicator; ``den``: the unclamped normaliser sum), or ``None`` (the sweep keeps none): then they
    are recomputed here, one sort-scan of one column each. NaN where the forward's output was: on
    bad queries, and on every key of a batch row with a bad key.
    """
    profile, normalizer, center = form
    keys = screened_keys(xp, *inputs)
    work = keys.q.dtype
    gout = as_work(xp, gout, work)
    if aux is None:
        aux = attention_aux(engine, keys.q, keys.k, profile, keys.take, normalizer, xp=xp)
    values = zeroed_values(xp, keys)
    count = xp.sum(xp.astype(keys.take, work)[..., None], axis=-2, keepdims=True)      # (..., 1, 1)
    value_sums = xp.sum(values, axis=-2, keepdims=True, dtype=work) if center else None
    good = keys.good[..., None]
    cot = pullback(xp, gout, out, relu_count=aux["relu_count"], den=aux.get("den"), count=count,
                   value_sums=value_sums, good=good, center=center, normalizer=normalizer)
    silent = silent_rows(xp, profile, normalizer, aux.get("den"), good)
    # the centring mean's cotangent reaches the values as a term subtracted from dv
    mean_term = xp.matrix_transpose(cot.mean_weights * cot.scale) @ gout if center else None
    dq, dk, dv, param = sums_vjp(xp, engine.profiles_vjp, keys, values, gout, cot, silent, form)
    return (*nan_scores(xp, keys, dq, dk), finished_dv(xp, keys, dv, mean_term), param)


def causal_bwd(engine, inputs: Inputs, form: Form, gout, out, aux, *, xp):
    """VJP of causal attention on ``engine`` (docs/mathematics.rst, "Causal attention"), over its
    ``causal_profiles_vjp``; as :func:`attention_bwd`, but the sums run over the keys each query
    sees (running sums read at the queries' positions), and a batch row is NaN from the first query
    that sees a bad key. The forward's residuals are needed (``aux``)."""
    lq, lk = inputs.q.shape[-1], inputs.k.shape[-1]
    if lq == 0 or lk == 0:
        # no query or no key: causal and non-causal attention are the same (zero) map
        return attention_bwd(engine, inputs, form, gout, out, aux, xp=xp)
    return seen_bwd(engine.causal_profiles_vjp, CausalGrid(lq, lk), inputs, form, gout, out, aux, xp=xp)


def seen_bwd(profiles_vjp, grid, inputs: Inputs, form: Form, gout, out, aux, *, xp):
    """The backward of attention whose queries each see a set of keys that ``grid`` describes (a
    :class:`CausalGrid`, or a band: :class:`slicedkern.engines.banded.Band`): its ``seen_sums`` and
    ``seen_sums_adjoint`` give the counts and value sums over the keys each query sees and their
    adjoint, its ``sees_any`` the NaN rule; ``profiles_vjp`` pulls back the profile sums over those
    keys. The forward's residuals are needed (``aux``)."""
    if aux is None:
        raise ValueError("causal attention's backward needs the forward's residuals")
    profile, normalizer, center = form
    keys = screened_seen_keys(xp, grid, *inputs)
    work = keys.q.dtype
    gout = as_work(xp, gout, work)
    values = zeroed_values(xp, keys)
    count = grid.seen_sums(xp, xp.astype(keys.take, work)[..., None], work)
    value_sums = grid.seen_sums(xp, values, work) if center else None
    good = keys.good[..., None]
    cot = pullback(xp, gout, out, relu_count=aux["relu_count"], den=aux.get("den"), count=count,
                   value_sums=value_sums, good=good, center=center, normalizer=normalizer)
    silent = silent_rows(xp, profile, normalizer, aux.get("den"), good)
    mean_term = grid.seen_sums_adjoint(xp, cot.mean_weights * cot.scale * gout) if center else None
    dq, dk, dv, param = sums_vjp(xp, profiles_vjp, keys, values, gout, cot, silent, form)
    return (*nan_scores(xp, keys, dq, dk), finished_dv(xp, keys, dv, mean_term), param)


def indicator_terms(form: Form, cot: Cotangents):
    """``(profiles, cotangents)`` of the sums over the valid-key indicator attention pulls back: of
    ``R`` (``form.center``) and of the normaliser's sum (``form.normalizer.summed``)."""
    profile, normalizer, center = form
    profiles, cotangents = [], []
    if center:
        profiles.append(profile)
        cotangents.append(cot.relu_count)
    if normalizer.summed:
        profiles.append(normalizer.profile)
        cotangents.append(cot.den)
    return profiles, cotangents


def column_profiles(profile: Profile, indicator_profiles, dv: int) -> list:
    """The value profile over the columns ``0 .. dv`` of ``[v | indicator]``, then each of
    ``indicator_profiles`` over column ``dv``: the profiles of attention's sums pulled back together."""
    return [profile.with_(columns=slice(0, dv))] + [p.with_(columns=slice(dv, dv + 1)) for p in indicator_profiles]


def joined_params(params, *, silent_copy: bool, center: bool):
    """The value profile's ``(dknots, dcoeffs)`` from the parameter gradients of a pull-back over the
    profiles :func:`sums_vjp` lists: the values' (first), ``R``'s (second, ``center``) and the silent
    rows' copy of the values' (last, ``silent_copy``) added; the normaliser's (fixed) dropped."""
    if silent_copy:
        params = add_params(params[:1], params[-1:]) + params[1:-1]
    return (add_params(params[:1], params[1:2]) if center else params[:1])[0]


def sums_vjp(xp, profiles_vjp, keys: Keys, values, gout, cot: Cotangents, silent, form: Form):
    """The pull-back of attention's sums over the keys each query sees, on ``profiles_vjp`` (an
    engine's, or its causal one): of the value sums ``N`` with the cotangent ``gout * cot.scale``,
    of ``R`` with ``cot.relu_count`` (``center``) and of the normaliser's sum with ``cot.den``;
    ``(dq, dk, dv, (dknots, dcoeffs))``, ``dv`` the pulled-back value sums (not yet finished:
    :func:`attention_bwd`). ``values``: zero on the keys that take no part.

    The values and the valid-key indicator are pulled back together, in one profile-sum VJP of
    ``[v | indicator]``: one sort of the keys and one of the queries, and the rank searches of shared
    knots, serve both. ``silent`` (:func:`silent_rows`): the rows whose cotangent reaches ``dq``
    and ``dk`` but not ``dv``.
    """
    profile, center = form.profile, form.center
    indicator_profiles, indicator_cots = indicator_terms(form, cot)
    gnum = gout * cot.scale                                             # (..., lq, Dv), work dtype
    if not indicator_profiles:
        dq, dk, dv, params = profiles_vjp(keys.q, keys.k, values, [profile], [gnum], xp=xp)
        return dq, dk, dv, params[0]
    dv_cols = values.shape[-1]
    profiles = column_profiles(profile, indicator_profiles, dv_cols)
    columns = [values, xp.astype(keys.take, values.dtype)[..., None]]
    if silent is None:
        cotangents = [gnum, *indicator_cots]
    else:
        # Rows whose normaliser sum is exactly 0 while the profile vanishes wherever it does (ReLU
        # attention; ties, a first key): their output is 0 and their value gradient exactly 0,
        # but g / eps times the rounding of the sums over the queries (|q| 2^-52 a pair) would
        # reach dv: 1.7e10 for -0.9 at |q| = 1e20 (docs/changelog.rst). Their cotangent goes
        # through a copy of the value columns whose gradient is dropped: dq and dk keep its
        # tie-rule terms (H(0) = 1), dv gets none of it.
        zero = xp.zeros((), dtype=gnum.dtype, device=array_device(gnum))
        cotangents = [xp.where(silent, zero, gnum), *indicator_cots, xp.where(silent, gnum, zero)]
        columns.append(values)
        profiles.append(profile.with_(columns=slice(dv_cols + 1, 2 * dv_cols + 1)))
    dq, dk, dw, params = profiles_vjp(keys.q, keys.k, xp.concat(columns, axis=-1), profiles, cotangents, xp=xp)
    return dq, dk, dw[..., :dv_cols], joined_params(params, silent_copy=silent is not None, center=center)


def silent_rows(xp, profile: Profile, normalizer: Normalizer, den, good, *, uniform: bool = False,
                as_mask: bool = False):
    """``(..., lq, 1)`` True on the rows whose normaliser sum is exactly 0 and whose every term is
    then 0 (:func:`vanishes_where_normalizer_does`), or None when no row can be (or, traced, for
    the ``|r|`` normaliser, whose sum is 0 only when every key seen ties with the query).

    ``uniform``: the answer must not depend on the data (a collective engine: every rank must send
    the same columns), so it is the traced one. ``as_mask``: the caller takes the mask whatever it
    holds (an engine that scales the cotangent by it in its kernels), so it is returned without
    asking the host whether it holds any."""
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
