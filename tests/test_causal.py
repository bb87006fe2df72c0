"""Causal attention (docs/mathematics.rst, "Causal attention") against the dense causal reference.

Every causal op on every backend and engine that has a causal mode (the others must decline it):
masks, ``Lq != Lk`` both ways, batch dims, ties, many levels of the divide and conquer, float32 input;
the causal NaN rule; gradients (``slicedkern.vjp``, torch autograd, ``jax.grad`` under ``jit`` and
``vmap``) against finite differences of :mod:`slicedkern.reference`, bandwidths and mixture weights
included; the sliced op.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from _helpers import C, M, N, assert_close, assert_meta, jax_x64, names_argument, tie_scores, to_numpy

import slicedkern
from slicedkern import reference
from slicedkern.kernels import Abs, Hat, HatMixture, PiecewiseLinear, ReLU

B, H = 2, 2
GENERAL = PiecewiseLinear((-0.75, 0.0, 0.5, 1.25), (1.5, -2.0, 0.75, 0.5), slope=-0.5, intercept=0.25)

#: name -> (fast op, reference op, extra positional args builder (rng -> tuple), keyword options)
CASES = {
    "relu-abs-centred": (slicedkern.relu_attention, reference.relu_attention, None, {}),
    "relu-relu-centred": (slicedkern.relu_attention, reference.relu_attention, None, {"normalize": "relu"}),
    "relu-count": (slicedkern.relu_attention, reference.relu_attention, None,
                   {"normalize": "count", "center": False}),
    "relu-none-centred": (slicedkern.relu_attention, reference.relu_attention, None, {"normalize": None}),
    "hat": (slicedkern.hat_attention, reference.hat_attention, lambda rng: (0.7,), {}),
    "hat-per-head-abs": (slicedkern.hat_attention, reference.hat_attention,
                         lambda rng: (rng.random(H) + 0.4,), {"normalize": "abs"}),
    "mixture-arrays": (slicedkern.hat_mixture_attention, reference.hat_mixture_attention,
                       lambda rng: (rng.random((B, H, 2)) + 0.3, rng.normal(size=(B, H, 2))), {}),
    "kernel-general-centred": (slicedkern.kernel_attention, reference.kernel_attention,
                               lambda rng: (GENERAL,), {"center": True, "normalize": "relu"}),
}

#: (Lq, Lk): fewer queries than keys, a square, more queries than keys (the canonical JAX shapes)
SHAPES = [(N, M), (M, M), (M, N)]


@pytest.fixture
def cxp(xp):
    """The backend under test, skipped when its engine has no causal mode for these arrays (an engine
    without one, or the sweep on JAX arrays, which it reads through a host callback only outside its
    causal mode; the refusals are checked by :func:`test_engine_without_causal_mode_declines` and
    tests/engines/test_sweep_jax.py)."""
    try:
        slicedkern.relu_attention(xp.asarray(np.zeros((1, 1))), xp.asarray(np.zeros((1, 1))),
                                  xp.asarray(np.zeros((1, 1, 1))), causal=True)
    except ValueError as exc:
        if not str(exc).startswith("argument 'engine'") or "causal" not in str(exc):
            raise
        pytest.skip(f"the {xp.engine!r} engine has no causal mode for {xp.name} arrays")
    return xp


def _args(xp, args):
    return [xp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]


def causal_atol(q, k, v, kernel_lipschitz, *, key_mask=None, center, normalize, eps=1e-6, expected=None):
    """Elementwise a-priori error scale of causal attention: the sort-scan's (see
    ``_helpers.attention_atol``), per query over the keys it sees."""
    q, k, v = (np.asarray(to_numpy(a), dtype=np.float64) for a in (q, k, v))
    batch = np.broadcast_shapes(q.shape[:-1], k.shape[:-1], v.shape[:-2])
    q, k = np.broadcast_to(q, batch + q.shape[-1:]), np.broadcast_to(k, batch + k.shape[-1:])
    v = np.broadcast_to(v, batch + v.shape[-2:])
    lq, lk = q.shape[-1], k.shape[-1]
    valid = np.ones(k.shape, bool) if key_mask is None else np.broadcast_to(key_mask, k.shape)
    seen = valid[..., None, :] & (np.arange(lk)[None, :] <= np.arange(lq)[:, None] + lk - lq)
    span = float(np.ptp(np.concatenate([q.ravel(), k.ravel()])))
    count = seen.sum(axis=-1)[..., None].astype(np.float64)                       # (..., Lq, 1)
    vsum = seen.astype(np.float64) @ np.abs(v)                                    # (..., Lq, Dv)
    mu = np.abs(seen.astype(np.float64) @ v) / np.maximum(count, 1.0) if center else 0.0
    unit = 64 * 2.0 ** -52 * (kernel_lipschitz * span + 1.0)
    d_num = unit * (vsum + mu * count)
    if normalize is None:
        return d_num
    if normalize == "count":
        return d_num / np.maximum(count, 1.0)
    r = q[..., :, None] - k[..., None, :]
    den = np.where(seen, np.abs(r) if normalize == "abs" else np.maximum(r, 0.0), 0.0).sum(-1)[..., None]
    out = 0.0 if expected is None else np.abs(np.asarray(to_numpy(expected), dtype=np.float64))
    return (d_num + out * 64 * 2.0 ** -52 * (2.0 * span + 1.0) * count) / np.maximum(den, eps)


def _lipschitz(args):
    for a in args:
        if isinstance(a, PiecewiseLinear):
            return abs(a.slope) + sum(abs(c) for c in a.coeffs)
    if len(args) == 2:                                   # a mixture: sum |w| / min bandwidth
        return float(np.max(np.abs(args[1]).sum(-1)) / np.min(args[0]))
    if len(args) == 1:
        return 2.0 / float(np.min(args[0]))
    return 2.0


def _data(rng, lq, lk, *, ties=False, dv=C):
    if ties:
        q, k = tie_scores(rng, (B, H, lq)), tie_scores(rng, (1, H, lk))
    else:
        q, k = rng.normal(size=(B, H, lq)), rng.normal(size=(1, H, lk))      # keys shared over B
    v = rng.normal(size=(1, H, lk, dv)) + 0.5
    mask = rng.random((B, H, lk)) < 0.7
    mask[0, 0, :] = True
    mask[-1, -1, :] = False                                                 # a row that sees nothing
    return q, k, v, mask


def _check(xp, case, q, k, v, mask, args):
    fast, dense, _, opts = CASES[case]
    Q, K, V = (xp.asarray(a) for a in (q, k, v))
    Mk = None if mask is None else xp.asarray(mask)
    out = fast(Q, K, V, *_args(xp, args), key_mask=Mk, causal=True, **opts)
    expected = dense(Q, K, V, *_args(xp, args), key_mask=Mk, causal=True, **opts)
    batch = np.broadcast_shapes(q.shape[:-1], k.shape[:-1])
    assert_meta(out, like=Q, shape=batch + (q.shape[-1], v.shape[-1]))
    center = opts.get("center", fast is slicedkern.relu_attention)
    normalize = opts.get("normalize", "abs" if fast is slicedkern.relu_attention else "count")
    atol = 1e-10 * float(np.max(np.abs(to_numpy(expected)), initial=0.0)) + causal_atol(
        q, k, v, _lipschitz(args), key_mask=mask, center=center, normalize=normalize, expected=expected)
    assert_close(out, expected, rtol=1e-10, atol=atol, err_msg=case)
    return to_numpy(out)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"lq{s[0]}-lk{s[1]}")
@pytest.mark.parametrize("case", list(CASES))
def test_causal_matches_dense_reference(cxp, rng, case, shape):
    q, k, v, mask = _data(rng, *shape)
    builder = CASES[case][2]
    args = builder(rng) if builder else ()
    _check(cxp, case, q, k, v, mask, args)
    _check(cxp, case, q, k, v, None, args)


@pytest.mark.parametrize("case", ["relu-abs-centred", "hat", "kernel-general-centred"])
def test_causal_ties(cxp, rng, case):
    q, k, v, mask = _data(rng, M, M, ties=True)
    q[..., :4] = k[..., :4]
    builder = CASES[case][2]
    _check(cxp, case, q, k, v, mask, builder(rng) if builder else ())


@pytest.mark.new_shapes
@pytest.mark.parametrize("shape", [(260, 300), (300, 300), (311, 257)], ids=str)
def test_causal_many_levels(cxp, rng, shape):
    """Enough keys for five levels above the dense leaves, and a padding of the positions."""
    q, k, v, mask = _data(rng, *shape, dv=3)
    _check(cxp, "relu-abs-centred", q, k, v, mask, ())
    _check(cxp, "mixture-arrays", q, k, v, None, (rng.random((B, H, 2)) + 0.3, rng.normal(size=(B, H, 2))))


def test_causal_edges_of_the_grid(cxp, rng):
    """One key; more queries than keys (the first see nothing and get 0); no query, no key."""
    xp = cxp
    for lq, lk in [(1, 1), (3, 1), (5, 2), (2, 17)]:
        q, k, v, _ = _data(rng, lq, lk)
        out = _check(xp, "relu-abs-centred", q, k, v, None, ())
        np.testing.assert_array_equal(out[..., :max(lq - lk, 0), :], 0.0)
    for lq, lk in [(0, 4), (3, 0)]:
        q, k, v, _ = _data(rng, lq, lk)
        out = slicedkern.relu_attention(*(xp.asarray(a) for a in (q, k, v)), causal=True)
        assert_meta(out, like=xp.asarray(q), shape=(B, H, lq, C))
        np.testing.assert_array_equal(to_numpy(out), 0.0)


def test_causal_lower_triangle_by_hand():
    """The docstring example of hat_attention, and query i of Lq == Lk seeing keys 0..i."""
    q, k, v = np.zeros((1, 3)), np.array([[0.0, 0.5, 3.0]]), np.ones((1, 3, 1))
    np.testing.assert_allclose(slicedkern.hat_attention(q, k, v, causal=True)[..., 0], [[1.0, 0.75, 0.5]],
                               rtol=1e-15)
    # bottom-right alignment: one query against three keys sees all of them
    np.testing.assert_allclose(slicedkern.hat_attention(q[:, :1], k, v, causal=True)[..., 0], [[0.5]],
                               rtol=1e-15)
    # uncentred ReLU without normaliser: out_i = sum_{j <= i} ReLU(q_i - k_j) v_j
    q, k = np.array([[1.0, 2.0, 3.0]]), np.array([[0.0, 1.0, 0.5]])
    v = np.array([[[1.0], [10.0], [100.0]]])
    got = slicedkern.relu_attention(q, k, v, center=False, normalize=None, causal=True)[0, :, 0]
    np.testing.assert_allclose(got, [1.0, 2.0 + 10.0, 3.0 + 20.0 + 250.0], rtol=1e-15)


def test_float32_inputs(cxp, rng):
    q, k, v, mask = _data(rng, N, M)
    xp = cxp
    Q, K, V = (xp.asarray(a, dtype="float32") for a in (q, k, v))
    out = slicedkern.relu_attention(Q, K, V, key_mask=xp.asarray(mask), causal=True)
    assert_meta(out, like=Q, shape=(B, H, N, C))
    expected = reference.relu_attention(*(to_numpy(a).astype(np.float64) for a in (Q, K, V)), key_mask=mask,
                                        causal=True)
    np.testing.assert_allclose(to_numpy(out), expected, rtol=2e-6, atol=2e-6)


def test_non_finite_inputs_poison_only_the_queries_that_see_them(cxp, rng):
    """Query i sits at position i + Lk - Lq: a bad key at position j poisons the positions >= j."""
    xp = cxp
    lq, lk = 10, 13                                       # query i at position i + 3
    q, k, v = rng.normal(size=(3, lq)), rng.normal(size=(3, lk)), rng.normal(size=(3, lk, 2))
    mask = np.ones((3, lk), bool)
    k[0, 6] = np.nan                                      # poisons queries 3..9
    v[1, 9, 1] = np.inf                                   # poisons queries 6..9
    q[1, 0] = -np.inf                                     # its own row only
    k[2, 4], mask[2, 4] = np.inf, False                   # masked: poisons nothing
    expected_nan = np.zeros((3, lq), bool)
    expected_nan[0, 3:] = True
    expected_nan[1, 6:] = True
    expected_nan[1, 0] = True
    args = [xp.asarray(a) for a in (q, k, v)]
    out = to_numpy(slicedkern.relu_attention(*args, key_mask=xp.asarray(mask), causal=True))
    np.testing.assert_array_equal(np.isnan(out).any(-1), expected_nan)
    assert np.isnan(out[expected_nan]).all()
    clean_q, clean_k, clean_v = (np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0) for a in (q, k, v))
    ref = reference.relu_attention(clean_q, clean_k, clean_v, key_mask=mask, causal=True)
    np.testing.assert_allclose(out[~expected_nan], ref[~expected_nan], rtol=1e-10, atol=1e-12)

    _, pullback = slicedkern.vjp(lambda a, b, c: slicedkern.relu_attention(a, b, c, key_mask=xp.asarray(mask),
                                                                           causal=True), *args)
    dq, dk, dv = (to_numpy(g) for g in pullback(xp.asarray(np.ones((3, lq, 2)))))
    np.testing.assert_array_equal(np.isnan(dq), expected_nan)
    # a row in which some query saw a non-finite key: every key's gradient is NaN; other rows finite
    assert np.isnan(dk[:2]).all() and np.isnan(dv[:2]).all()
    assert np.isfinite(dk[2]).all() and np.isfinite(dv[2]).all()


def test_bad_causal_argument_is_a_type_error(rng):
    q, k, v = rng.normal(size=(1, 3)), rng.normal(size=(1, 3)), rng.normal(size=(1, 3, 2))
    for op, extra in [(slicedkern.relu_attention, ()), (slicedkern.hat_attention, (1.0,)),
                      (slicedkern.hat_mixture_attention, ([1.0], [1.0])), (slicedkern.kernel_attention, (Abs(),))]:
        for bad in ("yes", 1, None):
            with pytest.raises(TypeError) as info:
                op(q, k, v, *extra, causal=bad)
            assert names_argument(str(info.value), "causal")
    with pytest.raises(TypeError) as info:
        slicedkern.sliced_attention(q[..., None], k[..., None], v, ReLU(), directions=2, causal="no")
    assert names_argument(str(info.value), "causal")


def test_engine_without_causal_mode_declines(rng, monkeypatch):
    """An engine without a causal mode is a ValueError naming 'engine' when asked for, explicitly or
    as the context's default; the automatic rule picks one that has it (the sweep on NumPy arrays
    where numba is installed, else the scan)."""
    q, k, v = rng.normal(size=(2, 9)), rng.normal(size=(2, 9)), rng.normal(size=(2, 9, 2))
    expected = reference.relu_attention(q, k, v, causal=True)
    np.testing.assert_allclose(slicedkern.relu_attention(q, k, v, causal=True), expected, rtol=1e-12)
    with slicedkern.use_engine("auto"):
        np.testing.assert_allclose(slicedkern.relu_attention(q, k, v, causal=True), expected, rtol=1e-12)
    # the base class declines causal specs for an engine without a causal mode, naming the engine
    spec = types.SimpleNamespace(causal=True)
    assert "no causal mode" in slicedkern.engines.Engine().decline(spec, (q,), None)
    if "sweep" not in slicedkern.engines.available("numpy"):
        pytest.skip("the sweep engine needs numba")
    # the automatic rule picks the sweep (it has a causal mode): the same bits as asking for it, and
    # the scan's result to rounding
    auto = slicedkern.relu_attention(q, k, v, causal=True)
    np.testing.assert_array_equal(auto, slicedkern.relu_attention(q, k, v, causal=True, engine="sweep"))
    np.testing.assert_allclose(auto, slicedkern.relu_attention(q, k, v, causal=True, engine="scan"),
                               rtol=1e-13, atol=1e-15)
    torch = pytest.importorskip("torch")
    if not slicedkern.engines.get("triton").installed():
        pytest.skip("the triton engine needs Triton")
    # an engine without a causal mode (triton's, taken away here; it has one since issue 26), asked
    # for on torch tensors, declines with that reason
    monkeypatch.setattr(type(slicedkern.engines.get("triton")), "supports_causal", False)
    Q, K, V = (torch.tensor(a) for a in (q, k, v))
    with pytest.raises(ValueError) as info:
        slicedkern.relu_attention(Q, K, V, causal=True, engine="triton")
    assert names_argument(str(info.value), "engine") and "no causal mode" in str(info.value)
    with slicedkern.use_engine("triton"), pytest.raises(ValueError, match="no causal mode"):
        slicedkern.hat_attention(Q, K, V, 0.5, causal=True)
    with slicedkern.use_engine("sweep"):                        # the causal call runs on the sweep now
        np.testing.assert_allclose(slicedkern.hat_attention(q, k, v, 0.5, causal=True),
                                   reference.hat_attention(q, k, v, 0.5, causal=True), rtol=1e-12, atol=1e-14)


def test_sweep_matches_scan_serial_and_parallel(rng, monkeypatch):
    """The sweep's causal forward and pull-back against the scan's (to rounding), on the parallel path
    (rows claimed by numba's workers); the serial path (one worker) gives the same bits."""
    if "sweep" not in slicedkern.engines.available("numpy"):
        pytest.skip("the sweep engine needs numba")
    from slicedkern.engines.sweep import _causal_host
    lq, lk, dv = 700, 900, 24
    q, k, v = rng.normal(size=(4, lq)), rng.normal(size=(4, lk)), rng.normal(size=(4, lk, dv))
    q[:, :50] = k[:, 200:250]                       # ties between queries and the keys they see
    mask = rng.random((4, lk)) < 0.8
    bw = rng.random(4) + 0.4
    g = rng.normal(size=(4, lq, dv))

    def run(engine):
        out, pullback = slicedkern.vjp(lambda a, b, c, d: slicedkern.hat_attention(
            a, b, c, d, key_mask=mask, normalize="abs", causal=True, engine=engine), q, k, v, bw)
        return [out, *pullback(g)]

    # the threshold would run this size serially: force the parallel path (one worker per row, up
    # to numba's thread count), then the serial one
    numba = pytest.importorskip("numba")
    monkeypatch.setattr(_causal_host, "_workers", lambda bsz, *args: min(numba.get_num_threads(), bsz))
    parallel = run("sweep")
    scan = run("scan")
    for name, a, b in zip(["out", "dq", "dk", "dv", "dbandwidth"], parallel, scan):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11 * np.abs(b).max(), err_msg=name)
    monkeypatch.setattr(_causal_host, "_workers", lambda *args: 1)
    for name, a, b in zip(["out", "dq", "dk", "dv", "dbandwidth"], run("sweep"), parallel):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_sliced_causal_attention(cxp, rng):
    xp = cxp
    q, k, v = rng.normal(size=(2, 7, 3)), rng.normal(size=(2, 9, 3)), rng.normal(size=(2, 9, 2))
    theta = slicedkern.directions(4, 3, seed=0)
    out = slicedkern.sliced_attention(*(xp.asarray(a) for a in (q, k, v)), Hat(1.2), directions=xp.asarray(theta),
                                      center=True, causal=True)
    expected = reference.sliced_attention(q, k, v, Hat(1.2), directions=theta, center=True, causal=True)
    by_hand = np.mean([reference.kernel_attention(q @ t, k @ t, v, Hat(1.2), center=True, causal=True)
                       for t in theta], axis=0)
    np.testing.assert_allclose(expected, by_hand, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(to_numpy(out), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.exhaustive      # 70 s of eager JAX compiles; test_double_float_gradients runs this forward too
@pytest.mark.new_shapes
def test_double_float_work_dtype(rng):
    """JAX without float64: the double-float path (single-position leaves, wide sums and totals)."""
    jnp = pytest.importorskip("jax.numpy")
    q, k, v, mask = _data(rng, 11, 19, dv=2)
    expected = reference.relu_attention(q, k, v, key_mask=mask, causal=True)
    with jax_x64(False):
        out = slicedkern.relu_attention(*(jnp.asarray(a, dtype=jnp.float32) for a in (q, k, v)),
                                        key_mask=jnp.asarray(mask), causal=True)
        assert out.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-6, atol=2e-6)


# ------------------------------------------------------------------------------------------ gradients
GRAD_CASES = {
    "relu-abs-centred-mask": (slicedkern.relu_attention, reference.relu_attention, (), {}, True),
    "relu-relu-uncentred": (slicedkern.relu_attention, reference.relu_attention, (),
                            {"normalize": "relu", "center": False}, False),
    "hat-count-mask": (slicedkern.hat_attention, reference.hat_attention, (0.7,), {}, True),
    "mixture-centred-relu": (slicedkern.kernel_attention, reference.kernel_attention,
                             (HatMixture([0.4, 1.5], [1.0, -0.5]),), {"center": True, "normalize": "relu"}, True),
    "general-abs-none": (slicedkern.kernel_attention, reference.kernel_attention, (GENERAL,),
                         {"normalize": None, "center": True}, False),
}


def _finite_differences(loss, arrays, eps=1e-6):
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


def _grad_data(rng, lq, lk, b=2, dv=2):
    q, k, v = rng.normal(size=(b, lq)), rng.normal(size=(b, lk)), rng.normal(size=(b, lk, dv))
    mask = rng.random((b, lk)) > 0.3
    mask[:, 0] = True
    return q, k, v, mask, rng.normal(size=(b, lq, dv))


@pytest.mark.parametrize("shape", [(6, 6), (4, 9), (9, 4), (19, 21)], ids=str)
@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_vjp_matches_finite_differences(cxp, rng, case, shape):
    xp = cxp
    fast, dense, extra, opts, masked = GRAD_CASES[case]
    q, k, v, mask, g = _grad_data(rng, *shape)
    mask = mask if masked else None

    def loss(q_, k_, v_):
        return float(np.sum(dense(q_, k_, v_, *extra, key_mask=mask, causal=True, **opts) * g))

    expected = _finite_differences(loss, [q, k, v])
    # central differences round the loss: an error of about |loss terms| ulp / step (a "relu" normaliser
    # clamped at eps makes some outputs huge while their exact gradient may vanish)
    noise = 1e-9 * float(np.sum(np.abs(dense(q, k, v, *extra, key_mask=mask, causal=True, **opts) * g)))
    mask_b = None if mask is None else xp.asarray(mask)
    _, pullback = slicedkern.vjp(lambda q_, k_, v_: fast(q_, k_, v_, *extra, key_mask=mask_b, causal=True, **opts),
                                 *(xp.asarray(a) for a in (q, k, v)))
    for name, got, want in zip("qkv", pullback(xp.asarray(g)), expected):
        np.testing.assert_allclose(to_numpy(got), want, rtol=1e-5, atol=1e-6 * np.abs(want).max() + noise,
                                   err_msg=f"d{name}")


def test_parameter_gradients(cxp, rng):
    """Per-row bandwidths and mixture weights, against finite differences of the reference."""
    xp = cxp
    q, k, v, _, g = _grad_data(rng, 11, 13, b=3)
    bw = rng.random(3) + 0.4
    mix_b, mix_w = rng.random((3, 2)) + 0.3, rng.normal(size=(3, 2))
    for fast, dense, extra in [(slicedkern.hat_attention, reference.hat_attention, (bw,)),
                               (slicedkern.hat_mixture_attention, reference.hat_mixture_attention, (mix_b, mix_w))]:
        expected = _finite_differences(lambda *a: float(np.sum(dense(q, k, v, *a, causal=True) * g)), list(extra))
        _, pullback = slicedkern.vjp(lambda *a: fast(*a, causal=True), *(xp.asarray(a) for a in (q, k, v) + extra))
        for got, want in zip(pullback(xp.asarray(g))[3:], expected):
            np.testing.assert_allclose(to_numpy(got), want, rtol=1e-6, atol=1e-7)


def test_torch_autograd(rng):
    torch = pytest.importorskip("torch")
    q, k, v, mask, g = _grad_data(rng, 7, 20)
    bw = rng.random(2) + 0.5
    args = [torch.tensor(a, requires_grad=True) for a in (q, k, v, bw)]
    mask_t = torch.tensor(mask)
    assert torch.autograd.gradcheck(
        lambda a, b, c, d: slicedkern.hat_attention(a, b, c, d, key_mask=mask_t, normalize="abs", causal=True),
        args, eps=1e-6, atol=1e-6, rtol=1e-5)
    out = slicedkern.relu_attention(*args[:3], causal=True)
    (out * torch.tensor(g)).sum().backward()
    _, pullback = slicedkern.vjp(lambda a, b, c: slicedkern.relu_attention(a, b, c, causal=True), q, k, v)
    for got, want in zip(args[:3], pullback(g)):
        np.testing.assert_allclose(got.grad.numpy(), want, rtol=1e-12, atol=1e-13)


@pytest.mark.exhaustive      # 50 s of compiles; the default run has JAX's causal forward and grad elsewhere
def test_jax_grad_jit_vmap(rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    q, k, v, mask, g = _grad_data(rng, N, M)
    with jax_x64(True):
        Q, K, V, G = (jnp.asarray(a) for a in (q, k, v, g))

        def f(a, b, c):
            return slicedkern.relu_attention(a, b, c, key_mask=jnp.asarray(mask), causal=True)

        out = jax.jit(f)(Q, K, V)
        np.testing.assert_allclose(np.asarray(out), reference.relu_attention(q, k, v, key_mask=mask, causal=True),
                                   rtol=1e-10, atol=1e-12)
        grads = jax.jit(jax.grad(lambda a, b, c: jnp.sum(f(a, b, c) * G), argnums=(0, 1, 2)))(Q, K, V)
        _, pullback = slicedkern.vjp(lambda a, b, c: slicedkern.relu_attention(a, b, c, key_mask=mask,
                                                                               causal=True), q, k, v)
        for got, want in zip(grads, pullback(g)):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-10, atol=1e-12)
        batched = jax.vmap(lambda a, b, c: slicedkern.hat_attention(a, b, c, 0.8, causal=True))(Q, K, V)
        np.testing.assert_allclose(np.asarray(batched), reference.hat_attention(q, k, v, 0.8, causal=True),
                                   rtol=1e-10, atol=1e-12)
        # vmap of grad: one row at a time, the batched rows' gradients
        row_grads = jax.vmap(jax.grad(lambda a, b, c, g_: jnp.sum(
            slicedkern.relu_attention(a, b, c, causal=True) * g_), argnums=(0, 1, 2)))(Q, K, V, G)
        _, pullback = slicedkern.vjp(lambda a, b, c: slicedkern.relu_attention(a, b, c, causal=True), q, k, v)
        for got, want in zip(row_grads, pullback(g)):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-10, atol=1e-12)


@pytest.mark.exhaustive      # 20-30 s of eager JAX compiles; tests/fuzz test_jax_without_x64 runs the double-float path
@pytest.mark.new_shapes
def test_double_float_gradients(rng):
    """JAX without float64: the causal backward in double-float work, against the float64 pull-back."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    q, k, v, mask, g = _grad_data(rng, 9, 14)
    _, pullback = slicedkern.vjp(lambda a, b, c: slicedkern.hat_attention(a, b, c, 0.9, key_mask=mask,
                                                                          normalize="abs", causal=True), q, k, v)
    expected = pullback(g)
    with jax_x64(False):
        def loss(a, b, c):
            out = slicedkern.hat_attention(a, b, c, 0.9, key_mask=jnp.asarray(mask), normalize="abs", causal=True)
            return jnp.sum(out * jnp.asarray(g, dtype=jnp.float32))

        got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(jnp.asarray(a, dtype=jnp.float32) for a in (q, k, v)))
    for name, a, b in zip("qkv", got, expected):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-4 * np.abs(b).max(), err_msg=f"d{name}")
