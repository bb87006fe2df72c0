"""What to compute: the static, hashable description of one op call, shared by every engine.

An op call is reduced to a *spec* (kernel, options, where the parameters are arrays) and a flat tuple
of arrays (scores, values, mask, array parameters) already broadcast to one batch shape by the public
layer. Engines turn a spec and its arrays into a :class:`~slicedkern.kernels.Profile` with
:func:`profile_of`; parameter gradients come back through :func:`param_grads`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from . import kernels
from ._lib.namespace import clamp_min
from .kernels import Abs, PiecewiseLinear, Profile, ReLU, family_named

__all__ = ["KernelSumSpec", "AttentionSpec", "Normalizer", "NORMALIZERS", "NORMALIZER_CODES", "OP_DEFAULTS",
           "unpack", "profile_of", "param_grads", "sum_to", "params_ok", "spec_parts", "spec_from_parts"]

#: The attention normalisers by the name users pass as ``normalize``: a profile summed over the
#: valid keys (clamped below by ``eps``), the number of valid keys (``"count"``, at least 1), or none.
#: The one table every layer, op and engine reads (through :class:`Normalizer`).
NORMALIZERS = {"abs": Abs(), "relu": ReLU(), "count": None, None: None}
#: Their profiles, built once (a property that builds them would cost every call, and torch.compile
#: does not trace ``functools.cached_property``).
_PROFILES = {name: Profile.of(kernel) if kernel is not None else None for name, kernel in NORMALIZERS.items()}
#: The normalisers as the compiled kernels receive them (numba's and Triton's), the one coding:
#: 1 and 2 are the summed ones. The sweep's cached compiles hold these values, so they stay fixed.
NORMALIZER_CODES = {None: 0, "abs": 1, "relu": 2, "count": 3}


#: Each attention op's options and their defaults: the one table. ``slicedkern.DecodeCache`` and the
#: layers read it; the signatures of the ops (``slicedkern``, ``slicedkern.distributed``,
#: ``slicedkern.reference``) restate it for their readers, and tests/test_architecture.py holds them
#: equal to it.
OP_DEFAULTS = {
    "relu": {"center": True, "normalize": "abs", "eps": 1e-6},
    "hat": {"bandwidth": 1.0, "center": False, "normalize": "count", "eps": 1e-6},
    "hat_mixture": {"center": False, "normalize": "count", "eps": 1e-6},
    "kernel": {"center": False, "normalize": "count", "eps": 1e-6},
}


@dataclass(frozen=True)
class Normalizer:
    """The divisor of attention: what is summed, and the clamp rule (docs/mathematics.rst, "Attention").

    Parameters
    ----------
    name : {"abs", "relu", "count", None}
        The ``normalize`` option: the sum of ``|q_i - k_j|`` / ``ReLU(q_i - k_j)`` over the valid keys
        a query sees, their number, or no normaliser.
    eps : float
        The floor of a profile normaliser's sum.

    Examples
    --------
    >>> import numpy as np
    >>> Normalizer("abs", 0.5).divisor(np, np.array([2.0, 0.0]), np.array([0.1, 0.0]))
    array([0.5, 1. ])
    """

    name: str | None = "count"
    eps: float = 1e-6

    @property
    def profile(self) -> Profile | None:
        """The profile summed over the valid-key indicator ("abs", "relu"), or None."""
        return _PROFILES[self.name]

    @property
    def code(self) -> int:
        """The normaliser as the compiled kernels receive it (:data:`NORMALIZER_CODES`)."""
        return NORMALIZER_CODES[self.name]

    @property
    def summed(self) -> bool:
        """Whether the divisor is a profile sum: an extra sum forward, and a backward that reads the
        output (the quotient rule's ``-g . out / den`` term)."""
        return self.profile is not None

    def divisor(self, xp, count, den):
        """What a query's numerator is divided by, given the number of valid keys it sees (``count``)
        and its unclamped profile sum (``den``, ignored unless :attr:`summed`); they broadcast.

        A query that sees no key has an empty numerator and is divided by 1: a huge folded
        coefficient times ``1 / eps`` would overflow to inf, and inf times an empty sum is NaN.
        """
        if self.summed:
            return xp.where(count > 0, clamp_min(xp, den, self.eps), xp.ones_like(den))
        if self.name == "count":
            return clamp_min(xp, count, 1.0)
        return xp.ones_like(count)


@dataclass(frozen=True)
class KernelSumSpec:
    """``kernel_sum`` with a fixed profile; arrays ``(x, y, w)``."""

    kernel: PiecewiseLinear


@dataclass(frozen=True)
class AttentionSpec:
    """An attention op; arrays ``(q, k, v[, key_mask], *params)``.

    Either ``kernel`` is a fixed profile, or ``family`` names a learnable
    :class:`~slicedkern.kernels.KernelFamily` whose fixed numbers are ``fixed`` and whose array
    parameters ``param_layout`` names in order (the hat family: ``fixed = (bandwidths, weights)``,
    "bandwidth" (one hat, batch shape), "bandwidths" / "weights" (mixtures, batch + (K,))).
    ``causal``: query ``i`` of ``Lq`` sees only the keys ``j <= i + Lk - Lq`` (docs/mathematics.rst,
    "Causal attention"); an engine without a causal mode declines such a spec.
    """

    kernel: PiecewiseLinear | None
    family: str | None = None
    fixed: tuple = ()
    param_layout: tuple = ()
    center: bool = False
    normalizer: Normalizer = Normalizer()
    has_mask: bool = False
    causal: bool = False


def unpack(spec: AttentionSpec, arrays):
    """``(q, k, v, key_mask or None, {param name: array})`` from the flat array tuple."""
    q, k, v = arrays[:3]
    rest = list(arrays[3:])
    mask = rest.pop(0) if spec.has_mask else None
    return q, k, v, mask, dict(zip(spec.param_layout, rest))


def profile_of(spec, params=None) -> Profile:
    """The value profile of ``spec`` (its array parameters in ``params``)."""
    if spec.kernel is not None:
        return Profile.of(spec.kernel)
    return family_named(spec.family).profile(spec.fixed, params)


def param_grads(xp, spec: AttentionSpec, params, dknots, dcoeffs) -> tuple:
    """Gradients of the array parameters (in ``spec.param_layout`` order) from the profile's knot and
    coefficient gradients, summed to each parameter's shape."""
    grads = family_named(spec.family).pullback(xp, spec.fixed, params, dknots, dcoeffs)
    return tuple(sum_to(xp, grads[name], params[name].shape) for name in spec.param_layout)


def sum_to(xp, grad, shape):
    """Sum a broadcast gradient back to ``shape``."""
    shape = tuple(shape)
    extra = grad.ndim - len(shape)
    if extra > 0:
        grad = xp.sum(grad, axis=tuple(range(extra)))
    axes = tuple(i for i, (g, s) in enumerate(zip(grad.shape, shape)) if s == 1 and g != 1)
    if axes:
        grad = xp.sum(grad, axis=axes, keepdims=True)
    return xp.reshape(grad, shape)


def params_ok(xp, spec: AttentionSpec, params):
    """(batch) True where every array kernel parameter is valid (a positive, finite bandwidth), or
    ``None`` (all fixed, or none can be bad).

    The public layer rejects bad values it can see; under ``jax.jit`` / ``torch.compile`` they are
    traced, and the engines make those batch rows NaN instead of finite nonsense.
    """
    if not params:
        return None         # every parameter is a number, checked by the public layer
    return family_named(spec.family).rows_ok(xp, spec.fixed, params)


# -- a spec as text and numbers: what a registered torch operator takes (its schema holds no Python
# objects); the numbers apart, so that torch.compile may pass them as symbolic floats
#: decoded specs by (text, numbers), so that an operator called in a loop parses each spec once
_DECODED: dict[tuple, KernelSumSpec | AttentionSpec] = {}


def _json(value, numbers: list) -> str:
    """A spec field as JSON text, each float replaced by ``{"n": i}`` and appended to ``numbers``.

    Written by hand in plain Python (no ``json.dumps``, C code that ``torch.compile``'s tracer does
    not follow: the text is made while it traces, where a float may be symbolic).
    """
    if isinstance(value, PiecewiseLinear):
        # the class by name (ReLU, Hat, ...) and its state: an engine may read either
        return '{"kernel":"' + type(value).__name__ + '","state":' + _json(value.__getstate__(), numbers) + "}"
    if isinstance(value, Normalizer):
        return '{"normalizer":' + _json(value.name, numbers) + ',"eps":' + _json(value.eps, numbers) + "}"
    if isinstance(value, tuple):
        return "[" + ",".join([_json(part, numbers) for part in value]) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value + '"'       # the specs' strings are names: no character to escape
    numbers.append(value)
    return '{"n":' + str(len(numbers) - 1) + "}"


def _decode(value, numbers):
    if isinstance(value, list):
        return tuple(_decode(part, numbers) for part in value)
    if not isinstance(value, dict):
        return value
    if "n" in value:
        return float(numbers[value["n"]])
    if "normalizer" in value:
        return Normalizer(value["normalizer"], _decode(value["eps"], numbers))
    cls = getattr(kernels, value["kernel"])
    kernel = object.__new__(cls)      # the state as it was, past the constructor's checks (they passed)
    kernel.__setstate__(tuple(_decode(part, numbers) for part in value["state"]))
    return kernel


def spec_parts(spec: KernelSumSpec | AttentionSpec) -> tuple[str, list]:
    """``spec`` as a JSON text and its floats, which :func:`spec_from_parts` turns back into an equal
    spec, floats bit for bit (the engines may read any field): the form in which a registered torch
    operator receives it (slicedkern/adapters/_torch_ops.py).

    Examples
    --------
    >>> spec = AttentionSpec(kernel=ReLU(), center=True, normalizer=Normalizer("abs", 1e-6))
    >>> text, numbers = spec_parts(spec)
    >>> numbers
    [0.0, 1.0, 0.0, 0.0, 1e-06]
    >>> spec_from_parts(text, numbers) == spec
    True
    """
    numbers: list = []
    body = ",".join(['"' + f.name + '":' + _json(getattr(spec, f.name), numbers) for f in fields(spec)])
    return '{"spec":"' + type(spec).__name__ + '",' + body + "}", numbers


def spec_from_parts(text: str, numbers) -> KernelSumSpec | AttentionSpec:
    """The spec that :func:`spec_parts` wrote as ``text`` and ``numbers``."""
    key = (text, tuple(numbers))
    spec = _DECODED.get(key)
    if spec is None:
        body = json.loads(text)
        cls = {"KernelSumSpec": KernelSumSpec, "AttentionSpec": AttentionSpec}[body.pop("spec")]
        spec = _DECODED.setdefault(key, cls(**{name: _decode(value, numbers) for name, value in body.items()}))
    return spec
