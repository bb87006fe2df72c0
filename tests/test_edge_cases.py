"""Numerics and bad input on every backend: errors that name the argument, the NaN / inf policy, empty inputs,
no in-place modification, determinism, and an import that pulls in no framework."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest
from _helpers import C, M, N, assert_meta, make_backend, names_argument, require_selected

import slicedkern
from slicedkern.kernels import Hat, HatMixture, PiecewiseLinear, ReLU

B, H, LQ, LK, DV = 2, 3, N, M, C
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def qkv(rng):
    return rng.normal(size=(B, H, LQ)), rng.normal(size=(B, H, LK)), rng.normal(size=(B, H, LK, DV))


def xyw(rng):
    return rng.normal(size=(B, H, N)), rng.normal(size=(B, H, M)), rng.normal(size=(B, H, M, C))


def other_backend(xp):
    """A backend from a different array library than ``xp`` (NumPy, else array_api_strict)."""
    return make_backend("array_api_strict" if xp.name == "numpy" else "numpy")


@contextlib.contextmanager
def raises(exc, *names, match=None):
    """``pytest.raises`` that also checks the message names every argument in ``names``."""
    with pytest.raises(exc, match=match) as info:
        yield info
    message = str(info.value)
    assert names_argument(message, *names), f"{message!r} does not name {names}"


# -------------------------------------------------------------------------------------- TypeErrors
def test_mixed_libraries_kernel_sum(xp, rng):
    other = other_backend(xp)
    x, y, w = xyw(rng)
    with raises(TypeError, "x", "y"):
        slicedkern.kernel_sum(xp.asarray(x), other.asarray(y), xp.asarray(w), ReLU())
    with raises(TypeError, "w"):
        slicedkern.kernel_sum(xp.asarray(x), xp.asarray(y), other.asarray(w), ReLU())


def test_mixed_libraries_attention(xp, rng):
    other = other_backend(xp)
    q, k, v = qkv(rng)
    Q, K, V = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    with raises(TypeError, "q", "k"):
        slicedkern.relu_attention(Q, other.asarray(k), V)
    with raises(TypeError, "v"):
        slicedkern.hat_attention(Q, K, other.asarray(v))
    with raises(TypeError, "key_mask"):
        slicedkern.relu_attention(Q, K, V, key_mask=other.asarray(np.ones((B, H, LK), dtype=bool)))
    with raises(TypeError, "bandwidth"):
        slicedkern.hat_attention(Q, K, V, other.asarray(np.ones(H)))
    with raises(TypeError, "weights"):
        slicedkern.hat_mixture_attention(Q, K, V, xp.asarray(np.ones((H, 2))), other.asarray(np.ones((H, 2))))


def test_numpy_with_torch_is_a_type_error(request, rng):
    require_selected(request.config, "numpy", "torch")
    torch = pytest.importorskip("torch")
    q, k, v = qkv(rng)
    with raises(TypeError, "q", "k"):
        slicedkern.relu_attention(q, torch.asarray(k), torch.asarray(v))
    with raises(TypeError, "x", "y"):
        slicedkern.kernel_sum(torch.asarray(q), k, v, ReLU())


def test_different_devices_are_a_type_error(request, rng):
    require_selected(request.config, "array_api_strict")
    xs = pytest.importorskip("array_api_strict")
    q, k, v = qkv(rng)
    a = xs.asarray(q, device=xs.Device("device1"))
    b = xs.asarray(k, device=xs.Device("CPU_DEVICE"))
    c = xs.asarray(v, device=xs.Device("device1"))
    with raises(TypeError, "q", "k", match="device"):
        slicedkern.relu_attention(a, b, c)
    with raises(TypeError, "x", "y", match="device"):
        slicedkern.kernel_sum(a, b, c, ReLU())


@pytest.mark.parametrize("dtype", ["int64", "int32", "bool"])
def test_non_floating_scores(xp, rng, dtype):
    q, k, v = qkv(rng)
    ints = (rng.integers(-3, 3, size=(B, H, LK)) > 0) if dtype == "bool" else rng.integers(-3, 3, size=(B, H, LK))
    K = xp.asarray(ints, dtype)
    with raises(TypeError, "k", match="floating"):
        slicedkern.relu_attention(xp.asarray(q), K, xp.asarray(v))
    with raises(TypeError, "y", match="floating"):
        slicedkern.kernel_sum(xp.asarray(q), K, xp.asarray(v), Hat(1.0))
    with raises(TypeError, "v"):
        slicedkern.hat_attention(xp.asarray(q), xp.asarray(k), xp.asarray(rng.integers(0, 3, (B, H, LK, DV)),
                                                                            "int64"))
    with raises(TypeError, "bandwidth"):
        slicedkern.hat_attention(xp.asarray(q), xp.asarray(k), xp.asarray(v), xp.asarray(np.ones(H, np.int64)))


@pytest.mark.parametrize("dtype", ["float64", "int64"])
def test_non_bool_key_mask(xp, rng, dtype):
    q, k, v = (xp.asarray(a) for a in qkv(rng))
    mask = xp.asarray(np.ones((B, H, LK)), dtype)
    with raises(TypeError, "key_mask", match="bool"):
        slicedkern.relu_attention(q, k, v, key_mask=mask)
    with raises(TypeError, "key_mask", match="bool"):
        slicedkern.hat_attention(q, k, v, key_mask=mask)


@pytest.mark.parametrize("kernel", ["relu", ReLU, lambda r: r, 1.0, None], ids=["str", "class", "lambda",
                                                                               "float", "none"])
def test_kernel_must_be_a_piecewise_linear(xp, rng, kernel):
    x, y, w = (xp.asarray(a) for a in xyw(rng))
    with raises(TypeError, "kernel"):
        slicedkern.kernel_sum(x, y, w, kernel)
    q, k, v = (xp.asarray(a) for a in qkv(rng))
    with raises(TypeError, "kernel"):
        slicedkern.kernel_attention(q, k, v, kernel)


# ------------------------------------------------------------------------------------- ValueErrors
def test_mismatched_number_of_keys(xp, rng):
    q, k, v = qkv(rng)
    with raises(ValueError, "k", "v"):
        slicedkern.relu_attention(xp.asarray(q), xp.asarray(k), xp.asarray(v[..., :-1, :]))
    with raises(ValueError, "k", "v"):
        slicedkern.hat_attention(xp.asarray(q), xp.asarray(k[..., :-1]), xp.asarray(v))
    with raises(ValueError, "key_mask"):
        slicedkern.relu_attention(xp.asarray(q), xp.asarray(k), xp.asarray(v),
                                  key_mask=xp.asarray(np.ones((B, H, LK - 1), dtype=bool)))
    x, y, w = xyw(rng)
    with raises(ValueError, "y", "w"):
        slicedkern.kernel_sum(xp.asarray(x), xp.asarray(y), xp.asarray(w[..., :-1, :]), ReLU())


def test_bad_ranks(xp, rng):
    q, k, v = qkv(rng)
    with raises(ValueError, "v"):
        slicedkern.relu_attention(xp.asarray(q), xp.asarray(k), xp.asarray(k))    # v without Dv axis
    with raises(ValueError, "q"):
        slicedkern.relu_attention(xp.asarray(np.float64(1.0)), xp.asarray(k), xp.asarray(v))
    x, y, w = xyw(rng)
    with raises(ValueError, "w"):
        slicedkern.kernel_sum(xp.asarray(x), xp.asarray(y), xp.asarray(w[..., None]), ReLU())
    with raises(ValueError, "w"):
        slicedkern.kernel_sum(xp.asarray(x), xp.asarray(y), xp.asarray(w[0, 0, :, 0]), ReLU())


def test_non_broadcastable_batch(xp, rng):
    q = rng.normal(size=(2, LQ))
    k, v = rng.normal(size=(3, LK)), rng.normal(size=(3, LK, DV))
    with raises(ValueError, "q", "k", match="broadcast"):
        slicedkern.relu_attention(xp.asarray(q), xp.asarray(k), xp.asarray(v))
    with raises(ValueError, "x", "y", match="broadcast"):
        slicedkern.kernel_sum(xp.asarray(q), xp.asarray(k), xp.asarray(v), Hat(1.0))
    with raises(ValueError, "key_mask", match="broadcast"):
        slicedkern.relu_attention(xp.asarray(k[:, :LQ]), xp.asarray(k), xp.asarray(v),
                                  key_mask=xp.asarray(np.ones((2, LK), dtype=bool)))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_bandwidth_must_be_positive_scalar(xp, rng, bad):
    q, k, v = (xp.asarray(a) for a in qkv(rng))
    with raises(ValueError, "bandwidth"):
        slicedkern.hat_attention(q, k, v, bad)
    with raises(ValueError, "bandwidths"):
        slicedkern.hat_mixture_attention(q, k, v, [1.0, bad], [1.0, 1.0])


@pytest.mark.parametrize("bad", [0.0, -0.5, float("inf"), float("nan")])
def test_bandwidth_must_be_positive_array(xp, rng, bad):
    q, k, v = (xp.asarray(a) for a in qkv(rng))
    with raises(ValueError, "bandwidth"):
        slicedkern.hat_attention(q, k, v, xp.asarray(np.array([1.0, bad, 2.0])))
    bws = np.ones((H, 2))
    bws[1, 1] = bad
    with raises(ValueError, "bandwidths"):
        slicedkern.hat_mixture_attention(q, k, v, xp.asarray(bws), xp.asarray(np.ones((H, 2))))


def test_bandwidth_shape_must_broadcast_to_the_batch(xp, rng):
    q, k, v = (xp.asarray(a) for a in qkv(rng))
    with raises(ValueError, "bandwidth"):
        slicedkern.hat_attention(q, k, v, xp.asarray(np.ones(H + 1)))
    with raises(ValueError, "bandwidth"):
        slicedkern.hat_attention(q, k, v, xp.asarray(np.ones((4, B, H))))
    with raises(ValueError, "bandwidths", "weights"):
        slicedkern.hat_mixture_attention(q, k, v, [1.0, 2.0], [1.0])
    with raises(ValueError, "bandwidths", "weights"):
        slicedkern.hat_mixture_attention(q, k, v, xp.asarray(np.ones((H, 2))), xp.asarray(np.ones((H, 3))))


@pytest.mark.parametrize("normalize", ["sum", "ABS", "", "softmax", 1])
def test_unknown_normalize(xp, rng, normalize):
    q, k, v = (xp.asarray(a) for a in qkv(rng))
    for fn, extra in ((slicedkern.relu_attention, ()), (slicedkern.hat_attention, (0.5,)),
                      (slicedkern.hat_mixture_attention, ([0.5], [1.0])),
                      (slicedkern.kernel_attention, (ReLU(),))):
        with raises(ValueError, "normalize"):
            fn(q, k, v, *extra, normalize=normalize)


@pytest.mark.parametrize("eps", [-1e-6, float("nan")])
def test_negative_eps(xp, rng, eps):
    q, k, v = (xp.asarray(a) for a in qkv(rng))
    with raises(ValueError, "eps"):
        slicedkern.relu_attention(q, k, v, eps=eps)


# ---------------------------------------------------------------------------------- NaN / inf policy
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_bad_query_poisons_only_its_row(xp, rng, bad):
    q, k, v = qkv(rng)
    q_bad = q.copy()
    q_bad[1, 2, 5] = bad
    mask = xp.asarray(rng.random((B, H, LK)) < 0.7)
    ops = [lambda Q: slicedkern.relu_attention(Q, xp.asarray(k), xp.asarray(v), key_mask=mask),
           lambda Q: slicedkern.hat_attention(Q, xp.asarray(k), xp.asarray(v), 0.8),
           lambda Q: slicedkern.kernel_sum(Q, xp.asarray(k), xp.asarray(v), Hat(0.8))]
    for op in ops:
        clean = xp.to_numpy(op(xp.asarray(q)))
        dirty = xp.to_numpy(op(xp.asarray(q_bad)))
        assert np.all(np.isnan(dirty[1, 2, 5]))
        others = np.ones(dirty.shape[:3], bool)
        others[1, 2, 5] = False
        assert np.all(np.isfinite(dirty[others]))
        np.testing.assert_array_equal(dirty[others], clean[others])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["key", "value"])
def test_bad_key_or_value_poisons_its_batch_row(xp, rng, bad, where):
    q, k, v = qkv(rng)
    k_bad, v_bad = k.copy(), v.copy()
    if where == "key":
        k_bad[0, 1, 7] = bad
    else:
        v_bad[0, 1, 7, 1] = bad
    mask_np = np.ones((B, H, LK), bool)
    mask_np[..., 3] = False
    mask = xp.asarray(mask_np)
    ops = [lambda K, V: slicedkern.relu_attention(xp.asarray(q), K, V),
           lambda K, V: slicedkern.relu_attention(xp.asarray(q), K, V, key_mask=mask, normalize="relu"),
           lambda K, V: slicedkern.hat_mixture_attention(xp.asarray(q), K, V, [0.5, 2.0], [1.0, -1.0]),
           lambda K, V: slicedkern.kernel_sum(xp.asarray(q), K, V, Hat(0.8))]
    for op in ops:
        clean = xp.to_numpy(op(xp.asarray(k), xp.asarray(v)))
        dirty = xp.to_numpy(op(xp.asarray(k_bad), xp.asarray(v_bad)))
        assert np.all(np.isnan(dirty[0, 1])), "the whole batch row must be NaN"
        rows = np.ones((B, H), bool)
        rows[0, 1] = False
        assert np.all(np.isfinite(dirty[rows]))
        np.testing.assert_array_equal(dirty[rows], clean[rows])


def test_bad_weight_poisons_its_batch_row(xp, rng):
    x, y, w = xyw(rng)
    w_bad = w.copy()
    w_bad[1, 0, 4, 0] = np.nan
    clean = xp.to_numpy(slicedkern.kernel_sum(xp.asarray(x), xp.asarray(y), xp.asarray(w), ReLU()))
    dirty = xp.to_numpy(slicedkern.kernel_sum(xp.asarray(x), xp.asarray(y), xp.asarray(w_bad), ReLU()))
    assert np.all(np.isnan(dirty[1, 0]))
    rows = np.ones((B, H), bool)
    rows[1, 0] = False
    np.testing.assert_array_equal(dirty[rows], clean[rows])


def test_nan_everywhere_is_nan_everywhere(xp, rng):
    q, k, v = qkv(rng)
    nan = np.full_like(q, np.nan)
    out = xp.to_numpy(slicedkern.relu_attention(xp.asarray(nan), xp.asarray(k), xp.asarray(v)))
    assert np.all(np.isnan(out))
    out = xp.to_numpy(slicedkern.hat_attention(xp.asarray(q), xp.asarray(np.full_like(k, np.inf)),
                                               xp.asarray(v)))
    assert np.all(np.isnan(out))


# --------------------------------------------------------------------------------------- empty input
@pytest.mark.parametrize("empty", ["keys", "queries", "both"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_empty_attention(xp, rng, empty, dtype):
    lq = 0 if empty in ("queries", "both") else LQ
    lk = 0 if empty in ("keys", "both") else LK
    q = xp.asarray(rng.normal(size=(B, 1, lq)), dtype)      # batch dims still broadcast
    k = xp.asarray(rng.normal(size=(1, H, lk)), dtype)
    v = xp.asarray(rng.normal(size=(1, H, lk, DV)), dtype)
    mask = xp.asarray(np.ones((B, H, lk), dtype=bool))
    outs = [slicedkern.relu_attention(q, k, v),
            slicedkern.relu_attention(q, k, v, key_mask=mask, normalize="relu"),
            slicedkern.relu_attention(q, k, v, center=False, normalize=None),
            slicedkern.hat_attention(q, k, v, 0.5),
            slicedkern.hat_attention(q, k, v, xp.asarray(np.ones(H), dtype), normalize="abs"),
            slicedkern.hat_mixture_attention(q, k, v, [0.5, 1.0], [1.0, 2.0], key_mask=mask),
            slicedkern.kernel_attention(q, k, v, PiecewiseLinear(intercept=1.0), normalize=None)]
    for out in outs:
        assert_meta(out, like=q, shape=(B, H, lq, DV))
        np.testing.assert_array_equal(xp.to_numpy(out), 0.0)


@pytest.mark.parametrize("empty", ["keys", "queries"])
def test_empty_kernel_sum(xp, rng, empty):
    n, m = (0, M) if empty == "queries" else (N, 0)
    x = xp.asarray(rng.normal(size=(B, 1, n)))
    y = xp.asarray(rng.normal(size=(1, H, m)))
    for w, shape in ((rng.normal(size=(1, H, m, C)), (B, H, n, C)), (rng.normal(size=(1, H, m)), (B, H, n))):
        # the intercept would make a non-empty sum non-zero: an empty sum is still 0
        out = slicedkern.kernel_sum(x, y, xp.asarray(w), PiecewiseLinear(intercept=3.0, slope=1.0))
        assert_meta(out, like=x, shape=shape)
        np.testing.assert_array_equal(xp.to_numpy(out), 0.0)


# ---------------------------------------------------------------------- purity and determinism
def test_inputs_are_not_modified(xp, rng):
    q, k, v = qkv(rng)
    q[0, 0, 0] = np.nan
    k[1, 1, 1] = np.inf
    mask = rng.random((B, H, LK)) < 0.6
    bw = np.array([0.5, 1.0, 2.0])
    arrays = [xp.asarray(a) for a in (q, k, v, mask, bw)]
    before = [xp.to_numpy(a).copy() for a in arrays]
    Q, K, V, MK, BW = arrays
    slicedkern.relu_attention(Q, K, V, key_mask=MK)
    slicedkern.hat_attention(Q, K, V, BW, key_mask=MK)
    slicedkern.kernel_attention(Q, K, V, Hat(0.5), center=True, key_mask=MK)
    slicedkern.kernel_sum(Q, K, V, ReLU())
    slicedkern.hat_mixture_attention(Q, K, V, xp.asarray(np.ones((H, 2))), xp.asarray(np.ones((H, 2))))
    for a, b in zip(arrays, before):
        np.testing.assert_array_equal(xp.to_numpy(a), b)


def test_identical_calls_are_bit_identical(xp, rng):
    q, k, v = qkv(rng)
    k[..., ::3] = k[..., 1::3][..., : k[..., ::3].shape[-1]]    # plenty of ties
    Q, K, V = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    mask = xp.asarray(rng.random((B, H, LK)) < 0.7)
    calls = [lambda: slicedkern.relu_attention(Q, K, V, key_mask=mask),
             lambda: slicedkern.hat_mixture_attention(Q, K, V, [0.3, 1.0], [1.0, -0.5]),
             lambda: slicedkern.kernel_sum(Q, K, V, HatMixture([0.3, 1.0], [1.0, -0.5]))]
    for call in calls:
        first, second = xp.to_numpy(call()), xp.to_numpy(call())
        assert first.tobytes() == second.tobytes()


def test_importing_imports_no_framework():
    code = ("import sys, numpy as np, slicedkern, slicedkern.kernels, slicedkern.reference\n"
            "x = np.linspace(-1, 1, 5)\n"
            "slicedkern.kernel_sum(x, x, np.ones(5), slicedkern.kernels.Hat(0.5))\n"
            "slicedkern.relu_attention(x[None], x[None], np.ones((1, 5, 2)))\n"
            "slicedkern.reference.relu_attention(x[None], x[None], np.ones((1, 5, 2)))\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'jax', 'jaxlib', 'cupy'})\n"
            "print(repr(bad))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"importing slicedkern imported {result.stdout.strip()}"


def test_sdpa_shaped_scores_get_a_message_that_says_how_to_project(rng):
    q, k, v = rng.normal(size=(2, 4, 16, 8)), rng.normal(size=(2, 4, 16, 8)), rng.normal(size=(2, 4, 16, 8))
    with pytest.raises(ValueError, match="one projected score per token.*q @ w_q"):
        slicedkern.relu_attention(q, k, v)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "int64"])
def test_finite_primitive_agrees_with_isfinite(xp, dtype):
    """The NaN policy's ``finite`` (on torch ``x - x == 0``, two operators instead of
    ``isfinite``'s four) says what ``isfinite`` says: NaN, both infinities, the largest finite
    number, -0, a subnormal, integers."""
    from slicedkern.backends import finite
    if dtype == "bfloat16" and xp.name not in ("torch", "torch_cuda", "jax"):
        pytest.skip("no bfloat16 here")
    if dtype == "int64":
        values = np.array([0, -3, 2**62, -2**62])
    else:
        big = float(np.finfo(np.float32).max) if dtype != "float64" else float(np.finfo(np.float64).max)
        if dtype == "bfloat16":
            big = 3.3e38
        values = np.array([np.nan, np.inf, -np.inf, big, -big, -0.0, 1e-40 if dtype != "float64" else 5e-324, 1.5])
    a = xp.asarray(values, dtype=dtype)
    got = xp.to_numpy(finite(xp.xp, a))
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, np.isfinite(values) if dtype != "bfloat16" else
                                  np.isfinite(xp.to_numpy(a).astype(np.float64)))


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_finite_keys_primitive_marks_each_value_row(xp, dtype):
    """``finite_keys`` (the causal NaN rule's check of the values; on torch one ``aminmax``, no
    (m, c) temporaries) is True on a key exactly when every entry of its value row is finite: a
    NaN, an infinity of either sign in any column, a row of the largest finite numbers, a
    key with no columns, over batch dims."""
    from slicedkern.backends import finite_keys
    if dtype == "bfloat16" and xp.name not in ("torch", "torch_cuda", "jax"):
        pytest.skip("no bfloat16 here")
    big = 3.3e38 if dtype != "float64" else float(np.finfo(np.float64).max)
    rows = np.array([[1.0, 2.0, 3.0], [np.nan, 0.0, 1.0], [0.0, 1.0, np.inf], [-np.inf, -big, big], [big, -big, big],
                     [-0.0, 1e-30, -5.0]])
    values = np.stack([rows, rows[::-1]])                  # (2, 6, 3): a batch dim, the bad keys moved
    got = xp.to_numpy(finite_keys(xp.xp, xp.asarray(values, dtype=dtype)))
    assert got.dtype == np.bool_ and got.shape == (2, 6)
    np.testing.assert_array_equal(got, np.all(np.isfinite(values), axis=-1))
    empty = xp.to_numpy(finite_keys(xp.xp, xp.asarray(np.zeros((2, 4, 0)), dtype=dtype)))
    np.testing.assert_array_equal(empty, np.ones((2, 4), dtype=bool))


# ------------------------------------------------ issue 49 item 8: one rule for every profile parameter
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_mixture_weights_must_be_finite(xp, rng, bad):
    """NaN and infinite weights were accepted (NaN output) where NaN bandwidths raise."""
    q, k, v = (xp.asarray(a) for a in qkv(rng))
    with raises(ValueError, "weights", match="finite"):
        slicedkern.hat_mixture_attention(q, k, v, [1.0, 2.0], [1.0, bad])
    weights = np.ones((H, 2))
    weights[1, 0] = bad
    with raises(ValueError, "weights", match="finite"):
        slicedkern.hat_mixture_attention(q, k, v, xp.asarray(np.ones((H, 2))), xp.asarray(weights))
    with raises(ValueError, "weights", match="finite"):
        slicedkern.hat_mixture_attention(q, k, v, xp.asarray(np.ones((H, 2))), [1.0, bad])


def test_an_empty_mixture_is_refused_everywhere(xp, rng):
    """``hat_mixture_attention(q, k, v, [], [])`` gave zeros, an array mixture of no hat an
    IndexError, ``DecodeCache`` a TypeError: one answer, a ValueError, as the layers refuse
    ``mixture_size=0`` (tests/test_decode.py checks the cache)."""
    q, k, v = (xp.asarray(a) for a in qkv(rng))
    with raises(ValueError, "bandwidths", match="at least one hat"):
        slicedkern.hat_mixture_attention(q, k, v, [], [])
    empty = xp.asarray(np.ones((H, 0)))
    with raises(ValueError, "bandwidths", match="at least one hat"):
        slicedkern.hat_mixture_attention(q, k, v, empty, empty)
    with raises(ValueError, "bandwidths", match="at least one hat"):
        slicedkern.kernel_attention(q, k, v, HatMixture([], []))


# ----------------------------------------- issue 49 item 9: Python scalars where arrays are expected
def _scalar_calls(xp, rng):
    """(call, the argument it names) for a Python scalar in each array argument of the ops."""
    from slicedkern.sliced import energy_distance, mmd, sliced_attention, sliced_kernel_sum
    q, k, v = (xp.asarray(a) for a in qkv(rng))
    x, y = xp.asarray(rng.normal(size=(4, 2))), xp.asarray(rng.normal(size=(5, 2)))
    theta = xp.asarray(np.array([[0.6, 0.8]]))
    return [
        (lambda: slicedkern.relu_attention(q, k, v, key_mask=True), "key_mask"),
        (lambda: slicedkern.hat_attention(q, k, v, key_mask=False), "key_mask"),
        (lambda: slicedkern.kernel_sum(q, k, 1.0, ReLU()), "w"),
        (lambda: slicedkern.DecodeCache("relu").append(k, v, key_mask=True), "key_mask"),
        (lambda: energy_distance(x, y, directions=theta, x_weights=1.0), "x_weights"),
        (lambda: energy_distance(x, y, directions=theta, y_weights=2), "y_weights"),
        (lambda: sliced_kernel_sum(x, y, 1.0, ReLU(), directions=theta), "w"),
        (lambda: sliced_kernel_sum(x, 0.5, xp.asarray(np.ones(5)), ReLU(), directions=theta), "y"),
        (lambda: sliced_attention(x, y, xp.asarray(np.ones((5, 1))), ReLU(), directions=theta, key_mask=True),
         "key_mask"),
        (lambda: mmd(x, 1.0, Hat(1.0), directions=theta), "y"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_a_python_scalar_for_an_array_names_the_argument(xp, rng, case):
    """These ended in internal AttributeErrors ('bool' object has no attribute 'dtype'); a list was
    already a TypeError naming the argument, and a scalar is refused the same way (not broadcast)."""
    call, name = _scalar_calls(xp, rng)[case]
    with pytest.raises(TypeError, match=f"argument '{name}' must be an array.*got (bool|float|int)"):
        call()


def test_several_bandwidths_for_one_hat_point_to_the_mixture(xp, rng):
    """``hat_attention(q, k, v, [0.5, 1.0])`` complained about 'weights', which it has no argument for."""
    q, k, v = (xp.asarray(a) for a in qkv(rng))
    with pytest.raises(TypeError, match="argument 'bandwidth' must be a number or an array.*hat_mixture_attention"):
        slicedkern.hat_attention(q, k, v, [0.5, 1.0])
    with pytest.raises(TypeError, match="argument 'bandwidths' must be a sequence of numbers or an array"):
        slicedkern.hat_mixture_attention(q, k, v, 0.5, [1.0])
