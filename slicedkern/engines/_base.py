"""The engine protocol, and the spec-level forward and backward written once for every engine.

An engine computes; it validates nothing (the public layer did) and chooses nothing (the registry
did, once per call). It provides four primitives over arrays already broadcast to one batch shape,
scores in the work dtype:

* ``kernel_sum(x, y, w, profile, *, xp)`` -> (..., n, c) in the work dtype;
* ``attention(inputs, form, *, xp, for_backward)`` -> ``(out, residuals)`` over the records
  :class:`._vjp.Inputs` ``(q, k, v, key_mask)`` and :class:`._vjp.Form` ``(profile, normalizer,
  center)``, residuals a flat tuple of arrays (possibly empty) that only this engine reads back;
  ``for_backward`` says whether a backward will follow (an autograd node, a :func:`slicedkern.vjp`
  record), so that an engine may keep work for it only then (the sweep keeps its sort);
* ``profiles_vjp(x, y, w, profiles, cotangents, *, xp, param_grads=True)``;
* ``indicator_sums(q, k, ones, profiles, *, xp)``;

an engine with a causal mode (``supports_causal = True``) also provides

* ``causal_attention(inputs, form, *, xp)`` -> ``(out, residuals)`` with the residuals ``(take,
  relu_count[, den])`` per query over the keys it sees;
* ``causal_profiles_vjp(x, y, w, profiles, cotangents, *, xp, param_grads=True)``: ``profiles_vjp``
  over the keys ``j <= i + m - n`` of each query ``i`` (docs/mathematics.rst, "Causal attention");
* optionally (``gives_causal_sums = True``) ``causal_profile_sums(x, y, w, profiles, *, xp)``: its
  forward, the per-query profile sums over those keys, uncombined (one (..., n, c_p) array per
  profile), which the sharded engine (:mod:`.sharded`) adds across ranks; an engine without it
  is not sharded for causal calls;

``form.normalizer`` is the spec's :class:`~slicedkern._spec.Normalizer`; the output rule the sums
go through is :mod:`._combine`, written once;

and :class:`Engine` turns them into ``forward(spec, arrays)`` / ``backward(spec, arrays, out,
residuals, g)``, the two calls the adapters make.

The backward is one method per job, :meth:`Engine.kernel_sum_vjp`, :meth:`Engine.attention_vjp` and
:meth:`Engine.causal_attention_vjp`, whose default is the generic straight backward over the
primitives (:func:`._vjp.attention_bwd`, :func:`._vjp.causal_bwd`); an engine with a backward of its
own (the sweep's fused one, triton's over its forward's residuals, the sharded engine's collectives)
overrides them, written from the same pieces of :mod:`._vjp`, and returns the same gradients.
"""

from __future__ import annotations

from .._lib.namespace import array_device, as_work, scalar
from .._spec import KernelSumSpec, param_grads, params_ok, profile_of, unpack
from ..kernels import Profile
from . import _vjp
from ._vjp import Form, Inputs

__all__ = ["Engine", "no_causal_mode"]

#: the per-query residuals of attention's forward, in order ("den" only with a summed normaliser)
_AUX_NAMES = ("take", "relu_count", "den")


def no_causal_mode(name: str) -> str:
    """The reason an engine without a causal mode gives for declining a ``causal=True`` spec."""
    return (f"the {name!r} engine has no causal mode (causal=True); use engine='scan', or leave engine "
            "unset to let the automatic rule pick an engine that has one")


class Engine:
    """Base class of the engines: the spec-level forward and backward over the primitives."""

    #: the name users pass as ``engine=``
    name = ""
    #: whether the engine computes causal attention (``AttentionSpec.causal``); the others decline
    #: causal specs in :meth:`decline`, with :func:`no_causal_mode` as the reason
    supports_causal = False
    #: whether the engine gives causal profile sums uncombined (``causal_profile_sums``)
    gives_causal_sums = False
    #: whether the engine's non-causal ``attention`` takes ``row_ok`` ((batch) bool or None: the batch
    #: rows whose array bandwidths are good) and makes the other rows NaN itself, in its own
    #: epilogue, so that no masked copy of the output is written here
    folds_row_ok = False
    #: whether the engine's forward and backward run collectives: every rank must run the backward
    collective = False
    #: whether ``torch.compile`` traces the engine's array code (the scan); otherwise a compiled call
    #: runs it as one registered operator (slicedkern/adapters/_torch_ops.py, docs/compile.rst)
    traceable = False

    def decline(self, spec, arrays, backend) -> str | None:
        """Why this engine cannot run ``spec`` on ``arrays`` (of registry row ``backend``), or None.

        An override that keeps ``supports_causal = False`` must decline causal specs itself.
        """
        if getattr(spec, "causal", False) and not self.supports_causal:
            return no_causal_mode(self.name)
        return None

    def automatic(self, arrays) -> bool:
        """Whether the automatic rule may pick this engine for ``arrays`` (``decline`` permitting)."""
        return True

    def serves(self, library: str) -> bool:
        """Whether the engine runs on CPU arrays of ``library`` ("numpy", "torch", "jax", ...) here, as
        :func:`slicedkern.engines.available` lists it (the scan: every library)."""
        return False

    # -- the primitives (docstring of this module); tests/test_architecture.py checks each engine has them
    #: the primitives of every engine, and of an engine with ``supports_causal``
    PRIMITIVES = ("kernel_sum", "attention", "profiles_vjp", "indicator_sums", "decode_runs")
    CAUSAL_PRIMITIVES = ("causal_attention", "causal_profiles_vjp")

    def _missing(self, primitive: str):
        return NotImplementedError(f"the {self.name!r} engine does not provide {primitive!r}")

    def kernel_sum(self, x, y, w, profile, *, xp):
        """``S[..., i, :] = sum_j f(x_i - y_j) w[..., j, :]``: (..., n, c) in the work dtype."""
        raise self._missing("kernel_sum")

    def attention(self, inputs: Inputs, form: Form, *, xp, for_backward=False):
        """``(out, residuals)`` of normalised attention (docs/mathematics.rst, "Attention")."""
        raise self._missing("attention")

    def profiles_vjp(self, x, y, w, profiles, cotangents, *, xp, param_grads=True):
        """``(dx, dy, dw, [(dknots, dcoeffs)] per profile)``: the pull-back of several profile sums."""
        raise self._missing("profiles_vjp")

    def indicator_sums(self, q, k, ones, profiles, *, xp):
        """One (..., n, 1) sum of each profile over the indicator ``ones`` (..., m, 1)."""
        raise self._missing("indicator_sums")

    def causal_attention(self, inputs: Inputs, form: Form, *, xp):
        """:meth:`attention` over the keys ``j <= i + lk - lq`` of each query ``i``."""
        raise self._missing("causal_attention")

    def causal_profiles_vjp(self, x, y, w, profiles, cotangents, *, xp, param_grads=True):
        """:meth:`profiles_vjp` over the keys each query sees."""
        raise self._missing("causal_profiles_vjp")

    def causal_profile_sums(self, x, y, w, profiles, *, xp):
        """The forward of :meth:`causal_profiles_vjp`, uncombined (``gives_causal_sums``)."""
        raise self._missing("causal_profile_sums")

    def decodes(self, k) -> bool:
        """Whether :meth:`decode_runs` can hold a ``DecodeCache`` whose keys are like ``k``."""
        return False

    def decode_runs(self, xp, work, profile, *, center: bool, normalizer, dv: int):
        """The runs of a ``DecodeCache`` (docs/mathematics.rst, "Decoding"): an object with
        ``append(k, v, key_mask)``, ``attend(q, ...)`` and ``length``, for the op of ``profile``
        (array parameters of ``xp``) and its options, over ``dv`` value columns. Its ``compiled``
        attribute says whether it reads any float dtype and writes the output dtype it is given
        (``attend(q, dtype)``), or takes the work dtype ``work`` and a boolean key mask."""
        raise self._missing("decode_runs")

    # -- what the adapters call ---------------------------------------------------------------
    def forward(self, spec, arrays, *, xp, for_backward=False):
        """``(out, residuals)``: the output in the work dtype and a flat tuple of arrays.

        ``for_backward``: whether :meth:`backward` will be called with these residuals (the adapters
        know: an autograd node or a :func:`slicedkern.vjp` record); without it an engine may return
        fewer residuals, and the backward recomputes what it lacks.
        """
        if isinstance(spec, KernelSumSpec):
            x, y, w = arrays
            return self.kernel_sum(x, y, w, Profile.of(spec.kernel), xp=xp), ()
        q, k, v, mask, params = unpack(spec, arrays)
        inputs, form = Inputs(q, k, v, mask), Form(profile_of(spec, params), spec.normalizer, spec.center)
        ok = params_ok(xp, spec, params)
        if spec.causal:
            out, residuals = self.causal_attention(inputs, form, xp=xp)
        elif self.folds_row_ok and ok is not None:
            return self.attention(inputs, form, xp=xp, for_backward=for_backward, row_ok=ok)
        else:
            out, residuals = self.attention(inputs, form, xp=xp, for_backward=for_backward)
        if ok is not None:
            nan = scalar(xp, float("nan"), dtype=out.dtype, device=array_device(out))
            out = xp.where(ok[..., None, None], out, nan)
        return out, residuals

    def residual_layout(self, spec, arrays, *, xp) -> tuple | None:
        """The ``(shape, dtype)`` of each residual :meth:`forward` with ``for_backward`` returns for
        ``arrays`` (read for their shapes and dtypes only: a registered torch operator declares its
        outputs before it runs, slicedkern/adapters/_torch_ops.py), or None where they depend on more
        than shapes: a compiled call then keeps none, and the backward recomputes what it lacks.

        The default is the per-query residuals ``(take, relu_count[, den])`` of the generic backward,
        for attention (kernel sums keep none).
        """
        if isinstance(spec, KernelSumSpec):
            return ()
        q, k = arrays[0], arrays[1]
        per_query = ((tuple(q.shape) + (1,), q.dtype),)
        return (((tuple(k.shape), xp.bool),) + per_query * (2 if spec.normalizer.summed else 1))

    def backward(self, spec, arrays, out, residuals, g, *, xp):
        """Cotangents of every array of ``arrays`` (``None`` for the mask), given the forward's
        ``out`` and ``residuals`` and the output cotangent ``g`` (the output's or the work dtype)."""
        if isinstance(spec, KernelSumSpec):
            x, y, w = arrays
            dx, dy, dw, _ = self.kernel_sum_vjp(x, y, w, Profile.of(spec.kernel), g, xp=xp)
            return as_work(xp, dx, x.dtype), as_work(xp, dy, y.dtype), as_work(xp, dw, w.dtype)
        q, k, v, mask, params = unpack(spec, arrays)
        vjp = self.causal_attention_vjp if spec.causal else self.attention_vjp
        dq, dk, dv, (dknots, dcoeffs) = vjp(Inputs(q, k, v, mask), Form(profile_of(spec, params), spec.normalizer,
                                                                         spec.center), g, out, residuals, xp=xp)
        grads = [as_work(xp, dq, q.dtype), as_work(xp, dk, k.dtype), as_work(xp, dv, v.dtype)]
        if spec.has_mask:
            grads.append(None)
        if spec.param_layout:
            grads += list(param_grads(xp, spec, params, dknots, dcoeffs))
        return tuple(grads)

    # -- the backward: the generic one over the primitives unless an engine writes its own ---------
    def kernel_sum_vjp(self, x, y, w, profile, g, *, xp):
        """``(dx, dy, dw, (dknots, dcoeffs))`` of a kernel sum with cotangent ``g`` (any float dtype)."""
        return _vjp.kernel_sum_vjp(self, x, y, w, profile, as_work(xp, g, x.dtype), xp=xp)

    def attention_vjp(self, inputs: Inputs, form: Form, g, out, residuals, *, xp):
        """``(dq, dk, dv, (dknots, dcoeffs))`` of attention with cotangent ``g`` (any float dtype), given
        the forward's ``out`` and ``residuals``; knot / coefficient gradients are aligned with
        ``form.profile.knots`` / ``.coeffs`` (``None`` for float parameters). The default is the
        generic backward over this engine's profile-sum VJP (:func:`._vjp.attention_bwd`)."""
        return _vjp.attention_bwd(self, inputs, form, g, out, self.aux_of(residuals), xp=xp)

    def causal_attention_vjp(self, inputs: Inputs, form: Form, g, out, residuals, *, xp):
        """:meth:`attention_vjp` of :meth:`causal_attention` (engines with ``supports_causal``):
        :func:`._vjp.causal_bwd` by default."""
        return _vjp.causal_bwd(self, inputs, form, g, out, self.aux_of(residuals), xp=xp)

    def aux_of(self, residuals):
        """The per-query residuals of :meth:`attention` as the backward reads them (``None``: recompute)."""
        if not residuals:
            return None
        return dict(zip(_AUX_NAMES, residuals))

    @staticmethod
    def residuals_of(aux: dict) -> tuple:
        """The inverse of :meth:`aux_of`: the flat residuals ``(take, relu_count[, den])`` of ``aux``."""
        return tuple(aux[name] for name in _AUX_NAMES if name in aux)

    def __repr__(self):
        return f"<slicedkern engine {self.name!r}>"
