"""Sliced statistics on Dask next to the in-memory NumPy call: time and peak memory.

Each measurement runs in a fresh Python process (``--one``) so that its peak resident memory
(``resource.getrusage(...).ru_maxrss``) is its own; "base" is that peak after the imports and a
small warm-up call (numba compiles there), before the points are drawn. Modes:

* ``numpy``: the points drawn with NumPy, then ``energy_distance`` / ``mmd`` in memory
  (``method="sliced"``); the time of the statistic and of the whole process are reported;
* ``dask``: the points drawn lazily with ``dask.array.random`` (never in memory in full), the
  statistic built lazily and computed with the threaded scheduler on ``--workers`` threads.

Both see the same directions (``directions=P, seed=0``) but not the same points (two generators), so
the values agree to sampling error, not to rounding (tests/test_dask.py checks rounding).

Usage::

    python scripts/dask_bench.py --stat energy_distance --n 1000000 4000000 --dim 3 --slices 64
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def one(stat: str, mode: str, n: int, dim: int, slices: int, workers: int, rows: int) -> dict:
    import numpy as np

    import slicedkern
    from slicedkern.kernels import Hat

    kwargs = {"directions": slices, "seed": 0}
    fn = slicedkern.energy_distance if stat == "energy_distance" else (
        lambda x, y, **kw: slicedkern.mmd(x, y, Hat(1.0), **kw))
    warm = np.random.default_rng(1).standard_normal((2, 100, dim))
    fn(warm[0], warm[1], method="sliced", **kwargs)       # compile the numba kernels outside the timing
    if mode == "dask":
        import dask.array as da
    base_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux
    start = time.perf_counter()
    if mode == "numpy":
        rng = np.random.default_rng(0)
        x, y = rng.standard_normal((n, dim)), rng.standard_normal((n, dim)) + 0.05
        drawn = time.perf_counter()
        value = float(fn(x, y, method="sliced", **kwargs))
    else:
        import dask

        rng = da.random.default_rng(0)
        x = rng.standard_normal((n, dim), chunks=(rows, dim))
        y = rng.standard_normal((n, dim), chunks=(rows, dim)) + 0.05
        drawn = time.perf_counter()
        with dask.config.set(scheduler="threads", num_workers=workers):
            value = float(fn(x, y, **kwargs).compute())
    end = time.perf_counter()
    assert slicedkern.__file__.startswith(str(ROOT)), slicedkern.__file__
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux
    return {"stat": stat, "mode": mode, "n": n, "dim": dim, "slices": slices, "value": value,
            "statistic_s": end - drawn, "total_s": end - start, "peak_rss_mb": peak_mb, "base_rss_mb": base_mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stat", choices=["energy_distance", "mmd"], default="energy_distance")
    parser.add_argument("--n", type=int, nargs="+", default=[1_000_000], help="points per sample")
    parser.add_argument("--dim", type=int, default=3)
    parser.add_argument("--slices", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="threads of the Dask scheduler")
    parser.add_argument("--rows", type=int, default=250_000, help="points per Dask chunk")
    parser.add_argument("--modes", nargs="+", default=["numpy", "dask"])
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.stat, args.modes[0], args.n[0], args.dim, args.slices, args.workers,
                             args.rows)))
        return
    print(f"{'stat':16} {'mode':6} {'n = m':>10} {'d':>3} {'P':>4} {'statistic s':>12} {'total s':>8} "
          f"{'peak RSS MB':>12} {'base MB':>8} {'value':>12}")
    for n in args.n:
        for mode in args.modes:          # interleaved: one size, both modes, then the next size
            cmd = [sys.executable, __file__, "--one", "--stat", args.stat, "--modes", mode, "--n", str(n),
                   "--dim", str(args.dim), "--slices", str(args.slices), "--workers", str(args.workers),
                   "--rows", str(args.rows)]
            # the checkout this script belongs to, installed or not
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode:
                raise SystemExit(done.stderr)
            r = json.loads(done.stdout)
            print(f"{r['stat']:16} {r['mode']:6} {r['n']:>10,} {r['dim']:>3} {r['slices']:>4} "
                  f"{r['statistic_s']:>12.1f} {r['total_s']:>8.1f} {r['peak_rss_mb']:>12.0f} {r['base_rss_mb']:>8.0f} "
                  f"{r['value']:>12.4e}",
                  flush=True)


if __name__ == "__main__":
    main()
