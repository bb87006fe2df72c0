"""The slice plans of the two-sample statistics (:mod:`slicedkern.sliced.stats`).

Forward: each chunk of slices evaluates the exact 1-D statistic of the projected samples
(``_exact1d``, ``_exact1d_mmd``: relative error ~1e-16, docs/mathematics.rst, "Exact 1-D
statistics"). Pullback: the same statistic written as one sort-scan :func:`slicedkern.kernel_sum`
per chunk on the pooled sample ``z = [x, y]`` with weight columns that pick the within- and
between-sample sums, pulled back by :func:`slicedkern.vjp` (docs/mathematics.rst, "MMD and energy
distance").
"""

from __future__ import annotations

from .._lib.namespace import as_work
from .._validate import Setting
from ..backends import quiet
from ..kernels import Abs
from ..ops import kernel_sum
from ._exact1d import energy_distance_1d
from ._exact1d_mmd import mmd_1d
from .plan import Samples, SlicePlan, broadcast, chunk_for, lift, project, unproject

__all__ = ["EnergyPlan", "MMDPlan"]


class _PooledPlan(SlicePlan):
    """A statistic of the pooled sample ``z``: ``z`` itself when exact, else its projections.

    ``theta`` None means exact 1-D samples (one "slice", scale 1); otherwise the sum over slices is
    scaled by ``weight / P``. ``samples``: ``xs`` (..., n) or (..., n, d) and ``ys`` in the work
    dtype, not broadcast, and their batch shape. ``per_point`` bounds the elements a slice works on,
    per pooled point and batch element, for the default chunk.
    """

    def __init__(self, setting: Setting, samples: Samples, theta, *, squeeze, per_point, weight, chunk_size):
        xp, device, out_dtype, work = setting
        xs, ys, batch = samples
        self.exact = theta is None
        n, m = (xs.shape[-1], ys.shape[-1]) if self.exact else (xs.shape[-2], ys.shape[-2])
        if self.exact:
            theta, chunk, scale = xp.ones((1, 1), dtype=work, device=device), 1, 1.0
        else:
            size = 1
            for s in batch:
                size *= s
            chunk = chunk_for(chunk_size, theta.shape[0], size * (n + m) * per_point)
            scale = weight / theta.shape[0]
        super().__init__(xp, theta, chunk, scale, out_dtype)
        self.xs, self.ys, self.n, self.m, self.squeeze = xs, ys, n, m, squeeze
        self.batch, self.device = tuple(batch), device
        self._z = None

    @property
    def z(self):
        """The pooled sample ``[x, y]`` broadcast to the batch (built when the pullback needs it)."""
        if self._z is None:
            core = 1 if self.exact else 2
            self._z = self.xp.concat([broadcast(self.xp, self.xs, self.batch, core),
                                      broadcast(self.xp, self.ys, self.batch, core)], axis=-core)
        return self._z

    def samples(self, theta):
        """The chunk's 1-D samples: ``x`` (..., [P_chunk,] n) and ``y``, and the batch of their rows."""
        if self.exact:
            return self.xs, self.ys, self.batch
        return (project(self.xp, self.xs, theta), project(self.xp, self.ys, theta),
                self.batch + (theta.shape[0],))

    def points(self, theta):
        """The pooled sample as the chunk's 1-D points: (..., [P_chunk,] N)."""
        return self.z if self.exact else project(self.xp, self.z, theta)

    def back(self, theta, grads):
        dzp = grads[0] + grads[1]                            # z is both the queries and the keys
        return {"z": dzp if self.exact else unproject(self.xp, dzp, theta)}

    def over_slices(self, total):
        """Sum a (..., [P_chunk]) contribution over the chunk's slices."""
        return total if self.exact else self.xp.sum(total, axis=-1)

    def arguments(self, grads):
        dz, n = grads["z"], self.n
        out = {"x": dz[..., :n] if self.exact else dz[..., :n, :],
               "y": dz[..., n:] if self.exact else dz[..., n:, :]}
        return {k: v[..., None] for k, v in out.items()} if self.squeeze else out


class EnergyPlan(_PooledPlan):
    """``-sum_ij u_i u_j |z_i - z_j|`` with the signed weights ``u = [a, -b]`` (shared by the slices).

    ``weights``: the probability weights ``a`` (..., n) and ``b`` (..., m); ``raw``: the weights as
    given, ``{"x_weights": ..., "y_weights": ...}`` (each None when not given).
    """

    def __init__(self, setting: Setting, samples: Samples, theta, weights: tuple, raw: dict, **kw):
        super().__init__(setting, samples, theta, **kw)
        self.a, self.b = weights
        xp, work = setting.xp, self.work_dtype
        self.raw = raw
        self.raw_work = {k: None if w is None else as_work(xp, w, work) for k, w in self.raw.items()}
        self._u = None

    @property
    def u(self):
        if self._u is None:
            xp = self.xp
            u = xp.concat([broadcast(xp, self.a, self.batch, 1), -broadcast(xp, self.b, self.batch, 1)], axis=-1)
            self._u = u if self.exact else u[..., None, :]  # (..., [1,] N)
        return self._u

    def value(self, theta):
        x, y, batch = self.samples(theta)
        a, b = self.raw_work["x_weights"], self.raw_work["y_weights"]
        if not self.exact:                                  # one weight row for every slice
            a, b = (None if w is None else w[..., None, :] for w in (a, b))
        with quiet(self.xp):            # a row with an infinite value passes inf - inf on its way to NaN
            ed = energy_distance_1d(self.xp, x, y, a, b, batch=batch, device=self.device, work=self.work_dtype)
        return self.over_slices(ed)

    def inner(self, theta):
        zp = self.points(theta)
        return kernel_sum, (zp, zp, self.u), {"kernel": Abs()}

    def back(self, theta, grads):
        du = grads[2] if self.exact else self.xp.sum(grads[2], axis=-2)
        return {**super().back(theta, grads), "u": du}

    def reduce(self, theta, s):
        return self.over_slices(-self.xp.sum(self.u * s, axis=-1))

    def reduce_vjp(self, theta, s, g):
        gg = g[..., None] if self.exact else g[..., None, None]
        direct = -s * gg
        du = direct if self.exact else self.xp.sum(direct, axis=-2)
        return self.xp.broadcast_to(-self.u * gg, s.shape), {"u": du}

    def arguments(self, grads):
        out = super().arguments(grads)
        du = grads["u"]
        return {**out, **weight_gradients(self.xp, self.raw_work, du[..., :self.n], -du[..., self.n:])}


def weight_gradients(xp, raw, ga, gb) -> dict:
    """Gradients of the raw weights from those ``ga``, ``gb`` of the probability weights, through
    the normalisation ``p = raw / sum(raw)``: ``(G_i - sum_l p_l G_l) / sum(raw)``."""
    out = {}
    for name, part in (("x_weights", ga), ("y_weights", gb)):
        w = raw[name]
        if w is not None:
            total = xp.sum(w, axis=-1, keepdims=True)
            out[name] = (part - xp.sum(part * (w / total), axis=-1, keepdims=True)) / total
    return out


class MMDPlan(_PooledPlan):
    """``coef . [sum_xx, sum_xy, sum_yy] + shift`` from the pooled sums with membership columns."""

    def __init__(self, setting: Setting, samples: Samples, theta, *, kernel, estimator, coef, shift, **kw):
        super().__init__(setting, samples, theta, **kw)
        self.kernel, self.estimator, self.coef, self.shift = kernel, estimator, coef, shift
        self._member = None

    @property
    def member(self):
        """Membership columns (1.., N, 2): [in x, in y]."""
        if self._member is None:
            xp, n, m, work, device = self.xp, self.n, self.m, self.work_dtype, self.device
            ones = xp.ones((n,), dtype=work, device=device), xp.ones((m,), dtype=work, device=device)
            zeros = xp.zeros((n,), dtype=work, device=device), xp.zeros((m,), dtype=work, device=device)
            member = xp.stack([xp.concat([ones[0], zeros[1]]), xp.concat([zeros[0], ones[1]])], axis=-1)
            member = lift(xp, member, 2, len(self.batch))
            self._member = member if self.exact else member[..., None, :, :]
        return self._member

    def value(self, theta):
        x, y, batch = self.samples(theta)
        with quiet(self.xp):
            out = mmd_1d(self.xp, x, y, self.kernel, self.estimator, batch=batch, device=self.device,
                         work=self.work_dtype)
        count = 1 if self.exact else theta.shape[0]
        return self.over_slices(out) - count * self.shift           # mmd_1d includes the shift

    def inner(self, theta):
        zp = self.points(theta)
        return kernel_sum, (zp, zp, self.member), {"kernel": self.kernel}

    def reduce(self, theta, s):
        xp, n, coef = self.xp, self.n, self.coef
        total = (coef[0] * xp.sum(s[..., :n, 0], axis=-1) + coef[1] * xp.sum(s[..., :n, 1], axis=-1)
                 + coef[2] * xp.sum(s[..., n:, 1], axis=-1))
        return self.over_slices(total)

    def reduce_vjp(self, theta, s, g):
        xp, n, m, coef = self.xp, self.n, self.m, self.coef
        work, device = self.work_dtype, self.device
        gg = g[..., None, None] if self.exact else g[..., None, None, None]
        weights = xp.concat([xp.stack([xp.full((n,), coef[0], dtype=work, device=device),
                                       xp.full((n,), coef[1], dtype=work, device=device)], axis=-1),
                             xp.stack([xp.zeros((m,), dtype=work, device=device),
                                       xp.full((m,), coef[2], dtype=work, device=device)], axis=-1)],
                            axis=0)
        return xp.broadcast_to(weights * gg, s.shape), {}

    def finish(self, total):
        return total + self.shift
