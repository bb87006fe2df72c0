"""The sweep host bridge (:mod:`slicedkern.engines.sweep._host`) called with its profile and normaliser
spelled out as keywords, as its tests write them.

The bridge takes the engine protocol's records (``Inputs``, ``Form``, ``Profile``); these functions
build them from ``knots`` / ``coeffs`` (a tuple of numbers, a ``(M,)`` array, or a ``(..., M)`` array
of per-row profiles), ``slope``, ``intercept``, ``center``, ``normalizer`` (a name) and ``eps``, and
call the bridge, so that the tests state their cases compactly and assert on what the bridge returns.
Imported only where numba is installed.
"""

from __future__ import annotations

import numpy as np

from slicedkern._spec import Normalizer
from slicedkern.engines._vjp import Form, Inputs
from slicedkern.engines.sweep import _causal_host
from slicedkern.engines.sweep import _host as bridge
from slicedkern.kernels import Profile

AVAILABLE, NOT_SAVED, warmup = bridge.AVAILABLE, bridge.NOT_SAVED, bridge.warmup


def _per_knot(values) -> tuple:
    """A profile's knots (or coefficients) as :class:`Profile` holds them: one entry per knot."""
    if isinstance(values, (tuple, list)):
        return tuple(values)
    arr = values if hasattr(values, "shape") else np.asarray(values)
    if arr.ndim <= 1:
        return tuple(float(a) for a in np.asarray(arr).reshape(-1))
    return tuple(arr[..., i] for i in range(arr.shape[-1]))


def profile(knots=(0.0,), coeffs=(1.0,), slope=0.0, intercept=0.0, strict_knots=None) -> Profile:
    return Profile(_per_knot(knots), _per_knot(coeffs), slope, intercept, strict_knots=strict_knots)


def form(knots=(0.0,), coeffs=(1.0,), slope=0.0, intercept=0.0, center=True, normalizer="abs", eps=1e-6,
         strict_knots=None) -> Form:
    return Form(profile(knots, coeffs, slope, intercept, strict_knots), Normalizer(normalizer, eps), center)


def kernel_sum(x, y, w, knots, coeffs, slope=0.0, intercept=0.0):
    return bridge.kernel_sum(x, y, w, profile(knots, coeffs, slope, intercept))


def kernel_sum_vjp(x, y, w, knots, coeffs, slope, intercept, g, *, param_grads=True, strict_knots=None,
                   bad_query_poisons_row=True):
    return bridge.kernel_sum_vjp(x, y, w, profile(knots, coeffs, slope, intercept, strict_knots), g,
                                 param_grads=param_grads, bad_query_poisons_row=bad_query_poisons_row)


def attention(q, k, v, key_mask=None, knots=(0.0,), coeffs=(1.0,), center=True, normalizer="abs", eps=1e-6,
              slope=0.0, intercept=0.0, *, keep=False):
    return bridge.attention(Inputs(q, k, v, key_mask), form(knots, coeffs, slope, intercept, center, normalizer, eps),
                            keep=keep)


def attention_vjp(q, k, v, key_mask, g, out, *, knots=(0.0,), coeffs=(1.0,), slope=0.0, intercept=0.0,
                  center=True, normalizer="abs", eps=1e-6, param_grads=True, strict_knots=None, residuals=()):
    return bridge.attention_vjp(Inputs(q, k, v, key_mask),
                                form(knots, coeffs, slope, intercept, center, normalizer, eps, strict_knots),
                                g, out, residuals, param_grads=param_grads)


def causal_attention_vjp(q, k, v, key_mask, g, out, relu_count, den, *, knots=(0.0,), coeffs=(1.0,), slope=0.0,
                         intercept=0.0, center=True, normalizer="abs", eps=1e-6, strict_knots=None,
                         param_grads=True, vanishes=False):
    return _causal_host.causal_attention_vjp(
        Inputs(q, k, v, key_mask), form(knots, coeffs, slope, intercept, center, normalizer, eps, strict_knots),
        g, out, relu_count, den, param_grads=param_grads, vanishes=vanishes)
