"""Banded attention (``window=``, docs/mathematics.rst "Windows") against the dense float64 reference,
on every backend and engine with a causal mode: bounded and unbounded sides, a negative ``right``
(the keys older than a window), bands that hide every key, ``Lq != Lk``, masks, ties, windows inside
packed segments, the NaN rule over the band; gradients (``slicedkern.vjp`` against central
differences, torch autograd and ``jax.grad`` under ``jit`` against the reference's); bad input.
"""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import assert_close, central_differences, jax_x64, names_argument, tie_scores, to_numpy

import slicedkern
from slicedkern import reference
from slicedkern.kernels import PiecewiseLinear

B, H, DV = 2, 2, 3
GENERAL = PiecewiseLinear((-0.75, 0.0, 0.5), (1.5, -2.0, 0.75), slope=-0.5, intercept=0.25)
WINDOWS = [(4, 0), (3, 2), (-1, -6), (5, -2), (0, 0), (-1, 3), (6, -1), (2, -5), (50, 40)]

CASES = {
    "relu-abs-centred": (slicedkern.relu_attention, reference.relu_attention, None, {}),
    "relu-count": (slicedkern.relu_attention, reference.relu_attention, None, {"normalize": "count", "center": False}),
    "hat-per-head": (slicedkern.hat_attention, reference.hat_attention, lambda rng: (rng.random(H) + 0.4,),
                     {"center": True}),
    "mixture-arrays": (slicedkern.hat_mixture_attention, reference.hat_mixture_attention,
                       lambda rng: (rng.random((B, H, 2)) + 0.3, rng.normal(size=(B, H, 2))), {"normalize": "relu"}),
    "kernel-general": (slicedkern.kernel_attention, reference.kernel_attention, lambda rng: (GENERAL,),
                       {"normalize": "abs"}),
}


@pytest.fixture
def cxp(xp):
    """The backend under test, skipped where its engine has no causal mode for these arrays (a band
    is made of causal sums)."""
    try:
        slicedkern.relu_attention(xp.asarray(np.zeros((1, 2))), xp.asarray(np.zeros((1, 2))),
                                  xp.asarray(np.zeros((1, 2, 1))), window=(1, 0))
    except ValueError as exc:
        if not str(exc).startswith("argument 'engine'"):
            raise
        pytest.skip(f"the {xp.engine!r} engine has no causal mode for {xp.name} arrays")
    return xp


def _data(rng, lq, lk, *, ties=False):
    if ties:
        q, k = tie_scores(rng, (B, H, lq)), tie_scores(rng, (B, H, lk))
    else:
        q, k = rng.normal(size=(B, H, lq)), rng.normal(size=(B, H, lk))
    v = rng.normal(size=(B, H, lk, DV)) + 0.5
    mask = rng.random((B, H, lk)) < 0.8
    return q, k, v, mask


def _check(xp, case, q, k, v, mask, args, window, causal, segment_ids=None, rtol=1e-9):
    fast, dense, _, opts = CASES[case]
    conv = [xp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    Q, K, V = (xp.asarray(a) for a in (q, k, v))
    Mk = None if mask is None else xp.asarray(mask)
    ids = None if segment_ids is None else xp.asarray(segment_ids)
    out = fast(Q, K, V, *conv, key_mask=Mk, causal=causal, window=window, segment_ids=ids, **opts)
    expected = dense(Q, K, V, *conv, key_mask=Mk, causal=causal, window=window, segment_ids=ids, **opts)
    scale = float(np.max(np.abs(to_numpy(expected)), initial=0.0))
    assert_close(out, expected, rtol=rtol, atol=rtol * scale + 1e-12, err_msg=f"{case} {window} {causal}")
    return to_numpy(out)


@pytest.mark.parametrize("shape", [(21, 21), (13, 21), (21, 13)], ids=lambda s: f"lq{s[0]}-lk{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_windows_match_dense_reference(cxp, rng, case, causal, shape):
    builder = CASES[case][2]
    args = builder(rng) if builder else ()
    q, k, v, mask = _data(rng, *shape, ties=case == "relu-count")
    for window in WINDOWS:
        _check(cxp, case, q, k, v, mask, args, window, causal)
    _check(cxp, case, q, k, v, None, args, (3, -2), causal)


def test_trivial_windows_are_the_plain_and_causal_calls(cxp, rng):
    q, k, v, mask = (cxp.asarray(a) for a in _data(rng, 9, 11))
    for window, causal in [((-1, -1), False), ((-1, 0), False), ((-1, 5), True)]:
        got = slicedkern.relu_attention(q, k, v, key_mask=mask, window=window, causal=causal)
        want = slicedkern.relu_attention(q, k, v, key_mask=mask, causal=causal or window == (-1, 0))
        np.testing.assert_array_equal(to_numpy(got), to_numpy(want))


def test_windows_inside_segments(cxp, rng):
    q, k, v, mask = _data(rng, 23, 23)
    ids = np.array([3, 3, 3, 3, 3, 3, 3, 0, 0, 9, 9, 9, 9, 9, 9, 9, 9, 9, 1, 1, 1, 1, 1])[None, None, :]
    ids = np.concatenate([ids, ids[..., ::-1]], axis=0)
    for window in [(2, 0), (3, 1), (-1, -3), (1, -3)]:
        for causal in (False, True):
            _check(cxp, "hat-per-head", q, k, v, mask, (np.array([0.6, 1.4]),), window, causal, segment_ids=ids)


def test_band_nan_rule(cxp, rng):
    """A non-finite key makes NaN exactly the queries whose band holds it."""
    q, k, v, _ = _data(rng, 16, 16)
    k[..., 6] = np.inf
    for window in [(2, 0), (1, 1), (-1, -4)]:
        out = to_numpy(slicedkern.relu_attention(cxp.asarray(q), cxp.asarray(k), cxp.asarray(v), window=window))
        i = np.arange(16)
        left, right = window
        holds = (6 >= (i - left if left != -1 else -np.inf)) & (6 <= i + right)
        np.testing.assert_array_equal(np.isnan(out).any(axis=-1), np.broadcast_to(holds, out.shape[:-1]))


@pytest.mark.parametrize("window", [(3, 0), (2, 2), (-1, -3)])
def test_vjp_matches_central_differences(rng, window):
    q, k = rng.normal(size=(1, H, 10)), rng.normal(size=(1, H, 12))
    v = rng.normal(size=(1, H, 12, 2))
    bw = rng.random(H) + 0.6
    mask = rng.random((1, H, 12)) < 0.85
    g = rng.normal(size=(1, H, 10, 2))
    out, pullback = slicedkern.vjp(slicedkern.hat_attention, q, k, v, bw, key_mask=mask, center=True, normalize="abs",
                                   window=window)
    grads = pullback(g)

    def loss(q_=q, k_=k, v_=v, bw_=bw):
        return float(np.sum(g * reference.hat_attention(q_, k_, v_, bw_, key_mask=mask, center=True, normalize="abs",
                                                        window=window)))
    expected = [central_differences(lambda a: loss(q_=a), q), central_differences(lambda a: loss(k_=a), k),
                central_differences(lambda a: loss(v_=a), v), central_differences(lambda a: loss(bw_=a), bw)]
    for name, got, want in zip("qkvb", grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [None, (4, 0), (3, 2), (-1, -5)])
@pytest.mark.parametrize("engine", ["scan", "sweep"])
def test_torch_autograd_matches_reference_autograd(rng, engine, window, causal):
    """Packed segments with and without a window, through torch autograd."""
    torch = pytest.importorskip("torch")
    if engine not in slicedkern.engines.available("torch"):
        pytest.skip(f"the {engine!r} engine is not installed")
    q, k, v, mask = _data(rng, 17, 17)
    ids = torch.as_tensor(np.repeat([0, 1, 2], [6, 4, 7])[None, None, :])
    weights = (rng.random((B, H, 2)) + 0.3, rng.normal(size=(B, H, 2)))
    g = torch.as_tensor(rng.normal(size=(B, H, 17, DV)))

    def run(fn, **kw):
        leaves = [torch.tensor(a, requires_grad=True) for a in (q, k, v, *weights)]
        out = fn(*leaves, key_mask=torch.as_tensor(mask), window=window, causal=causal, segment_ids=ids,
                 normalize="abs", center=True, **kw)
        (out * g).sum().backward()
        return out.detach(), [a.grad for a in leaves]

    out, grads = run(slicedkern.hat_mixture_attention, engine=engine)
    ref, ref_grads = run(reference.hat_mixture_attention)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for name, a, b in zip(["q", "k", "v", "bandwidths", "weights"], grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=name)


def test_jax_grad_under_jit_matches_reference(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    q, k, v, mask = _data(rng, 14, 14)
    with jax_x64(True):
        def loss(fn):
            def value(q_, k_, v_, bw_):
                out = fn(q_, k_, v_, bw_, key_mask=jnp.asarray(mask), window=(3, -1), engine=None)
                return jnp.sum(out * jnp.arange(out.size, dtype=out.dtype).reshape(out.shape) / out.size)
            return value
        args = tuple(jnp.asarray(a) for a in (q, k, v, rng.random(H) + 0.5))
        got = jax.jit(jax.grad(loss(lambda *a, **kw: slicedkern.hat_attention(*a, **{**kw, "engine": "scan"})),
                               argnums=(0, 1, 2, 3)))(*args)
        want = jax.grad(loss(lambda *a, engine, **kw: reference.hat_attention(*a, **kw)), argnums=(0, 1, 2, 3))(*args)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-11)


def test_bad_windows_name_the_argument():
    q, k, v = np.zeros((2, 4)), np.zeros((2, 4)), np.zeros((2, 4, 1))
    for window, error in [((-2, 0), ValueError), ((1.5, 0), TypeError), ((1,), TypeError), (3, TypeError),
                          ((True, 0), TypeError)]:
        with pytest.raises(error) as info:
            slicedkern.relu_attention(q, k, v, window=window)
        assert names_argument(str(info.value), "window"), (window, info.value)
