"""Sequence-parallel attention (slicedkern.distributed) on torch.distributed: gloo on CPU, 2 and 4
processes, compared with the one-process op on the whole sequence (forward and gradients, masks,
the NaN policy), and bad input that must fail on every rank without a hang.

The processes are spawned (torch.multiprocessing) with a deadline; gloo's own timeout turns a
stuck collective into an error.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import _distributed_workers as workers  # noqa: E402

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import slicedkern.distributed as skd  # noqa: E402


@pytest.mark.parametrize("size", [2, pytest.param(4, marks=pytest.mark.exhaustive)])   # 4 ranks: 13-20 s
def test_matches_single_process_float64(size):
    workers.spawn(workers.check_matches, size, "scan", "float64")


def test_matches_single_process_default_engine_float32():
    # the default engine (the numba sweep where installed): two cases, for the compile time per process
    # (causal calls included: they run on the scan where the default engine has no causal partial sums)
    workers.spawn(workers.check_matches, 2, None, "float32", ("relu-default", "hat-array-bandwidth"), timeout=420)


def test_nan_policy_cross_lengths_and_broadcast_batch():
    workers.spawn(workers.check_nan_policy, 2)


def test_communication_volume_matches_the_formula():
    workers.spawn(workers.check_volume, 2)


@pytest.mark.parametrize("size", [2, pytest.param(3, marks=pytest.mark.exhaustive)])
def test_bad_input_fails_on_every_rank(size, tmp_path):
    workers.spawn(workers.check_bad_input, size, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(size)]
    for rank, got in enumerate(reports):
        assert "disagree on the queries per rank" in got["unequal"], got["unequal"]
        assert re.search("disagree on the (score|value) dtype", got["dtype"]), got["dtype"]
        assert "options and kernel" in got["options"], got["options"]
        if rank == size - 1:
            assert "argument 'eps'" in got["local"], got["local"]
        else:
            assert f"rank(s) [{size - 1}] failed validation" in got["local"], got["local"]
        assert "argument 'causal'" in got["causal-lengths"] and "as many queries as keys" in got["causal-lengths"]
        assert got["fine"] == "no error"


def test_uninitialised_group_is_a_clear_error():
    assert not dist.is_initialized()
    q = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="init_process_group"):
        skd.relu_attention(q, q, torch.zeros(4, 2, dtype=torch.float64))


def test_numpy_arrays_are_refused_by_name():
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match="argument 'q'"):
        skd.relu_attention(np.zeros(4), np.zeros(4), np.zeros((4, 2)))


@pytest.mark.parametrize("lq, lk", [(9, 9), (5, 12), (12, 5), (1, 1), (0, 3)])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_causal_profile_sums_match_dense_sums(lq, lk, dtype):
    """The scan engine's uncombined causal sums (the hook the causal layout adds across ranks) equal the
    dense masked sums, in float64 and in double-float work (float32), with ties and several profiles."""
    np = pytest.importorskip("numpy")
    import array_api_compat.numpy as xp

    from slicedkern.engines import get
    from slicedkern.kernels import Hat, Profile, ReLU

    rng = np.random.default_rng(lq * 31 + lk)
    x, y, w = rng.normal(size=(2, lq)), rng.normal(size=(2, lk)), rng.normal(size=(2, lk, 3))
    if lq and lk:
        x[0, -1] = y[0, 0]                               # a tie
    w[1, 0] = 0.0                                        # a key that takes no part
    profiles = [Profile.of(Hat(1.3)).with_(columns=slice(0, 2)), Profile.of(ReLU()).with_(columns=slice(2, 3))]
    cast = [a.astype(dtype) for a in (x, y, w)]
    got = get("scan").causal_profile_sums(*cast, profiles, xp=xp)
    x, y, w = (a.astype(np.float64) for a in cast)
    d = x[..., :, None] - y[..., None, :]
    seen = np.arange(lk)[None, :] <= np.arange(lq)[:, None] + lk - lq
    dense = [np.maximum(0.0, 1.0 - np.abs(d) / 1.3), np.maximum(d, 0.0)]
    tol = 1e-12 if dtype == "float64" else 1e-6
    for out, f, cols in zip(got, dense, (slice(0, 2), slice(2, 3))):
        expected = np.einsum("bij,bjc->bic", f * seen, w[..., cols])
        assert out.shape == expected.shape
        np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)
