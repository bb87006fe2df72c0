"""Fuzz: ``slicedkern.vjp(fn, *args)`` where ``fn`` WRAPS an attention op, against finite differences.

``vjp`` finds each input of the op among ``fn``'s positional arguments by identity (not by name or
order), adds the gradients of an argument passed to several inputs, gives ``None`` to arguments that
are not floating arrays, and refuses (``TypeError``) a floating array argument that reaches the op
only through a computation, or not at all. Each example draws a call of one attention op
(``relu_attention``, ``hat_attention``, ``hat_mixture_attention``, ``kernel_attention``) and a wrapper:

* the op's array inputs become ``fn``'s positional arguments in a random ORDER, with non-array
  arguments (a float, a string, ``None``) and the boolean ``key_mask`` interleaved, and each input
  passed to the op positionally or by KEYWORD (``bandwidth=``, ``v=``, ...);
* REPEATED arguments: self-attention ``fn(x, v) = op(x, x, v)`` (one array as queries and keys), or
  one array as both the bandwidths and the weights of a hat mixture;
* an input passed to ``vjp`` as a keyword argument of ``fn`` (it gets no gradient, and needs none);
* a COMPUTED input (``op(2 * a, ...)``, ``a + 0``, ``-(-1 * a)``) or an UNUSED floating array argument:
  ``vjp`` must raise ``TypeError``.

The pullback of a random cotangent ``g`` must return one entry per positional argument of ``fn``,
shaped and typed like it: ``None`` for the non-arrays and the mask, and for each floating array the
derivative of ``sum(g * fn(...))`` -- compared with fourth-order central differences of ``fn`` with
the dense float64 ``slicedkern.reference`` op in place of the fast one, perturbing that argument
wherever it is passed. Inputs lie away from every kink: the smooth cases of ``_grad_cases`` (float64
and float32, broadcast batches, masks, per-head parameters), or for self-attention points on the
integer lattice (distinct within a row) with knots and bandwidths on the half-integers, jittered by
at most 1/16, so that every ``x_i - x_j - t`` with ``i != j`` is at least 5/16 from 0. The diagonal
``x_i - x_i = 0`` sits on a kink for good: the tie rule (``H(0) = 1`` in the query role, the left
derivative in the key role) makes its two pulls cancel, as ``f(0)`` is constant (docs/mathematics.rst,
"Ties").

Tolerance: ``test_fuzz_gradients``'s, ``1e-6 (|fd| + max |fd|)`` plus four times the finite
differences' rounding error (``_oracle.loss_noise`` / step) and, for a linear input (values,
mixture weights), the rounding of its own gradient; judged after rounding to the argument's dtype.

NumPy, array_api_strict and torch (vjp serves torch tensors too); JAX only in the long profile
(every wrapper shape compiles).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _helpers import assert_meta, to_numpy
from hypothesis import assume, note
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import slicedkern

from ._cases import POSITIONAL, Arr, Case, kernels, log_uniform
from ._grad_cases import kink_gap, smooth_gradient_cases
from ._oracle import assert_within, evaluate, fourth_order_gradient, loss_noise, magnitudes, power_of_two_scale

ATTENTION_OPS = ("relu_attention", "hat_attention", "hat_mixture_attention", "kernel_attention")
RTOL = 1e-6
SCORE_LIKE = ("q", "k", "bandwidth", "bandwidths")
#: Non-array positional arguments a wrapper may take besides the arrays (they get no gradient).
EXTRAS = (0.5, "a label", None)


def _compute(how: str, a):
    """``a`` computed on: a new array of the same values (``vjp`` cannot know its gradient)."""
    if how == "2 * a":
        return 2 * a
    return a + 0 if how == "a + 0" else -(-1 * a)


class Wrapper:
    """``fn(*args, **kw)``: calls ``op`` with each input taken from ``fn``'s arguments.

    ``sources[i]`` says where the op's ``i``-th positional input comes from: ``("arg", j)`` (``fn``'s
    positional argument ``j``), ``("kw", name)`` (``fn``'s keyword argument) or ``("computed", j,
    how)``. Inputs ``cut`` and later are passed to the op by keyword; ``mask`` is the key mask's
    source (or None); ``options`` are fixed keywords.
    """

    def __init__(self, op, sources, cut, mask, options):
        self.op, self.sources, self.cut, self.mask, self.options = op, sources, cut, mask, options

    def inputs(self, args, kw):
        values = []
        for source in self.sources:
            if source[0] == "arg":
                values.append(args[source[1]])
            elif source[0] == "kw":
                values.append(kw[source[1]])
            else:
                values.append(_compute(source[2], args[source[1]]))
        mask = None if self.mask is None else (args[self.mask[1]] if self.mask[0] == "arg" else kw[self.mask[1]])
        return values, mask

    def fast(self, *args, **kw):
        values, mask = self.inputs(args, kw)
        names = POSITIONAL[self.op]
        keywords = {names[i]: values[i] for i in range(self.cut, len(values))}
        if mask is not None:
            keywords["key_mask"] = mask
        return getattr(slicedkern, self.op)(*values[:self.cut], **keywords, **self.options)

    def dense(self, args, kw):
        """The wrapper with the dense float64 oracle (``_oracle.evaluate``: rows without keys 0)."""
        values, mask = self.inputs(args, kw)
        options = dict(self.options)
        if mask is not None:
            options["key_mask"] = mask
        return evaluate(Case(self.op, ()), values, options)

    def __repr__(self):
        names = POSITIONAL[self.op]
        parts = []
        for i, source in enumerate(self.sources):
            text = {"arg": lambda s: f"a{s[1]}", "kw": lambda s: f"kw[{s[1]!r}]",
                    "computed": lambda s: s[2].replace("a", f"a{s[1]}")}[source[0]](source)
            parts.append(text if i < self.cut else f"{names[i]}={text}")
        if self.mask is not None:
            source = f"a{self.mask[1]}" if self.mask[0] == "arg" else f"kw[{self.mask[1]!r}]"
            parts.append(f"key_mask={source}")
        parts += [f"{k}={v!r}" for k, v in self.options.items()]
        return f"lambda *a, **kw: slicedkern.{self.op}({', '.join(parts)})"


# ------------------------------------------------------------------------------------------ cases
@st.composite
def self_attention_cases(draw, op: str):
    """A case with ``q`` and ``k`` one array ``x`` (..., L): points on the integer lattice, distinct
    in each row, knots and bandwidths on the half-integers (module docstring)."""
    batch = tuple(draw(st.lists(st.integers(1, 2), max_size=1)))
    length, dv = draw(st.integers(1, 5)), draw(st.integers(1, 2))
    unit = log_uniform(draw, -10.0, 10.0)
    rows = [draw(st.permutations(range(-4, 5))) for _ in range(math.prod(batch))]
    points = np.asarray([r[:length] for r in rows], dtype=np.float64).reshape(batch + (length,))

    def jitter(shape):
        return np.asarray(draw(hnp.arrays(np.float64, shape, elements=st.floats(-1 / 16, 1 / 16))))

    x = Arr.rounded((points + jitter(points.shape)) * unit, "float64")
    v = Arr.rounded(np.asarray(draw(hnp.arrays(np.float64, batch + (length, dv),
                                                elements=st.floats(-1, 1, allow_subnormal=False)))), "float64")

    def half(n):
        return float((n + 0.5 + jitter(())) * unit)

    args = (x, x, v)
    if op == "kernel_attention":
        args += (draw(kernels(unit, lattice=lambda n: half(n if n >= 0 else n - 1))),)
    elif op == "hat_attention":
        args += (half(draw(st.integers(1, 3))),)
    elif op == "hat_mixture_attention":
        n = draw(st.integers(1, 3))
        args += ([half(draw(st.integers(1, 3))) for _ in range(n)],
                 [draw(st.floats(-2, 2, allow_subnormal=False)) for _ in range(n)])
    options = {"normalize": draw(st.sampled_from(("abs", "relu", "count", None)))}
    if op in ("relu_attention", "kernel_attention"):
        options["center"] = draw(st.booleans())
    options["eps"] = draw(st.sampled_from((1e-3 * unit, 1e4 * unit * 16 * length)))
    g = np.asarray(draw(hnp.arrays(np.float64, batch + (length, dv), elements=st.floats(-1, 1, allow_subnormal=False))))
    return Case(op, args, options), g, unit


def _self_gap(case: Case) -> float:
    """``kink_gap`` over the pairs ``i != j`` only (the diagonal is exactly 0 for good)."""
    x = case.args[0].values
    if x.shape[-1] < 2:
        return math.inf
    off = ~np.eye(x.shape[-1], dtype=bool)
    diffs = (x[..., :, None] - x[..., None, :])[..., off]
    cut = Case(case.op, (Arr(diffs.ravel(), "float64"), Arr(np.zeros(1), "float64"), case.args[2]) + case.args[3:])
    return kink_gap(cut)


@st.composite
def wrapper_examples(draw, op: str, *, few_shapes: tuple = ()):
    """``(case, cotangent, unit, wrapper, args, kw, expect_error)``."""
    kinds = ("reorder", "self", "keyword_input", "computed", "unused")
    kind = draw(st.sampled_from(kinds + (("shared_mixture",) if op == "hat_mixture_attention" else ())))
    if kind == "self":
        case, g, unit = draw(self_attention_cases(op))
    else:
        case, g, unit = draw(smooth_gradient_cases(op, few_shapes=few_shapes))
    if kind == "shared_mixture" and isinstance(case.args[3], Arr):
        case = Case(op, case.args[:4] + (case.args[3],), case.kwargs)   # weights = the bandwidths array
    arrays = [a for a in case.args if isinstance(a, Arr)]
    distinct = list({id(a): a for a in arrays}.values())
    # fn's positional arguments: the distinct arrays, the mask, a few non-arrays, in a random order
    items = [("array", a) for a in distinct]
    options = {name: value for name, value in case.kwargs.items() if name != "key_mask"}
    mask = case.kwargs.get("key_mask")
    if mask is not None:
        items.append(("mask", mask))
    items += [("extra", e) for e in draw(st.lists(st.sampled_from(EXTRAS), max_size=2))]
    kw_names = []
    if kind == "keyword_input":                # one array handed to vjp as a keyword of fn
        moved = draw(st.sampled_from([i for i, it in enumerate(items) if it[0] == "array"]))
        kw_names.append((f"kw_{moved}", items.pop(moved)[1]))
    if kind == "unused":
        items.append(("unused", Arr(np.zeros(3), "float64")))
    order = draw(st.permutations(range(len(items))))
    items = [items[i] for i in order]
    position = {id(it[1]): j for j, it in enumerate(items)}
    by_keyword = {id(a): name for name, a in kw_names}
    sources = []
    for a in case.args:
        if isinstance(a, Arr):
            sources.append(("kw", by_keyword[id(a)]) if id(a) in by_keyword else ("arg", position[id(a)]))
        else:
            sources.append(("const", a))
    computed = None
    if kind == "computed":
        candidates = [i for i, s in enumerate(sources) if s[0] == "arg"]
        slot = draw(st.sampled_from(candidates))
        computed = position[id(case.args[slot])]
        # every use of that argument is computed on first: it reaches the op only so
        sources = [("computed", s[1], draw(st.sampled_from(("2 * a", "a + 0", "-(-1 * a)"))))
                   if s[0] == "arg" and s[1] == computed else s for s in sources]
    mask_source = None
    if mask is not None:
        mask_source = ("kw", by_keyword[id(mask)]) if id(mask) in by_keyword else ("arg", position[id(mask)])
    # non-array inputs (Python floats, lists, kernels) reach fn as keywords; any input after the op's
    # positional-only arrays (q, k, v / x, y, w) may be passed to the op by keyword (those from `cut` on)
    cut = draw(st.integers(3, len(case.args)))
    constants = {i: s[1] for i, s in enumerate(sources) if s[0] == "const"}
    sources = [("kw", f"const_{i}") if s[0] == "const" else s for i, s in enumerate(sources)]
    kw = {name: a for name, a in kw_names}
    kw.update({f"const_{i}": value for i, value in constants.items()})
    wrapper = Wrapper(op, sources, cut, mask_source, options)
    args = [it[1] for it in items]
    expect_error = kind in ("computed", "unused")
    return case, g, unit, wrapper, args, kw, expect_error, kind


# ------------------------------------------------------------------------------------------- checks
def _on(backend, value):
    return value.on(backend) if isinstance(value, Arr) else value


def _numpy(value):
    return value.values.copy() if isinstance(value, Arr) else value


def check_wrapper(backend, engine, example):
    case, g, unit, wrapper, args, kw, expect_error, kind = example
    note(f"backend {backend.name}, engine {engine.name!r}, {kind}; fn = {wrapper!r}\n"
         f"positional arguments a0.. = {args!r}\nkeyword arguments kw = {kw!r}\n"
         f"cotangent g = np.array({g.tolist()!r})\nthe op's call (NumPy arrays):\n{case!r}")
    gap = _self_gap(case) if kind == "self" else kink_gap(case)
    assume(gap >= unit / 4.0)          # the lattice construction kept its margin (rounding included)
    b_args = [_on(backend, a) for a in args]
    b_kw = {name: _on(backend, a) for name, a in kw.items()}
    if expect_error:
        with pytest.raises(TypeError, match="vjp differentiates"):
            engine.call(slicedkern.vjp, wrapper.fast, *b_args, **b_kw)
        return
    out, pullback = engine.call(slicedkern.vjp, wrapper.fast, *b_args, **b_kw)
    out_dtype = np.result_type(*(np.dtype(a.dtype) for a in case.args[:3])).name
    g = Arr.rounded(g, out_dtype).values
    grads = pullback(Arr(g, out_dtype).on(backend))
    assert isinstance(grads, tuple) and len(grads) == len(args), (
        f"{len(grads)} gradients for {len(args)} positional arguments")

    n_args, n_kw = [_numpy(a) for a in args], {name: _numpy(a) for name, a in kw.items()}
    expected = wrapper.dense(n_args, n_kw)
    assert out.shape == expected.shape, f"output shape {tuple(out.shape)} != {expected.shape}"
    noise = loss_noise(case, g, evaluate(case, *case.numpy()))
    floor = magnitudes(case).floor
    for j, (a, grad) in enumerate(zip(args, grads)):
        if not isinstance(a, Arr) or a.dtype == "bool":
            assert grad is None, f"a gradient for the non-differentiable argument a{j} ({a!r})"
            continue
        assert grad is not None, f"no gradient for the array argument a{j}"
        assert_meta(grad, like=b_args[j])
        roles = [POSITIONAL[case.op][i] for i, s in enumerate(wrapper.sources) if s == ("arg", j)]
        assert roles, f"a{j} is no input of the op"
        score_like = any(r in SCORE_LIKE for r in roles)
        if score_like:
            step = min(gap, unit) / 64.0     # gap is inf without an off-diagonal pair
        else:
            step = float(np.max(np.abs(a.values), initial=0.0)) or 1.0
        allowance = 4.0 * noise / step + floor
        for i, role in enumerate(POSITIONAL[case.op][:len(case.args)]):
            if wrapper.sources[i] == ("arg", j) and role not in SCORE_LIKE:
                ones = case.replaced(i, np.ones(case.args[i].shape))
                allowance += 4.0 * loss_noise(ones, g, evaluate(ones, *ones.numpy()))
        fd = _finite_difference(wrapper, n_args, n_kw, j, g, step)
        bound = RTOL * (np.abs(fd) + float(np.max(np.abs(fd), initial=0.0))) + allowance
        assert_within(to_numpy(grad), fd, bound, a.dtype, what=f"d/da{j} (the op's {'/'.join(roles)})")


def _finite_difference(wrapper, args, kw, j, g, step):
    """Fourth-order central differences of ``sum(g * fn_dense(*args, **kw))`` in ``args[j]`` (with
    ``g`` scaled by a power of two, so that tiny products ``g * out`` do not underflow)."""
    scale = power_of_two_scale(g)
    g = g / scale

    def loss_of(moved):
        return math.fsum((wrapper.dense(args[:j] + [moved] + args[j + 1:], kw) * g).ravel())

    return scale * fourth_order_gradient(loss_of, args[j], step)


@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_vjp_of_wrappers_matches_finite_differences(xp, engine, fuzz, op):
    if xp.is_jax and fuzz.bounded:
        pytest.skip("JAX: every wrapper shape compiles; SLICEDKERN_FUZZ=long runs it")
    strategy = wrapper_examples(op, few_shapes=fuzz.layouts_for(xp))
    fuzz.run(strategy, lambda example: check_wrapper(xp, engine, example), backend=xp.name, weight=0.6)


# ------------------------------------------------------------------------------------------ findings
@pytest.mark.parametrize("stat", ["sliced_attention", "energy_distance", "mmd"])
def test_vjp_of_a_wrapper_around_a_sliced_op_says_how_to_call_it(stat):
    """A sliced (composite) op inside a wrapper is refused with a message that names the op and the
    call that works (it raised '0 such calls' or 'do not reach the op as they are' before); the op
    passed to vjp itself works (NumPy, float64)."""
    from slicedkern.kernels import Hat

    rng = np.random.default_rng(7)
    x, y, v = rng.normal(size=(4, 2)), rng.normal(size=(5, 2)), rng.normal(size=(5, 1))
    theta = np.array([[0.6, 0.8], [-0.8, 0.6]])
    extra = (v, Hat(1.0)) if stat == "sliced_attention" else (Hat(1.0),) if stat == "mmd" else ()
    direct_op = getattr(slicedkern, stat)
    with pytest.raises(TypeError, match=f"vjp differentiates {stat} only when it is passed to vjp itself"):
        slicedkern.vjp(lambda a, b: direct_op(b, a, *extra, directions=theta), y, x)
    out, pullback = slicedkern.vjp(direct_op, x, y, *extra, directions=theta)
    dx, dy = pullback(np.ones_like(out))[:2]
    assert dx.shape == x.shape and dy.shape == y.shape and np.all(np.isfinite(dx))
