"""Two-sample statistics next to their peers: the 1-D energy distance (SciPy, a plain NumPy
version) and the energy distance in R^d (sliced, exact blockwise, dense SciPy ``cdist``).

The accuracy of the 1-D statistic is tracked too (``track_relative_error``): against a long-double
evaluation (scripts/energy_distance_1d.py has the exact-gap oracle, up to n = 1e7).
"""

from __future__ import annotations

import importlib.util

import numpy as np

from .common import BACKENDS, ENGINES, backend_module, public, sync, to_backend

PEERS_1D = ["slicedkern", "scipy", "plain numpy"]


def _plain_numpy(x, y, a=None, b=None):
    """Pooled argsort, cumulative weights, one dot product of the squared CDF gap with the spacings."""
    a = np.full(x.size, 1.0 / x.size) if a is None else a / a.sum()
    b = np.full(y.size, 1.0 / y.size) if b is None else b / b.sum()
    z = np.concatenate([x, y])
    order = np.argsort(z)
    d = np.cumsum(np.concatenate([a, -b])[order])[:-1]
    return 2.0 * np.dot(d * d, np.diff(z[order]))


def _oracle(x, y, a=None, b=None):
    """``2 sum D_k^2 (z_(k+1) - z_(k))`` in long double: unweighted, the CDF gap from the exact
    integers ``i m - j n``; weighted, a long-double running sum of the normalised weights (its own
    error, ``~ sqrt(N) 5e-20`` relative to the gap, is far below what is tracked)."""
    n, m = x.size, y.size
    z = np.concatenate([x, y])
    order = np.argsort(z, kind="stable")
    if a is None and b is None:
        i = np.cumsum(order < n)
        e = i * m - (np.arange(1, n + m + 1) - i) * n
        d = e.astype(np.longdouble) / (np.longdouble(n) * np.longdouble(m))
    else:
        a = np.ones(n, dtype=np.longdouble) if a is None else a.astype(np.longdouble)
        b = np.ones(m, dtype=np.longdouble) if b is None else b.astype(np.longdouble)
        d = np.cumsum(np.concatenate([a / np.sum(a), -b / np.sum(b)])[order])
    d = d[:-1]
    zs = z[order].astype(np.longdouble)
    return 2 * np.sum(d * d * (zs[1:] - zs[:-1]))


def _peer(name):
    if name == "slicedkern":
        energy_distance = public("energy_distance", "sliced")
        return lambda x, y, a, b: energy_distance(x, y, x_weights=a, y_weights=b)
    if name == "scipy":
        if importlib.util.find_spec("scipy") is None:
            raise NotImplementedError("scipy is not installed")
        from scipy.stats import energy_distance
        return lambda x, y, a, b: energy_distance(x, y, a, b) ** 2
    return _plain_numpy


def _one_run(backend, engine, method):
    """Skip what would only repeat another case: the statistics run no sort-scan engine forward
    (one engine is enough), and the peers are NumPy code."""
    backend_module(backend)
    if engine != ENGINES[0]:
        raise NotImplementedError("the forward of the statistics runs no sort-scan engine")
    if backend != "numpy" and method != "slicedkern":
        raise NotImplementedError(f"{method} runs on NumPy only")


class EnergyDistance1D:
    """1-D energy distance of n = m samples of N(0, 1) (equal distributions: the hard case)."""

    params = [BACKENDS, ENGINES, [10 ** 5, 10 ** 6], PEERS_1D, [False, True]]
    param_names = ["backend", "engine", "n", "method", "weighted"]
    timeout = 300

    def setup(self, backend, engine, n, method, weighted):
        _one_run(backend, engine, method)
        rng = np.random.default_rng(n)
        ab = (rng.random(n), rng.random(n)) if weighted else (None, None)
        self.host = rng.standard_normal(n), rng.standard_normal(n), *ab
        self.x, self.y = (to_backend(backend, v) for v in self.host[:2])
        self.a, self.b = (None if v is None else to_backend(backend, v) for v in ab)
        self.fn = _peer(method)
        sync(backend, self.fn(self.x, self.y, self.a, self.b))           # compile / load

    def teardown(self, *params):
        pass

    def time_energy_distance_1d(self, backend, engine, n, method, weighted):
        sync(backend, self.fn(self.x, self.y, self.a, self.b))

    def track_relative_error(self, backend, engine, n, method, weighted):
        reference = _oracle(*self.host)
        value = np.longdouble(float(np.asarray(self.fn(self.x, self.y, self.a, self.b))))
        return float(abs(value - reference) / reference)

    track_relative_error.unit = "relative error"


class EnergyDistanceRd:
    """Energy distance in R^3, n = m, P = 256 random directions: sliced, exact (compiled dense sums on
    NumPy and CPU torch, blockwise on the other backends), the auto choice, and the dense statistic
    from SciPy's ``cdist`` (n m memory)."""

    params = [BACKENDS, ENGINES, [500, 2000], ["sliced", "exact", "auto", "scipy cdist"]]
    param_names = ["backend", "engine", "n", "method"]
    timeout = 300

    def setup(self, backend, engine, n, method):
        _one_run(backend, engine, "slicedkern" if method != "scipy cdist" else method)
        rng = np.random.default_rng(n)
        x, y = rng.standard_normal((n, 3)), rng.standard_normal((n, 3)) + 0.1
        self.x, self.y = to_backend(backend, x), to_backend(backend, y)
        if method == "scipy cdist":
            if importlib.util.find_spec("scipy") is None:
                raise NotImplementedError("scipy is not installed")
            from scipy.spatial.distance import cdist

            def dense(x, y):
                return 2 * cdist(x, y).mean() - cdist(x, x).mean() - cdist(y, y).mean()

            self.fn = dense
            return
        energy_distance = public("energy_distance", "sliced")
        try:
            energy_distance(x[:4], y[:4], directions=4, method=method)
        except TypeError:
            raise NotImplementedError("no method= in this version") from None
        self.fn = lambda x, y: energy_distance(x, y, directions=256, seed=0, method=method)
        sync(backend, self.fn(self.x, self.y))

    def teardown(self, *params):
        pass

    def time_energy_distance_rd(self, backend, engine, n, method):
        sync(backend, self.fn(self.x, self.y))
