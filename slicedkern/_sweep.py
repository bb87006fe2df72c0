"""The fused CPU **sweep** engine (SPEC §5): one compiled loop per batch row, float64 running sums.

Optional: it needs numba. Nothing else in the package imports this module unless asked, and
:data:`AVAILABLE` is ``False`` (not an ``ImportError``) where numba is missing; the functions then
raise ``RuntimeError``.

How it works, per batch row (rows run in parallel with ``numba.prange``, scheduled dynamically)
-----------------------------------------------------------------------------------------------
1. *Prepare*: the finite queries and the valid (unmasked) keys are copied to float64, sorted once
   each with a stable LSD radix argsort (order-preserving image of the float64 bits, 11-bit digits;
   digits equal in every key are skipped, so float32 data costs four passes); the median key is
   the row's shift. Sorted values are kept as given: the sums subtract the shift (so that
   ``s P0 - P1`` cancels little), comparisons do not (see the tie rule). Non-finite queries go to
   the tail of the query permutation; a non-finite valid key marks the row bad. Scratch space is
   per thread, allocated once per call.
2. *Sweep*: for every knot ``t_m`` the thresholds ``s = x_i - t_m`` are visited in increasing
   order (one query sort serves every knot: shifting keeps the order), while a pointer per knot
   advances through the sorted keys, accumulating float64 running sums ``P0 = sum w_j`` and
   ``P1 = sum y_j w_j`` over the keys below ``s`` (merge-style: no binary search). Output row ``i``,
   ``a T0 + b (x_i T0 - T1) + sum_m C_m (s P0_m - P1_m)``, is assembled in float64 (the last knot
   folded into the store loop) and written once, straight into its place in original order.
   Weight rows are read through the key permutation from the caller's array (once per knot with a
   non-zero coefficient), with software prefetches a few rows ahead of the key and query pointers;
   nothing of size ``n x c`` is allocated besides the output. Inner loops run over contiguous
   columns and vectorise (no fastmath: the sums are evaluated as written).
3. Column chunks: when the batch rows alone would leave threads idle, the columns are split into
   chunks of at least 16 and (row, chunk) tasks run in parallel (sorting stays per row).

Attention (:func:`attention`) adds the valid-key indicator as an implicit extra column (its running
sums are the pointer position and the running key sum), centring folded in as ``N - mu R`` with
``mu`` from a float64 totals pass, and the normalisers (``|r| = 2 ReLU(r) - r``). The backward pass
(:func:`kernel_sum_vjp`) runs the same sweep twice: queries over keys for ``dx`` (step sums ``P0``),
then keys over queries (roles swapped, reflected kernel ``f(-r)``) for ``dw`` and ``dy``.

Dtypes: scores are sorted and combined in float64. :func:`attention` reads float32 or float64
values as they are and returns the inputs' dtype (float16 is computed in float32 and returned in
float16); :func:`kernel_sum` and :func:`kernel_sum_vjp` compute and return float64.

NaN policy (SPEC §4): a non-finite query gives a NaN output row; a non-finite valid key or weight
gives NaN for the whole batch row (detected through the float64 totals: a sum that meets an inf or
a NaN stays non-finite). For the backward pass, any non-finite value among ``x, y, w, g`` in a
batch row makes all of that row's gradients NaN. Inputs are never modified.

Tie rule: for step sums a key equal to ``x_i - t_m`` counts as ``<=`` (``H(0) = 1``): ``dx`` and
``dy`` both use the right derivative ``f'(r) = b + sum_m c_m [r >= t_m]`` at ``r = x_i - y_j`` (SPEC
§2.4), i.e. ``dx`` is the right derivative of the loss in ``x_i`` and ``dy`` the left one in ``y_j``.
The swapped sweep (queries as keys, knots ``-t_m``, strict) counts ``x_i < y_j + t_m``, the exact
complement. Every comparison is exact: it is made on the unshifted values, and ``x - t`` is taken
with its rounding error (TwoSum), which decides a key equal to the rounded ``x - t``. (Comparing
shifted values, ``fl(fl(x_i - shift) - t_m)`` against ``fl(y_j - shift)``, misjudged exact ties
whenever the median key had more significant bits than the data, e.g. a non-dyadic key, or
masked keys placed at the mean of the valid ones.) ``-0.0`` and ``+0.0`` compare equal; the sort
may order them either way. Value sums do not depend on ties (``ReLU(0) = 0``) and leave tied keys
out (strict ``<``): a query on or below every key then gets an exactly zero ReLU sum, not a
rounding residue that an ``eps``-clamped normaliser would amplify.

Inputs: NumPy arrays or CPU torch tensors (zero-copy through ``.numpy()`` where contiguous; any
torch input gives torch outputs). Compiled code is cached on disk (``cache=True``); :func:`warmup`
compiles or loads it up front.
"""

from __future__ import annotations

import numpy as np

try:
    import numba
    from llvmlite import ir as llvm_ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic
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
    _TOP = np.uint64(1) << np.uint64(63)
    _DMASK = np.uint64(2047)

    # ------------------------------------------------------------------------------- sorting
    @njit(cache=True, nogil=True, error_model="numpy")
    def _radix_sort(vals, payload, n, keys, tkeys, tpay, hist):
        """Sort ``vals[:n]`` (finite float64) in place, stably, carrying ``payload[:n]`` along.

        LSD radix sort on the order-preserving unsigned image of the float64 bits, 11-bit digits,
        digits shared by every key skipped (float32 data in float64 skips about two passes).
        ``keys``, ``tkeys`` (uint64), ``tpay`` (int64) of length >= n and ``hist`` (6, 2048) int64
        are scratch space (no allocation here: this runs inside parallel loops).
        """
        if n < 2:
            return
        bits = vals[:n].view(np.uint64)
        any_bits = np.uint64(0)
        all_bits = ~any_bits
        for i in range(n):
            u = bits[i]
            if u & _TOP:
                u = ~u
            else:
                u = u | _TOP
            keys[i] = u
            any_bits |= u
            all_bits &= u
        varying = any_bits ^ all_bits           # digits that are equal in every key are skipped
        digits = np.empty(6, np.int64)
        nd = 0
        for p in range(6):
            if (varying >> np.uint64(11 * p)) & _DMASK:
                digits[nd] = p
                nd += 1
        hist[:, :] = 0
        for i in range(n):
            k = keys[i]
            for q in range(nd):
                hist[q, np.int64((k >> np.uint64(11 * digits[q])) & _DMASK)] += 1
        src_k, src_p, dst_k, dst_p = keys, payload, tkeys, tpay
        offs = np.empty(2048, np.int64)
        swapped = False
        for q in range(nd):
            p = digits[q]
            total = 0
            for d in range(2048):
                offs[d] = total
                total += hist[q, d]
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
        for i in range(n):
            k = src_k[i]
            if k & _TOP:
                bits[i] = k & ~_TOP
            else:
                bits[i] = ~k
        if swapped:
            for i in range(n):
                payload[i] = src_p[i]

    @njit(cache=True, nogil=True, error_model="numpy")
    def _prepare_row(b, x, y, mask, has_mask, xs, qperm, ys, kperm, keys, tkeys, tpay, hist):
        """Sort one row's finite queries and valid keys (unshifted); returns (nq, nk, shift, key_bad)."""
        n = x.shape[1]
        m = y.shape[1]
        yv, kp = ys[b], kperm[b]
        nk = 0
        for j in range(m):
            if has_mask and not mask[b, j]:
                continue
            val = np.float64(y[b, j])
            if not np.isfinite(val):
                return 0, 0, 0.0, True
            yv[nk] = val
            kp[nk] = j
            nk += 1
        _radix_sort(yv, kp, nk, keys, tkeys, tpay, hist)
        # the median key; the sorted values stay unshifted (ties are decided on them, exactly) and
        # the sweep subtracts the shift only where it does arithmetic
        shift = yv[nk // 2] if nk > 0 else 0.0
        xv, qp = xs[b], qperm[b]
        nq = 0
        tail = n
        for i in range(n):
            val = np.float64(x[b, i])
            if np.isfinite(val):
                xv[nq] = val
                qp[nq] = i
                nq += 1
            else:
                tail -= 1
                qp[tail] = i
        _radix_sort(xv, qp, nq, keys, tkeys, tpay, hist)
        return nq, nk, shift, False

    @njit(parallel=True, cache=True, error_model="numpy")
    def _prepare_rows(x, y, mask, has_mask, xs, qperm, ys, kperm, counts, shift, keys, tkeys, tpay, hist):
        """Every row in parallel; ``counts[b] = (nq, nk, key_bad)``; scratch indexed by thread."""
        for b in prange(x.shape[0]):
            t = numba.get_thread_id()
            a, c, s, bad = _prepare_row(b, x, y, mask, has_mask, xs, qperm, ys, kperm,
                                        keys[t], tkeys[t], tpay[t], hist[t])
            counts[b, 0] = a
            counts[b, 1] = c
            counts[b, 2] = 1 if bad else 0
            shift[b] = s

    def _prepare(x, y, mask, has_mask):
        """Sorted queries/keys, their permutations and the median-key shifts of ``x`` (B, n), ``y`` (B, m)."""
        (bsz, n), m = x.shape, y.shape[1]
        xs, qperm = np.empty((bsz, n)), np.empty((bsz, n), np.int64)
        ys, kperm = np.empty((bsz, m)), np.empty((bsz, m), np.int64)
        counts, shift = np.empty((bsz, 3), np.int64), np.empty(bsz)
        threads, size = numba.get_num_threads(), max(n, m, 1)
        keys, tkeys = np.empty((threads, size), np.uint64), np.empty((threads, size), np.uint64)
        tpay, hist = np.empty((threads, size), np.int64), np.empty((threads, 6, 2048), np.int64)
        old = numba.set_parallel_chunksize(1)  # dynamic scheduling: rows (and a shared CPU) vary
        try:
            _prepare_rows(x, y, mask, has_mask, xs, qperm, ys, kperm, counts, shift, keys, tkeys, tpay, hist)
        finally:
            numba.set_parallel_chunksize(old)
        nq, nk = np.ascontiguousarray(counts[:, 0]), np.ascontiguousarray(counts[:, 1])
        return xs, qperm, nq, ys, kperm, nk, shift, counts[:, 2] != 0

    # -------------------------------------------------------------------------------- sweeps
    def _prefetch_intrinsic(rw):
        @intrinsic
        def prefetch(typingctx, arr, idx):
            """Prefetch the cache line of ``arr.flat[idx]`` (C-contiguous), for read (0) or write (1)."""
            if not isinstance(arr, types.Array):
                return None
            sig = types.void(arr, types.intp)

            def codegen(context, builder, signature, args):
                ary = context.make_array(signature.args[0])(context, builder, args[0])
                ptr = builder.gep(ary.data, [args[1]])
                i8p, i32 = llvm_ir.IntType(8).as_pointer(), llvm_ir.IntType(32)
                fnty = llvm_ir.FunctionType(llvm_ir.VoidType(), [i8p, i32, i32, i32])
                fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
                builder.call(fn, [builder.bitcast(ptr, i8p), i32(rw), i32(3), i32(1)])
                return context.get_dummy_value()

            return sig, codegen
        return prefetch

    _U = np.uint64
    _prefetch_read = _prefetch_intrinsic(0)
    _prefetch_write = _prefetch_intrinsic(1)
    _AHEAD = 8  # rows prefetched ahead of the key and query pointers

    @njit(cache=True, nogil=True, error_model="numpy", inline="always")
    def _fetch_row(arr, b, r, c0, width, write):
        """Prefetch ``arr[b, r, c0:c0 + width]`` (C-contiguous 3-D), one hint per 64-byte line."""
        start = (b * arr.shape[1] + r) * arr.shape[2] + c0
        step = max(1, 64 // arr.itemsize)
        for e in range(start, start + width, step):
            if write:
                _prefetch_write(arr, e)
            else:
                _prefetch_read(arr, e)

    @njit(cache=True, nogil=True, error_model="numpy")
    def _task(b, ch, c0, c1, mode, strict,
              qs, qperm, nq, ks, kperm, nk, korig, mask, has_mask, shift,
              wts, dot, knots, coeffs, slope, intercept,
              k0, center, norm, eps, out_val, out_dot, ahead):
        """One (batch row, column chunk) sweep; returns True when a weight is non-finite.

        mode 0: ``out_val[b, i] = sum_j f(x_i - y_j) w_j``           (kernel sum)
        mode 1: attention (indicator column, centring, normaliser) into ``out_val``
        mode 2: ``out_dot[ch, b, i] = sum_c dot[b, i, c] sum_j f'(x_i - y_j) w_jc``
        mode 3: modes 0 and 2 together (the swapped backward sweep).
        ``qs``/``ks`` sorted (unshifted) queries/keys, ``qperm``/``kperm`` their permutations;
        ``shift`` the per-row median key, subtracted wherever values enter sums. Whether a key is
        below ``x_i - t_m`` is decided exactly, on unshifted values and the rounding error of
        ``x_i - t_m`` (TwoSum), so that a tie is a tie whatever the shift.
        ``wts`` (B, m, c) weights by original key index; ``dot`` (B, n, c) by original query index.
        Inner loops index flat arrays at unsigned offsets (no wrap-around test), so they vectorise.
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
        qrow = qs[b]
        krow = ks[b]
        qp = qperm[b]
        kp = kperm[b]
        # flat views indexed with unsigned offsets: no wrap-around test, so inner loops vectorise
        wf, wcols, wrow_b = wts.reshape(-1), wts.shape[2], b * wts.shape[1]
        of, ocols, orow_b = out_val.reshape(-1), out_val.shape[2], b * out_val.shape[1]
        gf, gcols, grow_b = dot.reshape(-1), dot.shape[2], b * dot.shape[1]

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
                rb = (wrow_b + j) * wcols + c0
                for d in range(width):
                    val = np.float64(wf[_U(rb + d)])
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
            sum_y += krow[p] - sh
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
        for mm in range(nmk):
            if coeffs[b, mm] != 0.0:
                for p in range(min(ahead, nkb)):
                    _fetch_row(wts, b, kp[p], c0, width, False)
        for pos in range(min(ahead, nqb)):
            if want_val:
                _fetch_row(out_val, b, qp[pos], c0, width, True)
            if want_der:
                _fetch_row(dot, b, qp[pos], c0, width, False)

        # the last knot with a non-zero coefficient is folded into the output loop (no scratch pass)
        last = 0
        for mm in range(nmk):
            if coeffs[b, mm] != 0.0:
                last = mm
        linear = a != 0.0 or bs != 0.0
        for pos in range(nqb):
            i = qp[pos]
            xu = qrow[pos]          # the query as given: ties are decided on it
            x = xu - sh             # shifted: what the sums use
            if pos + ahead < nqb:
                if want_val:
                    _fetch_row(out_val, b, qp[pos + ahead], c0, width, True)
                if want_der:
                    _fetch_row(dot, b, qp[pos + ahead], c0, width, False)
            if want_val:
                if linear:
                    for d in range(width):
                        acc[d] = a * t0[d] + bs * (x * t0[d] - t1[d])
                else:
                    for d in range(width):
                        acc[d] = 0.0
            if want_der:
                for d in range(width):
                    dacc[d] = bs * t0[d]
            rind = a * nkf + bs * (x * nkf - sum_y) if linear else 0.0
            s_last = 0.0
            for mm in range(nmk):
                tm = knots[b, mm]
                s = x - tm
                # the exact threshold xu - tm = su + se (TwoSum): a key y is below it iff
                # y < su, or y == su and se > 0 (se >= 0 when ties count, ``strict`` False)
                su = xu - tm
                bv = su - xu
                se = (xu - (su - bv)) + (-tm - bv)
                tie_out = se <= 0.0 if strict else se < 0.0
                cm = coeffs[b, mm]
                off = mm * width
                p = ptr[mm]
                while p < nkb:
                    yu = krow[p]
                    if yu > su or (yu == su and tie_out):
                        break
                    yk = yu - sh
                    if cm != 0.0:
                        if p + ahead < nkb:
                            _fetch_row(wts, b, kp[p + ahead], c0, width, False)
                        rb = (wrow_b + kp[p]) * wcols + c0
                        if want_val:
                            for d in range(width):
                                val = np.float64(wf[_U(rb + d)])
                                p0[_U(off + d)] += val
                                p1[_U(off + d)] += yk * val
                        else:
                            for d in range(width):
                                p0[_U(off + d)] += np.float64(wf[_U(rb + d)])
                    cnt[mm] += 1.0
                    sy[mm] += yk
                    p += 1
                ptr[mm] = p
                if cm != 0.0:
                    if want_val and mm != last:
                        for d in range(width):
                            acc[d] += cm * (s * p0[_U(off + d)] - p1[_U(off + d)])
                    if want_der:
                        for d in range(width):
                            dacc[d] += cm * p0[_U(off + d)]
                    rind += cm * (s * cnt[mm] - sy[mm])
                if mm == last:
                    s_last = s
            if want_val:
                scale = 1.0
                if mode == 1:
                    if norm == 1 or norm == 2:
                        den = x * cnt[k0] - sy[k0]
                        if norm == 1:
                            den = 2.0 * den - (x * nkf - sum_y)
                        if not den >= eps:
                            den = eps
                        # eps = 0 and an empty sum: the attention of an empty key set is 0
                        scale = 1.0 / den if den > 0.0 else 1.0
                    elif norm == 3:
                        scale = 1.0 / (nkf if nkf > 1.0 else 1.0)
                ob = (orow_b + i) * ocols + c0
                cl = coeffs[b, last]
                lo = last * width
                for d in range(width):
                    of[_U(ob + d)] = (acc[d] + cl * (s_last * p0[_U(lo + d)] - p1[_U(lo + d)])
                                      - mu[d] * rind) * scale
            if want_der:
                gb = (grow_b + i) * gcols + c0
                tot = 0.0
                for d in range(width):
                    tot += np.float64(gf[_U(gb + d)]) * dacc[d]
                out_dot[ch, b, i] = tot

        if not totals:
            # finish the furthest pointer: its P0 becomes the column totals, finite iff every weight is
            off = far * width
            for p in range(ptr[far], nkb):
                if p + ahead < nkb:
                    _fetch_row(wts, b, kp[p + ahead], c0, width, False)
                rb = (wrow_b + kp[p]) * wcols + c0
                for d in range(width):
                    p0[_U(off + d)] += np.float64(wf[_U(rb + d)])
            for d in range(width):
                if not np.isfinite(p0[off + d]):
                    bad = True
            if bad:
                return True
        # non-finite queries: NaN rows
        for pos in range(nqb, n_all):
            i = qp[pos]
            if want_val:
                ob = (orow_b + i) * ocols + c0
                for d in range(width):
                    of[_U(ob + d)] = np.nan
            if want_der:
                out_dot[ch, b, i] = np.nan
        return False

    @njit(parallel=True, cache=True, error_model="numpy")
    def _run_tasks(nch, chunk, ncols, mode, strict,
                   qs, qperm, nq, ks, kperm, nk, korig, mask, has_mask, shift, keybad,
                   wts, dot, knots, coeffs, slope, intercept,
                   k0, center, norm, eps, out_val, out_dot, flags, ahead):
        for t in prange(flags.shape[0]):
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
                             k0, center, norm, eps, out_val, out_dot, ahead)

    def _run(nch, *args):
        """Every (row, chunk) task in parallel; returns the (B,) rows to fill with NaN."""
        keybad = args[14]
        flags = np.zeros(keybad.shape[0] * nch, np.bool_)
        old = numba.set_parallel_chunksize(1)
        try:
            _run_tasks(nch, *args, flags, _AHEAD)
        finally:
            numba.set_parallel_chunksize(old)
        return flags.reshape(-1, nch).any(axis=1)
else:  # pragma: no cover - exercised only without numba
    _prepare = _run = _unavailable


# ------------------------------------------------------------------------------ Python wrappers
def _to_numpy(a, name):
    """(NumPy array, torch dtype or None): a NumPy array, or a zero-copy view of a CPU torch tensor.

    Non-contiguous tensors are made contiguous first; half-precision tensors are widened to float32.
    """
    if type(a).__module__.startswith("torch"):
        import torch
        if a.device.type != "cpu":
            raise TypeError(f"argument {name!r}: the sweep engine serves CPU tensors, got device {a.device}")
        tdtype = a.dtype
        a = a.detach()
        if a.dtype in (torch.float16, torch.bfloat16):
            a = a.float()
        return a.contiguous().numpy(), tdtype
    return np.asarray(a), None


def _wrap(out, tdtypes, *, narrow=False):
    """Back to torch when any input was a tensor (``narrow``: in the inputs' half dtype, if any)."""
    tdtypes = [t for t in tdtypes if t is not None]
    if not tdtypes:
        return out
    import torch
    out = torch.from_numpy(out)
    if narrow:
        dt = tdtypes[0]
        for t in tdtypes[1:]:
            dt = torch.promote_types(dt, t)
        if dt in (torch.float16, torch.bfloat16):
            out = out.to(dt)
    return out


def _common_float(arrays, names):
    """The common work dtype (float32 or float64) of floating arrays; float16 computes in float32."""
    for a, nm in zip(arrays, names):
        if a.dtype.kind != "f":
            raise TypeError(f"argument {nm!r} must have a real floating dtype, got {a.dtype} "
                            f"with shape {a.shape}")
    dt = np.result_type(*[a.dtype for a in arrays])
    return np.dtype(np.float64) if dt == np.float64 else np.dtype(np.float32)


def _ro(a):
    """A read-only C-contiguous view (or copy): one compiled signature whatever the caller's flags."""
    a = np.ascontiguousarray(a).view()
    a.flags.writeable = False
    return a


def _rows(a, batch, core, dtype=None):
    """Flatten the batch dims to one row axis: read-only, C-contiguous, in ``dtype``."""
    bsz = int(np.prod(batch, dtype=np.int64)) if batch else 1
    a = a.reshape((bsz,) + tuple(core))
    return _ro(a if dtype is None else a.astype(dtype, copy=False))


def _per_row(value, batch, bsz, name, last=None):
    """A scalar / (M,) / batch-shaped parameter as a C-contiguous float64 (B,) or (B, M) array."""
    arr = np.asarray(_to_numpy(value, name)[0] if not np.isscalar(value) else value, dtype=np.float64)
    if last is None:  # per-row scalar
        try:
            arr = np.broadcast_to(arr, batch)
        except ValueError:
            raise ValueError(f"argument {name!r} of shape {arr.shape} does not broadcast to the batch "
                             f"shape {batch}") from None
        return _ro(arr.reshape(bsz))
    if arr.ndim == 0:
        arr = arr[None]
    try:
        arr = np.broadcast_to(arr, tuple(batch) + (arr.shape[-1],))
    except ValueError:
        raise ValueError(f"argument {name!r} of shape {arr.shape} does not broadcast to the batch "
                         f"shape {batch} + (M,)") from None
    return _ro(arr.reshape(bsz, arr.shape[-1]))


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
    if kn.shape[1] == 0:  # a purely linear profile: one idle knot keeps the loops uniform
        kn, co = _ro(np.zeros((bsz, 1))), _ro(np.zeros((bsz, 1)))
    return kn, co


_F64 = np.dtype(np.float64)
_DUMMY3 = np.zeros((0, 0, 0), np.float64)
_NO_MASK = _ro(np.ones((1, 1), np.bool_))


def _dummy(dt):
    return _ro(np.zeros((1, 1, 1), dt))


def _checked(x, y, w, names):
    """NumPy views of ``x`` (..., n), ``y`` (..., m), ``w`` (..., m, c), their torch dtypes, the batch.

    ``names`` name the three arguments in the errors; leading (batch) shapes must be equal.
    """
    (x, tx), (y, ty), (w, tw) = (_to_numpy(a, nm) for a, nm in zip((x, y, w), names))
    nx, ny, nw = names
    if x.ndim < 1 or y.ndim < 1 or w.ndim != y.ndim + 1:
        raise ValueError(f"expected {nx} (..., n), {ny} (..., m), {nw} (..., m, c), got shapes {x.shape}, "
                         f"{y.shape}, {w.shape}")
    batch = x.shape[:-1]
    if y.shape[:-1] != batch or w.shape[:-2] != batch or w.shape[-2] != y.shape[-1]:
        raise ValueError(f"shapes {nx} {x.shape}, {ny} {y.shape}, {nw} {w.shape} do not match (batch dims "
                         f"must be equal, {nw} must have m = {y.shape[-1]} rows)")
    return (x, y, w), (tx, ty, tw), batch


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
    (x, y, w), tdt, batch = _checked(x, y, w, ("x", "y", "w"))
    _common_float([x, y, w], ["x", "y", "w"])
    n, m, c = x.shape[-1], y.shape[-1], w.shape[-1]
    if n == 0 or m == 0 or c == 0 or 0 in batch:
        return _wrap(np.zeros(batch + (n, c), np.float64), tdt)
    bsz = int(np.prod(batch, dtype=np.int64))
    kn, co = _knot_arrays(knots, coeffs, batch, bsz)
    sl = _per_row(slope, batch, bsz, "slope")
    ic = _per_row(intercept, batch, bsz, "intercept")
    # kernel sums run in float64 throughout (one compiled signature; the output is float64 anyway)
    x2, y2, w2 = _rows(x, batch, (n,), _F64), _rows(y, batch, (m,), _F64), _rows(w, batch, (m, c), _F64)
    prep = _prepare(x2, y2, _NO_MASK, False)
    xs, qperm, nq, ys, kperm, nk, shift, keybad = prep
    out = np.empty((bsz, n, c), np.float64)
    nch, width = _chunks(bsz, c)
    bad = _run(nch, width, c, _MODE_SUM, True, xs, qperm, nq, ys, kperm, nk, y2, _NO_MASK, False, shift,
               keybad, w2, _dummy(_F64), kn, co, sl, ic, 0, False, 0, 0.0, out, _DUMMY3)
    if bad.any():
        out[bad] = np.nan
    return _wrap(out.reshape(batch + (n, c)), tdt)


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
    (q, k, v), tdt, batch = _checked(q, k, v, ("q", "k", "v"))
    # The values decide the compute dtype: scores are converted to float64 for the sort anyway, so
    # float64 scores (the library casts them) must not widen float32 values.
    _common_float([q, k], ["q", "k"])
    in_dt = v.dtype
    dt = _common_float([v], ["v"])
    out_dt = in_dt if in_dt.kind == "f" and in_dt.itemsize < 4 else dt
    lq, lk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    if lq == 0 or lk == 0 or dv == 0 or 0 in batch:
        return _wrap(np.zeros(batch + (lq, dv), out_dt), tdt, narrow=True)
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
            kn = _ro(np.concatenate([kn, np.zeros((bsz, 1))], axis=1))
            co = _ro(np.concatenate([co, np.zeros((bsz, 1))], axis=1))
    sl = _per_row(slope, batch, bsz, "slope")
    ic = _per_row(intercept, batch, bsz, "intercept")
    # scores in float64 (one compiled signature for the sorting; they are small), values in dt
    q2, k2, v2 = _rows(q, batch, (lq,), _F64), _rows(k, batch, (lk,), _F64), _rows(v, batch, (lk, dv), dt)
    xs, qperm, nq, ys, kperm, nk, shift, keybad = _prepare(q2, k2, mask, has_mask)
    out = np.empty((bsz, lq, dv), dt)
    nch, width = _chunks(bsz, dv)
    bad = _run(nch, width, dv, _MODE_ATTN, True, xs, qperm, nq, ys, kperm, nk, k2, mask, has_mask, shift,
               keybad, v2, _dummy(dt), kn, co, sl, ic, k0, bool(center), norm, float(eps), out,
               _DUMMY3)
    if bad.any():
        out[bad] = np.nan
    out = out.reshape(batch + (lq, dv))
    if out.dtype != out_dt:
        out = out.astype(out_dt)
    return _wrap(out, tdt, narrow=True)


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
    tdt = [t for _, t in arrs]
    x, y, w, g = (a for a, _ in arrs)
    if (x.ndim < 1 or y.ndim != x.ndim or w.ndim != y.ndim + 1 or g.ndim != x.ndim + 1 or
            y.shape[:-1] != x.shape[:-1] or w.shape[:-1] != y.shape or g.shape != x.shape + w.shape[-1:]):
        raise ValueError(f"expected x (..., n), y (..., m), w (..., m, c), g (..., n, c), got shapes "
                         f"{x.shape}, {y.shape}, {w.shape}, {g.shape}")
    batch = x.shape[:-1]
    _common_float([x, y, w, g], ["x", "y", "w", "g"])
    n, m, c = x.shape[-1], y.shape[-1], w.shape[-1]
    if n == 0 or m == 0 or c == 0 or 0 in batch:
        return tuple(_wrap(np.zeros(s, np.float64), tdt)
                     for s in (batch + (n,), batch + (m,), batch + (m, c)))
    bsz = int(np.prod(batch, dtype=np.int64))
    kn, co = _knot_arrays(knots, coeffs, batch, bsz)
    sl = _per_row(slope, batch, bsz, "slope")
    ic = _per_row(intercept, batch, bsz, "intercept")
    # the reflected kernel f(-r): knots -t, same coefficients, slope -b - sum c, intercept a - sum c t
    rkn, rsl, ric = _ro(-kn), _ro(-sl - co.sum(axis=1)), _ro(ic - (co * kn).sum(axis=1))
    x2, y2 = _rows(x, batch, (n,), _F64), _rows(y, batch, (m,), _F64)
    w2, g2 = _rows(w, batch, (m, c), _F64), _rows(g, batch, (n, c), _F64)
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
    return (_wrap(dx.reshape(batch + (n,)), tdt), _wrap(dy.reshape(batch + (m,)), tdt),
            _wrap(dw.reshape(batch + (m, c)), tdt))


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
