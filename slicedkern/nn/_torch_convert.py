"""How :func:`slicedkern.nn.torch.convert_attention` fits sliced layers into torch models: the
projections copied from an ``nn.MultiheadAttention``, the walk that replaces them, and the masks
torch's transformer layers pass (float padding masks, unflagged causal masks), read back into what
:class:`~slicedkern.nn.torch.SlicedAttention` takes; and which queries see a valid key."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["taken_arguments", "copy_projections", "replace_attention", "boolean_padding", "is_square_causal"]

#: Arguments of SlicedAttention that convert_attention takes from each nn.MultiheadAttention.
TAKEN_FROM_ATTENTION = ("embed_dim", "num_heads", "dropout", "bias", "kdim", "vdim", "batch_first", "device",
                         "dtype")


def taken_arguments(attention: nn.MultiheadAttention, options: dict) -> dict:
    """The constructor arguments a sliced layer takes from ``attention`` (TypeError for an
    ``attention`` of another type or an option among them; ValueError for what it cannot take)."""
    if not isinstance(attention, nn.MultiheadAttention):
        raise TypeError(f"argument 'attention' must be a torch.nn.MultiheadAttention, got "
                        f"{type(attention).__name__}")
    for name in options:
        if name in TAKEN_FROM_ATTENTION:
            raise TypeError(f"argument {name!r} is taken from each nn.MultiheadAttention and cannot be given")
    if attention.bias_k is not None or attention.add_zero_attn:
        raise ValueError("argument 'attention': add_bias_kv and add_zero_attn have no sliced counterpart")
    weight = attention.out_proj.weight
    return {"embed_dim": attention.embed_dim, "num_heads": attention.num_heads, "dropout": attention.dropout,
            "bias": attention.in_proj_bias is not None, "kdim": attention.kdim, "vdim": attention.vdim,
            "batch_first": attention.batch_first, "device": weight.device, "dtype": weight.dtype}


def copy_projections(layer: nn.Module, attention: nn.MultiheadAttention) -> None:
    """Copy ``attention``'s query, key, value and output projections into ``layer``'s ``q_proj``,
    ``k_proj``, ``v_proj`` and ``out_proj`` (``in_proj_weight`` split in three, or the separate ones)."""
    embed = attention.embed_dim
    if attention._qkv_same_embed_dim:
        weights = attention.in_proj_weight.split(embed)
    else:
        weights = (attention.q_proj_weight, attention.k_proj_weight, attention.v_proj_weight)
    biases = (None,) * 3 if attention.in_proj_bias is None else attention.in_proj_bias.split(embed)
    with torch.no_grad():
        for linear, w, b in zip((layer.q_proj, layer.k_proj, layer.v_proj), weights, biases):
            linear.weight.copy_(w)
            if b is not None:
                linear.bias.copy_(b)
        layer.out_proj.weight.copy_(attention.out_proj.weight)
        if attention.out_proj.bias is not None:
            layer.out_proj.bias.copy_(attention.out_proj.bias)


def replace_attention(model: nn.Module, make_layer: Callable[[nn.MultiheadAttention], nn.Module],
                      layer_class: type) -> nn.Module:
    """Replace every ``nn.MultiheadAttention`` below ``model`` by ``make_layer(it)`` (one layer per
    shared attention), and turn off the nested-tensor fast path of the encoders that now hold
    ``layer_class`` layers; ValueError if there was none."""
    converted: dict[int, nn.Module] = {}

    def walk(module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, nn.MultiheadAttention):
                if id(child) not in converted:
                    converted[id(child)] = make_layer(child)
                setattr(module, name, converted[id(child)])
            else:
                walk(child)

    walk(model)
    if not converted:
        raise ValueError(f"argument 'model' ({type(model).__name__}) holds no torch.nn.MultiheadAttention to "
                         "convert; attention written otherwise (e.g. with F.scaled_dot_product_attention) "
                         "is not replaced")
    for module in model.modules():
        # decided at construction from the softmax layer: it would run torch's fused kernel on nested tensors
        if isinstance(module, nn.TransformerEncoder) and isinstance(
                getattr(module.layers[0], "self_attn", None), layer_class):
            module.use_nested_tensor = False
    return model


def boolean_padding(mask: Tensor) -> Tensor:
    """A float ``key_padding_mask`` as torch's transformer layers make it from a boolean one (``0`` keep,
    ``-inf`` ignore) back to that boolean mask; TypeError for any other float mask (an additive bias
    cannot be applied without the attention weights)."""
    ignored = mask == -math.inf
    if not bool((ignored | (mask == 0)).all()):
        raise TypeError("argument 'key_padding_mask' must be a boolean mask (True = ignore the key) or the float "
                        "form torch's transformer layers make of one (0 = keep, -inf = ignore); other float "
                        "(additive) masks are not supported, since the attention weights are never formed")
    return ignored


def is_square_causal(mask: Tensor, q_len: int, k_len: int) -> bool:
    """Whether ``attn_mask`` is the square causal mask (boolean True, or float ``-inf``, strictly above the
    diagonal and nothing else), possibly repeated over leading dims: ``torch.nn``'s causal-mask test."""
    if q_len != k_len or mask.dim() < 2 or tuple(mask.shape[-2:]) != (q_len, k_len):
        return False
    above = torch.ones(q_len, q_len, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return bool((mask == above).all())
    if not mask.is_floating_point():
        return False
    expected = torch.zeros((q_len, q_len), dtype=mask.dtype, device=mask.device).masked_fill(above, -math.inf)
    return bool((mask == expected).all())
