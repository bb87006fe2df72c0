"""Namespace, dtype and device helpers shared by every module.

Everything here speaks the array API standard through ``array_api_compat``; nothing imports a
framework. Framework checks use ``array_api_compat.is_*_namespace``, which look at modules already
imported by the caller.
"""

from __future__ import annotations

import math

import array_api_compat as compat
import numpy as np

__all__ = [
    "namespace_of",
    "check_same_device",
    "check_floating",
    "compute_dtypes",
    "has_float64",
    "as_work",
    "shape_str",
]


def shape_str(a) -> str:
    return f"shape {tuple(a.shape)} and dtype {a.dtype}"


def namespace_of(named_arrays: dict, xp=None, *, required=()):
    """Return the common namespace of the given arrays, with an error naming each argument.

    ``named_arrays`` maps argument names to arrays (``None`` entries and Python scalars are skipped,
    except for the names in ``required``, which must be arrays). With an explicit ``xp`` every array
    must come from that library.
    """
    for name in required:
        a = named_arrays.get(name)
        if a is None or _is_scalar(a) or not compat.is_array_api_obj(a):
            raise TypeError(f"argument {name!r} must be an array (NumPy, torch, JAX, CuPy or another "
                            f"array-API library), got {type(a).__name__}")
    arrays = {k: a for k, a in named_arrays.items() if a is not None and not _is_scalar(a)}
    for name, a in arrays.items():
        if isinstance(a, np.ma.MaskedArray):
            raise TypeError(f"argument {name!r} is a NumPy masked array, whose mask slicedkern would "
                            "ignore; pass the data and express the mask with key_mask instead")
    spaces = {}
    for name, a in arrays.items():
        try:
            spaces[name] = compat.array_namespace(a)
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


def same_library(a, b) -> bool:
    """Whether two namespaces are the same library (``numpy`` and ``array_api_compat.numpy`` are)."""
    if a is b:
        return True
    checks = (compat.is_numpy_namespace, compat.is_torch_namespace, compat.is_jax_namespace,
              compat.is_cupy_namespace, compat.is_array_api_strict_namespace, compat.is_dask_namespace)
    return any(check(a) and check(b) for check in checks)


def _is_scalar(a) -> bool:
    return isinstance(a, (int, float, bool))


def check_same_device(named_arrays: dict):
    """Raise ``TypeError`` naming the arguments if the arrays do not all live on one device."""
    arrays = [(k, a) for k, a in named_arrays.items() if a is not None and not _is_scalar(a)]
    if not arrays:
        return None
    placed = [(name, compat.device(a)) for name, a in arrays]
    placed = [(name, dev) for name, dev in placed if dev is not None]   # tracers have no device
    if not placed:
        return compat.device(arrays[0][1])
    name0, dev0 = placed[0]
    for name, dev in placed[1:]:
        if dev != dev0:
            raise TypeError(f"arguments {name0!r} (device {dev0}) and {name!r} (device {dev}) are on "
                            "different devices; move them to one device first")
    return dev0


def check_floating(xp, named_arrays: dict):
    for name, a in named_arrays.items():
        if a is None or _is_scalar(a):
            continue
        if not xp.isdtype(a.dtype, "real floating"):
            raise TypeError(f"argument {name!r} must have a real floating dtype, got {shape_str(a)}")


def has_float64(xp, device) -> bool:
    """Whether ``xp`` can hold float64 on ``device`` (False for JAX without x64, for instance)."""
    try:
        info = xp.__array_namespace_info__()
        kinds = info.dtypes(device=device, kind="real floating")
    except Exception:  # namespaces without an inspection API: assume the standard's full set
        return True
    return "float64" in kinds


def compute_dtypes(xp, arrays, device):
    """Return ``(out_dtype, work_dtype)`` for floating ``arrays``.

    ``out_dtype`` is the promoted input dtype; ``work_dtype`` is float64 where the backend has it
    (prefix sums and their combination are accumulated there, SPEC §4) and float32 otherwise.
    Half-precision inputs are therefore never computed in half precision.
    """
    arrays = [a for a in arrays if a is not None and not _is_scalar(a)]
    out = xp.result_type(*arrays) if len(arrays) > 1 else arrays[0].dtype
    work = xp.float64 if has_float64(xp, device) else xp.float32
    return out, work


def as_work(xp, a, work):
    """``a`` cast to the work dtype (no copy when it already is)."""
    if a.dtype == work:
        return a
    return xp.astype(a, work)


def clamp_min(xp, a, lower: float):
    """``max(a, lower)`` elementwise, ``lower`` a Python float (``xp.clip`` of some wrappers does not
    trace under ``torch.compile(dynamic=True)``)."""
    return xp.maximum(a, xp.asarray(lower, dtype=a.dtype, device=compat.device(a)))


def ceil_log2(n: int) -> int:
    return max(0, math.ceil(math.log2(n))) if n > 0 else 0


def broadcast_shapes(*shapes, names=None) -> tuple:
    """NumPy broadcasting of shapes; ``ValueError`` naming the arguments when they do not broadcast."""
    ndim = max([len(s) for s in shapes] + [0])
    out = []
    for axis in range(-ndim, 0):
        size = 1
        for s in shapes:
            if len(s) >= -axis:
                d = s[axis]
                if d != 1:
                    if size not in (1, d):
                        who = f" of {', '.join(names)}" if names else ""
                        raise ValueError(f"the leading (batch) shapes{who} do not broadcast: "
                                         f"{', '.join(str(tuple(s)) for s in shapes)}")
                    size = d
        out.append(size)
    return tuple(out)


def holds_everywhere(xp, a, predicate) -> bool | None:
    """``all(predicate(xp, a))`` when the values of ``a`` are known now; ``None`` when ``a`` is traced.

    A concrete JAX array closed over by a jitted function is checked on the host: inside the trace
    every ``jnp`` operation is staged, even on concrete inputs, and ``bool`` of the result would fail.
    """
    if is_traced(a):
        return None
    if compat.is_jax_array(a):
        return bool(np.all(predicate(np, np.asarray(a))))
    return bool(xp.all(predicate(xp, a)))


def is_traced(a) -> bool:
    """Whether ``a`` is an abstract value (a JAX tracer, or a tensor inside ``torch.compile``)."""
    if compat.is_jax_array(a):
        import jax
        return isinstance(a, jax.core.Tracer)
    if compat.is_torch_array(a):
        import torch
        return torch.compiler.is_compiling()
    return False
