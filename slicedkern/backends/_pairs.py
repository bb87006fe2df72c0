"""Compiled pair sums of the exact energy distance in R^d, for host-readable float64 points (numba).

The fast path of ``method="exact"`` of :func:`slicedkern.sliced.energy_distance` on NumPy arrays and
on CPU torch tensors outside autograd: the three sums ``sum_ij w_i w_j |p_i - q_j|`` of the pairs
(x, y), (x, x) and (y, y) with float64 accumulation, each distance taken from the coordinate
differences (not ``|a|^2 + |b|^2 - 2 a.b``, which cancels for close points), as in the array-API
formulation of ``slicedkern/sliced/_dense.py`` (docs/mathematics.rst, "Exact statistics in R^d").
The within-sample sums visit each unordered pair once (``i < j``) and double it. Each compiled
loop writes the weighted sum of one row of pairs (``w_i sum_j w_j |p_i - q_j|``); NumPy then adds
the rows pairwise, so the result does not depend on how the rows were split between threads.

numba is imported on first use (``import slicedkern`` imports no numba); without it
:func:`energy_pair_sums` returns ``None`` and the caller takes the array-API path.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import types

import numpy as np

__all__ = ["energy_pair_sums", "compiled", "available", "PARALLEL_PAIRS"]

#: Pairs of one call below which it runs serially on the calling thread (a pair costs about 1.2 ns
#: at d = 3, so about 2.5 ms of work): on a busy machine a parallel launch can wait ~20 ms for parked
#: worker threads (seen at n = m = 500 on a shared 2-core machine); the sweep engine draws its line
#: alike (slicedkern/engines/sweep/_convert.py).
PARALLEL_PAIRS = 2 ** 21


#: Second points per chunk of a row: the chunk's squared distances stay in the L1 cache between
#: the passes over the coordinates, the roots and the sum.
CHUNK = 256

# The kernels are module-level Python functions compiled on first use (numba imported lazily,
# compiled code cached on disk). ``prange`` and the row helpers are bound when compiling
# (:func:`compiled`); the entry points run their rows serially when ``workers == 1`` (small work:
# the thread pool stays asleep) and split them into ``workers`` contiguous ranges otherwise. The
# points come coordinate-major, (R, d, n): a row's pairs are taken a chunk of second points at a
# time in loops that the compiler vectorises (the squared distances one coordinate at a time, then
# the roots), and the chunk is added into four running sums (no reassociation by the compiler).

prange = range


def _nb_cross_row(p, wp, q, wq, r, i, start, buf):
    """``wp[r, i] sum_{j >= start} wq[r, j] |p[r, :, i] - q[r, :, j]|``, summed in float64;
    ``buf`` holds :data:`CHUNK` floats of scratch."""
    dim = p.shape[1]
    m = q.shape[2]
    a0 = 0.0
    a1 = 0.0
    a2 = 0.0
    a3 = 0.0
    for lo in range(start, m, CHUNK):
        size = min(CHUNK, m - lo)
        # views of the chunk, indexed from 0: the compiler sees indices that cannot wrap around
        # and vectorises the loops
        c = p[r, 0, i]
        qc = q[r, 0, lo:lo + size]
        for j in range(size):
            diff = c - qc[j]
            buf[j] = diff * diff
        for k in range(1, dim):
            c = p[r, k, i]
            qc = q[r, k, lo:lo + size]
            for j in range(size):
                diff = c - qc[j]
                buf[j] += diff * diff
        wc = wq[r, lo:lo + size]
        for j in range(size):
            buf[j] = math.sqrt(buf[j]) * wc[j]
        j = 0
        while j + 4 <= size:
            a0 += buf[j]
            a1 += buf[j + 1]
            a2 += buf[j + 2]
            a3 += buf[j + 3]
            j += 4
        while j < size:
            a0 += buf[j]
            j += 1
    return wp[r, i] * ((a0 + a1) + (a2 + a3))


_cross_row = _nb_cross_row


def _nb_cross(p, wp, q, wq, out, workers):
    """``out[r, i] = wp[r, i] sum_j wq[r, j] |p_i - q_j|`` for ``p`` (R, d, n), ``q`` (R, d, m)."""
    rows, n = out.shape
    total = rows * n
    step = (total + workers - 1) // workers
    if workers == 1:
        buf = np.empty(CHUNK)
        for t in range(total):
            out[t // n, t % n] = _cross_row(p, wp, q, wq, t // n, t % n, 0, buf)
    else:
        for w in prange(workers):
            buf = np.empty(CHUNK)
            for t in range(w * step, min(total, (w + 1) * step)):
                out[t // n, t % n] = _cross_row(p, wp, q, wq, t // n, t % n, 0, buf)


def _nb_within_pair(p, wp, r, k, buf):
    """The rows ``k`` and ``n - 1 - k`` of ``sum_{i < j} wp_i wp_j |p_i - p_j|`` (row ``i`` holds
    the pairs ``(i, j > i)``): together ``n - 1`` pairs, whatever ``k``."""
    n = p.shape[2]
    total = _cross_row(p, wp, p, wp, r, k, k + 1, buf)
    if n - 1 - k != k:
        total += _cross_row(p, wp, p, wp, r, n - 1 - k, n - k, buf)
    return total


_within_pair = _nb_within_pair


def _nb_within(p, wp, out, workers):
    """``out[r, k]`` = :func:`_nb_within_pair` for ``k < ceil(n / 2)``; ``p`` (R, d, n)."""
    rows, half = out.shape
    total = rows * half
    step = (total + workers - 1) // workers
    if workers == 1:
        buf = np.empty(CHUNK)
        for t in range(total):
            out[t // half, t % half] = _within_pair(p, wp, t // half, t % half, buf)
    else:
        for w in prange(workers):
            buf = np.empty(CHUNK)
            for t in range(w * step, min(total, (w + 1) * step)):
                out[t // half, t % half] = _within_pair(p, wp, t // half, t % half, buf)


def available() -> bool:
    """Whether the compiled sums can run here (numba installed); imports nothing."""
    return importlib.util.find_spec("numba") is not None


@functools.cache
def compiled():
    """``{"cross": ..., "within": ...}``, compiled on first call (cached on disk), or ``None``
    without numba."""
    if not available():
        return None
    import numba

    def jit(fn, bound, **options):
        # the Python function again, with numba's prange and the compiled helpers as its globals
        glob = dict(fn.__globals__, prange=numba.prange, **bound)
        return numba.njit(cache=True, nogil=True, fastmath=False, error_model="numpy", **options)(
            types.FunctionType(fn.__code__, glob, fn.__name__))

    cross_row = jit(_nb_cross_row, {}, inline="always")
    within_pair = jit(_nb_within_pair, {"_cross_row": cross_row}, inline="always")
    return {"cross": jit(_nb_cross, {"_cross_row": cross_row}, parallel=True),
            "within": jit(_nb_within, {"_within_pair": within_pair}, parallel=True)}


def _points(v, batch, size):
    """Points (..., size, d) broadcast to ``batch`` as a C-contiguous float64 (R, d, size) array."""
    dim = v.shape[-1]
    v = np.broadcast_to(v, tuple(batch) + (size, dim)).reshape(-1, size, dim)
    return np.ascontiguousarray(np.swapaxes(v, -1, -2), dtype=np.float64)


def _weights(w, batch, size):
    return np.ascontiguousarray(np.broadcast_to(w, tuple(batch) + (size,)).reshape(-1, size), dtype=np.float64)


def energy_pair_sums(x, y, a, b, batch: tuple) -> np.ndarray | None:
    """``2 sum a_i b_j |x_i - y_j| - sum a_i a_k |x_i - x_k| - sum b_j b_l |y_j - y_l|`` of float64
    points ``x`` (..., n, d), ``y`` (..., m, d) and probability weights ``a`` (..., n), ``b`` (..., m),
    broadcast to ``batch``: shape ``batch``; ``None`` when numba is missing."""
    kern = compiled()
    if kern is None:
        return None
    import numba
    n, m = x.shape[-2], y.shape[-2]
    px, py = _points(x, batch, n), _points(y, batch, m)
    wx, wy = _weights(a, batch, n), _weights(b, batch, m)
    rows = px.shape[0]
    pairs = rows * (n * m + (n * n + m * m) // 2)
    workers = 1 if pairs < PARALLEL_PAIRS else numba.get_num_threads()
    xy = np.empty((rows, n))
    xx = np.empty((rows, (n + 1) // 2))
    yy = np.empty((rows, (m + 1) // 2))
    kern["cross"](px, wx, py, wy, xy, max(1, min(workers, xy.size)))
    kern["within"](px, wx, xx, max(1, min(workers, xx.size)))
    kern["within"](py, wy, yy, max(1, min(workers, yy.size)))
    # rows of pairs added pairwise (np.sum): the within-sample sums count each pair once
    out = 2.0 * (np.sum(xy, axis=-1) - np.sum(xx, axis=-1) - np.sum(yy, axis=-1))
    return out.reshape(tuple(batch))
