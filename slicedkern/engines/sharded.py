"""The sharded engine: sequence-parallel attention as an engine wrapper over a *communicator*.

Every rank holds a contiguous shard of the sequence: its queries (..., n_r), keys (..., m_r), values
and key mask. Every sum attention combines is additive over key shards (docs/scaling.rst), so
:class:`ShardedEngine` computes with the engine it wraps and adds across ranks:

* forward: the query scores are all-gathered (one scalar per token), the wrapped engine computes
  this rank's key shard's sums ``N``, ``R``, ``D`` for every query, a reduce-scatter brings each
  query's sums to its owner, and :func:`._combine.combine` finishes there exactly as one process
  would; the per-row totals (value sums, count, bad keys) are all-reduced;
* backward: the generic backward's pieces (:mod:`._vjp`) in :func:`attention_bwd` and
  :func:`causal_bwd`, whose profile-sum VJP all-gathers the cotangents and reduce-scatters the query
  gradients, and whose adjoint of the centring mean is an all-reduce; array parameters get their
  gradient summed over the ranks.

Causal (rank ``r`` of ``P`` holds the tokens ``r n ... (r + 1) n - 1``, as many queries as keys):
the later ranks' queries see all of this rank's keys (the non-causal sums, zeroed for the earlier
ranks' rows before the reduce-scatter); its own queries see a lower triangle, the wrapped engine's
``causal_profile_sums`` (and ``causal_profiles_vjp``) on the local shard; running totals are a local
running sum plus an exclusive scan over the ranks of the per-rank totals (one all-gather).

A communicator provides ``gather(x, axis)`` (the ranks' blocks concatenated along ``axis``),
``scatter_sum(x, axis)`` (the sum over ranks, this rank's block of ``axis``), ``sum(x)`` and
``rank`` (an int, or a traced scalar under JAX).
"""

from __future__ import annotations

from .._lib.namespace import array_device, as_work
from .._spec import AttentionSpec
from ..kernels import Profile
from . import _vjp
from ._base import Engine
from ._causal_grid import CausalGrid, running_sum, screen_causal
from ._combine import combine, pullback
from ._nanpolicy import sanitize_keys
from .sortscan.wide import Plain

__all__ = ["ShardedEngine"]


def _later_rows(xp, comm, total: int, n: int, dev):
    """(P n, 1) bool: the gathered query rows that belong to ranks after this one."""
    return (xp.arange(total, device=dev) // n > comm.rank)[:, None]


def _scan_ranks(xp, comm, per_rank, *, after: bool):
    """Sum of ``per_rank`` (...) over the ranks before this one (after it, with ``after``), and over all."""
    gathered = comm.gather(per_rank[None, ...], 0)                        # (P, ...): O(P B c) numbers
    index = xp.arange(gathered.shape[0], device=array_device(per_rank))
    pick = (index > comm.rank) if after else (index < comm.rank)
    pick = xp.reshape(pick, (gathered.shape[0],) + (1,) * per_rank.ndim)
    zero = xp.zeros((), dtype=gathered.dtype, device=array_device(gathered))
    return xp.sum(xp.where(pick, gathered, zero), axis=0), xp.sum(gathered, axis=0)


def _gather_columns(xp, comm, cotangents, axis=-2):
    """All-gather a list of (..., n_r, c_i) arrays as one message; split back."""
    widths = [c.shape[-1] for c in cotangents]
    whole = comm.gather(cotangents[0] if len(cotangents) == 1 else xp.concat(cotangents, axis=-1), axis)
    out, start = [], 0
    for width in widths:
        out.append(whole[..., start:start + width])
        start += width
    return out


def _indicator_profiles(profile: Profile, normalizer, dv: int):
    """The profiles of ``[N, R]`` (columns ``0 .. dv``) and ``D`` (column ``dv``) over ``[v | 1]``."""
    profiles = [profile.with_(columns=slice(0, dv + 1))]
    if normalizer.summed:
        profiles.append(normalizer.profile.with_(columns=slice(dv, dv + 1)))
    return profiles


def _gathered_vjp(engine, queries, y, w, profiles, cotangents, xp):
    """The wrapped engine's profile-sum VJP of this rank's keys for every rank's queries: the
    cotangents all-gathered, the query gradients reduce-scattered back to their owners."""
    gathered = _gather_columns(xp, engine.comm, list(cotangents))         # (..., P n, c_i)
    dx, dy, dw, params = engine.inner.profiles_vjp(queries, y, w, profiles, gathered, xp=xp)
    return engine.comm.scatter_sum(dx, -1), dy, dw, params


def _causal_gathered_vjp(engine, queries, x, y, w, profiles, cotangents, xp):
    """The causal profile-sum VJP over ranks: the later ranks' queries see every key of this rank
    (the gathered non-causal VJP, the earlier ranks' rows zeroed), this rank's own see a lower
    triangle (the wrapped engine's causal VJP on the local shard)."""
    n = x.shape[-1]
    gathered = _gather_columns(xp, engine.comm, list(cotangents))
    zero = xp.zeros((), dtype=x.dtype, device=array_device(x))
    later = _later_rows(xp, engine.comm, queries.shape[-1], n, array_device(x))
    gathered = [xp.where(later, c, zero) for c in gathered]
    dx, dy, dw, params = engine.inner.profiles_vjp(queries, y, w, profiles, gathered, xp=xp)
    own_dx, own_dy, own_dw, own_params = engine.inner.causal_profiles_vjp(x, y, w, profiles, cotangents, xp=xp)
    return (engine.comm.scatter_sum(dx, -1) + own_dx, dy + own_dy, dw + own_dw, _vjp.add_params(params, own_params))


def attention_bwd(engine, inputs: _vjp.Inputs, form: _vjp.Form, gout, out, aux, *, xp):
    """The generic backward (:func:`._vjp.attention_bwd`) over a shard of every batch row's keys:
    the totals and the bad-key verdict are the forward's all-reduced ones, the profile-sum VJP runs
    for every rank's queries (:func:`_gathered_vjp`), the centring mean's adjoint is an all-reduce,
    and the silent rows are the traced answer (every rank sends the same columns)."""
    profile, normalizer, center = form
    keys = _vjp.screened_keys(xp, *inputs)
    totals, dv = aux["totals"], inputs.v.shape[-1]                               # (..., 1, Dv + 2)
    row_ok = totals[..., 0, dv + 1] == 0                                  # no bad key on any rank
    keys = keys._replace(good=keys.good & row_ok[..., None], take=keys.take & row_ok[..., None], row_bad=~row_ok)
    gout = as_work(xp, gout, keys.q.dtype)
    good = keys.good[..., None]
    cot = pullback(xp, gout, out, relu_count=aux["relu_count"], den=aux.get("den"), count=totals[..., dv:dv + 1],
                   value_sums=totals[..., :dv] if center else None, good=good, center=center, normalizer=normalizer)
    silent = _vjp.silent_rows(xp, profile, normalizer, aux.get("den"), good, uniform=True)
    mean_term = engine.comm.sum(xp.matrix_transpose(cot.mean_weights * cot.scale) @ gout) if center else None
    queries = aux["queries"]

    def profiles_vjp(x, y, w, profiles, cotangents, *, xp):
        return _gathered_vjp(engine, queries, y, w, profiles, cotangents, xp)

    dq, dk, dv, param = _vjp.sums_vjp(xp, profiles_vjp, keys, _vjp.zeroed_values(xp, keys), gout, cot, silent, form)
    return (*_vjp.nan_scores(xp, keys, dq, dk), _vjp.finished_dv(xp, keys, dv, mean_term), param)


def causal_bwd(engine, inputs: _vjp.Inputs, form: _vjp.Form, gout, out, aux, *, xp):
    """The generic causal backward (:func:`._vjp.causal_bwd`) over ranks holding consecutive shards
    of as many queries as keys: running totals start from the earlier ranks' (the forward's
    exclusive scan), a key's adjoint adds the later ranks' rows as one total per rank, and the
    profile-sum VJP is :func:`_causal_gathered_vjp`."""
    profile, normalizer, center = form
    grid = CausalGrid(inputs.q.shape[-1], inputs.k.shape[-1])
    keys = _vjp.screened_seen_keys(xp, grid, *inputs)
    ranks, dv = aux["totals"], inputs.v.shape[-1]          # (..., 2, Dv + 2): the earlier ranks' totals, everyone's
    before = ranks[..., 0:1, :dv + 1]
    keys = keys._replace(good=keys.good & (ranks[..., 0, dv + 1] == 0)[..., None],
                         row_bad=ranks[..., 1, dv + 1] > 0)               # the last query sees every key
    work = keys.q.dtype
    gout = as_work(xp, gout, work)
    values = _vjp.zeroed_values(xp, keys)
    # this rank's keys as the local grid sees them, after the earlier ranks' totals
    count = grid.seen_sums(xp, xp.astype(keys.take, work)[..., None], work) + before[..., dv:dv + 1]
    value_sums = grid.seen_sums(xp, values, work) + before[..., :dv] if center else None
    good = keys.good[..., None]
    cot = pullback(xp, gout, out, relu_count=aux["relu_count"], den=aux.get("den"), count=count,
                   value_sums=value_sums, good=good, center=center, normalizer=normalizer)
    silent = _vjp.silent_rows(xp, profile, normalizer, aux.get("den"), good, uniform=True)
    mean_term = None
    if center:
        # key j gets the rows of every query i >= j: this rank's by a reverse running sum, the later
        # ranks' as one total per rank
        rows = cot.mean_weights * cot.scale * gout
        after, _ = _scan_ranks(xp, engine.comm, xp.sum(rows, axis=-2), after=True)
        mean_term = grid.seen_sums_adjoint(xp, rows) + after[..., None, :]
    queries = aux["queries"]

    def profiles_vjp(x, y, w, profiles, cotangents, *, xp):
        return _causal_gathered_vjp(engine, queries, x, y, w, profiles, cotangents, xp)

    dq, dk, dv, param = _vjp.sums_vjp(xp, profiles_vjp, keys, values, gout, cot, silent, form)
    return (*_vjp.nan_scores(xp, keys, dq, dk), _vjp.finished_dv(xp, keys, dv, mean_term), param)


class ShardedEngine(Engine):
    """``inner`` run sequence-parallel over the communicator ``comm`` (see the module docstring).

    Used by :mod:`slicedkern.distributed`; the adapters run it like any engine, its backward is the
    generic one over the sharded key views, and ``collective`` tells them that every rank must run
    the backward.
    """

    collective = True
    #: traced as it runs (its inner engine must be too: :meth:`decline`)
    traceable = True

    def __init__(self, inner: Engine, comm):
        self.inner, self.comm = inner, comm
        self.supports_causal = inner.supports_causal and inner.gives_causal_sums

    @property
    def name(self) -> str:
        return self.inner.name

    def __eq__(self, other):
        return isinstance(other, ShardedEngine) and (self.inner, self.comm) == (other.inner, other.comm)

    def __hash__(self):
        return hash((ShardedEngine, self.inner, self.comm))

    def decline(self, spec, arrays, backend):
        if not isinstance(spec, AttentionSpec):
            return "the sharded engine computes attention only"
        reason = self.inner.decline(spec, arrays, backend)
        if reason is None and not self.inner.traceable and backend.operator_device(arrays[0]) is not None:
            # its collectives run between the inner engine's calls: no one operator holds the call
            reason = (f"sequence-parallel attention does not run the {self.name!r} engine under torch.compile; "
                      "use engine='scan'")
        if reason is None and getattr(spec, "causal", False) and not self.supports_causal:
            reason = (f"the {self.name!r} engine gives no causal partial sums, which sequence-parallel causal "
                      "attention adds across ranks; use engine='scan'")
        return reason

    def automatic(self, arrays) -> bool:
        return self.inner.automatic(arrays)

    # -- primitives ---------------------------------------------------------------------------
    def attention(self, inputs, form, *, xp, for_backward=False):
        (q, k, v, key_mask), (profile, normalizer, center) = inputs, form
        comm = self.comm
        work, dv = q.dtype, v.shape[-1]
        x, y, w, q_ok, row_ok = sanitize_keys(xp, q, k, v, key_mask)
        take = xp.broadcast_to(row_ok[..., None], k.shape)
        if key_mask is not None:
            take = take & key_mask
        takef = xp.astype(take, work)[..., None]
        queries = comm.gather(x, -1)                                      # (..., P n): O(n) scalars
        weights = xp.concat([w, xp.astype(takef, w.dtype)], axis=-1)      # [v | 1] over the valid keys
        parts = self._partial_sums(queries, y, weights, takef, profile, normalizer, xp=xp)
        bad = xp.astype(~row_ok, work)[..., None]
        totals = comm.sum(xp.concat([xp.sum(xp.astype(w, work), axis=-2), xp.sum(takef, axis=-2), bad], axis=-1))
        own = comm.scatter_sum(parts, -2)                                 # (..., n, Dv + 1 [+ 1])
        totals = totals[..., None, :]                                     # (..., 1, Dv + 2)
        good = q_ok & (totals[..., 0, dv + 1] == 0)[..., None]
        seen = xp.broadcast_to(totals[..., :dv + 1], own.shape[:-1] + (dv + 1,))
        return self._combined(xp, own, seen, good, center, normalizer, dv, (take, queries, totals))

    def causal_attention(self, inputs, form, *, xp):
        (q, k, v, key_mask), (profile, normalizer, center) = inputs, form
        comm, inner = self.comm, self.inner
        work, dev = q.dtype, array_device(q)
        n, dv = q.shape[-1], v.shape[-1]
        sc = screen_causal(xp, CausalGrid(n, n), q, k, v, key_mask)       # the NaN rule inside the shard
        takef = xp.astype(sc.take, work)[..., None]
        bad = ~sc.take if key_mask is None else key_mask & ~sc.take
        queries = comm.gather(sc.q, -1)                                   # (..., P n): O(n) scalars
        weights = xp.concat([sc.v, xp.astype(takef, sc.v.dtype)], axis=-1)   # [v | 1] over the valid keys
        parts = self._partial_sums(queries, sc.k, weights, takef, profile, normalizer, xp=xp)
        later = _later_rows(xp, comm, queries.shape[-1], n, dev)
        parts = xp.where(later, parts, xp.zeros((), dtype=parts.dtype, device=dev))
        own = comm.scatter_sum(parts, -2)                                 # (..., n, Dv + 1 [+ 1])
        mine = inner.causal_profile_sums(sc.q, sc.k, weights, _indicator_profiles(profile, normalizer, dv), xp=xp)
        own = own + (mine[0] if len(mine) == 1 else xp.concat(mine, axis=-1))
        rows = xp.concat([xp.astype(sc.v, work), takef, xp.astype(bad, work)[..., None]], axis=-1)
        before, everything = _scan_ranks(xp, comm, xp.sum(rows, axis=-2), after=False)   # (..., Dv + 2)
        seen = running_sum(xp, rows[..., :dv + 1], axis=-2) + before[..., None, :dv + 1]
        good = sc.good & (before[..., dv + 1] == 0)[..., None]
        ranks = xp.stack([before, everything], axis=-2)                   # (..., 2, Dv + 2)
        return self._combined(xp, own, seen, good, center, normalizer, dv, (sc.take, queries, ranks))

    def _partial_sums(self, queries, y, weights, takef, profile, normalizer, *, xp):
        """This shard's ``[N, R[, D]]`` for every gathered query over ``weights = [v | 1]``:
        (..., P n, Dv + 1 [+ 1])."""
        parts = [self.inner.kernel_sum(queries, y, weights, profile, xp=xp)]
        if normalizer.summed:
            parts.append(self.inner.indicator_sums(queries, y, takef, [normalizer.profile], xp=xp)[0])
        return parts[0] if len(parts) == 1 else xp.concat(parts, axis=-1)

    @staticmethod
    def _combined(xp, own, seen, good, center, normalizer, dv, kept):
        """``(out, residuals)`` from the owner's sums: residuals ``(take, relu_count, queries, totals or
        ranks[, den])``, what the backward reads back."""
        out, relu_count, den = combine(xp, Plain(xp), own[..., :dv + 1],
                                       own[..., dv + 1:dv + 2] if normalizer.summed else None, seen, good,
                                       center=center, normalizer=normalizer, dv=dv)
        take, queries, totals = kept
        return out, (take, relu_count, queries, totals) + ((den,) if den is not None else ())

    # -- backward -------------------------------------------------------------------------------
    def aux_of(self, residuals):
        return dict(zip(("take", "relu_count", "queries", "totals", "den"), residuals))

    def attention_vjp(self, inputs, form, g, out, residuals, *, xp):
        return attention_bwd(self, inputs, form, g, out, self.aux_of(residuals), xp=xp)

    def causal_attention_vjp(self, inputs, form, g, out, residuals, *, xp):
        return causal_bwd(self, inputs, form, g, out, self.aux_of(residuals), xp=xp)


    def backward(self, spec, arrays, out, residuals, g, *, xp):
        grads = super().backward(spec, arrays, out, residuals, g, xp=xp)
        # every rank holds the whole parameter: its gradient is summed over the group
        fixed = 3 + int(spec.has_mask)
        return grads[:fixed] + tuple(self.comm.sum(p) for p in grads[fixed:])
