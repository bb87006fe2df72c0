"""``method="exact" | "sliced" | "auto"`` of the energy distance and the MMD in R^d, against the dense
float64 formulas: Euclidean distances for the energy distance, the radial profile of the sliced
kernel for the MMD (the limit of the sliced estimates as the number of directions grows)."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import assert_meta, to_numpy

from slicedkern import vjp
from slicedkern.backends import _pairs
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


# ------------------------------------------------------------------------ compiled pair sums (numba)
@pytest.fixture
def blockwise(monkeypatch):
    """Calls ``energy_distance(..., method="exact")`` with the compiled pair sums switched off."""
    def call(*args, **kw):
        with monkeypatch.context() as patch:
            patch.setattr(_dense, "energy_distance_pairs", lambda *a: None)
            return energy_distance(*args, method="exact", **kw)
    return call


def _hard_samples(rng, d, batch=(2,), n=31, m=18):
    """n != m, a point repeated within x, a point shared by both samples, a batch axis."""
    x, y = _samples(rng, batch=batch, n=n, m=m, d=d)
    x[..., 5, :] = x[..., 2, :]
    x[..., 6, :] = x[..., 2, :]
    y[..., 3, :] = x[..., 9, :]
    return x, y


@pytest.mark.parametrize("scale", [1.0, 1e-150, 1e150])
@pytest.mark.parametrize("d", [2, 3, 4, 5])
def test_compiled_exact_matches_dense_and_blockwise(rng, d, scale):
    pytest.importorskip("numba")
    x, y = _hard_samples(rng, d)
    a, b = rng.random((2, 31)), rng.random(18)
    a[0, 4] = 0.0                                                  # a zero weight
    reference = dense_energy(x, y, a, b)
    out = energy_distance(x * scale, y * scale, x_weights=a, y_weights=b, method="exact")
    np.testing.assert_allclose(out / scale, reference, rtol=1e-12)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_dense, "energy_distance_pairs", lambda *args: None)
        slow = energy_distance(x * scale, y * scale, x_weights=a, y_weights=b, method="exact")
    np.testing.assert_allclose(out, slow, rtol=1e-13)


@pytest.mark.parametrize("d", [1, 2, 3, 4, 5])
def test_compiled_pair_sums_every_dimension(rng, d):
    """The kernel itself for d = 1..5 (the public function takes the 1-D statistic for d = 1)."""
    pytest.importorskip("numba")
    x, y = _hard_samples(rng, d, batch=(), n=12, m=7)
    a, b = rng.random(12), rng.random(7)
    out = _pairs.energy_pair_sums(x, y, a / a.sum(), b / b.sum(), ())
    np.testing.assert_allclose(out, dense_energy(x, y, a, b), rtol=1e-12)


def test_compiled_parallel_rows_are_the_serial_ones(rng, monkeypatch):
    """Each compiled task writes whole rows of pairs, added afterwards in one order: splitting the
    rows between threads changes nothing, bit for bit."""
    pytest.importorskip("numba")
    x, y = _hard_samples(rng, 3, batch=(3,), n=101, m=64)
    a = rng.random(101)
    serial = energy_distance(x, y, x_weights=a, method="exact")
    monkeypatch.setattr(_pairs, "PARALLEL_PAIRS", 0)
    parallel = energy_distance(x, y, x_weights=a, method="exact")
    np.testing.assert_array_equal(serial, parallel)
    np.testing.assert_allclose(serial, dense_energy(x, y, a), rtol=1e-12)


def test_compiled_and_blockwise_broadcast_batches(rng, blockwise):
    x, y = _samples(rng, batch=(3, 1), n=9, m=6)
    y = y[0, 0]                                                   # one y for every batch row
    b = rng.random((2, 6))                                        # two weightings of y
    out = energy_distance(x, y, y_weights=b, method="exact")
    assert out.shape == (3, 2)
    np.testing.assert_allclose(out, dense_energy(x, y, None, b), rtol=1e-12)
    np.testing.assert_allclose(blockwise(x, y, y_weights=b), out, rtol=1e-13)


def test_exact_nan_point_gives_nan_in_its_row(rng, blockwise):
    x, y = _samples(rng, batch=(2,))
    x[1, 4, 2] = np.nan
    for out in (energy_distance(x, y, method="exact"), blockwise(x, y)):
        assert np.isfinite(out[0]) and np.isnan(out[1])
    out = mmd(x, y, Hat(1.0), method="exact")
    assert np.isfinite(out[0]) and np.isnan(out[1])


def test_torch_cpu_takes_the_compiled_sums_only_without_grad(rng, monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("numba")
    from slicedkern.backends import _torch
    calls = []

    def spy(*args):
        calls.append(1)
        return _pairs.energy_pair_sums(*args)

    monkeypatch.setattr(_torch, "energy_pair_sums", spy)
    x, y = _samples(rng, n=9, m=7)
    a = rng.random(9)
    xt, yt, at = (torch.asarray(v) for v in (x, y, a))
    out = energy_distance(xt, yt, x_weights=at, method="exact")
    assert calls and out.dtype == torch.float64
    np.testing.assert_allclose(out.numpy(), dense_energy(x, y, a), rtol=1e-12)
    calls.clear()
    out = energy_distance(xt.float(), yt.float(), x_weights=at.float(), method="exact")   # float32 in
    assert calls and out.dtype == torch.float32
    for wanted in ("x", "y", "a"):                        # one input recording a gradient is enough
        calls.clear()
        xg, yg, ag = (v.clone().requires_grad_(name == wanted) for name, v in zip("xya", (xt, yt, at)))
        out = energy_distance(xg, yg, x_weights=ag, method="exact")
        assert not calls, wanted
        (grad,) = torch.autograd.grad(out, {"x": xg, "y": yg, "a": ag}[wanted])
        assert torch.isfinite(grad).all() and bool((grad != 0).any())
        np.testing.assert_allclose(out.detach().numpy(), dense_energy(x, y, a), rtol=1e-12)
    calls.clear()
    with torch.no_grad():                                 # no graph recorded: compiled again
        out = energy_distance(xt.clone().requires_grad_(), yt, x_weights=at, method="exact")
    assert calls and not out.requires_grad


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


def test_auto_prices_the_compiled_sums(rng):
    """The issue's case (d = 3, n = m = 2000, P = 256) is exact where the compiled sums run; between
    the two thresholds NumPy and torch without a gradient take "exact", torch under autograd
    (blockwise sums) "sliced"."""
    from slicedkern.sliced.stats import _method
    assert _method("auto", 256, 2000, 2000, 3, values_only=False, traced=False, compiled=True) == "exact"
    assert _method("auto", 256, 2000, 2000, 3, values_only=False, traced=False, compiled=False) == "sliced"
    assert _method("auto", 256, 5000, 5000, 3, values_only=False, traced=False, compiled=True) == "sliced"
    pytest.importorskip("numba")
    x, y = _samples(rng, n=300, m=280)
    exact = float(energy_distance(x, y, method="exact"))
    sliced = float(energy_distance(x, y, directions=64, seed=0, method="sliced"))
    assert float(energy_distance(x, y, directions=64, seed=0)) == exact
    torch = pytest.importorskip("torch")
    xt, yt = torch.asarray(x), torch.asarray(y)
    assert float(energy_distance(xt, yt, directions=64, seed=0)) == pytest.approx(exact, rel=1e-13)
    out = energy_distance(xt.requires_grad_(), yt, directions=64, seed=0)
    assert out.requires_grad and float(out.detach()) == pytest.approx(sliced, rel=1e-12)
    assert float(out.detach()) != pytest.approx(exact, rel=1e-6)


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
