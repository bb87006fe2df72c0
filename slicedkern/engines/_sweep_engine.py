"""The **sweep** engine as a registry entry: the fused numba CPU engine behind the engine protocol.

The compiled kernels (:mod:`slicedkern._sweep`) read NumPy arrays and CPU torch tensors in place;
this class converts profiles to their per-row host arrays and says when the engine cannot serve.
Parameter gradients (bandwidths, mixture weights) come from the scan's knot sums: the sweep's
kernels have no knot-gradient mode (stated in the docstrings of the hat ops).

The sweep has no causal mode: it declines ``causal=True`` specs (:meth:`SweepEngine.decline`), so
that the automatic rule picks the scan's divide and conquer for them and ``engine="sweep"`` is a
``ValueError`` saying why.
"""

from __future__ import annotations

import importlib.util

import numpy as np

from ..backends import to_host
from ..kernels import is_fixed
from ._base import Engine, no_causal_mode
from .scan._backward import accumulate_columns, column_range, knot_grads
from .scan._scan import queries, sort_keys
from .scan._wide import arithmetic

__all__ = ["SweepEngine"]


def _kernels():
    """The compiled sweep, imported on first use: it imports numba, which ``import slicedkern`` must not."""
    from .. import _sweep
    return _sweep


def _host_profile(profile, batch) -> dict:
    """A profile as the sweep takes it: float64 knot / coefficient arrays (M,) or (rows..., M)."""
    def host(value):
        return value if is_fixed(value) else np.asarray(to_host(value), dtype=np.float64)

    knots = [host(t) for t in profile.knots]
    coeffs = [host(c) for c in profile.coeffs]
    if all(is_fixed(v) for v in knots + coeffs):
        return {"knots": np.asarray(knots, dtype=np.float64), "coeffs": np.asarray(coeffs, dtype=np.float64),
                "slope": float(profile.slope), "intercept": float(profile.intercept)}

    def stack(values):
        return np.stack([np.broadcast_to(np.asarray(v, dtype=np.float64), batch) for v in values], axis=-1)

    return {"knots": stack(knots), "coeffs": stack(coeffs), "slope": float(profile.slope),
            "intercept": float(profile.intercept)}


class SweepEngine(Engine):
    name = "sweep"

    @staticmethod
    def installed() -> bool:
        return importlib.util.find_spec("numba") is not None

    def decline(self, spec, arrays, backend):
        if getattr(spec, "causal", False):
            return no_causal_mode(self.name)
        if not self.installed():
            return "the 'sweep' engine needs numba (pip install numba)"
        if not backend.host_readable(arrays[0]):
            a = arrays[0]
            return (f"the 'sweep' engine runs on NumPy arrays and CPU torch tensors outside torch.compile "
                    f"and torch.func transforms, not on this {type(a).__module__}.{type(a).__name__}"
                    + (f" on device {a.device}" if hasattr(a, "device") else ""))
        return None

    def kernel_sum(self, x, y, w, profile, *, xp):
        return _kernels().kernel_sum(x, y, w, **_host_profile(profile, tuple(x.shape[:-1])))

    def attention(self, q, k, v, profile, *, key_mask, center, normalize, eps, xp):
        out = _kernels().attention(q, k, v, key_mask, center=center, normalizer=normalize, eps=eps,
                               **_host_profile(profile, tuple(q.shape[:-1])))
        return out, ()

    def profiles_vjp(self, x, y, w, profiles, cotangents, *, xp, param_grads=True):
        batch = tuple(x.shape[:-1])
        c = w.shape[-1]
        dx = dy = dw = None
        for p, g in zip(profiles, cotangents):
            cols = column_range(p, c)
            px, py, pw = _kernels().kernel_sum_vjp(x, y, w[..., cols.start:cols.stop], g=g,
                                               **_host_profile(p, batch))
            dx = px if dx is None else dx + px
            dy = py if dy is None else dy + py
            dw = accumulate_columns(xp, dw, pw, cols, c)
        if param_grads and not all(p.is_fixed for p in profiles):
            ar = arithmetic(xp, x.dtype)
            sk = sort_keys(y, w, xp=xp, ar=ar)
            params = knot_grads(sk, queries(x, sk, ar=ar), profiles, cotangents, xp=xp, ar=ar,
                                param_grads=True)
        else:
            params = [(tuple(None for _ in p.knots), tuple(None for _ in p.coeffs)) for p in profiles]
        return dx, dy, dw, params

    def indicator_sums(self, q, k, ones, profiles, *, xp):
        batch = tuple(q.shape[:-1])
        return [_kernels().kernel_sum(q, k, ones, **_host_profile(p, batch)) for p in profiles]
