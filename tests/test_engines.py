"""The two engines behind one interface: selection, and scan == sweep == dense, values and gradients."""

from __future__ import annotations

import numpy as np
import pytest

import slicedkern
from slicedkern import reference
from slicedkern.kernels import Abs, Hat, HatMixture, ReLU

pytest.importorskip("numba")

OPS = [
    ("relu", lambda q, k, v, m: slicedkern.relu_attention(q, k, v, key_mask=m),
     lambda q, k, v, m: reference.relu_attention(q, k, v, key_mask=m)),
    ("relu-relu-norm", lambda q, k, v, m: slicedkern.relu_attention(q, k, v, key_mask=m, normalize="relu"),
     lambda q, k, v, m: reference.relu_attention(q, k, v, key_mask=m, normalize="relu")),
    ("hat", lambda q, k, v, m: slicedkern.hat_attention(q, k, v, 0.6, key_mask=m),
     lambda q, k, v, m: reference.hat_attention(q, k, v, 0.6, key_mask=m)),
    ("mixture-abs", lambda q, k, v, m: slicedkern.kernel_attention(
        q, k, v, HatMixture([0.25, 1.0], [1.0, -0.4]), key_mask=m, center=True, normalize="abs"),
     lambda q, k, v, m: reference.kernel_attention(
         q, k, v, HatMixture([0.25, 1.0], [1.0, -0.4]), key_mask=m, center=True, normalize="abs")),
]


def _data(rng):
    q = np.round(8 * rng.normal(size=(2, 3, 40))) / 8          # dyadic: exact ties, decided alike by both engines
    k = np.round(8 * rng.normal(size=(2, 3, 33))) / 8
    v = rng.normal(size=(2, 3, 33, 5))
    mask = rng.random((2, 3, 33)) > 0.25
    return q, k, v, mask


def test_engine_selection():
    x = np.zeros((1, 3))
    assert slicedkern.engine_for(x) == "sweep"
    with slicedkern.use_engine("scan"):
        assert slicedkern.engine_for(x) == "scan"
        with slicedkern.use_engine("sweep"):
            assert slicedkern.engine_for(x) == "sweep"
        assert slicedkern.engine_for(x) == "scan"
    with pytest.raises(ValueError, match="'name'"):
        with slicedkern.use_engine("fast"):
            pass
    import array_api_strict as xs
    assert slicedkern.engine_for(xs.asarray([1.0])) == "scan"
    with slicedkern.use_engine("sweep"), pytest.raises(ValueError, match="sweep"):
        slicedkern.relu_attention(xs.asarray([[0.0]]), xs.asarray([[1.0]]), xs.asarray([[[1.0]]]))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("name, fast, dense", OPS, ids=[o[0] for o in OPS])
def test_engines_agree_with_each_other_and_the_reference(rng, lib, name, fast, dense):
    q, k, v, mask = _data(rng)
    expected = dense(q, k, v, mask)
    if lib == "torch":
        torch = pytest.importorskip("torch")
        args = [torch.tensor(a) for a in (q, k, v, mask)]
    else:
        args = [q, k, v, mask]
    results = {}
    for engine in ("scan", "sweep"):
        with slicedkern.use_engine(engine):
            out, pullback = slicedkern.vjp(lambda a, b, c: fast(a, b, c, args[3]), *args[:3])
            grads = pullback(out * 0 + 1)
        results[engine] = [np.asarray(a) for a in (out, *grads)]
    np.testing.assert_allclose(results["scan"][0], expected, rtol=1e-10, atol=1e-12)
    # a "relu" normaliser is zero below every key and clamped at eps = 1e-6: cotangents there are
    # ~1e6, and so is the rounding of the two engines' different summation orders
    rtol = 1e-5 if name == "relu-relu-norm" else 1e-9
    for a, b in zip(results["scan"], results["sweep"]):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=rtol * 0.1 * max(1.0, float(np.abs(a).max())))


@pytest.mark.parametrize("kernel", [ReLU(), Abs(), Hat(0.5)], ids=repr)
def test_kernel_sum_engines_and_torch_autograd(rng, kernel):
    torch = pytest.importorskip("torch")
    x, y = np.round(8 * rng.normal(size=(3, 30))) / 8, np.round(8 * rng.normal(size=(3, 25))) / 8
    w = rng.normal(size=(3, 25, 2))
    grads = {}
    for engine in ("scan", "sweep"):
        t = [torch.tensor(a, requires_grad=True) for a in (x, y, w)]
        with slicedkern.use_engine(engine):
            out = slicedkern.kernel_sum(*t, kernel)
            (out ** 2).sum().backward()
        np.testing.assert_allclose(out.detach().numpy(), reference.kernel_sum(x, y, w, kernel), rtol=1e-10,
                                   atol=1e-10)
        grads[engine] = [a.grad.numpy() for a in t]
    for a, b in zip(grads["scan"], grads["sweep"]):
        np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-9)


def test_per_head_bandwidth_gradient_on_the_sweep(rng):
    q, k, v, mask = _data(rng)
    bw = rng.random(3) + 0.3
    out = {}
    for engine in ("scan", "sweep"):
        with slicedkern.use_engine(engine):
            res, pullback = slicedkern.vjp(slicedkern.hat_attention, q, k, v, bw)
            out[engine] = [res, *pullback(np.ones_like(res))]
    for a, b in zip(out["scan"], out["sweep"]):
        np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("engine", ["scan", "sweep"])
def test_tiny_eps_and_an_empty_normaliser_give_zero(engine):
    q = np.array([[-5.0, 0.5]])                 # the first query is below every key
    k, v = np.array([[0.0, 1.0]]), np.ones((1, 2, 1))
    mask = np.array([[True, True]])
    with slicedkern.use_engine(engine):
        out = slicedkern.relu_attention(q, k, v, normalize="relu", eps=1e-300, center=False, key_mask=mask)
        none = slicedkern.relu_attention(q, k, v, normalize="abs", eps=1e-300, key_mask=~mask)
    assert out[0, 0, 0] == 0.0 and out[0, 1, 0] == 1.0
    assert np.all(none == 0.0)


@pytest.mark.parametrize("engine", ["scan", "sweep"])
def test_a_nan_query_adds_nothing_to_the_key_gradients(rng, engine):
    x, y, w = rng.normal(size=(1, 6)), rng.normal(size=(1, 5)), rng.normal(size=(1, 5, 2))
    g = rng.normal(size=(1, 6, 2))
    bad = x.copy()
    bad[0, 2] = np.nan
    with slicedkern.use_engine(engine):
        _, pullback = slicedkern.vjp(slicedkern.kernel_sum, bad, y, w, Hat(0.8))
        dx, dy, dw, _ = pullback(g)
    keep = np.array([0, 1, 3, 4, 5])
    _, clean = slicedkern.vjp(slicedkern.kernel_sum, x[:, keep], y, w, Hat(0.8))
    cx, cy, cw, _ = clean(g[:, keep])
    assert np.all(np.isnan(dx[0, 2]))
    np.testing.assert_allclose(dx[:, keep], cx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dy, cy, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw, cw, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("engine", ["scan", "sweep"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_half_precision_numpy_is_computed_wider_and_returned_in_its_dtype(rng, engine, dtype):
    """The documented rule (docs/backends.rst, "Half precision"): an upcast, not a TypeError."""
    q, k, v, mask = (a.astype(dtype) if a.dtype.kind == "f" else a for a in _data(rng))
    out = slicedkern.relu_attention(q, k, v, key_mask=mask, engine=engine)
    assert out.dtype == np.dtype(dtype)
    expected = reference.relu_attention(*(a.astype(np.float64) for a in (q, k, v)), key_mask=mask)
    # the float64 answer on the same (rounded) inputs, rounded once to the dtype
    np.testing.assert_allclose(out.astype(np.float64), expected.astype(dtype).astype(np.float64),
                               rtol=2 * np.finfo(dtype).eps, atol=2 * np.finfo(dtype).eps * np.abs(expected).max())


def test_sweep_refuses_a_tensor_off_the_cpu():
    """A tensor on another device (CUDA; here the data-less "meta" device) with engine="sweep" is an
    error naming the argument, never a silent copy to the host."""
    torch = pytest.importorskip("torch")
    q, v = torch.zeros((2, 7), device="meta"), torch.zeros((2, 7, 3), device="meta")
    with pytest.raises(ValueError, match="argument 'engine': the 'sweep' engine runs on NumPy arrays and "
                                         "CPU torch tensors.*device meta"):
        slicedkern.relu_attention(q, q, v, engine="sweep")


def test_the_support_table_is_the_engines_own_answers():
    """``slicedkern.engines.support`` (rendered into docs/backends.rst) reports each engine's
    ``decline`` verbatim: the scan serves everything, the sweep NumPy (causal too), triton no NumPy."""
    import array_api_strict as xs

    from slicedkern.engines import get
    from slicedkern.engines.support import FEATURES, support

    table = support({"numpy": np.zeros(3), "strict": xs.zeros(3)})
    assert table["numpy"]["scan"] == table["strict"]["scan"] == {"attention": None, "causal": None}
    assert table["numpy"]["sweep"] == {"attention": None, "causal": None}
    assert "serves torch tensors only" in table["numpy"]["triton"]["attention"]
    backend = slicedkern.backends.backend_of(xs.zeros(3))
    assert table["strict"]["sweep"]["causal"] == get("sweep").decline(FEATURES["causal"], (xs.zeros(3),), backend)
