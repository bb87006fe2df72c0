"""The fused CPU **sweep** engine's functions on NumPy arrays and CPU torch tensors (host bridge).

It imports numba (through the compiled kernels, :mod:`._kernels_forward` and
:mod:`._kernels_backward`), so the engine (:class:`slicedkern.engines.sweep.SweepEngine`) loads it on
first use only: ``import slicedkern`` never imports numba. It converts inputs (:mod:`._convert`),
checks arguments, allocates nothing of size ``n x c`` but the results, and applies the NaN-row policy.

How it works, per batch row (docs/mathematics.rst, "The kernel sum by sort-scan" and "The
backward pass")
------------------------------------------------------------------------------------------------
1. *Sort*: the finite queries and the valid (unmasked) keys, in float64, each sorted once (a
   stable LSD radix sort; insertion sort for short rows). The median key is the row's *shift*:
   sums subtract it (so that ``s P0 - P1`` cancels little), comparisons do not (ties are decided
   exactly on the values as given, with ``x - t`` taken as an exact pair, TwoSum).
2. *Forward sweep* (:func:`kernel_sum`, :func:`attention`): queries in increasing order, one
   pointer per knot advancing through the sorted keys with float64 running sums ``P0 = sum w_j``,
   ``P1 = sum y_j w_j``; each output row is assembled in float64 and written once. Attention adds
   the valid-key indicator as an implicit column (count and key sums), the centring as
   ``N - mu R`` and the normalisers (``|r| = 2 ReLU(r) - r``).
3. *Backward sweep* (:func:`kernel_sum_vjp`, :func:`attention_vjp`): keys in increasing order, one
   pointer per knot advancing through the sorted queries. One pass per row yields ``dq``, ``dk``
   and the knot / coefficient gradients together (no second sort, no (n, D) temporary); a second,
   keys in decreasing order, writes ``dv`` from suffix sums over the queries (so that a query
   takes no part in the rounding of the value gradients of keys its ReLU terms do not reach); a
   short preparation per row computes the per-query normaliser, centring and quotient-rule
   factors first. ``attention(..., keep=True)`` returns the forward's sorted rows, ``1 / D_i``,
   ``R_i`` and value totals, and ``attention_vjp(..., residuals=)`` reuses them: the backward then
   neither sorts nor sweeps the scores again.

Rows (and, when rows alone would leave threads idle, column chunks of at least 16) run in
parallel, claimed dynamically by the workers; small problems run serially on the calling thread,
so that a tiny call neither waits for nor wakes the thread pool.

Dtypes: scores are sorted and combined in float64 and every running sum is float64.
:func:`attention` and :func:`attention_vjp` read float32 or float64 values as they are and return
the inputs' dtypes (float16 / bfloat16 are computed in float32 and returned in half precision);
:func:`kernel_sum` and :func:`kernel_sum_vjp` compute and return float64. Knot and coefficient
gradients are float64.

NaN policy: in the forward pass a non-finite query gives a NaN output row, a non-finite valid key
or value a NaN batch row. In :func:`attention_vjp` a non-finite query gets a NaN ``dq`` and
contributes nothing else (its cotangent is not read); a non-finite valid key or value, or a
non-finite cotangent of a finite query, makes every gradient of that batch row NaN (``dknots`` and
``dcoeffs`` included). In :func:`kernel_sum_vjp` any non-finite value among ``x, y, w, g`` makes
every gradient of its batch row NaN. Masked keys get zero ``dk`` and ``dv``. Inputs are never
modified.

Tie rule of the backward pass: ``f'(r) = slope + sum_m coeffs[m] [r >= knots[m]]`` (``H(0) = 1``)
in both ``dq`` and ``dk``: ``dq`` is the right derivative of the loss in a query, ``dk`` the left
one in a key, and both are exact on ties (docs, "The backward pass", Ties).

Inputs: NumPy arrays or CPU torch tensors (zero-copy through ``.numpy()`` where contiguous; any
torch input gives torch outputs). Compiled code is cached on disk; :func:`warmup` compiles or
loads it up front.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..._spec import Normalizer
from ...kernels import Profile
from .._vjp import Form, Inputs
from . import _layout
from ._causal_host import causal_attention, causal_attention_vjp, causal_profile_vjp
from ._convert import (
    F64,
    NO_MASK,
    Array,
    attention_inputs,
    bad_rows,
    checked,
    common_float,
    dummy,
    mask_rows,
    normalizer_code,
    profile_rows,
    result_dtype,
    rows,
    schedule,
    strict_rows,
    summed,
    sweep_profile,
    to_numpy,
    with_zero_knot,
    wrap,
)
from ._kernels_backward import backward_rows
from ._kernels_common import NO_NORMALIZER, BackwardOptions, SumOptions, allocate_saved, allocate_sorted
from ._kernels_forward import forward_rows

__all__ = ["AVAILABLE", "kernel_sum", "attention", "kernel_sum_vjp", "attention_vjp", "warmup",
           "causal_attention", "causal_profile_vjp", "causal_attention_vjp"]

#: Whether the engine can run here (this module imports only where numba does).
AVAILABLE = True

#: The forward's ``saved`` group without ``keep``: dummies the kernels do not touch, so every call
#: shares them.
NOT_SAVED = allocate_saved(1, 1, 1, False)


# ---------------------------------------------------------------------------------------- forward
def kernel_sum(x: Array, y: Array, w: Array, profile: Profile) -> Array:
    """``S[..., i, :] = sum_j f(x_i - y_j) w[..., j, :]`` by one fused sweep per batch row.

    Parameters
    ----------
    x : array, shape (..., n)
    y : array, shape (..., m)
    w : array, shape (..., m, c)
        NumPy arrays or CPU torch tensors, real floating, with equal (already broadcast) leading dims.
    profile : Profile
        ``f(r) = intercept + slope r + sum_m coeffs[m] ReLU(r - knots[m])``
        (:class:`slicedkern.kernels.Profile`): each knot and coefficient a number or an array that
        broadcasts to the batch shape (per-row profiles), ``slope`` and ``intercept`` likewise.

    Returns
    -------
    array, shape (..., n, c), float64 (a torch tensor when any input is one).

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern.engines.sweep import _host as sweep
    >>> from slicedkern.kernels import Profile
    >>> x, y, w = np.array([[0.0, 1.0]]), np.array([[0.5]]), np.ones((1, 1, 1))
    >>> sweep.kernel_sum(x, y, w, Profile((0.0,), (1.0,)))[..., 0]      # ReLU(x - 0.5)
    array([[0. , 0.5]])
    """
    (x, y, w), tdt, batch = checked(x, y, w, ("x", "y", "w"))
    common_float([x, y, w], ["x", "y", "w"])
    n, m, c = x.shape[-1], y.shape[-1], w.shape[-1]
    if n == 0 or m == 0 or c == 0 or 0 in batch:
        return wrap(np.zeros(batch + (n, c), np.float64), tdt)
    bsz = int(np.prod(batch, dtype=np.int64))
    rows_, _ = profile_rows(profile, batch, bsz)
    plan = schedule(bsz, n, m, c)
    # kernel sums run in float64 throughout (one compiled signature; the output is float64 anyway)
    scores = (rows(x, bsz, (n,), F64), rows(y, bsz, (m,), F64), NO_MASK, False)
    options = SumOptions.plain()
    out = np.empty((bsz, n, c))
    bad = forward_rows(scores, rows_, options, rows(w, bsz, (m, c), F64), out,
                       allocate_sorted(bsz, n, m), NOT_SAVED, plan)
    bad = bad_rows(bad, plan[0])
    if bad.any():
        out[bad] = np.nan
    return wrap(out.reshape(batch + (n, c)), tdt)


def attention(inputs: Inputs, form: Form, *, keep: bool = False) -> Array | tuple[Array, tuple]:
    """Normalised kernel attention ``out_i = sum_j f(q_i - k_j) (v_j - mu) / D_i`` (docs, "Attention").

    Parameters
    ----------
    inputs : Inputs
        ``(q (..., Lq), k (..., Lk), v (..., Lk, Dv), key_mask (..., Lk) bool or None)``: NumPy
        arrays or CPU torch tensors with equal (already broadcast) leading dims; masked keys (False)
        take part in nothing.
    form : Form
        ``(profile, normalizer, center)``: the value profile ``f`` as in :func:`kernel_sum`; the
        divisor ``D_i`` (:class:`slicedkern._spec.Normalizer`: ``sum_valid |q_i - k|`` or
        ``sum_valid ReLU(q_i - k)`` clamped below by ``eps``, ``max(n_valid, 1)``, or 1); whether the
        values are centred over the valid keys (``mu`` their mean, folded in as ``N - mu R``).
    keep : bool
        Also return what :func:`attention_vjp` would otherwise recompute.

    Returns
    -------
    out : array, shape (..., Lq, Dv)
        In the values' dtype (float32 or float64; half-precision values give half precision),
        computed from float64 running sums.
    residuals : tuple of arrays, only with ``keep``
        The sorted rows and per-query terms of the sweep, for ``attention_vjp(..., residuals=)``
        with the same arguments: the backward then neither sorts nor re-sweeps the scores.

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern._spec import Normalizer
    >>> from slicedkern.engines._vjp import Form, Inputs
    >>> from slicedkern.engines.sweep import _host as sweep
    >>> from slicedkern.kernels import Profile
    >>> q, k, v = np.array([[1.0]]), np.array([[0.0, 2.0]]), np.array([[[1.0], [3.0]]])
    >>> relu = Form(Profile((0.0,), (1.0,)), Normalizer("count"), center=False)
    >>> sweep.attention(Inputs(q, k, v, None), relu)    # ReLU(1 - 0) * 1 / 2
    array([[[0.5]]])
    """
    (q, k, v, key_mask), (profile, normalizer, center) = inputs, form
    code = normalizer_code(normalizer)
    q, k, v, tdt, batch, dt, out_dt = attention_inputs(q, k, v)
    lq, lk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    if _layout.empty_call(batch, lq, lk, dv):
        out = wrap(np.zeros(batch + (lq, dv), out_dt), tdt, narrow=True)
        return (out, ()) if keep else out
    bsz = math.prod(batch)
    mask, has_mask = mask_rows(key_mask, k.shape, bsz)
    profile_rows_, zero_knot, _ = sweep_profile(profile, batch, bsz, normalizer)
    plan = schedule(bsz, lq, lk, dv)
    scores = (rows(q, bsz, (lq,), F64), rows(k, bsz, (lk,), F64), mask, has_mask)
    options = SumOptions(center=bool(center), normalizer=code, zero_knot=zero_knot, eps=float(normalizer.eps))
    out = np.empty((bsz, lq, dv), dt)
    sorted_rows, saved = allocate_sorted(bsz, lq, lk), allocate_saved(bsz, lq, dv, True) if keep else NOT_SAVED
    bad = forward_rows(scores, profile_rows_, options, rows(v, bsz, (lk, dv), dt), out, sorted_rows, saved, plan)
    if np.count_nonzero(bad):       # (a third of bad.any()'s time on small calls)
        out[bad_rows(bad, plan[0])] = np.nan
    out = out.reshape(batch + (lq, dv))
    if out.dtype != out_dt:
        out = out.astype(out_dt)
    out = wrap(out, tdt, narrow=True)
    if not keep:
        return out
    return out, tuple(wrap(a, tdt) for a in sorted_rows + saved[:4])


# --------------------------------------------------------------------------------------- backward
def _backward(scores, profile, options, tensors, shapes, kept=None):
    """Run the fused backward; ``(dq, dk, dv, dknots, dcoeffs, bad rows)`` with rows flattened.

    ``kept``: the forward's residuals (:func:`attention` with ``keep``) as NumPy arrays, or None.
    """
    bsz, n, m, c = shapes
    nch, width, workers = schedule(bsz, n, m, c)
    n_knots = profile[0].shape[1]
    grads = (np.zeros((nch, bsz, n)), np.empty((nch, bsz, m)), np.empty((bsz, m, c), tensors[0].dtype),
             np.empty((nch, bsz, n_knots)), np.empty((nch, bsz, n_knots)))
    if kept is None:
        # the forward's saved group, empty: the backward fills it itself (and sorts again)
        sorted_rows = allocate_sorted(bsz, n, m)
        scale, relu_sum, unclamped, totals, _ = allocate_saved(bsz, n, c, True)
    else:
        sorted_rows, (scale, relu_sum, unclamped, totals) = tuple(kept[:6]), kept[6:]
    saved = (relu_sum, unclamped, totals, kept is not None)
    terms = (scale, np.zeros((bsz, n)), np.zeros((bsz, n)), np.zeros((bsz, 3, c)), np.zeros((bsz, 2)))
    bad = backward_rows(scores, profile, options, tensors, grads, (sorted_rows, terms, saved),
                        (nch, width, workers))
    dq, dk, dv, dkn, dco = grads
    return summed(dq), summed(dk), dv, summed(dkn), summed(dco), bad_rows(bad, nch)


def kernel_sum_vjp(x: Array, y: Array, w: Array, profile: Profile, g: Array, *, param_grads: bool = True,
                   bad_query_poisons_row: bool = True) -> tuple[Any, ...]:
    """Vector-Jacobian product of :func:`kernel_sum` with cotangent ``g``, by one fused backward sweep.

    Parameters
    ----------
    x, y, w, profile
        As in :func:`kernel_sum`. The profile's ``strict_knots`` are the knots whose own gradient
        counts an exact tie ``x_i - y_j = knots[m]`` below the knot (``H(0) = 0``); ``dx`` and ``dy``
        are not affected.
    g : array, shape (..., n, c)
        The cotangent of the output.
    param_grads : bool
        Also compute the gradients of the knots and coefficients (otherwise ``None``).
    bad_query_poisons_row : bool
        A non-finite query makes its whole batch row NaN (default); otherwise only its ``dx``, and
        it contributes nothing else.

    Returns
    -------
    dx : (..., n)
        ``sum_c g_ic sum_j f'(x_i - y_j) w_jc``.
    dy : (..., m)
        ``-sum_c w_jc sum_i f'(x_i - y_j) g_ic``.
    dw : (..., m, c)
        ``sum_i f(x_i - y_j) g_i``.
    dknots, dcoeffs : (..., M) or None
        ``-coeffs[m] sum_i g_i . sum_j H(x_i - y_j - knots[m]) w_j`` and
        ``sum_i g_i . sum_j ReLU(x_i - y_j - knots[m]) w_j``, per batch row (sum them over rows
        that share a knot).

    All float64 (torch tensors when any input is one), with the right derivative
    ``f'(r) = slope + sum_m coeffs[m] [r >= knots[m]]`` at kinks. Any non-finite value of
    ``y, w, g`` in a batch row makes every gradient of that row NaN (of ``x`` too, see
    ``bad_query_poisons_row``).

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern.engines.sweep import _host as sweep
    >>> from slicedkern.kernels import Profile
    >>> x, y, w, g = np.array([[1.0]]), np.array([[0.0]]), np.ones((1, 1, 1)), np.ones((1, 1, 1))
    >>> dx, dy, dw, dknots, dcoeffs = sweep.kernel_sum_vjp(x, y, w, Profile((0.0,), (1.0,)), g)
    >>> float(dx[0, 0]), float(dy[0, 0]), float(dw[0, 0, 0]), float(dknots[0, 0]), float(dcoeffs[0, 0])
    (1.0, -1.0, 1.0, -1.0, 1.0)
    """
    (x, y, w), tdt, batch = checked(x, y, w, ("x", "y", "w"))
    g, tg = to_numpy(g, "g")
    tdt.append(tg)
    if g.shape != x.shape + w.shape[-1:]:
        raise ValueError(f"expected x (..., n), y (..., m), w (..., m, c), g (..., n, c), got shapes "
                         f"{x.shape}, {y.shape}, {w.shape}, {g.shape}")
    common_float([x, y, w, g], ["x", "y", "w", "g"])
    n, m, c = x.shape[-1], y.shape[-1], w.shape[-1]
    bsz = int(np.prod(batch, dtype=np.int64))
    rows_, n_user = profile_rows(profile, batch, bsz)
    if n == 0 or m == 0 or c == 0 or bsz == 0:
        shapes = (batch + (n,), batch + (m,), batch + (m, c)) + ((batch + (n_user,),) * 2 if param_grads else ())
        zeros = [wrap(np.zeros(s), tdt) for s in shapes]
        return tuple(zeros) if param_grads else (*zeros, None, None)
    scores = (rows(x, bsz, (n,), F64), rows(y, bsz, (m,), F64), NO_MASK, False)
    options = BackwardOptions(center=False, normalizer=NO_NORMALIZER, zero_knot=0, eps=0.0, n_user_knots=n_user,
                              want_coeffs=bool(param_grads), query_poisons_row=bool(bad_query_poisons_row),
                              strict=strict_rows(profile.strict_knots, rows_[0].shape[1]))
    tensors = (rows(w, bsz, (m, c), F64), rows(g, bsz, (n, c), F64), dummy(F64))
    dx, dy, dw, dkn, dco, bad = _backward(scores, rows_, options, tensors, (bsz, n, m, c))
    dkn, dco = dkn[:, :n_user], dco[:, :n_user]
    if bad.any():
        for arr in (dx, dy, dw, dkn, dco):
            arr[bad] = np.nan
    grads = [wrap(np.ascontiguousarray(a).reshape(batch + a.shape[1:]), tdt) for a in (dx, dy, dw, dkn, dco)]
    return tuple(grads) if param_grads else (*grads[:3], None, None)


def attention_vjp(inputs: Inputs, form: Form, g: Array, out: Array | None, residuals: tuple = (), *,
                  param_grads: bool = True) -> tuple[Any, ...]:
    """Vector-Jacobian product of :func:`attention` with cotangent ``g``, by one fused backward sweep.

    Parameters
    ----------
    inputs, form
        As in the forward call (:func:`attention`); the profile's ``strict_knots`` as in
        :func:`kernel_sum_vjp`.
    g : array, shape (..., Lq, Dv)
        The cotangent of the output.
    out : array, shape (..., Lq, Dv), or None
        The forward output (its dot with ``g`` is the normaliser's cotangent); needed only for the
        "abs" and "relu" normalisers.
    residuals : tuple of arrays, optional
        What the forward call (:func:`attention` with ``keep=True``, on the same arguments)
        returned besides the output; the backward then reuses its sort and per-query terms.
    param_grads : bool
        Also compute the gradients of the knots and coefficients (otherwise ``None``).

    Returns
    -------
    dq : (..., Lq)
    dk : (..., Lk)
        In the scores' dtype (float32 or float64; half precision where both scores are).
    dv : (..., Lk, Dv)
        In the values' dtype.
    dknots, dcoeffs : (..., M) float64, or None
        Per batch row, aligned with ``knots`` / ``coeffs`` (sum them over rows that share one); a
        hat's bandwidth gradient follows by the chain rule through its knots ``+-b`` and
        coefficients ``1/b, -2/b, 1/b``.

    With ``gnum_i = g_i / D_i`` and ``R_i = sum_valid f(q_i - k_j)``: the numerator pulls back as a
    kernel sum, the centring adds ``-mu . gnum_i`` as the cotangent of ``R_i`` and ``-sum_i R_i gnum_i
    / n_valid`` to every valid ``dv_j``, and the normaliser adds ``-(g_i . out_i) / D_i`` as the
    cotangent of ``D_i`` (zero where ``eps`` clamped it). See the module docstring for the NaN policy
    and the tie rule.

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern.engines.sweep import _host as sweep
    >>> from slicedkern._spec import Normalizer
    >>> from slicedkern.engines._vjp import Form, Inputs
    >>> from slicedkern.kernels import Profile
    >>> q, k, v = np.array([[1.0]]), np.array([[0.0, 2.0]]), np.array([[[1.0], [3.0]]])
    >>> relu = Form(Profile((0.0,), (1.0,)), Normalizer("count"), center=False)
    >>> dq, dk, dv, _, _ = sweep.attention_vjp(Inputs(q, k, v, None), relu, np.ones((1, 1, 1)), None)
    >>> dq, dk, dv[..., 0]           # out = ReLU(q - k0) v0 / 2
    (array([[0.5]]), array([[-0.5, -0. ]]), array([[0.5, 0. ]]))
    """
    (q, k, v, key_mask), (profile, normalizer, center) = inputs, form
    code = normalizer_code(normalizer)
    (q, k, v), tdt, batch = checked(q, k, v, ("q", "k", "v"))
    g, tg = to_numpy(g, "g")
    lq, lk, dv_cols = q.shape[-1], k.shape[-1], v.shape[-1]
    if g.shape != batch + (lq, dv_cols):
        raise ValueError(f"argument 'g' must have shape {batch + (lq, dv_cols)} (..., Lq, Dv), got {g.shape}")
    needs_out = normalizer.summed
    tout = None
    if needs_out:
        if out is None:
            raise ValueError(f"argument 'out' (the forward output) is needed for normalizer {normalizer.name!r}")
        out, tout = to_numpy(out, "out")
        if out.shape != g.shape:
            raise ValueError(f"argument 'out' must have shape {g.shape} like 'g', got {out.shape}")
    score_dt = common_float([q, k], ["q", "k"])
    dt = common_float([v, g] + ([out] if needs_out else []), ["v", "g"] + (["out"] if needs_out else []))
    score_out_dt, value_out_dt = result_dtype([q, k], score_dt), result_dtype([v], dt)
    bsz = int(np.prod(batch, dtype=np.int64))
    rows_, n_user = profile_rows(profile, batch, bsz)
    t_scores, t_values = [tdt[0], tdt[1]], [tdt[2], tg] + ([tout] if needs_out else [])
    all_t = tdt + [tg, tout]
    if lq == 0 or lk == 0 or dv_cols == 0 or bsz == 0:
        results = [wrap(np.zeros(batch + (lq,), score_out_dt), t_scores, narrow=True),
                   wrap(np.zeros(batch + (lk,), score_out_dt), t_scores, narrow=True),
                   wrap(np.zeros(batch + (lk, dv_cols), value_out_dt), t_values, narrow=True)]
        params = [wrap(np.zeros(batch + (n_user,)), all_t) for _ in range(2)] if param_grads else [None, None]
        return (*results, *params)
    mask, has_mask = mask_rows(key_mask, k.shape, bsz)
    rows_, zero_knot = with_zero_knot(rows_, normalizer)
    scores = (rows(q, bsz, (lq,), F64), rows(k, bsz, (lk,), F64), mask, has_mask)
    options = BackwardOptions(center=bool(center), normalizer=code, zero_knot=zero_knot, eps=float(normalizer.eps),
                              n_user_knots=n_user, want_coeffs=bool(param_grads), query_poisons_row=False,
                              strict=strict_rows(profile.strict_knots, rows_[0].shape[1]))
    tensors = (rows(v, bsz, (lk, dv_cols), dt), rows(g, bsz, (lq, dv_cols), dt),
               rows(out, bsz, (lq, dv_cols), dt) if needs_out else dummy(dt))
    kept = [to_numpy(a, "residuals")[0] for a in residuals] if residuals else None
    dq, dk, dv, dkn, dco, bad = _backward(scores, rows_, options, tensors, (bsz, lq, lk, dv_cols), kept)
    dkn, dco = dkn[:, :n_user], dco[:, :n_user]
    if bad.any():
        for arr in (dq, dk, dv, dkn, dco):
            arr[bad] = np.nan
    dq = dq.astype(score_out_dt, copy=False).reshape(batch + (lq,))
    dk = dk.astype(score_out_dt, copy=False).reshape(batch + (lk,))
    dv = dv.reshape(batch + (lk, dv_cols))
    if dv.dtype != value_out_dt:
        dv = dv.astype(value_out_dt)
    results = [wrap(dq, t_scores, narrow=True), wrap(dk, t_scores, narrow=True),
               wrap(dv, t_values, narrow=True)]
    if not param_grads:
        return (*results, None, None)
    return (*results, *(wrap(np.ascontiguousarray(a).reshape(batch + (n_user,)), all_t) for a in (dkn, dco)))


def warmup() -> bool:
    """Compile (or load from the on-disk cache) every kernel for float32 and float64 values.

    Returns
    -------
    bool
        ``False`` where numba is missing (nothing to do), else ``True``.

    Examples
    --------
    >>> from slicedkern.engines.sweep import _host as sweep
    >>> sweep.warmup() == sweep.AVAILABLE
    True
    """
    rng = np.random.default_rng(0)
    relu = Profile((0.0,), (1.0,))
    form = Form(relu, Normalizer("abs"), center=True)
    for dt in (np.float32, np.float64):
        x, y = rng.standard_normal((1, 3)).astype(dt), rng.standard_normal((1, 4)).astype(dt)
        w, g = rng.standard_normal((1, 4, 2)).astype(dt), rng.standard_normal((1, 3, 2)).astype(dt)
        inputs = Inputs(x, y, w, None)
        kernel_sum(x, y, w, relu)
        out = attention(inputs, form)
        attention(inputs._replace(key_mask=np.ones((1, 4), bool)), form)
        kernel_sum_vjp(x, y, w, relu, g)
        attention_vjp(inputs, form, g, out)
        out, _, relu_count, den = causal_attention(inputs, form)
        causal_attention_vjp(inputs, form, g, out, relu_count, den)
        causal_profile_vjp(x, y, w, relu, g)
    return True
