"""slicedkern.vjp of the composite sliced ops against central differences (float64, every backend)."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import to_numpy

import slicedkern
from slicedkern.kernels import Hat, HatMixture, ReLU


def _fd(loss, arrays, eps=1e-6):
    grads = []
    for i, a in enumerate(arrays):
        grad = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            plus, minus = [x.copy() for x in arrays], [x.copy() for x in arrays]
            plus[i][idx] += eps
            minus[i][idx] -= eps
            grad[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        grads.append(grad)
    return grads


def _check(xp, fn, args, kwargs, g, n_grads):
    expected = _fd(lambda *a: float(np.sum(to_numpy(fn(*(xp.asarray(b) for b in a), *args[n_grads:],
                                                         **kwargs)) * g)), list(args[:n_grads]))
    backend_args = [xp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    out, pullback = slicedkern.vjp(fn, *backend_args, **kwargs)
    grads = pullback(xp.asarray(g))
    assert len(grads) == len(args)
    for got, want, arg in zip(grads[:n_grads], expected, backend_args):
        assert type(got) is type(arg) and tuple(got.shape) == tuple(arg.shape)
        np.testing.assert_allclose(to_numpy(got), want, rtol=1e-6, atol=1e-7 * max(1.0, np.abs(want).max()))


def test_sliced_kernel_sum_vjp(xp, rng):
    theta = slicedkern.directions(7, 3, seed=1)
    x, y = rng.normal(size=(2, 5, 3)), rng.normal(size=(2, 6, 3))
    w = rng.normal(size=(2, 6, 2))
    _check(xp, slicedkern.sliced_kernel_sum, (x, y, w, HatMixture([0.5, 2.0], [1.0, 0.5])),
           {"directions": xp.asarray(theta), "chunk_size": 3}, rng.normal(size=(2, 5, 2)), 3)


def test_sliced_attention_vjp(xp, rng):
    theta = slicedkern.directions(5, 2, seed=2)
    q, k, v = rng.normal(size=(4, 2)), rng.normal(size=(6, 2)), rng.normal(size=(6, 3))
    _check(xp, slicedkern.sliced_attention, (q, k, v, ReLU()),
           {"directions": xp.asarray(theta), "center": True, "normalize": "abs", "chunk_size": 2},
           rng.normal(size=(4, 3)), 3)


@pytest.mark.parametrize("sliced", [False, True])
def test_energy_distance_vjp(xp, rng, sliced):
    if sliced:
        x, y = rng.normal(size=(5, 3)), rng.normal(size=(6, 3)) + 0.5
        kwargs = {"directions": xp.asarray(slicedkern.directions(6, 3, seed=3)), "chunk_size": 4}
    else:
        x, y, kwargs = rng.normal(size=7), rng.normal(size=5) + 0.3, {}
    _check(xp, slicedkern.energy_distance, (x, y), kwargs, np.asarray(1.3), 2)


@pytest.mark.parametrize("estimator", ["v", "u"])
def test_mmd_vjp(xp, rng, estimator):
    x, y = rng.normal(size=(5, 2)), rng.normal(size=(4, 2)) + 0.4
    kwargs = {"directions": xp.asarray(slicedkern.directions(4, 2, seed=4)), "estimator": estimator}
    _check(xp, slicedkern.mmd, (x, y, Hat(1.5)), kwargs, np.asarray(0.7), 2)
