"""Sliced kernels in R^d: random directions, multi-slice kernel sums and attention, energy distance,
MMD and the radial profile of a sliced kernel.

A sliced kernel averages a 1-D profile ``f`` over directions ``theta`` of the unit sphere::

    K(x, y) = E_theta f(<theta, x> - <theta, y>)  ~  (1/P) sum_p f(<theta_p, x> - <theta_p, y>)

Every slice is one 1-D sort-scan kernel sum (:func:`slicedkern.kernel_sum`), so a sum over ``n``
queries and ``m`` keys costs ``O(P (n + m) log m)`` instead of ``O(n m d)``. The functions here are
compositions of the public :func:`slicedkern.kernel_sum` / :func:`slicedkern.kernel_attention` with
plain array operations (projections, sums), so gradients flow wherever those two are differentiable
(torch autograd, ``jax.grad``).

Directions are generated on the host with NumPy (:func:`directions`), from a seed, so the same seed
gives the same directions on every backend.

Examples
--------
>>> import numpy as np, slicedkern
>>> from slicedkern.sliced import energy_distance
>>> rng = np.random.default_rng(0)
>>> x, y = rng.normal(size=(500, 3)), rng.normal(size=(400, 3)) + [1.0, 0.0, 0.0]
>>> ed = energy_distance(x, y, directions=256, seed=0)
>>> ed.shape, bool(0.3 < ed < 0.8)
((), True)
"""

from __future__ import annotations

import math
import numbers

import array_api_compat as compat
import numpy as np

from ._api import _check_kernel, _floating, _need_ndim, _setup
from ._namespace import broadcast_shapes, has_float64, holds_everywhere, shape_str
from .kernels import Abs

__all__ = ["directions", "sliced_kernel_sum", "sliced_attention", "energy_distance", "mmd",
           "radial_profile"]

_METHODS = ("random", "orthogonal", "sobol")
_ESTIMATORS = ("v", "u")
_NORMALIZERS = ("abs", "relu", "count", None)

#: Default bound on the number of elements a chunk of slices works on (projections, prefix sums,
#: outputs): about 64 MiB of float64 per array; ``chunk_size=`` overrides it.
_CHUNK_ELEMENTS = 2 ** 23


# ------------------------------------------------------------------------------ public building blocks
def _kernel_sum(*args, **kwargs):
    """The package's public ``kernel_sum``, looked up at call time (it carries the autograd adapters)."""
    from . import kernel_sum
    return kernel_sum(*args, **kwargs)


def _kernel_attention(*args, **kwargs):
    from . import kernel_attention
    return kernel_attention(*args, **kwargs)


# ------------------------------------------------------------------------------------------ checks
def _count(value, name: str) -> int:
    """A positive Python integer, or ``TypeError`` / ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"argument {name!r} must be a positive integer, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"argument {name!r} must be a positive integer, got {value}")
    return int(value)


def _check_chunk(chunk_size):
    return None if chunk_size is None else _count(chunk_size, "chunk_size")


def _work(xp, a, work):
    return a if a.dtype == work else xp.astype(a, work)


def _lift(xp, a, core: int, rank: int):
    """Prepend unit axes so that ``a`` has ``rank`` batch axes in front of its ``core`` trailing axes."""
    extra = rank - (a.ndim - core)
    return a if extra == 0 else xp.reshape(a, (1,) * extra + tuple(a.shape))


def _broadcast(xp, a, batch, core: int):
    return xp.broadcast_to(a, tuple(batch) + tuple(a.shape[a.ndim - core:]))


def _result(xp, out, dtype):
    """``out`` in ``dtype``; NumPy reductions to 0-d give scalars, returned as 0-d arrays instead."""
    out = xp.astype(out, dtype)
    if compat.is_numpy_namespace(xp) and not isinstance(out, np.ndarray):
        out = np.asarray(out)
    return out


def _project(xp, a, theta):
    """``a`` (..., n, d) on the directions ``theta`` (P, d): shape (..., P, n), one row per slice."""
    return xp.matmul(theta, xp.matrix_transpose(a))


def _chunk_for(chunk_size, n_slices, per_slice):
    if chunk_size is not None:
        return min(chunk_size, n_slices)
    return max(1, min(n_slices, _CHUNK_ELEMENTS // max(per_slice, 1)))


class _Plan:
    """A sliced op as ``scale * sum over chunks of reduce(op(*arrays))``, with its explicit pullback.

    ``inner(theta_chunk)`` returns ``(op, arrays, kwargs, back)``: the 1-D op of the chunk (a public
    sort-scan op), its array arguments (projections of the sources on the chunk's directions, or
    sources passed through), and ``back(theta_chunk, grads)`` mapping the op's array gradients to
    gradients of the named sources. ``reduce(theta_chunk, out)`` turns the op's output into the
    chunk's contribution; ``reduce_vjp(theta_chunk, out, g)`` returns the cotangent of ``out`` and
    direct source gradients (for a contribution that also depends on a source, like ``u`` in the
    energy distance). :meth:`pullback` is what :func:`slicedkern.vjp` runs for these composite ops.
    """

    def __init__(self, xp, theta, chunk, inner, reduce, reduce_vjp, scale, out_dtype, finish=None):
        self.xp, self.theta, self.chunk = xp, theta, chunk
        self.inner, self.reduce, self.reduce_vjp = inner, reduce, reduce_vjp
        self.scale, self.out_dtype = scale, out_dtype
        self.finish = finish if finish is not None else (lambda xp_, out: out)

    def _chunks(self):
        n_slices = self.theta.shape[0]
        for start in range(0, n_slices, self.chunk):
            yield self.theta[start:min(start + self.chunk, n_slices), :]

    def forward(self):
        total = None
        for th in self._chunks():
            op, arrays, kwargs, _ = self.inner(th)
            part = self.reduce(th, op(*arrays, xp=self.xp, **kwargs))
            total = part if total is None else total + part
        return _result(self.xp, self.finish(self.xp, total * self.scale), self.out_dtype)

    def pullback(self, g):
        """Gradients of ``sum(g * out)`` with respect to the named sources (a dict)."""
        from ._dispatch import vjp
        grads: dict = {}

        def add(name, value):
            grads[name] = value if name not in grads else grads[name] + value

        g = g * self.scale
        for th in self._chunks():
            op, arrays, kwargs, back = self.inner(th)
            out, pull = vjp(op, *arrays, xp=self.xp, **kwargs)
            cot, direct = self.reduce_vjp(th, out, g)
            for name, value in back(th, pull(cot)[:len(arrays)]).items():
                add(name, value)
            for name, value in direct.items():
                add(name, value)
        return grads


def _unproject(xp, grad, theta):
    """Transpose of :func:`_project`: (..., P, n) gradients to (..., n, d)."""
    return xp.matmul(xp.matrix_transpose(grad), theta)


def _gaussian_frames(rng, n_slices, dim):
    """``ceil(n_slices / dim)`` Haar-random orthonormal frames, stacked row-wise, truncated."""
    frames = []
    for _ in range(-(-n_slices // dim)):
        q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
        signs = np.where(np.diag(r) < 0, -1.0, 1.0)     # makes the QR factor Haar-distributed
        frames.append((q * signs).T)
    return np.concatenate(frames, axis=0)[:n_slices]


def _sobol_points(rng, n_slices, dim):
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


def directions(n_slices, dim, *, method="orthogonal", seed=None, like=None):
    """Unit directions ``theta_1, ..., theta_P`` of R^d for slicing.

    Parameters
    ----------
    n_slices : int
        Number of directions ``P >= 1``.
    dim : int
        Dimension ``d >= 1``.
    method : {"orthogonal", "random", "sobol"}, default "orthogonal"
        ``"random"``: i.i.d. uniform on the sphere (normalised Gaussians). ``"orthogonal"``: stacked
        random orthonormal frames (QR of ``d x d`` Gaussian matrices with the sign fix that makes them
        Haar-distributed), ``ceil(P / d)`` frames, truncated to ``P`` rows. ``"sobol"``: scrambled
        Sobol' points (``scipy.stats.qmc.Sobol``, needs SciPy) mapped to Gaussians with the inverse
        normal CDF, then normalised. Each family is uniform on the sphere marginally; the structured
        ones have a markedly smaller Monte-Carlo error than i.i.d. directions.
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
    a differentiable function of anything.

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern.sliced import directions
    >>> theta = directions(6, 3, seed=0)
    >>> theta.shape, np.allclose(theta[:3] @ theta[:3].T, np.eye(3))
    ((6, 3), True)
    """
    n_slices = _count(n_slices, "n_slices")
    dim = _count(dim, "dim")
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
    else:
        g = _sobol_points(rng, n_slices, dim)
    theta = g / np.linalg.norm(g, axis=1, keepdims=True)
    if like is None:
        return theta
    device = compat.device(like)
    if space.isdtype(like.dtype, "real floating"):
        dtype = like.dtype
    else:
        dtype = space.float64 if has_float64(space, device) else space.float32
    return space.asarray(theta, dtype=dtype, device=device)


def _resolve_directions(value, dim, *, xp, device, work, seed):
    """The directions argument of the sliced ops as a (P, d) array of ``xp`` in the work dtype."""
    if value is None:
        raise ValueError(f"argument 'directions' is required for {dim}-dimensional samples: pass a number "
                         "of slices P or a (P, d) array of unit vectors (see slicedkern.directions)")
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        theta = directions(_count(value, "directions"), dim, method="orthogonal", seed=seed)
        return xp.asarray(theta, dtype=work, device=device)
    if isinstance(value, bool) or isinstance(value, numbers.Number):
        raise TypeError(f"argument 'directions' must be a positive integer or a (P, d) array, got "
                        f"{type(value).__name__}")
    if isinstance(value, np.ndarray) and not compat.is_numpy_namespace(xp):
        # host directions (what slicedkern.directions returns by default) are moved to the data
        if value.dtype.kind != "f":
            raise TypeError(f"argument 'directions' must have a real floating dtype, got {shape_str(value)}")
        value = xp.asarray(np.asarray(value, dtype=np.float64), dtype=work, device=device)
    value = _floating(xp, value, "directions", device, work, expected="a positive integer or a (P, d) array")
    if value.ndim != 2 or value.shape[1] != dim or value.shape[0] < 1:
        raise ValueError(f"argument 'directions' must have shape (P, d) with P >= 1 and d = {dim} (the last "
                         f"axis of the samples), got {shape_str(value)}")
    return value


# ----------------------------------------------------------------------------------- kernel sums
def sliced_kernel_sum(x, y, w, kernel, *, directions, chunk_size=None, seed=None, xp=None,
                      _planning=False):
    """Sliced kernel sum ``S_i = (1/P) sum_p sum_j f(<theta_p, x_i - y_j>) w_j`` in R^d.

    Each slice is one 1-D sort-scan :func:`slicedkern.kernel_sum` of the projected points, so the cost
    is ``O(P (n M + m) log m)`` for ``M`` knots, and memory is bounded by processing ``chunk_size``
    slices at a time (the slice axis is a batch axis of the 1-D sums).

    Parameters
    ----------
    x : array, shape (..., n, d)
        Query points.
    y : array, shape (..., m, d)
        Key points.
    w : array, shape (..., m) or (..., m, c)
        Weights: one scalar per key when ``w.ndim == y.ndim - 1``, ``c`` columns when
        ``w.ndim == y.ndim``.
    kernel : slicedkern.kernels.PiecewiseLinear
        The 1-D profile ``f``.
    directions : int or array, shape (P, d)
        The directions ``theta_p`` (unit vectors), or their number ``P``: then
        ``slicedkern.directions(P, d, method="orthogonal", seed=seed)`` (fresh ones at every call when
        ``seed`` is None). A NumPy array is accepted with samples of any library and moved to their
        device.
    chunk_size : int, optional
        Number of slices per 1-D call. Default: as many as keep each intermediate array below about
        8 Mi elements.
    seed : None, int or numpy.random.Generator, optional
        Seed of the directions when ``directions`` is an integer.
    xp : array namespace, optional
        Inferred from the arrays when omitted.

    Returns
    -------
    array, shape (..., n) or (..., n, c)
        Leading dims broadcast; namespace, device and floating dtype of the inputs.

    Raises
    ------
    TypeError
        Arrays from different libraries or devices, non-floating dtypes, a kernel that is not a
        :class:`~slicedkern.kernels.PiecewiseLinear`.
    ValueError
        Incompatible shapes (``d`` of ``x``, ``y`` and ``directions``, ``m`` of ``y`` and ``w``), missing
        ``directions``, a non-positive ``chunk_size``.

    Notes
    -----
    Projections and sums are computed in float64 where the backend has it (half precision in float32
    or better) and returned in the input dtype. Non-finite inputs give NaN as in ``kernel_sum``.

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern.kernels import Hat
    >>> from slicedkern.sliced import directions, sliced_kernel_sum
    >>> rng = np.random.default_rng(0)
    >>> x, y, w = rng.normal(size=(4, 3)), rng.normal(size=(6, 3)), np.ones(6)
    >>> theta = directions(32, 3, seed=1)
    >>> s = sliced_kernel_sum(x, y, w, Hat(1.0), directions=theta)
    >>> dense = Hat(1.0)((x @ theta.T)[:, None, :] - (y @ theta.T)[None, :, :]).mean(-1) @ w
    >>> s.shape, bool(np.allclose(s, dense))
    ((4,), True)
    """
    xp, device, out_dtype, work = _setup({"x": x, "y": y, "w": w}, xp)
    _check_kernel(kernel)
    _need_ndim(x, "x", 2, "(..., n, d)")
    _need_ndim(y, "y", 2, "(..., m, d)")
    dim = _same_dim(x, y, ("x", "y"))
    if w.ndim == y.ndim - 1:
        vector, w_core = True, 1
    elif w.ndim == y.ndim:
        vector, w_core = False, 2
    else:
        raise ValueError(f"argument 'w' must have shape (..., m) or (..., m, c) with rank y.ndim - 1 or y.ndim "
                         f"({y.ndim - 1} or {y.ndim}), got {shape_str(w)}")
    if w.shape[w.ndim - w_core] != y.shape[-2]:
        raise ValueError(f"arguments 'y' and 'w' must have the same number of keys m, got {shape_str(y)} and "
                         f"{shape_str(w)}")
    batch = broadcast_shapes(tuple(x.shape[:-2]), tuple(y.shape[:-2]), tuple(w.shape[:w.ndim - w_core]),
                             names=("x", "y", "w"))
    chunk_size = _check_chunk(chunk_size)
    theta = _resolve_directions(directions, dim, xp=xp, device=device, work=work, seed=seed)

    rank = len(batch)
    xw = _lift(xp, _work(xp, x, work), 2, rank)
    yw = _lift(xp, _work(xp, y, work), 2, rank)
    w = _lift(xp, w, w_core, rank)
    w = w[..., None, :] if vector else w[..., None, :, :]      # broadcast over the slice axis
    n, m = x.shape[-2], y.shape[-2]
    c = 1 if vector else w.shape[-1]
    per_slice = math.prod(batch) * (n + m) * (c + 2)
    chunk = _chunk_for(chunk_size, theta.shape[0], per_slice)
    axis = -2 if vector else -3

    def inner(th):
        def back(th_, grads):
            dx, dy, dw = grads
            return {"x": _unproject(xp, dx, th_), "y": _unproject(xp, dy, th_),
                    "w": xp.sum(dw, axis=axis)}
        return _kernel_sum, (_project(xp, xw, th), _project(xp, yw, th), w), {"kernel": kernel}, back

    def reduce(th, s):
        return xp.sum(s, axis=axis)

    def reduce_vjp(th, s, g):
        return xp.broadcast_to(xp.expand_dims(g, axis=axis), s.shape), {}

    plan = _Plan(xp, theta, chunk, inner, reduce, reduce_vjp, 1.0 / theta.shape[0], out_dtype)
    return (plan, lambda grads: grads) if _planning else plan.forward()


def _same_dim(x, y, names):
    dim = x.shape[-1]
    if y.shape[-1] != dim:
        raise ValueError(f"arguments {names[0]!r} and {names[1]!r} must have the same dimension d on their "
                         f"last axis, got {shape_str(x)} and {shape_str(y)}")
    if dim < 1:
        raise ValueError(f"argument {names[0]!r} must have a dimension d >= 1 on its last axis, got "
                         f"{shape_str(x)}")
    return dim


# ------------------------------------------------------------------------------------------ attention
def sliced_attention(q, k, v, kernel, *, directions, key_mask=None, center=False, normalize="count",
                     eps=1e-6, chunk_size=None, seed=None, xp=None, _planning=False):
    """Multi-slice kernel attention on d-dimensional queries and keys.

    The average over slices of :func:`slicedkern.kernel_attention` applied to the projected tokens::

        out = (1/P) sum_p kernel_attention(q @ theta_p, k @ theta_p, v, kernel, ...)

    Each slice is normalised on its own (by its count, or its own ``|q - k|`` sum), then the slices are
    averaged.

    Parameters
    ----------
    q : array, shape (..., Lq, d)
        Queries.
    k : array, shape (..., Lk, d)
        Keys.
    v : array, shape (..., Lk, Dv)
        Values, shared by every slice.
    kernel : slicedkern.kernels.PiecewiseLinear
        The 1-D profile ``f``.
    directions : int or array, shape (P, d)
        As in :func:`sliced_kernel_sum`.
    key_mask : bool array, shape (..., Lk), optional
        True where the key takes part (in every slice).
    center : bool, default False
        Centre the values over the valid keys.
    normalize : {"count", "abs", "relu", None}, default "count"
        Per-slice denominator, as in :func:`slicedkern.kernel_attention`.
    eps : float, default 1e-6
        Lower clamp of the "abs" / "relu" denominators.
    chunk_size : int, optional
        Slices per call (default: bounded memory, as in :func:`sliced_kernel_sum`).
    seed : None, int or numpy.random.Generator, optional
        Seed of the directions when ``directions`` is an integer.
    xp : array namespace, optional

    Returns
    -------
    array, shape (..., Lq, Dv)
        Leading dims broadcast; namespace, device and floating dtype of the inputs.

    Raises
    ------
    TypeError
        Arrays from different libraries or devices, non-floating ``q``, ``k``, ``v``, a non-boolean
        ``key_mask``.
    ValueError
        Incompatible shapes, missing ``directions``, an unknown ``normalize``, a negative ``eps``.

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern.kernels import ReLU
    >>> from slicedkern.sliced import sliced_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 7, 4)), rng.normal(size=(2, 7, 3))
    >>> sliced_attention(q, k, v, ReLU(), directions=8, seed=0, center=True, normalize="abs").shape
    (2, 5, 3)
    """
    xp, device, out_dtype, work = _setup({"q": q, "k": k, "v": v, "key_mask": key_mask}, xp)
    _check_kernel(kernel)
    _need_ndim(q, "q", 2, "(..., Lq, d)")
    _need_ndim(k, "k", 2, "(..., Lk, d)")
    _need_ndim(v, "v", 2, "(..., Lk, Dv)")
    dim = _same_dim(q, k, ("q", "k"))
    lk = k.shape[-2]
    if v.shape[-2] != lk:
        raise ValueError(f"arguments 'k' and 'v' must have the same number of keys Lk, got {shape_str(k)} and "
                         f"{shape_str(v)}")
    shapes, names = [tuple(q.shape[:-2]), tuple(k.shape[:-2]), tuple(v.shape[:-2])], ["q", "k", "v"]
    if key_mask is not None:
        if key_mask.dtype != xp.bool:
            raise TypeError(f"argument 'key_mask' must be a boolean array, got {shape_str(key_mask)}")
        if key_mask.ndim < 1 or key_mask.shape[-1] != lk:
            raise ValueError(f"argument 'key_mask' must have shape (..., Lk) with Lk = {lk}, got "
                             f"{shape_str(key_mask)}")
        shapes.append(tuple(key_mask.shape[:-1]))
        names.append("key_mask")
    batch = broadcast_shapes(*shapes, names=tuple(names))
    if normalize not in _NORMALIZERS:
        raise ValueError(f"argument 'normalize' must be one of {_NORMALIZERS}, got {normalize!r}")
    if not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"argument 'eps' must be a non-negative number, got {eps!r}")
    chunk_size = _check_chunk(chunk_size)
    theta = _resolve_directions(directions, dim, xp=xp, device=device, work=work, seed=seed)

    rank = len(batch)
    qw = _lift(xp, _work(xp, q, work), 2, rank)
    kw = _lift(xp, _work(xp, k, work), 2, rank)
    v = _lift(xp, v, 2, rank)[..., None, :, :]
    mask = None if key_mask is None else _lift(xp, key_mask, 1, rank)[..., None, :]
    lq, dv = q.shape[-2], v.shape[-1]
    per_slice = math.prod(batch) * (lq * (dv + 2) + lk * (2 * dv + 4))
    chunk = _chunk_for(chunk_size, theta.shape[0], per_slice)

    def inner(th):
        def back(th_, grads):
            dq, dk, dv_ = grads
            return {"q": _unproject(xp, dq, th_), "k": _unproject(xp, dk, th_), "v": xp.sum(dv_, axis=-3)}
        return _kernel_attention, (_project(xp, qw, th), _project(xp, kw, th), v), {
            "kernel": kernel, "key_mask": mask, "center": center, "normalize": normalize, "eps": eps}, back

    def reduce(th, out):
        return xp.sum(out, axis=-3)

    def reduce_vjp(th, out, g):
        return xp.broadcast_to(xp.expand_dims(g, axis=-3), out.shape), {}

    plan = _Plan(xp, theta, chunk, inner, reduce, reduce_vjp, 1.0 / theta.shape[0], out_dtype)
    return (plan, lambda grads: grads) if _planning else plan.forward()


# ---------------------------------------------------------------------------- two-sample statistics
def _layout(x, y, directions):
    """``(exact, dim)``: how the samples are laid out (see :func:`energy_distance`)."""
    if x.ndim == 0 or y.ndim == 0:
        raise ValueError(f"arguments 'x' and 'y' must be samples of shape (n,) or (..., n, d), got "
                         f"{shape_str(x)} and {shape_str(y)}")
    if x.ndim == 1 or y.ndim == 1:
        if x.ndim != y.ndim:
            raise ValueError("arguments 'x' and 'y' must both be 1-D samples of shape (n,) and (m,), or both "
                             f"d-dimensional of shape (..., n, d) and (..., m, d), got {shape_str(x)} and "
                             f"{shape_str(y)}")
        return True, 1
    dim = _same_dim(x, y, ("x", "y"))
    if dim == 1:
        return True, 1
    if directions is None:
        raise ValueError(f"argument 'directions' is required for {dim}-dimensional samples (x has shape "
                         f"{tuple(x.shape)}): pass a number of slices P or a (P, d) array of unit vectors; "
                         "1-D samples are given as shape (n,) or (..., n, 1)")
    return False, dim


def _samples(xp, x, exact, work):
    """Work-dtype samples: (..., n) scalars when ``exact``, else (..., n, d) points."""
    x = _work(xp, x, work)
    if exact and x.ndim >= 2:
        x = x[..., 0]
    return x


def _probability_weights(xp, weights, n, name, *, device, work):
    """Weights (..., n) normalised to sum 1 on their last axis (uniform ones when None)."""
    if weights is None:
        return xp.full((n,), 1.0 / n, dtype=work, device=device)
    if weights.ndim < 1 or weights.shape[-1] != n:
        raise ValueError(f"argument {name!r} must have shape (..., {n}) (one weight per sample), got "
                         f"{shape_str(weights)}")
    weights = _work(xp, weights, work)
    total = xp.sum(weights, axis=-1, keepdims=True)
    if holds_everywhere(xp, weights, lambda ns, a: a >= 0) is False:
        raise ValueError(f"argument {name!r} must be non-negative")
    if holds_everywhere(xp, total, lambda ns, a: a > 0) is False:
        raise ValueError(f"argument {name!r} must have a positive sum")
    return weights / total


def _kappa(dim: int) -> float:
    """``E_theta |theta_1| = Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2))`` for theta uniform on S^{d-1}."""
    return math.exp(math.lgamma(dim / 2) - math.lgamma((dim + 1) / 2)) / math.sqrt(math.pi)


def energy_distance(x, y, *, directions=None, x_weights=None, y_weights=None, chunk_size=None, seed=None,
                    xp=None, _planning=False):
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
    named = {"x": x, "y": y, "x_weights": x_weights, "y_weights": y_weights}
    xp, device, out_dtype, work = _setup(named, xp)
    exact, dim = _layout(x, y, directions)
    n, m = (x.shape[-1], y.shape[-1]) if x.ndim == 1 else (x.shape[-2], y.shape[-2])
    if n == 0 or m == 0:
        raise ValueError(f"arguments 'x' and 'y' must hold at least one sample each, got {shape_str(x)} and "
                         f"{shape_str(y)}")
    chunk_size = _check_chunk(chunk_size)
    a = _probability_weights(xp, x_weights, n, "x_weights", device=device, work=work)
    b = _probability_weights(xp, y_weights, m, "y_weights", device=device, work=work)
    core = 1 if exact else 2
    theta = None if exact else _resolve_directions(directions, dim, xp=xp, device=device, work=work,
                                                   seed=seed)
    xs, ys = _samples(xp, x, exact, work), _samples(xp, y, exact, work)
    batch = broadcast_shapes(tuple(xs.shape[:xs.ndim - core]), tuple(ys.shape[:ys.ndim - core]),
                             tuple(a.shape[:-1]), tuple(b.shape[:-1]),
                             names=("x", "y", "x_weights", "y_weights"))
    z = xp.concat([_broadcast(xp, xs, batch, core), _broadcast(xp, ys, batch, core)], axis=-core)
    u = xp.concat([_broadcast(xp, a, batch, 1), -_broadcast(xp, b, batch, 1)], axis=-1)
    if exact:     # one "slice": the samples themselves
        theta, chunk, scale, uu = xp.ones((1, 1), dtype=work, device=device), 1, 1.0, u
    else:
        uu = u[..., None, :]                                # (..., 1, N): shared by every slice
        chunk = _chunk_for(chunk_size, theta.shape[0], math.prod(batch) * (n + m) * 4)
        scale = 1.0 / (theta.shape[0] * _kappa(dim))

    def inner(th):
        zp = z if exact else _project(xp, z, th)             # (..., [P_chunk,] N)

        def back(th_, grads):
            dzp = grads[0] + grads[1]
            return {"z": dzp if exact else _unproject(xp, dzp, th_),
                    "u": grads[2] if exact else xp.sum(grads[2], axis=-2)}
        return _kernel_sum, (zp, zp, uu), {"kernel": Abs()}, back

    def reduce(th, s):
        total = -xp.sum(uu * s, axis=-1)
        return total if exact else xp.sum(total, axis=-1)

    def reduce_vjp(th, s, g):
        gg = g[..., None] if exact else g[..., None, None]
        direct = -s * gg
        return xp.broadcast_to(-uu * gg, s.shape), {"u": direct if exact else xp.sum(direct, axis=-2)}

    plan = _Plan(xp, theta, chunk, inner, reduce, reduce_vjp, scale, out_dtype)
    if not _planning:
        return plan.forward()

    def to_args(grads):
        dz, du = grads["z"], grads["u"]
        out = {"x": dz[..., :n] if exact else dz[..., :n, :], "y": dz[..., n:] if exact else dz[..., n:, :]}
        if exact and x.ndim >= 2:
            out = {k: v[..., None] for k, v in out.items()}
        for name, raw, part in (("x_weights", x_weights, du[..., :n]), ("y_weights", y_weights, -du[..., n:])):
            if raw is not None:      # through the normalisation p = raw / sum(raw)
                raw_w = _work(xp, raw, work)
                total = xp.sum(raw_w, axis=-1, keepdims=True)
                p = raw_w / total
                out[name] = (part - xp.sum(part * p, axis=-1, keepdims=True)) / total
        return out

    return plan, to_args


def _symmetric(kernel):
    """``(f(r) + f(-r)) / 2``: the part of ``f`` a symmetric (sliced) kernel sees."""
    return kernel if kernel.is_even else 0.5 * (kernel + kernel.reflect())


def mmd(x, y, kernel, *, directions=None, estimator="v", chunk_size=None, seed=None, xp=None,
        _planning=False):
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
    xp, device, out_dtype, work = _setup({"x": x, "y": y}, xp)
    _check_kernel(kernel)
    if estimator not in _ESTIMATORS:
        raise ValueError(f"argument 'estimator' must be one of {_ESTIMATORS}, got {estimator!r}")
    exact, dim = _layout(x, y, directions)
    n, m = (x.shape[-1], y.shape[-1]) if x.ndim == 1 else (x.shape[-2], y.shape[-2])
    least = 2 if estimator == "u" else 1
    if n < least or m < least:
        raise ValueError(f"arguments 'x' and 'y' must hold at least {least} samples each for "
                         f"estimator={estimator!r}, got {shape_str(x)} and {shape_str(y)}")
    chunk_size = _check_chunk(chunk_size)
    kernel = _symmetric(kernel)
    core = 1 if exact else 2
    theta = None if exact else _resolve_directions(directions, dim, xp=xp, device=device, work=work,
                                                   seed=seed)
    xs, ys = _samples(xp, x, exact, work), _samples(xp, y, exact, work)
    batch = broadcast_shapes(tuple(xs.shape[:xs.ndim - core]), tuple(ys.shape[:ys.ndim - core]),
                             names=("x", "y"))
    z = xp.concat([_broadcast(xp, xs, batch, core), _broadcast(xp, ys, batch, core)], axis=-core)
    ones = xp.ones((n,), dtype=work, device=device), xp.ones((m,), dtype=work, device=device)
    zeros = xp.zeros((n,), dtype=work, device=device), xp.zeros((m,), dtype=work, device=device)
    member = xp.stack([xp.concat([ones[0], zeros[1]]), xp.concat([zeros[0], ones[1]])], axis=-1)
    member = _lift(xp, member, 2, len(batch))               # (1.., N, 2): [in x, in y]

    if estimator == "v":
        coef, shift = (1.0 / (n * n), -2.0 / (n * m), 1.0 / (m * m)), 0.0
    else:
        f0 = kernel(0.0)
        coef = (1.0 / (n * (n - 1)), -2.0 / (n * m), 1.0 / (m * (m - 1)))
        shift = -f0 * (1.0 / (n - 1) + 1.0 / (m - 1))      # the i = j terms, f(0) each
    if exact:
        theta, chunk, scale, mem = xp.ones((1, 1), dtype=work, device=device), 1, 1.0, member
    else:
        mem = member[..., None, :, :]
        chunk = _chunk_for(chunk_size, theta.shape[0], math.prod(batch) * (n + m) * 8)
        scale = 1.0 / theta.shape[0]

    def inner(th):
        zp = z if exact else _project(xp, z, th)

        def back(th_, grads):
            dzp = grads[0] + grads[1]
            return {"z": dzp if exact else _unproject(xp, dzp, th_)}
        return _kernel_sum, (zp, zp, mem), {"kernel": kernel}, back

    def reduce(th, s):
        """coef . [sum_xx, sum_xy, sum_yy] over the (..., [P,] N, 2) sums."""
        total = (coef[0] * xp.sum(s[..., :n, 0], axis=-1) + coef[1] * xp.sum(s[..., :n, 1], axis=-1)
                 + coef[2] * xp.sum(s[..., n:, 1], axis=-1))
        return total if exact else xp.sum(total, axis=-1)

    def reduce_vjp(th, s, g):
        gg = g[..., None, None] if exact else g[..., None, None, None]
        weights = xp.concat([xp.stack([xp.full((n,), coef[0], dtype=work, device=device),
                                       xp.full((n,), coef[1], dtype=work, device=device)], axis=-1),
                             xp.stack([xp.zeros((m,), dtype=work, device=device),
                                       xp.full((m,), coef[2], dtype=work, device=device)], axis=-1)],
                            axis=0)
        return xp.broadcast_to(weights * gg, s.shape), {}

    plan = _Plan(xp, theta, chunk, inner, reduce, reduce_vjp, scale, out_dtype,
                 finish=lambda xp_, total: total + shift)
    if not _planning:
        return plan.forward()

    def to_args(grads):
        dz = grads["z"]
        out = {"x": dz[..., :n] if exact else dz[..., :n, :], "y": dz[..., n:] if exact else dz[..., n:, :]}
        if exact and x.ndim >= 2:
            out = {k: v[..., None] for k, v in out.items()}
        return out

    return plan, to_args


# ------------------------------------------------------------------------------------ radial profile
class RadialProfile:
    """``Phi(r) = E_theta f(<theta, z>)`` for ``|z| = r``: the radial function of a sliced kernel.

    Built by :func:`radial_profile`; calling it evaluates ``Phi`` (see there).
    """

    __slots__ = ("kernel", "dim")

    def __init__(self, kernel, dim):
        self.kernel = kernel
        self.dim = dim

    def __repr__(self):
        return f"radial_profile({self.kernel!r}, dim={self.dim})"

    def __call__(self, r):
        """Evaluate ``Phi(r)``: a float for a number, an array of ``r``'s namespace and device otherwise."""
        if isinstance(r, numbers.Real) and not isinstance(r, bool):
            return float(self._evaluate(np.asarray(float(r), dtype=np.float64)))
        if isinstance(r, (list, tuple)):
            return self._evaluate(np.asarray(r, dtype=np.float64))
        try:
            space = compat.array_namespace(r)
        except TypeError:
            raise TypeError(f"argument 'r' must be a number or an array, got {type(r).__name__}") from None
        out = self._evaluate(_to_host(r))
        device = compat.device(r)
        if space.isdtype(r.dtype, "real floating"):
            dtype = r.dtype
        else:
            dtype = space.float64 if has_float64(space, device) else space.float32
        return space.asarray(out, dtype=dtype, device=device)

    def _evaluate(self, r):
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
            #                   = r k (1 - tau^2)^((d-1)/2) / (d - 1) - t_m (1 - sign(tau) I_{tau^2}(1/2, (d-1)/2)) / 2
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


def _to_host(a):
    """A float64 NumPy copy of an array of any library (detached from autograd)."""
    if isinstance(a, np.ndarray):
        return np.asarray(a, dtype=np.float64)
    if compat.is_torch_array(a):
        a = a.detach().cpu()
        return np.asarray(a.double().numpy() if a.is_floating_point() else a.numpy(), dtype=np.float64)
    if compat.is_cupy_array(a):
        return np.asarray(a.get(), dtype=np.float64)
    if compat.is_jax_array(a):
        return np.asarray(a, dtype=np.float64)
    return np.asarray(np.from_dlpack(a), dtype=np.float64)


def radial_profile(kernel, dim):
    """The radial function ``Phi`` of the sliced kernel of ``f`` in R^d.

    ``E_theta f(<theta, z>) = Phi(|z|)`` for ``theta`` uniform on the unit sphere of R^d::

        Phi(r) = c_d int_0^1 f_s(t r) (1 - t^2)^((d-3)/2) dt,   c_d = 2 Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2))

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
    _check_kernel(kernel)
    return RadialProfile(kernel, _count(dim, "dim"))


# slicedkern.vjp runs these ops through their _Plan (``fn(..., _planning=True)``): see _dispatch.vjp.
for _fn in (sliced_kernel_sum, sliced_attention, energy_distance, mmd):
    _fn._slicedkern_plan = True
del _fn
