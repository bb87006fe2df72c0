"""Gradients: the sort-scan VJP against finite differences of the dense reference, across backends.

* ``slicedkern.vjp`` (every backend) and JAX ``jax.grad`` against central differences of
  :mod:`slicedkern.reference` in float64;
* ``torch.autograd.gradcheck`` in float64, bandwidths included;
* torch, JAX and NumPy gradients equal to each other;
* masks, exact ties (finite, one-sided), ``torch.compile(fullgraph=True)``, ``torch.func.grad``,
  ``jax.jit`` / ``jax.vmap`` round trips.
"""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import to_numpy

import slicedkern
from slicedkern import reference
from slicedkern.kernels import Abs, Hat, HatMixture, PiecewiseLinear, ReLU

OPS = {
    "relu": (slicedkern.relu_attention, reference.relu_attention, {}),
    "relu-masked-relu-norm": (slicedkern.relu_attention, reference.relu_attention,
                              {"normalize": "relu", "mask": True}),
    "relu-uncentred-none": (slicedkern.relu_attention, reference.relu_attention,
                            {"center": False, "normalize": None, "mask": True}),
    "hat": (slicedkern.hat_attention, reference.hat_attention, {"bandwidth": 0.7, "mask": True}),
    "hat-abs": (slicedkern.hat_attention, reference.hat_attention, {"bandwidth": 1.3, "normalize": "abs"}),
    "hat-centred": (slicedkern.hat_attention, reference.hat_attention,
                    {"bandwidth": 0.9, "center": True, "mask": True}),
    "kernel-mixture-centred": (slicedkern.kernel_attention, reference.kernel_attention,
                               {"kernel": HatMixture([0.4, 1.5], [1.0, -0.5]), "center": True,
                                "mask": True}),
    "kernel-abs": (slicedkern.kernel_attention, reference.kernel_attention,
                   {"kernel": Abs(), "normalize": "relu"}),
}


def _call(fn, q, k, v, opts, mask):
    opts = dict(opts)
    opts.pop("mask", None)
    if "kernel" in opts:
        kernel = opts.pop("kernel")
        return fn(q, k, v, kernel, key_mask=mask, **opts)
    if "bandwidth" in opts:
        return fn(q, k, v, opts.pop("bandwidth"), key_mask=mask, **opts)
    return fn(q, k, v, key_mask=mask, **opts)


def _data(rng, b=2, lq=6, lk=7, d=3):
    q = rng.normal(size=(b, lq))
    k = rng.normal(size=(b, lk))
    v = rng.normal(size=(b, lk, d))
    mask = rng.random((b, lk)) > 0.3
    mask[:, 0] = True
    g = rng.normal(size=(b, lq, d))
    return q, k, v, mask, g


def _finite_differences(loss, arrays, eps=1e-6):
    grads = []
    for i, a in enumerate(arrays):
        grad = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            plus = [x.copy() for x in arrays]
            minus = [x.copy() for x in arrays]
            plus[i][idx] += eps
            minus[i][idx] -= eps
            grad[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        grads.append(grad)
    return grads


@pytest.mark.parametrize("case", list(OPS))
def test_vjp_matches_finite_differences(xp, rng, case):
    fast, dense, opts = OPS[case]
    q, k, v, mask, g = _data(rng)
    mask_np = mask if opts.get("mask") else None

    def loss(q_, k_, v_):
        return float(np.sum(_call(dense, q_, k_, v_, opts, mask_np) * g))

    expected = _finite_differences(loss, [q, k, v])
    args = [xp.asarray(a) for a in (q, k, v)]
    mask_b = xp.asarray(mask) if mask_np is not None else None
    out, pullback = slicedkern.vjp(lambda q_, k_, v_: _call(fast, q_, k_, v_, opts, mask_b), *args)
    grads = pullback(xp.asarray(g))
    assert len(grads) == 3
    for name, got, want, arg in zip("qkv", grads, expected, args):
        assert type(got) is type(arg) and tuple(got.shape) == tuple(arg.shape) and got.dtype == arg.dtype
        # central differences: scale atol with the gradient (near-empty ReLU normalisers are steep)
        np.testing.assert_allclose(to_numpy(got), want, rtol=1e-5, atol=1e-6 * np.abs(want).max(),
                                   err_msg=f"d{name}")


@pytest.mark.parametrize("kernel", [ReLU(), Abs(), Hat(0.6), HatMixture([0.3, 1.2], [2.0, -1.0]),
                                    PiecewiseLinear((-0.4, 0.3), (1.5, -0.5), slope=0.2, intercept=0.7)],
                         ids=repr)
def test_kernel_sum_vjp(xp, rng, kernel):
    x, y = rng.normal(size=(2, 5)), rng.normal(size=(2, 6))
    w, g = rng.normal(size=(2, 6)), rng.normal(size=(2, 5))
    expected = _finite_differences(lambda *a: float(np.sum(reference.kernel_sum(*a, kernel) * g)), [x, y, w])
    out, pullback = slicedkern.vjp(slicedkern.kernel_sum, *(xp.asarray(a) for a in (x, y, w)), kernel)
    grads = pullback(xp.asarray(g))
    assert grads[3] is None                                   # the kernel is not an array
    for got, want in zip(grads[:3], expected):
        np.testing.assert_allclose(to_numpy(got), want, rtol=1e-6, atol=1e-7)


def test_vjp_bandwidth_gradients(xp, rng):
    q, k, v, mask, g = _data(rng, b=3)
    bw = rng.random(3) + 0.4
    mix_b, mix_w = rng.random((3, 2)) + 0.3, rng.normal(size=(3, 2))
    for fast, dense, extra in [
        (slicedkern.hat_attention, reference.hat_attention, (bw,)),
        (slicedkern.hat_mixture_attention, reference.hat_mixture_attention, (mix_b, mix_w)),
    ]:
        expected = _finite_differences(lambda *a: float(np.sum(dense(q, k, v, *a) * g)), list(extra))
        _, pullback = slicedkern.vjp(fast, *(xp.asarray(a) for a in (q, k, v) + extra))
        grads = pullback(xp.asarray(g))
        for got, want in zip(grads[3:], expected):
            np.testing.assert_allclose(to_numpy(got), want, rtol=1e-6, atol=1e-7)


def test_vjp_rejects_wrong_cotangent_and_composites(rng):
    q, k, v, _, g = _data(rng)
    out, pullback = slicedkern.vjp(slicedkern.relu_attention, q, k, v)
    with pytest.raises(ValueError, match="cotangent"):
        pullback(g[..., :2])
    with pytest.raises(TypeError, match="vjp"):
        slicedkern.vjp(lambda a: a * 2, q)


def test_ties_give_finite_one_sided_gradients(rng):
    # every query sits exactly on a key and on a hat knot: derivatives are one-sided (right)
    k = np.array([[-1.0, -0.5, 0.0, 0.0, 0.5, 1.0]])
    q = np.array([[-0.5, 0.0, 0.5, 1.0, 1.5]])
    v = rng.normal(size=(1, 6, 2))
    g = rng.normal(size=(1, 5, 2))
    _, pullback = slicedkern.vjp(slicedkern.hat_attention, q, k, v, 0.5)
    dq, dk, dv, _ = pullback(g)
    assert all(np.all(np.isfinite(a)) for a in (dq, dk, dv))
    h = 1e-7

    def loss(q_, k_):
        return float(np.sum(reference.hat_attention(q_, k_, v, 0.5) * g))
    for i in range(q.shape[-1]):
        step = np.zeros_like(q)
        step[0, i] = h
        right = (loss(q + step, k) - loss(q, k)) / h
        assert dq[0, i] == pytest.approx(right, rel=1e-5, abs=1e-5)
    for j in range(k.shape[-1]):
        step = np.zeros_like(k)
        step[0, j] = h
        # keys: the left derivative (docs/mathematics.rst, "The backward pass")
        left = (loss(q, k) - loss(q, k - step)) / h
        assert dk[0, j] == pytest.approx(left, rel=1e-5, abs=1e-5)


# ------------------------------------------------------------------------------------------ torch
def test_torch_gradcheck_float64(rng):
    torch = pytest.importorskip("torch")
    q, k, v, mask, _ = _data(rng, b=2, lq=4, lk=5, d=2)
    bw = rng.random(2) + 0.5
    t = [torch.tensor(a, requires_grad=True) for a in (q, k, v, bw)]
    tmask = torch.tensor(mask)
    assert torch.autograd.gradcheck(lambda q_, k_, v_: slicedkern.relu_attention(q_, k_, v_, key_mask=tmask),
                                    t[:3])
    assert torch.autograd.gradcheck(lambda *a: slicedkern.hat_attention(*a, key_mask=tmask), t)
    wts = torch.tensor(rng.normal(size=(2, 2)), requires_grad=True)
    bws = torch.tensor(rng.random((2, 2)) + 0.5, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q_, b_, w_: slicedkern.hat_mixture_attention(q_, t[1], t[2], b_, w_),
                                    (t[0], bws, wts))
    x = torch.tensor(rng.normal(size=(2, 4)), requires_grad=True)
    assert torch.autograd.gradcheck(lambda x_, w_: slicedkern.kernel_sum(x_, t[1], w_, Hat(0.8)),
                                    (x, torch.tensor(rng.normal(size=(2, 5, 2)), requires_grad=True)))


def test_torch_needs_input_grad_and_float32(rng):
    torch = pytest.importorskip("torch")
    q, k, v, _, g = _data(rng)
    tq = torch.tensor(q, dtype=torch.float32, requires_grad=True)
    tk = torch.tensor(k, dtype=torch.float32)
    tv = torch.tensor(v, dtype=torch.float32)
    out = slicedkern.relu_attention(tq, tk, tv)
    assert out.dtype == torch.float32 and out.requires_grad
    (out * torch.tensor(g, dtype=torch.float32)).sum().backward()
    assert tq.grad.dtype == torch.float32 and tk.grad is None
    _, pullback = slicedkern.vjp(slicedkern.relu_attention, q, k, v)
    np.testing.assert_allclose(tq.grad.numpy(), pullback(g)[0], rtol=1e-4, atol=1e-5)


def test_torch_compile_and_func(rng):
    torch = pytest.importorskip("torch")
    q, k, v, _, _ = _data(rng)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))

    def loss(q_, k_, v_):
        return (slicedkern.relu_attention(q_, k_, v_) ** 2).sum()

    expected = torch.autograd.grad(loss(tq, tk, tv), (tq, tk, tv))
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="eager")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # dynamo's notes about lru_cache in array_api_compat
        got = torch.autograd.grad(compiled(tq, tk, tv), (tq, tk, tv))
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b)
    grad_q = torch.func.grad(lambda q_: loss(q_, tk.detach(), tv.detach()))(tq.detach())
    torch.testing.assert_close(grad_q, expected[0])


# -------------------------------------------------------------------------------------------- jax
def test_jax_grad_jit_vmap_match_numpy(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from _helpers import jax_x64
    q, k, v, mask, g = _data(rng)
    bw = rng.random(2) + 0.4
    with jax_x64(True):
        def loss(q_, k_, v_, b_):
            return jnp.sum(slicedkern.hat_attention(q_, k_, v_, b_, key_mask=jnp.asarray(mask)) * g)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*(jnp.asarray(a) for a in (q, k, v, bw)))
        _, pullback = slicedkern.vjp(slicedkern.hat_attention, q, k, v, bw, key_mask=mask)
        for got, want in zip(grads, pullback(g)):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-10, atol=1e-12)
        batched = jax.vmap(lambda q_, k_, v_: slicedkern.relu_attention(q_, k_, v_))(
            *(jnp.asarray(a) for a in (q, k, v)))
        np.testing.assert_allclose(np.asarray(batched), slicedkern.relu_attention(q, k, v), rtol=1e-12)
        vgrad = jax.vmap(jax.grad(lambda q_, k_, v_: jnp.sum(slicedkern.relu_attention(q_, k_, v_) ** 2)))(
            *(jnp.asarray(a) for a in (q, k, v)))
        _, pullback = slicedkern.vjp(slicedkern.relu_attention, q, k, v)
        out = slicedkern.relu_attention(q, k, v)
        np.testing.assert_allclose(np.asarray(vgrad), pullback(2 * out)[0], rtol=1e-10, atol=1e-12)


def test_jax_float32_grad_without_x64(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from _helpers import jax_x64
    q, k, v, _, g = _data(rng)
    with jax_x64(False):
        grads = jax.grad(lambda *a: jnp.sum(slicedkern.relu_attention(*a) * g), argnums=(0, 1, 2))(
            *(jnp.asarray(a, dtype=jnp.float32) for a in (q, k, v)))
    _, pullback = slicedkern.vjp(slicedkern.relu_attention, q, k, v)
    for got, want in zip(grads, pullback(g)):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)


def test_cross_backend_gradients(xp_pair, rng):
    first, second = xp_pair
    q, k, v, mask, g = _data(rng)
    results = []
    for b in (first, second):
        _, pullback = slicedkern.vjp(slicedkern.relu_attention, *(b.asarray(a) for a in (q, k, v)),
                                     key_mask=b.asarray(mask))
        results.append([to_numpy(a) for a in pullback(b.asarray(g))])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-13)


# ------------------------------------------------------------------------- higher order
def test_torch_second_order_is_a_clear_error(rng):
    torch = pytest.importorskip("torch")
    q, k, v, _, _ = _data(rng)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    out = slicedkern.relu_attention(tq, tk, tv).sum()
    # recording the backward's graph is allowed (torch.func.grad does it for first derivatives);
    # differentiating it is the clear error
    (grad_q,) = torch.autograd.grad(out, (tq,), create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(grad_q.sum(), (tq,))


def test_jax_second_order_is_a_clear_error(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from _helpers import jax_x64
    q, k, v, _, _ = _data(rng)
    with jax_x64(True):
        def loss(q_):
            return jnp.sum(slicedkern.relu_attention(q_, jnp.asarray(k), jnp.asarray(v)))

        with pytest.raises(TypeError, match="differentiable once"):
            jax.grad(lambda q_: jnp.sum(jax.grad(loss)(q_)))(jnp.asarray(q))
