"""The binary counter of sorted runs over per-row storage: the bookkeeping of every engine's decoding
runs (:class:`slicedkern.engines.sweep._decode.HostRuns` on the host and
:class:`slicedkern.engines.triton._decode.DeviceRuns` on a GPU, over preallocated storage; the
array-API :class:`slicedkern.engines.scan._decode.Runs`, whose runs are arrays of their own, reads
which appends merge from it).

docs/mathematics.rst, "Decoding". The keys appended so far occupy positions ``0..n-1`` of each row's
storage; a run is a range ``[s, e)`` of positions whose keys are kept sorted with their prefix table.
Appending ``t`` keys makes them a run and merges it with the last run while that one is not larger
(the carries of a binary counter): at most ``log2 n + 1`` runs, sizes decreasing, and each key is
re-sorted ``O(log n)`` times. Storage is allocated ahead and doubles when full.
"""

from __future__ import annotations

import numpy as np

__all__ = ["RunCounter"]


class RunCounter:
    """Which positions form the runs; the storage and the kernels are the subclass's."""

    #: Engine.decode_runs: reads any float dtype (in float64) and writes the dtype ``attend`` is given
    compiled = True

    def __init__(self) -> None:
        # the runs as [start, end) position ranges, sizes decreasing: starts in bounds[0, :n_runs],
        # ends in bounds[1, :n_runs] (at most 64: a binary counter of positions < 2^64)
        self.bounds = np.zeros((2, 64), np.int64)
        self.n_runs = 0
        self.n = 0
        self.capacity = 0

    @property
    def length(self) -> int:
        return self.n

    @property
    def runs(self) -> list[tuple[int, int]]:
        """The runs as ``[start, end)`` position ranges, sizes decreasing."""
        return [(int(s), int(e)) for s, e in self.bounds[:, :self.n_runs].T]

    def room_for(self, t: int) -> int | None:
        """The capacity to grow the storage to before ``t`` more keys are written (None: no growth):
        twice the old, or twice the chunk (a bulk fill of ``n`` keys leaves room for ``n`` more)."""
        if self.n + t <= self.capacity:
            return None
        return max(16, 2 * self.capacity, self.n + t, 2 * t)

    def push(self, t: int) -> tuple[int, int]:
        """Record ``t`` keys appended at positions ``n..n+t-1``; returns the run ``[start, end)`` to
        sort now: the new keys with the runs they carry into."""
        start, end = self.n, self.n + t
        starts, ends = self.bounds
        while self.n_runs and ends[self.n_runs - 1] - starts[self.n_runs - 1] <= end - start:
            self.n_runs -= 1
            start = int(starts[self.n_runs])
        starts[self.n_runs], ends[self.n_runs] = start, end
        self.n_runs += 1
        self.n = end
        return start, end
