"""The JAX side of sequence-parallel attention: a communicator over a named mesh axis (inside
``shard_map``); the ``custom_vjp`` is the adapters'.

Imported only once a JAX array reaches :mod:`slicedkern.distributed`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

__all__ = ["JaxComm"]


@dataclass(frozen=True)
class JaxComm:
    """Collectives over the mesh axis ``axis_name`` (usable inside ``shard_map``)."""

    axis_name: str

    @property
    def rank(self):
        """This device's index along the axis (a traced scalar)."""
        return jax.lax.axis_index(self.axis_name)

    def gather(self, x, axis):
        return jax.lax.all_gather(x, self.axis_name, axis=axis % x.ndim, tiled=True)

    def scatter_sum(self, x, axis):
        return jax.lax.psum_scatter(x, self.axis_name, scatter_dimension=axis % x.ndim, tiled=True)

    def sum(self, x):
        return jax.lax.psum(x, self.axis_name)
