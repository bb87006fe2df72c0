"""Packed sequences (``segment_ids=``, docs/mathematics.rst "Packed sequences") against the dense
float64 reference, on every backend and engine: causal and not, ties across segment boundaries,
empty and one-token segments, unsorted and non-contiguous ids, ``Lq != Lk`` with a pair of id
arrays, masks together with segments, ids broadcast over heads, extreme scales, the per-segment NaN
rule; gradients (``slicedkern.vjp`` against central differences of the reference, ``jax.grad`` against
the reference's own autograd; torch autograd in tests/test_windows.py, with and without a window);
packed = per-document calls; bad input.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _helpers import assert_close, central_differences, jax_x64, names_argument, tie_scores, to_numpy

import slicedkern
from slicedkern import reference
from slicedkern._lib.causal import visible
from slicedkern.kernels import PiecewiseLinear

B, H, DV = 2, 2, 3
GENERAL = PiecewiseLinear((-0.75, 0.0, 0.5), (1.5, -2.0, 0.75), slope=-0.5, intercept=0.25)

#: name -> (fast op, reference op, extra positional args builder (rng -> tuple), keyword options)
CASES = {
    "relu-abs-centred": (slicedkern.relu_attention, reference.relu_attention, None, {}),
    "relu-count": (slicedkern.relu_attention, reference.relu_attention, None, {"normalize": "count", "center": False}),
    "hat-per-head": (slicedkern.hat_attention, reference.hat_attention, lambda rng: (rng.random(H) + 0.4,),
                     {"center": True}),
    "mixture-arrays": (slicedkern.hat_mixture_attention, reference.hat_mixture_attention,
                       lambda rng: (rng.random((B, H, 2)) + 0.3, rng.normal(size=(B, H, 2))), {"normalize": "abs"}),
    "kernel-general": (slicedkern.kernel_attention, reference.kernel_attention, lambda rng: (GENERAL,),
                       {"normalize": "relu"}),
}


def _loop_visible(q_ids, k_ids, causal, window):
    """The rule of docs/mathematics.rst, "Packed sequences", one query and key at a time."""
    lq, lk = len(q_ids), len(k_ids)
    out = np.zeros((lq, lk), bool)
    for i, j in itertools.product(range(lq), range(lk)):
        s = q_ids[i]
        if k_ids[j] != s:
            continue
        a = sum(1 for t in range(i) if q_ids[t] == s)
        b = sum(1 for t in range(j) if k_ids[t] == s)
        p = a + sum(1 for t in k_ids if t == s) - sum(1 for t in q_ids if t == s)
        left, right = window if window is not None else (-1, -1)
        ok = (not causal or b <= p) and (left == -1 or b >= p - left) and (right == -1 or b <= p + right)
        out[i, j] = ok
    return out


@pytest.mark.parametrize("window", [None, (1, 0), (2, 1), (-1, -2), (0, -1), (3, -1)])
@pytest.mark.parametrize("causal", [False, True])
def test_visibility_is_the_rule_written_out(rng, causal, window):
    for lq, lk in [(7, 7), (5, 9), (9, 4)]:
        q_ids, k_ids = rng.integers(0, 3, lq), rng.integers(0, 3, lk)
        got = visible(np, lq, lk, q_ids=q_ids, k_ids=k_ids, causal=causal, window=window)
        np.testing.assert_array_equal(got, _loop_visible(q_ids, k_ids, causal, window))
        one = visible(np, lq, lk, causal=causal, window=window)
        np.testing.assert_array_equal(one, _loop_visible(np.zeros(lq, int), np.zeros(lk, int), causal, window))


def _ids(rng, length, *, batch=(B, 1)):
    """Unsorted, non-contiguous ids (negative ones too), with one-token segments."""
    labels = np.array([-3, 0, 2, 7, 11])
    ids = labels[rng.integers(0, len(labels), batch + (length,))]
    ids[..., 0] = 42                           # a one-token segment at the start of every row
    return ids


def _data(rng, lq, lk, *, ties):
    if ties:       # the same scores in different segments: ties across every boundary
        q, k = tie_scores(rng, (B, H, lq)), tie_scores(rng, (B, H, lk))
    else:
        q, k = rng.normal(size=(B, H, lq)), rng.normal(size=(B, H, lk))
    v = rng.normal(size=(B, H, lk, DV)) + 0.5
    mask = rng.random((B, H, lk)) < 0.75
    return q, k, v, mask


def _check(xp, case, q, k, v, mask, args, segment_ids, causal, rtol=1e-9):
    fast, dense, _, opts = CASES[case]
    conv = [xp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    ids = (tuple(xp.asarray(a) for a in segment_ids) if isinstance(segment_ids, tuple)
           else xp.asarray(segment_ids))
    Q, K, V = (xp.asarray(a) for a in (q, k, v))
    Mk = None if mask is None else xp.asarray(mask)
    out = fast(Q, K, V, *conv, key_mask=Mk, causal=causal, segment_ids=ids, **opts)
    expected = dense(Q, K, V, *conv, key_mask=Mk, causal=causal, segment_ids=ids, **opts)
    scale = float(np.max(np.abs(to_numpy(expected)), initial=0.0))
    assert_close(out, expected, rtol=rtol, atol=rtol * scale + 1e-12, err_msg=case)
    return to_numpy(out)


@pytest.mark.parametrize("ties", [False, True], ids=["plain", "ties"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_segments_match_dense_reference(xp, rng, case, causal, ties):
    builder = CASES[case][2]
    args = builder(rng) if builder else ()
    q, k, v, mask = _data(rng, 19, 19, ties=ties)
    ids = _ids(rng, 19)                                      # (B, 1, L): broadcast over the heads
    _check(xp, case, q, k, v, mask, args, ids, causal)
    _check(xp, case, q, k, v, None, args, ids, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths", [(6, 11), (11, 6)], ids=["lq<lk", "lq>lk"])
def test_segment_pairs_with_lq_ne_lk(xp, rng, causal, lengths):
    """Queries and keys with their own ids: segments with keys and no query, queries whose segment
    has no key (they see none: zero rows), and per-segment bottom-right alignment."""
    lq, lk = lengths
    q, k, v, mask = _data(rng, lq, lk, ties=False)
    q_ids = rng.integers(0, 3, (B, 1, lq))
    k_ids = rng.integers(1, 4, (B, 1, lk))                   # no key of segment 0, no query of 3
    for case in ("relu-abs-centred", "hat-per-head"):
        builder = CASES[case][2]
        args = builder(rng) if builder else ()
        out = _check(xp, case, q, k, v, mask, args, (q_ids, k_ids), causal)
        alone = np.broadcast_to(q_ids == 0, out.shape[:-1])
        np.testing.assert_array_equal(out[alone], 0.0)


def test_segments_at_extreme_scales(xp, rng):
    q, k, v, mask = _data(rng, 17, 17, ties=False)
    ids = _ids(rng, 17)
    for scale in (1e-6, 1e6):
        for causal in (False, True):
            _check(xp, "relu-abs-centred", q * scale, k * scale, v, mask, (), ids, causal, rtol=1e-8)
            _check(xp, "hat-per-head", q * scale, k * scale, v, mask, (np.array([0.5, 2.0]) * scale,), ids, causal,
                   rtol=1e-8)


def test_nan_rule_holds_per_segment(xp, rng):
    """A non-finite key makes NaN exactly the queries of its segment that see it; a non-finite query
    only its own row."""
    q, k, v, _ = _data(rng, 12, 12, ties=False)
    ids = np.repeat(np.array([0, 1, 2]), 4)[None, None, :]
    k = k.copy()
    q = q.copy()
    k[..., 5] = np.inf                                         # segment 1, its second key
    q[..., 9] = np.nan                                         # segment 2, one query
    for causal in (False, True):
        out = to_numpy(slicedkern.relu_attention(xp.asarray(q), xp.asarray(k), xp.asarray(v),
                                                 segment_ids=xp.asarray(ids), causal=causal))
        bad = np.zeros(12, bool)
        bad[9] = True
        bad[5 if causal else 4:8] = True
        np.testing.assert_array_equal(np.isnan(out).any(axis=-1), np.broadcast_to(bad, out.shape[:-1]))
        assert not np.isnan(out[..., ~bad, :]).any()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_equals_one_call_per_document(xp, rng, causal):
    """The packed call gives each document exactly its own call's result, and changing one document
    moves no other document's output."""
    cu = np.array([0, 5, 6, 6, 14, 20])                       # an empty and a one-token document
    total = int(cu[-1])
    ids = to_numpy(slicedkern.segment_ids_from_cu_seqlens(xp.asarray(cu)))
    q, k = rng.normal(size=(H, total)), rng.normal(size=(H, total))
    v = rng.normal(size=(H, total, DV))
    bw = rng.random(H) + 0.5
    packed = to_numpy(slicedkern.hat_attention(xp.asarray(q), xp.asarray(k), xp.asarray(v), xp.asarray(bw),
                                               center=True, causal=causal, segment_ids=xp.asarray(ids)))
    for start, stop in zip(cu[:-1], cu[1:]):
        if start == stop:
            continue
        alone = to_numpy(slicedkern.hat_attention(xp.asarray(q[:, start:stop]), xp.asarray(k[:, start:stop]),
                                                  xp.asarray(v[:, start:stop]), xp.asarray(bw), center=True,
                                                  causal=causal))
        np.testing.assert_allclose(packed[:, start:stop], alone, rtol=1e-12, atol=1e-12)
    q2, v2 = q.copy(), v.copy()
    q2[:, 7:10] += 3.0
    v2[:, 6:14] *= -2.0                                       # the fourth document changes
    moved = to_numpy(slicedkern.hat_attention(xp.asarray(q2), xp.asarray(k), xp.asarray(v2), xp.asarray(bw),
                                              center=True, causal=causal, segment_ids=xp.asarray(ids)))
    others = np.r_[0:6, 14:20]
    np.testing.assert_array_equal(moved[:, others], packed[:, others])
    assert np.abs(moved[:, 6:14] - packed[:, 6:14]).max() > 1e-3


# -------------------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_vjp_matches_central_differences(rng, causal):
    lq = lk = 9
    q, k = rng.normal(size=(1, H, lq)), rng.normal(size=(1, H, lk))
    v = rng.normal(size=(1, H, lk, 2))
    bw = rng.random(H) + 0.6
    mask = rng.random((1, H, lk)) < 0.8
    ids = np.array([[[3, 3, 1, 3, 1, 1, 5, 3, 1]]])
    g = rng.normal(size=(1, H, lq, 2))
    out, pullback = slicedkern.vjp(slicedkern.hat_attention, q, k, v, bw, key_mask=mask, center=True,
                                   normalize="abs", causal=causal, segment_ids=ids)
    grads = pullback(g)

    def loss(q_=q, k_=k, v_=v, bw_=bw):
        return float(np.sum(g * reference.hat_attention(q_, k_, v_, bw_, key_mask=mask, center=True, normalize="abs",
                                                        causal=causal, segment_ids=ids)))
    expected = [central_differences(lambda a: loss(q_=a), q), central_differences(lambda a: loss(k_=a), k),
                central_differences(lambda a: loss(v_=a), v), central_differences(lambda a: loss(bw_=a), bw)]
    for name, got, want in zip("qkvb", grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_jax_grad_matches_reference_grad(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    q, k, v, mask = _data(rng, 13, 13, ties=False)
    ids = _ids(rng, 13)
    with jax_x64(True):
        def loss(fn):
            def value(q_, k_, v_, bw_):
                out = fn(q_, k_, v_, bw_, key_mask=jnp.asarray(mask), causal=True, segment_ids=jnp.asarray(ids))
                return jnp.sum(out * jnp.arange(out.size, dtype=out.dtype).reshape(out.shape) / out.size)
            return value
        args = tuple(jnp.asarray(a) for a in (q, k, v, rng.random(H) + 0.5))
        got = jax.grad(loss(slicedkern.hat_attention), argnums=(0, 1, 2, 3))(*args)
        want = jax.grad(loss(reference.hat_attention), argnums=(0, 1, 2, 3))(*args)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-11)
        with pytest.raises(ValueError, match="'segment_ids' must be concrete"):
            jax.jit(lambda s: slicedkern.relu_attention(args[0], args[1], args[2], segment_ids=s))(jnp.asarray(ids))


# -------------------------------------------------------------------------------------- bad input
def test_bad_segment_ids_name_the_argument():
    q, k, v = np.zeros((2, 4)), np.zeros((2, 4)), np.zeros((2, 4, 1))
    cases = [
        (np.zeros((2, 4)), TypeError, "segment_ids"),                        # float ids
        (np.zeros((2, 4), bool), TypeError, "segment_ids"),
        (np.zeros((2, 5), int), ValueError, "segment_ids"),                  # wrong length
        (np.zeros((3, 4), int), ValueError, "segment_ids"),                  # does not broadcast
        ([0, 0, 1, 1], TypeError, "segment_ids"),                            # a list is not an array
        ((np.zeros(4, int),), ValueError, "segment_ids"),                    # a pair of one
        ((np.zeros(4, int), np.zeros(3, int)), ValueError, "segment_ids[1]"),
    ]
    for ids, error, name in cases:
        with pytest.raises(error) as info:
            slicedkern.relu_attention(q, k, v, segment_ids=ids)
        assert names_argument(str(info.value), name), (ids, info.value)
    with pytest.raises(ValueError, match="Lq = 3 and Lk = 4"):
        slicedkern.relu_attention(np.zeros((2, 3)), k, v, segment_ids=np.zeros(3, int))


def test_bad_cu_seqlens_name_the_argument():
    for cu, error, text in [
        (np.array([1, 3]), ValueError, "start at 0"),
        (np.array([0, 4, 2]), ValueError, "non-decreasing"),
        (np.array([0.0, 2.0]), TypeError, "integer dtype"),
        (np.zeros((2, 2), int), ValueError, "shape"),
        ([0, 2], TypeError, "integer array"),
    ]:
        with pytest.raises(error, match=text) as info:
            slicedkern.segment_ids_from_cu_seqlens(cu)
        assert names_argument(str(info.value), "cu_seqlens")
    with pytest.raises(ValueError, match="total = 5"):
        slicedkern.segment_ids_from_cu_seqlens(np.array([0, 2, 4]), total=5)


def test_cu_seqlens_keeps_namespace_dtype_and_empty_documents(xp):
    cu = xp.asarray(np.array([0, 2, 2, 3], dtype=np.int32))
    ids = slicedkern.segment_ids_from_cu_seqlens(cu, total=3)
    assert ids.dtype == cu.dtype
    np.testing.assert_array_equal(to_numpy(ids), [0, 0, 2])
