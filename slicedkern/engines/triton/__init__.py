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

The backward (:func:`._backward.attention_bwd`) is the generic one's pieces (:mod:`.._vjp`: the NaN
rule, the quotient rule) with attention's sums pulled back on these kernels
(:meth:`TritonEngine.profiles_vjp` over the value columns and cotangent rows left unevaluated,
:mod:`.._columns`): it reads the forward's sorted
keys and queries and its table's carry (residuals), so a forward and its backward sort each array
once and sum the values' tiles once; the score gradients' dot products with the cotangent and with
the values are taken in pass 2's epilogue, the cotangent rows are scaled by the quotient rule's
factor as the kernels read them, and ``dv`` is written centred, masked and in the values' dtype, so
no ``(n, D)`` array of sums is written; the cotangent and the output are read in their own dtype by
the quotient rule's row dots (:func:`._backward.row_dots`, :func:`._backward.column_sums`, float64
accumulators), and the values as given (the kernels skip the keys that take no part), so a forward
and its backward allocate nothing of ``n * D`` elements but the output and the gradients
(``scripts/triton_traffic.py``). Learned bandwidths and mixture weights get their gradients from
the same table: each array knot's ReLU and step sums dotted with the cotangent in pass 2's epilogue
(:func:`._backward.kernel_knot_grads`; the causal levels' pull-backs take theirs the same way, sorting nothing more).

Rows of at most :data:`._sums.SMALL_FUSED` queries and keys (float32 or narrower) take the whole
forward in one launch instead (:func:`._sums.attend_small`: each program sorts its row, sums the
tiles of every column, takes the values' NaN verdict off the totals and evaluates its queries with
pass 2's code), where the launches and the host's operators of the sorts and two passes would be
the time; its residuals are the same, and so is its backward.

Causal attention is the divide and conquer over positions of :mod:`.._dyadic` with these kernels at
every level, its dense leaves (sums and pull-back) and its combination (:class:`._causal.TritonLevels`):
two launches per profile and level whatever the number of blocks, each score array sorted once in
runs of :data:`CAUSAL_LEAF` positions and merged bottom-up for the levels above. Its backward
(:func:`._backward.causal_bwd`) is the generic causal one's pieces, on the same pull-back per level: the
values and the cotangent read in their own dtype, the levels' pull-backs added in place into the
leaves' gradients, and ``dv`` finished in one launch (:func:`._causal.causal_dv`).

It serves torch tensors: chosen automatically for CUDA tensors when Triton is installed, and on
request (``engine="triton"`` / :func:`~slicedkern.use_engine`) for CPU tensors too, which Triton runs
only under its interpreter (``TRITON_INTERPRET=1``, how the tests run it).
"""

from __future__ import annotations

import importlib.util

from ..._lib.namespace import scalar
from ...backends import quiet_nonfinite
from .._base import Engine
from .._columns import MaskedValues
from .._combine import empty_attention
from .._dyadic import causal_attention, causal_profile_sums, causal_profiles_vjp
from .._nanpolicy import screen
from .._vjp import Inputs
from ..sortscan.pullback import ColumnSums, column_range, no_pairs_knot_grads
from . import _sums
from ._backward import attention_bwd, causal_bwd, cotangent_tables, kernel_knot_grads
from ._causal import RUN_NAMES, TritonLevels
from ._decode import DeviceRuns
from ._scale import scaled_grads, scaled_up, value_scale
from ._sums import (
    DotTerm,
    Queries,
    SumTerm,
    as_int8,
    attend,
    attend_small,
    build_table,
    cotangent_rows,
    flat_rows,
    interpreted,
    profile_dots,
    profile_sum,
    profile_sum_into,
    row_view,
    sort_queries,
    unit_rows,
)

__all__ = ["TritonEngine"]

#: attention's residuals, in order ("den" only with a summed normaliser): the backward's per-query
#: sums, the forward's sorted keys and queries with their permutations, the carry of its table of
#: ``[v | indicator]`` (R, tiles + 1, 2 (dv + 1)) float64, and its NaN policy's verdicts (the queries
#: whose row is not NaN, the batch rows that are good) (Engine.aux_of)
_RESIDUALS = ("take", "relu_count", "key_order", "key_perm", "query_order", "query_perm", "key_carry", "good",
              "row_ok", "den")
#: Positions per dense leaf block of causal attention: the (64, 64) products of a block cost less on a
#: GPU than the six levels of launches they replace (a dense bottom chunk of 64-128 keys is the aim).
CAUSAL_LEAF = 64


def _factor(xp, sc, row_ok, up=None):
    """The output rows' factor: 1, or NaN where the NaN policy says (``sc``'s verdicts so far) and on
    the batch rows whose bandwidths are bad (``row_ok``, or None: :meth:`Engine.forward`); times
    ``up`` (a batch row's power of two, :func:`._scale.value_scale`) where given."""
    factor = sc.divisor(xp, 1.0)
    if up is not None:
        factor = factor * up[..., None]
    if row_ok is not None:
        factor = xp.where(row_ok[..., None], factor, scalar(xp, float("nan"), dtype=factor.dtype,
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
        if backend.operator_device(a) is None:
            # under torch.compile the call is one operator node and the kernels see real tensors
            # (slicedkern/adapters/_torch_ops.py); torch.func's wrapped tensors have no storage
            try:
                a.data_ptr()
            except RuntimeError:
                return "the 'triton' engine does not run under torch.func transforms: use engine='scan'"
        if a.device.type != "cuda" and not interpreted():
            return (f"the 'triton' engine runs on CUDA tensors, or on CPU tensors under Triton's interpreter "
                    f"(TRITON_INTERPRET=1); got a tensor on device {a.device}")
        return None

    def residual_layout(self, spec, arrays, *, xp):
        # the causal residuals depend on whether the levels sorted, the tables' on the tile plan: a
        # compiled call keeps none, and its backward sorts and sums again (docs/compile.rst)
        return None

    def automatic(self, arrays) -> bool:
        # CPU tensors run under the interpreter only, far slower than the sweep or the scan
        device = getattr(arrays[0], "device", None)
        return getattr(device, "type", None) == "cuda"

    def decodes(self, k) -> bool:
        # the runs stay on the GPU, attended in one launch; CUDA torch tensors only
        device = getattr(k, "device", None)
        return getattr(device, "type", None) == "cuda" and self.installed()

    def decode_runs(self, xp, work, profile, *, center, normalizer, dv):
        return DeviceRuns(xp, profile, center=center, normalizer=normalizer, dv=dv)

    # -- primitives -----------------------------------------------------------------------------
    def kernel_sum(self, x, y, w, profile, *, xp):
        batch, n, c = tuple(x.shape[:-1]), x.shape[-1], w.shape[-1]
        if n == 0 or y.shape[-1] == 0:
            return xp.zeros(x.shape + (c,), dtype=x.dtype, device=x.device)
        sc = screen(xp, x, y, w, None, defer=False)
        table = build_table(xp, flat_rows(xp, sc.y, 1), row_view(xp, w, 2), take=flat_rows(xp, sc.table_take, 1))
        factor = flat_rows(xp, sc.divisor(xp, 1.0), 1)          # 1, or NaN where the NaN policy says
        queries = sort_queries(xp, flat_rows(xp, sc.x, 1))
        out = profile_sum(xp, SumTerm(table, queries, profile, column_range(profile, c), True, factor), batch)
        return xp.reshape(out, batch + (n, out.shape[-1]))

    def attention(self, inputs, form, *, xp, for_backward=False, row_ok=None):
        (q, k, v, key_mask), profile = inputs, form.profile
        batch, lq, lk, dv = tuple(q.shape[:-1]), q.shape[-1], k.shape[-1], v.shape[-1]
        if lq == 0 or lk == 0:
            out, aux = empty_attention(xp, q, k, v, key_mask)
            return out, self.residuals_of(aux)
        # values narrower than float64 mean scores of float32 or narrower (the op casts the values to
        # the result's dtype, promoted over all three), lifted exactly: sorted as float32; and their
        # float64 sums cannot overflow, so the values' finiteness is read off the table's totals
        # (the NaN policy's deferred check) rather than from a pass over them
        narrow = v.dtype != xp.float64
        # narrow values scaled where their sums with the scores could overflow float32 (_scale's docstring)
        v, up = value_scale(xp, q, k, v, profile)
        sc = screen(xp, q, k, v, key_mask, defer=narrow and quiet_nonfinite(xp))
        table_take = None if sc.table_take is None else flat_rows(xp, sc.table_take, 1)
        if sc.deferred and max(lq, lk) <= _sums.SMALL_FUSED:
            # short rows: sorts, both passes and the values' verdict in one launch: at small L the launches are the time
            rows = Inputs(flat_rows(xp, sc.x, 1), flat_rows(xp, sc.y, 1), row_view(xp, v, 2), table_take)
            out, relu_count, raw, table, xr = attend_small(
                xp, rows, form, batch, factor=flat_rows(xp, _factor(xp, sc, row_ok, up), 1), dtype=v.dtype)
            if not for_backward:             # the kernel took the values' verdict itself: none to keep
                return xp.reshape(out, batch + (lq, dv)), ()
            sc.settle(xp, xp.reshape(table.totals, batch + (1, -1)), dv)       # the residuals' verdicts
        else:
            table = build_table(xp, flat_rows(xp, sc.y, 1), row_view(xp, v, 2), take=table_take, ones=True,
                                narrow=narrow)
            sc.settle(xp, xp.reshape(table.totals, batch + (1, -1)), dv)
            xr = sort_queries(xp, flat_rows(xp, sc.x, 1), narrow)
            out, relu_count, raw = attend(xp, table, xr, form, batch,
                                          factor=flat_rows(xp, _factor(xp, sc, row_ok, up), 1), dtype=v.dtype)
        # the sorted orders and the screening go to the backward too (n elements each): it sorts and
        # screens nothing again (the table's sums are those of the scaled values: the backward scales
        # them again, _scaled_vjp)
        residuals = [sc.take, xp.reshape(relu_count, batch + (lq, 1)), table.keys, table.perm, xr.sorted, xr.perm,
                     table.carry, sc.q_ok & sc.row_ok[..., None], sc.row_ok]
        if raw is not None:
            residuals.append(xp.reshape(raw, batch + (lq, 1)))
        return xp.reshape(out, batch + (lq, dv)), tuple(residuals)

    def _levels(self, runs: dict | None = None, narrow: bool = False) -> TritonLevels:
        """The causal levels on the kernels (:class:`._causal.TritonLevels`), with leaves of
        :data:`CAUSAL_LEAF` positions."""
        return TritonLevels(self.profiles_vjp, CAUSAL_LEAF, runs, narrow)

    def causal_attention(self, inputs, form, *, xp):
        q, k, v, key_mask = inputs
        runs = {}
        # values narrower than float64: scores of float32 or narrower (attention's forward, above),
        # and values scaled where the float32 running sums could overflow
        narrow = v.dtype != xp.float64
        v, up = value_scale(xp, q, k, v, form.profile)
        out, aux = causal_attention(Inputs(q, k, v, key_mask), form, xp=xp, levels=self._levels(runs, narrow=narrow))
        out = scaled_up(xp, out, up, in_place=True)
        residuals = self.residuals_of(aux)
        # the combination's block carry of the running totals (n / 64 rows) goes to the backward's
        # row dots, and the levels' sorted runs (n elements each), when the levels sorted, to its
        # levels: it sums and sorts nothing again. (None of it when the call was empty.)
        kept = tuple(runs[name] for name in ("position_carry",) + RUN_NAMES if name in runs)
        return out, residuals[:2] + kept + residuals[2:]

    def attention_vjp(self, inputs, form, g, out, residuals, *, xp):
        inputs, out, up = self._scaled(inputs, form, out, xp=xp)
        return scaled_grads(xp, attention_bwd(self, inputs, form, g, out, self.aux_of(residuals), xp=xp), up)

    def causal_attention_vjp(self, inputs, form, g, out, residuals, *, xp):
        inputs, out, up = self._scaled(inputs, form, out, xp=xp)
        kept = len(residuals) - 2 - int(form.normalizer.summed)     # 0, 1 (the carry) or 1 + 4 (and the runs)
        aux = self.aux_of(residuals[:2] + residuals[2 + kept:])
        if kept:
            aux["position_carry"] = residuals[2]
        if kept > 1:
            aux["runs"] = dict(zip(RUN_NAMES, residuals[3:2 + kept]))
        return scaled_grads(xp, causal_bwd(self, inputs, form, g, out, aux, xp=xp), up)

    @staticmethod
    def _scaled(inputs, form, out, *, xp):
        """The backward's inputs and output as the forward that scaled the values
        (:func:`._scale.value_scale`) saw them: the same scaled values and the output scaled alike
        (the forward's residuals are theirs), and the factor ``up`` that scales the score and
        parameter gradients up again (attention is linear in the values; ``dv`` does not depend on
        them)."""
        q, k, v, key_mask = inputs
        v, up = value_scale(xp, q, k, v, form.profile)
        if up is not None:
            out = scaled_up(xp, out, 1.0 / up)
        return Inputs(q, k, v, key_mask), out, up

    def causal_profile_sums(self, x, y, w, profiles, *, xp):
        return causal_profile_sums(x, y, w, profiles, xp=xp, levels=self._levels())

    def causal_profiles_vjp(self, x, y, w, profiles, cotangents, *, xp, param_grads=True):
        return causal_profiles_vjp(x, y, w, profiles, cotangents, xp=xp, param_grads=param_grads,
                                   levels=self._levels())

    def aux_of(self, residuals):
        if len(residuals) < len(_RESIDUALS) - 1:      # the early return of empty calls
            return super().aux_of(residuals)
        return dict(zip(_RESIDUALS, residuals))

    def profiles_vjp(self, x, y, w, profiles, cotangents, *, xp, param_grads=True, orders=None, dw_into=None,
                     key_carry=None, dv_finish=None):
        """The pull-back of profile sums; ``orders``: the (R, m) / (R, n) sorted keys, their int32
        permutation, the sorted queries and theirs, from the forward (attention's residuals), so
        that no array is sorted twice in a forward and its backward; ``key_carry``: the carry of the
        forward's table of the keys and ``w`` (a residual too: no pass 1 here). ``dw_into = (acc,
        row_stride, offset)``: ``dw`` added in place to ``acc`` (contiguous, float32 or float64), key ``j`` of
        row ``r`` at ``acc.flat[offset + r row_stride + j c + column]`` (a causal level's), and
        None returned. ``dv_finish = (sub, factor, dtype)``: ``dw`` of a profile over all the
        values' columns is ``(sums - sub) * factor`` in ``dtype``, in pass 2's epilogue (``sub`` (R,
        c) float64 or None, ``factor`` (R, m) float64; attention's ``finish_dv``).

        ``w`` may be a :class:`.._columns.MaskedValues` and a cotangent a
        :class:`.._columns.ScaledRows` (attention's backward, :func:`._backward.lazy_terms`):
        the kernels read the values where the keys take part and scale the cotangent rows as they
        read them, and ``dw`` has the values' columns (a profile sums either those or the indicator)."""
        masked = isinstance(w, MaskedValues)
        values = w.values if masked else w
        batch, n, m, c, dw_cols = tuple(x.shape[:-1]), x.shape[-1], y.shape[-1], w.shape[-1], values.shape[-1]
        if n == 0 or m == 0:
            dx = xp.zeros(x.shape, dtype=x.dtype, device=x.device)
            dy = xp.zeros(y.shape, dtype=x.dtype, device=x.device)
            dw = xp.zeros(y.shape + (dw_cols,), dtype=x.dtype, device=x.device) if dw_into is None else None
            return dx, dy, dw, no_pairs_knot_grads(x, profiles, xp=xp, param_grads=param_grads)
        # with the forward's orders the scores are read for their shapes only (no copy of a level's halves)
        xr, yr, vr = row_view(xp, x, 1), row_view(xp, y, 1), row_view(xp, values, 2)
        if orders is None:
            xq, yq = sort_queries(xp, xr.contiguous()), sort_queries(xp, yr.contiguous())   # each sorted once
        else:
            key_order, key_perm, query_order, query_perm = orders
            xq, yq = Queries(query_order, query_perm), Queries(xp.astype(key_order, xp.float64), key_perm)
        dev = x.device
        take = as_int8(xp, row_view(xp, w.take, 1)) if masked else None     # the dots read it as it is
        keyed = build_table(xp, yr, vr, take=take, ones=masked, presorted=yq, carry=key_carry)
        cots = [cotangent_rows(xp, g) for g in cotangents]
        # dx: the derivative sums (H(0) = 1, the scan's convention) dotted with the cotangent inside
        # the kernel, times the rows' factor
        # (no (n, c) array of them), every profile's partial dots summed once
        dx = profile_dots(xp, [DotTerm(keyed, xq, p.with_(derivative=True), column_range(p, c), rows, 0, False,
                                       factor=scale) for p, (rows, scale, _) in zip(profiles, cots)], batch)
        # dw and dy: the reflected profiles over tables of the sorted queries carrying the cotangents;
        # the values read where their keys take part (the indicator's column: 1 there)
        dw, dy_terms = ColumnSums(dw_cols), []
        for p, (table, span, valued) in zip(profiles, cotangent_tables(xp, xr, xq, cotangents, cots)):
            r = p.reflect()
            cols = column_range(p, c)
            if masked and cols.start >= dw_cols:
                dy_terms.append(DotTerm(table, yq, r.with_(derivative=True), span, unit_rows(xp, take.shape, dev), 0,
                                        True, take))
                continue
            if dv_finish is not None:
                if cols != range(0, dw_cols):
                    raise ValueError("dv_finish: one profile over all the values' columns gives dw")
                sub, factor, dtype = dv_finish
                dw.add(profile_sum(xp, SumTerm(valued, yq, r, span, True, factor, sub), batch, dtype=dtype), cols)
            elif dw_into is None:
                dw.add(profile_sum(xp, SumTerm(valued, yq, r, span, True), batch), cols)
            else:
                acc, row_stride, at = dw_into
                profile_sum_into(xp, SumTerm(valued, yq, r, span, True), batch, acc, row_stride, at + cols.start,
                                 dw_cols)
            dy_terms.append(DotTerm(table, yq, r.with_(derivative=True), span, vr, cols.start, True, take))
        dy = profile_dots(xp, dy_terms, batch)
        dx = xp.reshape(dx, batch + (n,))
        dy = xp.reshape(dy, batch + (m,))
        dw = xp.reshape(dw.assemble(xp), batch + (m, dw_cols)) if dw_into is None else None
        if param_grads:
            # knot and coefficient gradients over the same table and sorted queries as dx
            params = [kernel_knot_grads(xp, keyed, xq, p, batch, rows, column_range(p, c), scale=scale)
                      for p, (rows, scale, _) in zip(profiles, cots)]
        else:
            params = [(tuple(None for _ in p.knots), tuple(None for _ in p.coeffs)) for p in profiles]
        return dx, dy, dw, params

    def indicator_sums(self, q, k, ones, profiles, *, xp):
        batch, lq = tuple(q.shape[:-1]), q.shape[-1]
        table = build_table(xp, flat_rows(xp, k, 1), flat_rows(xp, ones, 2))
        xr = sort_queries(xp, flat_rows(xp, q, 1))
        return [xp.reshape(profile_sum(xp, SumTerm(table, xr, p, range(0, 1), True), batch), batch + (lq, 1))
                for p in profiles]
