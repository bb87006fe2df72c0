"""The fused backward of attention on the sweep engine (:func:`_host.attention_vjp`): dq, dk, dv and
the knot / coefficient gradients against finite differences of :mod:`slicedkern.reference`, the scan
engine's backward, the tie rule, the NaN policy, dtypes and the parallel / serial paths."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

import _sweep_calls as sweep  # noqa: E402

import slicedkern  # noqa: E402
from slicedkern import reference  # noqa: E402
from slicedkern.engines.sweep import _convert  # noqa: E402
from slicedkern.kernels import Abs, Hat, HatMixture, PiecewiseLinear, ReLU  # noqa: E402

from .test_sweep import GRID, NORMALIZERS, TIE_KERNELS, _fd, _loss, _tie_rows, attn, close, ksum  # noqa: E402


@pytest.fixture
def rng():
    return np.random.default_rng(20240611)


# ----------------------------------------------------------------------- fused attention backward
def attn_vjp(q, k, v, g, kernel, key_mask=None, center=False, normalize="count", eps=1e-6, out=None, **kw):
    """:func:`sweep.attention_vjp` with the profile of ``kernel`` (and the forward output if not given)."""
    profile = dict(knots=kernel.knots, coeffs=kernel.coeffs, slope=kernel.slope, intercept=kernel.intercept)
    if out is None:
        out = sweep.attention(q, k, v, key_mask, center=center, normalizer=normalize, eps=eps, **profile)
    return sweep.attention_vjp(q, k, v, key_mask, g, out, center=center, normalizer=normalize, eps=eps,
                               **profile, **kw)


def _attention_loss(q, k, v, g, kernel, mask, center, normalize, eps=1e-6):
    out = reference.kernel_attention(q, k, v, kernel, key_mask=mask, center=center, normalize=normalize, eps=eps)
    return float(np.sum(out * g))


ATTENTION_KERNELS = [
    pytest.param(ReLU(), id="relu"),
    pytest.param(Hat(0.6), id="hat"),
    pytest.param(PiecewiseLinear((-0.5, 0.3), (1.5, -0.75), slope=0.25, intercept=-0.5), id="general"),
]


@pytest.mark.parametrize("kernel", ATTENTION_KERNELS)
@pytest.mark.parametrize("normalize", NORMALIZERS)
@pytest.mark.parametrize("center", [False, True], ids=["plain", "centred"])
def test_attention_vjp_against_finite_differences(rng, kernel, normalize, center):
    """dq, dk, dv of masked, batched attention with Lq != Lk against central differences of the
    dense float64 reference. Random scores keep every kink farther than h = 1e-6 (so the FD error is
    O(h^2) from the normaliser's curvature plus 1e-16 / h roundoff: 1e-7 relative is safe)."""
    q, k = rng.normal(size=(2, 3, 5)), rng.normal(size=(2, 3, 7))
    v, g = rng.normal(size=(2, 3, 7, 2)), rng.normal(size=(2, 3, 5, 2))
    mask = rng.random(k.shape) > 0.3
    mask[..., 0] = True
    dq, dk, dv, _, _ = attn_vjp(q, k, v, g, kernel, mask, center, normalize)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape

    def loss(a, b, c):
        return _attention_loss(a, b, c, g, kernel, mask, center, normalize)

    close(dq, _fd(lambda a: loss(a, k, v), q), tol=1e-7)
    close(dk, _fd(lambda a: loss(q, a, v), k), tol=1e-7)
    close(dv, _fd(lambda a: loss(q, k, a), v), tol=1e-7)
    assert np.all(dk[~mask] == 0) and np.all(dv[~mask] == 0)


def _hat_profile(bandwidth):
    """Knots and coefficients (..., 3) of per-row hats ``max(0, 1 - |r| / b)``."""
    b = np.asarray(bandwidth, dtype=np.float64)
    return np.stack([-b, np.zeros_like(b), b], axis=-1), np.stack([1 / b, -2 / b, 1 / b], axis=-1)


def _bandwidth_grad(dknots, dcoeffs, bandwidth):
    """Chain rule from the hat's knots (-b, 0, b) and coefficients (1, -2, 1) / b to b."""
    return -dknots[..., 0] + dknots[..., 2] - (dcoeffs[..., 0] - 2 * dcoeffs[..., 1] + dcoeffs[..., 2]) / bandwidth ** 2


@pytest.mark.parametrize("normalize", ["count", "abs"])
@pytest.mark.parametrize("center", [False, True], ids=["plain", "centred"])
def test_attention_vjp_parameter_gradients(rng, normalize, center):
    """Per-row knots and coefficients: dknots / dcoeffs against central differences of the reference,
    and the bandwidth gradient of a per-head hat by the chain rule."""
    bandwidth = np.array([[0.4, 0.9, 1.7], [0.6, 1.1, 0.3]])                    # (2, 3): one per head
    knots, coeffs = _hat_profile(bandwidth)
    q, k = rng.normal(size=(2, 3, 6)), rng.normal(size=(2, 3, 8))
    v, g = rng.normal(size=(2, 3, 8, 2)), rng.normal(size=(2, 3, 6, 2))
    mask = rng.random(k.shape) > 0.25
    out = sweep.attention(q, k, v, mask, knots, coeffs, center, normalize)
    dq, dk, dv, dknots, dcoeffs = sweep.attention_vjp(q, k, v, mask, g, out, knots=knots, coeffs=coeffs,
                                                      center=center, normalizer=normalize)
    assert dknots.shape == dcoeffs.shape == (2, 3, 3) and dknots.dtype == np.float64

    def loss_row(idx, kn, co):
        return _attention_loss(q[idx], k[idx], v[idx], g[idx], PiecewiseLinear(tuple(kn), tuple(co)),
                               mask[idx], center, normalize)

    for idx in np.ndindex(2, 3):
        close(dknots[idx], _fd(lambda a: loss_row(idx, a, coeffs[idx]), knots[idx]), tol=1e-7)
        close(dcoeffs[idx], _fd(lambda a: loss_row(idx, knots[idx], a), coeffs[idx]), tol=1e-7)
        hat_loss = lambda b: _attention_loss(q[idx], k[idx], v[idx], g[idx], Hat(float(b[0])), mask[idx],
                                             center, normalize)
        close(_bandwidth_grad(dknots[idx], dcoeffs[idx], bandwidth[idx]),
              _fd(hat_loss, bandwidth[idx][None])[0], tol=1e-7)


@pytest.mark.parametrize("kernel", TIE_KERNELS)
@pytest.mark.parametrize("normalize", NORMALIZERS)
def test_attention_vjp_agrees_with_the_scan_engine(rng, kernel, normalize):
    """Tie-laden scores, masks, batch dims, Lq != Lk, centring on and off: the fused backward against
    the scan engine's (public ``slicedkern.vjp`` under ``use_engine("scan")``). dk and dv use the same
    tie rule in both; dq is compared where the scan's shifted comparisons are exact (dyadic data and
    no masked key: masked keys sit at the mean of the valid ones in the scan)."""
    q, k = rng.choice(GRID, (2, 3, 9)), rng.choice(GRID, (2, 3, 8))
    v, g = rng.normal(size=(2, 3, 8, 3)), rng.normal(size=(2, 3, 9, 3))
    for center in (False, True):
        for mask in (None, rng.random(k.shape) > 0.3):
            with slicedkern.use_engine("scan"):
                out, pullback = slicedkern.vjp(
                    lambda a, b, c: slicedkern.kernel_attention(a, b, c, kernel, key_mask=mask, center=center,
                                                                normalize=normalize), q, k, v)
                scan = pullback(g)
            mine = attn_vjp(q, k, v, g, kernel, mask, center, normalize, out=out)
            # a query on its only valid key has |q - k| summing to 0: eps = 1e-6 then amplifies the
            # rounding residues of the centring (as in test_forward_on_tie_data)
            tol = 1e-9 if center or normalize in ("abs", "relu") else 1e-11
            close(mine[1], scan[1], tol=tol)
            close(mine[2], scan[2], tol=tol)
            if mask is None:
                close(mine[0], scan[0], tol=tol)


def test_attention_vjp_bandwidth_agrees_with_the_scan_engine(rng):
    """hat_attention with a per-head bandwidth array: the bandwidth gradient from dknots / dcoeffs."""
    bandwidth = np.array([0.3, 0.75, 1.25])
    q, k = rng.normal(size=(2, 3, 10)), rng.normal(size=(2, 3, 12))
    v, g = rng.normal(size=(2, 3, 12, 4)), rng.normal(size=(2, 3, 10, 4))
    mask = rng.random(k.shape) > 0.2
    with slicedkern.use_engine("scan"):
        out, pullback = slicedkern.vjp(lambda a, b, c, bw: slicedkern.hat_attention(a, b, c, bw, key_mask=mask),
                                       q, k, v, bandwidth)
        dq_s, dk_s, dv_s, dbw_s = pullback(g)
    knots, coeffs = _hat_profile(np.broadcast_to(bandwidth, (2, 3)))
    dq, dk, dv, dknots, dcoeffs = sweep.attention_vjp(q, k, v, mask, g, out, knots=knots, coeffs=coeffs,
                                                      center=False, normalizer="count")
    for a, b in ((dq, dq_s), (dk, dk_s), (dv, dv_s)):
        close(a, b, tol=1e-11)
    close(_bandwidth_grad(dknots, dcoeffs, bandwidth).sum(axis=0), dbw_s, tol=1e-11)


@pytest.mark.parametrize("kernel", [ReLU(), Abs(), Hat(0.5)], ids=["relu", "abs", "hat"])
def test_kernel_sum_vjp_parameter_gradients(rng, kernel):
    x, y = rng.normal(size=(2, 6)), rng.normal(size=(2, 7))
    w, g = rng.normal(size=(2, 7, 3)), rng.normal(size=(2, 6, 3))
    _, _, _, dknots, dcoeffs = sweep.kernel_sum_vjp(x, y, w, kernel.knots, kernel.coeffs, kernel.slope,
                                                    kernel.intercept, g)
    knots, coeffs = np.asarray(kernel.knots), np.asarray(kernel.coeffs)
    for r in range(2):
        def loss(kn, co):
            return _loss(x[r], y[r], w[r], g[r], PiecewiseLinear(tuple(kn), tuple(co), kernel.slope, kernel.intercept))
        close(dknots[r], _fd(lambda a: loss(a, coeffs), knots), tol=1e-7)
        close(dcoeffs[r], _fd(lambda a: loss(knots, a), coeffs), tol=1e-7)
    none = sweep.kernel_sum_vjp(x, y, w, kernel.knots, kernel.coeffs, kernel.slope, kernel.intercept, g,
                                param_grads=False)
    assert none[3] is None and none[4] is None


def test_attention_vjp_ties_one_sided(rng):
    """On the 1/8 grid with a piecewise-linear loss (count normaliser): dq is the right derivative
    in each query, dk the left derivative in each key, exactly."""
    kernel = HatMixture([0.25, 1.0], [1.0, -0.4])
    q, k, v, g = _tie_rows(rng, 3, 9, 8, odd=False)
    mask = rng.random(k.shape) < 0.7
    dq, dk, _, _, _ = attn_vjp(q, k, v, g, kernel, mask, True, "count")
    h = 2.0 ** -12
    for r in range(q.shape[0]):
        def loss(a, b):
            return _attention_loss(a, b, v[r], g[r], kernel, mask[r], True, "count")
        base = loss(q[r], k[r])
        for i in range(q.shape[1]):
            a = q[r].copy()
            a[i] += h
            close(dq[r, i], (loss(a, k[r]) - base) / h, tol=1e-9)
        for j in range(k.shape[1]):
            b = k[r].copy()
            b[j] -= h
            close(dk[r, j], (base - loss(q[r], b)) / h, tol=1e-9)


def test_attention_vjp_eps_clamp(rng):
    """A query below every key: its ReLU normaliser is 0, clamped at eps, and gets no gradient
    through it (the clamp is constant); everything matches finite differences of the reference."""
    q, k = np.array([[-5.0, 0.5, 1.5]]), np.array([[0.0, 1.0]])
    v, g = rng.normal(size=(1, 2, 2)), rng.normal(size=(1, 3, 2))
    for normalize in ("relu", "abs"):
        dq, dk, dv, _, _ = attn_vjp(q, k, v, g, ReLU(), None, True, normalize, eps=1e-3)
        loss = lambda a, b, c: _attention_loss(a, b, c, g, ReLU(), None, True, normalize, eps=1e-3)  # noqa: E731
        close(dq, _fd(lambda a: loss(a, k, v), q), tol=1e-7)
        close(dk, _fd(lambda a: loss(q, a, v), k), tol=1e-7)
        close(dv, _fd(lambda a: loss(q, k, a), v), tol=1e-7)


def test_attention_vjp_value_gradients_leave_out_a_clamped_query_below_every_key():
    """Query 0 is below both keys: its ReLU normaliser is 0, clamped to ``eps``, so ``gnum_0 = g / eps
    = 1e6`` at ``x_0 = -1e20``; it takes part in no ``dv_j`` (``ReLU(x_0 - y_j) = 0``), which come from
    query 1 alone (``x = 2``, normaliser 2 + 1): ``dv = [2/3, 1/3]``. Row totals minus prefix sums over
    the queries left ``|x_0 gnum_0| 2^-52``, about 2e10, in both (issue 49: suffix sums now)."""
    q, k = np.array([[-1e20, 2.0]]), np.array([[0.0, 1.0]])
    v, g = np.array([[[1.0], [-1.0]]]), np.ones((1, 2, 1))
    for center, expected in ((False, [2 / 3, 1 / 3]), (True, [2 / 3 - 1 / 2, 1 / 3 - 1 / 2])):
        dv = attn_vjp(q, k, v, g, ReLU(), None, center, "relu")[2]
        np.testing.assert_allclose(dv[0, :, 0], expected, rtol=1e-15, atol=1e-15)


def test_attention_vjp_of_a_slope_that_the_knots_cancel(rng):
    """``f(r) = -r + ReLU(r) = ReLU(-r)``: the slope (-1) and the coefficients (1) add up to 0, with
    no intercept and no knot moment, and no normaliser or centring: the preparation once skipped the
    per-query terms, so ``dq`` lost the slope's ``-gnum_i . sum_j v_j`` (4.8 off here)."""
    kernel = PiecewiseLinear(knots=(0.0,), coeffs=(1.0,), slope=-1.0)
    q, k = rng.normal(size=(1, 4)), rng.normal(size=(1, 5))
    v, g = rng.normal(size=(1, 5, 2)), rng.normal(size=(1, 4, 2))
    dq, dk, dv, _, _ = attn_vjp(q, k, v, g, kernel, None, False, None)
    loss = lambda a, b, c: _attention_loss(a, b, c, g, kernel, None, False, None)  # noqa: E731
    close(dq, _fd(lambda a: loss(a, k, v), q), tol=1e-7)
    close(dk, _fd(lambda a: loss(q, a, v), k), tol=1e-7)
    close(dv, _fd(lambda a: loss(q, k, a), v), tol=1e-7)


def test_attention_vjp_nan_policy(rng):
    q, k = rng.normal(size=(5, 6)), rng.normal(size=(5, 7))
    v, g = rng.normal(size=(5, 7, 2)), rng.normal(size=(5, 6, 2))
    mask = np.ones(k.shape, bool)
    q[0, 1] = np.nan                          # a bad query: NaN dq there, nothing else
    g[0, 1] = np.nan                          # ... and its cotangent is not read
    k[1, 2] = np.inf                          # a bad valid key: the whole row
    v[2, 4, 1] = -np.inf                      # a bad valid value: the whole row
    k[3, 0], v[3, 5, 0] = np.nan, np.inf      # masked: ignored
    mask[3, [0, 5]] = False
    g[4, 2, 0] = np.nan                       # a bad cotangent of a finite query: the whole row
    out = sweep.attention(q, k, v, mask)
    grads = sweep.attention_vjp(q, k, v, mask, g, out)
    dq, dk, dv, dknots, dcoeffs = grads
    assert np.isnan(dq[0, 1]) and not np.any(np.isnan(np.delete(dq[0], 1)))
    assert not any(np.any(np.isnan(a[0])) for a in (dk, dv, dknots, dcoeffs))
    for row in (1, 2, 4):
        assert all(np.all(np.isnan(a[row])) for a in grads)
    assert not any(np.any(np.isnan(a[3])) for a in grads)
    assert np.all(dk[3, [0, 5]] == 0) and np.all(dv[3, [0, 5]] == 0)
    # the good rows as if the bad entries were not there
    keep = [0, 2, 3, 4, 5]
    sub = sweep.attention_vjp(q[0, keep], k[0], v[0], None, g[0, keep], out[0, keep])
    close(dq[0, keep], sub[0])
    close(dk[0], sub[1])
    close(dv[0], sub[2])
    sub = sweep.attention_vjp(q[3], k[3, mask[3]], v[3, mask[3]], None, g[3], out[3])
    close(dk[3, mask[3]], sub[1])
    close(dv[3, mask[3]], sub[2])


def test_attention_vjp_all_keys_masked_and_empty(rng):
    q, k = rng.normal(size=(2, 4)), rng.normal(size=(2, 5))
    v, g = rng.normal(size=(2, 5, 3)), rng.normal(size=(2, 4, 3))
    mask = np.ones((2, 5), bool)
    mask[1] = False
    out = sweep.attention(q, k, v, mask)
    dq, dk, dv, _, _ = sweep.attention_vjp(q, k, v, mask, g, out)
    assert np.all(out[1] == 0) and np.all(dq[1] == 0) and np.all(dk[1] == 0) and np.all(dv[1] == 0)
    for lq, lk in [(0, 5), (4, 0)]:
        grads = sweep.attention_vjp(q[:, :lq], k[:, :lk], v[:, :lk], None, g[:, :lq], out[:, :lq])
        assert [a.shape for a in grads] == [(2, lq), (2, lk), (2, lk, 3), (2, 1), (2, 1)]
        assert all(np.all(a == 0) for a in grads)


def test_attention_vjp_dtypes_and_torch(rng):
    """float32 in, float32 out, equal to the float64 computation on the same rounded inputs up to the
    final rounding; torch tensors in give torch tensors out, bit-identical to the NumPy path; half
    precision in gives half precision out."""
    q, k = rng.normal(size=(2, 40)).astype(np.float32), rng.normal(size=(2, 50)).astype(np.float32)
    v, g = rng.normal(size=(2, 50, 3)).astype(np.float32), rng.normal(size=(2, 40, 3)).astype(np.float32)
    out = sweep.attention(q, k, v)
    grads32 = sweep.attention_vjp(q, k, v, None, g, out)
    assert [a.dtype for a in grads32] == [np.float32] * 3 + [np.float64] * 2
    grads64 = sweep.attention_vjp(*(a.astype(np.float64) for a in (q, k, v)), None, g.astype(np.float64),
                                  out.astype(np.float64))
    for a, b in zip(grads32, grads64):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max())
    torch = pytest.importorskip("torch")
    tgrads = sweep.attention_vjp(*(torch.from_numpy(a) for a in (q, k, v)), None, torch.from_numpy(g),
                                 torch.from_numpy(out))
    assert all(isinstance(a, torch.Tensor) for a in tgrads)
    assert tgrads[0].dtype == tgrads[2].dtype == torch.float32
    for a, b in zip(tgrads, grads32):
        np.testing.assert_array_equal(a.numpy(), b)
    half = sweep.attention_vjp(*(torch.from_numpy(a).half() for a in (q, k, v)), None,
                               torch.from_numpy(g).half(), torch.from_numpy(out).half())
    assert half[0].dtype == half[1].dtype == half[2].dtype == torch.float16


def test_parallel_and_serial_paths_agree(rng, monkeypatch):
    """The serial path (small work) and the parallel one (dynamic scheduling over rows) run the same
    compiled tasks: results are bit-identical."""
    q, k = rng.choice(GRID, (6, 33)), rng.normal(size=(6, 41))
    v, g = rng.normal(size=(6, 41, 5)), rng.normal(size=(6, 33, 5))
    mask = rng.random(k.shape) > 0.2
    kernel = HatMixture([0.3, 1.0], [1.0, 0.5])

    def everything():
        out = attn(q, k, v, kernel, mask, True, "abs")
        return (out, ksum(q, k, v, kernel), *attn_vjp(q, k, v, g, kernel, mask, True, "abs", out=out),
                *sweep.kernel_sum_vjp(q, k, v, kernel.knots, kernel.coeffs, 0.0, 0.0, g))

    serial = everything()
    monkeypatch.setattr(_convert, "PARALLEL_MIN_WORK", 0)
    for a, b in zip(everything(), serial):
        np.testing.assert_array_equal(a, b)


def test_attention_vjp_bad_arguments(rng):
    q, k, v = rng.normal(size=(2, 3)), rng.normal(size=(2, 4)), rng.normal(size=(2, 4, 2))
    g = rng.normal(size=(2, 3, 2))
    with pytest.raises(ValueError, match="'out'"):
        sweep.attention_vjp(q, k, v, None, g, None, normalizer="abs")
    with pytest.raises(ValueError, match="'g'"):
        sweep.attention_vjp(q, k, v, None, g[:, :2], None, normalizer="count")
    with pytest.raises(ValueError, match="normalizer"):
        sweep.attention_vjp(q, k, v, None, g, None, normalizer="softmax")


@pytest.mark.parametrize("kernel", ATTENTION_KERNELS)
@pytest.mark.parametrize("normalize", NORMALIZERS)
@pytest.mark.parametrize("center", [False, True], ids=["plain", "centred"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_vjp_from_forward_residuals_is_bit_identical(rng, kernel, normalize, center, dtype, monkeypatch):
    """The backward that reuses the forward's sort and per-query terms (``keep=True`` then
    ``residuals=``) gives the same bits as the one that recomputes them: ties with the knots, a key
    mask with an all-masked row, a non-finite value, Lq != Lk, the serial and the parallel path."""
    q, k = rng.choice(GRID, (4, 29)).astype(dtype), rng.choice(GRID, (4, 37)).astype(dtype)
    v, g = rng.normal(size=(4, 37, 6)).astype(dtype), rng.normal(size=(4, 29, 6)).astype(dtype)
    mask = rng.random(k.shape) > 0.3
    mask[2] = False
    v[3, 5, 1] = np.inf
    profile = dict(knots=kernel.knots, coeffs=kernel.coeffs, slope=kernel.slope, intercept=kernel.intercept)
    options = dict(center=center, normalizer=normalize, **profile)
    for parallel in (False, True):
        if parallel:
            monkeypatch.setattr(_convert, "PARALLEL_MIN_WORK", 0)
        out, residuals = sweep.attention(q, k, v, mask, keep=True, **options)
        np.testing.assert_array_equal(out, sweep.attention(q, k, v, mask, **options))
        assert residuals
        reused = sweep.attention_vjp(q, k, v, mask, g, out, residuals=residuals, **options)
        recomputed = sweep.attention_vjp(q, k, v, mask, g, out, **options)
        for a, b in zip(reused, recomputed):
            np.testing.assert_array_equal(a, b)


def test_engine_keeps_residuals_only_for_a_backward(rng):
    """The engine keeps the forward's sort only when a backward will follow (``for_backward``): a
    forward alone writes no residuals; both forwards give the same output."""
    from slicedkern import engines
    from slicedkern._spec import Normalizer
    from slicedkern.engines._vjp import Form, Inputs
    from slicedkern.kernels import Profile

    engine = engines.get("sweep")
    q, k, v = rng.normal(size=(2, 9)), rng.normal(size=(2, 11)), rng.normal(size=(2, 11, 3))
    inputs, form = Inputs(q, k, v, None), Form(Profile.of(ReLU()), Normalizer("abs", 1e-6), True)
    alone, none = engine.attention(inputs, form, xp=np)
    kept, residuals = engine.attention(inputs, form, xp=np, for_backward=True)
    assert none == () and len(residuals) > 0
    np.testing.assert_array_equal(alone, kept)
