"""The PyTorch row of the backend registry (CPU and CUDA): native fast paths, no autograd."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

import array_api_compat as compat
import numpy as np
import torch

from .._lib.namespace import answer_device_directly
from ._generic import ArrayBackend
from ._merge1d import energy_distance_rows
from ._pairs import available, energy_pair_sums


def searchsorted_right(sorted_keys, values):
    """torch's native batched ``searchsorted`` (leading shapes must match exactly)."""
    return torch.searchsorted(sorted_keys.contiguous(), values.contiguous(), right=True)


def take_rows(table, index):
    """``torch.gather`` with the index expanded over the columns (a view, no copy).

    ``take_along_dim`` would also do it, but it wraps negative indices first (a full extra pass).
    """
    return torch.gather(table, -2, index[..., None].expand(*index.shape, table.shape[-1]))


def finite_rows(values):
    """(...) whether all of ``values`` (..., m, c) is finite: one ``aminmax`` pass, no boolean temporaries."""
    flat = values.flatten(-2)
    if flat.shape[-1] == 0:
        return torch.ones(flat.shape[:-1], dtype=torch.bool, device=values.device)
    lo, hi = torch.aminmax(flat, dim=-1)
    return torch.isfinite(lo) & torch.isfinite(hi)


#: Rows per block of the CPU prefix sum: a block of a (rows, 2C) float64 table stays in cache while
#: each of its columns is summed.
_BLOCK = 64


def _cumsum_rows_(table):
    """In-place inclusive cumulative sum of ``table`` (nb, M, C) along its rows.

    torch's CPU ``cumsum`` walks each column from top to bottom in turn: over a large row-major
    table every walk reloads the rows' cache lines. Summing blocks of rows in cache, then adding the
    running block totals, reads the table twice instead of once per column group.
    """
    nb, rows, width = table.shape
    nblocks = rows // _BLOCK
    if table.device.type != "cpu" or width < 8 or nblocks < 4:
        return table.cumsum_(-2)
    main = table[:, :nblocks * _BLOCK].view(nb, nblocks, _BLOCK, width)
    main.cumsum_(-2)
    running = main[:, :, -1, :].cumsum(-2)               # (nb, nblocks, C) totals of blocks 0..b
    main[:, 1:].add_(running[:, :-1, None, :])
    rest = table[:, nblocks * _BLOCK:]
    if rest.shape[1]:
        rest.cumsum_(-2)
        rest.add_(running[:, -1:, :])
    return table


def prefix_table(keys, weights, perm, take=None, ones=False):
    """:func:`slicedkern.backends.prefix_table` in one allocation and no temporaries.

    The table is laid out as (..., m + 1, 2, C) rows. Its ``y w`` half first holds the unsorted
    weights (cast on the copy, a zero row first); one ``index_select`` writes them in key order
    into the ``w`` half (keys that take no part read the zero row: nothing of theirs is read); one
    multiply by the sorted keys fills the ``y w`` half; then the prefix sum runs in place.
    """
    lead, m = tuple(perm.shape[:-1]), perm.shape[-1]
    c = weights.shape[-1]
    width = c + int(bool(ones))
    nb = 1
    for size in lead:
        nb *= size
    dev, dt = keys.device, keys.dtype
    with torch.no_grad():
        table = torch.empty((nb, m + 1, 2, width), dtype=dt, device=dev)
        src = table.view(*lead, m + 1, 2, width)[..., 1, :]
        src[..., 0, :] = 0
        src[..., 1:, :c] = weights
        if ones:
            src[..., 1:, c] = 1
        base = torch.arange(nb, device=dev)[:, None] * (m + 1)
        index = torch.empty((nb, m + 1), dtype=torch.int64, device=dev)
        index[:, :1] = base
        order = perm.reshape(nb, m)
        if take is None:
            index[:, 1:] = order + (base + 1)
        else:
            keep = torch.gather(take.reshape(nb, m), 1, order)
            index[:, 1:] = torch.where(keep, order + (base + 1), base)
        flat = table.view(nb * (m + 1), 2, width)
        scaled = torch.empty((nb, m + 1), dtype=dt, device=dev)
        scaled[:, 0] = 0
        scaled[:, 1:] = keys.reshape(nb, m)
        if dev.type == "cpu" and not torch.compiler.is_compiling():
            # out= into the strided halves: no (m, C) temporaries (Dynamo traces no strided out=).
            torch.index_select(flat[:, 1, :], 0, index.view(-1), out=flat[:, 0, :])
            torch.mul(flat[:, 0, :], scaled.view(-1, 1), out=flat[:, 1, :])
        else:
            flat[:, 0, :] = flat[:, 1, :].index_select(0, index.view(-1))
            flat[:, 1, :] = flat[:, 0, :] * scaled.view(-1, 1)
        table = _cumsum_rows_(table.view(nb, m + 1, 2 * width))
    return table.view(*lead, m + 1, 2 * width)


#: Up to this many columns, :func:`combine_rows` gathers column by column instead of by bags.
_NARROW = 2


def combine_rows(table, indices, parts, weights, columns, cache):
    """:func:`slicedkern.backends.combine_rows` as one ``embedding_bag``: a bag per query.

    The table is read as rows of ``c`` (each prefix-table row is two: ``w`` sums, ``y w`` sums), and
    the bag of query ``i`` sums its rows weighted by ``per_sample_weights``: one pass that gathers,
    scales and adds, writing only the (n, columns) result. A narrow result (the normaliser's column)
    is cheaper as a few gathers of single columns, shared through ``cache``. ``None`` where the
    layout does not fit.
    """
    if not table.is_contiguous() or table.dtype not in (torch.float64, torch.float32) or not parts:
        return None
    lead, rows = tuple(table.shape[:-2]), table.shape[-2]
    c = table.shape[-1] // 2
    sizes = ([i.shape[-1] for i in indices if i is not None]
             + [w.shape[-1] for w in weights if isinstance(w, torch.Tensor) and w.ndim])
    if not sizes:
        return None
    n = max(sizes)
    nb = 1
    for size in lead:
        nb *= size
    k = len(parts)
    dev = table.device
    width = len(range(c)[columns])
    if width <= _NARROW:
        return _combine_columns(table.view(nb, rows, 2, c), lead, n, indices, parts, weights, columns, cache)
    with torch.no_grad():
        base = torch.arange(nb, device=dev)[:, None] * rows
        index = torch.empty((nb, n, k), dtype=torch.int64, device=dev)
        scale = torch.empty((nb, n, k), dtype=table.dtype, device=dev)
        for j, (at, part, weight) in enumerate(zip(indices, parts, weights)):
            index[:, :, j] = (base + (rows - 1 if at is None else at.reshape(nb, n))) * 2 + part
            if isinstance(weight, torch.Tensor):
                weight = torch.broadcast_to(weight, lead + (n,)).reshape(nb, n)
            scale[:, :, j] = weight
        source = table.view(nb * rows * 2, c)
        # embedding_bag needs contiguous rows: a column slice would copy the whole table first,
        # which costs more than summing the few extra columns a bag writes (the attention's
        # indicator column beside the values) and dropping them from the result
        whole = (c - width) * k <= 2 * width
        out = torch.nn.functional.embedding_bag(index.view(nb * n, k), source if whole else source[:, columns],
                                                per_sample_weights=scale.view(nb * n, k), mode="sum")
        out = out.view(*lead, n, out.shape[-1])
    return out[..., columns] if whole else out


def _combine_columns(table, lead, n, indices, parts, weights, columns, cache):
    """:func:`combine_rows` for a few columns: one ``gather`` per (rank, half), shared via ``cache``."""
    nb, width = table.shape[0], len(range(table.shape[-1])[columns])
    acc = None
    with torch.no_grad():
        for at, part, weight in zip(indices, parts, weights):
            source = table[:, :, part, columns]                        # (nb, rows, width), strided
            if at is None:
                vals = source[:, -1:, :]
            else:
                key = ("torch-columns", id(at), part, columns.start, columns.stop, columns.step)
                hit = cache.get(key)
                if hit is None:
                    at2 = at.reshape(nb, n, 1).expand(nb, n, width)
                    hit = cache[key] = (at, torch.gather(source, 1, at2))
                vals = hit[1]
            if isinstance(weight, torch.Tensor):
                weight = torch.broadcast_to(weight, lead + (n,)).reshape(nb, n, 1)
            term = vals * weight
            acc = term if acc is None else acc + term
    return acc.expand(nb, n, width).reshape(*lead, n, width)




# a tensor's .device is its array-API device (what array_api_compat.device returns for it)
answer_device_directly(torch.Tensor, torch.nn.Parameter)


def _allow_pure_caches(dynamo_utils) -> None:
    """Tell ``torch.compile`` that array-api-compat's memoised type tests (``functools.lru_cache``s of
    pure functions of a type) may be traced through: dynamo otherwise prints a warning per cache it
    meets, ours (through array-api-compat's wrappers) included, in the user's log.
    torch does the same for einops; a torch without the hook changes nothing."""
    allow = getattr(dynamo_utils, "allow_lru_cache_wrapper_trace_without_warning", None)
    if allow is None:
        return
    from array_api_compat.common import _helpers
    for value in vars(_helpers).values():
        if isinstance(value, functools._lru_cache_wrapper):
            allow(value)


class _WhenDynamoLoads(importlib.abc.MetaPathFinder):
    """Runs :func:`_allow_pure_caches` right after ``torch._dynamo.utils`` is imported (by the user's
    first ``torch.compile``), without importing dynamo ourselves (1.8 s)."""

    target = "torch._dynamo.utils"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _allow_pure_caches(module)

            spec.loader.exec_module = exec_module
        return spec


if _WhenDynamoLoads.target in sys.modules:
    _allow_pure_caches(sys.modules[_WhenDynamoLoads.target])
elif not any(isinstance(f, _WhenDynamoLoads) for f in sys.meta_path):
    sys.meta_path.insert(0, _WhenDynamoLoads())


class _NoGradient(torch.autograd.Function):
    """The identity, whose backward raises: marks a value that has no gradient (DecodeCache)."""

    @staticmethod
    def forward(a, message):
        return a.view_as(a)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.message = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(ctx.message)


class TorchBackend(ArrayBackend):
    library = "torch"
    autograd = True
    quiet_nonfinite = True          # no warnings, no traps: a weight's check may wait for its row's totals

    def owns_namespace(self, xp) -> bool:
        return compat.is_torch_namespace(xp)

    def owns_array(self, a) -> bool:
        return compat.is_torch_array(a)

    def cpu_threads(self) -> int:
        # torch's own count, which follows torch.set_num_threads and OMP_NUM_THREADS: a training
        # step that asks torch for one thread gets one numba thread too (two numba threads beside
        # torch's on 2 cores made a step 5-10x slower under load: oversubscription)
        return torch.get_num_threads()

    def without_gradient(self, a, message: str):
        if torch.is_grad_enabled() and a.requires_grad:
            return _NoGradient.apply(a, message)
        return a

    def is_traced(self, a) -> bool:
        return torch.compiler.is_compiling()

    def reads_context(self, a) -> bool:
        return not torch.compiler.is_compiling()

    def operator_device(self, a) -> str | None:
        return a.device.type if torch.compiler.is_compiling() else None

    def host_readable(self, a) -> bool:
        # torch.func transforms wrap tensors without storage: data_ptr() raises on them (public API,
        # unlike functorch's own predicate), and a compiled graph needs traceable ops anyway.
        if a.device.type != "cpu" or torch.compiler.is_compiling():
            return False
        try:
            a.data_ptr()
        except RuntimeError:
            return False
        return True

    def to_host(self, a) -> np.ndarray:
        return a.detach().cpu().numpy()

    def searchsorted_right(self, xp, sorted_keys, values):
        return searchsorted_right(sorted_keys, values)

    def take_rows(self, xp, table, index):
        return take_rows(table, index)

    def finite(self, xp, a):
        if not a.is_floating_point():
            return torch.isfinite(a)
        # x - x is 0 for a finite x and NaN for NaN and +-inf: two operators, where torch.isfinite
        # runs four (==, abs, !=, and), each a kernel launch on a GPU (docs/benchmarks.rst, "On a GPU")
        a = a.detach()
        return (a - a) == 0

    def finite_keys(self, xp, values):
        if not values.is_floating_point() or values.shape[-1] == 0:
            return super().finite_keys(xp, values)
        # a row's least and greatest entries are finite exactly when all are (NaN propagates through
        # both): two (..., m) results, where the generic form writes two (..., m, c) temporaries
        lo, hi = torch.aminmax(values.detach(), dim=-1)
        return self.finite(xp, lo) & self.finite(xp, hi)

    def finite_rows(self, xp, values, valid=None):
        if valid is None:
            return finite_rows(values)
        return super().finite_rows(xp, values, valid)

    def prefix_table(self, xp, keys, weights, perm, *, take=None, ones=False):
        return prefix_table(keys, weights, perm, take, ones)

    def combine_rows(self, xp, table, indices, parts, weights, columns, *, cache=None):
        cache = {} if cache is None else cache
        out = combine_rows(table, indices, parts, weights, columns, cache)
        if out is None:
            return super().combine_rows(xp, table, indices, parts, weights, columns, cache=cache)
        return out

    def accurate_sum(self, xp, v):
        return torch.sum(v, dim=-1)                         # cascade summation

    def energy_distance_rows(self, xp, x, y, a, b, batch):
        # The NumPy row's compiled merge, on float64 copies of CPU tensors that record no gradient: the
        # array-API formulation (sort the pooled sample, gather, running sums) took 3.6x NumPy's time
        # for the sliced energy distance at n = 20000, d = 10, P = 256 (docs/backends.rst)
        arrays = [v for v in (x, y, a, b) if v is not None]
        if not self.compiled_energy_pairs(arrays):
            return None
        host = [None if v is None else v.detach().to(torch.float64).numpy() for v in (x, y, a, b)]
        out = energy_distance_rows(*host, tuple(batch))
        return None if out is None else torch.from_numpy(out).to(x.dtype)

    def compiled_energy_pairs(self, arrays) -> bool:
        # CPU tensors that record no gradient: the compiled sums read their memory; a tensor that
        # requires grad (outside torch.no_grad) keeps the array-API sums, which autograd sees
        recording = torch.is_grad_enabled()
        return available() and all(self.host_readable(v) and not (recording and v.requires_grad) for v in arrays)

    def energy_distance_pairs(self, xp, x, y, a, b, batch):
        arrays = (x, y, a, b)
        if any(v.dtype != torch.float64 for v in arrays) or not self.compiled_energy_pairs(arrays):
            return None
        with self.compiled_threads():
            out = energy_pair_sums(*(v.detach().numpy() for v in arrays), tuple(batch))
        return None if out is None else torch.from_numpy(out)

