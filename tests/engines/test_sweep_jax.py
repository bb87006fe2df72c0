"""The sweep engine on JAX arrays on the CPU, through the backend row's host callback.

The automatic rule picks the sweep for CPU JAX arrays, traced or not (docs/backends.rst, "JAX on
the CPU"); ``engine="scan"`` still forces the scan. These tests check the choice, and that values
and gradients under ``jit``, ``grad`` and ``vmap`` agree with the scan engine and with the dense
float64 reference, with ``jax_enable_x64`` on (float64 in, float64 out) and off (float32 arrays,
float64 sums inside the callback). Skipped without numba or JAX, and where JAX computes on a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")
jax = pytest.importorskip("jax")
if jax.default_backend() != "cpu":
    pytest.skip("JAX computes on an accelerator here: the scan serves it", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402

import slicedkern  # noqa: E402
from slicedkern import reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _helpers import jax_x64  # noqa: E402

B, LQ, LK, D = 2, 9, 11, 3


@pytest.fixture(params=[True, False], ids=["x64", "float32"])
def x64(request):
    """x64 on (float64 arrays) or off (JAX has no float64 then: float32 arrays)."""
    with jax_x64(request.param):
        yield request.param


def _tol(x64):
    return {"rtol": 1e-12, "atol": 1e-12} if x64 else {"rtol": 2e-5, "atol": 2e-5}


def _data(seed=0, batch=(B,)):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=batch + (LQ,)), rng.normal(size=batch + (LK,)), rng.normal(size=batch + (LK, D)))


def _jax(x64, *arrays):
    dt = jnp.float64 if x64 else jnp.float32
    return tuple(jnp.asarray(a, dtype=dt) for a in arrays)


def _hat_loss(engine):
    def loss(q, k, v, b):
        return jnp.sum(slicedkern.hat_attention(q, k, v, b, normalize="abs", engine=engine) ** 2)
    return loss


def _hat_loss_dense(q, k, v, b):
    return jnp.sum(reference.hat_attention(q, k, v, b, normalize="abs") ** 2)


def test_the_sweep_is_chosen_for_cpu_jax_arrays(x64):
    q, k, v = _jax(x64, *_data())
    assert slicedkern.engine_for(q) == "sweep"
    seen = []

    @jax.jit
    def f(q):
        seen.append(slicedkern.engine_for(q))          # runs once, at trace time
        return q

    f(q)
    assert seen == ["sweep"]
    assert "sweep" in slicedkern.engines.available("jax")
    with slicedkern.use_engine("scan"):
        assert slicedkern.engine_for(q) == "scan"
        f_scan = jax.jit(lambda q: (seen.append(slicedkern.engine_for(q)), q)[1])
        f_scan(q)
        # the context's default reaches a traced call: the jitted op is the array-API scan
        traced = str(jax.make_jaxpr(lambda a, b, c: slicedkern.relu_attention(a, b, c))(q, k, v))
    assert seen == ["sweep", "scan"]
    assert "callback" not in traced
    assert "callback" in str(jax.make_jaxpr(lambda a, b, c: slicedkern.relu_attention(a, b, c))(q, k, v))


def test_forward_matches_scan_and_reference(x64):
    q, k, v = _data(1)
    Q, K, V = _jax(x64, q, k, v)
    mask = np.random.default_rng(2).random((B, LK)) > 0.3
    M = jnp.asarray(mask)
    expected = reference.relu_attention(q, k, v, key_mask=mask)
    sweep = slicedkern.relu_attention(Q, K, V, key_mask=M)
    scan = slicedkern.relu_attention(Q, K, V, key_mask=M, engine="scan")
    jitted = jax.jit(lambda a, b, c, m: slicedkern.relu_attention(a, b, c, key_mask=m))(Q, K, V, M)
    for out in (sweep, jitted):
        assert isinstance(out, jax.Array) and out.dtype == Q.dtype and out.shape == (B, LQ, D)
        np.testing.assert_allclose(np.asarray(out), expected, **_tol(x64))
        np.testing.assert_allclose(np.asarray(out), np.asarray(scan), **_tol(x64))
    mixture = slicedkern.kernel_sum(Q, K, V, slicedkern.kernels.HatMixture([0.5, 1.0], [1.0, -0.3]))
    ks_expected = reference.kernel_sum(q, k, v, slicedkern.kernels.HatMixture([0.5, 1.0], [1.0, -0.3]))
    assert mixture.dtype == Q.dtype
    np.testing.assert_allclose(np.asarray(mixture), ks_expected, **_tol(x64))


def test_jit_grad_of_hat_bandwidth_matches_scan_and_reference(x64):
    q, k, v = _data(3)
    Q, K, V = _jax(x64, q, k, v)
    b = _jax(x64, np.array([0.6, 0.9]))[0]
    grad = jax.jit(jax.grad(_hat_loss(None), argnums=(0, 1, 2, 3)))
    scan = jax.jit(jax.grad(_hat_loss("scan"), argnums=(0, 1, 2, 3)))(Q, K, V, b)
    with jax_x64(True):
        dense = jax.grad(_hat_loss_dense, argnums=(0, 1, 2, 3))(*(jnp.asarray(a, jnp.float64)
                                                                 for a in (q, k, v, np.array([0.6, 0.9]))))
    for got, via_scan, exact, like in zip(grad(Q, K, V, b), scan, dense, (Q, K, V, b)):
        assert got.dtype == like.dtype and got.shape == like.shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(via_scan), **_tol(x64))
        np.testing.assert_allclose(np.asarray(got), np.asarray(exact), **_tol(x64))


def test_value_and_grad_of_relu_matches_scan(x64):
    Q, K, V = _jax(x64, *_data(4))

    def loss(engine):
        return lambda q, k, v: jnp.sum(jnp.sin(slicedkern.relu_attention(q, k, v, engine=engine)))

    got = jax.jit(jax.value_and_grad(loss(None), argnums=(0, 1, 2)))(Q, K, V)
    want = jax.jit(jax.value_and_grad(loss("scan"), argnums=(0, 1, 2)))(Q, K, V)
    np.testing.assert_allclose(float(got[0]), float(want[0]), **_tol(x64))
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **_tol(x64))


def test_vmap_over_a_batch_of_qkv(x64):
    q, k, v = _data(5, batch=(4, B))
    Q, K, V = _jax(x64, q, k, v)
    f = jax.jit(jax.vmap(lambda a, b, c: slicedkern.relu_attention(a, b, c)))
    np.testing.assert_allclose(np.asarray(f(Q, K, V)), reference.relu_attention(q, k, v), **_tol(x64))
    # and the gradient of a vmapped loss: the backward's callback is vmapped too
    g = jax.grad(lambda a, b, c: jnp.sum(jax.vmap(slicedkern.relu_attention)(a, b, c) ** 2), argnums=(0, 1, 2))
    g_scan = jax.grad(lambda a, b, c: jnp.sum(jax.vmap(
        lambda x, y, z: slicedkern.relu_attention(x, y, z, engine="scan"))(a, b, c) ** 2), argnums=(0, 1, 2))
    for a, b in zip(g(Q, K, V), g_scan(Q, K, V)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **_tol(x64))


def test_vmap_over_bandwidths(x64):
    q, k, v = _data(6)
    Q, K, V = _jax(x64, q, k, v)
    widths = np.array([0.3, 0.7, 1.5])
    W = _jax(x64, widths)[0]
    out = jax.jit(jax.vmap(lambda b: slicedkern.hat_attention(Q, K, V, b)))(W)
    assert out.shape == (3, B, LQ, D)
    for i, b in enumerate(widths):
        np.testing.assert_allclose(np.asarray(out[i]), reference.hat_attention(q, k, v, b), **_tol(x64))
    dws = jax.vmap(jax.grad(lambda b: jnp.sum(slicedkern.hat_attention(Q, K, V, b) ** 2)))(W)
    dws_scan = jax.vmap(jax.grad(lambda b: jnp.sum(slicedkern.hat_attention(Q, K, V, b, engine="scan") ** 2)))(W)
    np.testing.assert_allclose(np.asarray(dws), np.asarray(dws_scan), **_tol(x64))


def test_second_derivative_is_refused():
    with jax_x64(True):
        Q, K, V = _jax(True, *_data(7))
        b = jnp.asarray(0.8)
        with pytest.raises(TypeError, match="differentiable once"):
            jax.grad(jax.grad(lambda s: jnp.sum(slicedkern.hat_attention(Q, K, V, s))))(b)


def test_causal_through_the_host_callback(x64):
    """Causal attention on JAX arrays takes the sweep through the host callback, under jit and grad,
    forward and backward (the fused one, and the generic one where a key is not finite), equal to
    the dense reference and to the scan's causal mode."""
    q, k, v = _data(8)
    Q, K, V = _jax(x64, q, k, v)
    causal_relu = jax.make_jaxpr(lambda a, b_, c: slicedkern.relu_attention(a, b_, c, causal=True))(Q, K, V)
    assert "callback" in str(causal_relu)
    out = jax.jit(lambda a, b, c: slicedkern.relu_attention(a, b, c, causal=True))(Q, K, V)
    np.testing.assert_allclose(np.asarray(out), reference.relu_attention(q, k, v, causal=True), **_tol(x64))
    b = _jax(x64, np.array([0.6, 0.9]))[0]

    def loss(engine):
        return jax.jit(jax.grad(lambda a, b_, c, bw: jnp.sum(jnp.sin(slicedkern.hat_attention(
            a, b_, c, bw, causal=True, center=True, normalize="abs", engine=engine))), argnums=(0, 1, 2, 3)))

    got, want = loss("sweep")(Q, K, V, b), loss("scan")(Q, K, V, b)
    for a, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), **_tol(x64))
    K_bad = K.at[0, 3].set(jnp.nan)
    got, want = loss("sweep")(Q, K_bad, V, b), loss("scan")(Q, K_bad, V, b)
    for a, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(np.asarray(a)), np.isnan(np.asarray(w)))
        np.testing.assert_allclose(np.nan_to_num(np.asarray(a)), np.nan_to_num(np.asarray(w)), **_tol(x64))


def test_gpu_arrays_are_declined_in_words():
    """A JAX array that does not live on the CPU is not host-callable (checked on the backend row)."""
    from slicedkern.backends import backend_of
    row = backend_of(jnp.zeros(1))
    assert row.host_callable(jnp.zeros(1))

    class Elsewhere:                        # what a GPU array reports
        platform = "gpu"

    class FakeArray:
        def devices(self):
            return {Elsewhere()}

    assert not row.host_callable(FakeArray())
