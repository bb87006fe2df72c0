"""The **scan** engine: the sort-scan written against the array API standard only.

It serves every backend (GPUs, JAX under ``jit``/``vmap``, any namespace): one stable sort of the
keys, prefix sums in the work dtype (float64, or double-float where the backend has none), batched
rank searches and one weighted gather per profile (docs/mathematics.rst, "The kernel sum by sort-scan").
Its causal mode is the divide and conquer over positions of :mod:`.._dyadic` on the array-API
levels, each level one batched call of the same machinery (docs/mathematics.rst, "Causal attention").
"""

from __future__ import annotations

from .._base import Engine
from .._dyadic import causal_attention, causal_profile_sums, causal_profiles_vjp
from ..sortscan.pullback import indicator_sums, profiles_vjp
from ._compose import attention, kernel_sum
from ._decode import Runs

__all__ = ["ScanEngine"]


class ScanEngine(Engine):
    name = "scan"
    supports_causal = True
    traceable = True
    gives_causal_sums = True

    def serves(self, library: str) -> bool:
        return True

    def decodes(self, k) -> bool:
        return True

    def decode_runs(self, xp, work, profile, *, center, normalizer, dv):
        return Runs(xp, work, profile, center=center, normalizer=normalizer, dv=dv)

    def kernel_sum(self, x, y, w, profile, *, xp):
        return kernel_sum(x, y, w, profile, xp=xp)

    def attention(self, inputs, form, *, xp, for_backward=False):
        out, aux = attention(inputs, form, xp=xp)
        return out, self.residuals_of(aux)

    def causal_attention(self, inputs, form, *, xp):
        out, aux = causal_attention(inputs, form, xp=xp)
        return out, self.residuals_of(aux)

    def causal_profile_sums(self, x, y, w, profiles, *, xp):
        return causal_profile_sums(x, y, w, profiles, xp=xp)

    def causal_profiles_vjp(self, x, y, w, profiles, cotangents, *, xp, param_grads=True):
        return causal_profiles_vjp(x, y, w, profiles, cotangents, xp=xp, param_grads=param_grads)

    def profiles_vjp(self, x, y, w, profiles, cotangents, *, xp, param_grads=True):
        return profiles_vjp(x, y, w, profiles, cotangents, xp=xp, param_grads=param_grads)

    def indicator_sums(self, q, k, ones, profiles, *, xp):
        return indicator_sums(q, k, ones, profiles, xp=xp)
