"""The radial profile ``Phi`` of a sliced kernel, in closed form (docs/mathematics.rst, "Radial
profiles and kappa_d")."""

from __future__ import annotations

import math
import numbers

import array_api_compat as compat
import numpy as np

from .._lib.namespace import array_device, has_float64
from .._lib.typing import Array
from .._validate import check_kernel
from ..backends import to_host
from ..kernels import PiecewiseLinear
from .directions import positive_int

__all__ = ["radial_profile", "RadialProfile"]


class RadialProfile:
    """``Phi(r) = E_theta f(<theta, z>)`` for ``|z| = r``: the radial function of a sliced kernel.

    Built by :func:`radial_profile`; calling it evaluates ``Phi`` (see there).
    """

    __slots__ = ("kernel", "dim")

    def __init__(self, kernel: PiecewiseLinear, dim: int):
        self.kernel = kernel
        self.dim = dim

    def __repr__(self) -> str:
        return f"radial_profile({self.kernel!r}, dim={self.dim})"

    def __call__(self, r: float | list | tuple | Array) -> float | Array:
        """Evaluate ``Phi(r)``: a float for a number, an array of ``r``'s namespace and device otherwise."""
        if isinstance(r, numbers.Real) and not isinstance(r, bool):
            return float(self._evaluate(np.asarray(float(r), dtype=np.float64)))
        if isinstance(r, (list, tuple)):
            return self._evaluate(np.asarray(r, dtype=np.float64))
        try:
            space = compat.array_namespace(r)
        except TypeError:
            raise TypeError(f"argument 'r' must be a number or an array, got {type(r).__name__}") from None
        device = array_device(r)
        wide = space.float64 if has_float64(space, device) else space.float32
        if space.isdtype(r.dtype, "real floating"):
            dtype = r.dtype
            # widened in r's own library first: not every library hands every float dtype to NumPy
            # (torch's bfloat16, for one)
            r = space.astype(r, wide)
        else:
            dtype = wide
        out = self._evaluate(np.asarray(to_host(r), dtype=np.float64))
        return space.asarray(out, dtype=dtype, device=device)

    def derivative(self, r: np.ndarray) -> np.ndarray:
        """``Phi'(r)`` on a float64 NumPy array ``r >= 0`` (closed form; 0 at ``r = 0``, where
        ``Phi`` is even and flat or has a kink whose subgradient 0 is used).

        ``d/dr E ReLU(r t - t_m) = E[t 1(t > tau)] = k (1 - tau^2)^((d-1)/2) / (d - 1)`` with
        ``tau = t_m / r`` clipped to [-1, 1] (the first term of :meth:`_evaluate`).
        """
        f, d = self.kernel, self.dim
        r = np.abs(np.asarray(r, dtype=np.float64))
        if d == 1:
            return np.where(r > 0, 0.5 * (f.derivative_at(r) - f.derivative_at(-r)), 0.0)
        knots = np.asarray(f.knots, dtype=np.float64)
        coeffs = np.asarray(f.coeffs, dtype=np.float64)
        if not knots.size:
            return np.zeros(r.shape)
        k = math.exp(math.lgamma(d / 2) - math.lgamma((d - 1) / 2)) / math.sqrt(math.pi)
        rr = r[..., None]
        positive = (rr > 0) & np.isfinite(rr)
        tau = np.clip(knots / np.where(positive, rr, 1.0), -1.0, 1.0)
        slope = np.where(positive, k * (1.0 - tau * tau) ** ((d - 1) / 2) / (d - 1), 0.0)
        return slope @ coeffs

    def _evaluate(self, r: np.ndarray) -> np.ndarray:
        """``Phi`` on a float64 NumPy array (closed form)."""
        f, d = self.kernel, self.dim
        r = np.abs(r)
        if d == 1:                                          # theta = +-1
            return 0.5 * (f(r) + f(-r))
        knots = np.asarray(f.knots, dtype=np.float64)
        coeffs = np.asarray(f.coeffs, dtype=np.float64)
        out = np.full(r.shape, f.intercept, dtype=np.float64)  # E[b r t] = 0: t is symmetric
        if knots.size:
            from scipy.special import betainc
            # t = theta_1 has density k (1 - t^2)^((d-3)/2) on [-1, 1]; for r > 0 and tau = t_m / r,
            # E ReLU(r t - t_m) = r int_tau^1 t p - t_m P(t > tau)
            #                   = r k (1 - tau^2)^((d-1)/2) / (d - 1)
            #                     - t_m (1 - sign(tau) I_{tau^2}(1/2, (d-1)/2)) / 2
            # (tau clipped to [-1, 1]); at r = 0 it is ReLU(-t_m).
            k = math.exp(math.lgamma(d / 2) - math.lgamma((d - 1) / 2)) / math.sqrt(math.pi)
            rr = r[..., None]
            positive = rr > 0
            finite = np.isfinite(rr)
            safe = np.where(positive & finite, rr, 1.0)
            tau = np.clip(knots / safe, -1.0, 1.0)
            mass = 0.5 * (1.0 - np.sign(tau) * betainc(0.5, (d - 1) / 2, tau * tau))
            first = k * (1.0 - tau * tau) ** ((d - 1) / 2) / (d - 1)
            relu = np.where(positive, safe * first - knots * mass, np.maximum(-knots, 0.0))
            out = out + relu @ coeffs
            # r = inf: the terms growing like r cancel when sum(c) = 0, leaving a - sum(c t) / 2
            total = float(np.sum(coeffs))
            at_inf = (f.intercept - 0.5 * float(knots @ coeffs) if total == 0.0
                      else math.copysign(math.inf, total))
            out = np.where(np.isinf(r), at_inf, out)
        return np.where(np.isnan(r), np.nan, out)


def radial_profile(kernel: PiecewiseLinear, dim: int) -> RadialProfile:
    """The radial function ``Phi`` of the sliced kernel of ``f`` in R^d.

    ``E_theta f(<theta, z>) = Phi(|z|)`` for ``theta`` uniform on the unit sphere of R^d::

        Phi(r) = c_d int_0^1 f_s(t r) (1 - t^2)^((d-3)/2) dt,
        c_d = 2 Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2))

    with ``f_s(u) = (f(u) + f(-u)) / 2`` the even part of ``f`` (the expectation over the sphere only
    sees it; ``f_s = f`` for hats, mixtures and ``|r|``). For ``d = 1`` (``theta = +-1``)
    ``Phi(r) = f_s(r)``; ``Phi(0) = f(0)`` in every dimension.

    Parameters
    ----------
    kernel : slicedkern.kernels.PiecewiseLinear
        The 1-D profile ``f``.
    dim : int
        The dimension ``d >= 1``.

    Returns
    -------
    callable
        ``Phi(r)`` for ``r >= 0`` (``Phi(-r) = Phi(r)``): a float for a float, a NumPy float64 array
        for a list, and for an array of any library an array of the same namespace, device and
        floating dtype, shape of ``r``. NaN gives NaN.

    Raises
    ------
    TypeError
        ``kernel`` is not a :class:`~slicedkern.kernels.PiecewiseLinear`, ``dim`` not an integer.
    ValueError
        ``dim < 1``.

    Notes
    -----
    Exact closed form: for ``f = a + b u + sum_m c_m ReLU(u - t_m)`` the linear term averages out and
    each ReLU contributes through the regularised incomplete beta function (``scipy.special.betainc``,
    imported when first needed; ``d >= 2`` with knots needs SciPy). Evaluated on the host in float64:
    not differentiable, not traceable.

    Examples
    --------
    >>> import math
    >>> from slicedkern.kernels import Abs
    >>> from slicedkern.sliced import radial_profile
    >>> phi = radial_profile(Abs(), 3)   # E|<theta, z>| = |z| / 2 in R^3
    >>> round(phi(2.0), 12)
    1.0
    """
    check_kernel(kernel)
    return RadialProfile(kernel, positive_int(dim, "dim"))
