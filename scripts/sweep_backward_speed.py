"""Forward vs fused backward of the sweep engine (``slicedkern.engines.sweep``), torch CPU float32.

For each length L (default 16384 and 65536), B*H rows (default 8) and D value columns (default 64),
times the engine functions called directly (best of ``--repeat``, interleaved):

* relu attention (centred, "abs" normaliser): ``sweep.attention`` vs ``sweep.attention_vjp``
  (``param_grads=False``: ReLU has no parameter);
* hat attention (bandwidth 0.1, "count"): ``sweep.attention`` vs ``sweep.attention_vjp`` with the
  knot / coefficient gradients (from which the bandwidth gradient follows);

then the ratio backward / forward. ``--tiny`` also times the per-call cost of a tiny problem
(8 rows, L = 16, D = 64; median of 2000 calls), which must stay on the serial path.

Usage: ``PYTHONPATH=. python scripts/sweep_backward_speed.py [--lengths 16384 65536] [--tiny]``
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def best_of(fn, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def cases(q, k, v, sweep):
    """(name, forward, backward) closures on one problem."""
    hat_knots, hat_coeffs = (-0.1, 0.0, 0.1), (10.0, -20.0, 10.0)
    g = v.new_empty((v.shape[0], q.shape[-1], v.shape[-1])).normal_(generator=None)
    relu_out = sweep.attention(q, k, v, None, center=True, normalizer="abs")
    hat_out = sweep.attention(q, k, v, None, hat_knots, hat_coeffs, center=False, normalizer="count")
    return [
        ("relu (center, abs)",
         lambda: sweep.attention(q, k, v, None, center=True, normalizer="abs"),
         lambda: sweep.attention_vjp(q, k, v, None, g, relu_out, center=True, normalizer="abs",
                                     param_grads=False)),
        ("hat b=0.1 (count) + dknots",
         lambda: sweep.attention(q, k, v, None, hat_knots, hat_coeffs, center=False, normalizer="count"),
         lambda: sweep.attention_vjp(q, k, v, None, g, hat_out, knots=hat_knots, coeffs=hat_coeffs,
                                     center=False, normalizer="count")),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="numba and torch threads (default: all)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="also time a tiny call (8 x 16, D = 64)")
    args = parser.parse_args()

    import numba
    import torch

    from slicedkern.engines import sweep

    if args.threads:
        numba.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    sweep.warmup()
    torch.manual_seed(0)
    print(f"rows = {args.rows}, D = {args.dim}, torch CPU float32, numba threads = {numba.get_num_threads()} "
          f"({numba.threading_layer() if hasattr(numba, 'threading_layer') else '?'}), best of {args.repeat}")
    for length in args.lengths:
        q, k = torch.randn(args.rows, length), torch.randn(args.rows, length)
        v = torch.randn(args.rows, length, args.dim)
        for name, forward, backward in cases(q, k, v, sweep):
            forward(), backward()
            fwd, bwd = [], []
            for _ in range(args.repeat):      # interleaved: a shared machine's load hits both alike
                fwd.append(best_of(forward, 1))
                bwd.append(best_of(backward, 1))
            f, b = min(fwd), min(bwd)
            print(f"  L = {length:6d}  {name:28s} forward {f * 1e3:8.1f} ms   backward {b * 1e3:8.1f} ms   "
                  f"backward / forward {b / f:5.2f}")
    if args.tiny:
        q, k, v = torch.randn(8, 16), torch.randn(8, 16), torch.randn(8, 16, 64)
        for name, forward, backward in cases(q, k, v, sweep):
            for label, fn in (("forward", forward), ("backward", backward)):
                samples = []
                for _ in range(2000):
                    start = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - start)
                print(f"  tiny 8 x 16, D = 64  {name:28s} {label:8s} median {np.median(samples) * 1e6:7.1f} us"
                      f"   min {min(samples) * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
