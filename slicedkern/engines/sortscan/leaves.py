"""The leaves of the causal divide and conquer (:mod:`slicedkern.engines._dyadic`): dense sums inside
blocks of a few positions.

docs/mathematics.rst, "Causal attention": the causal scan splits the positions into blocks of
``size`` (a small power of two); the pairs of a query and a key of the same block with the key at or
before the query are summed here, densely, ``O(n size c)`` work as a batch of (size, size) matrix
products, which is cheaper than sorting blocks of a few keys. Profiles are evaluated pointwise, with
the tie conventions of the sort-scan's backward (docs/mathematics.rst, "The backward pass"): ``H(0) =
1`` for the derivative in ``dx`` and ``dy``, and each knot's own ``strict_knots`` side for its
gradient.
"""

from __future__ import annotations

from ..._lib.namespace import array_device
from ...kernels import Profile, is_fixed

__all__ = ["blocks", "unblock", "leaf_sums", "leaf_vjp"]


def _lift(value):
    """A profile parameter broadcast against (..., blocks, size, size): floats stay floats."""
    return value if is_fixed(value) else value[..., None, None, None]


def blocks(xp, a, size: int, core: int):
    """(..., n, *core) -> (..., n / size, size, *core): the positions in blocks of ``size``."""
    lead = tuple(a.shape[:a.ndim - 1 - core])
    n = a.shape[a.ndim - 1 - core]
    return xp.reshape(a, lead + (n // size, size) + tuple(a.shape[a.ndim - core:]))


def unblock(xp, a, core: int):
    """(..., blocks, size, *core) -> (..., blocks * size, *core)."""
    lead = tuple(a.shape[:a.ndim - 2 - core])
    rows = a.shape[a.ndim - 2 - core] * a.shape[a.ndim - 1 - core]
    return xp.reshape(a, lead + (rows,) + tuple(a.shape[a.ndim - core:]))


def _differences(xp, x, y, size):
    """``r[..., b, i, j] = x_i - y_j`` within block ``b``, and the lower triangle ``j <= i``."""
    xb, yb = blocks(xp, x, size, 0), blocks(xp, y, size, 0)
    r = xb[..., :, None] - yb[..., None, :]
    idx = xp.arange(size, device=array_device(x))
    return r, idx[:, None] >= idx[None, :]


def _value(p: Profile, r, xp):
    out = _lift(p.intercept) + _lift(p.slope) * r
    for t, c in zip(p.knots, p.coeffs):
        out = out + _lift(c) * xp.clip(r - _lift(t), min=0.0)
    return out


def _derivative(p: Profile, r, xp):
    """``f'(r)`` with ``H(0) = 1`` at every knot (the right derivative)."""
    out = _lift(p.slope) + xp.zeros_like(r)
    for t, c in zip(p.knots, p.coeffs):
        out = out + _lift(c) * xp.astype(r >= _lift(t), r.dtype)
    return out


def leaf_sums(xp, x, y, w, profiles, size: int):
    """``S[..., p, :] = sum_{j <= p, same block} f(x_p - y_j) w_j`` for each profile, plain.

    x, y (..., n) on the positions (``n`` a multiple of ``size``), w (..., n, c) in the work dtype,
    zero on the keys that take no part; returns one (..., n, c_p) array per profile (its columns).
    """
    r, tri = _differences(xp, x, y, size)
    wb = blocks(xp, w, size, 1)
    zero = xp.zeros((), dtype=r.dtype, device=array_device(r))
    return [unblock(xp, xp.where(tri, _value(p, r, xp), zero) @ wb[..., p.columns], 1) for p in profiles]


def leaf_vjp(xp, x, y, w, profiles, cotangents, size: int, *, param_grads: bool):
    """The pull-back of :func:`leaf_sums`: ``(dx, dy, dw, [(dknots, dcoeffs)] per profile)``.

    With ``A_ij = g_i . w_j`` on the visible pairs: ``dx_i = sum_j f'(r_ij) A_ij``, ``dy_j = -sum_i
    f'(r_ij) A_ij``, ``dw_j = sum_i f(r_ij) g_i``, and for an array knot ``t_m`` / coefficient ``c_m``
    ``-c_m sum H(r - t_m) A`` / ``sum ReLU(r - t_m) A`` (docs/mathematics.rst, "The backward pass").
    """
    r, tri = _differences(xp, x, y, size)
    wb = blocks(xp, w, size, 1)
    zero = xp.zeros((), dtype=r.dtype, device=array_device(r))
    c = w.shape[-1]
    dx = dy = None
    dw = xp.zeros(wb.shape, dtype=r.dtype, device=array_device(r))
    params = []
    for p, g in zip(profiles, cotangents):
        cols = range(c)[p.columns]
        gb = blocks(xp, g, size, 1)
        a = xp.where(tri, gb @ xp.matrix_transpose(wb[..., cols.start:cols.stop]), zero)
        da = _derivative(p, r, xp) * a
        dx = xp.sum(da, axis=-1) if dx is None else dx + xp.sum(da, axis=-1)
        dy = -xp.sum(da, axis=-2) if dy is None else dy - xp.sum(da, axis=-2)
        part = xp.matrix_transpose(xp.where(tri, _value(p, r, xp), zero)) @ gb
        pieces = [dw[..., :cols.start], dw[..., cols.start:cols.stop] + part, dw[..., cols.stop:]]
        dw = xp.concat(pieces, axis=-1)
        dknots, dcoeffs = [], []
        for t, coeff, strict in zip(p.knots, p.coeffs, p.strict_knots):
            if not param_grads or (is_fixed(t) and is_fixed(coeff)):
                dknots.append(None)
                dcoeffs.append(None)
                continue
            shifted = r - _lift(t)
            step = xp.astype(shifted > 0 if strict else shifted >= 0, r.dtype)
            dknots.append(None if is_fixed(t) else -coeff * xp.sum(step * a, axis=(-3, -2, -1)))
            dcoeffs.append(None if is_fixed(coeff) else xp.sum(xp.clip(shifted, min=0.0) * a, axis=(-3, -2, -1)))
        params.append((tuple(dknots), tuple(dcoeffs)))
    return unblock(xp, dx, 0), unblock(xp, dy, 0), unblock(xp, dw, 1), params
