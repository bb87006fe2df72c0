"""JAX fast paths (jit- and vmap-safe)."""

from __future__ import annotations

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
