"""Fuzz: gradients of the sliced ops in R^d -- ``sliced_attention``, ``energy_distance``, ``mmd`` --
with respect to the point sets, against finite differences of dense float64 oracles.

Each example: points in R^d (d 2-3), explicit unit directions (P 1-3, as a NumPy array or an array
of the backend), batch dims 0-1, float64 and float32 mixed; the backend's reverse mode (torch
autograd; ``slicedkern.vjp`` for NumPy and array_api_strict; ``jax.vjp`` in the long profile) for a
random cotangent ``g``:

* ``sliced_attention(q, k, v, kernel, directions=theta, ...)`` -- every kernel of
  ``_cases.kernels``, every normaliser, ``center``, a key mask, ``causal`` -- gradients in ``q``,
  ``k`` (``(..., L, d)``) and ``v``; oracle ``slicedkern.reference.sliced_attention``.
* ``energy_distance(x, y, directions=theta, x_weights=, y_weights=)`` -- gradients in ``x``, ``y``
  and, under torch autograd, in the weights; oracle: the mean over the directions of the 1-D
  ``2 E|X - Y| - E|X - X'| - E|Y - Y'|`` of the projections (normalised weights) over
  ``kappa_d = Gamma(d/2) / (sqrt(pi) Gamma((d + 1)/2))``, summed densely.
* ``mmd(x, y, kernel, directions=theta, estimator="v" | "u")`` -- gradients in ``x``, ``y``; oracle:
  the dense V- or U-statistic of ``K(a, b) = mean_p f_even(<theta_p, a - b>)``,
  ``f_even(r) = (f(r) + f(-r)) / 2``.

The points come from a seeded generator (Hypothesis draws sizes, options, kernels, scales and the
seed), and are kept when every projected difference of two distinct points is at least ``1e-4``
of their scale away from every kink (the knots of ``f``, 0 for ``|r|`` and the normalisers;
the pairs ``i == i`` of one sample never move). Central differences of fourth order with a step of
1/64 of that distance, which the pieces between kinks -- linear in the points, or rational for
normalised attention -- differentiate exactly up to rounding.

Tolerance, as ``test_fuzz_gradients``: ``1e-6 (|fd| + max |fd|)`` plus four times the finite
differences' rounding error, ``noise / step``, where ``noise = 16 u (N + M + 8) S`` bounds the float64
error of one dense evaluation of ``sum(g * out)``: ``S`` is the sum of ``|g|`` times the absolute
terms the statistic adds (``sum_ij w_i w_j |r_ij|`` per sample pair for the energy distance,
``sum |coef| (|a| + L (|r| + T))`` for the MMD; ``_oracle.loss_noise`` per slice for attention), ``N``
the points, ``M`` the knots. The values themselves are judged within ``noise`` (relative to the
terms, as ``test_fuzz_ops``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _helpers import assert_meta, to_numpy
from hypothesis import assume, note
from hypothesis import strategies as st

import slicedkern
from slicedkern import reference

from ._cases import Arr, Case, kernels, log_uniform, promote
from ._causal import causal_loss_noise, has_causal_mode
from ._oracle import UNIT, assert_within, evaluate, fourth_order_gradient, loss_noise, power_of_two_scale

RTOL = 1e-6
STATS = ("sliced_attention", "energy_distance", "mmd")


# -------------------------------------------------------------------------------------------- cases
@st.composite
def sliced_examples(draw, stat: str, *, dtypes=("float64", "float32")):
    """``{"stat", "arrays": {name: Arr}, "kernel", "options", "theta", "theta_on_backend", "g",
    "positional": names, "weights": names}``."""
    batch = tuple(draw(st.lists(st.integers(1, 2), max_size=1)))
    d, p = draw(st.integers(2, 3)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    scale = log_uniform(draw, -3.0, 3.0)
    raw = rng.normal(size=(p, d))
    theta = raw / np.linalg.norm(raw, axis=-1, keepdims=True)
    ex = {"stat": stat, "theta": theta, "theta_on_backend": draw(st.booleans()), "options": {}, "kernel": None,
          "scale": scale}

    def points(n, dtype):
        return Arr.rounded(rng.uniform(-1.0, 1.0, size=batch + (n, d)) * scale, dtype)

    if stat == "sliced_attention":
        lq, lk, dv = draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(1, 2))
        q_dt, k_dt, v_dt = (draw(st.sampled_from(dtypes)) for _ in range(3))
        ex["arrays"] = {"q": points(lq, q_dt), "k": points(lk, k_dt),
                        "v": Arr.rounded(rng.uniform(-1.0, 1.0, size=batch + (lk, dv)), v_dt)}
        ex["kernel"] = draw(kernels(scale))
        ex["positional"], ex["weights"] = ("q", "k", "v"), ()
        options = {"normalize": draw(st.sampled_from(("abs", "relu", "count", None))), "center": draw(st.booleans()),
                   "causal": draw(st.booleans())}
        if draw(st.booleans()):
            mask = rng.random(batch + (lk,)) < 0.8
            options["key_mask"] = Arr(mask, "bool")
        ex["options"] = options
        ex["eps_far_below"] = draw(st.booleans())
        out_shape = batch + (lq, dv)
        out_dtype = promote(q_dt, k_dt, v_dt)
    else:
        least = 1
        if stat == "mmd":
            ex["options"]["estimator"] = draw(st.sampled_from(("v", "u")))
            least = 2 if ex["options"]["estimator"] == "u" else 1
            ex["kernel"] = draw(kernels(scale))
        n, m = draw(st.integers(least, 5)), draw(st.integers(least, 5))
        x_dt, y_dt = (draw(st.sampled_from(dtypes)) for _ in range(2))
        ex["arrays"] = {"x": points(n, x_dt), "y": points(m, y_dt)}
        ex["positional"], ex["weights"] = ("x", "y"), ()
        if stat == "energy_distance":
            for name, size in (("x_weights", n), ("y_weights", m)):
                if draw(st.booleans()):
                    shape = draw(st.sampled_from(((size,), batch + (size,))))
                    dtype = x_dt if name == "x_weights" else y_dt
                    ex["arrays"][name] = Arr.rounded(rng.uniform(0.5, 1.5, size=shape), dtype)
            ex["weights"] = tuple(n for n in ("x_weights", "y_weights") if n in ex["arrays"])
        out_shape, out_dtype = batch, promote(x_dt, y_dt)
    ex["g"] = Arr.rounded(rng.uniform(-1.0, 1.0, size=out_shape), out_dtype).values
    ex["out_dtype"] = out_dtype
    return ex


def _knots(kernel, normalizer_knots: bool) -> list:
    knots = [0.0] if normalizer_knots else []
    if kernel is not None:
        knots += list(kernel.knots) + [-t for t in kernel.knots]
    return knots or [0.0]


def kink_distance(ex) -> float:
    """Smallest ``|<theta_p, a_i - b_j> - t|`` over distinct points of the pairs the statistic sums
    and the kinks ``t`` (module docstring)."""
    a = ex["arrays"]
    theta = ex["theta"]
    if ex["stat"] == "sliced_attention":
        pairs = [(a["q"].values, a["k"].values, False)]
    else:
        x, y = a["x"].values, a["y"].values
        pairs = [(x, y, False), (x, x, True), (y, y, True)]
    knots = np.asarray(_knots(ex["kernel"], True))
    gap = math.inf
    for left, right, same in pairs:
        diffs = (left @ theta.T)[..., :, None, :] - (right @ theta.T)[..., None, :, :]     # (..., n, m, P)
        if same:
            diffs = diffs[..., ~np.eye(left.shape[-2], dtype=bool), :]
        if diffs.size:
            gap = min(gap, float(np.min(np.abs(diffs[..., None] - knots))))
    return gap


# ------------------------------------------------------------------------------------------ oracles
def _kappa(d: int) -> float:
    return math.exp(math.lgamma(d / 2) - math.lgamma((d + 1) / 2)) / math.sqrt(math.pi)


def dense(ex, arrays: dict, *, absolute: bool = False):
    """The dense float64 oracle on NumPy ``arrays``; ``absolute``: the sum of the absolute terms
    instead (for the noise bound of the energy distance and the MMD)."""
    theta, stat = ex["theta"], ex["stat"]
    if stat == "sliced_attention":
        options = {k: (v.values if isinstance(v, Arr) else v) for k, v in ex["options"].items()}
        with np.errstate(all="ignore"):
            return np.asarray(reference.sliced_attention(arrays["q"], arrays["k"], arrays["v"], ex["kernel"],
                                                         directions=theta, **options))
    x, y = arrays["x"], arrays["y"]
    px, py = x @ theta.T, y @ theta.T                          # (..., n, P), (..., m, P)
    n, m = px.shape[-2], py.shape[-2]
    if stat == "energy_distance":
        a = arrays.get("x_weights", np.ones(n))
        b = arrays.get("y_weights", np.ones(m))
        a, b = a / a.sum(axis=-1, keepdims=True), b / b.sum(axis=-1, keepdims=True)

        def mean_abs(u, wu, w, ww, sign):
            r = np.abs(u[..., :, None, :] - w[..., None, :, :]).mean(axis=-1)      # (..., n, m)
            return sign * np.einsum("...i,...ij,...j->...", wu, r, ww)
        signs = (1.0, 1.0, 1.0) if absolute else (2.0, -1.0, -1.0)
        total = (mean_abs(px, a, py, b, signs[0]) * (2.0 if absolute else 1.0) + mean_abs(px, a, px, a, signs[1])
                 + mean_abs(py, b, py, b, signs[2]))
        return total / _kappa(theta.shape[-1])
    kernel = ex["kernel"]
    lipschitz = abs(kernel.slope) + sum(abs(c) for c in kernel.coeffs)
    reach = max((abs(t) for t in kernel.knots), default=0.0)

    def gram(u, w):
        r = u[..., :, None, :] - w[..., None, :, :]
        if absolute:
            return (abs(kernel.intercept) + lipschitz * (np.abs(r) + reach)).mean(axis=-1)
        return (0.5 * (kernel(r) + kernel(-r))).mean(axis=-1)
    kxx, kyy, kxy = gram(px, px), gram(py, py), gram(px, py)
    if ex["options"]["estimator"] == "v":
        within = kxx.sum(axis=(-2, -1)) / (n * n), kyy.sum(axis=(-2, -1)) / (m * m)
    else:
        off_x, off_y = ~np.eye(n, dtype=bool), ~np.eye(m, dtype=bool)
        within = (np.where(off_x, kxx, 0.0).sum(axis=(-2, -1)) / (n * (n - 1)),
                  np.where(off_y, kyy, 0.0).sum(axis=(-2, -1)) / (m * (m - 1)))
    return within[0] + within[1] + (2.0 if absolute else -2.0) * kxy.sum(axis=(-2, -1)) / (n * m)


def loss(ex, arrays, g) -> float:
    return math.fsum((dense(ex, arrays) * g).ravel())


def noise_of(ex, arrays, g, *, linear: str | None = None) -> float:
    """Bound of the float64 rounding error of one :func:`loss` (module docstring); ``linear``: of
    the loss with that (linear) argument set to ones."""
    if linear is not None:
        arrays = {**arrays, linear: np.ones_like(arrays[linear])}
    if ex["stat"] != "sliced_attention":
        n_points = arrays["x"].shape[-2] + arrays["y"].shape[-2]
        knots = len(ex["kernel"].knots) if ex["kernel"] is not None else 0
        terms = np.abs(g) * dense(ex, arrays, absolute=True)
        return 16.0 * UNIT * (n_points + knots + 8) * float(np.sum(terms))
    theta = ex["theta"]
    options = dict(ex["options"])
    causal = options.pop("causal")
    total = 0.0
    for row in theta:
        args = (Arr(arrays["q"] @ row, "float64"), Arr(arrays["k"] @ row, "float64"), Arr(arrays["v"], "float64"),
                ex["kernel"])
        case = Case("kernel_attention", args, options)
        if causal:
            total += causal_loss_noise(Case("kernel_attention", args, {**options, "causal": True}), g)
        else:
            total += loss_noise(case, g, evaluate(case, *case.numpy()))
    return 4.0 * total / theta.shape[0]       # the projections' own rounding: a few more ulps


def finite_difference(ex, arrays, g, name, step):
    """Fourth-order central differences of :func:`loss` in ``arrays[name]`` (``g`` scaled by a power
    of two against the underflow of tiny products ``g * out``)."""
    scale = power_of_two_scale(g)
    g = g / scale
    return scale * fourth_order_gradient(lambda moved: loss(ex, {**arrays, name: moved}, g), arrays[name], step)


# --------------------------------------------------------------------------------------- gradients
def _call(ex, backend, values: dict, *, fn=None):
    """The op (or ``fn(op, *positional, **keywords)``) on backend arrays ``values``: the point sets
    (and values) positional, directions, weights and options as keywords."""
    directions = backend.asarray(ex["theta"]) if ex["theta_on_backend"] else ex["theta"]
    stat = ex["stat"]
    if stat == "sliced_attention":
        options = {k: (v.on(backend) if isinstance(v, Arr) else v) for k, v in ex["options"].items()}
        op, args = slicedkern.sliced_attention, (values["q"], values["k"], values["v"], ex["kernel"])
    elif stat == "energy_distance":
        options = {n: values[n] for n in ex["weights"]}
        op, args = slicedkern.energy_distance, (values["x"], values["y"])
    else:
        op, args, options = slicedkern.mmd, (values["x"], values["y"], ex["kernel"]), dict(ex["options"])
    return (fn or (lambda f, *a, **kw: f(*a, **kw)))(op, *args, directions=directions, **options)


def backend_gradients(ex, backend, engine):
    """``(out, {name: gradient})`` from the backend's reverse mode."""
    values = {name: a.on(backend) for name, a in ex["arrays"].items()}
    g = backend.asarray(ex["g"], dtype=ex["out_dtype"])
    positional = ex["positional"]
    if backend.name in ("torch", "torch_cuda"):
        import torch
        names = positional + ex["weights"]
        for name in names:
            values[name].requires_grad_(True)
        out = engine.call(_call, ex, backend, values)
        found = torch.autograd.grad(out, [values[n] for n in names], grad_outputs=g, allow_unused=True)
        return out.detach(), {n: (torch.zeros_like(values[n]) if f is None else f) for n, f in zip(names, found)}
    if backend.is_jax:
        import jax

        def partial(*args):
            return _call(ex, backend, {**values, **dict(zip(positional, args))})
        out, pullback = engine.call(jax.vjp, partial, *(values[n] for n in positional))
        return out, dict(zip(positional, engine.call(pullback, g)))
    # slicedkern.vjp of the op itself (a wrapper around a sliced op is refused: test_fuzz_vjp_wrappers)
    out, pullback = engine.call(_call, ex, backend, values, fn=slicedkern.vjp)
    grads = engine.call(pullback, g)
    assert len(grads) == len(positional) + (ex["kernel"] is not None)
    assert all(grad is None for grad in grads[len(positional):]), "a gradient for the kernel"
    return out, dict(zip(positional, grads))


def check_gradients(backend, engine, ex):
    gap = kink_distance(ex)
    assume(gap >= 1e-4 * ex["scale"])
    if ex["options"].get("causal"):
        assume(has_causal_mode(backend, engine))         # not the sweep on JAX arrays (tests/test_causal.py)
    arrays = {name: a.values.copy() for name, a in ex["arrays"].items()}
    if ex["stat"] == "sliced_attention":
        q, k = arrays["q"] @ ex["theta"].T, arrays["k"] @ ex["theta"].T
        spread = float(np.max(np.abs(q), initial=0.0) + np.max(np.abs(k), initial=0.0)) + ex["scale"]
        # far below every non-zero normaliser (>= gap), or above every normaliser and its excursions
        ex["options"]["eps"] = 1e-3 * gap if ex["eps_far_below"] else 1e4 * spread * (k.shape[-2] + 1)
    note(f"backend {backend.name}, engine {engine.name!r}, kink distance {gap:.3e}; {ex['stat']} with "
         f"arrays {ex['arrays']!r}\ntheta = np.array({ex['theta'].tolist()!r})\nkernel = {ex['kernel']!r}\n"
         f"options = {ex['options']!r}\ncotangent g = np.array({ex['g'].tolist()!r})")
    out, grads = backend_gradients(ex, backend, engine)
    g = ex["g"]
    expected = dense(ex, arrays)
    noise = noise_of(ex, arrays, g if g.ndim else np.asarray(g))
    value_noise = noise_of(ex, arrays, np.ones_like(g))
    assert_meta(out, backend=backend, shape=expected.shape, dtype=backend.dtype(ex["out_dtype"]))
    assert_within(to_numpy(out), expected, value_noise, ex["out_dtype"], what=f"{ex['stat']} value")
    for name, grad in grads.items():
        assert grad is not None, f"no gradient for {name!r}"
        assert_meta(grad, like=ex["arrays"][name].on(backend))
        if name in ("q", "k", "x", "y"):
            step, allowance = gap / 64.0, 0.0
        elif name == "v":
            step = float(np.max(np.abs(arrays["v"]), initial=0.0)) or 1.0
            allowance = 4.0 * noise_of(ex, arrays, g, linear="v")
        else:                                   # weights: smooth (a normalisation), any small step
            step, allowance = 1e-3 * float(np.min(arrays[name])), 0.0
        fd = finite_difference(ex, arrays, g, name, step)
        bound = RTOL * (np.abs(fd) + float(np.max(np.abs(fd), initial=0.0))) + 4.0 * noise / step + allowance
        assert_within(to_numpy(grad), fd, bound, ex["arrays"][name].dtype,
                      what=f"d{name} of {ex['stat']} (central differences)")


@pytest.mark.parametrize("stat", STATS)
def test_sliced_gradients_match_finite_differences(xp, engine, fuzz, stat):
    if xp.is_jax and fuzz.bounded:
        pytest.skip("JAX: sliced ops compile per shape and slice chunk; SLICEDKERN_FUZZ=long runs them")
    dtypes = ("float64",) if xp.is_jax else ("float64", "float32")
    fuzz.run(sliced_examples(stat, dtypes=dtypes), lambda ex: check_gradients(xp, engine, ex), backend=xp.name,
             weight=0.6)


# ------------------------------------------------------------------------------------------ findings
@pytest.mark.parametrize("one_dimensional", [False, True], ids=["Rd", "1d"])
def test_mmd_of_a_knotless_kernel_keeps_the_autograd_graph(one_dimensional):
    """``mmd(x, y, f)`` with ``f = PiecewiseLinear(slope=1.0)`` (even part 0): the statistic is 0 for
    every sample, so its gradient is 0; under torch autograd it must still be a function of ``x``
    and ``y`` (``requires_grad``), as every other op's output is, so that ``backward()`` works."""
    torch = pytest.importorskip("torch")
    from slicedkern.kernels import PiecewiseLinear

    points = np.array([[0.0, 1.0], [0.5, -1.0], [2.0, 0.25]])
    points = points[:, 0] if one_dimensional else points
    x = torch.tensor(points, requires_grad=True)
    y = torch.tensor(points + 0.25, requires_grad=True)
    options = {} if one_dimensional else {"directions": np.array([[0.6, 0.8]])}
    out = slicedkern.mmd(x, y, PiecewiseLinear(slope=1.0), **options)
    assert out.requires_grad
    dx, dy = torch.autograd.grad(out, (x, y))
    assert not torch.any(dx) and not torch.any(dy)
