"""Host side of the sweep engine: inputs to read-only row-major NumPy views, profiles to per-row
arrays, results back to torch, and the schedule of a call (how many workers, which column chunks).

Imported only with the compiled kernels (numba is installed wherever this module is loaded).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import Any

import numba
import numpy as np

from ..._spec import NORMALIZER_CODES, Normalizer
from ...kernels import Profile

#: Normaliser names of the attention functions (those the kernels have codes for).
NORMALIZERS = tuple(NORMALIZER_CODES)

Array = Any          # a NumPy array or a CPU torch tensor
Param = float | Sequence[float] | Array

# Column chunks are at least this wide (narrower ones lose the vectorised inner loops).
MIN_CHUNK = 16
# Below this much work (batch rows x (queries + keys) x columns) a call runs serially on the
# calling thread. On a busy 2-core machine a parallel launch waits for a parked worker thread: 8 rows
# of L = 1024, D = 64 (2^20 units) took min 1.7 ms but median 56 ms in parallel, min 2.2 ms and median
# 11 ms serially (scripts/sweep_backward_speed.py --small); a serial call stays a few milliseconds.
PARALLEL_MIN_WORK = 1 << 21

F64 = np.dtype(np.float64)

# what the memo of fixed profiles needs of a normaliser: whether it is summed
_SUMMED, _UNSUMMED = Normalizer("abs"), Normalizer(None)


# ------------------------------------------------------------------------------ host conversion
def to_numpy(a, name):
    """(NumPy array, torch dtype or None): a NumPy array, or a zero-copy view of a CPU torch tensor.

    Non-contiguous tensors are made contiguous first; half-precision tensors are widened to float32.
    """
    if type(a) is np.ndarray:
        return a, None
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


def host_view(a, name):
    """(NumPy array, torch dtype or None) like :func:`to_numpy`, but a strided view of a CPU tensor
    as it is, without a contiguous copy: for the small per-token arrays of decoding, where each
    copy costs more than the kernel that reads it (a few microseconds; docs/benchmarks.rst,
    "Decoding")."""
    if type(a) is np.ndarray:
        return (a.astype(np.float32) if a.dtype == np.float16 else a), None
    if type(a).__module__.startswith("torch") and a.device.type == "cpu" and (
            a.itemsize >= 4 or not a.dtype.is_floating_point):      # half precision is widened
        return (a.detach() if a.requires_grad else a).numpy(), a.dtype
    return to_numpy(a, name)


def wrap(out, tdtypes, *, narrow=False):
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


def common_float(arrays, names):
    """The common work dtype (float32 or float64) of floating arrays; float16 computes in float32."""
    for a, nm in zip(arrays, names):
        if a.dtype.kind != "f":
            raise TypeError(f"argument {nm!r} must have a real floating dtype, got {a.dtype} "
                            f"with shape {a.shape}")
    return _work_dtype(tuple(a.dtype for a in arrays))


@functools.lru_cache(maxsize=256)
def _work_dtype(dtypes):
    dt = np.result_type(*dtypes)
    return np.dtype(np.float64) if dt == np.float64 else np.dtype(np.float32)


def result_dtype(arrays, work):
    """The dtype results are returned in: half precision when every input is, else ``work``."""
    return _result_dtype(tuple(a.dtype for a in arrays), work)


@functools.lru_cache(maxsize=256)
def _result_dtype(dtypes, work):
    dt = np.result_type(*dtypes)
    return dt if dt.itemsize < 4 else work


def ro(a):
    """A read-only C-contiguous view (or copy): one compiled signature whatever the caller's flags."""
    a = np.ascontiguousarray(a).view()
    a.flags.writeable = False
    return a


def rows(a, bsz, core, dtype):
    """Flatten the batch dims to one row axis: read-only, C-contiguous, in ``dtype``."""
    return ro(a.reshape((bsz,) + tuple(core)).astype(dtype, copy=False))


def per_row(value, batch, bsz, name):
    """A scalar or batch-shaped parameter as a read-only float64 (B,) array."""
    if isinstance(value, (int, float)):
        return ro(np.full(bsz, float(value)))
    arr = np.asarray(to_numpy(value, name)[0], dtype=np.float64)
    try:
        arr = np.broadcast_to(arr, batch)
    except ValueError:
        raise ValueError(f"argument {name!r} of shape {arr.shape} does not broadcast to the batch "
                         f"shape {batch}") from None
    return ro(arr.reshape(bsz))


def per_row_knots(value, batch, bsz, name):
    """A profile's knots (or coefficients) as a read-only float64 (B, M) array: a tuple of numbers
    (one profile for every row), or of numbers and arrays broadcastable to ``batch`` (one per knot)."""
    if all(isinstance(v, (int, float)) for v in value):
        # one profile for every row (the common case): no broadcast machinery
        rows_ = np.empty((bsz, len(value)))
        rows_[:] = np.asarray(value, dtype=np.float64)
        return ro(rows_)
    per_knot = []
    for v in value:
        arr = np.asarray(to_numpy(v, name)[0] if not isinstance(v, (int, float)) else v, dtype=np.float64)
        try:
            per_knot.append(np.broadcast_to(arr, tuple(batch)))
        except ValueError:
            raise ValueError(f"argument {name!r} has an entry of shape {arr.shape} that does not broadcast "
                             f"to the batch shape {batch}") from None
    return ro(np.stack(per_knot, axis=-1).reshape(bsz, len(per_knot)))


# Profiles whose parameters are all Python numbers (every built-in kernel) are built once per
# batch size: the arrays are read-only, so calls share them. Only for this many rows or fewer, where
# building them costs as much as the sweep; larger calls build their own (and the cache stays small).
MEMO_ROWS = 4096


def _fixed_key(knots, coeffs, slope, intercept, bsz):
    """The memo key of a profile given as Python numbers over ``bsz <= MEMO_ROWS`` rows, or None:
    the float64 bits of every parameter (so -0.0 and 0.0 differ, as they do in the kernels)."""
    if bsz > MEMO_ROWS or type(knots) not in (tuple, list) or type(coeffs) not in (tuple, list):
        return None
    values = (*knots, *coeffs, slope, intercept)
    for v in values:
        if type(v) not in (int, float):
            return None
    try:
        return len(knots), struct.pack(f"{len(values)}d", *values), bsz
    except (OverflowError, struct.error):        # an int beyond float64: the plain path says so
        return None


def _from_key(key):
    """``(knots, coeffs, slope, intercept, bsz)`` back from a :func:`_fixed_key`."""
    n_knots, packed, bsz = key
    values = struct.unpack(f"{len(packed) // 8}d", packed)
    n = len(values) - 2
    return values[:n_knots], values[n_knots:n], values[n], values[n + 1], bsz


@functools.lru_cache(maxsize=64)
def _memo_profile_rows(key):
    knots, coeffs, slope, intercept, bsz = _from_key(key)
    return _profile_rows(knots, coeffs, slope, intercept, (bsz,), bsz)


@functools.lru_cache(maxsize=64)
def _memo_sweep_profile(key, zero_knot):
    profile, n_user = _memo_profile_rows(key)
    return (*with_zero_knot(profile, _SUMMED if zero_knot else _UNSUMMED), n_user)


def profile_rows(profile: Profile, batch, bsz):
    """``(knots (B, M'), coeffs (B, M'), slope (B,), intercept (B,))`` of a
    :class:`~slicedkern.kernels.Profile` and the user's ``M``.

    A profile without knots gets one idle knot (zero coefficient), which keeps the loops uniform.
    Read-only arrays, shared between calls when every parameter is a Python number.
    """
    params = (profile.knots, profile.coeffs, profile.slope, profile.intercept)
    key = _fixed_key(*params, bsz)
    if key is not None:
        return _memo_profile_rows(key)
    return _profile_rows(*params, batch, bsz)


def sweep_profile(profile: Profile, batch, bsz, normalizer: Normalizer):
    """``(rows, zero_knot, n_user)``: :func:`profile_rows`, then :func:`with_zero_knot` for
    ``normalizer``; shared between calls when every parameter is a Python number."""
    params = (profile.knots, profile.coeffs, profile.slope, profile.intercept)
    key = _fixed_key(*params, bsz)
    if key is not None:
        return _memo_sweep_profile(key, normalizer.summed)
    rows_, n_user = _profile_rows(*params, batch, bsz)
    return (*with_zero_knot(rows_, normalizer), n_user)


def _profile_rows(knots, coeffs, slope, intercept, batch, bsz):
    kn = per_row_knots(knots, batch, bsz, "knots")
    co = per_row_knots(coeffs, batch, bsz, "coeffs")
    if kn.shape[1] != co.shape[1]:
        raise ValueError(f"arguments 'knots' and 'coeffs' must have the same length M, got "
                         f"{kn.shape[1]} and {co.shape[1]}")
    if not np.all(np.isfinite(kn)):
        raise ValueError("argument 'knots' must be finite")
    n_user = kn.shape[1]
    if n_user == 0:
        kn, co = ro(np.zeros((bsz, 1))), ro(np.zeros((bsz, 1)))
    return (kn, co, per_row(slope, batch, bsz, "slope"), per_row(intercept, batch, bsz, "intercept")), n_user


def strict_rows(strict_knots, n_knots):
    """The per-knot tie rule of the knot gradients as a read-only bool (n_knots,) array (False:
    ``H(0) = 1``), padded with False for the knots the bridge appends."""
    out = np.zeros(n_knots, np.bool_)
    if strict_knots is not None:
        flags = np.asarray(strict_knots, dtype=np.bool_).reshape(-1)
        if flags.size > n_knots:
            raise ValueError(f"argument 'strict_knots' has {flags.size} entries for {n_knots} knots")
        out[:flags.size] = flags
    return ro(out)


def with_zero_knot(profile, normalizer: Normalizer):
    """The profile rows and the index of a knot at 0 in every row (a summed normaliser's kink),
    appended with a zero coefficient where there is none."""
    kn, co, sl, ic = profile
    if not normalizer.summed:
        return profile, 0
    zero_cols = np.nonzero(np.all(kn == 0.0, axis=0))[0]
    if zero_cols.size:
        return profile, int(zero_cols[0])
    bsz = kn.shape[0]
    kn = ro(np.concatenate([kn, np.zeros((bsz, 1))], axis=1))
    co = ro(np.concatenate([co, np.zeros((bsz, 1))], axis=1))
    return (kn, co, sl, ic), kn.shape[1] - 1


def chunks(bsz, ncols, threads=None):
    """(number of chunks, chunk width): split columns only when rows alone leave threads idle."""
    if threads is None:
        threads = numba.get_num_threads()
    if ncols <= MIN_CHUNK or bsz == 0 or bsz % threads == 0 or bsz >= 4 * threads:
        return 1, max(ncols, 1)
    want = -(-4 * threads // bsz)
    nch = max(1, min(want, ncols // MIN_CHUNK))
    width = -(-ncols // nch)
    width = -(-width // MIN_CHUNK) * MIN_CHUNK
    nch = -(-ncols // width)
    return nch, width


def schedule(bsz, n, m, ncols):
    """``(n_chunks, chunk_width, n_workers)``: one worker (the calling thread) for small work."""
    threads = numba.get_num_threads()     # once: each call costs about a microsecond
    nch, width = chunks(bsz, ncols, threads)
    if threads == 1 or bsz * (n + m) * max(ncols, 1) < PARALLEL_MIN_WORK:
        return nch, width, 1
    return nch, width, min(threads, bsz * nch)


def checked(x, y, w, names):
    """NumPy views of ``x`` (..., n), ``y`` (..., m), ``w`` (..., m, c), their torch dtypes, the batch.

    ``names`` name the three arguments in the errors; leading (batch) shapes must be equal.
    """
    (x, tx), (y, ty), (w, tw) = (to_numpy(a, nm) for a, nm in zip((x, y, w), names))
    nx, ny, nw = names
    if x.ndim < 1 or y.ndim < 1 or w.ndim != y.ndim + 1:
        raise ValueError(f"expected {nx} (..., n), {ny} (..., m), {nw} (..., m, c), got shapes {x.shape}, "
                         f"{y.shape}, {w.shape}")
    batch = x.shape[:-1]
    if y.shape[:-1] != batch or w.shape[:-2] != batch or w.shape[-2] != y.shape[-1]:
        raise ValueError(f"shapes {nx} {x.shape}, {ny} {y.shape}, {nw} {w.shape} do not match (batch dims "
                         f"must be equal, {nw} must have m = {y.shape[-1]} rows)")
    return (x, y, w), [tx, ty, tw], batch


def attention_inputs(q, k, v):
    """Checked host views of attention's scores and values: ``(q, k, v, tdtypes, batch, work, out)``.

    The values decide the compute dtype ``work``: the scores are converted to float64 for the sort
    anyway, so float64 scores (the library casts them) must not widen float32 values.
    """
    (q, k, v), tdt, batch = checked(q, k, v, ("q", "k", "v"))
    common_float([q, k], ["q", "k"])
    work = common_float([v], ["v"])
    return q, k, v, tdt, batch, work, result_dtype([v], work)


def mask_rows(key_mask, shape, bsz):
    """``(mask (B, m) read-only bool, has_mask)`` for the kernels."""
    if key_mask is None:
        return NO_MASK, False
    mask = to_numpy(key_mask, "key_mask")[0]
    if mask.dtype != np.bool_ or mask.shape != shape:
        raise ValueError(f"argument 'key_mask' must be a boolean array of shape {shape}, got "
                         f"{mask.dtype} {mask.shape}")
    return ro(mask.reshape(bsz, shape[-1])), True


def normalizer_code(normalizer: Normalizer) -> int:
    """The kernels' code of ``normalizer`` (:data:`slicedkern._spec.NORMALIZER_CODES`), checked."""
    if normalizer.name not in NORMALIZERS:
        raise ValueError(f"argument 'normalizer' must be one of {NORMALIZERS}, got {normalizer.name!r}")
    return normalizer.code


def bad_rows(bad, n_chunks):
    """(B,) rows any of whose tasks reported a bad value."""
    return bad.reshape(-1, n_chunks).any(axis=1)


def summed(parts):
    """The sum over the leading (chunk) axis of per-chunk partial results."""
    return parts[0] if parts.shape[0] == 1 else parts.sum(axis=0)


NO_MASK = ro(np.ones((1, 1), np.bool_))


def dummy(dt):
    """A placeholder (1, 1, 1) array of ``dt`` for an operand the kernels will not read."""
    return ro(np.zeros((1, 1, 1), dt))


