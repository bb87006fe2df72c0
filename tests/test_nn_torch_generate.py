"""Generation from the torch layers: a cache per layer, the new tokens only, equal to the full causal
forward at every step (every kernel, per-head bandwidths, mixtures, RoPE, chunks, left padding)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from slicedkern.kernels import Hat  # noqa: E402
from slicedkern.nn.torch import (  # noqa: E402
    AttentionCache,
    SlicedAttention,
    SlicedTransformerEncoder,
    SlicedTransformerEncoderLayer,
)

KERNELS = {"relu": ("relu", None), "hat-per-head": ("hat", [0.5, 1.5]), "hat_mixture": ("hat_mixture", None),
           "fixed-hat": (Hat(0.7), None)}


def _layer(kernel, rope, batch_first=True, slices=1):
    name, bandwidth = KERNELS[kernel]
    torch.manual_seed(3)
    layer = SlicedAttention(16, 2, kernel=name, bandwidth=bandwidth, rope=rope, batch_first=batch_first,
                            slices=slices)
    with torch.no_grad():           # learned-looking parameters, not the initial ones
        if layer.log_bandwidth is not None:
            layer.log_bandwidth.add_(0.3 * torch.randn_like(layer.log_bandwidth))
        if layer.mixture_weight is not None:
            layer.mixture_weight.copy_(torch.randn_like(layer.mixture_weight))
    return layer.double().eval()


def _steps(layer, x, pad, chunks):
    """The layer run token chunk by token chunk with one cache: (N, L, E)."""
    cache = layer.init_cache()
    out, start = [], 0
    for size in chunks:
        part = x[:, start:start + size]
        mask = None if pad is None else pad[:, start:start + size]
        got, _ = layer(part, part, part, key_padding_mask=mask, is_causal=True, cache=cache)
        out.append(got)
        start += size
    assert len(cache) == start
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("padded", [False, True], ids=["full", "left-padded"])
def test_cached_generation_equals_the_full_causal_forward(kernel, rope, padded):
    layer = _layer(kernel, rope)
    n, length = 3, 11
    x = torch.randn(n, length, 16, dtype=torch.float64)
    pad = None
    if padded:                      # left-padded prompts of three lengths in one batch
        pad = torch.zeros(n, length, dtype=torch.bool)
        pad[0, :4], pad[1, :1] = True, True
    with torch.no_grad():
        full, _ = layer(x, x, x, key_padding_mask=pad, is_causal=True)
        for chunks in ([1] * length, [4, 1, 3, 2, 1]):
            torch.testing.assert_close(_steps(layer, x, pad, chunks), full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["relu", "hat_mixture"])
def test_cached_generation_with_several_slices(kernel):
    """``slices=3``: each slice is a row of the decode cache, and the steps average them as the full
    causal forward does."""
    layer = _layer(kernel, rope=True, slices=3)
    x = torch.randn(3, 9, 16, dtype=torch.float64)
    pad = torch.zeros(3, 9, dtype=torch.bool)
    pad[0, :4] = True
    with torch.no_grad():
        full, _ = layer(x, x, x, key_padding_mask=pad, is_causal=True)
        torch.testing.assert_close(_steps(layer, x, pad, [1] * 9), full, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(_steps(layer, x, pad, [4, 2, 3]), full, rtol=1e-12, atol=1e-12)


def test_padding_contents_never_move_a_result():
    """Random values in the padded tokens change no output of a real token, cached or not."""
    layer = _layer("hat-per-head", rope=True)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[:, :3] = True
    other = x.clone()
    other[:, :3] = 100 * torch.randn(2, 3, 16, dtype=torch.float64)
    with torch.no_grad():
        a, b = _steps(layer, x, pad, [3, 1, 5]), _steps(layer, other, pad, [3, 1, 5])
    torch.testing.assert_close(a[:, 3:], b[:, 3:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("batch_first", [True, False])
def test_encoder_stack_generates_as_it_runs(batch_first):
    torch.manual_seed(0)
    layer = SlicedTransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, kernel="hat", rope=True,
                                          batch_first=batch_first, norm_first=True)
    encoder = SlicedTransformerEncoder(layer, num_layers=2, norm=torch.nn.LayerNorm(16)).double().eval()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    src = x if batch_first else x.transpose(0, 1)
    with torch.no_grad():
        full = encoder(src, is_causal=True)
        cache = encoder.init_cache()
        steps = []
        for t in range(7):
            token = src[:, t:t + 1] if batch_first else src[t:t + 1]
            steps.append(encoder(token, is_causal=True, cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1 if batch_first else 0), full, rtol=1e-12, atol=1e-12)


def test_bad_caches_name_the_argument():
    layer, other = _layer("relu", rope=False), _layer("relu", rope=False)
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    cache = layer.init_cache()
    assert isinstance(cache, AttentionCache)
    with pytest.raises(ValueError, match="'is_causal'"):
        layer(x, x, x, cache=cache)
    with pytest.raises(ValueError, match="'cache' belongs to another layer"):
        other(x, x, x, is_causal=True, cache=cache)
    with pytest.raises(TypeError, match="'cache'"):
        layer(x, x, x, is_causal=True, cache=[])
    layer(x, x, x, is_causal=True, cache=cache)
    with pytest.raises(ValueError, match="'cache' holds a batch of 2 rows"):
        layer(x[:1], x[:1], x[:1], is_causal=True, cache=cache)
    with pytest.raises(ValueError, match="'cache'"):
        layer(x.float(), x.float(), x.float(), is_causal=True, cache=cache)
    with pytest.raises(ValueError, match="'query' and 'key'"):
        layer(x[:, :1], x, x, is_causal=True, cache=cache)
    with pytest.raises(ValueError, match="one cache per layer"):
        SlicedTransformerEncoder(SlicedTransformerEncoderLayer(16, 2), 2)(x, is_causal=True, cache=[])


@pytest.mark.parametrize("kernel", ["hat-per-head", "relu"])
def test_left_padded_prompt_generates_as_the_unpadded_one(kernel):
    """Issue 49 item 1: with RoPE, a prompt left-padded by 3 generates, token by token and by
    chunks, the outputs of the unpadded prompt (the cache counts the real tokens it has seen)."""
    layer = _layer(kernel, rope=True)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    padded = torch.cat([torch.randn(2, 3, 16, dtype=torch.float64), x], dim=1)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[:, :3] = True
    with torch.no_grad():
        want = _steps(layer, x, None, [1] * 6)
        for chunks in ([1] * 9, [4, 2, 3]):
            torch.testing.assert_close(_steps(layer, padded, pad, chunks)[:, 3:], want, rtol=1e-12, atol=1e-12)


def test_a_step_of_no_tokens_leaves_the_cache_unchanged():
    """Issue 49 item 3: zero new tokens give an (N, 0, E) output, before and after other steps, and
    the generation goes on as if the empty steps had not been."""
    layer = _layer("hat-per-head", rope=True)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    cache = layer.init_cache()
    with torch.no_grad():
        full, _ = layer(x, x, x, is_causal=True)
        empty, _ = layer(x[:, :0], x[:, :0], x[:, :0], is_causal=True, cache=cache)
        assert empty.shape == (2, 0, 16) and len(cache) == 0 and cache.decode is None and cache.meta is None
        first, _ = layer(x[:, :3], x[:, :3], x[:, :3], is_causal=True, cache=cache)
        pad = torch.zeros(2, 0, dtype=torch.bool)
        empty, _ = layer(x[:, :0], x[:, :0], x[:, :0], key_padding_mask=pad, is_causal=True, cache=cache)
        assert empty.shape == (2, 0, 16) and len(cache) == 3
        rest, _ = layer(x[:, 3:], x[:, 3:], x[:, 3:], is_causal=True, cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, rtol=1e-12, atol=1e-12)
