"""Argument checks of the public ops, written once: every error names the argument.

Checks run before any work; values are checked only where they are known (not under a trace).
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import array_api_compat as compat
import numpy as np

from ._lib.namespace import (
    array_device,
    as_work,
    broadcast_shapes,
    check_floating,
    check_same_device,
    compute_dtypes,
    is_scalar,
    shape_str,
    torch_compiling,
)
from ._spec import NORMALIZERS
from .backends import array_namespace, holds_everywhere, is_array, is_chunked, is_traced, same_library, to_host
from .kernels import PiecewiseLinear, check_hat_count, finite_real, positive_real

__all__ = ["setup", "namespace_of", "need_ndim", "check_kernel", "check_normalize", "check_eps",
           "check_bool", "positive_param", "finite_param", "floating_param", "broadcast_all",
           "check_param_batch", "hat_floats", "hat_param", "not_an_array", "segment_ids_on_host",
           "check_window"]


#: The namespace of every NumPy array, asked once (array_api_compat takes microseconds per array,
#: as long as the small calls' whole sweep).
_NUMPY_NAMESPACE = compat.array_namespace(np.empty(0))


def namespace_of(named_arrays: dict, xp=None, *, required=()):
    """The common namespace of the given arrays, with an error naming each argument.

    ``named_arrays`` maps argument names to arrays (``None`` entries are skipped, except for the
    names in ``required``). Every other entry must be an array: a Python scalar is refused as a list
    is, not broadcast (a ``key_mask=True`` or ``x_weights=1.0`` would otherwise mean something only
    some ops could guess). With an explicit ``xp`` every array must come from that library.
    """
    for name, a in named_arrays.items():
        if (a is None and name in required) or (a is not None and (_python_scalar(a) or not is_array(a))):
            raise TypeError(not_an_array(name, a))
    arrays = {k: a for k, a in named_arrays.items() if a is not None}
    for name, a in arrays.items():
        if isinstance(a, np.ma.MaskedArray):
            raise TypeError(f"argument {name!r} is a NumPy masked array, whose mask slicedkern would "
                            "ignore; pass the data and express the mask with key_mask instead")
    spaces = {}
    for name, a in arrays.items():
        try:
            spaces[name] = _NUMPY_NAMESPACE if type(a) is np.ndarray else array_namespace(a)
        except TypeError as exc:
            raise TypeError(f"argument {name!r} is not an array of a supported library "
                            f"(got {type(a).__name__})") from exc
    if xp is not None:
        for name, space in spaces.items():
            if not same_library(space, xp):
                raise TypeError(f"argument {name!r} ({type(arrays[name]).__module__}."
                                f"{type(arrays[name]).__name__}) does not belong to the namespace "
                                f"xp={getattr(xp, '__name__', xp)!r}; convert it or leave xp=None")
        return xp
    if not arrays:
        raise TypeError("no array argument was given: pass arrays or set xp=")
    first_name, first = next(iter(spaces.items()))
    for name, space in spaces.items():
        if space is not first:
            raise TypeError(f"arguments {first_name!r} ({type(arrays[first_name]).__module__}."
                            f"{type(arrays[first_name]).__name__}) and {name!r} "
                            f"({type(arrays[name]).__module__}.{type(arrays[name]).__name__}) come from "
                            "different array libraries; convert them to one library first")
    return first


def _python_scalar(value) -> bool:
    """A Python number (not a NumPy scalar, which NumPy arithmetic on 0-d arrays returns: an array)."""
    return type(value) in (bool, int, float, complex)


def not_an_array(name: str, value) -> str:
    """The message of an array argument given something else (a Python scalar, a list, ``None``)."""
    hint = (" (a Python scalar is not broadcast: pass an array of the argument's shape)"
            if _python_scalar(value) else "")
    return (f"argument {name!r} must be an array (NumPy, torch, JAX, CuPy or another array-API "
            f"library), got {type(value).__name__}{hint}")


#: The ops that take lazy chunked (Dask) arrays (docs/scaling.rst, "Dask").
CHUNKED_OPS = "sliced_kernel_sum, energy_distance and mmd"


class Setting(NamedTuple):
    """Where and in what an op computes: what :func:`setup` finds of its array arguments."""

    xp: Any          # the arrays' namespace
    device: Any      # their device
    out_dtype: Any   # the result's dtype
    work: Any        # the dtype it computes in


def setup(named: dict, xp, required=(), *, chunked: bool = False) -> Setting:
    """Namespace, device and dtypes of the array arguments (a :class:`Setting`), with errors that
    name them.

    ``required`` names the arguments that must be arrays (the others may be ``None``); ``chunked``
    says whether the op has a plan for lazy chunked (Dask) arrays.
    """
    key = _memo_key(named, xp, required, chunked)
    if key is None:
        return _setup(named, xp, required, chunked)
    found = _SETUPS.get(key)
    if found is None:
        found = _setup(named, xp, required, chunked)     # raises (and keeps nothing) on bad arguments
        if len(_SETUPS) >= 256:
            _SETUPS.clear()
        _SETUPS[key] = found
    return found


#: :func:`setup`'s answers for NumPy arrays and plain torch tensors, by :func:`_memo_key`.
_SETUPS: dict = {}


def _memo_key(named, xp, required, chunked):
    """What :func:`setup`'s answer depends on when every argument is a NumPy array or a plain torch
    tensor (of at least one dimension: no value-based promotion), a Python scalar or ``None``: the
    types, dtypes and (torch) devices, not the values. ``None`` for any other argument (a tensor
    subclass, as tracers and parameters are), a tensor inside ``torch.compile``, or a given ``xp``:
    no memo. Small calls in a loop
    (decoding) pay microseconds for the answer, not the tens of a full check."""
    if xp is not None:
        return None
    parts = []
    for name, a in named.items():
        kind = type(a)
        if kind is np.ndarray and a.ndim:
            parts.append((name, a.dtype))
        elif kind.__name__ == "Tensor" and kind.__module__ == "torch" and a.ndim:
            if torch_compiling():
                return None      # no memo read for dynamo to guard on (namespace.torch_compiling)
            parts.append((name, "torch", a.dtype, a.device))
        elif a is None or kind in (int, float, bool):
            parts.append((name, kind))
        else:
            return None
    return tuple(required), chunked, tuple(parts)


def _setup(named, xp, required, chunked):
    xp = namespace_of(named, xp, required=required)
    if not chunked and is_chunked(xp):
        name = next(k for k, a in named.items() if a is not None and not is_scalar(a))
        raise TypeError(f"argument {name!r} is a Dask array: of slicedkern's ops only {CHUNKED_OPS} take Dask "
                        "arrays; compute it first (np.asarray(a)) to use this op in memory")
    device = check_same_device(named)
    floats = {k: a for k, a in named.items() if k != "key_mask"}
    check_floating(xp, floats)
    out_dtype, work = compute_dtypes(xp, [a for a in floats.values() if a is not None], device)
    return Setting(xp, device, out_dtype, work)


def need_ndim(a, name, ndim, what):
    if a.ndim < ndim:
        raise ValueError(f"argument {name!r} must have shape {what}, got {shape_str(a)}")


def check_kernel(kernel):
    if not isinstance(kernel, PiecewiseLinear):
        raise TypeError("argument 'kernel' must be a slicedkern.kernels.PiecewiseLinear (ReLU(), Hat(b), "
                        f"...), got {type(kernel).__name__}")


def check_normalize(normalize):
    if normalize not in NORMALIZERS:
        raise ValueError(f"argument 'normalize' must be one of {tuple(NORMALIZERS)}, got {normalize!r}")


def check_eps(eps):
    # eps = 0 would make out = num / 0 wherever every valid key ties with the query (inf, or NaN for
    # 0 / 0); a positive floor keeps the formula and a finite answer (docs/mathematics.rst, "Attention")
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not (0 < eps < float("inf")):
        raise ValueError(f"argument 'eps' must be a positive finite number (the normaliser's floor), "
                         f"got {eps!r}")
    return float(eps)


def check_bool(value, name):
    """A Python or NumPy boolean, else ``TypeError`` (a string such as "no" would be truthy)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"argument {name!r} must be True or False, got {value!r}")
    return bool(value)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def positive_param(xp, value, name, device, work, expected=None):
    """A positive float, or an array of them (values checked unless traced), in the work dtype;
    ``expected`` as in :func:`floating_param`."""
    if _is_number(value):
        return positive_real(value, name)
    value = floating_param(xp, value, name, device, work, expected)
    if holds_everywhere(xp, value, lambda ns, a: (a > 0) & ns.isfinite(a)) is False:
        raise ValueError(f"argument {name!r} must be positive and finite everywhere")
    return value


def finite_param(xp, value, name, device, work, expected=None):
    """A finite float, or an array of them (values checked unless traced), in the work dtype: the
    rule of :func:`slicedkern.kernels.finite_real` for a parameter given as an array."""
    if _is_number(value):
        return finite_real(value, name)
    value = floating_param(xp, value, name, device, work, expected)
    if holds_everywhere(xp, value, lambda ns, a: ns.isfinite(a)) is False:
        raise ValueError(f"argument {name!r} must be finite everywhere")
    return value


def hat_floats(value, name: str, *, positive: bool, single: bool) -> tuple[float, ...] | None:
    """Hat parameters given as Python numbers, checked: a tuple of floats, or ``None`` for anything
    else (an array, checked by :func:`hat_param`).

    ``single`` (``hat_attention``'s ``bandwidth``) takes one number; a mixture's parameters take a
    sequence of them, one per hat (a bare number would leave the number of hats to a guess).
    """
    check = positive_real if positive else finite_real
    if single:
        if isinstance(value, (list, tuple)):
            raise TypeError(f"argument {name!r} must be a number or an array (one per batch row or head), got "
                            f"{type(value).__name__}; a mixture of several hats is hat_mixture_attention "
                            "(bandwidths=, weights=)")
        return (check(value, name),) if _is_number(value) else None
    if _is_number(value):
        raise TypeError(f"argument {name!r} must be a sequence of numbers or an array of shape (..., K), one "
                        f"entry per hat, got {type(value).__name__}")
    if not isinstance(value, (list, tuple)):
        return None
    for entry in value:
        if not _is_number(entry):
            raise TypeError(f"argument {name!r} must hold numbers, got {type(entry).__name__}")
    check_hat_count(len(value), name)
    return tuple(check(entry, name) for entry in value)


def hat_param(xp, value, name: str, device, work, batch, *, positive: bool, single: bool):
    """Hat parameters: ``(floats, array)``: a tuple of floats (:func:`hat_floats`), or ``None`` and
    a work-dtype array, of batch shape ``(...)`` when ``single``, else ``(..., K)``, ``K >= 1``."""
    floats = hat_floats(value, name, positive=positive, single=single)
    if floats is not None:
        return floats, None
    expected = "a number or an array" if single else "a sequence of numbers or an array of shape (..., K)"
    arr = (positive_param if positive else finite_param)(xp, value, name, device, work, expected)
    if not single:
        if arr.ndim == 0:
            raise ValueError(f"argument {name!r} must have a last axis with one entry per hat, got "
                             f"{shape_str(value)}")
        check_hat_count(arr.shape[-1], name)
    check_param_batch(arr if single else arr[..., 0], name, batch)
    return None, arr


def floating_param(xp, value, name, device, work, expected=None):
    """An array parameter checked against the namespace and device of the other arrays, and its
    dtype; ``expected`` says what the argument takes, for the error of a non-array."""
    expected = expected or "a number, a sequence of numbers or an array"
    try:
        space = array_namespace(value)
    except TypeError:
        raise TypeError(f"argument {name!r} must be {expected}, got {type(value).__name__}") from None
    if not same_library(space, xp):
        raise TypeError(f"argument {name!r} comes from a different array library than the other arrays")
    if array_device(value) is not None and device is not None and array_device(value) != device:
        raise TypeError(f"argument {name!r} is on device {array_device(value)}, the other arrays on "
                        f"{device}")
    if not xp.isdtype(value.dtype, "real floating"):
        raise TypeError(f"argument {name!r} must have a real floating dtype, got {shape_str(value)}")
    return as_work(xp, value, work)


def broadcast_all(xp, arrays: dict, cores: dict, names):
    """Broadcast the leading (batch) dims of the named arrays; ``cores`` gives each one's core rank."""
    shapes = [tuple(a.shape[:a.ndim - cores[k]]) for k, a in arrays.items()]
    batch = broadcast_shapes(*shapes, names=names)
    out = {}
    for (k, a), lead in zip(arrays.items(), shapes):
        # an array that has the batch shape already is used as it is (broadcast_to makes a view)
        out[k] = a if lead == batch else xp.broadcast_to(a, batch + tuple(a.shape[a.ndim - cores[k]:]))
    return batch, out


def check_param_batch(value, name, batch):
    """``ValueError`` unless an array parameter broadcasts to the batch shape of the scores."""
    if isinstance(value, float):
        return
    _check_lead(tuple(value.shape), tuple(value.shape), name, batch)


def _check_lead(lead: tuple, shape: tuple, name: str, batch) -> None:
    """``ValueError`` unless the leading dims ``lead`` of an argument of ``shape`` broadcast to ``batch``."""
    try:
        fits = len(lead) <= len(batch) and broadcast_shapes(lead, batch) == tuple(batch)
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"argument {name!r} of shape {shape} does not broadcast to the batch shape "
                         f"{tuple(batch)} of the scores")




def _one_segment_array(xp, ids, name: str, length: int, what: str, batch) -> np.ndarray:
    """One segment-id array checked and read to the host, broadcast to ``batch + (length,)``, as
    (rows, length) int64."""
    if not is_array(ids):
        raise TypeError(f"argument {name!r} must be an integer array of shape {what}, got "
                        f"{type(ids).__name__}")
    if not same_library(array_namespace(ids), xp):
        raise TypeError(f"argument {name!r} comes from a different array library than the other arrays")
    if ids.dtype == xp.bool or not xp.isdtype(ids.dtype, "integral"):
        raise TypeError(f"argument {name!r} must have an integer dtype, got {shape_str(ids)}")
    if ids.ndim < 1 or ids.shape[-1] != length:
        raise ValueError(f"argument {name!r} must have shape {what} with {length} entries on its last axis, "
                         f"got {shape_str(ids)}")
    _check_lead(tuple(ids.shape[:-1]), tuple(ids.shape), name, batch)
    if is_traced(ids) or torch_compiling():
        raise ValueError(f"argument {name!r} must be concrete (known when the call is made, not traced): the "
                         "packed layout is computed from its values on the host")
    host = np.asarray(to_host(ids)).astype(np.int64, copy=False)
    # the rows counted, not -1: with no tokens (length 0) NumPy cannot infer them
    rows = int(np.prod(tuple(batch), dtype=np.int64))
    return np.broadcast_to(host, tuple(batch) + (length,)).reshape(rows, length)


def segment_ids_on_host(xp, segment_ids, lq: int, lk: int, batch) -> tuple[np.ndarray, np.ndarray]:
    """``segment_ids`` (one (..., L) integer array for queries and keys, which then must be as many,
    or a pair ``(q_segment_ids, k_segment_ids)``) checked and read to the host: two int64 arrays
    (rows, Lq) and (rows, Lk), the rows those of ``batch``."""
    if isinstance(segment_ids, tuple):
        if len(segment_ids) != 2:
            raise ValueError("argument 'segment_ids' must be one integer array or a pair (q_segment_ids, "
                             f"k_segment_ids), got a sequence of {len(segment_ids)}")
        q_ids, k_ids = segment_ids
        return (_one_segment_array(xp, q_ids, "segment_ids[0]", lq, "(..., Lq)", batch),
                _one_segment_array(xp, k_ids, "segment_ids[1]", lk, "(..., Lk)", batch))
    if lq != lk:
        raise ValueError(f"argument 'segment_ids' as one array needs as many queries as keys, got Lq = {lq} and "
                         f"Lk = {lk}; pass a pair (q_segment_ids, k_segment_ids)")
    ids = _one_segment_array(xp, segment_ids, "segment_ids", lq, "(..., L)", batch)
    return ids, ids


def check_window(window) -> tuple[int, int] | None:
    """``window``: None or a pair of ints ``(left, right)`` (flash-attention's ``window_size``), with
    ``left >= -1`` (``-1``: unbounded) and any ``right`` (``-1``: unbounded; below, keys before the
    aligned one)."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2 or not all(
            isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window):
        raise TypeError(f"argument 'window' must be a pair of ints (left, right), got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < -1:
        raise ValueError(f"argument 'window' must have left >= -1 (-1: unbounded), got left = {left}")
    return left, right
