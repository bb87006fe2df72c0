"""slicedkern.nn.torch: the layers against a dense composition, padding invariance, errors, composition.

The oracle :func:`dense_layer` recomputes a layer from its ``state_dict`` with plain torch ops and
the dense ``slicedkern.reference`` attention (float64), or with the public ops
(``slicedkern.relu_attention`` ...), following the computation documented in :mod:`slicedkern.nn`;
causal attention uses one reference row per query, with a key mask of the keys it sees
(``j <= i + Lk - Lq``, the ops' bottom-right alignment).
"""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import slicedkern  # noqa: E402
from slicedkern import reference  # noqa: E402
from slicedkern.kernels import Hat, PiecewiseLinear, ReLU  # noqa: E402
from slicedkern.nn.torch import (  # noqa: E402
    SlicedAttention,
    SlicedTransformerEncoder,
    SlicedTransformerEncoderLayer,
    convert_attention,
)

#: A fixed kernel object: a hat plus a small ReLU ramp (neither even nor monotone).
CUSTOM = Hat(0.8) + 0.25 * ReLU()
KERNELS = {"relu": {"kernel": "relu"},
           "hat": {"kernel": "hat", "bandwidth": 0.7},
           "hat_mixture": {"kernel": "hat_mixture", "bandwidth": 0.5, "mixture_size": 2},
           "custom": {"kernel": CUSTOM}}


# ----------------------------------------------------------------------------------- the oracle
def rope_reference(x, num_heads, positions=None):
    """RoPE as complex rotations of the (first half, second half) feature pairs of each head, at
    ``positions`` (N, L) (default ``0..L-1``)."""
    n, length, embed = x.shape
    half = embed // num_heads // 2
    if positions is None:
        positions = torch.arange(length).expand(n, length)
    pairs = x.reshape(n, length, num_heads, 2, half)
    z = torch.complex(pairs[..., 0, :], pairs[..., 1, :])
    theta = (positions.to(x.dtype)[..., None]
             * 10000.0 ** (-torch.arange(half, dtype=x.dtype) / half))              # (N, L, half)
    z = z * torch.polar(torch.ones_like(theta), theta)[:, :, None, :]
    return torch.stack((z.real, z.imag), dim=-2).reshape(n, length, embed)


def reference_positions(valid, q_len):
    """The layer's RoPE positions, written out: a key at the number of real keys before it, query
    ``i`` at the position of key ``i + Lk - Lq`` (``Lq <= Lk``)."""
    before = torch.cat([torch.zeros_like(valid[:, :1], dtype=torch.int64),
                        valid.to(torch.int64).cumsum(-1)[:, :-1]], dim=-1)
    return before[:, valid.shape[1] - q_len:], before


def dense_layer(layer, options, query, key, value, key_padding_mask=None, causal=False, ops=reference):
    """The layer's output from its weights, with ``ops`` (``slicedkern.reference`` or ``slicedkern``)
    as the attention."""
    sd = layer.state_dict()
    heads = layer.num_heads
    kernel = options.get("kernel", "relu")
    center = options.get("center", kernel == "relu")
    normalize = options.get("normalize", "abs" if kernel == "relu" else "count")
    if options.get("batch_first", False) is False and query.ndim == 3:
        query, key, value = (a.transpose(0, 1) for a in (query, key, value))

    def linear(x, name):
        out = x @ sd[f"{name}.weight"].T
        return out + sd[f"{name}.bias"] if f"{name}.bias" in sd else out

    def score(x):
        hidden = F.gelu(linear(x, "score_hidden")) if "score_hidden.weight" in sd else x
        return (hidden @ sd["score_out.weight"].T).transpose(1, 2)          # (N, H, L)

    q, k, v = linear(query, "q_proj"), linear(key, "k_proj"), linear(value, "v_proj")
    n, q_len, k_len = q.shape[0], q.shape[1], k.shape[1]
    valid = (torch.ones(n, k_len, dtype=torch.bool) if key_padding_mask is None else ~key_padding_mask)
    if options.get("rope", False):
        q_pos, k_pos = reference_positions(valid, q_len)
        q, k = rope_reference(q, heads, q_pos), rope_reference(k, heads, k_pos)
    qs, ks = score(q), score(k)
    vh = v.reshape(n, k_len, heads, -1).transpose(1, 2)                     # (N, H, Lk, Dh)
    if causal:
        # One reference row per query: keys j <= i, so centring uses the prefix mean.
        rows = valid[:, None, :] & torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
        qs, ks = qs[..., None], ks[:, :, None, :].expand(n, heads, q_len, k_len)
        vh = vh[:, :, None].expand(n, heads, q_len, k_len, vh.shape[-1])
        mask = rows[:, None]                                                # (N, 1, Lq, Lk)
    else:
        mask = valid[:, None, :]                                            # (N, 1, Lk)
    if center and kernel in ("hat", "hat_mixture"):
        w = mask[..., None].to(vh.dtype)
        vh = vh - (vh * w).sum(-2, keepdim=True) / w.sum(-2, keepdim=True).clamp(min=1)
    per_query = (slice(None), None) if causal else ()
    if kernel == "relu":
        ctx = ops.relu_attention(qs, ks, vh, key_mask=mask, center=center, normalize=normalize)
    elif kernel == "hat":
        bandwidth = sd["log_bandwidth"].exp()[per_query]
        ctx = ops.hat_attention(qs, ks, vh, bandwidth, key_mask=mask, normalize=normalize)
    elif kernel == "hat_mixture":
        bandwidths = sd["log_bandwidth"].exp()[per_query]
        weights = sd["mixture_weight"][per_query]
        ctx = ops.hat_mixture_attention(qs, ks, vh, bandwidths, weights, key_mask=mask,
                                              normalize=normalize)
    else:
        ctx = ops.kernel_attention(qs, ks, vh, kernel, key_mask=mask, center=center,
                                         normalize=normalize)
    if causal:
        ctx = ctx[..., 0, :]
    out = linear(ctx.transpose(1, 2).reshape(n, q_len, -1), "out_proj")
    has_key = mask.any(-1).any(1)[..., None] if causal else mask.any(-1)[..., None]
    out = torch.where(has_key, out, 0.0)
    if options.get("batch_first", False) is False and out.ndim == 3:
        out = out.transpose(0, 1)
    return out


def make_layer(options, seed=0, embed_dim=12, num_heads=3, **extra):
    """A float64 layer with randomised bandwidths and mixture weights (so heads differ)."""
    torch.manual_seed(seed)
    layer = SlicedAttention(embed_dim, num_heads, dtype=torch.float64, **options, **extra)
    with torch.no_grad():
        if layer.log_bandwidth is not None:
            layer.log_bandwidth.add_(0.3 * torch.randn_like(layer.log_bandwidth))
        if layer.mixture_weight is not None:
            layer.mixture_weight.copy_(torch.randn_like(layer.mixture_weight))
    return layer


def inputs(n=2, q_len=5, k_len=7, embed=12, kdim=None, vdim=None, batch_first=True, seed=1):
    g = torch.Generator().manual_seed(seed)

    def draw(length, dim):
        shape = (n, length, dim) if batch_first else (length, n, dim)
        return torch.randn(shape, generator=g, dtype=torch.float64)

    mask = torch.zeros(n, k_len, dtype=torch.bool)
    mask[0, -2:] = True          # two padded keys in the first sequence
    mask[-1, 1] = True           # and one in the middle of the last
    return draw(q_len, embed), draw(k_len, kdim or embed), draw(k_len, vdim or embed), mask


# ------------------------------------------------------------------------------ against the oracle
@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("batch_first", [True, False])
def test_cross_attention_matches_dense_composition(name, batch_first):
    """Cross-attention with Lq != Lk, kdim / vdim, a padding mask, both layouts, every kernel."""
    options = {**KERNELS[name], "batch_first": batch_first}
    layer = make_layer(options, kdim=5, vdim=4)
    query, key, value, mask = inputs(kdim=5, vdim=4, batch_first=batch_first)
    out, weights = layer(query, key, value, key_padding_mask=mask)
    assert weights is None
    assert out.shape == query.shape and out.dtype == torch.float64
    expected = dense_layer(layer, options, query, key, value, mask)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-11)
    out_nomask, _ = layer(query, key, value)
    torch.testing.assert_close(out_nomask, dense_layer(layer, options, query, key, value),
                               rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", list(KERNELS))
def test_matches_composition_of_public_ops(name):
    """The layer equals the same composition written with the public ops (not the reference)."""
    options = {**KERNELS[name], "batch_first": False, "center": True}
    layer = make_layer(options)
    query, key, value, mask = inputs(k_len=9, batch_first=False)
    out, _ = layer(query, key, value, key_padding_mask=mask)
    expected = dense_layer(layer, options, query, key, value, mask, ops=slicedkern)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("options", [
    {"kernel": "hat", "center": True, "score": "linear"},
    {"kernel": "hat_mixture", "center": True, "rope": True, "mixture_size": 3},
    {"kernel": "relu", "center": False, "normalize": "relu", "rope": True},
    {"kernel": "relu", "normalize": None, "score": "linear"},
    {"kernel": CUSTOM, "center": True, "normalize": "abs"},
], ids=["hat-centred-linear", "mixture-centred-rope", "relu-uncentred-rope", "relu-unnormalised",
        "custom-centred-abs"])
def test_options_match_dense_composition(options):
    """Centring (the layer's own for hats), normalisers, linear scores and RoPE, self-attention."""
    layer = make_layer({**options, "batch_first": True}, num_heads=2)
    x, _, _, mask = inputs(q_len=7)
    out, _ = layer(x, x, x, key_padding_mask=mask)
    expected = dense_layer(layer, {**options, "batch_first": True}, x, x, x, mask)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-11)


def test_unbatched_input_is_a_batch_of_one():
    layer = make_layer(KERNELS["hat"])
    query, key, value, mask = inputs(n=1, batch_first=False)
    out, _ = layer(query[:, 0], key[:, 0], value[:, 0], key_padding_mask=mask[0])
    batched, _ = layer(query, key, value, key_padding_mask=mask)
    assert out.shape == (query.shape[0], 12)
    torch.testing.assert_close(out, batched[:, 0], rtol=0, atol=0)


# ------------------------------------------------------------------------------------- causal
@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("center", [False, True])
def test_causal_matches_dense_reference(name, center):
    """``is_causal=True`` against one reference row per query (keys j <= i), with padding."""
    options = {**KERNELS[name], "batch_first": True, "center": center}
    layer = make_layer(options)
    x, _, _, mask = inputs(q_len=7)
    out, _ = layer(x, x, x, key_padding_mask=mask, is_causal=True)
    torch.testing.assert_close(out, dense_layer(layer, options, x, x, x, mask, causal=True),
                               rtol=1e-9, atol=1e-11)
    # nn.MultiheadAttention's convention: attn_mask is then only a hint of the causal mask.
    hint = torch.ones(7, 7, dtype=torch.bool).triu(1)
    torch.testing.assert_close(layer(x, x, x, key_padding_mask=mask, attn_mask=hint, is_causal=True)[0], out)


@pytest.mark.parametrize("name", ["relu", "hat_mixture"])
@pytest.mark.parametrize("q_len, k_len", [(4, 7), (9, 6)])
def test_causal_cross_attention_matches_dense_reference(name, q_len, k_len):
    """Lq != Lk: query i sees keys j <= i + Lk - Lq, as the ops; a query that sees none gets zeros."""
    options = {**KERNELS[name], "batch_first": False, "center": True}
    layer = make_layer(options)
    query, key, value, mask = inputs(q_len=q_len, k_len=k_len, batch_first=False)
    out, _ = layer(query, key, value, key_padding_mask=mask, is_causal=True)
    torch.testing.assert_close(out, dense_layer(layer, options, query, key, value, mask, causal=True),
                               rtol=1e-9, atol=1e-11)
    if q_len > k_len:
        assert torch.all(out[:q_len - k_len] == 0)


def dense_causal_op(kernel):
    """A dense stand-in of the ``causal=`` ops: one reference row per query, keys j <= i + Lk - Lq."""
    def op(q, k, v, *params, key_mask=None, causal=False, **options):
        q_len, k_len = q.shape[-1], k.shape[-1]
        tril = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)      # bottom-right
        valid = (torch.ones(k.shape, dtype=torch.bool) if key_mask is None else key_mask)[..., None, :] & tril
        params = tuple(p[..., None] if p.ndim == 1 else p[:, None] for p in params)
        lead = torch.broadcast_shapes(q.shape[:-1], k.shape[:-1], v.shape[:-2])
        out = getattr(reference, kernel)(q[..., None], k[..., None, :].expand(*lead, q_len, k_len),
                                         v[..., None, :, :].expand(*lead, q_len, k_len, v.shape[-1]),
                                         *params, key_mask=valid, **options)
        return out[..., 0, :]
    op.__name__ = kernel
    return op


@pytest.mark.parametrize("name", ["relu", "hat", "hat_mixture"])
def test_causal_plumbing_with_a_dense_causal_op(name, monkeypatch):
    """The layer's causal path (prefix-mean centring of hats, zeroed rows) with a stand-in op.

    Runs whatever the installed ops support, so the layer's side of causal attention is tested
    before the causal ops land: the stand-in computes per-query dense rows, and the layer must
    then agree with the oracle, padding at the start of a sequence included.
    """
    options = {**KERNELS[name], "batch_first": True, "center": True}
    layer = make_layer(options)
    op_name = {"relu": "relu_attention", "hat": "hat_attention", "hat_mixture": "hat_mixture_attention"}[name]
    monkeypatch.setattr(layer, "_op", dense_causal_op(op_name))
    x, _, _, mask = inputs(q_len=7)
    mask[1, :3] = True            # the first three queries of sequence 1 have no valid key j <= i
    out, _ = layer(x, x, x, key_padding_mask=mask, is_causal=True)
    torch.testing.assert_close(out, dense_layer(layer, options, x, x, x, mask, causal=True),
                               rtol=1e-9, atol=1e-11)
    assert torch.all(out[1, :3] == 0)


@pytest.mark.parametrize("q_len, k_len", [(4, 7), (9, 6)])
def test_causal_cross_attention_plumbing_with_a_dense_causal_op(q_len, k_len, monkeypatch):
    """Lq != Lk: bottom-right alignment in the centring and the zeroed rows (the first Lq - Lk
    queries see no key when Lq > Lk), with and without a padding mask."""
    options = {**KERNELS["hat"], "batch_first": True, "center": True}
    layer = make_layer(options)
    monkeypatch.setattr(layer, "_op", dense_causal_op("hat_attention"))
    query, key, value, mask = inputs(q_len=q_len, k_len=k_len)
    for key_padding_mask in (mask, None):
        out, _ = layer(query, key, value, key_padding_mask=key_padding_mask, is_causal=True)
        expected = dense_layer(layer, options, query, key, value, key_padding_mask, causal=True)
        torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-11)
        if q_len > k_len:
            assert torch.all(out[:, :q_len - k_len] == 0)


# --------------------------------------------------------------------------- padding invariance
@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("rope", [False, True])
def test_padded_tokens_never_change_real_outputs(name, rope):
    """8 heads: appending random padded tokens, or changing them, leaves the real outputs as they were.

    The paper's layers leak here at 8 heads (their head reshape mixes tokens); the scores of one
    token must depend on that token only, and padded keys must count nowhere.
    """
    options = {**KERNELS[name], "batch_first": True, "center": True, "rope": rope}
    layer = make_layer(options, embed_dim=32, num_heads=8)
    g = torch.Generator().manual_seed(3)
    real = torch.randn(2, 10, 32, generator=g, dtype=torch.float64)
    reference_out, _ = layer(real, real, real)
    for _trial in range(2):
        padded = torch.cat((real, 5.0 * torch.randn(2, 6, 32, generator=g, dtype=torch.float64)), dim=1)
        mask = torch.zeros(2, 16, dtype=torch.bool)
        mask[:, 10:] = True
        out, _ = layer(padded, padded, padded, key_padding_mask=mask)
        torch.testing.assert_close(out[:, :10], reference_out, rtol=1e-10, atol=1e-12)


def test_padded_tokens_never_change_real_outputs_in_a_stack():
    torch.manual_seed(0)
    layer = SlicedTransformerEncoderLayer(16, 8, dim_feedforward=24, dropout=0.0, batch_first=True,
                                          norm_first=True, kernel="hat", dtype=torch.float64)
    encoder = SlicedTransformerEncoder(layer, num_layers=2, norm=torch.nn.LayerNorm(16, dtype=torch.float64))
    real = torch.randn(3, 9, 16, dtype=torch.float64)
    padded = torch.cat((real, torch.randn(3, 4, 16, dtype=torch.float64)), dim=1)
    mask = torch.zeros(3, 13, dtype=torch.bool)
    mask[:, 9:] = True
    torch.testing.assert_close(encoder(padded, src_key_padding_mask=mask)[:, :9], encoder(real),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(KERNELS))
def test_rows_with_all_keys_padded_are_zero_with_finite_gradients(name):
    layer = make_layer({**KERNELS[name], "batch_first": True, "center": True})
    query, key, value, mask = inputs()
    mask[0] = True                                      # every key of sequence 0 is padding
    query.requires_grad_(True)
    out, _ = layer(query, key, value, key_padding_mask=mask)
    assert torch.all(out[0] == 0)
    assert torch.all(torch.isfinite(out)) and torch.any(out[1] != 0)
    out.sum().backward()
    assert all(torch.all(torch.isfinite(p.grad)) for p in layer.parameters())
    assert torch.all(torch.isfinite(query.grad))


# ------------------------------------------------------------------------------------ gradients
@pytest.mark.parametrize("name", list(KERNELS))
def test_every_parameter_has_a_gradient(name):
    """Every parameter gets a finite, nonzero gradient; none is ignored by the forward."""
    layer = make_layer({**KERNELS[name], "batch_first": True, "center": False})
    query, key, value, mask = inputs()
    out, _ = layer(query, key, value, key_padding_mask=mask)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    for param_name, param in layer.named_parameters():
        assert param.grad is not None, param_name
        assert torch.all(torch.isfinite(param.grad)), param_name
        assert param.grad.abs().max() > 1e-8, param_name
    if name in ("hat", "hat_mixture"):
        assert layer.log_bandwidth.grad.shape == layer.log_bandwidth.shape


def test_fixed_bandwidth_is_a_buffer():
    layer = SlicedAttention(8, 2, kernel="hat", bandwidth=(0.5, 2.0), learn_bandwidth=False)
    assert "log_bandwidth" not in dict(layer.named_parameters())
    torch.testing.assert_close(layer.state_dict()["log_bandwidth"], torch.log(torch.tensor([0.5, 2.0])))


@pytest.mark.parametrize("name", ["relu", "hat"])
def test_gradcheck_inputs(name):
    layer = make_layer({**KERNELS[name], "batch_first": True}, embed_dim=4, num_heads=2)
    g = torch.Generator().manual_seed(5)
    query, key = (torch.randn(1, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for n in (3, 4))
    mask = torch.tensor([[False, False, True, False]])
    assert torch.autograd.gradcheck(lambda q, k: layer(q, k, k, key_padding_mask=mask)[0], (query, key))


# ----------------------------------------------------------------------------- several slices
def one_slice_layers(layer, options):
    """The ``P`` one-slice layers a ``slices=P`` layer averages: its weights, with score rows ``p::P``
    (score ``h * P + p`` of ``Pi`` is slice ``p`` of head ``h``)."""
    slices, state = layer.config.slices, layer.state_dict()
    singles = []
    for p in range(slices):
        single = SlicedAttention(layer.embed_dim, layer.num_heads, kdim=layer.kdim, vdim=layer.vdim,
                                 dtype=torch.float64, **options)
        single.load_state_dict({**state, "score_out.weight": state["score_out.weight"][p::slices]})
        singles.append(single)
    return singles


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_slices_are_the_mean_of_one_slice_layers(name, causal):
    """``slices=3``: the mean of three one-slice layers, each against the dense reference (cross
    attention with Lq != Lk, kdim / vdim, padding, centring, causal or not)."""
    options = {**KERNELS[name], "batch_first": True, "center": True}
    layer = make_layer(options, kdim=5, vdim=4, slices=3)
    assert layer.score_out.weight.shape == (9, 12)
    query, key, value, mask = inputs(kdim=5, vdim=4)
    out, _ = layer(query, key, value, key_padding_mask=mask, is_causal=causal)
    singles = [dense_layer(single, options, query, key, value, mask, causal=causal)
               for single in one_slice_layers(layer, options)]
    torch.testing.assert_close(out, sum(singles) / 3, rtol=1e-9, atol=1e-11)
    assert (singles[0] - singles[1]).abs().max() > 1e-3        # the slices differ: the mean is no copy


@pytest.mark.parametrize("name", list(KERNELS))
def test_slices_keep_padded_tokens_out(name):
    options = {**KERNELS[name], "batch_first": True, "center": True, "rope": True, "slices": 2}
    layer = make_layer(options, embed_dim=32, num_heads=8)
    g = torch.Generator().manual_seed(3)
    real = torch.randn(2, 10, 32, generator=g, dtype=torch.float64)
    padded = torch.cat((real, 5.0 * torch.randn(2, 6, 32, generator=g, dtype=torch.float64)), dim=1)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[:, 10:] = True
    for causal in (False, True):
        out, _ = layer(padded, padded, padded, key_padding_mask=mask, is_causal=causal)
        torch.testing.assert_close(out[:, :10], layer(real, real, real, is_causal=causal)[0],
                                   rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["relu", "hat_mixture"])
def test_slices_gradients(name):
    """Every parameter gets a gradient, and the inputs' gradients pass gradcheck, with ``slices=2``."""
    layer = make_layer({**KERNELS[name], "batch_first": True, "center": False}, embed_dim=4, num_heads=2, slices=2)
    g = torch.Generator().manual_seed(5)
    query, key = (torch.randn(1, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for n in (3, 4))
    mask = torch.tensor([[False, False, True, False]])
    assert torch.autograd.gradcheck(lambda q, k: layer(q, k, k, key_padding_mask=mask)[0], (query, key))
    out, _ = layer(query, key, key, key_padding_mask=mask)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    for param_name, param in layer.named_parameters():
        assert param.grad is not None and param.grad.abs().max() > 1e-8, param_name


# ----------------------------------------------------------------------- parameters and state
def test_reset_parameters_follows_multihead_attention():
    layer = SlicedAttention(8, 2, kernel="hat_mixture", bandwidth=1.0, mixture_size=3)
    with torch.no_grad():
        for p in layer.parameters():
            p.fill_(0.3)
    layer.reset_parameters()
    for name in ("q_proj", "k_proj", "v_proj", "score_hidden", "out_proj"):
        assert torch.all(getattr(layer, name).bias == 0), name
    bound = math.sqrt(6.0 / (8 + 8))                    # xavier-uniform, as nn.MultiheadAttention
    assert layer.q_proj.weight.abs().max() <= bound and layer.q_proj.weight.std() > bound / 4
    torch.testing.assert_close(layer.log_bandwidth, torch.log(torch.tensor([[0.5, 1.0, 2.0]] * 2)))
    torch.testing.assert_close(layer.mixture_weight, torch.full((2, 3), 1 / 3))


def test_multihead_attention_names():
    """Constructor and attribute names mean what they mean on nn.MultiheadAttention."""
    ours = SlicedAttention(12, 3, kdim=5, vdim=4, batch_first=True, dropout=0.1)
    theirs = torch.nn.MultiheadAttention(12, 3, kdim=5, vdim=4, batch_first=True, dropout=0.1)
    for name in ("embed_dim", "num_heads", "head_dim", "kdim", "vdim", "batch_first", "dropout",
                 "_qkv_same_embed_dim"):
        assert getattr(ours, name) == getattr(theirs, name), name


@pytest.mark.parametrize("name", list(KERNELS))
def test_state_dict_round_trip(name):
    layer = make_layer({**KERNELS[name], "batch_first": True}, seed=4)
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    fresh = make_layer({**KERNELS[name], "batch_first": True}, seed=5)
    query, key, value, mask = inputs()
    assert not torch.equal(fresh(query, key, value)[0], layer(query, key, value)[0])
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    torch.testing.assert_close(fresh(query, key, value, key_padding_mask=mask)[0],
                               layer(query, key, value, key_padding_mask=mask)[0], rtol=0, atol=0)


# ------------------------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("name", ["relu", "hat"])
def test_bfloat16_autocast(name):
    """Under CPU autocast the projections run in bfloat16; the ops attend in float32 or better and
    return bfloat16; parameters keep float32 gradients."""
    torch.manual_seed(0)
    layer = SlicedAttention(16, 4, batch_first=True, **{k: v for k, v in KERNELS[name].items()})
    x = torch.randn(2, 24, 16)
    mask = torch.zeros(2, 24, dtype=torch.bool)
    mask[1, 20:] = True
    full, _ = layer(x, x, x, key_padding_mask=mask)
    assert full.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half, _ = layer(x, x, x, key_padding_mask=mask)
    assert half.dtype == torch.bfloat16
    assert torch.all(torch.isfinite(half))
    # bfloat16 keeps 8 bits: the projections' rounding moves the scores by about 1%.
    assert (half.float() - full).abs().max() <= 0.1 * full.abs().max()
    half.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 and torch.all(torch.isfinite(p.grad)) for p in layer.parameters())


def test_float32_layer_keeps_float32():
    layer = SlicedAttention(8, 2, kernel="hat_mixture", batch_first=True)
    x = torch.randn(1, 5, 8)
    out, _ = layer(x, x, x)
    assert out.dtype == torch.float32 and layer.log_bandwidth.dtype == torch.float32


# -------------------------------------------------------------------------------- compile
def test_torch_compile_matches_eager():
    """A model using the layer, compiled by Dynamo, gives eager's output and gradients.

    The Dynamo-only backend keeps this test short; graph breaks (inside the op) are allowed.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16),
                                SlicedTransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0,
                                                              batch_first=True, norm_first=True))
    x = torch.randn(2, 12, 3)
    eager = model(x)
    eager.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        # Dynamo warns while it traces torch's own autograd.Function machinery and the core's
        # functools caches; they say nothing about the results, which are checked below.
        warnings.simplefilter("ignore")
        compiled = torch.compile(model, backend="eager")(x)
        compiled.square().sum().backward()
        # The ops are opaque to Dynamo (custom ops): the whole model is one graph, no break.
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(model)(x)
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------- encoder layer
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_is_torch_encoder_layer_with_sliced_attention(norm_first, activation):
    """Same block as nn.TransformerEncoderLayer: its FFN / norm weights and our attention give
    the same output, and the submodule names agree."""
    torch.manual_seed(0)
    ours = SlicedTransformerEncoderLayer(12, 3, dim_feedforward=20, dropout=0.0, activation=activation,
                                         batch_first=True, norm_first=norm_first, kernel="hat",
                                         dtype=torch.float64)
    theirs = torch.nn.TransformerEncoderLayer(12, 3, dim_feedforward=20, dropout=0.0, activation=activation,
                                              batch_first=True, norm_first=norm_first, dtype=torch.float64)
    shared = {k: v for k, v in ours.state_dict().items() if not k.startswith("self_attn.")}
    assert set(shared) == {k for k in theirs.state_dict() if not k.startswith("self_attn.")}
    theirs.load_state_dict({**theirs.state_dict(), **shared})
    theirs.self_attn = ours.self_attn          # train mode: torch's layer takes its plain path
    x = torch.randn(2, 6, 12, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-12, atol=1e-12)


def test_encoder_passes_boolean_masks():
    layer = SlicedTransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    encoder = SlicedTransformerEncoder(layer, 3)
    assert len(encoder.layers) == 3 and encoder.layers[0] is not encoder.layers[1]
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 3:] = True
    assert encoder(torch.randn(2, 5, 8), src_key_padding_mask=mask).shape == (2, 5, 8)


# ------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs, error, match", [
    ({"num_heads": 5}, ValueError, "'num_heads'"),
    ({"kernel": "softmax"}, ValueError, "'kernel'"),
    ({"score": "mlp2"}, ValueError, "'score'"),
    ({"kernel": "relu", "bandwidth": 1.0}, ValueError, "'bandwidth'"),
    ({"kernel": "hat", "bandwidth": -1.0}, ValueError, "'bandwidth'"),
    ({"kernel": "hat", "bandwidth": (1.0, 2.0, 3.0)}, ValueError, "one entry per head"),
    ({"kernel": "hat", "mixture_size": 2}, ValueError, "'mixture_size'"),
    ({"kernel": "hat_mixture", "bandwidth": (1.0, 2.0), "mixture_size": 3}, ValueError, "mixture_size"),
    ({"normalize": "softmax"}, ValueError, "'normalize'"),
    ({"dropout": 1.5}, ValueError, "'dropout'"),
    ({"num_heads": 4, "rope": True}, ValueError, "'rope'"),
    ({"kdim": 0}, ValueError, "'kdim'"),
    ({"slices": 0}, ValueError, "'slices'"),
    ({"slices": 2.0}, ValueError, "'slices'"),
])
def test_bad_constructor_arguments(kwargs, error, match):
    arguments = {"embed_dim": 12, "num_heads": 2, **kwargs}
    with pytest.raises(error, match=match):
        SlicedAttention(arguments.pop("embed_dim"), arguments.pop("num_heads"), **arguments)


def test_bad_forward_arguments():
    layer = SlicedAttention(12, 3, batch_first=True, kdim=5)
    x, k = torch.randn(2, 4, 12), torch.randn(2, 6, 5)
    good = torch.zeros(2, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match="'query' must have embed_dim = 12"):
        layer(torch.randn(2, 4, 11), k, x[:, :1].expand(2, 6, 12))
    with pytest.raises(ValueError, match="'key' must have kdim = 5"):
        layer(x, x, x)
    with pytest.raises(ValueError, match="'key' and 'value'"):
        layer(x, k, x)
    value = torch.randn(2, 6, 12)
    with pytest.raises(ValueError, match="'key_padding_mask' must have shape"):
        layer(x, k, value, key_padding_mask=good[:, :5])
    with pytest.raises(TypeError, match="'key_padding_mask' must be a boolean mask"):
        layer(x, k, value, key_padding_mask=torch.full((2, 6), -1.0))   # additive, not torch's 0 / -inf form
    with pytest.raises(ValueError, match="need_weights=True"):
        layer(x, k, value, need_weights=True)
    with pytest.raises(ValueError, match="attn_mask"):
        layer(x, k, value, attn_mask=torch.zeros(4, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="batch size"):
        layer(x, k[:1], value[:1])
    with pytest.raises(ValueError, match="'query' must have shape"):
        layer(x[0, 0], k, value)
    assert layer(x, k, value, key_padding_mask=good)[0].shape == (2, 4, 12)


def test_kernel_object_is_used_as_is():
    kernel = PiecewiseLinear(knots=(-1.0, 1.0), coeffs=(1.0, -1.0))     # a clipped ramp
    layer = SlicedAttention(6, 2, kernel=kernel, batch_first=True)
    assert layer.log_bandwidth is None and layer.mixture_weight is None
    x = torch.randn(1, 4, 6)
    out, _ = layer(x, x, x)
    assert out.shape == (1, 4, 6) and torch.all(torch.isfinite(out))


# ------------------------------------------------------------------- issue 49: RoPE, flags, model
def _rope_layer(kernel):
    torch.manual_seed(0)
    layer = SlicedAttention(8, 2, kernel=kernel, rope=True, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        for parameter in layer.parameters():       # non-zero biases, bandwidths away from 1
            parameter.add_(0.3 * torch.randn_like(parameter))
    return layer.eval()


@pytest.mark.parametrize("kernel", ["hat", "relu"])
def test_rope_padding_is_no_position(kernel):
    """Issue 49 item 1: padding moves no real token's RoPE position, cross-attention (padded memory
    before the real keys; after them with ``query_positions``) and a left-padded causal prompt."""
    layer = _rope_layer(kernel)
    g = torch.Generator().manual_seed(4)
    n, lq, lk = 2, 4, 6
    query, memory, extra = (torch.randn(n, length, 8, generator=g, dtype=torch.float64) for length in (lq, lk, 3))
    with torch.no_grad():
        base, _ = layer(query, memory, memory)
        before = torch.cat([extra[:, :2], memory], dim=1)
        pad = torch.zeros(n, lk + 2, dtype=torch.bool)
        pad[:, :2] = True
        got, _ = layer(query, before, before, key_padding_mask=pad)
        torch.testing.assert_close(got, base, rtol=1e-12, atol=1e-12)
        own = torch.arange(lq).expand(n, lq)            # the queries' own positions
        base, _ = layer(query, memory, memory, query_positions=own)
        after = torch.cat([memory, extra[:, :2]], dim=1)
        got, _ = layer(query, after, after, key_padding_mask=pad.flip(-1), query_positions=own)
        torch.testing.assert_close(got, base, rtol=1e-12, atol=1e-12)
        x = memory
        base, _ = layer(x, x, x, is_causal=True)
        padded = torch.cat([extra, x], dim=1)
        pad = torch.zeros(n, lk + 3, dtype=torch.bool)
        pad[:, :3] = True
        got, _ = layer(padded, padded, padded, key_padding_mask=pad, is_causal=True)
        torch.testing.assert_close(got[:, 3:], base, rtol=1e-12, atol=1e-12)


def test_explicit_positions_are_the_rotation_angles():
    """``query_positions`` / ``key_positions`` are the positions the rotation uses: the layer's own
    rule given explicitly changes nothing, a shift of both moves the scores, and bad ones are named."""
    layer = _rope_layer("hat")
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    positions = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        base, _ = layer(x, x, x)
        same, _ = layer(x, x, x, query_positions=positions, key_positions=positions)
        shifted, _ = layer(x, x, x, query_positions=positions + 7, key_positions=positions + 7)
    torch.testing.assert_close(same, base, rtol=0, atol=0)
    assert float((shifted - base).abs().max()) > 1e-3
    with pytest.raises(TypeError, match="'query_positions' must hold integers"):
        layer(x, x, x, query_positions=positions.double())
    with pytest.raises(ValueError, match="'key_positions' must have shape"):
        layer(x, x, x, key_positions=positions[:, :3])
    with pytest.raises(ValueError, match="'query_positions' applies to rope=True"):
        make_layer(KERNELS["hat"], embed_dim=8, num_heads=2, batch_first=True)(x, x, x, query_positions=positions)
    with pytest.raises(ValueError, match="'key_positions' cannot be given with a cache"):
        layer(x, x, x, is_causal=True, cache=layer.init_cache(), key_positions=positions)


FLAGS = ("learn_bandwidth", "bias", "batch_first", "rope", "center")


@pytest.mark.parametrize("bad", ["no", 1, 0.0, None])
@pytest.mark.parametrize("flag", FLAGS)
def test_flags_must_be_booleans(flag, bad):
    """Issue 49 item 6: a flag given as "no" (truthy) or a number is a TypeError naming it, in the
    layer, the encoder layer and convert_attention; center alone also takes None (the ops' default)."""
    if flag == "center" and bad is None:
        return
    with pytest.raises(TypeError, match=f"'{flag}' must be True or False"):
        SlicedAttention(8, 2, kernel="hat", **{flag: bad})
    with pytest.raises(TypeError, match=f"'{flag}' must be True or False"):
        SlicedTransformerEncoderLayer(8, 2, **{flag: bad})
    if flag not in ("bias", "batch_first"):       # those two convert_attention takes from each attention
        with pytest.raises(TypeError, match=f"'{flag}' must be True or False"):
            convert_attention(nn.MultiheadAttention(8, 2), **{flag: bad})


def test_numpy_booleans_are_flags():
    layer = SlicedAttention(8, 2, kernel="hat", rope=np.True_, bias=np.False_, batch_first=np.True_,
                            learn_bandwidth=np.False_, center=np.True_)
    assert (layer.config.rope, layer.config.bias, layer.batch_first, layer.config.learn_bandwidth,
            layer.config.center) == (True, False, True, False, True)
    assert all(type(v) is bool for v in (layer.config.rope, layer.config.bias, layer.batch_first))


@pytest.mark.parametrize("name", ["is_causal", "need_weights", "average_attn_weights"])
def test_call_flags_must_be_booleans(name):
    layer = SlicedAttention(8, 2, batch_first=True)
    x = torch.randn(1, 3, 8)
    with pytest.raises(TypeError, match=f"'{name}' must be True or False"):
        layer(x, x, x, **{name: "no"})
    with pytest.raises(TypeError, match="'norm_first' must be True or False"):
        SlicedTransformerEncoderLayer(8, 2, norm_first="no")


@pytest.mark.parametrize("model", ["model", None, 3])
def test_convert_attention_of_a_non_module_names_model(model):
    """Issue 49 item 7: a TypeError naming 'model', not an AttributeError from inside the walk."""
    with pytest.raises(TypeError, match="argument 'model' must be a torch.nn.Module"):
        convert_attention(model)
