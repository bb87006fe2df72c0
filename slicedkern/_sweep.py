"""The fused CPU **sweep** engine (SPEC §5): one compiled loop per batch row, float64 running sums.

Optional: it needs numba. Nothing else in the package imports this module unless asked, and
:data:`AVAILABLE` is ``False`` (not an ``ImportError``) where numba is missing.

How it works, per batch row (rows run in parallel with ``numba.prange``)
------------------------------------------------------------------------
1. *Prepare*: the finite queries and the valid keys are copied to float64, sorted once each with a
   stable LSD radix argsort (the float64 bit patterns, 11-bit digits, passes with a single digit
   skipped), and shifted by the median key. Non-finite queries go to the tail of the query
   permutation; a non-finite valid key marks the row bad.
2. *Sweep*: for every knot ``t_m`` the shifted queries ``s = x_i - t_m`` are visited in increasing
   order (one query sort serves every knot: shifting keeps the order), while a pointer per knot
   advances through the sorted keys, accumulating float64 running sums ``P0 = sum w_j`` and
   ``P1 = sum y_j w_j`` over the keys ``y_j <= s`` (merge-style: no binary search). The output row
   ``i`` (original order, written once through the query permutation) is
   ``a T0 + b (x_i T0 - T1) + sum_m C_m (s P0_m - P1_m)``, assembled in a float64 scratch row.
   Each weight row is read once per knot with a non-zero coefficient, straight from the caller's
   array through the key permutation; nothing of size ``n x c`` is allocated besides the output.
3. Column chunks: when there are fewer batch rows than threads, the weight columns are split into
   chunks of at least 16 and (row, chunk) pairs run in parallel (sorting stays per row).

Attention (``attention``) adds the valid-key indicator as an implicit extra column (its running
sums are the pointer position and the running key sum), centring folded in as ``N - mu R``, and
the normalisers. The backward pass (``kernel_sum_vjp``) runs the same sweep twice: queries over
keys for ``dx`` (step sums ``P0``), and keys over queries (roles swapped, reflected kernel) for
``dw`` and ``dy``.

NaN policy (SPEC §4): a non-finite query gives a NaN output row; a non-finite valid key or weight
gives NaN for the whole batch row (detected through the float64 totals: a sum that meets an inf or
a NaN stays non-finite). For the backward pass, any non-finite value among ``x, y, w, g`` in a
batch row makes all of that row's gradients NaN.

Tie rule: a key equal to ``x_i - t_m`` counts as ``<=`` (the step ``H(0) = 1``); values do not
depend on it (``ReLU(0) = 0``).

Inputs: NumPy arrays or CPU torch tensors (zero-copy through ``.numpy()`` where contiguous; torch
in gives torch out). float16 is computed in float32.
"""

from __future__ import annotations

import math

import numpy as np

try:
    import numba
    from numba import njit, prange
except ImportError:  # numba is optional
    numba = None

AVAILABLE = numba is not None

__all__ = ["AVAILABLE", "kernel_sum", "attention", "kernel_sum_vjp", "warmup"]

_NORM_CODES = {None: 0, "abs": 1, "relu": 2, "count": 3}
_MODE_SUM, _MODE_ATTN, _MODE_DX, _MODE_SWAP = 0, 1, 2, 3
_MIN_CHUNK = 16


def _unavailable(*_args, **_kwargs):
    raise RuntimeError("the sweep engine needs numba, which is not installed (pip install numba)")


if AVAILABLE:
    _U1 = np.uint64(1)
    _TOP = np.uint64(1) << np.uint64(63)
    _DMASK = np.uint64(2047)

    # ------------------------------------------------------------------------------- sorting
    @njit(cache=True, nogil=True)
    def _radix_sort(vals, payload, n):
        """Sort ``vals[:n]`` (finite float64) in place, stably, carrying ``payload[:n]`` along.

        LSD radix sort on the order-preserving unsigned image of the float64 bits, 11-bit digits,
        digits shared by every key skipped (float32 data in float64 skips about two passes).
        """
        if n < 2:
            return
        keys = np.empty(n, np.uint64)
        bits = vals[:n].view(np.uint64)
        for i in range(n):
            u = bits[i]
            if u & _TOP:
                keys[i] = ~u
            else:
                keys[i] = u | _TOP
        hist = np.zeros((6, 2048), np.int64)
        for i in range(n):
            k = keys[i]
            for p in range(6):
                hist[p, np.int64((k >> np.uint64(11 * p)) & _DMASK)] += 1
        tkeys = np.empty(n, np.uint64)
        tpay = np.empty(n, np.int64)
        src_k, src_p, dst_k, dst_p = keys, payload, tkeys, tpay
        offs = np.empty(2048, np.int64)
        swapped = False
        for p in range(6):
            single = False
            for d in range(2048):
                if hist[p, d] == n:
                    single = True
                    break
                if hist[p, d] != 0:
                    break
            if single:
                continue
            total = 0
            for d in range(2048):
                offs[d] = total
                total += hist[p, d]
            sh = np.uint64(11 * p)
            for i in range(n):
                k = src_k[i]
                d = np.int64((k >> sh) & _DMASK)
                pos = offs[d]
                offs[d] = pos + 1
                dst_k[pos] = k
                dst_p[pos] = src_p[i]
            src_k, dst_k = dst_k, src_k
            src_p, dst_p = dst_p, src_p
            swapped = not swapped
        out = vals[:n].view(np.uint64)
        for i in range(n):
            k = src_k[i]
            if k & _TOP:
                out[i] = k & ~_TOP
            else:
                out[i] = ~k
        if swapped:
            for i in range(n):
                payload[i] = src_p[i]

    @njit(cache=True, nogil=True)
    def _prepare_row(b, x, y, mask, has_mask, xs, qperm, ys, kperm):
        """Sort one row's finite queries and valid keys; returns (nq, nk, shift, key_bad)."""
        n = x.shape[1]
        m = y.shape[1]
        vals = np.empty(m, np.float64)
        idx = np.empty(m, np.int64)
        nk = 0
        bad = False
        for j in range(m):
            if has_mask and not mask[b, j]:
                continue
            yv = np.float64(y[b, j])
            if not np.isfinite(yv):
                bad = True
                break
            vals[nk] = yv
            idx[nk] = j
            nk += 1
        if bad:
            return 0, 0, 0.0, True
        _radix_sort(vals, idx, nk)
        shift = vals[nk // 2] if nk > 0 else 0.0
        for p in range(nk):
            ys[b, p] = vals[p] - shift
            kperm[b, p] = idx[p]
        qv = np.empty(n, np.float64)
        qi = np.empty(n, np.int64)
        nq = 0
        tail = n
        for i in range(n):
            xv = np.float64(x[b, i])
            if np.isfinite(xv):
                qv[nq] = xv
                qi[nq] = i
                nq += 1
            else:
                tail -= 1
                qperm[b, tail] = i
        _radix_sort(qv, qi, nq)
        for p in range(nq):
            xs[b, p] = qv[p] - shift
            qperm[b, p] = qi[p]
        return nq, nk, shift, False

    @njit(parallel=True, cache=True)
    def _prepare(x, y, mask, has_mask):
        bsz, n = x.shape
        m = y.shape[1]
        xs = np.empty((bsz, n), np.float64)
        qperm = np.empty((bsz, n), np.int64)
        ys = np.empty((bsz, m), np.float64)
        kperm = np.empty((bsz, m), np.int64)
        nq = np.zeros(bsz, np.int64)
        nk = np.zeros(bsz, np.int64)
        shift = np.zeros(bsz, np.float64)
        keybad = np.zeros(bsz, np.bool_)
        for b in prange(bsz):
            a, c, s, bad = _prepare_row(b, x, y, mask, has_mask, xs, qperm, ys, kperm)
            nq[b] = a
            nk[b] = c
            shift[b] = s
            keybad[b] = bad
        return xs, qperm, nq, ys, kperm, nk, shift, keybad

    # -------------------------------------------------------------------------------- sweeps
    @njit(cache=True, nogil=True)
    def _task(b, ch, c0, c1, mode, strict,
              qs, qperm, nq, ks, kperm, nk, korig, mask, has_mask, shift,
              wts, dot, knots, coeffs, slope, intercept,
              k0, center, norm, eps, out_val, out_dot):
        """One (batch row, column chunk) sweep; returns True when a weight is non-finite.

        mode 0: ``out_val[b, i] = sum_j f(x_i - y_j) w_j``           (kernel sum)
        mode 1: attention (indicator column, centring, normaliser) into ``out_val``
        mode 2: ``out_dot[ch, b, i] = sum_c dot[b, i, c] sum_j f'(x_i - y_j) w_jc``
        mode 3: modes 0 and 2 together (the swapped backward sweep).
        ``qs``/``ks`` sorted shifted queries/keys, ``qperm``/``kperm`` their permutations;
        ``wts`` (B, m, c) weights by original key index; ``dot`` (B, n, c) by original query index.
        """
        n_all = qperm.shape[1]
        m_all = korig.shape[1]
        width = c1 - c0
        nmk = knots.shape[1]
        nqb = nq[b]
        nkb = nk[b]
        sh = shift[b]
        a = intercept[b]
        bs = slope[b]
        want_val = mode != 2
        want_der = mode >= 2
        nan = np.nan

        # the knot with the furthest reach among those with a non-zero coefficient
        far = -1
        for mm in range(nmk):
            if coeffs[b, mm] != 0.0 and (far < 0 or knots[b, mm] < knots[b, far]):
                far = mm
        totals = (a != 0.0) or (bs != 0.0) or (mode == 1 and center) or mode >= 2 or far < 0

        t0 = np.zeros(width, np.float64)
        t1 = np.zeros(width, np.float64)
        bad = False
        if totals:
            for j in range(m_all):
                if has_mask and not mask[b, j]:
                    continue
                yj = np.float64(korig[b, j]) - sh
                for d in range(width):
                    val = np.float64(wts[b, j, c0 + d])
                    t0[d] += val
                    t1[d] += yj * val
            for d in range(width):
                if not (np.isfinite(t0[d]) and np.isfinite(t1[d])):
                    bad = True
            if bad:
                return True
        nkf = np.float64(nkb)
        sum_y = 0.0
        for p in range(nkb):
            sum_y += ks[b, p]
        mu = np.zeros(width, np.float64)
        if mode == 1 and center:
            cnt1 = nkf if nkf > 1.0 else 1.0
            for d in range(width):
                mu[d] = t0[d] / cnt1

        p0 = np.zeros(nmk * width, np.float64)
        p1 = np.zeros(nmk * width, np.float64)
        cnt = np.zeros(nmk, np.float64)
        sy = np.zeros(nmk, np.float64)
        ptr = np.zeros(nmk, np.int64)
        acc = np.empty(width, np.float64)
        dacc = np.empty(width, np.float64)

        for pos in range(nqb):
            i = qperm[b, pos]
            x = qs[b, pos]
            for d in range(width):
                acc[d] = 0.0
                dacc[d] = 0.0
            rind = 0.0
            for mm in range(nmk):
                s = x - knots[b, mm]
                cm = coeffs[b, mm]
                off = mm * width
                p = ptr[mm]
                while p < nkb:
                    yk = ks[b, p]
                    if yk > s or (strict and yk == s):
                        break
                    if cm != 0.0:
                        j = kperm[b, p]
                        if want_val:
                            for d in range(width):
                                val = np.float64(wts[b, j, c0 + d])
                                p0[off + d] += val
                                p1[off + d] += yk * val
                        else:
                            for d in range(width):
                                p0[off + d] += np.float64(wts[b, j, c0 + d])
                    cnt[mm] += 1.0
                    sy[mm] += yk
                    p += 1
                ptr[mm] = p
                if cm != 0.0:
                    if want_val:
                        for d in range(width):
                            acc[d] += cm * (s * p0[off + d] - p1[off + d])
                    if want_der:
                        for d in range(width):
                            dacc[d] += cm * p0[off + d]
                    rind += cm * (s * cnt[mm] - sy[mm])
            if want_val:
                if a != 0.0 or bs != 0.0:
                    for d in range(width):
                        acc[d] += a * t0[d] + bs * (x * t0[d] - t1[d])
                    rind += a * nkf + bs * (x * nkf - sum_y)
                if mode == 1:
                    if norm == 1 or norm == 2:
                        den = x * cnt[k0] - sy[k0]
                        if norm == 1:
                            den = 2.0 * den - (x * nkf - sum_y)
                        if not den >= eps:
                            den = eps
                    elif norm == 3:
                        den = nkf if nkf > 1.0 else 1.0
                    else:
                        den = 1.0
                    if center:
                        for d in range(width):
                            out_val[b, i, c0 + d] = (acc[d] - mu[d] * rind) / den
                    else:
                        for d in range(width):
                            out_val[b, i, c0 + d] = acc[d] / den
                else:
                    for d in range(width):
                        out_val[b, i, c0 + d] = acc[d]
            if want_der:
                tot = 0.0
                if bs != 0.0:
                    for d in range(width):
                        tot += np.float64(dot[b, i, c0 + d]) * (dacc[d] + bs * t0[d])
                else:
                    for d in range(width):
                        tot += np.float64(dot[b, i, c0 + d]) * dacc[d]
                out_dot[ch, b, i] = tot

        if not totals:
            # finish the furthest pointer: its P0 becomes the column totals, finite iff every weight is
            off = far * width
            for p in range(ptr[far], nkb):
                j = kperm[b, p]
                for d in range(width):
                    p0[off + d] += np.float64(wts[b, j, c0 + d])
            for d in range(width):
                if not np.isfinite(p0[off + d]):
                    bad = True
            if bad:
                return True
        # non-finite queries: NaN rows
        for pos in range(nqb, n_all):
            i = qperm[b, pos]
            if want_val:
                for d in range(width):
                    out_val[b, i, c0 + d] = nan
            if want_der:
                out_dot[ch, b, i] = nan
        return False

    @njit(parallel=True, cache=True)
    def _run(nch, chunk, ncols, mode, strict,
             qs, qperm, nq, ks, kperm, nk, korig, mask, has_mask, shift, keybad,
             wts, dot, knots, coeffs, slope, intercept,
             k0, center, norm, eps, out_val, out_dot):
        """Every (row, chunk) task in parallel; returns the (B,) rows to fill with NaN."""
        bsz = qperm.shape[0]
        flags = np.zeros(bsz * nch, np.bool_)
        for t in prange(bsz * nch):
            b = t // nch
            ch = t - b * nch
            if keybad[b]:
                flags[t] = True
                continue
            c0 = ch * chunk
            c1 = min(ncols, c0 + chunk)
            flags[t] = _task(b, ch, c0, c1, mode, strict,
                             qs, qperm, nq, ks, kperm, nk, korig, mask, has_mask, shift,
                             wts, dot, knots, coeffs, slope, intercept,
                             k0, center, norm, eps, out_val, out_dot)
        rows = np.zeros(bsz, np.bool_)
        for t in range(bsz * nch):
            if flags[t]:
                rows[t // nch] = True
        return rows
else:  # pragma: no cover - exercised only without numba
    _prepare = _run = _unavailable


# ------------------------------------------------------------------------------ Python wrappers
def _to_numpy(a, name):
    """(array, is_torch): NumPy view of a NumPy array or a CPU torch tensor."""
    mod = type(a).__module__
    if mod.startswith("torch"):
        if a.device.type != "cpu":
            raise TypeError(f"argument {name!r}: the sweep engine serves CPU tensors, got device {a.device}")
        a = a.detach()
        if not a.is_contiguous():
            a = a.contiguous()
        if a.dtype.is_floating_point and a.dtype not in (_torch_dtype("float32"), _torch_dtype("float64")):
            a = a.float()
        return a.numpy(), True
    return np.asarray(a), False


def _torch_dtype(name):
    import torch
    return getattr(torch, name)


def _wrap(out, is_torch):
    if is_torch:
        import torch
        return torch.from_numpy(out)
    return out


def _common_float(arrays, names):
    """The common work dtype (float32 or float64) of floating arrays; float16 computes in float32."""
    for a, nm in zip(arrays, names):
        if a.dtype.kind != "f":
            raise TypeError(f"argument {nm!r} must have a real floating dtype, got {a.dtype} "
                            f"with shape {a.shape}")
    dt = np.result_type(*[a.dtype for a in arrays])
    return np.dtype(np.float64) if dt == np.float64 else np.dtype(np.float32)


def _rows(a, batch, core):
    """Flatten the batch dims to one row axis, C-contiguous."""
    bsz = int(np.prod(batch, dtype=np.int64)) if batch else 1
    return np.ascontiguousarray(a.reshape((bsz,) + tuple(core)))


def _per_row(value, batch, bsz, name, last=None):
    """A scalar / (M,) / batch-shaped parameter as a C-contiguous float64 (B,) or (B, M) array."""
    arr = np.asarray(_to_numpy(value, name)[0] if not np.isscalar(value) else value, dtype=np.float64)
    if last is None:  # per-row scalar
        try:
            arr = np.broadcast_to(arr, batch)
        except ValueError:
            raise ValueError(f"argument {name!r} of shape {arr.shape} does not broadcast to the batch "
                             f"shape {batch}") from None
        return np.ascontiguousarray(arr.reshape(bsz))
    if arr.ndim == 0:
        arr = arr[None]
    try:
        arr = np.broadcast_to(arr, tuple(batch) + (arr.shape[-1],))
    except ValueError:
        raise ValueError(f"argument {name!r} of shape {arr.shape} does not broadcast to the batch "
                         f"shape {batch} + (M,)") from None
    return np.ascontiguousarray(arr.reshape(bsz, arr.shape[-1]))


def _chunks(bsz, ncols):
    """(number of chunks, chunk width): split columns only when rows alone leave threads idle."""
    threads = numba.get_num_threads() if AVAILABLE else 1
    if ncols <= _MIN_CHUNK or bsz == 0 or bsz % threads == 0 or bsz >= 4 * threads:
        return 1, max(ncols, 1)
    want = -(-4 * threads // bsz)
    nch = max(1, min(want, ncols // _MIN_CHUNK))
    width = -(-ncols // nch)
    width = -(-width // _MIN_CHUNK) * _MIN_CHUNK
    nch = -(-ncols // width)
    return nch, width


def _knot_arrays(knots, coeffs, batch, bsz):
    kn = _per_row(knots, batch, bsz, "knots", last=True)
    co = _per_row(coeffs, batch, bsz, "coeffs", last=True)
    if kn.shape[1] != co.shape[1]:
        raise ValueError(f"arguments 'knots' and 'coeffs' must have the same length M, got "
                         f"{kn.shape[1]} and {co.shape[1]}")
    if not np.all(np.isfinite(kn)):
        raise ValueError("argument 'knots' must be finite")
    return kn, co


_DUMMY3 = np.zeros((0, 0, 0), np.float64)
_DUMMY_DOT = np.zeros((1, 1, 1), np.float64)
_NO_MASK = np.ones((1, 1), np.bool_)


def kernel_sum(x, y, w, knots, coeffs, slope=0.0, intercept=0.0):
    """``S[..., i, :] = sum_j f(x_i - y_j) w[..., j, :]`` by one fused sweep per batch row.

    Parameters
    ----------
    x : array (..., n), y : array (..., m), w : array (..., m, c)
        NumPy arrays or CPU torch tensors with equal (already broadcast) leading dims.
    knots, coeffs : sequence or array, (M,) or (..., M)
        ``f(r) = intercept + slope r + sum_m coeffs[m] ReLU(r - knots[m])``; per-row arrays allowed.
    slope, intercept : float or array (...,)

    Returns
    -------
    float64 array (..., n, c) (a torch tensor when the inputs are).
    """
    if not AVAILABLE:
        _unavailable()
    (x, tx), (y, ty), (w, tw) = _to_numpy(x, "x"), _to_numpy(y, "y"), _to_numpy(w, "w")
    is_torch = tx or ty or tw
    if x.ndim < 1 or y.ndim < 1 or w.ndim != y.ndim + 1:
        raise ValueError(f"expected x (..., n), y (..., m), w (..., m, c), got shapes {x.shape}, {y.shape}, "
                         f"{w.shape}")
    batch = x.shape[:-1]
    if y.shape[:-1] != batch or w.shape[:-2] != batch or w.shape[-2] != y.shape[-1]:
        raise ValueError(f"shapes x {x.shape}, y {y.shape}, w {w.shape} do not match (batch dims must be "
                         f"equal, w must have m = {y.shape[-1]} rows)")
    dt = _common_float([x, y, w], ["x", "y", "w"])
    n, m, c = x.shape[-1], y.shape[-1], w.shape[-1]
    if n == 0 or m == 0 or c == 0 or 0 in batch:
        return _wrap(np.zeros(batch + (n, c), np.float64), is_torch)
    bsz = int(np.prod(batch, dtype=np.int64))
    kn, co = _knot_arrays(knots, coeffs, batch, bsz)
    sl = _per_row(slope, batch, bsz, "slope")
    ic = _per_row(intercept, batch, bsz, "intercept")
    x2, y2, w2 = _rows(x.astype(dt, copy=False), batch, (n,)), _rows(y.astype(dt, copy=False), batch, (m,)), \
        _rows(w.astype(dt, copy=False), batch, (m, c))
    prep = _prepare(x2, y2, _NO_MASK, False)
    xs, qperm, nq, ys, kperm, nk, shift, keybad = prep
    out = np.empty((bsz, n, c), np.float64)
    nch, width = _chunks(bsz, c)
    bad = _run(nch, width, c, _MODE_SUM, False, xs, qperm, nq, ys, kperm, nk, y2, _NO_MASK, False, shift,
               keybad, w2, _DUMMY_DOT, kn, co, sl, ic, 0, False, 0, 0.0, out, _DUMMY3)
    if bad.any():
        out[bad] = np.nan
    return _wrap(out.reshape(batch + (n, c)), is_torch)


def attention(q, k, v, key_mask=None, knots=(0.0,), coeffs=(1.0,), center=True, normalizer="abs",
              eps=1e-6, slope=0.0, intercept=0.0):
    """Normalised kernel attention with the semantics of :func:`slicedkern._ops.attention`.

    Parameters
    ----------
    q : (..., Lq), k : (..., Lk), v : (..., Lk, Dv), key_mask : bool (..., Lk) or None
        NumPy arrays or CPU torch tensors, equal (already broadcast) leading dims.
    knots, coeffs, slope, intercept
        The value profile (default ReLU), as in :func:`kernel_sum`.
    center : bool
        Centre the values over the valid keys, folded in as ``N - mu R``.
    normalizer : {"abs", "relu", "count", None}
        ``sum_valid |q - k|`` / ``sum_valid ReLU(q - k)`` clamped below by ``eps``, ``max(n_valid, 1)``,
        or none.

    Returns
    -------
    array (..., Lq, Dv) in the inputs' common dtype (float32 or float64; float16 inputs give float16),
    computed from float64 running sums.
    """
    if not AVAILABLE:
        _unavailable()
    if normalizer not in _NORM_CODES:
        raise ValueError(f"argument 'normalizer' must be one of {tuple(_NORM_CODES)}, got {normalizer!r}")
    (q, tq), (k, tk), (v, tv) = _to_numpy(q, "q"), _to_numpy(k, "k"), _to_numpy(v, "v")
    is_torch = tq or tk or tv
    if q.ndim < 1 or k.ndim < 1 or v.ndim != k.ndim + 1:
        raise ValueError(f"expected q (..., Lq), k (..., Lk), v (..., Lk, Dv), got shapes {q.shape}, "
                         f"{k.shape}, {v.shape}")
    batch = q.shape[:-1]
    if k.shape[:-1] != batch or v.shape[:-2] != batch or v.shape[-2] != k.shape[-1]:
        raise ValueError(f"shapes q {q.shape}, k {k.shape}, v {v.shape} do not match")
    in_dt = np.result_type(q.dtype, k.dtype, v.dtype)
    dt = _common_float([q, k, v], ["q", "k", "v"])
    out_dt = in_dt if in_dt.kind == "f" and in_dt.itemsize < 4 else dt
    lq, lk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    if lq == 0 or lk == 0 or dv == 0 or 0 in batch:
        return _wrap(np.zeros(batch + (lq, dv), out_dt), is_torch)
    bsz = int(np.prod(batch, dtype=np.int64))
    if key_mask is None:
        mask, has_mask = _NO_MASK, False
    else:
        mask = _to_numpy(key_mask, "key_mask")[0]
        if mask.dtype != np.bool_ or mask.shape != k.shape:
            raise ValueError(f"argument 'key_mask' must be a boolean array of shape {k.shape}, got "
                             f"{mask.dtype} {mask.shape}")
        mask, has_mask = _rows(mask, batch, (lk,)), True
    kn, co = _knot_arrays(knots, coeffs, batch, bsz)
    norm = _NORM_CODES[normalizer]
    k0 = 0
    if norm in (1, 2):
        zero_cols = np.nonzero(np.all(kn == 0.0, axis=0))[0]
        if zero_cols.size:
            k0 = int(zero_cols[0])
        else:  # a knot at 0 with coefficient 0: only its (scalar) indicator sums are kept
            k0 = kn.shape[1]
            kn = np.concatenate([kn, np.zeros((bsz, 1))], axis=1)
            co = np.concatenate([co, np.zeros((bsz, 1))], axis=1)
    sl = _per_row(slope, batch, bsz, "slope")
    ic = _per_row(intercept, batch, bsz, "intercept")
    q2 = _rows(q.astype(dt, copy=False), batch, (lq,))
    k2 = _rows(k.astype(dt, copy=False), batch, (lk,))
    v2 = _rows(v.astype(dt, copy=False), batch, (lk, dv))
    xs, qperm, nq, ys, kperm, nk, shift, keybad = _prepare(q2, k2, mask, has_mask)
    out = np.empty((bsz, lq, dv), dt)
    nch, width = _chunks(bsz, dv)
    bad = _run(nch, width, dv, _MODE_ATTN, False, xs, qperm, nq, ys, kperm, nk, k2, mask, has_mask, shift,
               keybad, v2, _DUMMY_DOT, kn, co, sl, ic, k0, bool(center), norm, float(eps), out, _DUMMY3)
    if bad.any():
        out[bad] = np.nan
    out = out.reshape(batch + (lq, dv))
    if out.dtype != out_dt:
        out = out.astype(out_dt)
    return _wrap(out, is_torch)


def kernel_sum_vjp(x, y, w, knots, coeffs, slope, intercept, g):
    """Vector-Jacobian product of :func:`kernel_sum` with cotangent ``g`` (..., n, c), SPEC §2.4.

    Returns ``(dx, dy, dw)``, float64, shapes (..., n), (..., m), (..., m, c):

    * ``dw_j = sum_i f(x_i - y_j) g_i`` (swapped sweep, reflected kernel ``f(-r)``);
    * ``dx_i = sum_c g_ic sum_j f'(x_i - y_j) w_jc`` (step sums of the forward sweep);
    * ``dy_j = -sum_c w_jc sum_i f'(x_i - y_j) g_ic`` (step sums of the swapped sweep);

    with the right derivative ``f'(r) = slope + sum_m coeffs[m] [r >= knots[m]]`` at kinks.
    Any non-finite value of ``x, y, w, g`` in a batch row makes that row's gradients NaN.
    """
    if not AVAILABLE:
        _unavailable()
    arrs = [_to_numpy(a, nm) for a, nm in ((x, "x"), (y, "y"), (w, "w"), (g, "g"))]
    is_torch = any(t for _, t in arrs)
    x, y, w, g = (a for a, _ in arrs)
    batch = x.shape[:-1]
    if (x.ndim < 1 or y.shape[:-1] != batch or w.shape != y.shape + (w.shape[-1],) or
            g.shape != x.shape + (w.shape[-1],)):
        raise ValueError(f"expected x (..., n), y (..., m), w (..., m, c), g (..., n, c), got shapes "
                         f"{x.shape}, {y.shape}, {w.shape}, {g.shape}")
    dt = _common_float([x, y, w, g], ["x", "y", "w", "g"])
    n, m, c = x.shape[-1], y.shape[-1], w.shape[-1]
    if n == 0 or m == 0 or c == 0 or 0 in batch:
        return tuple(_wrap(np.zeros(s, np.float64), is_torch)
                     for s in (batch + (n,), batch + (m,), batch + (m, c)))
    bsz = int(np.prod(batch, dtype=np.int64))
    kn, co = _knot_arrays(knots, coeffs, batch, bsz)
    sl = _per_row(slope, batch, bsz, "slope")
    ic = _per_row(intercept, batch, bsz, "intercept")
    # the reflected kernel f(-r): knots -t, same coefficients, slope -b - sum c, intercept a - sum c t
    rkn = np.ascontiguousarray(-kn)
    rsl = -sl - co.sum(axis=1)
    ric = ic - (co * kn).sum(axis=1)
    x2, y2 = _rows(x.astype(dt, copy=False), batch, (n,)), _rows(y.astype(dt, copy=False), batch, (m,))
    w2, g2 = _rows(w.astype(dt, copy=False), batch, (m, c)), _rows(g.astype(dt, copy=False), batch, (n, c))
    xs, qperm, nq, ys, kperm, nk, shift, keybad = _prepare(x2, y2, _NO_MASK, False)
    keybad = keybad | (nq != n)            # a non-finite x poisons the row's gradients
    nch, width = _chunks(bsz, c)
    dxp = np.empty((nch, bsz, n), np.float64)
    bad1 = _run(nch, width, c, _MODE_DX, False, xs, qperm, nq, ys, kperm, nk, y2, _NO_MASK, False, shift,
                keybad, w2, g2, kn, co, sl, ic, 0, False, 0, 0.0, _DUMMY3, dxp)
    dw = np.empty((bsz, m, c), np.float64)
    dyp = np.empty((nch, bsz, m), np.float64)
    bad2 = _run(nch, width, c, _MODE_SWAP, True, ys, kperm, nk, xs, qperm, nq, x2, _NO_MASK, False, shift,
                keybad, g2, w2, rkn, co, rsl, ric, 0, False, 0, 0.0, dw, dyp)
    dx = dxp[0] if nch == 1 else dxp.sum(axis=0)
    dy = dyp[0] if nch == 1 else dyp.sum(axis=0)
    bad = bad1 | bad2
    if bad.any():
        dx[bad] = np.nan
        dy[bad] = np.nan
        dw[bad] = np.nan
    return (_wrap(dx.reshape(batch + (n,)), is_torch), _wrap(dy.reshape(batch + (m,)), is_torch),
            _wrap(dw.reshape(batch + (m, c)), is_torch))


def warmup():
    """Compile (or load from the cache) the kernels for float32 and float64 on tiny inputs."""
    if not AVAILABLE:
        return False
    rng = np.random.default_rng(0)
    for dt in (np.float32, np.float64):
        x, y = rng.standard_normal((1, 3)).astype(dt), rng.standard_normal((1, 4)).astype(dt)
        w, g = rng.standard_normal((1, 4, 2)).astype(dt), rng.standard_normal((1, 3, 2)).astype(dt)
        kernel_sum(x, y, w, (0.0,), (1.0,))
        attention(x, y, w, None)
        attention(x, y, w, np.ones((1, 4), bool))
        kernel_sum_vjp(x, y, w, (0.0,), (1.0,), 0.0, 0.0, g)
    return True
