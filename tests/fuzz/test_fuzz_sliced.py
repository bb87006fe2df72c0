"""Fuzz: ``sliced_kernel_sum`` on every backend and engine against a dense float64 oracle.

``S_i = (1/P) sum_p sum_j f(<theta_p, x_i - y_j>) w_j`` for points in R^d (d 1-3), explicit directions
(P 1-4 unit vectors, as a NumPy array or an array of the backend), every profile of
``_cases.kernels``, batch dims 0-1 that broadcast, n or m empty, w (..., m) or (..., m, c), float64 /
float32 mixed, ``chunk_size`` None, 1 or 2 (the slice axis split into several 1-D calls).

Tolerance: as ``test_fuzz_ops`` (``fl(e - E) <= a <= fl(e + E)``), with the projections' rounding in
``E``: ``C u (|a| + L (max |<theta, x>| + max |<theta, y>| + T)) sum_j |w_j|``, ``C = 8 (m + M + d + 8)``.
"""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import assert_meta, to_numpy
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from slicedkern.sliced import sliced_kernel_sum

from ._cases import Arr, kernels, log_uniform, promote
from ._oracle import TINY, UNIT, assert_within

#: The one shape JAX gets (each new shape compiles): batched, several slices, two columns.
JAX_SHAPE = {"batch": (2,), "n": 3, "m": 4, "d": 2, "p": 3, "columns": 2}


@st.composite
def sliced_cases(draw, *, jax: bool):
    """``(x, y, w, kernel, theta, theta_on_backend, chunk_size)`` with float64 values rounded to their
    dtype (:class:`._cases.Arr`)."""
    if jax:
        shape = JAX_SHAPE
    else:
        shape = {"batch": tuple(draw(st.lists(st.integers(1, 2), max_size=1))), "n": draw(st.integers(0, 6)),
                 "m": draw(st.integers(0, 6)), "d": draw(st.integers(1, 3)), "p": draw(st.integers(1, 4)),
                 "columns": draw(st.sampled_from((None, 1, 2)))}
    batch, d = shape["batch"], shape["d"]
    dtypes = ("float64",) if jax else ("float64", "float32")
    x_dt, y_dt, w_dt = (draw(st.sampled_from(dtypes)) for _ in range(3))
    scale = log_uniform(draw, -3.0, 3.0)
    unit = st.one_of(st.sampled_from((-1.0, -0.5, 0.0, 0.5, 1.0)), st.floats(-1.0, 1.0, allow_subnormal=False))
    x = Arr.rounded(draw(hnp.arrays(np.float64, batch + (shape["n"], d), elements=unit)) * scale, x_dt)
    y_batch = batch if draw(st.booleans()) else tuple(1 for _ in batch)
    y = Arr.rounded(draw(hnp.arrays(np.float64, y_batch + (shape["m"], d), elements=unit)) * scale, y_dt)
    w_core = (shape["m"],) if shape["columns"] is None else (shape["m"], shape["columns"])
    w = Arr.rounded(draw(hnp.arrays(np.float64, y_batch + w_core, elements=unit)), w_dt)
    raw = draw(hnp.arrays(np.float64, (shape["p"], d), elements=st.floats(-1.0, 1.0, allow_subnormal=False)))
    norms = np.linalg.norm(raw, axis=-1, keepdims=True)
    theta = np.where(norms > 1e-3, raw / np.where(norms > 1e-3, norms, 1.0), np.eye(d)[:1])
    kernel = draw(kernels(scale))
    return x, y, w, kernel, theta, draw(st.booleans()), draw(st.sampled_from((None, 1, 2)))


def dense_sliced(x, y, w, kernel, theta):
    """The oracle in float64: every slice's dense kernel matrix, averaged, times ``w``."""
    px, py = x @ theta.T, y @ theta.T                                   # (..., n, P), (..., m, P)
    vector = w.ndim == y.ndim - 1
    wc = w[..., None] if vector else w
    matrix = np.mean(kernel(px[..., :, None, :] - py[..., None, :, :]), axis=-1)   # (..., n, m)
    out = matrix @ wc
    return out[..., 0] if vector else out, px, py


def check_sliced(backend, engine, example):
    x, y, w, kernel, theta, theta_on_backend, chunk = example
    note(f"backend {backend.name}, engine {engine.name!r}; x = {x!r}\ny = {y!r}\nw = {w!r}\nkernel = {kernel!r}\n"
         f"theta = np.array({theta.tolist()!r})\nout = sliced_kernel_sum(x, y, w, kernel, directions=theta, "
         f"chunk_size={chunk!r})")
    directions = backend.asarray(theta) if theta_on_backend else theta
    out = engine.call(sliced_kernel_sum, x.on(backend), y.on(backend), w.on(backend), kernel,
                      directions=directions, chunk_size=chunk)
    with np.errstate(all="ignore"):
        expected, px, py = dense_sliced(x.values, y.values, w.values, kernel, theta)
    out_dtype = promote(x.dtype, y.dtype, w.dtype)
    assert_meta(out, backend=backend, shape=expected.shape, dtype=backend.dtype(out_dtype))
    lipschitz = abs(kernel.slope) + sum(abs(c) for c in kernel.coeffs)
    reach = max((abs(t) for t in kernel.knots), default=0.0)
    scores = np.max(np.abs(px), initial=0.0) + np.max(np.abs(py), initial=0.0)
    wc = w.values[..., None] if w.values.ndim == y.values.ndim - 1 else w.values
    wsum = np.abs(wc).sum(axis=-2, keepdims=True)                      # (..., 1, c)
    operations = 8.0 * (y.shape[-2] + len(kernel.knots) + theta.shape[-1] + 8)
    bound = operations * UNIT * (abs(kernel.intercept) + lipschitz * (scores + reach)) * wsum + operations * TINY
    bound = np.broadcast_to(bound, np.broadcast_shapes(bound.shape, wc.shape[:-2] + (1, wc.shape[-1])))
    bound = bound[..., 0] if w.values.ndim == y.values.ndim - 1 else bound
    bound = bound + 4.0 * UNIT * np.abs(expected)
    assert_within(to_numpy(out), expected, bound, out_dtype, what="sliced_kernel_sum output")


def test_sliced_kernel_sum_matches_dense_reference(xp, engine, fuzz):
    if fuzz.bounded and xp.is_jax:
        pytest.skip("JAX: sliced ops compile per shape and chunk; run with SLICEDKERN_FUZZ=long")
    fuzz.run(sliced_cases(jax=xp.is_jax), lambda example: check_sliced(xp, engine, example), backend=xp.name)
