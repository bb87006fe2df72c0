"""The Triton kernels of the triton engine: a blocked scan over the sorted value rows, and a query
kernel that searches each query's rank and combines the gathered prefix sums.

This module imports Triton at its top: the engine loads it on the first call that runs on it, so
``import slicedkern`` never imports Triton (docs/architecture.rst, "Engines"). The functions are
jitted by :func:`build` on that first call, not at import, so that Triton's interpreter setting
(``TRITON_INTERPRET``) is read when the kernels are first needed: importing this module (doctest
collection does) fixes nothing.

Layout (every tensor contiguous, the batch flattened to ``R`` rows):

* ``keys`` (R, m) the sorted keys in the work dtype (float64), ``perm`` (R, m) their original
  positions, ``shift`` (R,) the median key (subtracted in the arithmetic, as in the scan engine);
* ``w`` (R, m, c) the weights in their own order and dtype (read once, through ``perm``), ``take``
  (R, m) int8 the keys that take part (the others weigh zero, whatever they hold);
* ``table`` (R, m, 2 C) the *block-local* inclusive prefix sums ``[P0 | P1]`` of ``[w, (y - shift) w]``
  over the sorted rows, ``C = c + ONES`` (``ONES`` appends the indicator column ``take``), in the
  accumulator dtype (float32 for float32 / half weights, float64 for float64 ones);
* ``carry`` (R, nb + 1, 2 C) float64: the exclusive prefix sums of the block totals, the last row
  the grand total. A prefix sum at rank ``r`` is ``carry[(r - 1) // BLOCK_M] + table[r - 1]``:
  float32 within a block, float64 between blocks (docs/mathematics.rst, "Numerics").
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
    from triton import knobs
except ImportError:      # imported without Triton (doctest collection): the engine declines before build()
    triton = tl = knobs = None

__all__ = ["build", "interpreted", "block_scan", "query_combine"]

_JITTED = ("_rank", "_prefix", "block_scan", "query_combine")
_mode: list = []     # [interpreted?] once built


def block_scan(keys_ptr, shift_ptr, perm_ptr, w_ptr, take_ptr, table_ptr, totals_ptr,
               m, c, C, nb, sw_r, sw_m, sw_c,
               HAS_TAKE: tl.constexpr, ONES: tl.constexpr, ACC: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """One block of sorted rows x one block of columns: local inclusive sums and the block totals."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cb = tl.program_id(2)
    j = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    jm = j < m
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    p = tl.load(perm_ptr + row * m + j, mask=jm, other=0)
    shift = tl.load(shift_ptr + row)
    y = (tl.load(keys_ptr + row * m + j, mask=jm, other=0.0) - shift).to(ACC)
    ok = jm
    if HAS_TAKE:
        ok = ok & (tl.load(take_ptr + row * m + p, mask=jm, other=0) != 0)
    wm = ok[:, None] & (cols[None, :] < c)
    wv = tl.load(w_ptr + row * sw_r + p[:, None] * sw_m + cols[None, :] * sw_c, mask=wm, other=0.0)
    # ``where``, not a product: a masked key's weight may be NaN and must not reach the sums
    wv = tl.where(wm, wv.to(ACC), 0.0)
    if ONES:
        wv = tl.where(ok[:, None] & (cols[None, :] == c), 1.0, wv).to(ACC)
    wy = wv * y[:, None]
    p0 = tl.cumsum(wv, 0)
    p1 = tl.cumsum(wy, 0)
    out = row * m * 2 * C + j[:, None] * 2 * C + cols[None, :]
    sm = jm[:, None] & (cols[None, :] < C)
    tl.store(table_ptr + out, p0, mask=sm)
    tl.store(table_ptr + out + C, p1, mask=sm)
    tot = row * nb * 2 * C + blk * 2 * C + cols
    cm = cols < C
    tl.store(totals_ptr + tot, tl.sum(wv, 0).to(tl.float64), mask=cm)
    tl.store(totals_ptr + tot + C, tl.sum(wy, 0).to(tl.float64), mask=cm)


def _rank(keys_ptr, row, m, d, e, STRICT: tl.constexpr, LOG_M: tl.constexpr):
    """The number of keys below the exact difference ``d + e`` (``<`` when STRICT, else ``<=``).

    ``d = fl(x - t)`` and ``e`` its rounding error (TwoSum), so a tie ``x - y = t`` is decided on the
    exact values, as the scan engine decides it. Binary search with ``LOG_M`` fixed steps.
    """
    pos = tl.zeros(d.shape, dtype=tl.int64)
    for i in tl.static_range(LOG_M):
        step = 1 << (LOG_M - 1 - i)
        cand = pos + step
        inside = cand <= m
        key = tl.load(keys_ptr + row * m + cand - 1, mask=inside, other=0.0)
        if STRICT:
            below = (key < d) | ((key == d) & (e > 0))
        else:
            below = (key < d) | ((key == d) & (e >= 0))
        pos = tl.where(inside & below, cand, pos)
    return pos


def _prefix(table_ptr, carry_ptr, row, m, C, nb, rank, cols, part, nm, cm, BLOCK_M: tl.constexpr):
    """Exclusive prefix sums at ``rank`` (BLOCK_N,) of part ``part`` (0: P0, 1: P1), float64."""
    has = nm & (rank > 0)
    r1 = tl.where(has, rank - 1, 0)
    blk = r1 // BLOCK_M
    lm = has[:, None] & cm[None, :]
    local = tl.load(table_ptr + row * m * 2 * C + r1[:, None] * 2 * C + part * C + cols[None, :],
                    mask=lm, other=0.0).to(tl.float64)
    carry = tl.load(carry_ptr + row * (nb + 1) * 2 * C + blk[:, None] * 2 * C + part * C + cols[None, :],
                    mask=lm, other=0.0)
    return local + carry


def query_combine(x_ptr, keys_ptr, shift_ptr, table_ptr, carry_ptr, knots_ptr, coeffs_ptr, lin_ptr,
                  alpha_ptr, div_ptr, out_ptr,
                  n, m, C, nb, col0, width,
                  K: tl.constexpr, STRICT: tl.constexpr, DERIV: tl.constexpr, HAS_ALPHA: tl.constexpr,
                  HAS_DIV: tl.constexpr, LOG_M: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """``out[i, :] = (profile sum over columns col0 .. col0 + width + alpha_i * total P0) / div_i``.

    The profile ``intercept + slope r + sum_k coeffs[k] ReLU(r - knots[k])`` (per batch row:
    ``knots``, ``coeffs`` (R, K), ``lin`` (R, 2) = slope, intercept), or its derivative when DERIV.
    Value: ``sum_k c_k (s_k P0[r_k] - P1[r_k]) + (intercept + slope xs) P0[m] - slope P1[m]`` with
    ``s_k = x - shift - t_k``; derivative: ``sum_k c_k P0[r_k] + slope P0[m]``. Float64 throughout.
    """
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cl = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    nm = i < n
    cm = cl < width
    cols = col0 + cl
    x = tl.load(x_ptr + row * n + i, mask=nm, other=0.0)
    shift = tl.load(shift_ptr + row)
    xs = x - shift
    acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float64)
    for k in tl.static_range(K):
        t = tl.load(knots_ptr + row * K + k)
        cf = tl.load(coeffs_ptr + row * K + k)
        d = x - t
        bb = d - x
        e = (x - (d - bb)) + (-t - bb)          # x - t = d + e exactly (TwoSum)
        rank = _rank(keys_ptr, row, m, d, e, STRICT, LOG_M)
        p0 = _prefix(table_ptr, carry_ptr, row, m, C, nb, rank, cols, 0, nm, cm, BLOCK_M)
        if DERIV:
            acc += cf * p0
        else:
            p1 = _prefix(table_ptr, carry_ptr, row, m, C, nb, rank, cols, 1, nm, cm, BLOCK_M)
            s = xs - t
            acc += cf * (s[:, None] * p0 - p1)
    slope = tl.load(lin_ptr + row * 2)
    intercept = tl.load(lin_ptr + row * 2 + 1)
    total = row * (nb + 1) * 2 * C + nb * 2 * C + cols
    t0 = tl.load(carry_ptr + total, mask=cm, other=0.0)
    t1 = tl.load(carry_ptr + total + C, mask=cm, other=0.0)
    if DERIV:
        acc += slope * t0[None, :]
    else:
        acc += (intercept + slope * xs)[:, None] * t0[None, :] - slope * t1[None, :]
    if HAS_ALPHA:
        acc += tl.load(alpha_ptr + row * n + i, mask=nm, other=0.0)[:, None] * t0[None, :]
    if HAS_DIV:
        acc = acc / tl.load(div_ptr + row * n + i, mask=nm, other=1.0)[:, None]
    tl.store(out_ptr + row * n * width + i[:, None] * width + cl[None, :], acc,
             mask=nm[:, None] & cm[None, :])


def build() -> None:
    """Jit the kernels once (in place of the plain functions above), in the mode Triton says now."""
    if not _mode:
        scope = globals()
        for name in _JITTED:
            scope[name] = triton.jit(scope[name])
        _mode.append(bool(knobs.runtime.interpret))


def interpreted() -> bool | None:
    """Whether the built kernels run under the interpreter (``None``: not built yet)."""
    return _mode[0] if _mode else None
