"""Sequence-parallel attention, written once over a *communicator* (torch process group or JAX mesh axis).

Every rank holds a contiguous shard of the sequence: its queries ``q`` (..., n_r), keys ``k`` (..., m_r),
values ``v`` (..., m_r, Dv) and key mask. Every sum the attention combines is additive over key shards
(docs/scaling.rst):

* the numerator ``N_i = sum_j f(q_i - k_j) v_j`` and the profile's count ``R_i = sum_j f(q_i - k_j)``
  (for the centring fold ``N - mu R``);
* the normaliser ``D_i = sum_j g(q_i - k_j)`` over the valid keys;
* the per-row totals: ``sum_j v_j``, the number of valid keys, the number of bad keys (NaN policy).

So the forward all-gathers the query *scores* (one scalar per token), lets each rank compute its key
shard's partial sums for every query with the engine's own kernel sums, reduce-scatters the partials
to the queries' owners and combines them there exactly as the one-process op does. The backward
mirrors it: the per-query cotangents are all-gathered, each rank pulls them back through its key
shard with the engine's ``profiles_vjp``, and the query gradients (one scalar per token) are
reduce-scattered home. Array parameters (bandwidths, mixture weights) get the gradient summed over
the group: every rank holds the gradient of the sum of all ranks' losses.

A communicator provides ``gather(x, axis)`` (the ranks' blocks concatenated along ``axis``),
``scatter_sum(x, axis)`` (the sum over ranks, this rank's block of ``axis``) and ``sum(x)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._lib.namespace import array_device, clamp_min
from .._spec import bandwidth_ok, normalizer_profile, param_grads, profile_of, unpack
from ..engines._nanpolicy import sanitize_keys
from ..engines._vjp import _add_params
from ..kernels import Profile

__all__ = ["forward", "backward", "Saved"]


@dataclass
class Saved:
    """What the backward reads: the gathered queries, this rank's key shard, the own rows' sums."""

    queries: Any        # (..., n) every rank's query scores, made finite
    keys: Any           # (..., m_r) this rank's keys, made finite
    values: Any         # (..., m_r, Dv) zero where a key takes no part
    takef: Any          # (..., m_r, 1) 1.0 where a key takes part
    q_ok: Any           # (..., n_r) finite own queries
    row_ok: Any         # (...) batch rows with no bad key on any rank
    relu_count: Any     # (..., n_r, 1) the profile summed over the valid keys
    den: Any            # (..., n_r, 1) unclamped normaliser sum, or None
    den_c: Any          # (..., n_r, 1) the divisor the forward used
    mean: Any           # (..., 1, Dv) mean value over the valid keys
    count: Any          # (..., 1, 1) number of valid keys, at least 1
    out: Any            # (..., n_r, Dv) the output, work dtype


def forward(spec, engine, comm, arrays, *, xp):
    """``(out, saved)``: this rank's output rows (work dtype) and what :func:`backward` needs."""
    q, k, v, mask, params = unpack(spec, arrays)
    profile = profile_of(spec, params)
    normalizer = normalizer_profile(spec.normalize)
    work, dev = q.dtype, array_device(q)
    dv = v.shape[-1]
    x, y, w, q_ok, row_ok = sanitize_keys(xp, q, k, v, mask)
    take = xp.broadcast_to(row_ok[..., None], k.shape)
    if mask is not None:
        take = take & mask
    takef = xp.astype(take, work)[..., None]

    queries = comm.gather(x, -1)                                          # (..., n): O(n) scalars
    weights = xp.concat([w, xp.astype(takef, w.dtype)], axis=-1)          # [v | 1] over the valid keys
    parts = [engine.kernel_sum(queries, y, weights, profile, xp=xp)]       # (..., n, Dv + 1): N, R
    if isinstance(normalizer, Profile):
        parts.append(engine.indicator_sums(queries, y, takef, [normalizer], xp=xp)[0])   # D
    parts = parts[0] if len(parts) == 1 else xp.concat(parts, axis=-1)
    bad = xp.astype(~row_ok, work)[..., None]
    totals = comm.sum(xp.concat([xp.sum(xp.astype(w, work), axis=-2), xp.sum(takef, axis=-2), bad], axis=-1))
    own = comm.scatter_sum(parts, -2)                                     # (..., n_r, Dv + 1 [+ 1])

    valid = totals[..., dv:dv + 1][..., None]                             # (..., 1, 1)
    row_ok = totals[..., dv + 1] == 0
    count = clamp_min(xp, valid, 1.0)
    mean = totals[..., None, :dv] / count
    num, relu_count = own[..., :dv], own[..., dv:dv + 1]
    den = None
    if spec.center:
        num = num - relu_count * mean                                     # docs/mathematics.rst, "Attention"
    if isinstance(normalizer, Profile):
        den = own[..., dv + 1:dv + 2]
        den_c = xp.where(valid > 0, clamp_min(xp, den, spec.eps), xp.ones_like(den))
    elif normalizer == "count":
        den_c = xp.broadcast_to(count, relu_count.shape)
    else:
        den_c = xp.ones_like(relu_count)
    good = q_ok & row_ok[..., None]
    ok = bandwidth_ok(xp, spec, params)
    if ok is not None:
        good = good & ok[..., None]
    nan = xp.asarray(float("nan"), dtype=work, device=dev)
    out = xp.where(good[..., None], num / den_c, nan)
    saved = Saved(queries, y, w, takef, q_ok, row_ok, relu_count, den, den_c, mean, count, out)
    return out, saved


def backward(spec, engine, comm, arrays, saved: Saved, gout, *, xp):
    """Cotangents of ``arrays`` (``None`` for the mask) on this rank, given its output cotangent."""
    q, k, v, mask, params = unpack(spec, arrays)
    profile = profile_of(spec, params)
    normalizer = normalizer_profile(spec.normalize)
    work = q.dtype
    dv = v.shape[-1]
    s = saved
    good = (s.q_ok & s.row_ok[..., None])[..., None]
    zero = xp.zeros((), dtype=work, device=array_device(q))
    gnum = gout * (xp.astype(good, work) / s.den_c)                       # (..., n_r, Dv)
    columns, indicator_profiles = [gnum], []
    if spec.center:
        columns.append(-(gnum @ xp.matrix_transpose(s.mean)))              # cotangent of R
        indicator_profiles.append(profile)
    if isinstance(normalizer, Profile):
        dot = xp.vecdot(gout, s.out)[..., None]
        columns.append(xp.where(good & (s.den >= spec.eps), -dot / s.den_c, zero))   # cotangent of D
        indicator_profiles.append(normalizer)
    cot = comm.gather(columns[0] if len(columns) == 1 else xp.concat(columns, axis=-1), -2)   # (..., n, c)

    dx, dk, dw, grads = engine.profiles_vjp(s.queries, s.keys, s.values, [profile], [cot[..., :dv]], xp=xp)
    if indicator_profiles:
        cots = [cot[..., dv + i:dv + i + 1] for i in range(len(indicator_profiles))]
        dx2, dk2, _, grads2 = engine.profiles_vjp(s.queries, s.keys, s.takef, indicator_profiles, cots, xp=xp)
        dx, dk = dx + dx2, dk + dk2
        if spec.center:
            grads = _add_params(grads, grads2[:1])
    dq = comm.scatter_sum(dx, -1)                                         # (..., n_r): O(n) scalars
    if spec.center:
        g_mean = comm.sum(-(xp.matrix_transpose(s.relu_count) @ gnum))    # (..., 1, Dv)
        dw = dw + g_mean / s.count
    nan = xp.asarray(float("nan"), dtype=work, device=array_device(q))
    dv_ = dw * xp.where(s.row_ok[..., None, None], s.takef, nan)
    return gradients(xp, spec, comm, params, grads, xp.where(s.q_ok & s.row_ok[..., None], dq, nan),
                     xp.where(s.row_ok[..., None], dk, nan), xp.astype(dv_, v.dtype))


def gradients(xp, spec, comm, params, grads, dq, dk, dv):
    """The backward's result, one entry per argument of the op: ``dq, dk, dv``, ``None`` for the mask,
    then the parameters' gradients summed over the ranks (every rank holds the whole parameter)."""
    out = [dq, dk, dv] + ([None] if spec.has_mask else [])
    if spec.param_layout:
        dknots, dcoeffs = grads[0]
        out += [comm.sum(g) for g in param_grads(xp, spec, params, dknots, dcoeffs)]
    return tuple(out)
