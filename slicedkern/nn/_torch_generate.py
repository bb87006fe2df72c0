"""Generation with the torch layers: rotary embeddings at absolute positions and the layer's cache.

:class:`AttentionCache` keeps a :class:`slicedkern.DecodeCache` per layer (one row per batch entry
and head); :func:`generate_step` is :meth:`slicedkern.nn.torch.SlicedAttention.forward` with a
cache (docs/mathematics.rst, "Decoding"). Re-exported by :mod:`slicedkern.nn.torch`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import Generation, decode_heads, keep_seen, merge_heads

__all__ = ["AttentionCache", "generate_step"]


class AttentionCache(Generation):
    """The keys and values a :class:`SlicedAttention` layer has seen while generating.

    Made by :meth:`SlicedAttention.init_cache`; passed as ``cache=`` with ``is_causal=True`` and the
    new tokens only, it makes the layer's output for them equal to the rows of the full causal
    forward over every token so far (a :class:`slicedkern.DecodeCache` per layer, one row per batch
    entry and head; docs/mathematics.rst, "Decoding"). Inference only: the cache reads the layer's
    bandwidths and weights when it is first used and keeps no gradient.

    Examples
    --------
    >>> import torch
    >>> from slicedkern.nn.torch import SlicedAttention
    >>> attn = SlicedAttention(16, 2, batch_first=True).double().eval()
    >>> x = torch.randn(3, 6, 16, dtype=torch.float64)
    >>> full, _ = attn(x, x, x, is_causal=True)
    >>> cache = attn.init_cache()
    >>> tokens = [x[:, t:t + 1] for t in range(6)]
    >>> steps = [attn(xt, xt, xt, is_causal=True, cache=cache)[0] for xt in tokens]
    >>> torch.allclose(torch.cat(steps, dim=1), full)
    True
    """

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def check_layer(self, layer: nn.Module) -> None:
        if self.layer is not layer:
            raise ValueError("argument 'cache' belongs to another layer: make one per layer with "
                             "layer.init_cache()")


def generate_step(layer: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                   key_padding_mask: Tensor | None, is_causal: bool, cache: AttentionCache) -> Tensor:
    """:meth:`SlicedAttention.forward` with a cache, batch first: (N, T, E) new tokens to (N, T, E)."""
    if not isinstance(cache, AttentionCache):
        raise TypeError(f"argument 'cache' must be an AttentionCache (layer.init_cache()), got "
                        f"{type(cache).__name__}")
    cache.check_layer(layer)
    cache.check_step(is_causal, query.shape[1], key.shape[1], query.shape[0], query.dtype, query.device)
    cfg = layer.config
    q, k, v = layer.q_proj(query), layer.k_proj(key), layer.v_proj(value)
    valid = None if key_padding_mask is None else ~key_padding_mask       # (N, T)
    bandwidth = None if layer.log_bandwidth is None else torch.exp(layer.log_bandwidth.detach())
    weight = None if layer.mixture_weight is None else layer.mixture_weight.detach()
    ctx, sees = decode_heads(cfg, cache, layer.scores, q, k, v, valid, (bandwidth, weight))
    return keep_seen(layer.out_proj(layer.attention_dropout(merge_heads(cfg, ctx))), sees)
