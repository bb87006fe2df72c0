"""The scan engine's backward: vector-Jacobian products of profile sums by sort-scan.

For ``S = K w`` with ``K_ij = f(x_i - y_j)`` and cotangent ``g`` (docs/mathematics.rst, "The backward pass"):

* ``dx_i = sum_c g_ic sum_j f'(x_i - y_j) w_jc``: derivative sums over the forward sort of the keys;
* ``dw_j = sum_i f(x_i - y_j) g_i``: a kernel sum with the roles swapped (keys <- queries) and the
  reflected profile ``r -> f(-r)``, over one sort of the queries;
* ``dy_j = -sum_c w_jc sum_i f'(x_i - y_j) g_ic``: derivative sums of the reflected profile over
  that same sort of the queries;
* for an array knot ``t_m`` (a differentiable bandwidth): ``-c_m sum g P0[rank(x - t_m)]``, and for
  an array coefficient ``c_m`` the ReLU sum at that knot contracted with ``g``.

Every step is a sort-scan: ``O((n + m) log(n + m))`` per knot. At exact ties both ``dx`` and ``dy``
use ``f'(0^+)`` (``H(0) = 1``): the right derivative in a query, the left one in a key, exact for
self-sums where queries and keys are one set.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..._lib.namespace import array_device
from ...kernels import Profile, is_fixed
from .sums import knot_sums, profile_sums, queries, sort_keys
from .wide import arithmetic

__all__ = ["profiles_vjp", "knot_grads", "no_pairs_knot_grads", "indicator_sums", "column_range", "ColumnSums"]


def column_range(profile: Profile, c: int) -> range:
    cols = range(c)[profile.columns]
    if cols.step != 1:
        raise ValueError("profile columns must be a contiguous slice")
    return cols


class ColumnSums:
    """Gradients of column ranges of ``w`` (..., m, c), summed and assembled into one array at the end.

    Parts of the same range are added; the ranges are cut at every boundary and the pieces concatenated
    once (zeros where no range reaches), so that a part is never padded to the full width first.
    """

    def __init__(self, c: int):
        self.c = c
        self.parts: dict = {}

    def add(self, part, cols: range) -> None:
        key = (cols.start, cols.stop)
        self.parts[key] = part if key not in self.parts else self.parts[key] + part

    def assemble(self, xp):
        if list(self.parts) == [(0, self.c)]:
            return self.parts[(0, self.c)]
        cuts = sorted({0, self.c, *(b for key in self.parts for b in key)})
        like = next(iter(self.parts.values()))
        pieces = []
        for a, b in zip(cuts[:-1], cuts[1:]):
            piece = None
            for (start, stop), part in self.parts.items():
                if start <= a and b <= stop:
                    block = part[..., a - start:b - start]
                    piece = block if piece is None else piece + block
            if piece is None:
                piece = xp.zeros(like.shape[:-1] + (b - a,), dtype=like.dtype, device=array_device(like))
            pieces.append(piece)
        return pieces[0] if len(pieces) == 1 else xp.concat(pieces, axis=-1)


def profiles_vjp(x, y, w, profiles: Sequence[Profile], cotangents, *, xp, param_grads=True):
    """Pull cotangents of several profile sums of one ``(x, y, w)`` back to the inputs.

    Parameters
    ----------
    x : array, shape (..., n); y : array, shape (..., m); w : array, shape (..., m, c)
        As in the forward (finite, equal leading shapes; x and y in the work dtype).
    profiles : sequence of Profile
        Each summed over its column slice of ``w`` (``derivative=False``).
    cotangents : sequence of arrays, shapes (..., n, c_p)
        One per profile, in the work dtype.
    param_grads : bool
        Also return gradients for array knots and coefficients.

    Returns
    -------
    dx (..., n), dy (..., m), dw (..., m, c), and a list (one per profile) of
    ``(dknots, dcoeffs)`` tuples aligned with ``profile.knots`` / ``profile.coeffs`` (``None`` for
    float parameters), each of the batch shape.
    """
    work = x.dtype
    c = w.shape[-1]
    if x.shape[-1] == 0 or y.shape[-1] == 0:
        return _no_pairs_vjp(x, y, w, profiles, xp=xp, param_grads=param_grads)
    ar = arithmetic(xp, work)

    # dx: derivative sums over the forward sort of the keys.
    sk = sort_keys(y, w, xp=xp, ar=ar)
    xs = queries(x, sk, ar=ar)
    derivs = profile_sums(xs, sk, [p.with_(derivative=True) for p in profiles], xp=xp, ar=ar)
    dx = None
    for d, g in zip(derivs, cotangents):
        term = xp.sum(ar.value(d) * g, axis=-1)
        dx = term if dx is None else dx + term

    # dw and dy: one sort of the queries carrying every cotangent.
    stacked = xp.concat(list(cotangents), axis=-1)
    skx = sort_keys(x, stacked, xp=xp, ar=ar)
    ys = queries(y, skx, ar=ar)
    offsets, start = [], 0
    for g in cotangents:
        offsets.append(slice(start, start + g.shape[-1]))
        start += g.shape[-1]
    reflected = [p.reflect(columns=o) for p, o in zip(profiles, offsets)]
    # strict: a tie x_i = y_j + t_m counts on the query side, H(x_i - y_j - t_m) = H(0) = 1, the
    # convention dx uses too, so that in self-sums (x and y the same points) the two cancel.
    sums = profile_sums(ys, skx, reflected + [r.with_(derivative=True) for r in reflected], xp=xp, ar=ar,
                        strict=True)
    values, slopes = sums[:len(profiles)], sums[len(profiles):]
    dw, dy = ColumnSums(c), None
    for p, val, slope in zip(profiles, values, slopes):
        cols = column_range(p, c)
        dw.add(ar.value(val), cols)
        term = xp.sum(w[..., cols.start:cols.stop] * ar.value(slope), axis=-1)
        dy = term if dy is None else dy + term
    return dx, dy, dw.assemble(xp), knot_grads(sk, xs, profiles, cotangents, xp=xp, ar=ar, param_grads=param_grads)


def _no_pairs_vjp(x, y, w, profiles, *, xp, param_grads):
    """:func:`profiles_vjp` without queries or without keys: every sum is empty, every gradient 0.

    The forward returns zeros there without sorting (``_compose``); the sort-scan itself needs at
    least one query and one key (its searches and gathers have nothing to index).
    """
    dev = array_device(x)
    return (xp.zeros(x.shape, dtype=x.dtype, device=dev), xp.zeros(y.shape, dtype=y.dtype, device=dev),
            xp.zeros(w.shape, dtype=w.dtype, device=dev), no_pairs_knot_grads(x, profiles, xp=xp,
                                                                            param_grads=param_grads))


def no_pairs_knot_grads(x, profiles, *, xp, param_grads):
    """:func:`knot_grads` where there are no queries or no keys: zeros of the batch shape."""
    zero = xp.zeros(x.shape[:-1], dtype=x.dtype, device=array_device(x))
    params = []
    for p in profiles:
        none = not param_grads or all(is_fixed(a) for a in p.knots + p.coeffs)
        # ``zero * coeff``: the shape the sort-scan's ``-coeff * sum(...)`` has (per-head coefficients)
        params.append((tuple(None if none or is_fixed(t) else zero * a for t, a in zip(p.knots, p.coeffs)),
                       tuple(None if none or is_fixed(a) else zero for a in p.coeffs)))
    return params


def knot_grads(sk, xs, profiles, cotangents, *, xp, ar, param_grads):
    """``(dknots, dcoeffs)`` per profile for its array knots and coefficients (None for fixed ones).

    A knot's step sums count a tie ``x - y = t`` as the profile's ``strict_knots`` says, so that a
    parametric family's gradient is the one-sided derivative it documents.
    """
    params = []
    for p, g in zip(profiles, cotangents):
        dknots, dcoeffs = [], []
        for knot, coeff, strict in zip(p.knots, p.coeffs, p.strict_knots):
            if not param_grads or (is_fixed(knot) and is_fixed(coeff)):
                dknots.append(None)
                dcoeffs.append(None)
                continue
            relu, step, _ = knot_sums(sk, xs, knot, xp=xp, ar=ar, strict=strict)
            step = ar.value(step)[..., p.columns]
            relu = ar.value(relu)[..., p.columns]
            dknots.append(None if is_fixed(knot) else -coeff * xp.sum(xp.sum(g * step, axis=-1), axis=-1))
            dcoeffs.append(None if is_fixed(coeff) else xp.sum(xp.sum(g * relu, axis=-1), axis=-1))
        params.append((tuple(dknots), tuple(dcoeffs)))
    return params


def indicator_sums(q, k, ones, profiles, *, xp):
    """Profile sums over the valid-key indicator column ``ones`` (..., m, 1): one sort-scan."""
    ar = arithmetic(xp, q.dtype)
    sk = sort_keys(k, ones, xp=xp, ar=ar)
    return [ar.value(s) for s in profile_sums(queries(q, sk, ar=ar), sk, profiles, xp=xp, ar=ar, strict=True)]
