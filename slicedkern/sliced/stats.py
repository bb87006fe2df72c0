"""Two-sample statistics: the energy distance and the MMD of a sliced kernel.

Both are one 1-D sort-scan :func:`slicedkern.kernel_sum` per slice on the pooled sample
``z = [x, y]`` with weight columns that pick the within- and between-sample sums
(docs/mathematics.rst, "MMD and energy distance"); 1-D samples are exact (one "slice": the samples
themselves).
"""

from __future__ import annotations

import math

from .._lib.namespace import as_work, broadcast_shapes, shape_str
from .._lib.typing import Array, Namespace
from ..adapters.vjp import composite
from ..backends import holds_everywhere
from ..kernels import Abs, PiecewiseLinear
from ..ops import kernel_sum
from ..ops._validate import check_kernel, setup
from .directions import Seed, resolve_directions, same_dim
from .plan import SlicePlan, broadcast, check_chunk, chunk_for, lift, project, unproject

__all__ = ["energy_distance", "mmd"]

_ESTIMATORS = ("v", "u")


# ------------------------------------------------------------------------------------ the samples
def _layout(x: Array, y: Array, directions: int | Array | None) -> tuple[bool, int]:
    """``(exact, dim)``: 1-D samples (exact) or points of R^d (sliced); see :func:`energy_distance`."""
    if x.ndim == 0 or y.ndim == 0:
        raise ValueError(f"arguments 'x' and 'y' must be samples of shape (n,) or (..., n, d), got "
                         f"{shape_str(x)} and {shape_str(y)}")
    if x.ndim == 1 or y.ndim == 1:
        if x.ndim != y.ndim:
            raise ValueError("arguments 'x' and 'y' must both be 1-D samples of shape (n,) and (m,), or both "
                             f"d-dimensional of shape (..., n, d) and (..., m, d), got {shape_str(x)} and "
                             f"{shape_str(y)}")
        return True, 1
    dim = same_dim(x, y, ("x", "y"))
    if dim == 1:
        return True, 1
    if directions is None:
        raise ValueError(f"argument 'directions' is required for {dim}-dimensional samples (x has shape "
                         f"{tuple(x.shape)}): pass a number of slices P or a (P, d) array of unit vectors; "
                         "1-D samples are given as shape (n,) or (..., n, 1)")
    return False, dim


def _sizes(x: Array, y: Array) -> tuple[int, int]:
    """The numbers of samples ``n``, ``m`` of validated layouts."""
    return (x.shape[-1], y.shape[-1]) if x.ndim == 1 else (x.shape[-2], y.shape[-2])


def _pooled(xp: Namespace, x: Array, y: Array, exact: bool, work, *shapes: tuple,
            names: tuple[str, ...] = ("x", "y")) -> tuple[Array, tuple[int, ...]]:
    """The pooled sample ``z = [x, y]`` in the work dtype, (..., N) scalars when ``exact`` and
    (..., N, d) points otherwise, and the batch shape (with the extra batch ``shapes``)."""
    core = 1 if exact else 2
    xs, ys = as_work(xp, x, work), as_work(xp, y, work)
    if exact and x.ndim >= 2:                               # (..., n, 1) scalars
        xs, ys = xs[..., 0], ys[..., 0]
    batch = broadcast_shapes(tuple(xs.shape[:xs.ndim - core]), tuple(ys.shape[:ys.ndim - core]), *shapes,
                             names=names)
    z = xp.concat([broadcast(xp, xs, batch, core), broadcast(xp, ys, batch, core)], axis=-core)
    return z, batch


def _probability_weights(xp: Namespace, weights: Array | None, n: int, name: str, *, device, work) -> Array:
    """Weights (..., n) normalised to sum 1 on their last axis (uniform ones when None)."""
    if weights is None:
        return xp.full((n,), 1.0 / n, dtype=work, device=device)
    if weights.ndim < 1 or weights.shape[-1] != n:
        raise ValueError(f"argument {name!r} must have shape (..., {n}) (one weight per sample), got "
                         f"{shape_str(weights)}")
    weights = as_work(xp, weights, work)
    total = xp.sum(weights, axis=-1, keepdims=True)
    if holds_everywhere(xp, weights, lambda ns, a: a >= 0) is False:
        raise ValueError(f"argument {name!r} must be non-negative")
    if holds_everywhere(xp, total, lambda ns, a: a > 0) is False:
        raise ValueError(f"argument {name!r} must have a positive sum")
    return weights / total


def _kappa(dim: int) -> float:
    """``E_theta |theta_1| = Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2))`` for theta uniform on S^{d-1}
    (docs/mathematics.rst, "Radial profiles and kappa_d")."""
    return math.exp(math.lgamma(dim / 2) - math.lgamma((dim + 1) / 2)) / math.sqrt(math.pi)


def _symmetric(kernel: PiecewiseLinear) -> PiecewiseLinear:
    """``(f(r) + f(-r)) / 2``: the part of ``f`` a symmetric (sliced) kernel sees."""
    return kernel if kernel.is_even else 0.5 * (kernel + kernel.reflect())


# ------------------------------------------------------------------------------------------ plans
class _PooledPlan(SlicePlan):
    """A statistic of the pooled sample ``z``: ``z`` itself when exact, else its projections.

    ``theta`` None means exact (one "slice" of the samples themselves, scale 1); otherwise the sum
    over slices is scaled by ``weight / P``. ``per_point`` bounds the elements a slice works on, per
    pooled point and batch element, for the default chunk.
    """

    def __init__(self, xp, z, theta, *, n, squeeze, batch, per_point, weight, chunk_size, out_dtype,
                 device, work):
        self.exact = theta is None
        if self.exact:
            theta, chunk, scale = xp.ones((1, 1), dtype=work, device=device), 1, 1.0
        else:
            chunk = chunk_for(chunk_size, theta.shape[0], math.prod(batch) * z.shape[-2] * per_point)
            scale = weight / theta.shape[0]
        super().__init__(xp, theta, chunk, scale, out_dtype)
        self.z, self.n, self.squeeze = z, n, squeeze

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


class _EnergyPlan(_PooledPlan):
    """``-sum_ij u_i u_j |z_i - z_j|`` with the signed weights ``u = [a, -b]`` (shared by the slices)."""

    def __init__(self, xp, z, theta, u, *, x_weights, y_weights, **kw):
        super().__init__(xp, z, theta, **kw)
        self.u = u if self.exact else u[..., None, :]       # (..., [1,] N)
        self.raw = {"x_weights": x_weights, "y_weights": y_weights}

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
        xp, n, work = self.xp, self.n, self.work_dtype
        out = super().arguments(grads)
        du = grads["u"]
        for name, part in (("x_weights", du[..., :n]), ("y_weights", -du[..., n:])):
            raw = self.raw[name]
            if raw is not None:      # through the normalisation p = raw / sum(raw)
                raw = as_work(xp, raw, work)
                total = xp.sum(raw, axis=-1, keepdims=True)
                out[name] = (part - xp.sum(part * (raw / total), axis=-1, keepdims=True)) / total
        return out


class _MMDPlan(_PooledPlan):
    """``coef . [sum_xx, sum_xy, sum_yy] + shift`` from the pooled sums with membership columns."""

    def __init__(self, xp, z, theta, *, kernel, m, coef, shift, batch, device, work, **kw):
        super().__init__(xp, z, theta, batch=batch, device=device, work=work, **kw)
        n = self.n
        ones = xp.ones((n,), dtype=work, device=device), xp.ones((m,), dtype=work, device=device)
        zeros = xp.zeros((n,), dtype=work, device=device), xp.zeros((m,), dtype=work, device=device)
        member = xp.stack([xp.concat([ones[0], zeros[1]]), xp.concat([zeros[0], ones[1]])], axis=-1)
        member = lift(xp, member, 2, len(batch))            # (1.., N, 2): [in x, in y]
        self.member = member if self.exact else member[..., None, :, :]
        self.kernel, self.m, self.coef, self.shift = kernel, m, coef, shift
        self.device = device

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


# ------------------------------------------------------------------------------- energy distance
def _plan_energy_distance(x: Array, y: Array, *, directions: int | Array | None = None,
                          x_weights: Array | None = None, y_weights: Array | None = None,
                          chunk_size: int | None = None, seed: Seed = None, xp: Namespace | None = None
                          ) -> _EnergyPlan:
    """The plan of :func:`energy_distance` (same arguments), after validating them."""
    named = {"x": x, "y": y, "x_weights": x_weights, "y_weights": y_weights}
    xp, device, out_dtype, work = setup(named, xp)
    exact, dim = _layout(x, y, directions)
    n, m = _sizes(x, y)
    if n == 0 or m == 0:
        raise ValueError(f"arguments 'x' and 'y' must hold at least one sample each, got {shape_str(x)} and "
                         f"{shape_str(y)}")
    chunk_size = check_chunk(chunk_size)
    a = _probability_weights(xp, x_weights, n, "x_weights", device=device, work=work)
    b = _probability_weights(xp, y_weights, m, "y_weights", device=device, work=work)
    theta = None if exact else resolve_directions(directions, dim, xp=xp, device=device, work=work, seed=seed)
    z, batch = _pooled(xp, x, y, exact, work, tuple(a.shape[:-1]), tuple(b.shape[:-1]),
                       names=("x", "y", "x_weights", "y_weights"))
    u = xp.concat([broadcast(xp, a, batch, 1), -broadcast(xp, b, batch, 1)], axis=-1)
    # E_theta |<theta, z>| = kappa_d |z|: dividing by kappa_d makes the sliced estimate unbiased
    return _EnergyPlan(xp, z, theta, u, x_weights=x_weights, y_weights=y_weights, n=n,
                       squeeze=exact and x.ndim >= 2, batch=batch, per_point=4, weight=1.0 / _kappa(dim),
                       chunk_size=chunk_size, out_dtype=out_dtype, device=device, work=work)


@composite(_plan_energy_distance)
def energy_distance(x: Array, y: Array, *, directions: int | Array | None = None, x_weights: Array | None = None,
                    y_weights: Array | None = None, chunk_size: int | None = None, seed: Seed = None,
                    xp: Namespace | None = None) -> Array:
    """Energy distance ``ED = 2 E|X - Y| - E|X - X'| - E|Y - Y'|`` between two samples.

    Székely's energy distance, not its square root: for 1-D samples it equals
    ``scipy.stats.energy_distance(x, y, u_weights, v_weights) ** 2``. In 1-D it is exact and costs
    ``O(N log N)`` (``N = n + m``, one sort-scan :func:`slicedkern.kernel_sum` with the profile
    ``|r|``); in R^d (``d > 1``) it is the sliced estimate with the directions ``theta_p``, rescaled by
    ``1 / kappa_d``, ``kappa_d = Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2)) = E_theta |theta_1|``, which is
    unbiased over random directions.

    Parameters
    ----------
    x : array, shape (n,) or (..., n, d)
        First sample. A 1-D array is ``n`` scalars; otherwise the last axis holds the coordinates
        and the one before it the samples; leading axes are batch axes (one statistic each). Scalar
        samples with batch axes are given as (..., n, 1).
    y : array, shape (m,) or (..., m, d)
        Second sample, laid out like ``x``, with the same ``d``.
    directions : int or array, shape (P, d), optional
        Required when ``d > 1``, as in :func:`sliced_kernel_sum`; ignored when ``d == 1`` (exact).
    x_weights : array, shape (..., n), optional
        Non-negative probability weights of ``x`` (normalised to sum 1, like ``u_weights`` of
        ``scipy.stats.energy_distance``); uniform when omitted.
    y_weights : array, shape (..., m), optional
        Weights of ``y``.
    chunk_size : int, optional
        Slices per 1-D call (default: bounded memory).
    seed : None, int or numpy.random.Generator, optional
        Seed of the directions when ``directions`` is an integer.
    xp : array namespace, optional

    Returns
    -------
    array, shape (...)
        The batch shape (0-d for one pair of samples); namespace, device and floating dtype of the
        inputs. Differentiable w.r.t. ``x``, ``y`` and the weights where ``kernel_sum`` is.

    Raises
    ------
    TypeError
        Arrays from different libraries or devices, non-floating dtypes.
    ValueError
        Mismatched layouts or dimensions, missing ``directions`` when ``d > 1``, empty samples,
        weights of the wrong length, negative or all-zero weights (checked when not traced).

    Notes
    -----
    The statistic is evaluated as ``-sum_ij u_i u_j |z_i - z_j|`` over the pooled sample ``z = [x, y]``
    with the signed weights ``u = [a, -b]``: one sort per slice. It is non-negative in exact
    arithmetic; rounding can leave a value of the order of ``1e-16`` times the scale of the data below
    zero for identical samples.

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern.sliced import energy_distance
    >>> x, y = np.array([0.0, 1.0]), np.array([0.0, 3.0])
    >>> float(energy_distance(x, y))  # 2 * 1.5 - 0.5 - 1.5
    1.0
    """
    return _plan_energy_distance(x, y, directions=directions, x_weights=x_weights, y_weights=y_weights,
                                 chunk_size=chunk_size, seed=seed, xp=xp).forward()


# ------------------------------------------------------------------------------------------- MMD
def _plan_mmd(x: Array, y: Array, kernel: PiecewiseLinear, *, directions: int | Array | None = None,
              estimator: str = "v", chunk_size: int | None = None, seed: Seed = None,
              xp: Namespace | None = None) -> _MMDPlan:
    """The plan of :func:`mmd` (same arguments), after validating them."""
    xp, device, out_dtype, work = setup({"x": x, "y": y}, xp)
    check_kernel(kernel)
    if estimator not in _ESTIMATORS:
        raise ValueError(f"argument 'estimator' must be one of {_ESTIMATORS}, got {estimator!r}")
    exact, dim = _layout(x, y, directions)
    n, m = _sizes(x, y)
    least = 2 if estimator == "u" else 1
    if n < least or m < least:
        raise ValueError(f"arguments 'x' and 'y' must hold at least {least} samples each for "
                         f"estimator={estimator!r}, got {shape_str(x)} and {shape_str(y)}")
    chunk_size = check_chunk(chunk_size)
    kernel = _symmetric(kernel)
    theta = None if exact else resolve_directions(directions, dim, xp=xp, device=device, work=work, seed=seed)
    z, batch = _pooled(xp, x, y, exact, work)
    if estimator == "v":
        coef, shift = (1.0 / (n * n), -2.0 / (n * m), 1.0 / (m * m)), 0.0
    else:
        coef = (1.0 / (n * (n - 1)), -2.0 / (n * m), 1.0 / (m * (m - 1)))
        shift = -kernel(0.0) * (1.0 / (n - 1) + 1.0 / (m - 1))      # the i = j terms, f(0) each
    return _MMDPlan(xp, z, theta, kernel=kernel, m=m, coef=coef, shift=shift, n=n,
                    squeeze=exact and x.ndim >= 2, batch=batch, per_point=8, weight=1.0,
                    chunk_size=chunk_size, out_dtype=out_dtype, device=device, work=work)


@composite(_plan_mmd)
def mmd(x: Array, y: Array, kernel: PiecewiseLinear, *, directions: int | Array | None = None,
        estimator: str = "v", chunk_size: int | None = None, seed: Seed = None,
        xp: Namespace | None = None) -> Array:
    """Squared maximum mean discrepancy with the sliced kernel of a 1-D profile.

    With ``K(a, b) = (1/P) sum_p f(<theta_p, a - b>)`` (``K(a, b) = f(a - b)`` for 1-D samples)::

        V:  mean_ij K(x_i, x_j) + mean_ij K(y_i, y_j) - 2 mean_ij K(x_i, y_j)
        U:  the same with the diagonal terms i = j left out of the two within-sample means,
            sum_{i != j} K(x_i, x_j) / (n (n - 1)) + ... - 2 mean_ij K(x_i, y_j)

    Parameters
    ----------
    x : array, shape (n,) or (..., n, d)
        First sample, laid out as in :func:`energy_distance`.
    y : array, shape (m,) or (..., m, d)
        Second sample.
    kernel : slicedkern.kernels.PiecewiseLinear
        The 1-D profile ``f``. Only its even part ``(f(r) + f(-r)) / 2`` is used, which keeps ``K``
        symmetric (e.g. ``ReLU()`` acts as ``|r| / 2``); the even kernels ``Hat``, ``HatMixture``, ``Abs``
        are used as they are. ``-Abs()`` gives the energy distance (times ``kappa_d`` in R^d).
    directions : int or array, shape (P, d), optional
        Required when ``d > 1``, as in :func:`sliced_kernel_sum`; ignored when ``d == 1`` (exact).
    estimator : {"v", "u"}, default "v"
        Biased V-statistic or unbiased U-statistic (needs ``n, m >= 2``).
    chunk_size : int, optional
        Slices per 1-D call (default: bounded memory).
    seed : None, int or numpy.random.Generator, optional
        Seed of the directions when ``directions`` is an integer.
    xp : array namespace, optional

    Returns
    -------
    array, shape (...)
        The batch shape (0-d for one pair of samples); namespace, device and floating dtype of the
        inputs. Differentiable w.r.t. ``x`` and ``y`` where ``kernel_sum`` is (sliced-MMD flows).

    Raises
    ------
    TypeError
        Arrays from different libraries or devices, non-floating dtypes, a kernel that is not a
        :class:`~slicedkern.kernels.PiecewiseLinear`.
    ValueError
        Mismatched layouts or dimensions, missing ``directions`` when ``d > 1``, an unknown
        ``estimator``, too few samples.

    Notes
    -----
    One sort-scan per slice on the pooled sample ``[x, y]`` with two weight columns (membership of
    ``x`` and of ``y``) gives the three sums. In every slice ``K(x_i, x_i) = f(0)``, so the U-statistic
    subtracts ``n f(0)`` from the within-sample sums. The V-statistic is non-negative for
    positive-definite kernels (e.g. hats); the U-statistic can be negative.

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern.kernels import Hat
    >>> from slicedkern.sliced import mmd
    >>> x, y = np.array([0.0, 1.0]), np.array([0.0, 3.0])
    >>> float(mmd(x, y, Hat(2.0)))  # (1 + 0.5) / 2 + (1 + 0) / 2 - 2 (1 + 0 + 0.5 + 0) / 4
    0.5
    """
    return _plan_mmd(x, y, kernel, directions=directions, estimator=estimator, chunk_size=chunk_size, seed=seed,
                     xp=xp).forward()
