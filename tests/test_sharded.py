"""The sharded engine (sequence parallelism) and the attention arithmetic it shares with every engine.

:class:`slicedkern.engines.ShardedEngine` runs in one process here, its ranks as threads over an
in-memory communicator, so that every layout (non-causal and causal, 2 and 3 ranks, each
normaliser, centring, array bandwidths, masks, a non-finite key) is checked against the
one-process op, forward and gradients, in seconds and without a process group. The gloo and
``shard_map`` runs are ``tests/test_distributed.py`` and ``tests/test_distributed_jax.py``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import slicedkern
from slicedkern._spec import Normalizer
from slicedkern.adapters import run
from slicedkern.engines import ShardedEngine, get
from slicedkern.ops.attention import hat_spec, prepare

torch = pytest.importorskip("torch")


class ThreadComm:
    """The communicator of one rank of ``size`` threads meeting at a barrier (test double of the
    torch process group: the same three collectives and ``rank``)."""

    def __init__(self, hub, rank):
        self.hub, self.rank = hub, rank

    def _exchange(self, x):
        hub = self.hub
        hub.slots[self.rank] = x
        hub.barrier.wait()
        blocks = list(hub.slots)
        hub.barrier.wait()
        return blocks

    def gather(self, x, axis):
        return torch.cat(self._exchange(x), dim=axis)

    def scatter_sum(self, x, axis):
        total = sum(self._exchange(x))
        return torch.chunk(total, len(self.hub.slots), dim=axis)[self.rank]

    def sum(self, x):
        return sum(self._exchange(x))


class Hub:
    def __init__(self, size):
        self.slots = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)


def _sharded_run(size, arrays, weights, options, hats):
    """Every rank's output rows and its inputs' gradients, ranks as threads."""
    hub, results, errors = Hub(size), [None] * size, []
    n_q, n_k = arrays[0].shape[-1] // size, arrays[1].shape[-1] // size

    def rank_main(rank):
        try:
            def shard(a, n, core):
                index = (Ellipsis, slice(rank * n, (rank + 1) * n)) + (slice(None),) * core
                return a[index]
            q = torch.tensor(shard(arrays[0], n_q, 0), requires_grad=True)
            k = torch.tensor(shard(arrays[1], n_k, 0), requires_grad=True)
            v = torch.tensor(shard(arrays[2], n_k, 1), requires_grad=True)
            mask = None if arrays[3] is None else torch.tensor(shard(arrays[3], n_k, 0))
            params = [torch.tensor(p, requires_grad=True) for p in hats[1]]
            comm = ThreadComm(hub, rank)
            call = prepare(q, k, v, hats[0](params) if hats[0] else None, key_mask=mask, engine="scan", xp=None,
                           wrap=lambda e: ShardedEngine(e, comm), **options)
            assert isinstance(call.engine, ShardedEngine)
            out = run(*call)
            (out * torch.tensor(shard(weights, n_q, 1))).sum().backward()
            results[rank] = (out.detach(), q.grad, k.grad, v.grad, [p.grad for p in params])
        except BaseException as exc:          # noqa: BLE001 -- reported by the main thread
            errors.append(exc)
            hub.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


CASES = {
    "relu-abs-centred": (None, dict(kernel=slicedkern.kernels.ReLU(), center=True, normalize="abs")),
    "relu-relu": (None, dict(kernel=slicedkern.kernels.ReLU(), center=True, normalize="relu")),
    "relu-none": (None, dict(kernel=slicedkern.kernels.ReLU(), center=False, normalize=None)),
    "hat-array-count-centred": ("hat", dict(center=True, normalize="count")),
    "mixture-arrays-abs": ("mixture", dict(center=False, normalize="abs")),
}


def _hats(which, rng, batch):
    if which is None:
        return None, []
    if which == "hat":
        bandwidth = rng.uniform(0.5, 1.5, size=batch)
        return (lambda ps: hat_spec(ps[0], None, ("bandwidth", "weights"))), [bandwidth]
    bandwidths, weights = rng.uniform(0.3, 2.0, size=batch + (2,)), rng.normal(size=batch + (2,))
    return (lambda ps: hat_spec(ps[0], ps[1], ("bandwidths", "weights"))), [bandwidths, weights]


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_engine_matches_one_process(size, causal, case):
    rng = np.random.default_rng(size * 7 + len(case))
    batch, n, dv = (2,), 4 * size, 3
    which, opts = CASES[case]
    q, k, v = rng.normal(size=batch + (n,)), rng.normal(size=batch + (n,)), rng.normal(size=batch + (n, dv))
    k[0, 1] = q[0, n - 2]                          # a tie across shards
    mask = rng.random(batch + (n,)) > 0.25
    mask[:, 0] = True
    if causal:
        k[1, n // 2 + 1] = np.inf                  # a non-finite key in the second half: NaN from there on
    weights = rng.normal(size=batch + (n, dv))
    options = dict(opts, eps=1e-6, causal=causal)
    hats = _hats(which, rng, batch)

    got = _sharded_run(size, (q, k, v, mask), weights, options, hats)
    full = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    params = [torch.tensor(p, requires_grad=True) for p in hats[1]]
    call = prepare(*full, hats[0](params) if hats[0] else None, key_mask=torch.tensor(mask), engine="scan",
                   xp=None, **options)
    want = run(*call)
    (want * torch.tensor(weights)).sum().backward()

    def cat(i, axis):
        return torch.cat([r[i] for r in got], dim=axis)

    close = dict(rtol=1e-9, atol=1e-9, equal_nan=True)
    torch.testing.assert_close(cat(0, -2), want.detach(), **close)
    torch.testing.assert_close(cat(1, -1), full[0].grad, **close)
    torch.testing.assert_close(cat(2, -1), full[1].grad, **close)
    torch.testing.assert_close(cat(3, -2), full[2].grad, **close)
    for j, p in enumerate(params):
        for r in got:                               # every rank holds the whole parameter's gradient
            torch.testing.assert_close(r[4][j], p.grad, **close)


def test_sharded_engine_declines_causal_without_causal_sums():
    """The sweep gives no uncombined causal sums: sharded, it declines causal calls with its reason
    (the selection falls through to the scan), and serves the others."""
    pytest.importorskip("numba")
    sweep = ShardedEngine(get("sweep"), comm=None)
    q = torch.zeros(4, dtype=torch.float64)
    spec_of = {c: prepare(q, q, torch.zeros(4, 2, dtype=torch.float64), None, kernel=slicedkern.kernels.ReLU(),
                          key_mask=None, center=True, normalize="abs", eps=1e-6, causal=c, engine="scan",
                          xp=None).spec for c in (False, True)}
    backend = slicedkern.backends.backend_of(q)
    assert sweep.decline(spec_of[False], (q,), backend) is None
    assert "gives no causal partial sums" in sweep.decline(spec_of[True], (q,), backend)
    chosen = prepare(q, q, torch.zeros(4, 2, dtype=torch.float64), None, kernel=slicedkern.kernels.ReLU(),
                     key_mask=None, center=True, normalize="abs", eps=1e-6, causal=True, engine=None, xp=None,
                     wrap=lambda e: ShardedEngine(e, None)).engine
    assert chosen.inner is get("scan")


@pytest.mark.parametrize("name, count, den, expected", [
    ("abs", [3.0, 3.0, 0.0], [2.0, 1e-9, 0.0], [2.0, 1e-6, 1.0]),     # clamped at eps; no key: 1
    ("relu", [1.0, 0.0], [0.0, 5.0], [1e-6, 1.0]),
    ("count", [0.0, 4.0], [9.0, 9.0], [1.0, 4.0]),                   # at least 1; den ignored
    (None, [0.0, 4.0], [9.0, 9.0], [1.0, 1.0]),
])
def test_the_divisor_rule(name, count, den, expected):
    got = Normalizer(name, 1e-6).divisor(np, np.asarray(count), np.asarray(den))
    np.testing.assert_array_equal(np.broadcast_to(got, (len(expected),)), expected)
    assert Normalizer(name).summed == (name in ("abs", "relu"))
    assert hash(Normalizer(name, 1e-6)) == hash(Normalizer(name, 1e-6))
