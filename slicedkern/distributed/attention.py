"""Sequence-parallel attention: the top-level attention ops, each process holding a contiguous shard.

Rank ``r`` of ``P`` holds rows ``r * n / P ... (r + 1) * n / P`` of the sequence: its query scores
``q`` (..., n / P), key scores ``k`` (..., m / P), values ``v`` (..., m / P, Dv) and key mask; the op
returns its rows of the output, equal (to rounding) to the one-process op on the concatenated
sequence. torch: every rank of ``group`` calls the op (and, if it records gradients, the backward).
JAX: call it inside ``jax.shard_map`` with the sequence axis sharded over the mesh axis ``axis_name``.
With ``causal=True`` every rank holds as many queries as keys, and global query ``i`` sees the keys
``j <= i`` (docs/scaling.rst, "Causal attention"). Layouts and communication volumes: docs/scaling.rst.
"""

from __future__ import annotations

import contextlib
import contextvars

from .._lib.typing import Array, ArrayOrFloat
from .._validate import check_kernel
from ..adapters import run
from ..backends import backend_of
from ..engines import ShardedEngine
from ..kernels import PiecewiseLinear, ReLU
from ..ops.attention import hat_spec, prepare

__all__ = ["relu_attention", "hat_attention", "hat_mixture_attention", "kernel_attention", "count_bytes"]

#: The communication log of the innermost :func:`count_bytes` of this context, or None.
_log: contextvars.ContextVar[list | None] = contextvars.ContextVar("slicedkern_comm_log", default=None)


@contextlib.contextmanager
def count_bytes():
    """Record the torch collectives of the enclosed calls: a list of ``(operation, bytes)``.

    ``bytes`` is this rank's buffer of each call: the block it contributes to an ``all_gather``, the
    full buffer it hands to a ``reduce_scatter`` or an ``all_reduce``.
    :func:`slicedkern.distributed.volume.ring_bytes` turns the list into the bytes each rank sends.

    Examples
    --------
    >>> from slicedkern.distributed import count_bytes
    >>> with count_bytes() as log:
    ...     pass                          # sequence-parallel calls on a torch process group
    >>> log
    []
    """
    log: list = []
    token = _log.set(log)
    try:
        yield log
    finally:
        _log.reset(token)


def _torch():
    from . import _torch as module  # imports torch: only once a torch tensor has arrived
    return module


def _jax():
    from . import _jax as module  # imports jax: only once a JAX array has arrived
    return module


def _call(q, k, v, hats, comm, options):
    """Validate, and choose the engine to shard over ``comm``: a :class:`~slicedkern.ops.attention.Call`.

    Raised on every rank alike (the ranks agree on shapes and options): a causal call needs as many
    queries as keys per rank; the engine must serve the sharded layout (its ``decline``).
    """
    if options.get("kernel") is not None:
        check_kernel(options["kernel"])
    call = prepare(q, k, v, hats, wrap=lambda engine: ShardedEngine(engine, comm), **options)
    q, k = call.inputs[:2]
    if call.spec.causal and q.shape[-1] != k.shape[-1]:
        raise ValueError(f"argument 'causal': sequence-parallel causal attention needs as many queries as keys "
                         f"on every rank (q.shape[-1] == k.shape[-1]), got {q.shape[-1]} and {k.shape[-1]}")
    return call


def _sharded(q, k, v, hats, *, group, axis_name, **options):  # options: those of ops.attention.prepare
    """Validate on every rank, check that the ranks agree (torch), then run the sharded engine through
    the adapters, as every op runs."""
    if axis_name is not None:
        if group is not None:
            raise ValueError("arguments 'group' (torch) and 'axis_name' (JAX) exclude each other")
        if backend_of(q).library != "jax":
            raise TypeError("argument 'axis_name' names a JAX mesh axis: q, k and v must be JAX arrays "
                            "(inside jax.shard_map); torch tensors take group= instead")
        return run(*_call(q, k, v, hats, _jax().JaxComm(axis_name), options))
    if backend_of(q).library != "torch":
        raise TypeError(f"argument 'q': slicedkern.distributed runs on torch tensors over a process group "
                        f"(group=) or on JAX arrays inside shard_map (axis_name=), got {type(q).__name__}")
    module = _torch()
    group = module.check_group(group)
    call, error = None, None
    try:
        call = _call(q, k, v, hats, module.TorchComm(group, _log.get()), options)
    except (TypeError, ValueError) as exc:
        error = exc                      # raised after the agreement step, so that no rank waits
    module.agree(call, error, group, _log.get())
    return run(*call)


def relu_attention(q: Array, k: Array, v: Array, /, *, key_mask: Array | None = None, center: bool = True,
                   normalize: str | None = "abs", eps: float = 1e-6, causal: bool = False,
                   engine: str | None = None, group=None, axis_name: str | None = None, xp=None) -> Array:
    """Sequence-parallel :func:`slicedkern.relu_attention`: this rank's shard of the output.

    Parameters
    ----------
    q : array, shape (..., Lq / P)
        This rank's query scores (a contiguous shard of the sequence).
    k : array, shape (..., Lk / P)
        This rank's key scores.
    v : array, shape (..., Lk / P, Dv)
        This rank's values.
    key_mask : bool array, shape (..., Lk / P), optional
        This rank's part of the key mask.
    center, normalize, eps, engine, xp
        As in :func:`slicedkern.relu_attention`.
    causal : bool, default False
        Causal attention on the whole sequence: global query ``i`` sees the valid keys ``j <= i``, the
        normaliser and the centring mean running over them, and a query that sees no key gets 0
        (:func:`slicedkern.relu_attention` with ``causal=True`` on the concatenated sequence). Every
        rank must then hold as many queries as keys (``q.shape[-1] == k.shape[-1]``), else every
        rank raises ``ValueError``. The engine must give causal partial sums (the scan does; an
        unset ``engine`` picks it).
    group : torch.distributed.ProcessGroup, optional
        torch: the ranks sharing the sequence, in sequence order (default: the world group). Every
        rank must hold shards of equal length, dtype and batch shape and pass the same options;
        otherwise every rank raises ``ValueError`` (one small all-gather checks it first).
    axis_name : str, optional
        JAX: the mesh axis the sequence is sharded over (inside ``jax.shard_map``).

    Returns
    -------
    array, shape (..., Lq / P, Dv)
        This rank's rows of the output.

    Notes
    -----
    Gradients flow to this rank's ``q``, ``k``, ``v`` (the gradient of the sum of every rank's loss);
    array parameters of the other ops receive that gradient summed over the group, so they must be
    equal on every rank. Communication (docs/scaling.rst): an all-gather of the query scores and a
    reduce-scatter of ``Dv + 2`` columns per query forward; an all-gather of ``Dv + 2`` columns
    and a reduce-scatter of one per query backward. Causal: the same, plus the causal sums of the
    rank's own triangle computed locally, and the per-row totals all-gathered (an exclusive scan
    over the ranks) instead of all-reduced.

    Examples
    --------
    On each of ``P`` ranks of an initialised process group, with its shard of the sequence:

    >>> import slicedkern.distributed as skd
    >>> out = skd.relu_attention(q_shard, k_shard, v_shard)   # doctest: +SKIP
    """
    return _sharded(q, k, v, None, kernel=ReLU(), key_mask=key_mask, center=center, normalize=normalize,
                    eps=eps, causal=causal, engine=engine, xp=xp, group=group, axis_name=axis_name)


def hat_attention(q: Array, k: Array, v: Array, /, bandwidth: ArrayOrFloat = 1.0, *, key_mask: Array | None = None,
                  center: bool = False, normalize: str | None = "count", eps: float = 1e-6, causal: bool = False,
                  engine: str | None = None, group=None, axis_name: str | None = None, xp=None) -> Array:
    """Sequence-parallel :func:`slicedkern.hat_attention`; shards, ``group`` and ``axis_name`` as in
    :func:`relu_attention`.

    Parameters
    ----------
    q, k, v, key_mask, causal, group, axis_name
        As in :func:`relu_attention`.
    bandwidth, center, normalize, eps, engine, xp
        As in :func:`slicedkern.hat_attention` (an array bandwidth: equal on every rank).

    Returns
    -------
    array, shape (..., Lq / P, Dv)

    Examples
    --------
    >>> import slicedkern.distributed as skd
    >>> out = skd.hat_attention(q_shard, k_shard, v_shard, bandwidth=0.5)   # doctest: +SKIP
    """
    return _sharded(q, k, v, hat_spec(bandwidth, None, ("bandwidth", "weights")), key_mask=key_mask,
                    center=center, normalize=normalize, eps=eps, causal=causal, engine=engine, xp=xp,
                    group=group, axis_name=axis_name)


def hat_mixture_attention(q: Array, k: Array, v: Array, /, bandwidths: ArrayOrFloat, weights: ArrayOrFloat, *,
                          key_mask: Array | None = None, center: bool = False, normalize: str | None = "count",
                          eps: float = 1e-6, causal: bool = False, engine: str | None = None, group=None,
                          axis_name: str | None = None, xp=None) -> Array:
    """Sequence-parallel :func:`slicedkern.hat_mixture_attention`.

    Parameters
    ----------
    q, k, v, key_mask, causal, group, axis_name
        As in :func:`relu_attention`.
    bandwidths, weights, center, normalize, eps, engine, xp
        As in :func:`slicedkern.hat_mixture_attention` (arrays: equal on every rank).

    Returns
    -------
    array, shape (..., Lq / P, Dv)

    Examples
    --------
    >>> import slicedkern.distributed as skd
    >>> out = skd.hat_mixture_attention(q_shard, k_shard, v_shard, [0.5, 2.0], [1.0, -0.5])  # doctest: +SKIP
    """
    return _sharded(q, k, v, hat_spec(bandwidths, weights, ("bandwidths", "weights")), key_mask=key_mask,
                    center=center, normalize=normalize, eps=eps, causal=causal, engine=engine, xp=xp,
                    group=group, axis_name=axis_name)


def kernel_attention(q: Array, k: Array, v: Array, /, kernel: PiecewiseLinear, *, key_mask: Array | None = None,
                     center: bool = False, normalize: str | None = "count", eps: float = 1e-6,
                     causal: bool = False, engine: str | None = None, group=None, axis_name: str | None = None,
                     xp=None) -> Array:
    """Sequence-parallel :func:`slicedkern.kernel_attention`.

    Parameters
    ----------
    q, k, v, key_mask, causal, group, axis_name
        As in :func:`relu_attention`.
    kernel, center, normalize, eps, engine, xp
        As in :func:`slicedkern.kernel_attention`.

    Returns
    -------
    array, shape (..., Lq / P, Dv)

    Examples
    --------
    >>> import slicedkern.distributed as skd
    >>> from slicedkern.kernels import Hat
    >>> out = skd.kernel_attention(q_shard, k_shard, v_shard, Hat(1.0))   # doctest: +SKIP
    """
    return _sharded(q, k, v, None, kernel=kernel, key_mask=key_mask, center=center, normalize=normalize,
                    eps=eps, causal=causal, engine=engine, xp=xp, group=group, axis_name=axis_name)
