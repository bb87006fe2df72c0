"""Attention ops (docs/mathematics.rst, "Attention") against their dense ``slicedkern.reference`` counterparts."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import (
    C,
    M,
    N,
    assert_close,
    assert_meta,
    assert_values_close,
    attention_atol,
    rel_err,
    scaled_kernel,
    tie_scores,
)

import slicedkern
from slicedkern import reference
from slicedkern.kernels import Abs, Hat, HatMixture, PiecewiseLinear, ReLU

B, H, LQ, LK, DV = 2, 3, N, M, C
RTOL64 = 1e-10
NORMALIZE = ["abs", "relu", "count", None]
GENERAL = PiecewiseLinear((-0.75, 0.0, 0.5, 1.25), (1.5, -2.0, 0.75, 0.5), slope=-0.5, intercept=0.25)


def data(rng, *, scale=1.0, shared_kv=False, ties=False):
    """q (B, H, Lq), k (B or 1, H, Lk), v (B or 1, H, Lk, Dv) as NumPy float64."""
    kb = 1 if shared_kv else B
    if ties:
        q, k = tie_scores(rng, (B, H, LQ)), tie_scores(rng, (kb, H, LK))
        q[..., :4] = k[..., :4]   # queries equal to keys, whatever the batch row
    else:
        q, k = scale * rng.normal(size=(B, H, LQ)), scale * rng.normal(size=(kb, H, LK))
    v = rng.normal(size=(kb, H, LK, DV)) + 0.5
    return q, k, v


def random_mask(rng, shape=(B, H, LK)):
    """Random key mask with one fully masked batch row and one fully valid row."""
    mask = rng.random(shape) < 0.6
    mask[-1, -1, :] = False
    mask[0, 0, :] = True
    return mask


DEFAULTS = {slicedkern.relu_attention: dict(center=True, normalize="abs", eps=1e-6),
            slicedkern.hat_attention: dict(center=False, normalize="count", eps=1e-6),
            slicedkern.hat_mixture_attention: dict(center=False, normalize="count", eps=1e-6),
            slicedkern.kernel_attention: dict(center=False, normalize="count", eps=1e-6)}


def bound_kernel(fn, args):
    """A kernel whose Lipschitz constant bounds the op's (for the a-priori error scale)."""
    if fn is slicedkern.relu_attention:
        return ReLU()
    if fn is slicedkern.kernel_attention:
        return args[0]
    if fn is slicedkern.hat_attention:
        bw = args[0] if args else 1.0
        return Hat(float(np.min(to_np(bw))))
    bws, ws = (np.asarray(to_np(a), dtype=np.float64) for a in args[:2])
    bws, ws = np.broadcast_arrays(bws, ws)
    # sum_i |w_i| Hat(min bandwidth) has at least the Lipschitz constant of any row's mixture
    return float(np.max(np.abs(ws).sum(axis=-1))) * Hat(float(np.min(bws)))


def to_np(a):
    from _helpers import to_numpy
    return a if isinstance(a, (float, int, list, tuple)) else to_numpy(a)


def run(xp, fn, ref, q, k, v, *args, key_mask=None, rtol=RTOL64, atol=None, **kw):
    """Call the fast op and the dense reference on backend ``xp``; compare, metadata first.

    The tolerance is ``rtol`` relative to the output's magnitude plus the a-priori elementwise error
    scale of the sort-scan (:func:`attention_atol`), unless ``atol`` is given.
    """
    Q, K, V = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    mask = None if key_mask is None else xp.asarray(key_mask)
    out = fn(Q, K, V, *args, key_mask=mask, **kw)
    expected = ref(Q, K, V, *args, key_mask=mask, **kw)
    batch = np.broadcast_shapes(q.shape[:-1], k.shape[:-1], v.shape[:-2])
    assert_meta(out, like=Q, shape=batch + (q.shape[-1], v.shape[-1]))
    if atol is None:
        opts = {**DEFAULTS[fn], **kw}
        opts.pop("causal", None)            # a query's keys are a subset of them: the same bound holds
        atol = rtol * float(np.max(np.abs(xp.to_numpy(expected)), initial=0.0)) + attention_atol(
            q, k, v, bound_kernel(fn, args), key_mask=key_mask, expected=expected, **opts)
    assert_close(out, expected, rtol=rtol, atol=atol)
    return out, expected


def xp_args(xp, args):
    """Move array-valued extra arguments (bandwidths, weights) to the backend."""
    return [xp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]


# ------------------------------------------------------------------------- the dense oracle itself
def test_reference_relu_attention_is_paper_eq3(rng):
    q, k, v = rng.normal(size=5), rng.normal(size=7), rng.normal(size=(7, 2))
    vt = v - v.mean(axis=0)
    num = np.array([sum(max(qi - kj, 0.0) * vt[j] for j, kj in enumerate(k)) for qi in q])
    den = np.array([sum(abs(qi - kj) for kj in k) for qi in q])
    np.testing.assert_allclose(reference.relu_attention(q, k, v), num / den[:, None], rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(slicedkern.relu_attention(q, k, v), num / den[:, None], rtol=1e-12, atol=1e-13)


def test_reference_masked_hat_attention_is_paper_eq5(rng):
    q, k, v = rng.normal(size=5), rng.normal(size=7), rng.normal(size=(7, 2))
    mask = np.array([True, False, True, True, False, True, True])
    b = 0.8
    num = np.array([sum(max(0.0, 1 - abs(qi - kj) / b) * v[j] for j, kj in enumerate(k) if mask[j])
                    for qi in q])
    expected = num / mask.sum()
    np.testing.assert_allclose(reference.hat_attention(q, k, v, b, key_mask=mask), expected, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(slicedkern.hat_attention(q, k, v, b, key_mask=mask), expected, rtol=1e-12, atol=1e-13)


def test_masked_centring_uses_valid_keys_only(rng):
    q, k, v = rng.normal(size=4), rng.normal(size=6), rng.normal(size=(6, 3))
    mask = np.array([True, True, False, True, False, True])
    vt = v - v[mask].mean(axis=0)
    num = np.array([sum(max(qi - k[j], 0.0) * vt[j] for j in np.flatnonzero(mask)) for qi in q])
    den = np.array([sum(max(qi - k[j], 0.0) for j in np.flatnonzero(mask)) for qi in q])
    expected = num / np.maximum(den, 1e-6)[:, None]
    got = slicedkern.relu_attention(q, k, v, key_mask=mask, normalize="relu")
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(reference.relu_attention(q, k, v, key_mask=mask, normalize="relu"),
                               expected, rtol=1e-13, atol=1e-13)


def test_docstring_examples():
    q, k, v = np.zeros((1, 1)), np.array([[0.0, 0.5, 3.0]]), np.ones((1, 3, 1))
    np.testing.assert_allclose(slicedkern.hat_attention(q, k, v, bandwidth=1.0), [[[0.5]]], rtol=1e-15)
    np.testing.assert_allclose(slicedkern.kernel_attention(q, k, v, Hat(1.0)), [[[0.5]]], rtol=1e-15)
    q, k, v = np.zeros((1, 1)), np.array([[0.0, 0.5]]), np.ones((1, 2, 1))
    np.testing.assert_allclose(slicedkern.hat_mixture_attention(q, k, v, [1.0, 2.0], [1.0, 1.0]),
                               [[[1.625]]], rtol=1e-15)


# ------------------------------------------------------------------------------------ relu_attention
@pytest.mark.parametrize("normalize", NORMALIZE)
@pytest.mark.parametrize("center", [True, False])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_relu_attention(xp, rng, normalize, center, masked):
    q, k, v = data(rng)
    mask = random_mask(rng) if masked else None
    out, _ = run(xp, slicedkern.relu_attention, reference.relu_attention, q, k, v, key_mask=mask,
                 center=center, normalize=normalize)
    if masked:  # the fully masked row is the attention of an empty key set: 0
        np.testing.assert_array_equal(xp.to_numpy(out)[-1, -1], 0.0)


def test_relu_attention_defaults(xp, rng):
    """Defaults: centred values, "abs" normaliser, eps = 1e-6."""
    q, k, v = data(rng)
    Q, K, V = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    out = slicedkern.relu_attention(Q, K, V)
    explicit = slicedkern.relu_attention(Q, K, V, center=True, normalize="abs", eps=1e-6)
    np.testing.assert_array_equal(xp.to_numpy(out), xp.to_numpy(explicit))
    assert_close(out, reference.relu_attention(Q, K, V), rtol=RTOL64)
    uncentred = slicedkern.relu_attention(Q, K, V, center=False)
    assert np.max(np.abs(xp.to_numpy(uncentred) - xp.to_numpy(out))) > 1e-3


@pytest.mark.parametrize("normalize, eps", [("abs", 1e-300), ("abs", 1e-6), ("abs", 5.0), ("relu", 1e-6),
                                           ("relu", 0.5), ("relu", 5.0)])
def test_eps_clamps_the_normaliser(xp, rng, eps, normalize):
    q, k, v = data(rng)
    q[..., :3] = k.min(axis=-1, keepdims=True) - 0.1   # below every key: ReLU normaliser 0
    mask = random_mask(rng)
    mask[-1, -1, 0] = True                               # no empty key set (0 / 0 with a vanishing eps)
    run(xp, slicedkern.relu_attention, reference.relu_attention, q, k, v, key_mask=mask,
        normalize=normalize, eps=eps, center=False)
    if normalize == "relu" and eps > 0:
        # numerator and ReLU normaliser are both exactly 0 below every key
        out = slicedkern.relu_attention(xp.asarray(q), xp.asarray(k), xp.asarray(v), normalize="relu",
                                        eps=eps, center=False)
        np.testing.assert_array_equal(xp.to_numpy(out)[..., :3, :], 0.0)


def test_eps_value_is_used(xp, rng):
    """A large eps changes the result exactly as num / max(den, eps)."""
    q, k, v = data(rng)
    Q, K, V = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    small = xp.to_numpy(slicedkern.relu_attention(Q, K, V, normalize="abs", eps=1e-12))
    none = xp.to_numpy(slicedkern.relu_attention(Q, K, V, normalize=None))
    den = np.abs(q[..., :, None] - k[..., None, :]).sum(axis=-1)[..., None]
    big_eps = float(np.median(den))
    big = xp.to_numpy(slicedkern.relu_attention(Q, K, V, normalize="abs", eps=big_eps))
    np.testing.assert_allclose(small, none / den, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(big, none / np.maximum(den, big_eps), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scale", [1e-6, 1e6])
@pytest.mark.parametrize("normalize", NORMALIZE)
def test_relu_attention_scales(xp, rng, scale, normalize):
    q, k, v = data(rng, scale=scale)
    run(xp, slicedkern.relu_attention, reference.relu_attention, q, k, v, normalize=normalize,
        key_mask=random_mask(rng), eps=1e-6 * scale)


def test_relu_attention_is_scale_invariant(xp, rng):
    """ReLU and |.| are 1-homogeneous: scaling q and k (and eps) leaves "abs"/"relu" outputs alone."""
    q, k, v = data(rng)
    V = xp.asarray(v)
    base = slicedkern.relu_attention(xp.asarray(q), xp.asarray(k), V)
    for s in (2.0 ** -20, 2.0 ** 20):
        scaled = slicedkern.relu_attention(xp.asarray(q * s), xp.asarray(k * s), V, eps=1e-6 * s)
        assert_values_close(scaled, xp.to_numpy(base), rtol=1e-10)


@pytest.mark.parametrize("normalize", NORMALIZE)
def test_relu_attention_offset(xp, rng, normalize):
    """Scores 1e6 + N(0, 1): the output depends on O(1) differences only."""
    q, k, v = data(rng)
    out, _ = run(xp, slicedkern.relu_attention, reference.relu_attention, q + 1e6, k + 1e6, v,
                 normalize=normalize)
    if normalize in ("abs", "relu"):
        qd, kd = np.round(q * 2**16) / 2**16, np.round(k * 2**16) / 2**16   # exact after the shift
        base = slicedkern.relu_attention(qd, kd, v, normalize=normalize)
        shifted = slicedkern.relu_attention(xp.asarray(qd + 1e6), xp.asarray(kd + 1e6), xp.asarray(v),
                                            normalize=normalize)
        assert_values_close(shifted, base, rtol=1e-10)


# ------------------------------------------------------------------------------------- hat attention
@pytest.mark.parametrize("normalize", NORMALIZE)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("bandwidth", [0.5, 2.0, "per_head"])
def test_hat_attention(xp, rng, normalize, masked, bandwidth):
    q, k, v = data(rng)
    if bandwidth == "per_head":
        bandwidth = np.array([0.3, 1.0, 2.5])          # (H,) broadcasts against (B, H)
    mask = random_mask(rng) if masked else None
    out, _ = run(xp, slicedkern.hat_attention, reference.hat_attention, q, k, v,
                 *xp_args(xp, [bandwidth]), key_mask=mask, normalize=normalize)
    if masked:
        np.testing.assert_array_equal(xp.to_numpy(out)[-1, -1], 0.0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("op", ["hat", "hat_mixture"])
def test_hat_ops_center(xp, rng, op, causal):
    """``center=True`` on the hat ops: the values centred on the mean of the valid keys each query
    sees (a running mean when causal), as relu_attention does; what the layers' ``center`` uses."""
    q, k, v = data(rng)
    args = [np.array([0.3, 1.0, 2.5])] if op == "hat" else [MIX_BW, MIX_W]
    fn = slicedkern.hat_attention if op == "hat" else slicedkern.hat_mixture_attention
    ref = reference.hat_attention if op == "hat" else reference.hat_mixture_attention
    out, _ = run(xp, fn, ref, q, k, v, *xp_args(xp, args), key_mask=random_mask(rng), center=True,
                 causal=causal)
    plain = fn(*(xp.asarray(a) for a in (q, k, v)), *xp_args(xp, args), causal=causal)
    assert rel_err(out, plain) > 1e-3              # the option is not ignored


def test_hat_attention_defaults(xp, rng):
    q, k, v = data(rng)
    Q, K, V = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    out = slicedkern.hat_attention(Q, K, V)
    np.testing.assert_array_equal(xp.to_numpy(out), xp.to_numpy(
        slicedkern.hat_attention(Q, K, V, 1.0, normalize="count")))
    assert_close(out, reference.hat_attention(Q, K, V), rtol=RTOL64)
    # "count" means the number of keys: the numerator over Lk
    none = slicedkern.hat_attention(Q, K, V, normalize=None)
    assert_values_close(out, xp.to_numpy(none) / LK, rtol=1e-14)


@pytest.mark.parametrize("shape", [(H,)] + [pytest.param(s, marks=pytest.mark.new_shapes)
                                             for s in [(1, H), (B, 1), (B, H), ()]], ids=str)
def test_hat_bandwidth_array_equals_per_row_scalars(xp, rng, shape):
    """An array bandwidth gives, in every batch row, the scalar-bandwidth result of that row."""
    q, k, v = data(rng)
    bw = rng.uniform(0.3, 2.0, size=shape)
    out = xp.to_numpy(slicedkern.hat_attention(xp.asarray(q), xp.asarray(k), xp.asarray(v),
                                               xp.asarray(bw)))
    full = np.broadcast_to(bw, (B, H))
    for b in range(B):
        for h in range(H):
            row = reference.hat_attention(q[b, h], k[b, h], v[b, h], float(full[b, h]))   # NumPy
            assert_values_close(out[b, h], row, rtol=1e-12)


def test_hat_bandwidth_float32_array_with_float64_scores(xp, rng):
    q, k, v = data(rng)
    bw = np.array([0.5, 1.0, 1.5], dtype=np.float32)
    out = slicedkern.hat_attention(xp.asarray(q), xp.asarray(k), xp.asarray(v), xp.asarray(bw, "float32"))
    expected = reference.hat_attention(xp.asarray(q), xp.asarray(k), xp.asarray(v),
                                       xp.asarray(bw.astype(np.float64)))
    assert_close(out, expected, rtol=RTOL64)


@pytest.mark.parametrize("scale", [1e-6, 1e6])
def test_hat_attention_scales(xp, rng, scale):
    q, k, v = data(rng, scale=scale)
    # bandwidth scaled with the data, and a fixed one (every pair inside / outside the hat)
    for bw in (0.7 * scale, 0.7):
        run(xp, slicedkern.hat_attention, reference.hat_attention, q, k, v, bw)


def test_hat_attention_offset(xp, rng):
    q, k, v = data(rng)
    mask = np.ones((B, H, LK), dtype=bool)
    mask[..., ::4] = False
    run(xp, slicedkern.hat_attention, reference.hat_attention, q + 1e6, k + 1e6, v, 0.6, key_mask=mask)


@pytest.mark.parametrize("op", ["relu", "hat"])
def test_masked_keys_do_not_cost_accuracy_at_an_offset(xp, rng, op):
    """Scores 1e8 + N(0, 1) with most keys masked: as accurate as the same problem at offset 0.

    Differences of the (dyadic-rounded) scores are exact, so both problems have one exact answer.
    Masked keys must not take part in anything, including the conditioning of the scan.
    """
    q, k, v = data(rng)
    q, k = np.round(q * 2**20) / 2**20, np.round(k * 2**20) / 2**20
    mask = rng.random((B, H, LK)) < 0.3          # about 70 % of the keys masked
    mask[..., 0] = True
    if op == "relu":
        def fn(a, b):
            return slicedkern.relu_attention(xp.asarray(a), xp.asarray(b), xp.asarray(v),
                                             key_mask=xp.asarray(mask))
    else:
        def fn(a, b):
            return slicedkern.hat_attention(xp.asarray(a), xp.asarray(b), xp.asarray(v), 0.5,
                                            key_mask=xp.asarray(mask))
    base = xp.to_numpy(fn(q, k))
    shifted = fn(q + 1e8, k + 1e8)
    assert_values_close(shifted, base, rtol=1e-10)


# --------------------------------------------------------------------------------------- mixtures
MIX_BW, MIX_W = [0.25, 1.0, 3.0], [1.0, -0.5, 2.0]


@pytest.mark.parametrize("normalize", NORMALIZE)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_hat_mixture_lists(xp, rng, normalize, masked):
    q, k, v = data(rng)
    mask = random_mask(rng) if masked else None
    out, _ = run(xp, slicedkern.hat_mixture_attention, reference.hat_mixture_attention, q, k, v,
                 MIX_BW, MIX_W, key_mask=mask, normalize=normalize)
    if masked:
        np.testing.assert_array_equal(xp.to_numpy(out)[-1, -1], 0.0)


@pytest.mark.parametrize("shape", [(H, 3)] + [pytest.param(s, marks=pytest.mark.new_shapes)
                                               for s in [(3,), (B, H, 3), (B, 1, 3)]], ids=str)
def test_hat_mixture_arrays(xp, rng, shape):
    q, k, v = data(rng)
    bws = rng.uniform(0.2, 2.0, size=shape)
    ws = rng.normal(size=shape)
    run(xp, slicedkern.hat_mixture_attention, reference.hat_mixture_attention, q, k, v,
        *xp_args(xp, [bws, ws]), key_mask=random_mask(rng))


def test_hat_mixture_array_params_equal_list_params(xp, rng):
    q, k, v = data(rng)
    Q, K, V = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    from_lists = slicedkern.hat_mixture_attention(Q, K, V, MIX_BW, MIX_W)
    from_arrays = slicedkern.hat_mixture_attention(Q, K, V, xp.asarray(np.array(MIX_BW)),
                                                   xp.asarray(np.array(MIX_W)))
    tuples = slicedkern.hat_mixture_attention(Q, K, V, tuple(MIX_BW), tuple(MIX_W))
    assert_close(from_arrays, from_lists, rtol=1e-13)
    assert_close(tuples, from_lists, rtol=1e-13)


@pytest.mark.parametrize("which", ["bandwidths", "weights"])
def test_hat_mixture_list_and_array_params(xp, rng, which):
    """One parameter a list, the other a per-head array: same as both as arrays."""
    q, k, v = data(rng)
    bws = np.broadcast_to(np.array(MIX_BW), (H, 3)).copy()
    ws = np.broadcast_to(np.array(MIX_W), (H, 3)).copy()
    if which == "bandwidths":
        ws = rng.normal(size=(H, 3))
        args = [MIX_BW, xp.asarray(ws)]
    else:
        bws = rng.uniform(0.2, 2.0, size=(H, 3))
        args = [xp.asarray(bws), MIX_W]
    Q, K, V = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    out = slicedkern.hat_mixture_attention(Q, K, V, *args)
    expected = reference.hat_mixture_attention(Q, K, V, xp.asarray(bws), xp.asarray(ws))
    assert_close(out, expected, rtol=RTOL64)


def test_hat_mixture_reference_with_a_list_and_an_array(xp, rng):
    """The dense reference accepts the same parameter forms as the fast op."""
    q, k, v = data(rng)
    ws = rng.normal(size=(H, 3))
    Q, K, V = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    mixed = reference.hat_mixture_attention(Q, K, V, MIX_BW, xp.asarray(ws))
    arrays = reference.hat_mixture_attention(Q, K, V, xp.asarray(np.broadcast_to(MIX_BW, (H, 3)).copy()),
                                             xp.asarray(ws))
    assert_close(mixed, arrays, rtol=1e-13)


def test_mixture_of_one_hat_is_hat_attention(xp, rng):
    q, k, v = data(rng)
    Q, K, V = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    mix = slicedkern.hat_mixture_attention(Q, K, V, [0.8], [1.0])
    hat = slicedkern.hat_attention(Q, K, V, 0.8)
    assert_close(mix, hat, rtol=1e-13)
    bw = xp.asarray(np.array([[0.4], [0.8], [1.6]]))
    mix = slicedkern.hat_mixture_attention(Q, K, V, bw, xp.asarray(np.ones((H, 1))))
    hat = slicedkern.hat_attention(Q, K, V, xp.asarray(np.array([0.4, 0.8, 1.6])))
    assert_close(mix, hat, rtol=1e-13)


# ---------------------------------------------------------------------------------- kernel_attention
@pytest.mark.parametrize("kernel", [ReLU(), Abs(), Hat(0.6), HatMixture([0.5, 2.0], [1.0, 0.5]), GENERAL],
                         ids=["relu", "abs", "hat", "mixture", "general"])
@pytest.mark.parametrize("normalize", NORMALIZE)
@pytest.mark.parametrize("center", [False, True])
def test_kernel_attention(xp, rng, kernel, normalize, center):
    q, k, v = data(rng)
    run(xp, slicedkern.kernel_attention, reference.kernel_attention, q, k, v, kernel,
        key_mask=random_mask(rng), normalize=normalize, center=center)


def test_kernel_attention_matches_the_named_ops(xp, rng):
    q, k, v = data(rng)
    Q, K, V = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    assert_close(slicedkern.kernel_attention(Q, K, V, ReLU(), center=True, normalize="abs"),
                 slicedkern.relu_attention(Q, K, V), rtol=1e-13)
    assert_close(slicedkern.kernel_attention(Q, K, V, Hat(0.7)), slicedkern.hat_attention(Q, K, V, 0.7),
                 rtol=1e-13)
    assert_close(slicedkern.kernel_attention(Q, K, V, HatMixture(MIX_BW, MIX_W)),
                 slicedkern.hat_mixture_attention(Q, K, V, MIX_BW, MIX_W), rtol=1e-13)


@pytest.mark.parametrize("scale", [1e-6, 1e6])
def test_kernel_attention_scaled_kernel(xp, rng, scale):
    q, k, v = data(rng, scale=scale)
    run(xp, slicedkern.kernel_attention, reference.kernel_attention, q, k, v, scaled_kernel(GENERAL, scale),
        key_mask=random_mask(rng), normalize="count", center=True)


# ----------------------------------------------------------------------------- ties and broadcasting
@pytest.mark.parametrize("op", ["relu", "hat", "mixture", "general"])
def test_ties(xp, rng, op):
    q, k, v = data(rng, ties=True)
    mask = random_mask(rng)
    if op == "relu":
        run(xp, slicedkern.relu_attention, reference.relu_attention, q, k, v, key_mask=mask)
        run(xp, slicedkern.relu_attention, reference.relu_attention, q, k, v, key_mask=mask,
            normalize="relu")
    elif op == "hat":
        run(xp, slicedkern.hat_attention, reference.hat_attention, q, k, v, 0.5, key_mask=mask)
    elif op == "mixture":
        run(xp, slicedkern.hat_mixture_attention, reference.hat_mixture_attention, q, k, v,
            [0.25, 0.5, 1.0], [1.0, 2.0, -1.0], key_mask=mask)
    else:
        run(xp, slicedkern.kernel_attention, reference.kernel_attention, q, k, v, GENERAL, key_mask=mask,
            center=True, normalize="abs")


@pytest.mark.parametrize("op", ["relu", "hat", "mixture_arrays"])
def test_shared_keys_broadcast_over_batch(xp, rng, op):
    """q (B, H, Lq) against k, v shared over the batch, (1, H, Lk); the mask (B, H, Lk)."""
    q, k, v = data(rng, shared_kv=True)
    mask = np.broadcast_to(random_mask(rng, (1, H, LK)), (B, H, LK)).copy()
    mask[0, 1, :5] = False      # the mask may differ along the broadcast batch axis
    if op == "relu":
        out, _ = run(xp, slicedkern.relu_attention, reference.relu_attention, q, k, v, key_mask=mask)
    elif op == "hat":
        out, _ = run(xp, slicedkern.hat_attention, reference.hat_attention, q, k, v,
                     *xp_args(xp, [np.array([0.3, 1.0, 2.5])]), key_mask=mask)
    else:
        out, _ = run(xp, slicedkern.hat_mixture_attention, reference.hat_mixture_attention, q, k, v,
                     *xp_args(xp, [rng.uniform(0.2, 2, (H, 3)), rng.normal(size=(H, 3))]), key_mask=mask)
    assert tuple(out.shape) == (B, H, LQ, DV)


def test_mask_broadcast_over_batch(xp, rng):
    """A key mask with fewer batch dims than k broadcasts like the other arguments."""
    q, k, v = data(rng)
    mask = rng.random(LK) < 0.5
    Q, K, V = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    out = slicedkern.relu_attention(Q, K, V, key_mask=xp.asarray(mask))
    full = slicedkern.relu_attention(Q, K, V, key_mask=xp.asarray(np.broadcast_to(mask, (B, H, LK)).copy()))
    np.testing.assert_array_equal(xp.to_numpy(out), xp.to_numpy(full))
    assert_close(out, reference.relu_attention(Q, K, V, key_mask=xp.asarray(
        np.broadcast_to(mask, (B, H, LK)).copy())), rtol=RTOL64)


@pytest.mark.new_shapes
def test_unbatched(xp, rng):
    q, k, v = rng.normal(size=LQ), rng.normal(size=LK), rng.normal(size=(LK, DV))
    out, _ = run(xp, slicedkern.relu_attention, reference.relu_attention, q, k, v)
    assert tuple(out.shape) == (LQ, DV)
    run(xp, slicedkern.hat_attention, reference.hat_attention, q, k, v, 0.9)


@pytest.mark.new_shapes
@pytest.mark.parametrize("lq, lk", [(1, LK), (LQ, 1), (1, 1)])
def test_single_query_or_key(xp, rng, lq, lk):
    q, k, v = rng.normal(size=(H, lq)), rng.normal(size=(H, lk)), rng.normal(size=(H, lk, DV))
    run(xp, slicedkern.relu_attention, reference.relu_attention, q, k, v)
    run(xp, slicedkern.hat_attention, reference.hat_attention, q, k, v, 1.5)


# --------------------------------------------------------------------------- masked keys count nowhere
def _poison(rng, k, v, mask):
    """Copies of k, v with every masked key's score and value replaced by garbage (NaN, inf, huge)."""
    k2, v2 = k.copy(), v.copy()
    bad = np.broadcast_to(~mask, k.shape)
    junk = rng.choice(np.array([np.nan, np.inf, -np.inf, 1e300, -7.0]), size=k.shape)
    k2[bad] = junk[bad]
    vbad = np.broadcast_to(bad[..., None], v.shape)
    v2[vbad] = np.where(rng.random(v.shape) < 0.5, np.nan, np.inf)[vbad]
    return k2, v2


@pytest.mark.parametrize("op", ["relu", "relu_relu", "hat", "hat_per_head", "mixture", "general"])
def test_masked_keys_influence_nothing(xp, rng, op):
    q, k, v = data(rng)
    mask = random_mask(rng)
    k2, v2 = _poison(rng, k, v, mask)
    calls = {
        "relu": lambda Q, K, V, m: slicedkern.relu_attention(Q, K, V, key_mask=m),
        "relu_relu": lambda Q, K, V, m: slicedkern.relu_attention(Q, K, V, key_mask=m, normalize="relu"),
        "hat": lambda Q, K, V, m: slicedkern.hat_attention(Q, K, V, 0.7, key_mask=m),
        "hat_per_head": lambda Q, K, V, m: slicedkern.hat_attention(
            Q, K, V, xp.asarray(np.array([0.3, 1.0, 2.5])), key_mask=m),
        "mixture": lambda Q, K, V, m: slicedkern.hat_mixture_attention(Q, K, V, MIX_BW, MIX_W, key_mask=m),
        "general": lambda Q, K, V, m: slicedkern.kernel_attention(Q, K, V, GENERAL, key_mask=m, center=True,
                                                                  normalize="abs"),
    }
    fn = calls[op]
    m = xp.asarray(mask)
    clean = xp.to_numpy(fn(xp.asarray(q), xp.asarray(k), xp.asarray(v), m))
    poisoned = xp.to_numpy(fn(xp.asarray(q), xp.asarray(k2), xp.asarray(v2), m))
    assert np.all(np.isfinite(clean))
    np.testing.assert_array_equal(poisoned, clean)
    # and the result equals attention over the valid keys alone (one row, NumPy, no mask)
    b, h = 0, 1
    keep = mask[b, h]
    if op != "hat_per_head":
        plain = {"relu": slicedkern.relu_attention, "relu_relu": slicedkern.relu_attention}.get(op)
        row = (calls[op] if plain is None else
               (lambda Q, K, V, m: plain(Q, K, V, normalize="relu" if op == "relu_relu" else "abs")))(
            q[b, h], k[b, h][keep], v[b, h][keep], None)
        assert_values_close(clean[b, h], row, rtol=1e-12)


def test_all_keys_masked_gives_zero(xp, rng):
    q, k, v = data(rng)
    mask = np.zeros((B, H, LK), dtype=bool)
    Q, K, V, MK = xp.asarray(q), xp.asarray(k), xp.asarray(v), xp.asarray(mask)
    for out in (slicedkern.relu_attention(Q, K, V, key_mask=MK),
                slicedkern.relu_attention(Q, K, V, key_mask=MK, normalize="relu", center=False),
                slicedkern.relu_attention(Q, K, V, key_mask=MK, normalize="count"),
                slicedkern.hat_attention(Q, K, V, key_mask=MK),
                slicedkern.hat_mixture_attention(Q, K, V, MIX_BW, MIX_W, key_mask=MK, normalize="abs"),
                slicedkern.kernel_attention(Q, K, V, GENERAL, key_mask=MK, normalize=None)):
        assert_meta(out, like=Q, shape=(B, H, LQ, DV))
        np.testing.assert_array_equal(xp.to_numpy(out), 0.0)


@pytest.mark.parametrize("op", [slicedkern.relu_attention, slicedkern.hat_attention, slicedkern.kernel_sum])
def test_arrays_are_positional_only(op):
    """The arrays of the 1-D ops are positional-only (``q, k, v, /``, as array-api-extra has them):
    their names are free for wrappers, and a keyword call is Python's own TypeError."""
    a, w = np.zeros((1, 2)), np.zeros((1, 2, 1))
    extra = (ReLU(),) if op is slicedkern.kernel_sum else ()
    op(a, a, w, *extra)
    names = ("x", "y", "w") if op is slicedkern.kernel_sum else ("q", "k", "v")
    with pytest.raises(TypeError, match="positional-only"):
        op(**dict(zip(names, (a, a, w))), **({"kernel": ReLU()} if extra else {}))
