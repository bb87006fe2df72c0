"""Sliced attention for Flax NNX, with the parameters and semantics of :mod:`slicedkern.nn.torch`.

``SlicedAttention`` here takes the same constructor arguments as its torch twin (plus Flax's
``param_dtype`` and ``rngs``), the same call arguments (``key_padding_mask`` True = ignore,
``batch_first``, ``(output, None)`` returned), and holds the same parameters under the same names;
:meth:`SlicedAttention.load_torch_state_dict` loads a torch module's weights, and
:meth:`SlicedAttention.torch_state_dict` gives them back. It runs under ``jax.jit``, ``jax.grad``,
``nnx.jit`` and ``nnx.grad``.

Examples
--------
>>> import jax.numpy as jnp
>>> from flax import nnx
>>> from slicedkern.nn.flax import SlicedAttention
>>> attn = SlicedAttention(16, 4, kernel="hat", batch_first=True, rngs=nnx.Rngs(0))
>>> x = jnp.ones((2, 10, 16))
>>> pad = jnp.zeros((2, 10), dtype=bool).at[1, 7:].set(True)     # True = padding
>>> out, weights = attn(x, x, x, key_padding_mask=pad)
>>> out.shape, weights
((2, 10, 16), None)
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..kernels import PiecewiseLinear
from . import (
    Generation,
    attend_heads,
    attention_op,
    check_bool,
    check_forward,
    check_positions,
    decode_heads,
    keep_seen,
    layer_config,
    merge_heads,
)
from ._positions import rotate_forward, zero_unseen

__all__ = ["SlicedAttention", "FixedBandwidth"]

# torch's initialisers: xavier-uniform projections; out_proj as nn.Linear (kaiming-uniform, a = sqrt 5).
_XAVIER = jax.nn.initializers.glorot_uniform()
_TORCH_LINEAR = jax.nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


class FixedBandwidth(nnx.Variable):
    """The log-bandwidths of a layer built with ``learn_bandwidth=False``: state, not a parameter."""


class SlicedAttention(nnx.Module):
    """Multi-head sliced attention for Flax NNX (see :class:`slicedkern.nn.torch.SlicedAttention`).

    Parameters
    ----------
    embed_dim, num_heads, kernel, score, bandwidth, learn_bandwidth, mixture_size, center, normalize,
    dropout, bias, kdim, vdim, batch_first, rope, slices
        As in :class:`slicedkern.nn.torch.SlicedAttention`, with the same defaults: in particular
        ``batch_first=False`` (inputs ``(L, N, E)``) and ``key_padding_mask`` True = ignore, which
        are torch's conventions, not Flax's.
    param_dtype : dtype, default float32
        Of the parameters (torch's ``dtype``).
    rngs : nnx.Rngs
        Initialisation, and the ``"dropout"`` stream when ``dropout > 0``.

    Notes
    -----
    Parameters (``nnx.Param``): ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, ``score_hidden``
    (``score="mlp"`` only), ``score_out`` (``nnx.Linear``, kernels of shape ``(in, out)``, the
    transpose of torch's weights), ``log_bandwidth`` (a :class:`FixedBandwidth` variable when
    ``learn_bandwidth=False``) and ``mixture_weight``. Dropout follows ``deterministic=`` or the
    module's ``train()`` / ``eval()`` mode.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from slicedkern.nn.flax import SlicedAttention
    >>> attn = SlicedAttention(32, 4, rngs=nnx.Rngs(0))           # (L, N, E) like torch
    >>> query = jax.random.normal(jax.random.key(1), (5, 2, 32))
    >>> memory = jax.random.normal(jax.random.key(2), (9, 2, 32))
    >>> attn(query, memory, memory)[0].shape
    (5, 2, 32)
    """

    def __init__(self, embed_dim: int, num_heads: int, *, kernel: str | PiecewiseLinear = "relu",
                 score: str = "mlp", bandwidth: float | tuple[float, ...] | None = None,
                 learn_bandwidth: bool = True, mixture_size: int | None = None, center: bool | None = None,
                 normalize: str | None = "auto", dropout: float = 0.0, bias: bool = True,
                 kdim: int | None = None, vdim: int | None = None, batch_first: bool = False,
                 rope: bool = False, slices: int = 1, param_dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        self.config = layer_config(embed_dim, num_heads, kernel=kernel, score=score, bandwidth=bandwidth,
                                   learn_bandwidth=learn_bandwidth, mixture_size=mixture_size,
                                   center=center, normalize=normalize, dropout=dropout, bias=bias,
                                   kdim=kdim, vdim=vdim, batch_first=batch_first, rope=rope, slices=slices)
        cfg = self.config
        self.embed_dim, self.num_heads, self.head_dim = cfg.embed_dim, cfg.num_heads, cfg.head_dim
        self.kdim, self.vdim, self.batch_first = cfg.kdim, cfg.vdim, cfg.batch_first

        def linear(n_in, n_out, use_bias=cfg.bias, init=_XAVIER):
            return nnx.Linear(n_in, n_out, use_bias=use_bias, param_dtype=param_dtype, kernel_init=init,
                              rngs=rngs)

        self.q_proj = linear(cfg.embed_dim, cfg.embed_dim)
        self.k_proj = linear(cfg.kdim, cfg.embed_dim)
        self.v_proj = linear(cfg.vdim, cfg.embed_dim)
        self.score_hidden = nnx.data(linear(cfg.embed_dim, cfg.embed_dim) if cfg.score == "mlp" else None)
        self.score_out = linear(cfg.embed_dim, cfg.num_heads * cfg.slices, use_bias=False)
        self.out_proj = linear(cfg.embed_dim, cfg.embed_dim, init=_TORCH_LINEAR)
        self.attention_dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        log_bandwidth = mixture_weight = None
        if cfg.has_bandwidth:
            logs = jnp.log(jnp.asarray(cfg.bandwidths, dtype=param_dtype))
            if cfg.kernel_name == "hat_mixture":
                logs = jnp.broadcast_to(logs, (cfg.num_heads, cfg.mixture_size))
                mixture_weight = nnx.Param(jnp.full((cfg.num_heads, cfg.mixture_size), 1.0 / cfg.mixture_size,
                                                    dtype=param_dtype))
            log_bandwidth = nnx.Param(logs) if cfg.learn_bandwidth else FixedBandwidth(logs)
        self.log_bandwidth = nnx.data(log_bandwidth)
        self.mixture_weight = nnx.data(mixture_weight)
        self._op = attention_op(cfg)
        #: the generation state of ``decode=True`` (:meth:`init_cache`), or None
        self.cache = nnx.data(None)

    def init_cache(self, input_shape: tuple[int, ...], dtype: Any = jnp.float32) -> None:
        """Prepare the layer for ``decode=True`` calls, Flax's decoding convention.

        ``input_shape``: the shape of the inputs the decoding calls will pass (its batch size is
        checked at every step); ``dtype`` the inputs' dtype. Decoding then takes the new tokens only,
        one or a chunk at a time, with ``is_causal=True``, and returns the rows the full causal
        forward gives them (:class:`slicedkern.DecodeCache` per head; eager, not under ``jit``: the
        cache grows by runs of changing sizes). Call again to start a new sequence.
        """
        self.cache = Generation()
        axis = 0 if (self.batch_first or len(input_shape) == 2) else 1
        self.cache.check(1 if len(input_shape) == 2 else int(input_shape[axis]), jnp.dtype(dtype), None)

    # ------------------------------------------------------------------------- torch interchange
    def _torch_names(self) -> dict[str, tuple[Any, str, bool]]:
        """torch name -> (variable holder, attribute, transposed) of every parameter."""
        names: dict[str, tuple[Any, str, bool]] = {}
        for module_name in ("q_proj", "k_proj", "v_proj", "score_hidden", "score_out", "out_proj"):
            module = getattr(self, module_name)
            if module is None:
                continue
            names[f"{module_name}.weight"] = (module, "kernel", True)
            if module.bias is not None:
                names[f"{module_name}.bias"] = (module, "bias", False)
        if self.log_bandwidth is not None:
            names["log_bandwidth"] = (self, "log_bandwidth", False)
        if self.mixture_weight is not None:
            names["mixture_weight"] = (self, "mixture_weight", False)
        return names

    def load_torch_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the weights of a :class:`slicedkern.nn.torch.SlicedAttention` of the same configuration.

        Parameters
        ----------
        state_dict : mapping of str to array-like
            The torch module's ``state_dict()``, its tensors converted to NumPy
            (``{k: t.numpy() for k, t in module.state_dict().items()}``). Linear weights are
            transposed into Flax kernels; values are cast to this module's parameter dtype.

        Raises
        ------
        KeyError
            When a name is missing or unexpected (the configurations differ).
        ValueError
            When a shape differs.
        """
        names = self._torch_names()
        missing, unexpected = sorted(set(names) - set(state_dict)), sorted(set(state_dict) - set(names))
        if missing or unexpected:
            raise KeyError(f"argument 'state_dict' does not match this layer: missing {missing}, "
                           f"unexpected {unexpected}")
        for name, (holder, attribute, transposed) in names.items():
            variable = getattr(holder, attribute)
            value = np.asarray(state_dict[name])
            value = value.T if transposed else value
            current = variable[...]
            if value.shape != current.shape:
                expected = current.T.shape if transposed else current.shape
                raise ValueError(f"argument 'state_dict': {name!r} has shape {np.shape(state_dict[name])}, "
                                 f"this layer expects {expected}")
            variable[...] = jnp.asarray(value, dtype=current.dtype)

    def torch_state_dict(self) -> dict[str, np.ndarray]:
        """The parameters under torch's names and layout, as NumPy arrays (for ``load_state_dict``)."""
        out = {}
        for name, (holder, attribute, transposed) in self._torch_names().items():
            value = np.asarray(getattr(holder, attribute)[...])
            out[name] = value.T.copy() if transposed else value
        return out

    # ---------------------------------------------------------------------------------- forward
    def scores(self, projected: jax.Array) -> jax.Array:
        """``Pi``: the ``(N, L, H * slices)`` scores of projected tokens ``(N, L, E)``, token by token."""
        hidden = projected
        if self.score_hidden is not None:
            hidden = jax.nn.gelu(self.score_hidden(projected), approximate=False)   # torch's exact GELU
        return self.score_out(hidden)

    def __call__(self, query: jax.Array, key: jax.Array, value: jax.Array, *,
                 key_padding_mask: jax.Array | None = None, need_weights: bool = False,
                 attn_mask: jax.Array | None = None, is_causal: bool = False,
                 deterministic: bool | None = None, rngs: nnx.Rngs | None = None,
                 decode: bool = False, query_positions: jax.Array | None = None,
                 key_positions: jax.Array | None = None) -> tuple[jax.Array, None]:
        """Attend from ``query`` to ``key`` / ``value``.

        Parameters
        ----------
        query : array, shape (Lq, N, E), (N, Lq, E) with ``batch_first``, or (Lq, E)
        key : array, shape (Lk, N, kdim), (N, Lk, kdim) with ``batch_first``, or (Lk, kdim)
        value : array, shape (Lk, N, vdim), (N, Lk, vdim) with ``batch_first``, or (Lk, vdim)
        key_padding_mask : bool array, shape (N, Lk) or (Lk,), optional
            True where the key is padding and must be ignored.
        need_weights : bool, default False
            Must be False: the attention weights are never formed.
        attn_mask : array, optional
            Accepted only with ``is_causal=True``, as the causal mask it stands for.
        is_causal : bool, default False
            Query ``i`` attends to keys ``j <= i + Lk - Lq`` only (``j <= i`` in self-attention): the
            ops' ``causal=True``, bottom-right aligned when ``Lq != Lk``. A query that sees no
            valid key gets zeros.
        deterministic : bool, optional
            Disable dropout (default: the module's ``eval()`` / ``train()`` mode).
        rngs : nnx.Rngs, optional
            Dropout randomness for this call (default: the stream given at construction).
        decode : bool, default False
            Generation (after :meth:`init_cache`, ``is_causal=True``): ``query``, ``key`` and ``value``
            are the new tokens only, after those already decoded; ``key_padding_mask`` marks padding
            among them. The output equals their rows of the full causal forward over every token
            so far, RoPE at their absolute positions included; no new token gives an empty output
            and leaves the cache as it was.
        query_positions, key_positions : integer array, shape (N, Lq) / (N, Lk), or (Lq,) / (Lk,), optional
            RoPE positions of the tokens (``rope=True`` only, not with ``decode``); each one left
            out follows the layer's rule: a key's position counts the real keys before it, query
            ``i`` takes key ``i + Lk - Lq``'s (``slicedkern.nn.rope_positions``; see
            :class:`slicedkern.nn.torch.SlicedAttention`, Notes).

        Returns
        -------
        output : array
            Shaped like ``query`` with ``E`` features; zeros for a row whose keys are all padded.
        weights : None
        """
        mask_shape = None if key_padding_mask is None else tuple(key_padding_mask.shape)
        batched = check_forward(self.config, tuple(query.shape), tuple(key.shape), tuple(value.shape),
                                mask_shape, key_padding_mask is not None and key_padding_mask.dtype == jnp.bool_,
                                need_weights, attn_mask is not None, is_causal)
        check_bool(decode, "decode")
        if deterministic is not None:
            check_bool(deterministic, "deterministic")
        positions = []
        for name, given, tokens in (("query_positions", query_positions, query), ("key_positions", key_positions,
                                                                                 key)):
            if given is not None:
                given = jnp.asarray(given)
                expected = ((tokens.shape[1 - self.batch_first], tokens.shape[self.batch_first]) if batched
                            else (tokens.shape[0],))
                check_positions(self.config, name, given.shape, jnp.issubdtype(given.dtype, jnp.integer), expected,
                                decode)
                given = given if batched else given[None]
            positions.append(given)
        if not batched:
            query, key, value = query[None], key[None], value[None]
            key_padding_mask = None if key_padding_mask is None else key_padding_mask[None]
        elif not self.batch_first:
            query, key, value = (jnp.swapaxes(a, 0, 1) for a in (query, key, value))
        if decode:
            out = self._generate(query, key, value, key_padding_mask, is_causal, deterministic, rngs)
        else:
            out = self._attend(query, key, value, key_padding_mask, is_causal, deterministic, rngs, *positions)
        if not batched:
            out = out[0]
        elif not self.batch_first:
            out = jnp.swapaxes(out, 0, 1)
        return out, None

    def _generate(self, query, key, value, key_padding_mask, is_causal, deterministic, rngs):
        """``decode=True``, batch first: (N, T, E) new tokens to (N, T, E)."""
        if self.cache is None:
            raise ValueError("argument 'decode': call init_cache(input_shape) before decoding")
        cache, cfg = self.cache, self.config
        batch, length = query.shape[0], query.shape[1]
        cache.check_step(is_causal, length, key.shape[1], batch, query.dtype, None)
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        valid = None if key_padding_mask is None else ~key_padding_mask
        bandwidth = None if self.log_bandwidth is None else jnp.exp(self.log_bandwidth[...])
        weight = None if self.mixture_weight is None else self.mixture_weight[...]
        ctx, sees = decode_heads(cfg, cache, self.scores, q, k, v, valid, (bandwidth, weight))
        out = self.out_proj(self.attention_dropout(merge_heads(cfg, ctx), deterministic=deterministic, rngs=rngs))
        return keep_seen(out, sees)

    def _attend(self, query, key, value, key_padding_mask, causal, deterministic, rngs, query_positions=None,
                key_positions=None):
        """The batch-first computation: (N, Lq, E), (N, Lk, kdim), (N, Lk, vdim) to (N, Lq, E);
        positions (N, L) or None (the layer's rule)."""
        cfg = self.config
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        if cfg.rope:
            q, k = rotate_forward(q, k, cfg.num_heads, key_padding_mask, query_positions, key_positions)
        bandwidth = None if self.log_bandwidth is None else jnp.exp(self.log_bandwidth[...])
        if isinstance(self.log_bandwidth, FixedBandwidth):
            bandwidth = jax.lax.stop_gradient(bandwidth)
        weight = None if self.mixture_weight is None else self.mixture_weight[...]
        ctx = attend_heads(cfg, self._op, self.scores(q), self.scores(k), v, key_padding_mask, bandwidth, weight,
                           causal)                                             # (N, Lq, E)
        out = self.out_proj(self.attention_dropout(ctx, deterministic=deterministic, rngs=rngs))
        return zero_unseen(out, key_padding_mask, key.shape[1], causal)


def _constructor_signature(cls) -> inspect.Signature:
    """The signature of ``cls(...)``: its ``__init__``'s parameters after ``self``."""
    signature = inspect.signature(cls.__init__)
    return signature.replace(parameters=list(signature.parameters.values())[1:],
                             return_annotation=inspect.Signature.empty)


# NNX's metaclasses define __call__(*args, **kwargs), which is all that inspect (help(), the API
# pages) would show of these classes: show their constructors' parameters instead.
SlicedAttention.__signature__ = _constructor_signature(SlicedAttention)
FixedBandwidth.__signature__ = _constructor_signature(FixedBandwidth)
