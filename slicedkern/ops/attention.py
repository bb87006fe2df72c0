"""The attention ops: validated once (:mod:`._validate`), built into a spec, the engine selected
once, then run by the framework's adapter.

Shapes follow ``scaled_dot_product_attention``: q (..., Lq), k (..., Lk) (one projected score per
token), v (..., Lk, Dv) -> (..., Lq, Dv); leading dims broadcast (docs/mathematics.rst, "Attention").
Bandwidth gradients at a tie ``|q - k| = b`` are the right derivative in ``b``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .._lib.namespace import array_device, as_work, scalar, shape_str
from .._lib.typing import Array, ArrayOrFloat, Namespace
from .._spec import AttentionSpec, Normalizer
from .._validate import (
    broadcast_all,
    check_bool,
    check_eps,
    check_kernel,
    check_normalize,
    check_window,
    hat_param,
    need_ndim,
    segment_ids_on_host,
    setup,
)
from ..adapters import run
from ..engines import BandedEngine, SegmentedEngine, band_bounds, segment_layout, select
from ..kernels import HatMixture, PiecewiseLinear, ReLU

__all__ = ["relu_attention", "hat_attention", "hat_mixture_attention", "kernel_attention", "Call", "prepare"]

#: Kernels are immutable: one ReLU serves every call.
_RELU = ReLU()


def _attention(q, k, v, hats, *, kernel=None, key_mask, center, normalize, eps, causal, segment_ids=None,
               window=None, engine, xp):
    """Shared validation and dispatch of every attention op (see :func:`prepare`)."""
    # the caller's own objects, so that slicedkern.vjp finds each input among a wrapper's arguments
    sources = {"q": q, "k": k, "v": v, "key_mask": key_mask, **(hats.sources if hats is not None else {})}
    call = prepare(q, k, v, hats, kernel=kernel, key_mask=key_mask, center=center, normalize=normalize, eps=eps,
                   causal=causal, segment_ids=segment_ids, window=window, engine=engine, xp=xp)
    out = run(*call, sources=tuple(sources.get(n) for n in call.names))
    return nan_rows_without_keys(call.xp, call.inputs[0], call.inputs[1], out)


def nan_rows_without_keys(xp, queries, keys, out):
    """With no key at all (``Lk = 0``) the engines return zeros; a non-finite query's row is NaN
    there too, as it is when keys exist but it sees none (docs/mathematics.rst, "Non-finite input":
    one rule). ``queries`` (..., n), ``keys`` (..., m), ``out`` (..., n, c) or (..., n)."""
    if keys.shape[-1] != 0 or queries.shape[-1] == 0 or 0 in out.shape:
        return out
    vector = out.ndim == queries.ndim
    nan = scalar(xp, float("nan"), dtype=out.dtype, device=array_device(out))
    ok = xp.isfinite(queries) if vector else xp.isfinite(queries)[..., None]
    return xp.where(ok, out, nan)


class Call(NamedTuple):
    """A validated attention call, the arguments of :func:`slicedkern.adapters.run` in order."""

    xp: Any                 # the array namespace
    spec: AttentionSpec     # what to compute
    engine: Any             # the engine chosen once for the forward and the backward
    inputs: tuple           # (q, k, v[, key_mask], *params), broadcast, scores in the work dtype
    names: tuple            # the argument name of each input
    out_dtype: Any          # the result's dtype


def prepare(q, k, v, hats, *, kernel=None, key_mask, center, normalize, eps, causal=False, segment_ids=None,
            window=None, engine, xp, wrap=None) -> Call:
    """Validate an attention call once and choose its engine: a :class:`Call`.

    ``kernel`` is a fixed profile; otherwise ``hats`` is a builder (see :func:`hat_spec`) that
    returns the hat part of the spec and its array parameters. ``wrap`` maps each candidate engine
    to the one that runs the call (:class:`slicedkern.engines.ShardedEngine` in
    ``slicedkern.distributed``), as :func:`slicedkern.engines.select` takes it. With
    ``segment_ids`` the chosen engine runs every segment as a sequence of its own
    (:class:`slicedkern.engines.SegmentedEngine`); with a ``window`` that is neither everything nor
    the causal triangle, over each query's band (:class:`slicedkern.engines.BandedEngine`).
    """
    named = {"q": q, "k": k, "v": v, "key_mask": key_mask}
    xp, device, out_dtype, work = setup(named, xp, required=("q", "k", "v"))
    need_ndim(q, "q", 1, "(..., Lq)")
    need_ndim(k, "k", 1, "(..., Lk)")
    need_ndim(v, "v", 2, "(..., Lk, Dv)")
    if v.shape[-2] != k.shape[-1]:
        if k.ndim >= 2 and k.ndim == v.ndim and k.shape[-2] == v.shape[-2]:
            # k (..., Lk, E) beside v (..., Lk, Dv): SDPA's layout, with a feature axis (only when the
            # score reading does not fit: q (3, 6), k (3, 7), v (7, 2) is three rows sharing v)
            raise ValueError(f"arguments 'q' and 'k' must be one projected score per token, shape (..., L), "
                             f"with 'v' of shape (..., Lk, Dv); got 'q' {shape_str(q)}, 'k' {shape_str(k)} and "
                             f"'v' {shape_str(v)}. If q and k carry a feature axis E (as in "
                             "scaled_dot_product_attention), project them to one score per token first, e.g. "
                             "q @ w_q with w_q of shape (E,) (docs/getting_started.rst)")
        raise ValueError(f"arguments 'k' and 'v' must have the same number of keys Lk, got {shape_str(k)} "
                         f"and {shape_str(v)}")
    arrays, cores = {"q": q, "k": k, "v": v}, {"q": 1, "k": 1, "v": 2}
    if key_mask is not None:
        if key_mask.dtype != xp.bool:
            raise TypeError(f"argument 'key_mask' must be a boolean array, got {shape_str(key_mask)}")
        need_ndim(key_mask, "key_mask", 1, "(..., Lk)")
        if key_mask.shape[-1] != k.shape[-1]:
            raise ValueError(f"argument 'key_mask' must have Lk = {k.shape[-1]} entries on its last axis, "
                             f"got {shape_str(key_mask)}")
        arrays["key_mask"], cores["key_mask"] = key_mask, 1
    check_normalize(normalize)
    eps = check_eps(eps)
    center = check_bool(center, "center")
    causal = check_bool(causal, "causal")
    window = check_window(window)
    left, right = band_bounds(window, causal)
    banded = (left, right) not in ((-1, -1), (-1, 0))
    # a band is built of causal sums: its spec is causal, so that the engine chosen has a causal mode
    causal = (left, right) != (-1, -1)
    batch, arrays = broadcast_all(xp, arrays, cores, tuple(arrays))
    hat_fields, params = hats(xp, device, work, batch) if hats is not None else ({}, {})
    fields = {"kernel": kernel, **hat_fields}
    spec = AttentionSpec(center=center, normalizer=Normalizer(normalize, eps), has_mask=key_mask is not None,
                         causal=causal, param_layout=tuple(params), **fields)
    q, k = as_work(xp, arrays["q"], work), as_work(xp, arrays["k"], work)
    v = arrays["v"]                  # widened inside the prefix sums, after the gather
    if v.dtype != out_dtype:
        # values narrower than the scores: the result is in the promoted dtype, so the values are too
        # (an engine that computes in the values' dtype would round the result to it)
        v = xp.astype(v, out_dtype)
    inputs = (q, k, v) + ((arrays["key_mask"],) if key_mask is not None else ()) + tuple(params.values())
    names = ("q", "k", "v") + (("key_mask",) if key_mask is not None else ()) + tuple(params)
    if (segment_ids is not None or banded) and wrap is not None:
        raise ValueError("arguments 'segment_ids' and 'window' are not taken by sequence-parallel attention yet")
    if banded:
        wrap = _banded(left, right)
    if segment_ids is not None:
        ids = segment_ids_on_host(xp, segment_ids, q.shape[-1], k.shape[-1], batch)
        # with no query or no key there is nothing to pack: every query sees no key either way
        if q.shape[-1] and k.shape[-1]:
            wrap = _segmented(segment_layout(*ids), getattr(hats, "param_cores", {}), wrap)
    return Call(xp, spec, select(spec, inputs, engine, wrap=wrap), inputs, names, out_dtype)


def _banded(left: int, right: int):
    def wrap(engine):
        return BandedEngine(engine, left, right)
    return wrap


def _segmented(layout, param_cores, inner_wrap):
    def wrap(engine):
        return SegmentedEngine(engine if inner_wrap is None else inner_wrap(engine), layout, param_cores)
    return wrap


def relu_attention(q: Array, k: Array, v: Array, /, *, key_mask: Array | None = None, center: bool = True,
                   normalize: str | None = "abs", eps: float = 1e-6, causal: bool = False,
                   segment_ids: Array | tuple[Array, Array] | None = None,
                   window: tuple[int, int] | None = None, engine: str | None = None,
                   xp: Namespace | None = None) -> Array:
    """Sliced ReLU attention (paper eq. 3), ``O(n log n)``.

    ``out_i = sum_j ReLU(q_i - k_j) (v_j - mean(v)) / max(sum_l |q_i - k_l|, eps)``, sums over the keys
    that ``key_mask`` keeps (and, with ``causal=True``, that query ``i`` sees).

    Parameters
    ----------
    q : array, shape (..., Lq)
        One projected score per query token.
    k : array, shape (..., Lk)
        One projected score per key token.
    v : array, shape (..., Lk, Dv)
        Values.
    key_mask : bool array, shape (..., Lk), optional
        True where the key takes part (an array: a Python ``True`` is a ``TypeError``, as is every
        Python scalar where an array is expected). Masked keys count nowhere: not in the sums, the mean used for
        centring, the normaliser or the count.
    center : bool, default True
        Centre the values over the valid keys (the paper's "centered value parametrization").
    normalize : {"abs", "relu", "count", None}, default "abs"
        Denominator: ``sum_l |q_i - k_l|``, ``sum_l ReLU(q_i - k_l)``, the number of valid keys, or none.
    eps : float, default 1e-6
        Lower clamp of the denominator, positive (``"count"`` clamps at 1).
    causal : bool, default False
        Query ``i`` sees only the keys ``j <= i + Lk - Lq`` (bottom-right aligned, as FlashAttention
        2.1+; the lower triangle when ``Lq == Lk``), intersected with ``key_mask``. The sums, the
        normaliser, the count and the centring mean (a running mean) are all over the keys the query
        sees; a query that sees none (the first ``Lq - Lk`` ones when ``Lq > Lk``) gets 0. A non-finite
        key or value makes NaN only the queries that see it. ``O(n log^2 n)`` on the scan engine,
        ``O(n log n)`` per knot on the sweep (docs/mathematics.rst, "Causal attention"); the triton
        engine runs the scan's levels on its own kernels.
    segment_ids : integer array, shape (..., L), or a tuple of two, shapes (..., Lq) and (..., Lk), optional
        Packed sequences: a query sees only the keys that carry its segment id (one array when the
        queries and keys are the same tokens, else ``(q_segment_ids, k_segment_ids)``); leading dims
        broadcast against the batch. Every rule above holds per segment (centring, normaliser,
        count, NaN rule), and ``causal=True`` aligns each segment bottom-right on its own, as
        ``flash_attn_varlen_func`` does. Ids need not be sorted or contiguous; they must be concrete
        (not traced), since they fix the layout. Each segment runs as a sequence of its own,
        documents of similar lengths batched together (docs/getting_started.rst, "Packed sequences
        and windows"); :func:`slicedkern.segment_ids_from_cu_seqlens` converts ``cu_seqlens``.
    window : tuple (left, right) of int, optional
        A band (flash-attention's ``window_size``): query ``i`` sees only the keys ``p - left <= j <=
        p + right`` around the key ``p = i + Lk - Lq`` it is aligned with (per segment with
        ``segment_ids``); ``-1`` leaves a side unbounded, ``causal=True`` caps ``right`` at 0, and a
        ``right`` below ``-1`` keeps only keys older than ``p``: ``(-1, -(w + 1))`` is every key but
        the last ``w + 1``, the global part of a local/global hybrid. Exact, as the difference of two
        causal sums with shifted alignments (docs/mathematics.rst, "Windows"); the engine must have a
        causal mode. ``left < -1`` is a ``ValueError``.
    engine : {"scan", "sweep", "triton"}, optional
        The engine of the forward and the backward (docs/architecture.rst); default: the
        :func:`slicedkern.use_engine` setting, else triton for CUDA torch tensors when Triton is
        installed, the sweep for NumPy / CPU torch when numba is installed, else the scan. A
        requested engine that cannot serve the arrays is a ``ValueError``. With ``causal=True`` the
        default is the sweep where it runs, else the scan, and ``engine="triton"`` is a
        ``ValueError``.
    xp : array namespace, optional

    Returns
    -------
    array, shape (..., Lq, Dv)
        Leading dims broadcast; same namespace, device and floating dtype as the inputs.

    Notes
    -----
    The paper's reference code returns twice this value (a constant a following projection absorbs).
    Half-precision inputs are computed in float32 or better and returned in their dtype.

    Examples
    --------
    >>> import numpy as np, slicedkern
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(2, 5)), rng.normal(size=(2, 7)), rng.normal(size=(2, 7, 3))
    >>> slicedkern.relu_attention(q, k, v).shape
    (2, 5, 3)
    >>> slicedkern.relu_attention(q, k, v, causal=True).shape    # query i sees keys j <= i + 2
    (2, 5, 3)
    """
    return _attention(q, k, v, None, kernel=_RELU, key_mask=key_mask, center=center,
                      normalize=normalize, eps=eps, causal=causal,
                      segment_ids=segment_ids, window=window, engine=engine, xp=xp)


def hat_spec(bandwidths, weights, names):
    """Builder of the hat fields of an :class:`AttentionSpec` and its array parameters.

    One hat when ``weights is None``; else a mixture. Float parameters go into the (static) spec,
    array parameters are passed as arrays (differentiable).
    """
    single = weights is None

    def build(xp, device, work, batch):
        alphas, alpha_arr = hat_param(xp, bandwidths, names[0], device, work, batch, positive=True,
                                      single=single)
        if single:
            betas, beta_arr = (1.0,), None
        else:
            betas, beta_arr = hat_param(xp, weights, names[1], device, work, batch, positive=False, single=False)
        n_alpha = len(alphas) if alpha_arr is None else (1 if single else alpha_arr.shape[-1])
        n_beta = len(betas) if beta_arr is None else beta_arr.shape[-1]
        if n_alpha != n_beta:
            raise ValueError(f"arguments {names[0]!r} and {names[1]!r} must have one entry per hat, got "
                             f"{n_alpha} and {n_beta}")
        params = {}
        if alpha_arr is not None:
            params["bandwidth" if single else "bandwidths"] = alpha_arr
        if beta_arr is not None:
            params["weights"] = beta_arr
        if not params:
            return {"kernel": HatMixture(alphas, betas)}, {}
        return {"family": "hat", "fixed": (alphas or (), betas or ())}, params

    build.sources = {("bandwidth" if single else "bandwidths"): bandwidths, "weights": weights}
    # trailing axes of each array parameter that are not batch axes (a mixture's K)
    build.param_cores = {"bandwidth": 0, "bandwidths": 1, "weights": 1}
    return build


def hat_attention(q: Array, k: Array, v: Array, /, bandwidth: ArrayOrFloat = 1.0, *, key_mask: Array | None = None,
                  center: bool = False, normalize: str | None = "count", eps: float = 1e-6, causal: bool = False,
                  segment_ids: Array | tuple[Array, Array] | None = None,
                  window: tuple[int, int] | None = None, engine: str | None = None,
                  xp: Namespace | None = None) -> Array:
    """Hat ("ReLU-bump") attention (paper eq. 5).

    ``out_i = (1 / n_valid) sum_j max(0, 1 - |q_i - k_j| / b) v_j``.

    Parameters
    ----------
    q : array, shape (..., Lq)
    k : array, shape (..., Lk)
    v : array, shape (..., Lk, Dv)
    bandwidth : float or array, default 1.0
        Positive half-width ``b``; an array broadcasts against the leading dims (one per head, say).
        A list is a ``TypeError``: several hats are :func:`hat_mixture_attention`.
    key_mask : bool array, shape (..., Lk), optional
        True where the key takes part.
    center : bool, default False
        Use ``v_j - mean(v)`` over the valid keys a query sees (causal: a running mean), as
        :func:`relu_attention` does; the layers' ``center=True`` for hats.
    normalize : {"count", "abs", "relu", None}, default "count"
    eps : float, default 1e-6
        Lower clamp of the "abs" / "relu" denominators, positive.
    causal : bool, default False
        Query ``i`` sees only the keys ``j <= i + Lk - Lq``; the count is then the number of keys it
        sees. As in :func:`relu_attention`.
    segment_ids : integer array (..., L) or a tuple of two, optional
        Packed sequences, as in :func:`relu_attention`.
    window : tuple (left, right) of int, optional
        A band of keys per query, as in :func:`relu_attention`.
    engine : {"scan", "sweep", "triton"}, optional
        As in :func:`relu_attention`.
    xp : array namespace, optional

    Returns
    -------
    array, shape (..., Lq, Dv)

    Examples
    --------
    >>> import numpy as np, slicedkern
    >>> q, k, v = np.zeros((1, 1)), np.array([[0.0, 0.5, 3.0]]), np.ones((1, 3, 1))
    >>> slicedkern.hat_attention(q, k, v, bandwidth=1.0)  # (1 + 0.5 + 0) / 3
    array([[[0.5]]])
    >>> q3 = np.array([[0.0, 0.0, 0.0]])
    >>> slicedkern.hat_attention(q3, k, v, causal=True)[..., 0]  # 1 / 1, (1 + 0.5) / 2, 1.5 / 3
    array([[1.  , 0.75, 0.5 ]])
    """
    return _attention(q, k, v, hat_spec(bandwidth, None, ("bandwidth", "weights")),
                      key_mask=key_mask, center=center, normalize=normalize, eps=eps, causal=causal,
                      segment_ids=segment_ids, window=window, engine=engine, xp=xp)


def hat_mixture_attention(q: Array, k: Array, v: Array, /, bandwidths: ArrayOrFloat, weights: ArrayOrFloat, *,
                          key_mask: Array | None = None, center: bool = False, normalize: str | None = "count",
                          eps: float = 1e-6, causal: bool = False,
                          segment_ids: Array | tuple[Array, Array] | None = None,
                          window: tuple[int, int] | None = None, engine: str | None = None,
                          xp: Namespace | None = None) -> Array:
    """Attention with a mixture of hats ``sum_i weights[i] max(0, 1 - |r| / bandwidths[i])``.

    Parameters
    ----------
    q, k, v, key_mask, center, normalize, eps, causal, segment_ids, window, engine, xp
        As in :func:`hat_attention`.
    bandwidths : sequence of float or array, shape (..., K)
        Positive finite bandwidths, ``K >= 1``; an array's leading dims broadcast against the batch
        (per head).
    weights : sequence of float or array, shape (..., K)
        Finite mixture weights (any sign).

    Returns
    -------
    array, shape (..., Lq, Dv)

    Examples
    --------
    >>> import numpy as np, slicedkern
    >>> q, k, v = np.zeros((1, 1)), np.array([[0.0, 0.5]]), np.ones((1, 2, 1))
    >>> slicedkern.hat_mixture_attention(q, k, v, [1.0, 2.0], [1.0, 1.0])  # (2 + 1.25) / 2
    array([[[1.625]]])
    """
    return _attention(q, k, v, hat_spec(bandwidths, weights, ("bandwidths", "weights")),
                      key_mask=key_mask, center=center, normalize=normalize, eps=eps, causal=causal,
                      segment_ids=segment_ids, window=window, engine=engine, xp=xp)


def kernel_attention(q: Array, k: Array, v: Array, /, kernel: PiecewiseLinear, *, key_mask: Array | None = None,
                     center: bool = False, normalize: str | None = "count", eps: float = 1e-6,
                     causal: bool = False, segment_ids: Array | tuple[Array, Array] | None = None,
                     window: tuple[int, int] | None = None,
                     engine: str | None = None, xp: Namespace | None = None) -> Array:
    """Attention with any piecewise-linear profile: ``out_i = sum_j f(q_i - k_j) v_j / normaliser``.

    Parameters
    ----------
    q, k, v, key_mask, eps, causal, segment_ids, window, engine, xp
        As in :func:`relu_attention`.
    kernel : slicedkern.kernels.PiecewiseLinear
        The profile ``f``.
    center : bool, default False
        Centre the values over the valid keys (with ``causal=True``: over the keys each query sees).
    normalize : {"count", "abs", "relu", None}, default "count"

    Returns
    -------
    array, shape (..., Lq, Dv)

    Examples
    --------
    >>> import numpy as np, slicedkern
    >>> from slicedkern.kernels import Hat
    >>> q, k, v = np.zeros((1, 1)), np.array([[0.0, 0.5, 3.0]]), np.ones((1, 3, 1))
    >>> slicedkern.kernel_attention(q, k, v, Hat(1.0))
    array([[[0.5]]])
    """
    check_kernel(kernel)
    return _attention(q, k, v, None, kernel=kernel, key_mask=key_mask, center=center,
                      normalize=normalize, eps=eps, causal=causal,
                      segment_ids=segment_ids, window=window, engine=engine, xp=xp)
