"""The JAX row of the backend registry (jit- and vmap-safe)."""

from __future__ import annotations

import array_api_compat as compat
import jax
import jax.numpy as jnp
import numpy as np

from ._generic import ArrayBackend


def _search_row(keys, vals):
    return jnp.searchsorted(keys, vals, side="right", method="scan_unrolled")


_search_rows = jax.vmap(_search_row)


class JaxBackend(ArrayBackend):
    library = "jax"
    autograd = True

    def owns_namespace(self, xp) -> bool:
        return compat.is_jax_namespace(xp)

    def owns_array(self, a) -> bool:
        return compat.is_jax_array(a)

    def is_traced(self, a) -> bool:
        return isinstance(a, jax.core.Tracer)

    def to_host(self, a) -> np.ndarray:
        return np.asarray(a)

    def holds_everywhere(self, xp, a, predicate) -> bool | None:
        # Inside a trace every jnp operation is staged, even on a concrete array closed over by the
        # jitted function, and bool() of the result fails: check concrete values on the host.
        if self.is_traced(a):
            return None
        return bool(np.all(predicate(np, np.asarray(a))))

    def compile(self, fn):
        return jax.jit(fn)

    def materialize(self, xp, *arrays):
        # In a loop whose steps each read the previous step's result twice (the Hillis-Steele scan),
        # XLA would otherwise fuse the steps and recompute each one exponentially often.
        return jax.lax.optimization_barrier(arrays)

    def searchsorted_right(self, xp, sorted_keys, values):
        """``jnp.searchsorted`` vectorised over the leading axes with ``vmap``."""
        lead = values.shape[:-1]
        keys2 = jnp.reshape(sorted_keys, (-1, sorted_keys.shape[-1]))
        vals2 = jnp.reshape(values, (-1, values.shape[-1]))
        return jnp.reshape(_search_rows(keys2, vals2), lead + (values.shape[-1],))
