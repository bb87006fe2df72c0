"""Compiled (numba) kernels of the sweep engine, shared part: intrinsics, small helpers, the row sort.

The entry points (:func:`._kernels_forward.forward_rows`, :func:`._kernels_backward.backward_rows`)
are one compiled call per
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
    from :func:`sort_row`: per row the finite queries and the valid keys sorted ascending (values
    unshifted), their original indices, ``counts[b] = (n_finite_queries, n_valid_keys, key_bad)``
    and the median valid key, subtracted wherever values enter sums (not where they are compared).
``profile``
    ``(knots (B, M), coeffs (B, M), slope (B,), intercept (B,))``:
    ``f(r) = intercept + slope r + sum_m coeffs[m] ReLU(r - knots[m])`` per row.
``schedule``
    ``(n_chunks, chunk_width, n_workers)``: value columns are split in ``n_chunks`` chunks of
    ``chunk_width`` (one task per row and chunk).

Results and work space are allocated by the caller (:func:`allocate_sorted`):
NumPy backs large arrays with transparent huge pages, and first-touch page faults of a fresh
numba allocation cost as much as the forward sweep itself (measured: 55 ms instead of 32 ms for
8 rows of L = 16384, D = 64), more still when two threads fault at once.

The mathematics is that of docs/mathematics.rst ("The kernel sum by sort-scan", "Attention", "The
backward pass"); the comments below say where and why the code departs from the plain formulas.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from llvmlite import ir as llvm_ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..._spec import NORMALIZER_CODES
from . import _layout

__all__ = ["SumOptions", "BackwardOptions", "CausalOptions",
           "NO_NORMALIZER", "ABS_NORMALIZER", "RELU_NORMALIZER", "COUNT_NORMALIZER",
           "JIT", "INLINE", "PARALLEL", "PREFETCH_AHEAD", "allocate_sorted", "allocate_saved", "sort_row", "fetch_row",
           "exact_sum", "below", "dot", "dot_pair", "claim", "divisor_of", "normaliser_scale", "strict_rank",
           "value_totals"]

#: Normaliser codes as the compiled code receives them (``normalizer`` of the attention options):
#: the one coding of slicedkern._spec, which the Triton kernels read too.
NO_NORMALIZER, ABS_NORMALIZER, RELU_NORMALIZER, COUNT_NORMALIZER = (NORMALIZER_CODES[name]
                                                                    for name in (None, "abs", "relu", "count"))



class SumOptions(NamedTuple):
    """What the forward kernels combine (:func:`._kernels_forward.forward_rows`); a plain kernel sum
    is ``SumOptions.plain()``."""

    center: bool        # fold the centring term ``- mean R`` in
    normalizer: int     # a code of NORMALIZER_CODES
    zero_knot: int      # the knot at 0 of the profile, which carries an "abs" / "relu" normaliser
    eps: float          # the normaliser's floor

    @staticmethod
    def plain() -> SumOptions:
        return SumOptions(False, NO_NORMALIZER, 0, 0.0)


class BackwardOptions(NamedTuple):
    """The fused backward's options (:func:`._kernels_backward.backward_rows`)."""

    center: bool
    normalizer: int
    zero_knot: int
    eps: float
    n_user_knots: int           # the profile's own knots (a normaliser's knot at 0 may follow them)
    want_coeffs: bool           # knot and coefficient gradients (array parameters)
    query_poisons_row: bool     # a non-finite query makes its whole row's key gradients NaN
    strict: Any                 # (M,) bool: knot m's own gradient counts an exact tie as below it


class CausalOptions(NamedTuple):
    """The causal sweep's options (:func:`._kernels_causal.causal_rows`)."""

    center: bool
    normalizer: int
    zero_knot: int
    eps: float
    want_params: bool           # knot and coefficient gradients (the pull-back modes)
    vanishes: bool = False      # the value profile is 0 wherever the normaliser is (silent rows)


JIT = dict(cache=True, nogil=True, error_model="numpy")
INLINE = dict(JIT, inline="always")
# Entry points: prange only. Every other parfor conversion is off so that array creation in the
# serial branch never becomes a parallel region (which would wake the thread pool).
PARALLEL = dict(cache=True, error_model="numpy",
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
@njit(**INLINE)
def fetch_row(arr, b, row, c0, width, for_write):
    """Prefetch ``arr[b, row, c0:c0 + width]`` (C-contiguous 3-D), one hint per 64-byte line."""
    start = (b * arr.shape[1] + row) * arr.shape[2] + c0
    step = max(1, 64 // arr.itemsize)
    for e in range(start, start + width, step):
        if for_write:
            _prefetch_write(arr, e)
        else:
            _prefetch_read(arr, e)


@njit(**INLINE)
def exact_sum(a, b):
    """``(s, e)`` with ``s = fl(a + b)`` and ``a + b = s + e`` exactly (TwoSum)."""
    s = a + b
    bv = s - a
    return s, (a - (s - bv)) + (b - bv)


@njit(**INLINE)
def below(value, s, e, inclusive):
    """Whether ``value < s + e`` (``<=`` when ``inclusive``), decided exactly.

    Thresholds ``x - t`` are compared as the exact pair of :func:`exact_sum`, so that a tie is a
    tie whatever the rounding of ``x - t`` (docs/mathematics.rst, "The backward pass", Ties).
    """
    return value < s or (value == s and (e > 0.0 or (inclusive and e == 0.0)))


# reassoc lets LLVM keep several partial sums in vector registers: a plain float reduction is one
# serial chain of additions and would dominate the backward sweep. The order is fixed by the
# compiled code, so results are reproducible on a given machine.
@njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})
def dot(a, b):
    """``sum_d a[d] b[d]`` in float64 over two 1-D arrays of equal length."""
    total = 0.0
    for d in range(a.shape[0]):
        total += np.float64(a[d]) * np.float64(b[d])
    return total


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})
def dot_pair(a, b, c):
    """``(a . b, a . c)`` in float64, reading ``a`` once (see :func:`dot`)."""
    first = 0.0
    second = 0.0
    for d in range(a.shape[0]):
        ad = np.float64(a[d])
        first += ad * np.float64(b[d])
        second += ad * np.float64(c[d])
    return first, second


@njit(**INLINE)
def claim(counter):
    """The next task index for the calling worker (dynamic scheduling)."""
    return _fetch_add(counter)


@njit(**JIT)
def strict_rank(vals, n, su, se):
    """The number of ``vals[:n]`` (sorted) below ``su + se`` exactly (:func:`below`, strict)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if below(vals[mid], su, se, False):
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(**INLINE)
def divisor_of(normalizer, count, den, eps):
    """What a query's numerator is divided by: the compiled twin of
    :meth:`slicedkern._spec.Normalizer.divisor` (``max(den, eps)`` for a profile normaliser, 1 where
    no key is seen; the count, at least 1; else 1)."""
    if normalizer == ABS_NORMALIZER or normalizer == RELU_NORMALIZER:
        if count <= 0.0:
            return 1.0
        return den if den > eps else eps
    if normalizer == COUNT_NORMALIZER:
        return count if count > 1.0 else 1.0
    return 1.0


@njit(**INLINE)
def normaliser_scale(normalizer, x, zero_count, zero_sum, n_keys, key_sum, eps):
    """``(1 / D_i, unclamped D_i >= eps)`` for a query ``x`` (shifted) that sees all ``n_keys``
    valid keys, docs "Attention"; the divisor is :func:`divisor_of`'s.

    ``zero_count`` / ``zero_sum``: count and sum (shifted) of the keys strictly below ``x``;
    ``key_sum``: sum of all valid keys (shifted). ``|r| = 2 ReLU(r) - r`` gives the "abs" sum.
    """
    if normalizer != ABS_NORMALIZER and normalizer != RELU_NORMALIZER:
        return 1.0 / divisor_of(normalizer, n_keys, 0.0, eps), True
    den = x * zero_count - zero_sum
    if normalizer == ABS_NORMALIZER:
        den = 2.0 * den - (x * n_keys - key_sum)
    return 1.0 / divisor_of(normalizer, n_keys, den, eps), den >= eps


@njit(**JIT)
def value_totals(b, c0, c1, keys_given, mask, has_mask, shift, values, t0, t1):
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
@njit(**JIT)
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


@njit(**JIT)
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


@njit(**INLINE)
def _sort(vals, payload, n):
    if n < SMALL_SORT:
        _insertion_sort(vals, payload, n)
    else:
        _radix_sort(vals, payload, n)


@njit(**JIT)
def sort_row(b, scores, sorted_rows):
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
    """Work space for the ``sorted_rows`` group (see the module docstring) of ``bsz`` rows
    (:func:`._layout.sorted_rows`), zeros: the entries past a row's counts (masked keys) are never
    written, and as residuals of a registered operator they must not differ between two runs."""
    return tuple(np.zeros(shape, dtype) for shape, dtype in _layout.sorted_rows(bsz, n, m))


def allocate_saved(bsz, n, c, keep):
    """The forward's ``saved`` group (:func:`._kernels_forward.forward_rows`, :func:`._layout.saved`):
    ``(scale, relu_sum (bsz, n), unclamped (bsz, n) bool, totals (bsz, c), keep)``, zeros; (1, 1)
    dummies of the same types (one compiled signature) when ``keep`` is False."""
    if not keep:
        bsz, n, c = 1, 1, 1
    return tuple(np.zeros(shape, dtype) for shape, dtype in _layout.saved(bsz, n, c)) + (bool(keep),)
