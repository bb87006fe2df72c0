"""The torch adapter: one sort-scan op as a ``torch.autograd.Function``.

``forward`` is context-free and ``setup_context`` saves the inputs, the output and the engine's flat
residuals, so the graph holds ``O(n Dv)`` memory like the inputs; ``backward`` calls the same
engine's backward. Composes with ``torch.func.grad``; under ``torch.compile`` an engine dynamo cannot
trace runs as a registered operator instead (:mod:`._torch_ops`, docs/compile.rst).
"""

from __future__ import annotations

import array_api_compat.torch as xp
import torch

from ._torch_ops import SECOND_ORDER
from ._torch_ops import apply as as_operator

__all__ = ["apply", "SECOND_ORDER"]


class SortScan(torch.autograd.Function):
    """The op of a static ``spec`` on an ``engine``; outputs ``(out, *residuals)``, all tensors."""

    @staticmethod
    def forward(spec, engine, out_dtype, *arrays):
        out, residuals = engine.forward(spec, arrays, xp=xp, for_backward=True)
        return (out.to(out_dtype), *residuals)

    @staticmethod
    def setup_context(ctx, inputs, output):
        spec, engine, _, *arrays = inputs
        out, *residuals = output
        ctx.spec, ctx.engine, ctx.n_arrays = spec, engine, len(arrays)
        if residuals:
            ctx.mark_non_differentiable(*residuals)
        ctx.save_for_backward(*arrays, out, *residuals)

    @staticmethod
    def backward(ctx, grad_out, *_):
        # a collective engine's backward runs collectives: every rank runs it, whatever it needs
        if not any(ctx.needs_input_grad[3:]) and not ctx.engine.collective:
            return (None, None, None) + (None,) * ctx.n_arrays
        saved = ctx.saved_tensors
        arrays, out, residuals = saved[:ctx.n_arrays], saved[ctx.n_arrays], saved[ctx.n_arrays + 1:]
        # the cotangent as it comes (the output's dtype): an engine casts what it reads (the sweep
        # reads it in the values' dtype: no float64 copy of an (n, D) array)
        with torch.no_grad():
            grads = ctx.engine.backward(ctx.spec, arrays, out, tuple(residuals), grad_out, xp=xp)
        grads = [g if need else None for g, need in zip(grads, ctx.needs_input_grad[3:])]
        if torch.is_grad_enabled():
            # a graph of the backward is being recorded (create_graph=True, torch.func): the
            # gradients pass through a node that refuses to be differentiated; first-order
            # transforms such as torch.func.grad never call it
            kept = [g for g in grads if g is not None]
            kept = iter(FirstOrderOnly.apply(len(kept), *kept, grad_out, *arrays))
            grads = [None if g is None else next(kept) for g in grads]
        return (None, None, None, *grads)


class FirstOrderOnly(torch.autograd.Function):
    """The identity on the first ``n`` tensors (the gradients); the rest are what they depend on."""

    @staticmethod
    def forward(n, *tensors):
        return tuple(t.clone() for t in tensors[:n])

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(SECOND_ORDER)


def apply(spec, engine, arrays, out_dtype):
    """Run ``spec`` on torch tensors; an autograd node only when some input requires grad. Under
    ``torch.compile`` an engine that cannot be traced runs as one operator node (:mod:`._torch_ops`)."""
    if torch.compiler.is_compiling() and not engine.traceable:
        return as_operator(spec, engine, arrays, out_dtype)
    if torch.is_grad_enabled() and any(a.requires_grad for a in arrays if a.is_floating_point()):
        return SortScan.apply(spec, engine, out_dtype, *arrays)[0]
    out, _ = engine.forward(spec, arrays, xp=xp)
    return out
