"""Decoding on the host (:class:`slicedkern.engines.sweep._decode.HostRuns`): what
:class:`slicedkern.DecodeCache` runs on NumPy arrays and CPU torch tensors where numba is installed,
held equal to the array-API runs (:class:`slicedkern.engines.scan._decode.Runs`) and to the causal
op, with chunks, key masks, ties, per-row hat parameters and the NaN rule."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

import array_api_compat.numpy as xp  # noqa: E402
from _helpers import DECODE_CHUNKS, decode_data, poison_decode_data  # noqa: E402

import slicedkern  # noqa: E402
from slicedkern._spec import Normalizer  # noqa: E402
from slicedkern.engines import get as engine  # noqa: E402
from slicedkern.engines.scan._decode import Runs  # noqa: E402
from slicedkern.engines.sweep import _decode as decode_module  # noqa: E402
from slicedkern.engines.sweep._decode import HostRuns  # noqa: E402
from slicedkern.kernels import Hat, Profile, ReLU  # noqa: E402

CHUNKS = DECODE_CHUNKS
_data = decode_data


def host_runs(profile, *, xp, **options):
    """The sweep's decoding runs, as ``DecodeCache`` asks the engine for them."""
    return engine("sweep").decode_runs(xp, xp.float64, profile, **options)


@pytest.fixture
def rng():
    return np.random.default_rng(20261127)


def _decode(runs, q, k, v, mask):
    """The last query of each chunk, after appending the chunk."""
    rows, t = [], 0
    for step in CHUNKS:
        runs.append(k[..., t:t + step], v[..., t:t + step, :], mask[..., t:t + step])
        rows.append(np.asarray(runs.attend(q[..., t + step - 1:t + step])))
        t += step
    return np.concatenate(rows, axis=-2)


PROFILES = {
    "relu": Profile.of(ReLU()),
    "hat": Profile.of(Hat(0.7)),
    "general": Profile((-0.5, 0.3), (1.5, -0.75), 0.25, -0.5),
}


@pytest.mark.parametrize("profile", list(PROFILES))
@pytest.mark.parametrize("normalize", ["abs", "relu", "count", None])
@pytest.mark.parametrize("center", [False, True], ids=["plain", "centred"])
def test_host_runs_equal_the_array_api_runs(rng, profile, normalize, center):
    q, k, v, mask = _data(rng)
    options = dict(center=center, normalizer=Normalizer(normalize, 1e-6), dv=v.shape[-1])
    host = _decode(host_runs(PROFILES[profile], xp=xp, **options), q, k, v, mask)
    generic = _decode(Runs(xp, xp.float64, PROFILES[profile], **options), q, k, v, mask)
    # the ReLU normaliser clamps to eps = 1e-6 (outputs up to 1e6): rounding scales with the output
    np.testing.assert_allclose(host, generic, rtol=1e-12, atol=1e-12 * max(1.0, np.abs(generic).max()))


def test_per_row_hat_parameters_and_the_causal_op(rng):
    """A bandwidth per head (arrays of the batch shape), through DecodeCache, against the causal op."""
    q, k, v, mask = _data(rng)
    bandwidth = np.array([0.5, 1.0, 2.0])
    cache = slicedkern.DecodeCache("hat", bandwidth=bandwidth, center=True, normalize="abs")
    got = _decode(cache, q, k, v, mask)
    assert isinstance(cache._runs, HostRuns)
    ends = np.cumsum(CHUNKS) - 1
    want = slicedkern.hat_attention(q, k, v, bandwidth, causal=True, key_mask=mask, center=True,
                                    normalize="abs")[..., ends, :]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_nan_rule(rng):
    """A non-finite key that takes part makes every later query of its row NaN; a masked one is not
    read; a non-finite query is NaN alone."""
    q, k, v, mask = _data(rng, batch=(2,))
    poison_decode_data(q, k, v, mask)
    options = dict(center=True, normalizer=Normalizer("abs", 1e-6), dv=v.shape[-1])
    host = _decode(host_runs(PROFILES["relu"], xp=xp, **options), q, k, v, mask)
    generic = _decode(Runs(xp, xp.float64, PROFILES["relu"], **options), q, k, v, mask)
    np.testing.assert_array_equal(np.isnan(host), np.isnan(generic))
    np.testing.assert_allclose(np.nan_to_num(host), np.nan_to_num(generic), rtol=1e-12, atol=1e-12)
    ends = np.cumsum(CHUNKS) - 1
    assert np.isnan(host[0, ends >= 10]).all() and not np.isnan(host[0, ends < 10]).any()
    assert np.isnan(host[1, ends == 20]).all() and np.isnan(host[1]).sum() == 3 * (ends == 20).sum()


def test_storage_grows_and_keeps_the_keys(rng):
    """Appending past the preallocated capacity copies what was stored (capacity doubles)."""
    q, k, v, mask = _data(rng, n=300, batch=(1,))
    runs = host_runs(PROFILES["relu"], xp=xp, center=False, normalizer=Normalizer(None), dv=v.shape[-1])
    runs.append(k[..., :1], v[..., :1, :], mask[..., :1])
    first = runs.capacity
    for t in range(1, 300):
        runs.append(k[..., t:t + 1], v[..., t:t + 1, :], mask[..., t:t + 1])
    assert runs.capacity > first and runs.length == 300
    assert [e - s for s, e in runs.runs] == [256, 32, 8, 4]     # 300 in binary
    want = slicedkern.relu_attention(q, k, v, causal=True, key_mask=mask, center=False, normalize=None)
    np.testing.assert_allclose(runs.attend(q[..., -1:]), want[..., -1:, :], rtol=1e-12, atol=1e-12)


def test_storage_without_huge_pages_is_what_np_empty_gives(rng, monkeypatch):
    """The storage of a large cache (:func:`._decode._storage`, every array here, the threshold
    lowered to 0) is C-contiguous, writable, of the asked dtype and shape, and serves the same
    results through growth as the array-API runs."""
    monkeypatch.setattr(decode_module, "_SMALL_STORAGE", 0)
    for dtype, shape in ((np.float64, (3, 5, 7)), (np.bool_, (2, 9))):
        a = decode_module._storage(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
        a[...] = 1
        assert a.all()
    q, k, v, mask = _data(rng, n=300, batch=(2,))
    options = dict(center=True, normalizer=Normalizer("abs", 1e-6), dv=v.shape[-1])
    runs = host_runs(PROFILES["hat"], xp=xp, **options)
    generic = Runs(xp, xp.float64, PROFILES["hat"], **options)
    got, want = [], []
    for t in range(0, 300, 7):
        for cache, out in ((runs, got), (generic, want)):
            cache.append(k[..., t:t + 7], v[..., t:t + 7, :], mask[..., t:t + 7])
            out.append(np.asarray(cache.attend(q[..., t:t + 1])))
    assert runs.capacity >= 300
    np.testing.assert_allclose(np.concatenate(got, -2), np.concatenate(want, -2), rtol=1e-12, atol=1e-12)


def test_torch_tensors_come_back_as_tensors(rng):
    torch = pytest.importorskip("torch")
    q, k, v, mask = _data(rng)
    cache = slicedkern.DecodeCache("relu")
    cache.append(torch.tensor(k, dtype=torch.float32), torch.tensor(v, dtype=torch.float32))
    out = cache.attend(torch.tensor(q[..., -1:], dtype=torch.float32))
    assert isinstance(cache._runs, HostRuns)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == (2, 3, 1, 3)
    want = slicedkern.relu_attention(q, k, v, causal=True)[..., -1:, :]
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_strided_views_and_the_output_dtype(rng, library):
    """Per-token slices of a longer array are read as they are (no contiguous copy), and a float32
    output is written by the kernel directly: bit for bit the float64 result rounded once, and the
    same as from contiguous copies; float16 arrays give float16 (computed in float64, rounded once)."""
    q, k, v, _ = _data(rng, n=24, batch=(1, 4))
    if library == "torch":
        torch = pytest.importorskip("torch")
        as32 = lambda a: torch.tensor(a, dtype=torch.float32)            # noqa: E731
        as64, back = lambda a: torch.tensor(a, dtype=torch.float64), lambda a: a.numpy()   # noqa: E731
        half = lambda a: torch.tensor(a, dtype=torch.float16)            # noqa: E731
    else:
        as32, as64, back = (lambda a: a.astype(np.float32)), (lambda a: a.astype(np.float64)), np.asarray
        half = lambda a: a.astype(np.float16)                             # noqa: E731
    q32, k32, v32 = as32(q), as32(k), as32(v)
    strided, copied, wide = (slicedkern.DecodeCache("hat", bandwidth=0.8, center=True) for _ in range(3))
    got, from_copies, rounded = [], [], []
    for t in range(24):
        strided.append(k32[..., t:t + 1], v32[..., t:t + 1, :])
        copied.append(as32(back(k32[..., t:t + 1]).copy()), as32(back(v32[..., t:t + 1, :]).copy()))
        wide.append(as64(back(k32[..., t:t + 1])), as64(back(v32[..., t:t + 1, :])))
        got.append(back(strided.attend(q32[..., t:t + 1])))
        from_copies.append(back(copied.attend(as32(back(q32[..., t:t + 1]).copy()))))
        rounded.append(back(wide.attend(as64(back(q32[..., t:t + 1])))).astype(np.float32))
    got = np.concatenate(got, axis=-2)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.concatenate(from_copies, axis=-2))
    np.testing.assert_array_equal(got, np.concatenate(rounded, axis=-2))
    halves, wide16 = slicedkern.DecodeCache("hat", bandwidth=0.8), slicedkern.DecodeCache("hat", bandwidth=0.8)
    halves.append(half(k), half(v))
    wide16.append(as64(back(half(k)).astype(np.float64)), as64(back(half(v)).astype(np.float64)))
    out16 = back(halves.attend(half(q[..., -1:])))
    assert out16.dtype == np.float16
    want = back(wide16.attend(as64(back(half(q[..., -1:])).astype(np.float64))))
    np.testing.assert_array_equal(out16, want.astype(np.float16))
