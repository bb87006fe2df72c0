"""Generation from the Flax layer, Flax's convention (``init_cache``, ``decode=True``): the new tokens
only, equal to the full causal forward at every step (every kernel, RoPE, chunks, left padding)."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
import jax.numpy as jnp  # noqa: E402
from _helpers import jax_x64  # noqa: E402

from slicedkern.kernels import Hat  # noqa: E402
from slicedkern.nn.flax import SlicedAttention  # noqa: E402


@pytest.fixture(autouse=True)
def x64():
    with jax_x64(True):
        yield


def _layer(kernel, rope, slices=1):
    layer = SlicedAttention(16, 2, kernel=kernel, rope=rope, batch_first=True, param_dtype=jnp.float64,
                            bandwidth=[0.5, 1.5] if kernel == "hat" else None, slices=slices, rngs=nnx.Rngs(0))
    if layer.mixture_weight is not None:       # learned-looking weights, not the initial ones
        layer.mixture_weight[...] = jax.random.normal(jax.random.key(5), layer.mixture_weight[...].shape)
    layer.eval()
    return layer


# every JAX decoding step compiles a few small functions per new run size (about 13 s a case here):
# the default profile runs one case, --exhaustive the rest
_SLOW = pytest.mark.exhaustive


@pytest.mark.parametrize("kernel, rope, slices", [
    ("hat", True, 1), ("hat_mixture", True, 3), pytest.param("hat_mixture", False, 1, marks=_SLOW),
    pytest.param("relu", False, 1, marks=_SLOW), pytest.param("relu", True, 1, marks=_SLOW),
    pytest.param("hat", False, 1, marks=_SLOW), pytest.param("hat_mixture", True, 1, marks=_SLOW),
    pytest.param(Hat(0.7), False, 1, marks=_SLOW), pytest.param(Hat(0.7), True, 1, marks=_SLOW)], ids=str)
def test_decoding_equals_the_full_causal_forward(kernel, rope, slices):
    layer = _layer(kernel, rope, slices)
    x = jax.random.normal(jax.random.key(1), (3, 8, 16), dtype=jnp.float64)
    pad = jnp.zeros((3, 8), dtype=bool).at[0, :4].set(True).at[1, :1].set(True)   # left-padded prompts
    full, _ = layer(x, x, x, key_padding_mask=pad, is_causal=True)
    for chunks in ([1] * 8, [4, 1, 3]):
        layer.init_cache(x.shape, jnp.float64)
        steps, start = [], 0
        for size in chunks:
            part = x[:, start:start + size]
            out, _ = layer(part, part, part, key_padding_mask=pad[:, start:start + size], is_causal=True,
                           decode=True)
            steps.append(out)
            start += size
        assert len(layer.cache) == 8
        assert float(jnp.max(jnp.abs(jnp.concatenate(steps, axis=1) - full))) < 1e-12


def test_bad_decoding_calls_name_the_argument():
    layer = _layer("relu", rope=False)
    x = jnp.zeros((2, 1, 16), dtype=jnp.float64)
    with pytest.raises(ValueError, match="init_cache"):
        layer(x, x, x, is_causal=True, decode=True)
    layer.init_cache(x.shape, jnp.float64)
    with pytest.raises(ValueError, match="'is_causal'"):
        layer(x, x, x, decode=True)
    with pytest.raises(ValueError, match="'cache' holds a batch of 2 rows"):
        layer(x[:1], x[:1], x[:1], is_causal=True, decode=True)
    with pytest.raises(ValueError, match="'cache'"):
        layer(x.astype(jnp.float32), x.astype(jnp.float32), x.astype(jnp.float32), is_causal=True, decode=True)


def _decode(layer, x, pad, chunks):
    layer.init_cache(x.shape, jnp.float64)
    steps, start = [], 0
    for size in chunks:
        part = x[:, start:start + size]
        mask = None if pad is None else pad[:, start:start + size]
        steps.append(layer(part, part, part, key_padding_mask=mask, is_causal=True, decode=True)[0])
        start += size
    return jnp.concatenate(steps, axis=1)


@pytest.mark.parametrize("kernel", ["hat", pytest.param("relu", marks=_SLOW)])
def test_left_padded_prompt_decodes_as_the_unpadded_one(kernel):
    """Issue 49 item 1: with RoPE, a prompt left-padded by 3 decodes the unpadded prompt's outputs,
    and so does the full causal forward (padding is no position)."""
    layer = _layer(kernel, rope=True)
    x = jax.random.normal(jax.random.key(2), (2, 5, 16), dtype=jnp.float64)
    padded = jnp.concatenate([jax.random.normal(jax.random.key(3), (2, 3, 16), dtype=jnp.float64), x], axis=1)
    pad = jnp.zeros((2, 8), dtype=bool).at[:, :3].set(True)
    want, _ = layer(x, x, x, is_causal=True)
    full, _ = layer(padded, padded, padded, key_padding_mask=pad, is_causal=True)
    assert float(jnp.max(jnp.abs(full[:, 3:] - want))) < 1e-12
    got = _decode(layer, padded, pad, [4, 4])
    assert float(jnp.max(jnp.abs(got[:, 3:] - want))) < 1e-12


def test_decoding_no_tokens_leaves_the_cache_unchanged():
    """Issue 49 item 3: ``decode=True`` with zero new tokens gives (N, 0, E) and changes nothing."""
    layer = _layer("hat", rope=True)
    x = jax.random.normal(jax.random.key(4), (2, 4, 16), dtype=jnp.float64)
    want, _ = layer(x, x, x, is_causal=True)
    layer.init_cache(x.shape, jnp.float64)
    empty, _ = layer(x[:, :0], x[:, :0], x[:, :0], is_causal=True, decode=True)
    assert empty.shape == (2, 0, 16) and len(layer.cache) == 0 and layer.cache.decode is None
    first, _ = layer(x[:, :2], x[:, :2], x[:, :2], is_causal=True, decode=True)
    empty, _ = layer(x[:, :0], x[:, :0], x[:, :0], is_causal=True, decode=True)
    assert empty.shape == (2, 0, 16) and len(layer.cache) == 2
    rest, _ = layer(x[:, 2:], x[:, 2:], x[:, 2:], is_causal=True, decode=True)
    assert float(jnp.max(jnp.abs(jnp.concatenate([first, rest], axis=1) - want))) < 1e-12
