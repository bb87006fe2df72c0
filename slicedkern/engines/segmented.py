"""Packed sequences as an engine wrapper: every segment of a row attends as a sequence of its own.

docs/mathematics.rst, "Packed sequences": with segment ids a query sees only the keys of its own
segment, causal per segment (bottom-right aligned inside it, :mod:`slicedkern._lib.causal`), and
every rule of attention (centring, the normaliser, the NaN rule, a query that sees no key) holds per
segment. Since a segment is a sequence of its own, :class:`SegmentedEngine` gathers the segments of
every batch row into rows of a batch of documents and runs the engine it wraps on them:

* the documents are grouped by the powers of two at or above their numbers of queries and of keys,
  one call of the wrapped engine per group, so that padding at most doubles a group's work (one
  call of the longest document's length for all would pay the longest for each);
* inside a group a document is padded at the *front* (masked keys, zero queries whose rows are
  dropped): front padding keeps the bottom-right causal alignment ``b <= a + Lk_s - Lq_s`` of every
  document whatever the group's lengths;
* the results return to the queries' places by one gather (every query belongs to exactly one
  document), and so do the gradients of the queries, keys and values in the backward (which runs
  the wrapped engine's backward per group); array parameters' gradients add up over the documents
  of each batch row.

The layout is computed once per call on the host from the segment ids, which must therefore be
concrete (not traced); the wrapped engine's arithmetic is untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from .._lib.namespace import array_device
from .._spec import sum_to, unpack
from ._base import Engine

__all__ = ["SegmentLayout", "segment_layout", "SegmentedEngine"]


class Group(NamedTuple):
    """Documents padded to ``lq`` queries and ``lk`` keys: host arrays (``docs`` rows each)."""

    rows: np.ndarray       # (docs,) the batch row of each document
    q_index: np.ndarray    # (docs, lq) flat index of each slot's query (0 for padding)
    q_valid: np.ndarray    # (docs, lq) bool: the slot holds a query
    k_index: np.ndarray    # (docs, lk) flat index of each slot's key
    k_valid: np.ndarray    # (docs, lk) bool


class SegmentLayout(NamedTuple):
    """Where every query and key of a packed call sits among the documents' groups."""

    groups: tuple          # of Group
    q_slot: np.ndarray     # (R Lq,) each query's slot in the groups' query slots, concatenated
    k_slot: np.ndarray     # (R Lk,) each key's slot in the groups' key slots (keys of no query's
    #                        segment: the one slot past the end, which holds zeros)
    rows: int              # R, the batch rows


def _next_power_of_two(n: np.ndarray) -> np.ndarray:
    return 1 << np.ceil(np.log2(np.maximum(n, 1))).astype(np.int64)


def _documents(ids: np.ndarray, codes: np.ndarray, width: int):
    """The tokens of ``ids`` (R, L) grouped by (row, segment): ``(order, keys, starts, lengths)`` with
    ``order`` the flat token indices sorted by row, segment code (``codes``, below ``width``) and
    position, and per document its key ``row * width + code``, first entry in ``order`` and length."""
    rows, length = ids.shape
    row_of = np.repeat(np.arange(rows, dtype=np.int64), length)
    key = row_of * width + codes
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]
    starts = np.flatnonzero(np.r_[True, sorted_key[1:] != sorted_key[:-1]]) if sorted_key.size else np.zeros(0, int)
    lengths = np.diff(np.r_[starts, sorted_key.size])
    return order, sorted_key[starts], starts, lengths


def _slots(order, starts, lengths, width):
    """(docs, width) flat indices and validity of documents laid at the end of ``width`` slots."""
    pad = width - lengths
    slot = np.arange(width)[None, :] - pad[:, None]
    valid = slot >= 0
    if not order.size:                 # no tokens on this side (Lk = 0): every slot is padding
        return np.zeros(slot.shape, dtype=np.int64), valid
    index = np.where(valid, order[np.clip(starts[:, None] + slot, 0, order.size - 1)], 0)
    return index, valid


def segment_layout(q_ids: np.ndarray, k_ids: np.ndarray) -> SegmentLayout:
    """The layout of segment ids ``q_ids`` (R, Lq) and ``k_ids`` (R, Lk) (host integer arrays).

    Examples
    --------
    >>> import numpy as np
    >>> layout = segment_layout(np.array([[0, 0, 1]]), np.array([[0, 0, 1]]))
    >>> [(g.q_index.shape, g.k_index.shape) for g in layout.groups]
    [((1, 1), (1, 1)), ((1, 2), (1, 2))]
    >>> layout.q_slot                      # query 2 (segment 1) first, in the group of length one
    array([1, 2, 0])
    """
    rows, lq = q_ids.shape
    lk = k_ids.shape[1]
    _, codes = np.unique(np.concatenate([q_ids.ravel(), k_ids.ravel()]), return_inverse=True)
    codes = codes.astype(np.int64)
    width = int(codes.max(initial=0)) + 1
    q_order, q_docs, q_starts, q_lengths = _documents(q_ids, codes[:q_ids.size], width)
    k_order, k_docs, k_starts, k_lengths = _documents(k_ids, codes[q_ids.size:], width)
    # each query document's keys: the key document of the same (row, segment), or none
    where = np.searchsorted(k_docs, q_docs)
    found = (where < k_docs.size) & (k_docs[np.minimum(where, max(k_docs.size - 1, 0))] == q_docs) \
        if k_docs.size else np.zeros(q_docs.size, bool)
    kk_starts = np.where(found, k_starts[np.minimum(where, max(k_docs.size - 1, 0))] if k_docs.size else 0, 0)
    kk_lengths = np.where(found, k_lengths[np.minimum(where, max(k_docs.size - 1, 0))] if k_docs.size else 0, 0)
    q_width, k_width = _next_power_of_two(q_lengths), _next_power_of_two(kk_lengths)
    groups, q_slot = [], np.zeros(rows * lq, np.int64)
    k_slot = np.zeros(rows * lk, np.int64)
    k_taken = np.zeros(rows * lk, bool)
    q_base = k_base = 0
    for wq, wk in sorted(set(zip(q_width.tolist(), k_width.tolist()))):
        docs = np.flatnonzero((q_width == wq) & (k_width == wk))
        q_index, q_valid = _slots(q_order, q_starts[docs], q_lengths[docs], wq)
        k_index, k_valid = _slots(k_order, kk_starts[docs], kk_lengths[docs], wk)
        q_slot[q_index[q_valid]] = q_base + np.flatnonzero(q_valid.ravel())
        k_slot[k_index[k_valid]] = k_base + np.flatnonzero(k_valid.ravel())
        k_taken[k_index[k_valid]] = True
        groups.append(Group(q_docs[docs] // width, q_index, q_valid, k_index, k_valid))
        q_base += q_index.size
        k_base += k_index.size
    k_slot[~k_taken] = k_base
    return SegmentLayout(tuple(groups), q_slot, k_slot, rows)


class SegmentedEngine(Engine):
    """``inner`` run on the documents of a packed call (see the module docstring).

    ``param_cores`` gives, per array parameter name, how many trailing axes are not batch axes (a hat
    mixture's ``(..., K)``: one); the others are batch-shaped.
    """

    def __init__(self, inner: Engine, layout: SegmentLayout, param_cores: dict | None = None):
        self.inner, self.layout = inner, layout
        self.param_cores = dict(param_cores or {})
        self.supports_causal = inner.supports_causal
        self.traceable = inner.traceable
        self._residual_counts: tuple = ()

    @property
    def name(self) -> str:
        return self.inner.name

    def decline(self, spec, arrays, backend):
        reason = self.inner.decline(spec, arrays, backend)
        if reason is None and not self.inner.traceable and backend.operator_device(arrays[0]) is not None:
            reason = (f"packed sequences (segment_ids) do not run the {self.name!r} engine under torch.compile; "
                      "use engine='scan'")
        return reason

    def automatic(self, arrays) -> bool:
        return self.inner.automatic(arrays)

    # -- gathering documents ---------------------------------------------------------------------
    def _on_device(self, xp, a: np.ndarray, like):
        return xp.asarray(a, device=array_device(like))

    def _group_arrays(self, xp, spec, arrays, group: Group) -> tuple:
        """The group's ``(q, k, v, key_mask, *params)``: documents as batch rows, padded in front."""
        q, k, v, mask, params = unpack(spec, arrays)
        batch, dv = tuple(q.shape[:-1]), v.shape[-1]
        zero = xp.zeros((), dtype=q.dtype, device=array_device(q))
        docs, lq = group.q_index.shape
        lk = group.k_index.shape[1]
        q_valid = self._on_device(xp, group.q_valid, q)
        k_valid = self._on_device(xp, group.k_valid, q)
        q_index = self._on_device(xp, group.q_index.ravel(), q)
        k_index = self._on_device(xp, group.k_index.ravel(), q)
        qg = xp.where(q_valid, xp.reshape(xp.take(xp.reshape(q, (-1,)), q_index, axis=0), (docs, lq)), zero)
        kg = xp.where(k_valid, xp.reshape(xp.take(xp.reshape(k, (-1,)), k_index, axis=0), (docs, lk)), zero)
        vg = xp.reshape(xp.take(xp.reshape(v, (-1, dv)), k_index, axis=0), (docs, lk, dv))
        vg = xp.where(k_valid[..., None], vg, xp.zeros((), dtype=v.dtype, device=array_device(v)))
        take = k_valid
        if mask is not None:
            take = take & xp.reshape(xp.take(xp.reshape(mask, (-1,)), k_index, axis=0), (docs, lk))
        rows = self._on_device(xp, group.rows, q)
        gathered = []
        for name in spec.param_layout:
            p = params[name]
            core = tuple(p.shape[p.ndim - self.param_cores.get(name, 0):]) if self.param_cores.get(name, 0) else ()
            whole = xp.reshape(xp.broadcast_to(p, batch + core), (-1,) + core)
            gathered.append(xp.take(whole, rows, axis=0))
        return (qg, kg, vg, take, *gathered)

    def _inner_spec(self, spec):
        return dataclasses.replace(spec, has_mask=True)

    # -- what the adapters call ------------------------------------------------------------------
    def forward(self, spec, arrays, *, xp, for_backward=False):
        q, v = arrays[0], arrays[2]
        inner_spec = self._inner_spec(spec)
        outs, saved, counts = [], [], []
        for group in self.layout.groups:
            out, residuals = self.inner.forward(inner_spec, self._group_arrays(xp, spec, arrays, group), xp=xp,
                                                for_backward=for_backward)
            outs.append(xp.reshape(out, (-1, out.shape[-1])))
            saved += [out, *residuals]
            counts.append(len(residuals))
        self._residual_counts = tuple(counts)
        dv = v.shape[-1]
        if not outs:
            return xp.zeros(tuple(q.shape) + (dv,), dtype=q.dtype, device=array_device(q)), ()
        every = outs[0] if len(outs) == 1 else xp.concat(outs, axis=0)
        out = xp.take(every, self._on_device(xp, self.layout.q_slot, q), axis=0)
        return xp.reshape(out, tuple(q.shape) + (out.shape[-1],)), tuple(saved)

    def backward(self, spec, arrays, out, residuals, g, *, xp):
        q, k, v, mask, params = unpack(spec, arrays)
        batch, dv = tuple(q.shape[:-1]), v.shape[-1]
        inner_spec = self._inner_spec(spec)
        g_rows = xp.reshape(g, (-1, g.shape[-1]))
        dqs, dks, dvs = [], [], []
        dparams: dict = {name: None for name in spec.param_layout}
        at = 0
        for group, count in zip(self.layout.groups, self._residual_counts):
            out_g, res_g = residuals[at], tuple(residuals[at + 1:at + 1 + count])
            at += 1 + count
            docs, lq = group.q_index.shape
            q_valid = self._on_device(xp, group.q_valid, q)
            index = self._on_device(xp, group.q_index.ravel(), q)
            gg = xp.reshape(xp.take(g_rows, index, axis=0), (docs, lq, g.shape[-1]))
            gg = xp.where(q_valid[..., None], gg, xp.zeros((), dtype=g.dtype, device=array_device(g)))
            grads = self.inner.backward(inner_spec, self._group_arrays(xp, spec, arrays, group), out_g, res_g, gg,
                                        xp=xp)
            dqs.append(xp.reshape(grads[0], (-1,)))
            dks.append(xp.reshape(grads[1], (-1,)))
            dvs.append(xp.reshape(grads[2], (-1, dv)))
            rows_onehot = self._on_device(xp, (np.arange(self.layout.rows)[:, None] == group.rows[None, :]), q)
            for name, grad in zip(spec.param_layout, grads[4:]):
                flat = xp.reshape(grad, (docs, -1))
                per_row = xp.astype(rows_onehot, flat.dtype) @ flat
                dparams[name] = per_row if dparams[name] is None else dparams[name] + per_row
        zero_q = xp.zeros((1,), dtype=q.dtype, device=array_device(q))
        dq = xp.take(xp.concat(dqs + [zero_q], axis=0), self._on_device(xp, self.layout.q_slot, q), axis=0)
        dk = xp.take(xp.concat(dks + [xp.zeros((1,), dtype=k.dtype, device=array_device(k))], axis=0),
                     self._on_device(xp, self.layout.k_slot, q), axis=0)
        dvv = xp.take(xp.concat(dvs + [xp.zeros((1, dv), dtype=v.dtype, device=array_device(v))], axis=0),
                      self._on_device(xp, self.layout.k_slot, q), axis=0)
        grads = [xp.reshape(dq, q.shape), xp.reshape(dk, k.shape), xp.reshape(dvv, v.shape)]
        if spec.has_mask:
            grads.append(None)
        for name in spec.param_layout:
            p = params[name]
            core = tuple(p.shape[p.ndim - self.param_cores.get(name, 0):]) if self.param_cores.get(name, 0) else ()
            whole = dparams[name]
            if whole is None:
                whole = xp.zeros((self.layout.rows,) + core, dtype=p.dtype, device=array_device(p))
            grads.append(sum_to(xp, xp.reshape(whole, batch + core), p.shape))
        return tuple(grads)

    def residual_layout(self, spec, arrays, *, xp) -> Any:
        return None

    def __repr__(self):
        return f"<slicedkern engine {self.name!r} over packed sequences>"

