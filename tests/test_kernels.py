"""The kernel algebra: representation, evaluation, sum / scale / reflect, equality."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _helpers import assert_meta, assert_values_close

from slicedkern.kernels import Abs, Hat, HatMixture, PiecewiseLinear, ReLU

R = np.array([-3.0, -2.0, -1.5, -1.0, -0.5, -1e-12, 0.0, 1e-12, 0.25, 0.5, 1.0, 1.75, 2.0, 4.0])


def relu(r):
    return np.maximum(r, 0.0)


def hat(r, b):
    return np.maximum(0.0, 1.0 - np.abs(r) / b)


def general(r, knots, coeffs, slope, intercept):
    """``a + b r + sum_m c_m ReLU(r - t_m)`` spelled out with a loop."""
    out = intercept + slope * r
    for t, c in zip(knots, coeffs):
        out = out + c * relu(r - t)
    return out


GENERAL = dict(knots=(-1.0, 0.5, 2.0), coeffs=(0.5, -1.25, 3.0), slope=-0.75, intercept=0.3)

CLOSED_FORMS = [
    pytest.param(ReLU(), relu, id="relu"),
    pytest.param(Abs(), np.abs, id="abs"),
    pytest.param(Hat(1.0), lambda r: hat(r, 1.0), id="hat1"),
    pytest.param(Hat(0.3), lambda r: hat(r, 0.3), id="hat0.3"),
    pytest.param(Hat(2.5), lambda r: hat(r, 2.5), id="hat2.5"),
    pytest.param(HatMixture([0.5, 2.0], [1.5, -0.25]),
                 lambda r: 1.5 * hat(r, 0.5) - 0.25 * hat(r, 2.0), id="mixture"),
    pytest.param(PiecewiseLinear(**GENERAL), lambda r: general(r, **GENERAL), id="general"),
]


# ------------------------------------------------------------------------------ representation
def test_representations_follow_the_spec_table():
    assert (ReLU().knots, ReLU().coeffs, ReLU().slope, ReLU().intercept) == ((0.0,), (1.0,), 0.0, 0.0)
    assert (Abs().knots, Abs().coeffs, Abs().slope, Abs().intercept) == ((0.0,), (2.0,), -1.0, 0.0)
    b = 0.4
    h = Hat(b)
    assert h.knots == (-b, 0.0, b)
    assert h.coeffs == pytest.approx((1 / b, -2 / b, 1 / b), rel=1e-15)
    assert (h.slope, h.intercept) == (0.0, 0.0)
    assert h.bandwidth == b
    assert Hat().bandwidth == 1.0


def test_mixture_is_the_sum_of_its_hats():
    mix = HatMixture([0.5, 2.0, 1.0], [1.0, -2.0, 0.5])
    manual = 1.0 * Hat(0.5) + (-2.0) * Hat(2.0) + 0.5 * Hat(1.0)
    assert mix == manual
    # hats share the knot at 0: 3 hats -> 2 * 3 + 1 knots
    assert len(mix.knots) == 7
    assert mix.knots == tuple(sorted(mix.knots))


def test_knots_are_sorted_and_coefficients_follow_them():
    f = PiecewiseLinear(knots=(2.0, -1.0, 0.5), coeffs=(3.0, 1.0, -2.0))
    assert f.knots == (-1.0, 0.5, 2.0)
    assert f.coeffs == (1.0, -2.0, 3.0)


def test_equal_knots_are_merged_and_zero_coefficients_dropped():
    f = PiecewiseLinear(knots=(1.0, 1.0, 0.0, 3.0), coeffs=(2.0, 3.0, 0.0, 1.0))
    assert f.knots == (1.0, 3.0)
    assert f.coeffs == (5.0, 1.0)
    g = PiecewiseLinear(knots=(1.0, 1.0), coeffs=(2.0, -2.0))
    assert g.knots == () and g.coeffs == ()
    # 0.0 and -0.0 are one knot
    h = PiecewiseLinear(knots=(0.0, -0.0), coeffs=(1.0, 1.0))
    assert h.knots == (0.0,) and h.coeffs == (2.0,)
    # the same value in floats of different types
    assert PiecewiseLinear((np.float64(0.5), 0.5), (1, 1)).knots == (0.5,)


def test_merging_after_algebra_is_minimal():
    assert (ReLU() - ReLU()).knots == ()
    assert (Hat(1.0) + Hat(1.0)).knots == (-1.0, 0.0, 1.0)
    assert HatMixture([1.0, 1.0], [0.25, 0.75]) == Hat(1.0)
    cancel = HatMixture([1.0, 1.0], [1.0, -1.0])
    assert cancel.knots == () and cancel(0.0) == 0.0


def test_as_piecewise_linear_keeps_the_profile():
    h = Hat(0.7)
    p = h.as_piecewise_linear()
    assert type(p) is PiecewiseLinear
    assert p == h and p._key() == h._key()


# ----------------------------------------------------------------------------------- evaluation
@pytest.mark.parametrize("kernel, closed", CLOSED_FORMS)
def test_pointwise_numpy(kernel, closed):
    out = kernel(R)
    assert isinstance(out, np.ndarray) and out.dtype == np.float64 and out.shape == R.shape
    np.testing.assert_allclose(out, closed(R), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("kernel, closed", CLOSED_FORMS)
def test_pointwise_python_floats(kernel, closed):
    for r in R:
        value = kernel(float(r))
        assert isinstance(value, float)
        assert value == pytest.approx(float(closed(np.array(r))), rel=1e-14, abs=1e-14)


@pytest.mark.parametrize("kernel, closed", CLOSED_FORMS)
def test_pointwise_on_every_backend(xp, kernel, closed):
    r = xp.asarray(R.reshape(2, 7))
    out = kernel(r)
    assert_meta(out, like=r)
    assert_values_close(out, closed(R.reshape(2, 7)), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_pointwise_keeps_low_precision_dtype(xp, dtype):
    r = xp.asarray(R, dtype=dtype)
    out = Hat(1.5)(r)
    assert_meta(out, like=r)
    exact = hat(xp.to_numpy(r).astype(np.float64), 1.5)
    tol = {"float32": 1e-6, "float16": 2e-3}[dtype]
    assert_values_close(out, exact, rtol=tol, atol=tol)


def test_hat_profile_values():
    h = Hat(2.0)
    np.testing.assert_array_equal(h(np.array([-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0])),
                                  [0.0, 0.0, 0.5, 1.0, 0.5, 0.0, 0.0])
    # support is [-b, b] and the peak is 1 at 0
    assert h(0.0) == 1.0 and h(2.0) == 0.0 and h(-2.0) == 0.0 and h(10.0) == 0.0


def test_derivative_is_the_right_derivative():
    h = Hat(1.0)
    r = np.array([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0])
    np.testing.assert_array_equal(h.derivative_at(r), [0.0, 1.0, 1.0, -1.0, -1.0, 0.0, 0.0])
    np.testing.assert_array_equal(Abs().derivative_at(np.array([-1.0, 0.0, 1.0])), [-1.0, 1.0, 1.0])
    f = PiecewiseLinear(**GENERAL)
    step = 1e-7
    pts = np.array([-2.0, -0.3, 1.1, 3.0])  # away from knots
    fd = (f(pts + step) - f(pts - step)) / (2 * step)
    np.testing.assert_allclose(f.derivative_at(pts), fd, rtol=1e-6)


# -------------------------------------------------------------------------------------- algebra
PAIRS = [(ReLU(), Abs()), (Hat(0.5), Hat(2.0)), (PiecewiseLinear(**GENERAL), HatMixture([1.0], [2.0])),
         (Abs(), PiecewiseLinear(slope=1.0, intercept=-2.0))]


@pytest.mark.parametrize("f, g", PAIRS)
def test_sum_difference_and_scaling_evaluate_pointwise(f, g):
    np.testing.assert_allclose((f + g)(R), f(R) + g(R), rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose((f - g)(R), f(R) - g(R), rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose((2.5 * f)(R), 2.5 * f(R), rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose((f * -0.5)(R), -0.5 * f(R), rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose((-f)(R), -f(R), rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose((np.float64(3.0) * g)(R), 3.0 * g(R), rtol=1e-14, atol=1e-14)
    assert isinstance(f + g, PiecewiseLinear) and isinstance(3 * f, PiecewiseLinear)


@pytest.mark.parametrize("kernel, closed", CLOSED_FORMS)
def test_reflect_is_f_of_minus_r(kernel, closed):
    refl = kernel.reflect()
    assert isinstance(refl, PiecewiseLinear)
    np.testing.assert_allclose(refl(R), kernel(-R), rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(refl(R), closed(-R), rtol=1e-14, atol=1e-14)
    for r in R:
        assert refl(float(r)) == pytest.approx(kernel(float(-r)), rel=1e-14, abs=1e-14)
    # reflecting twice gives the kernel back (as a profile)
    np.testing.assert_allclose(refl.reflect()(R), kernel(R), rtol=1e-14, atol=1e-14)


def test_reflect_representation():
    # ReLU(-r) = ReLU(r) - r
    assert ReLU().reflect() == PiecewiseLinear((0.0,), (1.0,), slope=-1.0)
    # even kernels are their own reflection
    for f in (Abs(), Hat(0.3), Hat(1.7), HatMixture([0.25], [3.0])):
        assert f.reflect() == f
        assert f.is_even
    assert not ReLU().is_even
    assert not PiecewiseLinear(**GENERAL).is_even
    shifted = PiecewiseLinear((1.0,), (1.0,))        # ReLU(r - 1) -> ReLU(-r - 1)
    assert shifted.reflect().knots == (-1.0,)


@pytest.mark.parametrize("bandwidths, weights", [([0.5, 3.0], [1.0, -2.0]), ([0.5, 2.0], [1.5, -0.25]),
                                                 ([0.1, 0.7, 1.3], [1.0, 1.0, 1.0])])
def test_hat_mixtures_are_even(bandwidths, weights):
    """A mixture of hats is even; ``is_even`` documents ``f(r) == f(-r)``."""
    mix = HatMixture(bandwidths, weights)
    np.testing.assert_allclose(mix(R), mix(-R), rtol=1e-14, atol=1e-14)
    assert mix.is_even


def test_abs_identity():
    assert 2 * ReLU() + PiecewiseLinear((), (), slope=-1.0) == Abs()
    assert ReLU() + ReLU().reflect() == Abs()


def test_algebra_rejects_non_kernels_and_non_reals():
    with pytest.raises(TypeError):
        ReLU() + 1.0
    with pytest.raises(TypeError):
        ReLU() - 1.0
    with pytest.raises(TypeError):
        ReLU() * "2"
    with pytest.raises(TypeError):
        True * ReLU()


# --------------------------------------------------------------------- immutability, eq, hash
@pytest.mark.parametrize("kernel", [ReLU(), Abs(), Hat(1.0), HatMixture([1.0], [2.0]),
                                    PiecewiseLinear(**GENERAL)])
def test_immutable(kernel):
    before = (kernel.knots, kernel.coeffs, kernel.slope, kernel.intercept)
    for name in ("knots", "coeffs", "slope", "intercept", "_knots", "_slope", "new_attribute"):
        with pytest.raises(AttributeError):
            setattr(kernel, name, 1.0)
    _ = kernel + kernel, 2 * kernel, -kernel, kernel.reflect()
    assert (kernel.knots, kernel.coeffs, kernel.slope, kernel.intercept) == before
    assert isinstance(kernel.knots, tuple) and isinstance(kernel.coeffs, tuple)


def test_constructor_copies_its_sequences():
    knots, coeffs = [0.0, 1.0], [1.0, 2.0]
    f = PiecewiseLinear(knots, coeffs)
    knots[0], coeffs[0] = 5.0, 7.0
    assert f.knots == (0.0, 1.0) and f.coeffs == (1.0, 2.0)


def test_equality_and_hash():
    a = Hat(1.0)
    b = PiecewiseLinear((-1.0, 0.0, 1.0), (1.0, -2.0, 1.0))
    assert a == b and hash(a) == hash(b)
    assert ReLU() == PiecewiseLinear((0.0,), (1.0,)) and hash(ReLU()) == hash(PiecewiseLinear((0.0,), (1.0,)))
    assert Hat(1.0) != Hat(2.0)
    assert ReLU() != Abs()
    assert PiecewiseLinear(slope=1.0) != PiecewiseLinear(intercept=1.0)
    assert (ReLU() == 0) is False and (ReLU() != "ReLU") is True
    table = {Hat(1.0): "a", ReLU(): "b"}
    assert table[b] == "a" and table[PiecewiseLinear((0,), (1,))] == "b"
    assert len({Abs(), 2 * ReLU() - PiecewiseLinear(slope=1.0), Abs().reflect()}) == 1


def test_repr_is_informative():
    assert "0.5" in repr(Hat(0.5)) and "Hat" in repr(Hat(0.5))
    assert repr(ReLU()) == "ReLU()"
    assert "knots" in repr(PiecewiseLinear(**GENERAL))


# ----------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("b", [0.0, -1.0, -0.0, math.inf, math.nan])
def test_hat_bandwidth_must_be_positive_and_finite(b):
    with pytest.raises(ValueError, match="bandwidth"):
        Hat(b)


@pytest.mark.parametrize("bandwidths", [[1.0, 0.0], [-2.0], [1.0, math.inf]])
def test_mixture_bandwidths_must_be_positive(bandwidths):
    with pytest.raises(ValueError, match="bandwidths"):
        HatMixture(bandwidths, [1.0] * len(bandwidths))


def test_mismatched_lengths():
    with pytest.raises(ValueError, match="same length"):
        PiecewiseLinear((0.0, 1.0), (1.0,))
    with pytest.raises(ValueError, match="same length"):
        PiecewiseLinear((), (1.0,))
    with pytest.raises(ValueError, match="same length"):
        HatMixture([1.0, 2.0], [1.0])


@pytest.mark.parametrize("t", [math.nan, math.inf, -math.inf])
def test_knots_must_be_finite(t):
    with pytest.raises(ValueError, match="finite"):
        PiecewiseLinear((t,), (1.0,))


def test_non_numbers_are_type_errors():
    with pytest.raises(TypeError):
        Hat("1.0")
    with pytest.raises(TypeError):
        Hat(True)
    with pytest.raises(TypeError):
        PiecewiseLinear(("0",), (1.0,))
    with pytest.raises(TypeError):
        PiecewiseLinear((0.0,), (1.0,), slope="1")
    with pytest.raises(TypeError):
        HatMixture([1.0], [None])
    with pytest.raises(TypeError):
        PiecewiseLinear((0.0,), (1j,))


@pytest.mark.parametrize("kernel", [Hat(0.5), HatMixture([0.5, 2.0], [1.0, -0.3]), ReLU(), Abs(),
                                    PiecewiseLinear((0.0, 1.0), (1.0, -2.0), slope=0.5, intercept=1.0)])
def test_kernels_pickle(kernel):
    import pickle

    back = pickle.loads(pickle.dumps(kernel))
    assert type(back) is type(kernel) and back == kernel and repr(back) == repr(kernel)
    with pytest.raises(AttributeError, match="immutable"):
        back._slope = 2.0


# ------------------------------------------------ issue 49 item 8: one rule for every profile parameter
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("make, name", [
    (lambda x: PiecewiseLinear((0.0,), (x,)), "coeffs"),
    (lambda x: PiecewiseLinear((0.0,), (1.0,), slope=x), "slope"),
    (lambda x: PiecewiseLinear((0.0,), (1.0,), intercept=x), "intercept"),
    (lambda x: PiecewiseLinear((x,), (1.0,)), "knots"),
    (lambda x: HatMixture([1.0, 2.0], [1.0, x]), "weights"),
    (lambda x: HatMixture([1.0, x], [1.0, 1.0]), "bandwidths"),
], ids=["coeffs", "slope", "intercept", "knots", "weights", "bandwidths"])
def test_every_profile_parameter_must_be_finite(make, name, bad):
    """NaN knots and bandwidths raised while NaN coefficients and weights made every output NaN."""
    with pytest.raises(ValueError, match=f"argument '{name}' must be"):
        make(bad)


def test_an_empty_mixture_is_refused():
    with pytest.raises(ValueError, match="'bandwidths' must hold at least one hat"):
        HatMixture([], [])
    assert PiecewiseLinear()(np.array([-1.0, 2.0])).tolist() == [0.0, 0.0]     # the zero profile, by name
