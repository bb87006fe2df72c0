"""The bench's view of each array library: inputs, conversion, synchronisation, differentiation.

Which libraries exist, and what they are called, comes from the package's one backend list,
:class:`slicedkern._lib.backends.Backend`; this module adds only what timing needs. The framework
of a backend is imported when that backend is built, never at import time.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import numpy as np

import slicedkern
from slicedkern._lib.backends import Backend
from slicedkern._lib.typing import Array

from .measure import proc_status

__all__ = ["BENCH_BACKENDS", "BACKEND_NAMES", "default_backend", "installed_backends",
           "BenchBackend", "make_backend", "Sdpa"]

#: The backends the bench times, in the order it lists them. torch on a GPU is ``--backend torch
#: --device cuda`` (:attr:`Backend.TORCH_CUDA`); array_api_strict checks conformance and is not
#: worth timing, and CuPy has no bench backend yet.
BENCH_BACKENDS = (Backend.NUMPY, Backend.TORCH, Backend.JAX)
#: Their names, the choices of ``--backend``.
BACKEND_NAMES = tuple(b.value for b in BENCH_BACKENDS)


def installed_backends() -> list[str]:
    """The names of the bench backends whose library can be imported here."""
    return [b.value for b in BENCH_BACKENDS if b.installed()]


def default_backend() -> str:
    """torch where installed (SDPA is timed on it anyway), else NumPy."""
    return Backend.TORCH.value if Backend.TORCH.installed() else Backend.NUMPY.value


class BenchBackend(abc.ABC):
    """Inputs, synchronisation and differentiation for one array library on one device.

    Parameters
    ----------
    device : {"cpu", "cuda"}
        Device of the arrays.
    batch, dim : int
        Batch size and value dimension ``D`` of the inputs.
    seed : int
        Seed of the inputs.

    Attributes
    ----------
    member : Backend
        The entry of the package's backend list this is (``TORCH_CUDA`` for torch on ``"cuda"``).
    gradients : str
        How the forward+backward columns differentiate, for the footer.
    """

    member: Backend
    gradients = ""

    def __init__(self, device: str, batch: int, dim: int, seed: int = 0):
        self.device, self.batch, self.dim = device, batch, dim
        self.rng = np.random.default_rng(seed)

    @property
    def name(self) -> str:
        """The ``--backend`` name (the library: ``"torch"`` on either device)."""
        return self.member.module

    @property
    def library(self) -> str:
        """The library as the engine registry names it."""
        return self.member.library

    def host_inputs(self, n: int, *, batch: int | None = None) -> tuple:
        """float32 NumPy ``q, k (batch, n)``, ``v, g (batch, n, D)``."""
        b = self.batch if batch is None else batch
        q, k = (self.rng.standard_normal((b, n), dtype=np.float32) for _ in range(2))
        v, g = (self.rng.standard_normal((b, n, self.dim), dtype=np.float32) for _ in range(2))
        return q, k, v, g

    def inputs(self, n: int, *, batch: int | None = None) -> tuple:
        """``q, k, v, g`` on this backend and device."""
        return tuple(self.convert(a) for a in self.host_inputs(n, batch=batch))

    def memory_method(self) -> str | None:
        """How to probe the memory of calls on this backend (see :class:`~.measure.Probe`)."""
        return "rss" if proc_status("VmHWM") is not None else None

    @abc.abstractmethod
    def convert(self, a: Array) -> Array:
        """``a`` (NumPy) as an array of this backend, on its device."""

    def sync(self, out: object) -> object:
        """Wait for ``out`` to be computed."""
        return out

    @abc.abstractmethod
    def forward(self, fn: Callable) -> Callable:
        """A closure ``run(q, k, v, g)`` computing ``fn(q, k, v)`` (``g`` unused)."""

    @abc.abstractmethod
    def forward_backward(self, fn: Callable) -> Callable:
        """A closure ``run(q, k, v, g)`` computing ``fn(q, k, v)`` and the gradients of
        ``sum(g * out)`` with respect to ``q, k, v``."""


class NumpyBackend(BenchBackend):
    """NumPy on the CPU; gradients through :func:`slicedkern.vjp`."""

    member = Backend.NUMPY
    gradients = "slicedkern.vjp."

    def convert(self, a):
        return a

    def memory_method(self):
        # tracemalloc sees NumPy's data buffers, with a finer grain than the page-sized RSS.
        return "tracemalloc"

    def forward(self, fn):
        def run(q, k, v, g):
            return fn(q, k, v)
        return run

    def forward_backward(self, fn):
        def run(q, k, v, g):
            _, pullback = slicedkern.vjp(fn, q, k, v)
            return pullback(g)
        return run


class TorchBackend(BenchBackend):
    """torch on the CPU or a CUDA device; gradients through autograd."""

    gradients = "torch autograd."

    def __init__(self, device, batch, dim, seed=0):
        super().__init__(device, batch, dim, seed)
        import torch
        self.torch = torch
        self.dev = torch.device(device)
        self.member = Backend.TORCH_CUDA if self.dev.type == "cuda" else Backend.TORCH
        if self.dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here")

    def convert(self, a):
        return self.torch.from_numpy(a).to(self.dev)

    def memory_method(self):
        return "cuda" if self.dev.type == "cuda" else super().memory_method()

    def sync(self, out):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()
        return out

    def forward(self, fn):
        def run(q, k, v, g):
            with self.torch.no_grad():
                return self.sync(fn(q, k, v))
        return run

    def forward_backward(self, fn):
        def run(q, k, v, g):
            for a in (q, k, v):                # the inputs are this cell's own leaf tensors
                a.requires_grad_(True)
                a.grad = None
            out = fn(q, k, v)
            out.backward(g)
            return self.sync((q.grad, k.grad, v.grad))
        return run


class JaxBackend(BenchBackend):
    """JAX on its CPU or GPU device; every call jitted, gradients through ``jax.grad``."""

    member = Backend.JAX
    gradients = ("jax.grad, jitted. JAX timings are of jitted functions, compiled (per shape) "
                 "before timing.")

    def __init__(self, device, batch, dim, seed=0):
        super().__init__(device, batch, dim, seed)
        import jax
        self.jax = jax
        platform_name = {"cuda": "gpu"}.get(device, device)
        try:
            self.dev = jax.devices(platform_name)[0]
        except RuntimeError as exc:
            raise ValueError(f"--device {device}: JAX has no such device here ({exc})") from None

    def convert(self, a):
        return self.jax.device_put(a, self.dev)

    def memory_method(self):
        return super().memory_method() if self.dev.platform == "cpu" else None

    def sync(self, out):
        # JAX dispatches asynchronously: without this the timings would be of the dispatch.
        return self.jax.block_until_ready(out)

    def forward(self, fn):
        jitted = self.jax.jit(lambda q, k, v: fn(q, k, v))

        def run(q, k, v, g):
            return self.sync(jitted(q, k, v))
        return run

    def forward_backward(self, fn):
        import jax.numpy as jnp
        jax = self.jax
        grad = jax.jit(jax.grad(lambda q, k, v, g: jnp.sum(fn(q, k, v) * g), argnums=(0, 1, 2)))

        def run(q, k, v, g):
            return self.sync(grad(q, k, v, g))
        return run


_CLASSES = {Backend.NUMPY: NumpyBackend, Backend.TORCH: TorchBackend, Backend.JAX: JaxBackend}


def make_backend(name: str, device: str, batch: int, dim: int) -> BenchBackend:
    """The bench backend ``name`` on ``device``, importing its framework.

    Parameters
    ----------
    name : {"numpy", "torch", "jax"}
        One of :data:`BACKEND_NAMES`.
    device : {"cpu", "cuda"}
        Device of the arrays.
    batch, dim : int
        Batch size and value dimension ``D``.

    Returns
    -------
    BenchBackend

    Raises
    ------
    ValueError
        For a name the bench does not time, or a device the backend does not have.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == Backend.NUMPY.value and device != "cpu":
        raise ValueError(f"--backend numpy runs on the CPU only, not --device {device}")
    return _CLASSES[Backend(name)](device, batch, dim)


class Sdpa:
    """torch ``scaled_dot_product_attention`` on ``(batch, 1, L, D)`` float32 inputs.

    Timed next to every backend (torch is imported here even when the sliced ops run on NumPy or
    JAX), with its natural inputs: one head of ``L`` tokens of dimension ``D``.

    Parameters
    ----------
    device : {"cpu", "cuda"}
        torch device of SDPA.
    backend : BenchBackend
        The bench backend, for the batch size and ``D``.
    """

    def __init__(self, device: str, backend: BenchBackend):
        import torch
        self.torch, self.backend = torch, backend
        self.dev = torch.device(device)
        if self.dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here")
        self.probe = "cuda" if self.dev.type == "cuda" else (
            "rss" if proc_status("VmHWM") is not None else None)

    def inputs(self, backend: BenchBackend, n: int) -> tuple:
        """``q, k, v`` of shape ``(batch, 1, n, D)`` and no cotangent."""
        torch, b = self.torch, self.backend
        gen = torch.Generator().manual_seed(n)
        shape = (b.batch, 1, n, b.dim)
        return tuple(torch.randn(shape, generator=gen, dtype=torch.float32).to(self.dev)
                     for _ in range(3)) + (None,)

    def run(self, q, k, v, g):
        """The forward, synchronised (``g`` unused)."""
        torch = self.torch
        with torch.no_grad():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        return out


class NumpySoftmax:
    """Softmax attention written in NumPy, where torch (and so SDPA) is not installed.

    The same problem as :class:`Sdpa`: ``(batch, 1, L, D)`` float32 queries, keys and values,
    ``softmax(q k^T / sqrt(D)) v`` with the row maximum subtracted; one batched matmul each way, in
    float32 (the ``L x L`` weights are formed, as a plain softmax attention does).

    Parameters
    ----------
    backend : BenchBackend
        The bench backend, for the batch size and ``D``.
    """

    probe = "tracemalloc"

    def __init__(self, backend: BenchBackend):
        self.backend = backend

    def inputs(self, backend: BenchBackend, n: int) -> tuple:
        """``q, k, v`` of shape ``(batch, 1, n, D)`` float32, and no cotangent."""
        b = self.backend
        rng = np.random.default_rng(n)
        shape = (b.batch, 1, n, b.dim)
        return tuple(rng.standard_normal(shape, dtype=np.float32) for _ in range(3)) + (None,)

    def run(self, q, k, v, g):
        """The forward (``g`` unused)."""
        scores = q @ np.swapaxes(k, -1, -2)
        scores *= np.float32(1.0 / np.sqrt(q.shape[-1]))
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        return scores @ v

