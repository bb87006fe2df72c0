"""``DecodeCache``: causal attention one generated token (or chunk) at a time, polylog cost per token."""

from __future__ import annotations

from .._lib.namespace import array_device, shape_str
from .._spec import OP_DEFAULTS, AttentionSpec, Normalizer, profile_of
from .._validate import check_bool, check_eps, check_normalize, hat_floats, setup
from ..backends import is_array, without_gradient
from ..engines import decoder
from ..kernels import Hat, HatMixture, PiecewiseLinear, Profile, ReLU
from .attention import hat_spec, nan_rows_without_keys

__all__ = ["DecodeCache"]

_NO_GRADIENT = ("DecodeCache is inference-only: its outputs have no gradient. Generate without differentiating "
                "(torch.no_grad(), or outside jax.grad); to train, call the attention op with causal=True")

#: op name -> its keywords with their defaults (the ops' table; a mixture's hats have no default)
_OPTIONS = {**OP_DEFAULTS, "hat_mixture": {"bandwidths": None, "weights": None, **OP_DEFAULTS["hat_mixture"]}}


def _floats_or_array(value, name, *, positive, single):
    """:func:`hat_floats`, with a ``TypeError`` at construction for what is neither numbers nor an
    array (an array is checked at the first ``append``)."""
    floats = hat_floats(value, name, positive=positive, single=single)
    if floats is None and not is_array(value):
        what = "a number" if single else "a sequence of numbers"
        raise TypeError(f"argument {name!r} must be {what} or an array, got {type(value).__name__}")
    return floats


def _hat_floats(op, options) -> tuple | None:
    """The hat parameters of ``op`` as floats, checked as the ops check them (``(bandwidths,
    weights)``), or ``None`` when one of them is an array (per head, say): their profile is built
    at the first ``append``, when the batch shape and the library are known."""
    if op == "hat":
        bandwidths = _floats_or_array(options["bandwidth"], "bandwidth", positive=True, single=True)
        return None if bandwidths is None else (bandwidths, (1.0,))
    bandwidths = _floats_or_array(options["bandwidths"], "bandwidths", positive=True, single=False)
    weights = _floats_or_array(options["weights"], "weights", positive=False, single=False)
    if bandwidths is None or weights is None:
        return None
    if len(bandwidths) != len(weights):
        raise ValueError(f"arguments 'bandwidths' and 'weights' must have one entry per hat, got "
                         f"{len(bandwidths)} and {len(weights)}")
    return bandwidths, weights


def _kernel(op, options) -> PiecewiseLinear | None:
    """The fixed profile of ``op``, or ``None`` for hat parameters given as arrays."""
    if isinstance(op, PiecewiseLinear):
        return op
    if op == "relu":
        return ReLU()
    floats = _hat_floats(op, options)
    if floats is None:
        return None
    return Hat(floats[0][0]) if op == "hat" else HatMixture(*floats)


def _array_profile(hats, xp, work, k) -> Profile:
    """The profile of hat parameters given as arrays, broadcast to the batch shape of ``k``."""
    batch = tuple(k.shape[:-1])
    fields, params = hats(xp, array_device(k), work, batch)
    spec = AttentionSpec(kernel=fields.get("kernel"), family=fields.get("family"), fixed=fields.get("fixed", ()),
                         param_layout=tuple(params))
    params = {name: xp.broadcast_to(without_gradient(p, _NO_GRADIENT),
                                    batch if name == "bandwidth" else batch + (p.shape[-1],))
              for name, p in params.items()}
    return profile_of(spec, params)


def _gradient_guard(guard, *arrays):
    """A zero that depends on every array here that records a gradient (marked by
    :func:`without_gradient`): added to the host runs' outputs, which read the arrays' memory and so
    drop their history, it makes differentiating them raise the cache's refusal, as the array-API
    runs' outputs do."""
    for a in arrays:
        if getattr(a, "requires_grad", False) and a.numel() > 0:
            zero = (a.reshape(-1)[:1] * 0).sum()
            guard = zero if guard is None else guard + zero
    return guard


def _signature(a) -> tuple:
    """What the checks of an argument depend on: its type, dtype, shape and device, and whether it
    records a gradient (never its values)."""
    return type(a), a.dtype, tuple(a.shape), getattr(a, "device", None), getattr(a, "requires_grad", False)


class DecodeCache:
    """Incremental causal attention for autoregressive generation (docs/mathematics.rst, "Decoding").

    Holds the keys and values appended so far for a batch of rows and answers queries that see all
    of them, exactly as the causal op does for those positions: after ``append(k[..., :t + 1], ...)``
    (in one or several calls), ``attend(q[..., t:t + 1])`` is row ``t`` of the op with ``causal=True``.
    The keys are kept as sorted runs of decreasing sizes merged like the carries of a binary counter:
    ``O(log n)`` runs, each key re-sorted ``O(log n)`` times, so an append costs amortised
    ``O(D log^2 n)`` and an attend of ``M`` queries ``O(M (log^2 n + D log n))``, with no ``O(n)``
    work per token; memory ``O(n D)`` like a softmax KV cache. Inference only: differentiating an
    output (torch ``backward``, ``jax.grad``) through the cache's keys, values or queries raises
    (``RuntimeError`` on torch, ``TypeError`` on JAX) rather than leaving their gradients silently
    empty; generate under ``torch.no_grad()``. Padding is a ``key_mask`` of :meth:`append`, as the
    ops' (a left-padded prompt's pad keys count nowhere); any array-API backend. The first
    :meth:`append` chooses where the runs live, through the engines (:func:`~slicedkern.use_engine`
    applies): compiled on the host for NumPy arrays and CPU torch tensors (the sweep), on the GPU
    for CUDA torch tensors (triton), as array-API code elsewhere (the scan).

    Parameters
    ----------
    op : {"relu", "hat", "hat_mixture"} or slicedkern.kernels.PiecewiseLinear
        The attention op: :func:`~slicedkern.relu_attention`, :func:`~slicedkern.hat_attention`,
        :func:`~slicedkern.hat_mixture_attention`, or :func:`~slicedkern.kernel_attention` with this
        kernel.
    **options
        The op's own keywords, with its defaults: ``center``, ``normalize``, ``eps``,
        ``bandwidth`` (hat), ``bandwidths`` and ``weights`` (hat_mixture). The hat parameters are
        checked as the ops check them: a number (a mixture's: sequences of numbers, at least one
        hat; weights finite, bandwidths positive and finite), or arrays as the ops take them (a
        bandwidth of shape ``(H,)`` per head of a ``(B, H)`` batch, say; mixtures ``(..., K)``), of
        the library of the keys, checked against their batch shape at the first :meth:`append`;
        they get no gradient.

    Examples
    --------
    >>> import numpy as np, slicedkern
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(2, 5)), rng.normal(size=(2, 5)), rng.normal(size=(2, 5, 3))
    >>> cache = slicedkern.DecodeCache("relu")
    >>> rows = []
    >>> for t in range(5):
    ...     cache.append(k[:, t:t + 1], v[:, t:t + 1])
    ...     rows.append(cache.attend(q[:, t:t + 1]))
    >>> full = slicedkern.relu_attention(q, k, v, causal=True)
    >>> np.allclose(np.concatenate(rows, axis=1), full)
    True
    """

    def __init__(self, op, **options):
        name = "kernel" if isinstance(op, PiecewiseLinear) else op
        if name not in _OPTIONS:
            raise ValueError(f"argument 'op' must be 'relu', 'hat', 'hat_mixture' or a "
                             f"slicedkern.kernels.PiecewiseLinear, got {op!r}")
        unknown = sorted(set(options) - set(_OPTIONS[name]))
        if unknown:
            raise TypeError(f"argument(s) {unknown} are not options of the {name!r} op; "
                            f"it takes {sorted(_OPTIONS[name])}")
        opts = {**_OPTIONS[name], **options}
        kernel = _kernel(op, opts)
        if kernel is None:
            # validated against the batch shape at the first append, as the ops validate them
            names = ("bandwidth", "weights") if name == "hat" else ("bandwidths", "weights")
            self._hats = hat_spec(opts[names[0]], None if name == "hat" else opts["weights"], names)
            self._profile = None
        else:
            self._hats, self._profile = None, Profile.of(kernel)
        check_normalize(opts["normalize"])
        self._normalizer = Normalizer(opts["normalize"], check_eps(opts["eps"]))
        self._center = check_bool(opts.get("center", False), "center")
        self._runs = None
        self._shape = None          # (batch shape, dv, namespace, work dtype, output dtype)
        self._guard = None          # host runs: what carries the refusal of a gradient to the outputs
        # host runs: the signatures of the last append's (k, v) and attend's q that passed every check,
        # and the attend's output dtype. A token's call with the same signatures skips the checks, which
        # would cost more than the compiled work (docs/benchmarks.rst, "Decoding")
        self._append_checked = None
        self._attend_checked = None

    def __len__(self) -> int:
        """The number of keys appended so far."""
        return 0 if self._runs is None else self._runs.length

    def append(self, k, v, key_mask=None) -> None:
        """Append keys ``k`` (..., t) and values ``v`` (..., t, Dv), in position order, to every row.

        ``key_mask`` (bool, broadcasting to ``k``'s shape, optional): True where the key takes part,
        as the ops' ``key_mask``; a masked key (a left-padded prompt's padding, say) is in no sum,
        mean or normaliser, and its values are not read for the NaN rule.
        """
        if key_mask is None and self._append_checked is not None and self._append_checked == (_signature(k),
                                                                                              _signature(v)):
            self._runs.append(k, v, None)
            return
        xp, _, out_dtype, work = setup({"k": k, "v": v, "key_mask": key_mask}, None, required=("k", "v"))
        if k.ndim < 1 or v.ndim != k.ndim + 1 or tuple(v.shape[:-1]) != tuple(k.shape):
            raise ValueError(f"arguments 'k' and 'v' must have shapes (..., t) and (..., t, Dv), got "
                             f"{shape_str(k)} and {shape_str(v)}")
        if key_mask is not None:
            if key_mask.dtype != xp.bool:
                raise TypeError(f"argument 'key_mask' must be a boolean array, got {shape_str(key_mask)}")
            if key_mask.ndim > k.ndim or any(m not in (1, s) for m, s in zip(key_mask.shape[::-1], k.shape[::-1])):
                raise ValueError(f"argument 'key_mask' must broadcast to the keys' shape {tuple(k.shape)}, "
                                 f"got {shape_str(key_mask)}")
            key_mask = xp.broadcast_to(key_mask, tuple(k.shape))
        if self._shape is None:
            if self._hats is not None:
                self._profile = _array_profile(self._hats, xp, work, k)
            self._shape = (tuple(k.shape[:-1]), v.shape[-1], xp, work, out_dtype)
            self._runs = decoder(k).decode_runs(xp, work, self._profile, center=self._center,
                                                normalizer=self._normalizer, dv=v.shape[-1])
        batch, dv, xp0, work0, _ = self._shape
        if xp is not xp0 or tuple(k.shape[:-1]) != batch or v.shape[-1] != dv:
            raise ValueError(f"arguments 'k' and 'v' must continue the cache's rows: batch shape {batch}, "
                             f"Dv = {dv}, the same library; got {shape_str(k)} and {shape_str(v)}")
        if k.shape[-1] == 0:
            return
        # the runs keep no autograd history: an output that depends on k or v raises when differentiated
        k, v = without_gradient(k, _NO_GRADIENT), without_gradient(v, _NO_GRADIENT)
        if not self._runs.compiled:
            if key_mask is None:
                key_mask = xp.ones(tuple(k.shape), dtype=xp.bool, device=array_device(k))
            k = xp.astype(k, work0)
        else:                                     # the compiled runs read any float dtype, in float64
            self._guard = _gradient_guard(self._guard, k, v)
            signatures = (_signature(k), _signature(v))
            if key_mask is None and not any(sig[-1] for sig in signatures):     # neither records a gradient
                self._append_checked = signatures
        self._runs.append(k, v, key_mask)

    def attend(self, q):
        """Attention of queries ``q`` (..., M) over every key appended so far: (..., M, Dv).

        Zero while the appends so far hold no key (appends of ``t = 0`` keys), as the causal op
        gives a query that sees none; NaN for a non-finite query (keys appended or not), and for every
        query once a non-finite key or value has been appended (it sees that key).

        Raises
        ------
        ValueError
            Before the first :meth:`append` (the cache learns the batch shape, ``Dv`` and the library
            from it), or for ``q`` of another batch shape or library than the appended keys.

        Examples
        --------
        >>> import numpy as np, slicedkern
        >>> cache = slicedkern.DecodeCache("relu")
        >>> cache.append(np.zeros((1, 0)), np.zeros((1, 0, 2)))      # no key yet, but Dv = 2
        >>> cache.attend(np.zeros((1, 1)))
        array([[[0., 0.]]])
        """
        checked = self._attend_checked
        if checked is not None and self._guard is None and checked[0] == _signature(q):
            out = self._runs.attend(q, checked[1])
            return out if out.dtype == checked[1] else self._shape[2].astype(out, checked[1])
        if self._shape is None:
            raise ValueError("argument 'q': append keys and values before attending (the cache is empty)")
        batch, dv, xp, work, out_dtype = self._shape
        xp_q, _, q_dtype, _ = setup({"q": q}, None, required=("q",))
        if xp_q is not xp or tuple(q.shape[:-1]) != batch:
            raise ValueError(f"argument 'q' must have shape {batch} + (M,) from the cache's library, "
                             f"got {shape_str(q)}")
        if self._runs.length == 0 or q.shape[-1] == 0:
            empty = xp.zeros(q.shape + (dv,), dtype=xp.result_type(out_dtype, q_dtype), device=array_device(q))
            return nan_rows_without_keys(xp, q, q[..., :0], empty)
        q = without_gradient(q, _NO_GRADIENT)
        dtype = xp.result_type(out_dtype, q_dtype)
        if not self._runs.compiled:
            out = self._runs.attend(xp.astype(q, work))
        else:                                     # written in the output dtype where the kernel can
            out = self._runs.attend(q, dtype)
            guard = _gradient_guard(self._guard, q)
            if guard is not None:
                out = out + xp.astype(guard, out.dtype)
            elif self._guard is None:
                self._attend_checked = (_signature(q), dtype)
        return out if out.dtype == dtype else xp.astype(out, dtype)
