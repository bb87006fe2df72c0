"""Decoding on the host: :class:`HostRuns`, the interface of :class:`slicedkern.engines.scan._decode.Runs`
over the compiled kernels of :mod:`._kernels_decode`, for NumPy arrays and CPU torch tensors.

The same binary counter of sorted runs (docs/mathematics.rst, "Decoding"), with each run's sort and
prefix table and every query's rank searches compiled, and the keys kept in preallocated per-row
storage that doubles when full; the attention arithmetic is compiled with the sums
(:func:`._kernels_decode.attend_rows`, the twin of :func:`slicedkern.engines._combine.combine`).
Imported where numba is.
"""

from __future__ import annotations

import functools
import math
import mmap
from collections.abc import Callable

import numpy as np

from ..._spec import Normalizer
from ...kernels import Profile
from .._runs import RunCounter
from ._convert import host_view, sweep_profile, wrap
from ._kernels_decode import admit, attend_rows, build_run

__all__ = ["HostRuns"]

#: Storage below this many bytes comes from ``np.empty`` as usual (:func:`_storage`).
_SMALL_STORAGE = 1 << 22


def _storage(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised array for the cache's storage, declining transparent huge pages (Linux).

    NumPy advises the kernel to back arrays of 4 MiB and more with 2 MiB pages. The storage is
    allocated at twice what it holds and filled a token at a time, so every few thousand tokens a
    write lands on a page not touched yet; where the kernel compacts memory to find a huge page
    (``/sys/kernel/mm/transparent_hugepage/defrag`` = ``madvise``, this project's machines) that
    one write stalls for milliseconds. Measured at a cache of 2^20 keys, 4 heads of dimension 16:
    the first append after the fill 18 to 23 ms with huge pages, 0.4 to 7 ms without; with another
    job on both cores, an append 49 µs against 17 µs averaged over 512 tokens (docs/benchmarks.rst,
    "Decoding"). Elsewhere (no ``MADV_NOHUGEPAGE``), or when small, ``np.empty``.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is None or nbytes < _SMALL_STORAGE:
        return np.empty(shape, dtype)
    buffer = mmap.mmap(-1, nbytes)                  # anonymous, private, read-write; freed with the array
    buffer.madvise(advice)
    return np.frombuffer(buffer, dtype).reshape(shape)


@functools.lru_cache(maxsize=16)
def _written_dtype(dtype) -> type:
    """The NumPy dtype the kernel writes an output of ``dtype`` (NumPy or torch) in: float32 and
    float64 directly, every other one in float64 (cast afterwards)."""
    name = str(dtype).rsplit(".", 1)[-1]           # "float32" for np.float32 and torch.float32 alike
    return np.dtype(name).type if name in ("float32", "float64") else np.float64


@functools.lru_cache(maxsize=16)
def _all_taken(shape: tuple) -> np.ndarray:
    """A read-only all-True key mask (the same few chunk shapes recur while generating)."""
    mask = np.ones(shape, np.bool_)
    mask.flags.writeable = False
    return mask


class HostRuns(RunCounter):
    """The keys and values appended so far for a batch of rows, as sorted runs on the host, and the
    attention of one op over them (the interface of :class:`~slicedkern.engines.scan._decode.Runs`).

    Parameters
    ----------
    host_profile : callable
        ``host_profile(batch)``: the op's kernel profile as the host bridge takes it
        (:class:`~slicedkern.kernels.Profile` of numbers or host arrays) for that batch shape (the
        engine's ``_host_profile``).
    center : bool
    normalizer : Normalizer
    dv : int
        Value columns.
    """

    def __init__(self, host_profile: Callable[[tuple], Profile], *, center: bool, normalizer: Normalizer, dv: int):
        super().__init__()
        self.host_profile, self.center, self.normalizer, self.dv = host_profile, center, normalizer, dv
        self._rows = None                           # per-row kernel profile, set at the first append

    def _setup(self, batch: tuple, bsz: int) -> None:
        rows, self._zero_knot, _ = sweep_profile(self.host_profile(batch), batch, bsz, self.normalizer)
        self._rows = rows[:4]
        self._options = (bool(self.center), self.normalizer.code, self._zero_knot,
                         float(self.normalizer.eps))
        self._batch, self._bsz = batch, bsz
        self.totals = np.zeros((bsz, self.dv + 1))
        self.bad = np.zeros(bsz, np.bool_)

    def _allocate(self, capacity: int) -> None:
        bsz, dv, old = self._bsz, self.dv, getattr(self, "keys", None)
        fresh = (_storage((bsz, capacity), np.float64), _storage((bsz, capacity, dv), np.float64),
                 _storage((bsz, capacity), np.bool_), _storage((bsz, capacity), np.float64),
                 _storage((bsz, capacity, 2 * (dv + 1)), np.float64), _storage((bsz, capacity), np.float64))
        if old is not None:
            for new, cur in zip(fresh, (self.keys, self.values, self.taken, self.sorted_keys, self.prefix,
                                        self.shifts)):
                new[:, :self.n] = cur[:, :self.n]
        self.keys, self.values, self.taken, self.sorted_keys, self.prefix, self.shifts = fresh
        self.capacity = capacity

    def append(self, k, v, mask=None) -> None:
        """Append keys ``k`` (..., t), values ``v`` (..., t, dv) and ``mask`` (..., t) bool (the keys
        that take part; None: all), in position order."""
        k, v = host_view(k, "k")[0], host_view(v, "v")[0]
        batch, t = k.shape[:-1], k.shape[-1]
        mask = _all_taken(k.shape) if mask is None else host_view(mask, "key_mask")[0]
        bsz = math.prod(batch)
        if self._rows is None:
            self._setup(batch, bsz)
        grow = self.room_for(t)
        if grow is not None:
            self._allocate(grow)
        admit(k.reshape(bsz, t), v.reshape(bsz, t, self.dv), mask.reshape(bsz, t), self.n, self.keys,
              self.values, self.taken, self.totals, self.bad)
        start, end = self.push(t)
        build_run(start, end, self.keys, self.values, self.taken, self.sorted_keys, self.prefix, self.shifts)

    def attend(self, q, dtype=None):
        """Attention of queries ``q`` (..., M) over every key appended so far (a tensor for a torch
        ``q``), written by the kernel in ``dtype`` when that is float32 or float64 (NumPy or torch),
        else in float64."""
        host, tdt = host_view(q, "q")
        m = host.shape[-1]
        out = np.empty((self._bsz, m, self.dv), _written_dtype(dtype))
        attend_rows(host.reshape(self._bsz, m), self.bounds[0, :self.n_runs], self.bounds[1, :self.n_runs],
                    self.sorted_keys, self.prefix, self.shifts, self.totals, self.bad, self._rows, self._options, out)
        out = out.reshape(self._batch + (m, self.dv))
        return out if tdt is None else wrap(out, [tdt])
