"""Speed and float32 accuracy of the fused sweep engine (``slicedkern.engines.sweep``), CPU.

Times, best of ``--repeat`` interleaved runs, on B x L float32 scores and values of width D (default
8 x 65536, D = 64), torch and numba both on ``--threads`` threads (default 2):

(a) the torch "floor": ``torch.sort`` + ``torch.gather`` of the value rows + ``torch.cumsum``;
(b) the fused sweep: ``_sweep.attention`` (ReLU, center=True, normalize="abs") on the NumPy views
    of the same tensors;
(c) the array-API scan engine: ``slicedkern.relu_attention`` on the torch tensors;
(d) the NumPy floor: ``np.argsort`` + ``np.take_along_axis`` + ``np.cumsum``;

then the ratios, and the float32 error of the sweep (normwise ``||out32 - out64|| / ||out64||`` and
the largest absolute difference) against a float64 run on the same rounded inputs, at n = 2^18,
D = 4, for ReLU attention and for hat attention with b = 0.01.

Usage: ``PYTHONPATH=. python scripts/sweep_speed.py [--batch 8] [--length 65536] [--dim 64]``
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def best_of(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--acc-n", type=int, default=2 ** 18)
    parser.add_argument("--acc-dim", type=int, default=4)
    parser.add_argument("--skip-scan", action="store_true", help="do not time the array-API scan (c)")
    args = parser.parse_args()

    import numba
    import torch

    import slicedkern
    from slicedkern._spec import Normalizer
    from slicedkern.engines._vjp import Form, Inputs
    from slicedkern.engines.sweep import _host as _sweep
    from slicedkern.kernels import Profile

    relu = Form(Profile((0.0,), (1.0,)), Normalizer("abs"), center=True)

    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    _sweep.warmup()

    bsz, length, dim = args.batch, args.length, args.dim
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(bsz, length, generator=gen)
    k = torch.randn(bsz, length, generator=gen)
    v = torch.randn(bsz, length, dim, generator=gen)
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()

    def torch_floor():
        _, perm = torch.sort(k, dim=-1)
        rows = torch.gather(v, 1, perm[..., None].expand(-1, -1, dim))
        return torch.cumsum(rows, dim=1)

    def numpy_floor():
        perm = np.argsort(kn, axis=-1)
        return np.cumsum(np.take_along_axis(vn, perm[..., None], axis=1), axis=1)

    def sweep():
        return _sweep.attention(Inputs(qn, kn, vn, None), relu)

    def scan():
        return slicedkern.relu_attention(q, k, v)

    print(f"B = {bsz}, L = {length}, D = {dim}, float32, threads = {args.threads} "
          f"(torch {torch.__version__}, numba {numba.__version__}), best of {args.repeat}")
    rows = [("(a) torch floor: sort + gather + cumsum", torch_floor),
            ("(b) fused sweep: _sweep.attention (ReLU, center, abs)", sweep)]
    if not args.skip_scan:
        rows.append(("(c) array-API scan: slicedkern.relu_attention (torch)", scan))
    rows.append(("(d) NumPy floor: argsort + take_along_axis + cumsum", numpy_floor))
    for _, fn in rows:
        fn()
    samples = {name[:3]: [] for name, _ in rows}
    for _ in range(args.repeat):  # interleaved, so that a shared machine's load hits every row alike
        for name, fn in rows:
            samples[name[:3]].append(best_of(fn, 1))
    times = {key: min(ts) for key, ts in samples.items()}
    for name, _ in rows:
        print(f"  {name:58s} {times[name[:3]] * 1e3:9.1f} ms")
    print(f"  ratio (b)/(a) sweep / torch floor   : {times['(b)'] / times['(a)']:.3f}")
    print(f"  ratio (b)/(d) sweep / NumPy floor   : {times['(b)'] / times['(d)']:.3f}")
    if "(c)" in times:
        print(f"  ratio (b)/(c) sweep / scan engine   : {times['(b)'] / times['(c)']:.3f}")
        print(f"  ratio (c)/(a) scan / torch floor    : {times['(c)'] / times['(a)']:.3f}")

    if not args.skip_scan:
        ref = scan().numpy().astype(np.float64)
        out = sweep().astype(np.float64)
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        print(f"  agreement (b) vs (c), normwise      : {err:.2e}")

    n, d = args.acc_n, args.acc_dim
    rng = np.random.default_rng(1)
    q32 = rng.standard_normal((1, n)).astype(np.float32)
    k32 = rng.standard_normal((1, n)).astype(np.float32)
    v32 = rng.standard_normal((1, n, d)).astype(np.float32)
    q64, k64, v64 = (a.astype(np.float64) for a in (q32, k32, v32))
    print(f"float32 error of the sweep vs float64 (same rounded inputs), n = {n}, D = {d}:")
    cases = {
        "relu_attention (center, abs)": relu,
        "hat_attention b=0.01 (count)": Form(Profile((-0.01, 0.0, 0.01), (100.0, -200.0, 100.0)),
                                             Normalizer("count"), center=False),
    }
    for name, form in cases.items():
        out32 = _sweep.attention(Inputs(q32, k32, v32, None), form)
        out64 = _sweep.attention(Inputs(q64, k64, v64, None), form)
        diff = out32.astype(np.float64) - out64
        rel = np.linalg.norm(diff) / np.linalg.norm(out64)
        print(f"  {name:30s} normwise {rel:.2e}   max abs {np.abs(diff).max():.2e}   "
              f"(float32 rounding of the output alone: "
              f"{np.linalg.norm(out64.astype(np.float32) - out64) / np.linalg.norm(out64):.2e})")


if __name__ == "__main__":
    main()
