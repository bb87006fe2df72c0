"""Incremental attention for decoding: a binary counter of sorted runs, each with its prefix table.

docs/mathematics.rst, "Decoding". The keys appended so far are kept as a few *runs*, each sorted once
with its prefix table (:func:`slicedkern.engines.sortscan.sums.sort_keys`), of sizes that strictly
decrease: appending a chunk makes it a run, and merges it with the last run while that one is not
larger (the carries of a binary counter), so there are at most ``log2 n + 1`` runs and each key is
re-sorted ``O(log n)`` times. A query that sees every key appended so far is the sum over the runs of the ordinary
sort-scan sums (one rank search per knot and run, one gathered row each), combined as causal
attention combines its levels (:func:`slicedkern.engines._combine.combine`).

The work of one run (its sort and prefix table; its sums for a block of queries) and the final
combination are functions of arrays only, compiled by the backend row (``compile``: ``jax.jit`` on
JAX, nothing elsewhere): run sizes are the powers of two of a binary counter when tokens arrive
one by one, so JAX compiles ``O(log n)`` shapes, not one per token (docs/mathematics.rst, "Decoding").
"""

from __future__ import annotations

from ..._lib.namespace import array_device, scalar
from ..._spec import Normalizer
from ...backends import finite, finite_keys, ops_for
from ...kernels import Profile
from .._combine import combine
from .._runs import RunCounter
from ..sortscan.sums import SortedKeys, profile_sums, queries, sort_keys
from ..sortscan.wide import Pair, arithmetic

__all__ = ["Runs"]


def _parts(value) -> tuple:
    """A wide value as a tuple of arrays (what a compiled function may take and return)."""
    return (value.hi, value.lo) if isinstance(value, Pair) else (value,)


def _wide(parts: tuple):
    return Pair(*parts) if len(parts) == 2 else parts[0]


class _Run:
    def __init__(self, y, w, take, sorted_parts):
        self.y, self.w, self.take = y, w, take
        self.sorted_parts = sorted_parts        # (keys, prefix parts, shift) of sort_keys

    @property
    def size(self) -> int:
        return self.y.shape[-1]


class Runs:
    """The keys and values appended so far for a batch of rows, as sorted runs, and the attention of
    one op over them.

    Parameters
    ----------
    xp : namespace
    work : dtype
        The work dtype (float64, or float32 with double-float sums).
    profile : Profile
        The op's kernel profile.
    center : bool
    normalizer : Normalizer
        The op's options.
    dv : int
        Value columns.
    """

    #: Engine.decode_runs: takes the work dtype and a boolean key mask
    compiled = False

    def __init__(self, xp, work, profile: Profile, *, center: bool, normalizer: Normalizer, dv: int):
        self.xp, self.work = xp, work
        self.ar = ar = arithmetic(xp, work)
        self.runs: list[_Run] = []
        self._counter = RunCounter()        # which appends merge: the compiled runs' binary counter
        self.totals = None          # (..., 1, dv + 1): the values' sum and the count of the keys taken
        self.bad = None             # (...): some appended key or value was not finite
        profiles = [profile.with_(columns=slice(0, dv + 1))]
        if normalizer.summed:
            profiles.append(normalizer.profile.with_(columns=slice(dv, dv + 1)))

        def build(y, w, take):
            sk = sort_keys(y, w, xp=xp, ar=ar, take=take, ones=True)
            return sk.keys, _parts(sk.prefix), sk.shift

        def run_sums(q, keys, prefix, shift):
            sk = SortedKeys(keys, _wide(prefix), shift)
            return [_parts(s) for s in profile_sums(queries(q, sk, ar=ar), sk, profiles, xp=xp, ar=ar,
                                                    strict=True)]

        def finish(parts, totals, q_ok, bad):
            sums = [_wide(p) for p in parts[0]]
            for more in parts[1:]:
                sums = [ar.add(a, _wide(b)) for a, b in zip(sums, more)]
            totals = xp.broadcast_to(totals, q_ok.shape + (dv + 1,))
            out, _, _ = combine(xp, ar, sums[0], sums[1] if len(sums) > 1 else None, totals, q_ok & ~bad[..., None],
                                center=center, normalizer=normalizer, dv=dv)
            return out

        def admit(k, v, mask):
            ok = finite(xp, k) & finite_keys(xp, v)
            take = ok & mask
            zero = scalar(xp, 0.0, dtype=k.dtype, device=array_device(k))
            k = xp.where(ok, k, zero)
            v = xp.where(take[..., None], xp.astype(v, work), zero)
            rows = xp.concat([v, xp.astype(take, work)[..., None]], axis=-1)
            return k, v, take, xp.sum(rows, axis=-2, keepdims=True), xp.any(mask & ~ok, axis=-1)

        compile = ops_for(xp).compile
        self._admit, self._build = compile(admit), compile(build)
        self._run_sums, self._finish = compile(run_sums), compile(finish)

    @property
    def length(self) -> int:
        return self._counter.length

    def append(self, k, v, mask):
        """Append keys ``k`` (..., t) in the work dtype and values ``v`` (..., t, dv), in position order;
        ``mask`` (..., t) bool: the keys that take part."""
        xp = self.xp
        y, w, take, total, bad = self._admit(k, v, mask)   # non-finite keys: zeroed, flagged (the NaN rule)
        self.bad = bad if self.bad is None else self.bad | bad
        self.totals = total if self.totals is None else self.totals + total
        self._counter.push(y.shape[-1])
        while len(self.runs) >= self._counter.n_runs:      # the runs the new one carried into
            last = self.runs.pop()
            y = xp.concat([last.y, y], axis=-1)
            w = xp.concat([last.w, w], axis=-2)
            take = xp.concat([last.take, take], axis=-1)
        self.runs.append(_Run(y, w, take, self._build(y, w, take)))

    def attend(self, q):
        """Attention of queries ``q`` (..., n) in the work dtype over every key appended so far."""
        xp = self.xp
        q_ok = finite(xp, q)
        q = xp.where(q_ok, q, scalar(xp, 0.0, dtype=q.dtype, device=array_device(q)))
        parts = [self._run_sums(q, *run.sorted_parts) for run in self.runs]
        return self._finish(parts, self.totals, q_ok, self.bad)
