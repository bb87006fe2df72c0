"""JAX fast paths (jit- and vmap-safe)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def _search_row(keys, vals):
    return jnp.searchsorted(keys, vals, side="right", method="scan_unrolled")


_search_rows = jax.vmap(_search_row)


def searchsorted_right(sorted_keys, values):
    """``jnp.searchsorted`` vectorised over the leading axes with ``vmap``."""
    lead = values.shape[:-1]
    keys2 = jnp.reshape(sorted_keys, (-1, sorted_keys.shape[-1]))
    vals2 = jnp.reshape(values, (-1, values.shape[-1]))
    return jnp.reshape(_search_rows(keys2, vals2), lead + (values.shape[-1],))


# ------------------------------------------------------------------------------- autograd adapter


def _namespace():
    import array_api_compat
    return array_api_compat.array_namespace(jnp.zeros(()))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sort_scan(spec, out_dtype, *arrays):
    from .._diff import forward
    out, _ = forward(spec, arrays, xp=_namespace())
    return out.astype(out_dtype)


def _sort_scan_fwd(spec, out_dtype, *arrays):
    from .._diff import forward
    out, residuals = forward(spec, arrays, xp=_namespace())
    out = out.astype(out_dtype)
    if residuals:
        residuals = (out, residuals[1])
    return out, (arrays, residuals)


def _sort_scan_bwd(spec, out_dtype, saved, grad_out):
    from .._diff import backward
    arrays, residuals = saved
    grads = backward(spec, arrays, residuals, grad_out.astype(arrays[0].dtype), xp=_namespace())
    return tuple(None if g is None else g.astype(a.dtype) for g, a in zip(grads, arrays))


_sort_scan.defvjp(_sort_scan_fwd, _sort_scan_bwd)


def apply(spec, arrays, out_dtype):
    """Run ``spec`` on JAX arrays through a ``custom_vjp`` (jit-, vmap- and grad-safe)."""
    return _sort_scan(spec, jnp.dtype(out_dtype), *arrays)
