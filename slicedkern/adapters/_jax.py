"""The JAX adapter: one sort-scan op as a ``jax.custom_vjp`` (jit-, vmap- and grad-safe).

The spec, the engine and the output dtype are static (non-differentiable) arguments; the forward's
residuals are the inputs, the output and the engine's flat residual arrays.
"""

from __future__ import annotations

from functools import partial

import array_api_compat
import jax
import jax.numpy as jnp

__all__ = ["apply"]

_xp = array_api_compat.array_namespace(jnp.zeros(()))

SECOND_ORDER = ("slicedkern's sort-scan ops are differentiable once: their gradient is piecewise "
                "constant in the scores, with jumps at ties, so a second derivative (grad of grad, "
                "jax.hessian) is not supported")


@jax.custom_vjp
def _first_order_only(grads, depends_on):
    """The identity on the backward's cotangents, which refuses to be differentiated itself.

    ``depends_on`` (the backward's inputs) ties the cotangents to what a second derivative would
    follow: the engine's backward runs on ``stop_gradient`` copies (its tie searches use
    ``nextafter``, which has no derivative), so without it a second derivative would be silently 0.
    """
    return grads


def _first_order_fwd(grads, depends_on):
    return grads, None


def _first_order_bwd(_, __):
    raise TypeError(SECOND_ORDER)


_first_order_only.defvjp(_first_order_fwd, _first_order_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _sort_scan(spec, engine, out_dtype, *arrays):
    out, _ = engine.forward(spec, arrays, xp=_xp)
    return out.astype(out_dtype)


def _sort_scan_fwd(spec, engine, out_dtype, *arrays):
    # stop_gradient: under an outer derivative (grad of grad) this forward is itself traced, and
    # its tie searches (nextafter) have no derivative; the saved ``arrays`` keep theirs, so the
    # second derivative reaches _first_order_only and is refused there
    out, residuals = engine.forward(spec, jax.lax.stop_gradient(arrays), xp=_xp, for_backward=True)
    out = out.astype(out_dtype)
    return out, (arrays, out, residuals)


def _sort_scan_bwd(spec, engine, out_dtype, saved, grad_out):
    depends_on = (saved, grad_out)
    arrays, out, residuals, grad_out = jax.lax.stop_gradient((*saved, grad_out))
    grads = engine.backward(spec, arrays, out, residuals, grad_out.astype(arrays[0].dtype), xp=_xp)
    grads = tuple(None if g is None else g.astype(a.dtype) for g, a in zip(grads, arrays))
    return _first_order_only(grads, depends_on)


_sort_scan.defvjp(_sort_scan_fwd, _sort_scan_bwd)


def apply(spec, engine, arrays, out_dtype):
    """Run ``spec`` on JAX arrays through the ``custom_vjp``."""
    return _sort_scan(spec, engine, jnp.dtype(out_dtype), *arrays)
