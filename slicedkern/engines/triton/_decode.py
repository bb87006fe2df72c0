"""Decoding on a GPU: :class:`DeviceRuns`, the interface of :class:`slicedkern.engines.scan._decode.Runs`
with the runs' storage on the device and a query's attention one Triton launch
(:func:`._kernels.decode_attend`) over every run.

The binary counter of sorted runs (docs/mathematics.rst, "Decoding"; :class:`.._runs.RunCounter`),
as the host's :class:`slicedkern.engines.sweep._decode.HostRuns` keeps it: per-row storage allocated
ahead, each run sorted with its inclusive prefix rows of ``[w, take, (y - shift) w, (y - shift)
take]`` in float64 (``shift`` the run's median key). Appending is a few torch operators (the new
keys written, the carried run sorted and its prefix rows summed); attending is one launch, whatever
the number of runs, instead of the array-API runs' operators per run and knot.
"""

from __future__ import annotations

import math

from ..._spec import Normalizer
from ...backends import finite, finite_keys
from ...kernels import Profile
from .._runs import RunCounter
from ._args import Runs, float64_scalar, log_steps, profile_record
from ._sums import loaded

__all__ = ["DeviceRuns"]

#: Queries per program of :func:`._kernels.decode_attend` (decoding asks one at a time; a prompt's
#: chunk fills them).
BLOCK_Q = 16


class DeviceRuns(RunCounter):
    """The keys and values appended so far for a batch of torch rows, as sorted runs on their device,
    and the attention of one op over them (the interface of
    :class:`~slicedkern.engines.scan._decode.Runs`).

    Parameters
    ----------
    xp : namespace
        The array namespace of torch.
    profile : Profile
        The op's kernel profile (array parameters broadcast to the batch shape).
    center : bool
    normalizer : Normalizer
    dv : int
        Value columns.
    """

    def __init__(self, xp, profile: Profile, *, center: bool, normalizer: Normalizer, dv: int):
        super().__init__()
        self.xp, self.profile, self.center, self.normalizer, self.dv = xp, profile, center, normalizer, dv
        self._args: tuple | None = None           # the profile as the kernel reads it, at the first append

    def _setup(self, batch: tuple, bsz: int, device) -> None:
        xp = self.xp
        self._batch, self._bsz, self._device = batch, bsz, device
        self._args = profile_record(loaded(), xp, self.profile, batch, bsz, device, strict=True)
        if self.normalizer.summed:
            self._nargs = profile_record(loaded(), xp, self.normalizer.profile, batch, bsz, device, strict=True)
        else:
            self._nargs = self._args
        self.totals = xp.zeros((bsz, self.dv + 1), dtype=xp.float64, device=device)
        self.bad = xp.zeros((bsz,), dtype=xp.bool, device=device)

    def _allocate(self, capacity: int) -> None:
        xp, bsz, dv, dev = self.xp, self._bsz, self.dv, self._device
        fresh = {"keys": xp.zeros((bsz, capacity), dtype=xp.float64, device=dev),
                 "values": xp.zeros((bsz, capacity, dv), dtype=xp.float64, device=dev),
                 "taken": xp.zeros((bsz, capacity), dtype=xp.bool, device=dev),
                 "sorted_keys": xp.zeros((bsz, capacity), dtype=xp.float64, device=dev),
                 "prefix": xp.zeros((bsz, capacity, 2 * (dv + 1)), dtype=xp.float64, device=dev),
                 "shifts": xp.zeros((bsz, capacity), dtype=xp.float64, device=dev)}
        for name, new in fresh.items():
            old = getattr(self, name, None)
            if old is not None:
                new[:, :self.n] = old[:, :self.n]
            setattr(self, name, new)
        self.capacity = capacity

    def append(self, k, v, mask=None) -> None:
        """Append keys ``k`` (..., t), values ``v`` (..., t, dv) and ``mask`` (..., t) bool (the keys
        that take part; None: all), in position order."""
        xp = self.xp
        k, v = k.detach(), v.detach()               # the runs keep no history (DecodeCache guards it)
        batch, t = tuple(k.shape[:-1]), k.shape[-1]
        bsz = math.prod(batch)
        if self._args is None:
            self._setup(batch, bsz, k.device)
        grow = self.room_for(t)
        if grow is not None:
            self._allocate(grow)
        k = xp.reshape(xp.astype(k, xp.float64), (bsz, t))
        v = xp.reshape(xp.astype(v, xp.float64), (bsz, t, self.dv))
        # the NaN rule: a key that takes part but is not finite is stored as a zero key that takes
        # no part, and marks its row
        ok = finite(xp, k) & finite_keys(xp, v)
        mask = None if mask is None else xp.reshape(mask, (bsz, t))
        take = ok if mask is None else ok & mask
        self.bad = self.bad | xp.any(~ok if mask is None else mask & ~ok, axis=-1)
        n = self.n
        self.keys[:, n:n + t] = xp.where(ok, k, 0.0)
        self.values[:, n:n + t] = xp.where(take[..., None], v, 0.0)
        self.taken[:, n:n + t] = take
        self.totals[:, :self.dv] += xp.sum(self.values[:, n:n + t], axis=1)
        self.totals[:, self.dv] += xp.sum(xp.astype(take, xp.float64), axis=1)
        start, end = self.push(t)
        self._build(start, end)

    def _build(self, s: int, e: int) -> None:
        """Sort the keys of positions ``[s, e)`` of every row and write their prefix rows."""
        xp = self.xp
        keys, order = self.keys[:, s:e].sort(dim=-1, stable=True)      # one sort: values and order
        shift = keys[:, (e - s) // 2:(e - s) // 2 + 1]
        w = xp.take_along_axis(self.values[:, s:e], order[..., None], axis=1)
        taken = xp.astype(xp.take_along_axis(self.taken[:, s:e], order, axis=1), xp.float64)[..., None]
        ys = (keys - shift)[..., None]
        rows = xp.concat([w, taken, ys * w, ys * taken], axis=-1)
        self.prefix[:, s:e] = xp.cumulative_sum(rows, axis=1)
        self.sorted_keys[:, s:e] = keys
        self.shifts[:, s] = shift[:, 0]

    def attend(self, q, dtype=None):
        """Attention of queries ``q`` (..., M) over every key appended so far, one launch; in
        ``dtype`` (default float64)."""
        xp = self.xp
        m = q.shape[-1]
        out = xp.empty((self._bsz, m, self.dv), dtype=xp.float64, device=self._device)
        if m and self._bsz and self.dv:
            bounds = xp.asarray(self.bounds[:, :self.n_runs].copy(), device=self._device)
            grid = (self._bsz, -(-m // BLOCK_Q))
            runs = Runs(bounds, self.n_runs, self.sorted_keys, self.prefix, self.shifts, self.totals,
                        xp.astype(self.bad, xp.int8), self.capacity, log_steps(self.capacity))
            loaded().decode_attend[grid](
                xp.reshape(xp.astype(q.detach(), xp.float64), (self._bsz, m)).contiguous(), runs, self._args,
                self._nargs, out, m, self.dv, float64_scalar(xp, self.normalizer.eps, self._device),
                CENTER=bool(self.center), NORM=self.normalizer.code, BLOCK_Q=BLOCK_Q,
                BLOCK_W=max(2, 1 << self.dv.bit_length()))      # a power of two >= dv + 1
        out = xp.reshape(out, self._batch + (m, self.dv))
        return out if dtype is None else xp.astype(out, dtype)
