"""Sequence-parallel attention on gloo (CPU): time per call at 1, 2 and 4 processes for the same total
size, and the bytes each rank sends per call next to ring attention's (issue: scale-out).

Every configuration runs in its own set of spawned processes; the configurations are interleaved over
``--rounds`` rounds and the minimum is kept. 1 process runs the one-process op (no collectives). The
bytes are counted collective by collective (:func:`slicedkern.distributed.count_bytes`) and checked
against :func:`slicedkern.distributed.volume.sequence_parallel_bytes`.

What CPU numbers can say: on one host the ranks share cores and memory bandwidth, and gloo moves bytes
through the kernel's loopback; they show the collectives' overhead and whether the per-rank work
shrinks, not the speed of a GPU cluster with NVLink or InfiniBand.

Usage: ``PYTHONPATH=. python scripts/distributed_bench.py [--n 65536] [--batch 4] [--dv 32] [--rounds 3]
[--causal]``; ``--rank-work`` times one rank's share of the forward in this process instead (no
collectives); ``--causal`` times ``causal=True`` (against the one-process causal op).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time

import numpy as np


def _worker(rank, size, init, args, outdir):
    import torch
    import torch.distributed as dist

    import slicedkern
    import slicedkern.distributed as skd
    from slicedkern.distributed.volume import ring_attention_bytes, ring_bytes, sequence_parallel_bytes

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    n, b, dv = args["n"], args["batch"], args["dv"]
    q, k, v = rng.normal(size=(b, n)), rng.normal(size=(b, n)), rng.normal(size=(b, n, dv))
    lo, hi = rank * n // size, (rank + 1) * n // size
    dtype = torch.float32
    shard = [torch.tensor(a[:, lo:hi] if a.ndim == 2 else a[:, lo:hi, :], dtype=dtype, requires_grad=True)
             for a in (q, k, v)]
    if size > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=300))

        def call():
            return skd.relu_attention(*shard, engine=args["engine"], causal=args["causal"])
    else:
        def call():
            return slicedkern.relu_attention(*shard, engine=args["engine"], causal=args["causal"])

    times = {"forward": [], "forward+backward": []}
    for rep in range(args["repeats"] + 1):
        if size > 1:
            dist.barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            call()
        t1 = time.perf_counter()
        if size > 1:
            dist.barrier()
        t2 = time.perf_counter()
        call().sum().backward()
        t3 = time.perf_counter()
        if rep:                                        # the first call compiles / warms up
            times["forward"].append(t1 - t0)
            times["forward+backward"].append(t3 - t2)
    report = {k: min(v) for k, v in times.items()}
    if size > 1:
        with skd.count_bytes() as log:
            call().sum().backward()
        counted = ring_bytes(log, size)
        # float32 inputs are computed in the work dtype, float64, and the partial sums travel in it
        formula = sequence_parallel_bytes(size, b, n // size, dv, itemsize=8, causal=args["causal"])
        assert counted == formula, (counted, formula)
        report["bytes_sent"] = counted
        report["ring_attention_bytes"] = ring_attention_bytes(size, b, n // size, dv, itemsize=4)
        # the slowest rank is the call's time: gather every rank's numbers
        everyone = [None] * size
        dist.all_gather_object(everyone, report)
        if rank == 0:
            with open(os.path.join(outdir, f"p{size}.json"), "w") as f:
                json.dump(everyone, f)
        dist.destroy_process_group()
    else:
        with open(os.path.join(outdir, "p1.json"), "w") as f:
            json.dump([report], f)


def rank_work(args, sizes=(2, 4, 16), repeats=7):
    """One rank's forward partial sums (its key shard against all n queries) in this process, next to
    the one-process forward: how far the per-rank work shrinks with P, without any collective."""
    import array_api_compat.torch as xp
    import torch

    import slicedkern
    from slicedkern.engines import get
    from slicedkern.kernels import Abs, Profile, ReLU

    torch.set_num_threads(1)
    engine = get(args.engine)
    rng = np.random.default_rng(0)
    b, n, dv = args.batch, args.n, args.dv
    q, k = torch.tensor(rng.normal(size=(b, n))), torch.tensor(rng.normal(size=(b, n)))
    v = torch.tensor(rng.normal(size=(b, n, dv)))

    def one_rank(p):
        m = n // p
        ones = torch.ones(b, m, 1, dtype=v.dtype)
        engine.kernel_sum(q, k[:, :m], torch.cat([v[:, :m], ones], -1), Profile.of(ReLU()), xp=xp)
        engine.indicator_sums(q, k[:, :m], ones, [Profile.of(Abs())], xp=xp)

    calls = {"one process": lambda: slicedkern.relu_attention(q, k, v, engine=args.engine)}
    calls.update({f"one rank of P={p}": (lambda p=p: one_rank(p)) for p in sizes})
    times = {name: [] for name in calls}
    for _ in range(repeats):                    # interleaved
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    base = min(times["one process"])
    print(f"forward work without collectives (float64, min of {repeats} interleaved):")
    for name, t in times.items():
        print(f"  {name:>17}: {min(t):.3f} s  ({min(t) / base:.2f} x one process)")


def main():
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=65536, help="total sequence length")
    parser.add_argument("--batch", type=int, default=4, help="batch rows (batch x heads)")
    parser.add_argument("--dv", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", default="scan")
    parser.add_argument("--sizes", default="1,2,4")
    parser.add_argument("--causal", action="store_true", help="causal=True (the one-process op causal too)")
    parser.add_argument("--rank-work", action="store_true", help="only time one rank's share in-process")
    args = parser.parse_args()
    if args.rank_work:
        rank_work(args)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    best: dict = {}
    volumes: dict = {}
    for _ in range(args.rounds):
        for size in sizes:
            with tempfile.TemporaryDirectory() as tmp:
                mp.start_processes(_worker, args=(size, os.path.join(tmp, "init"), vars(args), tmp), nprocs=size,
                                   start_method="spawn")
                with open(os.path.join(tmp, f"p{size}.json")) as f:
                    reports = json.load(f)
            for key in ("forward", "forward+backward"):
                slowest = max(r[key] for r in reports)
                best[size, key] = min(best.get((size, key), float("inf")), slowest)
            if size > 1:
                volumes[size] = (reports[0]["bytes_sent"], reports[0]["ring_attention_bytes"])
    label = "relu_attention causal" if args.causal else "relu_attention"
    print(f"{label}, float32, batch {args.batch}, total n {args.n}, Dv {args.dv}, engine {args.engine}, "
          f"1 thread per process; min over {args.rounds} interleaved rounds x {args.repeats} repeats")
    print(f"{'P':>3} {'forward s':>10} {'fwd+bwd s':>10} {'vs P=1':>7} {'sent/rank MB':>13} {'ring MB':>8}")
    for size in sizes:
        fb = best[size, "forward+backward"]
        sent, ring = volumes.get(size, (0, 0))
        print(f"{size:>3} {best[size, 'forward']:>10.4f} {fb:>10.4f} {fb / best[sizes[0], 'forward+backward']:>7.2f} "
              f"{sent / 1e6:>13.2f} {ring / 1e6:>8.2f}")


if __name__ == "__main__":
    main()
