"""QMC slicing designs (``slicedkern.directions(..., method="design")``) and the family the sliced ops
draw for an integer number of slices: unit norms, antipodal symmetry, one design per (P, d) up to a
seeded rotation, unbiasedness over rotations, and every sliced op on every backend."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _helpers import assert_meta, names_argument, to_numpy

from slicedkern.kernels import Abs, Hat, ReLU
from slicedkern.sliced import _design, directions, energy_distance, mmd, sliced_attention, sliced_kernel_sum
from slicedkern.sliced.directions import default_method, resolve_directions

#: (P, d): closed forms (d = 1, 2, P <= 2 d), odd P, a descent, shipped sizes.
SIZES = [(6, 1), (9, 2), (5, 4), (8, 3), (7, 3), (33, 5), (64, 3), (256, 10), (1024, 3)]


def _distance_sum(theta):
    """``sum_{i != j} |theta_i - theta_j|``: what a design makes large."""
    g = np.clip(theta @ theta.T, -1.0, 1.0)
    return float(np.sum(np.sqrt(2.0 - 2.0 * g)))


@pytest.mark.parametrize("n_slices, dim", SIZES)
def test_design_unit_norms_and_antipodal_pairs(n_slices, dim):
    base = _design.unrotated_design(n_slices, dim)
    theta = directions(n_slices, dim, method="design", seed=3)
    for t in (base, theta):
        assert t.shape == (n_slices, dim) and t.dtype == np.float64
        np.testing.assert_allclose(np.linalg.norm(t, axis=1), 1.0, rtol=0, atol=1e-14)
        pairs = n_slices // 2
        np.testing.assert_allclose(t[0:2 * pairs:2], -t[1:2 * pairs:2], rtol=0, atol=1e-15)
    assert not base.flags.writeable                        # shared through the cache


@pytest.mark.parametrize("n_slices, dim", [(7, 3), (33, 5), (1, 4)])
def test_design_odd_count_is_the_next_even_design_truncated(n_slices, dim):
    """Odd ``P``: the design of ``P + 1`` without its last row (docs/directions.rst)."""
    for seed in (0, 1):
        odd = directions(n_slices, dim, method="design", seed=seed)
        even = directions(n_slices + 1, dim, method="design", seed=seed)
        np.testing.assert_array_equal(odd, even[:n_slices])


def test_design_determinism_per_seed():
    a, b = directions(64, 5, method="design", seed=12), directions(64, 5, method="design", seed=12)
    np.testing.assert_array_equal(a, b)
    c = directions(64, 5, method="design", seed=13)
    assert np.max(np.abs(a - c)) > 0.1                    # another rotation
    # the same seed gives the same directions through a Generator too
    np.testing.assert_array_equal(a, directions(64, 5, method="design", seed=np.random.default_rng(12)))


@pytest.mark.parametrize("n_slices, dim", [(64, 3), (48, 6), (256, 10)])
def test_design_is_one_point_set_up_to_rotation(n_slices, dim):
    grams = [(t := directions(n_slices, dim, method="design", seed=s)) @ t.T for s in range(3)]
    base = _design.unrotated_design(n_slices, dim)
    for gram in grams:
        np.testing.assert_allclose(gram, base @ base.T, rtol=0, atol=1e-12)


def test_design_beyond_one_block():
    """``P > MAX_BLOCK``: blocks of MAX_BLOCK rows, each the design of its size under a fixed rotation."""
    block, dim = _design.MAX_BLOCK, 3
    n_slices = 2 * block + 7
    base = _design.unrotated_design(n_slices, dim)
    assert base.shape == (n_slices, dim)
    np.testing.assert_allclose(np.linalg.norm(base, axis=1), 1.0, rtol=0, atol=1e-14)
    np.testing.assert_allclose(base[0:n_slices - 1:2], -base[1:n_slices - 1:2], rtol=0, atol=1e-15)
    first = _design.unrotated_design(block, dim)
    np.testing.assert_array_equal(base[:block], first)
    second = base[block:2 * block]
    np.testing.assert_allclose(second @ second.T, first @ first.T, rtol=0, atol=1e-12)
    assert np.max(np.abs(second - first)) > 0.1                      # rotated, not repeated
    np.testing.assert_allclose(base[2 * block:] @ base[2 * block:].T,
                               _design.unrotated_design(7, dim) @ _design.unrotated_design(7, dim).T, atol=1e-12)
    np.testing.assert_array_equal(directions(n_slices, dim, method="design", seed=2),
                                  directions(n_slices + 1, dim, method="design", seed=2)[:n_slices])


def test_design_is_rebuilt_identically():
    """The descent starts from a fixed seed: clearing the cache gives the same design bit for bit."""
    before = np.array(_design.unrotated_design(40, 4))
    _design._cached_design.cache_clear()
    np.testing.assert_array_equal(_design.unrotated_design(40, 4), before)
    np.testing.assert_allclose(_design.build_half_design(20, 4), before[0::2], rtol=0, atol=1e-15)


@pytest.mark.parametrize("n_slices, dim", [(64, 3), (128, 5), (256, 10)])
def test_design_spreads_wider_than_orthogonal_frames(n_slices, dim):
    design = _distance_sum(_design.unrotated_design(n_slices, dim))
    frames = max(_distance_sum(directions(n_slices, dim, method="orthogonal", seed=s)) for s in range(8))
    assert design > frames


@pytest.mark.parametrize("n_slices, dim", [(512, 3), (1024, 10)])
def test_shipped_design_is_a_polished_descent(n_slices, dim):
    """A shipped size is read from the package data, and is at least as spread as the on-the-fly
    descent would be."""
    assert f"P{n_slices}_d{dim}" in _design._shipped()
    shipped = _design.unrotated_design(n_slices, dim)
    half = _design.build_half_design(n_slices // 2, dim, steps=60)
    built = np.empty_like(shipped)
    built[0::2], built[1::2] = half, -half
    assert _distance_sum(shipped) >= _distance_sum(built)


def test_design_is_unbiased_over_rotations():
    """The mean over many rotations of a coarse design converges to the exact energy distance.

    The tolerance is four standard errors of the observed spread of the estimates (no constant
    tuned to pass); a fixed, un-rotated design is biased by much more than that.
    """
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(12, 3)), rng.normal(size=(10, 3)) + [0.7, 0.0, 0.0]
    exact = float(energy_distance(x, y, method="exact"))
    n_rot, n_slices = 4000, 4
    theta = np.concatenate([directions(n_slices, 3, method="design", seed=s) for s in range(n_rot)])
    kappa = math.gamma(1.5) / (math.sqrt(math.pi) * math.gamma(2.0))
    per_slice = energy_distance((x @ theta.T).T[..., None], (y @ theta.T).T[..., None]) / kappa
    estimates = per_slice.reshape(n_rot, n_slices).mean(axis=1)
    spread = estimates.std(ddof=1)
    assert spread > 0
    assert abs(estimates.mean() - exact) < 4.0 * spread / math.sqrt(n_rot)
    fixed = float(energy_distance(x, y, directions=_design.unrotated_design(n_slices, 3), method="sliced"))
    assert abs(fixed - exact) > 4.0 * spread / math.sqrt(n_rot)


def test_design_errors_name_the_argument():
    with pytest.raises(ValueError, match="method"):
        directions(8, 3, method="designs")
    with pytest.raises(ValueError, match="n_slices"):
        directions(0, 3, method="design")
    with pytest.raises(TypeError, match="dim"):
        directions(8, 3.0, method="design")
    with pytest.raises(ValueError) as info:
        energy_distance(np.zeros((4, 3)), np.ones((4, 3)), directions=0)
    assert names_argument(str(info.value), "directions")


# ------------------------------------------------------------------------------ the ops' default
def test_default_family_of_the_ops():
    # a profile with an odd part: the antipodal design (its pairs cancel the odd part)
    assert all(default_method(p, d, even=False) == "design" for p, d in ((1, 3), (8, 10), (64, 100)))
    # an even profile: the projective set (the design of 2 P at the cost of P)
    assert all(default_method(p, d) == "projective" for p, d in ((1, 3), (8, 10), (256, 3), (1024, 100)))
    import array_api_compat.numpy as xp
    for n_slices, dim, even in ((16, 3, True), (64, 50, True), (8, 10, False), (8, 10, True)):
        drawn = resolve_directions(n_slices, dim, xp=xp, device="cpu", work=np.float64, seed=5, even=even)
        method = default_method(n_slices, dim, even=even)
        np.testing.assert_array_equal(drawn, directions(n_slices, dim, method=method, seed=5))


def test_projective_at_most_d_slices_is_one_frame():
    """``P <= d``: the design of 2P is the cross-polytope, so the projective set is P orthonormal
    directions, as the first frame of ``"orthogonal"``."""
    theta = directions(7, 10, method="projective", seed=0)
    np.testing.assert_allclose(theta @ theta.T, np.eye(7), rtol=0, atol=1e-14)


def test_ops_pick_the_family_by_the_profile():
    """An integer P gives the antipodal design for ReLU (odd part), the projective set for a hat."""
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(5, 10)), rng.normal(size=(6, 10)), rng.normal(size=(6, 2))
    for kernel, method in ((ReLU(), "design"), (Hat(2.0), default_method(8, 10))):
        theta = directions(8, 10, method=method, seed=1)
        np.testing.assert_allclose(sliced_attention(q, k, v, kernel, directions=8, seed=1),
                                   sliced_attention(q, k, v, kernel, directions=theta), rtol=1e-13, atol=1e-15)
        np.testing.assert_allclose(sliced_kernel_sum(q, k, v, kernel, directions=8, seed=1),
                                   sliced_kernel_sum(q, k, v, kernel, directions=theta), rtol=1e-13, atol=1e-15)


def test_design_like_every_backend(xp):
    like = xp.asarray(np.zeros((2, 3)))
    theta = directions(10, 3, method="design", seed=4, like=like)
    assert_meta(theta, like=like, shape=(10, 3))
    np.testing.assert_array_equal(to_numpy(theta), directions(10, 3, method="design", seed=4))


@pytest.mark.parametrize("family", ["default", "design", "projective"])
def test_every_sliced_op_takes_the_designs(xp, family):
    """``directions=P`` (the default family of the op's profile) and design arrays give the same
    values on every backend, equal to the NumPy results with the same directions."""
    rng = np.random.default_rng(1)
    x, y, w = rng.normal(size=(9, 3)), rng.normal(size=(11, 3)), rng.normal(size=(11,))
    v = rng.normal(size=(11, 2))
    X, Y, W, V = (xp.asarray(a) for a in (x, y, w, v))
    cases = [   # (op, its profile is even, the NumPy op)
        (lambda **kw: sliced_kernel_sum(X, Y, W, Hat(1.0), **kw), True,
         lambda theta: sliced_kernel_sum(x, y, w, Hat(1.0), directions=theta)),
        (lambda **kw: sliced_attention(X, Y, V, ReLU(), normalize="count", **kw), False,
         lambda theta: sliced_attention(x, y, v, ReLU(), normalize="count", directions=theta)),
        (lambda **kw: energy_distance(X, Y, method="sliced", **kw), True,
         lambda theta: energy_distance(x, y, method="sliced", directions=theta)),
        (lambda **kw: mmd(X, Y, Hat(1.5), method="sliced", **kw), True,
         lambda theta: mmd(x, y, Hat(1.5), method="sliced", directions=theta)),
    ]
    for op, even, expected in cases:
        method = default_method(12, 3, even=even) if family == "default" else family
        assert method in ("design", "projective")
        theta = directions(12, 3, method=method, seed=7)
        given = {"directions": 12, "seed": 7} if family == "default" else {"directions": xp.asarray(theta)}
        np.testing.assert_allclose(to_numpy(op(**given)), expected(theta), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n_slices, dim", [(6, 3), (7, 4), (40, 5), (600, 3)])
def test_projective_is_half_of_the_design_of_twice_as_many(n_slices, dim):
    """One of each antipodal pair of the design of 2P, rotated alike: for an even profile the
    estimate of the design of 2P exactly, at the cost of P slices; every P up to rotation alike."""
    half = directions(n_slices, dim, method="projective", seed=4)
    full = directions(2 * n_slices, dim, method="design", seed=4)
    assert half.shape == (n_slices, dim)
    np.testing.assert_allclose(np.linalg.norm(half, axis=1), 1.0, rtol=0, atol=1e-14)
    np.testing.assert_allclose(half, full[0::2], rtol=0, atol=1e-15)
    other = directions(n_slices, dim, method="projective", seed=5)
    np.testing.assert_allclose(other @ other.T, half @ half.T, rtol=0, atol=1e-12)
    assert np.max(np.abs(other - half)) > 0.1
    rng = np.random.default_rng(6)
    x, y, w = rng.normal(size=(5, dim)), rng.normal(size=(8, dim)), rng.normal(size=(8,))
    np.testing.assert_allclose(sliced_kernel_sum(x, y, w, Hat(1.3), directions=half),
                               sliced_kernel_sum(x, y, w, Hat(1.3), directions=full), rtol=1e-12, atol=1e-14)


def test_dask_path_takes_the_design():
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(40, 3)), rng.normal(size=(30, 3)) + 0.5
    lazy = energy_distance(da.from_array(x, chunks=16), da.from_array(y, chunks=16), directions=24, seed=9)
    theta = directions(24, 3, method=default_method(24, 3), seed=9)         # the statistics are even
    np.testing.assert_allclose(float(lazy.compute()), float(energy_distance(x, y, directions=theta,
                                                                             method="sliced")), rtol=1e-12)
    ones = da.from_array(np.ones(30), chunks=16)
    total = sliced_kernel_sum(da.from_array(x, chunks=16), da.from_array(y, chunks=16), ones, Abs(), directions=24,
                              seed=9)
    np.testing.assert_allclose(np.asarray(total.compute()), sliced_kernel_sum(x, y, np.ones(30), Abs(),
                                                                              directions=theta), rtol=1e-12)
