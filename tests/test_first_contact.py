"""Regression tests for issue 23: what a new user and fuzzing found (each failed on the main it was
filed against; the item numbers are the issue's).

Items 1 (collection without torch / JAX) and 14 (``is_causal``) are guarded here and in
``tests/test_architecture.py``; the rest are silent wrong answers and rejected valid input.
"""

from __future__ import annotations

import numpy as np
import pytest

import slicedkern
from slicedkern import reference

ENGINES = ["scan", "sweep"]


def _finite_differences(fn, args, index, eps=1e-6):
    """Central differences of ``sum(fn(*args))`` with respect to ``args[index]`` (float64)."""
    grad = np.zeros_like(args[index])
    for idx in np.ndindex(args[index].shape):
        plus = [a.copy() for a in args]
        minus = [a.copy() for a in args]
        plus[index][idx] += eps
        minus[index][idx] -= eps
        grad[idx] = (np.sum(fn(*plus)) - np.sum(fn(*minus))) / (2 * eps)
    return grad


# ------------------------------------------------ 7. vjp matches a wrapper's arguments by identity
@pytest.mark.parametrize("engine", ENGINES)
def test_vjp_through_a_wrapper_that_swaps_q_and_k(engine):
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(1, 4)), rng.normal(size=(1, 4)), rng.normal(size=(1, 4, 1))

    def fn(q, k, v):
        return slicedkern.relu_attention(k, q, v, engine=engine)

    out, pullback = slicedkern.vjp(fn, q, k, v)
    grads = pullback(np.ones_like(out))
    for index in range(3):
        np.testing.assert_allclose(grads[index], _finite_differences(fn, [q, k, v], index), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("engine", ENGINES)
def test_vjp_through_a_wrapper_finds_the_bandwidth(engine):
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(1, 4)), rng.normal(size=(1, 5)), rng.normal(size=(1, 5, 2))
    b = np.asarray(1.3)

    def fn(q, k, v, b):
        return slicedkern.hat_attention(q, k, v, b, engine=engine)

    out, pullback = slicedkern.vjp(fn, q, k, v, b)
    grads = pullback(np.ones_like(out))
    assert grads[3] is not None and grads[3].shape == ()
    np.testing.assert_allclose(grads[3], _finite_differences(fn, [q, k, v, b], 3), rtol=1e-6)


def test_vjp_sums_the_gradients_of_an_argument_passed_twice():
    rng = np.random.default_rng(2)
    x, v = rng.normal(size=(2, 5)), rng.normal(size=(2, 5, 3))

    def fn(x, v):
        return slicedkern.relu_attention(x, x, v)

    out, pullback = slicedkern.vjp(fn, x, v)
    dx, dv = pullback(np.ones_like(out))
    np.testing.assert_allclose(dx, _finite_differences(fn, [x, v], 0), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dv, _finite_differences(fn, [x, v], 1), rtol=1e-6, atol=1e-8)


def test_vjp_refuses_an_argument_it_cannot_differentiate():
    q, k, v = np.zeros((1, 2)), np.zeros((1, 3)), np.zeros((1, 3, 1))
    with pytest.raises(TypeError, match=r"argument\(s\) \[0\] do not reach the op"):
        slicedkern.vjp(lambda q, k, v: slicedkern.relu_attention(2 * q, k, v), q, k, v)


def test_vjp_of_kernel_sum_with_reordered_arguments():
    rng = np.random.default_rng(3)
    x, y, w = rng.normal(size=4), rng.normal(size=5), rng.normal(size=5)

    def fn(w, x, y):
        return slicedkern.kernel_sum(x, y, w, slicedkern.kernels.Hat(0.7))

    out, pullback = slicedkern.vjp(fn, w, x, y)
    grads = pullback(np.ones_like(out))
    for index in range(3):
        np.testing.assert_allclose(grads[index], _finite_differences(fn, [w, x, y], index), rtol=1e-6, atol=1e-8)


# ------------------------------------------ 10. large tied scores, "relu" normaliser, gradients
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("engine", ENGINES)
def test_relu_normaliser_gradients_at_large_tied_scores(engine, causal):
    """A row whose ReLU normaliser is exactly 0 (no key below the query) pulled ``g / eps`` times the
    rounding of the prefix sums back into ``dv``: 1.7e10 where the answer is about 1 at 1e20."""
    torch = pytest.importorskip("torch")
    worst = 0.0
    for seed in (80, 100, 114, 138, 174):
        rng = np.random.default_rng(seed)
        scores = rng.integers(-9, 9, size=18).astype(float) * 1e20
        v, g = rng.normal(size=(18, 1)), rng.normal(size=(18, 1))
        out, pullback = slicedkern.vjp(lambda a, b, c: slicedkern.relu_attention(
            a, b, c, normalize="relu", causal=causal, engine=engine), scores, scores, v)
        vt = torch.tensor(v, requires_grad=True)
        dense = reference.relu_attention(torch.tensor(scores), torch.tensor(scores), vt, normalize="relu",
                                         causal=causal)
        (dense * torch.tensor(g)).sum().backward()
        worst = max(worst, float(np.abs(pullback(g)[2] - vt.grad.numpy()).max()))
    assert worst < 1e-12


# ------------------------------------------ 11. causal backward without keys, on every engine
@pytest.mark.parametrize("shapes", [((2, 3), (2, 0)), ((0,), (0,))], ids=["Lk0", "both0"])
@pytest.mark.parametrize("engine", ENGINES)
def test_causal_gradients_without_keys_are_zeros(engine, shapes):
    q, k = np.ones(shapes[0]), np.ones(shapes[1])
    v = np.ones(shapes[1] + (2,))
    out, pullback = slicedkern.vjp(lambda a, b, c: slicedkern.relu_attention(a, b, c, causal=True, engine=engine),
                                   q, k, v)
    dq, dk, dv = pullback(np.ones_like(out))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert not np.any(dq)


@pytest.mark.parametrize("engine", ENGINES)
def test_torch_causal_gradients_without_keys(engine):
    torch = pytest.importorskip("torch")
    q = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    k = torch.ones(2, 0, dtype=torch.float64, requires_grad=True)
    v = torch.ones(2, 0, 4, dtype=torch.float64, requires_grad=True)
    slicedkern.relu_attention(q, k, v, causal=True, engine=engine).sum().backward()
    assert q.grad.shape == q.shape and not q.grad.any()
    assert k.grad.shape == k.shape and v.grad.shape == v.shape


def test_jax_causal_gradients_without_keys():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def loss(q, k, v):
        return slicedkern.relu_attention(q, k, v, causal=True).sum()

    dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(jnp.ones((2, 3)), jnp.ones((2, 0)), jnp.ones((2, 0, 4)))
    assert dq.shape == (2, 3) and not np.any(np.asarray(dq))
    assert dk.shape == (2, 0) and dv.shape == (2, 0, 4)


# ------------------------------------------------------------ 12. JAX, scan engine, Dv = 0
@pytest.mark.parametrize("x64", [False, True], ids=["float32", "x64"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_jax_scan_with_no_value_columns(causal, x64):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from _helpers import jax_x64

    with jax_x64(x64):
        q, k, v = jnp.zeros((2, 3)), jnp.arange(8.0).reshape(2, 4), jnp.zeros((2, 4, 0))
        out = slicedkern.relu_attention(q, k, v, causal=causal, engine="scan")
        assert out.shape == (2, 3, 0)
        grads = jax.grad(lambda *a: slicedkern.relu_attention(*a, causal=causal, engine="scan").sum(),
                         argnums=(0, 1, 2))(q, k, v)
        assert [g.shape for g in grads] == [(2, 3), (2, 4), (2, 4, 0)]


# ------------------------------------------------------- 13. documented broadcasting accepted
@pytest.mark.parametrize("engine", ENGINES)
def test_values_shared_by_every_batch_row(engine):
    rng = np.random.default_rng(4)
    q, k, v = rng.normal(size=(3, 6)), rng.normal(size=(3, 7)), rng.normal(size=(7, 2))
    out = slicedkern.relu_attention(q, k, v, engine=engine)
    assert out.shape == (3, 6, 2)
    np.testing.assert_allclose(out, reference.relu_attention(q, k, v[None]), rtol=1e-12, atol=1e-14)


def test_mismatched_key_counts_still_name_the_arguments():
    with pytest.raises(ValueError, match="'k' and 'v' must have the same number of keys"):
        slicedkern.relu_attention(np.zeros((3, 6)), np.zeros((3, 7)), np.zeros((5, 2)))


# -------------------------------------- 15. one NaN rule for a query, whether it sees a key or not
def _nan_query_cases():
    nan = np.nan
    one = np.ones((1, 1))
    return {
        "no keys": dict(q=np.array([nan, 0.5]), k=np.zeros(0), v=np.ones((0, 1))),
        "all masked": dict(q=np.array([nan, 0.5]), k=np.array([0.0, 1.0]), v=np.ones((2, 1)),
                           key_mask=np.array([False, False])),
        "causal, before the keys": dict(q=np.array([nan, 0.5]), k=np.array([0.0]), v=one, causal=True),
        "causal, sees a key": dict(q=np.array([0.5, nan]), k=np.array([0.0]), v=one, causal=True),
    }


@pytest.mark.parametrize("op", ["relu_attention", "hat_attention"])
@pytest.mark.parametrize("case", list(_nan_query_cases()))
@pytest.mark.parametrize("engine", ENGINES)
def test_a_nan_query_gives_a_nan_row_whether_or_not_it_sees_a_key(engine, case, op):
    args = _nan_query_cases()[case]
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    out = getattr(slicedkern, op)(q, k, v, engine=engine, **args)
    expected = getattr(reference, op)(q, k, v, **args)
    bad = ~np.isfinite(q)
    assert np.isnan(out[bad]).all() and np.isnan(expected[bad]).all()
    assert np.isfinite(out[~bad]).all()
    np.testing.assert_allclose(out[~bad], expected[~bad], rtol=1e-12)


@pytest.mark.parametrize("engine", ENGINES)
def test_kernel_sum_of_a_nan_query_without_keys_is_nan(engine):
    out = slicedkern.kernel_sum(np.array([np.nan, 1.0]), np.zeros(0), np.zeros(0), slicedkern.kernels.ReLU(),
                                engine=engine)
    assert np.isnan(out[0]) and out[1] == 0.0


def test_decode_cache_of_a_nan_query_without_keys_is_nan():
    cache = slicedkern.DecodeCache("relu")
    cache.append(np.zeros((1, 0)), np.zeros((1, 0, 2)))
    out = cache.attend(np.array([[np.nan, 1.0]]))
    assert np.isnan(out[0, 0]).all() and not out[0, 1].any()


# --------------------------------------------- 9. DecodeCache never leaves gradients silently empty
def test_decode_cache_refuses_torch_backward():
    torch = pytest.importorskip("torch")
    k = torch.randn(1, 4, requires_grad=True)
    v = torch.randn(1, 4, 2, requires_grad=True)
    q = torch.randn(1, 1, requires_grad=True)
    cache = slicedkern.DecodeCache("relu")
    cache.append(k, v)
    out = cache.attend(q)
    with pytest.raises(RuntimeError, match="DecodeCache is inference-only"):
        out.sum().backward()
    with torch.no_grad():
        cache = slicedkern.DecodeCache("relu")
        cache.append(k, v)
        assert not cache.attend(q).requires_grad


def test_decode_cache_refuses_jax_grad_and_runs_under_jit():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(5)
    k, v, q = jnp.asarray(rng.normal(size=(1, 4))), jnp.asarray(rng.normal(size=(1, 4, 2))), jnp.zeros((1, 1))

    def attend(q):
        cache = slicedkern.DecodeCache("relu")
        cache.append(k, v)
        return cache.attend(q).sum()

    with pytest.raises(TypeError, match="DecodeCache is inference-only"):
        jax.grad(attend)(q)
    np.testing.assert_allclose(float(jax.jit(attend)(q)), float(attend(q)), rtol=1e-6)


# ------------------------------------------------------- 8. and 14. the torch layer's conventions
def test_rope_positions_queries_at_the_end_of_the_keys():
    torch = pytest.importorskip("torch")
    from slicedkern.nn.torch import SlicedAttention

    torch.manual_seed(0)
    attn = SlicedAttention(8, 2, rope=True, batch_first=True, dtype=torch.float64)
    x = torch.randn(1, 12, 8, dtype=torch.float64)
    full, _ = attn(x, x, x, is_causal=True)
    last, _ = attn(x[:, -1:], x, x, is_causal=True)
    torch.testing.assert_close(last[:, 0], full[:, -1], rtol=1e-12, atol=1e-12)
    tail, _ = attn(x[:, -5:], x, x, is_causal=True)
    torch.testing.assert_close(tail, full[:, -5:], rtol=1e-12, atol=1e-12)


def test_flax_rope_positions_queries_at_the_end_of_the_keys():
    jax = pytest.importorskip("jax")
    nnx = pytest.importorskip("flax.nnx")
    from _helpers import jax_x64

    from slicedkern.nn.flax import SlicedAttention
    with jax_x64(True):
        attn = SlicedAttention(8, 2, rope=True, batch_first=True, param_dtype=jax.numpy.float64,
                               rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(1), (1, 12, 8), dtype=jax.numpy.float64)
        full, _ = attn(x, x, x, is_causal=True)
        last, _ = attn(x[:, -1:], x, x, is_causal=True)
        np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(full[:, -1]), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_layer_is_causal_must_be_a_boolean(bad):
    torch = pytest.importorskip("torch")
    from slicedkern.nn.torch import SlicedAttention

    attn = SlicedAttention(8, 2, batch_first=True)
    x = torch.randn(1, 5, 8)
    with pytest.raises(TypeError, match="'is_causal' must be True or False"):
        attn(x, x, x, is_causal=bad)


def _fresh_interpreter(code: str, unset: tuple = ()):
    """Run ``code`` in a new Python process with this checkout importable (and the variables
    ``unset`` removed from its environment); the completed process."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    for name in unset:
        env.pop(name, None)
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)


# ---------------------------------------------------- 6. numba threads follow the caller's framework
def test_sweep_on_torch_tensors_uses_torchs_thread_count(monkeypatch):
    torch = pytest.importorskip("torch")
    numba = pytest.importorskip("numba")
    from slicedkern.engines import sweep

    seen = []
    bridge = sweep._bridge()
    original = bridge.attention

    def spy(*args, **kwargs):
        seen.append(numba.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(bridge, "attention", spy)
    before_torch, before_numba = torch.get_num_threads(), numba.get_num_threads()
    q, v = torch.randn(2, 64, dtype=torch.float64), torch.randn(2, 64, 3, dtype=torch.float64)
    try:
        torch.set_num_threads(1)
        slicedkern.relu_attention(q, q, v, engine="sweep")
    finally:
        torch.set_num_threads(before_torch)
    assert seen == [1]
    assert numba.get_num_threads() == before_numba          # restored for the calling thread


def test_a_fresh_process_keeps_torchs_thread_count_through_numbas_first_launch():
    """In a fresh interpreter (numba's thread pool not launched yet): ``torch.set_num_threads(1)``,
    then causal attention's forward and backward on the sweep. Numba's OpenMP pool, launched by the
    first compiled call, could set the process's OpenMP count, torch's own, back to the cores: torch
    then reported 2 threads and every later call ran numba on 2 threads beside torch's one."""
    pytest.importorskip("torch")
    pytest.importorskip("numba")
    code = (
        "import numba, torch, slicedkern\n"
        "from slicedkern.engines import sweep\n"
        "torch.set_num_threads(1)\n"
        "torch.get_num_threads()\n"      # this read is what made the launch's change stick here
        "seen = []\n"
        "bridge = sweep._bridge()\n"
        "for name in ('causal_attention', 'causal_attention_vjp'):\n"
        "    def spy(*a, _f=getattr(bridge, name), **k):\n"
        "        seen.append(numba.get_num_threads())\n"
        "        return _f(*a, **k)\n"
        "    setattr(bridge, name, spy)\n"
        "q = torch.randn(2, 256, dtype=torch.float64, requires_grad=True)\n"
        "v = torch.randn(2, 256, 4, dtype=torch.float64)\n"
        "for _ in range(2):\n"
        "    slicedkern.relu_attention(q, q, v, causal=True, engine='sweep').sum().backward()\n"
        "print('numba', seen, 'torch', torch.get_num_threads())\n")
    result = _fresh_interpreter(code, unset=("OMP_NUM_THREADS", "NUMBA_NUM_THREADS"))
    assert result.returncode == 0, result.stderr
    assert "numba [1, 1, 1, 1] torch 1" in result.stdout, result.stdout


def test_numpy_arrays_follow_omp_num_threads(monkeypatch):
    numba = pytest.importorskip("numba")
    from slicedkern.backends import compiled_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = numba.get_num_threads()
    with compiled_threads(np.zeros(3)) as threads:
        assert threads == 1 and numba.get_num_threads() == 1
    assert numba.get_num_threads() == before
    monkeypatch.delenv("OMP_NUM_THREADS")
    with compiled_threads(np.zeros(3)) as threads:
        assert threads == before


# ------------------------------------------- 5. torch.compile prints none of our lru_cache warnings
def test_torch_compile_of_the_layer_warns_nothing_about_caches():
    """A compiled model with the layer, forward and backward, in a fresh interpreter (dynamo warns
    once per process): no ``functools.lru_cache`` warning (92 lines of them before), none raised
    in slicedkern's own files."""
    pytest.importorskip("torch")
    import os
    code = (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "import torch\n"
        "from slicedkern.nn.torch import SlicedAttention\n"
        "torch.manual_seed(0)\n"
        "layer = SlicedAttention(16, 2, batch_first=True)\n"
        "step = torch.compile(lambda x: layer(x, x, x, is_causal=True)[0].sum(), backend='eager')\n"
        "x = torch.randn(2, 8, 16, requires_grad=True)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    step(x).backward()\n"
        "for w in caught:\n"
        "    print('WARNING', w.filename, str(w.message).splitlines()[0])\n"
        "print('grad', bool(torch.isfinite(x.grad).all()))\n")
    result = _fresh_interpreter(code)
    assert result.returncode == 0, result.stderr
    warned = [line for line in result.stdout.splitlines() if line.startswith("WARNING")]
    assert not [w for w in warned if "lru_cache" in w or os.sep + "slicedkern" + os.sep in w], warned
    assert "grad True" in result.stdout
