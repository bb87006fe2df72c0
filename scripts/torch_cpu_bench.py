"""Torch CPU timings and memory of sliced ReLU attention (issues: core, gradients).

* ``speed``: 8 x 65536 float32 scores, D = 64, best of ``--repeats``, all in one run: the floor
  (``torch.sort`` + ``torch.gather`` + ``torch.cumsum``), ``relu_attention`` forward, and forward +
  backward of ``relu_attention`` and of the reference algorithm (concatenate keys and queries, sort
  2n, argsort to unsort, cumulative sums, plain autograd).
* ``memory``: in a fresh process per method, resident memory before and after a forward with grad
  (8 x 16384, D = 64): what the output and the graph hold, against the bytes of q, k, v.

Usage: ``python scripts/torch_cpu_bench.py speed|memory [--threads 2]``
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

import slicedkern


def reference_relu_attention(q, k, v):
    """The reference algorithm: one sort of keys and queries together, unsorted by argsort."""
    b, n = q.shape
    d = v.shape[-1]
    v = v - v.mean(dim=-2, keepdim=True)
    scores = torch.cat([k, q], dim=-1)
    sorted_scores, order = torch.sort(scores, dim=-1)
    is_key = (order < n).to(v.dtype)
    key_index = order.clamp(max=n - 1)
    weights = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    weights = torch.gather(weights, 1, key_index[..., None].expand(-1, -1, d + 1)) * is_key[..., None]
    p0 = torch.cumsum(weights, dim=1)
    p1 = torch.cumsum(weights * sorted_scores[..., None], dim=1)
    relu = sorted_scores[..., None] * p0 - p1
    unsort = torch.argsort(order, dim=-1)[:, n:]
    relu_q = torch.gather(relu, 1, unsort[..., None].expand(-1, -1, d + 1))
    total_k = k.sum(dim=-1, keepdim=True)
    den = 2 * relu_q[..., d] - (q * n - total_k)
    return relu_q[..., :d] / den.clamp(min=1e-6)[..., None]


def _best(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def speed(args):
    import numpy as np
    torch.manual_seed(0)
    b, n, d = 8, args.n, 64
    q, k, v = torch.randn(b, n), torch.randn(b, n), torch.randn(b, n, d)
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()

    def floor():
        keys, perm = torch.sort(k, dim=-1)
        vals = torch.gather(v, 1, perm[..., None].expand(-1, -1, d))
        return torch.cumsum(vals, dim=1)

    def numpy_floor():
        perm = np.argsort(kn, axis=-1)
        return np.cumsum(np.take_along_axis(vn, perm[..., None], axis=1), axis=1)

    def fwd_bwd(op):
        def run():
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            op(qg, kg, vg).backward(torch.ones(b, n, d))
        return run

    def engine(name, fn):
        def run():
            with slicedkern.use_engine(name):
                return fn()
        return run

    rows = {}
    with torch.no_grad():
        rows["floor"] = _best(floor, args.repeats)
        rows["numpy floor"] = _best(numpy_floor, args.repeats)
        for name in ("sweep", "scan"):
            rows[f"fwd {name}"] = _best(engine(name, lambda: slicedkern.relu_attention(q, k, v)), args.repeats)
            rows[f"numpy fwd {name}"] = _best(engine(name, lambda: slicedkern.relu_attention(qn, kn, vn)),
                                              args.repeats)
        rows["reference fwd"] = _best(lambda: reference_relu_attention(q, k, v), args.repeats)
    for name in ("sweep", "scan"):
        rows[f"fwd+bwd {name}"] = _best(engine(name, fwd_bwd(slicedkern.relu_attention)), args.repeats)
    rows["reference fwd+bwd"] = _best(fwd_bwd(reference_relu_attention), args.repeats)
    ref = reference_relu_attention(q, k, v)
    err = (slicedkern.relu_attention(q, k, v) - ref).norm() / ref.norm()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {b} x {n} float32 scores, D = {d}, "
          f"best of {args.repeats}, all in one run")
    for name, t in rows.items():
        print(f"  {name:24s} {t * 1e3:9.1f} ms")
    print("ratios")
    print(f"  torch forward, sweep / floor            {rows['fwd sweep'] / rows['floor']:6.2f}x   (target <= 0.75)")
    print(f"  reference forward / sweep forward       {rows['reference fwd'] / rows['fwd sweep']:6.2f}x   "
          f"(target >= 8)")
    print(f"  reference fwd+bwd / sweep fwd+bwd       {rows['reference fwd+bwd'] / rows['fwd+bwd sweep']:6.2f}x   "
          f"(target >= 6)")
    print(f"  numpy forward, sweep / numpy floor      {rows['numpy fwd sweep'] / rows['numpy floor']:6.2f}x   "
          f"(target <= 1)")
    print(f"  torch forward, scan / floor             {rows['fwd scan'] / rows['floor']:6.2f}x   (target <= 3)")
    print(f"  reference fwd+bwd / scan fwd+bwd        {rows['reference fwd+bwd'] / rows['fwd+bwd scan']:6.2f}x")
    print(f"  (relative difference, slicedkern vs the reference algorithm: {float(err):.1e})")


_MEMORY_CHILD = r"""
import resource, sys, torch, gc
sys.path.insert(0, {root!r})
import slicedkern
sys.path.insert(0, {scripts!r})
from torch_cpu_bench import reference_relu_attention
torch.set_num_threads({threads})
torch.manual_seed(0)
b, n, d = 8, {n}, 64
q, k, v = (torch.randn(b, n, requires_grad=True), torch.randn(b, n, requires_grad=True),
           torch.randn(b, n, d, requires_grad=True))
op = slicedkern.relu_attention if {method!r} == "slicedkern" else reference_relu_attention
with torch.no_grad():
    op(q[:, :256], k[:, :256], v[:, :256])        # warm-up: allocator and lazy imports
gc.collect()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
before = rss()
out = op(q, k, v)
gc.collect()
after = rss()
print(after - before, q.nbytes + k.nbytes + v.nbytes, out.nbytes)
"""


def memory(args):
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    scripts = os.path.dirname(os.path.abspath(__file__))
    print(f"resident memory held after a forward with grad, 8 x {args.n}, D = 64, float32")
    for method in ("slicedkern", "reference"):
        code = _MEMORY_CHILD.format(root=root, scripts=scripts, threads=args.threads, n=args.n,
                                    method=method)
        # A fixed mmap threshold makes glibc hand freed temporaries back to the OS, so that the
        # resident-set delta counts what is held rather than what the allocator keeps cached.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
        held, inputs, out = map(int, subprocess.run([sys.executable, "-c", code], check=True, env=env,
                                                   capture_output=True, text=True).stdout.split())
        print(f"{method:12s} held {held / 2**20:8.1f} MiB = {held / inputs:5.2f}x the bytes of q, k, v "
              f"({inputs / 2**20:.1f} MiB; the output alone is {out / inputs:.2f}x)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("speed", "memory"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.mode == "speed":
        args.n = args.n or 65536
        speed(args)
    else:
        args.n = args.n or 16384
        memory(args)


if __name__ == "__main__":
    main()
