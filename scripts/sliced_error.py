"""Accuracy and speed of the sliced energy distance in R^d.

1. Error table: mean absolute relative error of ``slicedkern.energy_distance(x, y, directions=theta)``
   against the dense energy distance (all pairwise Euclidean distances), for several numbers of
   slices P and each direction family, averaged over seeds of the directions. Default: d = 10,
   n = m = 2000 Gaussian samples, ``y`` shifted by 0.5 along the first coordinate.
2. Timing (torch CPU, float32): the sliced energy distance with P = 256 against a dense one built on
   ``torch.cdist`` (row blocks, so that memory stays bounded), at n = m = 20000, best of 3 runs of
   ``time.perf_counter``.

Run from the repository root::

    PYTHONPATH=. python scripts/sliced_error.py                     # full run (a few minutes on 2 cores)
    PYTHONPATH=. python scripts/sliced_error.py --quick             # seconds
    PYTHONPATH=. python scripts/sliced_error.py --no-timing --seeds 3 --slices 16,64
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from slicedkern.sliced import directions, energy_distance

METHODS = ("random", "orthogonal", "sobol")


def make_samples(n, m, dim, shift, seed, dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dim))
    y = rng.normal(size=(m, dim))
    y[:, 0] += shift
    return x.astype(dtype), y.astype(dtype)


def dense_energy_numpy(x, y, block=2048):
    """``2 E|X - Y| - E|X - X'| - E|Y - Y'|`` from all pairwise distances, float64, row blocks."""
    def mean_dist(a, b):
        total = 0.0
        bb = np.sum(b * b, axis=1)
        for start in range(0, len(a), block):
            blk = a[start:start + block]
            sq = np.sum(blk * blk, axis=1)[:, None] + bb[None, :] - 2.0 * blk @ b.T
            total += float(np.sum(np.sqrt(np.maximum(sq, 0.0))))
        return total / (len(a) * len(b))
    return 2.0 * mean_dist(x, y) - mean_dist(x, x) - mean_dist(y, y)


def dense_energy_torch(x, y, block):
    """The same with ``torch.cdist`` on row blocks, each block's sum accumulated in float64."""
    import torch

    def mean_dist(a, b):
        total = torch.zeros((), dtype=torch.float64)
        for start in range(0, a.shape[0], block):
            total = total + torch.cdist(a[start:start + block], b).sum(dtype=torch.float64)
        return total / (a.shape[0] * b.shape[0])
    return 2.0 * mean_dist(x, y) - mean_dist(x, x) - mean_dist(y, y)


def to_backend(a, backend):
    if backend == "torch":
        import torch
        return torch.asarray(a)
    return a


def error_table(args):
    x, y = make_samples(args.n, args.n, args.dim, args.shift, args.data_seed)
    dense = dense_energy_numpy(x, y)
    print(f"Relative error of the sliced energy distance, d = {args.dim}, n = m = {args.n}, shift "
          f"{args.shift}, dense value {dense:.6f}")
    print(f"mean |sliced / dense - 1| over {args.seeds} direction seeds ({args.backend}, float64)\n")
    xb, yb = to_backend(x, args.backend), to_backend(y, args.backend)
    header = f"{'P':>6} | " + " | ".join(f"{m:>12}" for m in args.methods)
    if len(args.methods) > 1 and "random" in args.methods:
        header += " | " + " | ".join(f"{'gain ' + m[:5]:>11}" for m in args.methods if m != "random")
    print(header)
    print("-" * len(header))
    for n_slices in args.slices:
        errors = {}
        for method in args.methods:
            errs = []
            for seed in range(args.seeds):
                theta = to_backend(directions(n_slices, args.dim, method=method, seed=seed), args.backend)
                ed = float(energy_distance(xb, yb, directions=theta))
                errs.append(abs(ed / dense - 1.0))
            errors[method] = float(np.mean(errs))
        row = f"{n_slices:>6} | " + " | ".join(f"{errors[m]:>12.3e}" for m in args.methods)
        if len(args.methods) > 1 and "random" in args.methods:
            row += " | " + " | ".join(f"{errors['random'] / errors[m]:>10.1f}x" for m in args.methods
                                      if m != "random")
        print(row, flush=True)
    print()


def best_of(fn, repeats):
    best, value = math.inf, None
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - start)
    return best, value


def timing(args):
    import torch
    x, y = make_samples(args.timing_n, args.timing_n, args.dim, args.shift, args.data_seed, np.float32)
    xt, yt = torch.asarray(x), torch.asarray(y)
    theta = torch.asarray(directions(args.timing_slices, args.dim, method="orthogonal", seed=0),
                          dtype=torch.float32)
    print(f"Timing, torch {torch.__version__} CPU ({torch.get_num_threads()} threads), float32, d = "
          f"{args.dim}, n = m = {args.timing_n}, best of {args.repeats}")
    with torch.no_grad():
        t_sliced, v_sliced = best_of(lambda: float(energy_distance(xt, yt, directions=theta)), args.repeats)
        t_dense, v_dense = best_of(lambda: float(dense_energy_torch(xt, yt, args.dense_block)), args.repeats)
    print(f"{'method':<34} | {'seconds':>8} | {'value':>10}")
    print("-" * 58)
    print(f"{f'sliced, P = {args.timing_slices} (orthogonal)':<34} | {t_sliced:>8.3f} | {v_sliced:>10.6f}")
    print(f"{f'dense torch.cdist (blocks of {args.dense_block})':<34} | {t_dense:>8.3f} | {v_dense:>10.6f}")
    print(f"speed-up {t_dense / t_sliced:.2f}x, relative difference {abs(v_sliced / v_dense - 1):.2e}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=10)
    parser.add_argument("--n", type=int, default=2000, help="samples per set in the error table")
    parser.add_argument("--shift", type=float, default=0.5, help="shift of y along the first axis")
    parser.add_argument("--slices", type=lambda s: [int(v) for v in s.split(",")], default=[16, 64, 256, 1024])
    parser.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS))
    parser.add_argument("--seeds", type=int, default=10, help="direction seeds averaged per cell")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--backend", choices=("numpy", "torch"), default="numpy",
                        help="array library of the error table")
    parser.add_argument("--timing-n", type=int, default=20000)
    parser.add_argument("--timing-slices", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dense-block", type=int, default=4096, help="rows per torch.cdist block")
    parser.add_argument("--no-table", action="store_true")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small sizes: n = 500, 3 seeds, timing at 4000")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.seeds, args.slices, args.timing_n = 500, 3, [16, 64, 256], 4000
    for m in args.methods:
        if m not in METHODS:
            parser.error(f"unknown method {m!r}; choose among {', '.join(METHODS)}")
    if not args.no_table:
        error_table(args)
    if not args.no_timing:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("torch is not installed: timing skipped")
            return
        timing(args)


if __name__ == "__main__":
    main()
