"""The same float64 inputs give the same values on every pair of backends; backends without float64
(JAX with x64 off, array_api_strict's "no_float64" device) stay close to the float64 result."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import C, M, N, assert_meta, assert_values_close, backend_context, jax_x64, require_selected

import slicedkern
from slicedkern import reference
from slicedkern.kernels import Abs, Hat, HatMixture, PiecewiseLinear, ReLU

B, H, LQ, LK, DV = 2, 3, N, M, C
GENERAL = PiecewiseLinear((-0.75, 0.0, 0.5, 1.25), (1.5, -2.0, 0.75, 0.5), slope=-0.5, intercept=0.25)
BW = np.array([0.3, 1.0, 2.5])
MIX_BW = np.array([[0.2, 1.0], [0.5, 1.5], [1.0, 3.0]])
MIX_W = np.array([[1.0, -0.5], [2.0, 0.25], [0.5, 0.5]])


def ops(be, mask):
    """name -> function of backend arrays (q or x, k or y, v or w)."""
    m = be.asarray(mask)
    return {
        "kernel_sum_relu": lambda a, b, c: slicedkern.kernel_sum(a, b, c, ReLU()),
        "kernel_sum_abs": lambda a, b, c: slicedkern.kernel_sum(a, b, c, Abs()),
        "kernel_sum_hat": lambda a, b, c: slicedkern.kernel_sum(a, b, c, Hat(0.4)),
        "kernel_sum_general": lambda a, b, c: slicedkern.kernel_sum(a, b, c, GENERAL),
        "relu_attention": lambda a, b, c: slicedkern.relu_attention(a, b, c, key_mask=m),
        "relu_attention_relu": lambda a, b, c: slicedkern.relu_attention(a, b, c, normalize="relu",
                                                                         center=False),
        "hat_attention": lambda a, b, c: slicedkern.hat_attention(a, b, c, 0.6, key_mask=m),
        "hat_attention_per_head": lambda a, b, c: slicedkern.hat_attention(a, b, c, be.asarray(BW),
                                                                           normalize="abs"),
        "hat_mixture_lists": lambda a, b, c: slicedkern.hat_mixture_attention(a, b, c, [0.3, 1.2],
                                                                              [1.0, -0.5], key_mask=m),
        "hat_mixture_arrays": lambda a, b, c: slicedkern.hat_mixture_attention(
            a, b, c, be.asarray(MIX_BW), be.asarray(MIX_W)),
        "kernel_attention": lambda a, b, c: slicedkern.kernel_attention(a, b, c, GENERAL, key_mask=m,
                                                                        center=True, normalize=None),
    }


OPS = ["kernel_sum_relu", "kernel_sum_abs", "kernel_sum_hat", "kernel_sum_general", "relu_attention",
       "relu_attention_relu", "hat_attention", "hat_attention_per_head", "hat_mixture_lists",
       "hat_mixture_arrays", "kernel_attention"]


def problem(rng, ties=False):
    q = rng.normal(size=(B, H, LQ))
    k = rng.normal(size=(B, H, LK))
    if ties:
        q = np.round(q * 4) / 4
        k = np.round(k * 4) / 4
        q[..., :5] = k[..., :5]
    v = rng.normal(size=(B, H, LK, DV))
    mask = rng.random((B, H, LK)) < 0.7
    mask[-1, -1] = False
    return q, k, v, mask


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_backends_agree(xp_pair, rng, ties):
    first, second = xp_pair
    q, k, v, mask = problem(rng, ties)
    ops1, ops2 = ops(first, mask), ops(second, mask)
    assert set(ops1) == set(OPS)
    for name in OPS:
        a = ops1[name](first.asarray(q), first.asarray(k), first.asarray(v))
        b = ops2[name](second.asarray(q), second.asarray(k), second.asarray(v))
        assert_meta(a, backend=first, shape=b.shape, dtype=first.dtype("float64"))
        assert_meta(b, backend=second, dtype=second.dtype("float64"))
        assert_values_close(a, second.to_numpy(b), rtol=1e-12, err_msg=f"({name})")


def test_every_backend_agrees_with_numpy_reference(xp, rng):
    """Also each backend alone against the dense NumPy reference (works with one backend selected)."""
    q, k, v, mask = problem(rng)
    fast = ops(xp, mask)
    expected = {
        "kernel_sum_hat": reference.kernel_sum(q, k, v, Hat(0.4)),
        "relu_attention": reference.relu_attention(q, k, v, key_mask=mask),
        "hat_attention_per_head": reference.hat_attention(q, k, v, BW, normalize="abs"),
        "hat_mixture_arrays": reference.hat_mixture_attention(q, k, v, MIX_BW, MIX_W),
    }
    for name, e in expected.items():
        out = fast[name](xp.asarray(q), xp.asarray(k), xp.asarray(v))
        assert_values_close(out, e, rtol=1e-10, err_msg=f"({name})")


# ------------------------------------------------------------------------ backends without float64
@pytest.fixture
def no_float64(request):
    """A backend whose float64 is unavailable: JAX with x64 off, or array_api_strict's "no_float64"."""
    name = request.param
    require_selected(request.config, name)
    if name == "jax":
        pytest.importorskip("jax")
        import jax.numpy as jnp
        with jax_x64(False):
            yield "jax", lambda a: jnp.asarray(np.asarray(a, dtype=np.float32)), jnp
    else:
        xs = pytest.importorskip("array_api_strict")
        dev = xs.Device("no_float64")
        yield "array_api_strict", lambda a: xs.asarray(np.asarray(a, dtype=np.float32), device=dev), xs


NARROW = HatMixture([0.02, 1.0], [1.0, -0.5])     # a hat of width 0.02 on N(0, 1) scores, and a wide one
FLOAT32_CASES = {
    "kernel_sum_narrow_hats": (lambda a, b, c: slicedkern.kernel_sum(a, b, c, NARROW),
                               lambda a, b, c: reference.kernel_sum(a, b, c, NARROW)),
    "relu_attention": (lambda a, b, c: slicedkern.relu_attention(a, b, c),
                       lambda a, b, c: reference.relu_attention(a, b, c)),
    "hat_attention_narrow": (lambda a, b, c: slicedkern.hat_attention(a, b, c, 0.05),
                             lambda a, b, c: reference.hat_attention(a, b, c, 0.05)),
}
_JITTED: dict = {}


def _fast(name, case):
    """The op of ``case``; on JAX through ``jax.jit`` (one compile, cached across the test's runs:
    eager JAX compiles each of its many small ops instead, which takes longer)."""
    fast = FLOAT32_CASES[case][0]
    if name != "jax":
        return fast
    import jax
    if case not in _JITTED:
        _JITTED[case] = jax.jit(fast)
    return _JITTED[case]


@pytest.mark.parametrize("no_float64", ["jax", "array_api_strict"], indirect=True)
@pytest.mark.parametrize("offset", [0.0, 100.0])
def test_float32_without_float64_is_accurate(no_float64, rng, offset):
    """float32 in, float32 out, within 1e-5 (relative, normwise and to the data's magnitude) of the
    float64 result on the same (float32-rounded) inputs: narrow hats at 200 keys included, where
    plain float32 prefix sums lose about 1e-4 (docs/mathematics.rst, "Numerics": compensated
    accumulation without float64)."""
    name, to_backend, ns = no_float64
    n = m = 200
    q = (offset + rng.normal(size=(2, n))).astype(np.float32)
    k = (offset + rng.normal(size=(2, m))).astype(np.float32)
    v = rng.normal(size=(2, m, 2)).astype(np.float32)
    exact64 = [a.astype(np.float64) for a in (q, k, v)]
    if name == "jax":
        import jax
        assert not jax.config.jax_enable_x64
    for case, (_, ref) in FLOAT32_CASES.items():
        out = _fast(name, case)(to_backend(q), to_backend(k), to_backend(v))
        assert out.dtype == ns.float32, f"{case}: {out.dtype}"
        expected = ref(*exact64)
        values = np.asarray(out) if name == "jax" else np.from_dlpack(out)
        assert_values_close(values, expected, rtol=1e-5, err_msg=f"({name}, {case})")


@pytest.mark.parametrize("initial", [False, True])
def test_jax_x64_switch_is_restored(request, initial):
    """The fixtures' x64 switch for JAX restores whatever was set before, also after an error."""
    require_selected(request.config, "jax")
    jax = pytest.importorskip("jax")
    with jax_x64(initial):
        with backend_context("jax"):
            assert jax.config.jax_enable_x64
        assert jax.config.jax_enable_x64 == initial
        with pytest.raises(RuntimeError):
            with backend_context("jax"):
                raise RuntimeError
        assert jax.config.jax_enable_x64 == initial
