"""Fuzz: the triton engine under Triton's interpreter (CPU tensors) on empty axes and extreme float32
scales, forward and gradients, against the dense float64 ``slicedkern.reference``.

* ``test_triton_at_extreme_float32_scales``: float32 scores of 1e-30..1e30 and values of
  1e-30..1e30 (their products 1e-30..1e60, far beyond float32's largest number), ReLU attention with every
  normaliser and ``center``, hat attention with a learned bandwidth per row, causal or not, a key
  mask or none, short rows (the one-launch forward) and tiles crossed (small tiles, as
  ``tests/engines/test_triton.py`` sets them). The output is judged against the reference within
  ``1e-4`` of the size of its terms (the reference of ``|v| + max |v|``, uncentred, with the same
  normaliser: what a query's sums are rounded against), a gradient within ``1e-4`` of its largest
  entry plus ``1e-4`` of the cotangent times those terms over the smallest gap of a query and a
  key (a score's or bandwidth's) or per unit value (a value's): a gradient of 0 is rounded against
  them (issue 49, item 2: NaN and -inf before, where the products passed 3.4e38).
* ``test_relu_normaliser_score_gradient_cancels_in_float32``: a finding of this fuzzer, pinned
  (``xfail(strict=True)``): under the "relu" normaliser a score gradient that is 0 (one key, the
  output the key's value) comes out of the float32 triton backward at 6.5e-3 of its terms (2.2e-11
  where they are 3.4e-9; the scan in float32 gives 0), on today's main as before issue 49; the
  fuzz test above judges only the finiteness of ``dq`` and ``dk`` under that normaliser.
* ``test_triton_on_empty_axes``: no query or no key (and the other axis of any length, several
  batch rows), every inputs recording gradients, a key mask, learned bandwidths and mixture
  weights: the empty output or zeros, and zero gradients of every input's shape (issue 49, items 4
  and 5).

Under the interpreter every program of the grid runs in Python: few examples, a few positions.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import assume, note  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import slicedkern  # noqa: E402
from slicedkern import reference  # noqa: E402
from slicedkern.kernels import Abs  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="the triton engine needs Triton: pip install 'slicedkern[triton]'")

if os.environ["TRITON_INTERPRET"] in ("0", ""):
    pytest.skip("these run the kernels under Triton's interpreter, on CPU tensors", allow_module_level=True)

#: examples of each test relative to the profile's (every one costs seconds under the interpreter)
WEIGHT = 0.5


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 8 keys, blocks of 8 queries and 4 columns, rows sorted in blocks of 16 and causal
    leaves of 4 positions: short cases cross tiles, blocks and levels."""
    import slicedkern.engines.triton as engine
    from slicedkern.engines.triton import _sums
    monkeypatch.setattr(_sums, "SORT_MIN_BLOCK", 16)
    monkeypatch.setattr(_sums, "BLOCK_M", 8)
    monkeypatch.setattr(_sums, "BLOCK_N", 8)
    monkeypatch.setattr(_sums, "BLOCK_C", 4)
    monkeypatch.setattr(engine, "CAUSAL_LEAF", 4)


def _float32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32).astype(np.float64)


@st.composite
def extreme_cases(draw):
    rows, lq, lk, dv = draw(st.integers(1, 2)), draw(st.integers(1, 7)), draw(st.integers(1, 11)), draw(
        st.integers(1, 3))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    # products of 1e-30 and above: below, a learned bandwidth's gradient on the hat's cancelling
    # terms is off by more than float32's rounding (1.2e-4 of it at scores 1e-22 with values 1e-19)
    low = draw(st.integers(-30, 30))
    scores, values = 10.0 ** low, 10.0 ** draw(st.integers(max(-30, -30 - low), 30))
    q = _float32(rng.normal(size=(rows, lq)) * scores)
    k = _float32(rng.normal(size=(rows, lk)) * scores)
    v = _float32(rng.normal(size=(rows, lk, dv)) * values)
    mask = None
    if draw(st.booleans()):
        mask = rng.random((rows, lk)) > 0.3
    kernel = draw(st.sampled_from(["relu", "hat"]))
    options = {"causal": draw(st.booleans())}
    if kernel == "relu":
        options["normalize"] = draw(st.sampled_from(["abs", "relu", "count", None]))
        options["center"] = draw(st.booleans())
    bandwidth = _float32(scores * (0.3 + rng.random(rows)))
    return dict(q=q, k=k, v=v, mask=mask, kernel=kernel, options=options, bandwidth=bandwidth,
                cot=rng.normal(size=(rows, lq, dv)), scales=(scores, values))


def _attend(module, kernel, args, mask, options):
    kw = dict(options, key_mask=None if mask is None else torch.tensor(mask))
    if kernel == "relu":
        return module.relu_attention(*args, **kw)
    return module.hat_attention(*args, **kw)


def test_triton_at_extreme_float32_scales(fuzz, small_tiles):
    def check(case):
        note(f"scales {case['scales']}, {case['kernel']} {case['options']}, shapes {case['v'].shape}")
        results = []
        for module, dtype, kw in ((reference, torch.float64, {}), (slicedkern, torch.float32, {"engine": "triton"})):
            if results:
                # a result beyond float32 is no case for it (the interpreter raises on the cast)
                assume(max(np.abs(a).max(initial=0.0) for a in results[0]) < 1e37)
            names = ("q", "k", "v") + (("bandwidth",) if case["kernel"] == "hat" else ())
            args = [torch.tensor(case[name], dtype=dtype).requires_grad_() for name in names]
            out = _attend(module, case["kernel"], args, case["mask"], dict(case["options"], **kw))
            grads = torch.autograd.grad((out * torch.tensor(case["cot"], dtype=dtype)).sum(), args)
            results.append([a.detach().to(torch.float64).numpy() for a in (out, *grads)])
        # the size of the output's terms: the sums of |r| (at least ReLU(r), which the kernels form
        # from sums of both signs) over |v| + max |v|, uncentred, with the same normaliser; a hat's
        # are its three ReLUs', |r| / h + 1 each (they cancel where the hat is 0)
        top = np.abs(case["v"]).max()
        size_args = [torch.tensor(a) for a in (case["q"], case["k"], np.abs(case["v"]) + top)]
        mask = None if case["mask"] is None else torch.tensor(case["mask"])
        normalize = case["options"].get("normalize", "count")
        size = reference.kernel_attention(*size_args, Abs(), key_mask=mask, causal=case["options"]["causal"],
                                          normalize=normalize).numpy()
        if case["kernel"] == "hat":
            size = 4.0 * (size / case["bandwidth"][:, None, None] + 2.0 * top)
        # a score gradient's size: the cotangent times the output's terms over the smallest gap of a
        # query and a key (what a normaliser sum may be; a gradient that is 0 exactly, as one key's
        # under the "abs" normaliser, is rounded against it)
        gaps = np.abs(case["q"][..., :, None] - case["k"][..., None, :])
        gap = gaps[gaps > 0].min() if (gaps > 0).any() else 1.0
        score_size = np.abs(case["cot"]).max() * size.max() / gap
        # a value gradient's: the cotangent times the terms per unit value, over the queries
        value_size = np.abs(case["cot"]).max() * case["q"].shape[-1] * size.max() / (2.0 * top + 1e-300)
        want_all, got_all = results
        for label, got, want in zip(("out", "dq", "dk", "dv", "dbandwidth"), got_all, want_all):
            assert np.isfinite(got).all(), label
            if label in ("dq", "dk") and case["options"].get("normalize") == "relu":
                continue                # a known defect, pinned below
            if label == "out":
                bound = 1e-4 * size
            else:
                bound = 1e-4 * (np.abs(want).max() + (value_size if label == "dv" else score_size))
            bound = bound + 1e-40         # float32's subnormal numbers are judged absolutely
            assert (np.abs(got - want) <= bound).all(), (label, float(np.abs(got - want).max()), float(np.max(bound)))

    fuzz.run(extreme_cases(), check, backend="torch", weight=WEIGHT)


@st.composite
def empty_cases(draw):
    empty = draw(st.sampled_from(["queries", "keys"]))
    other = draw(st.integers(0, 5))
    lq, lk = (0, other) if empty == "queries" else (other, 0)
    return dict(rows=draw(st.integers(1, 3)), lq=lq, lk=lk, dv=draw(st.integers(1, 3)),
                kernel=draw(st.sampled_from(["relu", "hat", "mixture"])), causal=draw(st.booleans()),
                masked=draw(st.booleans()), dtype=draw(st.sampled_from([torch.float32, torch.float64])))


def test_triton_on_empty_axes(fuzz):
    def check(case):
        rows, lq, lk, dv, dtype = case["rows"], case["lq"], case["lk"], case["dv"], case["dtype"]
        args = [torch.randn(rows, lq, dtype=dtype), torch.randn(rows, lk, dtype=dtype),
                torch.randn(rows, lk, dv, dtype=dtype)]
        if case["kernel"] == "hat":
            args.append(torch.full((rows,), 0.7, dtype=dtype))
        elif case["kernel"] == "mixture":
            args += [torch.full((rows, 2), 0.7, dtype=dtype), torch.tensor([[1.0, -0.4]] * rows, dtype=dtype)]
        args = [a.requires_grad_() for a in args]
        kw = dict(causal=case["causal"], engine="triton",
                  key_mask=torch.ones(rows, lk, dtype=torch.bool) if case["masked"] else None)
        op = {"relu": slicedkern.relu_attention, "hat": slicedkern.hat_attention,
              "mixture": slicedkern.hat_mixture_attention}[case["kernel"]]
        out = op(*args, **kw)
        assert out.shape == (rows, lq, dv) and (out == 0).all()
        grads = torch.autograd.grad(out.sum(), args)
        for a, g in zip(args, grads):
            assert g.shape == a.shape and (g == 0).all()

    fuzz.run(empty_cases(), check, backend="torch", weight=WEIGHT)


@pytest.mark.xfail(strict=True, reason="float32 triton backward: a zero score gradient under the 'relu' "
                                       "normaliser comes out at 6.5e-3 of its terms")
def test_relu_normaliser_score_gradient_cancels_in_float32():
    q = torch.tensor([[1257302.25, -1321048.625, 6404226.5]]) * 1000.0
    k = torch.tensor([[1049001.125]]) * 1000.0
    args = [q.requires_grad_(), k.requires_grad_(), torch.tensor([[[-0.53566939]]], requires_grad=True)]
    out = slicedkern.relu_attention(*args, normalize="relu", center=False, engine="triton")
    _, dk, _ = torch.autograd.grad((out * torch.tensor([[[1.304], [0.5], [-0.7]]])).sum(), args)
    # the terms are 1.3 * 0.54 / 2.1e8 = 3.4e-9; the exact gradient 0 (the reference: 4e-25)
    assert float(dk.abs().max()) <= 1e-6 * 3.4e-9
