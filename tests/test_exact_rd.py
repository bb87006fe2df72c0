"""``method="exact" | "sliced" | "auto"`` of the energy distance and the MMD in R^d, against the dense
float64 formulas: Euclidean distances for the energy distance, the radial profile of the sliced
kernel for the MMD (the limit of the sliced estimates as the number of directions grows)."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import assert_meta, to_numpy

from slicedkern import vjp
from slicedkern.kernels import Abs, Hat, HatMixture
from slicedkern.sliced import _dense, directions, energy_distance, mmd, radial_profile


# ----------------------------------------------------------------------------------- dense formulas
def _norms(p, q):
    return np.sqrt(np.sum((p[..., :, None, :] - q[..., None, :, :]) ** 2, axis=-1))


def dense_energy(x, y, a=None, b=None):
    n, m = x.shape[-2], y.shape[-2]
    a = np.full(n, 1.0 / n) if a is None else a / a.sum(-1, keepdims=True)
    b = np.full(m, 1.0 / m) if b is None else b / b.sum(-1, keepdims=True)

    def mean(p, wp, q, wq):
        return np.einsum("...i,...ij,...j->...", wp, _norms(p, q), wq)

    return 2 * mean(x, a, y, b) - mean(x, a, x, a) - mean(y, b, y, b)


def dense_mmd(x, y, kernel, estimator):
    phi = radial_profile(kernel, x.shape[-1])
    kxx, kyy, kxy = (phi(_norms(p, q)) for p, q in ((x, x), (y, y), (x, y)))
    n, m = x.shape[-2], y.shape[-2]
    if estimator == "v":
        return kxx.mean((-2, -1)) + kyy.mean((-2, -1)) - 2 * kxy.mean((-2, -1))
    off = lambda k, s: (k.sum((-2, -1)) - np.trace(k, axis1=-2, axis2=-1)) / (s * (s - 1))  # noqa: E731
    return off(kxx, n) + off(kyy, m) - 2 * kxy.mean((-2, -1))


def _samples(rng, batch=(), n=23, m=17, d=3):
    x = rng.normal(size=batch + (n, d))
    y = rng.normal(size=batch + (m, d)) * 1.3 + 0.2
    y[..., 0, :] = x[..., 0, :]                  # a shared point: a zero distance across the samples
    return x, y


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few pairs, so that every sum runs over several blocks."""
    monkeypatch.setattr(_dense, "BLOCK_PAIRS", 40)


# ------------------------------------------------------------------------------------------- values
def test_energy_exact_matches_dense(xp, rng, small_blocks):
    x, y = _samples(rng, batch=(2,))
    a, b = rng.random((2, 23)), rng.random(17)
    out = energy_distance(xp.asarray(x), xp.asarray(y), x_weights=xp.asarray(a), y_weights=xp.asarray(b),
                          method="exact")
    assert_meta(out, backend=xp, shape=(2,), dtype=xp.dtype("float64"))
    np.testing.assert_allclose(to_numpy(out), dense_energy(x, y, a, b), rtol=1e-12)


@pytest.mark.parametrize("estimator", ["v", "u"])
@pytest.mark.parametrize("kernel", [Hat(0.9), HatMixture([0.4, 2.0], [1.0, 0.5]), -Abs()], ids=["hat", "mixture",
                                                                                                "energy"])
def test_mmd_exact_matches_dense(rng, kernel, estimator, small_blocks):
    x, y = _samples(rng, batch=(2,), d=4)
    out = mmd(x, y, kernel, estimator=estimator, method="exact")
    assert out.shape == (2,)
    np.testing.assert_allclose(out, dense_mmd(x, y, kernel, estimator), rtol=1e-11, atol=1e-14)


def test_exact_is_the_limit_of_the_sliced_estimate(rng):
    x, y = _samples(rng, n=60, m=50)
    exact = float(energy_distance(x, y, method="exact"))
    sliced = float(energy_distance(x, y, directions=directions(4000, 3, method="orthogonal", seed=1),
                                   method="sliced"))
    assert abs(sliced - exact) < 0.02 * exact
    exact = float(mmd(x, y, Hat(1.5), method="exact"))
    sliced = float(mmd(x, y, Hat(1.5), directions=4000, seed=1, method="sliced"))
    assert abs(sliced - exact) < 0.03 * abs(exact)


def test_one_dimensional_samples_ignore_method(rng):
    x, y = rng.normal(size=30), rng.normal(size=20)
    values = {meth: float(energy_distance(x, y, method=meth)) for meth in ("auto", "sliced", "exact")}
    assert len(set(values.values())) == 1
    np.testing.assert_allclose(values["exact"], dense_energy(x[:, None], y[:, None]), rtol=1e-12)


# ------------------------------------------------------------------------------------------ the rule
def test_auto_takes_exact_for_small_samples_and_random_directions(rng):
    x, y = _samples(rng, n=40, m=30)
    auto = float(energy_distance(x, y, directions=64, seed=0))
    assert auto == float(energy_distance(x, y, directions=64, seed=0, method="exact"))
    assert auto != float(energy_distance(x, y, directions=64, seed=0, method="sliced"))
    auto = float(mmd(x, y, Hat(1.0), directions=64, seed=0))
    assert auto == float(mmd(x, y, Hat(1.0), method="exact"))


def test_auto_keeps_sliced_for_given_directions_and_large_samples(rng):
    x, y = _samples(rng, n=40, m=30)
    theta = directions(64, 3, seed=0)
    assert float(energy_distance(x, y, directions=theta)) == float(energy_distance(x, y, directions=theta,
                                                                                   method="sliced"))
    x, y = _samples(rng, n=3000, m=3000)
    assert float(energy_distance(x, y, directions=4, seed=0)) == float(energy_distance(
        x, y, directions=4, seed=0, method="sliced"))


def test_auto_mmd_stays_sliced_under_autograd(rng):
    torch = pytest.importorskip("torch")
    x, y = _samples(rng, n=20, m=15)
    xt = torch.asarray(x).requires_grad_()
    out = mmd(xt, torch.asarray(y), Hat(1.0), directions=8, seed=0)
    out.backward()                                       # the sliced statistic: differentiable
    assert float(out.detach()) == pytest.approx(float(mmd(x, y, Hat(1.0), directions=8, seed=0, method="sliced")),
                                       rel=1e-12)


def test_method_errors_name_the_argument(rng):
    x, y = _samples(rng)
    with pytest.raises(ValueError, match="'method'"):
        energy_distance(x, y, directions=4, method="dense")
    with pytest.raises(ValueError, match="'method'"):
        mmd(x, y, Hat(1.0), directions=4, method="fast")
    with pytest.raises(ValueError, match="'directions'"):
        energy_distance(x, y, method="sliced")


# ---------------------------------------------------------------------------------------- gradients
def _finite_differences(f, v, h=1e-6):
    g = np.zeros_like(v)
    for idx in np.ndindex(v.shape):
        up, down = v.copy(), v.copy()
        up[idx] += h
        down[idx] -= h
        g[idx] = (f(up) - f(down)) / (2 * h)
    return g


def test_energy_exact_vjp_and_torch_autograd(rng, small_blocks):
    x, y = _samples(rng, n=7, m=5)
    a = rng.random(7) + 0.2
    out, pullback = vjp(energy_distance, x, y, x_weights=a, method="exact")
    dx, dy = pullback(np.asarray(2.0))
    fx = _finite_differences(lambda v: float(energy_distance(v, y, x_weights=a, method="exact")), x)
    fy = _finite_differences(lambda v: float(energy_distance(x, v, x_weights=a, method="exact")), y)
    np.testing.assert_allclose(dx, 2 * fx, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dy, 2 * fy, rtol=1e-6, atol=1e-8)
    torch = pytest.importorskip("torch")
    xt, yt, at = (torch.asarray(v).requires_grad_() for v in (x, y, a))
    gx, gy, ga = torch.autograd.grad(energy_distance(xt, yt, x_weights=at, method="exact"), (xt, yt, at))
    np.testing.assert_allclose(gx.numpy(), fx, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(gy.numpy(), fy, rtol=1e-6, atol=1e-8)
    fa = _finite_differences(lambda v: float(energy_distance(x, y, x_weights=v, method="exact")), a)
    np.testing.assert_allclose(ga.numpy(), fa, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("estimator", ["v", "u"])
def test_mmd_exact_vjp(rng, estimator, small_blocks):
    x, y = _samples(rng, n=6, m=5)
    kernel = HatMixture([0.7, 2.5], [1.0, 0.3])
    _, pullback = vjp(mmd, x, y, kernel, estimator=estimator, method="exact")
    dx, dy, _ = pullback(np.asarray(1.0))
    fx = _finite_differences(lambda v: float(mmd(v, y, kernel, estimator=estimator, method="exact")), x)
    fy = _finite_differences(lambda v: float(mmd(x, v, kernel, estimator=estimator, method="exact")), y)
    np.testing.assert_allclose(dx, fx, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(dy, fy, rtol=1e-5, atol=1e-8)
