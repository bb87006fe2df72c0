"""``slicedkern.kernel_sum`` against the dense ``slicedkern.reference.kernel_sum`` on every backend."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import (
    C,
    M,
    N,
    assert_close,
    assert_meta,
    assert_values_close,
    queries_on_knots,
    scaled_kernel,
    scan_atol,
    tie_scores,
)

import slicedkern
from slicedkern import reference
from slicedkern.kernels import Abs, Hat, HatMixture, PiecewiseLinear, ReLU

RTOL64 = 1e-10

KERNELS = [
    pytest.param(ReLU(), id="relu"),
    pytest.param(Abs(), id="abs"),
    pytest.param(Hat(0.5), id="hat0.5"),
    pytest.param(Hat(2.0), id="hat2"),
    pytest.param(HatMixture([0.25, 1.5], [1.0, -0.5]), id="mixture"),
    pytest.param(PiecewiseLinear((-0.75, 0.0, 0.5, 1.25), (1.5, -2.0, 0.75, 0.5), slope=-0.5,
                                 intercept=0.25), id="general"),
]


def check(xp, x, y, w, kernel, *, rtol=RTOL64, atol=None):
    """Run both on backend ``xp`` from NumPy float64 data and compare, metadata first."""
    X, Y, W = xp.asarray(x), xp.asarray(y), xp.asarray(w)
    out = slicedkern.kernel_sum(X, Y, W, kernel)
    expected = reference.kernel_sum(X, Y, W, kernel)
    if atol is None:
        atol = max(rtol * float(np.max(np.abs(xp.to_numpy(expected)), initial=0.0)),
                   scan_atol(x, y, w, kernel))
    assert_close(out, expected, rtol=rtol, atol=atol)
    # the reference is itself checked against a float64 NumPy loop-free formula elsewhere; here make
    # sure it agrees with NumPy too, so a wrong backend cannot agree with a wrong reference
    assert_values_close(expected, reference.kernel_sum(x, y, w, kernel), rtol=1e-12, atol=atol)
    return out


# ------------------------------------------------------------------------------------ the oracle
def test_reference_matches_an_explicit_double_loop(rng):
    x, y, w = rng.normal(size=7), rng.normal(size=5), rng.normal(size=(5, 2))
    f = HatMixture([0.5, 2.0], [1.0, -0.3]) + 0.5 * ReLU()
    loop = np.array([[sum(f(float(xi - yj)) * w[j, c] for j, yj in enumerate(y)) for c in range(2)]
                     for xi in x])
    np.testing.assert_allclose(reference.kernel_sum(x, y, w, f), loop, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(slicedkern.kernel_sum(x, y, w, f), loop, rtol=1e-12, atol=1e-12)


def test_docstring_example():
    out = slicedkern.kernel_sum(np.array([0.0, 2.0]), np.array([0.0, 1.0, 3.0]), np.ones(3), ReLU())
    np.testing.assert_array_equal(out, [0.0, 3.0])


# ----------------------------------------------------------------------------------- float64 cases
@pytest.mark.parametrize("kernel", KERNELS)
def test_random(xp, rng, kernel):
    check(xp, rng.normal(size=N), rng.normal(size=M), rng.normal(size=(M, C)), kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_weight_columns(xp, rng, kernel):
    out = check(xp, rng.normal(size=N), rng.normal(size=M), rng.normal(size=(M, C)), kernel)
    assert tuple(out.shape) == (N, C)


@pytest.mark.parametrize("kernel", KERNELS)
def test_exact_ties(xp, rng, kernel):
    """Duplicated keys, queries equal to keys and to key + knot: every kink is hit exactly."""
    y = tie_scores(rng, M)
    x = queries_on_knots(rng, y, kernel.knots + (-1.0, 1.0), N)
    w = rng.normal(size=(M, C))
    check(xp, x, y, w, kernel)


def test_ties_with_dyadic_data_are_exact(xp, rng):
    """Dyadic scores and weights with exact ties: equal to the dense sum to rounding."""
    y = tie_scores(rng, M)
    y[:4] = [0.0, 0.0, 0.5, -0.5]
    w = rng.integers(-8, 9, size=(M, C)) / 4.0
    w[:4] = [[1.0, 1.0], [0.5, 2.0], [-1.0, -1.0], [3.0, 3.0]]
    w[4:, 1] = 0.0
    x = queries_on_knots(rng, y, (-0.5, 0.5, 1.0), N)
    x[0] = 0.0
    exact = reference.kernel_sum(x, y, w, Hat(0.5))
    out = slicedkern.kernel_sum(xp.asarray(x), xp.asarray(y), xp.asarray(w), Hat(0.5))
    np.testing.assert_allclose(xp.to_numpy(out), exact, rtol=0, atol=1e-13)
    # by hand, column 1 at x = 0: keys 0, 0 (hat 1) and +-0.5 (hat 0): 1 + 2
    assert exact[0, 1] == 3.0


@pytest.mark.parametrize("kernel", KERNELS)
def test_batch_broadcasting(xp, rng, kernel):
    x = rng.normal(size=(2, 1, N))
    y = rng.normal(size=(1, 3, M))
    out = check(xp, x, y, rng.normal(size=(2, 1, M, C)), kernel)
    assert tuple(out.shape) == (2, 3, N, C)
    out = check(xp, x, y, rng.normal(size=(1, 3, M, C)), kernel)
    assert tuple(out.shape) == (2, 3, N, C)


@pytest.mark.new_shapes
@pytest.mark.parametrize("kernel", [KERNELS[0], KERNELS[3]])
def test_vector_weights(xp, rng, kernel):
    """``w`` of shape (..., m): one weight per key, output (..., n), batch dims broadcast."""
    x = rng.normal(size=(2, 1, N))
    y = rng.normal(size=(1, 3, M))
    w = rng.normal(size=(1, 3, M))
    out = check(xp, x, y, w, kernel)
    assert tuple(out.shape) == (2, 3, N)
    column = slicedkern.kernel_sum(xp.asarray(x), xp.asarray(y), xp.asarray(w[..., None]), kernel)
    np.testing.assert_array_equal(xp.to_numpy(out), xp.to_numpy(column)[..., 0])


def test_batch_rows_are_independent(xp, rng):
    """Each batch row is the 1-D kernel sum of that row alone."""
    x, y, w = rng.normal(size=(2, 3, N)), rng.normal(size=(2, 3, M)), rng.normal(size=(2, 3, M, C))
    f = Hat(0.8)
    out = xp.to_numpy(slicedkern.kernel_sum(xp.asarray(x), xp.asarray(y), xp.asarray(w), f))
    for b in range(2):
        for h in range(3):
            row = slicedkern.kernel_sum(x[b, h], y[b, h], w[b, h], f)      # NumPy, one row
            assert_values_close(out[b, h], row, rtol=1e-13, atol=scan_atol(x, y, w, f))


def test_unbatched_queries_against_batched_keys(xp, rng):
    x, y, w = rng.normal(size=N), rng.normal(size=(2, 3, M)), rng.normal(size=(2, 3, M, C))
    out = check(xp, x, y, w, Abs())
    assert tuple(out.shape) == (2, 3, N, C)


@pytest.mark.parametrize("n, m", [(1, M), (N, 1), (1, 1), (N, 200)])
@pytest.mark.parametrize("kernel", [KERNELS[0], KERNELS[2], KERNELS[5]])
@pytest.mark.new_shapes
def test_sizes(xp, rng, n, m, kernel):
    check(xp, rng.normal(size=n), rng.normal(size=m), rng.normal(size=(m, C)), kernel)


@pytest.mark.parametrize("scale", [1e-6, 1e6])
@pytest.mark.parametrize("kernel", KERNELS)
def test_scaled_data_and_kernel(xp, rng, scale, kernel):
    """Scores and kernel length scale multiplied by ``scale``: the same problem, other units."""
    x, y, w = scale * rng.normal(size=N), scale * rng.normal(size=M), rng.normal(size=(M, C))
    check(xp, x, y, w, scaled_kernel(kernel, scale))


@pytest.mark.parametrize("scale", [1e-6, 1e6])
@pytest.mark.parametrize("kernel", KERNELS)
def test_scaled_data_fixed_kernel(xp, rng, scale, kernel):
    """Tiny scores (every pair inside the hats) and huge ones (far outside, linear parts huge)."""
    x, y, w = scale * rng.normal(size=N), scale * rng.normal(size=M), rng.normal(size=(M, C))
    check(xp, x, y, w, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_large_offset(xp, rng, kernel):
    """Scores ``1e6 + N(0, 1)``: the kernel sees O(1) differences of O(1e6) numbers."""
    x = 1e6 + rng.normal(size=N)
    y = 1e6 + rng.normal(size=M)
    check(xp, x, y, rng.normal(size=(M, C)), kernel)


def test_large_offset_against_unshifted_problem(xp, rng):
    """Shifting everything by 1e6 changes nothing but rounding (differences are exact here)."""
    x, y, w = rng.normal(size=N), rng.normal(size=M), rng.normal(size=(M, C))
    x, y = np.round(x * 2**20) / 2**20, np.round(y * 2**20) / 2**20   # exact after the shift
    f = Hat(0.3)
    base = slicedkern.kernel_sum(xp.asarray(x), xp.asarray(y), xp.asarray(w), f)
    shifted = slicedkern.kernel_sum(xp.asarray(x + 1e6), xp.asarray(y + 1e6), xp.asarray(w), f)
    assert_values_close(shifted, xp.to_numpy(base), rtol=1e-10)


def test_mixed_scales(xp, rng):
    """Keys of very different magnitudes in one row."""
    y = np.concatenate([1e-6 * rng.normal(size=12), rng.normal(size=10), 1e5 * rng.normal(size=10)])
    x = np.concatenate([y[::2], rng.normal(size=N - 16)])
    check(xp, x, y, rng.normal(size=(M, C)), Abs())
    check(xp, x, y, rng.normal(size=(M, C)), ReLU() + Hat(0.5))


def test_zero_and_constant_kernels(xp, rng):
    x, y, w = rng.normal(size=N), rng.normal(size=M), rng.normal(size=(M, C))
    X, Y, W = xp.asarray(x), xp.asarray(y), xp.asarray(w)
    zero = slicedkern.kernel_sum(X, Y, W, PiecewiseLinear())
    assert_meta(zero, like=X, shape=(N, C))
    np.testing.assert_array_equal(xp.to_numpy(zero), 0.0)
    const = slicedkern.kernel_sum(X, Y, W, PiecewiseLinear(intercept=2.0))
    assert_values_close(const, np.broadcast_to(2.0 * w.sum(axis=0), (N, C)), rtol=1e-14)
    linear = slicedkern.kernel_sum(X, Y, W, PiecewiseLinear(slope=1.0))
    assert_values_close(linear, (x[:, None] - y[None, :]) @ w, rtol=1e-12)


# ------------------------------------------------------------------------------------------ dtypes
def test_float32_stays_float32(xp, rng):
    x, y, w = (a.astype(np.float32) for a in (rng.normal(size=N), rng.normal(size=M),
                                             rng.normal(size=(M, C))))
    X, Y, W = xp.asarray(x, "float32"), xp.asarray(y, "float32"), xp.asarray(w, "float32")
    out = slicedkern.kernel_sum(X, Y, W, Hat(0.5))
    assert_meta(out, like=X, shape=(N, C))
    exact = reference.kernel_sum(x.astype(np.float64), y.astype(np.float64), w.astype(np.float64),
                                 Hat(0.5))
    # float64 work dtype: one rounding at the end
    assert_values_close(out, exact, rtol=2e-7)


def test_mixed_float32_float64_promotes(xp, rng):
    x, y, w = rng.normal(size=N), rng.normal(size=M), rng.normal(size=(M, C))
    X = xp.asarray(x.astype(np.float32), "float32")
    Y, W = xp.asarray(y), xp.asarray(w)
    out = slicedkern.kernel_sum(X, Y, W, ReLU())
    assert_meta(out, like=Y, shape=(N, C))
    assert_values_close(out, reference.kernel_sum(x.astype(np.float32).astype(np.float64), y, w, ReLU()),
                        rtol=1e-12)


@pytest.mark.parametrize("dtype, tol", [("float16", 2 ** -10), ("bfloat16", 2 ** -7)])
@pytest.mark.parametrize("kernel", [KERNELS[0], KERNELS[2], KERNELS[4]])
def test_half_precision(xp, rng, dtype, tol, kernel):
    """float16 / bfloat16 in, same dtype out, as accurate as one rounding to that dtype allows."""
    if xp.name == "numpy" and dtype == "bfloat16":
        pytest.skip("numpy has no bfloat16")
    if xp.is_jax:
        pytest.skip("JAX half precision: compile time per dtype; covered by torch and NumPy")
    x, y, w = rng.normal(size=N), rng.normal(size=M), rng.normal(size=(M, C))
    X, Y, W = (xp.asarray(a, dtype) for a in (x, y, w))
    out = slicedkern.kernel_sum(X, Y, W, kernel)
    assert_meta(out, like=X, shape=(N, C))
    rounded = [xp.to_numpy(a).astype(np.float64) for a in (X, Y, W)]
    exact = reference.kernel_sum(*rounded, kernel)
    assert_values_close(out, exact, rtol=tol)


# ---------------------------------------------------------------------------------------- JAX jit
def test_jax_jit_matches_eager(xp, rng):
    if not xp.is_jax:
        pytest.skip("JAX only")
    import jax
    x, y, w = (xp.asarray(rng.normal(size=s)) for s in (N, M, (M, C)))
    f = HatMixture([0.5, 1.0], [1.0, 2.0])
    eager = slicedkern.kernel_sum(x, y, w, f)
    jitted = jax.jit(lambda a, b, c: slicedkern.kernel_sum(a, b, c, f))(x, y, w)
    assert_close(jitted, eager, rtol=1e-14)
