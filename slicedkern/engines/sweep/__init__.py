"""The **sweep** engine: fused numba kernels on NumPy arrays and CPU torch tensors.

One compiled call per op sorts every batch row once and sweeps it (docs/architecture.rst, "Engines"):
the forward visits the queries in order with a pointer per knot through the sorted keys; the
backward visits the keys in order with a pointer per knot through the sorted queries and yields
``dq``, ``dk``, ``dv`` and the knot / coefficient gradients (bandwidths, mixture weights) together,
in float64 running sums, with no ``(n, D)`` temporary besides the gradients. Batch rows run in
parallel (numba threads, claimed dynamically); small calls run serially on the calling thread.
Causal attention is one sweep over positions per row with a Fenwick tree over the keys' score ranks
(:mod:`._kernels_causal`, docs/mathematics.rst, "Causal attention"); its backward is the generic
causal one (engines/_vjp.py) over the same sweep's pull-backs.

This module is what the registry imports: it does not import numba. The compiled kernels and their
host bridge (:mod:`._host`) are loaded on the first call, and cached on disk by numba after the first
compilation (docs/backends.rst, "First call").
"""

from __future__ import annotations

import importlib.util

import numpy as np

from ..._lib.namespace import as_work
from ...backends import to_host
from ...kernels import is_fixed
from .._base import Engine
from ..scan._backward import accumulate_columns, column_range

__all__ = ["SweepEngine", "AVAILABLE"]


def _bridge():
    """The compiled engine's host bridge, imported on first use (it imports numba)."""
    from . import _host as host
    return host


def _host_profile(profile, batch) -> dict:
    """A profile as the kernels take it: float64 knot / coefficient arrays (M,) or (batch..., M)."""
    def host(value):
        return value if is_fixed(value) else np.asarray(to_host(value), dtype=np.float64)

    knots = [host(t) for t in profile.knots]
    coeffs = [host(c) for c in profile.coeffs]
    if all(is_fixed(v) for v in knots + coeffs):
        knot_arr = np.asarray(knots, dtype=np.float64)
        coeff_arr = np.asarray(coeffs, dtype=np.float64)
    else:
        def stack(values):
            return np.stack([np.broadcast_to(np.asarray(v, dtype=np.float64), batch) for v in values], axis=-1)
        knot_arr, coeff_arr = stack(knots), stack(coeffs)
    return {"knots": knot_arr, "coeffs": coeff_arr, "slope": float(profile.slope),
            "intercept": float(profile.intercept)}


def _param_tuple(profile, dknots, dcoeffs):
    """The kernels' ``(batch..., M)`` knot / coefficient gradients as the engine protocol returns them:
    one batch-shaped array per array parameter, ``None`` per float one."""
    def pick(params, grads):
        return tuple(None if is_fixed(p) or grads is None else grads[..., i] for i, p in enumerate(params))
    return pick(profile.knots, dknots), pick(profile.coeffs, dcoeffs)


class SweepEngine(Engine):
    """The fused CPU engine (numba): NumPy arrays and CPU torch tensors outside traced code."""

    name = "sweep"
    #: causal attention by one Fenwick-tree sweep over positions per row (:mod:`._kernels_causal`)
    supports_causal = True

    @staticmethod
    def installed() -> bool:
        return importlib.util.find_spec("numba") is not None

    def decline(self, spec, arrays, backend):
        reason = super().decline(spec, arrays, backend)
        if reason is not None:
            return reason
        if not self.installed():
            return "the 'sweep' engine needs numba (pip install numba)"
        if not backend.host_readable(arrays[0]):
            a = arrays[0]
            return (f"the 'sweep' engine runs on NumPy arrays and CPU torch tensors outside torch.compile "
                    f"and torch.func transforms, not on this {type(a).__module__}.{type(a).__name__}"
                    + (f" on device {a.device}" if hasattr(a, "device") else ""))
        return None

    # -- forward primitives ---------------------------------------------------------------------
    def kernel_sum(self, x, y, w, profile, *, xp):
        return _bridge().kernel_sum(x, y, w, **_host_profile(profile, tuple(x.shape[:-1])))

    def attention(self, q, k, v, profile, *, key_mask, center, normalize, eps, xp):
        out = _bridge().attention(q, k, v, key_mask, center=center, normalizer=normalize, eps=eps,
                                **_host_profile(profile, tuple(q.shape[:-1])))
        return out, ()

    def causal_attention(self, q, k, v, profile, *, key_mask, center, normalize, eps, xp):
        out, take, relu_count, den = _bridge().causal_attention(
            q, k, v, key_mask, center=center, normalizer=normalize, eps=eps,
            **_host_profile(profile, tuple(q.shape[:-1])))
        residuals = (take, as_work(xp, relu_count, q.dtype)[..., None])
        if normalize in ("abs", "relu"):
            residuals += (as_work(xp, den, q.dtype)[..., None],)
        return out, residuals

    def causal_profiles_vjp(self, x, y, w, profiles, cotangents, *, xp, param_grads=True):
        c = w.shape[-1]
        dx = dy = dw = None
        params = []
        for p, g in zip(profiles, cotangents):
            cols = column_range(p, c)
            want = param_grads and not p.is_fixed
            px, py, pw, dkn, dco = _bridge().causal_profile_vjp(
                x, y, w[..., cols.start:cols.stop], g, strict_knots=p.strict_knots, param_grads=want,
                **_host_profile(p, tuple(x.shape[:-1])))
            px, py, pw = (as_work(xp, a, x.dtype) for a in (px, py, pw))
            dx = px if dx is None else dx + px
            dy = py if dy is None else dy + py
            dw = accumulate_columns(xp, dw, pw, cols, c)
            params.append(_param_tuple(p, dkn, dco) if want else (tuple(None for _ in p.knots),
                                                                   tuple(None for _ in p.coeffs)))
        return dx, dy, dw, params

    # -- the fused backward (overrides the generic one of engines/_vjp.py) ------------------------
    def kernel_sum_vjp(self, x, y, w, profile, g, *, xp):
        dx, dy, dw, dknots, dcoeffs = _bridge().kernel_sum_vjp(
            x, y, w, g=g, param_grads=not profile.is_fixed, strict_knots=profile.strict_knots,
            bad_query_poisons_row=False, **_host_profile(profile, tuple(x.shape[:-1])))
        return dx, dy, dw, _param_tuple(profile, dknots, dcoeffs)

    def attention_vjp(self, q, k, v, profile, g, out, residuals, *, key_mask, center, normalize, eps, xp):
        # the kernels read the cotangent in the values' dtype (float64 running sums either way)
        g, out = as_work(xp, g, v.dtype), as_work(xp, out, v.dtype)
        dq, dk, dv, dknots, dcoeffs = _bridge().attention_vjp(
            q, k, v, key_mask, g, out if normalize in ("abs", "relu") else None, center=center,
            normalizer=normalize, eps=eps, param_grads=not profile.is_fixed, strict_knots=profile.strict_knots,
            **_host_profile(profile, tuple(q.shape[:-1])))
        return dq, dk, dv, _param_tuple(profile, dknots, dcoeffs)

    # -- the generic primitives (engines/_vjp.py runs on them too) --------------------------------
    def profiles_vjp(self, x, y, w, profiles, cotangents, *, xp, param_grads=True):
        c = w.shape[-1]
        dx = dy = dw = None
        params = []
        for p, g in zip(profiles, cotangents):
            cols = column_range(p, c)
            px, py, pw, pparams = self.kernel_sum_vjp(x, y, w[..., cols.start:cols.stop], p, g, xp=xp)
            dx = px if dx is None else dx + px
            dy = py if dy is None else dy + py
            dw = accumulate_columns(xp, dw, pw, cols, c)
            params.append(pparams if param_grads else (tuple(None for _ in p.knots),
                                                        tuple(None for _ in p.coeffs)))
        return dx, dy, dw, params

    def indicator_sums(self, q, k, ones, profiles, *, xp):
        batch = tuple(q.shape[:-1])
        return [_bridge().kernel_sum(q, k, ones, **_host_profile(p, batch)) for p in profiles]


#: Whether the sweep can run here (numba installed); checked without importing numba.
AVAILABLE = SweepEngine.installed()
