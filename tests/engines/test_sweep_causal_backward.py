"""The fused causal backward of the sweep engine (:func:`_causal_host.causal_attention_vjp`): equal to
the generic causal backward over the same engine's profile-sum pull-backs (engines/_vjp.py, which
tests/test_causal.py holds to the dense reference) on ties, masks, Lq != Lk, learned knots and every
normaliser; the calls it does not serve (non-finite input, silent rows) take the generic one."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

import _sweep_calls as sweep_calls  # noqa: E402
import array_api_compat.numpy as xp  # noqa: E402

from slicedkern._spec import Normalizer  # noqa: E402
from slicedkern.engines._base import Engine  # noqa: E402
from slicedkern.engines._vjp import Form, Inputs  # noqa: E402
from slicedkern.engines.sweep import SweepEngine, _causal_host  # noqa: E402
from slicedkern.engines.sweep import _host as bridge  # noqa: E402
from slicedkern.kernels import Profile  # noqa: E402

ENGINE = SweepEngine()
NORMALIZERS = ["abs", "relu", "count", None]
PROFILES = {
    "relu": dict(knots=(0.0,), coeffs=(1.0,)),
    "hat": dict(knots=(-0.5, 0.0, 0.5), coeffs=(2.0, -4.0, 2.0), strict_knots=(False, False, True)),
    "general": dict(knots=(0.3,), coeffs=(1.5,), slope=0.25, intercept=-0.5),
}


@pytest.fixture
def rng():
    return np.random.default_rng(20261127)


@pytest.fixture
def fused_calls(monkeypatch):
    """Records, per call of the fused backward, whether it served the call (False: it handed it back)."""
    calls = []
    real = _causal_host.causal_attention_vjp

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(bridge, "causal_attention_vjp", spy)
    return calls


def _case(rng, lq, lk, c=3, batch=(2,), ties=True, mask=False):
    q, k = rng.normal(size=batch + (lq,)), rng.normal(size=batch + (lk,))
    if ties:            # ties between queries and keys, and among keys, at the knots' distances
        q[..., :3] = np.round(q[..., :3] * 2) / 2
        k[..., :4] = np.round(k[..., :4] * 2) / 2
    v = rng.normal(size=batch + (lk, c))
    key_mask = rng.random(k.shape) > 0.3 if mask else None
    return q, k, v, key_mask


def _both(q, k, v, key_mask, profile, center, normalize, g=None, rng=None):
    """(fused, generic) gradients of one causal forward."""
    inputs, form = Inputs(q, k, v, key_mask), Form(profile, Normalizer(normalize, 1e-6), center)
    out, residuals = ENGINE.causal_attention(inputs, form, xp=xp)
    if g is None:
        g = rng.normal(size=out.shape)
    args = (inputs, form, g, out, residuals)
    return ENGINE.causal_attention_vjp(*args, xp=xp), Engine.causal_attention_vjp(ENGINE, *args, xp=xp)


def _assert_equal_grads(fused, generic, rtol=1e-9):
    """Equal to a tolerance relative to the largest gradient of each array. The generic pull-back forms
    a key's sums as totals minus prefix sums, so where the fused sweep gives an exact 0 it leaves the
    rounding of those totals, which scales with the sums, not with the gradient: 1.1e-10 of the
    largest gradient on the machine of 2026-11-28, where the same code at 23f4bd1 failed a bound of
    1e-10 that the earlier machines passed."""
    def close(a, b):
        b = np.asarray(b)
        scale = max(1.0, float(np.nanmax(np.abs(b)))) if np.isfinite(b).any() else 1.0
        np.testing.assert_allclose(np.nan_to_num(np.asarray(a)), np.nan_to_num(b), rtol=0, atol=rtol * scale)

    for a, b in zip(fused[:3], generic[:3]):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        close(a, b)
    for got, want in zip(fused[3], generic[3]):       # (knot grads, coefficient grads)
        for a, b in zip(got, want):
            if b is None:
                assert a is None
            else:
                close(a, b)


@pytest.mark.parametrize("profile_name", list(PROFILES))
@pytest.mark.parametrize("normalize", NORMALIZERS)
@pytest.mark.parametrize("center", [False, True], ids=["plain", "centred"])
@pytest.mark.parametrize("shape", [(7, 7), (5, 8), (8, 5)], ids=["square", "more-keys", "more-queries"])
def test_fused_equals_generic(rng, fused_calls, profile_name, normalize, center, shape):
    q, k, v, key_mask = _case(rng, *shape, mask=shape == (5, 8))
    profile = Profile(**PROFILES[profile_name])
    fused, generic = _both(q, k, v, key_mask, profile, center, normalize, rng=rng)
    _assert_equal_grads(fused, generic)
    # it served the call unless ReLU attention had a silent row (D = 0 over a key seen: a query below
    # every key it sees under the ReLU normaliser, or tied with each under |r|)
    assert fused_calls[-1] or (profile_name == "relu" and normalize in ("abs", "relu"))


@pytest.mark.parametrize("normalize", NORMALIZERS)
def test_fused_learned_knots(rng, fused_calls, normalize):
    """Per-row (learned) knots and coefficients: their gradients, a strict knot's tie rule included."""
    q, k, v, key_mask = _case(rng, 6, 6, batch=(3,), mask=True)
    knots = (np.full(3, -0.5), np.zeros(3), np.array([0.5, 0.5, 1.0]))
    coeffs = (np.full(3, 2.0), np.full(3, -4.0), np.array([2.0, 2.0, 1.0]))
    profile = Profile(knots, coeffs, strict_knots=(False, False, True))
    fused, generic = _both(q, k, v, key_mask, profile, True, normalize, rng=rng)
    assert fused_calls == [True]
    _assert_equal_grads(fused, generic)


def test_fused_batch_dims_and_parallel_rows(rng, fused_calls, monkeypatch):
    """Two batch dims, rows claimed by several workers (the parallel path forced)."""
    monkeypatch.setattr(_causal_host, "PARALLEL_MIN_WORK", 0)
    q, k, v, key_mask = _case(rng, 9, 9, c=4, batch=(2, 3), mask=True)
    fused, generic = _both(q, k, v, key_mask, Profile(**PROFILES["hat"]), True, "abs", rng=rng)
    assert fused_calls == [True]
    _assert_equal_grads(fused, generic)


@pytest.mark.parametrize("where", ["query", "key", "value"])
def test_non_finite_input_takes_the_generic_backward(rng, fused_calls, where):
    q, k, v, _ = _case(rng, 6, 6)
    {"query": q, "key": k, "value": v[..., 0]}[where][0, 2] = np.nan
    fused, generic = _both(q, k, v, None, Profile(**PROFILES["relu"]), True, "abs", rng=rng)
    assert fused_calls == []                # the preconditions fail before the sweep runs
    _assert_equal_grads(fused, generic)


def test_silent_rows_take_the_generic_backward(rng, fused_calls):
    """ReLU attention, ReLU normaliser: the first query below the first key has D = 0 and sees a key."""
    q, k = np.array([[-1.0, 0.5, 2.0]]), np.array([[0.0, 0.0, 1.0]])
    v = rng.normal(size=(1, 3, 2))
    fused, generic = _both(q, k, v, None, Profile(**PROFILES["relu"]), False, "relu", rng=rng)
    assert fused_calls == [False]
    _assert_equal_grads(fused, generic)


def test_fused_float32_and_torch(rng, fused_calls):
    torch = pytest.importorskip("torch")
    q, k, v, key_mask = _case(rng, 7, 7, mask=True)
    profile = Profile(**PROFILES["hat"])
    g = rng.normal(size=v.shape[:-2] + (7, v.shape[-1]))
    want = _both(q, k, v, key_mask, profile, True, "abs", g=g)[1]
    import array_api_compat.torch as xt
    tq, tk, tv, tg = (torch.tensor(a, dtype=torch.float32) for a in (q, k, v, g))
    tm = torch.tensor(key_mask)
    inputs, form = Inputs(tq, tk, tv, tm), Form(profile, Normalizer("abs", 1e-6), True)
    out, residuals = ENGINE.causal_attention(inputs, form, xp=xt)
    got = ENGINE.causal_attention_vjp(inputs, form, tg, out, residuals, xp=xt)
    assert fused_calls[-1]
    for a, b in zip(got[:3], want[:3]):
        assert a.dtype == torch.float32
        np.testing.assert_allclose(a.numpy(), b, rtol=2e-4, atol=2e-4 * max(1.0, float(np.abs(b).max())))


def test_example_is_the_hand_computed_one():
    q, k, v = np.array([[1.0, 3.0]]), np.array([[0.0, 2.0]]), np.array([[[1.0], [3.0]]])
    dq, dk, dv, dknots, dcoeffs = sweep_calls.causal_attention_vjp(
        q, k, v, None, np.ones((1, 2, 1)), None, None, None, knots=(0.0,), coeffs=(1.0,), center=False,
        normalizer=None)
    # out_0 = ReLU(1 - 0) 1, out_1 = ReLU(3 - 0) 1 + ReLU(3 - 2) 3
    np.testing.assert_array_equal(dq, [[1.0, 4.0]])
    np.testing.assert_array_equal(dk, [[-2.0, -3.0]])
    np.testing.assert_array_equal(dv[..., 0], [[4.0, 1.0]])
    np.testing.assert_array_equal(dknots, [[-5.0]])      # -(g . sum H v) over both queries
    np.testing.assert_array_equal(dcoeffs, [[7.0]])      # the output's sum: 1 + 6


@pytest.mark.parametrize("profile_name", list(PROFILES))
@pytest.mark.parametrize("normalize", ["abs", None])
def test_a_common_offset_is_shifted_away(rng, profile_name, normalize):
    """Scores 2^26 from 0 (on a grid of 2^-20, so that adding the offset is exact): the sweep shifts
    every score by one the target sees before it sums, so the differences it sums are those of the
    scores near 0, bit for bit, forward and backward alike (the fused one, or the generic one where a
    tie leaves a row to it); unshifted, ``x P0 - P1`` would lose about 2^26 ulps to cancellation."""
    q, k, v, _ = _case(rng, 7, 7)
    q, k = np.round(q * 2.0**20) / 2.0**20, np.round(k * 2.0**20) / 2.0**20
    profile = Profile(**PROFILES[profile_name])
    normalizer = Normalizer(normalize, 1e-6)
    g = rng.normal(size=v.shape[:-2] + (7, v.shape[-1]))
    results = []
    for offset in (0.0, 2.0**26):
        inputs, form = Inputs(q + offset, k + offset, v, None), Form(profile, normalizer, True)
        out, residuals = ENGINE.causal_attention(inputs, form, xp=xp)
        grads = ENGINE.causal_attention_vjp(inputs, form, g, out, residuals, xp=xp)
        params = [a for part in grads[3] for a in part if a is not None]    # knot and coefficient gradients
        results.append([out, *grads[:3], *params])
    for near, far in zip(*results):
        np.testing.assert_array_equal(far, near)
