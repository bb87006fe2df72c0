"""Fuzz: gradients of every op, on every backend and engine, against finite differences.

The gradient of ``sum(g * op(...))`` for a random cotangent ``g`` comes from the backend's own
reverse mode -- ``torch.autograd``, ``jax.vjp``, and ``slicedkern.vjp`` for NumPy and every
other namespace -- with respect to every floating array argument: scores, values, weights,
per-head bandwidths and mixture weights (0-d arrays included; a Python float gets none). It is
compared with finite differences of the dense float64 oracle on the same rounded inputs.

* ``test_gradients_match_finite_differences``: inputs drawn AWAY from every kink
  (``_grad_cases.smooth_gradient_cases``: every ``q_i - k_j - t_m`` at least 5/16 of a lattice unit
  from zero, ``eps`` far from every normaliser), float64 and float32 mixed; fourth-order central
  differences with a step of 1/64 of the distance to the nearest kink.
* ``test_gradients_at_exact_ties_follow_the_tie_rule``: scores, knots and bandwidths on one
  dyadic grid, so that ``q_i - k_j - t_m = 0`` exactly and often. The documented rule is
  ``H(0) = 1`` in both the query and the key gradient: ``dq`` (``dx``) is the RIGHT derivative of
  the loss in ``q_i``, ``dk`` (``dy``) its LEFT derivative in ``k_j``; values and mixture weights
  enter linearly (central differences). A bandwidth moves a pair of knots in opposite directions;
  its gradient is documented as the RIGHT derivative in the bandwidth (issue 11, item 11: not a
  blend of the two sides, and always the same side).
  Second-order one-sided differences, step ``2**-20`` grid units.

Allowed error of each gradient element: ``1e-6 (|fd| + max |fd| over that argument)`` plus four
times the finite differences' own rounding error (a bound of the oracle's float64 error divided by
the step), judged after rounding to the argument's dtype, as in ``test_fuzz_ops``.
"""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import assert_meta, to_numpy
from hypothesis import note

import slicedkern

from ._cases import OP_NAMES, Arr
from ._grad_cases import assume_away_from_kinks, smooth_gradient_cases, tie_gradient_cases
from ._oracle import assert_within, expected_output, finite_difference, forward_bound, loss_noise, magnitudes

RTOL = 1e-6

#: Argument names by role at ties: the right derivative (query side), the left one (key side),
#: and the right derivative in a bandwidth (docs/mathematics.rst; ``slicedkern.ops.attention``).
QUERY_ROLE = ("x", "q")
KEY_ROLE = ("y", "k")
BANDWIDTH_ROLE = ("bandwidth", "bandwidths")
SCORE_LIKE = QUERY_ROLE + KEY_ROLE + BANDWIDTH_ROLE


# -------------------------------------------------------------------------------- reverse modes
def _vjp_gradients(case, args, kwargs, cotangent):
    out, pullback = slicedkern.vjp(case.function, *args, **kwargs)
    grads = pullback(cotangent)
    assert len(grads) == len(args), f"vjp returned {len(grads)} gradients for {len(args)} positional arguments"
    for position, grad in enumerate(grads):
        if position not in case.float_positions():
            assert grad is None, f"vjp gave a gradient for the non-array argument {case.arg_name(position)!r}"
    return out, list(grads)


def _torch_gradients(case, args, kwargs, cotangent):
    import torch
    positions = case.float_positions()
    leaves = [args[i].requires_grad_(True) for i in positions]
    out = case.function(*args, **kwargs)
    found = torch.autograd.grad(out, leaves, grad_outputs=cotangent, allow_unused=True)
    grads = [None] * len(args)
    for position, leaf, grad in zip(positions, leaves, found):
        # an input the output does not depend on (no keys, say) has a zero gradient
        grads[position] = torch.zeros_like(leaf) if grad is None else grad
    return out.detach(), grads


def _jax_gradients(case, args, kwargs, cotangent):
    import jax
    positions = case.float_positions()

    def partial_op(*differentiable):
        full = list(args)
        for position, value in zip(positions, differentiable):
            full[position] = value
        return case.function(*full, **kwargs)

    out, pullback = jax.vjp(partial_op, *(args[i] for i in positions))
    grads = [None] * len(args)
    for position, grad in zip(positions, pullback(cotangent)):
        grads[position] = grad
    return out, grads


def backend_gradients(backend, engine, case, cotangent: np.ndarray):
    """``(out, grads)``: the output and one gradient per positional argument (None where it is not
    a floating array) from ``backend``'s reverse mode, forward and backward on ``engine``."""
    args, kwargs = case.on(backend)
    g = Arr(cotangent, case.out_dtype()).on(backend)
    if backend.name in ("torch", "torch_cuda"):
        mode = _torch_gradients
    elif backend.is_jax:
        mode = _jax_gradients
    else:
        mode = _vjp_gradients
    out, grads = engine.call(mode, case, args, kwargs, g)
    return out, grads, args


# ------------------------------------------------------------------------------------- checking
def _gradient_noise(case, position: int, cotangent: np.ndarray, noise: float, step: float) -> float:
    """Rounding allowance of one gradient element: four times the finite differences' rounding
    error (``noise / step``), and for a linear argument (values, weights) the rounding error of
    its own gradient, a kernel sum of the cotangent: the loss's error bound per unit of that
    argument (the loss with the argument set to ones), plus the underflow floor."""
    allowance = 4.0 * noise / step + magnitudes(case).floor
    if case.arg_name(position) not in SCORE_LIKE:
        ones = case.replaced(position, np.ones(case.args[position].shape))
        allowance += 4.0 * loss_noise(ones, cotangent, expected_output(ones))
    return allowance


def _step(case, position: int, unit: float) -> float:
    """Finite-difference step: ``unit`` for scores and bandwidths; for the linear arguments
    (values, weights, mixture weights) their own magnitude (any step is exact but for rounding)."""
    if case.arg_name(position) in SCORE_LIKE:
        return unit
    magnitude = float(np.max(np.abs(case.args[position].values), initial=0.0))
    return magnitude if magnitude > 0 else 1.0


def _bound(fd: np.ndarray, allowance: float) -> np.ndarray:
    scale = float(np.max(np.abs(fd), initial=0.0))
    return RTOL * (np.abs(fd) + scale) + allowance


def _report(backend, engine, case, cotangent, what: str):
    note(f"backend {backend.name}, engine {engine.name!r}, {what}; reproducer (NumPy arrays):\n{case!r}\n"
         f"cotangent g = np.array({cotangent.tolist()!r})  # loss = sum(g * out)")


def _check_common(backend, case, cotangent, out, grads, args):
    """Output (through the differentiable path) and each gradient's namespace, device, shape, dtype."""
    expected = expected_output(case)
    assert_meta(out, backend=backend, shape=expected.shape, dtype=backend.dtype(case.out_dtype()))
    bound, judged = forward_bound(case, expected)
    assert_within(to_numpy(out), expected, bound, case.out_dtype(), judged=judged, what=f"{case.op} output")
    for position in case.float_positions():
        assert grads[position] is not None, f"no gradient for {case.arg_name(position)!r}"
        assert_meta(grads[position], like=args[position])
    return expected


def check_smooth(backend, engine, example):
    case, cotangent, unit = example
    gap = assume_away_from_kinks(case, unit)
    _report(backend, engine, case, cotangent, f"kink gap {gap:.3e}")
    out, grads, args = backend_gradients(backend, engine, case, cotangent)
    expected = _check_common(backend, case, cotangent, out, grads, args)
    noise = loss_noise(case, cotangent, expected)
    for position in case.float_positions():
        # no kink at all (no key): any step would do, but an infinite one would move the query to inf,
        # whose row is NaN even without keys (the one NaN rule for queries)
        step = _step(case, position, (gap if np.isfinite(gap) else unit) / 64.0)
        fd = finite_difference(case, cotangent, position, step, "central")
        bound = _bound(fd, _gradient_noise(case, position, cotangent, noise, step))
        assert_within(to_numpy(grads[position]), fd, bound, case.args[position].dtype,
                      what=f"d{case.arg_name(position)} (central differences)")


def check_ties(backend, engine, example):
    case, cotangent, unit = example
    _report(backend, engine, case, cotangent, "exact ties on a dyadic grid")
    out, grads, args = backend_gradients(backend, engine, case, cotangent)
    expected = _check_common(backend, case, cotangent, out, grads, args)
    noise = loss_noise(case, cotangent, expected)
    for position in case.float_positions():
        name = case.arg_name(position)
        step = _step(case, position, unit * 2.0 ** -20)
        got = to_numpy(grads[position])
        dtype = case.args[position].dtype
        allowance = _gradient_noise(case, position, cotangent, noise, step)
        if name in QUERY_ROLE or name in KEY_ROLE:
            side = "right" if name in QUERY_ROLE else "left"
            fd = finite_difference(case, cotangent, position, step, side)
            assert_within(got, fd, _bound(fd, allowance), dtype,
                          what=f"d{name} at ties (the tie rule H(0) = 1: the {side} derivative)")
        elif name in BANDWIDTH_ROLE:
            fd = finite_difference(case, cotangent, position, step, "right")
            assert_within(got, fd, _bound(fd, allowance), dtype,
                          what=f"d{name} at ties (documented: the right derivative in the bandwidth)")
        else:
            fd = finite_difference(case, cotangent, position, step, "central")
            assert_within(got, fd, _bound(fd, allowance), dtype, what=f"d{name} (linear argument)")


# ---------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("op", OP_NAMES)
def test_gradients_match_finite_differences(xp, engine, fuzz, op):
    dtypes = ("float64",) if fuzz.one_dtype_on(xp) else ("float64", "float32")
    strategy = smooth_gradient_cases(op, few_shapes=fuzz.layouts_for(xp), dtypes=dtypes)
    fuzz.run(strategy, lambda example: check_smooth(xp, engine, example), backend=xp.name, weight=0.6)


@pytest.mark.parametrize("op", OP_NAMES)
def test_gradients_at_exact_ties_follow_the_tie_rule(xp, engine, fuzz, op):
    strategy = tie_gradient_cases(op, few_shapes=fuzz.layouts_for(xp))
    fuzz.run(strategy, lambda example: check_ties(xp, engine, example), backend=xp.name, weight=0.6)
