"""Sliced kernels in R^d: the sliced energy distance between two point clouds."""

from __future__ import annotations

import numpy as np

from .common import BACKENDS, ENGINES, Benchmark, backend_module, public, sync, to_backend

DIM = 16
SLICES = 32


class _SlicedEnergy(Benchmark):
    """Shared set-up: the points and directions on the backend, the op (jitted on JAX), warmed up."""

    def prepare(self, backend, engine, x, y, theta):
        backend_module(backend)
        energy_distance = public("energy_distance", "sliced")
        self.x, self.y, self.theta = (to_backend(backend, a) for a in (x, y, theta))
        if backend == "jax":
            import jax
            energy_distance = jax.jit(energy_distance)
        self.fn = energy_distance
        self.enter_engine(engine, self.x)
        try:
            sync(backend, self.fn(self.x, self.y, directions=self.theta))     # warm-up / compile
        except Exception as exc:
            self.teardown()
            raise NotImplementedError(f"energy_distance fails here: {exc}") from exc

    def run(self, backend):
        sync(backend, self.fn(self.x, self.y, directions=self.theta))


class EnergyDistance(_SlicedEnergy):
    """``energy_distance(x, y, directions=theta)``: x, y of shape (n, 16), 32 fixed directions."""

    params = [BACKENDS, ENGINES, [2 ** 12, 2 ** 16]]
    param_names = ["backend", "engine", "n"]

    def setup(self, backend, engine, n):
        rng = np.random.default_rng(n)
        theta = rng.standard_normal((SLICES, DIM))
        theta /= np.linalg.norm(theta, axis=1, keepdims=True)
        x = rng.standard_normal((n, DIM)).astype(np.float32)
        y = (rng.standard_normal((n, DIM)) + 0.5).astype(np.float32)
        self.prepare(backend, engine, x, y, theta.astype(np.float32))

    def time_energy_distance(self, backend, engine, n):
        self.run(backend)


class SlicedEnergyDistanceAcrossLibraries(_SlicedEnergy):
    """The sliced energy distance of the same data on every backend, in float32 and float64, x, y of
    shape (n, 10) and 256 directions (issue 23: torch took 5-6x NumPy's time at n = 20000); compare
    the backends' rows of one run."""

    params = [BACKENDS, ENGINES, [20_000], ["float32", "float64"]]
    param_names = ["backend", "engine", "n", "dtype"]
    D, P = 10, 256

    def setup(self, backend, engine, n, dtype):
        rng = np.random.default_rng(0)
        x = rng.standard_normal((n, self.D))
        y = rng.standard_normal((n, self.D)) + 0.1
        theta = public("directions", "sliced")(self.P, self.D, seed=0)
        self.prepare(backend, engine, *(a.astype(dtype) for a in (x, y, theta)))

    def time_sliced_energy_distance(self, backend, engine, n, dtype):
        self.run(backend)
