"""Wide accumulation: the arithmetic of the sort-scan's prefix sums and their combination.

``s P0[r] - P1[r]`` subtracts two terms far larger than their difference (docs/mathematics.rst,
"Numerics"), and a narrow hat
subtracts such differences again, so both the prefix sums and the combination need more than
float32. Two interchangeable implementations share one interface:

* :class:`Plain`: the work dtype is float64 (every backend that has it): ordinary operators.
* :class:`DoubleFloat`: the backend has no float64 (JAX without ``jax_enable_x64``, some
  accelerators). A value is a :class:`Pair` ``hi + lo`` of float32 arrays,
  about 48 significant bits, with error-free transformations (Knuth's TwoSum, Dekker's split
  product). Prefix sums use a work-efficient odd-even scan of double-float additions, ``O(m)``
  work in ``2 log2 m`` parallel steps; nothing here is sequential or value-dependent, so it traces
  under ``jax.jit``.

Both also build the prefix table (``table``) and evaluate ``combine``: the per-query weighted sum
of gathered table rows that every profile sum reduces to (:mod:`slicedkern.engines.sortscan.sums`). ``Plain`` hands it
to :func:`slicedkern.backends.combine_rows` (one ``embedding_bag`` on torch) with a per-query divisor
folded into the weights; ``DoubleFloat`` sums pair products and divides last.

Slicing with ``value[..., i:j]`` and ``value[..., None]`` works on both representations.
"""

from __future__ import annotations

from ..._lib.namespace import array_device, exclusive_scan, scalar
from ...backends import combine_rows, prefix_table, sorted_weights, take_rows

__all__ = ["arithmetic", "two_sum", "power_of_two_scaled", "unscaled", "Plain", "DoubleFloat", "Pair"]


def is_one(value) -> bool:
    return isinstance(value, (int, float)) and value == 1


def two_sum(a, b):
    """Knuth's TwoSum: ``(s, e)`` with ``s = fl(a + b)`` and ``a + b = s + e`` exactly."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def arithmetic(xp, work):
    """The accumulator for ``work``: plain float64, or double-float when only float32 exists."""
    return Plain(xp) if work == xp.float64 else DoubleFloat(xp)


def _power_of_two(xp, e):
    """``2 ** e`` for integer-valued float32 ``e`` in [-126, 126], exactly (products of powers of two;
    ``pow`` and ``exp2`` are not exact on every backend)."""
    one = xp.ones_like(e)
    up, down = one, one
    magnitude = xp.abs(e)
    for bit in range(7):
        step = 2.0 ** (2 ** bit)
        on = xp.remainder(xp.floor(magnitude / 2 ** bit), 2.0) == 1.0
        up = xp.where(on & (e > 0), up * step, up)
        down = xp.where(on & (e < 0), down / step, down)
    return up * down


def power_of_two_scaled(xp, ar, w):
    """Weights scaled per batch row by a power of two so that their largest finite entry is about 1.

    Double-float products split each factor in halves (Dekker), which overflows for values above
    about 1e34 and loses the error terms below about 1e-30 (subnormal, flushed). The sums are linear
    in the weights, so the row's result is scaled back exactly. Plain float64 needs none of it.
    Returns ``(w, factor)``: ``factor`` (..., 1, 1) multiplies the result, ``None`` when unscaled.
    """
    if not ar.wide or w.shape[-1] == 0 or w.shape[-2] == 0:
        return w, None         # (no weight: nothing to scale, and no maximum to take)
    work = xp.float32
    w = xp.astype(w, work)
    size = xp.where(xp.isfinite(w), xp.abs(w), xp.zeros_like(w))
    top = xp.max(size, axis=(-2, -1), keepdims=True)
    tiny = scalar(xp, xp.finfo(work).smallest_normal, dtype=work, device=array_device(w))
    e = xp.clip(xp.floor(xp.log2(xp.maximum(top, tiny))), min=-126.0, max=126.0)
    return w * _power_of_two(xp, -e), _power_of_two(xp, e)


def unscaled(out, factor):
    """``out``, sums over weights :func:`power_of_two_scaled` scaled by ``factor``, scaled back."""
    return out if factor is None else out * factor


class Plain:
    """Work dtype float64: every operation is the ordinary one."""

    wide = False

    def __init__(self, xp):
        self.xp = xp

    def lift(self, a):
        return a

    def value(self, a):
        return a

    def shift(self, a, b):
        return a - b

    def add(self, a, b):
        return a + b

    def sub(self, a, b):
        return a - b

    def mul(self, a, b):
        return a * b

    def scale(self, a, c):
        """``a`` times a float or a plain array ``c``."""
        return a * c

    def div(self, a, c):
        return a / c

    def table(self, keys, weights, perm, take=None, ones=False):
        return prefix_table(self.xp, keys, weights, perm, take=take, ones=ones)

    def gather(self, table, index):
        return take_rows(self.xp, table, index)

    def combine(self, table, terms, columns, divisor=None, cache=None):
        """``sum_k weight_k * table[..., index_k, part_k, columns] / divisor`` (see ``combine_rows``).

        ``terms`` are ``(index, part, weight)`` with ``index`` (..., n) or ``None`` (the totals row)
        and ``weight`` a float or an array broadcastable to (..., n). ``1 / divisor`` (..., n) is
        folded into the weights, so the (n, columns) result is written once. Known: with a divisor
        floored at a tiny ``eps`` (1e-300) a hat's weights of ``1 / bandwidth`` times it overflow
        before the terms cancel (NaN; docs/changelog.rst).
        """
        weights = [w for _, _, w in terms]
        if divisor is not None:
            scale = 1.0 / divisor
            weights = [scale if is_one(w) else scale * w for w in weights]
        return combine_rows(self.xp, table, [t[0] for t in terms], [t[1] for t in terms], weights, columns,
                            cache=cache)


class Pair:
    """``hi + lo`` with ``|lo| <= ulp(hi) / 2``; indexing applies to both parts."""

    __slots__ = ("hi", "lo")

    def __init__(self, hi, lo):
        self.hi, self.lo = hi, lo

    def __getitem__(self, key):
        return Pair(self.hi[key], self.lo[key])

    @property
    def shape(self):
        return self.hi.shape

    @property
    def dtype(self):
        return self.hi.dtype


class DoubleFloat:
    """Double-float arithmetic on float32 :class:`Pair` values."""

    wide = True
    _SPLIT = 4097.0  # 2**12 + 1 splits a float32 significand into two 12-bit halves

    def __init__(self, xp):
        self.xp = xp

    # -- error-free transformations ----------------------------------------------------------
    _two_sum = staticmethod(two_sum)

    @staticmethod
    def _fast_two_sum(a, b):
        s = a + b
        return s, b - (s - a)

    def _split(self, a):
        c = self._SPLIT * a
        hi = c - (c - a)
        return hi, a - hi

    def _two_prod(self, a, b):
        p = a * b
        ah, al = self._split(a)
        bh, bl = self._split(b)
        return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl

    def _parts(self, a):
        return (a.hi, a.lo) if isinstance(a, Pair) else (a, None)

    def _new(self, hi, lo):
        return Pair(*self._fast_two_sum(hi, lo))

    # -- interface -----------------------------------------------------------------------------
    def lift(self, a):
        return self._new(a, self.xp.zeros_like(a))

    def hi(self, a):
        return self._parts(a)[0]

    def value(self, a):
        hi, lo = self._parts(a)
        return hi if lo is None else hi + lo

    def shift(self, a, b):
        """``a - b`` exactly, for plain arrays ``a`` and ``b``."""
        return self._new(*self._two_sum(a, -b))

    def add(self, a, b):
        ah, al = self._parts(a)
        bh, bl = self._parts(b)
        s, e = self._two_sum(ah, bh)
        if al is not None:
            e = e + al
        if bl is not None:
            e = e + bl
        return self._new(s, e)

    def sub(self, a, b):
        bh, bl = self._parts(b)
        return self.add(a, self._new(-bh, -bl) if bl is not None else -bh)

    def mul(self, a, b):
        ah, al = self._parts(a)
        bh, bl = self._parts(b)
        p, e = self._two_prod(ah, bh)
        if bl is not None:
            e = e + ah * bl
        if al is not None:
            e = e + al * bh
        return self._new(p, e)

    def scale(self, a, c):
        if isinstance(c, (int, float)):
            c = scalar(self.xp, c, dtype=self.hi(a).dtype, device=array_device(self.hi(a)))
        return self.mul(a, c)

    def div(self, a, c):
        """``a / c`` for a plain array ``c`` (one Newton correction of the float32 quotient)."""
        ah, al = self._parts(a)
        q = ah / c
        p, e = self._two_prod(q, c)
        r = (ah - p) - e
        if al is not None:
            r = r + al
        return self._new(q, r / c)

    def table(self, keys, weights, perm, take=None, ones=False):
        """Exclusive double-float prefix sums of ``[w, y w]``; ``keys`` is a pair, ``weights`` plain."""
        xp = self.xp
        kh, kl = self._parts(keys)
        w = sorted_weights(xp, weights, perm, kh.dtype, take=take, ones=ones)
        p, e = self._two_prod(kh[..., None], w)
        e = e + kl[..., None] * w
        hi = xp.concat([w, p], axis=-1)
        lo = xp.concat([xp.zeros_like(w), e], axis=-1)
        return self._new(*exclusive_scan(xp, self._add_pairs, (hi, lo)))

    def _add_pairs(self, a, b):
        """Double-float ``a + b`` of ``(hi, lo)`` tuples: the operator of the prefix-sum scan."""
        s, err = self._two_sum(a[0], b[0])
        return self._fast_two_sum(s, err + a[1] + b[1])

    def gather(self, table, index):
        hi, lo = self._parts(table)
        return self._new(take_rows(self.xp, hi, index), take_rows(self.xp, lo, index))

    def combine(self, table, terms, columns, divisor=None, cache=None):
        """:meth:`Plain.combine` in double-float: gathered rows times weights, summed, then divided."""
        c = self.hi(table).shape[-1] // 2
        cache = {} if cache is None else cache
        acc = None
        for index, part, weight in terms:
            if index is None:
                rows = table[..., -1:, :]
            else:
                rows = cache.get(id(index))
                if rows is None:
                    rows = cache[id(index)] = (index, self.gather(table, index))
                rows = rows[1]
            block = rows[..., part * c:(part + 1) * c][..., columns]
            if isinstance(weight, (int, float)):
                term = block if weight == 1 else self.scale(block, weight)
            else:
                term = self.mul(block, weight[..., None])
            acc = term if acc is None else self.add(acc, term)
        if divisor is not None:
            acc = self.div(acc, divisor[..., None])
        return acc
