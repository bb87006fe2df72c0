"""Compiled (numba) kernels of the sweep engine; the host bridge imports this module only where numba is.

Every public entry point here (:func:`forward_rows`, :func:`backward_rows`) is one compiled call per
operation: it sorts every batch row, then runs the sweeps, and returns freshly allocated results.
Batch rows (and column chunks of a row) are *tasks*; with ``n_workers == 1`` they run in a plain
loop on the calling thread (small problems never wake numba's thread pool), otherwise ``n_workers``
workers claim task indices from an atomic counter (dynamic scheduling without touching numba's
process- or thread-wide chunk-size setting).

Argument groups (plain tuples, unpacked at the top of each function):

``scores``
    ``(x (B, n) float64, y (B, m) float64, key_mask (B, m) bool, has_mask)``: queries and keys as
    given (any finite values), and which keys take part.
``sorted_rows``
    ``(queries (B, n), query_order (B, n), keys (B, m), key_order (B, m), counts (B, 3), shift (B,))``
    from :func:`_sort_row`: per row the finite queries and the valid keys sorted ascending (values
    unshifted), their original indices, ``counts[b] = (n_finite_queries, n_valid_keys, key_bad)``
    and the median valid key, subtracted wherever values enter sums (not where they are compared).
``profile``
    ``(knots (B, M), coeffs (B, M), slope (B,), intercept (B,))``:
    ``f(r) = intercept + slope r + sum_m coeffs[m] ReLU(r - knots[m])`` per row.
``schedule``
    ``(n_chunks, chunk_width, n_workers)``: value columns are split in ``n_chunks`` chunks of
    ``chunk_width`` (one task per row and chunk).

Results and work space are allocated by the caller (:func:`allocate_sorted`, NumPy's ``empty``):
NumPy backs large arrays with transparent huge pages, and first-touch page faults of a fresh
numba allocation cost as much as the forward sweep itself (measured: 55 ms instead of 32 ms for
8 rows of L = 16384, D = 64), more still when two threads fault at once.

The mathematics is that of docs/mathematics.rst ("The kernel sum by sort-scan", "Attention", "The
backward pass"); the comments below say where and why the code departs from the plain formulas.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir as llvm_ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["NORMALIZER_CODES", "allocate_sorted", "forward_rows", "backward_rows"]

#: Normaliser codes as the compiled code receives them (``normalizer`` of the attention options).
NO_NORMALIZER, ABS_NORMALIZER, RELU_NORMALIZER, COUNT_NORMALIZER = 0, 1, 2, 3
NORMALIZER_CODES = {None: NO_NORMALIZER, "abs": ABS_NORMALIZER, "relu": RELU_NORMALIZER,
                    "count": COUNT_NORMALIZER}

_JIT = dict(cache=True, nogil=True, error_model="numpy")
_INLINE = dict(_JIT, inline="always")
# Entry points: prange only. Every other parfor conversion is off so that array creation in the
# serial branch never becomes a parallel region (which would wake the thread pool).
_PARALLEL = dict(cache=True, error_model="numpy",
                 parallel={"prange": True, "numpy": False, "comprehension": False, "reduction": False,
                           "inplace_binop": False, "setitem": False, "stencil": False, "fusion": False})

#: Rows prefetched ahead of every pointer that walks the rows of a (.., L, D) array in sorted order.
PREFETCH_AHEAD = 8
#: Below this many values an insertion sort beats the radix sort (whose histograms cost 96 KiB).
SMALL_SORT = 48

_TOP_BIT = np.uint64(1) << np.uint64(63)
_DIGIT_MASK = np.uint64(2047)
_DIGIT_BITS = 11
_N_DIGITS = 6


# ------------------------------------------------------------------------------------ intrinsics
def _prefetch_intrinsic(for_write):
    @intrinsic
    def prefetch(typingctx, arr, flat_index):
        """Hint that ``arr.flat[flat_index]`` (C-contiguous) will be read (or written) soon."""
        if not isinstance(arr, types.Array):
            return None
        sig = types.void(arr, types.intp)

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            ptr = builder.gep(ary.data, [args[1]])
            i8p, i32 = llvm_ir.IntType(8).as_pointer(), llvm_ir.IntType(32)
            fnty = llvm_ir.FunctionType(llvm_ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(int(for_write)), i32(3), i32(1)])
            return context.get_dummy_value()

        return sig, codegen
    return prefetch


_prefetch_read = _prefetch_intrinsic(False)
_prefetch_write = _prefetch_intrinsic(True)


@intrinsic
def _fetch_add(typingctx, counter):
    """Atomically add one to ``counter[0]`` (int64) and return its previous value."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None
    sig = types.int64(counter)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        one = llvm_ir.Constant(llvm_ir.IntType(64), 1)
        return builder.atomic_rmw("add", ary.data, one, "monotonic")

    return sig, codegen


# --------------------------------------------------------------------------------- small helpers
@njit(**_INLINE)
def _fetch_row(arr, b, row, c0, width, for_write):
    """Prefetch ``arr[b, row, c0:c0 + width]`` (C-contiguous 3-D), one hint per 64-byte line."""
    start = (b * arr.shape[1] + row) * arr.shape[2] + c0
    step = max(1, 64 // arr.itemsize)
    for e in range(start, start + width, step):
        if for_write:
            _prefetch_write(arr, e)
        else:
            _prefetch_read(arr, e)


@njit(**_INLINE)
def _exact_sum(a, b):
    """``(s, e)`` with ``s = fl(a + b)`` and ``a + b = s + e`` exactly (TwoSum)."""
    s = a + b
    bv = s - a
    return s, (a - (s - bv)) + (b - bv)


@njit(**_INLINE)
def _below(value, s, e, inclusive):
    """Whether ``value < s + e`` (``<=`` when ``inclusive``), decided exactly.

    Thresholds ``x - t`` are compared as the exact pair of :func:`_exact_sum`, so that a tie is a
    tie whatever the rounding of ``x - t`` (docs/mathematics.rst, "The backward pass", Ties).
    """
    return value < s or (value == s and (e > 0.0 or (inclusive and e == 0.0)))


# reassoc lets LLVM keep several partial sums in vector registers: a plain float reduction is one
# serial chain of additions and would dominate the backward sweep. The order is fixed by the
# compiled code, so results are reproducible on a given machine.
@njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})
def _dot(a, b):
    """``sum_d a[d] b[d]`` in float64 over two 1-D arrays of equal length."""
    total = 0.0
    for d in range(a.shape[0]):
        total += np.float64(a[d]) * np.float64(b[d])
    return total


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})
def _dot_pair(a, b, c):
    """``(a . b, a . c)`` in float64, reading ``a`` once (see :func:`_dot`)."""
    first = 0.0
    second = 0.0
    for d in range(a.shape[0]):
        ad = np.float64(a[d])
        first += ad * np.float64(b[d])
        second += ad * np.float64(c[d])
    return first, second


@njit(**_INLINE)
def _claim(counter):
    """The next task index for the calling worker (dynamic scheduling)."""
    return _fetch_add(counter)


@njit(**_INLINE)
def _normaliser_scale(normalizer, x, zero_count, zero_sum, n_keys, key_sum, eps):
    """``(1 / D_i, unclamped D_i >= eps)`` for a query ``x`` (shifted), docs "Attention".

    ``zero_count`` / ``zero_sum``: count and sum (shifted) of the keys strictly below ``x``;
    ``key_sum``: sum of all valid keys (shifted). ``|r| = 2 ReLU(r) - r`` gives the "abs" sum.
    """
    if normalizer == ABS_NORMALIZER or normalizer == RELU_NORMALIZER:
        den = x * zero_count - zero_sum
        if normalizer == ABS_NORMALIZER:
            den = 2.0 * den - (x * n_keys - key_sum)
        unclamped_ok = den >= eps
        if not unclamped_ok:
            den = eps
        # eps = 0 and an empty sum: the attention of an empty key set is 0, not 0 / 0
        return (1.0 / den if den > 0.0 else 1.0), unclamped_ok
    if normalizer == COUNT_NORMALIZER:
        return 1.0 / (n_keys if n_keys > 1.0 else 1.0), True
    return 1.0, True


@njit(**_JIT)
def _value_totals(b, c0, c1, keys_given, mask, has_mask, shift, values, t0, t1):
    """``t0 = sum_j v_j``, ``t1 = sum_j (y_j - shift) v_j`` over the valid keys of row ``b``, columns
    ``c0:c1``, in original key order; returns True when a total is not finite (a bad value)."""
    width = c1 - c0
    for j in range(keys_given.shape[1]):
        if has_mask and not mask[b, j]:
            continue
        yj = keys_given[b, j] - shift
        vrow = values[b, j, c0:c1]
        for d in range(width):
            val = np.float64(vrow[d])
            t0[d] += val
            t1[d] += yj * val
    for d in range(width):
        if not (np.isfinite(t0[d]) and np.isfinite(t1[d])):
            return True
    return False


# --------------------------------------------------------------------------------------- sorting
@njit(**_JIT)
def _radix_sort(vals, payload, n):
    """Sort ``vals[:n]`` (finite float64) in place, stably, carrying ``payload[:n]`` along.

    LSD radix sort on the order-preserving unsigned image of the float64 bits, 11-bit digits;
    digits equal in every key are skipped (float32 data widened to float64 needs about four
    passes instead of six).
    """
    bits = vals[:n].view(np.uint64)
    keys = np.empty(n, np.uint64)
    any_bits = np.uint64(0)
    all_bits = ~any_bits
    for i in range(n):
        u = bits[i]
        u = ~u if u & _TOP_BIT else u | _TOP_BIT
        keys[i] = u
        any_bits |= u
        all_bits &= u
    varying = any_bits ^ all_bits
    digits = np.empty(_N_DIGITS, np.int64)
    n_digits = 0
    for p in range(_N_DIGITS):
        if (varying >> np.uint64(_DIGIT_BITS * p)) & _DIGIT_MASK:
            digits[n_digits] = p
            n_digits += 1
    hist = np.zeros((n_digits, 2048), np.int64)
    for i in range(n):
        k = keys[i]
        for q in range(n_digits):
            hist[q, np.int64((k >> np.uint64(_DIGIT_BITS * digits[q])) & _DIGIT_MASK)] += 1
    src_k, src_p = keys, payload
    dst_k, dst_p = np.empty(n, np.uint64), np.empty(n, np.int64)
    offsets = np.empty(2048, np.int64)
    for q in range(n_digits):
        total = 0
        for d in range(2048):
            offsets[d] = total
            total += hist[q, d]
        shift = np.uint64(_DIGIT_BITS * digits[q])
        for i in range(n):
            k = src_k[i]
            d = np.int64((k >> shift) & _DIGIT_MASK)
            pos = offsets[d]
            offsets[d] = pos + 1
            dst_k[pos] = k
            dst_p[pos] = src_p[i]
        src_k, dst_k = dst_k, src_k
        src_p, dst_p = dst_p, src_p
    for i in range(n):
        k = src_k[i]
        bits[i] = k & ~_TOP_BIT if k & _TOP_BIT else ~k
    if n_digits % 2 == 1:          # the result sits in the scratch buffer
        for i in range(n):
            payload[i] = src_p[i]


@njit(**_JIT)
def _insertion_sort(vals, payload, n):
    """Sort ``vals[:n]`` in place, stably, carrying ``payload[:n]`` along (small ``n``)."""
    for i in range(1, n):
        v = vals[i]
        p = payload[i]
        j = i - 1
        while j >= 0 and vals[j] > v:
            vals[j + 1] = vals[j]
            payload[j + 1] = payload[j]
            j -= 1
        vals[j + 1] = v
        payload[j + 1] = p


@njit(**_INLINE)
def _sort(vals, payload, n):
    if n < SMALL_SORT:
        _insertion_sort(vals, payload, n)
    else:
        _radix_sort(vals, payload, n)


@njit(**_JIT)
def _sort_row(b, scores, sorted_rows):
    """Fill row ``b`` of ``sorted_rows`` (see the module docstring) from ``scores``.

    Non-finite queries go to the tail of the query order (they get NaN rows); a non-finite valid
    key marks the row bad (``counts[b, 2] = 1``) and nothing else is done for it.
    """
    x, y, mask, has_mask = scores
    queries, query_order, keys, key_order, counts, shift = sorted_rows
    n, m = x.shape[1], y.shape[1]
    kv, kp = keys[b], key_order[b]
    nk = 0
    for j in range(m):
        if has_mask and not mask[b, j]:
            continue
        val = y[b, j]
        if not np.isfinite(val):
            counts[b, 0], counts[b, 1], counts[b, 2] = 0, 0, 1
            shift[b] = 0.0
            return
        kv[nk] = val
        kp[nk] = j
        nk += 1
    _sort(kv, kp, nk)
    # the median key: sums subtract it (s P0 - P1 then cancels little for scores far from 0);
    # comparisons use the values as given, so that ties are decided exactly
    shift[b] = kv[nk // 2] if nk > 0 else 0.0
    qv, qp = queries[b], query_order[b]
    nq = 0
    tail = n
    for i in range(n):
        val = x[b, i]
        if np.isfinite(val):
            qv[nq] = val
            qp[nq] = i
            nq += 1
        else:
            tail -= 1
            qp[tail] = i
    _sort(qv, qp, nq)
    counts[b, 0], counts[b, 1], counts[b, 2] = nq, nk, 0


def allocate_sorted(bsz, n, m):
    """Work space for the ``sorted_rows`` group (see the module docstring) of ``bsz`` rows."""
    return (np.empty((bsz, n)), np.empty((bsz, n), np.int64), np.empty((bsz, m)),
            np.empty((bsz, m), np.int64), np.zeros((bsz, 3), np.int64), np.zeros(bsz))


# --------------------------------------------------------------------------------------- forward
@njit(**_JIT)
def _forward_task(b, c0, c1, scores, sorted_rows, profile, options, values, out):
    """Columns ``c0:c1`` of row ``b`` of the (normalised, centred) kernel sum; True on a bad value.

    ``options = (center, normalizer, zero_knot, eps)``; a plain kernel sum is ``(False,
    NO_NORMALIZER, 0, 0.0)``. ``knots[b, zero_knot] == 0`` carries the "abs"/"relu" normaliser.
    Queries are visited in increasing order, a pointer per knot advancing through the sorted keys
    (merge-style) with float64 running sums ``P0 = sum w_j``, ``P1 = sum (y_j - shift) w_j``; the
    output row is assembled in float64 and written once (docs, "The kernel sum by sort-scan").
    """
    _, keys_given, mask, has_mask = scores
    queries, query_order, keys, key_order, counts, shift = sorted_rows
    knots, coeffs, slope, intercept = profile
    center, normalizer, zero_knot, eps = options
    n_all = query_order.shape[1]
    width = c1 - c0
    n_knots = knots.shape[1]
    nq, nk = counts[b, 0], counts[b, 1]
    sh, a, bs = shift[b], intercept[b], slope[b]
    qrow, krow, qp, kp = queries[b], keys[b], query_order[b], key_order[b]

    # the knot with the furthest reach among those with a non-zero coefficient: when nothing else
    # needs the column totals, its pointer is finished after the sweep and its P0 is the totals
    far = -1
    for m in range(n_knots):
        if coeffs[b, m] != 0.0 and (far < 0 or knots[b, m] < knots[b, far]):
            far = m
    need_totals = a != 0.0 or bs != 0.0 or center or far < 0
    t0 = np.zeros(width)
    t1 = np.zeros(width)
    if need_totals and _value_totals(b, c0, c1, keys_given, mask, has_mask, sh, values, t0, t1):
        return True
    n_keys = np.float64(nk)
    key_sum = 0.0
    for p in range(nk):
        key_sum += krow[p] - sh
    mean = np.zeros(width)
    if center:  # centring folded in as N - mean R (docs, "Attention")
        for d in range(width):
            mean[d] = t0[d] / (n_keys if n_keys > 1.0 else 1.0)

    p0 = np.zeros((n_knots, width))
    p1 = np.zeros((n_knots, width))
    count = np.zeros(n_knots)
    key_part = np.zeros(n_knots)
    ptr = np.zeros(n_knots, np.int64)
    acc = np.empty(width)
    for m in range(n_knots):
        if coeffs[b, m] != 0.0:
            for p in range(min(PREFETCH_AHEAD, nk)):
                _fetch_row(values, b, kp[p], c0, width, False)
    for pos in range(min(PREFETCH_AHEAD, nq)):
        _fetch_row(out, b, qp[pos], c0, width, True)

    # the last knot with a non-zero coefficient is folded into the store loop (no extra pass)
    last = 0
    for m in range(n_knots):
        if coeffs[b, m] != 0.0:
            last = m
    linear = a != 0.0 or bs != 0.0
    for pos in range(nq):
        i = qp[pos]
        xu = qrow[pos]          # as given: ties are decided on it
        x = xu - sh             # shifted: what the sums use
        if pos + PREFETCH_AHEAD < nq:
            _fetch_row(out, b, qp[pos + PREFETCH_AHEAD], c0, width, True)
        if linear:
            for d in range(width):
                acc[d] = a * t0[d] + bs * (x * t0[d] - t1[d])
        else:
            for d in range(width):
                acc[d] = 0.0
        relu_count = a * n_keys + bs * (x * n_keys - key_sum) if linear else 0.0
        s_last = 0.0
        for m in range(n_knots):
            tm = knots[b, m]
            s = x - tm
            su, se = _exact_sum(xu, -tm)
            cm = coeffs[b, m]
            p0m, p1m = p0[m], p1[m]
            p = ptr[m]
            # value sums leave tied keys out (ReLU(0) = 0): a query on or below every key gets an
            # exactly zero sum, not a rounding residue that an eps-clamped normaliser would amplify
            while p < nk and _below(krow[p], su, se, False):
                yk = krow[p] - sh
                if cm != 0.0:
                    if p + PREFETCH_AHEAD < nk:
                        _fetch_row(values, b, kp[p + PREFETCH_AHEAD], c0, width, False)
                    vrow = values[b, kp[p], c0:c1]
                    for d in range(width):
                        val = np.float64(vrow[d])
                        p0m[d] += val
                        p1m[d] += yk * val
                count[m] += 1.0
                key_part[m] += yk
                p += 1
            ptr[m] = p
            if cm != 0.0:
                if m != last:
                    for d in range(width):
                        acc[d] += cm * (s * p0m[d] - p1m[d])
                relu_count += cm * (s * count[m] - key_part[m])
            if m == last:
                s_last = s
        scale, _ = _normaliser_scale(normalizer, x, count[zero_knot], key_part[zero_knot], n_keys,
                                     key_sum, eps)
        orow = out[b, i, c0:c1]
        cl = coeffs[b, last]
        p0l, p1l = p0[last], p1[last]
        for d in range(width):
            orow[d] = (acc[d] + cl * (s_last * p0l[d] - p1l[d]) - mean[d] * relu_count) * scale

    if not need_totals:
        # finish the furthest pointer: its P0 becomes the column totals, finite iff every value is
        p0f = p0[far]
        for p in range(ptr[far], nk):
            if p + PREFETCH_AHEAD < nk:
                _fetch_row(values, b, kp[p + PREFETCH_AHEAD], c0, width, False)
            vrow = values[b, kp[p], c0:c1]
            for d in range(width):
                p0f[d] += np.float64(vrow[d])
        for d in range(width):
            if not np.isfinite(p0f[d]):
                return True
    for pos in range(nq, n_all):  # non-finite queries: NaN rows
        orow = out[b, qp[pos], c0:c1]
        for d in range(width):
            orow[d] = np.nan
    return False


@njit(**_PARALLEL)
def forward_rows(scores, profile, options, values, out, sorted_rows, schedule):
    """Sort every row into ``sorted_rows``, then sweep every (row, column chunk) into ``out``.

    ``out (B, n, c)`` has the dtype of ``values``. Returns ``bad (B * n_chunks,)``:
    ``bad[b * n_chunks + ch]`` marks a task whose row has a non-finite valid key or value (the
    caller fills those rows with NaN).
    """
    x = scores[0]
    n_chunks, chunk_width, n_workers = schedule
    bsz, c = x.shape[0], values.shape[2]
    n_tasks = bsz * n_chunks
    bad = np.zeros(n_tasks, np.bool_)
    if n_workers == 1:
        for b in range(bsz):
            _sort_row(b, scores, sorted_rows)
        for t in range(n_tasks):
            b, ch = t // n_chunks, t % n_chunks
            if sorted_rows[4][b, 2] != 0:
                bad[t] = True
            else:
                c0 = ch * chunk_width
                bad[t] = _forward_task(b, c0, min(c, c0 + chunk_width), scores, sorted_rows, profile,
                                       options, values, out)
        return bad
    next_row = np.zeros(1, np.int64)
    for _ in prange(n_workers):
        b = _claim(next_row)
        while b < bsz:
            _sort_row(b, scores, sorted_rows)
            b = _claim(next_row)
    next_task = np.zeros(1, np.int64)
    for _ in prange(n_workers):
        t = _claim(next_task)
        while t < n_tasks:
            b, ch = t // n_chunks, t % n_chunks
            if sorted_rows[4][b, 2] != 0:
                bad[t] = True
            else:
                c0 = ch * chunk_width
                bad[t] = _forward_task(b, c0, min(c, c0 + chunk_width), scores, sorted_rows, profile,
                                       options, values, out)
            t = _claim(next_task)
    return bad


# -------------------------------------------------------------------------------------- backward
@njit(**_JIT)
def _backward_prepare_row(b, scores, sorted_rows, profile, options, tensors, terms, dq_first):
    """Per-query and per-row terms of the backward pass of row ``b``; True when the row is bad.

    Writes, for every query ``i`` (original order; non-finite queries get ``scale = 0`` and
    ``dq = NaN``):

    * ``scale[b, i] = 1 / D_i``: the value cotangent is ``gnum_i = g_i / D_i``;
    * ``grad_count[b, i] = -mean . gnum_i``: the cotangent of ``R_i`` (centring, ``N - mean R``);
    * ``grad_norm[b, i] = -(g_i . out_i) / D_i`` where the normaliser was not clamped;
    * ``dq_first[b, i]``: the parts of ``dq_i`` that need no sweep (slope terms, the constant
      ``-n_keys`` of ``|r|' = 2 H(r) - 1``);

    and per row ``row_vectors[b] = (G0, G1, dmean)``: ``sum_i gnum_i``, ``sum_i (x_i - shift)
    gnum_i``, ``-sum_i R_i gnum_i``, and ``row_scalars[b] = (sum_i grad_count, sum_i grad_norm)``.
    The quotient rule and the centring are those of docs/mathematics.rst, "The backward pass".
    """
    x, keys_given, mask, has_mask = scores
    queries, query_order, keys, key_order, counts, shift = sorted_rows
    knots, coeffs, slope, intercept = profile
    center, normalizer, zero_knot, eps, n_user_knots, want_coeffs, query_poisons_row = options
    values, cot, out = tensors
    scale, grad_count, grad_norm, row_vectors, row_scalars = terms
    n, c, n_knots = x.shape[1], values.shape[2], knots.shape[1]
    nq, nk = counts[b, 0], counts[b, 1]
    if counts[b, 2] != 0 or (query_poisons_row and nq < n):
        return True
    sh, a, bs = shift[b], intercept[b], slope[b]
    qrow, krow, qp = queries[b], keys[b], query_order[b]
    n_keys = np.float64(nk)
    nonzero_count = n_keys if n_keys > 1.0 else 1.0
    coeff_sum, knot_moment, any_active = 0.0, 0.0, False
    for m in range(n_knots):
        coeff_sum += coeffs[b, m]
        knot_moment += coeffs[b, m] * knots[b, m]
        any_active = any_active or coeffs[b, m] != 0.0 or (want_coeffs and m < n_user_knots)
    grad_normaliser = normalizer == ABS_NORMALIZER or normalizer == RELU_NORMALIZER

    totals = np.zeros(c)
    if center or bs != 0.0:
        if _value_totals(b, 0, c, keys_given, mask, has_mask, sh, values, totals, np.zeros(c)):
            return True

    # 1. per query (sorted order): the centring sum R_i and the normaliser, strict value sums as in
    #    the forward pass, so that D_i and the eps test are the forward's own
    relu_sum = np.zeros(n)
    unclamped = np.ones(n, np.bool_)
    for i in range(n):
        scale[b, i] = 0.0
    if center or grad_normaliser:
        key_sum = 0.0
        for p in range(nk):
            key_sum += krow[p] - sh
        ptr = np.zeros(n_knots, np.int64)
        count = np.zeros(n_knots)
        key_part = np.zeros(n_knots)
        for pos in range(nq):
            xu = qrow[pos]
            xs = xu - sh
            r = a * n_keys + bs * (xs * n_keys - key_sum)
            for m in range(n_knots):
                cm = coeffs[b, m]
                if not ((center and cm != 0.0) or (grad_normaliser and m == zero_knot)):
                    continue
                su, se = _exact_sum(xu, -knots[b, m])
                p = ptr[m]
                while p < nk and _below(krow[p], su, se, False):
                    count[m] += 1.0
                    key_part[m] += krow[p] - sh
                    p += 1
                ptr[m] = p
                if cm != 0.0:
                    r += cm * ((xs - knots[b, m]) * count[m] - key_part[m])
            i = qp[pos]
            relu_sum[i] = r
            scale[b, i], unclamped[i] = _normaliser_scale(normalizer, xs, count[zero_knot],
                                                          key_part[zero_knot], n_keys, key_sum, eps)
    else:
        constant, _ = _normaliser_scale(normalizer, 0.0, 0.0, 0.0, n_keys, 0.0, eps)
        for pos in range(nq):
            scale[b, qp[pos]] = constant
    for pos in range(nq, n):
        dq_first[b, qp[pos]] = np.nan

    # 2. per query (original order: the rows of g and out are read sequentially), only when some
    #    term needs more than the sweep's own running sums
    linear_slope = bs + coeff_sum
    need_vectors = (center or grad_normaliser or a != 0.0 or linear_slope != 0.0 or knot_moment != 0.0
                    or not any_active)
    g0, g1, dmean = row_vectors[b, 0], row_vectors[b, 1], row_vectors[b, 2]
    count_total, norm_total = 0.0, 0.0
    if need_vectors:
        for i in range(n):
            sc = scale[b, i]
            if sc == 0.0:
                continue
            grow = cot[b, i]
            xs = x[b, i] - sh
            dot_totals = _dot(grow, totals) if center or bs != 0.0 else 0.0
            gc = -sc * dot_totals / nonzero_count if center else 0.0
            gn = -sc * _dot(grow, out[b, i]) if grad_normaliser and unclamped[i] else 0.0
            grad_count[b, i] = gc
            grad_norm[b, i] = gn
            dq = sc * bs * dot_totals + gc * bs * n_keys
            if normalizer == ABS_NORMALIZER:
                dq -= gn * n_keys
            dq_first[b, i] = dq
            count_total += gc
            norm_total += gn
            r = relu_sum[i] if center else 0.0
            for d in range(c):
                gv = np.float64(grow[d]) * sc
                g0[d] += gv
                g1[d] += xs * gv
                dmean[d] -= r * gv
        for d in range(c):
            if not (np.isfinite(g0[d]) and np.isfinite(g1[d]) and np.isfinite(dmean[d])):
                return True
        if not (np.isfinite(count_total) and np.isfinite(norm_total)):
            return True
    row_scalars[b, 0] = count_total
    row_scalars[b, 1] = norm_total
    return False


@njit(**_JIT)
def _backward_task(b, ch, c0, c1, scores, sorted_rows, profile, options, tensors, terms, grads):
    """Columns ``c0:c1`` of the backward sweep of row ``b``; True when a value or cotangent is bad.

    Keys are visited in increasing order; for each knot ``t_m`` a pointer advances through the
    sorted queries, *absorbing* the queries with ``x_i < y_j + t_m`` (exactly) before key ``j`` is
    handled. At that moment:

    * a query absorbed by knot ``m`` sees the keys already passed, ``y <= x_i - t_m``: their value
      sum ``KP0`` is the forward's step sum ``P0[rank(x_i - t_m)]``, so
      ``dq_i += c_m gnum_i . KP0`` and ``dknots_m -= c_m gnum_i . KP0`` (right derivative, H(0) = 1);
    * key ``j`` sees the queries not yet absorbed, ``x_i >= y_j + t_m``: with the running sums
      ``P0_m = sum gnum_i``, ``P1_m = sum (x_i - shift) gnum_i`` over the absorbed ones and the row
      totals ``G0``, ``G1``, ``dv_j = sum_i f(x_i - y_j) gnum_i`` and
      ``dk_j = -v_j . sum_i f'(x_i - y_j) gnum_i`` (left derivative in the key).

    One pass per row and chunk yields dq, dk and dv together; every sum is float64; ``dv`` is
    written once per key. Chunk 0 also carries the scalar (indicator) terms of centring and
    normaliser. docs/mathematics.rst, "The backward pass".
    """
    _, keys_given, mask, has_mask = scores
    queries, query_order, keys, key_order, counts, shift = sorted_rows
    knots, coeffs, slope, intercept = profile
    center, normalizer, zero_knot, eps, n_user_knots, want_coeffs, _ = options
    values, cot, _ = tensors
    scale, grad_count, grad_norm, row_vectors, row_scalars = terms
    dq_parts, dk_parts, dv, dknots_parts, dcoeffs_parts = grads
    m_all, width, n_knots = keys_given.shape[1], c1 - c0, knots.shape[1]
    nq, nk = counts[b, 0], counts[b, 1]
    sh, a, bs = shift[b], intercept[b], slope[b]
    qrow, krow, qp, kp = queries[b], keys[b], query_order[b], key_order[b]
    first = ch == 0
    grad_normaliser = first and (normalizer == ABS_NORMALIZER or normalizer == RELU_NORMALIZER)
    norm_weight = 2.0 if normalizer == ABS_NORMALIZER else 1.0     # |r|' = 2 H(r) - 1, ReLU' = H
    n_keys = np.float64(nk)

    active = np.zeros(n_knots, np.bool_)     # knots whose sums carry value columns
    moving = np.zeros(n_knots, np.bool_)     # knots whose pointer has to move at all
    coeff_sum, knot_moment, any_active = 0.0, 0.0, False
    for m in range(n_knots):
        cm = coeffs[b, m]
        coeff_sum += cm
        knot_moment += cm * knots[b, m]
        active[m] = cm != 0.0 or (want_coeffs and m < n_user_knots)
        moving[m] = active[m] or (grad_normaliser and m == zero_knot)
        any_active = any_active or active[m]
    linear_slope = bs + coeff_sum
    nonzero_count = n_keys if n_keys > 1.0 else 1.0
    last_coeff = -1
    for m in range(n_knots):
        if coeffs[b, m] != 0.0:
            last_coeff = m
    g0, g1 = row_vectors[b, 0, c0:c1], row_vectors[b, 1, c0:c1]
    dmean = row_vectors[b, 2, c0:c1]
    count_total, norm_total = row_scalars[b, 0], row_scalars[b, 1]
    # the part of dv_j that does not depend on j but through y_j G0 (the affine part of f and the
    # suffix sums written as totals minus prefixes) and the centring's d mean / n_valid
    base = np.empty(width)
    for d in range(width):
        base[d] = (a - knot_moment) * g0[d] + linear_slope * g1[d] + dmean[d] / nonzero_count

    p0 = np.zeros((n_knots, width))
    p1 = np.zeros((n_knots, width))
    count_prefix = np.zeros(n_knots)        # sum of grad_count over the absorbed queries
    norm_prefix = 0.0                       # sum of grad_norm over those absorbed at knot 0
    ptr = np.zeros(n_knots, np.int64)
    knot_sums = np.zeros(n_knots)
    coeff_sums = np.zeros(n_knots)
    kp0 = np.zeros(width)
    kp1 = np.zeros(width)
    gnum = np.empty(width)
    vj = np.empty(width)
    acc = np.empty(width)
    dacc = np.empty(width)
    kcount, ksum = 0.0, 0.0                 # count and sum (shifted) of the keys passed
    yu, ys = 0.0, 0.0
    for p in range(min(PREFETCH_AHEAD, nk)):
        _fetch_row(values, b, kp[p], c0, width, False)
    for m in range(n_knots):
        if active[m]:
            for pos in range(min(PREFETCH_AHEAD, nq)):
                _fetch_row(cot, b, qp[pos], c0, width, False)

    for p in range(nk + 1):                 # p == nk: a last step absorbs every query left
        if p < nk:
            yu = krow[p]
            ys = yu - sh
            if p + PREFETCH_AHEAD < nk:
                ahead = kp[p + PREFETCH_AHEAD]
                _fetch_row(values, b, ahead, c0, width, False)
                _fetch_row(dv, b, ahead, c0, width, True)
        for m in range(n_knots):
            if not moving[m]:
                continue
            tm, cm = knots[b, m], coeffs[b, m]
            su, se = _exact_sum(yu, tm) if p < nk else (np.inf, 0.0)
            p0m, p1m = p0[m], p1[m]
            pos = ptr[m]
            while pos < nq and _below(qrow[pos], su, se, False):
                i = qp[pos]
                xs = qrow[pos] - sh
                if active[m]:
                    if pos + PREFETCH_AHEAD < nq:
                        _fetch_row(cot, b, qp[pos + PREFETCH_AHEAD], c0, width, False)
                    sc = scale[b, i]
                    grow = cot[b, i, c0:c1]
                    for d in range(width):
                        gv = np.float64(grow[d]) * sc
                        gnum[d] = gv
                        p0m[d] += gv
                        p1m[d] += xs * gv
                    if want_coeffs:
                        step, moment = _dot_pair(gnum, kp0, kp1)
                        coeff_sums[m] += (xs - tm) * step - moment
                    else:
                        step = _dot(gnum, kp0)
                    if first:
                        gc = grad_count[b, i]
                        count_prefix[m] += gc
                        step += gc * kcount
                        if want_coeffs:
                            coeff_sums[m] += gc * ((xs - tm) * kcount - ksum)
                    knot_sums[m] += step
                    dq_parts[ch, b, i] += cm * step
                if grad_normaliser and m == zero_knot:
                    gn = grad_norm[b, i]
                    norm_prefix += gn
                    dq_parts[ch, b, i] += norm_weight * gn * kcount
                pos += 1
            ptr[m] = pos
        if p == nk:
            break

        # key j: dv_j and dk_j from the running sums of the queries absorbed so far; the last knot
        # with a coefficient is folded into the loop that stores dv_j (one pass less per key)
        j = kp[p]
        vrow = values[b, j, c0:c1]
        slope_ys = linear_slope * ys
        for d in range(width):
            vj[d] = np.float64(vrow[d])
            acc[d] = base[d] - slope_ys * g0[d]
            dacc[d] = linear_slope * g0[d]
        for m in range(last_coeff):
            cm = coeffs[b, m]
            if cm == 0.0:
                continue
            u = ys + knots[b, m]
            p0m, p1m = p0[m], p1[m]
            for d in range(width):
                acc[d] += cm * (u * p0m[d] - p1m[d])
                dacc[d] -= cm * p0m[d]
        dvrow = dv[b, j, c0:c1]
        cl = coeffs[b, last_coeff] if last_coeff >= 0 else 0.0
        u = ys + knots[b, last_coeff] if last_coeff >= 0 else 0.0
        p0l, p1l = p0[max(last_coeff, 0)], p1[max(last_coeff, 0)]
        for d in range(width):
            dvrow[d] = acc[d] + cl * (u * p0l[d] - p1l[d])
            dacc[d] -= cl * p0l[d]
            kp0[d] += vj[d]
        dk = -_dot(vj, dacc)
        if first:
            dk -= linear_slope * count_total
            for m in range(n_knots):
                dk += coeffs[b, m] * count_prefix[m]
            if grad_normaliser:
                dk -= norm_total - norm_weight * norm_prefix
        dk_parts[ch, b, j] = dk
        if want_coeffs:
            for d in range(width):
                kp1[d] += ys * vj[d]
        kcount += 1.0
        ksum += ys

    if has_mask:  # masked keys take part in nothing: zero gradients
        for j in range(m_all):
            if not mask[b, j]:
                dvrow = dv[b, j, c0:c1]
                for d in range(width):
                    dvrow[d] = 0.0
                dk_parts[ch, b, j] = 0.0
    for m in range(n_knots):
        dknots_parts[ch, b, m] = -coeffs[b, m] * knot_sums[m]
        dcoeffs_parts[ch, b, m] = coeff_sums[m]
    # the values' totals (kp0) and, when the preparation skipped them, the cotangents' totals (P0
    # of an active knot, after the final step) decide whether the row is finite
    for d in range(width):
        if not np.isfinite(kp0[d]):
            return True
    if any_active:
        for m in range(n_knots):
            if active[m]:
                for d in range(width):
                    if not np.isfinite(p0[m, d]):
                        return True
                break
    return False


@njit(**_PARALLEL)
def backward_rows(scores, profile, options, tensors, grads, workspace, schedule):
    """The fused backward pass of every row, into ``grads``; returns ``bad (B * n_chunks,)``.

    ``options = (center, normalizer, zero_knot, eps, n_user_knots, want_coeffs, query_poisons_row)``;
    ``tensors = (values (B, m, c), cot (B, n, c), out (B, n, c))`` in one dtype (``out`` is read
    only for an "abs"/"relu" normaliser). ``grads = (dq_parts (n_chunks, B, n) zeros, dk_parts
    (n_chunks, B, m), dv (B, m, c) in the values' dtype, dknots_parts, dcoeffs_parts (n_chunks, B,
    M))``: per-chunk partial sums, added up by the caller. ``workspace = (sorted_rows, terms)`` with
    ``terms = (scale, grad_count, grad_norm (B, n), row_vectors (B, 3, c), row_scalars (B, 2))``,
    all zeros. ``bad`` marks tasks of rows with a non-finite valid key, value or cotangent (or
    query, under ``query_poisons_row``): the caller fills those rows with NaN.
    """
    x = scores[0]
    values = tensors[0]
    sorted_rows, terms = workspace
    n_chunks, chunk_width, n_workers = schedule
    bsz, c = x.shape[0], values.shape[2]
    dq_first = grads[0][0]
    row_bad = np.zeros(bsz, np.bool_)
    n_tasks = bsz * n_chunks
    bad = np.zeros(n_tasks, np.bool_)
    if n_workers == 1:
        for b in range(bsz):
            _sort_row(b, scores, sorted_rows)
            row_bad[b] = _backward_prepare_row(b, scores, sorted_rows, profile, options, tensors, terms,
                                               dq_first)
        for t in range(n_tasks):
            b, ch = t // n_chunks, t % n_chunks
            if row_bad[b]:
                bad[t] = True
            else:
                c0 = ch * chunk_width
                bad[t] = _backward_task(b, ch, c0, min(c, c0 + chunk_width), scores, sorted_rows, profile,
                                        options, tensors, terms, grads)
        return bad
    next_row = np.zeros(1, np.int64)
    for _ in prange(n_workers):
        b = _claim(next_row)
        while b < bsz:
            _sort_row(b, scores, sorted_rows)
            row_bad[b] = _backward_prepare_row(b, scores, sorted_rows, profile, options, tensors, terms,
                                               dq_first)
            b = _claim(next_row)
    next_task = np.zeros(1, np.int64)
    for _ in prange(n_workers):
        t = _claim(next_task)
        while t < n_tasks:
            b, ch = t // n_chunks, t % n_chunks
            if row_bad[b]:
                bad[t] = True
            else:
                c0 = ch * chunk_width
                bad[t] = _backward_task(b, ch, c0, min(c, c0 + chunk_width), scores, sorted_rows, profile,
                                        options, tensors, terms, grads)
            t = _claim(next_task)
    return bad
