"""The **triton** engine: the sort-scan as two Triton passes, for torch tensors.

The keys and the queries are sorted once each (int32 permutations; scores of float32 or narrower,
which the op lifts to float64, as the float32 numbers they are; rows of up to
:data:`._sums.SMALL_SORT` such scores in one launch of :func:`._order.sort_rows`, longer ones by
``torch.sort``); everything after the
sorts runs in Triton kernels (:mod:`._kernels`): pass 1 sums the value rows per tile of sorted keys
(float64 carries between tiles), pass 2 evaluates each block of sorted queries over the tiles its
ranks span, re-reading the values rather than a stored prefix table, and writes the combined output
with the centring term and the per-query divisor (normaliser and NaN policy) folded in, through the
query permutation. Attention's forward is one sort of each score array, one pass 1 and one pass 2:
the ``relu_count`` and normaliser sums over the indicator column are summed in the same pass-2
launch as the values, and written as the backward's residuals; the output is written in the values'
dtype (the result's: the op casts the values to it), so no cast or float64 copy of it follows
(docs/architecture.rst, "Engines").

The backward is the generic one (:mod:`.._vjp`: the NaN rule, the quotient rule) with attention's
sums pulled back on these kernels (:func:`_sums_vjp`): it reads the forward's sorted
keys and queries and its table's carry (residuals), so a forward and its backward sort each array
once and sum the values' tiles once; the score gradients' dot products with the cotangent and with
the values are taken in pass 2's epilogue, the cotangent rows are scaled by the quotient rule's
factor as the kernels read them, and ``dv`` is written centred, masked and in the values' dtype, so
no ``(n, D)`` array of sums is written; the cotangent and the output are read in their own dtype by
the quotient rule's row dots (:func:`._sums.row_dots`, :func:`._sums.column_sums`, float64
accumulators), and the values as given (the kernels skip the keys that take no part), so a forward
and its backward allocate nothing of ``n * D`` elements but the output and the gradients
(``scripts/triton_traffic.py``). Learned bandwidths and mixture weights get their gradients from
the same table: each array knot's ReLU and step sums dotted with the cotangent in pass 2's epilogue
(:func:`_knot_grads`; the causal levels' pull-backs take theirs the same way, sorting nothing more).

Rows of at most :data:`._sums.SMALL_FUSED` queries and keys (float32 or narrower) take the whole
forward in one launch instead (:func:`._sums.attend_small`: each program sorts its row, sums the
tiles of every column, takes the values' NaN verdict off the totals and evaluates its queries with
pass 2's code), where the launches and the host's operators of the sorts and two passes would be
the time (issue 26, item 3); its residuals are the same, and so is its backward.

Causal attention is the scan's divide and conquer over positions (:mod:`..scan._causal`) with these
kernels at every level, its dense leaves (sums and pull-back) and its combination (:mod:`._causal`):
two launches per profile and level whatever the number of blocks, each score array sorted once in
runs of :data:`CAUSAL_LEAF` positions and merged bottom-up for the levels above. Its backward is the
generic one over the causal prefix (:class:`_CausalKeys`): the cotangent read in its own dtype, the
levels' pull-backs added in place into the leaves' gradients, and ``dv`` finished in one launch
(:func:`._sums.causal_dv`).

It serves torch tensors: chosen automatically for CUDA tensors when Triton is installed, and on
request (``engine="triton"`` / :func:`~slicedkern.use_engine`) for CPU tensors too, which Triton runs
only under its interpreter (``TRITON_INTERPRET=1``, how the tests run it).
"""

from __future__ import annotations

import functools
import importlib.util

from ..._lib.namespace import as_work
from ...backends import quiet_nonfinite
from ...kernels import Profile, is_fixed
from .._base import Engine
from .._nanpolicy import screen
from .._vjp import AllKeys, SeenKeys, attention_vjp, join_value_columns
from ..scan._causal import Levels, causal_attention, causal_profile_sums, causal_profiles_vjp
from ..sortscan.pullback import ColumnSums, column_range
from . import _sums
from ._causal import (
    RUN_NAMES,
    causal_row_dots,
    combine_output,
    dense_leaves,
    dense_leaves_vjp,
    level_orders,
    level_sums,
    level_sums_into,
)
from ._decode import DeviceRuns
from ._sums import (
    Queries,
    attend,
    attend_small,
    build_table,
    causal_dv,
    column_sums,
    flat_rows,
    interpreted,
    profile_dot,
    profile_sum,
    profile_sum_into,
    row_dots,
    row_view,
    sort_queries,
)

__all__ = ["TritonEngine"]

#: attention's residuals, in order ("den" only with a summed normaliser): the backward's per-query
#: sums, the forward's sorted keys and queries with their permutations, the carry of its table of
#: ``[v | indicator]`` (R, tiles + 1, 2 (dv + 1)) float64, and its NaN policy's verdicts (the queries
#: whose row is not NaN, the batch rows that are good) (Engine.aux_of)
_RESIDUALS = ("take", "relu_count", "key_order", "key_perm", "query_order", "query_perm", "key_carry", "good",
              "row_ok", "den")
#: Positions per dense leaf block of causal attention: the (64, 64) products of a block cost less on a
#: GPU than the six levels of launches they replace (issue 26 asks for a 64-128 dense bottom chunk).
CAUSAL_LEAF = 64


def decodes(k) -> bool:
    """Whether ``DecodeCache`` keeps the runs of the keys ``k`` on their GPU (:func:`device_runs`):
    CUDA torch tensors, Triton installed."""
    device = getattr(k, "device", None)
    return getattr(device, "type", None) == "cuda" and TritonEngine.installed()


def device_runs(profile, *, center: bool, normalizer, dv: int, xp):
    """Decoding runs on the device, attended in one launch (:class:`._decode.DeviceRuns`)."""
    return DeviceRuns(xp, profile, center=center, normalizer=normalizer, dv=dv)


def _factor(xp, sc, row_ok):
    """The output rows' factor: 1, or NaN where the NaN policy says (``sc``'s verdicts so far) and on
    the batch rows whose bandwidths are bad (``row_ok``, or None: :meth:`Engine.forward`)."""
    factor = sc.divisor(xp, 1.0)
    if row_ok is not None:
        factor = xp.where(row_ok[..., None], factor, xp.asarray(float("nan"), dtype=factor.dtype,
                                                                device=factor.device))
    return factor


class TritonEngine(Engine):
    name = "triton"
    supports_causal = True
    gives_causal_sums = True
    folds_row_ok = True

    @staticmethod
    def installed() -> bool:
        return importlib.util.find_spec("triton") is not None

    def decline(self, spec, arrays, backend):
        a = arrays[0]
        if backend.library != "torch":
            return f"the 'triton' engine serves torch tensors only, not {type(a).__module__}.{type(a).__name__}"
        if not self.installed():
            return "the 'triton' engine needs Triton (pip install triton, or slicedkern[triton])"
        reason = super().decline(spec, arrays, backend)
        if reason is not None:
            return reason
        if backend.is_traced(a):
            return "the 'triton' engine does not run under torch.compile: use engine='scan'"
        try:
            a.data_ptr()
        except RuntimeError:
            return "the 'triton' engine does not run under torch.func transforms: use engine='scan'"
        if a.device.type != "cuda" and not interpreted():
            return (f"the 'triton' engine runs on CUDA tensors, or on CPU tensors under Triton's interpreter "
                    f"(TRITON_INTERPRET=1); got a tensor on device {a.device}")
        return None

    def automatic(self, arrays) -> bool:
        # CPU tensors run under the interpreter only, far slower than the sweep or the scan
        device = getattr(arrays[0], "device", None)
        return getattr(device, "type", None) == "cuda"

    # -- primitives -----------------------------------------------------------------------------
    def kernel_sum(self, x, y, w, profile, *, xp):
        batch, n, c = tuple(x.shape[:-1]), x.shape[-1], w.shape[-1]
        if n == 0 or y.shape[-1] == 0:
            return xp.zeros(x.shape + (c,), dtype=x.dtype, device=x.device)
        sc = screen(xp, x, y, w, None, defer=False)
        table = build_table(xp, flat_rows(xp, sc.y, 1), row_view(xp, w, 2), take=flat_rows(xp, sc.table_take, 1))
        factor = flat_rows(xp, sc.divisor(xp, 1.0), 1)          # 1, or NaN where the NaN policy says
        out = profile_sum(xp, table, sort_queries(xp, flat_rows(xp, sc.x, 1)), profile, batch, column_range(profile, c),
                          strict=True, factor=factor)
        return xp.reshape(out, batch + (n, out.shape[-1]))

    def attention(self, q, k, v, profile, *, key_mask, center, normalizer, xp, for_backward=False, row_ok=None):
        batch, lq, lk, dv = tuple(q.shape[:-1]), q.shape[-1], k.shape[-1], v.shape[-1]
        dt, dev = q.dtype, q.device
        if lq == 0 or lk == 0:
            take = xp.ones(k.shape, dtype=xp.bool, device=dev) if key_mask is None else key_mask
            zeros = xp.zeros(q.shape + (1,), dtype=dt, device=dev)
            return xp.zeros(q.shape + (dv,), dtype=dt, device=dev), (take, zeros, zeros)
        # values narrower than float64 mean scores of float32 or narrower (the op casts the values to
        # the result's dtype, promoted over all three), lifted exactly: sorted as float32; and their
        # float64 sums cannot overflow, so the values' finiteness is read off the table's totals
        # (the NaN policy's deferred check) rather than from a pass over them
        narrow = v.dtype != xp.float64
        sc = screen(xp, q, k, v, key_mask, defer=narrow and quiet_nonfinite(xp))
        table_take = None if sc.table_take is None else flat_rows(xp, sc.table_take, 1)
        if sc.deferred and max(lq, lk) <= _sums.SMALL_FUSED:
            # short rows: sorts, both passes and the values' verdict in one launch (issue 26, item 3)
            out, relu_count, raw, table, xr = attend_small(
                xp, flat_rows(xp, sc.y, 1), flat_rows(xp, sc.x, 1), row_view(xp, v, 2), table_take, profile,
                normalizer, batch, center=center, factor=flat_rows(xp, _factor(xp, sc, row_ok), 1), dtype=v.dtype)
            if not for_backward:             # the kernel took the values' verdict itself: none to keep
                return xp.reshape(out, batch + (lq, dv)), ()
            sc.settle(xp, xp.reshape(table.totals, batch + (1, -1)), dv)       # the residuals' verdicts
        else:
            table = build_table(xp, flat_rows(xp, sc.y, 1), row_view(xp, v, 2), take=table_take, ones=True,
                                narrow=narrow)
            sc.settle(xp, xp.reshape(table.totals, batch + (1, -1)), dv)
            xr = sort_queries(xp, flat_rows(xp, sc.x, 1), narrow)
            out, relu_count, raw = attend(xp, table, xr, profile, normalizer, batch, center=center,
                                          factor=flat_rows(xp, _factor(xp, sc, row_ok), 1), dtype=v.dtype)
        # the sorted orders and the screening go to the backward too (n elements each): it sorts and
        # screens nothing again
        residuals = [sc.take, xp.reshape(relu_count, batch + (lq, 1)), table.keys, table.perm, xr.sorted, xr.perm,
                     table.carry, sc.q_ok & sc.row_ok[..., None], sc.row_ok]
        if raw is not None:
            residuals.append(xp.reshape(raw, batch + (lq, 1)))
        return xp.reshape(out, batch + (lq, dv)), tuple(residuals)

    def _levels(self, runs: dict | None = None, narrow: bool = False) -> Levels:
        """The causal levels on the kernels; ``runs``: :func:`._causal.level_orders`' sorted runs,
        recorded by a forward (empty) or read by its backward (filled); ``narrow``: the scores are
        float32 numbers, sorted as such (:func:`._causal.level_orders`)."""
        return Levels(level_sums, self.profiles_vjp, CAUSAL_LEAF, native_values=True,
                      orders=functools.partial(level_orders, runs=runs, narrow=narrow),
                      sums_into=level_sums_into, leaves=dense_leaves, leaves_vjp=dense_leaves_vjp,
                      combine=combine_output, mutable=True, masked_values=True)

    def causal_attention(self, q, k, v, profile, *, key_mask, center, normalizer, xp):
        runs = {}
        # values narrower than float64: scores of float32 or narrower (attention's forward, above)
        out, aux = causal_attention(q, k, v, profile, key_mask=key_mask, center=center, normalizer=normalizer,
                                    xp=xp, levels=self._levels(runs, narrow=v.dtype != xp.float64))
        residuals = self.residuals_of(aux)
        if runs:
            # the levels' sorted runs (n elements each) go to the backward: it sorts nothing again
            residuals = residuals[:2] + tuple(runs[name] for name in RUN_NAMES) + residuals[2:]
        return out, residuals

    def causal_attention_vjp(self, q, k, v, profile, g, out, residuals, *, key_mask, center, normalizer, xp):
        runs = None
        if len(residuals) >= 2 + len(RUN_NAMES):
            runs = dict(zip(RUN_NAMES, residuals[2:2 + len(RUN_NAMES)]))
            residuals = residuals[:2] + residuals[2 + len(RUN_NAMES):]
        aux = self.aux_of(residuals)
        if runs is not None:
            aux["runs"] = runs
        return attention_vjp(self, q, k, v, profile, g, out, aux, key_mask=key_mask, center=center,
                             normalizer=normalizer, causal=True, xp=xp)

    def causal_profile_sums(self, x, y, w, profiles, *, xp):
        return causal_profile_sums(x, y, w, profiles, xp=xp, levels=self._levels())

    def causal_profiles_vjp(self, x, y, w, profiles, cotangents, *, xp, param_grads=True):
        return causal_profiles_vjp(x, y, w, profiles, cotangents, xp=xp, param_grads=param_grads,
                                   levels=self._levels())

    def aux_of(self, residuals):
        if len(residuals) < len(_RESIDUALS) - 1:      # the early return of empty calls
            return super().aux_of(residuals)
        return dict(zip(_RESIDUALS, residuals))

    def key_view(self, q, k, v, key_mask, aux, *, causal: bool, xp):
        if causal:
            return _CausalKeys(self, q, k, v, key_mask, xp, None if aux is None else aux.get("runs"))
        if aux is None or "query_perm" not in aux:
            return super().key_view(q, k, v, key_mask, aux, causal=causal, xp=xp)
        return _SortedKeys(self, q, k, v, key_mask, xp, aux)

    def profiles_vjp(self, x, y, w, profiles, cotangents, *, xp, param_grads=True, orders=None, dw_into=None):
        """The pull-back of profile sums; ``orders``: the (R, m) / (R, n) sorted keys, their int32
        permutation, the sorted queries and theirs, from the forward (attention's residuals), so
        that no array is sorted twice in a forward and its backward. ``dw_into = (acc, row_stride,
        offset)``: ``dw`` added in place to ``acc`` (float64, contiguous), key ``j`` of row ``r`` at
        ``acc.flat[offset + r row_stride + j c + column]`` (a causal level's), and None returned."""
        batch, n, m, c = tuple(x.shape[:-1]), x.shape[-1], y.shape[-1], w.shape[-1]
        if n == 0 or m == 0:
            dx = xp.zeros(x.shape, dtype=x.dtype, device=x.device)
            dy = xp.zeros(y.shape, dtype=x.dtype, device=x.device)
            dw = xp.zeros(w.shape, dtype=x.dtype, device=x.device) if dw_into is None else None
            return dx, dy, dw, [(tuple(None for _ in p.knots), tuple(None for _ in p.coeffs))
                                for p in profiles]
        # dx: derivative sums over the sorted keys, H(0) = 1 (the scan's convention)
        xr, yr = flat_rows(xp, x, 1), flat_rows(xp, y, 1)
        if orders is None:
            xq, yq = sort_queries(xp, xr), sort_queries(xp, yr)      # each array sorted once
        else:
            key_order, key_perm, query_order, query_perm = orders
            xq, yq = Queries(query_order, query_perm), Queries(xp.astype(key_order, xp.float64), key_perm)
        keyed = build_table(xp, yr, row_view(xp, w, 2), presorted=yq)
        dx = None
        for p, g in zip(profiles, cotangents):
            # the derivative sums dotted with the cotangent inside the kernel: no (n, c) array of them
            term = profile_dot(xp, keyed, xq, p.with_(derivative=True), batch, column_range(p, c),
                               row_view(xp, g, 2), 0, strict=False)
            dx = term if dx is None else dx + term
        # dw and dy: the reflected profiles over one sort of the queries carrying every cotangent
        stacked = flat_rows(xp, xp.concat(list(cotangents), axis=-1), 2)
        queried = build_table(xp, xr, stacked, presorted=xq)
        dw, dy = ColumnSums(c), None
        start = 0
        for p, g in zip(profiles, cotangents):
            span = range(start, start + g.shape[-1])
            start += g.shape[-1]
            r = p.reflect()
            cols = column_range(p, c)
            if dw_into is None:
                dw.add(profile_sum(xp, queried, yq, r, batch, span, strict=True), cols)
            else:
                acc, row_stride, at = dw_into
                profile_sum_into(xp, queried, yq, r, batch, span, acc, row_stride, at + cols.start, strict=True,
                                 query_stride=c)
            term = profile_dot(xp, queried, yq, r.with_(derivative=True), batch, span, row_view(xp, w, 2),
                               cols.start, strict=True)
            dy = term if dy is None else dy + term
        dx = xp.reshape(dx, batch + (n,))
        dy = xp.reshape(dy, batch + (m,))
        dw = xp.reshape(dw.assemble(xp), batch + (m, c)) if dw_into is None else None
        if param_grads:
            # knot and coefficient gradients over the same table and sorted queries as dx
            params = [_knot_grads(xp, keyed, xq, p, batch, row_view(xp, g, 2), column_range(p, c))
                      for p, g in zip(profiles, cotangents)]
        else:
            params = [(tuple(None for _ in p.knots), tuple(None for _ in p.coeffs)) for p in profiles]
        return dx, dy, dw, params

    def indicator_sums(self, q, k, ones, profiles, *, xp):
        batch, lq = tuple(q.shape[:-1]), q.shape[-1]
        table = build_table(xp, flat_rows(xp, k, 1), flat_rows(xp, ones, 2))
        xr = sort_queries(xp, flat_rows(xp, q, 1))
        return [xp.reshape(profile_sum(xp, table, xr, p, batch, range(0, 1), strict=True), batch + (lq, 1))
                for p in profiles]


class _KernelRows:
    """The quotient rule's reads of the output's cotangent on the kernels, for the engine's views
    of the keys: the cotangent kept in its own dtype and strides (no float64 copy of it), its row
    dots one launch (:func:`._sums.row_dots`)."""

    def cotangent(self, xp, g):
        return g

    def row_dot(self, xp, g, b):
        batch, lq = tuple(g.shape[:-2]), g.shape[-2]
        b = xp.broadcast_to(b, batch + tuple(b.shape[-2:]))
        dots = row_dots(xp, row_view(xp, g, 2), row_view(xp, b, 2))
        return xp.reshape(dots, batch + (lq, 1))


#: the value sums each query of causal attention sees, as :meth:`_CausalKeys.totals` hands them to
#: :meth:`_CausalKeys.row_dot` (unevaluated: :func:`._causal.causal_row_dots` sums them as it reads)
_SEEN_VALUE_SUMS = object()


class _CausalKeys(_KernelRows, SeenKeys):
    """The keys each query sees in causal attention (:class:`~slicedkern.engines._vjp.SeenKeys`),
    with the cotangent read by the kernels (:class:`_KernelRows`) and ``dv`` finished in one launch
    (:func:`._sums.causal_dv`): the centring mean's cotangent is handed from :meth:`to_keys` to
    :meth:`finish_dv` unevaluated, so that neither its reverse running sum nor ``dv - sub`` is an
    (lk, dv) array (issue 26, item 5). ``runs``: the forward's sorted runs of the levels (its
    residuals, :func:`._causal.level_orders`), or None: the levels' pull-backs merge from them and
    sort nothing."""

    def __init__(self, engine, q, k, v, key_mask, xp, runs=None):
        super().__init__(engine, q, k, v, key_mask, xp)
        self.runs = runs

    def totals(self, xp, *, values: bool):
        # the value sums each query sees are read only by the quotient rule's row dots (row_dot),
        # which sum them as they read the values: handed over unevaluated
        count = self.seen(xp, xp.astype(self.take, self.q.dtype)[..., None])
        return count, _SEEN_VALUE_SUMS if values else None

    def row_dot(self, xp, g, b):
        if b is not _SEEN_VALUE_SUMS:
            return super().row_dot(xp, g, b)
        batch, lq = tuple(g.shape[:-2]), g.shape[-2]
        v, take = row_view(xp, self.raw_v, 2), flat_rows(xp, self.take, 1)
        dots = causal_row_dots(xp, row_view(xp, g, 2), v, take, take.shape[-1] - lq)
        return xp.reshape(dots, batch + (lq, 1))

    def profiles_vjp(self, x, y, w, profiles, cotangents, *, xp, param_grads=True):
        return causal_profiles_vjp(x, y, w, profiles, cotangents, xp=xp, param_grads=param_grads,
                                   levels=self.engine._levels(self.runs))

    def to_keys(self, xp, weights, g):
        return weights, g

    def finish_dv(self, xp, dv, dv_sub, dv_factor):
        batch, lk, d = tuple(dv.shape[:-2]), dv.shape[-2], dv.shape[-1]
        weights = g = None
        if dv_sub is not None:
            weights, g = dv_sub
            lq = g.shape[-2]
            weights = flat_rows(xp, xp.broadcast_to(weights, batch + (lq, 1))[..., 0], 1)
            g = row_view(xp, xp.broadcast_to(g, batch + (lq, d)), 2)
        factor = flat_rows(xp, xp.broadcast_to(dv_factor, batch + (lk, 1))[..., 0], 1)
        return xp.reshape(causal_dv(xp, row_view(xp, dv, 2), g, weights, factor, self.raw_v.dtype), batch + (lk, d))

    def value_columns(self, xp, *, silent):
        # the values as given (the row dots' kernel reads them so), zeroed in place in the joined
        # columns, this view's own array: no zeroed copy of the values besides (issue 26, item 5)
        return join_value_columns(xp, self.raw_v, self.take, silent=silent).masked_fill_(~self.take[..., None], 0.0)


class _SortedKeys(_KernelRows, AllKeys):
    """Every key of the row (:class:`~slicedkern.engines._vjp.AllKeys`), pulled back over the
    forward's residuals: its sorted orders, table of keys and NaN policy's verdicts, so that the
    backward of attention on the triton engine sorts and screens nothing (:func:`_sums_vjp`).

    ``q`` and ``k`` are the unscreened scores, read for their shapes only; ``raw_v`` the values,
    read by kernels that skip the keys that take no part."""

    silent_as_mask = True      # the silent rows scale the cotangent of dv's table: no host read of den

    def __init__(self, engine, q, k, v, key_mask, xp, aux):
        self.q, self.k, self.raw_v, self.key_mask = q, k, v, key_mask
        self.take, self.good, self.row_bad = aux["take"], aux["good"], ~aux["row_ok"]
        self.orders = (aux["key_order"], aux["key_perm"], aux["query_order"], aux["query_perm"])
        self.key_carry = aux["key_carry"]
        self.engine, self.xp, self._v = engine, xp, None

    def to_keys(self, xp, weights, g):
        batch, dv = tuple(g.shape[:-2]), g.shape[-1]
        weights = flat_rows(xp, xp.broadcast_to(weights, g.shape[:-1] + (1,))[..., 0], 1)
        return xp.reshape(column_sums(xp, weights, row_view(xp, g, 2)), batch + (1, dv))

    def totals(self, xp, *, values: bool):
        # the forward's table of [v | indicator] over the keys that take part: its last carry row
        batch, dv = tuple(self.k.shape[:-1]), self.raw_v.shape[-1]
        sums = xp.astype(xp.reshape(self.key_carry[:, -1, :dv + 1], batch + (1, dv + 1)), self.q.dtype)
        return sums[..., dv:], sums[..., :dv] if values else None

    def sums_vjp(self, profile, normalizer, gout, cot, silent, *, center: bool, dv_sub, dv_factor, xp):
        if normalizer.summed and not normalizer.profile.is_fixed:
            # a normaliser with array parameters (none of the named ones has them): the generic
            # pull-back over the scan's knot sums, in the work dtype, over screened keys
            keys = AllKeys(self.engine, self.q, self.k, self.raw_v, self.key_mask, xp)
            return keys.sums_vjp(profile, normalizer, as_work(xp, gout, self.q.dtype), cot, silent, center=center,
                                 dv_sub=dv_sub, dv_factor=dv_factor, xp=xp)
        return _sums_vjp(xp, self, profile, normalizer, gout, cot, silent, center=center, dv_sub=dv_sub,
                         dv_factor=dv_factor)


def _sums_vjp(xp, keys: _SortedKeys, profile, normalizer, gout, cot, silent, *, center: bool, dv_sub, dv_factor):
    """:func:`slicedkern.engines._vjp.sums_vjp` on the kernels, for fixed profiles: the same
    pull-back, with no ``(n, dv)`` array but the gradient ``dv`` itself (issue 26, item 2).

    * ``dq``: the derivative sums of the values over the forward's table of keys (its carry is a
      residual: no pass 1), dotted with ``gout`` in pass 2's epilogue and scaled by the quotient
      rule's factor per query (``cot.scale``); the indicator column's derivative sums, one column,
      times the indicator cotangents (centring, normaliser);
    * ``dv`` and ``dk``: the reflected profile over a table of the sorted queries whose rows are
      ``gout`` times ``cot.scale``, scaled as the kernels read them (never written scaled); ``dk``'s
      dot with the values in pass 2's epilogue, the indicator cotangents (two columns at most) in a
      table of their own; ``dv_sub`` and ``dv_factor`` applied in pass 2's epilogue, which writes
      ``dv`` in the values' dtype.
    """
    x, y, v = keys.q, keys.k, keys.raw_v      # the kernels skip the keys that take no part (take)
    batch, n, m, dv = tuple(x.shape[:-1]), x.shape[-1], y.shape[-1], v.shape[-1]
    key_order, key_perm, query_order, query_perm = keys.orders
    xq = Queries(query_order, query_perm)
    yq = Queries(xp.astype(key_order, xp.float64), key_perm)
    xr = flat_rows(xp, x, 1)
    vr, gr = row_view(xp, v, 2), row_view(xp, gout, 2)
    take = flat_rows(xp, keys.take, 1)

    def per_row(a, shape):           # (..., n or m, 1) or (..., 1, dv) factors as (R, n or m or dv) float64
        return flat_rows(xp, xp.astype(xp.reshape(xp.broadcast_to(a, batch + shape), batch + (-1,)), xp.float64), 1)

    scale = per_row(cot.scale, (n, 1))
    indicator = ([(profile, cot.relu_count)] if center else []) + (
        [(normalizer.profile, cot.den)] if normalizer.summed else [])
    indicator_cots = [per_row(c, (n, 1)) for _, c in indicator]

    keyed = build_table(xp, flat_rows(xp, y, 1), vr, take=take, ones=True, presorted=yq, carry=keys.key_carry)
    dq = profile_dot(xp, keyed, xq, profile.with_(derivative=True), batch, range(0, dv), gr, 0,
                     strict=False) * scale
    for (p, _), c in zip(indicator, indicator_cots):
        sums = profile_sum(xp, keyed, xq, p.with_(derivative=True), batch, range(dv, dv + 1), strict=False)
        dq = dq + sums[..., 0] * c

    queried = build_table(xp, xr, gr, scale=scale, presorted=xq)
    reflected = profile.reflect()
    dk = profile_dot(xp, queried, yq, reflected.with_(derivative=True), batch, range(0, dv), vr, 0, strict=True)
    if silent is not None:
        # the silent rows' cotangent reaches dq and dk, not dv (_vjp.sums_vjp)
        kept = scale * (1.0 - per_row(silent, (n, 1)))
        queried = build_table(xp, xr, gr, scale=kept, presorted=xq)
    sub = None if dv_sub is None else per_row(dv_sub, (1, dv))
    dvs = profile_sum(xp, queried, yq, reflected, batch, range(0, dv), strict=True, sub=sub,
                      factor=per_row(dv_factor, (m, 1)), dtype=v.dtype)
    if indicator:
        extra = build_table(xp, xr, xp.concat([c[..., None] for c in indicator_cots], axis=-1), presorted=xq)
        for i, (p, _) in enumerate(indicator):
            sums = profile_sum(xp, extra, yq, p.reflect().with_(derivative=True), batch, range(i, i + 1),
                               strict=True)
            dk = dk + sums[..., 0]
    # the raw values of the keys that take no part were read (they may hold anything): zero there
    dk = xp.where(take, dk, xp.zeros((), dtype=dk.dtype, device=dk.device))
    params = _knot_grads(xp, keyed, xq, profile, batch, gr, range(0, dv), scale=scale,
                         cot_r=indicator_cots[0] if center else None)
    return (xp.reshape(dq, batch + (n,)), xp.reshape(dk, batch + (m,)), xp.reshape(dvs, batch + (m, dv)), params)


def _knot_grads(xp, keyed, xq, profile, batch, gr, cols: range, *, scale=None, cot_r=None):
    """``(dknots, dcoeffs)`` of a profile over the table columns ``cols`` (None for its fixed numbers)
    on the kernels, over a table of keys: per array knot ``t`` its ReLU sums (for the coefficient)
    and step sums (for the knot, the tie as ``profile.strict_knots`` says) dotted with the
    cotangent rows ``gr`` (R, n, len(cols)) in pass 2's epilogue, times ``scale`` (R, n) when given
    (attention's quotient-rule factor), plus the indicator column's (column ``cols.stop``) times
    the centring cotangent ``cot_r`` ((R, n), or None), summed over the queries: what
    :func:`~slicedkern.engines.sortscan.pullback.knot_grads` sums over materialised cotangents,
    with no sort and no (n, c) array here."""
    def summed(unit, strict):
        rows = profile_dot(xp, keyed, xq, unit, batch, cols, gr, 0, strict=strict)
        if scale is not None:
            rows = rows * scale
        if cot_r is not None:
            ind = range(cols.stop, cols.stop + 1)
            rows = rows + profile_sum(xp, keyed, xq, unit, batch, ind, strict=strict)[..., 0] * cot_r
        return xp.reshape(xp.sum(rows, axis=-1), batch)

    dknots, dcoeffs = [], []
    for knot, coeff, strict in zip(profile.knots, profile.coeffs, profile.strict_knots):
        unit = Profile([knot], [1.0])
        dcoeffs.append(None if is_fixed(coeff) else summed(unit, True))
        dknots.append(None if is_fixed(knot) else -coeff * summed(unit.with_(derivative=True), strict))
    return tuple(dknots), tuple(dcoeffs)
