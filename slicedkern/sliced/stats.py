"""Two-sample statistics: the energy distance and the MMD of a sliced kernel.

Both are one 1-D sort-scan :func:`slicedkern.kernel_sum` per slice on the pooled sample
``z = [x, y]`` with weight columns that pick the within- and between-sample sums
(docs/mathematics.rst, "MMD and energy distance"); 1-D samples are exact (one "slice": the samples
themselves).
"""

from __future__ import annotations

import functools
import math
import numbers

import numpy as np

from .._lib.namespace import as_work, broadcast_shapes, shape_str
from .._lib.typing import Array, Namespace
from .._validate import check_kernel, setup
from ..adapters.vjp import composite
from ..backends import compiled_energy_pairs, has_autograd, holds_everywhere, is_chunked, is_traced
from ..kernels import PiecewiseLinear
from ._chunked import COLUMN_FLOATS, ChunkedPlan, chunked_points, chunked_statistic, chunked_weights, host_directions
from ._dense import DenseEnergyPlan, DenseMMDPlan, dense_cost
from ._stat_plans import EnergyPlan, MMDPlan
from .directions import Seed, resolve_directions, same_dim
from .plan import Samples, check_chunk

__all__ = ["energy_distance", "mmd"]

_ESTIMATORS = ("v", "u")


# ------------------------------------------------------------------------------------ the samples
def _layout(x: Array, y: Array, directions: int | Array | None, method: str = "sliced") -> tuple[bool, int]:
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
    if directions is None and method != "exact":
        raise ValueError(f"argument 'directions' is required for {dim}-dimensional samples (x has shape "
                         f"{tuple(x.shape)}): pass a number of slices P or a (P, d) array of unit vectors; "
                         "1-D samples are given as shape (n,) or (..., n, 1)")
    return False, dim


def _sizes(x: Array, y: Array) -> tuple[int, int]:
    """The numbers of samples ``n``, ``m`` of validated layouts."""
    return (x.shape[-1], y.shape[-1]) if x.ndim == 1 else (x.shape[-2], y.shape[-2])


def _samples(xp: Namespace, x: Array, y: Array, exact: bool, work, *shapes: tuple,
             names: tuple[str, ...] = ("x", "y")) -> Samples:
    """The samples in the work dtype, (..., n) scalars when ``exact`` and (..., n, d) points
    otherwise (not broadcast), and the batch shape (with the extra batch ``shapes``)."""
    core = 1 if exact else 2
    xs, ys = as_work(xp, x, work), as_work(xp, y, work)
    if exact and x.ndim >= 2:                               # (..., n, 1) scalars
        xs, ys = xs[..., 0], ys[..., 0]
    batch = broadcast_shapes(tuple(xs.shape[:xs.ndim - core]), tuple(ys.shape[:ys.ndim - core]), *shapes,
                             names=names)
    return Samples(xs, ys, batch)


def _probability_weights(xp: Namespace, weights: Array | None, n: int, name: str, *, device, work) -> Array:
    """Weights (..., n) normalised to sum 1 on their last axis (uniform ones when None)."""
    if weights is None:
        return xp.full((n,), 1.0 / n, dtype=work, device=device)
    if weights.ndim < 1 or weights.shape[-1] != n:
        raise ValueError(f"argument {name!r} must have shape (..., {n}) (one weight per sample), got "
                         f"{shape_str(weights)}")
    weights = as_work(xp, weights, work)
    total = xp.sum(weights, axis=-1, keepdims=True)
    # a NaN weight is no error: its row's statistic is NaN, like that of a NaN point
    if holds_everywhere(xp, weights, lambda ns, a: ~(a < 0)) is False:
        raise ValueError(f"argument {name!r} must be non-negative")
    if holds_everywhere(xp, total, lambda ns, a: ~(a <= 0)) is False:
        raise ValueError(f"argument {name!r} must have a positive sum")
    return weights / total


def _kappa(dim: int) -> float:
    """``E_theta |theta_1| = Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2))`` for theta uniform on S^{d-1}
    (docs/mathematics.rst, "Radial profiles and kappa_d")."""
    return math.exp(math.lgamma(dim / 2) - math.lgamma((dim + 1) / 2)) / math.sqrt(math.pi)


def _symmetric(kernel: PiecewiseLinear) -> PiecewiseLinear:
    """``(f(r) + f(-r)) / 2``: the part of ``f`` a symmetric (sliced) kernel sees."""
    return kernel if kernel.is_even else 0.5 * (kernel + kernel.reflect())


# ---------------------------------------------------------------------------------------- methods
_METHODS = ("auto", "sliced", "exact")

#: Work of the sliced estimate per slice and pooled point and per unit of ``log2 N + d``, in units of
#: one coordinate difference of the blockwise dense sums (:func:`~slicedkern.sliced._dense.dense_cost`).
#: Measured with NumPy on CPU, side by side (n = m = 500 to 4000, d = 3 and 10): 1.2 to 2.3 for d = 3,
#: 0.7 for d = 10; 1.5 is kept (``python -m slicedkern bench --stats`` shows the choice next to both).
SLICE_COST = 1.5
#: The same in units of the compiled dense sums (NumPy and CPU torch outside autograd with numba;
#: slicedkern/backends/_pairs.py): 0.15 (d + 5) ns a pair on one thread against 1.0 to 1.5 ns a
#: unit of the sliced estimate, measured side by side on a shared 2-core machine (d = 3 and 10,
#: n = m = 1000 to 6000, P = 256, the compiled sums on one thread): 7 puts the
#: crossover at n = m of about 3500 for d = 3 and 2600 for d = 10 (measured: about 5000 and 2700).
#: With more threads the compiled sums are faster still, so the rule stays on the safe side.
SLICE_COST_COMPILED = 7.0


def _method(method: str, directions, n: int, m: int, dim: int, *, values_only: bool, traced: bool,
            compiled: bool = False) -> str:
    """``"sliced"`` or ``"exact"`` for the ``method=`` argument (rule in :func:`energy_distance`)."""
    if method not in _METHODS:
        raise ValueError(f"argument 'method' must be one of {_METHODS}, got {method!r}")
    if method != "auto":
        return method
    if isinstance(directions, bool) or not isinstance(directions, numbers.Integral):
        return "sliced"                  # given directions: the caller asked for these slices
    if values_only or traced:
        return "sliced"
    # the cost of the P slices asked for: their family (docs/directions.rst) changes their accuracy,
    # not their cost, and the exact statistic is at least as accurate as any P
    size = n + m
    sliced = (SLICE_COST_COMPILED if compiled else SLICE_COST) * int(directions) * size * (math.log2(size) + dim)
    return "exact" if dense_cost(n, m, dim, compiled=compiled) <= sliced else "sliced"


# ------------------------------------------------------------------------------ chunked (Dask)
def _chunked_layout(x: Array, y: Array, exact: bool, dim: int, directions, method: str, seed: Seed):
    """Points (n, d), (m, d) and host directions of Dask samples; ``method="exact"`` in R^d refused."""
    if not exact and method == "exact":
        raise ValueError("argument 'method': 'exact' is not offered for Dask arrays in R^d (it sums all n m "
                         "pairs); use 'sliced' (what 'auto' takes for Dask arrays)")
    theta = np.ones((1, 1)) if exact else host_directions(directions, dim, seed)
    return chunked_points(x, "x", exact), chunked_points(y, "y", exact), theta


def _energy_block(xb, yb, a, b):
    """The in-memory energy distances of projections (P_block, n) and (P_block, m): (P_block,)."""
    return energy_distance(xb[..., None], yb[..., None], x_weights=a, y_weights=b)


def _mmd_block(xb, yb, a, b, *, kernel, estimator):
    """The in-memory MMDs of projections (P_block, n) and (P_block, m): (P_block,)."""
    return mmd(xb[..., None], yb[..., None], kernel, estimator=estimator)


# ------------------------------------------------------------------------------- energy distance
def _plan_energy_distance(x: Array, y: Array, *, directions: int | Array | None = None,
                          x_weights: Array | None = None, y_weights: Array | None = None,
                          chunk_size: int | None = None, seed: Seed = None, method: str = "auto",
                          xp: Namespace | None = None) -> EnergyPlan | DenseEnergyPlan | ChunkedPlan:
    """The plan of :func:`energy_distance` (same arguments), after validating them."""
    named = {"x": x, "y": y, "x_weights": x_weights, "y_weights": y_weights}
    setting = setup(named, xp, required=("x", "y"), chunked=True)
    xp, device, out_dtype, work = setting
    if method not in _METHODS:
        raise ValueError(f"argument 'method' must be one of {_METHODS}, got {method!r}")
    exact, dim = _layout(x, y, directions, method)
    n, m = _sizes(x, y)
    if n == 0 or m == 0:
        raise ValueError(f"arguments 'x' and 'y' must hold at least one sample each, got {shape_str(x)} and "
                         f"{shape_str(y)}")
    chunk_size = check_chunk(chunk_size)
    if is_chunked(xp):                  # Dask: a lazy plan over whole projected columns
        xs, ys, theta = _chunked_layout(x, y, exact, dim, directions, method, seed)
        weights = chunked_weights(x_weights, "x_weights", n), chunked_weights(y_weights, "y_weights", m)
        return chunked_statistic(xp, xs, ys, weights, _energy_block, theta=theta,
                                 scale=1.0 if exact else 1.0 / (_kappa(dim) * theta.shape[0]),
                                 per_point=COLUMN_FLOATS["energy_distance"],
                                 chunk_size=chunk_size, out_dtype=out_dtype, work=work)
    a = _probability_weights(xp, x_weights, n, "x_weights", device=device, work=work)
    b = _probability_weights(xp, y_weights, m, "y_weights", device=device, work=work)
    samples = _samples(xp, x, y, exact, work, tuple(a.shape[:-1]), tuple(b.shape[:-1]),
                       names=("x", "y", "x_weights", "y_weights"))
    traced = any(is_traced(v) for v in named.values() if v is not None)
    compiled = not exact and not traced and compiled_energy_pairs(xp, x, y, x_weights, y_weights)
    if not exact and _method(method, directions, n, m, dim, values_only=False, traced=traced,
                             compiled=compiled) == "exact":
        raw = {k: None if w is None else as_work(xp, w, work) for k, w in (("x_weights", x_weights),
                                                                          ("y_weights", y_weights))}
        return DenseEnergyPlan(setting, samples, (a, b), raw=raw)
    theta = None if exact else resolve_directions(directions, dim, xp=xp, device=device, work=work, seed=seed)
    # E_theta |<theta, z>| = kappa_d |z|: dividing by kappa_d makes the sliced estimate unbiased
    return EnergyPlan(setting, samples, theta, (a, b), {"x_weights": x_weights, "y_weights": y_weights},
                      squeeze=exact and x.ndim >= 2, per_point=4, weight=1.0 / _kappa(dim), chunk_size=chunk_size)


@composite(_plan_energy_distance)
def energy_distance(x: Array, y: Array, *, directions: int | Array | None = None, x_weights: Array | None = None,
                    y_weights: Array | None = None, chunk_size: int | None = None, seed: Seed = None,
                    method: str = "auto", xp: Namespace | None = None) -> Array:
    """Energy distance ``ED = 2 E|X - Y| - E|X - X'| - E|Y - Y'|`` between two samples.

    Székely's energy distance, not its square root: for 1-D samples it equals
    ``scipy.stats.energy_distance(x, y, u_weights, v_weights) ** 2``. In 1-D it is exact and costs
    ``O(N log N)`` (``N = n + m``): the integral of the squared gap between the empirical CDFs over
    the pooled sample, with the gap formed from exact running sums (relative error about ``1e-16``
    however alike the samples; docs/mathematics.rst, "Exact 1-D statistics"). In R^d (``d > 1``)
    it is either the sliced estimate, the mean over the directions ``theta_p`` of that exact 1-D
    statistic of the projections rescaled by ``1 / kappa_d``,
    ``kappa_d = Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2)) = E_theta |theta_1|`` (unbiased over random
    directions), or the exact statistic with Euclidean distances (``method``).

    Parameters
    ----------
    x : array, shape (n,) or (..., n, d)
        First sample. A 1-D array is ``n`` scalars; otherwise the last axis holds the coordinates
        and the one before it the samples; leading axes are batch axes (one statistic each). Scalar
        samples with batch axes are given as (..., n, 1).
    y : array, shape (m,) or (..., m, d)
        Second sample, laid out like ``x``, with the same ``d``.
    directions : int or array, shape (P, d), optional
        Required when ``d > 1`` (unless ``method="exact"``), as in :func:`sliced_kernel_sum`: an
        integer ``P`` draws the family of ``default_method(P, d)``: the statistics' profiles are
        even, so ``"projective"``, one of each antipodal pair of the QMC slicing design of ``2 P``,
        which gives the design's estimate at the cost of ``P`` slices (docs/directions.rst);
        ignored when ``d == 1`` (exact).
    x_weights : array, shape (..., n), optional
        Non-negative probability weights of ``x`` (normalised to sum 1, like ``u_weights`` of
        ``scipy.stats.energy_distance``); uniform when omitted.
    y_weights : array, shape (..., m), optional
        Weights of ``y``.
    chunk_size : int, optional
        Slices per 1-D call (default: bounded memory).
    seed : None, int or numpy.random.Generator, optional
        Seed of the directions when ``directions`` is an integer.
    method : {"auto", "sliced", "exact"}, default "auto"
        In R^d: ``"sliced"`` the sliced estimate, ``O(P N (log N + d))``; ``"exact"`` the dense
        statistic ``2 E|X - Y| - E|X - X'| - E|Y - Y'|`` with Euclidean norms, in ``O(N^2 d)``
        time and bounded memory (``directions`` may then be omitted): compiled (numba, each
        within-sample pair once, parallel for large samples) for NumPy arrays and CPU torch tensors
        that record no gradient, summed blockwise in array operations otherwise. ``"auto"`` takes
        ``"exact"`` when ``directions`` is an integer ``P`` (random directions: the exact statistic
        is what they estimate) and the exact sums are the cheaper: compiled, when
        ``(n m + (n^2 + m^2) / 2) (d + 5) <= 7 P N (log2 N + d)`` (``SLICE_COST_COMPILED``);
        blockwise, when ``(n^2 + n m + m^2) (d + 3) <= 1.5 P N (log2 N + d)`` (``SLICE_COST``);
        both constants measured on NumPy (docs/mathematics.rst, "Exact statistics in R^d"). Else,
        and with a directions array, it is ``"sliced"``. For example ``d = 3``, NumPy: exact up
        to ``n = m`` of about 3500 at ``P = 256``, 750 at ``P = 64``; torch under autograd: 560
        at ``P = 256``. The rule prices the ``P`` slices asked for, whatever their family: a QMC
        design makes those ``P`` slices more accurate, not cheaper, and where the exact sums cost
        less they are also exact (docs/directions.rst, "How the statistics choose between exact and sliced"). For
        Dask arrays ``"exact"`` in R^d is refused (all ``n m`` pairs) and ``"auto"`` is
        ``"sliced"``.
        Ignored for 1-D samples (always exact).
    xp : array namespace, optional

    Returns
    -------
    array, shape (...)
        The batch shape (0-d for one pair of samples); namespace, device and floating dtype of the
        inputs. Differentiable w.r.t. ``x``, ``y`` and the weights under torch autograd and
        ``jax.grad``; :func:`slicedkern.vjp` pulls back the sort-scan form of the same statistic
        (``x`` and ``y``). For Dask arrays, a lazy 0-d Dask array (see Notes), with no gradient.

    Raises
    ------
    TypeError
        Arrays from different libraries or devices, non-floating dtypes.
    ValueError
        Mismatched layouts or dimensions, missing ``directions`` when ``d > 1``, empty samples,
        weights of the wrong length, negative or all-zero weights (checked when not traced; for
        Dask arrays on ``.compute()``). For Dask arrays also: batch axes, ``method="exact"`` in
        R^d, a direction larger than ``slicedkern.max-column-bytes``.
    MemoryError
        Dask on a ``dask.distributed`` cluster: a block of directions larger than its worker's
        memory limit (on ``.compute()``, before the block runs).

    Notes
    -----
    The 1-D statistic (and that of each slice) is a sum of non-negative terms, so it is never
    negative. NumPy float64 samples use a compiled merge (numba, when installed) of the two
    samples sorted separately; other libraries the same arithmetic in array-API operations. The
    exact statistic in R^d is a difference of sums; for nearly equal samples its relative error
    grows like ``eps E|X - Y| / ED``.

    **Dask arrays** ``x`` (n, d), ``y`` (m, d) and the weights (n,), (m,), chunked by rows in any
    way (no batch axes), give a lazy result equal to the NumPy call to rounding: the points are
    projected blockwise, regrouped so that each block holds all ``n + m`` projections on
    ``chunk_size`` directions (default: as many as fit Dask's ``array.chunk-size``), and each block
    runs the in-memory 1-D statistic on one worker; the values are averaged over the directions
    (docs/scaling.rst, "Dask"). Memory model: one direction's column is sorted whole, so a worker
    needs about ``6 (n + m)`` float64 numbers per direction of its block, and reads the ``(n + m) d``
    points when ``P > d`` (else the projections are regrouped). A direction needing more
    than the Dask configuration ``slicedkern.max-column-bytes`` (default 4 GiB) is refused when the
    graph is built; never a silent wrong answer. Chunks along the feature axis are merged first
    (each row chunk then holds whole points). 1-D samples are one column, sorted on one worker.
    Dask has no autograd: :func:`slicedkern.vjp` refuses Dask arrays.

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern.sliced import energy_distance
    >>> x, y = np.array([0.0, 1.0]), np.array([0.0, 3.0])
    >>> float(energy_distance(x, y))  # 2 * 1.5 - 0.5 - 1.5
    1.0
    """
    return _plan_energy_distance(x, y, directions=directions, x_weights=x_weights, y_weights=y_weights,
                                 chunk_size=chunk_size, seed=seed, method=method, xp=xp).forward()


# ------------------------------------------------------------------------------------------- MMD
def _plan_mmd(x: Array, y: Array, kernel: PiecewiseLinear, *, directions: int | Array | None = None,
              estimator: str = "v", chunk_size: int | None = None, seed: Seed = None,
              method: str = "auto", xp: Namespace | None = None) -> MMDPlan | DenseMMDPlan | ChunkedPlan:
    """The plan of :func:`mmd` (same arguments), after validating them."""
    setting = setup({"x": x, "y": y}, xp, required=("x", "y"), chunked=True)
    xp, device, out_dtype, work = setting
    check_kernel(kernel)
    if estimator not in _ESTIMATORS:
        raise ValueError(f"argument 'estimator' must be one of {_ESTIMATORS}, got {estimator!r}")
    if method not in _METHODS:
        raise ValueError(f"argument 'method' must be one of {_METHODS}, got {method!r}")
    exact, dim = _layout(x, y, directions, method)
    n, m = _sizes(x, y)
    least = 2 if estimator == "u" else 1
    if n < least or m < least:
        raise ValueError(f"arguments 'x' and 'y' must hold at least {least} samples each for "
                         f"estimator={estimator!r}, got {shape_str(x)} and {shape_str(y)}")
    chunk_size = check_chunk(chunk_size)
    if is_chunked(xp):                  # Dask: a lazy plan over whole projected columns
        xs, ys, theta = _chunked_layout(x, y, exact, dim, directions, method, seed)
        block = functools.partial(_mmd_block, kernel=kernel, estimator=estimator)
        return chunked_statistic(xp, xs, ys, (None, None), block, theta=theta, scale=1.0 / theta.shape[0],
                                 per_point=COLUMN_FLOATS["mmd"], chunk_size=chunk_size, out_dtype=out_dtype,
                                 work=work)
    kernel = _symmetric(kernel)
    samples = _samples(xp, x, y, exact, work)
    if estimator == "v":
        coef, shift = (1.0 / (n * n), -2.0 / (n * m), 1.0 / (m * m)), 0.0
    else:
        coef = (1.0 / (n * (n - 1)), -2.0 / (n * m), 1.0 / (m * (m - 1)))
        shift = -kernel(0.0) * (1.0 / (n - 1) + 1.0 / (m - 1))      # the i = j terms, f(0) each
    # the radial profile is evaluated on the host: "auto" keeps autograd libraries and traces sliced
    traced = is_traced(x) or is_traced(y)
    chosen = _method(method, directions, n, m, dim, values_only=has_autograd(xp), traced=traced)
    if not exact and chosen == "exact":
        return DenseMMDPlan(setting, samples, kernel=kernel, coef=coef, shift=shift)
    theta = None if exact else resolve_directions(directions, dim, xp=xp, device=device, work=work, seed=seed)
    return MMDPlan(setting, samples, theta, kernel=kernel, estimator=estimator, coef=coef, shift=shift,
                   squeeze=exact and x.ndim >= 2, per_point=8, weight=1.0, chunk_size=chunk_size)


@composite(_plan_mmd)
def mmd(x: Array, y: Array, kernel: PiecewiseLinear, *, directions: int | Array | None = None,
        estimator: str = "v", chunk_size: int | None = None, seed: Seed = None, method: str = "auto",
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
        Required when ``d > 1`` (unless ``method="exact"``), as in :func:`sliced_kernel_sum`: an
        integer ``P`` draws the family of ``default_method(P, d)``: the statistics' profiles are
        even, so ``"projective"``, one of each antipodal pair of the QMC slicing design of ``2 P``,
        which gives the design's estimate at the cost of ``P`` slices (docs/directions.rst);
        ignored when ``d == 1`` (exact).
    estimator : {"v", "u"}, default "v"
        Biased V-statistic or unbiased U-statistic (needs ``n, m >= 2``).
    chunk_size : int, optional
        Slices per 1-D call (default: bounded memory).
    seed : None, int or numpy.random.Generator, optional
        Seed of the directions when ``directions`` is an integer.
    method : {"auto", "sliced", "exact"}, default "auto"
        In R^d: ``"sliced"`` the estimate with ``P`` directions; ``"exact"`` the limit ``P -> inf``,
        ``K(a, b) = Phi(|a - b|)`` with the radial profile ``Phi`` of :func:`radial_profile`, summed
        blockwise in ``O(N^2 d)`` time and bounded memory (``directions`` may be omitted). ``Phi``
        is evaluated on the host: the exact MMD has values and :func:`slicedkern.vjp`, but torch
        autograd and ``jax.grad`` do not see through it, and it cannot be traced. ``"auto"`` takes
        ``"exact"`` under the rule of :func:`energy_distance` (``directions`` an integer and the
        dense sums cheaper), and only for libraries without autograd (NumPy, CuPy, array-api-strict)
        outside traces; otherwise ``"sliced"``. For Dask arrays ``"exact"`` in R^d is refused and
        ``"auto"`` is ``"sliced"``. Ignored for 1-D samples (always exact).
    xp : array namespace, optional

    Returns
    -------
    array, shape (...)
        The batch shape (0-d for one pair of samples); namespace, device and floating dtype of the
        inputs. The sliced and 1-D statistics are differentiable w.r.t. ``x`` and ``y`` under torch
        autograd and ``jax.grad`` (sliced-MMD flows) and with :func:`slicedkern.vjp`. For Dask
        arrays, a lazy 0-d Dask array (see Notes), with no gradient.

    Raises
    ------
    TypeError
        Arrays from different libraries or devices, non-floating dtypes, a kernel that is not a
        :class:`~slicedkern.kernels.PiecewiseLinear`.
    ValueError
        Mismatched layouts or dimensions, missing ``directions`` when ``d > 1``, an unknown
        ``estimator``, too few samples; for Dask arrays also batch axes, ``method="exact"`` in
        R^d, a direction larger than ``slicedkern.max-column-bytes``.
    MemoryError
        Dask on a ``dask.distributed`` cluster: a block of directions larger than its worker's
        memory limit (on ``.compute()``).

    Notes
    -----
    Each slice (and a 1-D pair of samples) is evaluated exactly as a combination of integrals of
    squared windows of the CDF gap (docs/mathematics.rst, "Exact 1-D statistics"): relative error
    about ``1e-16`` for hats and positive mixtures of hats even for nearly equal samples. The
    pullback differentiates the same statistic as one sort-scan per slice on the pooled sample
    ``[x, y]`` with two weight columns (membership of ``x`` and of ``y``). In every slice
    ``K(x_i, x_i) = f(0)``, so the U-statistic subtracts ``n f(0)`` from the within-sample sums. The
    V-statistic is non-negative for positive-definite kernels (e.g. hats); the U-statistic can be negative.

    **Dask arrays** ``x`` (n, d) and ``y`` (m, d), chunked by rows, give a lazy result equal to the
    NumPy call to rounding, laid out as for :func:`energy_distance` (whole projected columns per
    block, the in-memory 1-D MMD on each). Memory model: about ``24 (n + m)`` float64 numbers per
    direction on one worker (the column and the 1-D MMD's working arrays; the points too when
    ``P > d``), refused beyond the Dask
    configuration ``slicedkern.max-column-bytes``. No gradients.

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
                     method=method, xp=xp).forward()
