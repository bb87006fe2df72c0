"""Sliced ops on lazy chunked arrays (Dask): the layout and the lazy plan (docs/scaling.rst, "Dask").

The points arrive chunked by rows. Each block of directions gets the whole projected columns of its
directions -- all ``n`` projections -- either by projecting every row chunk itself (``P > d``: the
points wait in memory until the last block has read them) or from the projections on all
directions regrouped by a rechunk (``P <= d``: the projections wait); the row method
``map_directions`` chooses. The block hands its columns, as NumPy arrays, to the in-memory op,
which sorts each column as it would in one process; the per-direction results are summed lazily
into the mean over directions. Nothing runs before ``.compute()``.

Memory model. A block of ``P_b`` directions needs ``per_point * (n + m) * P_b`` float64 numbers on
its worker (:data:`COLUMN_FLOATS`: the columns and the 1-D op's working arrays). One direction's
column cannot be split: the sort is global. A direction that needs more than the Dask
configuration ``slicedkern.max-column-bytes`` (default 4 GiB) is refused when the graph is built
(``ValueError``), and a block larger than a ``dask.distributed`` worker's memory limit fails on the
worker with ``MemoryError`` before it runs: never a silent wrong answer. When ``P > d`` a block also
reads the ``(n + m) d`` points; when ``P <= d`` the ``(n + m) P`` projections are spread over the
workers while they are regrouped.

1-D samples are one direction, ``theta = [1]``: their exact statistic sorts the whole pooled sample
on one worker, under the same memory model.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

import array_api_compat.numpy as host_xp
import numpy as np

from .._lib.namespace import shape_str
from .._lib.typing import Array, Namespace
from ..backends import ops_for, to_host
from .directions import Seed, resolve_directions

__all__ = ["ChunkedPlan", "COLUMN_FLOATS", "kernel_sum_floats", "chunked_points", "chunked_weights",
           "host_directions", "chunked_statistic", "chunked_kernel_sum"]

#: Float64 numbers one direction works on, per pooled point: the projections and the peak of the 1-D
#: op's NumPy allocations, measured with ``tracemalloc`` (n = m = 1e5; energy distance 3.5 weighted, MMD
#: 22 for hats and mixtures, V and U) plus the column, rounded up (the energy distance's compiled
#: merge allocates outside NumPy).
COLUMN_FLOATS = {"energy_distance": 6, "mmd": 24}


def kernel_sum_floats(columns: int) -> int:
    """:data:`COLUMN_FLOATS` of a kernel sum with ``columns`` weight columns (measured 5.1 for one
    column, 6.6 for four, with the output)."""
    return 2 * columns + 4


class ChunkedPlan:
    """A lazy result with the plan interface :func:`slicedkern.vjp` expects, and no pullback."""

    def __init__(self, xp: Namespace, result: Array, work):
        self.xp, self.result, self.work_dtype = xp, result, work

    def forward(self) -> Array:
        """The lazy result (a Dask array: nothing is computed yet)."""
        return self.result

    def pullback(self, g: Array):
        raise TypeError("Dask arrays have no gradients: slicedkern.vjp and autograd do not apply to the chunked "
                        "sliced ops; compute the gradient in memory (NumPy, torch, JAX) on a subsample instead")


def chunked_points(a: Array, name: str, one_d: bool) -> Array:
    """``a`` as (n, d) points (``(n,)`` 1-D samples become (n, 1)); batch axes are refused."""
    if a.ndim == 1 and one_d:
        return a[:, None]
    if a.ndim != 2:
        raise ValueError(f"argument {name!r}: Dask arrays are taken without batch axes, as (n, d) points or "
                         f"(n,) scalars, got {shape_str(a)}; loop over the batch, or use in-memory arrays")
    return a


def host_directions(value: int | Array | None, dim: int, seed: Seed, *, even: bool = True) -> np.ndarray:
    """The ``directions=`` argument as a float64 NumPy (P, d) array: the block functions receive them
    with the graph, and the projection is blockwise against them."""
    if value is not None and not isinstance(value, (numbers.Number, np.ndarray)):
        value = to_host(value)                     # e.g. a (P, d) Dask array: small, computed now
    return resolve_directions(value, dim, xp=host_xp, device="cpu", work=host_xp.float64, seed=seed, even=even)


def chunked_weights(w: Array | None, name: str, n: int) -> Array | None:
    if w is not None and (w.ndim != 1 or w.shape[0] != n):
        raise ValueError(f"argument {name!r}: with Dask arrays the weights have shape ({n},) (one per sample, "
                         f"no batch axes), got {shape_str(w)}")
    return w


def _column_bytes(per_point: int, points: int, work) -> int:
    return per_point * points * np.dtype(work).itemsize


def chunked_statistic(xp: Namespace, x: Array, y: Array, weights: tuple, block: Callable, *, theta: np.ndarray,
                      scale: float, per_point: int, chunk_size: int | None, out_dtype, work) -> ChunkedPlan:
    """``scale * sum_p block(x_p, y_p, *weights)``, lazily, over whole projected columns.

    ``x`` (n, d), ``y`` (m, d) Dask points; ``weights`` one array (n,) / (m,) or None per sample;
    ``theta`` (P, d) NumPy directions; ``block(xb, yb, a, b)`` the in-memory statistic of the
    projections ``xb`` (P_block, n), ``yb`` (P_block, m), one value per direction (P_block,).
    """
    row = ops_for(xp)
    column_bytes = _column_bytes(per_point, x.shape[0] + y.shape[0], work)
    per_block = chunk_size or row.directions_per_block(theta.shape[0], column_bytes)
    extras = [(None, None) if w is None else (w, side) for w, side in zip(weights, "xy")]
    values = row.map_directions(block, x, y, theta, extras, per_block=per_block, column_bytes=column_bytes,
                                dtype=work)
    return ChunkedPlan(xp, xp.astype(xp.sum(values) * scale, out_dtype), work)


def chunked_kernel_sum(xp: Namespace, x: Array, y: Array, w: Array, block: Callable, *, theta: np.ndarray,
                       per_point: int, chunk_size: int | None, out_dtype, work) -> ChunkedPlan:
    """``(1/P) sum_p block(x_p, y_p, w)``, lazily: (n,) or (n, c), chunked by rows like ``x``.

    ``block(xb, yb, w)`` returns the sum over its directions of the in-memory kernel sums,
    (1, n) or (1, n, c).
    """
    row = ops_for(xp)
    column_bytes = _column_bytes(per_point, x.shape[0] + y.shape[0], work)
    per_block = chunk_size or row.directions_per_block(theta.shape[0], column_bytes)
    partial = row.map_directions(block, x, y, theta, [(w, "y")], per_block=per_block, column_bytes=column_bytes,
                                 dtype=work, rows=(x.shape[0], None if w.ndim == 1 else w.shape[1]))
    total = xp.sum(partial, axis=0) / theta.shape[0]
    return ChunkedPlan(xp, row.rows_like(xp.astype(total, out_dtype), x), work)
