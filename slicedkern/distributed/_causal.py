"""Causal sequence-parallel attention, written once over a communicator (as :mod:`._core`).

Rank ``r`` of ``P`` holds the tokens ``r n ... (r + 1) n - 1`` (as many queries as keys per rank), so
global query ``i`` sees the keys ``j <= i`` (docs/mathematics.rst, "Causal attention"). Seen from the
keys of rank ``r``:

* the queries of the later ranks see all of them: rank ``r`` computes its shard's non-causal partial
  sums ``N``, ``R``, ``D`` for every gathered query, as :mod:`._core` does, and zeroes the rows of the
  ranks ``<= r`` before the reduce-scatter;
* its own queries see a lower triangle of them: the engine's causal profile sums on the local shard
  (``causal_profile_sums``), added on the owner after the reduce-scatter, so they never travel;
* the queries of the earlier ranks see none of them.

The running totals a query needs (the sum of the values it sees and their count, for the running
centring mean and the "count" normaliser; the number of non-finite keys it sees, for the NaN rule)
are a local running sum plus an exclusive scan over the ranks of the per-rank totals: one all-gather
of ``Dv + 2`` numbers per batch row. The backward mirrors all of it with ``profiles_vjp`` (the later
ranks' rows), ``causal_profiles_vjp`` (the own triangle) and a reverse scan for the centring mean.
The combination is the scan engine's own (:func:`slicedkern.engines.scan._causal.compose`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._lib.namespace import array_device, clamp_min
from .._spec import bandwidth_ok, normalizer_profile, profile_of, unpack
from ..engines._causal_grid import CausalGrid, running_sum, screen_causal
from ..engines._vjp import _add_params
from ..engines.scan._causal import compose
from ..engines.scan._wide import Plain
from ..kernels import Profile
from ._core import gradients

__all__ = ["forward", "backward", "CausalSaved"]


@dataclass
class CausalSaved:
    """What the causal backward reads (shapes per rank: ``n`` tokens, ``P n`` gathered queries)."""

    queries: Any        # (..., P n) every rank's query scores, made finite
    q: Any              # (..., n) this rank's query scores, made finite
    keys: Any           # (..., n) this rank's keys, made finite
    values: Any         # (..., n, Dv) zero where a key takes no part
    takef: Any          # (..., n, 1) 1.0 where a key takes part
    q_good: Any         # (..., n) finite queries that see no non-finite key
    row_bad: Any        # (...) batch rows in which some query sees a non-finite key
    relu_count: Any     # (..., n, 1) the profile summed over the valid keys each query sees
    den: Any            # (..., n, 1) unclamped normaliser sum, or None
    den_c: Any          # (..., n, 1) the divisor the forward used
    mean: Any           # (..., n, Dv) the running mean of the values each query sees
    count: Any          # (..., n, 1) the number of valid keys each query sees, at least 1
    out: Any            # (..., n, Dv) the output, work dtype


def _ranks(xp, comm, size: int, dev):
    """``(rank, index)``: this rank (an int, or a traced scalar under JAX) and ``arange(size)``."""
    return comm.rank, xp.arange(size, device=dev)


def _later_rows(xp, comm, total: int, n: int, dev):
    """(P n, 1) bool: the gathered query rows that belong to ranks after this one."""
    rank, index = _ranks(xp, comm, total, dev)
    return (index // n > rank)[:, None]


def _scan_ranks(xp, comm, per_rank, *, after: bool):
    """Sum of ``per_rank`` (...) over the ranks before this one (after it, with ``after``), and over all."""
    gathered = comm.gather(per_rank[None, ...], 0)                        # (P, ...): O(P B c) numbers
    rank, index = _ranks(xp, comm, gathered.shape[0], array_device(per_rank))
    pick = (index > rank) if after else (index < rank)
    pick = xp.reshape(pick, (gathered.shape[0],) + (1,) * per_rank.ndim)
    zero = xp.zeros((), dtype=gathered.dtype, device=array_device(gathered))
    return xp.sum(xp.where(pick, gathered, zero), axis=0), xp.sum(gathered, axis=0)


def forward(spec, engine, comm, arrays, *, xp):
    """``(out, saved)``: this rank's causal output rows (work dtype) and what :func:`backward` needs."""
    q, k, v, mask, params = unpack(spec, arrays)
    profile = profile_of(spec, params)
    normalizer = normalizer_profile(spec.normalize)
    work, dev = q.dtype, array_device(q)
    n, dv = q.shape[-1], v.shape[-1]
    sc = screen_causal(xp, CausalGrid(n, n), q, k, v, mask)               # the NaN rule inside the shard
    takef = xp.astype(sc.take, work)[..., None]
    bad = ~sc.take if mask is None else mask & ~sc.take
    w = sc.v
    weights = xp.concat([w, xp.astype(takef, w.dtype)], axis=-1)          # [v | 1] over the valid keys
    profiles = [profile.with_(columns=slice(0, dv + 1))]
    if isinstance(normalizer, Profile):
        profiles.append(normalizer.with_(columns=slice(dv, dv + 1)))

    queries = comm.gather(sc.q, -1)                                       # (..., P n): O(n) scalars
    later = _later_rows(xp, comm, queries.shape[-1], n, dev)
    parts = [engine.kernel_sum(queries, sc.k, weights, profile, xp=xp)]   # N, R for every query
    if isinstance(normalizer, Profile):
        parts.append(engine.indicator_sums(queries, sc.k, takef, [normalizer], xp=xp)[0])   # D
    parts = parts[0] if len(parts) == 1 else xp.concat(parts, axis=-1)
    parts = xp.where(later, parts, xp.zeros((), dtype=parts.dtype, device=dev))
    own = comm.scatter_sum(parts, -2)                                     # (..., n, Dv + 1 [+ 1])
    mine = engine.causal_profile_sums(sc.q, sc.k, weights, profiles, xp=xp)   # the own triangle

    rows = xp.concat([xp.astype(w, work), takef, xp.astype(bad, work)[..., None]], axis=-1)
    before, everything = _scan_ranks(xp, comm, xp.sum(rows, axis=-2), after=False)   # (..., Dv + 2)
    totals = running_sum(xp, rows[..., :dv + 1], axis=-2) + before[..., None, :dv + 1]
    q_good = sc.good & (before[..., dv + 1] == 0)[..., None]
    row_bad = everything[..., dv + 1] > 0                                 # the last query sees every key
    num_r = own[..., :dv + 1] + mine[0]
    den_sum = own[..., dv + 1:dv + 2] + mine[1] if len(mine) > 1 else None
    good = q_good
    ok = bandwidth_ok(xp, spec, params)
    if ok is not None:
        good = good & ok[..., None]
    out, relu_count, den = compose(xp, Plain(xp), num_r, den_sum, totals, good, center=spec.center,
                                   normalizer=normalizer, eps=spec.eps, dv=dv)
    count = totals[..., dv:dv + 1]
    count_c = clamp_min(xp, count, 1.0)
    if isinstance(normalizer, Profile):
        den_c = xp.where(count > 0, clamp_min(xp, den, spec.eps), xp.ones_like(den))
    elif normalizer == "count":
        den_c = count_c
    else:
        den_c = xp.ones_like(count)
    saved = CausalSaved(queries, sc.q, sc.k, w, takef, q_good, row_bad, relu_count, den, den_c,
                        totals[..., :dv] / count_c, count_c, out)
    return out, saved


def backward(spec, engine, comm, arrays, saved: CausalSaved, gout, *, xp):
    """Cotangents of ``arrays`` (``None`` for the mask) on this rank, given its output cotangent."""
    q, k, v, mask, params = unpack(spec, arrays)
    profile = profile_of(spec, params)
    normalizer = normalizer_profile(spec.normalize)
    work, dev = q.dtype, array_device(q)
    dv = v.shape[-1]
    s = saved
    good = s.q_good[..., None]
    zero = xp.zeros((), dtype=work, device=dev)
    gnum = gout * (xp.astype(good, work) / s.den_c)                       # (..., n, Dv)
    columns, indicator_profiles = [gnum], []
    if spec.center:
        columns.append(-xp.vecdot(gnum, s.mean)[..., None])               # cotangent of R
        indicator_profiles.append(profile)
    if isinstance(normalizer, Profile):
        dot = xp.vecdot(gout, s.out)[..., None]
        columns.append(xp.where(good & (s.den >= spec.eps), -dot / s.den_c, zero))   # cotangent of D
        indicator_profiles.append(normalizer)
    mine = columns[0] if len(columns) == 1 else xp.concat(columns, axis=-1)
    cot = comm.gather(mine, -2)                                           # (..., P n, c)
    cot = xp.where(_later_rows(xp, comm, cot.shape[-2], s.q.shape[-1], dev), cot, zero)

    def pull(vjp, x, c):
        """The later ranks' rows (``vjp`` = profiles_vjp) or the own triangle (causal_profiles_vjp)."""
        dx, dk, dw, grads = vjp(x, s.keys, s.values, [profile], [c[..., :dv]], xp=xp)
        if indicator_profiles:
            cots = [c[..., dv + i:dv + i + 1] for i in range(len(indicator_profiles))]
            dx2, dk2, _, grads2 = vjp(x, s.keys, s.takef, indicator_profiles, cots, xp=xp)
            dx, dk = dx + dx2, dk + dk2
            if spec.center:
                grads = _add_params(grads, grads2[:1])
        return dx, dk, dw, grads

    dx, dk, dw, grads = pull(engine.profiles_vjp, s.queries, cot)
    own_dx, own_dk, own_dw, own_grads = pull(engine.causal_profiles_vjp, s.q, mine)
    dq = comm.scatter_sum(dx, -1) + own_dx                                # (..., n): O(n) scalars
    dk, dw, grads = dk + own_dk, dw + own_dw, _add_params(grads, own_grads)
    if spec.center:
        # mean_i = (the values query i sees) / count_i: key j gets the mean's cotangent of every query
        # i >= j, the own rank's by a reverse running sum, the later ranks' as one total per rank
        g_mean = -(s.relu_count / s.count) * gnum                         # (..., n, Dv)
        after, _ = _scan_ranks(xp, comm, xp.sum(g_mean, axis=-2), after=True)
        dw = dw + running_sum(xp, g_mean, axis=-2, reverse=True) + after[..., None, :]
    nan = xp.asarray(float("nan"), dtype=work, device=dev)
    dv_ = dw * xp.where(s.row_bad[..., None, None], nan, s.takef)
    return gradients(xp, spec, comm, params, grads, xp.where(s.q_good, dq, nan),
                     xp.where(s.row_bad[..., None], nan, dk), xp.astype(dv_, v.dtype))
