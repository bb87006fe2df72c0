"""Sliced kernels in R^d (``slicedkern.sliced``): directions, multi-slice sums and attention, energy
distance, MMD and radial profiles, against dense formulas, SciPy and Monte-Carlo averages."""

from __future__ import annotations

import contextlib
import math

import array_api_compat as compat
import numpy as np
import pytest

from slicedkern import reference
from slicedkern.kernels import Abs, Hat, HatMixture, PiecewiseLinear, ReLU
from slicedkern.sliced import directions, energy_distance, mmd, radial_profile, sliced_attention, sliced_kernel_sum
from slicedkern.sliced.directions import default_method

#: Backends of the value tests. JAX compiles the sort-scan for every new shape (about 2 s each), so it
#: runs the cheap metadata tests here and a few shape-sharing checks in ``test_jax_*`` below.
BACKENDS = ("numpy", "torch", "array_api_strict")
ALL_BACKENDS = BACKENDS + ("jax",)

KERNELS = [
    pytest.param(Hat(0.8), id="hat"),
    pytest.param(Abs(), id="abs"),
    pytest.param(ReLU(), id="relu"),
    pytest.param(HatMixture([0.3, 1.5], [1.0, -0.25]), id="mixture"),
    pytest.param(PiecewiseLinear((-0.5, 0.25, 1.0), (1.5, -2.0, 0.75), slope=-0.5, intercept=0.25),
                 id="general"),
]


# --------------------------------------------------------------------------------------- backends
class Backend:
    """One array library as the tests see it: its namespace, a device and NumPy conversion."""

    def __init__(self, name):
        self.name = name
        if name == "numpy":
            import array_api_compat.numpy as xp
            self.xp, self.device = xp, "cpu"
        elif name == "torch":
            torch = pytest.importorskip("torch")
            import array_api_compat.torch as xp
            self.xp, self.device = xp, torch.device("cpu")
        elif name == "jax":
            jax = pytest.importorskip("jax")
            self.xp, self.device = pytest.importorskip("jax.numpy"), jax.devices("cpu")[0]
        else:
            xs = pytest.importorskip("array_api_strict")
            self.xp, self.device = xs, xs.Device("device1")      # a non-default device on purpose

    def __repr__(self):
        return f"Backend({self.name!r})"

    def asarray(self, a, dtype="float64"):
        a = np.asarray(a)
        dt = getattr(self.xp, dtype) if a.dtype.kind == "f" else None
        if self.name == "torch":
            import torch
            return torch.asarray(a.copy(), dtype=dt, device=self.device)
        return self.xp.asarray(a, dtype=dt, device=self.device, copy=True)


def to_numpy(a):
    if isinstance(a, np.ndarray):
        return a
    if compat.is_torch_array(a):
        return a.detach().cpu().numpy()
    if compat.is_jax_array(a):
        return np.asarray(a)
    return np.from_dlpack(a)


@contextlib.contextmanager
def jax_x64():
    import jax
    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


def _backend_context(name):
    backend = Backend(name)
    if backend.name == "jax":
        with jax_x64():
            yield backend
    else:
        yield backend


@pytest.fixture(params=BACKENDS)
def bk(request):
    """NumPy, torch and array_api_strict in turn."""
    yield from _backend_context(request.param)


@pytest.fixture(params=ALL_BACKENDS)
def any_bk(request):
    """Every backend, JAX included (with x64 on for the duration of the test, then restored)."""
    yield from _backend_context(request.param)


@pytest.fixture
def rng(request):
    import zlib
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def assert_meta(out, like, shape, dtype=None):
    assert compat.array_namespace(out) is compat.array_namespace(like)
    assert type(out) is type(like)
    assert compat.device(out) == compat.device(like)
    assert tuple(out.shape) == tuple(shape)
    assert out.dtype == (like.dtype if dtype is None else dtype)


def close(actual, expected, rtol, atol=0.0):
    np.testing.assert_allclose(np.asarray(to_numpy(actual), dtype=np.float64), expected, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------------- dense oracles
def kappa(d):
    return math.gamma(d / 2) / (math.sqrt(math.pi) * math.gamma((d + 1) / 2))


def dense_sliced_matrix(x, y, theta, kernel):
    """``K[..., i, j] = mean_p f(<theta_p, x_i - y_j>)`` in NumPy float64."""
    px, py = x @ theta.T, y @ theta.T                       # (..., n, P), (..., m, P)
    return np.mean(kernel(px[..., :, None, :] - py[..., None, :, :]), axis=-1)


def dense_energy_sliced(x, y, theta):
    d = x.shape[-1]
    k = dense_sliced_matrix
    return (2 * k(x, y, theta, Abs()).mean((-2, -1)) - k(x, x, theta, Abs()).mean((-2, -1))
            - k(y, y, theta, Abs()).mean((-2, -1))) / kappa(d)


def dense_mmd(kxx, kyy, kxy, estimator):
    n, m = kxx.shape[-1], kyy.shape[-1]
    if estimator == "v":
        return kxx.mean((-2, -1)) + kyy.mean((-2, -1)) - 2 * kxy.mean((-2, -1))
    off = lambda k, s: (k.sum((-2, -1)) - np.trace(k, axis1=-2, axis2=-1)) / (s * (s - 1))  # noqa: E731
    return off(kxx, n) + off(kyy, m) - 2 * kxy.mean((-2, -1))


def even(kernel):
    return lambda r: 0.5 * (kernel(r) + kernel(-r))


# -------------------------------------------------------------------------------------- directions
@pytest.mark.parametrize("method", ["random", "orthogonal", "sobol"])
@pytest.mark.parametrize("n_slices, dim", [(1, 1), (7, 1), (5, 3), (25, 10), (64, 4)])
def test_directions_shape_norm_and_seed(method, n_slices, dim):
    if method == "sobol":
        pytest.importorskip("scipy")
    theta = directions(n_slices, dim, method=method, seed=3)
    assert isinstance(theta, np.ndarray) and theta.dtype == np.float64
    assert theta.shape == (n_slices, dim)
    np.testing.assert_allclose(np.linalg.norm(theta, axis=1), 1.0, rtol=1e-14)
    np.testing.assert_array_equal(theta, directions(n_slices, dim, method=method, seed=3))
    if n_slices * dim > 1 and dim > 1:
        assert not np.array_equal(theta, directions(n_slices, dim, method=method, seed=4))


@pytest.mark.parametrize("dim", [1, 2, 5, 10])
def test_orthogonal_frames_are_orthonormal(dim):
    theta = directions(3 * dim + 1, dim, method="orthogonal", seed=0)
    for f in range(3):
        frame = theta[f * dim:(f + 1) * dim]
        np.testing.assert_allclose(frame @ frame.T, np.eye(dim), atol=1e-13)


def test_directions_are_uniform_on_the_sphere():
    # E theta = 0 and E theta theta^T = I / d, for every family (loose Monte-Carlo bounds)
    pytest.importorskip("scipy")
    d = 4
    for method in ("random", "orthogonal", "sobol"):
        theta = directions(4096, d, method=method, seed=1)
        np.testing.assert_allclose(theta.mean(0), 0.0, atol=0.06)
        np.testing.assert_allclose(theta.T @ theta / len(theta), np.eye(d) / d, atol=0.03)


@pytest.mark.parametrize("method", ["random", "orthogonal", "sobol"])
def test_directions_like_every_backend(any_bk, method):
    bk = any_bk
    if method == "sobol":
        pytest.importorskip("scipy")
    like = bk.asarray(np.zeros((2, 3)))
    theta = directions(9, 3, method=method, seed=11, like=like)
    assert_meta(theta, like, (9, 3))
    np.testing.assert_array_equal(to_numpy(theta), directions(9, 3, method=method, seed=11))
    like32 = bk.asarray(np.zeros(2), dtype="float32")
    assert_meta(directions(4, 2, seed=0, like=like32), like32, (4, 2))
    ints = bk.asarray(np.zeros(2, dtype=np.int64))
    assert directions(4, 2, seed=0, like=ints).dtype == bk.xp.float64


def test_directions_errors():
    with pytest.raises(ValueError, match="n_slices"):
        directions(0, 3)
    with pytest.raises(ValueError, match="dim"):
        directions(3, 0)
    with pytest.raises(TypeError, match="n_slices"):
        directions(2.5, 3)
    with pytest.raises(TypeError, match="dim"):
        directions(3, True)
    with pytest.raises(ValueError, match="method"):
        directions(3, 3, method="halton")
    with pytest.raises(TypeError, match="like"):
        directions(3, 3, like=[1.0])


# --------------------------------------------------------------------------------- kernel sums
@pytest.mark.parametrize("kernel", KERNELS)
def test_sliced_kernel_sum_matches_dense(bk, kernel, rng):
    x, y = rng.normal(size=(2, 9, 3)), rng.normal(size=(1, 11, 3))
    w = rng.normal(size=(11, 2))[None]                     # (1, m, c)
    theta = directions(13, 3, method="random", seed=5)
    X, Y, W, T = bk.asarray(x), bk.asarray(y), bk.asarray(w), bk.asarray(theta)
    out = sliced_kernel_sum(X, Y, W, kernel, directions=T, chunk_size=4)
    expected = dense_sliced_matrix(x, y, theta, kernel) @ w
    assert_meta(out, X, (2, 9, 2))
    close(out, expected, rtol=1e-10, atol=1e-10 * np.abs(expected).max())
    # one weight per key; all slices in one call; NumPy directions with any backend
    vec = sliced_kernel_sum(X, Y, W[..., 0], kernel, directions=theta)
    close(vec, expected[..., 0], rtol=1e-10, atol=1e-10 * np.abs(expected).max())


def test_sliced_kernel_sum_integer_directions_and_chunks(bk, rng):
    x, y, w = rng.normal(size=(6, 4)), rng.normal(size=(8, 4)), rng.random(8)
    X, Y, W = bk.asarray(x), bk.asarray(y), bk.asarray(w)
    # an integer P draws the ops' default family for (P, d) with that seed (docs/directions.rst)
    theta = directions(10, 4, method=default_method(10, 4), seed=2)
    expected = dense_sliced_matrix(x, y, theta, Hat(1.0)) @ w
    for chunk in (None, 1, 3, 10, 50):
        out = sliced_kernel_sum(X, Y, W, Hat(1.0), directions=10, seed=2, chunk_size=chunk)
        close(out, expected, rtol=1e-12, atol=1e-13)


def test_sliced_kernel_sum_float32_keeps_dtype(bk, rng):
    x, y, w = rng.normal(size=(5, 3)), rng.normal(size=(7, 3)), rng.random(7)
    X, Y, W = (bk.asarray(a, dtype="float32") for a in (x, y, w))
    out = sliced_kernel_sum(X, Y, W, Abs(), directions=16, seed=0)
    assert_meta(out, X, (5,))
    expected = dense_sliced_matrix(x, y, directions(16, 3, method=default_method(16, 3), seed=0), Abs()) @ w
    close(out, expected, rtol=1e-5)


def test_sliced_kernel_sum_empty(rng):
    out = sliced_kernel_sum(np.zeros((0, 3)), rng.normal(size=(4, 3)), np.ones(4), Hat(1.0), directions=5)
    assert out.shape == (0,)
    out = sliced_kernel_sum(rng.normal(size=(2, 3)), np.zeros((0, 3)), np.ones(0), Hat(1.0), directions=5)
    np.testing.assert_array_equal(out, np.zeros(2))


# ------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("kernel, center, normalize", [(ReLU(), True, "abs"), (Hat(0.7), False, "count"),
                                                       (Hat(1.5), False, None), (ReLU(), False, "relu")])
def test_sliced_attention_matches_dense(bk, kernel, center, normalize, rng):
    q, k, v = rng.normal(size=(2, 5, 3)), rng.normal(size=(2, 7, 3)), rng.normal(size=(7, 4))
    mask = rng.random((2, 7)) < 0.7
    mask[:, 0] = True
    theta = directions(6, 3, method="random", seed=1)
    Q, K, V, M = bk.asarray(q), bk.asarray(k), bk.asarray(v), bk.asarray(mask)
    out = sliced_attention(Q, K, V, kernel, directions=bk.asarray(theta), key_mask=M, center=center,
                           normalize=normalize, chunk_size=4)
    assert_meta(out, Q, (2, 5, 4))
    pq, pk = np.swapaxes(q @ theta.T, -1, -2), np.swapaxes(k @ theta.T, -1, -2)   # (2, P, L)
    expected = np.mean(reference.kernel_attention(pq, pk, v[None, None], kernel, key_mask=mask[:, None],
                                                  center=center, normalize=normalize), axis=1)
    close(out, expected, rtol=1e-10, atol=1e-12)


def test_sliced_attention_errors(rng):
    q, k, v = rng.normal(size=(5, 3)), rng.normal(size=(7, 3)), rng.normal(size=(7, 2))
    with pytest.raises(ValueError, match="'normalize'"):
        sliced_attention(q, k, v, ReLU(), directions=4, normalize="softmax")
    with pytest.raises(ValueError, match="'v'"):
        sliced_attention(q, k, v[:6], ReLU(), directions=4)
    with pytest.raises(ValueError, match="'k'"):
        sliced_attention(q, k[:, :2], v, ReLU(), directions=4)
    with pytest.raises(TypeError, match="key_mask"):
        sliced_attention(q, k, v, ReLU(), directions=4, key_mask=np.ones(7))
    with pytest.raises(ValueError, match="key_mask"):
        sliced_attention(q, k, v, ReLU(), directions=4, key_mask=np.ones(6, dtype=bool))
    with pytest.raises(ValueError, match="directions"):
        sliced_attention(q, k, v, ReLU(), directions=None)


# ---------------------------------------------------------------------------------- energy distance
def test_energy_distance_1d_matches_scipy(rng):
    stats = pytest.importorskip("scipy.stats")
    for n, m, shift in [(1, 1, 0.3), (2, 5, 0.0), (60, 45, 0.4), (300, 200, 1.5)]:
        x, y = rng.normal(size=n), rng.normal(size=m) + shift
        expected = stats.energy_distance(x, y) ** 2
        np.testing.assert_allclose(float(energy_distance(x, y)), expected, rtol=1e-9, atol=1e-15)
        u, v = rng.random(n), rng.random(m)
        weighted = energy_distance(x, y, x_weights=u, y_weights=v)
        np.testing.assert_allclose(float(weighted), stats.energy_distance(x, y, u, v) ** 2, rtol=1e-9,
                                   atol=1e-15)


def test_energy_distance_1d_ties_and_batches(bk, rng):
    stats = pytest.importorskip("scipy.stats")
    x = rng.choice([-1.0, 0.0, 0.5, 2.0], size=(3, 20, 1))          # (..., n, 1): batched 1-D samples
    y = rng.choice([-1.0, 0.5, 1.0], size=(3, 15, 1))
    a = rng.random((3, 20))
    out = energy_distance(bk.asarray(x), bk.asarray(y), x_weights=bk.asarray(a))
    assert_meta(out, bk.asarray(x), (3,))
    expected = [stats.energy_distance(x[i, :, 0], y[i, :, 0], a[i]) ** 2 for i in range(3)]
    close(out, expected, rtol=1e-9, atol=1e-15)
    flat = energy_distance(bk.asarray(x[0, :, 0]), bk.asarray(y[0, :, 0]))
    assert_meta(flat, bk.asarray(x[0, :, 0]), ())
    close(flat, stats.energy_distance(x[0, :, 0], y[0, :, 0]) ** 2, rtol=1e-9)


def test_energy_distance_sliced_matches_dense_same_directions(bk, rng):
    x, y = rng.normal(size=(2, 30, 4)), rng.normal(size=(25, 4)) + [0.5, 0.0, 0.0, 0.0]
    theta = directions(12, 4, method="sobol" if _has_scipy() else "random", seed=0)
    out = energy_distance(bk.asarray(x), bk.asarray(y), directions=bk.asarray(theta), chunk_size=5)
    assert_meta(out, bk.asarray(x), (2,))
    close(out, dense_energy_sliced(x, y[None], theta), rtol=1e-10)
    # weights: a weighted dense version
    a, b = rng.random(30), rng.random(25)
    a_, b_ = a / a.sum(), b / b.sum()
    k = dense_sliced_matrix
    dense = (2 * a_ @ k(x[0], y, theta, Abs()) @ b_ - a_ @ k(x[0], x[0], theta, Abs()) @ a_
             - b_ @ k(y, y, theta, Abs()) @ b_) / kappa(4)
    out = energy_distance(bk.asarray(x[0]), bk.asarray(y), directions=theta, x_weights=bk.asarray(a),
                          y_weights=bk.asarray(b))
    close(out, dense, rtol=1e-10)


def _has_scipy():
    try:
        import scipy  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("method", ["orthogonal", "sobol"])
def test_energy_distance_high_dim_approaches_dense(method, rng):
    spatial = pytest.importorskip("scipy.spatial")
    d = 10
    x, y = rng.normal(size=(250, d)), rng.normal(size=(200, d))
    y[:, 0] += 0.5
    cd = spatial.distance.cdist
    dense = 2 * cd(x, y).mean() - cd(x, x).mean() - cd(y, y).mean()
    out = float(energy_distance(x, y, directions=directions(2000, d, method=method, seed=0)))
    assert abs(out / dense - 1) < 0.02


# -------------------------------------------------------------------------------------------- MMD
@pytest.mark.parametrize("estimator", ["v", "u"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_mmd_matches_dense(bk, kernel, estimator, rng):
    x, y = rng.normal(size=(2, 12, 3)), rng.normal(size=(2, 9, 3)) + 0.3
    theta = directions(8, 3, method="random", seed=4)
    out = mmd(bk.asarray(x), bk.asarray(y), kernel, directions=bk.asarray(theta), estimator=estimator,
              chunk_size=3)
    assert_meta(out, bk.asarray(x), (2,))
    sym = even(kernel)
    k = dense_sliced_matrix
    expected = dense_mmd(k(x, x, theta, sym), k(y, y, theta, sym), k(x, y, theta, sym), estimator)
    close(out, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("estimator", ["v", "u"])
def test_mmd_1d_exact(bk, estimator, rng):
    x, y = rng.normal(size=15), rng.normal(size=11) * 1.3
    kernel = HatMixture([0.5, 2.0], [1.0, 0.5])
    out = mmd(bk.asarray(x), bk.asarray(y), kernel, estimator=estimator)
    assert_meta(out, bk.asarray(x), ())
    kx = lambda a, b: kernel(a[:, None] - b[None, :])  # noqa: E731
    close(out, dense_mmd(kx(x, x), kx(y, y), kx(x, y), estimator), rtol=1e-10, atol=1e-13)
    # (..., n, 1) is the same 1-D statistic; the directions are then irrelevant
    same = mmd(bk.asarray(x[:, None]), bk.asarray(y[:, None]), kernel, estimator=estimator, directions=3)
    close(same, dense_mmd(kx(x, x), kx(y, y), kx(x, y), estimator), rtol=1e-10, atol=1e-13)


def test_mmd_with_negative_abs_is_scaled_energy_distance(rng):
    x, y = rng.normal(size=(20, 3)), rng.normal(size=(30, 3)) + 0.2
    theta = directions(9, 3, seed=1)
    np.testing.assert_allclose(mmd(x, y, -Abs(), directions=theta),
                               kappa(3) * energy_distance(x, y, directions=theta), rtol=1e-11)


# ---------------------------------------------------------------------------------- radial profile
def quad_profile(kernel, d, r):
    """``c_d int_0^1 f_s(t r) (1 - t^2)^((d-3)/2) dt`` by quadrature, with t = sin(phi)."""
    integrate = pytest.importorskip("scipy.integrate")
    if r == 0:
        return kernel(0.0)
    c_d = 2 * math.gamma(d / 2) / (math.sqrt(math.pi) * math.gamma((d - 1) / 2))
    fs = even(kernel)
    kinks = sorted({math.asin(min(1.0, abs(t) / r)) for t in kernel.knots})
    val, _ = integrate.quad(lambda p: fs(math.sin(p) * r) * math.cos(p) ** (d - 2), 0, math.pi / 2,
                            points=kinks or None, epsabs=1e-13, epsrel=1e-12, limit=200)
    return c_d * val


@pytest.mark.parametrize("dim", [2, 3, 5, 10])
@pytest.mark.parametrize("kernel", KERNELS)
def test_radial_profile_matches_quadrature(kernel, dim):
    pytest.importorskip("scipy")
    phi = radial_profile(kernel, dim)
    radii = np.array([0.0, 0.1, 0.3, 0.7, 1.0, 1.4, 2.5, 6.0])
    values = phi(radii)
    expected = [quad_profile(kernel, dim, float(r)) for r in radii]
    np.testing.assert_allclose(values, expected, rtol=1e-9, atol=1e-12)
    assert phi(0.0) == pytest.approx(kernel(0.0), abs=1e-15)
    np.testing.assert_allclose(phi(-radii), values)


def test_radial_profile_dim_one_and_special_values():
    kernel = PiecewiseLinear((-0.5, 1.0), (1.0, -0.5), slope=0.25, intercept=1.0)
    r = np.array([0.0, 0.3, 2.0])
    np.testing.assert_allclose(radial_profile(kernel, 1)(r), 0.5 * (kernel(r) + kernel(-r)))
    phi = radial_profile(Hat(1.0), 4)
    out = phi(np.array([np.nan, np.inf]))
    assert np.isnan(out[0]) and out[1] == 0.0
    np.testing.assert_allclose(radial_profile(Abs(), 7)(2.0), 2 * kappa(7), rtol=1e-13)


@pytest.mark.parametrize("dim", [2, 3, 10])
@pytest.mark.parametrize("kernel", [Hat(1.0), ReLU(), HatMixture([0.4, 2.0], [1.0, 0.5])],
                         ids=["hat", "relu", "mixture"])
def test_radial_profile_matches_monte_carlo(kernel, dim, rng):
    pytest.importorskip("scipy")
    theta = directions(20000, dim, method="random", seed=7)
    phi = radial_profile(kernel, dim)
    for r in (0.4, 1.0, 2.2):
        z = rng.normal(size=dim)
        z *= r / np.linalg.norm(z)
        samples = kernel(theta @ z)
        se = samples.std() / math.sqrt(len(samples))
        assert abs(samples.mean() - phi(r)) < 4.5 * se + 1e-12


def test_radial_profile_namespaces(any_bk):
    bk = any_bk
    pytest.importorskip("scipy")
    phi = radial_profile(Hat(1.0), 3)
    r = bk.asarray(np.array([0.0, 0.5, 2.0]))
    out = phi(r)
    assert_meta(out, r, (3,))
    close(out, [1.0, 0.75, 0.25], rtol=1e-14)
    r32 = bk.asarray(np.array([[0.5]]), dtype="float32")
    assert_meta(phi(r32), r32, (1, 1))
    assert isinstance(phi(0.5), float)


def test_radial_profile_errors():
    with pytest.raises(TypeError, match="kernel"):
        radial_profile(lambda r: r, 3)
    with pytest.raises(ValueError, match="dim"):
        radial_profile(Hat(1.0), 0)
    with pytest.raises(TypeError, match="'r'"):
        radial_profile(Hat(1.0), 3)("1.0")


# ------------------------------------------------------------------------------------------ errors
def test_errors_name_the_argument(rng):
    x3, y3, y4 = rng.normal(size=(5, 3)), rng.normal(size=(6, 3)), rng.normal(size=(6, 4))
    with pytest.raises(ValueError, match="directions"):
        energy_distance(x3, y3)
    with pytest.raises(ValueError, match="directions"):
        mmd(x3, y3, Hat(1.0))
    with pytest.raises(ValueError, match="directions"):
        sliced_kernel_sum(x3, y3, np.ones(6), Hat(1.0), directions=None)
    with pytest.raises(ValueError, match="'x' and 'y'"):
        energy_distance(x3, y4, directions=4)
    with pytest.raises(ValueError, match="'x' and 'y'"):
        mmd(x3, y4, Hat(1.0), directions=4)
    with pytest.raises(ValueError, match="'x' and 'y'"):
        sliced_kernel_sum(x3, y4, np.ones(6), Hat(1.0), directions=4)
    with pytest.raises(ValueError, match="'x' and 'y'"):
        energy_distance(x3[:, 0], y3, directions=4)              # 1-D vs d-dimensional
    with pytest.raises(ValueError, match="estimator"):
        mmd(x3, y3, Hat(1.0), directions=4, estimator="w")
    with pytest.raises(ValueError, match="'x' and 'y'"):
        mmd(x3[:1], y3, Hat(1.0), directions=4, estimator="u")
    with pytest.raises(ValueError, match="directions"):
        energy_distance(x3, y3, directions=np.ones((4, 2)))
    with pytest.raises(ValueError, match="directions"):
        energy_distance(x3, y3, directions=0)
    with pytest.raises(TypeError, match="directions"):
        energy_distance(x3, y3, directions=2.5)
    with pytest.raises(ValueError, match="chunk_size"):
        energy_distance(x3, y3, directions=4, chunk_size=0)
    with pytest.raises(ValueError, match="x_weights"):
        energy_distance(x3, y3, directions=4, x_weights=np.ones(4))
    with pytest.raises(ValueError, match="y_weights"):
        energy_distance(x3[:, 0], y3[:, 0], y_weights=-np.ones(6))
    with pytest.raises(ValueError, match="'w'"):
        sliced_kernel_sum(x3, y3, np.ones(5), Hat(1.0), directions=4)
    with pytest.raises(TypeError, match="kernel"):
        mmd(x3, y3, "hat", directions=4)
    with pytest.raises(TypeError, match="'x'"):
        energy_distance(np.ones((5, 3), dtype=np.int64), y3, directions=4)
    with pytest.raises(ValueError, match="'x' and 'y'"):
        energy_distance(np.zeros(0), y3[:, 0])


def test_non_finite_samples_give_nan(rng):
    x, y = rng.normal(size=(2, 6, 3)), rng.normal(size=(2, 5, 3))
    x[1, 2, 0] = np.nan
    out = energy_distance(x, y, directions=4, seed=0)
    assert np.isfinite(out[0]) and np.isnan(out[1])
    out = mmd(x, y, Hat(1.0), directions=4, seed=0, estimator="u")
    assert np.isfinite(out[0]) and np.isnan(out[1])
    assert np.isnan(energy_distance(np.array([0.0, np.inf]), np.array([1.0])))


def test_mixed_libraries_raise_type_error(rng):
    torch = pytest.importorskip("torch")
    x, y = rng.normal(size=(5, 3)), rng.normal(size=(6, 3))
    with pytest.raises(TypeError, match="'x'.*'y'|'y'.*'x'"):
        energy_distance(torch.asarray(x), y, directions=4)
    with pytest.raises(TypeError, match="directions"):
        energy_distance(x, y, directions=torch.asarray(directions(4, 3)))


# ---------------------------------------------------------------------------------------- gradients
def _central_differences(fn, x, h=1e-6):
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = h
        grad[idx] = (fn(x + e) - fn(x - e)) / (2 * h)
    return grad


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


needs_torch = pytest.mark.skipif(_torch() is None, reason="torch is not installed")


@needs_torch
@pytest.mark.parametrize("dim", [1, 3])
def test_torch_grad_energy_distance(dim, rng):
    torch = _torch()
    x, y = rng.normal(size=(8, dim)), rng.normal(size=(7, dim)) + 0.3
    theta = directions(5, dim, seed=0)
    a = rng.random(8)

    def value(xn):
        return float(energy_distance(xn, y, directions=theta, x_weights=a))

    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    out = energy_distance(xt, torch.tensor(y), directions=theta, x_weights=torch.tensor(a))
    (grad,) = torch.autograd.grad(out, xt)
    np.testing.assert_allclose(grad.numpy(), _central_differences(value, x), rtol=1e-6, atol=1e-8)


@needs_torch
@pytest.mark.parametrize("kernel", [Abs(), Hat(1.5)], ids=["abs", "hat"])
def test_torch_grad_of_a_self_sum(kernel, rng):
    """The building block of the energy distance and MMD: ``sum_ij u_i u_j f(z_i - z_j)``, queries and
    keys the same tensor. Its diagonal ``f(0)`` is constant, so the tie of every point with itself must
    not contribute: the query-side and key-side derivatives must use the same one-sided convention
    (docs/mathematics.rst, "The backward pass": ``f'`` with ``H(0) = 1`` in both ``dx`` and ``dy``)."""
    import slicedkern
    torch = _torch()
    z, u = rng.normal(size=9), rng.normal(size=9)
    zt = torch.tensor(z, requires_grad=True)
    (grad,) = torch.autograd.grad(torch.sum(torch.tensor(u) * slicedkern.kernel_sum(zt, zt, torch.tensor(u),
                                                                                    kernel)), zt)
    value = lambda zn: float(np.sum(u * slicedkern.kernel_sum(zn, zn, u, kernel)))  # noqa: E731
    np.testing.assert_allclose(grad.numpy(), _central_differences(value, z), rtol=1e-6, atol=1e-8)


@needs_torch
@pytest.mark.parametrize("estimator", ["v", "u"])
def test_torch_grad_mmd_both_samples(estimator, rng):
    torch = _torch()
    x, y = rng.normal(size=(7, 3)), rng.normal(size=(6, 3))
    theta = directions(4, 3, seed=1)
    kernel = Hat(1.2)
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.tensor(y, requires_grad=True)
    gx, gy = torch.autograd.grad(mmd(xt, yt, kernel, directions=theta, estimator=estimator), (xt, yt))
    fx = lambda xn: float(mmd(xn, y, kernel, directions=theta, estimator=estimator))  # noqa: E731
    fy = lambda yn: float(mmd(x, yn, kernel, directions=theta, estimator=estimator))  # noqa: E731
    np.testing.assert_allclose(gx.numpy(), _central_differences(fx, x), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(gy.numpy(), _central_differences(fy, y), rtol=1e-6, atol=1e-8)


def _jax_case(rng):
    x, y = rng.normal(size=(2, 9, 3)), rng.normal(size=(2, 7, 3)) + 0.25
    return x, y, directions(6, 3, method="random", seed=3)


def test_jax_values_and_metadata(rng):
    """The sliced ops on JAX arrays (x64 on) against dense NumPy; few distinct shapes, since JAX
    compiles the sort-scan once per shape."""
    pytest.importorskip("jax")
    with jax_x64():
        bk = Backend("jax")
        x, y, theta = _jax_case(rng)
        w = rng.random(7)
        X, Y, T = bk.asarray(x), bk.asarray(y), bk.asarray(theta)

        out = sliced_kernel_sum(X, Y, bk.asarray(w[None]), Hat(0.8), directions=T)
        assert_meta(out, X, (2, 9))
        close(out, dense_sliced_matrix(x, y, theta, Hat(0.8)) @ w, rtol=1e-10, atol=1e-12)

        out = energy_distance(X, Y, directions=T)
        assert_meta(out, X, (2,))
        close(out, dense_energy_sliced(x, y, theta), rtol=1e-10)

        k = dense_sliced_matrix
        for estimator in ("v", "u"):
            out = mmd(X, Y, Hat(0.8), directions=T, estimator=estimator)
            assert_meta(out, X, (2,))
            expected = dense_mmd(k(x, x, theta, Hat(0.8)), k(y, y, theta, Hat(0.8)), k(x, y, theta, Hat(0.8)),
                                 estimator)
            close(out, expected, rtol=1e-10, atol=1e-12)


def test_jax_grad_and_jit_energy_distance(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    with jax_x64():
        x, y, theta = _jax_case(rng)

        def f(xj):
            return jnp.sum(energy_distance(xj, jnp.asarray(y), directions=jnp.asarray(theta)))

        def value(xn):
            return float(np.sum(energy_distance(xn, y, directions=theta)))

        np.testing.assert_allclose(float(jax.jit(f)(jnp.asarray(x))), value(x), rtol=1e-12)
        grad = jax.grad(f)(jnp.asarray(x))
        np.testing.assert_allclose(np.asarray(grad), _central_differences(value, x), rtol=1e-6, atol=1e-8)
