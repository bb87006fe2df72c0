"""Regression tests for the wrong answers and crashes that fuzzing found (one test per finding).

Each test states the finding it guards; all of them failed before the fix they name.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import slicedkern
from slicedkern import reference
from slicedkern.kernels import HatMixture, ReLU

ENGINES = ["scan", "sweep"]


# ------------------------------------------------------------- 1. values narrower than the scores
@pytest.mark.parametrize("engine", ENGINES)
def test_values_narrower_than_scores_compute_in_the_promoted_dtype(engine):
    q, k = np.array([0.1]), np.array([0.3, -0.2])
    v = np.array([[0.1], [0.7]], np.float32)
    out = slicedkern.relu_attention(q, k, v, engine=engine)
    expected = reference.relu_attention(q, k, v.astype(np.float64))
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, expected, rtol=1e-15)
    assert abs(out[0, 0] - 0.17999999597668648) < 1e-16


@pytest.mark.parametrize("engine", ENGINES)
def test_half_values_with_float32_scores_do_not_overflow(engine):
    q, k = np.array([1000.0], np.float32), np.array([0.0], np.float32)
    v = np.array([[100.0]], np.float16)
    out = slicedkern.relu_attention(q, k, v, normalize=None, center=False, engine=engine)
    assert out.dtype == np.float32
    assert out[0, 0] == np.float32(1e5)


def test_torch_float32_values_with_float64_scores():
    torch = pytest.importorskip("torch")
    q, k = torch.tensor([0.1], dtype=torch.float64), torch.tensor([0.3, -0.2], dtype=torch.float64)
    v = torch.tensor([[0.1], [0.7]], dtype=torch.float32)
    for engine in ENGINES:
        out = slicedkern.relu_attention(q, k, v, engine=engine)
        assert out.dtype == torch.float64
        assert abs(float(out[0, 0]) - 0.17999999597668648) < 1e-16


# -------------------------------------------------- 2. NumPy vjp of unbatched parameter arrays
@pytest.mark.parametrize("engine", ENGINES)
def test_numpy_vjp_of_a_zero_dim_bandwidth(engine):
    q, k, v = np.array([[0.0, 0.5]]), np.array([[0.2, 0.9, -0.3]]), np.array([[[1.0], [2.0], [-1.0]]])
    out, pullback = slicedkern.vjp(slicedkern.hat_attention, q, k, v, np.array(1.0), engine=engine)
    grads = pullback(np.ones_like(out))
    assert grads[3].shape == ()
    np.testing.assert_allclose(grads[3], 2.0 / 3.0, rtol=1e-12)


@pytest.mark.parametrize("engine", ENGINES)
def test_numpy_vjp_of_one_dim_mixture_parameters(engine):
    q, k, v = np.array([[0.0, 0.5]]), np.array([[0.2, 0.9, -0.3]]), np.array([[[1.0], [2.0], [-1.0]]])
    bw, w = np.array([0.5, 1.2]), np.array([1.0, -0.7])
    out, pullback = slicedkern.vjp(slicedkern.hat_mixture_attention, q, k, v, bw, w, engine=engine)
    _, _, _, dbw, dw = pullback(np.ones_like(out))

    def loss(bw_, w_):
        return float(np.sum(reference.hat_mixture_attention(q, k, v, list(bw_), list(w_))))

    h = 1e-6
    fd_bw = [(loss(bw + h * e, w) - loss(bw - h * e, w)) / (2 * h) for e in np.eye(2)]
    fd_w = [(loss(bw, w + h * e) - loss(bw, w - h * e)) / (2 * h) for e in np.eye(2)]
    np.testing.assert_allclose(dbw, fd_bw, rtol=1e-6)
    np.testing.assert_allclose(dw, fd_w, rtol=1e-6)


# ---------------------------------------------------------- 3. JAX ties at a zero threshold
def test_jax_tie_at_zero_follows_the_right_derivative_rule():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from _helpers import jax_x64
    with jax_x64(True):
        def self_sum(z):
            return jnp.sum(slicedkern.kernel_sum(z, z, jnp.ones_like(z), ReLU()))

        grad = jax.grad(self_sum)(jnp.asarray([0.0, 1.0, 3.0]))
        np.testing.assert_allclose(np.asarray(grad), [-2.0, 0.0, 2.0])

        def key_loss(y):
            return jnp.sum(slicedkern.kernel_sum(jnp.zeros(1), y, jnp.ones(1), ReLU()))

        assert float(jax.grad(key_loss)(jnp.zeros(1))[0]) == -1.0


# -------------------------------------------------------------------------- 4. threads
def test_threads_do_not_see_each_others_engine():
    x = np.zeros(3)
    wrong = []
    barrier = threading.Barrier(4)

    def work(name):
        with slicedkern.use_engine(name):
            barrier.wait()
            for _ in range(200):
                if slicedkern.engine_for(x) != name:
                    wrong.append(name)

    threads = [threading.Thread(target=work, args=(n,)) for n in ("scan", "sweep", "scan", "sweep")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_concurrent_vjp_calls_keep_their_own_records(rng):
    cases = [(rng.normal(size=(1, 4)), rng.normal(size=(1, 5)), rng.normal(size=(1, 5, 2))) for _ in range(4)]
    expected = []
    for q, k, v in cases:
        out, pull = slicedkern.vjp(slicedkern.relu_attention, q, k, v)
        expected.append(pull(np.ones_like(out)))
    errors = []
    barrier = threading.Barrier(4)

    def work(i):
        q, k, v = cases[i]
        barrier.wait()
        try:
            for _ in range(50):
                out, pull = slicedkern.vjp(slicedkern.relu_attention, q, k, v)
                for got, want in zip(pull(np.ones_like(out)), expected[i]):
                    if not np.array_equal(got, want):
                        errors.append(i)
        except Exception as exc:          # noqa: BLE001 - any exception in a thread is the failure
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# ------------------------------------------------------------------------------- 5. eps = 0
@pytest.mark.parametrize("eps", [0, 0.0, -1e-6, float("inf"), True])
def test_eps_must_be_positive(eps):
    q, k, v = np.zeros((1, 1)), np.zeros((1, 1)), np.full((1, 1, 1), 2.0)
    with pytest.raises(ValueError, match="'eps'"):
        slicedkern.hat_attention(q, k, v, 1.0, normalize="abs", eps=eps)


# ---------------------------------------------------- 6. double-float range (JAX without x64)
@pytest.mark.parametrize("engine", ["scan", "sweep"])
def test_double_float_handles_large_and_tiny_values(engine):
    pytest.importorskip("jax")
    import jax.numpy as jnp
    from _helpers import jax_x64

    from slicedkern.kernels import Hat
    if engine == "sweep":
        pytest.importorskip("numba")
    with jax_x64(False):
        q, k = jnp.asarray([0.5], jnp.float32), jnp.asarray([0.0, 0.25], jnp.float32)
        v = jnp.asarray([[5e34], [2.5e34]], jnp.float32)
        out = slicedkern.kernel_sum(q, k, v, ReLU(), engine=engine)
        np.testing.assert_allclose(np.asarray(out), [[0.5 * 5e34 + 0.25 * 2.5e34]], rtol=1e-6)
        x = jnp.asarray([1e-20, 3e-20], jnp.float32)
        y = jnp.asarray([0.0, 2e-20, 2.5e-20], jnp.float32)
        w = jnp.asarray([1e-20, 2e-20, 3e-20], jnp.float32)
        got = np.asarray(slicedkern.kernel_sum(x, y, w, Hat(1e-20), engine=engine))
    # The scan's double-float arithmetic holds the bandwidth in float32 (JAX without x64 has no
    # float64); the sweep sums in float64 on the host and keeps the bandwidth as given. Either way
    # the answer is the exact one for the bandwidth the engine holds: x[0] sits exactly on the
    # float32 hat's edge (0) and a hair inside the float64 one.
    bandwidth = float(np.float32(1e-20)) if engine == "scan" else 1e-20
    expected = reference.kernel_sum(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                    np.asarray(w, np.float64), Hat(bandwidth))
    np.testing.assert_allclose(got, expected, rtol=1e-6)


# ------------------------------------------------------------- 7. finite inputs, NaN outputs
@pytest.mark.parametrize("engine", ENGINES)
def test_fully_masked_row_with_tiny_eps_and_bandwidth_is_zero(engine):
    q, k, v = np.array([[0.0, 1.0]]), np.array([[0.5, 0.2]]), np.ones((1, 2, 3))
    mask = np.zeros((1, 2), bool)
    out = slicedkern.hat_attention(q, k, v, 1e-300, key_mask=mask, normalize="abs", eps=1e-300,
                                   engine=engine)
    assert np.all(out == 0.0)


# -------------------------------------------------------------------- 8. torch.compile
@pytest.mark.parametrize("dynamic", [False, pytest.param(True, marks=pytest.mark.exhaustive)])
@pytest.mark.parametrize("op", ["relu", "hat", "hat_array"])
def test_torch_compile_fullgraph_with_gradients(op, dynamic):
    torch = pytest.importorskip("torch")
    import warnings
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(2, 6, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    bw = torch.tensor([0.7, 1.3], dtype=torch.float64, requires_grad=True)
    fn = {"relu": lambda q_, k_, v_, b_: slicedkern.relu_attention(q_, k_, v_),
          "hat": lambda q_, k_, v_, b_: slicedkern.hat_attention(q_, k_, v_, 0.8),
          "hat_array": lambda q_, k_, v_, b_: slicedkern.hat_attention(q_, k_, v_, b_)}[op]

    def loss(q_, k_, v_, b_):
        return (fn(q_, k_, v_, b_) ** 2).sum()

    inputs = (q, k, v, bw)
    expected = torch.autograd.grad(loss(*inputs), inputs, allow_unused=True)
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="eager", dynamic=dynamic)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.autograd.grad(compiled(*inputs), inputs, allow_unused=True)
    for a, b in zip(expected, got):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(b, a)


# ------------------------------------------------------------------------- 9. jax.jit
def test_jax_jit_with_a_closed_over_concrete_bandwidth():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from _helpers import jax_x64
    with jax_x64(True):
        bw = jnp.asarray([0.5, 2.0])
        q, k, v = jnp.zeros((2, 3)), jnp.ones((2, 4)) * 0.25, jnp.ones((2, 4, 1))
        out = jax.jit(lambda a, b, c: slicedkern.hat_attention(a, b, c, bw))(q, k, v)
        expected = reference.hat_attention(np.zeros((2, 3)), np.full((2, 4), 0.25), np.ones((2, 4, 1)),
                                           np.array([0.5, 2.0]))
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-12)
        negative = -bw                        # concrete, closed over: checked on the host
        with pytest.raises(ValueError, match="'bandwidth'"):
            jax.jit(lambda a, b, c: slicedkern.hat_attention(a, b, c, negative))(q, k, v)


def test_jax_jit_with_an_invalid_traced_bandwidth_gives_nan_rows():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from _helpers import jax_x64
    with jax_x64(True):
        q, k, v = jnp.zeros((2, 3)), jnp.ones((2, 4)) * 0.25, jnp.ones((2, 4, 1))
        out = jax.jit(lambda b: slicedkern.hat_attention(q, k, v, b))(jnp.asarray([-1.0, 2.0]))
        out = np.asarray(out)
    assert np.all(np.isnan(out[0])) and np.all(np.isfinite(out[1]))


# ---------------------------------------------------------------------- 10. unclear errors
@pytest.mark.parametrize("bad", [1.0, None, [0.5, 0.2]])
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_non_array_scores_or_values_name_the_argument(bad, name):
    args = {"q": np.zeros((1, 2)), "k": np.zeros((1, 3)), "v": np.zeros((1, 3, 1))}
    args[name] = bad
    with pytest.raises(TypeError, match=f"'{name}'"):
        slicedkern.relu_attention(args["q"], args["k"], args["v"])


def test_explicit_numpy_namespace_with_torch_tensors_names_the_argument():
    torch = pytest.importorskip("torch")
    q, k, v = torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1, 3, 1)
    with pytest.raises(TypeError, match="'q'.*xp="):
        slicedkern.relu_attention(q, k, v, xp=np)


def test_center_must_be_a_boolean():
    q, k, v = np.zeros((1, 2)), np.zeros((1, 3)), np.zeros((1, 3, 1))
    with pytest.raises(TypeError, match="'center'"):
        slicedkern.relu_attention(q, k, v, center="no")


def test_numpy_masked_arrays_are_rejected():
    q, k = np.zeros((1, 2)), np.ma.masked_array(np.zeros((1, 3)), mask=[[True, False, False]])
    with pytest.raises(TypeError, match="'k'.*masked"):
        slicedkern.relu_attention(q, k, np.zeros((1, 3, 1)))


# ---------------------------------------------------- 11. bandwidth gradient at exact ties
@pytest.mark.parametrize("engine", ENGINES)
def test_bandwidth_gradient_at_ties_is_the_right_derivative(engine):
    # |q - k| = b exactly for a key on each side of the query: both hat edges sit on a key
    q, k = np.array([[0.0, 0.25]]), np.array([[-0.5, 0.5, 0.125]])
    v = np.array([[[1.0], [2.0], [-1.0]]])
    b = np.array(0.5)
    out, pullback = slicedkern.vjp(slicedkern.hat_attention, q, k, v, b, engine=engine)
    db = pullback(np.ones_like(out))[3]

    def loss(bw):
        return float(np.sum(reference.hat_attention(q, k, v, bw)))

    h = 1e-7
    right = (loss(0.5 + h) - loss(0.5)) / h
    left = (loss(0.5) - loss(0.5 - h)) / h
    assert abs(right - left) > 0.1                 # the tie is a real kink
    np.testing.assert_allclose(db, right, rtol=1e-5)


@pytest.mark.parametrize("engine", ENGINES)
def test_mixture_weight_gradient_matches_a_fixed_kernel(engine):
    q, k, v = np.array([[0.1, -0.4]]), np.array([[0.3, -0.2, 0.9]]), np.array([[[1.0], [0.5], [2.0]]])
    out_a = slicedkern.hat_mixture_attention(q, k, v, [0.5, 1.5], [1.0, 2.0], engine=engine)
    out_b = slicedkern.kernel_attention(q, k, v, HatMixture([0.5, 1.5], [1.0, 2.0]), engine=engine)
    np.testing.assert_allclose(out_a, out_b, rtol=1e-13)


# ------------------------------------------------ fuzz suite (tests/fuzz): gradients, empty axes
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("shapes", [((2, 0), (2, 3)), ((2, 3), (2, 0)), ((0,), (0,))], ids=["Lq0", "Lk0", "both0"])
def test_gradients_without_queries_or_keys_are_zeros(engine, shapes):
    # the scan's backward (and the sweep's bandwidth gradient, which borrows it) sorted and searched
    # empty axes: "cannot reshape array of size 0", "operands could not be broadcast"
    q_shape, k_shape = shapes
    q, k, v = np.ones(q_shape), np.ones(k_shape), np.ones(k_shape + (2,))
    b = np.full(q_shape[:-1], 0.5)
    out, pullback = slicedkern.vjp(slicedkern.hat_attention, q, k, v, b, engine=engine)
    grads = pullback(np.ones_like(out))
    for grad, arg in zip(grads, (q, k, v, b)):
        assert grad.shape == arg.shape and not np.any(grad)
    out, pullback = slicedkern.vjp(slicedkern.kernel_sum, q, k, v, ReLU(), engine=engine)
    assert [g.shape for g in pullback(np.ones_like(out))[:3]] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("engine", ENGINES)
def test_torch_gradients_without_keys(engine):
    torch = pytest.importorskip("torch")
    q = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    k = torch.ones(2, 0, dtype=torch.float64, requires_grad=True)
    v = torch.ones(2, 0, 1, dtype=torch.float64, requires_grad=True)
    b = torch.full((2,), 0.5, dtype=torch.float64, requires_grad=True)
    slicedkern.hat_attention(q, k, v, b, engine=engine).sum().backward()
    assert all(t.grad is not None and not torch.any(t.grad) for t in (q, b))


def test_numpy_gradient_of_a_zero_dim_parameter_is_an_array():
    # a reduction over every axis gives a NumPy scalar (np.float64), not the 0-d array passed in
    q, k, v = np.array([[0.0, 0.5]]), np.array([[0.2, 0.9, -0.3]]), np.array([[[1.0], [2.0], [-1.0]]])
    out, pullback = slicedkern.vjp(slicedkern.hat_attention, q, k, v, np.array(1.0))
    grad = pullback(np.ones_like(out))[3]
    assert type(grad) is np.ndarray and grad.shape == ()


@pytest.mark.parametrize("shapes", [((0,), (0,)), ((2, 3), (2, 0)), ((2, 0), (2, 3))], ids=["both0", "Lk0", "Lq0"])
def test_torch_masked_attention_without_queries_or_keys_is_differentiable(shapes):
    # the scan's forward handed the key mask back as its own residual: "An input that has been
    # returned as-is as output is being saved for backward"
    torch = pytest.importorskip("torch")
    q = torch.zeros(shapes[0], dtype=torch.float64, requires_grad=True)
    k = torch.zeros(shapes[1], dtype=torch.float64, requires_grad=True)
    v = torch.ones(shapes[1] + (2,), dtype=torch.float64, requires_grad=True)
    mask = torch.ones(shapes[1], dtype=torch.bool)
    slicedkern.relu_attention(q, k, v, key_mask=mask, normalize="abs", engine="scan").sum().backward()
    assert q.grad.shape == q.shape and not torch.any(q.grad)
