"""``SlicedAttention`` and ``convert_attention``, the attention layer of :mod:`slicedkern.nn.torch`
(which re-exports them beside the encoder layer and stack built on it)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..backends import learn_types
from ..kernels import PiecewiseLinear
from . import (
    attend_heads,
    attention_op,
    check_bool,
    check_forward,
    check_positions,
    layer_config,
)
from ._positions import rotate_forward, zero_unseen
from ._torch_convert import (
    boolean_padding,
    copy_projections,
    is_square_causal,
    replace_attention,
    taken_arguments,
)
from ._torch_generate import AttentionCache, generate_step

__all__ = ["SlicedAttention", "convert_attention"]

# the tensor types memoised before any forward, which torch.compile may trace first: it warns about
# every functools.lru_cache it meets, and array-api-compat's type tests are such caches
learn_types(torch.empty(0), nn.Parameter(torch.empty(0), requires_grad=False))


class SlicedAttention(nn.Module):
    """Multi-head sliced attention, a drop-in for ``torch.nn.MultiheadAttention``.

    Each head scores every token with one number, from a learned map ``Pi`` applied alike to the
    projected queries and keys, and attends with a piecewise-linear kernel of the score
    differences in ``O(L log L)`` (sort and prefix sums); the ``L x L`` attention weights are never
    formed. See :mod:`slicedkern.nn` for the computation step by step.

    Parameters
    ----------
    embed_dim : int
        Model width ``E``; ``num_heads`` must divide it.
    num_heads : int
        Number of heads ``H``, each attending on its ``E / H`` features of the values.
    kernel : {"relu", "hat", "hat_mixture"} or slicedkern.kernels.PiecewiseLinear, default "relu"
        Sliced ReLU attention (:func:`slicedkern.relu_attention`), hat attention with one learned
        bandwidth per head (:func:`slicedkern.hat_attention`), a mixture of ``mixture_size`` hats per
        head with learned bandwidths and weights (:func:`slicedkern.hat_mixture_attention`), or a
        fixed kernel object (:func:`slicedkern.kernel_attention`).
    score : {"mlp", "linear"}, default "mlp"
        The map ``Pi`` from a projected token (``E`` features) to its ``H`` scores: a hidden layer of
        width ``E`` with GELU then a linear map, or a linear map. It has no output bias, since a
        shift shared by query and key scores cancels in their differences.
    bandwidth : float or sequence of float, optional
        Initial hat bandwidths (hat kernels only). "hat": a number, or one per head (default 1).
        "hat_mixture": one per hat, or a number ``b`` spread as ``b * 2 ** (i - (K - 1) / 2)``.
    learn_bandwidth : bool, default True
        Learn the bandwidths, stored as ``log_bandwidth`` (a parameter, else a buffer).
    mixture_size : int, optional
        Hats per head of "hat_mixture" (default 3); their weights ``mixture_weight`` are learned.
    center : bool, optional
        Centre the values over the valid keys before attending (default: True for "relu", False
        otherwise, as the ops do).
    normalize : {"auto", "abs", "relu", "count", None}, default "auto"
        The ops' normaliser; "auto" is "abs" for "relu" and "count" for the others.
    dropout : float, default 0.0
        Dropout on the attention output of the heads, before ``out_proj`` (there are no attention
        weights to drop).
    bias : bool, default True
        Biases of the query, key, value, output projections and of the score MLP's hidden layer.
    kdim, vdim : int, optional
        Features of ``key`` and ``value`` (default ``embed_dim``).
    batch_first : bool, default False
        Inputs and outputs are ``(N, L, E)`` if True, ``(L, N, E)`` otherwise.
    rope : bool, default False
        Apply rotary position embeddings to the projected queries and keys, head by head, before
        scoring (needs an even head width). Positions count real tokens only (see Notes); queries
        take the positions of the last ``Lq`` keys, the alignment of ``is_causal``.
    slices : int, default 1
        Scores per head and token: ``Pi`` gives ``P = slices`` of them, each slice attends on its
        own and the head's output is their mean (the multi-slice kernel of
        :func:`slicedkern.sliced_attention`), at ``P`` times the cost of one slice.
    device, dtype : optional
        Of the parameters.

    Notes
    -----
    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (``nn.Linear``), ``score_hidden``
    (``score="mlp"`` only) and ``score_out`` (``nn.Linear`` to ``H * slices``, no bias), ``log_bandwidth`` (``(H,)`` for
    "hat", ``(H, K)`` for "hat_mixture") and ``mixture_weight`` (``(H, K)``). ``in_proj_weight`` and
    ``in_proj_bias`` are None: torch's transformer layers then never take their fused fast path,
    which would compute softmax attention from them.

    Padding never reaches the real tokens: ``Pi`` reads one token at a time, and padded keys count
    in no sum, mean or normaliser. A query whose keys are all padded gets an output of zeros.

    Padding is no position either (``rope=True``): a sliced score is a projection of the rotated
    vector, so unlike a dot product it depends on absolute positions, and a key's position is the
    number of real keys before it in its row (``slicedkern.nn.rope_positions``, as Hugging Face
    derives ``position_ids`` from the attention mask). Query ``i`` takes the position of key
    ``i + Lk - Lq``, the token ``is_causal`` aligns it with: in self-attention, chunked or cached
    generation, padding left, right or inside the sequences moves no real token. In
    cross-attention the queries are thus the last ``Lq`` tokens of the memory's sequence; memory
    padding after them moves them, unless ``query_positions`` places them (see :meth:`forward`).
    Half-precision inputs (``torch.autocast``) are attended in float32 or better and come back in
    their dtype, as the ops do.

    Examples
    --------
    >>> import torch
    >>> from slicedkern.nn.torch import SlicedAttention
    >>> attn = SlicedAttention(32, 4)                  # (L, N, E) like nn.MultiheadAttention
    >>> query, memory = torch.randn(5, 2, 32), torch.randn(9, 2, 32)
    >>> out, _ = attn(query, memory, memory)
    >>> out.shape
    torch.Size([5, 2, 32])
    """

    #: None, as in an ``nn.MultiheadAttention`` without them: torch's fast paths then call forward.
    in_proj_weight: None = None
    in_proj_bias: None = None

    def __init__(self, embed_dim: int, num_heads: int, *, kernel: str | PiecewiseLinear = "relu",
                 score: str = "mlp", bandwidth: float | tuple[float, ...] | None = None,
                 learn_bandwidth: bool = True, mixture_size: int | None = None, center: bool | None = None,
                 normalize: str | None = "auto", dropout: float = 0.0, bias: bool = True,
                 kdim: int | None = None, vdim: int | None = None, batch_first: bool = False,
                 rope: bool = False, slices: int = 1, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = layer_config(embed_dim, num_heads, kernel=kernel, score=score, bandwidth=bandwidth,
                                   learn_bandwidth=learn_bandwidth, mixture_size=mixture_size,
                                   center=center, normalize=normalize, dropout=dropout, bias=bias,
                                   kdim=kdim, vdim=vdim, batch_first=batch_first, rope=rope, slices=slices)
        cfg = self.config
        factory = {"device": device, "dtype": dtype}
        # The attribute names of nn.MultiheadAttention that code reads.
        self.embed_dim, self.num_heads, self.head_dim = cfg.embed_dim, cfg.num_heads, cfg.head_dim
        self.kdim, self.vdim, self.batch_first, self.dropout = cfg.kdim, cfg.vdim, cfg.batch_first, cfg.dropout
        self._qkv_same_embed_dim = cfg.kdim == cfg.vdim == cfg.embed_dim

        self.q_proj = nn.Linear(cfg.embed_dim, cfg.embed_dim, bias=cfg.bias, **factory)
        self.k_proj = nn.Linear(cfg.kdim, cfg.embed_dim, bias=cfg.bias, **factory)
        self.v_proj = nn.Linear(cfg.vdim, cfg.embed_dim, bias=cfg.bias, **factory)
        self.score_hidden = (nn.Linear(cfg.embed_dim, cfg.embed_dim, bias=cfg.bias, **factory)
                             if cfg.score == "mlp" else None)
        self.score_out = nn.Linear(cfg.embed_dim, cfg.num_heads * cfg.slices, bias=False, **factory)
        self.out_proj = nn.Linear(cfg.embed_dim, cfg.embed_dim, bias=cfg.bias, **factory)
        self.attention_dropout = nn.Dropout(cfg.dropout)
        if cfg.has_bandwidth:
            shape = (cfg.num_heads,) if cfg.kernel_name == "hat" else (cfg.num_heads, cfg.mixture_size)
            log_bandwidth = torch.empty(shape, **factory)
            if cfg.learn_bandwidth:
                self.log_bandwidth = nn.Parameter(log_bandwidth)
            else:
                self.register_buffer("log_bandwidth", log_bandwidth)
        else:
            self.log_bandwidth = None
        self.mixture_weight = (nn.Parameter(torch.empty((cfg.num_heads, cfg.mixture_size), **factory))
                               if cfg.kernel_name == "hat_mixture" else None)
        self._op = attention_op(cfg)
        self.reset_parameters()

    @classmethod
    def from_multihead_attention(cls, attention: nn.MultiheadAttention, **options) -> SlicedAttention:
        """A sliced layer with the shapes, options and projections of ``attention``, an
        ``nn.MultiheadAttention``; the score map and bandwidths are new (:func:`convert_attention`).

        ``options`` are this class's own keyword arguments (``kernel``, ``score``, ``bandwidth``,
        ...). ``dropout`` drops the heads' outputs here, not attention weights. TypeError for an
        ``attention`` of another type or an option taken from it; ValueError for ``add_bias_kv`` or
        ``add_zero_attn``, which sliced attention lacks.
        """
        layer = cls(**taken_arguments(attention, options), **options)
        copy_projections(layer, attention)
        return layer.train(attention.training)

    def reset_parameters(self) -> None:
        """Initialise as ``nn.MultiheadAttention`` does, and the bandwidths to their initial values.

        Xavier-uniform projection and score weights, zero biases, ``out_proj`` as ``nn.Linear``
        with a zero bias; ``log_bandwidth`` from ``bandwidth``; mixture weights ``1 / K``.
        """
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.score_hidden, self.score_out):
            if linear is None:
                continue
            nn.init.xavier_uniform_(linear.weight)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.out_proj.reset_parameters()
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)
        cfg = self.config
        with torch.no_grad():
            if cfg.kernel_name == "hat":
                self.log_bandwidth.copy_(torch.tensor([math.log(b) for b in cfg.bandwidths]))
            elif cfg.kernel_name == "hat_mixture":
                logs = torch.tensor([math.log(b) for b in cfg.bandwidths])
                self.log_bandwidth.copy_(logs.expand(cfg.num_heads, -1))
                self.mixture_weight.fill_(1.0 / cfg.mixture_size)

    def scores(self, projected: Tensor) -> Tensor:
        """``Pi``: the ``(N, L, H * slices)`` scores of projected tokens ``(N, L, E)``, token by token."""
        hidden = projected if self.score_hidden is None else F.gelu(self.score_hidden(projected))
        return self.score_out(hidden)

    def init_cache(self) -> AttentionCache:
        """An empty :class:`AttentionCache` for generating with this layer (``forward(..., cache=)``)."""
        return AttentionCache(self)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = False, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False, *, cache: AttentionCache | None = None,
                query_positions: Tensor | None = None, key_positions: Tensor | None = None) -> tuple[Tensor, None]:
        """Attend from ``query`` to ``key`` / ``value``.

        Parameters
        ----------
        query : Tensor, shape (Lq, N, E), (N, Lq, E) with ``batch_first``, or (Lq, E)
        key : Tensor, shape (Lk, N, kdim), (N, Lk, kdim) with ``batch_first``, or (Lk, kdim)
        value : Tensor, shape (Lk, N, vdim), (N, Lk, vdim) with ``batch_first``, or (Lk, vdim)
        key_padding_mask : bool Tensor, shape (N, Lk) or (Lk,), optional
            True where the key is padding and must be ignored (``torch.nn.MultiheadAttention``'s
            convention). A float mask is accepted only in the form torch's transformer layers make
            of a boolean one (``0`` keep, ``-inf`` ignore); any other float mask is an error.
        need_weights : bool, default False
            Must be False: the attention weights are never formed.
        attn_mask : Tensor, optional
            Accepted with ``is_causal=True``, as the causal mask it stands for, or without it when it
            is the square causal mask itself (boolean, True above the diagonal, or float, ``-inf``
            there and ``0`` elsewhere: what ``nn.Transformer.generate_square_subsequent_mask``
            makes), as torch's encoder detects it; any other ``Lq x Lk`` mask cannot be applied and
            is an error.
        average_attn_weights : bool, default True
            Ignored, as ``nn.MultiheadAttention`` ignores it without weights; here for its signature.
        is_causal : bool, default False
            Query ``i`` attends to keys ``j <= i + Lk - Lq`` only (``j <= i`` in self-attention): the
            ops' ``causal=True``, bottom-right aligned when ``Lq != Lk``. A query that sees no
            valid key gets zeros.
        cache : AttentionCache, optional
            Generation (self-attention, ``is_causal=True``): ``query``, ``key`` and ``value`` are the
            new tokens only (one or a chunk), at the positions after those already in the cache;
            ``key_padding_mask`` (N, new tokens) marks padding among them (a left-padded prompt).
            The output equals those rows of the full causal forward over every token so far, RoPE
            at their absolute positions included. See :meth:`init_cache`.
        query_positions, key_positions : integer Tensor, shape (N, Lq) / (N, Lk), or (Lq,) / (Lk,), optional
            RoPE positions of the tokens (``rope=True`` only, not with a cache), as Hugging Face's
            ``position_ids``; each one left out follows the layer's rule (see Notes). For
            cross-attention to a separate memory, ``query_positions`` gives the queries their own
            positions (e.g. ``torch.arange(Lq)``), which the memory's padding then never moves.

        Returns
        -------
        output : Tensor
            Shaped like ``query`` with ``E`` features; zeros for a row whose keys are all padded.
        weights : None
        """
        if key_padding_mask is not None and key_padding_mask.is_floating_point():
            key_padding_mask = boolean_padding(key_padding_mask)
        if attn_mask is not None and is_causal is False and is_square_causal(attn_mask, self._length(query),
                                                                               self._length(key)):
            is_causal = True          # what torch's encoder and decoder detect before calling a layer
        mask_shape = None if key_padding_mask is None else tuple(key_padding_mask.shape)
        batched = check_forward(self.config, tuple(query.shape), tuple(key.shape), tuple(value.shape),
                                mask_shape, key_padding_mask is not None and key_padding_mask.dtype == torch.bool,
                                need_weights, attn_mask is not None, is_causal)
        check_bool(average_attn_weights, "average_attn_weights")
        positions = []
        for name, given, tokens in (("query_positions", query_positions, query), ("key_positions", key_positions,
                                                                                 key)):
            if given is not None:
                expected = ((tokens.shape[1 - self.batch_first], tokens.shape[self.batch_first]) if batched
                            else (tokens.shape[0],))
                integer = not (given.is_floating_point() or given.is_complex() or given.dtype == torch.bool)
                check_positions(self.config, name, tuple(given.shape), integer, expected, cache is not None)
                given = given if batched else given.unsqueeze(0)
            positions.append(given)
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        if cache is not None:
            out = self._generate(query, key, value, key_padding_mask, is_causal, cache)
        else:
            out = self._attend(query, key, value, key_padding_mask, is_causal, *positions)
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, None

    def _length(self, tokens: Tensor) -> int:
        """The sequence length of ``query`` / ``key`` as forward takes them (before any checks)."""
        return tokens.shape[1] if tokens.dim() == 3 and self.batch_first else tokens.shape[0]

    def _generate(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None,
                  is_causal: bool, cache: AttentionCache) -> Tensor:
        return generate_step(self, query, key, value, key_padding_mask, is_causal, cache)

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None,
                causal: bool, query_positions: Tensor | None = None, key_positions: Tensor | None = None) -> Tensor:
        """The batch-first computation: (N, Lq, E), (N, Lk, kdim), (N, Lk, vdim) to (N, Lq, E);
        positions (N, L) or None (the layer's rule)."""
        cfg = self.config
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        if cfg.rope:
            q, k = rotate_forward(q, k, cfg.num_heads, key_padding_mask, query_positions, key_positions)
        bandwidth = None if self.log_bandwidth is None else torch.exp(self.log_bandwidth)
        ctx = attend_heads(cfg, self._op, self.scores(q), self.scores(k), v, key_padding_mask, bandwidth,
                           self.mixture_weight, causal)                    # (N, Lq, E)
        return zero_unseen(self.out_proj(self.attention_dropout(ctx)), key_padding_mask, key.shape[1], causal)


def convert_attention(model: nn.Module, **options) -> nn.Module:
    """Replace every ``nn.MultiheadAttention`` in ``model`` by a :class:`SlicedAttention`, in place.

    A one-line way to try sliced attention in an existing model. Each replacement keeps its
    attention's shapes, ``batch_first``, ``dropout``, ``bias``, device, dtype and its query, key,
    value and output projections (:meth:`SlicedAttention.from_multihead_attention`); the score map
    and the bandwidths are new, freshly initialised, so the converted model needs training (or
    fine-tuning) before its outputs mean anything. A module function, like
    ``torch.ao.quantization.convert``, since it walks any model; it modifies ``model`` in place and
    returns it, like ``nn.SyncBatchNorm.convert_sync_batchnorm`` (``copy.deepcopy`` first to keep
    the original). An attention shared by several parents becomes one shared sliced layer.

    ``torch.nn``'s transformer, encoder and decoder layers keep working: their attention calls
    (boolean or float padding masks, causal masks, ``need_weights=False``) are accepted, and their
    fused softmax fast path is switched off, in training and in evaluation alike.

    Parameters
    ----------
    model : nn.Module
        The model; if it is an ``nn.MultiheadAttention`` itself, the new layer is returned.
    **options
        :class:`SlicedAttention`'s own keyword arguments (``kernel``, ``score``, ``bandwidth``,
        ``learn_bandwidth``, ``mixture_size``, ``center``, ``normalize``, ``rope``, ``slices``), the same for
        every layer. The arguments taken from the attentions (``embed_dim``, ``num_heads``,
        ``dropout``, ``bias``, ``kdim``, ``vdim``, ``batch_first``, ``device``, ``dtype``) cannot be given.

    Returns
    -------
    nn.Module
        ``model``, converted.

    Raises
    ------
    TypeError
        ``model`` is not an ``nn.Module``; an unknown option, or one taken from the attentions, or a
        flag that is not a boolean (the message names it).
    ValueError
        ``model`` holds no ``nn.MultiheadAttention`` (a softmax model would run under a sliced
        name), or one with ``add_bias_kv`` / ``add_zero_attn``.

    Examples
    --------
    >>> import torch
    >>> from slicedkern.nn.torch import SlicedAttention, convert_attention
    >>> layer = torch.nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True)
    >>> model = convert_attention(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
    ...                           kernel="hat")
    >>> isinstance(model.layers[0].self_attn, SlicedAttention)
    True
    >>> model(torch.randn(2, 7, 16)).shape
    torch.Size([2, 7, 16])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"argument 'model' must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.MultiheadAttention):
        return SlicedAttention.from_multihead_attention(model, **options)
    return replace_attention(model, lambda mha: SlicedAttention.from_multihead_attention(mha, **options),
                             SlicedAttention)
