"""Fuzz: causal attention (``causal=True``) on every backend and engine, values and gradients.

Every attention op -- ``relu_attention``, ``hat_attention``, ``hat_mixture_attention``,
``kernel_attention`` -- with ``causal=True``: query ``i`` sees the valid keys ``j <= i + Lk - Lq``.

* ``test_causal_op_matches_dense_reference``: the hostile forward cases of ``test_fuzz_ops``
  (``_cases.forward_cases``: ``Lq != Lk`` both ways and empty axes, broadcast batch dims, masks with
  fully masked rows, ties, mixed and half dtypes, scales 1e-30..1e30, per-head parameters, every
  normaliser, ``center``, ``eps`` 0..1e30) made causal. Expected value and allowed error: those of
  ``test_fuzz_ops`` (``fl(e - E) <= a <= fl(e + E)``, ``_oracle``'s docstring) computed PER QUERY
  over the keys it sees (``_causal.per_query_case``): its count, normaliser, centring mean and
  largest key are the ones that enter its error; a query that sees no key must be exactly 0. The
  dense ``slicedkern.reference.*(causal=True)`` must agree with that per-query evaluation.
* ``test_causal_gradients_match_finite_differences``: gradients (torch autograd, ``jax.vjp``,
  ``slicedkern.vjp`` elsewhere; the forward's engine runs the backward) with respect to every
  floating argument, on inputs away from every kink (``_grad_cases.smooth_gradient_cases``), against
  fourth-order central differences of ``slicedkern.reference.*(causal=True)`` in float64.
* ``test_causal_gradients_at_exact_ties``: the tie rule of ``test_fuzz_gradients`` (``dq`` the right
  derivative, ``dk`` the left one, a bandwidth's the right one) on dyadic grids, causal.

Tolerances are those of ``test_fuzz_gradients`` -- ``1e-6 (|fd| + max |fd|)`` plus four times the
finite differences' rounding error -- with the rounding bound of the loss taken per query as above
(a causal query's normaliser can be far smaller than the non-causal one, and its error larger).

Findings (deterministic, NumPy; ``xfail(strict=True)`` where an engine is known to fail):

* ``test_causal_row_does_not_depend_on_unseen_keys``: the causal sweep's row 0 changed when a later,
  larger key was appended (found by ``test_fuzz_decode``; fixed: the sweep shifts a row's scores by
  the first key a query can see, not by the row's median key).
* ``test_zero_relu_normaliser_rule_is_scale_free``: the scan (and the causal sweep) drop ``dv`` of a
  row whose ReLU normaliser is 0 when the profile vanishes there; the test of that once probed
  ``min(knots) - 1``, which rounding defeated at knots beyond 2**53 (fixed: the step scales).
* ``test_zero_abs_normaliser_follows_the_tie_rule_on_every_engine``: the documented tie rule where a
  ``|r|`` normaliser sum is exactly 0 (engines disagreed there).
"""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import assert_meta, to_numpy
from hypothesis import note

import slicedkern
from slicedkern.engines import available as engines_available

from ._cases import FLOAT_DTYPES, forward_cases, np_dtype
from ._causal import (
    assert_reference_agrees,
    causal_loss_noise,
    causal_oracle,
    has_causal_mode,
    per_query_case,
    with_causal,
)
from ._grad_cases import assume_away_from_kinks, smooth_gradient_cases, tie_gradient_cases
from ._oracle import assert_within, call_recording_warnings, finite_difference, magnitudes, power_of_two_scale
from .test_fuzz_gradients import backend_gradients

ATTENTION_OPS = ("relu_attention", "hat_attention", "hat_mixture_attention", "kernel_attention")

#: As in test_fuzz_gradients: relative error allowed on top of the rounding allowances.
RTOL = 1e-6

QUERY_ROLE, KEY_ROLE, BANDWIDTH_ROLE = ("q",), ("k",), ("bandwidth", "bandwidths")
SCORE_LIKE = QUERY_ROLE + KEY_ROLE + BANDWIDTH_ROLE


@pytest.fixture
def cxp(xp, engine):
    """The backend under test, skipped where its engine has no causal mode (the sweep on JAX arrays,
    which it reads through a host callback only outside the causal mode: tests/test_causal.py checks
    that refusal)."""
    if not has_causal_mode(xp, engine):
        pytest.skip(f"the {xp.engine!r} engine has no causal mode for {xp.name} arrays")
    return xp


# ------------------------------------------------------------------------------------------ forward
def check_causal_forward(backend, engine, case):
    """One causal call of ``case`` on ``backend`` against the per-query oracle (module docstring)."""
    note(f"backend {backend.name}, engine {engine.name!r}; reproducer (NumPy arrays):\n{case!r}")
    expected, bound, judged = causal_oracle(case)
    assert_reference_agrees(case, expected, bound, judged)
    check_call(backend, engine, case, expected, bound, judged, f"causal {case.op} output")


def check_call(backend, engine, case, expected, bound, judged, what: str):
    """``case`` called on ``backend`` within ``bound`` of ``expected`` where ``judged``, in the
    expected dtype and shape, warning only where the exact result is not finite."""
    args, kwargs = case.on(backend)
    called = call_recording_warnings(engine, case, args, kwargs)
    if called is None:
        return                          # rejecting eps = 0 clearly is one of the two documented answers
    out, caught = called
    with np.errstate(all="ignore"):
        non_finite = not np.all(np.isfinite(expected.astype(np_dtype(case.out_dtype()))))
    for w in caught:
        # NumPy's own floating-point warnings where the exact result rounds to +-inf / NaN (test_fuzz_ops)
        assert issubclass(w.category, RuntimeWarning) and non_finite, (
            f"unexpected warning {w.category.__name__}: {w.message} ({w.filename}:{w.lineno})")
    assert_meta(out, backend=backend, shape=expected.shape, dtype=backend.dtype(case.out_dtype()))
    assert_within(to_numpy(out), expected, bound, case.out_dtype(), judged=judged, what=what)


@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_causal_op_matches_dense_reference(cxp, engine, fuzz, op):
    dtypes = ("float64",) if fuzz.one_dtype_on(cxp) else FLOAT_DTYPES
    strategy = forward_cases(op, has_float16=hasattr(cxp.xp, "float16"), few_shapes=fuzz.layouts_for(cxp),
                             dtypes=dtypes).map(with_causal)
    fuzz.run(strategy, lambda case: check_causal_forward(cxp, engine, case), backend=cxp.name, weight=0.75)


# ---------------------------------------------------------------------------------------- gradients
def _step(case, position: int, unit: float) -> float:
    """Scores and bandwidths: ``unit``; linear arguments: their own magnitude (test_fuzz_gradients)."""
    if case.arg_name(position) in SCORE_LIKE:
        return unit
    magnitude = float(np.max(np.abs(case.args[position].values), initial=0.0))
    return magnitude if magnitude > 0 else 1.0


def _allowance(case, position: int, cotangent, noise: float, step: float) -> float:
    """Rounding allowance of one gradient element, as ``test_fuzz_gradients._gradient_noise``, with
    the loss's rounding bounds taken per query (``_causal.causal_loss_noise``)."""
    allowance = 4.0 * noise / step + magnitudes(per_query_case(case)).floor
    if case.arg_name(position) not in SCORE_LIKE:
        allowance += 4.0 * causal_loss_noise(case, cotangent, position)
    return allowance


def _bound(fd: np.ndarray, allowance: float) -> np.ndarray:
    return RTOL * (np.abs(fd) + float(np.max(np.abs(fd), initial=0.0))) + allowance


def _gradients(backend, engine, case, cotangent, what: str):
    """The backend's output and gradients, the output checked against the oracle; the loss's noise."""
    note(f"backend {backend.name}, engine {engine.name!r}, {what}; reproducer (NumPy arrays):\n{case!r}\n"
         f"cotangent g = np.array({cotangent.tolist()!r})  # loss = sum(g * out)")
    out, grads, args = backend_gradients(backend, engine, case, cotangent)
    expected, bound, judged = causal_oracle(case)
    assert_meta(out, backend=backend, shape=expected.shape, dtype=backend.dtype(case.out_dtype()))
    assert_within(to_numpy(out), expected, bound, case.out_dtype(), judged=judged, what=f"causal {case.op} output")
    for position in case.float_positions():
        assert grads[position] is not None, f"no gradient for {case.arg_name(position)!r}"
        assert_meta(grads[position], like=args[position])
    return grads, causal_loss_noise(case, cotangent)


#: Below this, a cotangent or a value entry is set to 0 on JAX (:func:`_without_tiny`).
TINY_ON_JAX = 1e-250


def _without_tiny(backend, case, cotangent):
    """On JAX: cotangent, value and weight entries below :data:`TINY_ON_JAX` set to 0. XLA on CPU
    flushes subnormal intermediates to 0, and the backward forms products such as ``g b`` (a
    bandwidth) before dividing them again: with ``|g| ~ 1e-305`` a whole query's term vanishes
    (an absolute error of ``|g|``, far above ``_oracle``'s underflow floor ``C tiny``). That measures
    the flushing, not the gradients; NumPy and torch keep subnormals and get the full range."""
    if not backend.is_jax:
        return case, cotangent
    for position in case.float_positions():
        if case.arg_name(position) not in SCORE_LIKE:
            values = case.args[position].values
            case = case.replaced(position, np.where(np.abs(values) < TINY_ON_JAX, 0.0, values))
    return case, np.where(np.abs(cotangent) < TINY_ON_JAX, 0.0, cotangent)


def check_smooth(backend, engine, example):
    case, cotangent, unit = example
    case, cotangent = _without_tiny(backend, with_causal(case), cotangent)
    gap = assume_away_from_kinks(case, unit)
    grads, noise = _gradients(backend, engine, case, cotangent, f"kink gap {gap:.3e}")
    for position in case.float_positions():
        step = _step(case, position, gap / 64.0)
        scale = power_of_two_scale(cotangent)            # no underflow of tiny g * out in the loss
        fd = scale * finite_difference(case, cotangent / scale, position, step, "central")
        assert_within(to_numpy(grads[position]), fd, _bound(fd, _allowance(case, position, cotangent, noise, step)),
                      case.args[position].dtype, what=f"causal d{case.arg_name(position)} (central differences)")


def check_ties(backend, engine, example):
    case, cotangent, unit = example
    case, cotangent = _without_tiny(backend, with_causal(case), cotangent)
    grads, noise = _gradients(backend, engine, case, cotangent, "exact ties on a dyadic grid")
    for position in case.float_positions():
        name = case.arg_name(position)
        step = _step(case, position, unit * 2.0 ** -20)
        if name in QUERY_ROLE or name in BANDWIDTH_ROLE:
            stencil = "right"
        elif name in KEY_ROLE:
            stencil = "left"
        else:
            stencil = "central"
        scale = power_of_two_scale(cotangent)            # no underflow of tiny g * out in the loss
        fd = scale * finite_difference(case, cotangent / scale, position, step, stencil)
        assert_within(to_numpy(grads[position]), fd, _bound(fd, _allowance(case, position, cotangent, noise, step)),
                      case.args[position].dtype, what=f"causal d{name} at ties ({stencil} derivative)")


@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_causal_gradients_match_finite_differences(cxp, engine, fuzz, op):
    dtypes = ("float64",) if fuzz.one_dtype_on(cxp) else ("float64", "float32")
    strategy = smooth_gradient_cases(op, few_shapes=fuzz.layouts_for(cxp), dtypes=dtypes)
    fuzz.run(strategy, lambda example: check_smooth(cxp, engine, example), backend=cxp.name, weight=0.5)


@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_causal_gradients_at_exact_ties(cxp, engine, fuzz, op):
    strategy = tie_gradient_cases(op, few_shapes=fuzz.layouts_for(cxp))
    fuzz.run(strategy, lambda example: check_ties(cxp, engine, example), backend=cxp.name, weight=0.4)


# ------------------------------------------------------------------------------------------ findings
#: (engine, causal) pairs of the NumPy engines, for the findings below
_NUMPY_ENGINES = tuple(engines_available("numpy"))


def _numpy_pullback(op, args, g, **options):
    out, pullback = slicedkern.vjp(lambda q, k, v: op(q, k, v, **options), *args)
    return out, pullback(g)


def _finding_params(failing: set, reason: str):
    return [pytest.param(name, causal, id=f"{name}-{'causal' if causal else 'full'}",
                         marks=[pytest.mark.xfail(strict=True, reason=reason)] if (name, causal) in failing else [])
            for name in _NUMPY_ENGINES for causal in (False, True)]


@pytest.mark.parametrize("engine_name, causal", _finding_params(set(), ""))
def test_zero_abs_normaliser_follows_the_tie_rule_on_every_engine(engine_name, causal):
    """One query tied with its one key, ``normalize="abs"``, ``eps = 2**-10``: the normaliser sum is
    exactly 0, the output ``ReLU(0) / eps = 0``. The documented tie rule (``H(0) = 1``, the right
    derivative in ``q``, the left one in ``k``; the quotient rule) gives ``dq = 1 / eps = 1024``,
    ``dk = -1024``, and ``dv = ReLU(0) / eps = 0``, on every engine, causal or not (a single query sees
    every key). Engines once disagreed here (the scan and the causal engines dropped the row)."""
    q, k, v, g = np.array([0.0]), np.array([0.0]), np.array([[1.0]]), np.array([[1.0]])
    out, grads = _numpy_pullback(slicedkern.relu_attention, (q, k, v), g, normalize="abs", center=False,
                                 eps=2.0 ** -10, causal=causal, engine=engine_name)
    assert out.tolist() == [[0.0]]
    assert [grad.tolist() for grad in grads] == [[1024.0], [-1024.0], [[0.0]]]


@pytest.mark.parametrize("engine_name, causal", _finding_params(set(), ""))
def test_zero_relu_normaliser_rule_is_scale_free(engine_name, causal):
    """``f(r) = -1e20 - r + ReLU(r + 1e20)`` is 0 for ``r >= -1e20`` and ``-1e20 - r`` below: a query
    3e20 below its one key has a ReLU normaliser of 0 (clamped to ``eps = 1``) and output
    ``f(-3e20) v = 2e20``; exact gradients ``dq = f'(-3e20) = -1``, ``dk = 1``, ``dv = 2e20``. At
    scale 1 (knot at -1) every engine gives them."""
    from slicedkern.kernels import PiecewiseLinear

    kernel = PiecewiseLinear(knots=(-1e20,), coeffs=(1.0,), slope=-1.0, intercept=-1e20)
    q, k, v, g = np.array([-3e20]), np.array([0.0]), np.array([[1.0]]), np.array([[1.0]])
    out, (dq, dk, dv) = _numpy_pullback(
        lambda a, b, c, **o: slicedkern.kernel_attention(a, b, c, kernel, **o), (q, k, v), g,
        normalize="relu", eps=1.0, causal=causal, engine=engine_name)
    assert out.tolist() == [[2e20]]
    assert (dq.tolist(), dk.tolist(), dv.tolist()) == ([-1.0], [1.0], [[2e20]])


@pytest.mark.parametrize("engine_name", _NUMPY_ENGINES)
def test_causal_row_does_not_depend_on_unseen_keys(engine_name):
    """Causality to the last bit of accuracy: query 0 sees key 0 only, so its row must be the row of the
    call without key 1 (within float64 rounding of ITS scores, ~1e-12: an a-priori error of about 1e-20
    here, ``_oracle``'s bound). Found by test_fuzz_decode (the cache's row 0 differs from the causal op's)."""
    q, k, v = np.array([1e-12, 0.0]), np.array([9.99999996e-13, 1.0]), np.array([[1.0], [0.0]])
    options = {"center": False, "causal": True, "engine": engine_name}
    alone = slicedkern.relu_attention(q[:1], k[:1], v[:1], **options)
    np.testing.assert_allclose(alone, slicedkern.reference.relu_attention(q[:1], k[:1], v[:1], center=False),
                               rtol=1e-9)
    full = slicedkern.relu_attention(q, k, v, **options)
    np.testing.assert_allclose(full[:1], alone, rtol=1e-9, atol=1e-20)
