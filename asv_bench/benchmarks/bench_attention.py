"""Sliced ReLU attention and hat attention: forward, forward+backward, peak memory, accuracy.

Inputs: ``q, k`` of shape (4, n) (one projected score per token) and ``v`` (4, n, 32), float32.
Forward+backward computes the gradients of ``sum(g * out)`` with respect to ``q, k, v``: torch
autograd, ``jax.grad`` (jitted), or :func:`slicedkern.vjp` for NumPy.
"""

from __future__ import annotations

import numpy as np

from .common import (
    BACKENDS,
    ENGINES,
    Benchmark,
    backend_module,
    public,
    random_inputs,
    relative_error,
    sync,
    to_backend,
)

SIZES = [2 ** 12, 2 ** 16]
HAT_BANDWIDTH = 0.1


def relu(q, k, v):
    """The op of the ``Relu*`` benchmarks."""
    import slicedkern
    return slicedkern.relu_attention(q, k, v)


def hat(q, k, v):
    """The op of the ``Hat*`` benchmarks."""
    import slicedkern
    return slicedkern.hat_attention(q, k, v, HAT_BANDWIDTH)


class _Forward(Benchmark):
    """Forward pass of ``op``: time, peak memory and float32 accuracy."""

    op = None
    params = [BACKENDS, ENGINES, SIZES]
    param_names = ["backend", "engine", "n"]

    def setup(self, backend, engine, n):
        backend_module(backend)
        self.host = random_inputs(n)[:3]
        self.q, self.k, self.v = (to_backend(backend, a) for a in self.host)
        op = type(self).op
        if backend == "jax":
            import jax
            op = jax.jit(op)
        self.fn = op
        self.enter_engine(engine, self.q)
        try:
            sync(backend, self.fn(self.q, self.k, self.v))      # warm-up: JIT, numba, lazy init
        except Exception as exc:
            self.teardown()
            raise NotImplementedError(f"forward fails here: {exc}") from exc

    def time_forward(self, backend, engine, n):
        sync(backend, self.fn(self.q, self.k, self.v))

    def peakmem_forward(self, backend, engine, n):
        sync(backend, self.fn(self.q, self.k, self.v))

    def track_float32_error(self, backend, engine, n):
        """Normwise relative error of the float32 output vs float64 on the same inputs."""
        exact = type(self).op(*(a.astype(np.float64) for a in self.host))
        return relative_error(self.fn(self.q, self.k, self.v), exact)

    track_float32_error.unit = "relative error"


class _ForwardBackward(Benchmark):
    """Forward and backward pass of ``op`` (gradients with respect to q, k and v)."""

    op = None
    params = [BACKENDS, ENGINES, SIZES]
    param_names = ["backend", "engine", "n"]

    def setup(self, backend, engine, n):
        backend_module(backend)
        host = random_inputs(n)
        op = type(self).op
        if backend == "numpy":
            vjp = public("vjp", "_dispatch")
            self.q, self.k, self.v, self.g = host

            def run():
                return vjp(op, self.q, self.k, self.v)[1](self.g)
        elif backend == "torch":
            import torch
            self.q, self.k, self.v = (torch.from_numpy(a).requires_grad_(True) for a in host[:3])
            self.g = torch.from_numpy(host[3])

            def run():   # autograd.grad: no .grad accumulation between calls
                return torch.autograd.grad(op(self.q, self.k, self.v), (self.q, self.k, self.v),
                                           self.g)
        else:
            import jax
            import jax.numpy as jnp
            self.q, self.k, self.v, self.g = (to_backend("jax", a) for a in host)
            grad = jax.jit(jax.grad(lambda q, k, v, g: jnp.sum(op(q, k, v) * g), argnums=(0, 1, 2)))

            def run():
                return jax.block_until_ready(grad(self.q, self.k, self.v, self.g))
        self.run = run
        self.enter_engine(engine, self.q)
        try:
            run()                                                   # warm-up: JIT, numba, lazy init
        except Exception as exc:
            self.teardown()
            raise NotImplementedError(f"backward not available here: {exc}") from exc

    def time_forward_backward(self, backend, engine, n):
        self.run()


class ReluAttention(_Forward):
    """``relu_attention(q, k, v)`` forward."""

    op = staticmethod(relu)


class ReluAttentionGrad(_ForwardBackward):
    """``relu_attention(q, k, v)`` forward + backward."""

    op = staticmethod(relu)


class HatAttention(_Forward):
    """``hat_attention(q, k, v, 0.1)`` forward."""

    op = staticmethod(hat)


class HatAttentionGrad(_ForwardBackward):
    """``hat_attention(q, k, v, 0.1)`` forward + backward."""

    op = staticmethod(hat)


class AttentionTraining(Benchmark):
    """Forward and forward + backward at a training shape: torch CPU float32, 8 rows (B * H), D = 64.

    ``relu``: ``relu_attention(q, k, v)``; ``hat``: ``hat_attention(q, k, v, b)`` with a per-row
    bandwidth ``b`` that requires grad (so the backward includes the bandwidth gradient). The
    figures of scripts/sweep_backward_speed.py, where the backward should stay within 2x the forward.
    """

    params = [BACKENDS, ENGINES, [2 ** 14, 2 ** 16], ["relu", "hat"]]
    param_names = ["backend", "engine", "n", "op"]
    timeout = 600

    def setup(self, backend, engine, n, op):
        if backend != "torch":
            raise NotImplementedError("a torch training shape")
        backend_module("torch")
        import torch

        import slicedkern
        q, k, v, g = random_inputs(n, batch=8, dim=64)
        self.q, self.k, self.v = (torch.from_numpy(a).requires_grad_(True) for a in (q, k, v))
        self.b = torch.full((8,), 0.5, requires_grad=True)
        self.g = torch.from_numpy(g)
        if op == "relu":
            self.fn = lambda: slicedkern.relu_attention(self.q, self.k, self.v)
            self.inputs = (self.q, self.k, self.v)
        else:
            self.fn = lambda: slicedkern.hat_attention(self.q, self.k, self.v, self.b)
            self.inputs = (self.q, self.k, self.v, self.b)
        self.enter_engine(engine, self.q)
        try:
            self.time_forward_backward(backend, engine, n, op)  # warm-up: numba, allocator
        except Exception as exc:
            self.teardown()
            raise NotImplementedError(f"not available here: {exc}") from exc

    def time_forward(self, backend, engine, n, op):
        self.fn()

    def time_forward_backward(self, backend, engine, n, op):
        import torch
        torch.autograd.grad(self.fn(), self.inputs, self.g)
