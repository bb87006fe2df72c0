"""Continuous piecewise-linear 1-D kernel profiles.

Every profile is written once, in one representation::

    f(r) = intercept + slope * r + sum_m coeffs[m] * max(r - knots[m], 0)

Each knot costs one rank search in the sort-scan, so the representation is kept minimal
(equal knots are merged, zero coefficients dropped). Kernels are immutable, hashable, and form a
small algebra: ``f + g``, ``a * f``, ``-f`` and ``f.reflect()`` (``r -> f(-r)``, used by the
backward pass).

Examples
--------
>>> import numpy as np
>>> from slicedkern.kernels import Abs, Hat, PiecewiseLinear, ReLU
>>> Hat(2.0)(np.array([-3.0, -1.0, 0.0, 1.0]))
array([0. , 0.5, 1. , 0.5])
>>> (2 * ReLU() + PiecewiseLinear((), (), slope=-1.0)) == Abs()
True
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["PiecewiseLinear", "ReLU", "Abs", "Hat", "HatMixture", "Profile", "hat_profile",
           "hat_pullback", "finite_real", "positive_real", "check_hat_count", "KernelFamily", "HatFamily",
           "register_family", "family_named"]


def _real(value, name: str) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"argument {name!r} must be a real number, got {type(value).__name__}")
    return float(value)


def finite_real(value, name: str) -> float:
    """A profile parameter given as a number: a finite float, else ``TypeError`` / ``ValueError``
    naming ``name``. The one rule of every parameter (knots, coefficients, slope, intercept, mixture
    weights): a NaN or infinite one would make every output NaN rather than raise."""
    value = _real(value, name)
    if value != value or abs(value) == float("inf"):
        raise ValueError(f"argument {name!r} must be finite, got {value}")
    return value


def positive_real(value, name: str) -> float:
    """A bandwidth given as a number: a positive finite float, else ``TypeError`` / ``ValueError``."""
    value = _real(value, name)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"argument {name!r} must be positive and finite, got {value}")
    return value


class PiecewiseLinear:
    """A continuous piecewise-linear profile ``a + b r + sum_m c_m ReLU(r - t_m)``.

    Parameters
    ----------
    knots : sequence of float, length M
        Breakpoints ``t_m``.
    coeffs : sequence of float, length M
        Slope changes ``c_m`` at each knot.
    slope : float, default 0
        Slope ``b`` left of every knot.
    intercept : float, default 0
        Constant ``a``.

    Examples
    --------
    >>> import numpy as np
    >>> tri = PiecewiseLinear(knots=(-1.0, 0.0, 1.0), coeffs=(1.0, -2.0, 1.0))
    >>> tri(np.linspace(-2, 2, 5))
    array([0., 0., 1., 0., 0.])
    """

    __slots__ = ("_knots", "_coeffs", "_slope", "_intercept")

    def __init__(self, knots: Sequence[float] = (), coeffs: Sequence[float] = (), slope: float = 0.0,
                 intercept: float = 0.0):
        knots = tuple(finite_real(t, "knots") for t in knots)
        coeffs = tuple(finite_real(c, "coeffs") for c in coeffs)
        if len(knots) != len(coeffs):
            raise ValueError(f"knots and coeffs must have the same length, got {len(knots)} and "
                             f"{len(coeffs)}")
        merged: dict[float, float] = {}
        for t, c in zip(knots, coeffs):
            merged[t] = merged.get(t, 0.0) + c
        items = sorted((t, c) for t, c in merged.items() if c != 0.0)
        object.__setattr__(self, "_knots", tuple(t for t, _ in items))
        object.__setattr__(self, "_coeffs", tuple(c for _, c in items))
        object.__setattr__(self, "_slope", finite_real(slope, "slope"))
        object.__setattr__(self, "_intercept", finite_real(intercept, "intercept"))

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    # Pickling (Dask ships kernels to its workers, multiprocessing to its processes) restores the
    # slots past the immutability guard.
    def __getstate__(self):
        return self._knots, self._coeffs, self._slope, self._intercept

    def __setstate__(self, state):
        for name, value in zip(PiecewiseLinear.__slots__, state):
            object.__setattr__(self, name, value)

    # -- representation -------------------------------------------------------------------
    @property
    def knots(self) -> tuple[float, ...]:
        """Knots ``t_m``, increasing."""
        return self._knots

    @property
    def coeffs(self) -> tuple[float, ...]:
        """Coefficients ``c_m`` matching :attr:`knots`."""
        return self._coeffs

    @property
    def slope(self) -> float:
        return self._slope

    @property
    def intercept(self) -> float:
        return self._intercept

    def as_piecewise_linear(self) -> PiecewiseLinear:
        """The same profile as a plain :class:`PiecewiseLinear`."""
        return PiecewiseLinear(self._knots, self._coeffs, self._slope, self._intercept)

    def _key(self):
        return (self._knots, self._coeffs, self._slope, self._intercept)

    def __eq__(self, other):
        if not isinstance(other, PiecewiseLinear):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return (f"PiecewiseLinear(knots={self._knots}, coeffs={self._coeffs}, slope={self._slope}, "
                f"intercept={self._intercept})")

    # -- algebra ----------------------------------------------------------------------------
    def __add__(self, other):
        if not isinstance(other, PiecewiseLinear):
            return NotImplemented
        return PiecewiseLinear(self._knots + other._knots, self._coeffs + other._coeffs,
                               self._slope + other._slope, self._intercept + other._intercept)

    def __sub__(self, other):
        if not isinstance(other, PiecewiseLinear):
            return NotImplemented
        return self + (-1.0) * other

    def __mul__(self, scalar):
        if not isinstance(scalar, numbers.Real) or isinstance(scalar, bool):
            return NotImplemented
        s = float(scalar)
        return PiecewiseLinear(self._knots, tuple(s * c for c in self._coeffs), s * self._slope,
                               s * self._intercept)

    __rmul__ = __mul__

    def __neg__(self):
        return (-1.0) * self

    def reflect(self) -> PiecewiseLinear:
        """The profile ``r -> f(-r)``, again piecewise linear.

        ``ReLU(-r - t) = ReLU(r + t) - (r + t)``: the knots change sign, the coefficients stay, and
        the slope and intercept absorb the linear terms.
        """
        return PiecewiseLinear(*_reflected(self._knots, self._coeffs, self._slope, self._intercept))

    def derivative_at(self, r):
        """Right derivative ``f'(r) = b + sum_m c_m [r >= t_m]`` evaluated on an array."""
        xp = _namespace(r)
        out = xp.zeros_like(r) + self._slope
        for t, c in zip(self._knots, self._coeffs):
            out = out + c * xp.astype(r >= t, r.dtype)
        return out

    def __call__(self, r):
        """Evaluate ``f(r)`` elementwise on an array of any array-API library (or a float)."""
        if isinstance(r, numbers.Real):
            return self._intercept + self._slope * r + sum(
                c * max(r - t, 0.0) for t, c in zip(self._knots, self._coeffs))
        xp = _namespace(r)
        out = self._intercept + self._slope * r
        for t, c in zip(self._knots, self._coeffs):
            out = out + c * xp.clip(r - t, min=0.0)
        return out

    @property
    def is_even(self) -> bool:
        """Whether ``f(r) == f(-r)`` up to rounding (then its sliced kernel is radial)."""
        other = self.reflect()
        if other.knots != tuple(-t for t in reversed(other.knots)) or len(other.knots) != len(self.knots):
            return False
        scale = max([abs(c) for c in self._coeffs] + [abs(self._slope), abs(self._intercept), 1.0])
        pairs = list(zip(self._knots + self._coeffs + (self._slope, self._intercept),
                         other._knots + other._coeffs + (other._slope, other._intercept)))
        return all(abs(a - b) <= 1e-12 * scale for a, b in pairs)


def _reflected(knots, coeffs, slope, intercept):
    """``(knots, coeffs, slope, intercept)`` of ``r -> f(-r)``; float or array parameters.

    ``ReLU(-r - t) = ReLU(r + t) - (r + t)``: the knots flip, the coefficients stay, and the linear
    part absorbs ``-sum_m c_m (r + t_m)``.
    """
    total, moment = 0.0, 0.0
    for t, c in zip(knots, coeffs):
        total = total + c
        moment = moment + c * t
    return tuple(-t for t in knots), tuple(coeffs), -slope - total, intercept - moment


def _namespace(r):
    import array_api_compat
    return array_api_compat.array_namespace(r)


class ReLU(PiecewiseLinear):
    """``max(r, 0)``: the sliced ReLU attention profile."""

    __slots__ = ()

    def __init__(self):
        super().__init__((0.0,), (1.0,))

    def __repr__(self):
        return "ReLU()"


class Abs(PiecewiseLinear):
    """``|r| = 2 ReLU(r) - r``: the energy-distance profile."""

    __slots__ = ()

    def __init__(self):
        super().__init__((0.0,), (2.0,), slope=-1.0)

    def __repr__(self):
        return "Abs()"


class Hat(PiecewiseLinear):
    """The ReLU bump ``max(0, 1 - |r| / b)`` of bandwidth ``b > 0``.

    Parameters
    ----------
    bandwidth : float
        Half-width ``b`` of the support.
    """

    __slots__ = ()

    def __init__(self, bandwidth: float = 1.0):
        b = positive_real(bandwidth, "bandwidth")
        p = hat_profile((b,), (1.0,))
        super().__init__(p.knots, p.coeffs, p.slope, p.intercept)

    @property
    def bandwidth(self) -> float:
        return self.knots[-1]

    def __repr__(self):
        return f"Hat({self.bandwidth!r})"


def check_hat_count(count: int, name: str) -> None:
    """``ValueError`` for a mixture of no hat: the one answer of this class, the mixture op and the
    decoding cache, as the layers refuse ``mixture_size=0`` (the zero profile is ``PiecewiseLinear()``,
    asked for by name)."""
    if count == 0:
        raise ValueError(f"argument {name!r} must hold at least one hat, got none")


class HatMixture(PiecewiseLinear):
    """``sum_i weights[i] * max(0, 1 - |r| / bandwidths[i])``.

    Parameters
    ----------
    bandwidths : sequence of float, length K >= 1
        Positive finite bandwidths.
    weights : sequence of float, length K
        Finite mixture weights (any sign).
    """

    __slots__ = ()

    def __init__(self, bandwidths: Sequence[float], weights: Sequence[float]):
        bandwidths = tuple(positive_real(b, "bandwidths") for b in bandwidths)
        weights = tuple(finite_real(w, "weights") for w in weights)
        if len(bandwidths) != len(weights):
            raise ValueError(f"bandwidths and weights must have the same length, got {len(bandwidths)} "
                             f"and {len(weights)}")
        check_hat_count(len(bandwidths), "bandwidths")
        p = hat_profile(bandwidths, weights)
        super().__init__(p.knots, p.coeffs, p.slope, p.intercept)


def is_fixed(value) -> bool:
    """Whether a profile parameter is a fixed Python number (else an array: differentiable).

    NumPy turns arithmetic on 0-d arrays into NumPy scalars, which are ``float`` subclasses but
    still parameters the caller passed as arrays, so the test is on the exact type.
    """
    return type(value) in (int, float)


class Profile:
    """A profile ``intercept + slope r + sum_m coeffs[m] ReLU(r - knots[m])`` whose parameters may be
    arrays (per batch row: per-head bandwidths), as the engines evaluate it.

    Parameters
    ----------
    knots, coeffs : tuple
        Floats, or arrays of (a shape broadcastable to) the problem's batch shape.
    slope, intercept : float or array
    columns : slice
        The weight columns the profile is summed over.
    derivative : bool
        Sum ``f'(x_i - y_j) w_j`` instead of ``f``.
    strict_knots : tuple of bool, optional
        Per knot, whether the knot's own gradient counts a tie ``x - y = t_m`` as below the knot
        (``H(0) = 0``) rather than at it (``H(0) = 1``): chosen by a parametric family so that its
        parameter gradients are one-sided derivatives (see :func:`hat_profile`).
    """

    __slots__ = ("knots", "coeffs", "slope", "intercept", "columns", "derivative", "strict_knots")

    def __init__(self, knots, coeffs, slope=0.0, intercept=0.0, columns=slice(None), derivative=False,
                 strict_knots=None):
        self.knots, self.coeffs = tuple(knots), tuple(coeffs)
        self.slope, self.intercept = slope, intercept
        self.columns, self.derivative = columns, derivative
        self.strict_knots = tuple(strict_knots) if strict_knots is not None else (False,) * len(self.knots)

    @classmethod
    def of(cls, kernel: PiecewiseLinear, **kw) -> Profile:
        return cls(kernel.knots, kernel.coeffs, kernel.slope, kernel.intercept, **kw)

    def reflect(self, **kw) -> Profile:
        """The profile ``r -> f(-r)`` (float or array parameters)."""
        return Profile(*_reflected(self.knots, self.coeffs, self.slope, self.intercept), **kw)

    def with_(self, **kw) -> Profile:
        return Profile(self.knots, self.coeffs, self.slope, self.intercept,
                       kw.get("columns", self.columns), kw.get("derivative", self.derivative),
                       self.strict_knots)

    @property
    def is_fixed(self) -> bool:
        """Whether every parameter is a Python number."""
        return all(is_fixed(p) for p in self.knots + self.coeffs + (self.slope, self.intercept))

    def __call__(self, r, xp):
        """Dense evaluation on differences ``r`` (..., n, m); array parameters have batch shape (...)."""
        def lift(p):
            return p if is_fixed(p) else xp.astype(p, r.dtype)[..., None, None]
        out = lift(self.intercept) + lift(self.slope) * r
        for t, c in zip(self.knots, self.coeffs):
            out = out + lift(c) * xp.clip(r - lift(t), min=0.0)
        return out


def hat_profile(bandwidths, weights) -> Profile:
    """The mixture ``sum_i weights[i] max(0, 1 - |r| / bandwidths[i])`` as a :class:`Profile`.

    ``b max(0, 1 - |r| / a) = (b / a) (ReLU(r + a) - 2 ReLU(r) + ReLU(r - a))``: knots ``-a_i, +a_i``
    per hat and one shared knot at 0 (last). Parameters are floats or batch-shaped arrays.
    At a tie ``|x - y| = a`` the bandwidth gradient is the right derivative (``a`` increasing): the
    ``+a`` knot counts the tie below it, the ``-a`` knot at it (docs/mathematics.rst, "The backward pass").
    """
    knots, coeffs, strict, centre = [], [], [], 0.0
    for a, b in zip(bandwidths, weights):
        knots += [-a, a]
        coeffs += [b / a, b / a]
        strict += [False, True]
        centre = centre - 2.0 * b / a
    return Profile(tuple(knots) + (0.0,), tuple(coeffs) + (centre,), strict_knots=tuple(strict) + (False,))


def hat_pullback(bandwidths, weights, dknots, dcoeffs):
    """Chain rule from the knots / coefficients of :func:`hat_profile` back to its parameters.

    ``dknots``, ``dcoeffs`` are aligned with the profile's knots (``None`` where not needed).
    Returns ``(dbandwidths, dweights)``: lists with ``None`` for fixed (float) parameters.
    """
    def plus(a, b):
        if a is None:
            return b
        return a if b is None else a + b

    d_centre = dcoeffs[-1]
    dalpha, dbeta = [], []
    for i, (a, b) in enumerate(zip(bandwidths, weights)):
        dk_neg, dk_pos = dknots[2 * i], dknots[2 * i + 1]
        dc = plus(dcoeffs[2 * i], dcoeffs[2 * i + 1])
        if d_centre is not None:
            dc = plus(dc, -2.0 * d_centre)
        da = None
        if not is_fixed(a):
            da = plus(dk_pos, None if dk_neg is None else -dk_neg)
            if dc is not None:
                da = plus(da, -dc * b / (a * a))
        dalpha.append(da)
        dbeta.append(None if is_fixed(b) or dc is None else dc / a)
    return dalpha, dbeta


class KernelFamily(Protocol):
    """A learnable family of profiles: what an op with array kernel parameters (per-head bandwidths,
    mixture weights) tells the engines, which see only the :class:`Profile` it gives.

    A family is registered by name (:func:`register_family`); an attention spec names it and holds
    its fixed numbers (``fixed``, a tuple the family reads as it likes) beside the array parameters
    (``params``, by name: the spec's ``param_layout``). Adding a family is a class here (or in user
    code) and an op whose signature takes its parameters (docs/architecture.rst, "Kernel families").
    """

    #: the name specs refer to it by (their text form, for ``torch.compile``, carries only names)
    name: str

    def profile(self, fixed: tuple, params: Mapping[str, Any]) -> Profile:
        """The value profile; array parameters have the batch shape (or broadcast to it)."""

    def pullback(self, xp, fixed: tuple, params: Mapping[str, Any], dknots, dcoeffs) -> dict:
        """Each array parameter's gradient from the profile's knot and coefficient gradients
        (aligned with :meth:`profile`'s knots, None where not needed): ``{name: array}`` of a shape
        that broadcasts to the parameter's (the caller sums it to that shape)."""

    def rows_ok(self, xp, fixed: tuple, params: Mapping[str, Any]):
        """(batch) bool, True where the array parameters are valid, or None when none can be bad:
        the public layer rejects the bad values it can read, but traced ones (``jax.jit``,
        ``torch.compile``) reach the engines, which make those batch rows NaN instead."""


#: the registered families by name (:func:`register_family`)
_FAMILIES: dict[str, KernelFamily] = {}


def register_family(family: KernelFamily) -> KernelFamily:
    """Register ``family`` under ``family.name`` (a name taken by another family is a ``ValueError``)
    and return it: ``FAMILY = register_family(MyFamily())``."""
    taken = _FAMILIES.get(family.name)
    if taken is not None and taken is not family:
        raise ValueError(f"a kernel family named {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def family_named(name: str) -> KernelFamily:
    """The registered family ``name``."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"no kernel family named {name!r}; registered: {sorted(_FAMILIES)}") from None


class HatFamily:
    """Mixtures of hats, ``sum_i w_i max(0, 1 - |r| / b_i)`` (:func:`hat_profile`), as a
    :class:`KernelFamily` named ``"hat"``.

    ``fixed`` is ``(bandwidths, weights)``, tuples of floats for the parameters given as numbers;
    the array parameters are ``"bandwidth"`` (one hat, batch shape), or ``"bandwidths"`` and
    ``"weights"`` (a mixture, batch + (K,)).
    """

    name = "hat"

    @staticmethod
    def hats(fixed: tuple, params: Mapping[str, Any]) -> tuple[list, list]:
        """Per-hat bandwidths and weights: floats, or arrays of the batch shape."""
        if "bandwidth" in params:
            bandwidths = [params["bandwidth"]]
        elif "bandwidths" in params:
            arr = params["bandwidths"]
            bandwidths = [arr[..., i] for i in range(arr.shape[-1])]
        else:
            bandwidths = list(fixed[0])
        if "weights" in params:
            arr = params["weights"]
            weights = [arr[..., i] for i in range(arr.shape[-1])]
        else:
            weights = list(fixed[1])
        return bandwidths, weights

    def profile(self, fixed, params):
        return hat_profile(*self.hats(fixed, params))

    def pullback(self, xp, fixed, params, dknots, dcoeffs):
        dalpha, dbeta = hat_pullback(*self.hats(fixed, params), dknots, dcoeffs)
        grads = {}
        for name in params:
            if name == "bandwidth":
                grads[name] = dalpha[0]
            elif name == "bandwidths":
                grads[name] = xp.stack(dalpha, axis=-1)
            else:
                grads[name] = xp.stack(dbeta, axis=-1)
        return grads

    def rows_ok(self, xp, fixed, params):
        ok = None
        for a in self.hats(fixed, params)[0]:
            if is_fixed(a):
                continue
            good = (a > 0) & xp.isfinite(a)
            ok = good if ok is None else ok & good
        return ok


register_family(HatFamily())
