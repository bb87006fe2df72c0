"""The exact statistics in R^d, blockwise: the dense O((n + m)^2 d) sums without n m memory.

``method="exact"`` of :func:`slicedkern.sliced.energy_distance` and :func:`slicedkern.sliced.mmd`:
the limit of the sliced estimates as the number of directions grows (docs/mathematics.rst, "Exact
statistics in R^d"). The energy distance uses Euclidean distances (``E_theta |<theta, z>| / kappa_d
= |z|``); the MMD the radial profile ``Phi`` of the sliced kernel (:func:`radial_profile`), so that
``K(a, b) = Phi(|a - b|)``. The pair sums run over row blocks of the first sample, each block
(..., B, m) within :data:`BLOCK_PAIRS` pairs; distances are taken
from coordinate differences (not ``|a|^2 + |b|^2 - 2 a.b``, which cancels for close points).

NumPy arrays and CPU torch tensors that record no gradient sum the energy distance's pairs in
compiled code instead (``slicedkern/backends/_pairs.py``: the same coordinate differences, each
unordered within-sample pair once, about 3 ns a pair); the blockwise sums below serve every other
case (gradients, JAX, GPUs, array-api-strict) and the pullbacks.

A plan here has the interface :func:`slicedkern.vjp` expects of a composite op (``forward``,
``pullback``); the energy distance is written with array operations (torch autograd and
``jax.grad`` differentiate it), the MMD evaluates ``Phi`` on the host (values and
:func:`slicedkern.vjp` only).
"""

from __future__ import annotations

import math

from .._lib.typing import Array
from .._validate import Setting
from ..backends import energy_distance_pairs, to_host
from ._stat_plans import weight_gradients
from .plan import Samples, broadcast
from .radial import radial_profile

__all__ = ["DenseEnergyPlan", "DenseMMDPlan", "dense_cost"]


def dense_cost(n: int, m: int, dim: int, *, compiled: bool = False) -> float:
    """Work of the dense statistic, in units of one coordinate difference: the pairs summed times
    ``d`` plus the root, weight and sum of a pair. The blockwise sums visit every ordered pair of
    ``xx``, ``xy`` and ``yy`` (``n^2 + nm + m^2``), at ``d + 3`` units a pair; the compiled ones each
    unordered within-sample pair once (``nm + (n^2 + m^2) / 2``), at ``d + 5`` (their vectorised
    differences are cheap next to the root: measured 0.15 (d + 5) ns a pair on one thread)."""
    if compiled:
        return float(n * m + (n * n + m * m) / 2) * (dim + 5)
    return float(n * n + n * m + m * m) * (dim + 3)


#: Pairs per block: the (..., B, m) temporaries stay in the cache (the sums are memory-bound).
BLOCK_PAIRS = 2 ** 16


def _distances(xp, p, q):
    """``|p_i - q_j|`` (..., B, m) of a block ``p`` (..., B, d) and ``q`` (..., m, d) from the
    coordinate differences (one coordinate at a time: no (B, m, d) temporary), and whether it is
    positive."""
    r2 = None
    for k in range(p.shape[-1]):
        diff = p[..., :, k, None] - q[..., None, :, k]
        r2 = diff * diff if r2 is None else r2 + diff * diff
    pos = r2 > 0
    # 0 for coincident points (no infinite slope of the root), NaN for a pair with a NaN coordinate
    r = xp.where(pos, xp.sqrt(xp.where(pos, r2, xp.ones_like(r2))), xp.where(r2 == 0, xp.zeros_like(r2), r2))
    return r, pos


class _DensePlan:
    """Sums ``sum_ij wp_i wq_j Phi(|p_i - q_j|)`` over the pairs of (x, x), (x, y), (y, y) blockwise,
    for the radial function ``phi`` and its derivative ``dphi`` (arrays of distances to arrays)."""

    def __init__(self, setting: Setting, samples: Samples, *, phi, dphi):
        xp, device, out_dtype, work = setting
        xs, ys, batch = samples
        self.xp, self.work_dtype, self.out_dtype, self.device = xp, work, out_dtype, device
        self.phi, self.dphi = phi, dphi
        self.batch = tuple(batch)
        self.xs, self.ys = broadcast(xp, xs, self.batch, 2), broadcast(xp, ys, self.batch, 2)
        self.n, self.m, self.dim = xs.shape[-2], ys.shape[-2], xs.shape[-1]

    def _block(self, q_len: int) -> int:
        per_row = math.prod(self.batch) * q_len
        return max(1, BLOCK_PAIRS // max(per_row, 1))

    def pair_sum(self, p, wp, q, wq):
        """``sum_ij wp_i wq_j phi(|p_i - q_j|)``, shape ``batch``; ``wp`` (..., n), ``wq`` (..., m)."""
        xp, total = self.xp, None
        step = self._block(q.shape[-2])
        for start in range(0, p.shape[-2], step):
            stop = min(start + step, p.shape[-2])
            r, _ = _distances(xp, p[..., start:stop, :], q)
            inner = xp.sum(self.phi(r) * wq[..., None, :], axis=-1)
            part = xp.sum(wp[..., start:stop] * inner, axis=-1)
            total = part if total is None else total + part
        return total

    def pair_sum_vjp(self, p, wp, q, wq, g):
        """Gradients of ``g * pair_sum(p, wp, q, wq)`` for ``p``, ``wp``, ``q``, ``wq``."""
        xp = self.xp
        dp_parts, dwp_parts, dq, dwq = [], [], None, None
        step = self._block(q.shape[-2])
        gg = g[..., None, None]
        for start in range(0, p.shape[-2], step):
            stop = min(start + step, p.shape[-2])
            block = p[..., start:stop, :]
            r, pos = _distances(xp, block, q)
            w = wp[..., start:stop, None] * wq[..., None, :] * gg                 # (..., B, m)
            slope = w * xp.where(pos, self.dphi(r) / xp.where(pos, r, xp.ones_like(r)), xp.zeros_like(r))
            # d phi(|p_i - q_j|) / d p_i = phi'(r) (p_i - q_j) / r, one coordinate at a time
            pull = [slope * (block[..., :, k, None] - q[..., None, :, k]) for k in range(self.dim)]
            dp_parts.append(xp.stack([xp.sum(c, axis=-1) for c in pull], axis=-1))
            value = self.phi(r)
            dwp_parts.append(xp.sum(value * wq[..., None, :], axis=-1) * g[..., None])
            dq_part = -xp.stack([xp.sum(c, axis=-2) for c in pull], axis=-1)
            dwq_part = xp.sum(value * wp[..., start:stop, None], axis=-2) * g[..., None]
            dq = dq_part if dq is None else dq + dq_part
            dwq = dwq_part if dwq is None else dwq + dwq_part
        return xp.concat(dp_parts, axis=-2), xp.concat(dwp_parts, axis=-1), dq, dwq


class DenseEnergyPlan(_DensePlan):
    """``2 sum a_i b_j |x_i - y_j| - sum a_i a_k |x_i - x_k| - sum b_j b_l |y_j - y_l|``."""

    method = "exact"

    def __init__(self, setting: Setting, samples: Samples, weights: tuple, *, raw: dict):
        xp = setting.xp
        super().__init__(setting, samples, phi=lambda r: r, dphi=xp.ones_like)
        (a, b), self.raw = weights, raw
        self.a, self.b = broadcast(xp, a, self.batch, 1), broadcast(xp, b, self.batch, 1)

    def forward(self) -> Array:
        xs, ys, a, b = self.xs, self.ys, self.a, self.b
        # host-readable float64 arrays outside autograd: the compiled pair sums (same arithmetic)
        out = energy_distance_pairs(self.xp, xs, ys, a, b, self.batch)
        if out is None:
            out = 2.0 * self.pair_sum(xs, a, ys, b) - self.pair_sum(xs, a, xs, a) - self.pair_sum(ys, b, ys, b)
        return self.xp.astype(out, self.out_dtype)

    def pullback(self, g) -> dict:
        xs, ys, a, b = self.xs, self.ys, self.a, self.b
        dx1, da1, dy1, db1 = self.pair_sum_vjp(xs, a, ys, b, 2.0 * g)
        dx2, da2, dx3, da3 = self.pair_sum_vjp(xs, a, xs, a, -g)
        dy2, db2, dy3, db3 = self.pair_sum_vjp(ys, b, ys, b, -g)
        grads = {"x": dx1 + dx2 + dx3, "y": dy1 + dy2 + dy3}
        return {**grads, **weight_gradients(self.xp, self.raw, da1 + da2 + da3, db1 + db2 + db3)}


class DenseMMDPlan(_DensePlan):
    """``coef . [sum_xx, sum_xy, sum_yy] Phi + shift`` with the radial profile ``Phi``."""

    method = "exact"

    def __init__(self, setting: Setting, samples: Samples, *, kernel, coef, shift):
        xp = setting.xp
        self.profile = radial_profile(kernel, samples.xs.shape[-1])
        super().__init__(setting, samples, phi=self.profile, dphi=self._derivative)
        self.coef, self.shift = coef, shift
        ones = xp.ones((self.n,), dtype=self.work_dtype, device=self.device)
        self.ones_x = broadcast(xp, ones, self.batch, 1)
        self.ones_y = broadcast(xp, xp.ones((self.m,), dtype=self.work_dtype, device=self.device), self.batch, 1)

    def _derivative(self, r):
        # the radial profile is evaluated on the host (module docstring)
        return self.xp.asarray(self.profile.derivative(to_host(r)), dtype=self.work_dtype, device=self.device)

    def forward(self) -> Array:
        xs, ys, ox, oy, c = self.xs, self.ys, self.ones_x, self.ones_y, self.coef
        out = (c[0] * self.pair_sum(xs, ox, xs, ox) + c[1] * self.pair_sum(xs, ox, ys, oy)
               + c[2] * self.pair_sum(ys, oy, ys, oy) + self.shift)
        return self.xp.astype(out, self.out_dtype)

    def pullback(self, g) -> dict:
        xs, ys, ox, oy, c = self.xs, self.ys, self.ones_x, self.ones_y, self.coef
        dx1, _, dx2, _ = self.pair_sum_vjp(xs, ox, xs, ox, c[0] * g)
        dx3, _, dy1, _ = self.pair_sum_vjp(xs, ox, ys, oy, c[1] * g)
        dy2, _, dy3, _ = self.pair_sum_vjp(ys, oy, ys, oy, c[2] * g)
        return {"x": dx1 + dx2 + dx3, "y": dy1 + dy2 + dy3}
