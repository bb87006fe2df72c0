"""The generic backend row: standard-only implementations of every primitive, for any namespace.

Framework rows (``_numpy``, ``_torch``, ``_jax``) subclass :class:`ArrayBackend` and override only
what their library does faster or differently; everything else falls through to these.
"""

from __future__ import annotations

import contextlib
import os
import sys

import array_api_compat as compat
import numpy as np

from .._lib.namespace import array_device, ceil_log2, scalar

__all__ = ["ArrayBackend"]


class ArrayBackend:
    """Array primitives the sort-scan needs, written against the array API standard only.

    A row of the backend registry (:func:`slicedkern.backends.ops_for`). ``library`` names the
    framework as the engine registry and the tests see it.
    """

    library = "generic"
    #: whether NaN and infinities flow through arithmetic unnoticed (no warnings, no traps): then a
    #: non-finite weight may be detected from its row's totals instead of screened beforehand
    quiet_nonfinite = False
    #: whether the library differentiates array code itself (torch autograd, jax.grad)
    autograd = False
    #: whether arrays are lazy and split into chunks (Dask): the sliced ops then lay the points out
    #: by whole projected columns (slicedkern/sliced/_chunked.py) instead of running in memory
    chunked = False

    # -- which arrays are ours ------------------------------------------------------------------
    def owns_namespace(self, xp) -> bool:
        return True

    def owns_array(self, a) -> bool:
        return compat.is_array_api_obj(a)

    def is_traced(self, a) -> bool:
        """Whether ``a`` is an abstract value (under ``jax.jit`` or ``torch.compile``)."""
        return False

    def cpu_threads(self) -> int | None:
        """How many threads a compiled CPU kernel (numba) may use on this library's arrays, or None for
        numba's own count (``NUMBA_NUM_THREADS``, by default the cores): ``OMP_NUM_THREADS`` when it is
        set, the variable NumPy's BLAS and torch follow (docs/backends.rst, "Threads")."""
        value = os.environ.get("OMP_NUM_THREADS", "")
        return int(value) if value.isdigit() and int(value) > 0 else None

    @contextlib.contextmanager
    def compiled_threads(self):
        """Numba's thread count, in the calling thread, capped by :meth:`cpu_threads` for the duration
        of the block and restored afterwards (``numba.set_num_threads`` is per calling thread, so
        concurrent callers do not see each other's)."""
        try:
            import numba  # only around a compiled call, which needs numba anyway
        except ImportError:
            yield None
            return
        cap = self.cpu_threads()
        before = _numba_threads(numba)
        if cap is None or cap >= before:
            yield before
            return
        numba.set_num_threads(cap)
        try:
            yield cap
        finally:
            numba.set_num_threads(before)

    def without_gradient(self, a, message: str):
        """``a`` itself, marked so that differentiating through it raises ``message`` (an op that
        has no gradient must never let an autograd system treat it as constant, silently)."""
        return a

    def reads_context(self, a) -> bool:
        """Whether Python context variables (:func:`slicedkern.use_engine`) may be read on a call with
        ``a``: everywhere but inside ``torch.compile``, whose tracer cannot follow ``ContextVar.get``
        (JAX traces plain Python, so its tracers read them, once, at trace time)."""
        return True

    def host_readable(self, a) -> bool:
        """Whether a compiled CPU engine may read ``a``'s memory directly (NumPy, CPU torch)."""
        return False

    def host_callable(self, a) -> bool:
        """Whether a compiled CPU engine may compute on ``a`` through :meth:`host_call`: its memory is
        readable now, or (JAX) a host callback reaches it on the CPU, traced or not."""
        return self.host_readable(a)

    def operator_device(self, a) -> str | None:
        """The device type of ``a`` ("cpu", "cuda") when an op call on it runs as one registered
        operator of its library, whose implementation sees real arrays again (torch under
        ``torch.compile``: slicedkern/adapters/_torch_ops.py), so that an engine that cannot be traced
        may still serve the call; None otherwise."""
        return None

    def host_call(self, fn, results, *arrays):
        """``fn(*arrays)``, a tuple of host results, as arrays of this library.

        ``results`` gives each result's ``(shape, dtype)`` (a NumPy dtype); a row whose arrays can
        be traced (JAX) needs them to stage the call, and returns those shapes and dtypes. Here the
        arrays are readable now, so ``fn`` runs on them directly and its results are returned as
        they come (``fn`` returns torch tensors for torch inputs).
        """
        return fn(*arrays)

    def to_host(self, a) -> np.ndarray:
        """A NumPy copy (or view) of ``a``'s values; only for concrete arrays."""
        try:
            return np.from_dlpack(a)
        except (TypeError, RuntimeError, BufferError, AttributeError):
            return np.asarray(a)

    def holds_everywhere(self, xp, a, predicate) -> bool | None:
        """``all(predicate(xp, a))`` when ``a``'s values are known now, ``None`` when it is traced."""
        if self.is_traced(a):
            return None
        return bool(xp.all(predicate(xp, a)))

    def compile(self, fn):
        """``fn`` (arrays, and lists / tuples of arrays, in and out) compiled for repeated calls where
        the library compiles (``jax.jit``), else ``fn`` itself."""
        return fn

    # -- primitives of the sort-scan --------------------------------------------------------------
    def searchsorted_right(self, xp, sorted_keys, values):
        """Batched ``#{j : sorted_keys[..., j] <= values[..., i]}``, shape (..., n), default int.

        A fixed-iteration binary search over ``take_along_axis``: the loop count depends on the
        static length ``m`` only, so it is safe under JIT tracing.
        """
        m = sorted_keys.shape[-1]
        dev = array_device(values)
        lo = xp.zeros(values.shape, dtype=xp.int64, device=dev)
        if m == 0:
            return lo
        hi = xp.full(values.shape, m, dtype=xp.int64, device=dev)
        for _ in range(ceil_log2(m + 1)):
            mid = (lo + hi) // 2
            probe = xp.take_along_axis(sorted_keys, xp.minimum(mid, scalar(xp, m - 1, dtype=mid.dtype,
                                                                                  device=dev)), axis=-1)
            go_right = (mid < hi) & (probe <= values)
            lo = xp.where(go_right, mid + 1, lo)
            hi = xp.where(go_right, hi, mid)
        return lo

    def take_rows(self, xp, table, index):
        """``out[..., i, :] = table[..., index[..., i], :]``: a batched row gather."""
        return xp.take_along_axis(table, index[..., None], axis=-2)

    def finite(self, xp, a):
        """Elementwise: ``a`` is neither NaN nor infinite (the NaN policy's screening)."""
        return xp.isfinite(a)

    def finite_keys(self, xp, values):
        """(..., m) True where every entry of a key's value row ``values`` (..., m, c) is finite (the
        causal NaN rule's and decoding's check of the values)."""
        return xp.all(self.finite(xp, values), axis=-1)

    def finite_rows(self, xp, values, valid=None):
        """(...) True where every entry of ``values`` (..., m, c) on a valid key is finite."""
        ok = self.finite_keys(xp, values)
        if valid is not None:
            ok = ok | ~valid
        return xp.all(ok, axis=-1)

    def sorted_weights(self, xp, weights, perm, dtype, *, take=None, ones=False):
        """``weights`` (..., m, c) in the key order ``perm``, in ``dtype``; ``(..., m, c + ones)``.

        ``ones`` appends a column of ones; ``take`` (..., m) (original key order) zeroes the rows
        (that column included) of the keys that take no part, whatever they hold.
        """
        wide = self.take_rows(xp, weights, perm)
        if wide.dtype != dtype:
            wide = xp.astype(wide, dtype)
        if ones:
            one = xp.ones(tuple(perm.shape) + (1,), dtype=dtype, device=array_device(wide))
            wide = xp.concat([wide, one], axis=-1)
        if take is not None:
            keep = xp.take_along_axis(take, perm, axis=-1)
            wide = xp.where(keep[..., None], wide, scalar(xp, 0.0, dtype=dtype, device=array_device(wide)))
        return wide

    def prefix_table(self, xp, keys, weights, perm, *, take=None, ones=False):
        """Exclusive prefix sums of ``[w, y w]`` along the sorted keys, in the dtype of ``keys``.

        ``keys`` (..., m) sorted, ``weights`` (..., m, c) in the original order, ``perm`` sorts them.
        Returns (..., m + 1, 2 C), ``C = c + ones``: row ``p`` holds ``[sum_{j<p} w_j, sum_{j<p} y_j w_j]``.
        """
        wide = self.sorted_weights(xp, weights, perm, keys.dtype, take=take, ones=ones)
        return self.exclusive_rows(xp, xp.concat([wide, keys[..., None] * wide], axis=-1))

    def exclusive_rows(self, xp, a):
        """Exclusive prefix sums of ``a`` (..., m, C) along axis -2: (..., m + 1, C), row 0 zero."""
        return xp.cumulative_sum(a, axis=-2, include_initial=True)

    def combine_rows(self, xp, table, indices, parts, weights, columns, *, cache=None):
        """``sum_k weights[k][..., i] * table[..., indices[k][..., i], part_k * c + columns]``.

        ``indices``: integer arrays (..., n), or ``None`` for the totals row; ``parts``: 0 for the
        ``w`` sums, 1 for the ``y w`` sums; ``weights``: floats or arrays broadcastable to (..., n);
        ``cache``: row gathers keyed by ``id(index)``, shared between calls on one table.
        Returns (..., n, len(columns)).
        """
        cache = {} if cache is None else cache
        c = table.shape[-1] // 2
        acc = None
        for index, part, weight in zip(indices, parts, weights):
            if index is None:
                rows = table[..., -1:, :]
            else:
                rows = cache.get(id(index))
                if rows is None:
                    rows = cache[id(index)] = (index, self.take_rows(xp, table, index))
                rows = rows[1]
            block = rows[..., part * c:(part + 1) * c][..., columns]
            term = block * (weight if isinstance(weight, (int, float)) else weight[..., None])
            acc = term if acc is None else acc + term
        return acc

    # -- exact 1-D statistics (slicedkern/sliced/_exact1d.py) -------------------------------------
    def quiet(self):
        """A context in which non-finite arithmetic raises no warnings (a row with an infinite value
        computes ``inf - inf`` on its way to the NaN it returns)."""
        return contextlib.nullcontext()

    def accurate_sum(self, xp, v):
        """Sum along the last axis with an error that grows like ``log L``, not ``L``.

        The standard does not say how ``sum`` accumulates (XLA may add serially), so a pairwise
        tree is built from halving slices; libraries that sum pairwise natively override this.
        """
        length = v.shape[-1]
        while length > 64:
            if length % 2:
                pad = xp.zeros(tuple(v.shape[:-1]) + (1,), dtype=v.dtype, device=array_device(v))
                v = xp.concat([v, pad], axis=-1)
                length += 1
            v = v[..., 0:length:2] + v[..., 1:length:2]
            length //= 2
        return xp.sum(v, axis=-1)

    def energy_distance_rows(self, xp, x, y, a, b, batch):
        """A compiled exact 1-D energy distance of rows ``x`` (..., n), ``y`` (..., m) with raw
        weights ``a``, ``b`` (``None``: uniform), shape ``batch``; ``None`` when this library has
        none (the caller then uses the array-API formulation)."""
        return None

    def compiled_energy_pairs(self, arrays) -> bool:
        """Whether :meth:`energy_distance_pairs` will compute (not decline) for these arrays in
        the work dtype: what the ``method="auto"`` rule of the energy distance prices."""
        return False

    def energy_distance_pairs(self, xp, x, y, a, b, batch):
        """A compiled exact energy distance in R^d of points ``x`` (..., n, d), ``y`` (..., m, d)
        with probability weights ``a`` (..., n), ``b`` (..., m), shape ``batch``, as an array of
        this library; ``None`` when this library has none for these arrays (no compiled code, or
        a gradient to record): the caller then sums the pairs in array-API operations."""
        return None


def _numba_threads(numba) -> int:
    """``numba.get_num_threads()``, keeping torch's thread count as it was.

    The first call launches numba's thread pool; with the OpenMP threading layer the launch can set
    the process's OpenMP thread count, which torch reads as its own, to numba's (the cores): a
    ``torch.set_num_threads(1)`` made before it was undone, and every later call capped numba at
    two threads beside torch's (docs/backends.rst, "Threads")."""
    torch = sys.modules.get("torch")
    if torch is None:
        return numba.get_num_threads()
    torch_threads = torch.get_num_threads()
    threads = numba.get_num_threads()
    if torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)
    return threads
