"""Incremental attention for decoding: a binary counter of sorted runs, each with its prefix table.

docs/mathematics.rst, "Decoding". The keys appended so far are kept as a few *runs*, each sorted once
with its prefix table (:func:`._scan.sort_keys`), of sizes that strictly decrease: appending a chunk
makes it a run, and merges it with the last run while that one is not larger (the carries of a
binary counter), so there are at most ``log2 n + 1`` runs and each key is re-sorted ``O(log n)``
times. A query that sees every key appended so far is the sum over the runs of the ordinary
sort-scan sums (one rank search per knot and run, one gathered row each), combined as causal
attention combines its levels (:func:`._causal.compose`).
"""

from __future__ import annotations

import array_api_compat as compat

from ...kernels import Profile
from ._causal import compose
from ._scan import profile_sums, queries, sort_keys
from ._wide import arithmetic

__all__ = ["Runs"]


class _Run:
    def __init__(self, xp, ar, y, w, take):
        self.y, self.w, self.take = y, w, take
        self.sorted = sort_keys(y, w, xp=xp, ar=ar, take=take, ones=True)

    @property
    def size(self) -> int:
        return self.y.shape[-1]


class Runs:
    """The keys and values appended so far for a batch of rows, as sorted runs.

    Parameters
    ----------
    xp : namespace
    work : dtype
        The work dtype (float64, or float32 with double-float sums).
    """

    def __init__(self, xp, work):
        self.xp, self.work = xp, work
        self.ar = arithmetic(xp, work)
        self.runs: list[_Run] = []
        self.totals = None          # (..., 1, dv + 1): the values' sum and the count of the keys taken
        self.bad = None             # (...): some appended key or value was not finite

    @property
    def length(self) -> int:
        return sum(r.size for r in self.runs)

    def append(self, k, v):
        """Append keys ``k`` (..., t) in the work dtype and values ``v`` (..., t, dv), in position order."""
        xp = self.xp
        ok = xp.isfinite(k) & xp.all(xp.isfinite(v), axis=-1)
        bad = ~xp.all(ok, axis=-1)
        self.bad = bad if self.bad is None else self.bad | bad
        zero = xp.asarray(0.0, dtype=k.dtype, device=compat.device(k))
        k = xp.where(ok, k, zero)
        v = xp.where(ok[..., None], xp.astype(v, self.work), zero)
        rows = xp.concat([v, xp.astype(ok, self.work)[..., None]], axis=-1)
        total = xp.sum(rows, axis=-2, keepdims=True)
        self.totals = total if self.totals is None else self.totals + total
        y, w, take = k, v, ok
        while self.runs and self.runs[-1].size <= y.shape[-1]:
            last = self.runs.pop()
            y = xp.concat([last.y, y], axis=-1)
            w = xp.concat([last.w, w], axis=-2)
            take = xp.concat([last.take, take], axis=-1)
        self.runs.append(_Run(xp, self.ar, y, w, take))

    def attend(self, q, profile: Profile, *, center, normalizer, eps):
        """Attention of queries ``q`` (..., n) in the work dtype over every key appended so far."""
        xp, ar = self.xp, self.ar
        dv = self.totals.shape[-1] - 1
        profiles = [profile.with_(columns=slice(0, dv + 1))]
        if isinstance(normalizer, Profile):
            profiles.append(normalizer.with_(columns=slice(dv, dv + 1)))
        q_ok = xp.isfinite(q)
        q = xp.where(q_ok, q, xp.asarray(0.0, dtype=q.dtype, device=compat.device(q)))
        sums = None
        for run in self.runs:
            part = profile_sums(queries(q, run.sorted, ar=ar), run.sorted, profiles, xp=xp, ar=ar, strict=True)
            sums = part if sums is None else [ar.add(a, b) for a, b in zip(sums, part)]
        totals = xp.broadcast_to(self.totals, q.shape + (dv + 1,))
        good = q_ok & ~self.bad[..., None]
        out, _, _ = compose(xp, ar, sums[0], sums[1] if len(sums) > 1 else None, totals, good, center=center,
                            normalizer=normalizer, eps=eps, dv=dv)
        return out
