"""Sliced attention layers for PyTorch and Flax NNX.

Two framework modules share one configuration, kept here:

* :mod:`slicedkern.nn.torch` -- ``SlicedAttention``, a drop-in for ``torch.nn.MultiheadAttention``,
  ``SlicedTransformerEncoderLayer`` / ``SlicedTransformerEncoder``, drop-ins for their ``torch.nn``
  namesakes, and ``convert_attention``, which converts the attention of an existing model;
* :mod:`slicedkern.nn.flax` -- ``SlicedAttention`` as a Flax NNX module with the same parameters,
  the same parameter names and the same semantics (its weights load from a torch ``state_dict``).

Importing :mod:`slicedkern.nn` imports no framework; import the submodule of the framework you use.

How a layer computes
--------------------
For input tokens ``x`` (queries), ``y`` (keys) and ``z`` (values), with ``H`` heads of width
``Dh = embed_dim / H``:

1. ``Q = W_q x``, ``K = W_k y``, ``V = W_v z`` (shape ``(..., L, embed_dim)``), optionally with
   rotary position embeddings applied to ``Q`` and ``K`` head by head (``rope=True``) at the
   positions of ``rope_positions``: padding is no position (a key's position counts the valid
   keys before it), and query ``i`` takes the position of key ``i + Lk - Lq``, the token
   ``is_causal`` aligns it with;
2. one score per head and token, ``s = Pi(Q)`` and ``t = Pi(K)`` of shape ``(..., L, H)``, with the
   same learned map ``Pi``: linear (``score="linear"``) or a one-hidden-layer MLP of width
   ``embed_dim`` with GELU (``score="mlp"``). ``Pi`` reads one token at a time, so no token ever
   sees another one's hidden state here;
3. per head, the sort-scan attention of the chosen kernel on the scores, with the head's slice of
   ``V`` as values and the padding mask as ``key_mask``: :func:`slicedkern.relu_attention`,
   :func:`slicedkern.hat_attention` (one learned bandwidth per head, in log space),
   :func:`slicedkern.hat_mixture_attention` (per head, ``mixture_size`` learned bandwidths and
   weights) or :func:`slicedkern.kernel_attention` (a fixed kernel object);
   with ``slices=P``, ``Pi`` gives ``P`` scores per head and token, each slice attends on its own
   (normalised on its own) and the head's output is their mean: the Monte-Carlo multi-slice kernel
   of :func:`slicedkern.sliced_attention` inside the layer, at ``P`` times the cost of one slice;
4. the heads concatenated, dropout, and ``W_o``. A row whose keys are all padded returns zeros.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .. import DecodeCache, hat_attention, hat_mixture_attention, kernel_attention, relu_attention
from .._lib.namespace import array_device
from .._spec import NORMALIZERS, OP_DEFAULTS
from .._validate import check_bool
from ..backends import array_namespace
from ..kernels import PiecewiseLinear
from ._positions import rope_positions, rotary_embedding

__all__: list[str] = []

_KERNEL_NAMES = ("relu", "hat", "hat_mixture")
_SCORES = ("mlp", "linear")
_NORMALIZERS = tuple(NORMALIZERS)
#: Default number of hats per head of ``kernel="hat_mixture"``.
_DEFAULT_MIXTURE_SIZE = 3


@dataclass(frozen=True)
class LayerConfig:
    """The validated constructor arguments of a sliced attention layer (any framework).

    ``kernel_name`` is "relu", "hat", "hat_mixture", or "custom" for a kernel object (``kernel``).
    ``bandwidths`` holds the initial bandwidths: one per head for "hat", one per hat of the
    mixture for "hat_mixture" (every head starts alike), empty otherwise. ``center`` and
    ``normalize`` are resolved to the op's defaults when the caller left them out.
    """

    embed_dim: int
    num_heads: int
    kernel_name: str
    kernel: PiecewiseLinear | None
    score: str
    bandwidths: tuple[float, ...]
    learn_bandwidth: bool
    center: bool
    normalize: str | None
    dropout: float
    bias: bool
    kdim: int
    vdim: int
    batch_first: bool
    rope: bool
    slices: int = 1

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def mixture_size(self) -> int:
        return len(self.bandwidths) if self.kernel_name == "hat_mixture" else 0

    @property
    def has_bandwidth(self) -> bool:
        return self.kernel_name in ("hat", "hat_mixture")


def _positive_int(value, name: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"argument {name!r} must be a positive integer, got {value!r}")
    return int(value)


def _positive_floats(value, name: str) -> tuple[float, ...]:
    values = (value,) if isinstance(value, numbers.Real) and not isinstance(value, bool) else value
    try:
        values = tuple(values)
    except TypeError:
        raise TypeError(f"argument {name!r} must be a number or a sequence of numbers, "
                        f"got {type(value).__name__}") from None
    out = []
    for entry in values:
        if not isinstance(entry, numbers.Real) or isinstance(entry, bool):
            raise TypeError(f"argument {name!r} must hold numbers, got {type(entry).__name__}")
        if not (0.0 < float(entry) < math.inf):
            raise ValueError(f"argument {name!r} must be positive and finite, got {entry!r}")
        out.append(float(entry))
    if not out:
        raise ValueError(f"argument {name!r} must not be empty")
    return tuple(out)


def _initial_bandwidths(kernel_name: str, bandwidth, mixture_size, num_heads: int) -> tuple[float, ...]:
    """One bandwidth per head ("hat") or per hat of the mixture ("hat_mixture")."""
    if kernel_name not in ("hat", "hat_mixture"):
        if bandwidth is not None:
            raise ValueError(f"argument 'bandwidth' applies to kernel='hat' or 'hat_mixture', not to "
                             f"kernel={kernel_name!r}")
        if mixture_size is not None:
            raise ValueError(f"argument 'mixture_size' applies to kernel='hat_mixture' only, not to "
                             f"kernel={kernel_name!r}")
        return ()
    values = _positive_floats(1.0 if bandwidth is None else bandwidth, "bandwidth")
    if kernel_name == "hat":
        if mixture_size is not None:
            raise ValueError("argument 'mixture_size' applies to kernel='hat_mixture' only, not to "
                             "kernel='hat'")
        if len(values) not in (1, num_heads):
            raise ValueError(f"argument 'bandwidth' must be a number or hold one entry per head "
                             f"(num_heads = {num_heads}), got {len(values)} entries")
        return values * num_heads if len(values) == 1 else values
    if len(values) > 1:
        size = len(values) if mixture_size is None else _positive_int(mixture_size, "mixture_size")
        if size != len(values):
            raise ValueError(f"argument 'bandwidth' holds {len(values)} bandwidths but "
                             f"mixture_size = {mixture_size}")
        return values
    size = _DEFAULT_MIXTURE_SIZE if mixture_size is None else _positive_int(mixture_size, "mixture_size")
    # Geometric spread around the given bandwidth (b/2, b, 2b for three hats): several scales at once.
    return tuple(values[0] * 2.0 ** (i - (size - 1) / 2) for i in range(size))


def layer_config(embed_dim, num_heads, *, kernel, score, bandwidth, learn_bandwidth, mixture_size, center,
                 normalize, dropout, bias, kdim, vdim, batch_first, rope, slices=1) -> LayerConfig:
    """Validate the constructor arguments shared by the torch and Flax layers.

    Every error is a ``ValueError`` (or ``TypeError`` for a wrong type) that names the argument;
    the flags (``learn_bandwidth``, ``bias``, ``batch_first``, ``rope`` and ``center`` unless None)
    must be Python or NumPy booleans.
    """
    embed_dim = _positive_int(embed_dim, "embed_dim")
    num_heads = _positive_int(num_heads, "num_heads")
    if embed_dim % num_heads:
        raise ValueError(f"argument 'num_heads' ({num_heads}) must divide embed_dim ({embed_dim})")
    if isinstance(kernel, PiecewiseLinear):
        kernel_name, kernel_object = "custom", kernel
    elif isinstance(kernel, str) and kernel in _KERNEL_NAMES:
        kernel_name, kernel_object = kernel, None
    else:
        raise ValueError(f"argument 'kernel' must be one of {_KERNEL_NAMES} or a "
                         f"slicedkern.kernels.PiecewiseLinear, got {kernel!r}")
    if score not in _SCORES:
        raise ValueError(f"argument 'score' must be one of {_SCORES}, got {score!r}")
    bandwidths = _initial_bandwidths(kernel_name, bandwidth, mixture_size, num_heads)
    op_name = "kernel" if kernel_name == "custom" else kernel_name
    # the ops' defaults: centred ReLU, plain hats
    center = OP_DEFAULTS[op_name]["center"] if center is None else check_bool(center, "center")
    # one rule for every flag, the ops' own: "no" or 1 is an error, not a truthy True
    learn_bandwidth, bias, batch_first, rope = (check_bool(value, name) for value, name in (
        (learn_bandwidth, "learn_bandwidth"), (bias, "bias"), (batch_first, "batch_first"), (rope, "rope")))
    if normalize == "auto":
        normalize = OP_DEFAULTS[op_name]["normalize"]
    elif normalize not in _NORMALIZERS:
        raise ValueError(f"argument 'normalize' must be 'auto' or one of {_NORMALIZERS}, got {normalize!r}")
    if not isinstance(dropout, numbers.Real) or not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"argument 'dropout' must be a probability in [0, 1), got {dropout!r}")
    kdim = embed_dim if kdim is None else _positive_int(kdim, "kdim")
    vdim = embed_dim if vdim is None else _positive_int(vdim, "vdim")
    if rope and (embed_dim // num_heads) % 2:
        raise ValueError(f"argument 'rope' needs an even head width, got embed_dim / num_heads = "
                         f"{embed_dim // num_heads}")
    return LayerConfig(embed_dim=embed_dim, num_heads=num_heads, kernel_name=kernel_name,
                       kernel=kernel_object, score=score, bandwidths=bandwidths,
                       learn_bandwidth=learn_bandwidth, center=center, normalize=normalize,
                       dropout=float(dropout), bias=bias, kdim=kdim, vdim=vdim,
                       batch_first=batch_first, rope=rope,
                       slices=_positive_int(slices, "slices"))


def attention_op(config: LayerConfig) -> Callable:
    """The public slicedkern op that computes the configured kernel."""
    return {"relu": relu_attention, "hat": hat_attention, "hat_mixture": hat_mixture_attention,
            "custom": kernel_attention}[config.kernel_name]


def check_positions(config: LayerConfig, name: str, shape: Sequence[int], is_integer: bool,
                    expected: tuple[int, ...], cached: bool) -> None:
    """Validate explicit RoPE positions (``query_positions`` / ``key_positions``) of a forward call:
    integers of shape ``expected`` ((N, L), or (L,) unbatched), with ``rope=True`` and no cache."""
    if not config.rope:
        raise ValueError(f"argument {name!r} applies to rope=True only (the layer has no positions)")
    if cached:
        raise ValueError(f"argument {name!r} cannot be given with a cache: generation continues the cache's "
                         "positions (the real tokens it has seen)")
    if not is_integer:
        raise TypeError(f"argument {name!r} must hold integers (token positions)")
    if tuple(shape) != tuple(expected):
        raise ValueError(f"argument {name!r} must have shape {tuple(expected)} (one position per token), got "
                         f"shape {tuple(shape)}")


class Generation:
    """What a layer keeps while generating, in any framework: a :class:`slicedkern.DecodeCache` (one
    row per batch entry and head), the tokens so far and the valid keys each batch entry has seen
    (the next token's RoPE position, and a query that has seen none gets zeros)."""

    def __init__(self) -> None:
        self.decode = None            # made at the first step, with the layer's parameters then
        self.seen = None              # (N,) valid keys seen so far
        self.length = 0               # tokens appended, padding included
        self.meta = None              # (batch size, dtype, device) of the first step

    def __len__(self) -> int:
        return self.length

    def check_step(self, is_causal: bool, q_len: int, k_len: int, batch: int, dtype, device) -> None:
        """A generation step's arguments: causal, queries and keys the same new tokens, and the
        cache's batch, dtype and device (ValueError naming the argument)."""
        if not is_causal:
            raise ValueError("argument 'is_causal' must be True with a cache: generation attends to the tokens "
                             "so far, and a cache holds no future tokens")
        if k_len != q_len:
            raise ValueError(f"arguments 'query' and 'key': with a cache they are the same new tokens, got "
                             f"{q_len} queries and {k_len} keys")
        # a step of no tokens is checked against the cache but leaves it as it was
        self.check(batch, dtype, device, record=q_len > 0)

    def check(self, batch: int, dtype, device, record: bool = True) -> None:
        """The step continues the cache's batch, dtype and device (ValueError naming 'cache');
        ``record``: remember them if the cache has none yet."""
        meta = (batch, dtype, device)
        if self.meta is not None and meta != self.meta:
            raise ValueError(f"argument 'cache' holds a batch of {self.meta[0]} rows of {self.meta[1]} on "
                             f"{self.meta[2]}; got new tokens with {batch} rows of {dtype} on {device} "
                             "(a new batch needs a new cache)")
        if record:
            self.meta = meta

    def positions(self, like, valid):
        """The RoPE positions of the new tokens, (N, T) (``rope_positions`` after the valid keys
        seen so far); ``like`` (N, T, ...) the new tokens, ``valid`` (N, T) bool or None."""
        length = like.shape[1]
        return rope_positions(like, length, length, valid, self.seen)[1]

    def step(self, config: LayerConfig, parameters, q_scores, k_scores, v, valid):
        """Attend the new tokens, each over the keys so far and the new ones up to its position.

        ``parameters``: ``(bandwidth, mixture_weight)`` as :func:`op_arguments` takes them (read at
        the first step); ``q_scores``, ``k_scores`` and ``v`` as :func:`head_scores` and
        :func:`head_values` give them, (N, H, [P,] T) and (N, H, [P,] T, Dh); ``valid`` (N, T) bool
        or None (no padding). Returns ``(ctx (N, H, [P,] T, Dh), sees_a_key (N, T) bool)``; no new
        token (T = 0) gives empty ones and leaves the cache as it was.
        """
        xp = array_namespace(q_scores)
        device = array_device(q_scores)
        batch, length = q_scores.shape[0], q_scores.shape[-1]
        masked = valid is not None
        if not masked:
            valid = xp.ones((batch, length), dtype=xp.bool, device=device)
        if length == 0:
            return xp.zeros(v.shape, dtype=v.dtype, device=device), valid
        if self.decode is None:
            self.decode = decode_cache(config, *parameters)
        rows = []
        for t in range(length):      # each new query sees the new keys up to its own position
            mask = over_heads(valid[:, t:t + 1], q_scores.ndim) if masked else None
            self.decode.append(k_scores[..., t:t + 1], v[..., t:t + 1, :], key_mask=mask)
            rows.append(self.decode.attend(q_scores[..., t:t + 1]))
        self.length += length
        seen = xp.cumulative_sum(valid, axis=-1)            # (N, T) valid keys seen, this step's
        if self.seen is not None:
            seen = seen + xp.astype(self.seen, seen.dtype)[:, None]
        self.seen = seen[:, -1]
        return xp.concat(rows, axis=-2), seen > 0


def decode_cache(config: LayerConfig, bandwidth, mixture_weight) -> DecodeCache:
    """The :class:`slicedkern.DecodeCache` of the configured op, with the layer's parameters now
    (``bandwidth`` and ``mixture_weight`` as :func:`op_arguments` takes them; they get no gradient)."""
    params, options = op_arguments(config, bandwidth, mixture_weight)
    if config.kernel_name == "hat":
        return DecodeCache("hat", bandwidth=params[0], **options)
    if config.kernel_name == "hat_mixture":
        return DecodeCache("hat_mixture", bandwidths=params[0], weights=params[1], **options)
    if config.kernel_name == "custom":
        return DecodeCache(params[0], **options)
    return DecodeCache("relu", **options)


def op_arguments(config: LayerConfig, bandwidth, mixture_weight) -> tuple[tuple, dict]:
    """Positional parameters after ``(q, k, v)`` and keyword options of :func:`attention_op`.

    ``bandwidth`` is the array of bandwidths, shape ``(H,)`` for "hat" and ``(H, K)`` for
    "hat_mixture" (``mixture_weight`` then holds the ``(H, K)`` weights); both are ignored otherwise.
    The op broadcasts them over the batch dims ``(..., H)`` of the scores.
    """
    options = {"normalize": config.normalize, "center": config.center}
    if config.slices > 1:        # (H, ...) -> (H, 1, ...): broadcast over the slice axis of (N, H, P)
        bandwidth, mixture_weight = (None if x is None else array_namespace(x).expand_dims(x, axis=1)
                                     for x in (bandwidth, mixture_weight))
    if config.kernel_name == "relu":
        return (), options
    if config.kernel_name == "custom":
        return (config.kernel,), options
    if config.kernel_name == "hat":
        return (bandwidth,), options
    return (bandwidth, mixture_weight), options


def over_heads(mask, ndim: int):
    """A ``(N, L)`` key mask as ``(N, 1, [1,] L)``: broadcast over the head (and slice) axes of scores
    with ``ndim`` dims, ``(N, H, L)`` or ``(N, H, P, L)``."""
    return mask[(slice(None),) + (None,) * (ndim - 2) + (slice(None),)]


def head_scores(config: LayerConfig, scores):
    """The scores of ``Pi``, ``(N, L, H * P)``, as the ops take them: ``(N, H, L)``, or
    ``(N, H, P, L)`` with ``slices=P > 1`` (score ``h * P + p`` is slice ``p`` of head ``h``)."""
    xp = array_namespace(scores)
    if config.slices == 1:
        return xp.permute_dims(scores, (0, 2, 1))
    batch, length = scores.shape[0], scores.shape[1]
    return xp.permute_dims(xp.reshape(scores, (batch, length, config.num_heads, config.slices)), (0, 2, 3, 1))


def head_values(config: LayerConfig, v):
    """Projected values ``(N, L, E)`` split into heads, ``(N, H, L, Dh)``, and with ``slices=P > 1``
    broadcast to every slice, ``(N, H, P, L, Dh)`` (a view: the slices share the head's values)."""
    xp = array_namespace(v)
    batch, length = v.shape[0], v.shape[1]
    heads = xp.permute_dims(xp.reshape(v, (batch, length, config.num_heads, config.head_dim)), (0, 2, 1, 3))
    if config.slices == 1:
        return heads
    return xp.broadcast_to(heads[:, :, None], (batch, config.num_heads, config.slices, length, config.head_dim))


def merge_heads(config: LayerConfig, ctx):
    """The heads' outputs ``(N, H, [P,] L, Dh)`` as ``(N, L, E)``: the mean over slices, heads concatenated."""
    xp = array_namespace(ctx)
    if config.slices > 1:
        ctx = xp.mean(ctx, axis=2)
    batch, length = ctx.shape[0], ctx.shape[2]
    return xp.reshape(xp.permute_dims(ctx, (0, 2, 1, 3)), (batch, length, config.embed_dim))


def decode_heads(config: LayerConfig, cache, scores: Callable, q, k, v, valid, params):
    """One generation step of a layer over its heads, both frameworks: the projected new tokens ``q``,
    ``k`` (N, T, E) rotated at the positions after the valid tokens the cache has seen (``rope``),
    scored by ``scores`` (the layer's score map), and attended with their values ``v`` (N, T, E)
    through ``cache`` (the layer's :class:`~slicedkern.nn.Generation`); ``valid`` (N, T) bool or
    None, ``params`` the detached ``(bandwidth, mixture_weight)``. Returns ``(ctx, sees)``: the
    heads' outputs (N, H, [P,] T, Dh) and (N, T) whether each query sees a key yet."""
    if config.rope:
        positions = cache.positions(q, valid)
        q, k = (rotary_embedding(x, config.num_heads, positions) for x in (q, k))
    return cache.step(config, params, head_scores(config, scores(q)), head_scores(config, scores(k)),
                      head_values(config, v), valid)


def keep_seen(out, sees):
    """A generation step's output (N, T, E) with zeros where a query sees no key yet (``sees`` (N, T)),
    as the full forward gives them (:func:`._positions.zero_unseen`)."""
    xp = array_namespace(out)
    return xp.where(sees[..., None], out, xp.zeros((), dtype=out.dtype, device=array_device(out)))


def attend_heads(config: LayerConfig, op: Callable, q_scores, k_scores, v, key_padding_mask, bandwidth,
                 mixture_weight, causal: bool):
    """Steps 3 and 4 of the layer before dropout and ``W_o``, in any framework.

    ``q_scores`` (N, Lq, H * P) and ``k_scores`` (N, Lk, H * P) from ``Pi``; ``v`` (N, Lk, E) the
    projected values; ``key_padding_mask`` (N, Lk) bool, True = padding, or None; ``bandwidth`` and
    ``mixture_weight`` as :func:`op_arguments` takes them. Returns the heads' outputs ``(N, Lq, E)``.
    """
    q_scores, k_scores, v = head_scores(config, q_scores), head_scores(config, k_scores), head_values(config, v)
    key_mask = None if key_padding_mask is None else over_heads(~key_padding_mask, q_scores.ndim)
    params, options = op_arguments(config, bandwidth, mixture_weight)
    if causal:
        options["causal"] = True
    return merge_heads(config, op(q_scores, k_scores, v, *params, key_mask=key_mask, **options))


def check_forward(config: LayerConfig, query_shape: Sequence[int], key_shape: Sequence[int],
                  value_shape: Sequence[int], mask_shape: Sequence[int] | None, mask_is_bool: bool,
                  need_weights: bool, attn_mask_given: bool, is_causal: bool) -> bool:
    """Validate the arguments of a forward call; return whether the inputs are batched.

    Shapes follow ``torch.nn.MultiheadAttention``: ``(L, E)`` unbatched, ``(L, N, E)`` or, with
    ``batch_first``, ``(N, L, E)``; ``key_padding_mask`` ``(S,)`` or ``(N, S)``.
    """
    check_bool(is_causal, "is_causal")        # the ops' rule: "yes" or 1 is an error, not True
    check_bool(need_weights, "need_weights")
    if need_weights:
        raise ValueError("need_weights=True: sliced attention never forms the Lq x Lk attention weights "
                         "(that is what makes it O(L log L)); call it with need_weights=False, "
                         "the output's second entry is then None")
    if attn_mask_given and not is_causal:
        raise ValueError("attn_mask: sliced attention cannot apply a general Lq x Lk mask, since it never "
                         "forms the attention weights; pass padding as key_padding_mask and use "
                         "is_causal=True for a causal mask")
    if len(query_shape) not in (2, 3):
        raise ValueError(f"argument 'query' must have shape (L, embed_dim), (L, N, embed_dim) or, with "
                         f"batch_first, (N, L, embed_dim); got shape {tuple(query_shape)}")
    batched = len(query_shape) == 3
    for name, shape, dim in (("query", query_shape, config.embed_dim), ("key", key_shape, config.kdim),
                             ("value", value_shape, config.vdim)):
        if len(shape) != len(query_shape):
            raise ValueError(f"argument {name!r} must have as many dims as 'query' ({len(query_shape)}), "
                             f"got shape {tuple(shape)}")
        if shape[-1] != dim:
            which = {"query": "embed_dim", "key": "kdim", "value": "vdim"}[name]
            raise ValueError(f"argument {name!r} must have {which} = {dim} features on its last axis, "
                             f"got shape {tuple(shape)}")
    if tuple(key_shape[:-1]) != tuple(value_shape[:-1]):
        raise ValueError(f"arguments 'key' and 'value' must have the same sequence length and batch size, "
                         f"got shapes {tuple(key_shape)} and {tuple(value_shape)}")
    batch_axis = 0 if config.batch_first else 1
    if batched and query_shape[batch_axis] != key_shape[batch_axis]:
        raise ValueError(f"arguments 'query' and 'key' must have the same batch size on axis {batch_axis} "
                         f"(batch_first={config.batch_first}), got shapes {tuple(query_shape)} and "
                         f"{tuple(key_shape)}")
    if mask_shape is not None:
        if not mask_is_bool:
            raise TypeError("argument 'key_padding_mask' must be a boolean mask (True = ignore the key); "
                            "float (additive) masks are not supported. Note that torch.nn.TransformerEncoder "
                            "turns boolean masks into float ones: stack layers with "
                            "slicedkern.nn.torch.SlicedTransformerEncoder instead")
        seq_axis = 1 if config.batch_first else 0
        expected = ((key_shape[batch_axis], key_shape[seq_axis]) if batched else (key_shape[0],))
        if tuple(mask_shape) != expected:
            raise ValueError(f"argument 'key_padding_mask' must have shape {expected} (batch size, key "
                             f"length), got shape {tuple(mask_shape)}")
    return batched
