"""The double-float prefix table of the scan engine (backends without float64, JAX without x64)."""

from __future__ import annotations

import array_api_compat
import numpy as np
import pytest

from slicedkern._lib.namespace import inclusive_scan
from slicedkern.engines.sortscan.wide import DoubleFloat

xp = array_api_compat.array_namespace(np.zeros(1))


@pytest.mark.parametrize("n", [*range(1, 18), 31, 32, 33, 1000, 4097])
def test_odd_even_scan_is_the_exact_prefix_sum_to_double_float_precision(n):
    rng = np.random.default_rng(n)
    # mixed magnitudes: a float32 running sum of these loses every small term
    a = (rng.standard_normal((2, n, 3)) * 10.0 ** rng.integers(-6, 7, (2, n, 3))).astype(np.float32)
    df = DoubleFloat(xp)
    hi, lo = inclusive_scan(xp, df._add_pairs, (a, np.zeros_like(a)))
    assert hi.shape == lo.shape == a.shape and hi.dtype == np.float32
    got = hi.astype(np.float64) + lo.astype(np.float64)
    exact = np.cumsum(a.astype(np.float64), axis=1)
    scale = np.cumsum(np.abs(a.astype(np.float64)), axis=1)
    assert np.all(np.abs(got - exact) <= 2.0 ** -44 * scale)
    if n > 100:   # the float32 running sum is far worse: the test can tell the two apart
        assert np.max(np.abs(np.cumsum(a, axis=1) - exact) / scale) > 2.0 ** -30


def test_table_rows_are_exclusive_prefix_sums_of_w_and_yw():
    rng = np.random.default_rng(0)
    y = np.sort(rng.standard_normal((2, 50)).astype(np.float32), axis=-1)
    w = rng.standard_normal((2, 50, 3)).astype(np.float32)
    df = DoubleFloat(xp)
    perm = np.broadcast_to(np.arange(50), (2, 50))
    table = df.table(df.lift(y), w, perm)
    got = table.hi.astype(np.float64) + table.lo.astype(np.float64)
    w64, y64 = w.astype(np.float64), y.astype(np.float64)[..., None]
    expected = np.concatenate([np.zeros((2, 1, 6)), np.cumsum(np.concatenate([w64, y64 * w64], -1), 1)], 1)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1001])
def test_jax_exclusive_rows_is_the_exclusive_cumulative_sum(n):
    jnp = pytest.importorskip("jax.numpy")
    from slicedkern.backends import ops_for

    a = np.random.default_rng(n).standard_normal((3, n, 4)).astype(np.float32)
    jxp = array_api_compat.array_namespace(jnp.zeros(1))
    got = np.asarray(ops_for(jxp).exclusive_rows(jxp, jnp.asarray(a)))
    expected = np.concatenate([np.zeros((3, 1, 4)), np.cumsum(a.astype(np.float64), axis=1)], axis=1)
    assert got.shape == (3, n + 1, 4)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * n)


@pytest.mark.parametrize("table_lead, index_lead", [((2, 3), (2, 3)), ((1, 3), (2, 3)), ((2, 3), (3,)), ((), (4,))])
def test_jax_take_rows_gathers_whole_rows_with_broadcast_batch_axes(table_lead, index_lead):
    jnp = pytest.importorskip("jax.numpy")
    from slicedkern.backends import ops_for

    rng = np.random.default_rng(0)
    table = rng.standard_normal(table_lead + (9, 5))
    index = rng.integers(0, 9, index_lead + (7,))
    jxp = array_api_compat.array_namespace(jnp.zeros(1))
    got = np.asarray(ops_for(jxp).take_rows(jxp, jnp.asarray(table), jnp.asarray(index)))
    lead = np.broadcast_shapes(table_lead, index_lead)
    expected = np.take_along_axis(np.broadcast_to(table, lead + (9, 5)),
                                  np.broadcast_to(index, lead + (7,))[..., None], axis=-2)
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected.astype(got.dtype))
