"""Columns that attention's backward hands an engine's pull-back unevaluated.

The pull-back of attention's sums (:func:`._vjp.sums_vjp`) sums a profile over the values with the
valid-key indicator appended, ``[v * take | take]``, and pulls back the cotangent rows ``gout *
scale`` (the quotient rule's factor per query). Formed as arrays they are two ``(n, D)`` copies in
the work dtype (float64 for float32 values) that every level of causal attention then reads. An
engine whose kernels read the values where the keys take part, and scale the cotangent rows as they
read them, takes them as these descriptions instead (the triton engine: :func:`.triton._backward.lazy_terms`): the
values and the cotangent in their own dtype and strides (docs/architecture.rst, "Engines").

The causal decomposition pads and halves them part by part (:func:`map_parts`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["ScaledRows", "MaskedValues", "map_parts"]


class ScaledRows(NamedTuple):
    """The cotangent rows ``rows * scale``, (..., n, c), never formed.

    ``rows`` (..., n, c) in any float dtype and strides; ``scale`` (..., n, 1) in the work dtype;
    ``value_scale`` (..., n, 1) or None: the factor of the rows' share that reaches the values'
    gradient, where it differs from ``scale`` (attention's silent rows, whose share is 0 there but
    not in the scores' gradients: :func:`._vjp.silent_rows`).
    """

    rows: Any
    scale: Any
    value_scale: Any = None

    @property
    def shape(self):
        return tuple(self.rows.shape)

    def map(self, fn) -> ScaledRows:
        """``fn(part, core)`` applied to every part, ``core`` its axes after the positions'."""
        return ScaledRows(fn(self.rows, 1), fn(self.scale, 1),
                          None if self.value_scale is None else fn(self.value_scale, 1))


class MaskedValues(NamedTuple):
    """The columns ``[values * take | take]``, (..., m, dv + 1), never formed.

    ``values`` (..., m, dv) as given, any dtype and strides, read only where ``take`` (..., m) bool
    is True (they may hold anything elsewhere); column ``dv`` is the indicator. A pull-back over them
    returns the values' gradient, (..., m, dv): the indicator's is never asked for.
    """

    values: Any
    take: Any

    @property
    def shape(self):
        return tuple(self.values.shape[:-1]) + (self.values.shape[-1] + 1,)

    def map(self, fn) -> MaskedValues:
        """``fn(part, core)`` applied to every part, ``core`` its axes after the positions'."""
        return MaskedValues(fn(self.values, 1), fn(self.take, 0))


def map_parts(fn, a, core: int):
    """``fn(a, core)`` on an array, or on every part of a :class:`ScaledRows` / :class:`MaskedValues`."""
    if isinstance(a, (ScaledRows, MaskedValues)):
        return a.map(fn)
    return fn(a, core)
