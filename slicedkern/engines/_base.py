"""The engine protocol, and the spec-level forward and backward written once for every engine.

An engine computes; it validates nothing (the public layer did) and chooses nothing (the registry
did, once per call). It provides four primitives over arrays already broadcast to one batch shape,
scores in the work dtype:

* ``kernel_sum(x, y, w, profile, *, xp)`` -> (..., n, c) in the work dtype;
* ``attention(q, k, v, profile, *, key_mask, center, normalize, eps, xp)`` -> ``(out, residuals)``,
  residuals a flat tuple of arrays (possibly empty) that only this engine reads back;
* ``profiles_vjp(x, y, w, profiles, cotangents, *, xp, param_grads=True)``;
* ``indicator_sums(q, k, ones, profiles, *, xp)``;

and :class:`Engine` turns them into ``forward(spec, arrays)`` / ``backward(spec, arrays, out,
residuals, g)``, the two calls the adapters make.
"""

from __future__ import annotations

import array_api_compat as compat

from .._spec import KernelSumSpec, bandwidth_ok, normalizer_profile, param_grads, profile_of, unpack
from ..kernels import Profile
from . import _vjp

__all__ = ["Engine"]


class Engine:
    """Base class of the engines: the spec-level forward and backward over the primitives."""

    #: the name users pass as ``engine=``
    name = ""

    def decline(self, spec, arrays, backend) -> str | None:
        """Why this engine cannot run ``spec`` on ``arrays`` (of registry row ``backend``), or None."""
        return None

    def automatic(self, arrays) -> bool:
        """Whether the automatic rule may pick this engine for ``arrays`` (``decline`` permitting)."""
        return True

    # -- what the adapters call ---------------------------------------------------------------
    def forward(self, spec, arrays, *, xp):
        """``(out, residuals)``: the output in the work dtype and a flat tuple of arrays."""
        if isinstance(spec, KernelSumSpec):
            x, y, w = arrays
            return self.kernel_sum(x, y, w, Profile.of(spec.kernel), xp=xp), ()
        q, k, v, mask, params = unpack(spec, arrays)
        out, residuals = self.attention(q, k, v, profile_of(spec, params), key_mask=mask, center=spec.center,
                                        normalize=spec.normalize, eps=spec.eps, xp=xp)
        ok = bandwidth_ok(xp, spec, params)
        if ok is not None:
            nan = xp.asarray(float("nan"), dtype=out.dtype, device=compat.device(out))
            out = xp.where(ok[..., None, None], out, nan)
        return out, residuals

    def backward(self, spec, arrays, out, residuals, g, *, xp):
        """Cotangents of every array of ``arrays`` (``None`` for the mask), given the forward's
        ``out`` and ``residuals`` and the output cotangent ``g`` (work dtype)."""
        if isinstance(spec, KernelSumSpec):
            x, y, w = arrays
            dx, dy, dw, _ = _vjp.kernel_sum_vjp(self, x, y, w, Profile.of(spec.kernel), g, xp=xp)
            return dx, dy, xp.astype(dw, w.dtype)
        q, k, v, mask, params = unpack(spec, arrays)
        dq, dk, dv, (dknots, dcoeffs) = _vjp.attention_vjp(
            self, q, k, v, profile_of(spec, params), g, out, self.aux_of(residuals), key_mask=mask,
            center=spec.center, normalizer=normalizer_profile(spec.normalize), eps=spec.eps, xp=xp)
        grads = [dq, dk, xp.astype(dv, v.dtype)]
        if spec.has_mask:
            grads.append(None)
        if spec.param_layout:
            grads += list(param_grads(xp, spec, params, dknots, dcoeffs))
        return tuple(grads)

    def aux_of(self, residuals):
        """The per-query residuals of :meth:`attention` as the backward reads them (``None``: recompute)."""
        if not residuals:
            return None
        names = ("take", "relu_count", "den")
        return dict(zip(names, residuals))

    def __repr__(self):
        return f"<slicedkern engine {self.name!r}>"
