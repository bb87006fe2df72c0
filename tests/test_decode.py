"""``slicedkern.DecodeCache`` against the dense causal reference, on every backend."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import assert_close, assert_meta, to_numpy

import slicedkern
from slicedkern import reference
from slicedkern.kernels import PiecewiseLinear

GENERAL = PiecewiseLinear((-0.75, 0.0, 0.5), (1.5, -2.0, 0.75), slope=-0.5, intercept=0.25)

#: (op, options, dense reference (q, k, v, causal) -> out)
CASES = {
    "relu": ("relu", {}, lambda q, k, v, c: reference.relu_attention(q, k, v, causal=c)),
    "relu-relu-uncentred": ("relu", {"normalize": "relu", "center": False},
                            lambda q, k, v, c: reference.relu_attention(q, k, v, normalize="relu", center=False,
                                                                        causal=c)),
    "hat": ("hat", {"bandwidth": 0.7}, lambda q, k, v, c: reference.hat_attention(q, k, v, 0.7, causal=c)),
    "hat-centred": ("hat", {"bandwidth": 0.7, "center": True},
                    lambda q, k, v, c: reference.hat_attention(q, k, v, 0.7, center=True, causal=c)),
    "mixture-abs": ("hat_mixture", {"bandwidths": [0.5, 1.5], "weights": [1.0, -0.3], "normalize": "abs"},
                    lambda q, k, v, c: reference.hat_mixture_attention(q, k, v, [0.5, 1.5], [1.0, -0.3],
                                                                       normalize="abs", causal=c)),
    "kernel-centred-none": (GENERAL, {"center": True, "normalize": None},
                            lambda q, k, v, c: reference.kernel_attention(q, k, v, GENERAL, center=True,
                                                                          normalize=None, causal=c)),
}


def _data(rng, n, ties=False):
    q, k = rng.normal(size=(2, 3, n)), rng.normal(size=(2, 3, n))
    if ties:
        q, k = np.round(q * 2) / 2, np.round(k * 2) / 2
    return q, k, rng.normal(size=(2, 3, n, 4)) + 0.5


@pytest.mark.parametrize("ties", [False, True], ids=["plain", "ties"])
@pytest.mark.parametrize("case", list(CASES))
def test_token_by_token_matches_the_causal_op(xp, rng, case, ties):
    op, options, dense = CASES[case]
    n = 37
    q, k, v = _data(rng, n, ties)
    cache = slicedkern.DecodeCache(op, **options)
    rows = []
    for t in range(n):
        cache.append(xp.asarray(k[..., t:t + 1]), xp.asarray(v[..., t:t + 1, :]))
        query = xp.asarray(q[..., t:t + 1])
        out = cache.attend(query)
        assert_meta(out, like=query, shape=(2, 3, 1, 4))
        rows.append(to_numpy(out))
    assert len(cache) == n
    expected = to_numpy(dense(q, k, v, True))
    assert_close(np.concatenate(rows, axis=-2), expected, rtol=1e-10, atol=1e-10 * np.abs(expected).max())


@pytest.mark.parametrize("case", ["relu", "mixture-abs"])
def test_chunks_and_blocks_of_queries(xp, rng, case):
    """Appends of several keys; a block of queries sees every key appended so far."""
    op, options, dense = CASES[case]
    q, k, v = _data(rng, 40)
    cache = slicedkern.DecodeCache(op, **options)
    start = 0
    for step in [1, 3, 0, 1, 8, 2, 13, 1, 11]:
        cache.append(xp.asarray(k[..., start:start + step]), xp.asarray(v[..., start:start + step, :]))
        start += step
        block = q[..., :5]
        got = to_numpy(cache.attend(xp.asarray(block)))
        expected = to_numpy(dense(block, k[..., :start], v[..., :start, :], False))
        assert_close(got, expected, rtol=1e-10, atol=1e-10 * max(np.abs(expected).max(), 1.0))


def test_use_engine_chooses_the_runs(rng):
    """Decoding is chosen through the engine registry: under ``use_engine("scan")`` the cache keeps
    the array-API runs (not the sweep's compiled ones) and answers as the causal op does; an engine
    that cannot hold the keys is refused by name."""
    from slicedkern.engines import decoder
    q, k, v = _data(rng, 12)
    expected = to_numpy(reference.relu_attention(q, k, v, causal=True))[..., -1:, :]
    for name in ("auto", "scan"):
        with slicedkern.use_engine(name):
            cache = slicedkern.DecodeCache("relu")
            cache.append(k, v)
            assert_close(to_numpy(cache.attend(q[..., -1:])), expected, rtol=1e-10, atol=1e-10)
        assert cache._runs.compiled is (name == "auto" and "sweep" in slicedkern.engines.available("numpy"))
    assert decoder(k).name == ("sweep" if "sweep" in slicedkern.engines.available("numpy") else "scan")
    if slicedkern.engines.get("triton").installed():
        with slicedkern.use_engine("triton"):
            with pytest.raises(ValueError, match="'triton' engine of slicedkern.use_engine cannot decode these keys: "
                                                 "the 'triton' engine serves torch tensors only"):
                slicedkern.DecodeCache("relu").append(k, v)


def test_empty_cache_and_no_key_yet(rng):
    cache = slicedkern.DecodeCache("hat", bandwidth=1.0)
    with pytest.raises(ValueError, match="'q'"):
        cache.attend(np.zeros((2, 1)))
    cache.append(np.zeros((2, 0)), np.zeros((2, 0, 3)))
    np.testing.assert_array_equal(cache.attend(np.zeros((2, 4))), np.zeros((2, 4, 3)))


def test_non_finite_key_poisons_later_queries_only(rng):
    q, k, v = _data(rng, 9)
    k[0, 1, 4] = np.nan
    cache = slicedkern.DecodeCache("relu")
    rows = []
    for t in range(9):
        cache.append(k[..., t:t + 1], v[..., t:t + 1, :])
        rows.append(cache.attend(q[..., t:t + 1]))
    out = np.concatenate(rows, axis=-2)
    expected = slicedkern.relu_attention(q, k, v, causal=True)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    assert np.isnan(out[0, 1, 4:]).all() and np.isfinite(out[0, 1, :4]).all()
    np.testing.assert_allclose(out[~np.isnan(out)], expected[~np.isnan(expected)], rtol=1e-10, atol=1e-12)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="'op'"):
        slicedkern.DecodeCache("softmax")
    with pytest.raises(TypeError, match="bandwidth"):
        slicedkern.DecodeCache("relu", bandwidth=1.0)
    with pytest.raises(ValueError, match="'bandwidth'"):
        slicedkern.DecodeCache("hat", bandwidth=-1.0)
    with pytest.raises(ValueError, match="'bandwidths'"):
        slicedkern.DecodeCache("hat_mixture", bandwidths=[1.0, float("inf")], weights=[1.0, 1.0])
    with pytest.raises(TypeError, match="'bandwidth'"):
        slicedkern.DecodeCache("hat", bandwidth=[1.0, 2.0])
    with pytest.raises(ValueError, match="'weights'"):       # as the ops say it
        slicedkern.DecodeCache("hat_mixture", bandwidths=[1.0, 2.0], weights=[1.0])
    with pytest.raises(ValueError, match="'normalize'"):
        slicedkern.DecodeCache("relu", normalize="max")
    with pytest.raises(TypeError, match="'center'"):
        slicedkern.DecodeCache("relu", center="yes")
    cache = slicedkern.DecodeCache("relu")
    cache.append(np.zeros((2, 1)), np.zeros((2, 1, 3)))
    with pytest.raises(ValueError, match="'k' and 'v'"):
        cache.append(np.zeros((3, 1)), np.zeros((3, 1, 3)))
    with pytest.raises(ValueError, match="'k' and 'v'"):
        cache.append(np.zeros((2, 2)), np.zeros((2, 1, 3)))
    with pytest.raises(ValueError, match="'q'"):
        cache.attend(np.zeros((3, 1)))


@pytest.mark.parametrize("op", ["hat", "hat_mixture"])
def test_per_head_parameter_arrays(xp, rng, op):
    """Bandwidths (and mixture weights) given as arrays, one per head of a (B, H) batch, as the layers
    learn them: token by token equal to the causal op with the same arrays."""
    n = 21
    q, k, v = _data(rng, n)
    if op == "hat":
        params = {"bandwidth": np.array([0.3, 1.0, 2.5])}
        args = (params["bandwidth"],)
    else:
        params = {"bandwidths": rng.uniform(0.3, 2.0, size=(3, 2)), "weights": rng.normal(size=(3, 2))}
        args = (params["bandwidths"], params["weights"])
    cache = slicedkern.DecodeCache(op, center=True, **{name: xp.asarray(p) for name, p in params.items()})
    rows = []
    for t in range(n):
        cache.append(xp.asarray(k[..., t:t + 1]), xp.asarray(v[..., t:t + 1, :]))
        rows.append(to_numpy(cache.attend(xp.asarray(q[..., t:t + 1]))))
    dense = reference.hat_attention if op == "hat" else reference.hat_mixture_attention
    expected = dense(q, k, v, *args, center=True, causal=True)
    assert_close(np.concatenate(rows, axis=-2), expected, rtol=1e-10, atol=1e-10 * np.abs(expected).max())


def test_per_head_parameters_are_checked_against_the_batch():
    cache = slicedkern.DecodeCache("hat", bandwidth=np.array([0.5, 1.0]))       # 2 heads, 3 given below
    with pytest.raises(ValueError, match="'bandwidth'"):
        cache.append(np.zeros((2, 3, 1)), np.zeros((2, 3, 1, 4)))
    cache = slicedkern.DecodeCache("hat", bandwidth=np.array([0.5, -1.0, 1.0]))
    with pytest.raises(ValueError, match="'bandwidth'"):
        cache.append(np.zeros((2, 3, 1)), np.zeros((2, 3, 1, 4)))


def test_a_key_mask_that_does_not_broadcast_names_itself(xp):
    """On every backend (torch's own broadcast raises RuntimeError): a ValueError naming the mask."""
    cache = slicedkern.DecodeCache("relu")
    with pytest.raises(ValueError, match="'key_mask'"):
        cache.append(xp.asarray(np.zeros((2, 3, 1))), xp.asarray(np.zeros((2, 3, 1, 4))),
                     key_mask=xp.asarray(np.ones((2, 4, 1), dtype=bool)))


def test_repeated_tokens_skip_no_check_that_could_fail():
    """The per-token shortcut (calls with the signatures of the last checked ones) still refuses
    what the checks refuse, and still carries the gradient refusal once a key records a gradient."""
    rng = np.random.default_rng(3)
    cache = slicedkern.DecodeCache("relu")
    for _ in range(3):                       # the same signature: the shortcut is taken from the second
        cache.append(rng.normal(size=(2, 1)), rng.normal(size=(2, 1, 3)))
        cache.attend(rng.normal(size=(2, 1)))
    with pytest.raises(ValueError, match="'k' and 'v'"):
        cache.append(np.zeros((3, 1)), np.zeros((3, 1, 3)))
    with pytest.raises(ValueError, match="'k' and 'v'"):
        cache.append(np.zeros((2, 1)), np.zeros((2, 1, 4)))
    with pytest.raises(ValueError, match="'q'"):
        cache.attend(np.zeros((3, 1)))
    with pytest.raises(TypeError, match="'k'"):
        cache.append(np.zeros((2, 1), np.int64), np.zeros((2, 1, 3)))
    q, k, v = rng.normal(size=(2, 4)), rng.normal(size=(2, 4)), rng.normal(size=(2, 4, 3))
    cache = slicedkern.DecodeCache("relu")
    rows = []
    for t in range(4):
        cache.append(k[:, t:t + 1], v[:, t:t + 1])
        rows.append(cache.attend(q[:, t:t + 1]))
    assert_close(np.concatenate(rows, axis=1), reference.relu_attention(q, k, v, causal=True), rtol=1e-12)

    torch = pytest.importorskip("torch")
    cache = slicedkern.DecodeCache("relu")
    for _ in range(3):
        cache.append(torch.randn(1, 1), torch.randn(1, 1, 2))
        cache.attend(torch.randn(1, 1))
    cache.append(torch.randn(1, 1, requires_grad=True), torch.randn(1, 1, 2))
    out = cache.attend(torch.randn(1, 1))          # the same q signature as before: the guard must still hold
    with pytest.raises(RuntimeError, match="DecodeCache is inference-only"):
        out.sum().backward()


# --------------------------------------------------------------------------- issue 49, items 8 to 10
def test_mixture_parameters_follow_the_ops_rule():
    """An empty mixture was a TypeError here and zeros from hat_mixture_attention; NaN weights were
    accepted. One rule now, the ops' (tests/test_edge_cases.py)."""
    with pytest.raises(ValueError, match="'bandwidths' must hold at least one hat"):
        slicedkern.DecodeCache("hat_mixture", bandwidths=[], weights=[])
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="'weights' must be finite"):
            slicedkern.DecodeCache("hat_mixture", bandwidths=[1.0, 2.0], weights=[1.0, bad])
    cache = slicedkern.DecodeCache("hat_mixture", bandwidths=[1.0], weights=np.array([np.nan]))
    with pytest.raises(ValueError, match="'weights' must be finite"):
        cache.append(np.zeros((1, 1)), np.zeros((1, 1, 2)))


def test_a_scalar_key_mask_names_the_argument(rng):
    q, k, v = _data(rng, 3)
    cache = slicedkern.DecodeCache("relu")
    with pytest.raises(TypeError, match="argument 'key_mask' must be an array.*got bool"):
        cache.append(k, v, key_mask=True)
    assert len(cache) == 0
    cache.append(k, v, key_mask=np.ones(k.shape, dtype=bool))
    np.testing.assert_allclose(cache.attend(q[..., 2:]), reference.relu_attention(q, k, v, causal=True)[..., 2:, :],
                               rtol=1e-12, atol=1e-14)


def test_the_docstrings_say_what_the_cache_does(rng):
    """The class said "No key mask" (append takes one); attend said "Zero where no key has been
    appended" (it raises before the first append, which gives the value width Dv)."""
    assert "No key mask" not in slicedkern.DecodeCache.__doc__
    assert "key_mask" in slicedkern.DecodeCache.__doc__
    assert "ValueError" in slicedkern.DecodeCache.attend.__doc__
    # what the docstrings now say: a raise before any append, zeros after appends of no key, and a
    # masked key (padding) that counts nowhere
    cache = slicedkern.DecodeCache("hat", bandwidth=1.0)
    with pytest.raises(ValueError, match="'q'"):
        cache.attend(np.zeros((2, 1)))
    cache.append(np.zeros((2, 0)), np.zeros((2, 0, 3)))
    np.testing.assert_array_equal(cache.attend(np.zeros((2, 1))), np.zeros((2, 1, 3)))
    q, k, v = rng.normal(size=(1, 4)), rng.normal(size=(1, 4)), rng.normal(size=(1, 4, 2))
    mask = np.array([[False, True, True, True]])
    cache = slicedkern.DecodeCache("hat", bandwidth=1.0)
    cache.append(k, v, key_mask=mask)
    expected = reference.hat_attention(q, k, v, 1.0, key_mask=mask, causal=True)[..., 3:, :]
    np.testing.assert_allclose(cache.attend(q[..., 3:]), expected, rtol=1e-12, atol=1e-14)
