"""The triton engine under Triton's interpreter (CPU tensors), against the dense float64 reference.

``TRITON_INTERPRET=1`` is set before anything imports Triton's kernels here, so that the kernels run
on the CPU (CI has no GPU; on a GPU machine, ``TRITON_INTERPRET=0`` runs them compiled, on CUDA
tensors). Small sizes: the interpreter runs every program of the grid in Python.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from _helpers import DECODE_CHUNKS, decode_data, poison_decode_data  # noqa: E402

import slicedkern  # noqa: E402
from slicedkern import reference  # noqa: E402
from slicedkern.kernels import Abs, Hat, HatMixture, ReLU  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="the triton engine needs Triton: pip install 'slicedkern[triton]'")

DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] in ("0", "") else "cpu"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 runs the kernels compiled, which needs a CUDA device", allow_module_level=True)

SHAPE_Q, SHAPE_K, DV = (2, 3, 17), (2, 3, 23), 4       # batch dims (2, 3), Lq != Lk


def _tiles(monkeypatch, keys, queries, columns):
    from slicedkern.engines.triton import _sums
    monkeypatch.setattr(_sums, "BLOCK_M", keys)
    monkeypatch.setattr(_sums, "BLOCK_N", queries)
    monkeypatch.setattr(_sums, "BLOCK_C", columns)


@pytest.fixture(autouse=True, scope="module")
def language_patched_once_per_launch():
    """Triton's interpreter patches ``triton.language`` at every launch and again at every call of a
    ``@triton.jit`` helper from inside the kernel (about 1 ms each: a fifth of this file's time, the
    helpers being called per loop step). Inside a launch the language is already patched, so the
    nested calls get an empty patch scope. Nothing else changes; if Triton's interpreter no longer
    has these names, the tests run unchanged, only slower."""
    try:
        from triton.runtime import interpreter
        patch, empty_scope = interpreter._patch_lang, interpreter._LangPatchScope
    except (ImportError, AttributeError):
        yield
        return
    languages = {id(m) for m in (interpreter.tl, interpreter.tl.core)}
    patched = set()            # the language modules patched since the launch began

    def patch_unless_launched(fn):
        seen = {id(m) for m in fn.__globals__.values() if id(m) in languages}
        if patched and seen <= patched:
            return empty_scope()
        scope = patch(fn)
        if patched:            # a helper (triton's own) that sees another language module
            patched.update(seen)
            return scope
        restore = scope.restore

        def restore_and_end_launch():
            patched.clear()
            restore()

        scope.restore = restore_and_end_launch
        patched.update(seen)
        return scope

    with pytest.MonkeyPatch.context() as mp:
        if DEVICE == "cpu":
            mp.setattr(interpreter, "_patch_lang", patch_unless_launched)
        yield


@pytest.fixture
def engine_tiles():
    """The engine's own tile sizes, not :func:`small_tiles`': for the traffic counts, which do not
    depend on them (fewer programs for the interpreter to run)."""


@pytest.fixture(autouse=True)
def small_tiles(request, monkeypatch):
    """Tiles of 8 keys and blocks of 8 queries under the interpreter, so that these small cases cross
    tiles and query blocks (L not a multiple of either), and short rows sorted in blocks of their
    length's power of two (not of 256: the interpreter runs every stage of the network); the
    compiled kernels keep the defaults (``tl.dot`` needs 16 or more)."""
    if DEVICE == "cpu":
        from slicedkern.engines.triton import _sums
        monkeypatch.setattr(_sums, "SORT_MIN_BLOCK", 16)
        if "engine_tiles" not in request.fixturenames:
            _tiles(monkeypatch, 8, 8, 4)


def _t(a, dtype=torch.float64):
    return torch.tensor(np.asarray(a), device=DEVICE).to(dtype)


def _np(a):
    return a.detach().cpu().to(torch.float64).numpy()


def _data(rng, ties=False, rows=None):
    """Scores, values and a key mask of :data:`SHAPE_Q` and :data:`SHAPE_K`; with ``rows``, of one
    batch dim of that many rows instead (the interpreter's time grows with the rows)."""
    shape_q, shape_k = (SHAPE_Q, SHAPE_K) if rows is None else ((rows, SHAPE_Q[-1]), (rows, SHAPE_K[-1]))
    if ties:   # dyadic scores: exact ties between queries, keys and the knots +-0.5, 0
        q = rng.choice([-1.0, -0.5, 0.0, 0.25, 0.5, 1.0], size=shape_q)
        k = rng.choice([-1.0, -0.5, 0.0, 0.25, 0.5, 1.0], size=shape_k)
    else:
        q, k = rng.normal(size=shape_q), rng.normal(size=shape_k)
    return q, k, rng.normal(size=shape_k + (DV,)), rng.random(shape_k) > 0.3


ATTENTION = [
    ("relu-abs", lambda m, **kw: m.relu_attention(*kw.pop("a"), **kw)),
    ("relu-relu", lambda m, **kw: m.relu_attention(*kw.pop("a"), normalize="relu", **kw)),
    ("relu-count-uncentred", lambda m, **kw: m.relu_attention(*kw.pop("a"), normalize="count", center=False, **kw)),
    ("relu-none", lambda m, **kw: m.relu_attention(*kw.pop("a"), normalize=None, **kw)),
    ("hat", lambda m, **kw: m.hat_attention(*kw.pop("a"), 0.5, **kw)),
    ("mixture-abs", lambda m, **kw: m.kernel_attention(*kw.pop("a"), HatMixture([0.5, 1.0], [1.0, -0.4]),
                                                       center=True, normalize="abs", **kw)),
]


def test_selected_only_on_request_for_cpu_tensors():
    x = torch.zeros((1, 3))
    assert slicedkern.engine_for(x) != "triton"
    with slicedkern.use_engine("triton"):
        if DEVICE == "cpu":
            assert slicedkern.engine_for(x) == "triton"
        else:      # compiled: CPU tensors are declined, with the reason
            with pytest.raises(ValueError, match="'engine'.*CUDA tensors"):
                slicedkern.engine_for(x)
    with pytest.raises(ValueError, match="'engine'.*torch tensors only"):
        slicedkern.relu_attention(np.zeros((1, 3)), np.zeros((1, 3)), np.zeros((1, 3, 2)), engine="triton")


@pytest.mark.parametrize("ties", [pytest.param(False, marks=pytest.mark.exhaustive), True],
                         ids=["random", "ties"])     # under Triton's interpreter: 1 s a case; ties are the harder
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("name, op", ATTENTION, ids=[a[0] for a in ATTENTION])
def test_attention_forward_matches_the_reference(rng, name, op, masked, ties):
    q, k, v, mask = _data(rng, ties)
    mask = mask if masked else None
    expected = op(reference, a=(q, k, v), key_mask=mask)
    tm = _t(mask, torch.bool) if masked else None
    out = op(slicedkern, a=(_t(q), _t(k), _t(v)), key_mask=tm, engine="triton")
    assert out.shape == SHAPE_Q + (DV,) and out.dtype == torch.float64 and out.device.type == DEVICE
    np.testing.assert_allclose(_np(out), expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("kernel", [ReLU(), Abs(), Hat(0.5)], ids=repr)
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_kernel_sum_matches_the_reference(rng, kernel, ties):
    q, k, v, _ = _data(rng, ties)
    out = slicedkern.kernel_sum(_t(q), _t(k), _t(v), kernel, engine="triton")
    np.testing.assert_allclose(_np(out), reference.kernel_sum(q, k, v, kernel), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name, op", [ATTENTION[0], ATTENTION[1], ATTENTION[4], ATTENTION[5]],
                         ids=["relu-abs", "relu-relu", "hat", "mixture-abs"])
def test_attention_gradients_match_the_dense_reference(rng, name, op):
    q, k, v, mask = _data(rng)
    cot = _t(rng.normal(size=SHAPE_Q + (DV,)))
    grads = []
    for module, engine in ((slicedkern, "triton"), (reference, None)):
        args = [_t(a).requires_grad_() for a in (q, k, v)]
        kw = {"engine": engine} if engine else {}
        out = op(module, a=args, key_mask=_t(mask, torch.bool), **kw)
        grads.append(torch.autograd.grad((out * cot).sum(), args))
    for got, want, label in zip(*grads, "qkv"):
        np.testing.assert_allclose(_np(got), _np(want), rtol=1e-7, atol=1e-9, err_msg=label)


def test_value_width_across_column_blocks(rng):
    """D = 17 over column blocks of 4 (5 blocks, the last partial): the output, and the gradients
    whose score parts are dotted per column block in the kernel and summed after, against the
    dense reference, with a key mask and the summed normaliser (its quotient-rule term too)."""
    q, k = rng.normal(size=(1, 13)), rng.normal(size=(1, 11))     # one row: the interpreter is slow
    v, mask = rng.normal(size=(1, 11, 17)), rng.random((1, 11)) > 0.3
    cot = _t(rng.normal(size=(1, 13, 17)))
    results = []
    for module, kw in ((slicedkern, {"engine": "triton"}), (reference, {})):
        args = [_t(a).requires_grad_() for a in (q, k, v)]
        out = module.hat_attention(*args, 0.5, key_mask=_t(mask, torch.bool), normalize="abs", **kw)
        results.append((out, *torch.autograd.grad((out * cot).sum(), args)))
    for got, want, label in zip(*results, ("out", "q", "k", "v")):
        np.testing.assert_allclose(_np(got), _np(want), rtol=1e-8, atol=1e-10, err_msg=label)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_bandwidth_and_weight_gradients(rng, ties):
    """Per-head bandwidths and mixture weights, their gradients from the kernels' knot sums
    (``_views.kernel_knot_grads``; the tie on the side ``strict_knots`` says), equal to the scan's; dyadic scores
    put ties on the knots."""
    q, k, v, _ = _data(rng, ties=ties)
    # one bandwidth per head (batch dim 1); dyadic with ties, so that differences fall on the knots
    b = rng.choice([0.25, 0.5, 0.75], size=(3,)) if ties else rng.uniform(0.3, 1.5, size=(3,))
    w = np.array([1.0, -0.5])
    grads = []
    for engine in ("triton", "scan"):
        qa, ka, va = (_t(a).requires_grad_() for a in (q, k, v))
        bands = _t(np.stack([b, 2 * b], axis=-1)).requires_grad_()
        weights = _t(w).requires_grad_()
        out = slicedkern.hat_mixture_attention(qa, ka, va, bands, weights, engine=engine)
        grads.append(torch.autograd.grad(out.sin().sum(), (qa, ka, va, bands, weights)))
    for got, want in zip(*grads):
        np.testing.assert_allclose(_np(got), _np(want), rtol=1e-9, atol=1e-11)


def test_kernel_sum_gradients_with_ties_agree_with_the_scan(rng):
    """At exact ties the derivative is one-sided: the engines must pick the same side."""
    q, k, v, _ = _data(rng, ties=True)
    grads = []
    for engine in ("triton", "scan"):
        args = [_t(a).requires_grad_() for a in (q, k, v)]
        out = slicedkern.kernel_sum(*args, Hat(0.5), engine=engine)
        grads.append(torch.autograd.grad(out.cos().sum(), args))
    for got, want in zip(*grads):
        np.testing.assert_allclose(_np(got), _np(want), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3), (torch.float16, 1e-3)],
                         ids=["float32", "bfloat16", "float16"])
def test_low_precision_inputs(rng, dtype, tol):
    """Output in the input dtype; error against float64 on the same rounded inputs within the
    dtype's own rounding (normwise)."""
    q, k, v = (_t(a, dtype) for a in _data(rng)[:3])
    out = slicedkern.relu_attention(q, k, v, engine="triton")
    assert out.dtype == dtype
    expected = reference.relu_attention(*(_np(a) for a in (q, k, v)))
    err = np.linalg.norm(_np(out) - expected) / np.linalg.norm(expected)
    assert err <= tol
    args = [a.detach().requires_grad_() for a in (q, k, v)]
    grads = torch.autograd.grad(slicedkern.relu_attention(*args, engine="triton").float().sum(), args)
    assert [g.dtype for g in grads] == [dtype] * 3


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name, op", [ATTENTION[0], ATTENTION[1], ATTENTION[4]], ids=["relu-abs", "relu-relu", "hat"])
def test_low_precision_gradients(rng, dtype, tol, name, op):
    """Gradients of float32 and bfloat16 inputs against the float64 reference on the same rounded
    inputs, normwise: within the dtype's own rounding (seen: float32 4e-8 to 1.2e-6, the "relu"
    normaliser's dq the largest; bfloat16 1.5e-3 to 3.5e-3, about its unit of 3.9e-3)."""
    q, k, v = (_t(a, dtype) for a in _data(rng)[:3])
    cot = _t(rng.normal(size=SHAPE_Q + (DV,)), dtype)
    grads = []
    for module, engine, cast in ((slicedkern, "triton", dtype), (reference, None, torch.float64)):
        args = [a.to(cast).requires_grad_() for a in (q, k, v)]
        kw = {"engine": engine} if engine else {}
        grads.append(torch.autograd.grad((op(module, a=args, **kw) * cot.to(cast)).sum(), args))
    for got, want, label in zip(*grads, "qkv"):
        assert got.dtype == dtype
        assert float((got.double() - want).norm() / want.norm()) <= tol, label


@pytest.mark.parametrize("name, op", [ATTENTION[0], ATTENTION[4]], ids=["relu-abs", "hat"])
def test_float32_scores_with_masks_and_ties(rng, name, op):
    """float32 scores are sorted as float32 (``_sums._sort``, ``narrow``): with dyadic ties and a key
    mask, whose masked keys the NaN policy moves to the valid keys' mean (not a float32 number: it is
    rounded before the sort, and the kernels read it rounded), forward and gradients against the
    float64 reference on the same rounded inputs, normwise within float32's rounding."""
    q, k, v, mask = _data(rng, ties=True)
    cot = rng.normal(size=SHAPE_Q + (DV,))
    results = []
    for module, engine, cast in ((slicedkern, "triton", torch.float32), (reference, None, torch.float64)):
        args = [_t(a, torch.float32).to(cast).requires_grad_() for a in (q, k, v)]
        kw = {"engine": engine} if engine else {}
        out = op(module, a=args, key_mask=_t(mask, torch.bool), **kw)
        results.append((out, *torch.autograd.grad((out * _t(cot, cast)).sum(), args)))
    for got, want, label in zip(*results, ("out", "q", "k", "v")):
        assert got.dtype == torch.float32
        assert np.linalg.norm(_np(got) - _np(want)) <= 1e-6 * np.linalg.norm(_np(want)), label


def test_float32_gradients_where_a_normaliser_sum_is_tiny():
    """A query just above the lowest key: its "relu" normaliser sum is 1e-4, its cotangent row is
    scaled by 1e4 in the tables of the backward, and the value and normaliser terms of the keys'
    gradients cancel to O(1). Those tables sum in float64 (``_sums._wide``): in float32 their
    rounding put errors of 1e-1 into dk. And pass 2 forms its terms pair by pair
    (``_device._pairs``): from ``s P0 - P1`` in float32, the forward's output at that query was off
    by 5.5e-4 (relative) and dq by 1.2 (normwise). float32 inputs, against the float64 reference on
    the same rounded inputs, normwise: dv within 1e-5; dq and dk within 1e-4 (seen 2.3e-5 and
    2.6e-5), since the quotient rule's normaliser term reads the output rounded to float32, whose
    rounding at that query (6e-8 of |out|) reaches them divided by its sum, 1e-4."""
    rng = np.random.default_rng(5)
    k = np.sort(rng.normal(size=(2, 40)), axis=-1)
    q = rng.normal(size=(2, 30))
    q[:, 0] = k[:, 0] + 1e-4
    v, cot = rng.normal(size=(2, 40, 8)), _t(rng.normal(size=(2, 30, 8)), torch.float32)
    grads = []
    for module, engine, cast in ((slicedkern, "triton", torch.float32), (reference, None, torch.float64)):
        args = [_t(a, torch.float32).to(cast).requires_grad_() for a in (q, k, v)]
        kw = {"engine": engine} if engine else {}
        out = module.relu_attention(*args, normalize="relu", **kw)
        grads.append(torch.autograd.grad((out * cot.to(cast)).sum(), args))
    for got, want, label, tol in zip(*grads, "qkv", (1e-4, 1e-4, 1e-5)):
        assert float((got.double() - want).norm() / want.norm()) <= tol, label


def test_float32_sums_over_a_span_of_many_tiles(rng):
    """A few queries among many keys: one block of queries spans every tile, so its sums run in
    float32 over all the keys before meeting the float64 carry (docs/backends.rst, "Engines").
    Keys far from zero, so that the centred term cancels; the error stays at float32's rounding."""
    q = _t(5.0 + rng.normal(size=(2, 8)), torch.float32)
    k = _t(5.0 + rng.normal(size=(2, 400)), torch.float32)
    v = _t(rng.normal(size=(2, 400, 3)), torch.float32)
    for kernel, call in (("relu", slicedkern.relu_attention), ("hat", lambda *a, **kw: slicedkern.hat_attention(
            *a, 0.7, **kw))):
        out = call(q, k, v, engine="triton")
        expected = call(*(a.to(torch.float64) for a in (q, k, v)), engine="scan")
        err = np.linalg.norm(_np(out) - _np(expected)) / np.linalg.norm(_np(expected))
        assert err <= 2e-6, kernel


def test_nan_policy_and_empty_rows(rng):
    q, k, v, mask = _data(rng)
    q[0, 0, 3] = np.nan
    k[1, 2, 5] = np.inf
    mask[0, 1, :] = False                    # a row with no valid key: attention 0
    args = dict(a=(_t(q), _t(k), _t(v)), key_mask=_t(mask, torch.bool))
    out = _np(ATTENTION[0][1](slicedkern, engine="triton", **args))
    want = _np(ATTENTION[0][1](slicedkern, engine="scan", **dict(args, a=(_t(q), _t(k), _t(v)))))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    assert np.isnan(out[0, 0, 3]).all() and np.isnan(out[1, 2]).all() and (out[0, 1] == 0).all()
    np.testing.assert_allclose(out, want, rtol=1e-9, atol=1e-11)


def test_nan_policy_of_float32_values_read_off_the_totals(rng):
    """float32 values: their finiteness is read off the table's float64 totals (the NaN policy's
    deferred check), not from a pass over them. An infinite value of a key that takes part makes its
    batch row NaN (not inf: the check, not the arithmetic, decides), an infinite one of a masked key
    changes nothing, a NaN query its own row; forward against the scan, and the gradients NaN on
    exactly the rows the output is NaN on. (Under the interpreter, NumPy would warn of the ``inf *
    0`` the kernels compute on the bad row.)"""
    q, k, v, mask = _data(rng)
    mask[0, 0, 5], mask[1, 1, 3] = True, False
    v[0, 0, 5, 1] = np.inf                   # takes part: row (0, 0) is NaN, not inf
    v[1, 1, 3, 0] = np.inf                   # masked: ignored
    q[1, 2, 4] = np.nan                      # its own row only
    outs = []
    for engine in ("triton", "scan"):
        args = [_t(a, torch.float32).requires_grad_() for a in (q, k, v)]
        with np.errstate(invalid="ignore", over="ignore"):
            out = slicedkern.relu_attention(*args, key_mask=_t(mask, torch.bool), engine=engine)
            grads = torch.autograd.grad(out.sum(), args)
        outs.append((_np(out), *(_np(g) for g in grads)))
    (out, dq, dk, dv), (want, *_) = outs
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    assert np.isnan(out[0, 0]).all() and np.isnan(out[1, 2, 4]).all()
    assert np.isnan(out).sum() == out[0, 0].size + out.shape[-1]
    np.testing.assert_allclose(np.nan_to_num(out), np.nan_to_num(want), rtol=1e-5, atol=1e-6)
    bad = np.zeros(q.shape[:-1], dtype=bool)
    bad[0, 0] = True
    assert np.isnan(dk[bad]).all() and np.isnan(dv[bad]).all() and np.isnan(dq[bad]).all()
    assert np.isfinite(dk[~bad]).all() and np.isfinite(dv[~bad]).all()
    assert np.isnan(dq[1, 2, 4]) and np.isfinite(np.delete(dq[1, 2], 4)).all()


@pytest.mark.exhaustive            # under the interpreter a tile of 2 keys costs minutes; the default
def test_many_tiles_and_column_blocks(rng, monkeypatch):   # profile crosses tiles with the 8-key ones
    """Tiles of 2 keys, blocks of 4 queries, 2 columns: a query block reads several tiles, the
    last tile and block are partial, D above the column block; a mixture of 3 hats with ties and a
    key mask, forward and gradients against the dense reference."""
    if DEVICE == "cpu":
        _tiles(monkeypatch, 2, 4, 2)
    levels = [-1.0, -0.5, 0.0, 0.25, 0.5, 1.0]           # dyadic: ties between queries, keys and knots
    q, k = rng.choice(levels, size=(1, 13)), rng.choice(levels, size=(1, 11))
    v, mask = rng.normal(size=(1, 11, 3)), rng.random((1, 11)) > 0.3
    kernel = HatMixture([0.5, 1.0, 0.25], [1.0, -0.4, 0.3])
    cot = _t(rng.normal(size=(1, 13, 3)))
    results = []
    for module, kw in ((slicedkern, {"engine": "triton"}), (reference, {})):
        args = [_t(a).requires_grad_() for a in (q, k, v)]
        out = module.kernel_attention(*args, kernel, key_mask=_t(mask, torch.bool), center=True, normalize="abs",
                                      **kw)
        results.append((out, *torch.autograd.grad((out * cot).sum(), args)))
    for got, want, label in zip(*results, ("out", "q", "k", "v")):
        np.testing.assert_allclose(_np(got), _np(want), rtol=1e-9, atol=1e-11, err_msg=label)


def test_strided_values_in_the_b_t_h_d_layout(rng):
    """Values as a (B, H, T, D) view of a (B, T, H, D) tensor (the layout of the projections) are
    read through their strides: the same output as from a contiguous copy, and as the reference."""
    q, k = rng.normal(size=(1, 3, 19)), rng.normal(size=(1, 3, 19))
    base = _t(rng.normal(size=(1, 19, 3, 5)))
    v = base.transpose(1, 2)
    assert not v.is_contiguous()
    out = slicedkern.relu_attention(_t(q), _t(k), v, engine="triton")
    np.testing.assert_array_equal(_np(out), _np(slicedkern.relu_attention(_t(q), _t(k), v.contiguous(),
                                                                          engine="triton")))
    np.testing.assert_allclose(_np(out), reference.relu_attention(q, k, _np(v)), rtol=1e-9, atol=1e-11)


@pytest.fixture
def small_leaves(monkeypatch):
    """Causal leaves of 4 positions under the interpreter, so that these small cases run every level
    of the divide and conquer (23 keys: positions 0..31, levels of 4, 8 and 16 positions)."""
    import slicedkern.engines.triton as engine
    if DEVICE == "cpu":
        monkeypatch.setattr(engine, "CAUSAL_LEAF", 4)


CAUSAL = ATTENTION         # every normaliser: the causal epilogue divides by each


@pytest.mark.parametrize("name, op", CAUSAL, ids=[a[0] for a in CAUSAL])
def test_causal_attention_matches_the_dense_reference(rng, small_leaves, name, op):
    """Causal attention on the triton kernels (the scan's levels, each one pass 1 and one pass 2 over
    the block pairs as rows): Lq < Lk (bottom-right alignment), dyadic ties, a key mask; forward
    and gradients against the dense causal reference; two rows (the batch dims are flattened before
    the engine: the other tests hold them)."""
    q, k, v, mask = _data(rng, ties=True, rows=2)
    cot = _t(rng.normal(size=q.shape + (DV,)))
    results = []
    for module, kw in ((slicedkern, {"engine": "triton"}), (reference, {})):
        args = [_t(a).requires_grad_() for a in (q, k, v)]
        out = op(module, a=args, key_mask=_t(mask, torch.bool), causal=True, **kw)
        results.append((out, *torch.autograd.grad((out * cot).sum(), args)))
    for got, want, label in zip(*results, ("out", "q", "k", "v")):
        # the "relu" normaliser clamps at eps (outputs up to 1e6 here): rounding scales with the largest
        scale = max(1.0, float(np.abs(_np(want)).max()))
        np.testing.assert_allclose(_np(got), _np(want), rtol=1e-9, atol=1e-11 * scale, err_msg=label)


def test_causal_more_queries_than_keys_nan_rule_and_low_precision(rng, small_leaves):
    """Lq > Lk (the first queries see no key), a non-finite key that poisons the queries that see
    it, a NaN query; and float32 and bfloat16 inputs within their rounding of the float64 result,
    output and gradients (``dv`` written in the values' dtype by ``causal_dv``: through float32,
    which the interpreter's float64-to-bfloat16 cast got wrong, 1e-40 and NaN for 2.58)."""
    q, k = rng.normal(size=(2, 21)), rng.normal(size=(2, 13))
    v = rng.normal(size=(2, 13, 3))
    k[1, 6] = np.inf
    q[0, 15] = np.nan
    out = _np(slicedkern.relu_attention(_t(q), _t(k), _t(v), causal=True, engine="triton"))
    want = _np(slicedkern.relu_attention(_t(q), _t(k), _t(v), causal=True, engine="scan"))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    assert np.isnan(out[1, 14:]).all() and not np.isnan(out[1, :14]).any() and np.isnan(out[0, 15]).all()
    np.testing.assert_allclose(out, want, rtol=1e-9, atol=1e-11)
    # the levels read the values in their own dtype (float32 / bfloat16 tiles, float64 carries)
    cot = rng.normal(size=(2, 21, 3))
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
        q_, k_, v_ = (_t(a, dtype).requires_grad_() for a in (rng.normal(size=(2, 21)), rng.normal(size=(2, 13)), v))
        out_ = slicedkern.relu_attention(q_, k_, v_, causal=True, engine="triton")
        assert out_.dtype == dtype
        got = (out_, *torch.autograd.grad((out_.double() * _t(cot)).sum(), (q_, k_, v_)))
        exact_args = [_t(_np(a)).requires_grad_() for a in (q_, k_, v_)]
        exact = reference.relu_attention(*exact_args, causal=True)
        want = (exact, *torch.autograd.grad((exact * _t(cot)).sum(), exact_args))
        for a, b, label in zip(got, want, ("out", "q", "k", "v")):
            assert a.dtype == dtype, label
            err = np.linalg.norm(_np(a.double()) - _np(b)) / np.linalg.norm(_np(b))
            assert err <= (tol if label == "out" else 4 * tol), (dtype, label, err)


def test_causal_values_read_only_where_keys_take_part(rng, small_leaves):
    """The causal forward hands the kernels the values as given, not a copy zeroed on the keys that
    take no part (``Levels.masked_values``: every kernel loads a value only where its key takes
    part): a NaN and an infinite value of masked keys change nothing, an infinite value of a key
    that takes part makes NaN the queries that see it. Output and gradients equal the scan
    engine's, which zeroes the values first; NaN on the same entries."""
    q, k = rng.normal(size=(2, 13)), rng.normal(size=(2, 19))
    v, mask = rng.normal(size=(2, 19, 3)), rng.random((2, 19)) > 0.3
    mask[0, 4] = mask[0, 9] = False
    v[0, 4, 1], v[0, 9, 0] = np.nan, np.inf
    mask[1, 11] = True
    v[1, 11, 2] = np.inf                   # position 11: queries 5 .. 12 of row 1 see it
    results = []
    for engine in ("triton", "scan"):
        args = [_t(a).requires_grad_() for a in (q, k, v)]
        out = slicedkern.relu_attention(*args, key_mask=_t(mask, torch.bool), causal=True, engine=engine)
        results.append([_np(a) for a in (out, *torch.autograd.grad(out.sum(), args))])
    assert np.isnan(results[0][0][1, 5:]).all() and not np.isnan(results[0][0][1, :5]).any()
    assert not np.isnan(results[0][0][0]).any()
    for got, want, label in zip(*results, ("out", "q", "k", "v")):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=label)
        np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=1e-9, atol=1e-11, err_msg=label)


def test_causal_bandwidth_and_weight_gradients(rng, small_leaves):
    """Per-head bandwidths and mixture weights: their gradients summed over the blocks of every
    level and the leaves, equal to the scan's (two heads)."""
    q, k, v, _ = _data(rng, rows=2)
    b = rng.uniform(0.3, 1.5, size=(2,))
    grads = []
    for engine in ("triton", "scan"):
        qa, ka, va = (_t(a).requires_grad_() for a in (q, k, v))
        bands = _t(np.stack([b, 2 * b], axis=-1)).requires_grad_()
        weights = _t(np.array([1.0, -0.5])).requires_grad_()
        out = slicedkern.hat_mixture_attention(qa, ka, va, bands, weights, causal=True, engine=engine)
        grads.append(torch.autograd.grad(out.sin().sum(), (qa, ka, va, bands, weights)))
    for got, want in zip(*grads):
        np.testing.assert_allclose(_np(got), _np(want), rtol=1e-9, atol=1e-11)



@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
def test_leaf_pullback_matches_the_scan_leaves(rng, strict):
    """The dense leaves' pull-back kernel (``leaf_pullback``) against the scan's array form: dyadic
    scores and knots (ties of ``x - y`` with the knots on either side the profile says), a learned
    knot and coefficient per head, a knot of fixed zero coefficient (left out of the kernel), two
    profiles over different columns with strided cotangents, leaves of 8 over 24 positions."""
    import array_api_compat.torch as xp

    from slicedkern.engines.sortscan.leaves import leaf_vjp
    from slicedkern.engines.triton._causal import dense_leaves_vjp
    from slicedkern.kernels import Profile
    grid = [-1.0, -0.5, 0.0, 0.25, 0.5, 1.0]
    x, y = _t(rng.choice(grid, size=(2, 3, 24))), _t(rng.choice(grid, size=(2, 3, 24)))
    w = _t(rng.normal(size=(2, 3, 24, 5)))
    knot, coeff = _t(rng.choice([-0.5, 0.0, 0.25], size=(3,))), _t(rng.normal(size=(3,)))
    values = Profile([0.0, knot, 0.5], [2.0, coeff, 0.0], -1.0, 0.25, slice(0, 4), False, (True, strict, True))
    indicator = Profile([knot], [1.0], 0.0, 0.0, slice(4, 5), False, (not strict,))
    cots = [_t(rng.normal(size=(2, 3, 24, 6)))[..., 1:5], _t(rng.normal(size=(2, 3, 24, 1)))]
    for learned in (True, False):
        want = leaf_vjp(xp, x, y, w, [values, indicator], cots, 8, param_grads=learned)
        got = dense_leaves_vjp(xp, x, y, w, [values, indicator], cots, 8, param_grads=learned)
        for a, b in zip(got[:3], want[:3]):
            np.testing.assert_allclose(_np(a), _np(b), rtol=1e-12, atol=1e-12)
        for (gk, gc), (wk, wc) in zip(got[3], want[3]):
            for a, b in zip(gk + gc, wk + wc):
                assert (a is None) == (b is None)
                if a is not None:
                    np.testing.assert_allclose(_np(a), _np(b), rtol=1e-12, atol=1e-12)
        assert (got[3][0][0][1] is not None) == learned

# -- decoding: DecodeCache's runs on the device, one launch per attend ---------------------------------
DECODE_PROFILES = {"relu": ReLU(), "hat": Hat(0.7), "general": None}


def _decode_profile(name):
    from slicedkern.kernels import Profile
    kernel = DECODE_PROFILES[name]
    return Profile((-0.5, 0.3), (1.5, -0.75), 0.25, -0.5) if kernel is None else Profile.of(kernel)


def _decode_steps(runs, q, k, v, mask):
    """Every chunk's queries after appending the chunk (each sees every key appended so far)."""
    rows, t = [], 0
    for step in DECODE_CHUNKS:
        runs.append(_t(k[..., t:t + step]), _t(v[..., t:t + step, :]), _t(mask[..., t:t + step], torch.bool))
        rows.append(_np(runs.attend(_t(q[..., t:t + step]))))
        t += step
    return np.concatenate(rows, axis=-2)


@pytest.mark.parametrize("profile, normalize, center", [
    ("relu", "abs", True), ("relu", "relu", False), ("hat", "abs", True), ("hat", "count", True),
    ("general", None, False), ("general", "relu", True),
    *[pytest.param(p, nz, c, marks=pytest.mark.exhaustive) for p in DECODE_PROFILES
      for nz in ("abs", "relu", "count", None) for c in (False, True)
      if (p, nz, c) not in {("relu", "abs", True), ("relu", "relu", False), ("hat", "abs", True),
                            ("hat", "count", True), ("general", None, False), ("general", "relu", True)}]])
def test_device_runs_equal_the_array_api_runs(rng, profile, normalize, center):
    """The device runs (sorted on the device, attended by one launch over every run) against the
    array-API runs: chunks that carry into runs of every size, ties, a key mask, chunks of queries."""
    import array_api_compat.torch as xp

    from slicedkern._spec import Normalizer
    from slicedkern.engines.scan._decode import Runs
    from slicedkern.engines.triton._decode import DeviceRuns
    q, k, v, mask = decode_data(rng)
    options = dict(center=center, normalizer=Normalizer(normalize, 1e-6), dv=v.shape[-1])
    got = _decode_steps(DeviceRuns(xp, _decode_profile(profile), **options), q, k, v, mask)
    want = _decode_steps(Runs(xp, xp.float64, _decode_profile(profile), **options), q, k, v, mask)
    # the ReLU normaliser clamps to eps = 1e-6 (outputs up to 1e6): rounding scales with the output
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * max(1.0, np.abs(want).max()))


def test_device_runs_nan_rule_growth_and_per_head_bandwidths(rng):
    """A non-finite key that takes part makes every later query of its row NaN, a masked one is not
    read, a NaN query is NaN alone; storage that doubles keeps what it held; a bandwidth per head
    (an array profile) gives the array-API runs' result."""
    import array_api_compat.torch as xp

    from slicedkern._spec import Normalizer
    from slicedkern.engines.scan._decode import Runs
    from slicedkern.engines.triton._decode import DeviceRuns
    from slicedkern.kernels import Profile, hat_profile
    q, k, v, mask = decode_data(rng, batch=(2,))
    poison_decode_data(q, k, v, mask)
    runs = DeviceRuns(xp, Profile.of(ReLU()), center=True, normalizer=Normalizer("abs", 1e-6), dv=3)
    out = _decode_steps(runs, q, k, v, mask)
    seen = np.repeat(np.cumsum(DECODE_CHUNKS), DECODE_CHUNKS)      # keys appended when query j attends
    assert np.isnan(out[0, seen > 10]).all() and not np.isnan(out[0, seen <= 10]).any()
    assert np.isnan(out[1, 20]).all() and np.isnan(out[1]).sum() == 3
    assert runs.capacity == 64 and runs.length == 40        # 16 at the first append, doubled twice
    # a bandwidth per head (an array profile: per-row knots in the kernel), against the array-API runs
    # (held equal to the causal op in tests/test_decode.py)
    q, k, v, _ = decode_data(rng, batch=(1, 3))
    profile = hat_profile([_t(np.array([[0.5, 1.0, 2.0]]))], [1.0])
    results = []
    for runs in (DeviceRuns(xp, profile, center=True, normalizer=Normalizer("abs", 1e-6), dv=3),
                 Runs(xp, xp.float64, profile, center=True, normalizer=Normalizer("abs", 1e-6), dv=3)):
        for t in range(0, 40, 8):
            runs.append(_t(k[..., t:t + 8]), _t(v[..., t:t + 8, :]), _t(np.ones((1, 3, 8), bool), torch.bool))
        results.append(_np(runs.attend(_t(q[..., -1:]))))
    np.testing.assert_allclose(*results, rtol=1e-12, atol=1e-12)


def test_decode_cache_keeps_cuda_runs_on_the_device():
    """DecodeCache picks the device runs for CUDA tensors only (CPU tensors: the host's compiled runs)."""
    from slicedkern.engines import get
    assert not get("triton").decodes(torch.zeros(2))
    if DEVICE == "cuda":
        from slicedkern.engines.triton._decode import DeviceRuns
        cache = slicedkern.DecodeCache("relu")
        cache.append(torch.randn(1, 2, 5, device="cuda"), torch.randn(1, 2, 5, 3, device="cuda"))
        assert isinstance(cache._runs, DeviceRuns)


def _launch_arguments(value):
    """Every scalar of a launch argument, through the fields of its records."""
    if isinstance(value, tuple):
        return [scalar for field in value for scalar in _launch_arguments(field)]
    return [value]


def test_no_python_float_reaches_a_kernel(rng, small_leaves, monkeypatch):
    """Compiled Triton types a Python float argument float32 (the interpreter keeps it float64), so
    a float64 ``eps`` of 1e-300 would reach the divisor as 0 and one of 0.37 rounded: the GPU's
    ``test_eps_value_is_used`` failure of 2026-12-04. Every launch of attention's forward and
    backward (ReLU with each normaliser, a hat with learned bandwidths) and of decoding passes its
    float parameters as float64 arrays."""
    from slicedkern._spec import Normalizer
    from slicedkern.engines.triton import _sums
    from slicedkern.engines.triton._decode import DeviceRuns
    kernels = _sums.loaded()
    floats = []

    class Checked:
        def __init__(self, name, jitted):
            self.name, self.jitted = name, jitted

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                found = [a for a in _launch_arguments(args) + list(kwargs.values()) if type(a) is float]
                floats.extend((self.name, a) for a in found)
                return self.jitted[grid](*args, **kwargs)
            return launch
    for name in kernels.KERNELS:
        monkeypatch.setattr(kernels, name, Checked(name, getattr(kernels, name)))
    q, k, v, mask = _data(rng, rows=2)
    args = [_t(a).requires_grad_() for a in (q, k, v)]
    width = _t([0.5, 0.7]).requires_grad_()
    for causal in (False, True):
        for normalize in ("abs", "relu", "count", None):
            out = slicedkern.relu_attention(*args, key_mask=_t(mask, torch.bool), causal=causal,
                                            normalize=normalize, eps=0.37, engine="triton")
            torch.autograd.grad(out.sum(), args)
        out = slicedkern.hat_attention(*args, width, causal=causal, engine="triton")
        torch.autograd.grad(out.sum(), [*args, width])
    import array_api_compat.torch as xp
    runs = DeviceRuns(xp, _decode_profile("relu"), center=True, normalizer=Normalizer("abs", 0.37), dv=DV)
    runs.append(_t(k[..., :8]), _t(v[..., :8, :]))
    runs.attend(_t(q[..., :2]))
    assert not floats, floats


def test_no_host_value_is_copied_to_the_device_in_a_training_step(rng, small_leaves):
    """torch copies a CPU value to a CUDA tensor with a stream synchronisation (a pageable copy that
    is not ``non_blocking``), so one ``asarray`` of a Python scalar per call makes the host wait for
    the GPU: the H200 run of 2026-12-04 showed the call returning only when the device was done
    (docs/benchmarks.rst, "On a GPU"). Warm forward and backward calls, on triton and the scan (the
    two engines of CUDA tensors), causal and not, make no array from a host value (constants are
    ``full``, a fill on the device)."""
    made = []

    def watched(make):
        def call(obj, *args, **kwargs):
            if not isinstance(obj, torch.Tensor):
                made.append(type(obj).__name__)
            return make(obj, *args, **kwargs)
        return call
    q, k, v, mask = _data(rng, rows=2)
    args = [_t(a).requires_grad_() for a in (q, k, v)]
    key_mask = _t(mask, torch.bool)
    for engine in ("triton", "scan"):
        for causal in (False, True):
            for warm in (False, True):      # the first call makes the cached constants
                with pytest.MonkeyPatch.context() as mp:
                    if warm:
                        mp.setattr(torch, "asarray", watched(torch.asarray))
                        mp.setattr(torch, "tensor", watched(torch.tensor))
                    out = slicedkern.relu_attention(*args, key_mask=key_mask, causal=causal, engine=engine)
                    torch.autograd.grad(out.sum(), args)
            assert not made, (engine, causal, made)


def test_every_grid_fits_cuda_limits(monkeypatch, engine_tiles):
    """CUDA runs at most 65535 programs along a grid's second and third axes (2^31 - 1 along the
    first): the GPU run of 2026-12-04 failed at 2^20 keys, pass 1 having one program per tile of 16
    keys on the second axis. Every launch of attention's forward and backward at 2^21 keys, causal
    and not, captured without running (the kernels' results are not read on the host)."""
    from slicedkern.engines.triton import _sums
    kernels = _sums.loaded()
    grids = []

    class Captured:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            grids.append((self.name, tuple(grid)))
            return lambda *args, **kwargs: None
    for name in kernels.KERNELS:
        monkeypatch.setattr(kernels, name, Captured(name))
    n = 1 << 21
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, n, generator=g, dtype=torch.float32).requires_grad_() for _ in range(2))
    v = torch.randn(1, n, 2, generator=g, dtype=torch.float32).requires_grad_()
    for causal in (False, True):
        out = slicedkern.relu_attention(q, k, v, causal=causal, engine="triton")
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert {name for name, _ in grids} >= {"tile_sums", "attend_eval", "causal_epilogue"}, grids
    too_big = [(name, grid) for name, grid in grids
               if grid[0] >= 2 ** 31 or any(axis > 65535 for axis in grid[1:])]
    assert not too_big, sorted(set(too_big))


def _traffic():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "scripts" / "triton_traffic.py"
    spec = importlib.util.spec_from_file_location("triton_traffic", path)
    traffic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(traffic)
    return traffic


@pytest.fixture
def two_passes(monkeypatch):
    """The sorts and the two passes at every length: no one-launch forward of short rows."""
    from slicedkern.engines.triton import _sums
    monkeypatch.setattr(_sums, "SMALL_FUSED", 0)


@pytest.mark.parametrize("fused", [True, False], ids=["one-launch", "two-pass"])
def test_host_work_of_a_warm_call_makes_no_profile_arrays(monkeypatch, fused, engine_tiles):
    """On a GPU at small L the host's operators are the time (docs/benchmarks.rst, "On a GPU"): a
    fixed profile's knot, coefficient and slope arrays are made by the first call only, and the
    NaN policy makes no pass over the values; the forward of short rows in one launch runs fewer
    operators than its sorts and two passes."""
    if DEVICE != "cpu":
        pytest.skip("counted on CPU tensors, the launches skipped")
    from slicedkern.engines.triton import _sums
    if not fused:
        monkeypatch.setattr(_sums, "SMALL_FUSED", 0)
    for backward in (False, True):
        found = _traffic().host_cost(16, 4, 2, backward, repeat=1)
        # the constants are 0-d fills (_lib.namespace.scalar, no host copy): what must not appear is
        # a profile's arrays, stacked per call
        assert not {"stack"} & set(found["by op"]), found["by op"]
        assert found["by op"].get("full", 0) + found["by op"].get("fill", 0) <= 8, found["by op"]
        assert found["operators"] > 0 and found["launches"]["small_attend" if fused else "attend_eval"] >= 1
        # float32 values: their finiteness is read off the table's totals, and the backward reuses
        # the forward's verdicts, so no pass for it over the values, forward or backward; the
        # aminmax are the values' scaling's bound (issue 49, item 2: the values, the queries and
        # the keys), once in the forward and once in the backward
        assert found["by op"].get("aminmax") == 3 * (1 + backward), found["by op"]


def test_traffic_of_the_forward(two_passes, engine_tiles):
    """The forward's structure (scripts/triton_traffic.py counts it): one sort each of the keys and
    the queries (each one launch at this length), one tile-sum launch and one evaluation launch (the
    count and normaliser sums and the values together, centring and divisor in its epilogue), and
    no intermediate of n * D
    elements or more: no per-key prefix table, and the output written in its own dtype, not in
    float64 and cast."""
    if DEVICE != "cpu":
        pytest.skip("counted under the interpreter, on CPU tensors (the counts do not depend on the device)")
    both = _traffic().count(48, 8, 1, backward=True)
    found = both["forward"]
    # the two sorts are one launch each of the small-L sort (float32 scores, 48 per row)
    assert found["launches"] == {"sort_rows": 2, "tile_sums": 1, "attend_eval": 1}
    assert found["sorts"] == 2
    # float32 scores, lifted to float64 by the op, are sorted as the float32 numbers they are
    assert found["sorted dtypes"] == ["float32"]
    # one: the values scaled by their batch row's power of two (_scale.value_scale, issue 49, item 2)
    assert found["large intermediates"] == 1 and found["by op"] == {"mul": 1}, found
    # the backward reuses the forward's sorted orders (its residuals): still one sort per array
    assert both["sorts"] == 2


def test_traffic_of_the_backward(two_passes, engine_tiles):
    """The backward's structure (issue 26, item 2): the forward's table of keys kept (its carry a
    residual: no pass 1 over the keys again), one table of the cotangent rows over the sorted
    queries, scaled as the kernels read them, and one of the two indicator cotangents; evaluations
    for dq (the values' and the two indicator columns'), dk (the same, reflected) and dv, which is
    written centred, masked and in the values' dtype by its epilogue; the quotient rule's row dots
    with the output and the centring mean, and the mean's cotangent summed over the queries, by
    reductions that read the cotangent and the output in their own dtype. No intermediate of n * D
    elements or more: no float64 copy of the cotangent or the output, no copy of the values with the
    NaN policy's zeros (the kernels skip the keys that take no part), none of the pulled-back sums;
    and no value read back to the host (a device synchronisation)."""
    if DEVICE != "cpu":
        pytest.skip("counted under the interpreter, on CPU tensors (the counts do not depend on the device)")
    found = _traffic().count(48, 8, 1, backward=True)
    # pass 1 over the cotangent rows twice: dk's table, and dv's with the rows whose normaliser sum
    # is exactly 0 scaled by 0 (``_silent_rows``, a mask: nothing read back to the host to skip it)
    # pass 2: the forward's attention, the dots of dq and dk (three profiles each), dv's sums
    assert found["launches"] == {"sort_rows": 2, "tile_sums": 1 + 3, "attend_eval": 1, "dots_eval": 3 + 3,
                                 "sums_eval": 1, "row_dots": 2, "column_sums": 1}
    # three: the values scaled by the forward and by the backward, and the output by the backward
    # (_scale.value_scale, issue 49, item 2)
    assert found["large intermediates"] == 3 and found["by op"] == {"mul": 3}, found
    assert found["host reads"] == 0, found


def test_traffic_of_the_forward_of_short_rows(monkeypatch, engine_tiles):
    """Short rows take attention's forward in one launch (issue 26, item 3: ``small_attend`` sorts
    the keys and the queries, sums every column's tiles, reads the values' NaN verdict off the
    totals and evaluates the queries): no other launch, no intermediate of n * D elements or more,
    fewer host operators than the sorts and two passes; its backward is the two-pass one's on the
    same residuals (one sort per array in all, nothing read back to the host)."""
    if DEVICE != "cpu":
        pytest.skip("counted under the interpreter, on CPU tensors (the counts do not depend on the device)")
    from slicedkern.engines.triton import _sums
    traffic = _traffic()
    found = traffic.count(48, 8, 1, backward=True)
    forward = found["forward"]
    assert forward["launches"] == {"small_attend": 1}
    assert forward["sorts"] == 2 and forward["sorted dtypes"] == ["float32"]
    assert forward["large intermediates"] == 1, forward          # the scaled values (issue 49, item 2)
    assert found["launches"] == {"small_attend": 1, "tile_sums": 3, "dots_eval": 3 + 3, "sums_eval": 1,
                                 "row_dots": 2, "column_sums": 1}
    assert found["sorts"] == 2 and found["large intermediates"] == 3 and found["host reads"] == 0, found
    fused = traffic.host_cost(48, 8, 2, False, repeat=1)["operators"]
    monkeypatch.setattr(_sums, "SMALL_FUSED", 0)
    assert fused < traffic.host_cost(48, 8, 2, False, repeat=1)["operators"]


SHORT_ROWS = [pytest.param(name, op, dtype, marks=[pytest.mark.exhaustive] if dtype == torch.bfloat16 and
                           name != "relu-abs" else [], id=f"{name}-{str(dtype)[6:]}")
              for dtype in (torch.float32, torch.bfloat16) for name, op in ATTENTION]


@pytest.mark.parametrize("name, op, dtype", SHORT_ROWS)
def test_short_rows_in_one_launch_equal_the_two_passes(rng, monkeypatch, name, op, dtype):
    """The one-launch forward of short rows writes what the sorts and the two passes write, bit for
    bit under the interpreter (to float32 rounding compiled: the carry's running sums are a
    cumulative sum on the GPU): the output, and for ReLU and hat attention the residuals, so the
    gradients too. Every normaliser, masks, dyadic ties, Lq != Lk, 6 value columns (2 column
    blocks, one partial) and 2 query slices a row, a NaN value of a key that takes part (its batch
    row NaN), an infinite value of a masked key (nothing), a NaN query (its own row)."""
    from slicedkern.engines.triton import _sums
    dyadic = [-1.0, -0.5, 0.0, 0.25, 0.5, 1.0]
    q, k = rng.choice(dyadic, size=(2, 2, 17)), rng.choice(dyadic, size=(2, 2, 23))
    v, mask = rng.normal(size=(2, 2, 23, 6)), rng.random((2, 2, 23)) > 0.3
    mask[0, 1, 6], mask[1, 0, 2] = True, False
    v[0, 1, 6, 5], v[1, 0, 2, 3] = np.nan, np.inf
    q[1, 1, 4] = np.nan
    g = _t(rng.normal(size=(2, 2, 17, 6)), dtype)
    backward = name in ("relu-abs", "hat")
    found = []
    for fused in (1024, 0):
        monkeypatch.setattr(_sums, "SMALL_FUSED", fused)
        args = [_t(a, dtype).requires_grad_(backward) for a in (q, k, v)]
        with np.errstate(invalid="ignore", over="ignore"):
            out = op(slicedkern, a=args, key_mask=_t(mask, torch.bool), engine="triton")
            grads = torch.autograd.grad(out, args, g) if backward else ()
        found.append([_np(a) for a in (out, *grads)])
    assert np.isnan(found[0][0][0, 1]).all() and np.isnan(found[0][0][1, 1, 4]).all()
    assert np.isfinite(found[0][0][1, 0]).all()
    for one, two in zip(*found):
        np.testing.assert_array_equal(np.isnan(one), np.isnan(two))
        if DEVICE == "cpu":
            np.testing.assert_array_equal(one, two)
        else:
            np.testing.assert_allclose(one, two, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


def test_traffic_of_the_backward_with_learned_bandwidths(engine_tiles):
    """Hat attention with a learned bandwidth per head: its knot and coefficient gradients are the
    knots' ReLU and step sums dotted with the cotangent in pass 2's epilogue (``_views.kernel_knot_grads``), and
    the bandwidths' NaN rule is the forward's factor (``Engine.folds_row_ok``): no intermediate of
    n * D elements or more, forward or backward (before: 14, the generic pull-back's)."""
    if DEVICE != "cpu":
        pytest.skip("counted under the interpreter, on CPU tensors (the counts do not depend on the device)")
    found = _traffic().count(48, 8, 2, backward=True, bandwidths=True)
    # but the values scaled by the forward and the backward, and the output by the backward
    # (_scale.value_scale, issue 49, item 2)
    assert found["large intermediates"] == 3 and found["by op"] == {"mul": 3}, found
    assert found["sorts"] == 2


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_relu_normaliser_gradients_at_large_tied_scores(small_leaves, causal):
    """Rows whose ReLU normaliser is exactly 0 send their cotangent to dq and dk but not to dv
    (engines/_vjp.py, ``_silent_rows``): on the triton engine, a second cotangent table with those
    rows' factors zeroed (causal: a second copy of the value columns, through the levels and the
    leaves, whose dv is dropped). Scores of 1e20 with ties: dv within 1e-12 of the dense
    reference, where the rounding of the sums over the queries would put 1.7e10 (issue 23, item
    10)."""
    worst = 0.0
    for seed in (80, 100, 114, 138, 174):
        rng = np.random.default_rng(seed)
        scores = rng.integers(-9, 9, size=(1, 18)).astype(float) * 1e20
        v, g = rng.normal(size=(1, 18, 1)), _t(rng.normal(size=(1, 18, 1)))
        grads = []
        for module, engine in ((slicedkern, "triton"), (reference, None)):
            args = [_t(a).requires_grad_() for a in (scores, scores, v)]
            kw = {"engine": engine} if engine else {}
            out = module.relu_attention(*args, normalize="relu", causal=causal, **kw)
            grads.append(torch.autograd.grad((out * g).sum(), args[2])[0])
        worst = max(worst, float((grads[0] - grads[1]).abs().max()))
    assert worst < 1e-12


@pytest.mark.parametrize("n", [1, 7, 300, 4096])
def test_sort_rows_is_a_stable_sort(n):
    """The small-L sort (``_order.sort_rows``: float32 numbers as order-preserving bit patterns
    above their indices, one 64-bit ``tl.sort``) equals ``torch.sort(stable=True)``: values and
    indices, with ties, -0.0 beside 0.0, the largest finite numbers of both signs and subnormal
    ones, rows of 1 to 4096 (a whole block) entries, float64 arrays holding float32 numbers; three
    rows a launch (one at 4096)."""
    import array_api_compat.torch as xp

    from slicedkern.engines.triton import _sums
    g = torch.Generator().manual_seed(n)
    rows = 1 if n > 1024 else 3             # the interpreter runs a 4096-entry network in 7 s a row
    a = (torch.randint(-3, 4, (rows, n), generator=g) * 0.5).to(torch.float32)
    special = torch.tensor([-0.0, 0.0, 3.4e38, -3.4e38, 1e-45, -1e-45, -0.0], dtype=torch.float32)
    a.view(-1)[:min(special.numel(), a.numel())] = special[:a.numel()]
    a = a.to(device=DEVICE, dtype=torch.float64)
    values, perm = _sums._sorted(xp, a, torch.float32, torch.float64)
    want, want_perm = a.sort(dim=-1, stable=True)
    assert torch.equal(values, want) and torch.equal(perm.long(), want_perm)


@pytest.mark.parametrize("n, run", [(2, 1), (16, 1), (48, 8), (64, 32), (200, 100), (256, 16)])
def test_merge_runs_is_a_stable_sort(n, run):
    """One step of the causal levels' bottom-up merge sort (``_order.merge_runs``): runs of ``run``
    sorted (with ties: scores from 5 values) merged in pairs give exactly the stable sort of the runs
    of ``2 run``, values and indices within the run, with a run of 100 entries (not a power of two)
    and one row longer than a program's block; in the natural layout and in the split one (each
    level's left and right blocks contiguous) that the levels merge into."""
    import array_api_compat.torch as xp

    from slicedkern.engines.triton import _causal
    g = torch.Generator().manual_seed(n + run)
    a = torch.randint(-2, 3, (3, n), generator=g).to(device=DEVICE, dtype=torch.float64) * 0.25
    values, perm = a.reshape(3, n // run, run).sort(dim=-1, stable=True)
    merged, merged_perm = _causal.merge_runs(xp, values.reshape(3, n).contiguous(),
                                             perm.reshape(3, n).to(torch.int32).contiguous(), run)
    want, want_perm = a.reshape(3, n // (2 * run), 2 * run).sort(dim=-1, stable=True)
    assert torch.equal(merged, want.reshape(3, n))
    assert torch.equal(merged_perm.long(), want_perm.reshape(3, n))
    if n % (4 * run) == 0:
        # the split layout, (2, rows, n / 2) with every row's even runs first, in and out: the same
        # runs where the natural layout has them
        def split(x, size):
            return x.reshape(3, n // (2 * size), 2, size).permute(2, 0, 1, 3).reshape(2, 3, n // 2).contiguous()
        for split_in in (False, True):
            given = (split(values.reshape(3, n), run), split(perm.reshape(3, n), run)) if split_in else (
                values.reshape(3, n).contiguous(), perm.reshape(3, n).contiguous())
            got, got_perm = _causal.merge_runs(xp, given[0], given[1].to(torch.int32), run, split_in=split_in,
                                               split_out=True)
            assert torch.equal(got, split(want.reshape(3, n), 2 * run))
            assert torch.equal(got_perm.long(), split(want_perm.reshape(3, n), 2 * run))


@pytest.mark.parametrize("lq, lk", [(150, 150), (90, 150), (150, 90), (1, 70)])
def test_causal_dv_finishes_dv_with_the_reverse_running_sum(lq, lk):
    """``dv``'s one-launch finish (``_causal.causal_dv``): ``(dw - sub) * factor`` with ``sub`` the
    reverse running sum of ``weights * g`` over the queries that see each key (query ``i`` at
    position ``i + lk - lq``), against the array form: more queries than keys (the first see none),
    fewer, one; key blocks of 64 crossed, 40 columns (two column blocks), a strided float32
    cotangent, a float64 ``dw`` read through a column slice, NaN factors, output in float32; and
    without the subtraction."""
    import array_api_compat.torch as xp

    from slicedkern.engines.triton import _causal
    g = torch.Generator().manual_seed(lq + lk)
    dw = torch.randn(2, lk, 41, generator=g, dtype=torch.float64, device=DEVICE)[..., :40]
    cot = torch.randn(2, 40, lq, generator=g, device=DEVICE).transpose(1, 2)
    weights = torch.rand(2, lq, generator=g, dtype=torch.float64, device=DEVICE)
    factor = (torch.rand(2, lk, generator=g, dtype=torch.float64, device=DEVICE) > 0.3).double()
    factor[1, 5] = float("nan")
    rows = weights[..., None] * cot.double()
    positions = torch.arange(lq, device=DEVICE) + lk - lq
    sees = positions[None, :] >= torch.arange(lk, device=DEVICE)[:, None]        # (lk, lq): query sees key
    sub = torch.einsum("kq,rqd->rkd", sees.double(), rows)
    got = _causal.causal_dv(xp, dw, cot, weights, factor, torch.float32)
    want = ((dw - sub) * factor[..., None]).float()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)
    plain = _causal.causal_dv(xp, dw, None, None, factor, torch.float64)
    torch.testing.assert_close(plain, dw * factor[..., None], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("lq, n", [(150, 150), (90, 150), (150, 90), (1, 70)])
def test_causal_row_dots_sum_the_running_totals_as_they_read(lq, n):
    """The running totals of ``[v take | take]`` over the positions, summed from their blocks'
    carry (``_causal.position_carry``) and a running sum in registers, as the backward's row dots
    read them (``_causal.causal_row_dots``: ``<g_i, V_{i + offset}>``, query ``i`` at position
    ``i + n - lq``, before position 0 for the first ``lq - n``): against the array form, position
    blocks of 64 crossed, 40 columns (two column blocks), strided float32 values that hold junk
    where ``take`` is False, a strided bfloat16 cotangent; from their own carry and from one over
    more positions. And the forward's combination on the same totals, through causal attention, in
    the other tests."""
    import array_api_compat.torch as xp

    from slicedkern.engines.triton import _causal
    g = torch.Generator().manual_seed(lq + n)
    w = torch.randn(2, 40, n, generator=g, device=DEVICE).transpose(1, 2)
    take = torch.rand(2, n, generator=g, device=DEVICE) > 0.25
    cot = torch.randn(2, lq, 40, generator=g, device=DEVICE).to(torch.bfloat16)
    offset = n - lq
    got = _causal.causal_row_dots(xp, cot, w, take, offset)
    running = torch.cumsum(torch.where(take[..., None], w.double(), 0.0), dim=1)
    positions = torch.arange(lq, device=DEVICE) + offset
    seen = torch.where((positions >= 0)[None, :, None], running[:, positions.clamp(min=0)], 0.0)
    want = (cot.double() * seen).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    carry = _causal.position_carry(xp, w, take.to(torch.int8))
    torch.testing.assert_close(carry[:, -1, :40], running[:, -1], rtol=1e-12, atol=1e-12)
    # the forward's carry, over the positions padded past n (NaN values that take no part), serves
    # the backward's row dots as well (the engine keeps it as a residual)
    padded_w = torch.cat([w, torch.full((2, 70, 40), float("nan"), device=DEVICE)], dim=1)
    padded_take = torch.cat([take, torch.zeros(2, 70, dtype=torch.bool, device=DEVICE)], dim=1)
    forward = _causal.position_carry(xp, padded_w, padded_take.to(torch.int8))
    assert forward.shape[1] > carry.shape[1]
    torch.testing.assert_close(_causal.causal_row_dots(xp, cot, w, take, offset, forward), want, rtol=1e-12,
                               atol=1e-12)
    assert torch.equal(carry[:, -1, 40], take.sum(-1).double())


@pytest.mark.parametrize("lq, lk", [(21, 13), (13, 21)])
def test_causal_gradients_with_more_or_fewer_queries_than_keys(rng, small_leaves, lq, lk):
    """Centred ReLU attention's gradients, causal, with Lq > Lk (blind first queries) and Lq < Lk,
    a key mask, against the dense reference: the centring mean's cotangent taken back to the keys
    in ``dv``'s one-launch finish and the quotient rule's row dots on the kernels."""
    q, k, v = rng.normal(size=(2, lq)), rng.normal(size=(2, lk)), rng.normal(size=(2, lk, 5))
    mask = rng.uniform(size=(2, lk)) > 0.2
    cot = _t(rng.normal(size=(2, lq, 5)))
    results = []
    for module, kw in ((slicedkern, {"engine": "triton"}), (reference, {})):
        args = [_t(a).requires_grad_() for a in (q, k, v)]
        out = module.relu_attention(*args, key_mask=_t(mask, torch.bool), causal=True, **kw)
        results.append((out, *torch.autograd.grad((out * cot).sum(), args)))
    for got, want, label in zip(*results, ("out", "q", "k", "v")):
        np.testing.assert_allclose(_np(got), _np(want), rtol=1e-9, atol=1e-11, err_msg=label)


def test_traffic_of_the_causal_forward(small_leaves, engine_tiles):
    """Causal: one segmented sort of each score array in runs of a leaf, and one bottom-up merge
    sort from there (issue 26, item 4); the dense leaves one launch per profile, each level's sums
    added in place into the running sums: per level one merge launch per array for the next level
    (none after the last), one tile-sum launch and one evaluation launch (the values with the
    indicator, the "abs" normaliser's sums riding the same launch: before, a second one), whatever
    the number of blocks; 48 positions
    with leaves of 4: levels of 4, 8, 16 and 32 positions. The backward takes the forward's sorted
    runs (residuals) through the same merges: it sorts nothing (before: each array once more)."""
    if DEVICE != "cpu":
        pytest.skip("counted under the interpreter, on CPU tensors (the counts do not depend on the device)")
    both = _traffic().count(48, 8, 1, backward=True, causal=True)
    found = both["forward"]
    # the dense leaves are one launch per profile, their (positions, leaf) products in registers;
    # the output is combined from the running sums by one launch more, in its own dtype
    # float32 scores: each array's runs sorted as float32 in one launch of the engine's own sort
    assert found["launches"] == {"sort_rows": 2, "leaf_eval": 2, "tile_sums": 4, "sums_eval": 4,
                                 "merge_runs": 2 * 3, "position_sums": 1, "causal_epilogue": 1}
    assert found["sorted dtypes"] == ["float32"]
    assert found["sorts"] == 2
    # what remains of n * D and more is the running sums (float32 for float32 values: nothing of
    # float64) and the values padded to the positions (48 of 64): 2.8 times the values' bytes; 4.3
    # with float64 running sums, 5.3 with the NaN rule's zeroed copy of the
    # values (the kernels load a value only where its key takes part), 9.8 with the running totals
    # as a float64 array, 14.0 with them summed from a float64 copy of the values, 23.75 with the
    # combination as array code (float64 centring and division), 29.4 with the leaves' (positions,
    # leaf) matrices too; the combination sums the totals from their blocks' carry as it reads the
    # values (position_sums one launch); and 1.0 more: the values scaled by their batch row's
    # power of two (_scale.value_scale, issue 49, item 2)
    assert found["by op"] == {"empty": 1, "cat": 1, "mul": 1}, found
    assert found["large float64"] == 0, found
    assert found["large bytes / (n D itemsize)"] < 4.0, found
    assert both["sorts"] == 2 and both["launches"]["merge_runs"] == 2 * 2 * 3


def test_traffic_of_the_causal_backward(engine_tiles):
    """The causal backward's dense leaves are pulled back by one launch per profile (the values, the
    indicator's ReLU count and the "abs" normaliser), their (positions, leaf) terms in registers;
    the levels' pull-backs are added in place into the leaves' gradients, the cotangent is read in
    its own dtype (the quotient rule's row dots one launch each, that with the value sums each query
    sees summing them from their blocks' carry as it reads the values) and ``dv`` is finished in one
    launch with the centring mean's reverse running sum. The levels and the leaves read the values
    as given, where their keys take part, and the cotangent rows in their own dtype, scaled by the
    quotient rule's factor as they read them (``_columns.MaskedValues``, ``ScaledRows``), and the
    silent rows' share of ``dv`` is scaled to 0 there: no host read. At 128 positions (two leaves
    of 64) what remains of n * D and more, forward and backward, is 2.1 times the values' bytes (2
    intermediates: the forward's running sums and the leaves' gradients, float32 for float32 values,
    which the levels add to in float64 and round once), against 4.25 with them float64, 8.1 (4)
    with the cotangent rows scaled into one joined float64 array and the value columns joined,
    9.6 (6) with the two zeroed copies, 15.0 (9) with the running totals as float64 arrays, 44.6
    (23) with all those steps as array code and 810 when the leaves' pull-back ran as array code
    too. With learned bandwidths the backward sorts nothing, as without: it merges the forward's
    sorted runs."""
    if DEVICE != "cpu":
        pytest.skip("counted under the interpreter, on CPU tensors (the counts do not depend on the device)")
    both = _traffic().count(128, 8, 1, backward=True, causal=True)
    assert both["launches"]["leaf_pullback"] == 3
    assert both["launches"]["causal_dv"] == 1 and both["launches"]["row_dots"] == 1
    # the row dots sum the running totals from the forward's block carry (a residual): one
    # position_sums launch in all, the forward's (before: the backward's own too)
    assert both["launches"]["causal_row_dots"] == 1 and both["launches"]["position_sums"] == 1
    assert "bmm" not in both["by op"] and "cumsum" not in both["by op"]
    # and three of 1.0 each: the values scaled by the forward and by the backward, and the output
    # by the backward (_scale.value_scale, issue 49, item 2)
    assert both["by op"] == {"empty": 1, "zeros": 1, "mul": 3}, both
    assert both["large float64"] == 0, both
    assert both["large bytes / (n D itemsize)"] < 5.25, both
    # the silent rows are a mask (one more pass 1 per level), not a question to the host (before: one)
    assert both["host reads"] == 0, both
    # every intermediate of any size 20.2 times the values' bytes (float32 running sums and value
    # gradients); 22.0 with them float64 (the merges writing each level's
    # blocks contiguous, one array of partial dots per pull-back, the factors read through a row
    # stride); 23.4 without those, 26.1 with the joined arrays, 26.9 with a join per level, 29.4
    # with each level's value gradients written apart, joined by columns and added (at 1024
    # positions, 16 columns, 2 heads, 4 levels: 39.1 -> 30.1 -> 25.9 -> 23.3 -> 19.5); 25.5 with
    # the values' scaling (issue 49, item 2: the three copies above, the scores' bounds and the
    # score gradients scaled back, forward and backward)
    assert both["all bytes / (n D itemsize)"] < 25.75, both
    # learned bandwidths: the levels' knot gradients over the tables their pull-backs build, as the
    # non-causal backward's (before: the scan's knot sums, one more sort of each array and a row
    # gather per knot)
    learned = _traffic().count(128, 8, 1, backward=True, causal=True, bandwidths=True)
    assert learned["sorts"] == 2 and "gather" not in learned["by op"], learned


def _huge_case(rng, scores, values, lq=9, lk=11, rows=2):
    """float32-representable scores and values of the sizes given (as float64 arrays)."""
    def f32(a):
        return a.astype(np.float32).astype(np.float64)
    return (f32(rng.normal(size=(rows, lq)) * scores), f32(rng.normal(size=(rows, lk)) * scores),
            f32(rng.normal(size=(rows, lk, 2)) * values))


def _huge_call(module, kernel, q, k, v, bandwidth, **kw):
    if kernel == "relu":
        return module.relu_attention(q, k, v, **kw)
    return module.hat_attention(q, k, v, bandwidth, **kw)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("kernel", ["relu", "hat"])
@pytest.mark.parametrize("scores, values", [(1e30, 1e9), (1e19, 1e19)], ids=["scores1e30", "both1e19"])
def test_float32_products_of_scores_and_values_beyond_float32(rng, small_leaves, causal, kernel, scores, values):
    """float32 scores and values whose products pass float32's largest number (scores 1e30 with
    values 1e9, both 1e19) while the rows are finite: the values are scaled by a power of two
    where their sums could overflow and the output scaled back (_scale.value_scale), forward and
    gradients (a learned bandwidth per row for the hat) within float32's rounding of the dense
    float64 reference, causal too (issue 49, item 2: before, NaN and -inf)."""
    q, k, v = _huge_case(rng, scores, values)
    cot = rng.normal(size=q.shape + (2,))
    results = []
    for module, dtype, kw in ((slicedkern, torch.float32, {"engine": "triton"}), (reference, torch.float64, {})):
        args = [_t(a, dtype).requires_grad_() for a in (q, k, v)]
        if kernel == "hat":
            args.append(_t([0.5 * scores, 0.8 * scores], dtype).requires_grad_())
        out = _huge_call(module, kernel, *args[:3], args[3] if kernel == "hat" else None, causal=causal, **kw)
        results.append((out, *torch.autograd.grad((out * _t(cot, dtype)).sum(), args)))
    for got, want, label in zip(*results, ("out", "q", "k", "v", "bandwidth")):
        got, want = _np(got), _np(want)
        assert np.isfinite(got).all(), label
        # the output within float32's rounding of sums as large as the values; a gradient of its largest
        scale = float(np.abs(v).max()) if label == "out" else float(np.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale, err_msg=label)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_values_scaled_in_one_row_leave_the_others_bit_for_bit(rng, small_leaves, causal):
    """The scaling is per batch row and exact: a row whose products are in range gives the same bits
    beside a scaled row as alone, and the scaled row its own result scaled (both powers of two:
    values times 2 ** 120 give outputs and score gradients times 2 ** 120, value gradients the
    same)."""
    from slicedkern.engines.triton._scale import value_scale
    from slicedkern.kernels import Profile
    q, k, v = _huge_case(rng, 1.0, 1.0)
    big = v * 2.0 ** 120
    import array_api_compat.torch as xp
    _, up = value_scale(xp, *(_t(a) for a in (q, k)), _t(big, torch.float32), Profile.of(ReLU()))
    assert (up > 1).all()                     # 2 ** 120 by scores of order 1 and 11 keys: scaled
    cot = _t(rng.normal(size=q.shape + (2,)), torch.float32)

    def run(values):
        args = [_t(a, torch.float32).requires_grad_() for a in (q, k, values)]
        out = slicedkern.relu_attention(*args, causal=causal, engine="triton")
        return [_np(a) for a in (out, *torch.autograd.grad((out * cot).sum(), args))]

    alone, mixed = run(v), run(np.stack([v[0], big[1]]))
    for a, b in zip(alone, mixed):
        np.testing.assert_array_equal(a[0], b[0])
    scaled = run(big)
    for a, b, factor in zip(alone, scaled, (2.0 ** 120, 2.0 ** 120, 2.0 ** 120, 1.0)):
        np.testing.assert_array_equal(a * factor, b)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("lq, lk", [(0, 3), (3, 0)], ids=["no-queries", "no-keys"])
@pytest.mark.parametrize("kernel", ["relu", "hat", "mixture"])
def test_empty_axis_with_gradients(causal, lq, lk, kernel):
    """An empty query or key axis with inputs that record gradients, a key mask and learned
    bandwidths (and weights): the empty output and zero gradients, of every input's shape, as the
    scan gives (issue 49, items 4 and 5: before, autograd refused the mask returned as a residual,
    and the knot gradients of no pair were None)."""
    q, k, v = torch.randn(2, lq), torch.randn(2, lk), torch.randn(2, lk, 2)
    mask = torch.ones(2, lk, dtype=torch.bool)
    params = {"relu": (), "hat": (torch.tensor([0.5, 0.7]),),
              "mixture": (torch.tensor([[0.5, 1.0]] * 2), torch.tensor([[1.0, -0.4]] * 2))}[kernel]
    results = []
    for engine in ("triton", "scan"):
        args = [a.clone().requires_grad_() for a in (q, k, v, *params)]
        kw = dict(key_mask=mask, causal=causal, engine=engine)
        if kernel == "relu":
            out = slicedkern.relu_attention(*args, **kw)
        elif kernel == "hat":
            out = slicedkern.hat_attention(*args, **kw)
        else:
            out = slicedkern.hat_mixture_attention(*args, **kw)
        results.append((out, *torch.autograd.grad(out.sum(), args)))
    assert results[0][0].shape == (2, lq, 2)
    for got, want, arg in zip(results[0], results[1], (None, q, k, v, *params)):
        assert got.shape == (want.shape if arg is None else arg.shape)
        assert (got == 0).all() and (want == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_form_passes_opcheck_and_reads_nothing_back(causal):
    """Under ``torch.compile`` a triton call is one ``slicedkern::attention`` operator node that keeps
    no residuals (their shapes depend on more than the inputs': docs/compile.rst; the backward
    operator runs the forward again for them): ``opcheck`` holds its fake and its autograd formula to
    real runs, the gradients are eager's, and neither operator reads anything back to the host (a
    device synchronisation, which CUDA graph capture refuses)."""
    if DEVICE != "cpu":
        pytest.skip("checked under the interpreter, on CPU tensors")
    from slicedkern._spec import spec_parts
    from slicedkern.adapters import _torch_ops
    from slicedkern.ops.attention import _RELU, prepare

    g = torch.Generator().manual_seed(0)
    # float64, the work dtype: the op's inputs are the caller's tensors, and eager's call below is the same
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64) for shape in (SHAPE_Q, SHAPE_K, SHAPE_K + (DV,)))
    q, k, v = (a.requires_grad_() for a in (q, k, v))
    call = prepare(q, k, v, None, kernel=_RELU, key_mask=None, center=True, normalize="abs", eps=1e-6,
                   causal=causal, engine="triton", xp=None)
    leaves = list(call.inputs)
    args = (leaves, *spec_parts(call.spec), "triton", call.out_dtype, True)
    torch.library.opcheck(_torch_ops.attention, args)
    # the operators' implementations called as they are, so that the recorder sees every aten op
    # inside them (a dispatch mode is suspended inside an operator it intercepts)
    with _traffic().Recorder(1 << 30) as rec:
        out, *residuals = _torch_ops._forward(*args)
        grads = _torch_ops._backward([a.detach() for a in call.inputs], out.detach(), residuals,
                                     torch.ones_like(out), *args[1:4])
    assert residuals == [] and len(grads) == 3
    assert rec.ops["_local_scalar_dense"] == 0, rec.ops
    eager = slicedkern.relu_attention(*leaves, causal=causal, engine="triton")
    expected = torch.autograd.grad(eager, leaves, torch.ones_like(eager))
    for got, want in zip(grads, expected):
        assert torch.equal(got, want)
