"""Namespace-neutral helpers: shapes, devices, dtypes, promotion.

Everything here speaks the array API standard through ``array_api_compat``; nothing imports a
framework or asks which framework an array belongs to (that is the backend registry's job).
"""

from __future__ import annotations

import math
import sys

import array_api_compat as compat

__all__ = [
    "torch_compiling",
    "array_device",
    "answer_device_directly",
    "is_scalar",
    "check_same_device",
    "check_floating",
    "compute_dtypes",
    "has_float64",
    "as_work",
    "shape_str",
    "inclusive_scan",
    "exclusive_scan",
]


#: Array types whose ``.device`` is the array-API device (torch tensors, registered by the backend
#: registry's torch row): asked directly, not through ``array_api_compat.device``, whose type tests
#: are ``functools.lru_cache``s that ``torch.compile`` warns about in the user's log (a plain dict it
#: traces silently; backends/__init__.py, ``_BY_TYPE``).
_DIRECT_DEVICE: dict = {}


def answer_device_directly(*types) -> None:
    """Let :func:`array_device` read ``.device`` of arrays of these types."""
    for t in types:
        _DIRECT_DEVICE[t] = True


def array_device(a):
    """``array_api_compat.device(a)``."""
    if _DIRECT_DEVICE.get(type(a), False):
        return a.device
    return compat.device(a)


def shape_str(a) -> str:
    return f"shape {tuple(a.shape)} and dtype {a.dtype}"


def is_scalar(a) -> bool:
    return isinstance(a, (int, float, bool))


def check_same_device(named_arrays: dict):
    """Raise ``TypeError`` naming the arguments if the arrays do not all live on one device."""
    name0 = dev0 = None
    for name, a in named_arrays.items():
        if a is None or is_scalar(a):
            continue
        dev = array_device(a)
        if dev is None:             # tracers have no device
            continue
        if name0 is None:
            name0, dev0 = name, dev
        elif dev != dev0:
            raise TypeError(f"arguments {name0!r} (device {dev0}) and {name!r} (device {dev}) are on "
                            "different devices; move them to one device first")
    return dev0


def check_floating(xp, named_arrays: dict):
    for name, a in named_arrays.items():
        if a is None or is_scalar(a):
            continue
        if not _real_floating(xp, a.dtype):
            raise TypeError(f"argument {name!r} must have a real floating dtype, got {shape_str(a)}")


#: ``(namespace, dtype) -> is it real floating``: a plain dict, not an lru_cache, which torch.compile
#: would warn about in the user's log (backends/__init__.py, ``_BY_TYPE``)
_REAL_FLOATING: dict = {}


def _real_floating(xp, dtype) -> bool:
    """``xp.isdtype(dtype, "real floating")``, asked once per namespace and dtype."""
    # keyed by the namespace's name: torch.compile cannot hash a module inside a key
    if torch_compiling():
        # a memo read while dynamo traces becomes a guard on its contents, which the first run then
        # changes: one needless recompile (docs/compile.rst); the question itself traces
        return bool(xp.isdtype(dtype, "real floating"))
    key = (getattr(xp, "__name__", None) or id(xp), dtype)
    answer = _REAL_FLOATING.get(key)
    if answer is None:
        answer = _REAL_FLOATING[key] = bool(xp.isdtype(dtype, "real floating"))
    return answer


def torch_compiling() -> bool:
    """Whether ``torch.compile`` is tracing this call (False where torch was never imported): the
    memos of the validation step aside then, so that dynamo puts no guard on what they hold."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


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
    (prefix sums and their combination are accumulated there: docs/mathematics.rst, "Numerics") and float32 otherwise.
    Half-precision inputs are therefore never computed in half precision.
    """
    arrays = [a for a in arrays if a is not None and not is_scalar(a)]
    out = xp.result_type(*arrays) if len(arrays) > 1 else arrays[0].dtype
    work = xp.float64 if has_float64(xp, device) else xp.float32
    return out, work


def as_work(xp, a, work):
    """``a`` cast to the work dtype (no copy when it already is)."""
    if a.dtype == work:
        return a
    return xp.astype(a, work)


def scalar(xp, value, *, dtype, device):
    """A 0-d array of the Python number ``value``, made on ``device`` by a fill (``full``) rather than
    copied from the host: torch copies a host value to a CUDA tensor with a stream synchronisation,
    so one ``asarray`` of a constant per call made every call wait for the GPU (docs/benchmarks.rst,
    "On a GPU"). ``asarray`` where the device is a name or unknown (NumPy's "cpu", a JAX tracer's),
    which only it takes."""
    if device is None or isinstance(device, str):
        return xp.asarray(value, dtype=dtype, device=device)
    return xp.full((), value, dtype=dtype, device=device)


def clamp_min(xp, a, lower: float):
    """``max(a, lower)`` elementwise, ``lower`` a Python float (``xp.clip`` of some wrappers does not
    trace under ``torch.compile(dynamic=True)``)."""
    return xp.maximum(a, scalar(xp, lower, dtype=a.dtype, device=array_device(a)))


def ceil_log2(n: int) -> int:
    return max(0, math.ceil(math.log2(n))) if n > 0 else 0


def broadcast_shapes(*shapes, names=None) -> tuple:
    """NumPy broadcasting of shapes; ``ValueError`` naming the arguments when they do not broadcast."""
    if shapes and all(s == shapes[0] for s in shapes):
        return tuple(shapes[0])     # equal shapes (the common case): each is the broadcast one
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


def _interleave(xp, even, odd):
    """Rows ``even[0], odd[0], even[1], odd[1], ...`` along axis -2 (``even`` one row longer or equal)."""
    rows = even.shape[-2] + odd.shape[-2]
    if even.shape[-2] > odd.shape[-2]:
        pad = xp.zeros(odd.shape[:-2] + (1, odd.shape[-1]), dtype=odd.dtype, device=array_device(odd))
        odd = xp.concat([odd, pad], axis=-2)
    both = xp.stack([even, odd], axis=-2)                        # (..., half, 2, c)
    out = xp.reshape(both, tuple(both.shape[:-3]) + (2 * even.shape[-2], both.shape[-1]))
    return out[..., :rows, :]


def inclusive_scan(xp, op, rows):
    """Inclusive prefix scan of the tuple of arrays ``rows`` (each (..., n, c)) along axis -2 with the
    associative ``op`` (tuple, tuple) -> tuple.

    The odd-even recursion (Ladner and Fischer; Blelloch): combine neighbouring rows, scan the
    half-length sequence, and fill the rows in between with one more ``op``: ``O(n)`` work in
    ``2 log2 n`` steps, against the ``O(n log n)`` work of a Hillis-Steele scan. Written with slicing,
    ``stack`` and ``reshape`` only, so that it serves every namespace and traces under ``jax.jit``
    (the scan engine's double-float tables, and JAX's float64 ones, where XLA's own ``cumsum`` on
    the CPU is slower: docs/backends.rst, "Accumulation").
    """
    n = rows[0].shape[-2]
    if n < 2:
        return rows
    pairs = op(tuple(r[..., 0:n - 1:2, :] for r in rows), tuple(r[..., 1::2, :] for r in rows))
    odd = inclusive_scan(xp, op, tuple(pairs))                 # the prefixes ending at rows 1, 3, 5, ...
    upto = (n - 1) // 2                                          # rows 2, 4, ... each follow an odd prefix
    tail = op(tuple(o[..., :upto, :] for o in odd), tuple(r[..., 2::2, :] for r in rows))
    even = tuple(xp.concat([r[..., :1, :], t], axis=-2) for r, t in zip(rows, tail))
    return tuple(_interleave(xp, e, o) for e, o in zip(even, odd))


def exclusive_scan(xp, op, rows):
    """:func:`inclusive_scan` of ``rows`` behind a zero row: each result (..., n + 1, c), row ``p``
    combining input rows ``0 .. p - 1`` (``op`` must take zero rows as its identity)."""
    first = rows[0]
    zero = xp.zeros(first.shape[:-2] + (1, first.shape[-1]), dtype=first.dtype, device=array_device(first))
    return inclusive_scan(xp, op, tuple(xp.concat([zero, r], axis=-2) for r in rows))
