"""Public functions: validate, pick the namespace and dtypes, then call the backend-neutral core."""

from __future__ import annotations

import numbers

import array_api_compat as compat
import numpy as np

from ._diff import AttentionSpec, KernelSumSpec
from ._dispatch import execute as _execute
from ._namespace import (as_work, broadcast_shapes, check_floating, check_same_device,
                         compute_dtypes, holds_everywhere, namespace_of, shape_str)
from .kernels import HatMixture, PiecewiseLinear, ReLU

__all__ = ["kernel_sum", "relu_attention", "hat_attention", "hat_mixture_attention",
           "kernel_attention"]

_NORMALIZERS = ("abs", "relu", "count", None)


# --------------------------------------------------------------------------- validation helpers
def _setup(named: dict, xp, required=()):
    """Namespace, device and dtypes of the array arguments, with errors that name them.

    ``required`` names the arguments that must be arrays (the others may be ``None``).
    """
    xp = namespace_of(named, xp, required=required)
    device = check_same_device(named)
    floats = {k: a for k, a in named.items() if k != "key_mask"}
    check_floating(xp, floats)
    out_dtype, work = compute_dtypes(xp, [a for a in floats.values() if a is not None], device)
    return xp, device, out_dtype, work


def _need_ndim(a, name, ndim, what):
    if a.ndim < ndim:
        raise ValueError(f"argument {name!r} must have shape {what}, got {shape_str(a)}")


def _check_kernel(kernel):
    if not isinstance(kernel, PiecewiseLinear):
        raise TypeError("argument 'kernel' must be a slicedkern.kernels.PiecewiseLinear (ReLU(), Hat(b), "
                        f"...), got {type(kernel).__name__}")


def _check_normalize(normalize):
    if normalize not in _NORMALIZERS:
        raise ValueError(f"argument 'normalize' must be one of {_NORMALIZERS}, got {normalize!r}")


def _check_eps(eps):
    # eps = 0 would make out = num / 0 wherever every valid key ties with the query (inf, or NaN for
    # 0 / 0); a positive floor keeps the formula and a finite answer (docs/mathematics.rst, "Attention")
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not (0 < eps < float("inf")):
        raise ValueError(f"argument 'eps' must be a positive finite number (the normaliser's floor), "
                         f"got {eps!r}")
    return float(eps)


def _check_bool(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"argument {name!r} must be True or False, got {value!r}")
    return bool(value)


def _positive_param(xp, value, name, device, work):
    """A positive float, or an array of them (values checked unless traced), in the work dtype."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = float(value)
        if not (value > 0 and value != float("inf")):
            raise ValueError(f"argument {name!r} must be positive and finite, got {value}")
        return value
    value = _floating(xp, value, name, device, work)
    if holds_everywhere(xp, value, lambda ns, a: (a > 0) & ns.isfinite(a)) is False:
        raise ValueError(f"argument {name!r} must be positive and finite everywhere")
    return value


def _floating(xp, value, name, device, work, expected="a number, a sequence of numbers or an array"):
    """An array parameter checked against the namespace and device of the other arrays, and its dtype."""
    try:
        space = compat.array_namespace(value)
    except TypeError:
        raise TypeError(f"argument {name!r} must be {expected}, got {type(value).__name__}") from None
    if space is not xp:
        raise TypeError(f"argument {name!r} comes from a different array library than the other arrays")
    if compat.device(value) is not None and device is not None and compat.device(value) != device:
        raise TypeError(f"argument {name!r} is on device {compat.device(value)}, the other arrays on "
                        f"{device}")
    if not xp.isdtype(value.dtype, "real floating"):
        raise TypeError(f"argument {name!r} must have a real floating dtype, got {shape_str(value)}")
    return as_work(xp, value, work)


def _broadcast_all(xp, arrays: dict, cores: dict, names):
    """Broadcast the leading (batch) dims of the named arrays; ``cores`` gives each one's core rank."""
    shapes = [tuple(a.shape[:a.ndim - cores[k]]) for k, a in arrays.items()]
    batch = broadcast_shapes(*shapes, names=names)
    return batch, {k: xp.broadcast_to(a, batch + tuple(a.shape[a.ndim - cores[k]:]))
                   for k, a in arrays.items()}


def _check_param_batch(value, name, batch):
    if isinstance(value, float):
        return
    shape = tuple(value.shape)
    try:
        fits = len(shape) <= len(batch) and broadcast_shapes(shape, batch) == tuple(batch)
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"argument {name!r} of shape {tuple(value.shape)} does not broadcast to the batch "
                         f"shape {tuple(batch)} of the scores")


# ----------------------------------------------------------------------------------- kernel sums
def kernel_sum(x, y, w, kernel, *, xp=None):
    """Kernel sum ``S_i = sum_j f(x_i - y_j) w_j`` by sort-scan, in ``O((n M + m) log m)``.

    Parameters
    ----------
    x : array, shape (..., n)
        Queries.
    y : array, shape (..., m)
        Keys.
    w : array, shape (..., m) or (..., m, c)
        Weights: one scalar per key when ``w.ndim == y.ndim``, ``c`` columns otherwise.
    kernel : slicedkern.kernels.PiecewiseLinear
        The 1-D profile ``f`` (``ReLU()``, ``Abs()``, ``Hat(b)``, ...).
    xp : array namespace, optional
        Inferred from the arrays when omitted.

    Returns
    -------
    array, shape (..., n) or (..., n, c)
        Leading dims are broadcast; namespace, device and (floating) dtype of the inputs.

    Notes
    -----
    Prefix sums and their combination run in float64 where the backend has it. A non-finite query
    gives a NaN row; a non-finite key or weight gives NaN for its whole batch row.

    Examples
    --------
    >>> import numpy as np, slicedkern
    >>> from slicedkern.kernels import ReLU
    >>> x, y, w = np.array([0.0, 2.0]), np.array([0.0, 1.0, 3.0]), np.ones(3)
    >>> slicedkern.kernel_sum(x, y, w, ReLU())
    array([0., 3.])
    """
    xp, device, out_dtype, work = _setup({"x": x, "y": y, "w": w}, xp, required=("x", "y", "w"))
    _check_kernel(kernel)
    _need_ndim(x, "x", 1, "(..., n)")
    _need_ndim(y, "y", 1, "(..., m)")
    if w.ndim not in (y.ndim, y.ndim + 1):
        raise ValueError(f"argument 'w' must have shape (..., m) or (..., m, c) with the rank of 'y' "
                         f"({y.ndim}) or one more, got {shape_str(w)}")
    vector = w.ndim == y.ndim
    if vector:
        w = w[..., None]
    if w.shape[-2] != y.shape[-1]:
        raise ValueError(f"arguments 'y' and 'w' must have the same number of keys m, got {shape_str(y)} "
                         f"and {shape_str(w)}")
    _, arrays = _broadcast_all(xp, {"x": x, "y": y, "w": w}, {"x": 1, "y": 1, "w": 2}, ("x", "y", "w"))
    x, y = (as_work(xp, arrays[k], work) for k in ("x", "y"))
    w = arrays["w"]                  # widened inside the prefix sums, after the gather
    return _execute(xp, KernelSumSpec(kernel), (x, y, w), ("x", "y", "w"), out_dtype,
                    squeeze=vector)


# ------------------------------------------------------------------------------------- attention
def _attention(q, k, v, hats, *, kernel=None, key_mask, center, normalize, eps, xp):
    """Shared validation and dispatch of every attention op.

    ``kernel`` is a fixed profile; otherwise ``hats`` is a builder (see :func:`_hat_spec`) that
    returns the hat part of the spec and its array parameters.
    """
    named = {"q": q, "k": k, "v": v, "key_mask": key_mask}
    xp, device, out_dtype, work = _setup(named, xp, required=("q", "k", "v"))
    _need_ndim(q, "q", 1, "(..., Lq)")
    _need_ndim(k, "k", 1, "(..., Lk)")
    _need_ndim(v, "v", 2, "(..., Lk, Dv)")
    if v.shape[-2] != k.shape[-1]:
        raise ValueError(f"arguments 'k' and 'v' must have the same number of keys Lk, got {shape_str(k)} "
                         f"and {shape_str(v)}")
    arrays, cores = {"q": q, "k": k, "v": v}, {"q": 1, "k": 1, "v": 2}
    if key_mask is not None:
        if key_mask.dtype != xp.bool:
            raise TypeError(f"argument 'key_mask' must be a boolean array, got {shape_str(key_mask)}")
        _need_ndim(key_mask, "key_mask", 1, "(..., Lk)")
        if key_mask.shape[-1] != k.shape[-1]:
            raise ValueError(f"argument 'key_mask' must have Lk = {k.shape[-1]} entries on its last axis, "
                             f"got {shape_str(key_mask)}")
        arrays["key_mask"], cores["key_mask"] = key_mask, 1
    _check_normalize(normalize)
    eps = _check_eps(eps)
    center = _check_bool(center, "center")
    batch, arrays = _broadcast_all(xp, arrays, cores, tuple(arrays))
    hat_fields, params = hats(xp, device, work, batch) if hats is not None else ({}, {})
    fields = {"kernel": kernel, **hat_fields}
    spec = AttentionSpec(center=bool(center), normalize=normalize, eps=eps,
                         has_mask=key_mask is not None, param_layout=tuple(params), **fields)
    q, k = (as_work(xp, arrays[n], work) for n in ("q", "k"))
    v = arrays["v"]                  # widened inside the prefix sums, after the gather
    if v.dtype != out_dtype:
        # values narrower than the scores: the result is in the promoted dtype, so the values are too
        # (an engine that computes in the values' dtype would round the result to it)
        v = xp.astype(v, out_dtype)
    inputs = (q, k, v) + ((arrays["key_mask"],) if key_mask is not None else ()) + tuple(params.values())
    names = ("q", "k", "v") + (("key_mask",) if key_mask is not None else ()) + tuple(params)
    return _execute(xp, spec, inputs, names, out_dtype)


def relu_attention(q, k, v, *, key_mask=None, center=True, normalize="abs", eps=1e-6, xp=None):
    """Sliced ReLU attention (paper eq. 3), ``O(n log n)``.

    ``out_i = sum_j ReLU(q_i - k_j) (v_j - mean(v)) / max(sum_l |q_i - k_l|, eps)``, sums over the keys
    that ``key_mask`` keeps.

    Parameters
    ----------
    q : array, shape (..., Lq)
        One projected score per query token.
    k : array, shape (..., Lk)
        One projected score per key token.
    v : array, shape (..., Lk, Dv)
        Values.
    key_mask : bool array, shape (..., Lk), optional
        True where the key takes part. Masked keys count nowhere: not in the sums, the mean used for
        centring, the normaliser or the count.
    center : bool, default True
        Centre the values over the valid keys (the paper's "centered value parametrization").
    normalize : {"abs", "relu", "count", None}, default "abs"
        Denominator: ``sum_l |q_i - k_l|``, ``sum_l ReLU(q_i - k_l)``, the number of valid keys, or none.
    eps : float, default 1e-6
        Lower clamp of the denominator (``"count"`` clamps at 1).
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
    """
    return _attention(q, k, v, None, kernel=ReLU(), key_mask=key_mask, center=center,
                      normalize=normalize, eps=eps, xp=xp)


def _param_list(xp, value, name, device, work, batch, *, positive, single):
    """Hat parameters: ``(floats, array)``: a tuple of floats, or ``None`` and a work-dtype array.

    ``value`` is a number (``single`` only), a sequence of numbers, or an array: of batch shape
    ``(...)`` when ``single``, else ``(..., K)``.
    """
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and single:
        value = [value]
    if isinstance(value, (list, tuple)):
        out = []
        for entry in value:
            if not isinstance(entry, numbers.Real) or isinstance(entry, bool):
                raise TypeError(f"argument {name!r} must hold numbers, got {type(entry).__name__}")
            out.append(_positive_param(xp, entry, name, device, work) if positive else float(entry))
        return tuple(out), None
    arr = _positive_param(xp, value, name, device, work) if positive else _floating(
        xp, value, name, device, work)
    if not single and arr.ndim == 0:
        raise ValueError(f"argument {name!r} must have a last axis with one entry per hat, got "
                         f"{shape_str(value)}")
    _check_param_batch(arr if single else arr[..., 0], name, batch)
    return None, arr


def _hat_spec(bandwidths, weights, names):
    """Builder of the hat fields of an :class:`AttentionSpec` and its array parameters.

    One hat when ``weights is None``; else a mixture. Float parameters go into the (static) spec,
    array parameters are passed as arrays (differentiable).
    """
    single = weights is None

    def build(xp, device, work, batch):
        alphas, alpha_arr = _param_list(xp, bandwidths, names[0], device, work, batch, positive=True,
                                        single=single)
        if single:
            betas, beta_arr = (1.0,), None
        else:
            betas, beta_arr = _param_list(xp, weights, names[1], device, work, batch, positive=False,
                                          single=False)
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
        return {"alphas": alphas or (), "betas": betas or ()}, params

    return build


def hat_attention(q, k, v, bandwidth=1.0, *, key_mask=None, normalize="count", eps=1e-6, xp=None):
    """Hat ("ReLU-bump") attention (paper eq. 5).

    ``out_i = (1 / n_valid) sum_j max(0, 1 - |q_i - k_j| / b) v_j``.

    Parameters
    ----------
    q : array, shape (..., Lq)
    k : array, shape (..., Lk)
    v : array, shape (..., Lk, Dv)
    bandwidth : float or array, default 1.0
        Positive half-width ``b``; an array broadcasts against the leading dims (one per head, say).
    key_mask : bool array, shape (..., Lk), optional
        True where the key takes part.
    normalize : {"count", "abs", "relu", None}, default "count"
    eps : float, default 1e-6
        Lower clamp of the "abs" / "relu" denominators.
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
    """
    return _attention(q, k, v, _hat_spec(bandwidth, None, ("bandwidth", "weights")),
                      key_mask=key_mask, center=False, normalize=normalize, eps=eps, xp=xp)


def hat_mixture_attention(q, k, v, bandwidths, weights, *, key_mask=None, normalize="count", eps=1e-6,
                          xp=None):
    """Attention with a mixture of hats ``sum_i weights[i] max(0, 1 - |r| / bandwidths[i])``.

    Parameters
    ----------
    q, k, v, key_mask, normalize, eps, xp
        As in :func:`hat_attention`.
    bandwidths : sequence of float or array, shape (..., K)
        Positive bandwidths; an array's leading dims broadcast against the batch (per head).
    weights : sequence of float or array, shape (..., K)
        Mixture weights.

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
    return _attention(q, k, v, _hat_spec(bandwidths, weights, ("bandwidths", "weights")),
                      key_mask=key_mask, center=False, normalize=normalize, eps=eps, xp=xp)


def kernel_attention(q, k, v, kernel, *, key_mask=None, center=False, normalize="count", eps=1e-6,
                     xp=None):
    """Attention with any piecewise-linear profile: ``out_i = sum_j f(q_i - k_j) v_j / normaliser``.

    Parameters
    ----------
    q, k, v, key_mask, eps, xp
        As in :func:`relu_attention`.
    kernel : slicedkern.kernels.PiecewiseLinear
        The profile ``f``.
    center : bool, default False
        Centre the values over the valid keys.
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
    _check_kernel(kernel)
    return _attention(q, k, v, None, kernel=kernel, key_mask=key_mask, center=center,
                      normalize=normalize, eps=eps, xp=xp)
