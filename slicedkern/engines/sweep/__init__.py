"""The **sweep** engine: fused numba kernels on NumPy arrays, CPU torch tensors and CPU JAX arrays.

One compiled call per op sorts every batch row once and sweeps it (docs/architecture.rst, "Engines"):
the forward visits the queries in order with a pointer per knot through the sorted keys; the
backward visits the keys in order with a pointer per knot through the sorted queries and yields
``dq``, ``dk``, ``dv`` and the knot / coefficient gradients (bandwidths, mixture weights) together,
in float64 running sums, with no ``(n, D)`` temporary besides the gradients; on NumPy arrays and CPU
torch tensors the forward's sort and per-query terms are its residuals, which the backward reuses
(no second sort). Batch rows run in
parallel (numba threads, claimed dynamically); small calls run serially on the calling thread.
Causal attention is one sweep over positions per row with a Fenwick tree over the keys' score ranks
(:mod:`._kernels_causal`, docs/mathematics.rst, "Causal attention"); its backward is the generic
causal one (engines/_vjp.py) over the same sweep's pull-backs.

JAX arrays reach the kernels through ``jax.pure_callback`` (the backend row's ``host_call``), so the
engine runs under ``jit``, ``vmap`` and ``grad`` (docs/backends.rst, "JAX on the CPU"); the engine
itself never tests for a framework.

This module is what the registry imports: it does not import numba. The compiled kernels and their
host bridge (:mod:`._host`) are loaded on the first call, and cached on disk by numba after the first
compilation (docs/backends.rst, "First call").
"""

from __future__ import annotations

import importlib.util

import numpy as np
from array_api_compat import array_namespace

from ..._lib.namespace import array_device, as_work, scalar
from ..._spec import KernelSumSpec
from ...backends import backend_of, compiled_threads, to_host
from ...kernels import Profile, is_fixed
from .. import _vjp
from .._base import Engine
from .._vjp import Form, Inputs
from ..sortscan.pullback import ColumnSums, column_range
from . import _layout

__all__ = ["SweepEngine", "AVAILABLE"]

_F64 = np.dtype(np.float64)


_bridge_module = None
_NUMBA_FOUND = importlib.util.find_spec("numba") is not None


def _bridge():
    """The compiled engine's host bridge, imported on first use (it imports numba) and kept."""
    global _bridge_module
    if _bridge_module is None:
        from . import _host as host
        _bridge_module = host
    return _bridge_module


def _profile_args(profile, batch, xp):
    """A profile as array arguments of a host call and a builder of the host's profile from them.

    Returns ``(params, build)``: ``params`` is empty when every knot and coefficient is a number, else
    the (batch..., M) knot and coefficient arrays stacked in ``xp`` (so that a traced or vmapped
    parameter travels with the call); ``build(host_params)`` gives the :class:`Profile` the host
    bridge takes (numbers, or float64 NumPy arrays of the batch shape, per knot).
    """
    slope, intercept = float(profile.slope), float(profile.intercept)
    values = profile.knots + profile.coeffs
    if all(is_fixed(v) for v in values):
        # Python numbers as they are: the host builds (and, for small calls, keeps) their rows
        fixed = Profile(profile.knots, profile.coeffs, slope, intercept, strict_knots=profile.strict_knots)
        return (), lambda host: fixed
    like = next(v for v in values if not is_fixed(v))
    dev = array_device(like)

    def stack(params):
        return xp.stack([xp.broadcast_to(scalar(xp, p, dtype=like.dtype, device=dev) if is_fixed(p) else p,
                                         batch) for p in params], axis=-1)

    def build(host):
        knots, coeffs = (np.asarray(to_host(a), dtype=np.float64) for a in host)
        return Profile(tuple(knots[..., i] for i in range(knots.shape[-1])),
                       tuple(coeffs[..., i] for i in range(coeffs.shape[-1])), slope, intercept,
                       strict_knots=profile.strict_knots)

    return (stack(profile.knots), stack(profile.coeffs)), build


def _host_profile(profile, batch, xp) -> Profile:
    """The host bridge's profile read directly from host-readable arrays (the causal mode)."""
    params, build = _profile_args(profile, batch, xp)
    return build(params)


def _call(fn, results, *arrays):
    """``fn(*arrays)`` on the host through the arrays' backend row (a callback for JAX arrays), with
    as many numba threads as the arrays' library allows (torch's count for torch tensors)."""
    first = arrays[0]

    def run(*host):
        with compiled_threads(first):
            return fn(*host)

    return backend_of(first).host_call(run, results, *arrays)


def _param_tuple(profile, dknots, dcoeffs):
    """The kernels' ``(batch..., M)`` knot / coefficient gradients as the engine protocol returns them:
    one batch-shaped array per array parameter, ``None`` per float one."""
    def pick(params, grads):
        return tuple(None if is_fixed(p) or grads is None else grads[..., i] for i, p in enumerate(params))
    return pick(profile.knots, dknots), pick(profile.coeffs, dcoeffs)


def _device_text(a) -> str:
    try:
        return f" on device {a.device}"
    except Exception:               # no device, or a traced array that cannot say
        return ""


def _fused_causal_applies(q, key_mask, aux, xp) -> bool:
    """Whether the fused causal backward can serve a call (its preconditions,
    :func:`._causal_host.causal_attention_vjp`): every query finite, and every unmasked key taken
    (finite score and value): the causal NaN rule is then void."""
    take = aux["take"]
    return bool(xp.all(take if key_mask is None else take == key_mask)) and bool(xp.all(xp.isfinite(q)))


class SweepEngine(Engine):
    """The fused CPU engine (numba): NumPy arrays, CPU torch tensors outside traced code, and JAX
    arrays on the CPU through a host callback (traced included)."""

    name = "sweep"
    #: causal attention by one Fenwick-tree sweep over positions per row (:mod:`._kernels_causal`)
    supports_causal = True

    def serves(self, library: str) -> bool:
        return library in ("numpy", "torch", "jax") and self.installed()

    @staticmethod
    def installed() -> bool:
        # asked once (every call selects an engine); a module constant, not a functools.cache, which
        # torch.compile would warn about in the user's log
        return _NUMBA_FOUND

    def decline(self, spec, arrays, backend):
        reason = super().decline(spec, arrays, backend)
        if reason is not None:
            return reason
        if not self.installed():
            return "the 'sweep' engine needs numba (pip install numba)"
        if not backend.host_callable(arrays[0]) and backend.operator_device(arrays[0]) != "cpu":
            a = arrays[0]
            return (f"the 'sweep' engine runs on NumPy arrays and CPU torch tensors (torch.compile included, "
                    f"torch.func transforms not), and on JAX arrays on the CPU (jit and vmap included), not "
                    f"on this {type(a).__module__}.{type(a).__name__}"
                    + _device_text(a))
        return None

    def decodes(self, k) -> bool:
        return self.installed() and backend_of(k).host_readable(k)

    def decode_runs(self, xp, work, profile, *, center, normalizer, dv):
        # compiled on the host (numba imported on first use); read in float64 whatever ``work`` is
        from . import _decode as decode
        return decode.HostRuns(lambda batch: _host_profile(profile, batch, xp), center=center,
                               normalizer=normalizer, dv=dv)

    # -- forward primitives ---------------------------------------------------------------------
    # Each call goes to the host through the backend row (_call): directly for NumPy and CPU torch, by
    # a host callback for JAX. Shapes and dtypes are declared up front for the callback; kernel sums
    # are float64 there (float32 under JAX without x64, from the same float64 running sums).
    def kernel_sum(self, x, y, w, profile, *, xp):
        params, build = _profile_args(profile, tuple(x.shape[:-1]), xp)

        def compute(x, y, w, *params):
            return (_bridge().kernel_sum(x, y, w, build(params)),)

        return _call(compute, [(tuple(x.shape) + (w.shape[-1],), _F64)], x, y, w, *params)[0]

    def attention(self, inputs, form, *, xp, for_backward=False):
        (q, k, v, key_mask), (profile, normalizer, center) = inputs, form
        params, build = _profile_args(profile, tuple(q.shape[:-1]), xp)
        masks = () if key_mask is None else (key_mask,)

        if backend_of(q).host_readable(q):
            # the arrays are readable now (NumPy, CPU torch): the host reads them directly, and when a
            # backward will follow the sweep's sort and per-query terms are kept as residuals, so that
            # the backward neither sorts again nor re-sweeps the scores; a forward alone does not pay
            # for writing them
            with compiled_threads(q):
                result = _bridge().attention(inputs, Form(build(params), normalizer, center), keep=for_backward)
            return result if for_backward else (result, ())

        def compute(q, k, v, *rest):
            mask, params = (rest[0], rest[1:]) if masks else (None, rest)
            return (_bridge().attention(Inputs(q, k, v, mask), Form(build(params), normalizer, center)),)

        # a host callback (JAX) declares its results up front, so it keeps none: the backward sorts again
        out = _call(compute, [(tuple(q.shape) + (v.shape[-1],), v.dtype)], q, k, v, *masks, *params)[0]
        return out, ()

    def residual_layout(self, spec, arrays, *, xp):
        if isinstance(spec, KernelSumSpec) or spec.causal:
            return super().residual_layout(spec, arrays, xp=xp)
        # non-causal: the host's sorted rows and per-query terms (attention above, keep=True)
        q, k, v = arrays[:3]
        return tuple((shape, getattr(xp, dtype)) for shape, dtype in
                     _layout.attention_residuals(tuple(q.shape[:-1]), q.shape[-1], k.shape[-1], v.shape[-1]))

    def causal_attention(self, inputs, form, *, xp):
        (q, k, v, key_mask), (profile, normalizer, center) = inputs, form
        params, build = _profile_args(profile, tuple(q.shape[:-1]), xp)
        masks = () if key_mask is None else (key_mask,)

        def compute(q, k, v, *rest):
            mask, params = (rest[0], rest[1:]) if masks else (None, rest)
            return _bridge().causal_attention(Inputs(q, k, v, mask), Form(build(params), normalizer, center))

        results = [(tuple(q.shape) + (v.shape[-1],), v.dtype), (tuple(k.shape), np.bool_),
                   (tuple(q.shape), _F64), (tuple(q.shape), _F64)]
        out, take, relu_count, den = _call(compute, results, q, k, v, *masks, *params)
        residuals = (take, as_work(xp, relu_count, q.dtype)[..., None])
        if normalizer.summed:
            residuals += (as_work(xp, den, q.dtype)[..., None],)
        return out, residuals

    def causal_attention_vjp(self, inputs, form, g, out, residuals, *, xp):
        (q, k, v, key_mask), (profile, normalizer, center) = inputs, form
        if backend_of(q).host_readable(q):
            return self._causal_vjp_here(inputs, form, g, out, residuals, xp=xp)
        # JAX: the same on NumPy arrays, in one host callback (the choice between the fused and the
        # generic backward reads the values)
        batch, n_knots = tuple(q.shape[:-1]), len(profile.knots)
        params, build = _profile_args(profile, batch, xp)
        masks = () if key_mask is None else (key_mask,)
        n_residuals = len(residuals)
        param_grads = not profile.is_fixed

        def compute(q, k, v, g, out, *rest):
            residuals, rest = rest[:n_residuals], rest[n_residuals:]
            mask, params = (rest[0], rest[1:]) if masks else (None, rest)
            host = Form(build(params), normalizer, center)
            dq, dk, dv, (gk, gc) = self._causal_vjp_here(Inputs(q, k, v, mask), host, g, out, residuals,
                                                         xp=array_namespace(q))
            grads = [dq, dk, dv]
            if param_grads:
                grads += [np.stack([np.zeros(batch) if a is None else np.broadcast_to(a, batch) for a in part],
                                   axis=-1) for part in (gk, gc)]
            return grads

        results = [(tuple(q.shape), q.dtype), (tuple(k.shape), q.dtype), (tuple(v.shape), v.dtype)]
        results += [(batch + (n_knots,), _F64)] * (2 * param_grads)
        dq, dk, dv, *pgrads = _call(compute, results, q, k, v, as_work(xp, g, q.dtype), out, *residuals,
                                    *masks, *params)
        dknots, dcoeffs = pgrads if param_grads else (None, None)
        return dq, dk, dv, _param_tuple(profile, dknots, dcoeffs)

    def _causal_vjp_here(self, inputs, form, g, out, residuals, *, xp):
        """:meth:`causal_attention_vjp` on readable arrays: the fused backward (two sweeps) where its
        preconditions hold, else the generic one over this engine's causal profile-sum pull-backs
        (engines/_vjp.py)."""
        (q, _, v, key_mask), (profile, normalizer, center) = inputs, form
        aux = self.aux_of(residuals)
        grads = None
        if aux is not None and _fused_causal_applies(q, key_mask, aux, xp):
            param_grads = not profile.is_fixed
            vanishes = normalizer.summed and _vjp.vanishes_where_normalizer_does(profile, normalizer.profile)
            with compiled_threads(q):
                grads = _bridge().causal_attention_vjp(
                    inputs, Form(_host_profile(profile, tuple(q.shape[:-1]), xp), normalizer, center),
                    as_work(xp, g, v.dtype), out, aux["relu_count"][..., 0],
                    aux["den"][..., 0] if normalizer.summed else None, param_grads=param_grads, vanishes=vanishes)
        if grads is None:
            return super().causal_attention_vjp(inputs, form, g, out, residuals, xp=xp)
        dq, dk, dv, dkn, dco = grads
        dq, dk = (as_work(xp, a, q.dtype) for a in (dq, dk))
        return dq, dk, as_work(xp, dv, v.dtype), _param_tuple(profile, dkn, dco)

    def causal_profiles_vjp(self, x, y, w, profiles, cotangents, *, xp, param_grads=True):
        c = w.shape[-1]
        dx = dy = None
        dw = ColumnSums(c)
        params = []
        for p, g in zip(profiles, cotangents):
            cols = column_range(p, c)
            want = param_grads and not p.is_fixed
            with compiled_threads(x):
                px, py, pw, dkn, dco = _bridge().causal_profile_vjp(
                    x, y, w[..., cols.start:cols.stop], _host_profile(p, tuple(x.shape[:-1]), xp), g,
                    param_grads=want)
            # the bridge answers in NumPy for host-readable JAX arrays: back into the callers' namespace
            px, py, pw = (as_work(xp, xp.asarray(a), x.dtype) for a in (px, py, pw))
            dkn, dco = (None if a is None else xp.asarray(a) for a in (dkn, dco))
            dx = px if dx is None else dx + px
            dy = py if dy is None else dy + py
            dw.add(pw, cols)
            params.append(_param_tuple(p, dkn, dco) if want else (tuple(None for _ in p.knots),
                                                                   tuple(None for _ in p.coeffs)))
        return dx, dy, dw.assemble(xp), params

    # -- the fused backward (overrides the generic one of engines/_vjp.py) ------------------------
    def kernel_sum_vjp(self, x, y, w, profile, g, *, xp):
        params, build = _profile_args(profile, tuple(x.shape[:-1]), xp)
        param_grads = not profile.is_fixed
        batch = tuple(x.shape[:-1])

        def compute(x, y, w, g, *params):
            grads = _bridge().kernel_sum_vjp(x, y, w, build(params), g, param_grads=param_grads,
                                             bad_query_poisons_row=False)
            return grads if param_grads else grads[:3]

        results = [(tuple(x.shape), _F64), (tuple(y.shape), _F64), (tuple(w.shape), _F64)]
        results += [(batch + (len(profile.knots),), _F64)] * (2 * param_grads)
        dx, dy, dw, *pgrads = _call(compute, results, x, y, w, g, *params)
        dknots, dcoeffs = pgrads if param_grads else (None, None)
        return dx, dy, dw, _param_tuple(profile, dknots, dcoeffs)

    def attention_vjp(self, inputs, form, g, out, residuals, *, xp):
        (q, k, v, key_mask), (profile, normalizer, center) = inputs, form
        # the kernels read the cotangent in the values' dtype (float64 running sums either way)
        g = as_work(xp, g, v.dtype)
        params, build = _profile_args(profile, tuple(q.shape[:-1]), xp)
        param_grads = not profile.is_fixed
        masks = () if key_mask is None else (key_mask,)
        outs = (as_work(xp, out, v.dtype),) if normalizer.summed else ()

        def compute(q, k, v, g, *rest):
            rest = list(rest)
            mask = rest.pop(0) if masks else None
            fwd = rest.pop(0) if outs else None
            grads = _bridge().attention_vjp(Inputs(q, k, v, mask), Form(build(rest), normalizer, center), g, fwd,
                                            residuals, param_grads=param_grads)
            return grads if param_grads else grads[:3]

        results = [(tuple(q.shape), q.dtype), (tuple(k.shape), q.dtype), (tuple(v.shape), v.dtype)]
        results += [(tuple(q.shape[:-1]) + (len(profile.knots),), _F64)] * (2 * param_grads)
        dq, dk, dv, *pgrads = _call(compute, results, q, k, v, g, *masks, *outs, *params)
        dknots, dcoeffs = pgrads if param_grads else (None, None)
        return dq, dk, dv, _param_tuple(profile, dknots, dcoeffs)

    # -- the generic primitives (engines/_vjp.py runs on them too) --------------------------------
    def profiles_vjp(self, x, y, w, profiles, cotangents, *, xp, param_grads=True):
        c = w.shape[-1]
        dx = dy = None
        dw = ColumnSums(c)
        params = []
        for p, g in zip(profiles, cotangents):
            cols = column_range(p, c)
            px, py, pw, pparams = self.kernel_sum_vjp(x, y, w[..., cols.start:cols.stop], p, g, xp=xp)
            dx = px if dx is None else dx + px
            dy = py if dy is None else dy + py
            dw.add(pw, cols)
            params.append(pparams if param_grads else (tuple(None for _ in p.knots),
                                                        tuple(None for _ in p.coeffs)))
        return dx, dy, dw.assemble(xp), params

    def indicator_sums(self, q, k, ones, profiles, *, xp):
        return [self.kernel_sum(q, k, ones, p, xp=xp) for p in profiles]


#: Whether the sweep can run here (numba installed); checked without importing numba.
AVAILABLE = SweepEngine.installed()
