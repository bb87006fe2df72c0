"""The 1-D primitive: ``kernel_sum(x, y, w, kernel)`` for ReLU, a hat and a mixture of hats."""

from __future__ import annotations

import numpy as np

from .common import BACKENDS, BATCH, DIM, ENGINES, Benchmark, backend_module, relative_error, sync, to_backend

KERNELS = ["relu", "hat", "mixture"]


def make_kernel(name):
    """The profile benchmarked under ``name``."""
    from slicedkern import kernels
    if name == "relu":
        return kernels.ReLU()
    if name == "hat":
        return kernels.Hat(0.1)
    return kernels.HatMixture([0.05, 0.2, 1.0], [1.0, 0.5, 0.25])


class KernelSum(Benchmark):
    """``S_i = sum_j f(x_i - y_j) w_j`` with ``x, y (4, n)`` and ``w (4, n, 32)``, float32."""

    params = [BACKENDS, ENGINES, [2 ** 12, 2 ** 16], KERNELS]
    param_names = ["backend", "engine", "n", "kernel"]

    def setup(self, backend, engine, n, kernel):
        backend_module(backend)
        import slicedkern
        rng = np.random.default_rng(n)
        self.host = (rng.standard_normal((BATCH, n)).astype(np.float32),
                     rng.standard_normal((BATCH, n)).astype(np.float32),
                     rng.standard_normal((BATCH, n, DIM)).astype(np.float32))
        self.x, self.y, self.w = (to_backend(backend, a) for a in self.host)
        self.kernel = make_kernel(kernel)
        self.backend = backend
        fn = slicedkern.kernel_sum
        if backend == "jax":
            import jax
            fn = jax.jit(fn, static_argnums=3)
        self.fn = fn
        self.enter_engine(engine, self.x)
        try:
            sync(backend, self.fn(self.x, self.y, self.w, self.kernel))      # warm-up / compile
        except Exception as exc:
            self.teardown()
            raise NotImplementedError(f"kernel_sum fails here: {exc}") from exc

    def time_kernel_sum(self, backend, engine, n, kernel):
        sync(backend, self.fn(self.x, self.y, self.w, self.kernel))

    def track_float32_error(self, backend, engine, n, kernel):
        """Normwise relative error of the float32 result vs float64 on the same inputs."""
        import slicedkern
        exact = slicedkern.kernel_sum(*(a.astype(np.float64) for a in self.host), self.kernel)
        return relative_error(self.fn(self.x, self.y, self.w, self.kernel), exact)

    track_float32_error.unit = "relative error"
