"""Dense ``O(n m)`` versions of every op, on any array-API backend.

They spell out the definitions (see the mathematics page) with an explicit (..., n, m) kernel matrix and are the
oracle of the tests; they are also a readable fallback for small problems. Computation runs in
float64 where the backend has it; results come back in the inputs' dtype. Arguments follow the
fast functions of the same name (without their validation: use them on well-formed input).

Examples
--------
>>> import numpy as np
>>> from slicedkern import reference
>>> from slicedkern.kernels import ReLU
>>> x, y = np.array([0.0, 2.0]), np.array([0.0, 1.0, 3.0])
>>> reference.kernel_sum(x, y, np.ones(3), ReLU())
array([0., 3.])
"""

from __future__ import annotations

import array_api_compat as compat

from ._lib.causal import visible
from ._lib.namespace import array_device, compute_dtypes, scalar
from .kernels import Abs, HatMixture, ReLU, hat_profile

__all__ = ["kernel_sum", "relu_attention", "hat_attention", "hat_mixture_attention",
           "kernel_attention", "sliced_attention", "kernel_matrix"]


def _prep(*arrays):
    present = [a for a in arrays if a is not None]
    xp = compat.array_namespace(*present)
    out, work = compute_dtypes(xp, [a for a in present if xp.isdtype(a.dtype, "real floating")],
                               array_device(present[0]))
    cast = [None if a is None or not xp.isdtype(a.dtype, "real floating") else xp.astype(a, work)
            for a in arrays]
    return xp, out, cast


def kernel_matrix(x, y, kernel):
    """``K[..., i, j] = f(x[..., i] - y[..., j])``, shape (..., n, m)."""
    return kernel(x[..., :, None] - y[..., None, :])


def _nan_rows(xp, x, out):
    """NaN rows for non-finite queries ``x`` (..., n) in ``out`` (..., n, c), whether or not the query
    sees a key (docs/mathematics.rst, "Non-finite input")."""
    nan = scalar(xp, float("nan"), dtype=out.dtype, device=array_device(out))
    return xp.where(xp.isfinite(x)[..., None], out, nan)


def kernel_sum(x, y, w, kernel):
    """Dense ``S_i = sum_j f(x_i - y_j) w_j``; w (..., m) or (..., m, c)."""
    xp, out_dtype, (x, y, w) = _prep(x, y, w)
    vector = w.ndim == y.ndim
    if vector:
        w = w[..., None]
    s = _nan_rows(xp, x, kernel_matrix(x, y, kernel) @ w)
    return xp.astype(s[..., 0] if vector else s, out_dtype)


def _visible(xp, q, k, valid, causal, segment_ids=None, window=None):
    """(..., Lq, Lk) True where query ``i`` sees key ``j``: the key is valid, of the query's segment
    (``segment_ids``: one (..., L) array for both, or a pair) and, when ``causal``, at or before the
    key the query is aligned with, ``j <= i + Lk - Lq`` (bottom-right, per segment), and inside the
    ``window`` (docs/mathematics.rst, "Causal attention", "Packed sequences")."""
    keep = valid[..., None, :] != 0
    if segment_ids is None:
        q_ids = k_ids = None
    elif isinstance(segment_ids, tuple):
        q_ids, k_ids = segment_ids
    else:
        q_ids = k_ids = segment_ids
    if causal or q_ids is not None or window is not None:
        keep = keep & visible(xp, q.shape[-1], k.shape[-1], array_device(q), q_ids=q_ids, k_ids=k_ids,
                              causal=causal, window=window)
    return keep


def _attention(q, k, v, weights_of, key_mask, center, normalize, eps, causal=False, segment_ids=None, window=None):
    """``weights_of(r)`` gives the kernel matrix from the differences ``r = q_i - k_j``.

    Every sum runs over the keys each query sees (all valid keys of its segment, or with ``causal``
    those at or before its position, inside the ``window``); the centring mean and the count too. A
    query that sees no key gets 0, unless its score is not finite: a non-finite query's row is NaN.
    """
    xp, out_dtype, (q, k, v) = _prep(q, k, v)
    r = q[..., :, None] - k[..., None, :]
    valid = (xp.ones(k.shape, dtype=q.dtype, device=array_device(q)) if key_mask is None
             else xp.astype(key_mask, q.dtype))
    valid = xp.broadcast_to(valid, k.shape) if valid.ndim < k.ndim else valid
    keep = _visible(xp, q, k, valid, causal, segment_ids, window)
    zero = xp.zeros((), dtype=q.dtype, device=array_device(q))
    seen = xp.astype(keep, q.dtype)                              # (..., Lq, Lk)
    kmat = xp.where(keep, weights_of(r), zero)
    v = xp.where(valid[..., :, None] != 0, v, zero)
    count = xp.sum(seen, axis=-1)[..., None]                     # (..., Lq, 1)
    num = kmat @ v
    if center:
        # sum_j K_ij (v_j - mean_i) with mean_i over the keys query i sees
        mean = (seen @ v) / xp.maximum(count, xp.ones_like(count))
        num = num - mean * xp.sum(kmat, axis=-1)[..., None]
    if normalize is None:
        out = num
    elif normalize == "count":
        out = num / xp.maximum(count, xp.ones_like(count))
    else:
        den_kernel = Abs() if normalize == "abs" else ReLU()
        den = xp.sum(xp.where(keep, den_kernel(r), zero), axis=-1)[..., None]
        out = num / xp.maximum(den, xp.full_like(den, eps))
    return xp.astype(_nan_rows(xp, q, out), out_dtype)


def relu_attention(q, k, v, *, key_mask=None, center=True, normalize="abs", eps=1e-6, causal=False,
                   segment_ids=None, window=None):
    """Dense sliced ReLU attention (paper eq. 3); ``causal``: query ``i`` sees keys ``j <= i + Lk - Lq``;
    ``segment_ids`` ((..., L) integers, or a pair for queries and keys): a query sees only the keys of
    its segment, causal per segment; ``window = (left, right)``: and only the keys from ``p - left`` to
    ``p + right`` around the key ``p`` it is aligned with (``-1``: unbounded)."""
    return _attention(q, k, v, ReLU(), key_mask, center, normalize, eps, causal, segment_ids, window)


def kernel_attention(q, k, v, kernel, *, key_mask=None, center=False, normalize="count", eps=1e-6, causal=False,
                     segment_ids=None, window=None):
    """Dense attention with any piecewise-linear profile; ``segment_ids``, ``window`` as in
    :func:`relu_attention`."""
    return _attention(q, k, v, kernel, key_mask, center, normalize, eps, causal, segment_ids, window)


def _hats(alphas, betas):
    """Kernel-matrix builder for hats with float or array (batch-shaped) bandwidths / weights."""
    def weights_of(r):
        return hat_profile(alphas, betas)(r, compat.array_namespace(r))
    return weights_of


def hat_attention(q, k, v, bandwidth=1.0, *, key_mask=None, center=False, normalize="count", eps=1e-6,
                  causal=False, segment_ids=None, window=None):
    """Dense hat attention (paper eq. 5); ``bandwidth`` a float or a batch-shaped array."""
    return _attention(q, k, v, _hats([bandwidth], [1.0]), key_mask, center, normalize, eps, causal, segment_ids,
                      window)


def hat_mixture_attention(q, k, v, bandwidths, weights, *, key_mask=None, center=False, normalize="count",
                          eps=1e-6, causal=False, segment_ids=None, window=None):
    """Dense hat-mixture attention; ``bandwidths`` / ``weights`` sequences or arrays (..., K)."""
    def split(p):
        return [float(e) for e in p] if isinstance(p, (list, tuple)) else [p[..., i] for i in range(p.shape[-1])]
    if isinstance(bandwidths, (list, tuple)) and isinstance(weights, (list, tuple)):
        kernel = HatMixture(bandwidths, weights)
        return _attention(q, k, v, kernel, key_mask, center, normalize, eps, causal, segment_ids, window)
    return _attention(q, k, v, _hats(split(bandwidths), split(weights)), key_mask, center, normalize, eps,
                      causal, segment_ids, window)


def sliced_attention(q, k, v, kernel, *, directions, key_mask=None, center=False, normalize="count", eps=1e-6,
                     causal=False):
    """Dense multi-slice attention: the mean over the rows ``theta_p`` of ``directions`` (an array
    (P, d)) of :func:`kernel_attention` on the projections ``q @ theta_p``, ``k @ theta_p``; q (..., Lq, d),
    k (..., Lk, d). ``causal`` as in :func:`kernel_attention`, in every slice."""
    outs = [kernel_attention(q @ directions[p, :], k @ directions[p, :], v, kernel, key_mask=key_mask,
                             center=center, normalize=normalize, eps=eps, causal=causal)
            for p in range(directions.shape[0])]
    return sum(outs[1:], outs[0]) / len(outs)
