"""The Dask row of the backend registry: lazy arrays split into chunks.

A Dask array is never sorted as a whole. The sliced ops lay it out so that every chunk holds whole
projected columns (all ``n`` projections on a few directions) and hand each chunk, as NumPy arrays,
to the in-memory op (``slicedkern/sliced/_chunked.py``; docs/scaling.rst, "Dask"). This row holds the
Dask side of that layout: the blockwise projection, the rechunk to whole columns, the per-block
call and the memory checks. It is imported only once a Dask array has arrived.
"""

from __future__ import annotations

import warnings

import array_api_compat as compat
import dask
import dask.array as da
import numpy as np
from dask.array.core import PerformanceWarning
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


def _flat(blocks) -> list:
    """The NumPy blocks of a contracted index, in order (blockwise nests one list per index)."""
    return [b for item in blocks for b in _flat(item)] if isinstance(blocks, list) else [blocks]


def _whole(blocks):
    """One array from the blocks of a contracted index (None stays None)."""
    if blocks is None:
        return None
    parts = _flat(blocks)
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


class _Block:
    """The task of one block of directions: its projections, a memory check, then ``fn``.

    Called with the block's directions (P_b, d), the blocks of ``x`` and ``y`` (their row chunks
    when ``project``, else their whole projected columns) and the extra arrays. ``need`` is the
    block's working memory per direction, ``fixed`` what it needs besides (the points it reads).
    A class rather than a closure, so that process-based workers can unpickle it.
    """

    def __init__(self, fn, need: int, fixed: int, project: bool):
        self.fn, self.need, self.fixed, self.project = fn, need, fixed, project

    def columns(self, theta, blocks):
        parts = _flat(blocks)
        if not self.project:
            return _whole(parts)
        return np.concatenate([theta @ part.T for part in parts], axis=1)

    def __call__(self, theta, xs, ys, *extras):
        theta = _whole(theta)                       # (P_b, d): the feature axis is one chunk
        limit = _worker_memory_limit()
        need = self.need * theta.shape[0] + self.fixed
        if limit is not None and need > limit:
            raise MemoryError(f"a block of {theta.shape[0]} direction(s) needs about {format_bytes(need)} "
                              f"of working memory, more than this worker's limit of {format_bytes(limit)}; "
                              "pass a smaller chunk_size (directions per block), or give the workers more "
                              "memory: one direction's projections cannot be split across workers")
        return self.fn(self.columns(theta, xs), self.columns(theta, ys), *(_whole(e) for e in extras))


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
    def directions_per_block(self, n_directions: int, column_bytes: int) -> int:
        """Directions per block: as many as fit Dask's target chunk size (``array.chunk-size``)."""
        target = parse_bytes(dask.config.get("array.chunk-size"))
        return max(1, min(n_directions, target // max(column_bytes, 1)))

    def map_directions(self, fn, x, y, theta: np.ndarray, extras: list, *, per_block: int, column_bytes: int,
                       dtype, rows: tuple | None = None):
        """``fn(xb, yb, *extras)`` on every block of ``per_block`` directions, lazily.

        ``x`` (n, d), ``y`` (m, d) are Dask points, ``theta`` (P, d) the directions, ``xb`` (P_b, n)
        and ``yb`` (P_b, m) a block's whole projected columns; ``extras`` are ``(array, side)``
        pairs, ``side`` ``"x"`` or ``"y"`` for arrays along the points of that sample (given whole
        to every block), or ``(None, None)``. ``fn`` returns one value per direction (P_b,), or, with
        ``rows = (n, c)``, a (1, n[, c]) sum over its directions (``c`` None: no column axis).

        A chunking along the feature axis is undone first. Regrouping the rows by direction is an
        all-to-all: every block needs every row chunk. What waits in memory until the last block has
        read it is the smaller of two: with more directions than coordinates (``P > d``) the row
        chunks of the points, each block projecting them on its own directions; otherwise their
        projections on all ``P`` directions, regrouped by ``rechunk``. (Projecting every row chunk
        on every direction first and regrouping would keep all ``(n + m) P`` projections at once
        when ``P > d``: Dask computes a chunk's dependents together to release the chunk.)
        """
        d = x.shape[1]
        itemsize = np.dtype(dtype).itemsize
        project = theta.shape[0] > d
        fixed = (x.shape[0] + y.shape[0]) * d * itemsize if project else 0
        self._check(column_bytes, fixed, x.shape[0] + y.shape[0])
        theta = np.asarray(theta, dtype=dtype)
        x, y = (a.rechunk({1: -1}).astype(dtype) for a in (x, y))
        if project:
            samples = [x, "se", y, "te"]
        else:
            samples = [da.matmul(a, theta.T).T.rechunk((per_block, -1)) for a in (x, y)]
            samples = [samples[0], "ps", samples[1], "pt"]
        args = [da.from_array(theta, chunks=(per_block, -1)), "pe", *samples]
        for a, side in extras:
            index = None if a is None else {"x": "s", "y": "t"}[side] + "c" * (a.ndim - 1)
            args += [None if a is None else a.rechunk(-1), index]
        out, new_axes, adjust = "p", None, None
        if rows is not None:
            out, new_axes, adjust = "pq" + ("" if rows[1] is None else "c"), {"q": rows[0]}, {"p": 1}
        with warnings.catch_warnings():
            # Dask counts the blocks of every index, the contracted ones (the row chunks) too, and
            # warns of "increasing the number of chunks": there is one task per block of directions
            warnings.simplefilter("ignore", PerformanceWarning)
            return da.blockwise(_Block(fn, column_bytes, fixed, project), out, *args, dtype=dtype,
                                concatenate=False, new_axes=new_axes, adjust_chunks=adjust,
                                meta=np.empty((0,) * len(out), dtype=dtype))

    def _check(self, column_bytes: int, fixed: int, points: int) -> None:
        """``ValueError`` when one direction's working memory exceeds the configured limit."""
        limit = parse_bytes(dask.config.get(LIMIT_KEY, DEFAULT_LIMIT))
        if column_bytes + fixed > limit:
            also = f" (and {format_bytes(fixed)} for the points, which every block reads)" if fixed else ""
            raise ValueError(f"one direction's {points} projections need about {format_bytes(column_bytes)} of "
                             f"working memory on one worker{also}, more than the {format_bytes(limit)} allowed "
                             f"by the Dask configuration {LIMIT_KEY!r}; a direction's column is sorted as a "
                             f"whole and cannot be split, so raise the limit (dask.config.set({{{LIMIT_KEY!r}: "
                             "...})) if your workers have the memory, or subsample the points")

    def rows_like(self, a, like):
        """``a`` rechunked along its first axis like ``like``'s first axis."""
        return a.rechunk({0: like.chunks[0]})
