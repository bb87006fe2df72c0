"""The fast engines as registered torch operators, for ``torch.compile`` and ``torch.export``.

Dynamo cannot trace into the sweep (numba on host memory) or triton (its own launches): a compiled
call of an op would otherwise fall back to tracing the scan. Here one op call becomes one opaque node
of the graph, ``slicedkern::attention`` (or ``slicedkern::kernel_sum``), whose real implementation
is the engine's forward on real tensors, and whose backward is a second operator,
``slicedkern::attention_backward``, the engine's backward (docs/compile.rst). The static part of the
call (the spec) travels as text and numbers (:func:`slicedkern._spec.spec_parts`) and the engine by
name; each operator has a fake implementation that declares the output and residual shapes from the
inputs' alone (:meth:`slicedkern.engines._base.Engine.residual_layout`), without reading their data,
so the graph traces with symbolic sequence lengths.

Eager calls keep :mod:`._torch`'s ``autograd.Function``: the same engine calls on the same tensors,
so eager and compiled results agree bit for bit, without the dispatcher's per-call cost.
"""

from __future__ import annotations

import array_api_compat.torch as xp
import torch

from .._spec import KernelSumSpec, spec_from_parts, spec_parts
from ..engines import get as engine_named

__all__ = ["apply", "attention", "attention_backward", "kernel_sum", "kernel_sum_backward", "SECOND_ORDER"]

SECOND_ORDER = ("slicedkern's sort-scan ops are differentiable once: their gradient is piecewise "
                "constant in the scores, with jumps at ties, so a second derivative (create_graph=True, "
                "torch.func.hessian, double backward) is not supported")


def _forward(arrays: list[torch.Tensor], spec: str, numbers: list[float], engine: str, out_dtype: torch.dtype,
             keep: bool) -> list[torch.Tensor]:
    """``[out, *residuals]`` of ``spec`` on the engine called ``engine``; residuals only with ``keep``
    (a backward will follow), as many and as shaped as the engine's ``residual_layout`` says, or
    none when it cannot say (the backward operator then runs the forward again for them)."""
    call_spec, runner = spec_from_parts(spec, numbers), engine_named(engine)
    keep = keep and runner.residual_layout(call_spec, arrays, xp=xp) is not None
    out, residuals = runner.forward(call_spec, tuple(arrays), xp=xp, for_backward=keep)
    return _unaliased([out.to(out_dtype), *(residuals if keep else ())], arrays)


def _unaliased(results, inputs):
    """``results`` contiguous (as the fakes declare them), with a copy of each that shares memory with
    an input or an earlier result: an operator's outputs may alias neither (an engine may return an
    input it had no need to copy, the mask as the keys' "take" say)."""
    seen = {a.untyped_storage().data_ptr() for a in inputs if a.numel()}
    fresh = []
    for r in results:
        r = r.contiguous()
        if r.numel():
            if r.untyped_storage().data_ptr() in seen:
                r = r.clone()
            seen.add(r.untyped_storage().data_ptr())
        fresh.append(r)
    return fresh


def _forward_fake(arrays, spec, numbers, engine, out_dtype, keep):
    # the layout reads the spec's structure only, never its numbers (symbolic under dynamic shapes)
    call_spec, runner = spec_from_parts(spec, [0.0] * len(numbers)), engine_named(engine)
    q, v = arrays[0], arrays[2]         # (q, k, v) or (x, y, w): out (..., n, c) either way
    out = q.new_empty(tuple(q.shape) + (v.shape[-1],), dtype=out_dtype)
    layout = runner.residual_layout(call_spec, arrays, xp=xp) if keep else ()
    return [out] + [q.new_empty(shape, dtype=dtype) for shape, dtype in (layout or ())]


def _backward(arrays: list[torch.Tensor], out: torch.Tensor, residuals: list[torch.Tensor],
              grad: torch.Tensor, spec: str, numbers: list[float], engine: str) -> list[torch.Tensor]:
    """The cotangents of the differentiable ``arrays`` (every one but the mask), in order."""
    call_spec, runner = spec_from_parts(spec, numbers), engine_named(engine)
    with torch.no_grad():
        if runner.residual_layout(call_spec, arrays, xp=xp) is None:
            # the forward could not declare its residuals and kept none: they are made again here, by
            # the same forward, so that the backward is the eager one (flash-attention recomputes too)
            _, residuals = runner.forward(call_spec, tuple(arrays), xp=xp, for_backward=True)
        grads = runner.backward(call_spec, tuple(arrays), out, tuple(residuals), grad, xp=xp)
    kept = [g for g, a in zip(grads, arrays) if _differentiable(a)]
    return _unaliased(kept, (*arrays, out, *residuals, grad))


def _backward_fake(arrays, out, residuals, grad, spec, numbers, engine):
    return [a.new_empty(a.shape) for a in arrays if _differentiable(a)]


def _differentiable(a) -> bool:
    return a.is_floating_point()


def _setup_context(ctx, inputs, output):
    arrays, spec, numbers, engine, _, _ = inputs
    ctx.spec, ctx.numbers, ctx.engine, ctx.n_arrays = spec, numbers, engine, len(arrays)
    ctx.floating = [_differentiable(a) for a in arrays]
    ctx.save_for_backward(*arrays, *output)


def _autograd_backward(backward_op):
    def backward(ctx, grads):
        saved = ctx.saved_tensors
        arrays, out, residuals = saved[:ctx.n_arrays], saved[ctx.n_arrays], saved[ctx.n_arrays + 1:]
        grad = grads[0]
        if grad is None:
            grad = torch.zeros_like(out)
        computed = iter(backward_op(list(arrays), out, list(residuals), grad, ctx.spec, ctx.numbers, ctx.engine))
        return [next(computed) if floating else None for floating in ctx.floating], None, None, None, None, None

    return backward


def _register(name: str):
    """``slicedkern::<name>`` and ``slicedkern::<name>_backward``, with fakes and autograd."""
    forward = torch.library.custom_op(f"slicedkern::{name}", _forward, mutates_args=())
    backward = torch.library.custom_op(f"slicedkern::{name}_backward", _backward, mutates_args=())
    forward.register_fake(_forward_fake)
    backward.register_fake(_backward_fake)
    forward.register_autograd(_autograd_backward(backward), setup_context=_setup_context)
    backward.register_autograd(_second_order, setup_context=_no_context)
    return forward, backward


def _no_context(ctx, inputs, output):
    pass


def _second_order(ctx, *grads):
    raise RuntimeError(SECOND_ORDER)


attention, attention_backward = _register("attention")
kernel_sum, kernel_sum_backward = _register("kernel_sum")


def apply(spec, engine, arrays, out_dtype):
    """Run ``spec`` on ``engine`` as one operator node: the compiled form of :func:`._torch.apply`."""
    op = kernel_sum if isinstance(spec, KernelSumSpec) else attention
    keep = torch.is_grad_enabled() and any(a.requires_grad for a in arrays if a.is_floating_point())
    text, numbers = spec_parts(spec)
    return op(list(arrays), text, numbers, engine.name, out_dtype, keep)[0]
