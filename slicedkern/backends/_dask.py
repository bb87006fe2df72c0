"""The Dask row of the backend registry: lazy arrays split into chunks.

A Dask array is never sorted as a whole. The sliced ops lay it out so that every chunk holds whole
projected columns (all ``n`` projections on a few directions) and hand each chunk, as NumPy arrays,
to the in-memory op (``slicedkern/sliced/_chunked.py``; docs/scaling.rst, "Dask"). This row holds the
Dask side of that layout: the blockwise projection, the rechunk to whole columns, the per-block
call and the memory checks. It is imported only once a Dask array has arrived.
"""

from __future__ import annotations

import array_api_compat as compat
import dask
import dask.array as da
import numpy as np
from dask.utils import format_bytes, parse_bytes

from ._generic import ArrayBackend

__all__ = ["DaskBackend", "LIMIT_KEY", "DEFAULT_LIMIT"]

#: The Dask configuration key of the largest working memory one direction may need on a worker
#: (``dask.config.set({"slicedkern.max-column-bytes": "16GiB"})``), and its default.
LIMIT_KEY = "slicedkern.max-column-bytes"
DEFAULT_LIMIT = "4GiB"


def _worker_memory_limit() -> int | None:
    """The memory limit of the ``dask.distributed`` worker running this task (None elsewhere)."""
    try:
        from distributed import get_worker  # optional: only under a distributed scheduler
        limit = get_worker().memory_manager.memory_limit
    except (ImportError, ValueError, AttributeError):
        return None
    return int(limit) if limit else None


class _Guarded:
    """A block function that first checks that its directions' columns fit the worker.

    ``column_bytes`` is one direction's working memory; the block's first argument holds one row
    per direction. A class rather than a closure, so that process-based workers can unpickle it.
    """

    def __init__(self, fn, column_bytes: int):
        self.fn, self.column_bytes = fn, column_bytes

    def __call__(self, *blocks):
        limit = _worker_memory_limit()
        need = self.column_bytes * blocks[0].shape[0]
        if limit is not None and need > limit:
            raise MemoryError(f"a block of {blocks[0].shape[0]} direction(s) needs about {format_bytes(need)} "
                              f"of working memory, more than this worker's limit of {format_bytes(limit)}; "
                              "pass a smaller chunk_size (directions per block), or give the workers more "
                              "memory: one direction's projections cannot be split across workers")
        return self.fn(*blocks)


class DaskBackend(ArrayBackend):
    library = "dask"
    chunked = True

    def owns_namespace(self, xp) -> bool:
        return compat.is_dask_namespace(xp)

    def owns_array(self, a) -> bool:
        return compat.is_dask_array(a)

    def to_host(self, a) -> np.ndarray:
        return np.asarray(a.compute())

    def holds_everywhere(self, xp, a, predicate) -> bool | None:
        # Values are known only once the graph runs: checking them here would compute the inputs.
        # The chunked plans check them on the workers instead (through the in-memory ops).
        return None

    # -- the layout of the chunked sliced ops ------------------------------------------------------
    def check_column(self, column_bytes: int, points: int) -> None:
        """``ValueError`` when one direction's working memory exceeds the configured limit."""
        limit = parse_bytes(dask.config.get(LIMIT_KEY, DEFAULT_LIMIT))
        if column_bytes > limit:
            raise ValueError(f"one direction's {points} projections need about {format_bytes(column_bytes)} of "
                             f"working memory on one worker, more than the {format_bytes(limit)} allowed by the "
                             f"Dask configuration {LIMIT_KEY!r}; a direction's column is sorted as a whole and "
                             f"cannot be split, so raise the limit (dask.config.set({{{LIMIT_KEY!r}: ...}})) if "
                             "your workers have the memory, or subsample the points")

    def directions_per_block(self, n_directions: int, column_bytes: int) -> int:
        """Directions per block: as many as fit Dask's target chunk size (``array.chunk-size``)."""
        target = parse_bytes(dask.config.get("array.chunk-size"))
        return max(1, min(n_directions, target // max(column_bytes, 1)))

    def columns(self, points, theta: np.ndarray, per_block: int, dtype):
        """Projections (P, n) of ``points`` (n, d) on ``theta`` (P, d), ``per_block`` whole columns a chunk.

        A chunking along the feature axis is undone first (each row chunk then holds whole points,
        so the projection is blockwise); the rechunk to whole columns is the all-to-all step.
        """
        points = points.rechunk({1: -1}).astype(dtype)
        projected = da.matmul(points, np.asarray(theta.T, dtype=dtype))        # (n, P), rows as points
        return projected.T.rechunk((per_block, -1))

    def whole(self, a):
        """``a`` as a single chunk (None stays None)."""
        return None if a is None else a.rechunk(-1)

    def rows_like(self, a, like):
        """``a`` rechunked along its first axis like ``like``'s first axis."""
        return a.rechunk({0: like.chunks[0]})

    def per_block(self, fn, out_index: str, args: list, *, column_bytes: int, dtype, adjust_chunks=None):
        """``da.blockwise`` of ``fn`` on NumPy blocks, checked against the worker's memory limit."""
        return da.blockwise(_Guarded(fn, column_bytes), out_index, *args, dtype=dtype, concatenate=True,
                            adjust_chunks=adjust_chunks, meta=np.empty((0,) * len(out_index), dtype=dtype))
