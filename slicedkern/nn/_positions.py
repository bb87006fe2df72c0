"""Where the layers' tokens sit: rotary embeddings, their positions (padding is no position), and
which queries see a key. Over the array API, for the torch and the Flax layers alike
(:mod:`slicedkern.nn`, "How a layer computes"; docs/mathematics.rst, "Causal attention")."""

from __future__ import annotations

from .._lib.causal import aligned_keys, key_offset
from .._lib.namespace import array_device
from ..backends import array_namespace

__all__ = ["ROPE_BASE", "rotary_embedding", "rope_positions", "forward_positions", "rotate_forward", "sees_keys",
           "zero_unseen"]

#: Base of the rotary embedding's frequencies (RoFormer's value).
ROPE_BASE = 10000.0


def rotary_embedding(x, num_heads: int, positions):
    """Rotate each head's features of ``x`` (N, L, E) by position (RoPE, half-split layout).

    Feature ``i`` of the first half of a head and feature ``i`` of its second half form a pair,
    rotated by the angle ``position * ROPE_BASE ** (-2 i / head_dim)``; ``positions`` (N, L) are the
    tokens' positions (:func:`rope_positions`). Any array-API namespace: the torch and the Flax
    layers both call it. Returns an array of ``x``'s shape and dtype.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[[1.0, 0.0]]])            # one head of 2 features: one pair
    >>> np.round(rotary_embedding(x, 1, np.array([[np.pi / 2]])), 12)
    array([[[0., 1.]]])
    """
    xp = array_namespace(x)
    batch, length, embed_dim = x.shape
    half = embed_dim // num_heads // 2
    heads = xp.reshape(x, (batch, length, num_heads, 2, half))
    # Angles in float32 at least: positions past 256 are not even integers in bfloat16.
    dtype = xp.result_type(x.dtype, xp.float32)
    frequency = ROPE_BASE ** (-xp.arange(half, dtype=dtype, device=array_device(x)) / half)
    angle = (xp.astype(positions, dtype)[..., None] * frequency)[:, :, None, :]     # (N, L, 1, half)
    cos, sin = xp.cos(angle), xp.sin(angle)
    first, second = heads[..., 0, :], heads[..., 1, :]
    rotated = xp.stack((first * cos - second * sin, first * sin + second * cos), axis=-2)
    return xp.astype(xp.reshape(rotated, (batch, length, embed_dim)), x.dtype, copy=False)


def sees_keys(key_mask, like, batch: int, q_len: int, k_len: int, causal: bool):
    """Whether a query sees a valid key: (N, 1, 1), or per query (N, Lq, 1) if ``causal``.

    ``key_mask``: (N, 1, Lk) bool, True = a valid key, or None (all valid; only when ``causal``);
    ``like``: an array of the namespace and device to answer in. The layers zero the rows of the
    queries that see none (the bias of ``out_proj`` would be left there otherwise).
    """
    xp = array_namespace(like)
    if not causal:
        return xp.any(key_mask, axis=-1)[..., None]
    last = aligned_keys(xp, q_len, k_len, array_device(like))
    sees = last >= 0
    if key_mask is None:
        return xp.broadcast_to(sees, (batch, q_len))[..., None]
    counts = xp.take(xp.cumulative_sum(key_mask, axis=-1), xp.clip(last, 0, k_len - 1), axis=-1)[:, 0]   # (N, Lq)
    return ((counts > 0) & sees)[..., None]


def rope_positions(like, q_len: int, k_len: int, valid=None, start=None):
    """The RoPE positions of a layer's queries and keys: padding is no position.

    A key's position is the number of valid keys before it in its row (plus ``start``, (N,) the
    valid keys a cache has seen), so padding, left, right or inside, moves no real token, as Hugging
    Face derives ``position_ids`` from the attention mask; a padded key takes the position of the
    next valid one (it is masked anyway). Query ``i`` takes the position of key ``i + Lk - Lq``, the
    token the causal rule aligns it with (the queries are the last ``Lq`` tokens of the keys' sequence,
    self-attention and generation alike), or ``i + Lk - Lq`` itself before the first key
    (``Lq > Lk``). ``valid``: (N, Lk) bool, True = a real key, or None; ``like``: an array of the
    namespace, device and batch size ``N`` (axis 0) to make them in. Returns ``(queries (N, Lq),
    keys (N, Lk))``, integer arrays.
    """
    xp = array_namespace(like)
    device = array_device(like)
    if valid is None:
        valid = xp.ones((like.shape[0], k_len), dtype=xp.bool, device=device)
    counts = xp.cumulative_sum(valid, axis=-1)            # the default integer dtype (int32 in JAX)
    keys = counts - xp.astype(valid, counts.dtype)        # valid keys before each key
    if start is not None:
        keys = keys + xp.astype(start, counts.dtype)[:, None]
    offset = key_offset(q_len, k_len)
    if offset >= 0:
        return keys[:, offset:], keys
    before = xp.arange(offset, 0, dtype=counts.dtype, device=device)
    first = xp.zeros_like(keys[:, :1]) if start is None else xp.astype(start, counts.dtype)[:, None]
    head = xp.broadcast_to(before[None, :] + first, (keys.shape[0], -offset))
    return xp.concat((head, keys), axis=-1), keys


def forward_positions(like, q_len: int, k_len: int, key_padding_mask=None, query_positions=None,
                      key_positions=None):
    """The RoPE positions of a forward call (no cache): the explicit ``query_positions`` /
    ``key_positions`` (N, L) where given, else ``rope_positions`` of the keys that are not
    padding (``key_padding_mask`` (N, Lk), True = padding, or None). Returns ``(queries, keys)``."""
    valid = None if key_padding_mask is None else ~key_padding_mask
    q_pos, k_pos = rope_positions(like, q_len, k_len, valid)
    return (q_pos if query_positions is None else query_positions,
            k_pos if key_positions is None else key_positions)


def rotate_forward(q, k, num_heads: int, key_padding_mask=None, query_positions=None, key_positions=None):
    """The projected queries (N, Lq, E) and keys (N, Lk, E) of a forward call (no cache) rotated at
    their :func:`forward_positions`: a layer's ``rope=True``."""
    q_pos, k_pos = forward_positions(q, q.shape[1], k.shape[1], key_padding_mask, query_positions, key_positions)
    return rotary_embedding(q, num_heads, q_pos), rotary_embedding(k, num_heads, k_pos)


def zero_unseen(out, key_padding_mask, k_len: int, causal: bool):
    """A layer's output (N, Lq, E) with zeros on the rows of the queries that see no valid key
    (:func:`sees_keys`; ``key_padding_mask`` (N, Lk), True = padding, or None): the bias of
    ``out_proj`` would be left there otherwise, where the attention gave zeros."""
    batch, q_len = out.shape[0], out.shape[1]
    if key_padding_mask is None and not (causal and q_len > k_len):
        return out
    xp = array_namespace(out)
    key_mask = None if key_padding_mask is None else ~key_padding_mask[:, None, :]        # (N, 1, Lk)
    zero = xp.zeros((), dtype=out.dtype, device=array_device(out))
    return xp.where(sees_keys(key_mask, out, batch, q_len, k_len, causal), out, zero)
