"""The sliced statistics on Dask arrays: lazy results equal to the in-memory NumPy calls.

``sliced_kernel_sum``, ``energy_distance`` and ``mmd`` take Dask arrays chunked by rows and return
Dask arrays (docs/scaling.rst, "Dask"); these tests compare them with the same calls on the NumPy
arrays, check that nothing runs before ``.compute()``, check the refusals (``method="exact"`` in R^d,
batch axes, a direction too large for the configured memory, gradients) and run once on a
``dask.distributed`` cluster.
"""

from __future__ import annotations

import numpy as np
import pytest

import slicedkern
from slicedkern.kernels import Abs, Hat, HatMixture, ReLU

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")

N, M, D = 240, 180, 3
KERNELS = {"hat": Hat(0.8), "mixture": HatMixture([0.5, 2.0], [1.0, 0.3]), "relu": ReLU(), "abs": Abs()}


@pytest.fixture
def data():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, D))
    y = 1.2 * rng.standard_normal((M, D)) + 0.3
    return x, y, rng.random(N) + 0.1, rng.random(M) + 0.1


def lazy(a, chunks):
    return da.from_array(a, chunks=chunks)


# uneven row chunks, and the feature axis split too (rechunked before the projection)
# (x chunks, y chunks, chunks of the weights of y)
CHUNKINGS = {"rows": (((100, 100, 40), (3,)), ((50, 130), (3,)), (60,)),
             "uneven": (((7, 113, 120), (3,)), ((1, 179), (3,)), ((1, 179),)),
             "features": (((100, 100, 40), (2, 1)), ((90, 90), (1, 1, 1)), (80,))}


def close(lazy_result, expected, rtol=1e-12):
    assert isinstance(lazy_result, da.Array)
    got = np.asarray(lazy_result.compute())
    expected = np.asarray(expected)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol * np.max(np.abs(expected)))


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("weighted", [False, True])
def test_energy_distance(data, chunking, weighted):
    x, y, a, b = data
    cx, cy, _ = CHUNKINGS[chunking]
    wa, wb = (a, b) if weighted else (None, None)
    lazy_w = {"x_weights": lazy(a, (cx[0],)), "y_weights": lazy(b, (cy[0],))} if weighted else {}
    for directions in (24, slicedkern.directions(24, D, seed=3)):
        out = slicedkern.energy_distance(lazy(x, cx), lazy(y, cy), directions=directions, seed=5, chunk_size=7,
                                         **lazy_w)
        expected = slicedkern.energy_distance(x, y, directions=directions, seed=5, x_weights=wa, y_weights=wb,
                                              method="sliced")
        close(out, expected)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("estimator", ["v", "u"])
def test_mmd(data, kernel, estimator):
    x, y, _, _ = data
    cx, cy, _ = CHUNKINGS["uneven"]
    out = slicedkern.mmd(lazy(x, cx), lazy(y, cy), KERNELS[kernel], directions=20, seed=1, estimator=estimator,
                         chunk_size=6)
    expected = slicedkern.mmd(x, y, KERNELS[kernel], directions=20, seed=1, estimator=estimator, method="sliced")
    close(out, expected, rtol=1e-10)


@pytest.mark.parametrize("kernel", ["hat", "mixture", "relu"])
@pytest.mark.parametrize("columns", [None, 2])
def test_sliced_kernel_sum(data, kernel, columns):
    x, y, _, _ = data
    rng = np.random.default_rng(2)
    w = rng.standard_normal((M,) if columns is None else (M, columns))
    cx, cy, cw = CHUNKINGS["features"]
    cw = cw if columns is None else (cw[0], columns)
    theta = slicedkern.directions(16, D, seed=4)
    out = slicedkern.sliced_kernel_sum(lazy(x, cx), lazy(y, cy), lazy(w, cw), KERNELS[kernel], directions=theta,
                                       chunk_size=5)
    assert out.chunks[0] == (100, 100, 40)                 # rows chunked like the queries
    close(out, slicedkern.sliced_kernel_sum(x, y, w, KERNELS[kernel], directions=theta))


@pytest.mark.parametrize("n_slices", [2, 3])
def test_no_more_directions_than_coordinates(data, n_slices):
    # P <= d: the points are projected on every direction first, then regrouped (the other layout)
    x, y, a, b = data
    cx, cy, cw = CHUNKINGS["features"]
    theta = slicedkern.directions(n_slices, D, seed=6)
    close(slicedkern.energy_distance(lazy(x, cx), lazy(y, cy), directions=theta, x_weights=lazy(a, 70)),
          slicedkern.energy_distance(x, y, directions=theta, x_weights=a))
    close(slicedkern.mmd(lazy(x, cx), lazy(y, cy), Hat(0.6), directions=theta, chunk_size=1),
          slicedkern.mmd(x, y, Hat(0.6), directions=theta), rtol=1e-10)
    close(slicedkern.sliced_kernel_sum(lazy(x, cx), lazy(y, cy), lazy(b, cw), Hat(0.6), directions=theta),
          slicedkern.sliced_kernel_sum(x, y, b, Hat(0.6), directions=theta))
    # directions given as a Dask array (small: computed when the graph is built)
    close(slicedkern.mmd(lazy(x, cx), lazy(y, cy), Hat(0.6), directions=lazy(theta, 1)),
          slicedkern.mmd(x, y, Hat(0.6), directions=theta), rtol=1e-10)


def test_float32(data):
    x, y, _, _ = (np.asarray(v, dtype=np.float32) for v in data)
    cx, cy, _ = CHUNKINGS["rows"]
    out = slicedkern.energy_distance(lazy(x, cx), lazy(y, cy), directions=12, seed=0)
    assert out.dtype == np.float32
    close(out, slicedkern.energy_distance(x, y, directions=12, seed=0, method="sliced"), rtol=1e-6)
    w = np.ones(M, dtype=np.float32)
    out = slicedkern.sliced_kernel_sum(lazy(x, cx), lazy(y, cy), lazy(w, 60), Hat(1.0), directions=12, seed=0)
    close(out, slicedkern.sliced_kernel_sum(x, y, w, Hat(1.0), directions=12, seed=0), rtol=1e-6)


@pytest.mark.parametrize("shape", ["flat", "column"])
def test_one_dimensional_samples_are_exact(data, shape):
    x, y, a, b = data[0][:, 0], data[1][:, 0], data[2], data[3]
    if shape == "column":
        x, y = x[:, None], y[:, None]
    out = slicedkern.energy_distance(lazy(x, 50), lazy(y, 70), x_weights=lazy(a, 60), y_weights=lazy(b, 45))
    close(out, slicedkern.energy_distance(x, y, x_weights=a, y_weights=b))
    out = slicedkern.mmd(lazy(x, 50), lazy(y, 70), Hat(0.5), estimator="u", method="exact")
    close(out, slicedkern.mmd(x, y, Hat(0.5), estimator="u"))


def test_many_blocks_warn_nothing(data):
    x, y, _, _ = data
    # 64 blocks of one direction against 4 row chunks each (warnings are errors in this suite)
    out = slicedkern.energy_distance(lazy(x, 60), lazy(y, 45), directions=64, seed=0, chunk_size=1)
    assert out.dask is not None


def test_nothing_runs_before_compute(data):
    from dask.callbacks import Callback

    x, y, a, _ = data
    ran = []
    with Callback(pretask=lambda key, dsk, state: ran.append(key)):
        out = [slicedkern.energy_distance(lazy(x, 60), lazy(y, 60), directions=8, seed=0, x_weights=lazy(a, 60)),
               slicedkern.mmd(lazy(x, 60), lazy(y, 60), Hat(1.0), directions=8, seed=0),
               slicedkern.sliced_kernel_sum(lazy(x, 60), lazy(y, 60), lazy(a[:M], 60), Hat(1.0), directions=8,
                                            seed=0)]
        assert ran == []
        assert all(isinstance(o, da.Array) for o in out)
        dask.compute(*out)
        assert ran != []


def test_refusals(data):
    x, y, a, _ = data
    lx, ly = lazy(x, 60), lazy(y, 60)
    with pytest.raises(ValueError, match="'method'.*Dask"):
        slicedkern.energy_distance(lx, ly, method="exact")
    with pytest.raises(ValueError, match="'method'.*Dask"):
        slicedkern.mmd(lx, ly, Hat(1.0), directions=4, method="exact")
    with pytest.raises(ValueError, match="'x'.*batch axes"):
        slicedkern.mmd(lazy(np.stack([x, x]), 60), lazy(np.stack([y, y]), 60), Hat(1.0), directions=4)
    with pytest.raises(ValueError, match="'x_weights'"):
        slicedkern.energy_distance(lx, ly, directions=4, x_weights=lazy(np.stack([a, a]), 60))
    with pytest.raises(TypeError, match="'x' is a Dask array"):
        slicedkern.kernel_sum(lazy(x[:, 0], 60), lazy(y[:, 0], 60), lazy(y[:, 1], 60), Hat(1.0))
    with pytest.raises(TypeError, match="no gradients"):
        _, pullback = slicedkern.vjp(slicedkern.mmd, lx, ly, Hat(1.0), directions=4)
        pullback(np.ones(()))


def test_invalid_weights_raise_on_compute(data):
    x, y, a, _ = data
    out = slicedkern.energy_distance(lazy(x, 60), lazy(y, 60), directions=4, x_weights=lazy(-a, 60))
    with pytest.raises(ValueError, match="'x_weights' must be non-negative"):
        out.compute()


def test_a_direction_larger_than_the_limit_is_refused(data):
    x, y, _, _ = data
    # one direction of the energy distance works on 6 (n + m) float64 numbers, 20,160 bytes here, and
    # with more directions than coordinates every block reads the points, (n + m) d numbers: 30,240
    with dask.config.set({"slicedkern.max-column-bytes": "10kB"}):
        with pytest.raises(ValueError, match="420 projections.*slicedkern.max-column-bytes"):
            slicedkern.energy_distance(lazy(x, 60), lazy(y, 60), directions=4)
    with dask.config.set({"slicedkern.max-column-bytes": "25kB"}):
        with pytest.raises(ValueError, match="for the points"):
            slicedkern.energy_distance(lazy(x, 60), lazy(y, 60), directions=4)
        slicedkern.energy_distance(lazy(x, 60), lazy(y, 60), directions=3)      # P <= d: the points stay put
    with dask.config.set({"slicedkern.max-column-bytes": "31kB"}):
        slicedkern.energy_distance(lazy(x, 60), lazy(y, 60), directions=4)


@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed")
    # a memory limit the test data exceed on purpose (test_worker_memory_limit); the memory monitor
    # would pause the in-process workers at that limit, so it is switched off
    config = {"distributed.worker.memory.target": False, "distributed.worker.memory.spill": False,
              "distributed.worker.memory.pause": False, "distributed.worker.memory.terminate": False}
    with dask.config.set(config), distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                                           dashboard_address=None, memory_limit="32MiB") as cluster:
        with distributed.Client(cluster) as c:
            yield c


def test_local_cluster(data, client):
    x, y, a, b = data
    cx, cy, _ = CHUNKINGS["uneven"]
    ed = slicedkern.energy_distance(lazy(x, cx), lazy(y, cy), directions=16, seed=2, chunk_size=3,
                                    x_weights=lazy(a, 50), y_weights=lazy(b, 50))
    mmd = slicedkern.mmd(lazy(x, cx), lazy(y, cy), Hat(0.7), directions=16, seed=2, chunk_size=3)
    s = slicedkern.sliced_kernel_sum(lazy(x, cx), lazy(y, cy), lazy(b, 50), Hat(0.7), directions=16, seed=2)
    ed, mmd, s = client.compute([ed, mmd, s], sync=True)
    assert len(client.scheduler_info()["workers"]) == 2
    np.testing.assert_allclose(ed, slicedkern.energy_distance(x, y, directions=16, seed=2, x_weights=a,
                                                              y_weights=b, method="sliced"), rtol=1e-12)
    np.testing.assert_allclose(mmd, slicedkern.mmd(x, y, Hat(0.7), directions=16, seed=2, method="sliced"),
                               rtol=1e-10)
    np.testing.assert_allclose(s, slicedkern.sliced_kernel_sum(x, y, b, Hat(0.7), directions=16, seed=2),
                               rtol=1e-12)


def test_worker_memory_limit(client):
    rng = da.random.default_rng(0)
    # 24 float64 numbers per pooled point for the MMD: 2 x 100,000 points need 38 MB > the 32 MiB limit
    x, y = (rng.standard_normal((100_000, 2), chunks=(25_000, 2)) for _ in range(2))
    out = slicedkern.mmd(x, y, Hat(1.0), directions=2, seed=0, chunk_size=1)
    with pytest.raises(MemoryError, match="worker's limit"):
        client.compute(out, sync=True)
