"""The differentiable ops: forward with residuals and backward, once for every framework.

An op call is reduced to a static, hashable *spec* (kernel, options, where the parameters are
arrays) and a tuple of arrays (scores, values, mask, array parameters), already broadcast to one
batch shape and cast to the work dtype by the public layer with the framework's own operations (so
that torch and JAX autograd undo broadcasting and casts themselves). The adapters in
``slicedkern/backends`` and :func:`slicedkern.vjp` all call :func:`forward` and :func:`backward`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import array_api_compat as compat
import numpy as np

from . import _grad, _ops
from ._scan import Profile
from ._engine import engine_for
from .kernels import Abs, PiecewiseLinear, ReLU

__all__ = ["AttentionSpec", "KernelSumSpec", "forward", "backward"]


@dataclass(frozen=True)
class KernelSumSpec:
    """``kernel_sum`` with a fixed profile; arrays ``(x, y, w)``."""

    kernel: PiecewiseLinear

    def n_arrays(self) -> int:
        return 3


@dataclass(frozen=True)
class AttentionSpec:
    """An attention op; arrays ``(q, k, v[, key_mask], *params)``.

    Either ``kernel`` is a fixed profile, or ``alphas`` / ``betas`` describe a (mixture of) hat(s):
    one entry per hat, a float, or ``None`` where the value comes from an array parameter.
    ``param_layout`` names the array parameters in order: "bandwidth" (one hat, batch shape),
    "bandwidths" / "weights" (mixtures, batch shape + (K,)).
    """

    kernel: Optional[PiecewiseLinear]
    alphas: tuple = ()
    betas: tuple = ()
    param_layout: tuple = ()
    center: bool = False
    normalize: Optional[str] = "count"
    eps: float = 1e-6
    has_mask: bool = False


def _normalizer(spec: AttentionSpec):
    return {"abs": Profile.of(Abs()), "relu": Profile.of(ReLU())}.get(spec.normalize, spec.normalize)


def _unpack(spec: AttentionSpec, arrays):
    q, k, v = arrays[:3]
    rest = list(arrays[3:])
    mask = rest.pop(0) if spec.has_mask else None
    return q, k, v, mask, dict(zip(spec.param_layout, rest))


def _hats(spec: AttentionSpec, params):
    """Per-hat bandwidths and weights: floats, or arrays of the batch shape."""
    if "bandwidth" in params:
        alphas = [params["bandwidth"]]
    elif "bandwidths" in params:
        arr = params["bandwidths"]
        alphas = [arr[..., i] for i in range(arr.shape[-1])]
    else:
        alphas = list(spec.alphas)
    if "weights" in params:
        arr = params["weights"]
        betas = [arr[..., i] for i in range(arr.shape[-1])]
    else:
        betas = list(spec.betas)
    return alphas, betas


def _profile(spec: AttentionSpec, params) -> Profile:
    """The value profile; hats ``b max(0, 1 - |r|/a)`` = ``b/a (ReLU(r+a) - 2 ReLU(r) + ReLU(r-a))``."""
    if spec.kernel is not None:
        return Profile.of(spec.kernel)
    knots, coeffs, centre = [], [], 0.0
    for a, b in zip(*_hats(spec, params)):
        knots += [-a, a]
        coeffs += [b / a, b / a]
        centre = centre - 2.0 * b / a
    return Profile(tuple(knots) + (0.0,), tuple(coeffs) + (centre,))


def _hat_param_grads(xp, spec, params, dknots, dcoeffs):
    """Chain rule from the profile's knots / coefficients back to the hat parameters."""
    alphas, betas = _hats(spec, params)
    d_centre = dcoeffs[-1]
    dalpha, dbeta = [], []
    for i, (a, b) in enumerate(zip(alphas, betas)):
        dk_neg, dk_pos = dknots[2 * i], dknots[2 * i + 1]
        dc = _plus(dcoeffs[2 * i], dcoeffs[2 * i + 1])
        if d_centre is not None:
            dc = _plus(dc, -2.0 * d_centre)
        da = None
        if not isinstance(a, float):
            da = _plus(dk_pos, None if dk_neg is None else -dk_neg)
            if dc is not None:
                da = _plus(da, -dc * b / (a * a))
        db = None if isinstance(b, float) or dc is None else dc / a
        dalpha.append(da)
        dbeta.append(db)
    grads = {}
    for name in spec.param_layout:
        if name == "bandwidth":
            grads[name] = dalpha[0]
        elif name == "bandwidths":
            grads[name] = xp.stack(dalpha, axis=-1)
        else:
            grads[name] = xp.stack(dbeta, axis=-1)
    return tuple(_sum_to(xp, grads[name], params[name].shape) for name in spec.param_layout)


def _plus(a, b):
    if a is None:
        return b
    return a if b is None else a + b


def _sum_to(xp, grad, shape):
    """Sum a broadcast gradient back to ``shape``."""
    shape = tuple(shape)
    extra = grad.ndim - len(shape)
    if extra > 0:
        grad = xp.sum(grad, axis=tuple(range(extra)))
    axes = tuple(i for i, (g, s) in enumerate(zip(grad.shape, shape)) if s == 1 and g != 1)
    if axes:
        grad = xp.sum(grad, axis=axes, keepdims=True)
    return xp.reshape(grad, shape)


def _sweep_profile(profile: Profile, batch) -> dict:
    """A profile as the sweep engine takes it: NumPy knot / coefficient arrays (M,) or (..., M)."""
    def host(value):
        if isinstance(value, float):
            return value
        if hasattr(value, "detach"):
            value = value.detach().cpu()
        return np.asarray(value, dtype=np.float64)

    knots = [host(t) for t in profile.knots]
    coeffs = [host(c) for c in profile.coeffs]
    if all(isinstance(v, float) for v in knots + coeffs):
        return {"knots": np.asarray(knots, dtype=np.float64), "coeffs": np.asarray(coeffs, dtype=np.float64),
                "slope": float(profile.slope), "intercept": float(profile.intercept)}

    def stack(values):
        return np.stack([np.broadcast_to(np.asarray(v, dtype=np.float64), batch) for v in values], axis=-1)

    return {"knots": stack(knots), "coeffs": stack(coeffs), "slope": float(profile.slope),
            "intercept": float(profile.intercept)}


def forward(spec, arrays, *, xp):
    """``(out, residuals)``: the output in the work dtype and what :func:`backward` needs.

    The engine is :func:`slicedkern.engine_for` the first array's: the array-API scan, or the fused
    sweep (which keeps no residuals; its backward recomputes the per-query normaliser sums).
    """
    if engine_for(arrays[0]) == "sweep":
        from . import _sweep
        batch = tuple(arrays[0].shape[:-1])
        if isinstance(spec, KernelSumSpec):
            return _sweep.kernel_sum(*arrays, **_sweep_profile(Profile.of(spec.kernel), batch)), ()
        q, k, v, mask, params = _unpack(spec, arrays)
        out = _sweep.attention(q, k, v, mask, center=spec.center, normalizer=spec.normalize, eps=spec.eps,
                               **_sweep_profile(_profile(spec, params), batch))
        return _nan_where_bandwidth_invalid(xp, spec, params, out), (out, None)
    if isinstance(spec, KernelSumSpec):
        x, y, w = arrays
        return _ops.kernel_sum(x, y, w, Profile.of(spec.kernel), xp=xp), ()
    q, k, v, mask, params = _unpack(spec, arrays)
    out, aux = _ops.attention(q, k, v, _profile(spec, params), key_mask=mask, center=spec.center,
                              normalizer=_normalizer(spec), eps=spec.eps, xp=xp)
    return _nan_where_bandwidth_invalid(xp, spec, params, out), (out, aux)


def _nan_where_bandwidth_invalid(xp, spec, params, out):
    """NaN rows where an array bandwidth is not positive and finite.

    The public layer rejects such values when it can see them; under ``jax.jit`` or
    ``torch.compile`` they are traced, and this makes their batch rows NaN instead of finite nonsense.
    """
    alphas = [a for a in _hats(spec, params)[0] if not isinstance(a, float)]
    if not alphas:
        return out
    ok = None
    for a in alphas:
        good = (a > 0) & xp.isfinite(a)
        ok = good if ok is None else ok & good
    nan = xp.asarray(float("nan"), dtype=out.dtype, device=compat.device(out))
    return xp.where(ok[..., None, None], out, nan)


def backward(spec, arrays, residuals, cotangent, *, xp):
    """Cotangents for every array of ``arrays`` (``None`` for the mask)."""
    engine = engine_for(arrays[0])
    if isinstance(spec, KernelSumSpec):
        x, y, w = arrays
        dx, dy, dw, _ = _grad.kernel_sum_vjp(x, y, w, Profile.of(spec.kernel), cotangent, xp=xp,
                                             engine=engine)
        return dx, dy, xp.astype(dw, w.dtype)
    q, k, v, mask, params = _unpack(spec, arrays)
    out, aux = residuals
    profile = _profile(spec, params)
    dq, dk, dv, (dknots, dcoeffs) = _grad.attention_vjp(
        q, k, v, profile, cotangent, out, aux, key_mask=mask, center=spec.center,
        normalizer=_normalizer(spec), eps=spec.eps, xp=xp, engine=engine)
    grads = [dq, dk, xp.astype(dv, v.dtype)]
    if spec.has_mask:
        grads.append(None)
    if spec.param_layout:
        grads += list(_hat_param_grads(xp, spec, params, dknots, dcoeffs))
    return tuple(grads)
