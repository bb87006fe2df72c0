"""Sliced attention layers for PyTorch: drop-ins for ``nn.MultiheadAttention`` and the encoder layer.

``SlicedAttention`` takes the arguments of ``torch.nn.MultiheadAttention`` with the same meaning
(``batch_first``, ``kdim``/``vdim``, ``key_padding_mask`` True = ignore, ``(output, None)`` returned)
and computes sliced ReLU / hat attention in ``O(L log L)`` with slicedkern's sort-scan ops.
``SlicedTransformerEncoderLayer`` takes ``torch.nn.TransformerEncoderLayer``'s arguments, and
``SlicedTransformerEncoder`` stacks it as ``torch.nn.TransformerEncoder`` does, keeping boolean masks.

``convert_attention(model, **options)`` replaces every ``nn.MultiheadAttention`` of an existing
model by a ``SlicedAttention`` with its projections (the score maps are new and need training).

Examples
--------
>>> import torch
>>> from slicedkern.nn.torch import SlicedAttention
>>> attn = SlicedAttention(16, 4, kernel="hat", batch_first=True)
>>> x = torch.randn(2, 10, 16)
>>> pad = torch.zeros(2, 10, dtype=torch.bool)
>>> pad[1, 7:] = True       # the last three tokens of the second sequence are padding
>>> out, weights = attn(x, x, x, key_padding_mask=pad)
>>> out.shape, weights
(torch.Size([2, 10, 16]), None)
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..adapters import register_torch_operators
from ..kernels import PiecewiseLinear
from . import check_bool
from ._torch_attention import SlicedAttention, convert_attention
from ._torch_generate import AttentionCache

# a model of these layers may be exported (torch.export) and loaded where no op has run yet
register_torch_operators()

__all__ = ["SlicedAttention", "AttentionCache", "SlicedTransformerEncoderLayer", "SlicedTransformerEncoder",
           "convert_attention"]

# the public names live here, whichever file defines them (reprs, pickles, the API pages)
SlicedAttention.__module__ = convert_attention.__module__ = __name__


class SlicedTransformerEncoderLayer(nn.Module):
    """``torch.nn.TransformerEncoderLayer`` with :class:`SlicedAttention` as its self-attention.

    The arguments up to ``dtype`` are those of ``nn.TransformerEncoderLayer``, with the same
    meaning and defaults, and so are the submodule names (``self_attn``, ``linear1``, ``linear2``,
    ``norm1``, ``norm2``, ``dropout``, ``dropout1``, ``dropout2``): a model changes one class name.
    The keyword arguments after them configure the attention (see :class:`SlicedAttention`).

    Parameters
    ----------
    d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first, norm_first, bias,
    device, dtype
        As in ``torch.nn.TransformerEncoderLayer``; ``activation`` is "relu", "gelu" or a callable.
    kernel, score, bandwidth, learn_bandwidth, mixture_size, center, normalize, rope, slices
        As in :class:`SlicedAttention`.

    Examples
    --------
    >>> import torch
    >>> from slicedkern.nn.torch import SlicedTransformerEncoderLayer
    >>> layer = SlicedTransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True,
    ...                                       norm_first=True, kernel="hat")
    >>> layer(torch.randn(2, 12, 32)).shape
    torch.Size([2, 12, 32])
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str | Callable[[Tensor], Tensor] = F.relu, layer_norm_eps: float = 1e-5,
                 batch_first: bool = False, norm_first: bool = False, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, *,
                 kernel: str | PiecewiseLinear = "relu", score: str = "mlp",
                 bandwidth: float | tuple[float, ...] | None = None, learn_bandwidth: bool = True,
                 mixture_size: int | None = None, center: bool | None = None, normalize: str | None = "auto",
                 rope: bool = False, slices: int = 1) -> None:
        super().__init__()
        check_bool(norm_first, "norm_first")         # the attention checks its own flags
        factory = {"device": device, "dtype": dtype}
        self.self_attn = SlicedAttention(d_model, nhead, kernel=kernel, score=score, bandwidth=bandwidth,
                                         learn_bandwidth=learn_bandwidth, mixture_size=mixture_size,
                                         center=center, normalize=normalize, dropout=dropout, bias=bias,
                                         batch_first=batch_first, rope=rope, slices=slices, **factory)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        if isinstance(activation, str):
            if activation not in ("relu", "gelu"):
                raise ValueError(f"argument 'activation' must be 'relu', 'gelu' or a callable, got "
                                 f"{activation!r}")
            activation = F.relu if activation == "relu" else F.gelu
        elif not callable(activation):
            raise TypeError(f"argument 'activation' must be 'relu', 'gelu' or a callable, got "
                            f"{type(activation).__name__}")
        self.activation = activation

    def init_cache(self) -> AttentionCache:
        """An empty cache of the self-attention, for generating (``forward(..., cache=)``)."""
        return self.self_attn.init_cache()

    def forward(self, src: Tensor, src_mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                is_causal: bool = False, *, cache: AttentionCache | None = None) -> Tensor:
        """One encoder layer, with ``nn.TransformerEncoderLayer.forward``'s arguments.

        ``src`` (L, N, E) or (N, L, E) with ``batch_first``; ``src_key_padding_mask`` boolean (N, L),
        True = padding; ``src_mask`` only as the causal mask with ``is_causal=True``. ``cache``
        (:meth:`init_cache`): generation, ``src`` being the new tokens only, as in
        :meth:`SlicedAttention.forward`.
        """
        x = src
        if self.norm_first:
            x = x + self._attention_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal, cache)
            x = x + self._feed_forward_block(self.norm2(x))
        else:
            x = self.norm1(x + self._attention_block(x, src_mask, src_key_padding_mask, is_causal, cache))
            x = self.norm2(x + self._feed_forward_block(x))
        return x

    def _attention_block(self, x: Tensor, attn_mask: Tensor | None, key_padding_mask: Tensor | None,
                         is_causal: bool, cache: AttentionCache | None = None) -> Tensor:
        out, _ = self.self_attn(x, x, x, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                is_causal=is_causal, cache=cache)
        return self.dropout1(out)

    def _feed_forward_block(self, x: Tensor) -> Tensor:
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))


class SlicedTransformerEncoder(nn.Module):
    """A stack of ``num_layers`` copies of an encoder layer, as ``torch.nn.TransformerEncoder``.

    ``nn.TransformerEncoder`` turns a boolean ``src_key_padding_mask`` into an additive float mask
    before its layers see it (which sliced attention turns back, see :func:`convert_attention`);
    this class passes the boolean mask through unchanged.

    Parameters
    ----------
    encoder_layer : SlicedTransformerEncoderLayer
        Copied ``num_layers`` times (independent parameters).
    num_layers : int
    norm : nn.Module, optional
        Applied to the output of the last layer.

    Examples
    --------
    >>> import torch
    >>> from slicedkern.nn.torch import SlicedTransformerEncoder, SlicedTransformerEncoderLayer
    >>> layer = SlicedTransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
    >>> encoder = SlicedTransformerEncoder(layer, num_layers=2, norm=torch.nn.LayerNorm(16))
    >>> encoder(torch.randn(3, 8, 16)).shape
    torch.Size([3, 8, 16])
    """

    def __init__(self, encoder_layer: nn.Module, num_layers: int, norm: nn.Module | None = None) -> None:
        super().__init__()
        if not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"argument 'num_layers' must be a positive integer, got {num_layers!r}")
        self.layers = nn.ModuleList(copy.deepcopy(encoder_layer) for _ in range(num_layers))
        self.num_layers = num_layers
        self.norm = norm

    def init_cache(self) -> list[AttentionCache]:
        """One empty cache per layer, for generating (``forward(..., cache=)``)."""
        return [layer.init_cache() for layer in self.layers]

    def forward(self, src: Tensor, mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                is_causal: bool = False, *, cache: list[AttentionCache] | None = None) -> Tensor:
        """Run the layers in turn; arguments as ``nn.TransformerEncoder.forward``; ``cache`` (from
        :meth:`init_cache`) for generation, ``src`` being the new tokens only."""
        out = src
        caches = [None] * self.num_layers if cache is None else cache
        if len(caches) != self.num_layers:
            raise ValueError(f"argument 'cache' must hold one cache per layer ({self.num_layers}), got "
                             f"{len(caches)}: make it with init_cache()")
        for layer, layer_cache in zip(self.layers, caches):
            out = layer(out, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal,
                        cache=layer_cache)
        return out if self.norm is None else self.norm(out)
