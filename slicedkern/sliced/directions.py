"""Unit directions of R^d for slicing, and the ``directions=`` argument of the sliced ops.

Directions are drawn on the host with NumPy from a seed, so one seed gives the same directions on
every backend; they are data, not a differentiable function of anything (docs/mathematics.rst,
"Slicing in R^d", and docs/directions.rst, "Choosing directions", for the four families and the
default of the sliced ops).
"""

from __future__ import annotations

import math
import numbers

import array_api_compat as compat
import numpy as np

from .._lib.namespace import array_device, has_float64, shape_str
from .._lib.typing import Array, Namespace
from .._validate import floating_param
from ..backends import is_numpy_namespace
from ._design import unrotated_design

__all__ = ["directions", "resolve_directions", "default_method", "positive_int", "same_dim", "Seed"]

#: What ``numpy.random.default_rng`` accepts as a seed (a fresh one at every call when None).
Seed = int | np.random.Generator | None

_METHODS = ("random", "orthogonal", "sobol", "design", "projective")


def positive_int(value: object, name: str) -> int:
    """``value`` as a positive Python integer, or ``TypeError`` / ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"argument {name!r} must be a positive integer, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"argument {name!r} must be a positive integer, got {value}")
    return int(value)


def same_dim(a: Array, b: Array, names: tuple[str, str]) -> int:
    """The common dimension ``d >= 1`` of the last axes of ``a`` and ``b`` (the space sliced)."""
    dim = a.shape[-1]
    if b.shape[-1] != dim:
        raise ValueError(f"arguments {names[0]!r} and {names[1]!r} must have the same dimension d on their "
                         f"last axis, got {shape_str(a)} and {shape_str(b)}")
    if dim < 1:
        raise ValueError(f"argument {names[0]!r} must have a dimension d >= 1 on its last axis, got "
                         f"{shape_str(a)}")
    return dim


def _gaussian_frames(rng: np.random.Generator, n_slices: int, dim: int) -> np.ndarray:
    """``ceil(n_slices / dim)`` Haar-random orthonormal frames, stacked row-wise, truncated."""
    frames = []
    for _ in range(-(-n_slices // dim)):
        q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
        signs = np.where(np.diag(r) < 0, -1.0, 1.0)     # makes the QR factor Haar-distributed
        frames.append((q * signs).T)
    return np.concatenate(frames, axis=0)[:n_slices]


def _sobol_points(rng: np.random.Generator, n_slices: int, dim: int) -> np.ndarray:
    """Scrambled Sobol' points pushed through the inverse normal CDF (Gaussian, then normalised)."""
    try:
        from scipy.special import ndtri
        from scipy.stats import qmc
    except ImportError as exc:
        raise ImportError("method='sobol' of slicedkern.directions needs SciPy (scipy.stats.qmc); install "
                          "scipy or use method='orthogonal'") from exc
    bits = 30
    try:
        sampler = qmc.Sobol(dim, scramble=True, bits=bits, rng=rng)
    except TypeError:                                    # SciPy < 1.15 calls it ``seed``
        sampler = qmc.Sobol(dim, scramble=True, bits=bits, seed=rng)
    level = max(0, math.ceil(math.log2(n_slices)))     # a power of two keeps the balance properties
    u = sampler.random_base2(level)[:n_slices]
    # the points are multiples of 2^-bits: move them to the cell centres, strictly inside (0, 1)
    return ndtri(u + 2.0 ** -(bits + 1))


def directions(n_slices: int, dim: int, *, method: str = "orthogonal", seed: Seed = None,
               like: Array | None = None) -> Array:
    """Unit directions ``theta_1, ..., theta_P`` of R^d for slicing.

    Parameters
    ----------
    n_slices : int
        Number of directions ``P >= 1``.
    dim : int
        Dimension ``d >= 1``.
    method : {"orthogonal", "random", "sobol", "design", "projective"}, default "orthogonal"
        ``"random"``: i.i.d. uniform on the sphere (normalised Gaussians). ``"orthogonal"``: stacked
        random orthonormal frames (QR of ``d x d`` Gaussian matrices with the sign fix that makes them
        Haar-distributed), ``ceil(P / d)`` frames, truncated to ``P`` rows. ``"sobol"``: scrambled
        Sobol' points (``scipy.stats.qmc.Sobol``, needs SciPy) mapped to Gaussians with the inverse
        normal CDF, then normalised. ``"design"``: a QMC slicing design, a fixed antipodal point set
        of large distance sum (rows ``u_1, -u_1, u_2, -u_2, ...``; for odd ``P`` the design of
        ``P + 1`` without its last row; beyond ``P = 1024``, blocks of 1024 rows and one of the
        rest, each such a set under a fixed rotation), the same for every seed up to a Haar-random
        rotation drawn from the seed; built once per ``(P, d)`` and cached, or read from the
        package data for common sizes (docs/directions.rst). ``"projective"``: the rows
        ``u_1, u_2, ...`` of the design of ``2 P``, one of each antipodal pair, under the same
        kind of rotation; for an even profile, where ``theta`` and ``-theta`` give the same slice,
        it gives exactly the estimate of the design of ``2 P`` at the cost of ``P`` slices. Each
        family is uniform on the sphere marginally, so every sliced estimate is unbiased; the
        structured ones have a markedly smaller Monte-Carlo error than i.i.d. directions, and the
        two designs the smallest in most cases (docs/directions.rst has the table and
        :func:`~slicedkern.sliced.directions.default_method` the rule of the sliced ops).
    seed : None, int or numpy.random.Generator, optional
        Seed of ``numpy.random.default_rng``. The same seed gives the same directions on every backend.
    like : array, optional
        When given, the directions are returned in its namespace, on its device, in its floating dtype
        (the default floating dtype of the namespace when ``like`` is not floating).

    Returns
    -------
    array, shape (n_slices, dim)
        Rows of unit norm; a float64 NumPy array when ``like`` is None.

    Raises
    ------
    TypeError
        ``n_slices`` or ``dim`` is not an integer, ``like`` is not an array.
    ValueError
        ``n_slices < 1``, ``dim < 1`` or an unknown ``method``.
    ImportError
        ``method="sobol"`` without SciPy.

    Notes
    -----
    Directions are drawn on the host (NumPy) and then copied to ``like``'s device: they are data, not
    a differentiable function of anything. The designs follow the "QMC slicing" of Hertrich, Jahn
    and Quellmalz, *Fast summation of radial kernels via QMC slicing* (ICLR 2025, arXiv:2410.01316).
    A design is built once per ``(P, d)`` and process: read from the package data for
    ``P = 256, 512, 1024`` and ``d`` in 3-10, 12, 16, 20, 32, 50, 64, 100 (milliseconds), else by a
    descent of 300 steps of ``O(P^2 d)`` each (up to 0.3 s for ``P <= 256``, 1 to 2.6 s for ``P = 1024`` on one
    core).

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern.sliced import directions
    >>> theta = directions(6, 3, seed=0)
    >>> theta.shape, np.allclose(theta[:3] @ theta[:3].T, np.eye(3))
    ((6, 3), True)
    >>> a, b = directions(8, 3, method="design", seed=0), directions(8, 3, method="design", seed=1)
    >>> np.allclose(a[0::2], -a[1::2]), np.allclose(a @ a.T, b @ b.T)   # antipodal; one design, rotated
    (True, True)
    >>> np.allclose(directions(4, 3, method="projective", seed=0), directions(8, 3, method="design", seed=0)[0::2])
    True
    """
    n_slices = positive_int(n_slices, "n_slices")
    dim = positive_int(dim, "dim")
    if method not in _METHODS:
        raise ValueError(f"argument 'method' must be one of {_METHODS}, got {method!r}")
    if like is not None:
        try:
            space = compat.array_namespace(like)
        except TypeError:
            raise TypeError(f"argument 'like' must be an array, got {type(like).__name__}") from None
    rng = np.random.default_rng(seed)
    if method == "random":
        g = rng.standard_normal((n_slices, dim))
    elif method == "orthogonal":
        g = _gaussian_frames(rng, n_slices, dim)
    elif method == "sobol":
        g = _sobol_points(rng, n_slices, dim)
    elif method == "design":
        # a Haar-random rotation of the fixed design: each row uniform on the sphere (unbiased)
        g = unrotated_design(n_slices, dim) @ _gaussian_frames(rng, dim, dim)
    else:
        # one of each antipodal pair of the design of 2P (rows u_1, u_2, ...), the same rotation
        g = unrotated_design(2 * n_slices, dim)[0::2] @ _gaussian_frames(rng, dim, dim)
    theta = g / np.linalg.norm(g, axis=1, keepdims=True)
    if like is None:
        return theta
    device = array_device(like)
    if space.isdtype(like.dtype, "real floating"):
        dtype = like.dtype
    else:
        dtype = space.float64 if has_float64(space, device) else space.float32
    return space.asarray(theta, dtype=dtype, device=device)


def default_method(n_slices: int, dim: int, *, even: bool = True) -> str:
    """The family the sliced ops draw for an integer number of slices ``P`` in R^d.

    The rule follows the measured errors of docs/directions.rst ("Choosing directions"):

    * a profile with an odd part (``even=False``, e.g. ``ReLU``): ``"design"``, whose antipodal
      pairs cancel the odd part exactly;
    * an even profile (the statistics, ``Abs``, hats): ``"projective"``, one of each antipodal pair
      of the design of ``2 P``: for an even profile ``theta`` and ``-theta`` give the same slice, so
      it is the design of ``2 P`` at the cost of ``P`` slices (and at ``P <= d`` the same as one
      orthogonal frame).

    Parameters
    ----------
    n_slices : int
        Number of directions ``P >= 1``.
    dim : int
        Dimension ``d >= 1``.
    even : bool, default True
        Whether the 1-D profile the directions serve is even (its odd part is zero).

    Returns
    -------
    str
        ``"design"`` or ``"projective"``, a ``method`` of :func:`~slicedkern.directions`.

    Examples
    --------
    >>> from slicedkern.sliced.directions import default_method
    >>> default_method(256, 3), default_method(256, 3, even=False)
    ('projective', 'design')
    """
    return "projective" if even else "design"


def resolve_directions(value: int | Array | None, dim: int, *, xp: Namespace, device: object, work: object,
                       seed: Seed, even: bool = True) -> Array:
    """The ``directions=`` argument of the sliced ops as a (P, d) array of ``xp`` in the work dtype.

    An integer ``P`` draws ``directions(P, dim, method=default_method(P, dim, even=even), seed=seed)``
    (``even``: whether the op's 1-D profile is even); a host (NumPy) array is moved to the samples'
    namespace and device; any other array must already live there.
    """
    if value is None:
        raise ValueError(f"argument 'directions' is required for {dim}-dimensional samples: pass a number "
                         "of slices P or a (P, d) array of unit vectors (see slicedkern.directions)")
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        n_slices = positive_int(value, "directions")
        theta = directions(n_slices, dim, method=default_method(n_slices, dim, even=even), seed=seed)
        return xp.asarray(theta, dtype=work, device=device)
    if isinstance(value, bool) or isinstance(value, numbers.Number):
        raise TypeError(f"argument 'directions' must be a positive integer or a (P, d) array, got "
                        f"{type(value).__name__}")
    if isinstance(value, np.ndarray) and not is_numpy_namespace(xp):
        # host directions (what slicedkern.directions returns by default) are moved to the data
        if value.dtype.kind != "f":
            raise TypeError(f"argument 'directions' must have a real floating dtype, got {shape_str(value)}")
        value = xp.asarray(np.asarray(value, dtype=np.float64), dtype=work, device=device)
    value = floating_param(xp, value, "directions", device, work,
                           expected="a positive integer or a (P, d) array")
    if value.ndim != 2 or value.shape[1] != dim or value.shape[0] < 1:
        raise ValueError(f"argument 'directions' must have shape (P, d) with P >= 1 and d = {dim} (the last "
                         f"axis of the samples), got {shape_str(value)}")
    return value
