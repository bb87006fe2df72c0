"""The chunked slice plan: a sliced op as a sum over chunks of directions of 1-D sort-scan calls.

Every slice is one call of a public 1-D op (:func:`slicedkern.kernel_sum`,
:func:`slicedkern.kernel_attention`) on the samples projected on a direction; the slice axis is a
batch axis of those calls, so a chunk of ``chunk`` directions is one call, and memory is bounded by
the chunk rather than by ``P`` (docs/mathematics.rst, "Slicing in R^d"). A :class:`SlicePlan` runs
the chunks forward, and backward with :func:`slicedkern.vjp` of each chunk's call: that is the
pullback :func:`slicedkern.vjp` runs for the sliced ops, chunk by chunk, with the same bounded memory.
Under torch autograd and ``jax.grad`` the forward is differentiated directly through the 1-D ops.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .._lib.typing import Array, Namespace
from ..adapters.vjp import vjp
from ..backends import is_numpy_namespace
from .directions import positive_int

__all__ = ["SlicePlan", "CHUNK_ELEMENTS", "check_chunk", "chunk_for", "lift", "broadcast", "project",
           "unproject"]

#: Default bound on the number of elements a chunk of slices works on (projections, prefix sums,
#: outputs): about 64 MiB of float64 per array; ``chunk_size=`` overrides it.
CHUNK_ELEMENTS = 2 ** 23


def check_chunk(chunk_size: int | None) -> int | None:
    """The ``chunk_size=`` argument: None, or a positive integer."""
    return None if chunk_size is None else positive_int(chunk_size, "chunk_size")


def chunk_for(chunk_size: int | None, n_slices: int, per_slice: int) -> int:
    """Slices per call: ``chunk_size``, or as many as keep ``per_slice`` elements each under the bound."""
    if chunk_size is not None:
        return min(chunk_size, n_slices)
    return max(1, min(n_slices, CHUNK_ELEMENTS // max(per_slice, 1)))


def lift(xp: Namespace, a: Array, core: int, rank: int) -> Array:
    """Prepend unit axes so that ``a`` has ``rank`` batch axes in front of its ``core`` trailing axes."""
    extra = rank - (a.ndim - core)
    return a if extra == 0 else xp.reshape(a, (1,) * extra + tuple(a.shape))


def broadcast(xp: Namespace, a: Array, batch: tuple[int, ...], core: int) -> Array:
    """``a`` broadcast to the batch shape ``batch`` in front of its ``core`` trailing axes."""
    return xp.broadcast_to(a, tuple(batch) + tuple(a.shape[a.ndim - core:]))


def project(xp: Namespace, a: Array, theta: Array) -> Array:
    """``a`` (..., n, d) on the directions ``theta`` (P, d): shape (..., P, n), one row per slice."""
    return xp.matmul(theta, xp.matrix_transpose(a))


def unproject(xp: Namespace, grad: Array, theta: Array) -> Array:
    """Transpose of :func:`project`: (..., P, n) gradients to (..., n, d)."""
    return xp.matmul(xp.matrix_transpose(grad), theta)


def _result(xp: Namespace, out: Array, dtype: Any) -> Array:
    """``out`` in ``dtype``; NumPy reductions to 0-d give scalars, returned as 0-d arrays instead."""
    out = xp.astype(out, dtype)
    if is_numpy_namespace(xp) and not isinstance(out, np.ndarray):
        out = np.asarray(out)
    return out


class Samples(NamedTuple):
    """A two-sample statistic's samples in the work dtype, as the op validated them (not broadcast)."""

    xs: Any          # (..., n) scalars when exact, else (..., n, d) points
    ys: Any          # (..., m) or (..., m, d)
    batch: tuple     # the batch shape they (and any weights) broadcast to


class SlicePlan(abc.ABC):
    """A sliced op as ``finish(scale * sum over chunks of reduce(op(*arrays)))``, with its pullback.

    A subclass says what one chunk of directions computes: :meth:`inner` gives the 1-D op of the
    chunk and its array arguments (projections of the sources on the chunk's directions, or sources
    passed through), :meth:`back` maps that op's array gradients to gradients of the named sources,
    :meth:`reduce` turns the op's output into the chunk's contribution and :meth:`reduce_vjp` is its
    transpose. :meth:`arguments` maps the sources' gradients to the op's arguments at the end.

    Parameters
    ----------
    xp : array namespace
        The namespace of every array of the plan.
    theta : array, shape (P, d)
        The directions, in the work dtype (a single row of ones for an exact 1-D op).
    chunk : int
        Directions per call of the 1-D op.
    scale : float
        Factor of the sum over chunks (``1 / P`` for an average over slices).
    out_dtype : dtype
        The dtype of the result.
    """

    def __init__(self, xp: Namespace, theta: Array, chunk: int, scale: float, out_dtype: Any):
        self.xp, self.theta, self.chunk = xp, theta, chunk
        self.scale, self.out_dtype = scale, out_dtype
        #: The dtype the plan computes in; cotangents are cast to it before :meth:`pullback`.
        self.work_dtype = theta.dtype

    # ------------------------------------------------------------------- what a chunk computes
    @abc.abstractmethod
    def inner(self, theta: Array) -> tuple[Callable[..., Array], tuple, dict]:
        """``(op, arrays, kwargs)``: the chunk's call is ``op(*arrays, xp=xp, **kwargs)``."""

    @abc.abstractmethod
    def back(self, theta: Array, grads: tuple) -> dict[str, Array]:
        """Gradients of the named sources from the gradients ``grads`` of the chunk's ``arrays``."""

    @abc.abstractmethod
    def reduce(self, theta: Array, out: Array) -> Array:
        """The chunk's contribution to the (unscaled) result, from the op's output ``out``."""

    @abc.abstractmethod
    def reduce_vjp(self, theta: Array, out: Array, g: Array) -> tuple[Array, dict[str, Array]]:
        """The cotangent of ``out`` for the cotangent ``g`` of the contribution, and direct source
        gradients (for a contribution that also depends on a source, like the signed weights of the
        energy distance)."""

    def value(self, theta: Array) -> Array:
        """The chunk's contribution in the forward: :meth:`reduce` of the op's output by default; a
        plan may compute the same number another way (more accurately, say), the pullback being
        that of :meth:`inner` and :meth:`reduce` either way."""
        op, arrays, kwargs = self.inner(theta)
        return self.reduce(theta, op(*arrays, xp=self.xp, **kwargs))

    def finish(self, total: Array) -> Array:
        """The result from the scaled sum over chunks (a constant shift has no gradient)."""
        return total

    def arguments(self, grads: dict[str, Array]) -> dict[str, Array]:
        """Gradients of the op's arguments from those of the sources (the same names by default)."""
        return grads

    # ------------------------------------------------------------------------------- the runs
    def _chunks(self):
        n_slices = self.theta.shape[0]
        for start in range(0, n_slices, self.chunk):
            yield self.theta[start:min(start + self.chunk, n_slices), :]

    def forward(self) -> Array:
        """The op's result, in ``out_dtype``."""
        total = None
        for th in self._chunks():
            part = self.value(th)
            total = part if total is None else total + part
        return _result(self.xp, self.finish(total * self.scale), self.out_dtype)

    def pullback(self, g: Array) -> dict[str, Array]:
        """Gradients of ``sum(g * out)`` by argument name, ``g`` in the work dtype.

        Each gradient may still carry the broadcast (batch) axes of the computation; the caller sums
        them back to the argument's shape.
        """
        grads: dict[str, Array] = {}

        def add(name, value):
            grads[name] = value if name not in grads else grads[name] + value

        g = g * self.scale
        for th in self._chunks():
            op, arrays, kwargs = self.inner(th)
            out, pull = vjp(op, *arrays, xp=self.xp, **kwargs)
            cot, direct = self.reduce_vjp(th, out, g)
            for name, value in self.back(th, pull(cot)[:len(arrays)]).items():
                add(name, value)
            for name, value in direct.items():
                add(name, value)
        return self.arguments(grads)
