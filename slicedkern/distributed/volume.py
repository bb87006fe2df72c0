"""Communication volumes: the bytes each rank sends per call, for this package's sequence-parallel
attention and for ring attention on the same shapes (docs/scaling.rst).

Volumes are those of the bandwidth-optimal (ring) collective algorithms, which NCCL uses: with ``P``
ranks, an all-gather of a ``s``-byte block sends ``(P - 1) s`` bytes per rank, a reduce-scatter of an
``S``-byte buffer ``(P - 1) S / P``, an all-reduce ``2 (P - 1) S / P``. Each rank receives as much
as it sends. Other libraries (gloo) may use other algorithms for some sizes.
"""

from __future__ import annotations

__all__ = ["ring_bytes", "sequence_parallel_bytes", "ring_attention_bytes"]

#: Bytes of the agreement check the torch side runs first (24 int64 per rank, all-gathered).
AGREEMENT_BYTES = 24 * 8


def ring_bytes(log, ranks: int) -> int:
    """Bytes one rank sends for the collectives in ``log`` (from :func:`slicedkern.distributed.count_bytes`)."""
    total = 0.0
    for op, size in log:
        if op == "all_gather":
            total += (ranks - 1) * size
        elif op == "reduce_scatter":
            total += (ranks - 1) * size / ranks
        elif op == "all_reduce":
            total += 2 * (ranks - 1) * size / ranks
        else:
            raise ValueError(f"unknown collective {op!r}")
    return round(total)


def sequence_parallel_bytes(ranks: int, batch: int, n: int, dv: int, itemsize: int = 8, *, center: bool = True,
                            profile_normalizer: bool = True, params: int = 0, backward: bool = True,
                            agreement: bool = True, causal: bool = False) -> int:
    """Bytes one rank sends per call of :mod:`slicedkern.distributed` attention.

    Parameters
    ----------
    ranks : int
        ``P``, the processes sharing the sequence.
    batch : int
        Batch rows (the product of the leading dims: batch times heads).
    n : int
        Queries per rank (the sequence length over ``P``).
    dv : int
        Value width.
    itemsize : int
        Bytes of the work dtype, in which the partial sums travel: 8 (float64) wherever the backend
        has it, float32 inputs included (the one-process op accumulates there too); 4 otherwise.
    center, profile_normalizer : bool
        The centring (``relu_attention`` by default) and a profile normaliser ("abs" / "relu").
    params : int
        Array-parameter entries (per-head bandwidths and weights), all-reduced backward.
    backward, agreement : bool
        Include the backward; include the torch side's agreement check.
    causal : bool
        ``causal=True``: the per-row totals (and, backward, the centring mean's gradient) are
        all-gathered per rank for an exclusive scan over the ranks instead of all-reduced; the rest
        is the same (the partial sums for the earlier ranks' queries travel as zeros).

    Returns
    -------
    int

    Examples
    --------
    >>> from slicedkern.distributed.volume import ring_attention_bytes, sequence_parallel_bytes
    >>> sequence_parallel_bytes(4, 8, 1024, 64, agreement=False)
    26357952
    >>> ring_attention_bytes(4, 8, 1024, 64)
    19169280
    """
    p, row = ranks, batch * itemsize
    cols = dv + 1 + int(profile_normalizer)
    sent = (p - 1) * n * row                         # the query scores, all-gathered
    # value totals, valid count, bad-key count: all-reduced, or all-gathered for the scan over ranks
    sent += (p - 1) * row * (dv + 2) if causal else 2 * (p - 1) * row * (dv + 2) / p
    sent += (p - 1) * n * row * cols                 # the partial sums, reduce-scattered (P n rows in)
    if backward:
        sent += (p - 1) * n * row * (dv + int(center) + int(profile_normalizer))   # the cotangents
        sent += (p - 1) * n * row                    # the query gradients, reduce-scattered
        if center:                                   # the gradient of the mean value
            sent += (p - 1) * row * dv if causal else 2 * (p - 1) * row * dv / p
        sent += 2 * (p - 1) * params * itemsize / p
    if agreement:
        sent += (p - 1) * AGREEMENT_BYTES
    return round(sent)


def ring_attention_bytes(ranks: int, batch: int, n: int, dv: int, itemsize: int = 4, *, backward: bool = True,
                         key_width: int = 1) -> int:
    """Bytes one rank sends per call of ring attention on the same shards: its key and value shards go
    ``P - 1`` steps around the ring forward; backward, the keys and values go round again with their
    gradient accumulators. ``key_width`` is 1 for one score per token (``E`` for dot-product attention);
    ``itemsize`` that of the inputs (4 for float32).

    Examples
    --------
    >>> from slicedkern.distributed.volume import ring_attention_bytes
    >>> # 1 step of 4 keys and 4 x 3 values, float32
    >>> ring_attention_bytes(2, 1, 4, 3, backward=False)
    64
    """
    per_step = batch * n * (key_width + dv) * itemsize
    return (ranks - 1) * per_step * (3 if backward else 1)
