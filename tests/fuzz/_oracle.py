"""The float64 oracle of the fuzz suite: expected values, the error each may legitimately carry,
the comparison, and finite differences.

Tolerance rule (forward values)
-------------------------------
The library computes in float64 whatever the input dtypes (prefix sums and their combination:
the design's accumulation rule) and rounds the result once to the output dtype. So for an exact
value ``e`` (the dense reference in float64, on the same rounded inputs) the answer ``a`` must obey

    fl(e - E) <= a <= fl(e + E)

with ``fl`` rounding to the output dtype (monotone, so this is exact: it allows the output's own
rounding, underflow to zero or a subnormal, and overflow to +-inf, nothing more) and ``E`` an
a-priori bound of the float64 error of BOTH the sort-scan and the dense oracle:

    E = C u (|a| + L (|q_i| + max_j |k_j| + T)) (sum_j |v_j| + n_valid |mu|)  /  D'

* ``u = 2**-53``; ``C = 4 (Lk + M + 8)`` (sums of ``Lk`` terms, ``M`` knots, a few operations);
* the profile ``f(r) = a + b r + sum_m c_m ReLU(r - t_m)`` enters through ``L = |b| + sum_m |c_m|``
  and ``T = max_m |t_m|`` (per head for array bandwidths / weights): the sort-scan forms
  ``s P0 - P1`` with ``s = q_i - t_m``, terms as large as the MAGNITUDE of the scores (not their
  spread) times the weights, which then cancel. The error is relative to those terms, not to the
  result: a result that is small by cancellation (a narrow hat far from every key) is judged on
  the scale of the data, and a huge common offset of the scores legitimately costs digits;
* ``mu`` is the mean of the valid values (centring, folded in as ``N - mu R``);
* ``D'`` is 1 for ``normalize=None``, ``max(count, 1)`` for "count", and for "abs" / "relu" a
  lower bound of the computed clamped normaliser, ``max(D - E_D, eps)`` with
  ``E_D = C u 3 (|q_i| + max_j |k_j|) n_valid``; the quotient adds ``|out| E_D / D'``.

Every bound is homogeneous in the scales of scores and values, so 1e-30 and 1e30 are held to
the same relative standard. The float32 error of a computation done in float32 (~1e-7 of the terms)
is far above ``E`` (~1e-14): a backend that computes in a narrow dtype fails, as it should.
Values the formula leaves undefined are judged on the documented rules instead: a row with no
valid key is exactly 0; with ``eps = 0`` a normaliser that is exactly 0 (all scores 0, so
computed exactly) gives the formula's ``N / 0`` (NaN or +-inf); where the normaliser is 0 only up
to rounding, any value is accepted (the formula is ill-conditioned there).

Tolerance rule (gradients)
--------------------------
Gradients are compared with finite differences of the same oracle in float64: fourth-order
central differences for inputs drawn away from kinks (step 1/64 of the distance to the nearest
kink), second-order one-sided differences at exact ties (step ``2**-20`` units). Allowed error per
element: ``rtol (|fd| + max|fd over that argument|)`` with ``rtol = 1e-6`` plus the
finite-difference roundoff ``C u (sum |g| |terms|) / h``; a float32 gradient is judged after
rounding, as above.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
from _helpers import names_argument

from slicedkern.kernels import Hat

from ._cases import Arr, Case, np_dtype

__all__ = ["UNIT", "TINY", "expected_output", "magnitudes", "forward_bound", "assert_within", "finite_difference",
           "loss_of", "loss_noise", "evaluate", "power_of_two_scale", "call_recording_warnings"]

#: Unit roundoff of float64, the dtype the library computes in.
UNIT = 2.0 ** -53

#: Smallest normal float64: the absolute error an operation may add by underflow (a subnormal
#: result, or zero where the hardware flushes subnormals, as XLA on CPU does).
TINY = float(np.finfo(np.float64).tiny)

#: The documented default of ``eps``.
DEFAULT_EPS = 1e-6

#: Normaliser defaults of each attention op, and whether it centres by default.
DEFAULT_NORMALIZE = {"relu_attention": "abs", "hat_attention": "count", "hat_mixture_attention": "count",
                     "kernel_attention": "count"}
DEFAULT_CENTER = {"relu_attention": True, "kernel_attention": False}


def _full_batch(case: Case, args: list, kwargs: dict):
    """q, k, v (x, y, w with w as (..., m, c)) and the validity of each key, broadcast to the
    common batch shape, and that shape."""
    q, k, v = args[:3]
    if not case.is_attention and v.ndim == k.ndim:
        v = v[..., None]
    mask = kwargs.get("key_mask")
    shapes = [q.shape[:-1], k.shape[:-1], v.shape[:-2]] + ([mask.shape[:-1]] if mask is not None else [])
    batch = np.broadcast_shapes(*shapes)
    q = np.broadcast_to(q, batch + q.shape[-1:])
    k = np.broadcast_to(k, batch + k.shape[-1:])
    v = np.broadcast_to(v, batch + v.shape[-2:])
    valid = np.ones(k.shape, bool) if mask is None else np.broadcast_to(mask, k.shape)
    return q, k, v, valid, batch


def evaluate(case: Case, args: list, kwargs: dict) -> np.ndarray:
    """The dense oracle in float64 on NumPy arguments shaped like the case's, with the documented
    rule for a row without valid keys (exactly 0) applied. NaN / +-inf where the formula gives them
    (``eps = 0``). Arrays are broadcast to the common batch shape first."""
    with np.errstate(all="ignore"):
        if not case.is_attention:
            return np.asarray(case.oracle(*args, **kwargs), dtype=np.float64)
        q, k, v, valid, _ = _full_batch(case, args, kwargs)
        if "key_mask" in kwargs:
            kwargs = {**kwargs, "key_mask": valid}
        out = np.asarray(case.oracle(q, k, v, *args[3:], **kwargs), dtype=np.float64)
    empty = ~np.any(valid, axis=-1)
    return np.where(empty[..., None, None], 0.0, out)


def expected_output(case: Case) -> np.ndarray:
    """:func:`evaluate` on the case's own arguments."""
    return evaluate(case, *case.numpy())


def _hat_array(param) -> np.ndarray:
    """A mixture parameter (list of floats or :class:`Arr` (..., K)) as an array (..., K)."""
    return param.values if isinstance(param, Arr) else np.asarray(param, dtype=np.float64)


def _profile(case: Case):
    """``(A, L, T, M)`` of the op's profile ``a + b r + sum_m c_m ReLU(r - t_m)``: ``|a|``,
    ``|b| + sum_m |c_m|`` and ``max_m |t_m|`` (floats, or arrays over the parameters' batch shape
    for array bandwidths / weights: one profile per head) and the number of knots ``M``."""
    if case.op in ("kernel_sum", "kernel_attention") or (case.op == "hat_attention"
                                                          and not isinstance(case.args[3], Arr)):
        kernel = case.args[3] if case.op != "hat_attention" else Hat(case.args[3])
        return (abs(kernel.intercept), abs(kernel.slope) + sum(abs(c) for c in kernel.coeffs),
                max((abs(t) for t in kernel.knots), default=0.0), len(kernel.knots))
    if case.op == "relu_attention":
        return 0.0, 1.0, 0.0, 1
    # hats of width b and weight w: knots -b, 0, b with coefficients w/b, -2w/b, w/b
    if case.op == "hat_attention":
        widths = case.args[3].values
        return 0.0, 4.0 / widths, widths, 3
    widths, weights = _hat_array(case.args[3]), _hat_array(case.args[4])
    return (0.0, np.sum(4.0 * np.abs(weights) / widths, axis=-1),
            np.max(np.broadcast_to(widths, np.broadcast_shapes(widths.shape, weights.shape)), axis=-1),
            3 * widths.shape[-1])


def _per_head(value, batch: tuple):
    """A per-head profile quantity aligned with outputs (..., Lq, Dv) of batch shape ``batch``."""
    value = np.asarray(value, dtype=np.float64)
    return np.broadcast_to(value, batch)[..., None, None] if value.ndim else value


@dataclass
class Magnitudes:
    """Scales of the quantities the sort-scan forms for one case (module docstring).

    terms : (..., Lq, Dv)
        ``(|a| + L (|q_i| + max_j |k_j| + T)) (sum_j |v_j| + n_valid |mu|)``, over valid keys.
    factor : float
        ``C u``.
    floor : float
        ``C tiny``: the absolute error underflow may add (module docstring).
    count : (..., 1, 1)
        Number of valid keys.
    scores : (..., Lq, 1)
        ``|q_i| + max_j |k_j|`` over valid keys.
    den : (..., Lq, 1) or None
        The exact "abs" / "relu" normaliser, before the clamp (None for other normalisers).
    clamp : (..., Lq, 1) or float
        What the numerator is divided by: 1, ``max(count, 1)`` or ``max(den, eps)``.
    """

    terms: np.ndarray
    factor: float
    floor: float
    count: np.ndarray
    scores: np.ndarray
    den: np.ndarray | None
    clamp: np.ndarray | float


def magnitudes(case: Case, *, unit: float = UNIT, tiny: float = TINY) -> Magnitudes:
    """The :class:`Magnitudes` of ``case``; ``unit`` and ``tiny``: the unit roundoff and the
    smallest normal number of the work arithmetic."""
    args, kwargs = case.numpy()
    q, k, v, valid, batch = _full_batch(case, args, kwargs)
    a, lipschitz, reach, n_knots = _profile(case)
    lipschitz, reach = _per_head(lipschitz, batch), _per_head(reach, batch)
    kmax = np.max(np.where(valid, np.abs(k), 0.0), axis=-1, initial=0.0)[..., None, None]
    vv = np.where(valid[..., None], v, 0.0)
    count = valid.sum(axis=-1)[..., None, None].astype(np.float64)
    center = case.is_attention and case.option("center", DEFAULT_CENTER.get(case.op, False))
    mu = np.abs(vv.sum(axis=-2, keepdims=True)) / np.maximum(count, 1.0) if center else 0.0
    scores = np.abs(q)[..., None] + kmax
    with np.errstate(over="ignore"):
        terms = (a + lipschitz * (scores + reach)) * (np.abs(vv).sum(axis=-2, keepdims=True) + count * mu)
    operations = 4.0 * (k.shape[-1] + n_knots + 8)
    normalize = case.option("normalize", DEFAULT_NORMALIZE[case.op]) if case.is_attention else None
    den, clamp = None, 1.0
    if normalize == "count":
        clamp = np.maximum(count, 1.0)
    elif normalize in ("abs", "relu"):
        r = q[..., :, None] - k[..., None, :]
        profile = np.abs(r) if normalize == "abs" else np.maximum(r, 0.0)
        den = np.where(valid[..., None, :], profile, 0.0).sum(axis=-1)[..., None]
        clamp = np.maximum(den, case.option("eps", DEFAULT_EPS))
    return Magnitudes(terms, operations * unit, operations * tiny, count, scores, den, clamp)


def forward_bound(case: Case, expected: np.ndarray, *, unit: float = UNIT, tiny: float = TINY,
                  outer: Case | None = None):
    """``(bound, judged)``: the allowed error ``E`` of every output element (module docstring), and
    whether the element can be judged at all. ``unit``, ``tiny``: see :func:`magnitudes`.

    ``outer``: the same call over a superset of the keys whose sums ``case``'s are the difference of
    (a window's band: the causal sums up to its right edge less those before its left one), which
    then bound the rounding: twice the numerator's and the normaliser's errors of ``outer``, over the
    divisor of ``case``."""
    m = magnitudes(case, unit=unit, tiny=tiny)
    o = m if outer is None else magnitudes(outer, unit=unit, tiny=tiny)
    sums = 1.0 if outer is None else 2.0
    finite = np.isfinite(expected)
    size = np.where(finite, np.abs(expected), 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        e_num = sums * (o.factor * o.terms + o.floor)
        if not case.is_attention:
            bound = e_num if expected.ndim == e_num.ndim else e_num[..., 0]
            return bound + 4.0 * unit * size + m.floor, np.ones(expected.shape, bool)
        judged = np.ones(expected.shape, bool)
        if m.den is None:
            bound = e_num / m.clamp
        else:
            e_den = sums * (o.factor * 3.0 * o.scores * o.count + o.floor)
            den_low = np.maximum(m.den - e_den, case.option("eps", DEFAULT_EPS))
            bound = np.where(den_low > 0, (e_num + size * e_den) / np.where(den_low > 0, den_low, 1.0), 0.0)
            # eps = 0 and a normaliser that is 0 up to rounding: only an exact 0 can be judged (the
            # formula's N / 0, when the numerator is exact too or clearly non-zero)
            exact_zero = (m.den == 0) & (m.scores == 0) & ((m.terms == 0) | ~finite)
            judged = np.broadcast_to((den_low > 0) | exact_zero, expected.shape)
        bound = bound + 4.0 * unit * size + m.floor
    empty = m.count == 0
    bound = np.where(finite, bound, 0.0)        # an infinite or NaN expected value is matched exactly
    return (np.broadcast_to(np.where(empty, 0.0, bound), expected.shape),
            np.broadcast_to(judged | empty, expected.shape))


def assert_within(actual, expected, bound, dtype: str, *, judged=None, what: str = ""):
    """``fl(e - E) <= a <= fl(e + E)`` elementwise, ``fl`` rounding to ``dtype``; NaN exactly where
    expected, an infinite expected value exactly; elements not ``judged`` are free."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    bound = np.broadcast_to(np.asarray(bound, dtype=np.float64), e.shape)
    judged = np.ones(e.shape, bool) if judged is None else np.broadcast_to(judged, e.shape)
    with np.errstate(all="ignore"):
        low = (e - bound).astype(np_dtype(dtype)).astype(np.float64)
        high = (e + bound).astype(np_dtype(dtype)).astype(np.float64)
    ok = np.where(np.isnan(e), np.isnan(a), np.where(np.isinf(e), a == e, (low <= a) & (a <= high)))
    bad = np.argwhere(~(ok | ~judged))
    if bad.size == 0:
        return
    index = tuple(int(i) for i in bad[0])
    raise AssertionError(
        f"{what}: {len(bad)} of {e.size} elements outside the allowed error; first at {index}: got "
        f"{a[index]!r}, expected {e[index]!r} +- {bound[index]:.3e}, i.e. within [{low[index]!r}, "
        f"{high[index]!r}] in {dtype}")


# ---------------------------------------------------------------------------- finite differences
def loss_of(case: Case, cotangent: np.ndarray, args: list, kwargs: dict) -> float:
    """``sum(g * oracle(*args, **kwargs))`` in float64 (an exactly rounded sum)."""
    return math.fsum((evaluate(case, args, kwargs) * cotangent).ravel())


STENCILS = {
    # offsets (in steps) and weights; the derivative is sum(w * L(x + o h)) / h
    "central": ((-2, -1, 1, 2), (1.0 / 12.0, -8.0 / 12.0, 8.0 / 12.0, -1.0 / 12.0)),
    "right": ((0, 1, 2), (-1.5, 2.0, -0.5)),
    "left": ((0, -1, -2), (1.5, -2.0, 0.5)),
}


def finite_difference(case: Case, cotangent: np.ndarray, position: int, step: float, stencil: str) -> np.ndarray:
    """The derivative of ``sum(g * oracle)`` in every element of positional argument ``position``."""
    args, kwargs = case.numpy()
    base = args[position]
    grad = np.zeros(base.shape, dtype=np.float64)
    offsets, weights = STENCILS[stencil]
    for index in np.ndindex(base.shape):
        total = 0.0
        for offset, weight in zip(offsets, weights):
            moved = base.copy()
            moved[index] += offset * step
            total += weight * loss_of(case, cotangent, args[:position] + [moved] + args[position + 1:], kwargs)
        grad[index] = total / step
    return grad


def loss_noise(case: Case, cotangent: np.ndarray, expected: np.ndarray) -> float:
    """A bound of the float64 rounding error of one evaluation of ``sum(g * oracle)``:
    ``sum |g| (C u (terms + |out| 3 scores count) + C tiny) / clamp`` (see :func:`forward_bound`)."""
    m = magnitudes(case)
    g = np.abs(cotangent)
    if not case.is_attention and g.ndim < m.terms.ndim:
        g = g[..., None]
        expected = expected[..., None]
    size = np.abs(expected)
    with np.errstate(over="ignore", invalid="ignore"):
        per_element = (m.factor * (m.terms + size * 3.0 * m.scores * m.count) + m.floor) / m.clamp
        return float(np.sum(g * per_element))


def power_of_two_scale(cotangent: np.ndarray) -> float:
    """A power of two near ``max |g|`` (1 for a zero cotangent). Finite differences of
    ``sum((g / s) * out)``, times ``s``, are exactly those of ``sum(g * out)`` but for the underflow
    of tiny products ``g * out`` (a cotangent and values near 1e-257 make the loss 0)."""
    top = float(np.max(np.abs(cotangent), initial=0.0))
    return 2.0 ** math.floor(math.log2(top)) if top > 0 else 1.0


def fourth_order_gradient(loss_of, base: np.ndarray, step: float) -> np.ndarray:
    """Fourth-order central differences of the scalar ``loss_of(moved)`` in every entry of ``base``,
    ``moved`` being ``base`` with that entry moved by ``-2, -1, 1, 2`` steps."""
    grad = np.zeros(base.shape)
    for index in np.ndindex(base.shape):
        total = 0.0
        for offset, weight in zip((-2, -1, 1, 2), (1 / 12, -8 / 12, 8 / 12, -1 / 12)):
            moved = base.copy()
            moved[index] += offset * step
            total += weight * loss_of(moved)
        grad[index] = total / step
    return grad


def call_recording_warnings(engine, case: Case, args, kwargs):
    """``engine.call(case.function, *args, **kwargs)`` with every warning recorded: ``(out, caught)``,
    or ``None`` when the op refuses ``eps = 0`` naming the argument (one of the two documented answers)."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = engine.call(case.function, *args, **kwargs)
    except ValueError as exc:
        if case.option("eps", None) == 0.0 and names_argument(str(exc), "eps"):
            return None
        raise
    return out, caught
