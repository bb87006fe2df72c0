"""A measured prototype, not library code: causal ReLU sums by a bottom-up divide and conquer over
positions, against the sweep's Fenwick tree (issue 25: "a blocked sweep over position chunks with
the divide-and-conquer only across chunks").

``out_i = sum over j <= i of relu(q_i - k_j) [v_j, 1]`` in float64: dense leaves of ``leaf``
positions, then per level the left half's keys and the right half's queries in sorted order (one
merge of index arrays a level) and one streaming pass per pair of halves. Three layouts:

* ``random_rows``: each right query adds ``q A - B`` into its accumulator row through the query
  permutation;
* ``sequential_rows``: the merges move the value rows and the accumulator rows into sorted order,
  so that every stream is sequential;
* ``column_blocks``: ``random_rows`` over blocks of ``cb`` value columns, so that a block's
  accumulators stay in cache.

Usage (from the repository root; numba and torch)::

    PYTHONPATH=. python scripts/causal_dc_prototype.py [--length 16384] [--rows 8] [--dim 64]

It checks the three against the dense sums first, then times them with the sweep's causal and
non-causal forwards, min of 3 round-robin runs (numba's and torch's 2 threads). What it showed,
quiet machine, 8 x 16384 x 64: sweep causal 91-109 ms, random rows 68-88 ms, sequential rows
227-235 ms, column blocks 182-324 ms, sweep non-causal 15-17 ms (the stop-39 note of issue 25).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from numba import njit, prange


@njit(cache=True)
def _merge(order, key, tmp, h, n):
    for s in range(0, n, 2 * h):
        mid = min(s + h, n)
        e = min(s + 2 * h, n)
        a, b, t = s, mid, s
        while a < mid and b < e:
            if key[order[b]] < key[order[a]]:
                tmp[t] = order[b]
                b += 1
            else:
                tmp[t] = order[a]
                a += 1
            t += 1
        while a < mid:
            tmp[t] = order[a]
            a += 1
            t += 1
        while b < e:
            tmp[t] = order[b]
            b += 1
            t += 1
    order[:n] = tmp[:n]


@njit(cache=True)
def _dense_leaves(q, k, v, leaf, acc):
    """The pairs inside each leaf of ``leaf`` positions, densely, into ``acc`` (n, D + 1); the keys'
    and the queries' orders sorted within each leaf."""
    n = q.shape[0]
    D = v.shape[1]
    for s in range(0, n, leaf):
        e = min(s + leaf, n)
        for i in range(s, e):
            qi = q[i]
            o = acc[i]
            for j in range(s, i + 1):
                w = qi - k[j]
                if w > 0:
                    vj = v[j]
                    for d in range(D):
                        o[d] += w * vj[d]
                    o[D] += w
    ko = np.empty(n, np.int64)
    qo = np.empty(n, np.int64)
    for s in range(0, n, leaf):
        e = min(s + leaf, n)
        ko[s:e] = s + np.argsort(k[s:e], kind="mergesort")
        qo[s:e] = s + np.argsort(q[s:e], kind="mergesort")
    return ko, qo


@njit(cache=True)
def _row_random(q, k, v, leaf, out):
    n = q.shape[0]
    D = v.shape[1]
    ko, qo = _dense_leaves(q, k, v, leaf, out)
    tmp = np.empty(n, np.int64)
    A = np.empty(D + 1)
    Bk = np.empty(D + 1)
    h = leaf
    while h < n:
        for s in range(0, n, 2 * h):
            mid = min(s + h, n)
            e = min(s + 2 * h, n)
            if mid >= e:
                continue
            A[:] = 0.0
            Bk[:] = 0.0
            p = s
            for t in range(mid, e):
                i = qo[t]
                qi = q[i]
                while p < mid and k[ko[p]] < qi:
                    j = ko[p]
                    kj = k[j]
                    vj = v[j]
                    for d in range(D):
                        x = np.float64(vj[d])
                        A[d] += x
                        Bk[d] += kj * x
                    A[D] += 1.0
                    Bk[D] += kj
                    p += 1
                o = out[i]
                for d in range(D + 1):
                    o[d] += qi * A[d] - Bk[d]
        _merge(ko, k, tmp, h, n)
        _merge(qo, q, tmp, h, n)
        h *= 2


@njit(parallel=True, cache=True)
def _rows_random(q, k, v, leaf, out):
    for b in prange(q.shape[0]):
        _row_random(q[b], k[b], v[b], leaf, out[b])


def random_rows(q, k, v, leaf=32):
    out = np.zeros(q.shape + (v.shape[-1] + 1,))
    _rows_random(q.astype(np.float64), k.astype(np.float64), v, leaf, out)
    return out


def dense(q, k, v):
    n = q.shape[-1]
    r = np.maximum(q[..., :, None] - k[..., None, :], 0) * np.tril(np.ones((n, n)))
    w = np.concatenate([v, np.ones(v.shape[:-1] + (1,))], -1)
    return r @ w



@njit(cache=True)
def _merge_rows(order, key, rows, otmp, rtmp, h, n):
    for s in range(0, n, 2 * h):
        mid = min(s + h, n)
        e = min(s + 2 * h, n)
        a, b, t = s, mid, s
        while a < mid or b < e:
            if b < e and (a >= mid or key[order[b]] < key[order[a]]):
                src = b
                b += 1
            else:
                src = a
                a += 1
            otmp[t] = order[src]
            rtmp[t, :] = rows[src, :]
            t += 1
    order[:n] = otmp[:n]
    rows[:n] = rtmp[:n]


@njit(cache=True)
def _row_sequential(q, k, v, leaf, out):
    n = q.shape[0]
    D = v.shape[1]
    acc = np.zeros((n, D + 1))
    ko, qo = _dense_leaves(q, k, v, leaf, acc)
    # values (with k) by key order, accumulators by query order, within blocks
    vs = np.empty((n, D + 1))
    for t in range(n):
        j = ko[t]
        for d in range(D):
            vs[t, d] = v[j, d]
        vs[t, D] = 1.0
    accs = np.empty((n, D + 1))
    for t in range(n):
        accs[t] = acc[qo[t]]
    ks = np.empty(n)
    qs = np.empty(n)
    otmp = np.empty(n, np.int64)
    rtmp = np.empty((n, D + 1))
    A = np.empty(D + 1)
    Bk = np.empty(D + 1)
    h = leaf
    while h < n:
        for t in range(n):
            ks[t] = k[ko[t]]
            qs[t] = q[qo[t]]
        for s in range(0, n, 2 * h):
            mid = min(s + h, n)
            e = min(s + 2 * h, n)
            if mid >= e:
                continue
            A[:] = 0.0
            Bk[:] = 0.0
            p = s
            for t in range(mid, e):
                qi = qs[t]
                while p < mid and ks[p] < qi:
                    kj = ks[p]
                    row = vs[p]
                    for d in range(D + 1):
                        A[d] += row[d]
                        Bk[d] += kj * row[d]
                    p += 1
                o = accs[t]
                for d in range(D + 1):
                    o[d] += qi * A[d] - Bk[d]
        _merge_rows(ko, k, vs, otmp, rtmp, h, n)
        _merge_rows(qo, q, accs, otmp, rtmp, h, n)
        h *= 2
    for t in range(n):
        out[qo[t]] = accs[t]


@njit(parallel=True, cache=True)
def _rows_sequential(q, k, v, leaf, out):
    for b in prange(q.shape[0]):
        _row_sequential(q[b], k[b], v[b], leaf, out[b])


def sequential_rows(q, k, v, leaf=16):
    out = np.zeros(q.shape + (v.shape[-1] + 1,))
    _rows_sequential(q.astype(np.float64), k.astype(np.float64), v, leaf, out)
    return out

@njit(cache=True)
def _row_blocked(q, k, v, leaf, cb, out):
    n = q.shape[0]
    D = v.shape[1]
    W = D + 1
    # the level orders, once per row (index arrays only), every level's kept
    levels = 0
    h = leaf
    while h < n:
        levels += 1
        h *= 2
    ko = np.empty((levels + 1, n), np.int64)
    qo = np.empty((levels + 1, n), np.int64)
    for s in range(0, n, leaf):
        e = min(s + leaf, n)
        ko[0, s:e] = s + np.argsort(k[s:e], kind="mergesort")
        qo[0, s:e] = s + np.argsort(q[s:e], kind="mergesort")
    tmp = np.empty(n, np.int64)
    h = leaf
    for lv in range(levels):
        ko[lv + 1] = ko[lv]
        qo[lv + 1] = qo[lv]
        _merge(ko[lv + 1], k, tmp, h, n)
        _merge(qo[lv + 1], q, tmp, h, n)
        h *= 2
    A = np.empty(cb)
    Bk = np.empty(cb)
    for c0 in range(0, W, cb):
        c1 = min(c0 + cb, W)
        w = c1 - c0
        acc = np.zeros((n, cb))
        for s in range(0, n, leaf):
            e = min(s + leaf, n)
            for i in range(s, e):
                qi = q[i]
                for j in range(s, i + 1):
                    r = qi - k[j]
                    if r > 0:
                        for d in range(w):
                            col = c0 + d
                            acc[i, d] += r * (v[j, col] if col < D else 1.0)
        h = leaf
        for lv in range(levels):
            kl = ko[lv]
            ql = qo[lv]
            for s in range(0, n, 2 * h):
                mid = min(s + h, n)
                e = min(s + 2 * h, n)
                if mid >= e:
                    continue
                A[:] = 0.0
                Bk[:] = 0.0
                p = s
                for t in range(mid, e):
                    i = ql[t]
                    qi = q[i]
                    while p < mid and k[kl[p]] < qi:
                        j = kl[p]
                        kj = k[j]
                        for d in range(w):
                            col = c0 + d
                            x = np.float64(v[j, col]) if col < D else 1.0
                            A[d] += x
                            Bk[d] += kj * x
                        p += 1
                    for d in range(w):
                        acc[i, d] += qi * A[d] - Bk[d]
            h *= 2
        for i in range(n):
            for d in range(w):
                out[i, c0 + d] = acc[i, d]


@njit(parallel=True, cache=True)
def _rows_blocked(q, k, v, leaf, cb, out):
    for b in prange(q.shape[0]):
        _row_blocked(q[b], k[b], v[b], leaf, cb, out[b])


def column_blocks(q, k, v, leaf=32, cb=17):
    out = np.zeros(q.shape + (v.shape[-1] + 1,))
    _rows_blocked(q.astype(np.float64), k.astype(np.float64), v, leaf, cb, out)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    variants = {"random rows": random_rows, "sequential rows": sequential_rows,
                "column blocks of 4": lambda q, k, v, leaf: column_blocks(q, k, v, leaf, 4)}
    for n, leaf in ((1, 4), (7, 4), (100, 8), (257, 16), (1000, 32)):
        q, k = rng.standard_normal((3, n)), rng.standard_normal((3, n))
        v = rng.standard_normal((3, n, 5)).astype(np.float32)
        want = dense(q, k, v.astype(np.float64))
        for name, fn in variants.items():
            err = np.abs(fn(q, k, v, leaf) - want).max() / np.abs(want).max()
            assert err < 1e-13, (name, n, err)
    print("the three layouts equal the dense sums (1 to 1000 positions)")

    import torch

    import slicedkern
    torch.set_num_threads(2)
    R, L, D = args.rows, args.length, args.dim
    q, k = rng.standard_normal((R, L)).astype(np.float32), rng.standard_normal((R, L)).astype(np.float32)
    v = rng.standard_normal((R, L, D)).astype(np.float32)
    tq, tk, tv = map(torch.from_numpy, (q, k, v))
    rows = {
        "sweep non-causal (abs, centred)": lambda: slicedkern.relu_attention(tq, tk, tv, engine="sweep"),
        "sweep causal (abs, centred)": lambda: slicedkern.relu_attention(tq, tk, tv, causal=True, engine="sweep"),
        "sweep causal (no normaliser, uncentred)": lambda: slicedkern.relu_attention(
            tq, tk, tv, causal=True, engine="sweep", normalize=None, center=False),
        "D&C random rows, leaves of 16": lambda: random_rows(q, k, v, 16),
        "D&C random rows, leaves of 32": lambda: random_rows(q, k, v, 32),
        "D&C random rows, leaves of 64": lambda: random_rows(q, k, v, 64),
        "D&C sequential rows, leaves of 32": lambda: sequential_rows(q, k, v, 32),
        "D&C column blocks of 33, leaves of 32": lambda: column_blocks(q, k, v, 32, 33),
        "D&C column blocks of 17, leaves of 32": lambda: column_blocks(q, k, v, 32, 17),
    }
    best = {name: float("inf") for name in rows}
    for fn in rows.values():
        fn()
    for _ in range(3):
        for name, fn in rows.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"R = {R}, L = {L}, D = {D}: min of 3 round-robin runs, load {os.getloadavg()[0]:.2f}")
    for name, t in best.items():
        print(f"  {name:45s} {t * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
