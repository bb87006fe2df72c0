"""Fuzz: every op, on every backend and engine, against the dense float64 reference.

Each example is one call of ``kernel_sum`` (ReLU / Abs / Hat / HatMixture / PiecewiseLinear),
``relu_attention``, ``hat_attention``, ``hat_mixture_attention`` or ``kernel_attention`` with
hostile inputs (``_cases.forward_cases``): broadcast batch dims, empty axes, mixed and half
dtypes, fully masked rows, exact ties, +-0.0, scales 1e-30..1e30, per-head parameters, every
normaliser, ``center``, ``eps`` from 0 to 1e30. The answer must have the backend's type, device,
the promoted dtype and the broadcast shape, leave its inputs untouched, and be within:

Tolerance rule
--------------
The library computes in float64 whatever the input dtypes and rounds once to the output dtype.
With ``e`` the dense oracle in float64 on the same rounded inputs, ``fl`` rounding to the output
dtype and ``E`` an a-priori bound of the float64 rounding error,

    fl(e - E) <= answer <= fl(e + E),
    E = C u (|a| + L (|q_i| + max_j |k_j| + T)) (sum_j |v_j| + n_valid |mu|) / D'    (u = 2**-53)

``L``, ``T``, ``|a|``: slope sum, largest knot and intercept of the profile (per head), ``mu`` the
mean used by centring, ``D'`` the (clamped) normaliser, ``C = 4 (Lk + knots + 8)``; the quotient
adds ``|out| E_D / D'``. Rounding of the output (float32, float16), its underflow and its overflow
to +-inf are therefore allowed exactly, and nothing else: the error is measured against the
magnitude of the terms the sort-scan cancels (the scores' magnitude times the values), the same
relative standard at every scale. A computation carried out in float32 misses this bound by
about seven orders of magnitude. Rows without a valid key must be exactly 0; with ``eps = 0`` an
exactly zero normaliser gives the formula's NaN / +-inf (or ``eps = 0`` is rejected with a
``ValueError`` naming it). Details: ``_oracle``'s docstring.

``test_jax_without_x64`` holds JAX's float32 double-float path to the same rule with ``u = 2**-40``
(compensated arithmetic, not float64) over a range of scales that float32 products can hold.
"""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import assert_meta, to_numpy
from hypothesis import note

from ._cases import FLOAT_DTYPES, OP_NAMES, forward_cases, np_dtype
from ._oracle import TINY, UNIT, assert_within, call_recording_warnings, expected_output, forward_bound

#: Smallest normal float32: the underflow floor of JAX's float32 work arithmetic.
TINY32 = float(np.finfo(np.float32).tiny)


def check_forward(backend, engine, case, *, unit: float = UNIT, tiny: float = TINY):
    """One call of ``case`` on ``backend`` with ``engine`` against the oracle (module docstring)."""
    note(f"backend {backend.name}, engine {engine.name!r}; reproducer (NumPy arrays):\n{case!r}")
    args, kwargs = case.on(backend)
    expected = expected_output(case)
    called = call_recording_warnings(engine, case, args, kwargs)
    if called is None:
        return                          # rejecting eps = 0 clearly is one of the two documented answers
    out, caught = called
    _assert_warnings_legitimate(caught, expected, case.out_dtype())
    assert_meta(out, backend=backend, shape=expected.shape, dtype=backend.dtype(case.out_dtype()))
    bound, judged = forward_bound(case, expected, unit=unit, tiny=tiny)
    assert_within(to_numpy(out), expected, bound, case.out_dtype(), judged=judged, what=f"{case.op} output")
    _assert_unmodified(case, args, kwargs)


def _assert_warnings_legitimate(caught, expected: np.ndarray, dtype: str):
    """No warning, except NumPy's floating-point RuntimeWarnings (overflow in the cast to the
    output dtype, division by zero) where the exact result, rounded to ``dtype``, is +-inf or NaN:
    NumPy itself warns there, and the suite turns warnings into errors."""
    with np.errstate(all="ignore"):
        non_finite = not np.all(np.isfinite(expected.astype(np_dtype(dtype))))
    for w in caught:
        if issubclass(w.category, RuntimeWarning) and non_finite:
            continue
        raise AssertionError(f"unexpected warning {w.category.__name__}: {w.message} ({w.filename}:{w.lineno})")


def _assert_unmodified(case, args, kwargs):
    """The backend arrays still hold the case's values (inputs are never written to)."""
    original_args, original_kwargs = case.numpy()
    pairs = list(zip(original_args, args)) + [(original_kwargs[k], kwargs[k]) for k in original_kwargs]
    for before, after in pairs:
        if isinstance(before, np.ndarray):
            assert np.array_equal(before, to_numpy(after).astype(before.dtype)), "an input was modified in place"


def _has_float16(backend) -> bool:
    return hasattr(backend.xp, "float16")


@pytest.mark.parametrize("op", OP_NAMES)
def test_op_matches_dense_reference(xp, engine, fuzz, op):
    dtypes = ("float64",) if fuzz.one_dtype_on(xp) else FLOAT_DTYPES
    strategy = forward_cases(op, has_float16=_has_float16(xp), few_shapes=fuzz.layouts_for(xp), dtypes=dtypes)
    fuzz.run(strategy, lambda case: check_forward(xp, engine, case), backend=xp.name)


@pytest.mark.parametrize("op", OP_NAMES)
def test_jax_without_x64(jax_without_x64, fuzz, op):
    """JAX with x64 off: float32 (and float16) inputs through the double-float accumulation."""
    backend, engine = jax_without_x64
    dtypes = ("float32",) if fuzz.one_dtype_on(backend) else ("float32", "float16")
    strategy = forward_cases(op, has_float16=True, few_shapes=fuzz.layouts_for(backend), dtypes=dtypes,
                             log_scale_range=(-6.0, 6.0))
    fuzz.run(strategy, lambda case: check_forward(backend, engine, case, unit=2.0 ** -40, tiny=TINY32),
             backend="jax",
             weight=0.5)
