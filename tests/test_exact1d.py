"""Exact 1-D statistics (``energy_distance``, ``mmd`` on 1-D samples) against exact and long-double oracles.

Two oracles, both independent of the code under test:

* :func:`exact_energy_distance` / :func:`exact_mmd`: the pairwise definitions in rational arithmetic
  (``fractions.Fraction``), exact, for small samples.
* :func:`oracle_energy_distance`: the CDF formula ``2 sum_k D_k^2 (z_(k+1) - z_(k))`` with the running
  sums of the CDF gap taken in integer arithmetic (exact) and the rest in long double, for samples
  of any size (scripts/energy_distance_1d.py uses it up to n = 1e7). A plain long-double running sum
  is *not* good enough as an oracle: for nearly equal samples its rounding, of the order of
  ``eps_ld F``, is ``1e-15`` relative to ``D`` at n = 1e6.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
from _helpers import M, N, assert_meta, to_numpy

from slicedkern import energy_distance, mmd, vjp
from slicedkern.backends import ops_for
from slicedkern.kernels import Abs, Hat, HatMixture, PiecewiseLinear, ReLU

#: The accuracy target: relative error against the exact value, float64, every case.
TARGET = 1e-14


def _scalars(x, y):
    """Batches of 1-D samples are laid out (..., n, 1) by the public functions; a plain (n,) is one pair."""
    return (x, y) if x.ndim == 1 and y.ndim == 1 else (x[..., None], y[..., None])


def energy_distance_1d(x, y, x_weights=None, y_weights=None):
    """:func:`slicedkern.energy_distance` on samples laid out (..., n)."""
    x, y = _scalars(x, y)
    return energy_distance(x, y, x_weights=x_weights, y_weights=y_weights)


def mmd_1d(x, y, kernel, estimator="v"):
    """:func:`slicedkern.mmd` on samples laid out (..., n)."""
    x, y = _scalars(x, y)
    return mmd(x, y, kernel, estimator=estimator)


# ------------------------------------------------------------------------------------------ oracles
def _fractions(v):
    return [Fraction(float(t)) for t in np.ravel(v)]


def _probabilities(w, size):
    w = [Fraction(1)] * size if w is None else _fractions(w)
    total = sum(w)
    return [t / total for t in w]


def exact_energy_distance(x, y, x_weights=None, y_weights=None) -> Fraction:
    """``2 E|X - Y| - E|X - X'| - E|Y - Y'|`` from the pairwise definition, in exact arithmetic."""
    xs, ys = _fractions(x), _fractions(y)
    a, b = _probabilities(x_weights, len(xs)), _probabilities(y_weights, len(ys))

    def mean_abs(u, p, v, q):
        return sum(pi * qj * abs(ui - vj) for ui, pi in zip(u, p) for vj, qj in zip(v, q))

    return 2 * mean_abs(xs, a, ys, b) - mean_abs(xs, a, xs, a) - mean_abs(ys, b, ys, b)


def exact_mmd(x, y, kernel) -> tuple[Fraction, Fraction]:
    """Squared MMD of the profile ``kernel`` (its even part) from the pairwise definitions, exactly:
    ``(V, U)``, the biased and the unbiased estimator."""
    knots = [(Fraction(t), Fraction(c)) for t, c in zip(kernel.knots, kernel.coeffs)]
    slope, intercept = Fraction(kernel.slope), Fraction(kernel.intercept)
    cache: dict = {}

    def g(r):
        return intercept + slope * r + sum(c * max(r - t, 0) for t, c in knots)

    def f(r):                       # the even part, the only one a symmetric MMD sees
        if r not in cache:
            cache[r] = (g(r) + g(-r)) / 2
        return cache[r]

    xs, ys = _fractions(x), _fractions(y)
    n, m = len(xs), len(ys)
    kxx = sum(f(u - v) for u in xs for v in xs)
    kyy = sum(f(u - v) for u in ys for v in ys)
    cross = sum(f(u - v) for u in xs for v in ys) / (n * m)
    v_stat = kxx / n ** 2 + kyy / m ** 2 - 2 * cross
    if min(n, m) < 2:
        return v_stat, None
    u_stat = (kxx - n * f(0)) / (n * (n - 1)) + (kyy - m * f(0)) / (m * (m - 1)) - 2 * cross
    return v_stat, u_stat


def _mmd_close(got, x, y, kernel, estimator) -> bool:
    """V: relative error within the target. U subtracts the diagonal from O(1) within-sample means
    and can be much smaller than they are (or negative); its error is judged against ``|U| + |V|``."""
    v_stat, u_stat = exact_mmd(x, y, kernel)
    got = Fraction(float(got if isinstance(got, (np.generic, float)) else to_numpy(got)))
    if estimator == "v":
        return abs(got - v_stat) <= TARGET * abs(v_stat)
    return abs(got - u_stat) <= TARGET * (abs(u_stat) + abs(v_stat))


def _as_integers(v):
    """Integers ``k_i`` and an exponent ``e`` with ``v_i = k_i 2^e`` exactly (float64 ``v``)."""
    pairs = [float(t).as_integer_ratio() for t in np.ravel(v)]
    shift = max(d.bit_length() - 1 for _, d in pairs)
    return [num << (shift - (d.bit_length() - 1)) for num, d in pairs]


def oracle_energy_distance(x, y, x_weights=None, y_weights=None) -> np.longdouble:
    """Energy distance of 1-D NumPy float64 samples, ``2 sum_k D_k^2 (z_(k+1) - z_(k))``.

    The CDF gap ``D_k`` is formed from exact integer running sums (unweighted: the counts,
    ``D_k = (i_k m - j_k n) / (n m)``; weighted: ``E_k = T A_k - S B_k`` over the weights as integers
    on a common power-of-two scale) and rounded once to long double; the spacings and the final sum
    are long double. Its error is of the order of ``eps_ld = 5e-20`` (``1e-18`` at n = 1e7).
    """
    x, y = np.ravel(x), np.ravel(y)
    n, m = x.size, y.size
    z = np.concatenate([x, y])
    order = np.argsort(z, kind="stable")
    zs = z[order].astype(np.longdouble)
    if x_weights is None and y_weights is None:
        i = np.cumsum(order < n)
        e = i * m - (np.arange(1, n + m + 1) - i) * n                 # int64, exact
        d = e.astype(np.longdouble) / (np.longdouble(n) * np.longdouble(m))
    else:
        a = _as_integers(np.ones(n) if x_weights is None else x_weights)
        b = _as_integers(np.ones(m) if y_weights is None else y_weights)
        s, t = sum(a), sum(b)
        st, bits, e = s * t, 128, 0
        d = np.empty(n + m, dtype=np.longdouble)
        for start in range(0, n + m, 1 << 20):          # in chunks: 2e7 Python ints at once is GBs
            for pos, k in enumerate(order[start:start + (1 << 20)].tolist(), start):
                e += a[k] * t if k < n else -b[k - n] * s
                # D_k = E_k / (S T) to 128 bits, then rounded once to the long-double mantissa
                d[pos] = np.longdouble((e << bits) // st)
        d = d * np.longdouble(2.0) ** -bits
    d = d[:-1]
    return 2 * np.sum(d * d * (zs[1:] - zs[:-1]))


def rel_error(value, reference) -> float:
    """``|value - reference| / |reference|`` without rounding ``value`` (an array, a NumPy scalar of
    any precision, or a float) or ``reference`` (a Fraction or a long double)."""
    if not isinstance(value, (np.generic, float)):
        value = np.asarray(to_numpy(value))[()]
    value = Fraction(*value.as_integer_ratio())
    reference = reference if isinstance(reference, Fraction) else Fraction(*reference.as_integer_ratio())
    return float(abs(value - reference) / abs(reference))


# ------------------------------------------------------------------------------------------- data
def _case(name, rng, n=N, m=M):
    """Named hard cases: ``(x, y, x_weights, y_weights)`` as NumPy float64."""
    x = rng.normal(size=n)
    y = rng.normal(size=m) + 0.3
    a = b = None
    if name == "ties":                      # few dyadic values: many exact ties within and across
        x, y = np.round(4 * x) / 4, np.round(4 * y - 1) / 4
    elif name == "weighted":
        a, b = rng.random(n), rng.random(m)
    elif name == "ties_weighted":
        x, y = np.round(2 * x) / 2, np.round(2 * y) / 2
        a, b = rng.random(n), rng.random(m)
    elif name == "skewed_weights":          # weights over ~60 binades, some zero
        a, b = rng.random(n) ** 20, rng.lognormal(sigma=6.0, size=m)
        a[::5] = 0.0
    elif name == "one_weighted":
        b = rng.random(m) * 1e-3
    elif name == "nearly_equal":            # y = x up to a few ulps: D is tiny everywhere
        y = (x + rng.normal(size=n) * 1e-15)[:m] if m <= n else np.concatenate([x, x])[:m]
    elif name == "nearly_equal_weighted":
        y = x * (1 + 1e-15 * rng.normal(size=n))
        a = rng.random(n)
        b = a * (1 + 1e-12 * rng.normal(size=n))
    elif name == "single_points":
        x, y = x[:1], y[:1]
    return x, y, a, b


CASES = ["plain", "ties", "weighted", "ties_weighted", "skewed_weights", "one_weighted", "nearly_equal",
         "nearly_equal_weighted", "single_points"]


def _no_numba(monkeypatch):
    """Force the array-API path on NumPy (the path NumPy takes without numba): the NumPy row of the
    backend registry then offers no compiled energy distance."""
    monkeypatch.setattr(type(ops_for(np)), "energy_distance_rows", lambda self, *args: None)


def _numba_or_skip():
    pytest.importorskip("numba")


# ------------------------------------------------------------------------------------ oracles first
def test_oracles_agree_with_each_other(rng):
    """The long-double CDF oracle equals the exact pairwise definition (which checks both)."""
    for name in ("plain", "ties_weighted", "skewed_weights", "nearly_equal_weighted"):
        x, y, a, b = _case(name, rng)
        exact = exact_energy_distance(x, y, a, b)
        assert rel_error(oracle_energy_distance(x, y, a, b), exact) < 1e-17, name


# --------------------------------------------------------------------------------- values, backends
@pytest.mark.parametrize("name", CASES)
def test_matches_exact_definition(xp, name, rng):
    x, y, a, b = _case(name, rng, n=N, m=M if name != "nearly_equal_weighted" else N)
    exact = exact_energy_distance(x, y, a, b)
    args = [xp.asarray(v) if v is not None else None for v in (x, y, a, b)]
    out = energy_distance_1d(*args)
    assert_meta(out, backend=xp, shape=(), dtype=xp.dtype("float64"))
    assert rel_error(out, exact) <= TARGET


@pytest.mark.parametrize("name", ["plain", "ties_weighted", "nearly_equal"])
def test_numpy_generic_path_matches_exact(name, rng, monkeypatch):
    _no_numba(monkeypatch)
    x, y, a, b = _case(name, rng)
    assert rel_error(energy_distance_1d(x, y, a, b), exact_energy_distance(x, y, a, b)) <= TARGET


@pytest.mark.parametrize("path", ["numba", "generic"])
@pytest.mark.parametrize("name,n,m", [("nearly_equal", 200_000, 200_000), ("ties", 150_000, 60_001),
                                      ("nearly_equal_weighted", 60_000, 60_000),
                                      ("skewed_weights", 50_000, 30_000)])
def test_large_samples_match_long_double_oracle(path, name, n, m, rng, monkeypatch):
    """Where a plain running sum of the normalised signed weights is off by far more than the
    target (checked here too, so that the case is known to be a hard one)."""
    if path == "numba":
        _numba_or_skip()
    else:
        _no_numba(monkeypatch)
    x, y, a, b = _case(name, rng, n=n, m=m)
    reference = oracle_energy_distance(x, y, a, b)
    assert rel_error(energy_distance_1d(x, y, a, b), reference) <= 1e-15
    if name.startswith("nearly_equal"):
        pa = np.full(n, 1.0 / n) if a is None else a / a.sum()
        pb = np.full(m, 1.0 / m) if b is None else b / b.sum()
        z = np.concatenate([x, y])
        order = np.argsort(z, kind="stable")
        d = np.cumsum(np.concatenate([pa, -pb])[order])[:-1]
        # running sums in order (np.cumsum), not np.dot: a BLAS dot sums in blocks, and on the
        # machine of 2026-11-28 its error here was 1.5e-14, a running sum's 1.2e-12
        plain = 2 * np.cumsum(d * d * np.diff(z[order]))[-1]
        assert rel_error(plain, reference) > 2 * TARGET          # misses the target


def test_matches_scipy_squared(rng):
    stats = pytest.importorskip("scipy.stats")
    for name in ("plain", "ties_weighted", "skewed_weights"):
        x, y, a, b = _case(name, rng, n=300, m=170)
        expected = stats.energy_distance(x, y, a, b) ** 2        # SciPy returns sqrt(2 int (F - G)^2)
        np.testing.assert_allclose(energy_distance_1d(x, y, a, b), expected, rtol=1e-12)


def test_float32_inputs_keep_dtype_and_compute_in_float64(xp, rng):
    x, y, a, b = _case("weighted", rng)
    x32, y32 = x.astype(np.float32), y.astype(np.float32)
    out = energy_distance_1d(xp.asarray(x32, "float32"), xp.asarray(y32, "float32"))
    assert_meta(out, backend=xp, shape=(), dtype=xp.dtype("float32"))
    exact = exact_energy_distance(x32.astype(np.float64), y32.astype(np.float64))
    assert rel_error(out, exact) <= 2.0 ** -24           # one rounding to float32 at the end


def test_batches_broadcast_and_match_rows(xp, rng):
    x = rng.normal(size=(2, 1, N))
    y = rng.normal(size=(3, M)) * 1.5
    b = rng.random(size=(1, M))
    out = energy_distance_1d(xp.asarray(x), xp.asarray(y), None, xp.asarray(b))
    assert_meta(out, backend=xp, shape=(2, 3), dtype=xp.dtype("float64"))
    got = to_numpy(out)
    for i, j in itertools.product(range(2), range(3)):
        exact = exact_energy_distance(x[i, 0], y[j], None, b[0])
        assert rel_error(got[i, j], exact) <= TARGET


@pytest.mark.parametrize("weighted", [False, True])
def test_numba_and_generic_paths_agree_on_batches(weighted, rng, monkeypatch):
    _numba_or_skip()
    x = rng.normal(size=(4, 3, 500))
    y = np.round(rng.normal(size=(3, 700)), 2)
    a, b = (rng.random(size=(4, 1, 500)), rng.random(size=700)) if weighted else (None, None)
    fast = energy_distance_1d(x, y, a, b)
    _no_numba(monkeypatch)
    generic = energy_distance_1d(x, y, a, b)
    np.testing.assert_allclose(fast, generic, rtol=1e-15, atol=0)


@pytest.mark.parametrize("regime", ["local_repairs", "crowded_fallback", "signed_zeros_and_ties"])
def test_packed_sort_keeps_weights_with_their_points(regime, rng):
    """The weighted NumPy path sorts keys that pack a value's top bits with its index. Values that
    agree in those bits come out in index order and are repaired locally (small groups) or by a
    stable argsort (crowded rows); either way every weight must follow its point, which the
    long-double oracle checks."""
    _numba_or_skip()
    n = 40_000
    if regime == "local_repairs":      # groups of 4 values within a few hundred ulps of each other
        v = 1.0 + (np.arange(n) // 4) * 2.0 ** -30 + rng.integers(0, 2 ** 10, size=n) * 2.0 ** -52
    elif regime == "crowded_fallback":  # every value within 2^14 ulps: one huge group
        v = 1.0 + rng.integers(0, 2 ** 14, size=n) * 2.0 ** -52
    else:
        v = rng.choice(np.array([-0.0, 0.0, -1e-300, 5e-324, 1.0, -2.0]), size=n)
    v = rng.permutation(v)[None, :]
    w = rng.random(size=(1, n))
    y = rng.permutation(v[0])[: n // 2] * (1 + 2.0 ** -52)
    b = rng.random(n // 2)
    reference = oracle_energy_distance(v[0], y, w[0], b)
    assert rel_error(energy_distance_1d(v[0], y, w[0], b), reference) <= 1e-15


def test_weight_scale_and_zero_weights(xp, rng):
    """Weights are normalised: scaling by powers of two (exact, down to tiny and up to huge sums)
    changes nothing; other scales are checked against the exact value of the scaled weights; a zero
    weight is a point that is not there."""
    x, y, a, b = _case("weighted", rng)
    a[3] = 0.0
    base = energy_distance_1d(*(xp.asarray(v) for v in (x, y, a, b)))
    exact = exact_energy_distance(x, y, a, b)
    assert rel_error(base, exact) <= TARGET
    for sa, sb in ((2.0 ** 830, 2.0 ** -830), (2.0 ** -1000, 1.0), (1.0, 2.0 ** 1000)):
        scaled = energy_distance_1d(*(xp.asarray(v) for v in (x, y, a * sa, b * sb)))
        assert rel_error(scaled, exact) <= TARGET
    a7, b3 = a * 1e-3, b * 7.0
    scaled = energy_distance_1d(*(xp.asarray(v) for v in (x, y, a7, b3)))
    assert rel_error(scaled, exact_energy_distance(x, y, a7, b3)) <= TARGET
    dropped = energy_distance_1d(*(xp.asarray(v) for v in (np.delete(x, 3), y, np.delete(a, 3), b)))
    assert rel_error(dropped, exact) <= TARGET


def test_non_finite_rows_give_nan_and_leave_others(xp, rng):
    x = rng.normal(size=(4, N))
    y = rng.normal(size=(4, M))
    b = rng.random(size=(4, M))
    x[1, 3] = np.nan
    y[2, 0] = np.inf
    b[3, 5] = np.nan
    out = to_numpy(energy_distance_1d(xp.asarray(x), xp.asarray(y), None, xp.asarray(b)))
    assert np.isnan(out[1:]).all()
    assert rel_error(out[0], exact_energy_distance(x[0], y[0], None, b[0])) <= TARGET


def test_identical_samples_give_zero_and_symmetry(rng):
    x, y, a, b = _case("ties_weighted", rng)
    # exactly zero for unweighted samples (integer running sums); weighted, the remainders of the
    # exact running sum leave at most ~eps^2 of the data's scale
    assert 0.0 <= float(energy_distance_1d(x, x, a, a)) <= 1e-30
    assert float(energy_distance_1d(x, x)) == 0.0
    assert float(energy_distance_1d(x, rng.permutation(x))) == 0.0
    np.testing.assert_allclose(energy_distance_1d(x, y, a, b), energy_distance_1d(y, x, b, a), rtol=1e-15)


def test_inputs_unmodified_and_results_reproducible(rng):
    x, y, a, b = _case("weighted", rng, n=2000, m=1500)
    copies = [v.copy() for v in (x, y, a, b)]
    first = energy_distance_1d(x, y, a, b)
    second = energy_distance_1d(x, y, a, b)
    assert first.tobytes() == second.tobytes()
    for v, c in zip((x, y, a, b), copies):
        assert np.array_equal(v, c)


def test_errors_name_the_arguments(rng):
    x, y = rng.normal(size=5), rng.normal(size=4)
    with pytest.raises(ValueError, match="'x'"):
        energy_distance_1d(np.zeros(0), y)
    with pytest.raises(ValueError, match="'y'"):
        energy_distance(x, np.float64(1.0) + np.zeros(()))
    with pytest.raises(ValueError, match="'x_weights'"):
        energy_distance_1d(x, y, np.ones(4))
    with pytest.raises(ValueError, match="'y_weights'.*non-negative"):
        energy_distance_1d(x, y, None, np.array([1.0, -1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="'x_weights'.*positive sum"):
        energy_distance_1d(x, y, np.zeros(5))
    with pytest.raises(ValueError, match="broadcast"):
        energy_distance_1d(np.zeros((2, 5)), np.zeros((3, 4)))
    with pytest.raises(TypeError, match="'y'.*floating"):
        energy_distance_1d(x, np.arange(4))
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="different array libraries"):
        energy_distance_1d(x, torch.asarray(y))


# ---------------------------------------------------------------------------------------- gradients
def _smooth_case(rng, n=9, m=7):
    """Distinct points (no ties, so the statistic is differentiable) and positive weights."""
    x = rng.normal(size=n)
    y = rng.normal(size=m) + 0.4
    return x, y, rng.random(n) + 0.5, rng.random(m) + 0.5


def _finite_differences(f, args, h=1e-6):
    grads = []
    for k, v in enumerate(args):
        if v is None:
            grads.append(None)
            continue
        g = np.zeros_like(v)
        for idx in np.ndindex(v.shape):
            up = [a.copy() if a is not None else None for a in args]
            down = [a.copy() if a is not None else None for a in args]
            up[k][idx] += h
            down[k][idx] -= h
            g[idx] = (float(f(*up)) - float(f(*down))) / (2 * h)
        grads.append(g)
    return grads


@pytest.mark.parametrize("weighted", [False, True])
def test_numpy_vjp_matches_finite_differences(weighted, rng):
    """slicedkern.vjp pulls the exact forward back through the sort-scan of the same statistic."""
    x, y, a, b = _smooth_case(rng)
    kw = {"x_weights": a, "y_weights": b} if weighted else {}
    value, pullback = vjp(energy_distance, x, y, **kw)
    assert float(value) == float(energy_distance(x, y, **kw))
    grads = pullback(np.asarray(1.5))
    expected = _finite_differences(lambda x_, y_: energy_distance(x_, y_, **kw), (x, y))
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, 1.5 * want, rtol=1e-6, atol=1e-8)


def test_numpy_vjp_batches_and_broadcast_shapes(rng):
    x = rng.normal(size=(2, 1, 6, 1))
    y = rng.normal(size=(3, 5, 1))
    b = rng.random(size=5) + 0.1
    g = rng.normal(size=(2, 3))
    value, pullback = vjp(energy_distance, x, y, y_weights=b)
    dx, dy = pullback(g)
    assert value.shape == (2, 3) and dx.shape == x.shape and dy.shape == y.shape

    def loss(x_, y_):
        return np.sum(g * energy_distance(x_, y_, y_weights=b))

    fx, fy = _finite_differences(loss, (x, y))
    for got, want in ((dx, fx), (dy, fy)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


def test_torch_autograd_gradcheck(rng):
    torch = pytest.importorskip("torch")
    x, y, a, b = (torch.asarray(v, dtype=torch.float64).requires_grad_() for v in _smooth_case(rng))
    assert torch.autograd.gradcheck(lambda *t: energy_distance_1d(*t), (x, y, a, b), eps=1e-6, atol=1e-7)
    assert torch.autograd.gradcheck(lambda *t: energy_distance_1d(*t), (x, y), eps=1e-6, atol=1e-7)


def test_torch_autograd_matches_numpy_vjp(rng):
    torch = pytest.importorskip("torch")
    x = rng.normal(size=(3, 40))
    y = rng.normal(size=(3, 30)) + 0.05      # no ties: at a tie the two derivatives may differ
    b = rng.random(size=(3, 30)) + 0.1
    _, pullback = vjp(energy_distance, x[..., None], y[..., None], y_weights=b)
    expected = [g[..., 0] for g in pullback(np.ones(3))]
    tensors = [torch.asarray(v).requires_grad_() for v in (x, y)]
    energy_distance_1d(*tensors, None, torch.asarray(b)).sum().backward()
    for t, want in zip(tensors, expected):
        np.testing.assert_allclose(t.grad.numpy(), want, rtol=1e-10, atol=1e-12)


def test_jax_grad_and_jit(rng):
    jax = pytest.importorskip("jax")
    from _helpers import jax_x64
    x, y, a, b = _smooth_case(rng)
    _, pullback = vjp(energy_distance, x, y, x_weights=a, y_weights=b)
    expected = pullback(np.ones(()))
    with jax_x64(True):
        import jax.numpy as jnp
        args = [jnp.asarray(v) for v in (x, y, a, b)]
        grads = jax.grad(lambda *t: energy_distance_1d(*t), argnums=(0, 1))(*args)
        for got, want in zip(grads, expected):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-10, atol=1e-12)
        jitted = jax.jit(energy_distance_1d)(*args)
        assert rel_error(jitted, exact_energy_distance(x, y, a, b)) <= TARGET


# ---------------------------------------------------------------------------------------------- MMD
MMD_KERNELS = [
    pytest.param(Hat(0.8), id="hat"),
    pytest.param(-Abs(), id="energy"),
    pytest.param(ReLU(), id="relu"),
    pytest.param(HatMixture([0.3, 1.5], [1.0, 0.25]), id="mixture"),
    pytest.param(HatMixture([0.3, 1.5], [1.0, -0.25]), id="signed_mixture"),
    pytest.param(PiecewiseLinear((-0.5, 0.25, 1.0), (1.5, -2.0, 0.75), slope=-0.5, intercept=0.25),
                 id="general"),
]


def _mmd_case(rng, n=N, m=M):
    x = np.round(rng.normal(size=n), 1)                 # ties within and across the samples
    y = np.round(rng.normal(size=m) + 0.2, 1)
    return x, y


@pytest.mark.parametrize("estimator", ["v", "u"])
@pytest.mark.parametrize("kernel", MMD_KERNELS)
def test_mmd_matches_exact_definition(xp, kernel, estimator, rng):
    x, y = _mmd_case(rng)
    out = mmd_1d(xp.asarray(x), xp.asarray(y), kernel, estimator=estimator)
    assert_meta(out, backend=xp, shape=(), dtype=xp.dtype("float64"))
    assert _mmd_close(out, x, y, kernel, estimator)


@pytest.mark.parametrize("estimator", ["v", "u"])
def test_mmd_nearly_equal_samples_hat(estimator, rng):
    """Samples equal up to a few ulps: the statistic is ~1e-30 of the kernel's scale and must still
    be right to the target (a difference of kernel sums cannot get a single digit of it)."""
    x = rng.normal(size=60)
    y = x[::-1] * (1 + 1e-15 * rng.normal(size=60))
    kernel = HatMixture([0.5, 2.0], [1.0, 0.5])
    assert _mmd_close(mmd_1d(x, y, kernel, estimator=estimator), x, y, kernel, estimator)


def test_mmd_negative_abs_is_the_energy_distance(rng):
    x, y, _, _ = _case("ties", rng, n=3000, m=2000)
    np.testing.assert_allclose(mmd_1d(x, y, -Abs()), energy_distance_1d(x, y), rtol=1e-15)
    np.testing.assert_allclose(mmd_1d(x, y, 3.0 * ReLU()), -1.5 * energy_distance_1d(x, y), rtol=1e-15)


def test_mmd_batches_broadcast(xp, rng):
    x = rng.normal(size=(2, 1, N))
    y = np.round(rng.normal(size=(3, M)), 1)
    out = to_numpy(mmd_1d(xp.asarray(x), xp.asarray(y), Hat(1.0), estimator="u"))
    assert out.shape == (2, 3)
    for i, j in ((0, 0), (1, 2)):
        assert _mmd_close(out[i, j], x[i, 0], y[j], Hat(1.0), "u")


def test_mmd_non_finite_rows_and_errors(rng):
    x = rng.normal(size=(2, 6))
    x[0, 2] = np.inf
    out = mmd_1d(x, rng.normal(size=5), Hat(1.0))
    assert np.isnan(out[0]) and np.isfinite(out[1])
    with pytest.raises(TypeError, match="'kernel'"):
        mmd_1d(x, x, lambda r: r)
    with pytest.raises(ValueError, match="'estimator'"):
        mmd_1d(x, x, Hat(1.0), estimator="w")
    with pytest.raises(ValueError, match="at least 2"):
        mmd_1d(np.zeros(1), np.zeros(3), Hat(1.0), estimator="u")


def test_mmd_torch_gradcheck(rng):
    torch = pytest.importorskip("torch")
    x, y, _, _ = _smooth_case(rng)
    tx, ty = (torch.asarray(v).requires_grad_() for v in (x, y))
    for estimator in ("v", "u"):
        assert torch.autograd.gradcheck(lambda a, b: mmd_1d(a, b, Hat(0.7), estimator=estimator), (tx, ty),
                                        eps=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------ slices of R^d
def test_each_slice_of_the_sliced_statistics_is_exact(rng):
    """A slice along a coordinate axis is the 1-D statistic of that coordinate: the sliced energy
    distance and MMD in R^3 with directions e_1 (and e_1, e_2) meet the exact 1-D oracles."""
    from math import gamma, pi, sqrt
    kappa = gamma(3 / 2) / (sqrt(pi) * gamma(2))
    x = rng.normal(size=(3000, 3))
    y = x[::-1] * (1 + 1e-15 * rng.normal(size=(3000, 3)))         # nearly equal: the hard case
    a, b = rng.random(3000), rng.random(3000)
    theta = np.eye(3)[:2]
    out = energy_distance(x, y, directions=theta, x_weights=a, y_weights=b, method="sliced")
    expected = sum(oracle_energy_distance(x[:, k], y[:, k], a, b) for k in range(2)) / 2 / np.longdouble(kappa)
    assert rel_error(out, expected) <= TARGET
    xs, ys = np.round(x[:40], 1), np.round(y[:30] + 0.1, 1)
    kernel = Hat(0.8)
    for estimator in ("v", "u"):
        got = mmd(xs, ys, kernel, directions=theta[:1], estimator=estimator, method="sliced")
        assert _mmd_close(got, xs[:, 0], ys[:, 0], kernel, estimator)
