"""Host bridge of the sweep engine's causal mode (:mod:`._kernels_causal`): NumPy arrays and CPU
torch tensors in, results out, one compiled sweep per call.

docs/mathematics.rst, "Causal attention": query ``i`` of ``Lq`` sees the keys ``j <= i + Lk - Lq``
(intersected with the key mask). :func:`causal_attention` is the forward with its per-query
residuals; :func:`causal_profile_vjp` pulls a cotangent of one causal profile sum back to the
scores, the weights and the profile's knots / coefficients (two sweeps: the queries reading the
keys, then the keys reading the queries that see them). Imported only where numba is installed.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from ...kernels import Profile
from .._vjp import Form, Inputs
from ._convert import (
    F64,
    NO_MASK,
    PARALLEL_MIN_WORK,
    Array,
    attention_inputs,
    checked,
    common_float,
    mask_rows,
    normalizer_code,
    profile_rows,
    rows,
    strict_rows,
    to_numpy,
    with_zero_knot,
    wrap,
)
from ._kernels_causal import ATTENTION, BACKWARD_KEYS, BACKWARD_QUERIES, PULL_KEYS, PULL_QUERIES, causal_rows
from ._kernels_common import NO_NORMALIZER, CausalOptions

__all__ = ["causal_attention", "causal_profile_vjp", "causal_attention_vjp"]


def _workers(bsz: int, n: int, m: int, c: int) -> int:
    """One worker (the calling thread) for small work, else one per row up to the thread count."""
    threads = numba.get_num_threads()
    if threads == 1 or bsz * (n + m) * max(c, 1) < PARALLEL_MIN_WORK:
        return 1
    return min(threads, bsz)


def _pull_options(want_params: bool) -> CausalOptions:
    """A pull-back sweep's options: profile sums only (no centring, no normaliser)."""
    return CausalOptions(center=False, normalizer=NO_NORMALIZER, zero_knot=0, eps=0.0, want_params=want_params)


#: the prefix-sum columns each mode adds to the weights' (:mod:`._kernels_causal`, "Columns")
_EXTRA_COLUMNS = {ATTENTION: 1, PULL_QUERIES: 0, PULL_KEYS: 0, BACKWARD_QUERIES: 1, BACKWARD_KEYS: 2}


def _sweep(mode, src, tgt, profile, options, outs, terms=None):
    """Allocate the work space (sorted sources, one Fenwick tree per worker) and run the sweep."""
    scores = src[0]
    bsz, n_s = scores.shape
    c = src[1].shape[2]
    workers = _workers(bsz, tgt[0].shape[1], n_s, c)
    work = (np.empty((bsz, n_s)), np.empty((bsz, n_s), np.int64), np.empty((bsz, n_s), np.int64),
            np.zeros((bsz, n_s), np.bool_))
    trees = np.empty((workers, n_s + 1, 2 * (c + _EXTRA_COLUMNS[mode])))
    if len(tgt) == 2:
        tgt = (*tgt, NO_MASK, False)
    if terms is None:
        terms = (_placeholder(F64, 2), _placeholder(F64, 2), _placeholder(F64, 3), _placeholder(F64, 3))
    causal_rows(mode, src, tgt, terms, profile, options, work, outs, trees, workers)


def _placeholder(dt, ndim):
    return np.zeros((1,) * ndim, dt)


def causal_attention(inputs: Inputs, form: Form) -> tuple[Any, Any, Any, Any]:
    """Causal normalised kernel attention by one Fenwick sweep per batch row.

    Parameters
    ----------
    inputs : Inputs
        ``(q (..., Lq), k (..., Lk), v (..., Lk, Dv), key_mask (..., Lk) bool or None)``.
    form : Form
        As in :func:`._host.attention`; every sum runs over the keys each query sees.

    Returns
    -------
    out : (..., Lq, Dv)
        In the values' dtype; NaN on non-finite queries and on the queries that see a non-finite
        key or value (docs/mathematics.rst, "Non-finite input").
    take : (..., Lk) bool
        The keys that take part (unmasked, finite score and value).
    relu_count, den : (..., Lq) float64
        Per query, the value profile and the normaliser's profile summed over the valid-key
        indicator of the keys it sees (unclamped; ``den`` is 0 for "count" and no normaliser).

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern._spec import Normalizer
    >>> from slicedkern.engines._vjp import Form, Inputs
    >>> from slicedkern.engines.sweep import _causal_host as sweep
    >>> from slicedkern.kernels import Profile
    >>> q, k, v = np.array([[1.0, 3.0]]), np.array([[0.0, 2.0]]), np.array([[[1.0], [3.0]]])
    >>> relu = Form(Profile((0.0,), (1.0,)), Normalizer(None), center=False)
    >>> sweep.causal_attention(Inputs(q, k, v, None), relu)[0][..., 0]          # [1 * 1, 3 * 1 + 1 * 3]
    array([[1., 6.]])
    """
    (q, k, v, key_mask), (profile, normalizer, center) = inputs, form
    code = normalizer_code(normalizer)
    q, k, v, tdt, batch, dt, out_dt = attention_inputs(q, k, v)
    lq, lk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    bsz = int(np.prod(batch, dtype=np.int64))
    if lq == 0 or lk == 0 or dv == 0 or bsz == 0:
        take = np.zeros(batch + (lk,), np.bool_)
        zeros = [np.zeros(batch + (lq,)) for _ in range(2)]
        return (wrap(np.zeros(batch + (lq, dv), out_dt), tdt, narrow=True), wrap(take, tdt),
                *(wrap(z, tdt) for z in zeros))
    mask, has_mask = mask_rows(key_mask, k.shape, bsz)
    rows_, _ = profile_rows(profile, batch, bsz)
    rows_, zero_knot = with_zero_knot(rows_, normalizer)
    strict = strict_rows(None, rows_[0].shape[1])
    src = (rows(k, bsz, (lk,), F64), rows(v, bsz, (lk, dv), dt), mask, has_mask)
    tgt = (rows(q, bsz, (lq,), F64), _placeholder(dt, 3))
    out = np.empty((bsz, lq, dv), dt)
    relu_count, den = np.empty((bsz, lq)), np.empty((bsz, lq))
    take = np.empty((bsz, lk), np.bool_)
    outs = (out, _placeholder(F64, 2), relu_count, den, take, _placeholder(F64, 2), _placeholder(F64, 2))
    options = CausalOptions(center=bool(center), normalizer=code, zero_knot=zero_knot,
                            eps=float(normalizer.eps), want_params=False)
    _sweep(ATTENTION, src, tgt, (*rows_, strict), options, outs)
    out = out.reshape(batch + (lq, dv))
    if out.dtype != out_dt:
        out = out.astype(out_dt)
    return (wrap(out, tdt, narrow=True), wrap(take.reshape(batch + (lk,)), tdt),
            wrap(relu_count.reshape(batch + (lq,)), tdt), wrap(den.reshape(batch + (lq,)), tdt))


def causal_profile_vjp(x: Array, y: Array, w: Array, profile: Profile, g: Array, *,
                       param_grads: bool = True) -> tuple[Any, ...]:
    """Pull-back of the causal profile sum ``S_i = sum_{j <= i + m - n} f(x_i - y_j) w_j`` (cotangent ``g``).

    Parameters
    ----------
    x : array, shape (..., n); y : array, shape (..., m); w : array, shape (..., m, c)
        Finite (the caller applied the NaN rule); ``g`` : array, shape (..., n, c).
    profile : Profile
        The profile ``f``, as in :func:`._host.kernel_sum`; its ``strict_knots`` are the knots whose
        own gradient counts a tie ``x_i - y_j = knots[m]`` below the knot.
    param_grads : bool
        Also return the knot / coefficient gradients (else ``None``).

    Returns
    -------
    ``dx (..., n)``, ``dy (..., m)``, ``dw (..., m, c)`` float64 and ``dknots, dcoeffs (..., M)``
    float64 or None: ``dx_i = g_i . sum f'(x_i - y_j) w_j``, ``dy_j = -w_j . sum f'(x_i - y_j) g_i``
    (``f'`` with ``H(0) = 1``), ``dw_j = sum f(x_i - y_j) g_i``, each over the pairs ``j <= i + m - n``.

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern.engines.sweep import _causal_host as sweep
    >>> from slicedkern.kernels import Profile
    >>> x, y = np.array([[1.0, 3.0]]), np.array([[0.0, 2.0]])
    >>> w, g = np.ones((1, 2, 1)), np.ones((1, 2, 1))
    >>> dx, dy, dw, _, _ = sweep.causal_profile_vjp(x, y, w, Profile((0.0,), (1.0,)), g)
    >>> dx, dy, dw[..., 0]        # query 0 sees key 0; query 1 sees both
    (array([[1., 2.]]), array([[-2., -1.]]), array([[4., 1.]]))
    """
    (x, y, w), tdt, batch = checked(x, y, w, ("x", "y", "w"))
    g, tg = to_numpy(g, "g")
    tdt = tdt + [tg]
    if g.shape != x.shape + w.shape[-1:]:
        raise ValueError(f"argument 'g' must have shape {x.shape + w.shape[-1:]}, got {g.shape}")
    # w and g keep their own dtypes (float32 values against float64 cotangents: no widened copy)
    wdt, gdt = common_float([w], ["w"]), common_float([g], ["g"])
    n, m, c = x.shape[-1], y.shape[-1], w.shape[-1]
    bsz = int(np.prod(batch, dtype=np.int64))
    rows_, n_user = profile_rows(profile, batch, bsz)
    n_knots = rows_[0].shape[1]
    dx, dy, dw = np.zeros((bsz, n)), np.zeros((bsz, m)), np.zeros((bsz, m, c))
    dknots, dcoeffs = np.zeros((bsz, n_knots)), np.zeros((bsz, n_knots))
    if n and m and c and bsz:
        prof = (*rows_, strict_rows(profile.strict_knots, n_knots))
        xr, yr = rows(x, bsz, (n,), F64), rows(y, bsz, (m,), F64)
        wr, gr = rows(w, bsz, (m, c), wdt), rows(g, bsz, (n, c), gdt)
        none = _placeholder(F64, 2)
        # queries read the keys: dx and the knot / coefficient gradients
        outs = (_placeholder(F64, 3), dx, none, none, _placeholder(np.bool_, 2), dknots, dcoeffs)
        _sweep(PULL_QUERIES, (yr, wr, NO_MASK, False), (xr, gr), prof, _pull_options(bool(param_grads)),
               outs)
        # keys read the queries that see them (reflected, in reverse position order): dw and dy
        outs = (dw, dy, none, none, _placeholder(np.bool_, 2), none, none)
        _sweep(PULL_KEYS, (xr, gr, NO_MASK, False), (yr, wr), prof, _pull_options(False), outs)
    grads = [wrap(a.reshape(batch + a.shape[1:]), tdt) for a in (dx, dy, dw)]
    if not param_grads:
        return (*grads, None, None)
    return (*grads, *(wrap(a[:, :n_user].reshape(batch + (n_user,)), tdt) for a in (dknots, dcoeffs)))


def causal_attention_vjp(inputs: Inputs, form: Form, g: Array, out: Array | None, relu_count: Array | None,
                         den: Array | None, *, param_grads: bool = True,
                         vanishes: bool = False) -> tuple[Any, ...] | None:
    """The fused backward of :func:`causal_attention`: two sweeps per batch row (:mod:`._kernels_causal`,
    ``BACKWARD_QUERIES`` then ``BACKWARD_KEYS``).

    Parameters
    ----------
    inputs, form
        As in the forward call (the profile's ``strict_knots`` as in :func:`causal_profile_vjp`).
        Every query must be finite, and every unmasked key and its value (the forward's ``take``
        equals the key mask). The generic backward serves the calls that break these.
    g : array, shape (..., Lq, Dv)
        The cotangent of the output.
    out : array, shape (..., Lq, Dv), or None
        The forward output; read for the "abs" and "relu" normalisers.
    relu_count, den : array, shape (..., Lq), or None
        The forward's residuals (read when centring, and for a summed normaliser).
    param_grads : bool
        As in :func:`causal_profile_vjp`.
    vanishes : bool
        Whether the value profile is 0 wherever the normaliser is (ReLU attention): then a query
        whose normaliser sum is exactly 0 while it sees a key (a *silent* row, engines/_vjp.py) is
        possible, which this backward does not serve.

    Returns
    -------
    dq (..., Lq), dk (..., Lk) float64; dv (..., Lk, Dv) in the values' dtype; dknots, dcoeffs
    (..., M) float64, or None; or None where ``vanishes`` and some row is silent.

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern._spec import Normalizer
    >>> from slicedkern.engines._vjp import Form, Inputs
    >>> from slicedkern.engines.sweep import _causal_host as sweep
    >>> from slicedkern.kernels import Profile
    >>> q, k, v = np.array([[1.0, 3.0]]), np.array([[0.0, 2.0]]), np.array([[[1.0], [3.0]]])
    >>> relu = Form(Profile((0.0,), (1.0,)), Normalizer(None), center=False)
    >>> g = np.ones((1, 2, 1))
    >>> dq, dk, dv, _, _ = sweep.causal_attention_vjp(Inputs(q, k, v, None), relu, g, None, None, None)
    >>> dq, dk, dv[..., 0]        # out_0 = 1 * 1, out_1 = 3 * 1 + 1 * 3
    (array([[1., 4.]]), array([[-2., -3.]]), array([[4., 1.]]))
    """
    (q, k, v, key_mask), (profile, normalizer, center) = inputs, form
    code = normalizer_code(normalizer)
    (q, k, v), tdt, batch = checked(q, k, v, ("q", "k", "v"))
    g, tg = to_numpy(g, "g")
    tdt = tdt + [tg]
    lq, lk, c = q.shape[-1], k.shape[-1], v.shape[-1]
    if g.shape != batch + (lq, c):
        raise ValueError(f"argument 'g' must have shape {batch + (lq, c)} (..., Lq, Dv), got {g.shape}")
    summed = normalizer.summed
    dt = common_float([v, g], ["v", "g"])
    bsz = int(np.prod(batch, dtype=np.int64))
    rows_, n_user = profile_rows(profile, batch, bsz)
    rows_, zero_knot = with_zero_knot(rows_, normalizer)
    n_knots = rows_[0].shape[1]
    dq, dk = np.zeros((bsz, lq)), np.zeros((bsz, lk))
    dv = np.zeros((bsz, lk, c), dt)
    dknots, dcoeffs = np.zeros((bsz, n_knots)), np.zeros((bsz, n_knots))
    if lq and lk and c and bsz:
        mask, has_mask = mask_rows(key_mask, k.shape, bsz)
        prof = (*rows_, strict_rows(profile.strict_knots, n_knots))
        qr, kr = rows(q, bsz, (lq,), F64), rows(k, bsz, (lk,), F64)
        vr, gr = rows(v, bsz, (lk, c), dt), rows(g, bsz, (lq, c), dt)
        none = _placeholder(F64, 2)

        def residual(a, name):
            return rows(to_numpy(a, name)[0], bsz, (lq,), F64) if a is not None else none

        out_rows = rows(to_numpy(out, "out")[0], bsz, (lq, c), dt) if summed else _placeholder(dt, 3)
        query_terms = np.empty((bsz, lq, 5))
        terms = (residual(relu_count if center else None, "relu_count"), residual(den if summed else None, "den"),
                 out_rows, query_terms)
        options = CausalOptions(center=bool(center), normalizer=code, zero_knot=zero_knot,
                                eps=float(normalizer.eps), want_params=bool(param_grads), vanishes=bool(vanishes))
        # queries read the keys: dq, the knot / coefficient gradients and each query's cotangents
        outs = (_placeholder(dt, 3), dq, none, none, _placeholder(np.bool_, 2), dknots, dcoeffs)
        _sweep(BACKWARD_QUERIES, (kr, vr, mask, has_mask), (qr, gr), prof, options, outs, terms)
        if vanishes and query_terms[..., 4].any():
            return None
        # keys read the queries that see them (reflected, in reverse position order): dv and dk
        outs = (dv, dk, none, none, _placeholder(np.bool_, 2), none, none)
        _sweep(BACKWARD_KEYS, (qr, gr, NO_MASK, False), (kr, vr, mask, has_mask), prof,
               options._replace(want_params=False), outs, terms)
    grads = [wrap(a.reshape(batch + a.shape[1:]), tdt) for a in (dq, dk, dv)]
    if not param_grads:
        return (*grads, None, None)
    return (*grads, *(wrap(a[:, :n_user].reshape(batch + (n_user,)), tdt) for a in (dknots, dcoeffs)))
