"""The fused CPU sweep engine (``slicedkern.engines.sweep``) against the dense float64 reference.

Skipped where numba is missing. Small sizes only: the compiled kernels are cached on disk
(``cache=True``), so a cold run pays the compilation once (minutes on a busy 2-core machine).
The backward pass (:func:`sweep.kernel_sum_vjp`, :func:`sweep.attention_vjp`) is checked against
finite differences of :mod:`slicedkern.reference` in float64, against its exact definition on
tie-laden data, and against the array-API scan engine's backward (public ``slicedkern.vjp``).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytest.importorskip("numba")

import _sweep_calls as sweep  # noqa: E402

import slicedkern  # noqa: E402
from slicedkern import reference  # noqa: E402
from slicedkern.engines import sweep as engine_package  # noqa: E402
from slicedkern.engines.sweep import _convert  # noqa: E402
from slicedkern.kernels import Abs, Hat, HatMixture, PiecewiseLinear, ReLU  # noqa: E402

KERNELS = [
    pytest.param(ReLU(), id="relu"),
    pytest.param(Abs(), id="abs"),
    pytest.param(Hat(0.5), id="hat0.5"),
    pytest.param(HatMixture([0.25, 1.5], [1.0, -0.5]), id="mixture"),
    pytest.param(PiecewiseLinear((-0.75, 0.0, 0.5, 1.25), (1.5, -2.0, 0.75, 0.5), slope=-0.5,
                                 intercept=0.25), id="general"),
]
NORMALIZERS = ["abs", "relu", "count", None]
GRID = np.array([-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0])  # ties with every knot above


@pytest.fixture
def rng():
    return np.random.default_rng(20240611)


def ksum(x, y, w, kernel):
    return sweep.kernel_sum(x, y, w, kernel.knots, kernel.coeffs, kernel.slope, kernel.intercept)


def attn(q, k, v, kernel, key_mask=None, center=False, normalize="count", eps=1e-6):
    return sweep.attention(q, k, v, key_mask, kernel.knots, kernel.coeffs, center, normalize, eps,
                           kernel.slope, kernel.intercept)


def close(actual, expected, tol=1e-11):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tol * scale)


def test_available_and_warmup():
    assert sweep.AVAILABLE is True and engine_package.AVAILABLE is True
    assert sweep.warmup() is True


# ------------------------------------------------------------------------------- kernel sums
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_kernel_sum(rng, kernel, ties):
    shape = (2, 3)
    if ties:  # duplicate keys, queries equal to keys and to key + knot
        x, y = rng.choice(GRID, shape + (9,)), rng.choice(GRID, shape + (11,))
    else:
        x, y = rng.normal(size=shape + (9,)), rng.normal(size=shape + (11,))
    w = rng.normal(size=shape + (11, 3))
    out = ksum(x, y, w, kernel)
    assert out.dtype == np.float64 and out.shape == shape + (9, 3)
    close(out, reference.kernel_sum(x, y, w, kernel))


@pytest.mark.parametrize("n, m", [(1, 1), (5, 1), (1, 5), (40, 7), (7, 40)])
def test_kernel_sum_sizes(rng, n, m):
    kernel = HatMixture([0.3, 1.0], [1.0, 0.5]) + ReLU()
    x, y, w = rng.normal(size=(1, n)), rng.normal(size=(1, m)), rng.normal(size=(1, m, 2))
    close(ksum(x, y, w, kernel), reference.kernel_sum(x, y, w, kernel))


def test_kernel_sum_far_from_zero(rng):
    """Scores around 1e4 (the median shift keeps s P0 - P1 from cancelling)."""
    x, y, w = 1e4 + rng.normal(size=(1, 30)), 1e4 + rng.normal(size=(1, 20)), rng.normal(size=(1, 20, 2))
    close(ksum(x, y, w, Hat(0.5)), reference.kernel_sum(x, y, w, Hat(0.5)), tol=1e-9)


def test_kernel_sum_per_row_knots(rng):
    """Knots / coefficients / slope / intercept given per batch row."""
    b = np.array([[0.3, 1.0], [2.0, 0.5]])                  # (2, 2) per-row bandwidths
    x, y, w = rng.normal(size=(2, 2, 8)), rng.normal(size=(2, 2, 6)), rng.normal(size=(2, 2, 6, 2))
    knots = np.stack([-b, np.zeros_like(b), b], axis=-1)
    coeffs = np.stack([1 / b, -2 / b, 1 / b], axis=-1)
    slope, intercept = rng.normal(size=(2, 2)), rng.normal(size=(2, 2))
    out = sweep.kernel_sum(x, y, w, knots, coeffs, slope, intercept)
    for idx in np.ndindex(2, 2):
        kernel = Hat(b[idx]) + PiecewiseLinear((), (), slope=slope[idx], intercept=intercept[idx])
        close(out[idx], reference.kernel_sum(x[idx], y[idx], w[idx], kernel))


@pytest.mark.parametrize("n, m", [(0, 4), (3, 0), (0, 0)])
def test_kernel_sum_empty(rng, n, m):
    out = ksum(rng.normal(size=(2, n)), rng.normal(size=(2, m)), rng.normal(size=(2, m, 3)), Hat(1.0))
    assert out.shape == (2, n, 3)
    assert np.all(out == 0)


def test_kernel_sum_float32_inputs(rng):
    x, y, w = (rng.normal(size=s).astype(np.float32) for s in ((2, 50), (2, 60), (2, 60, 3)))
    out = ksum(x, y, w, Hat(0.25))
    assert out.dtype == np.float64                       # float64 accumulation and output
    close(out, reference.kernel_sum(*(a.astype(np.float64) for a in (x, y, w)), Hat(0.25)))


def test_kernel_sum_nan_policy(rng):
    x, y, w = rng.normal(size=(3, 6)), rng.normal(size=(3, 5)), rng.normal(size=(3, 5, 2))
    x[0, 2] = np.nan
    x[0, 4] = -np.inf
    y[1, 3] = np.inf
    w[2, 1, 0] = np.nan
    out = ksum(x, y, w, ReLU())
    assert np.all(np.isnan(out[0, [2, 4]]))
    good = [0, 1, 3, 5]
    close(out[0, good], reference.kernel_sum(x[0, good], y[0], w[0], ReLU()))
    assert np.all(np.isnan(out[1])) and np.all(np.isnan(out[2]))
    # inputs untouched
    assert np.isnan(x[0, 2]) and np.isinf(y[1, 3])


def test_kernel_sum_deterministic(rng):
    x, y, w = rng.choice(GRID, (2, 40)), rng.choice(GRID, (2, 50)), rng.normal(size=(2, 50, 3))
    a, b = ksum(x, y, w, Hat(0.5)), ksum(x, y, w, Hat(0.5))
    np.testing.assert_array_equal(a, b)


def test_column_chunks(rng, monkeypatch):
    """Columns split into chunks (fewer rows than threads) give the same results, forward and
    backward (the chunks' partial dq / dk / parameter sums are added up by the bridge)."""
    x, y, w = rng.normal(size=(1, 20)), rng.normal(size=(1, 25)), rng.normal(size=(1, 25, 40))
    g = rng.normal(size=(1, 20, 40))
    kernel = Hat(0.7) + Abs()
    args = (kernel.knots, kernel.coeffs, kernel.slope, kernel.intercept)
    profile = dict(knots=kernel.knots, coeffs=kernel.coeffs, slope=kernel.slope, intercept=kernel.intercept)
    whole = sweep.kernel_sum_vjp(x, y, w, *args, g)
    whole_attn = attn(x, y, w, kernel, None, True, "abs")
    whole_attn_vjp = sweep.attention_vjp(x, y, w, None, g, whole_attn, center=True, normalizer="abs", **profile)
    monkeypatch.setattr(_convert, "chunks", lambda bsz, ncols, threads=None: (3, 16) if ncols > 32 else (1, ncols))
    close(ksum(x, y, w, kernel), reference.kernel_sum(x, y, w, kernel))
    close(attn(x, y, w, kernel, None, True, "abs"), whole_attn)
    for a, b in zip(sweep.kernel_sum_vjp(x, y, w, *args, g), whole):
        close(a, b)
    chunked = sweep.attention_vjp(x, y, w, None, g, whole_attn, center=True, normalizer="abs", **profile)
    for a, b in zip(chunked, whole_attn_vjp):
        close(a, b)
    close(whole[2], np.swapaxes(reference.kernel_matrix(x, y, kernel), -1, -2) @ g)
    w[0, 3, 39] = np.inf                                   # a bad weight in the last chunk only
    assert np.all(np.isnan(ksum(x, y, w, kernel)))
    assert np.all(np.isnan(attn(x, y, w, kernel, None, False, "count")))
    assert all(np.all(np.isnan(a)) for a in sweep.kernel_sum_vjp(x, y, w, *args, g))
    assert all(np.all(np.isnan(a)) for a in
               sweep.attention_vjp(x, y, w, None, g, whole_attn, center=True, normalizer="abs", **profile))


# --------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("normalize", NORMALIZERS)
@pytest.mark.parametrize("center", [True, False])
def test_relu_attention(rng, normalize, center):
    q, k = rng.choice(GRID, (2, 3, 7)), rng.choice(GRID, (2, 3, 9))
    v = rng.normal(size=(2, 3, 9, 4))
    mask = rng.random((2, 3, 9)) > 0.3
    mask[1, 2] = False                                      # an all-masked row
    out = attn(q, k, v, ReLU(), mask, center, normalize)
    expected = reference.relu_attention(q, k, v, key_mask=mask, center=center, normalize=normalize)
    close(out, expected)
    assert np.all(out[1, 2] == 0)
    close(attn(q, k, v, ReLU(), None, center, normalize),
          reference.relu_attention(q, k, v, center=center, normalize=normalize))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("normalize", NORMALIZERS)
def test_kernel_attention(rng, kernel, normalize):
    q, k = rng.choice(GRID, (2, 8)), rng.normal(size=(2, 6))
    k[:, :3] = q[:, :3] - 0.5                               # queries equal to key + knot
    v = rng.normal(size=(2, 6, 3))
    mask = rng.random((2, 6)) > 0.25
    for center in (False, True):
        out = attn(q, k, v, kernel, mask, center, normalize)
        close(out, reference.kernel_attention(q, k, v, kernel, key_mask=mask, center=center,
                                              normalize=normalize))


def test_hat_attention_per_head_bandwidth(rng):
    b = np.array([0.2, 0.5, 1.5])
    q, k, v = rng.normal(size=(3, 10)), rng.normal(size=(3, 12)), rng.normal(size=(3, 12, 2))
    knots = np.stack([-b, np.zeros_like(b), b], axis=-1)
    coeffs = np.stack([1 / b, -2 / b, 1 / b], axis=-1)
    out = sweep.attention(q, k, v, None, knots, coeffs, False, "count")
    close(out, reference.hat_attention(q, k, v, b))


@pytest.mark.parametrize("lq, lk", [(0, 5), (4, 0), (1, 1), (13, 3), (3, 13)])
def test_attention_sizes(rng, lq, lk):
    q, k, v = rng.normal(size=(2, lq)), rng.normal(size=(2, lk)), rng.normal(size=(2, lk, 3))
    out = attn(q, k, v, ReLU(), None, True, "abs")
    assert out.shape == (2, lq, 3)
    if lq and lk:
        close(out, reference.relu_attention(q, k, v))
    else:
        assert np.all(out == 0)


def test_attention_eps_clamp(rng):
    """A query below every key: the ReLU normaliser is 0 and clamps at eps."""
    q, k, v = np.array([[-5.0, 0.5]]), np.array([[0.0, 1.0]]), rng.normal(size=(1, 2, 2))
    for normalize in ("relu", "abs"):
        close(attn(q, k, v, ReLU(), None, True, normalize, eps=1e-3),
              reference.relu_attention(q, k, v, normalize=normalize, eps=1e-3))


def test_attention_float32(rng):
    q, k = rng.normal(size=(2, 200)).astype(np.float32), rng.normal(size=(2, 300)).astype(np.float32)
    v = rng.normal(size=(2, 300, 5)).astype(np.float32)
    out = attn(q, k, v, ReLU(), None, True, "abs")
    assert out.dtype == np.float32
    expected = reference.relu_attention(*(a.astype(np.float64) for a in (q, k, v)))
    # float64 running sums: only the final rounding to float32 remains
    np.testing.assert_allclose(out, expected, rtol=2e-7, atol=2e-7 * np.abs(expected).max())
    out = attn(q, k, v, Hat(0.05), None, False, "count")
    expected = reference.hat_attention(*(a.astype(np.float64) for a in (q, k, v)), 0.05)
    np.testing.assert_allclose(out, expected, rtol=2e-7, atol=2e-7 * np.abs(expected).max())
    half = attn(q.astype(np.float16), k, v, ReLU(), None, True, "abs")
    assert half.dtype == np.float32                       # result type of float16 and float32
    only_half = attn(*(a.astype(np.float16) for a in (q, k, v)), ReLU(), None, True, "abs")
    assert only_half.dtype == np.float16


def test_attention_nan_policy(rng):
    q, k, v = rng.normal(size=(4, 5)), rng.normal(size=(4, 6)), rng.normal(size=(4, 6, 2))
    mask = np.ones((4, 6), bool)
    q[0, 1] = np.nan
    k[1, 2] = np.inf                                        # unmasked bad key: whole row NaN
    v[2, 4, 1] = -np.inf                                    # unmasked bad value: whole row NaN
    k[3, 0], v[3, 5, 0] = np.nan, np.inf                    # masked: ignored
    mask[3, [0, 5]] = False
    out = attn(q, k, v, ReLU(), mask, True, "abs")
    assert np.all(np.isnan(out[0, 1])) and not np.any(np.isnan(out[0, [0, 2, 3, 4]]))
    assert np.all(np.isnan(out[1])) and np.all(np.isnan(out[2]))
    keep = mask[3]
    close(out[3], reference.relu_attention(q[3], k[3, keep], v[3, keep]))
    close(out[0, [0, 2, 3, 4]], reference.relu_attention(q[0, [0, 2, 3, 4]], k[0], v[0]))


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_torch_tensors(rng):
    import torch
    q, k, v = rng.normal(size=(2, 7)), rng.normal(size=(2, 9)), rng.normal(size=(2, 9, 3))
    mask = rng.random((2, 9)) > 0.3
    tq, tk, tv = (torch.tensor(a, dtype=torch.float32) for a in (q, k, v))
    out = sweep.attention(tq, tk, tv.transpose(1, 2).contiguous().transpose(1, 2), torch.tensor(mask))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    expected = sweep.attention(tq.numpy(), tk.numpy(), tv.numpy(), mask)
    np.testing.assert_array_equal(out.numpy(), expected)
    half = sweep.attention(tq.half(), tk.half(), tv.half(), None)
    assert half.dtype == torch.float16
    s = sweep.kernel_sum(tq.double(), tk.double(), tv.double(), (0.0,), (1.0,))
    assert isinstance(s, torch.Tensor) and s.dtype == torch.float64
    close(s.numpy(), reference.kernel_sum(q.astype(np.float32).astype(np.float64),
                                          k.astype(np.float32).astype(np.float64),
                                          v.astype(np.float32).astype(np.float64), ReLU()))


def test_agrees_with_the_scan_engine(rng):
    q, k, v = rng.normal(size=(2, 3, 30)), rng.normal(size=(2, 3, 40)), rng.normal(size=(2, 3, 40, 4))
    with slicedkern.use_engine("scan"):
        close(attn(q, k, v, ReLU(), None, True, "abs"), slicedkern.relu_attention(q, k, v))
        close(attn(q, k, v, Hat(0.3), None, False, "count"), slicedkern.hat_attention(q, k, v, 0.3))
        close(ksum(q, k, v, Abs()), slicedkern.kernel_sum(q, k, v, Abs()))


def test_bad_arguments(rng):
    q, k, v = rng.normal(size=(2, 3)), rng.normal(size=(2, 4)), rng.normal(size=(2, 4, 2))
    with pytest.raises(ValueError, match="normalizer"):
        sweep.attention(q, k, v, None, normalizer="softmax")
    with pytest.raises(ValueError, match="shapes"):
        sweep.attention(q, k[:1], v)
    with pytest.raises(TypeError, match="'k'"):
        sweep.attention(q, k.astype(np.int64), v)
    with pytest.raises(ValueError, match="key_mask"):
        sweep.attention(q, k, v, np.ones((2, 3), bool))
    with pytest.raises(ValueError, match="same length"):
        sweep.kernel_sum(q, k, v, (0.0, 1.0), (1.0,))


# ---------------------------------------------------------------------------------- backward
def _loss(x, y, w, g, kernel):
    return float(np.sum(reference.kernel_sum(x, y, w, kernel) * g))


def _fd(fun, a, h=1e-6):
    grad = np.zeros_like(a)
    for idx in np.ndindex(a.shape):
        e = np.zeros_like(a)
        e[idx] = h
        grad[idx] = (fun(a + e) - fun(a - e)) / (2 * h)
    return grad


@pytest.mark.parametrize("kernel", KERNELS)
def test_vjp_against_finite_differences(rng, kernel):
    x, y = rng.normal(size=(2, 6)), rng.normal(size=(2, 7))
    w, g = rng.normal(size=(2, 7, 3)), rng.normal(size=(2, 6, 3))
    dx, dy, dw, _, _ = sweep.kernel_sum_vjp(x, y, w, kernel.knots, kernel.coeffs, kernel.slope,
                                            kernel.intercept, g)
    assert dx.shape == x.shape and dy.shape == y.shape and dw.shape == w.shape
    kmat = reference.kernel_matrix(x, y, kernel)
    close(dw, np.swapaxes(kmat, -1, -2) @ g, tol=1e-12)     # dw is linear: exact
    close(dx, _fd(lambda a: _loss(a, y, w, g, kernel), x), tol=1e-7)
    close(dy, _fd(lambda a: _loss(x, a, w, g, kernel), y), tol=1e-7)


@pytest.mark.parametrize("kernel", KERNELS)
def test_vjp_ties_use_the_right_derivative(rng, kernel):
    """At exact ties the gradients use f'(r) = slope + sum_m c_m [r >= t_m] (H(0) = 1)."""
    x, y = rng.choice(GRID, (1, 3, 9)), rng.choice(GRID, (1, 3, 8))
    w, g = rng.normal(size=(1, 3, 8, 2)), rng.normal(size=(1, 3, 9, 2))
    dx, dy, dw, _, _ = sweep.kernel_sum_vjp(x, y, w, kernel.knots, kernel.coeffs, kernel.slope,
                                            kernel.intercept, g)
    deriv = kernel.derivative_at(x[..., :, None] - y[..., None, :])          # (..., n, m)
    close(dx, np.einsum("...ic,...ij,...jc->...i", g, deriv, w))
    close(dy, -np.einsum("...jc,...ij,...ic->...j", w, deriv, g))
    close(dw, np.swapaxes(reference.kernel_matrix(x, y, kernel), -1, -2) @ g)


def test_vjp_per_row_knots_and_float32(rng):
    b = np.array([0.4, 1.3])
    knots = np.stack([-b, np.zeros_like(b), b], axis=-1)
    coeffs = np.stack([1 / b, -2 / b, 1 / b], axis=-1)
    x, y = rng.normal(size=(2, 5)).astype(np.float32), rng.normal(size=(2, 6)).astype(np.float32)
    w, g = rng.normal(size=(2, 6, 2)).astype(np.float32), rng.normal(size=(2, 5, 2)).astype(np.float32)
    dx, dy, dw, dknots, dcoeffs = sweep.kernel_sum_vjp(x, y, w, knots, coeffs, 0.0, 0.0, g)
    assert dx.dtype == dy.dtype == dw.dtype == dknots.dtype == dcoeffs.dtype == np.float64
    x, y, w, g = (a.astype(np.float64) for a in (x, y, w, g))
    for r in range(2):
        kernel = Hat(b[r])
        close(dw[r], reference.kernel_matrix(x[r], y[r], kernel).T @ g[r])
        close(dx[r], _fd(lambda a: _loss(a, y[r], w[r], g[r], kernel), x[r]), tol=1e-7)
        close(dy[r], _fd(lambda a: _loss(x[r], a, w[r], g[r], kernel), y[r]), tol=1e-7)


def test_vjp_empty_and_nan(rng):
    dx, dy, dw, dknots, dcoeffs = sweep.kernel_sum_vjp(np.zeros((2, 0)), np.ones((2, 3)), np.ones((2, 3, 1)),
                                                       (0.0,), (1.0,), 0.0, 0.0, np.zeros((2, 0, 1)))
    assert dx.shape == (2, 0) and dy.shape == (2, 3) and dw.shape == (2, 3, 1)
    assert dknots.shape == dcoeffs.shape == (2, 1)
    assert np.all(dy == 0) and np.all(dw == 0) and np.all(dknots == 0) and np.all(dcoeffs == 0)
    x, y = rng.normal(size=(3, 4)), rng.normal(size=(3, 5))
    w, g = rng.normal(size=(3, 5, 2)), rng.normal(size=(3, 4, 2))
    g[1, 2, 0] = np.nan
    x[2, 0] = np.inf
    grads = sweep.kernel_sum_vjp(x, y, w, (0.0,), (1.0,), 0.0, 0.0, g)
    for a in grads:
        assert not np.any(np.isnan(a[0]))
        assert np.all(np.isnan(a[1])) and np.all(np.isnan(a[2]))


def test_linear_profile_without_knots(rng):
    """A profile with no knot at all: intercept + slope r."""
    kernel = PiecewiseLinear((), (), slope=0.75, intercept=-0.5)
    x, y, w = rng.normal(size=(2, 5)), rng.normal(size=(2, 6)), rng.normal(size=(2, 6, 2))
    close(ksum(x, y, w, kernel), reference.kernel_sum(x, y, w, kernel))
    close(attn(x, y, w, kernel, None, True, "abs"),
          reference.kernel_attention(x, y, w, kernel, center=True, normalize="abs"))
    g = rng.normal(size=(2, 5, 2))
    dx, dy, dw, dknots, dcoeffs = sweep.kernel_sum_vjp(x, y, w, (), (), 0.75, -0.5, g)
    assert dknots.shape == dcoeffs.shape == (2, 0)
    close(dw, np.swapaxes(reference.kernel_matrix(x, y, kernel), -1, -2) @ g)
    close(dx, _fd(lambda a: _loss(a, y, w, g, kernel), x), tol=1e-7)


@pytest.mark.parametrize("kernel", KERNELS)
def test_vjp_agrees_with_the_scan_engine(rng, kernel):
    x, y = rng.choice(GRID, (2, 9)), rng.choice(GRID, (2, 8))   # ties included
    w, g = rng.normal(size=(2, 8, 3)), rng.normal(size=(2, 9, 3))
    expected = _scan_vjp(x, y, w, g, kernel)
    mine = sweep.kernel_sum_vjp(x, y, w, kernel.knots, kernel.coeffs, kernel.slope, kernel.intercept, g)
    for a, b in zip(mine, expected):
        close(a, b)


# ------------------------------------------------------------------ exact ties, whatever the shift
TIE_KERNELS = [
    pytest.param(ReLU(), id="relu"),
    pytest.param(Abs(), id="abs"),
    pytest.param(Hat(0.25), id="hat0.25"),
    pytest.param(Hat(0.5), id="hat0.5"),
    pytest.param(HatMixture([0.25, 1.0], [1.0, -0.4]), id="mixture"),
]
TIE_SHAPES = [(1, 1), (1, 4), (4, 1), (2, 3), (7, 6), (12, 10), (5, 16)]
ODD_KEY = 1.0 / 88.0    # not dyadic: as the median key it made every shifted comparison inexact


def _tie_rows(rng, rows, n, m, odd):
    """``rows`` small problems on the 1/8 grid (|v| <= 1.5): duplicates everywhere, -0.0 and +0.0,
    zero weights, ties with every knot above. ``odd``: some keys (zero weight, as masked keys) moved
    to a non-dyadic value, alternately 1/88 and the mean of the other keys, often the median."""
    grid = np.arange(-12, 13) / 8.0
    x, y = rng.choice(grid, (rows, n)), rng.choice(grid, (rows, m))
    x[(x == 0) & (rng.random(x.shape) < 0.5)] = -0.0
    y[(y == 0) & (rng.random(y.shape) < 0.5)] = -0.0
    w, g = rng.normal(size=(rows, m, 2)), rng.normal(size=(rows, n, 2))
    w[rng.random((rows, m)) < 0.2] = 0.0
    if odd and m > 1:
        for r in range(rows):
            moved = rng.random(m) < 0.5
            moved[rng.integers(m)] = True
            moved[rng.integers(m)] = False
            y[r, moved] = ODD_KEY if r % 2 else y[r, ~moved].mean()
            w[r, moved] = 0.0
    return x, y, w, g


def _exact_vjp(x, y, w, g, kernel):
    """The tie convention by its definition, densely: ``f'(r) = b + sum_m c_m [r >= t_m]``."""
    deriv = kernel.derivative_at(x[..., :, None] - y[..., None, :])          # exact on this data
    dx = np.einsum("...ic,...ij,...jc->...i", g, deriv, w)
    dy = -np.einsum("...jc,...ij,...ic->...j", w, deriv, g)
    dw = np.swapaxes(reference.kernel_matrix(x, y, kernel), -1, -2) @ g
    return dx, dy, dw


def _scan_vjp(x, y, w, g, kernel):
    """``(dx, dy, dw)`` of the kernel sum by the array-API scan engine (the public ``vjp``)."""
    with slicedkern.use_engine("scan"):
        _, pullback = slicedkern.vjp(slicedkern.kernel_sum, x, y, w, kernel)
        return pullback(g)[:3]


@pytest.mark.parametrize("kernel", TIE_KERNELS)
@pytest.mark.parametrize("odd", [False, True], ids=["dyadic-shift", "odd-shift"])
def test_vjp_exact_ties_randomized(rng, kernel, odd):
    """Many small tie-laden problems (one per batch row): dx, dy, dw equal the dense definition and
    the scan engine. Ties are decided on the unshifted values (the median shift used to round
    ``x_i - shift`` and ``y_j - shift`` differently, so ``x_i - y_j == t_m`` was missed)."""
    for n, m in TIE_SHAPES:
        x, y, w, g = _tie_rows(rng, 48, n, m, odd)
        mine = sweep.kernel_sum_vjp(x, y, w, kernel.knots, kernel.coeffs, kernel.slope,
                                    kernel.intercept, g)[:3]
        for a, b in zip(mine, _exact_vjp(x, y, w, g, kernel)):
            close(a, b, tol=1e-12)
        scan = _scan_vjp(x, y, w, g, kernel)
        # the scan's dx compares fl(fl(x - shift) - t) with fl(y - shift) for the median key shift, so
        # with a non-dyadic median it can misjudge ties itself: compared on dyadic shifts only
        for a, b in list(zip(mine, scan))[0 if not odd else 1:]:
            close(a, b, tol=1e-12)


@pytest.mark.parametrize("kernel", TIE_KERNELS)
def test_vjp_ties_one_sided_finite_differences(rng, kernel):
    """dx is the right derivative of the loss in x_i, dy the left derivative in y_j (exact for these
    piecewise-linear losses while the step stays below the 1/8 spacing of the kinks)."""
    h = 2.0 ** -12
    x, y, w, g = _tie_rows(rng, 4, 9, 8, odd=True)
    dx, dy, _, _, _ = sweep.kernel_sum_vjp(x, y, w, kernel.knots, kernel.coeffs, kernel.slope,
                                           kernel.intercept, g)
    for r in range(x.shape[0]):
        loss = _loss(x[r], y[r], w[r], g[r], kernel)
        for i in range(x.shape[1]):
            xr = x[r].copy()
            xr[i] += h
            close(dx[r, i], (_loss(xr, y[r], w[r], g[r], kernel) - loss) / h, tol=1e-9)
        for j in range(y.shape[1]):
            yr = y[r].copy()
            yr[j] -= h
            close(dy[r, j], (loss - _loss(x[r], yr, w[r], g[r], kernel)) / h, tol=1e-9)


def test_self_sum_ties_cancel(rng):
    """Queries and keys the same points (self-sums, every pair on the grid): the forward pass (dx) and
    the swapped one (dy) decide each tie by the same rule, so dx + dy is exact too."""
    kernel = HatMixture([0.25, 1.0], [1.0, -0.4])
    x, _, w, _ = _tie_rows(rng, 16, 11, 11, odd=False)
    y = x.copy()
    w = w[..., :1]
    dx, dy, _, _, _ = sweep.kernel_sum_vjp(x, y, w, kernel.knots, kernel.coeffs, kernel.slope,
                                           kernel.intercept, w)
    ex, ey, _ = _exact_vjp(x, y, w, w, kernel)
    close(dx, ex, tol=1e-12)
    close(dy, ey, tol=1e-12)
    close(dx + dy, ex + ey, tol=1e-12)


@pytest.mark.parametrize("kernel", TIE_KERNELS)
def test_forward_on_tie_data(rng, kernel):
    """Values on the same data: kernel_sum and attention (masks, both normalisers) against the scan
    and the dense reference."""
    for n, m in [(1, 1), (7, 6), (12, 10)]:
        x, y, w, _ = _tie_rows(rng, 24, n, m, odd=True)
        mask = rng.random(y.shape) < 0.7
        mask[:, 0] = True
        expected = reference.kernel_sum(x, y, w, kernel)
        close(ksum(x, y, w, kernel), expected)
        with slicedkern.use_engine("scan"):
            close(slicedkern.kernel_sum(x, y, w, kernel), expected)
        for center, norm in [(False, "count"), (True, "abs"), (False, None)]:
            expected = reference.kernel_attention(x, y, w, kernel, key_mask=mask, center=center,
                                                  normalize=norm)
            # a query on its only valid key has |q - k| summing to 0: the eps = 1e-6 clamp then
            # amplifies the rounding residue of the folded centring (N - mu R), in both engines
            tol = 1e-9 if center else 1e-11
            close(attn(x, y, w, kernel, mask, center, norm), expected, tol=tol)
            with slicedkern.use_engine("scan"):
                close(slicedkern.kernel_attention(x, y, w, kernel, key_mask=mask, center=center,
                                                  normalize=norm), expected, tol=tol)


@pytest.mark.parametrize("kernel", TIE_KERNELS)
def test_attention_key_mask_gradients_on_ties(rng, kernel):
    """Masked keys sit at the mean of the valid ones in the scan (a non-dyadic median): the fused
    backward's dk and dv match the scan's, and dq / dk the one-sided finite differences of the dense
    reference (exact here: the loss is piecewise linear and h is below the 1/8 grid spacing)."""
    q, k, v, _ = _tie_rows(rng, 3, 9, 10, odd=False)
    mask = rng.random(k.shape) < 0.6
    mask[:, :2] = True
    with slicedkern.use_engine("scan"):
        out, pullback = slicedkern.vjp(
            lambda a, b, c: slicedkern.kernel_attention(a, b, c, kernel, key_mask=mask), q, k, v)
        scan = pullback(np.ones_like(out))
    mine = sweep.attention_vjp(q, k, v, mask, np.ones_like(out), out, knots=kernel.knots, coeffs=kernel.coeffs,
                               slope=kernel.slope, intercept=kernel.intercept, center=False, normalizer="count")
    close(mine[1], scan[1], tol=1e-12)
    close(mine[2], scan[2], tol=1e-12)
    h = 2.0 ** -12

    def loss(a, b):
        return float(np.sum(reference.kernel_attention(a, b, v, kernel, key_mask=mask)))

    base = loss(q, k)
    for idx in np.ndindex(q.shape):
        a = q.copy()
        a[idx] += h
        close(mine[0][idx], (loss(a, k) - base) / h, tol=1e-9)
    for idx in np.ndindex(k.shape):
        b = k.copy()
        b[idx] -= h
        close(mine[1][idx], (base - loss(q, b)) / h if mask[idx] else 0.0, tol=1e-9)
    # the same through the public API: the sweep engine's backward against the scan engine's
    grads = {}
    for engine in ("scan", "sweep"):
        with slicedkern.use_engine(engine):
            out, pullback = slicedkern.vjp(
                lambda a, b, c: slicedkern.kernel_attention(a, b, c, kernel, key_mask=mask), q, k, v)
            grads[engine] = pullback(np.ones_like(out))
    close(grads["sweep"][1], grads["scan"][1], tol=1e-12)
    close(grads["sweep"][2], grads["scan"][2], tol=1e-12)
    for idx in np.ndindex(q.shape):
        a = q.copy()
        a[idx] += h
        close(grads["sweep"][0][idx], (loss(a, k) - base) / h, tol=1e-9)
    for idx in np.ndindex(k.shape):
        b = k.copy()
        b[idx] -= h
        close(grads["sweep"][1][idx], (base - loss(q, b)) / h if mask[idx] else 0.0, tol=1e-9)


def test_vjp_knot_below_one_ulp():
    """``x - t`` rounds to a key when ``t`` is below half an ulp: the tie is still decided exactly."""
    for t in (2.0 ** -60, -(2.0 ** -60)):
        kernel = PiecewiseLinear((t,), (1.0,), slope=0.25)
        x, y = np.array([[1.0, -1.0, 0.5]]), np.array([[1.0, -1.0, 0.5, 3.0]])
        w, g = np.ones((1, 4, 1)), np.ones((1, 3, 1))
        mine = sweep.kernel_sum_vjp(x, y, w, kernel.knots, kernel.coeffs, kernel.slope,
                                    kernel.intercept, g)
        for a, b in zip(mine[:2], _exact_vjp(x, y, w, g, kernel)[:2]):
            np.testing.assert_array_equal(a, b)

