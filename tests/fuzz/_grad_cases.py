"""What the fuzz suite draws for gradients: cases away from every kink, and cases on exact ties.

* :func:`smooth_gradient_cases` -- inputs AWAY from every kink, for central finite differences:
  queries on the half-integer lattice, keys and knots (hat bandwidths included) on the integer
  lattice, each jittered by at most 1/16, so that every ``q_i - k_j - t_m`` is at least 5/16 of a
  lattice unit away from zero; ``eps`` far from every normaliser value.
* :func:`tie_gradient_cases` -- everything ON a dyadic grid (quarters times a power of two), so
  that ``q_i - k_j - t_m = 0`` holds exactly and often: for the tie rule of the gradients.

Both return ``(case, cotangent, unit)``; cases are :class:`._cases.Case` (see there).
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from slicedkern.kernels import PiecewiseLinear

from ._cases import Arr, Case, Layout, hat_params, kernels, layouts, log_uniform, mask, promote

__all__ = ["smooth_gradient_cases", "tie_gradient_cases", "kink_gap", "assume_away_from_kinks"]


# ------------------------------------------------------------------------------------ gradients
#: Values of gradient cases: normal floats in [-1, 1] (subnormals only blur the comparison there;
#: the forward cases keep them).
_UNIT_FLOATS = st.floats(-1.0, 1.0, allow_subnormal=False)


def _jitter(draw, shape: tuple, amount: float) -> np.ndarray:
    return np.asarray(draw(hnp.arrays(np.float64, shape, elements=st.floats(-amount, amount))))


@st.composite
def smooth_gradient_cases(draw, op: str, *, few_shapes: tuple = (), dtypes=("float64", "float32")):
    """Inputs at least 5/16 of a lattice unit away from every kink (see the module docstring).

    Returns ``(case, cotangent, unit)``: the cotangent (float64, rounded to the output dtype) and
    the lattice unit in score units (the distance scale of the kinks).
    """
    layout = draw(layouts(few_shapes=few_shapes, max_len=6, max_batch=2, vector_ok=op == "kernel_sum"))
    q_dt, k_dt, v_dt = (draw(st.sampled_from(dtypes)) for _ in range(3))
    param_dt = promote(q_dt, k_dt, v_dt)
    narrow = "float32" in (q_dt, k_dt, v_dt, param_dt)
    unit = log_uniform(draw, -10.0 if narrow else -20.0, 10.0 if narrow else 20.0)
    offset = draw(st.sampled_from((0, 0, 8, 64)))

    def lattice(n, *, half=False, shape=None):
        # n: integer lattice points (scalar or array); half: on the half-integer lattice instead
        n = np.asarray(n, dtype=np.float64) + (0.5 if half else 0.0)
        jitter = _jitter(draw, np.shape(n), 1.0 / 16.0)
        return (n + jitter) * unit

    def integers(shape, lo, hi):
        return np.asarray(draw(hnp.arrays(np.int64, shape, elements=st.integers(lo, hi))), dtype=np.float64)

    q = lattice(integers(layout.q_batch + (layout.lq,), -4, 3) + offset, half=True)
    k = lattice(integers(layout.k_batch + (layout.lk,), -4, 4) + offset)
    v_shape = layout.v_batch + ((layout.lk,) if layout.vector else (layout.lk, layout.dv))
    v_scale = log_uniform(draw, -5.0, 5.0)
    v = np.asarray(draw(hnp.arrays(np.float64, v_shape, elements=_UNIT_FLOATS))) * v_scale
    args = (Arr.rounded(q, q_dt), Arr.rounded(k, k_dt), Arr.rounded(v, v_dt))

    def knot(n):
        return float(lattice(n))

    def widths(shape):
        return lattice(integers(shape, 1, 3))

    def weights(shape):
        return 2.0 * np.asarray(draw(hnp.arrays(np.float64, shape, elements=_UNIT_FLOATS)))

    if op in ("kernel_sum", "kernel_attention"):
        args += (draw(kernels(unit, lattice=knot)),)
    elif op in ("hat_attention", "hat_mixture_attention"):
        args += hat_params(draw, op, layout.batch, param_dt, widths, weights)
    options = {}
    if op != "kernel_sum":
        options = _gradient_options(draw, op, layout, eps_below=1e-3 * unit,
                                    eps_above=1e4 * unit * (abs(offset) + 16) * max(layout.lk, 1))
    case = Case(op, args, options)
    return case, _cotangent(draw, case), unit


def _gradient_options(draw, op: str, layout: Layout, *, eps_below: float, eps_above: float) -> dict:
    """Normaliser, centring, mask, and an ``eps`` far below every non-zero normaliser (or above all).

    The clamp ``max(D, eps)`` has a kink at ``D = eps``; finite differences must not straddle it.
    """
    options = {"normalize": draw(st.sampled_from(("abs", "relu", "count", None)))}
    if op in ("relu_attention", "kernel_attention"):
        options["center"] = draw(st.booleans())
    options["eps"] = draw(st.sampled_from((eps_below, eps_above)))
    key_mask = mask(draw, layout)
    if key_mask is not None:
        options["key_mask"] = key_mask
    return options


def _cotangent(draw, case: Case) -> np.ndarray:
    g = np.asarray(draw(hnp.arrays(np.float64, case.out_shape(), elements=_UNIT_FLOATS)))
    return Arr.rounded(g, case.out_dtype()).values


@st.composite
def tie_gradient_cases(draw, op: str, *, few_shapes: tuple = ()):
    """Scores, knots and bandwidths on one dyadic grid: exact ties ``q_i - k_j - t_m = 0``.

    Returns ``(case, cotangent, unit)`` as :func:`smooth_gradient_cases`; float64 throughout and
    ``unit`` a power of two (every difference of grid points is exact).
    """
    layout = draw(layouts(few_shapes=few_shapes, max_len=6, max_batch=2, vector_ok=op == "kernel_sum"))
    unit = 2.0 ** draw(st.integers(-40, 40))
    quarter = unit / 4.0

    def grid(shape, lo=-6, hi=6):
        return np.asarray(draw(hnp.arrays(np.int64, shape, elements=st.integers(lo, hi))),
                          dtype=np.float64) * quarter

    k = grid(layout.k_batch + (layout.lk,))
    q_shape = layout.q_batch + (layout.lq,)
    if k.size and draw(st.booleans()):          # queries equal to keys
        q = k.ravel()[draw(hnp.arrays(np.intp, q_shape, elements=st.integers(0, k.size - 1)))]
    else:
        q = grid(q_shape)
    v_shape = layout.v_batch + ((layout.lk,) if layout.vector else (layout.lk, layout.dv))
    v = np.asarray(draw(hnp.arrays(np.float64, v_shape, elements=_UNIT_FLOATS)))
    args = (Arr(q, "float64"), Arr(k, "float64"), Arr(v, "float64"))

    def knot(n):
        return float(n) * quarter

    def widths(shape):
        return grid(shape, 1, 4)

    def weights(shape):
        return 2.0 * np.asarray(draw(hnp.arrays(np.float64, shape, elements=_UNIT_FLOATS)))

    if op in ("kernel_sum", "kernel_attention"):
        args += (draw(kernels(unit, lattice=knot)),)
    elif op in ("hat_attention", "hat_mixture_attention"):
        args += hat_params(draw, op, layout.batch, "float64", widths, weights)
    options = {}
    if op != "kernel_sum":
        # 2**-10 units: below every non-zero normaliser (>= 1/4 unit), above the finite-difference
        # excursions of a zero one (a few 2**-20 units).
        options = _gradient_options(draw, op, layout, eps_below=unit * 2.0 ** -10, eps_above=unit * 2.0 ** 20)
    case = Case(op, args, options)
    return case, _cotangent(draw, case), unit


def kink_gap(case: Case) -> float:
    """Smallest ``|q_i - k_j - t_m|`` over all queries, keys and knots (bandwidths included), in
    float64; ``inf`` without queries or keys. Masked keys count too (harmless: a bound)."""
    q, k = case.args[0].values, case.args[1].values
    if q.size == 0 or k.size == 0:
        return math.inf
    knots = [0.0]
    for a in case.args[3:]:
        if isinstance(a, PiecewiseLinear):
            knots += list(a.knots)
    for a, position in ((a, i) for i, a in enumerate(case.args) if i >= 3):
        if case.arg_name(position) in ("bandwidth", "bandwidths"):
            widths = a.values.ravel() if isinstance(a, Arr) else np.atleast_1d(np.asarray(a, dtype=np.float64))
            knots += list(widths) + list(-widths)
    diffs = (q[..., :, None] - k[..., None, :]).ravel()
    return float(min(np.min(np.abs(diffs - t)) for t in set(knots)))


def assume_away_from_kinks(case: Case, unit: float) -> float:
    """The case's kink gap, after checking the lattice construction kept it (rounding included)."""
    gap = kink_gap(case)
    assume(gap >= unit / 4.0)
    return gap
