"""Property-based tests (hypothesis) of the sort-scan identities, NumPy float64."""

from __future__ import annotations

import warnings

import numpy as np
from _helpers import assert_values_close, scan_atol
from hypothesis import given, settings
from hypothesis import strategies as st

import slicedkern
from slicedkern import reference
from slicedkern.kernels import Hat, PiecewiseLinear

with warnings.catch_warnings():
    # Hypothesis imports this module only to report a failure, and the import warns (a deprecated
    # TypedDict of mypy_extensions): with warnings as errors that would turn a failing example into
    # a pytest INTERNALERROR. Import it now, quietly.
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import hypothesis.extra._patching  # noqa: F401
    except ImportError:  # pragma: no cover
        pass

SETTINGS = settings(max_examples=50, deadline=None)
RTOL = 1e-10

# Scores: a few grid values (exact ties, exact differences) or arbitrary floats.
GRID = (-1.5, -1.0, -0.25, 0.0, 0.25, 0.5, 1.0, 2.0)
score = st.one_of(st.sampled_from(GRID), st.floats(-3.0, 3.0, allow_nan=False, allow_subnormal=False))
grid_score = st.sampled_from(GRID)
weight = st.floats(-2.0, 2.0, allow_nan=False, allow_subnormal=False)
coeff = st.floats(-3.0, 3.0, allow_nan=False, allow_subnormal=False)


@st.composite
def kernels(draw, max_knots=4):
    """Random piecewise-linear profiles; knots sometimes on the score grid (ties with key + knot)."""
    k = draw(st.integers(0, max_knots))
    knots = draw(st.lists(st.one_of(st.sampled_from((-0.75, -0.25, 0.0, 0.25, 0.5, 1.0)),
                                    st.floats(-2.0, 2.0, allow_nan=False, allow_subnormal=False)),
                          min_size=k, max_size=k))
    coeffs = draw(st.lists(coeff, min_size=k, max_size=k))
    return PiecewiseLinear(knots, coeffs, slope=draw(coeff), intercept=draw(coeff))


@st.composite
def problems(draw, scores=score, max_n=12, max_m=12, columns=True):
    """(x, y, w) with n, m >= 1 and w of shape (m,) or (m, c)."""
    n = draw(st.integers(1, max_n))
    m = draw(st.integers(1, max_m))
    x = np.array(draw(st.lists(scores, min_size=n, max_size=n)))
    y = np.array(draw(st.lists(scores, min_size=m, max_size=m)))
    c = draw(st.sampled_from([None, 1, 2])) if columns else None
    size = m if c is None else m * c
    w = np.array(draw(st.lists(weight, min_size=size, max_size=size)))
    if c is not None:
        w = w.reshape(m, c)
    return x, y, w


def close(a, b, atol):
    """``|a - e| <= atol + RTOL |e|`` elementwise (and normwise); ``atol`` may be an array."""
    assert_values_close(np.asarray(a), np.asarray(b), rtol=RTOL, atol=atol)


@SETTINGS
@given(problems(), kernels())
def test_equals_dense_reference(problem, kernel):
    x, y, w = problem
    close(slicedkern.kernel_sum(x, y, w, kernel), reference.kernel_sum(x, y, w, kernel),
          scan_atol(x, y, w, kernel))


@SETTINGS
@given(problems(columns=False), kernels(), st.floats(-3.0, 3.0, allow_nan=False))
def test_linear_in_the_weights(problem, kernel, a):
    x, y, w1 = problem
    w2 = np.cos(np.arange(w1.size) + 0.5) * 2.0
    lhs = slicedkern.kernel_sum(x, y, w1 + a * w2, kernel)
    rhs = slicedkern.kernel_sum(x, y, w1, kernel) + a * slicedkern.kernel_sum(x, y, w2, kernel)
    close(lhs, rhs, (1 + abs(a)) * scan_atol(x, y, np.abs(w1) + np.abs(w2), kernel))


@SETTINGS
@given(problems(), kernels(), kernels(), st.floats(-4.0, 4.0, allow_nan=False))
def test_linear_in_the_kernel(problem, f, g, a):
    x, y, w = problem
    atol = (1 + abs(a)) * (scan_atol(x, y, w, f) + scan_atol(x, y, w, g))
    close(slicedkern.kernel_sum(x, y, w, f + g),
          slicedkern.kernel_sum(x, y, w, f) + slicedkern.kernel_sum(x, y, w, g), atol)
    close(slicedkern.kernel_sum(x, y, w, a * f), a * slicedkern.kernel_sum(x, y, w, f), atol)
    close(slicedkern.kernel_sum(x, y, w, -f), -slicedkern.kernel_sum(x, y, w, f), atol)


@SETTINGS
@given(problems(scores=grid_score), kernels(), st.integers(-1000, 1000))
def test_translation_invariant(problem, kernel, shift):
    """Shifting queries and keys by one constant changes nothing (grid scores: exact shifts)."""
    x, y, w = problem
    c = shift / 4.0
    atol = scan_atol(np.concatenate([x, x + c]), y, w, kernel)
    close(slicedkern.kernel_sum(x + c, y + c, w, kernel), slicedkern.kernel_sum(x, y, w, kernel), atol)


@SETTINGS
@given(problems(), kernels(), st.data())
def test_adjoint_identity(problem, kernel, data):
    """``sum_i g_i . S_i(x, y, w, f) == sum_j w_j . S_j(y, x, g, f.reflect())``.

    Both sides are ``g^T K w`` with ``K_ij = f(x_i - y_j)``; the right one runs the keys and queries
    swapped with the reflected profile, as the backward pass does for ``dw``.
    """
    x, y, w = problem
    g = np.array(data.draw(st.lists(weight, min_size=x.size * (w.size // y.size),
                                    max_size=x.size * (w.size // y.size))))
    g = g.reshape((x.size,) + w.shape[1:])
    lhs = np.sum(g * slicedkern.kernel_sum(x, y, w, kernel))
    rhs = np.sum(w * slicedkern.kernel_sum(y, x, g, kernel.reflect()))
    atol = (scan_atol(x, y, w, kernel) * np.abs(g).sum() + scan_atol(y, x, g, kernel.reflect()) * np.abs(w).sum())
    np.testing.assert_allclose(lhs, rhs, rtol=RTOL, atol=atol + 1e-300)


@SETTINGS
@given(problems(), kernels(), st.randoms(use_true_random=False))
def test_key_permutation_invariant_and_query_equivariant(problem, kernel, random):
    x, y, w = problem
    key_perm = np.array(random.sample(range(y.size), y.size))
    query_perm = np.array(random.sample(range(x.size), x.size))
    base = slicedkern.kernel_sum(x, y, w, kernel)
    close(slicedkern.kernel_sum(x, y[key_perm], w[key_perm], kernel), base, scan_atol(x, y, w, kernel))
    # queries are evaluated independently: permuting them permutes the rows exactly
    np.testing.assert_array_equal(slicedkern.kernel_sum(x[query_perm], y, w, kernel), base[query_perm])


@SETTINGS
@given(problems(columns=False), st.floats(0.05, 3.0))
def test_hat_attention_is_a_normalised_kernel_sum(problem, b):
    """hat_attention with the default "count" normaliser = kernel_sum(Hat(b)) / m."""
    x, y, w = problem
    out = slicedkern.hat_attention(x, y, w[:, None], b)[:, 0]
    close(out, slicedkern.kernel_sum(x, y, w, Hat(b)) / y.size, scan_atol(x, y, w, Hat(b)))


@SETTINGS
@given(problems(columns=False))
def test_relu_attention_is_a_ratio_of_kernel_sums(problem):
    """relu_attention(center=False) = ReLU sum of v over the |.| sum of ones, clamped at eps."""
    from slicedkern.kernels import Abs, ReLU
    x, y, w = problem
    num = slicedkern.kernel_sum(x, y, w, ReLU())
    den = slicedkern.kernel_sum(x, y, np.ones_like(y), Abs())
    out = slicedkern.relu_attention(x, y, w[:, None], center=False)[:, 0]
    expected = num / np.maximum(den, 1e-6)
    atol = (scan_atol(x, y, w, ReLU()) + np.abs(expected) * scan_atol(x, y, np.ones_like(y), Abs())) \
        / np.maximum(den, 1e-6)
    close(out, expected, atol)
