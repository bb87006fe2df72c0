"""The exact 1-D MMD of a piecewise-linear profile, as integrals of squared CDF-gap windows.

For ``f = alpha + beta r + sum_m c_m ReLU(r - t_m)`` and the signed weights ``s`` of the pooled
sample (``+1/n`` for a point of ``x``, ``-1/m`` for one of ``y``; ``sum s = 0``) the constant and
linear parts cancel, and ``sum_ij s_i s_j ReLU(z_i - z_j - t) = -int D(u) D(u + t) du`` with the CDF
gap ``D``. With ``int D(u) D(u + t) du = int D^2 - V(|t|)`` and
``V(tau) = 1/2 int (D(u + tau) - D(u))^2 du``::

    MMD^2_V = -(sum_m c_m) ED / 2 + sum_m c_m V(|t_m|),

a combination of integrals of squares (docs/mathematics.rst, "Exact 1-D statistics"):
``D(u + tau) - D(u)`` is the signed weight in the window ``(u, u + tau]``, an exact integer running
sum over the pooled sample and its copy shifted by ``-tau``. The unbiased estimator leaves the
diagonal ``f(0)`` out of the within-sample means::

    MMD^2_U = MMD^2_V + sum_m c_m (I_x(|t_m|) / (n - 1) + I_y(|t_m|) / (m - 1)),
    I_x(tau) = mean_ij ReLU(x_i - x_j - tau) = int F(u) (1 - F(u + tau)) du >= 0.

For a hat, or a mixture of hats with positive weights, every term of ``MMD^2_V`` is non-negative;
``MMD^2_U`` is a difference (it can be negative) whose error is a few ``eps`` of
``|MMD^2_V| + |MMD^2_U|``. The cost is ``O(K N log N)`` for ``K`` distinct ``|t_m|``.
"""

from __future__ import annotations

from .._lib.namespace import array_device, scalar
from .._lib.typing import Array, Namespace
from ..backends import accurate_sum
from ..kernels import PiecewiseLinear
from ._exact1d import energy_distance_1d, finite_rows, pooled, take, two_sum

__all__ = ["mmd_1d"]


def _shifted_sort(xp, v, tau: float):
    """The points ``v - tau`` and ``v`` (``v`` sorted, (..., L)) pooled and sorted.

    Returns the permutation of ``concat([v - tau, v])``, the sorted flags (1 for a shifted point)
    and the lengths between consecutive sorted points, (..., 2L - 1). A length is formed from the
    unshifted values, ``(v_b - v_a) - tau (f_b - f_a)``, with the first difference kept exactly
    (TwoSum): a short interval next to a shifted point is not the difference of two rounded
    ``v - tau``, so its relative error is a few ``eps`` whatever ``|v| / tau``.
    """
    device = array_device(v)
    flags = xp.concat([xp.ones(v.shape, dtype=v.dtype, device=device),
                       xp.zeros(v.shape, dtype=v.dtype, device=device)], axis=-1)
    perm = xp.argsort(xp.concat([v - tau, v], axis=-1), axis=-1, stable=True)
    base = take(xp, xp.concat([v, v], axis=-1), perm)
    fs = take(xp, xp.broadcast_to(flags, tuple(perm.shape)), perm)
    diff, err = two_sum(base[..., 1:], -base[..., :-1])
    return perm, fs, (diff - tau * (fs[..., 1:] - fs[..., :-1])) + err


def _window_square(xp, zs, units, tau: float, scale: float):
    """``V(tau)`` for unweighted samples, shape ``batch``. ``zs`` is the sorted pooled sample and
    ``units`` its signed weights in units of ``scale = 1 / (n m)`` (``m`` for a point of ``x``,
    ``-n`` for one of ``y``): the window sum is an exact integer running sum."""
    perm, _, lengths = _shifted_sort(xp, zs, tau)
    w = xp.cumulative_sum(take(xp, xp.concat([units, -units], axis=-1), perm), axis=-1)[..., :-1] * scale
    return 0.5 * accurate_sum(xp, w * w * lengths)


def _self_relu(xp, vs, tau: float):
    """``I(tau) = mean_ij ReLU(v_i - v_j - tau) = int F(u) (1 - F(u + tau)) du`` (``tau >= 0``,
    ``vs`` sorted): with ``i`` the count of points ``<= u`` and ``k`` that of shifted points, the
    integrand is ``i (L - k) / L^2``, an exact integer over ``L^2``."""
    size = float(vs.shape[-1])
    _, fs, lengths = _shifted_sort(xp, vs, tau)
    shifted = xp.cumulative_sum(fs, axis=-1)
    plain = xp.cumulative_sum(1.0 - fs, axis=-1)
    count = (plain * (size - shifted))[..., :-1]
    return accurate_sum(xp, count * lengths) / (size * size)


def mmd_1d(xp: Namespace, x: Array, y: Array, kernel: PiecewiseLinear, estimator: str, *, batch: tuple,
           device, work) -> Array:
    """The squared MMD (``estimator`` "v" or "u") of the rows of ``x`` (..., n) and ``y`` (..., m) in
    the work dtype with the profile ``kernel``; shape ``batch``, NaN on rows with
    a non-finite value."""
    n, m = x.shape[-1], y.shape[-1]
    weight_of: dict[float, float] = {}                  # coefficients grouped by tau = |t_m|
    for t, c in zip(kernel.knots, kernel.coeffs):
        weight_of[abs(float(t))] = weight_of.get(abs(float(t)), 0.0) + float(c)
    total = sum(float(c) for c in kernel.coeffs)
    # zero that is a function of x and y: with no term below (a knotless profile, whose even part is
    # constant) the statistic is 0 for every sample, and under autograd it must still be a function
    # of the samples, with a zero gradient, so that backward() works as for every other profile
    out = xp.broadcast_to(0.0 * (xp.sum(x, axis=-1) + xp.sum(y, axis=-1)), tuple(batch))
    # a sum that overflows is no NaN of a finite row (non-finite rows are made NaN at the end)
    out = xp.where(xp.isfinite(out), out, xp.zeros_like(out))
    if total != 0.0:
        ed = energy_distance_1d(xp, x, y, None, None, batch=batch, device=device, work=work)
        out = out + (-0.5 * total) * ed
    if any(tau > 0.0 and c != 0.0 for tau, c in weight_of.items()):
        z, perm = pooled(xp, x, y, batch)
        units = xp.concat([xp.full((n,), float(m), dtype=work, device=device),
                           xp.full((m,), -float(n), dtype=work, device=device)], axis=-1)
        zs = take(xp, z, perm)
        units = take(xp, xp.broadcast_to(units, tuple(perm.shape)), perm)
        for tau, c in weight_of.items():
            if tau > 0.0 and c != 0.0:
                out = out + c * _window_square(xp, zs, units, tau, 1.0 / (float(n) * float(m)))
    if estimator == "u":
        xs, ys = xp.sort(x, axis=-1), xp.sort(y, axis=-1)
        for tau, c in weight_of.items():
            if c != 0.0:
                ix = xp.broadcast_to(_self_relu(xp, xs, tau), tuple(batch))
                iy = xp.broadcast_to(_self_relu(xp, ys, tau), tuple(batch))
                out = out + c * (ix / float(n - 1) + iy / float(m - 1))
    nan = scalar(xp, float("nan"), dtype=work, device=device)
    return xp.where(finite_rows(xp, batch, x, y), out, nan)
