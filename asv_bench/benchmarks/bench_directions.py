"""Directions for slicing (docs/directions.rst): the cost of a QMC slicing design, and the error of
the sliced energy distance with orthogonal frames and the two designs at a few (P, d).

The errors are RMS relative errors over 8 seeds against the dense energy distance (n = m = 2000,
``y`` shifted by 0.5 along the first axis), as in ``scripts/directions_bench.py`` at a smaller size.
Commits without ``method="design"`` skip it (``NotImplementedError``). Directions are drawn on the
host with NumPy whatever the arrays, so these run for the ``numpy`` backend and the ``scan`` engine
only (the suite's first three parameters, ``backend``, ``engine`` and ``n``, are the same for every
class; here ``n`` is the number of slices ``P``) and skip the other combinations.
"""

from __future__ import annotations

import math

import numpy as np

from .common import public

_EXACT: dict = {}


def _design_module():
    try:
        from slicedkern.sliced import _design
    except ImportError as exc:
        raise NotImplementedError("this commit has no QMC slicing designs") from exc
    return _design


def _mean_distance(a, b, block=500):
    total = 0.0
    bb = np.sum(b * b, axis=1)
    for start in range(0, len(a), block):
        blk = a[start:start + block]
        sq = np.sum(blk * blk, axis=1)[:, None] + bb[None, :] - 2.0 * blk @ b.T
        total += float(np.sqrt(np.maximum(sq, 0.0)).sum())
    return total / (len(a) * len(b))


def _samples(dim, n=2000):
    """The samples of dimension ``dim`` and their dense energy distance (computed once per process)."""
    if dim not in _EXACT:
        rng = np.random.default_rng(dim)
        x, y = rng.standard_normal((n, dim)), rng.standard_normal((n, dim))
        y[:, 0] += 0.5
        exact = 2 * _mean_distance(x, y) - _mean_distance(x, x) - _mean_distance(y, y)
        _EXACT[dim] = x, y, exact
    return _EXACT[dim]


def _host_only(backend, engine):
    if backend != "numpy" or engine != "scan":
        raise NotImplementedError("directions are drawn on the host: timed once, as numpy / scan")


class DesignBuild:
    """Building a design by the descent (what an unshipped size costs once per process), and the
    first use of a size (shipped ones are read from the package data)."""

    params = [["numpy", "torch", "jax"], ["scan", "sweep"], [64, 256, 1024], [3, 10, 100]]
    param_names = ["backend", "engine", "n", "d"]
    timeout = 120

    def setup(self, backend, engine, n_slices, dim):
        _host_only(backend, engine)
        self.design = _design_module()

    def teardown(self, *params):
        pass

    def time_descent(self, backend, engine, n_slices, dim):
        self.design.build_half_design(-(-n_slices // 2), dim)

    def time_first_use(self, backend, engine, n_slices, dim):
        self.design._cached_design.cache_clear()
        self.design._shipped.cache_clear()
        self.design.unrotated_design(n_slices, dim)


class SlicedEnergyError:
    """RMS relative error of the sliced energy distance over 8 seeds, per family."""

    params = [["numpy", "torch", "jax"], ["scan", "sweep"], [64, 256, 1024], ["orthogonal", "design", "projective"],
              [3, 10]]
    param_names = ["backend", "engine", "n", "family", "d"]
    timeout = 300

    def setup(self, backend, engine, n_slices, family, dim):
        _host_only(backend, engine)
        try:
            public("directions", "sliced")(2, 2, method=family, seed=0)
        except ValueError as exc:                       # a commit without this family
            raise NotImplementedError(str(exc)) from exc
        self.x, self.y, self.exact = _samples(dim)

    def teardown(self, *params):
        pass

    def track_rms_relative_error(self, backend, engine, n_slices, family, dim):
        directions, energy_distance = public("directions", "sliced"), public("energy_distance", "sliced")
        errs = []
        for seed in range(8):
            theta = directions(n_slices, dim, method=family, seed=seed)
            errs.append(float(energy_distance(self.x, self.y, directions=theta)) / self.exact - 1.0)
        return math.sqrt(float(np.mean(np.square(errs))))

    track_rms_relative_error.unit = "RMS relative error"
