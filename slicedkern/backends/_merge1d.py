"""Compiled merge kernels of the exact 1-D energy distance, for NumPy float64 samples (numba).

The fast path of :func:`slicedkern.sliced.energy_distance` on NumPy: each sample is sorted once
(NumPy's vectorised ``np.sort``; a weighted sample sorts integer keys that pack the value's
order-preserving bits with the point's index, then gathers its weights), and one compiled pass
merges the two sorted samples while it accumulates the CDF gap exactly and the integral of its
square with a compensated sum. The arithmetic is that of the array-API formulation in
``slicedkern/sliced/_exact1d.py`` (docs/mathematics.rst, "Exact 1-D statistics"); both give a
relative error of about ``1e-16``.

numba is imported on first use (``import slicedkern`` imports no numba); without it
:func:`energy_distance_rows` returns ``None`` and the caller takes the array-API path.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import numpy as np

__all__ = ["energy_distance_rows", "compiled"]


# The kernels are module-level Python functions compiled on first use (numba imported lazily,
# compiled code cached on disk). Their arithmetic is written out (no helper calls) so that each
# caches as one unit; it is the error-free arithmetic of the array-API path, in double-double.

def _nb_counts(xs, ys, out):
    """Unweighted ED of sorted rows ``xs`` (R, n) and ``ys`` (R, m) into ``out`` (R,)."""
    rows, n = xs.shape
    m = ys.shape[1]
    nm = float(n) * float(m)
    for r in range(rows):
        x = xs[r]
        y = ys[r]
        # sorted with NaN last: the ends tell whether the row is finite
        if not (np.isfinite(x[0]) and np.isfinite(x[n - 1]) and np.isfinite(y[0]) and np.isfinite(y[m - 1])):
            out[r] = np.nan
            continue
        i = 0
        j = 0
        prev = min(x[0], y[0])
        gap = 0.0                      # E_k = i m - j n, exact
        acc = 0.0
        comp = 0.0
        while i < n or j < m:
            if j == m or (i < n and x[i] <= y[j]):
                cur = x[i]
                i += 1
            else:
                cur = y[j]
                j += 1
            t = gap * gap * (cur - prev)
            s = acc + t                # TwoSum: acc + comp carries the sum in double-double
            bb = s - acc
            comp += (acc - (s - bb)) + (t - bb)
            acc = s
            gap = float(i * m - j * n)
            prev = cur
        out[r] = 2.0 * ((acc + comp) / nm) / nm


def _nb_weighted(xs, wx, ys, wy, out):
    """Weighted ED of sorted rows ``xs``, ``ys`` with their raw weights into ``out`` (R,)."""
    rows, n = xs.shape
    m = ys.shape[1]
    factor = 134217729.0
    for r in range(rows):
        x = xs[r]
        a = wx[r]
        y = ys[r]
        b = wy[r]
        # exact-ish sums S = s1 + s2, T = t1 + t2 (TwoSum accumulation)
        s1 = 0.0
        s2 = 0.0
        for k in range(n):
            s = s1 + a[k]
            bb = s - s1
            s2 += (s1 - (s - bb)) + (a[k] - bb)
            s1 = s
        t1 = 0.0
        t2 = 0.0
        for k in range(m):
            s = t1 + b[k]
            bb = s - t1
            t2 += (t1 - (s - bb)) + (b[k] - bb)
            t1 = s
        fa = 1.0
        fb = 1.0
        if s1 > 2.0 ** 300:
            fa = 2.0 ** -400
        elif s1 < 2.0 ** -300:
            fa = 2.0 ** 400
        if t1 > 2.0 ** 300:
            fb = 2.0 ** -400
        elif t1 < 2.0 ** -300:
            fb = 2.0 ** 400
        s1 *= fa
        s2 *= fa
        t1 *= fb
        t2 *= fb
        if not (np.isfinite(s1) and np.isfinite(t1) and np.isfinite(s2) and np.isfinite(t2)):
            out[r] = np.nan
            continue
        c = factor * s1
        s1h = c - (c - s1)
        s1l = s1 - s1h
        c = factor * t1
        t1h = c - (c - t1)
        t1l = t1 - t1h
        inv = 1.0 / ((s1 * t1) * (1.0 + s2 / s1 + t2 / t1))
        big = 3.0 * (s1 * t1)
        i = 0
        j = 0
        prev = min(x[0], y[0])
        # E_k = T A_k - S B_k = e_on + e_off: e_on sums the parts of the exact products on the grid
        # ulp(big) (exact: no rounding at all), e_off the small remainders. Two independent one-add
        # chains: the loop is not held up by double-double latency.
        e_on = 0.0
        e_off = 0.0
        acc = 0.0
        comp = 0.0
        finite = True
        while i < n or j < m:
            if j == m or (i < n and x[i] <= y[j]):
                cur = x[i]
                w = a[i] * fa
                p = w * t1             # two-product w * t1 = p + e, plus w * t2
                c = factor * w
                wh = c - (c - w)
                wl = w - wh
                e = ((wh * t1h - p) + wh * t1l + wl * t1h) + wl * t1l + w * t2
                i += 1
            else:
                cur = y[j]
                w = b[j] * fb
                p = w * s1
                c = factor * w
                wh = c - (c - w)
                wl = w - wh
                e = ((wh * s1h - p) + wh * s1l + wl * s1h) + wl * s1l + w * s2
                p = -p
                e = -e
                j += 1
            if not np.isfinite(cur):
                finite = False
            d = (e_on + e_off) * inv
            t = d * d * (cur - prev)
            s = acc + t
            bb = s - acc
            comp += (acc - (s - bb)) + (t - bb)
            acc = s
            on = (p + big) - big
            e_on += on
            e_off += (p - on) + e
            prev = cur
        out[r] = 2.0 * (acc + comp) if finite else np.nan


def _nb_pack(bits, shift, out):
    """Order-preserving keys of float64 ``bits`` (uint64 view), low ``shift`` bits = column index."""
    rows, n = bits.shape
    top = np.uint64(1) << np.uint64(63)
    low = (np.uint64(1) << np.uint64(shift)) - np.uint64(1)
    for r in range(rows):
        for k in range(n):
            u = bits[r, k]
            u = ~u if u & top else u | top
            out[r, k] = (u & ~low) | np.uint64(k)


def _nb_unpack(keys, shift, vals, w, out_v, out_w, overflow):
    """Gather values and weights in key order, then repair the order where keys tie.

    Keys tie in their value bits only for values that agree in their top ``64 - shift`` bits; such
    values are adjacent after the sort, so an insertion pass repairs them in ``O(n + moves)``. A row
    whose repair would take more than ``8 n`` moves (values crowded within ``2^-(52 - shift)`` of each
    other) is left to the caller (``overflow[r] = 1``).
    """
    rows, n = keys.shape
    low = (np.uint64(1) << np.uint64(shift)) - np.uint64(1)
    budget = 8 * n + 64
    for r in range(rows):
        for k in range(n):
            idx = np.int64(keys[r, k] & low)
            out_v[r, k] = vals[r, idx]
            out_w[r, k] = w[r, idx]
        moves = 0
        overflow[r] = 0
        for k in range(1, n):
            v = out_v[r, k]
            if not v < out_v[r, k - 1]:
                continue
            wk = out_w[r, k]
            q = k
            while q > 0 and v < out_v[r, q - 1]:
                out_v[r, q] = out_v[r, q - 1]
                out_w[r, q] = out_w[r, q - 1]
                q -= 1
            out_v[r, q] = v
            out_w[r, q] = wk
            moves += k - q
            if moves > budget:
                overflow[r] = 1
                break


@functools.cache
def compiled():
    """The compiled kernels (compiled on first call, cached on disk), or ``None`` without numba."""
    if importlib.util.find_spec("numba") is None:
        return None
    import numba
    jit = numba.njit(cache=True, nogil=True)
    return {f.__name__[4:]: jit(f) for f in (_nb_counts, _nb_weighted, _nb_pack, _nb_unpack)}


def _rows(a, batch, size):
    """``a`` broadcast to ``batch + (size,)`` as a C-contiguous float64 (R, size) array."""
    return np.ascontiguousarray(np.broadcast_to(a, batch + (size,)).reshape(-1, size), dtype=np.float64)


def _sort_weighted(kern, v, w):
    """Rows of ``v`` sorted, ``w`` permuted alike: one ``np.sort`` of packed integer keys (value bits
    above, column index below; NumPy's vectorised sort, about 3x faster than ``np.argsort``), a
    gather, and a local repair where values share their top key bits (:func:`_nb_unpack`)."""
    rows, n = v.shape
    shift = max(1, (n - 1).bit_length())
    keys = np.empty((rows, n), dtype=np.uint64)
    kern["pack"](v.view(np.uint64), shift, keys)
    keys.sort(axis=-1)
    vs, ws = np.empty_like(v), np.empty_like(w)
    overflow = np.empty(rows, dtype=np.int64)
    kern["unpack"](keys, shift, v, w, vs, ws, overflow)
    for r in np.flatnonzero(overflow):
        order = np.argsort(v[r], kind="stable")
        vs[r], ws[r] = v[r][order], w[r][order]
    return vs, ws


def energy_distance_rows(x, y, a, b, batch: tuple) -> np.ndarray | None:
    """ED of float64 rows ``x`` (..., n), ``y`` (..., m) with raw weights ``a``, ``b`` (or ``None``),
    broadcast to ``batch``; ``None`` when numba is missing."""
    kern = compiled()
    if kern is None:
        return None
    n, m = x.shape[-1], y.shape[-1]
    out = np.empty(math.prod(batch), dtype=np.float64)
    if a is None and b is None:
        # sort each sample in its own batch shape, broadcast afterwards (sorting commutes with it)
        xs = _rows(np.sort(x, axis=-1), batch, n)
        ys = _rows(np.sort(y, axis=-1), batch, m)
        kern["counts"](xs, ys, out)
    else:
        sides = []
        for v, w, size in ((x, a, n), (y, b, m)):
            w = np.ones((size,)) if w is None else w
            own = tuple(np.broadcast_shapes(v.shape[:-1], w.shape[:-1]))
            vs, ws = _sort_weighted(kern, _rows(v, own, size), _rows(w, own, size))
            sides.append((_rows(vs.reshape(own + (size,)), batch, size),
                          _rows(ws.reshape(own + (size,)), batch, size)))
        (xs, wx), (ys, wy) = sides
        kern["weighted"](xs, wx, ys, wy, out)
    return out.reshape(batch)
