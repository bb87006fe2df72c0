"""Fuzz: packed sequences (``segment_ids=``) and windows (``window=``) on every backend and engine.

The hostile forward cases of ``test_fuzz_ops`` (``_cases.forward_cases``: ``Lq != Lk`` and empty
axes, broadcast batch dims, masks with fully masked rows, ties, mixed and half dtypes, extreme
scales, per-head parameters, every normaliser, ``center``, ``eps``) gain segment ids, a window, or
both, causal or not. Segment ids are drawn from four values in any order: unsorted and
non-contiguous ids (a document split in two runs is one segment: docs/mathematics.rst, "Packed
sequences"), one-token and empty segments, segments of different lengths in queries and keys, and
ties across segment boundaries (the cases' scores repeat). Windows are drawn with ``-1`` (unbounded),
zero, widths past the length and a negative ``right`` (the keys older than a window), so that some
queries see no key at all.

The visibility is written here a second time, as loops over the tokens (:func:`seen_by_loops`),
independently of ``slicedkern._lib.causal.visible``; the expected output and its allowed error are
then the per-query oracle of the causal fuzz suite (``_causal.per_query_case``: each query a batch
row of its own, its keys masked to those it sees), so every query is judged by the count,
normaliser and centring mean of the keys it sees, and one that sees none must be exactly 0; its
gradients (float64) against central differences of the dense reference, which takes both
options. A
window's band is computed as the difference of two causal sums, so its rounding is judged on the
larger of them (every key up to the band's right edge): a band of tiny values behind large ones
loses their digits (found by this test: 1e-38 behind 1.0 came out 0), as the docs say.
"""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import assert_meta, to_numpy
from hypothesis import note
from hypothesis import strategies as st

from ._cases import FLOAT_DTYPES, Arr, Case, forward_cases
from ._causal import causal_oracle, has_causal_mode, per_query_case
from ._grad_cases import assume_away_from_kinks, smooth_gradient_cases
from ._oracle import (
    assert_within,
    expected_output,
    finite_difference,
    loss_noise,
    magnitudes,
    power_of_two_scale,
)
from .test_fuzz_causal import check_call
from .test_fuzz_gradients import backend_gradients

#: As in test_fuzz_gradients: relative error allowed on top of the rounding allowances.
RTOL = 1e-6
SCORE_LIKE = ("q", "k", "bandwidth", "bandwidths")

ATTENTION_OPS = ("relu_attention", "hat_attention", "hat_mixture_attention", "kernel_attention")


def seen_by_loops(q_ids, k_ids, lq: int, lk: int, causal: bool, window) -> np.ndarray:
    """(Lq, Lk) bool, token by token: query ``i`` sees key ``j`` when both are in one segment and the
    key's rank among the segment's keys is within the window of (and, causal, not after) the rank the
    query is aligned with, ``a + Lk_s - Lq_s`` for the query of rank ``a`` (flash-attention's
    varlen alignment)."""
    q_ids = np.zeros(lq, int) if q_ids is None else q_ids
    k_ids = np.zeros(lk, int) if k_ids is None else k_ids
    left, right = (-1, -1) if window is None else window
    seen = np.zeros((lq, lk), bool)
    for i in range(lq):
        segment = q_ids[i]
        rank = sum(1 for t in range(i) if q_ids[t] == segment)
        aligned = rank + sum(1 for t in range(lk) if k_ids[t] == segment) - sum(1 for t in range(lq)
                                                                                if q_ids[t] == segment)
        key_rank = 0
        for j in range(lk):
            if k_ids[j] != segment:
                continue
            offset = key_rank - aligned
            key_rank += 1
            if causal and offset > 0:
                continue
            if left != -1 and offset < -left:
                continue
            if right != -1 and offset > right:
                continue
            seen[i, j] = True
    return seen


def draw_visibility(draw, lq: int, lk: int) -> dict:
    """Keyword options of a visibility for ``lq`` queries and ``lk`` keys: ``segment_ids`` (None, one
    array when queries and keys are the same tokens, or a pair), ``window`` and ``causal``."""
    kind = draw(st.sampled_from(("segments", "window", "both")))
    options = {"causal": draw(st.booleans())}
    if kind != "window":
        def draw_ids(n):
            return Arr(np.asarray(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), dtype=np.int64),
                       "int64")
        options["segment_ids"] = (draw_ids(lq) if lq == lk and draw(st.booleans())
                                  else (draw_ids(lq), draw_ids(lk)))
    if kind != "segments":
        bound = max(lq, lk) + 2
        left = draw(st.one_of(st.just(-1), st.integers(0, bound)))
        # right < -left is an empty band: every query sees no key, and gets 0
        options["window"] = (left, draw(st.one_of(st.just(-1), st.integers(-bound, bound))))
    return options


@st.composite
def visibility_cases(draw, op: str, *, has_float16: bool, few_shapes: tuple, dtypes):
    """A forward case (``_cases.forward_cases``) with a visibility (:func:`draw_visibility`)."""
    case = draw(forward_cases(op, has_float16=has_float16, few_shapes=few_shapes, dtypes=dtypes))
    options = draw_visibility(draw, case.args[0].shape[-1], case.args[1].shape[-1])
    return Case(case.op, case.args, {**case.kwargs, **options})


@st.composite
def visibility_gradient_cases(draw, op: str, *, few_shapes: tuple, dtypes):
    """``(case, cotangent, unit)`` of ``_grad_cases.smooth_gradient_cases`` with a visibility."""
    case, cotangent, unit = draw(smooth_gradient_cases(op, few_shapes=few_shapes, dtypes=dtypes))
    options = draw_visibility(draw, case.args[0].shape[-1], case.args[1].shape[-1])
    return Case(case.op, case.args, {**case.kwargs, **options}), cotangent, unit


def visibility_of(case: Case) -> tuple[np.ndarray, np.ndarray | None]:
    """``(seen, outer)`` (Lq, Lk) of a case's options: the keys each query sees, and for a window
    the keys of the larger of the two causal sums its band is the difference of
    (slicedkern.engines.banded: its rounding is theirs, docs/mathematics.rst, "Windows")."""
    lq, lk = case.args[0].shape[-1], case.args[1].shape[-1]
    ids = case.kwargs.get("segment_ids")
    if ids is None:
        q_ids = k_ids = None
    elif isinstance(ids, Arr):
        q_ids = k_ids = ids.values
    else:
        q_ids, k_ids = (a.values for a in ids)
    causal, window = case.kwargs.get("causal", False), case.kwargs.get("window")
    seen = seen_by_loops(q_ids, k_ids, lq, lk, causal, window)
    outer = None if window is None else seen_by_loops(q_ids, k_ids, lq, lk, causal, (-1, window[1]))
    return seen, outer


def check_visibility(backend, engine, case):
    note(f"backend {backend.name}, engine {engine.name!r}; reproducer (NumPy arrays):\n{case!r}")
    seen, outer = visibility_of(case)
    expected, bound, judged = causal_oracle(case, seen, outer)
    check_call(backend, engine, case, expected, bound, judged, f"{case.op} output with segments / window")


def check_gradients(backend, engine, example):
    """Gradients of a case with a visibility against central differences of the dense reference
    (which takes ``segment_ids`` and ``window``), with test_fuzz_causal's tolerance, the loss's
    rounding taken per query over the keys it sees (over the band's outer sums for a window)."""
    case, cotangent, unit = example
    note(f"backend {backend.name}, engine {engine.name!r}; reproducer (NumPy arrays):\n{case!r}\n"
         f"cotangent g = np.array({cotangent.tolist()!r})  # loss = sum(g * out)")
    gap = assume_away_from_kinks(case, unit)
    seen, outer = visibility_of(case)
    out, grads, args = backend_gradients(backend, engine, case, cotangent)
    expected, bound, judged = causal_oracle(case, seen, outer)
    assert_within(to_numpy(out), expected, bound, case.out_dtype(), judged=judged,
                  what=f"{case.op} output with segments / window")
    widest = per_query_case(case, seen if outer is None else outer)
    noise = 2.0 * loss_noise(widest, cotangent[..., None, :], expected_output(widest))
    for position in case.float_positions():
        assert grads[position] is not None, f"no gradient for {case.arg_name(position)!r}"
        assert_meta(grads[position], like=args[position])
        step = gap / 64.0 if case.arg_name(position) in SCORE_LIKE else max(
            float(np.max(np.abs(case.args[position].values), initial=0.0)), 1.0)
        allowance = 4.0 * noise / step + magnitudes(widest).floor
        if case.arg_name(position) not in SCORE_LIKE:
            ones = widest.replaced(position, np.ones(widest.args[position].shape))
            allowance += 8.0 * loss_noise(ones, cotangent[..., None, :], expected_output(ones))
        scale = power_of_two_scale(cotangent)            # no underflow of tiny g * out in the loss
        fd = scale * finite_difference(case, cotangent / scale, position, step, "central")
        assert_within(to_numpy(grads[position]), fd,
                      RTOL * (np.abs(fd) + float(np.max(np.abs(fd), initial=0.0))) + allowance,
                      case.args[position].dtype, what=f"d{case.arg_name(position)} with segments / window")


@pytest.fixture
def cxp(xp, engine):
    """The backend under test, skipped where its engine has no causal mode (windows are differences
    of causal sums; the sweep on JAX arrays has none: tests/test_causal.py)."""
    if not has_causal_mode(xp, engine):
        pytest.skip(f"the {xp.engine!r} engine has no causal mode for {xp.name} arrays")
    return xp


@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_segments_and_windows_match_the_per_query_oracle(cxp, engine, fuzz, op):
    dtypes = ("float64",) if fuzz.one_dtype_on(cxp) else FLOAT_DTYPES
    strategy = visibility_cases(op, has_float16=hasattr(cxp.xp, "float16"), few_shapes=fuzz.layouts_for(cxp),
                                dtypes=dtypes)
    fuzz.run(strategy, lambda case: check_visibility(cxp, engine, case), backend=cxp.name, weight=0.75)


@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_segments_and_windows_gradients_match_finite_differences(cxp, engine, fuzz, op):
    # float64 only: a float32 gradient can be 40 ulps off whatever the visibility (found here with
    # 1000 examples on a case without segments or window: hat, "abs", dq of q = 0.5 against three
    # keys at 0, on the scan and the sweep alike: docs/changelog.rst, "Known"), which is
    # test_fuzz_gradients' to judge, not this test's
    dtypes = ("float64",)
    strategy = visibility_gradient_cases(op, few_shapes=fuzz.layouts_for(cxp), dtypes=dtypes)
    fuzz.run(strategy, lambda example: check_gradients(cxp, engine, example), backend=cxp.name, weight=0.5)


def test_the_loops_agree_with_the_documented_examples():
    """The oracle's own loops on the examples of ``slicedkern._lib.causal.visible``'s docstring and
    of flash-attention's varlen alignment (a segment with 3 keys and 2 queries: its queries see up
    to keys 1 and 2 of it)."""
    ids = np.array([0, 0, 1, 1])
    assert seen_by_loops(ids, ids, 4, 4, True, None).astype(int).tolist() == [
        [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert seen_by_loops(None, None, 4, 4, False, (1, 0)).astype(int).tolist() == [
        [1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    seen = seen_by_loops(np.array([0, 0, 1]), np.array([0, 0, 0, 1, 1]), 3, 5, True, None)
    assert seen.astype(int).tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 1]]
    # the keys older than a window of 1: every key before the aligned one's predecessor
    assert seen_by_loops(None, None, 4, 4, True, (-1, -2)).astype(int).tolist() == [
        [0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]]
