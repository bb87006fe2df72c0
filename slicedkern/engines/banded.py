"""Banded (sliding-window) attention as an engine wrapper: sums over a band as differences of causal sums.

docs/mathematics.rst, "Windows": with ``window = (left, right)`` query ``i`` of ``Lq``, aligned with
the key ``p_i = i + Lk - Lq``, sees the keys ``p_i - left <= j <= p_i + right`` (``-1``: that side
unbounded; ``causal`` caps ``right`` at 0). Every sum attention combines is linear in the set of
keys, so over the band ``(lo_i, hi_i]`` it is the causal sum over the keys ``j <= hi_i`` less the one
over ``j <= lo_i``, both *aligned* sums ``T_c(i) = sum_{j <= i + c}`` with a constant offset ``c``:

* ``T_c`` is the wrapped engine's causal attention (no normaliser, no centring: the plain profile
  sum) on the queries and keys with ``c - (Lk - Lq)`` zero-weight keys appended (``c`` larger) or as
  many placeholder queries appended (``c`` smaller), which moves the bottom-right alignment by the
  difference and changes no sum;
* an unbounded right side is the non-causal sum over all keys, an unbounded left side nothing;
* the counts and value sums for the centring and the count normaliser, and the NaN rule (a
  non-finite key makes NaN the queries whose band holds it), are the same differences of running
  sums (:class:`Band`), and the output is :func:`._combine.combine` of the band's sums, as for every
  engine.

The backward is the generic one over the band (:func:`._vjp.seen_bwd`), whose profile-sum pull-back
is the difference of the two aligned causal pull-backs. Each term is exact; the difference cancels
the keys left of the band, so its rounding is that of the causal sum up to ``hi``, not of the band
alone (float64 work keeps it at ``2^-52`` of those sums).
"""

from __future__ import annotations

from .._lib.causal import key_offset
from .._lib.namespace import array_device, scalar
from .._spec import Normalizer
from ._base import Engine
from ._causal_grid import running_sum, screen_causal
from ._combine import combine
from ._vjp import Form, Inputs, add_params, seen_bwd
from .sortscan.wide import Plain

__all__ = ["Band", "BandedEngine", "band_bounds"]

#: the plain profile sum: no normaliser, no centring
_PLAIN = Normalizer(None)


def band_bounds(window, causal: bool) -> tuple[int, int]:
    """``(left, right)`` with causality folded in: ``right`` at most 0 when ``causal`` (``-1``:
    unbounded, so causal makes it 0)."""
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0 if right == -1 else min(right, 0)
    return left, right


class Band:
    """Which keys the queries of a banded call see, as two aligned offsets (see the module docstring).

    Query ``i`` sees the keys ``lo + i < j <= hi + i``; ``hi`` None: every key to the end; ``lo``
    None: every key from the start.
    """

    def __init__(self, lq: int, lk: int, left: int, right: int):
        self.lq, self.lk = lq, lk
        #: no query sees a key: the band is empty (``p - left > p + right``) or there is no pair
        self.empty = lq == 0 or lk == 0 or (left != -1 and right != -1 and right < -left)
        base = key_offset(lq, lk)
        # a side every query's band passes is no bound at all
        self.hi = None if right == -1 or base + right >= lk - 1 else base + right
        self.lo = None if left == -1 or base - left - 1 + lq - 1 < 0 else base - left - 1

    def _read(self, xp, running, offset):
        """``running`` (..., lk, c), an inclusive running sum over the keys, read at ``i + offset``
        for every query (0 before the first key, the total past the last): (..., lq, c)."""
        zero = xp.zeros(tuple(running.shape[:-2]) + (1, running.shape[-1]), dtype=running.dtype,
                        device=array_device(running))
        padded = xp.concat([zero, running], axis=-2)
        index = xp.clip(xp.arange(self.lq, device=array_device(running)) + (offset + 1), 0, self.lk)
        return xp.take(padded, index, axis=-2)

    def _read_adjoint(self, xp, rows, offset):
        """The adjoint of :meth:`_read` composed with the running sum: key ``j`` gets the rows of
        every query with ``i + offset >= j``: (..., lk, c)."""
        after = running_sum(xp, rows, axis=-2, reverse=True)
        zero = xp.zeros(tuple(rows.shape[:-2]) + (1, rows.shape[-1]), dtype=rows.dtype, device=array_device(rows))
        padded = xp.concat([after, zero], axis=-2)
        index = xp.clip(xp.arange(self.lk, device=array_device(rows)) - offset, 0, self.lq)
        return xp.take(padded, index, axis=-2)

    def seen_sums(self, xp, a, dtype):
        """Per-key rows ``a`` (..., lk, c) summed over the keys each query sees: (..., lq, c)."""
        running = running_sum(xp, a, axis=-2, dtype=dtype)
        if self.hi is None:
            total = xp.sum(a, axis=-2, keepdims=True, dtype=dtype)
            out = xp.broadcast_to(total, tuple(a.shape[:-2]) + (self.lq, a.shape[-1]))
        else:
            out = self._read(xp, running, self.hi)
        return out if self.lo is None else out - self._read(xp, running, self.lo)

    def seen_sums_adjoint(self, xp, rows):
        """The adjoint of :meth:`seen_sums` on per-query ``rows`` (..., lq, c): (..., lk, c)."""
        if self.hi is None:
            total = xp.sum(rows, axis=-2, keepdims=True)
            out = xp.broadcast_to(total, tuple(rows.shape[:-2]) + (self.lk, rows.shape[-1]))
        else:
            out = self._read_adjoint(xp, rows, self.hi)
        return out if self.lo is None else out - self._read_adjoint(xp, rows, self.lo)

    def sees_any(self, xp, flags):
        """(..., lq) bool: whether each query's band holds a key whose ``flags`` is True."""
        counts = self.seen_sums(xp, xp.astype(flags, xp.int32)[..., None], xp.int32)
        return counts[..., 0] > 0


def _pad(xp, a, count: int, axis: int):
    """``a`` with ``count`` zeros appended along ``axis`` (negative)."""
    if count == 0:
        return a
    shape = list(a.shape)
    shape[axis] = count
    return xp.concat([a, xp.zeros(tuple(shape), dtype=a.dtype, device=array_device(a))], axis=axis)


class BandedEngine(Engine):
    """``inner`` run over a band of keys per query (see the module docstring)."""

    def __init__(self, inner: Engine, left: int, right: int):
        self.inner, self.left, self.right = inner, left, right
        self.supports_causal = True
        self.traceable = inner.traceable

    @property
    def name(self) -> str:
        return self.inner.name

    def decline(self, spec, arrays, backend):
        if not self.inner.supports_causal:
            return (f"the {self.name!r} engine has no causal mode, which windowed attention is made of; "
                    "use engine='scan' or 'sweep'")
        reason = self.inner.decline(spec, arrays, backend)
        if reason is None and not self.inner.traceable and backend.operator_device(arrays[0]) is not None:
            reason = (f"windowed attention does not run the {self.name!r} engine under torch.compile; "
                      "use engine='scan'")
        return reason

    def automatic(self, arrays) -> bool:
        return self.inner.automatic(arrays)

    # -- the aligned sums ------------------------------------------------------------------------
    def _aligned(self, xp, x, y, w, profile, offset: int):
        """``T_offset``: per query ``i``, ``sum_{j <= i + offset} f(x_i - y_j) w_j``, (..., lq, c)."""
        lq, lk = x.shape[-1], y.shape[-1]
        shift = offset - key_offset(lq, lk)
        y, w = _pad(xp, y, max(shift, 0), -1), _pad(xp, w, max(shift, 0), -2)
        x = _pad(xp, x, max(-shift, 0), -1)
        out, _ = self.inner.causal_attention(Inputs(x, y, w, None), Form(profile, _PLAIN, False), xp=xp)
        return out[..., :lq, :]

    def _aligned_vjp(self, xp, x, y, w, profiles, cotangents, offset: int, param_grads: bool):
        lq, lk = x.shape[-1], y.shape[-1]
        shift = offset - key_offset(lq, lk)
        yp, wp = _pad(xp, y, max(shift, 0), -1), _pad(xp, w, max(shift, 0), -2)
        xp_ = _pad(xp, x, max(-shift, 0), -1)
        cots = [_pad(xp, g, max(-shift, 0), -2) for g in cotangents]
        dx, dy, dw, params = self.inner.causal_profiles_vjp(xp_, yp, wp, profiles, cots, xp=xp,
                                                            param_grads=param_grads)
        return dx[..., :lq], dy[..., :lk], dw[..., :lk, :], params

    def band_sums(self, xp, band: Band, x, y, w, profile):
        """The profile sums over each query's band: (..., lq, c), the work dtype."""
        if band.hi is None:
            out = self.inner.kernel_sum(x, y, w, profile, xp=xp)
        else:
            out = self._aligned(xp, x, y, w, profile, band.hi)
        return out if band.lo is None else out - self._aligned(xp, x, y, w, profile, band.lo)

    def band_profiles_vjp(self, band: Band):
        """``profiles_vjp(x, y, w, profiles, cotangents, *, xp, param_grads)`` over the band."""
        def profiles_vjp(x, y, w, profiles, cotangents, *, xp, param_grads=True):
            if band.hi is None:
                dx, dy, dw, params = self.inner.profiles_vjp(x, y, w, profiles, cotangents, xp=xp,
                                                             param_grads=param_grads)
            else:
                dx, dy, dw, params = self._aligned_vjp(xp, x, y, w, profiles, cotangents, band.hi, param_grads)
            if band.lo is None:
                return dx, dy, dw, params
            lx, ly, lw, lparams = self._aligned_vjp(xp, x, y, w, profiles, [-g for g in cotangents], band.lo,
                                                    param_grads)
            return dx + lx, dy + ly, dw + lw, add_params(params, lparams)
        return profiles_vjp

    # -- the primitives the base class calls -----------------------------------------------------
    def _band(self, inputs):
        return Band(inputs.q.shape[-1], inputs.k.shape[-1], self.left, self.right)

    @staticmethod
    def _nothing_seen(xp, inputs):
        """The inputs with every key masked: what an empty band leaves each query (zero rows, NaN
        for a non-finite query)."""
        none = xp.zeros(tuple(inputs.k.shape), dtype=xp.bool, device=array_device(inputs.k))
        return inputs._replace(key_mask=none)

    def attention(self, inputs, form, *, xp, for_backward=False):
        return self._banded(inputs, form, xp=xp)

    def causal_attention(self, inputs, form, *, xp):
        return self._banded(inputs, form, xp=xp)

    def _banded(self, inputs, form, *, xp):
        (q, k, v, key_mask), (profile, normalizer, center) = inputs, form
        band = self._band(inputs)
        if band.empty:
            return self.inner.attention(self._nothing_seen(xp, inputs), form, xp=xp)
        work, dv = q.dtype, v.shape[-1]
        sc = screen_causal(xp, band, q, k, v, key_mask)
        takef = xp.astype(sc.take, work)[..., None]
        # [v | 1] over the valid keys, in the work dtype: the two aligned sums must not round apart
        weights = xp.concat([xp.astype(sc.v, work), takef], axis=-1)
        num_r = self.band_sums(xp, band, sc.q, sc.k, weights, profile)
        den = (self.band_sums(xp, band, sc.q, sc.k, takef, normalizer.profile) if normalizer.summed else None)
        seen = band.seen_sums(xp, weights, work)
        out, relu_count, den = combine(xp, Plain(xp), num_r, den, seen, sc.good, center=center,
                                       normalizer=normalizer, dv=dv)
        # a query whose band holds no key gets 0 (the documented rule): its sums are differences
        # of two causal sums that agree up to rounding, not exact zeros (tests/fuzz/test_fuzz_segments.py)
        sees = (seen[..., dv:dv + 1] > 0) | ~sc.good[..., None]
        out = xp.where(sees, out, scalar(xp, 0.0, dtype=out.dtype, device=array_device(out)))
        return out, (sc.take, relu_count) + ((den,) if den is not None else ())

    def attention_vjp(self, inputs, form, g, out, residuals, *, xp):
        return self._banded_vjp(inputs, form, g, out, residuals, xp=xp)

    def causal_attention_vjp(self, inputs, form, g, out, residuals, *, xp):
        return self._banded_vjp(inputs, form, g, out, residuals, xp=xp)

    def _banded_vjp(self, inputs, form, g, out, residuals, *, xp):
        band = self._band(inputs)
        if band.empty:
            return self.inner.attention_vjp(self._nothing_seen(xp, inputs), form, g, out, residuals, xp=xp)
        return seen_bwd(self.band_profiles_vjp(band), band, inputs, form, g, out, self.aux_of(residuals), xp=xp)

    def __repr__(self):
        return f"<slicedkern engine {self.name!r} over a window ({self.left}, {self.right})>"
