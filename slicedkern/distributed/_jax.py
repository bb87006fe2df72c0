"""The JAX side of sequence-parallel attention: a communicator over a named mesh axis (inside
``shard_map``) and the ``custom_vjp`` whose backward runs the mirrored collectives.

Imported only once a JAX array reaches :mod:`slicedkern.distributed`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial

import array_api_compat
import jax
import jax.numpy as jnp

from . import _causal, _core

__all__ = ["JaxComm", "apply"]

_xp = array_api_compat.array_namespace(jnp.zeros(()))


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


def _algorithm(spec):
    """The module that runs ``spec``: :mod:`._causal` for causal attention, else :mod:`._core`."""
    return _causal if spec.causal else _core


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _sharded(spec, engine, comm, out_dtype, *arrays):
    out, _ = _algorithm(spec).forward(spec, engine, comm, arrays, xp=_xp)
    return out.astype(out_dtype)


def _sharded_fwd(spec, engine, comm, out_dtype, *arrays):
    out, saved = _algorithm(spec).forward(spec, engine, comm, arrays, xp=_xp)
    return out.astype(out_dtype), (arrays, tuple(getattr(saved, f.name) for f in fields(saved)))


def _sharded_bwd(spec, engine, comm, out_dtype, residuals, grad_out):
    arrays, saved = residuals
    algorithm = _algorithm(spec)
    saved_type = algorithm.CausalSaved if spec.causal else algorithm.Saved
    grads = algorithm.backward(spec, engine, comm, arrays, saved_type(*saved), grad_out.astype(arrays[0].dtype), xp=_xp)
    return tuple(None if g is None else g.astype(a.dtype) for g, a in zip(grads, arrays))


_sharded.defvjp(_sharded_fwd, _sharded_bwd)


def apply(prepared, axis_name):
    """Run a prepared call sequence-parallel over the mesh axis ``axis_name``."""
    _, spec, engine, inputs, _, out_dtype = prepared
    return _sharded(spec, engine, JaxComm(axis_name), jnp.dtype(out_dtype), *inputs)
