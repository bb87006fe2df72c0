"""Fuzz: ``slicedkern.DecodeCache`` against the dense float64 reference and the causal op.

Each example is one decoding session: an op (``"relu"``, ``"hat"``, ``"hat_mixture"`` or a random
``PiecewiseLinear`` kernel of ``_cases.kernels``) with random options (``center``, ``normalize`` in
abs / relu / count / None or the default, ``eps`` from 1e-300 to 1e30 or the default; ``eps = 0``
must be refused with a ``ValueError`` naming it), batch dims 0-2, ``Dv`` 1-3, float64 and float32
arrays mixed, scores from a grid (exact ties, ``q == k``, +-0.0) or a continuum with common offsets,
scales 1e-20..1e20. Keys and values are appended in random chunks (token by token, several at once,
empty appends); after every append the cache attends the chunk's own queries and a few probe queries.

* Every attended block must equal the NON-causal op over the keys appended so far (what the cache
  documents: a query sees every key appended), judged as in ``test_fuzz_ops``:
  ``fl(e - E) <= a <= fl(e + E)`` with ``e`` the dense ``slicedkern.reference`` op in float64 on the
  same rounded inputs and ``E`` ``_oracle.forward_bound``'s a-priori bound of the float64 rounding
  of a sort-scan over those keys (the cache's runs add the same terms in another grouping: a few
  more additions, far inside ``C = 4 (Lk + M + 8)``). No key appended yet: exactly 0.
* The last query of each chunk sees exactly the keys up to its own position, so its row must
  also equal that row of the op with ``causal=True`` on the same backend and engine, within the
  sum of both bounds (each is within its bound of the same exact value; the causal bound is taken
  per query, ``_causal.causal_oracle``), plus one ulp of a float32 output (both rounded once). Not
  where the engine has no causal mode (the sweep on JAX arrays).
* Output dtype: the promoted dtype of ``k``, ``v`` and ``q``; namespace and device of the backend.

JAX compiles the cache's runs per shape: in the bounded (CI) profile it is left to
``tests/test_decode.py``; the long profile runs it here too.
"""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import assert_meta, to_numpy
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import slicedkern

from ._cases import GRID, Arr, Case, attention_options, kernels, log_uniform, np_dtype, promote
from ._causal import causal_oracle, has_causal_mode
from ._oracle import assert_within, expected_output, forward_bound

#: DecodeCache's op name -> the attention op of the fuzz suite
OP_OF = {"relu": "relu_attention", "hat": "hat_attention", "hat_mixture": "hat_mixture_attention",
         "kernel": "kernel_attention"}


@st.composite
def decode_sessions(draw, *, dtypes=("float64", "float32")):
    """``(op, cache_options, case_args, case_options, q, k, v, probes, chunks)``: arrays as
    :class:`._cases.Arr`; ``case_args`` the op's parameters after ``(q, k, v)`` (for the oracle)."""
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    n, dv, n_probes = draw(st.integers(0, 10)), draw(st.integers(1, 3)), draw(st.integers(0, 2))
    q_dt, k_dt, v_dt = (draw(st.sampled_from(dtypes)) for _ in range(3))
    scale = log_uniform(draw, -20.0, 20.0)
    offset = draw(st.sampled_from((0.0, 1.0, 1e3)))
    elements = st.sampled_from(GRID) if draw(st.booleans()) else st.floats(-1.0, 1.0, allow_subnormal=False)
    k = np.asarray(draw(hnp.arrays(np.float64, batch + (n,), elements=elements)))
    q = np.asarray(draw(hnp.arrays(np.float64, batch + (n,), elements=elements)))
    if n and draw(st.booleans()):                  # queries equal to keys, often their own
        q = np.where(np.asarray(draw(hnp.arrays(np.bool_, q.shape, elements=st.booleans()))), k, q)
    probes = np.asarray(draw(hnp.arrays(np.float64, batch + (n_probes,), elements=elements)))
    v = np.asarray(draw(hnp.arrays(np.float64, batch + (n, dv), elements=st.floats(-1.0, 1.0,
                                                                                    allow_subnormal=False))))
    v = v * log_uniform(draw, -10.0, 10.0)
    q_arr, probe_arr = (Arr.rounded((a + offset) * scale, q_dt) for a in (q, probes))
    k_arr, v_arr = Arr.rounded((k + offset) * scale, k_dt), Arr.rounded(v, v_dt)

    op = draw(st.sampled_from(tuple(OP_OF)))
    options, args = {}, ()
    if op == "hat":
        b = draw(st.one_of(st.sampled_from((1.0, 0.5, 0.25)), st.floats(0.03, 10.0))) * scale
        options["bandwidth"], args = b, (b,)
    elif op == "hat_mixture":
        widths = draw(st.lists(st.sampled_from((1.0, 0.5, 0.25)) | st.floats(0.03, 10.0), min_size=1, max_size=3))
        bandwidths = [b * scale for b in widths]
        weights = draw(st.lists(st.sampled_from((1.0, -1.0, 0.5)) | st.floats(-2.0, 2.0, allow_subnormal=False),
                                min_size=len(bandwidths), max_size=len(bandwidths)))
        options.update(bandwidths=bandwidths, weights=weights)
        args = (bandwidths, weights)
    elif op == "kernel":
        kernel = draw(kernels(scale))
        args = (kernel,)
    options.update(attention_options(draw, OP_OF[op]))
    case_options = {name: value for name, value in options.items()
                    if name not in ("bandwidth", "bandwidths", "weights")}
    chunks, left = [], n
    while left or (len(chunks) < 4 and draw(st.booleans())):
        # token by token first (what shrinking goes to), several tokens, empty appends; at most 12 calls
        size = left if len(chunks) >= 11 else min(left, draw(st.sampled_from((1, 2, 3, 5, 0))))
        chunks.append(size)
        left -= size
    cache_op = args[0] if op == "kernel" else op
    return cache_op, options, args, case_options, q_arr, k_arr, v_arr, probe_arr, chunks


def _rows(a: Arr, stop: int, start: int = 0) -> Arr:
    return Arr(a.values[..., start:stop], a.dtype)


def check_session(backend, engine, session):
    cache_op, options, args, case_options, q, k, v, probes, chunks = session
    op = OP_OF["kernel" if not isinstance(cache_op, str) else cache_op]
    note(f"backend {backend.name}, engine {engine.name!r}; reproducer (NumPy arrays):\n"
         f"q = {q!r}\nk = {k!r}\nv = {v!r}\nprobes = {probes!r}\nchunks = {chunks!r}\n"
         f"cache = slicedkern.DecodeCache({cache_op!r}, **{options!r})")
    if options.get("eps") == 0.0:
        with pytest.raises(ValueError, match="'eps'"):
            slicedkern.DecodeCache(cache_op, **options)
        return
    cache = slicedkern.DecodeCache(cache_op, **options)
    with pytest.raises(ValueError, match="'q'"):
        cache.attend(q.on(backend))             # nothing appended yet
    causal_case = Case(op, (q, k, v) + args, {**case_options, "causal": True})
    causal_out = None
    if chunks and q.shape[-1] and has_causal_mode(backend, engine):      # (not the sweep on JAX arrays)
        causal_args, causal_kwargs = causal_case.on(backend)
        causal_out = to_numpy(engine.call(causal_case.function, *causal_args, **causal_kwargs))
        # the causal sweep's rounding scales with keys a query does not see (test_fuzz_causal's
        # test_causal_row_does_not_depend_on_unseen_keys): its bound says so
        _, causal_bound, causal_judged = causal_oracle(causal_case)
    start = 0
    for step, size in enumerate(chunks):
        stop = start + size
        cache.append(_rows(k, stop, start).on(backend), Arr(v.values[..., start:stop, :], v.dtype).on(backend))
        assert len(cache) == stop
        block = Arr(np.concatenate([q.values[..., start:stop], probes.values], axis=-1), q.dtype)
        out = cache.attend(block.on(backend))
        case = Case(op, (block, _rows(k, stop), Arr(v.values[..., :stop, :], v.dtype)) + args, case_options)
        expected = expected_output(case)
        dtype = promote(q.dtype, k.dtype, v.dtype)
        assert_meta(out, backend=backend, shape=expected.shape, dtype=backend.dtype(dtype))
        bound, judged = forward_bound(case, expected)
        got = to_numpy(out)
        assert_within(got, expected, bound, dtype, judged=judged,
                      what=f"attend after append {step} (keys 0..{stop - 1}) against the non-causal reference")
        if size and causal_out is not None:
            row = stop - 1                       # the chunk's last query sees keys 0..row: causal row `row`
            last = size - 1
            theirs = causal_out[..., row, :].astype(np.float64)
            # both rounded once to the output dtype from within their bounds: one ulp apart at most
            ulp = 0.0 if dtype == "float64" else np.spacing(np.abs(theirs).astype(np_dtype(dtype))).astype(np.float64)
            assert_within(got[..., last, :].astype(np.float64), theirs,
                          bound[..., last, :] + causal_bound[..., row, :] + ulp, "float64",
                          judged=judged[..., last, :] & causal_judged[..., row, :],
                          what=f"attend of query {row} against row {row} of the causal op")
        start = stop


def test_decode_cache_matches_reference_and_causal_op(xp, engine, fuzz):
    if fuzz.bounded and xp.is_jax:
        pytest.skip("JAX: the cache compiles its runs per shape; tests/test_decode.py covers JAX, "
                    "SLICEDKERN_FUZZ=long runs it here")
    dtypes = ("float64",) if xp.is_jax else ("float64", "float32")
    fuzz.run(decode_sessions(dtypes=dtypes), lambda session: check_session(xp, engine, session), backend=xp.name)
