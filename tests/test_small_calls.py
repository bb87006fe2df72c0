"""What the per-call fixed cost of small calls is cut with keeps the answers (issue 14, small calls).

Small calls share what does not depend on the values: the argument setup of NumPy calls (by names,
types and dtypes), the sweep's profile rows of the built-in kernels (by the parameters' float64
bits and the number of rows), and arrays that have the batch shape already are not re-broadcast.
These tests check that a shared answer is the one a fresh computation gives, and that errors are
raised every time (nothing is remembered from a failed call). Speed itself is a benchmark
(``scripts/sweep_backward_speed.py --small``), not a test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import slicedkern
from slicedkern import _validate, reference
from slicedkern._spec import Normalizer


@pytest.fixture
def rng():
    return np.random.default_rng(14)


def test_setup_memo_follows_the_dtypes(rng):
    q, k, v = rng.normal(size=(2, 5)), rng.normal(size=(2, 6)), rng.normal(size=(2, 6, 3))
    for dq, dv in [(np.float32, np.float32), (np.float64, np.float32), (np.float32, np.float64),
                   (np.float16, np.float16), (np.float32, np.float32)]:
        out = slicedkern.relu_attention(q.astype(dq), k.astype(dq), v.astype(dv))
        assert out.dtype == np.result_type(dq, dv)
        want = reference.relu_attention(q.astype(dq).astype(np.float64), k.astype(dq).astype(np.float64),
                                        v.astype(dv).astype(np.float64))
        np.testing.assert_allclose(out.astype(np.float64), want, rtol=2e-2 if dq == np.float16 else 1e-4,
                                   atol=2e-2 if dq == np.float16 else 1e-5)


def test_setup_memo_keeps_no_error(rng):
    q, v = rng.normal(size=(2, 5)), rng.normal(size=(2, 5, 3))
    for _ in range(2):          # the second call fails exactly as the first: nothing was kept
        with pytest.raises(TypeError, match="argument 'k' must have a real floating dtype"):
            slicedkern.relu_attention(q, np.ones((2, 5), np.int64), v)
    masked = np.ma.masked_array(q, mask=np.zeros_like(q, bool))
    for _ in range(2):
        with pytest.raises(TypeError, match="argument 'q' is a NumPy masked array"):
            slicedkern.relu_attention(masked, q, v)
    assert slicedkern.relu_attention(q, q, v).shape == (2, 5, 3)


def test_setup_answer_is_the_unmemoised_one(rng):
    named = {"q": rng.normal(size=(3, 4)).astype(np.float32), "k": rng.normal(size=(3, 4)),
             "v": rng.normal(size=(3, 4, 2)).astype(np.float32), "key_mask": None}
    first = _validate.setup(named, None, required=("q", "k", "v"))
    again = _validate.setup(named, None, required=("q", "k", "v"))
    fresh = _validate._setup(named, None, ("q", "k", "v"), False)
    assert first == again == fresh
    assert _validate._memo_key({"q": np.float64(1.0)}, None, (), False) is None     # not an ndarray
    assert _validate._memo_key({"q": np.zeros(())}, None, (), False) is None         # 0-d: no memo


def test_setup_answer_for_torch_is_the_unmemoised_one(rng):
    """Plain CPU tensors are memoised by type, dtype and device; subclasses (parameters, tracers)
    and 0-d tensors (which promote like scalars) are not."""
    torch = pytest.importorskip("torch")
    named = {"q": torch.zeros(3, 4, dtype=torch.float32), "k": torch.zeros(3, 4, dtype=torch.float64),
             "v": torch.zeros(3, 4, 2, dtype=torch.float32), "key_mask": torch.ones(3, 4, dtype=torch.bool)}
    first = _validate.setup(named, None, required=("q", "k", "v"))
    assert first == _validate.setup(named, None, required=("q", "k", "v"))
    assert first == _validate._setup(named, None, ("q", "k", "v"), False)
    assert _validate._memo_key({"q": torch.nn.Parameter(torch.zeros(2))}, None, (), False) is None
    assert _validate._memo_key({"q": torch.zeros(())}, None, (), False) is None
    for _ in range(2):          # a bad dtype raises every time: nothing was kept
        with pytest.raises(TypeError, match="argument 'k' must have a real floating dtype"):
            _validate.setup({**named, "k": torch.zeros(3, 4, dtype=torch.int64)}, None, required=("q", "k", "v"))


def test_broadcast_all_keeps_arrays_of_the_batch_shape(rng):
    xp = _validate.namespace_of({"a": np.zeros(1)})
    a, b = rng.normal(size=(2, 3, 4)), rng.normal(size=(3, 4))
    batch, out = _validate.broadcast_all(xp, {"a": a, "b": b}, {"a": 1, "b": 1}, ("a", "b"))
    assert batch == (2, 3)
    assert out["a"] is a
    assert out["b"].shape == (2, 3, 4) and np.shares_memory(out["b"], b)
    with pytest.raises(ValueError, match="do not broadcast"):
        _validate.broadcast_all(xp, {"a": a, "b": np.zeros((4, 4))}, {"a": 1, "b": 1}, ("a", "b"))


numba = pytest.importorskip("numba")
import _sweep_calls as sweep  # noqa: E402

from slicedkern.engines.sweep import _convert  # noqa: E402


def test_profile_memo_is_exact_and_read_only():
    def rows(*params, batch=(3,)):
        return _convert.profile_rows(sweep.profile(*params), batch, math.prod(batch))

    memo, n_user = rows((0.0, 1.5), (1.0, -2.0), 0.25, -1.0)
    fresh, n_fresh = rows(tuple(np.array([0.0, 1.5])), tuple(np.array([1.0, -2.0])), 0.25, -1.0)
    assert n_user == n_fresh == 2
    for a, b in zip(memo, fresh):
        np.testing.assert_array_equal(a, b)
        assert not a.flags.writeable
    assert rows((0.0, 1.5), (1.0, -2.0), 0.25, -1.0)[0][0] is memo[0]
    # -0.0 and 0.0 are different keys (their signs reach the kernels); ints are their floats
    key = _convert._fixed_key
    assert key((-0.0,), (1.0,), 0.0, 0.0, 3) != key((0.0,), (1.0,), 0.0, 0.0, 3)
    assert key((0,), (1,), 0, 0, 3) == key((0.0,), (1.0,), 0.0, 0.0, 3)
    assert np.signbit(rows((-0.0,), (1.0,), 0.0, 0.0, batch=(1,))[0][0][0, 0])
    assert key((10 ** 400,), (1.0,), 0.0, 0.0, 3) is None
    assert key((np.float64(0.0),), (1.0,), 0.0, 0.0, 3) is None           # only Python numbers
    assert key((0.0,), (1.0,), 0.0, 0.0, _convert.MEMO_ROWS + 1) is None
    for _ in range(2):          # errors are raised every time, not remembered
        with pytest.raises(ValueError, match="argument 'knots' must be finite"):
            rows((float("inf"),), (1.0,), 0.0, 0.0)


@pytest.mark.parametrize("normalizer", ["abs", "relu", "count", None])
def test_sweep_profile_matches_the_plain_path(normalizer):
    norm = Normalizer(normalizer)
    memo = _convert.sweep_profile(sweep.profile((-0.5, 0.5), (1.0, -1.0)), (4,), 4, norm)
    fresh = sweep.profile(tuple(np.array([-0.5, 0.5])), tuple(np.array([1.0, -1.0])))
    plain = _convert.with_zero_knot(_convert.profile_rows(fresh, (4,), 4)[0], norm)
    assert memo[1] == plain[1] and memo[2] == 2
    for a, b in zip(memo[0], plain[0]):
        np.testing.assert_array_equal(a, b)


def test_shared_work_space_leaves_results_alone(rng):
    q, k, v = rng.normal(size=(2, 5)), rng.normal(size=(2, 7)), rng.normal(size=(2, 7, 3))
    first = sweep.attention(q, k, v, None)
    out, residuals = sweep.attention(q, k, v, None, keep=True)      # keep writes its own arrays
    again = sweep.attention(q, k, v, None)
    np.testing.assert_array_equal(first, out)
    np.testing.assert_array_equal(first, again)
    assert residuals and all(not np.shares_memory(r, a) for r in residuals for a in sweep.NOT_SAVED[:4])
    np.testing.assert_allclose(first, reference.relu_attention(q, k, v), rtol=1e-10, atol=1e-12)
