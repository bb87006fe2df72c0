"""The fused CPU **sweep** engine: host bridge (NumPy arrays and CPU torch tensors in and out).

Optional: it needs numba. This module imports without it; :data:`AVAILABLE` is then ``False``
and the functions raise ``RuntimeError``. The compiled code is in :mod:`._kernels` (imported only
where numba is); this module converts inputs, checks arguments, allocates nothing of size
``n x c`` but the results, and applies the NaN-row policy.

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
   pointer per knot advancing through the sorted queries. One pass per row yields ``dq``, ``dk``,
   ``dv`` and the knot / coefficient gradients together (no second sort, no (n, D) temporary);
   a short preparation per row computes the per-query normaliser, centring and quotient-rule
   factors first.

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

from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np

try:
    import numba
except ImportError:  # numba is optional
    numba = None
    _kernels = None
else:
    from . import _kernels

__all__ = ["AVAILABLE", "kernel_sum", "attention", "kernel_sum_vjp", "attention_vjp", "warmup"]

#: Whether the engine can run here (numba importable).
AVAILABLE = numba is not None

#: Normaliser names of :func:`attention` and :func:`attention_vjp`.
NORMALIZERS = (None, "abs", "relu", "count")

Array = Any          # a NumPy array or a CPU torch tensor
Param = Union[float, Sequence[float], Array]

# Column chunks are at least this wide (narrower ones lose the vectorised inner loops).
_MIN_CHUNK = 16
# Below this much work (batch rows x (queries + keys) x columns) a call runs serially on the
# calling thread: measured on 2 cores, 8 rows of L = 256, D = 64 take ~0.2 ms serially, about what
# waking the thread pool costs on a busy machine (see scripts/sweep_backward_speed.py --tiny).
_PARALLEL_MIN_WORK = 1 << 18

_F64 = np.dtype(np.float64)


def _unavailable() -> None:
    raise RuntimeError("the sweep engine needs numba, which is not installed (pip install numba)")


# ------------------------------------------------------------------------------ host conversion
def _to_numpy(a, name):
    """(NumPy array, torch dtype or None): a NumPy array, or a zero-copy view of a CPU torch tensor.

    Non-contiguous tensors are made contiguous first; half-precision tensors are widened to float32.
    """
    if type(a).__module__.startswith("torch"):
        import torch
        if a.device.type != "cpu":
            raise TypeError(f"argument {name!r}: the sweep engine serves CPU tensors, got device {a.device}")
        tdtype = a.dtype
        a = a.detach()
        if a.dtype in (torch.float16, torch.bfloat16):
            a = a.float()
        return a.contiguous().numpy(), tdtype
    return np.asarray(a), None


def _wrap(out, tdtypes, *, narrow=False):
    """Back to torch when any input was a tensor (``narrow``: in the inputs' half dtype, if any)."""
    tdtypes = [t for t in tdtypes if t is not None]
    if not tdtypes:
        return out
    import torch
    out = torch.from_numpy(out)
    if narrow:
        dt = tdtypes[0]
        for t in tdtypes[1:]:
            dt = torch.promote_types(dt, t)
        if dt in (torch.float16, torch.bfloat16):
            out = out.to(dt)
    return out


def _common_float(arrays, names):
    """The common work dtype (float32 or float64) of floating arrays; float16 computes in float32."""
    for a, nm in zip(arrays, names):
        if a.dtype.kind != "f":
            raise TypeError(f"argument {nm!r} must have a real floating dtype, got {a.dtype} "
                            f"with shape {a.shape}")
    dt = np.result_type(*[a.dtype for a in arrays])
    return np.dtype(np.float64) if dt == np.float64 else np.dtype(np.float32)


def _result_dtype(arrays, work):
    """The dtype results are returned in: half precision when every input is, else ``work``."""
    dt = np.result_type(*[a.dtype for a in arrays])
    return dt if dt.itemsize < 4 else work


def _ro(a):
    """A read-only C-contiguous view (or copy): one compiled signature whatever the caller's flags."""
    a = np.ascontiguousarray(a).view()
    a.flags.writeable = False
    return a


def _rows(a, bsz, core, dtype):
    """Flatten the batch dims to one row axis: read-only, C-contiguous, in ``dtype``."""
    return _ro(a.reshape((bsz,) + tuple(core)).astype(dtype, copy=False))


def _per_row(value, batch, bsz, name):
    """A scalar or batch-shaped parameter as a read-only float64 (B,) array."""
    if isinstance(value, (int, float)):
        return _ro(np.full(bsz, float(value)))
    arr = np.asarray(_to_numpy(value, name)[0], dtype=np.float64)
    try:
        arr = np.broadcast_to(arr, batch)
    except ValueError:
        raise ValueError(f"argument {name!r} of shape {arr.shape} does not broadcast to the batch "
                         f"shape {batch}") from None
    return _ro(arr.reshape(bsz))


def _per_row_knots(value, batch, bsz, name):
    """A (M,) or (..., M) parameter as a read-only float64 (B, M) array."""
    if isinstance(value, (tuple, list)) and all(isinstance(v, (int, float)) for v in value):
        arr = np.asarray(value, dtype=np.float64)
    else:
        arr = np.asarray(_to_numpy(value, name)[0], dtype=np.float64)
    if arr.ndim == 0:
        arr = arr[None]
    try:
        arr = np.broadcast_to(arr, tuple(batch) + (arr.shape[-1],))
    except ValueError:
        raise ValueError(f"argument {name!r} of shape {arr.shape} does not broadcast to the batch "
                         f"shape {batch} + (M,)") from None
    return _ro(arr.reshape(bsz, arr.shape[-1]))


def _profile(knots, coeffs, slope, intercept, batch, bsz):
    """``(knots (B, M'), coeffs (B, M'), slope (B,), intercept (B,))`` and the user's ``M``.

    A profile without knots gets one idle knot (zero coefficient), which keeps the loops uniform.
    """
    kn = _per_row_knots(knots, batch, bsz, "knots")
    co = _per_row_knots(coeffs, batch, bsz, "coeffs")
    if kn.shape[1] != co.shape[1]:
        raise ValueError(f"arguments 'knots' and 'coeffs' must have the same length M, got "
                         f"{kn.shape[1]} and {co.shape[1]}")
    if not np.all(np.isfinite(kn)):
        raise ValueError("argument 'knots' must be finite")
    n_user = kn.shape[1]
    if n_user == 0:
        kn, co = _ro(np.zeros((bsz, 1))), _ro(np.zeros((bsz, 1)))
    return (kn, co, _per_row(slope, batch, bsz, "slope"), _per_row(intercept, batch, bsz, "intercept")), n_user


def _with_zero_knot(profile, normalizer):
    """The profile and the index of a knot at 0 in every row (the "abs"/"relu" normaliser's kink),
    appended with a zero coefficient where there is none."""
    kn, co, sl, ic = profile
    if normalizer not in ("abs", "relu"):
        return profile, 0
    zero_cols = np.nonzero(np.all(kn == 0.0, axis=0))[0]
    if zero_cols.size:
        return profile, int(zero_cols[0])
    bsz = kn.shape[0]
    kn = _ro(np.concatenate([kn, np.zeros((bsz, 1))], axis=1))
    co = _ro(np.concatenate([co, np.zeros((bsz, 1))], axis=1))
    return (kn, co, sl, ic), kn.shape[1] - 1


def _chunks(bsz, ncols):
    """(number of chunks, chunk width): split columns only when rows alone leave threads idle."""
    threads = numba.get_num_threads() if AVAILABLE else 1
    if ncols <= _MIN_CHUNK or bsz == 0 or bsz % threads == 0 or bsz >= 4 * threads:
        return 1, max(ncols, 1)
    want = -(-4 * threads // bsz)
    nch = max(1, min(want, ncols // _MIN_CHUNK))
    width = -(-ncols // nch)
    width = -(-width // _MIN_CHUNK) * _MIN_CHUNK
    nch = -(-ncols // width)
    return nch, width


def _schedule(bsz, n, m, ncols):
    """``(n_chunks, chunk_width, n_workers)``: one worker (the calling thread) for small work."""
    nch, width = _chunks(bsz, ncols)
    threads = numba.get_num_threads()
    if threads == 1 or bsz * (n + m) * max(ncols, 1) < _PARALLEL_MIN_WORK:
        return nch, width, 1
    return nch, width, min(threads, bsz * nch)


def _checked(x, y, w, names):
    """NumPy views of ``x`` (..., n), ``y`` (..., m), ``w`` (..., m, c), their torch dtypes, the batch.

    ``names`` name the three arguments in the errors; leading (batch) shapes must be equal.
    """
    (x, tx), (y, ty), (w, tw) = (_to_numpy(a, nm) for a, nm in zip((x, y, w), names))
    nx, ny, nw = names
    if x.ndim < 1 or y.ndim < 1 or w.ndim != y.ndim + 1:
        raise ValueError(f"expected {nx} (..., n), {ny} (..., m), {nw} (..., m, c), got shapes {x.shape}, "
                         f"{y.shape}, {w.shape}")
    batch = x.shape[:-1]
    if y.shape[:-1] != batch or w.shape[:-2] != batch or w.shape[-2] != y.shape[-1]:
        raise ValueError(f"shapes {nx} {x.shape}, {ny} {y.shape}, {nw} {w.shape} do not match (batch dims "
                         f"must be equal, {nw} must have m = {y.shape[-1]} rows)")
    return (x, y, w), [tx, ty, tw], batch


def _mask_rows(key_mask, shape, bsz):
    """``(mask (B, m) read-only bool, has_mask)`` for the kernels."""
    if key_mask is None:
        return _NO_MASK, False
    mask = _to_numpy(key_mask, "key_mask")[0]
    if mask.dtype != np.bool_ or mask.shape != shape:
        raise ValueError(f"argument 'key_mask' must be a boolean array of shape {shape}, got "
                         f"{mask.dtype} {mask.shape}")
    return _ro(mask.reshape(bsz, shape[-1])), True


def _normalizer_code(normalizer):
    if normalizer not in NORMALIZERS:
        raise ValueError(f"argument 'normalizer' must be one of {NORMALIZERS}, got {normalizer!r}")
    return _kernels.NORMALIZER_CODES[normalizer]


def _bad_rows(bad, n_chunks):
    """(B,) rows any of whose tasks reported a bad value."""
    return bad.reshape(-1, n_chunks).any(axis=1)


def _summed(parts):
    """The sum over the leading (chunk) axis of per-chunk partial results."""
    return parts[0] if parts.shape[0] == 1 else parts.sum(axis=0)


_NO_MASK = _ro(np.ones((1, 1), np.bool_))


# ---------------------------------------------------------------------------------------- forward
def kernel_sum(x: Array, y: Array, w: Array, knots: Param, coeffs: Param, slope: Param = 0.0,
               intercept: Param = 0.0) -> Array:
    """``S[..., i, :] = sum_j f(x_i - y_j) w[..., j, :]`` by one fused sweep per batch row.

    Parameters
    ----------
    x : array, shape (..., n)
    y : array, shape (..., m)
    w : array, shape (..., m, c)
        NumPy arrays or CPU torch tensors, real floating, with equal (already broadcast) leading dims.
    knots, coeffs : sequence or array, shape (M,) or (..., M)
        ``f(r) = intercept + slope r + sum_m coeffs[m] ReLU(r - knots[m])``; per-row arrays allowed.
    slope, intercept : float or array, shape (...)

    Returns
    -------
    array, shape (..., n, c), float64 (a torch tensor when any input is one).

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern.engines import sweep
    >>> x, y, w = np.array([[0.0, 1.0]]), np.array([[0.5]]), np.ones((1, 1, 1))
    >>> sweep.kernel_sum(x, y, w, (0.0,), (1.0,))[..., 0]      # ReLU(x - 0.5)
    array([[0. , 0.5]])
    """
    if not AVAILABLE:
        _unavailable()
    (x, y, w), tdt, batch = _checked(x, y, w, ("x", "y", "w"))
    _common_float([x, y, w], ["x", "y", "w"])
    n, m, c = x.shape[-1], y.shape[-1], w.shape[-1]
    if n == 0 or m == 0 or c == 0 or 0 in batch:
        return _wrap(np.zeros(batch + (n, c), np.float64), tdt)
    bsz = int(np.prod(batch, dtype=np.int64))
    profile, _ = _profile(knots, coeffs, slope, intercept, batch, bsz)
    schedule = _schedule(bsz, n, m, c)
    # kernel sums run in float64 throughout (one compiled signature; the output is float64 anyway)
    scores = (_rows(x, bsz, (n,), _F64), _rows(y, bsz, (m,), _F64), _NO_MASK, False)
    options = (False, _kernels.NO_NORMALIZER, 0, 0.0)
    out = np.empty((bsz, n, c))
    bad = _kernels.forward_rows(scores, profile, options, _rows(w, bsz, (m, c), _F64), out,
                                _kernels.allocate_sorted(bsz, n, m), schedule)
    bad = _bad_rows(bad, schedule[0])
    if bad.any():
        out[bad] = np.nan
    return _wrap(out.reshape(batch + (n, c)), tdt)


def attention(q: Array, k: Array, v: Array, key_mask: Optional[Array] = None, knots: Param = (0.0,),
              coeffs: Param = (1.0,), center: bool = True, normalizer: Optional[str] = "abs",
              eps: float = 1e-6, slope: Param = 0.0, intercept: Param = 0.0) -> Array:
    """Normalised kernel attention ``out_i = sum_j f(q_i - k_j) (v_j - mu) / D_i`` (docs, "Attention").

    Parameters
    ----------
    q : array, shape (..., Lq)
    k : array, shape (..., Lk)
    v : array, shape (..., Lk, Dv)
    key_mask : bool array, shape (..., Lk), or None
        NumPy arrays or CPU torch tensors with equal (already broadcast) leading dims; masked keys
        (False) take part in nothing.
    knots, coeffs, slope, intercept
        The value profile ``f`` (default ReLU), as in :func:`kernel_sum`.
    center : bool
        Centre the values over the valid keys (``mu`` their mean), folded in as ``N - mu R``.
    normalizer : {"abs", "relu", "count", None}
        ``D_i``: ``sum_valid |q_i - k|`` or ``sum_valid ReLU(q_i - k)`` clamped below by ``eps``,
        ``max(n_valid, 1)``, or 1.
    eps : float

    Returns
    -------
    array, shape (..., Lq, Dv), in the values' dtype (float32 or float64; half-precision values
    give half precision), computed from float64 running sums.

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern.engines import sweep
    >>> q, k, v = np.array([[1.0]]), np.array([[0.0, 2.0]]), np.array([[[1.0], [3.0]]])
    >>> sweep.attention(q, k, v, center=False, normalizer="count")    # ReLU(1 - 0) * 1 / 2
    array([[[0.5]]])
    """
    if not AVAILABLE:
        _unavailable()
    code = _normalizer_code(normalizer)
    (q, k, v), tdt, batch = _checked(q, k, v, ("q", "k", "v"))
    # The values decide the compute dtype: scores are converted to float64 for the sort anyway, so
    # float64 scores (the library casts them) must not widen float32 values.
    _common_float([q, k], ["q", "k"])
    dt = _common_float([v], ["v"])
    out_dt = _result_dtype([v], dt)
    lq, lk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    if lq == 0 or lk == 0 or dv == 0 or 0 in batch:
        return _wrap(np.zeros(batch + (lq, dv), out_dt), tdt, narrow=True)
    bsz = int(np.prod(batch, dtype=np.int64))
    mask, has_mask = _mask_rows(key_mask, k.shape, bsz)
    profile, _ = _profile(knots, coeffs, slope, intercept, batch, bsz)
    profile, zero_knot = _with_zero_knot(profile, normalizer)
    schedule = _schedule(bsz, lq, lk, dv)
    scores = (_rows(q, bsz, (lq,), _F64), _rows(k, bsz, (lk,), _F64), mask, has_mask)
    options = (bool(center), code, zero_knot, float(eps))
    out = np.empty((bsz, lq, dv), dt)
    bad = _kernels.forward_rows(scores, profile, options, _rows(v, bsz, (lk, dv), dt), out,
                                _kernels.allocate_sorted(bsz, lq, lk), schedule)
    bad = _bad_rows(bad, schedule[0])
    if bad.any():
        out[bad] = np.nan
    out = out.reshape(batch + (lq, dv))
    if out.dtype != out_dt:
        out = out.astype(out_dt)
    return _wrap(out, tdt, narrow=True)


# --------------------------------------------------------------------------------------- backward
def _backward(scores, profile, options, tensors, shapes):
    """Run the fused backward; ``(dq, dk, dv, dknots, dcoeffs, bad rows)`` with rows flattened."""
    bsz, n, m, c = shapes
    nch, width, workers = _schedule(bsz, n, m, c)
    n_knots = profile[0].shape[1]
    grads = (np.zeros((nch, bsz, n)), np.empty((nch, bsz, m)), np.empty((bsz, m, c), tensors[0].dtype),
             np.empty((nch, bsz, n_knots)), np.empty((nch, bsz, n_knots)))
    terms = (np.zeros((bsz, n)), np.zeros((bsz, n)), np.zeros((bsz, n)), np.zeros((bsz, 3, c)),
             np.zeros((bsz, 2)))
    bad = _kernels.backward_rows(scores, profile, options, tensors, grads,
                                 (_kernels.allocate_sorted(bsz, n, m), terms), (nch, width, workers))
    dq, dk, dv, dkn, dco = grads
    return _summed(dq), _summed(dk), dv, _summed(dkn), _summed(dco), _bad_rows(bad, nch)


def kernel_sum_vjp(x: Array, y: Array, w: Array, knots: Param, coeffs: Param, slope: Param,
                   intercept: Param, g: Array, *, param_grads: bool = True) -> Tuple[Any, ...]:
    """Vector-Jacobian product of :func:`kernel_sum` with cotangent ``g``, by one fused backward sweep.

    Parameters
    ----------
    x, y, w, knots, coeffs, slope, intercept
        As in :func:`kernel_sum`.
    g : array, shape (..., n, c)
        The cotangent of the output.
    param_grads : bool
        Also compute the gradients of the knots and coefficients (otherwise ``None``).

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
    ``x, y, w, g`` in a batch row makes every gradient of that row NaN.

    Examples
    --------
    >>> import numpy as np
    >>> from slicedkern.engines import sweep
    >>> x, y, w, g = np.array([[1.0]]), np.array([[0.0]]), np.ones((1, 1, 1)), np.ones((1, 1, 1))
    >>> dx, dy, dw, dknots, dcoeffs = sweep.kernel_sum_vjp(x, y, w, (0.0,), (1.0,), 0.0, 0.0, g)
    >>> float(dx[0, 0]), float(dy[0, 0]), float(dw[0, 0, 0]), float(dknots[0, 0]), float(dcoeffs[0, 0])
    (1.0, -1.0, 1.0, -1.0, 1.0)
    """
    if not AVAILABLE:
        _unavailable()
    (x, y, w), tdt, batch = _checked(x, y, w, ("x", "y", "w"))
    g, tg = _to_numpy(g, "g")
    tdt.append(tg)
    if g.shape != x.shape + w.shape[-1:]:
        raise ValueError(f"expected x (..., n), y (..., m), w (..., m, c), g (..., n, c), got shapes "
                         f"{x.shape}, {y.shape}, {w.shape}, {g.shape}")
    _common_float([x, y, w, g], ["x", "y", "w", "g"])
    n, m, c = x.shape[-1], y.shape[-1], w.shape[-1]
    bsz = int(np.prod(batch, dtype=np.int64))
    profile, n_user = _profile(knots, coeffs, slope, intercept, batch, bsz)
    if n == 0 or m == 0 or c == 0 or bsz == 0:
        shapes = (batch + (n,), batch + (m,), batch + (m, c)) + ((batch + (n_user,),) * 2 if param_grads else ())
        zeros = [_wrap(np.zeros(s), tdt) for s in shapes]
        return tuple(zeros) if param_grads else (*zeros, None, None)
    scores = (_rows(x, bsz, (n,), _F64), _rows(y, bsz, (m,), _F64), _NO_MASK, False)
    options = (False, _kernels.NO_NORMALIZER, 0, 0.0, n_user, bool(param_grads), True)
    tensors = (_rows(w, bsz, (m, c), _F64), _rows(g, bsz, (n, c), _F64), _dummy(_F64))
    dx, dy, dw, dkn, dco, bad = _backward(scores, profile, options, tensors, (bsz, n, m, c))
    dkn, dco = dkn[:, :n_user], dco[:, :n_user]
    if bad.any():
        for arr in (dx, dy, dw, dkn, dco):
            arr[bad] = np.nan
    grads = [_wrap(np.ascontiguousarray(a).reshape(batch + a.shape[1:]), tdt) for a in (dx, dy, dw, dkn, dco)]
    return tuple(grads) if param_grads else (*grads[:3], None, None)


def attention_vjp(q: Array, k: Array, v: Array, key_mask: Optional[Array], g: Array, out: Optional[Array],
                  *, knots: Param = (0.0,), coeffs: Param = (1.0,), slope: Param = 0.0, intercept: Param = 0.0,
                  center: bool = True, normalizer: Optional[str] = "abs", eps: float = 1e-6,
                  param_grads: bool = True) -> Tuple[Any, ...]:
    """Vector-Jacobian product of :func:`attention` with cotangent ``g``, by one fused backward sweep.

    Parameters
    ----------
    q, k, v, key_mask, knots, coeffs, slope, intercept, center, normalizer, eps
        As in the forward call (:func:`attention`).
    g : array, shape (..., Lq, Dv)
        The cotangent of the output.
    out : array, shape (..., Lq, Dv), or None
        The forward output (its dot with ``g`` is the normaliser's cotangent); needed only for the
        "abs" and "relu" normalisers.
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
    >>> from slicedkern.engines import sweep
    >>> q, k, v = np.array([[1.0]]), np.array([[0.0, 2.0]]), np.array([[[1.0], [3.0]]])
    >>> g = np.ones((1, 1, 1))
    >>> dq, dk, dv, _, _ = sweep.attention_vjp(q, k, v, None, g, None, center=False, normalizer="count")
    >>> dq, dk, dv[..., 0]           # out = ReLU(q - k0) v0 / 2
    (array([[0.5]]), array([[-0.5, -0. ]]), array([[0.5, 0. ]]))
    """
    if not AVAILABLE:
        _unavailable()
    code = _normalizer_code(normalizer)
    (q, k, v), tdt, batch = _checked(q, k, v, ("q", "k", "v"))
    g, tg = _to_numpy(g, "g")
    lq, lk, dv_cols = q.shape[-1], k.shape[-1], v.shape[-1]
    if g.shape != batch + (lq, dv_cols):
        raise ValueError(f"argument 'g' must have shape {batch + (lq, dv_cols)} (..., Lq, Dv), got {g.shape}")
    needs_out = normalizer in ("abs", "relu")
    tout = None
    if needs_out:
        if out is None:
            raise ValueError(f"argument 'out' (the forward output) is needed for normalizer {normalizer!r}")
        out, tout = _to_numpy(out, "out")
        if out.shape != g.shape:
            raise ValueError(f"argument 'out' must have shape {g.shape} like 'g', got {out.shape}")
    score_dt = _common_float([q, k], ["q", "k"])
    dt = _common_float([v, g] + ([out] if needs_out else []), ["v", "g"] + (["out"] if needs_out else []))
    score_out_dt, value_out_dt = _result_dtype([q, k], score_dt), _result_dtype([v], dt)
    bsz = int(np.prod(batch, dtype=np.int64))
    profile, n_user = _profile(knots, coeffs, slope, intercept, batch, bsz)
    t_scores, t_values = [tdt[0], tdt[1]], [tdt[2], tg] + ([tout] if needs_out else [])
    all_t = tdt + [tg, tout]
    if lq == 0 or lk == 0 or dv_cols == 0 or bsz == 0:
        results = [_wrap(np.zeros(batch + (lq,), score_out_dt), t_scores, narrow=True),
                   _wrap(np.zeros(batch + (lk,), score_out_dt), t_scores, narrow=True),
                   _wrap(np.zeros(batch + (lk, dv_cols), value_out_dt), t_values, narrow=True)]
        params = [_wrap(np.zeros(batch + (n_user,)), all_t) for _ in range(2)] if param_grads else [None, None]
        return (*results, *params)
    mask, has_mask = _mask_rows(key_mask, k.shape, bsz)
    profile, zero_knot = _with_zero_knot(profile, normalizer)
    scores = (_rows(q, bsz, (lq,), _F64), _rows(k, bsz, (lk,), _F64), mask, has_mask)
    options = (bool(center), code, zero_knot, float(eps), n_user, bool(param_grads), False)
    tensors = (_rows(v, bsz, (lk, dv_cols), dt), _rows(g, bsz, (lq, dv_cols), dt),
               _rows(out, bsz, (lq, dv_cols), dt) if needs_out else _dummy(dt))
    dq, dk, dv, dkn, dco, bad = _backward(scores, profile, options, tensors, (bsz, lq, lk, dv_cols))
    dkn, dco = dkn[:, :n_user], dco[:, :n_user]
    if bad.any():
        for arr in (dq, dk, dv, dkn, dco):
            arr[bad] = np.nan
    dq = dq.astype(score_out_dt, copy=False).reshape(batch + (lq,))
    dk = dk.astype(score_out_dt, copy=False).reshape(batch + (lk,))
    dv = dv.reshape(batch + (lk, dv_cols))
    if dv.dtype != value_out_dt:
        dv = dv.astype(value_out_dt)
    results = [_wrap(dq, t_scores, narrow=True), _wrap(dk, t_scores, narrow=True),
               _wrap(dv, t_values, narrow=True)]
    if not param_grads:
        return (*results, None, None)
    return (*results, *(_wrap(np.ascontiguousarray(a).reshape(batch + (n_user,)), all_t) for a in (dkn, dco)))


def _dummy(dt):
    """A placeholder (1, 1, 1) array of ``dt`` for an operand the kernels will not read."""
    return _ro(np.zeros((1, 1, 1), dt))


def warmup() -> bool:
    """Compile (or load from the on-disk cache) every kernel for float32 and float64 values.

    Returns
    -------
    bool
        ``False`` where numba is missing (nothing to do), else ``True``.

    Examples
    --------
    >>> from slicedkern.engines import sweep
    >>> sweep.warmup() == sweep.AVAILABLE
    True
    """
    if not AVAILABLE:
        return False
    rng = np.random.default_rng(0)
    for dt in (np.float32, np.float64):
        x, y = rng.standard_normal((1, 3)).astype(dt), rng.standard_normal((1, 4)).astype(dt)
        w, g = rng.standard_normal((1, 4, 2)).astype(dt), rng.standard_normal((1, 3, 2)).astype(dt)
        kernel_sum(x, y, w, (0.0,), (1.0,))
        out = attention(x, y, w, None)
        attention(x, y, w, np.ones((1, 4), bool))
        kernel_sum_vjp(x, y, w, (0.0,), (1.0,), 0.0, 0.0, g)
        attention_vjp(x, y, w, None, g, out)
    return True
