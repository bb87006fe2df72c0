"""Multi-slice kernel sums and attention in R^d: the average over directions of the 1-D ops.

Each public op is planned by a private function of the same signature that validates the arguments
and returns a :class:`~slicedkern.sliced.plan.SlicePlan`; the op runs the plan's forward, and
:func:`slicedkern.vjp` its pullback (docs/mathematics.rst, "Slicing in R^d").
"""

from __future__ import annotations

import functools
import math
from typing import Any

from .._lib.namespace import as_work, broadcast_shapes, shape_str
from .._lib.typing import Array, Namespace
from .._validate import check_bool, check_eps, check_kernel, check_normalize, need_ndim, setup
from ..adapters.vjp import composite
from ..backends import is_chunked
from ..kernels import PiecewiseLinear
from ..ops import kernel_attention, kernel_sum
from ._chunked import ChunkedPlan, chunked_kernel_sum, chunked_points, host_directions, kernel_sum_floats
from .directions import Seed, resolve_directions, same_dim
from .plan import SlicePlan, check_chunk, chunk_for, lift, project, unproject

__all__ = ["sliced_kernel_sum", "sliced_attention"]


class _SliceMean(SlicePlan):
    """An op averaged over slices: each chunk's output summed over its slice axis ``axis``."""

    axis: int

    def reduce(self, theta, out):
        return self.xp.sum(out, axis=self.axis)

    def reduce_vjp(self, theta, out, g):
        return self.xp.broadcast_to(self.xp.expand_dims(g, axis=self.axis), out.shape), {}


class _KernelSumPlan(_SliceMean):
    """``points = (x, y, w)``: ``x``, ``y`` (1.., n|m, d) projected per chunk; ``w`` with a unit slice
    axis, shared."""

    def __init__(self, xp, theta, chunk, out_dtype, *, points, kernel, vector):
        super().__init__(xp, theta, chunk, 1.0 / theta.shape[0], out_dtype)
        (self.x, self.y, self.w), self.kernel = points, kernel
        self.axis = -2 if vector else -3

    def inner(self, theta):
        xp = self.xp
        return kernel_sum, (project(xp, self.x, theta), project(xp, self.y, theta), self.w), {
            "kernel": self.kernel}

    def back(self, theta, grads):
        xp = self.xp
        dx, dy, dw = grads
        return {"x": unproject(xp, dx, theta), "y": unproject(xp, dy, theta), "w": xp.sum(dw, axis=self.axis)}


class _AttentionPlan(_SliceMean):
    """``q``, ``k`` projected per chunk; ``v`` and ``key_mask`` with a unit slice axis, shared."""

    axis = -3

    def __init__(self, xp, theta, chunk, out_dtype, *, q, k, v, options):
        super().__init__(xp, theta, chunk, 1.0 / theta.shape[0], out_dtype)
        self.q, self.k, self.v, self.options = q, k, v, options

    def inner(self, theta):
        xp = self.xp
        return kernel_attention, (project(xp, self.q, theta), project(xp, self.k, theta), self.v), self.options

    def back(self, theta, grads):
        xp = self.xp
        dq, dk, dv = grads
        return {"q": unproject(xp, dq, theta), "k": unproject(xp, dk, theta), "v": xp.sum(dv, axis=self.axis)}


# ----------------------------------------------------------------------------------- kernel sums
def _kernel_sum_block(xb: Array, yb: Array, w: Array, *, kernel: PiecewiseLinear) -> Array:
    """The in-memory kernel sums of projections (P_block, n), (P_block, m) with weights (m,) or
    (m, c), summed over the block's directions: (1, n) or (1, n, c)."""
    return kernel_sum(xb, yb, w[None, ...], kernel).sum(axis=0, keepdims=True)


def _plan_kernel_sum(x: Array, y: Array, w: Array, kernel: PiecewiseLinear, *, directions: int | Array,
                     chunk_size: int | None = None, seed: Seed = None, xp: Namespace | None = None
                     ) -> _KernelSumPlan | ChunkedPlan:
    """The plan of :func:`sliced_kernel_sum` (same arguments), after validating them."""
    xp, device, out_dtype, work = setup({"x": x, "y": y, "w": w}, xp, required=("x", "y", "w"), chunked=True)
    check_kernel(kernel)
    need_ndim(x, "x", 2, "(..., n, d)")
    need_ndim(y, "y", 2, "(..., m, d)")
    dim = same_dim(x, y, ("x", "y"))
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
    chunk_size = check_chunk(chunk_size)
    if is_chunked(xp):                  # Dask: a lazy plan over whole projected columns
        block = functools.partial(_kernel_sum_block, kernel=kernel)
        return chunked_kernel_sum(xp, chunked_points(x, "x", False), chunked_points(y, "y", False), w, block,
                                  theta=host_directions(directions, dim, seed, even=kernel.is_even),
                                  per_point=kernel_sum_floats(1 if vector else w.shape[-1]), chunk_size=chunk_size,
                                  out_dtype=out_dtype, work=work)
    theta = resolve_directions(directions, dim, xp=xp, device=device, work=work, seed=seed, even=kernel.is_even)

    rank = len(batch)
    w = lift(xp, w, w_core, rank)
    w = w[..., None, :] if vector else w[..., None, :, :]      # broadcast over the slice axis
    n, m = x.shape[-2], y.shape[-2]
    c = 1 if vector else w.shape[-1]
    per_slice = math.prod(batch) * (n + m) * (c + 2)
    return _KernelSumPlan(xp, theta, chunk_for(chunk_size, theta.shape[0], per_slice), out_dtype,
                          points=(lift(xp, as_work(xp, x, work), 2, rank), lift(xp, as_work(xp, y, work), 2, rank), w),
                          kernel=kernel, vector=vector)


@composite(_plan_kernel_sum)
def sliced_kernel_sum(x: Array, y: Array, w: Array, kernel: PiecewiseLinear, *, directions: int | Array,
                      chunk_size: int | None = None, seed: Seed = None, xp: Namespace | None = None) -> Array:
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
        ``slicedkern.directions(P, d, method=default_method(P, d, even=kernel.is_even), seed=seed)``
        (fresh ones at every call when ``seed`` is None), the family measured the most accurate for
        the profile: the antipodal QMC slicing design (``"design"``, a fixed point set, randomly
        rotated) for a profile with an odd part, whose odd part its pairs cancel; for an even profile
        ``"projective"``, one of each antipodal pair of the design of ``2 P``, which gives that
        design's estimate at the cost of ``P`` slices
        (:func:`slicedkern.sliced.directions.default_method`, docs/directions.rst). A NumPy array
        is accepted with samples of any library and moved to their device.
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
        Leading dims broadcast; namespace, device and floating dtype of the inputs. For Dask
        arrays, a lazy Dask array chunked by rows like ``x`` (see Notes), with no gradient.

    Raises
    ------
    TypeError
        Arrays from different libraries or devices, non-floating dtypes, a kernel that is not a
        :class:`~slicedkern.kernels.PiecewiseLinear`.
    ValueError
        Incompatible shapes (``d`` of ``x``, ``y`` and ``directions``, ``m`` of ``y`` and ``w``), missing
        ``directions``, a non-positive ``chunk_size``; for Dask arrays also batch axes, a direction
        larger than ``slicedkern.max-column-bytes``.
    MemoryError
        Dask on a ``dask.distributed`` cluster: a block of directions larger than its worker's
        memory limit (on ``.compute()``).

    Notes
    -----
    Projections and sums are computed in float64 where the backend has it (half precision in float32
    or better) and returned in the input dtype. Non-finite inputs give NaN as in ``kernel_sum``.

    **Dask arrays** ``x`` (n, d), ``y`` (m, d) and ``w`` (m,) or (m, c), chunked by rows (no batch
    axes; chunks along the feature axis are merged), give a lazy result equal to the NumPy call to
    rounding: the points are projected blockwise, regrouped so that each block holds all ``n + m``
    projections on ``chunk_size`` directions, each block runs the in-memory sums of its
    directions on one worker, and the blocks' sums are added (docs/scaling.rst, "Dask"). Memory
    model: about ``(2 c + 4) (n + m)`` float64 numbers per direction on one worker (``c = 1`` for a
    vector ``w``; the ``(n + m) d`` points too when ``P > d``), refused beyond the Dask
    configuration ``slicedkern.max-column-bytes`` (default 4 GiB). Dask has no autograd: no
    gradients.

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
    return _plan_kernel_sum(x, y, w, kernel, directions=directions, chunk_size=chunk_size, seed=seed,
                            xp=xp).forward()


# ------------------------------------------------------------------------------------------ attention
def _plan_attention(q: Array, k: Array, v: Array, kernel: PiecewiseLinear, *, directions: int | Array,
                    key_mask: Array | None = None, center: bool = False, normalize: str | None = "count",
                    eps: float = 1e-6, causal: bool = False, chunk_size: int | None = None, seed: Seed = None,
                    xp: Namespace | None = None) -> _AttentionPlan:
    """The plan of :func:`sliced_attention` (same arguments), after validating them."""
    xp, device, out_dtype, work = setup({"q": q, "k": k, "v": v, "key_mask": key_mask}, xp, required=("q", "k", "v"))
    check_kernel(kernel)
    need_ndim(q, "q", 2, "(..., Lq, d)")
    need_ndim(k, "k", 2, "(..., Lk, d)")
    need_ndim(v, "v", 2, "(..., Lk, Dv)")
    dim = same_dim(q, k, ("q", "k"))
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
    check_normalize(normalize)
    eps = check_eps(eps)
    causal = check_bool(causal, "causal")
    chunk_size = check_chunk(chunk_size)
    theta = resolve_directions(directions, dim, xp=xp, device=device, work=work, seed=seed, even=kernel.is_even)

    rank = len(batch)
    v = lift(xp, v, 2, rank)[..., None, :, :]                 # shared by every slice
    mask = None if key_mask is None else lift(xp, key_mask, 1, rank)[..., None, :]
    lq, dv = q.shape[-2], v.shape[-1]
    per_slice = math.prod(batch) * (lq * (dv + 2) + lk * (2 * dv + 4))
    options: dict[str, Any] = {"kernel": kernel, "key_mask": mask, "center": center, "normalize": normalize,
                               "eps": eps, "causal": causal}
    return _AttentionPlan(xp, theta, chunk_for(chunk_size, theta.shape[0], per_slice), out_dtype,
                          q=lift(xp, as_work(xp, q, work), 2, rank), k=lift(xp, as_work(xp, k, work), 2, rank),
                          v=v, options=options)


@composite(_plan_attention)
def sliced_attention(q: Array, k: Array, v: Array, kernel: PiecewiseLinear, *, directions: int | Array,
                     key_mask: Array | None = None, center: bool = False, normalize: str | None = "count",
                     eps: float = 1e-6, causal: bool = False, chunk_size: int | None = None, seed: Seed = None,
                     xp: Namespace | None = None) -> Array:
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
        As in :func:`sliced_kernel_sum`: an integer ``P`` draws the family of
        ``default_method(P, d, even=kernel.is_even)``, a QMC slicing design (the antipodal one for
        the ReLU profile, whose odd part its pairs cancel).
    key_mask : bool array, shape (..., Lk), optional
        True where the key takes part (in every slice).
    center : bool, default False
        Centre the values over the valid keys.
    normalize : {"count", "abs", "relu", None}, default "count"
        Per-slice denominator, as in :func:`slicedkern.kernel_attention`.
    eps : float, default 1e-6
        Lower clamp of the "abs" / "relu" denominators (positive and finite).
    causal : bool, default False
        Query ``i`` sees only the keys ``j <= i + Lk - Lq`` in every slice, as in
        :func:`slicedkern.kernel_attention` (docs/mathematics.rst, "Causal attention").
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
        Incompatible shapes, missing ``directions``, an unknown ``normalize``, an ``eps`` that is not
        positive and finite.

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern.kernels import ReLU
    >>> from slicedkern.sliced import sliced_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 7, 4))
    >>> v = rng.normal(size=(2, 7, 3))
    >>> out = sliced_attention(q, k, v, ReLU(), directions=8, seed=0, center=True,
    ...                        normalize="abs")
    >>> out.shape
    (2, 5, 3)
    """
    return _plan_attention(q, k, v, kernel, directions=directions, key_mask=key_mask, center=center,
                           normalize=normalize, eps=eps, causal=causal, chunk_size=chunk_size, seed=seed,
                           xp=xp).forward()
