"""Command line: ``python -m slicedkern demo`` and ``python -m slicedkern bench``.

``demo`` runs sliced ReLU attention on the default embedded problem (8 x 65536 random scores,
D = 64) with NumPy, checks it against the dense reference on a slice small enough for O(n^2), and
prints the time and the error.

``bench`` times sliced ReLU / hat attention against softmax attention (torch SDPA) and the dense
reference over sequence lengths on an installed backend, and prints a table (see
``python -m slicedkern bench --help``).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import slicedkern

# neither imports a framework: those are imported when a command runs
from . import bench, reference


def _demo(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(0)
    b, n, d = args.batch, args.n, args.dim
    q = rng.standard_normal((b, n)).astype(np.float32)
    k = rng.standard_normal((b, n)).astype(np.float32)
    v = rng.standard_normal((b, n, d)).astype(np.float32)
    slicedkern.relu_attention(q[:, :64], k[:, :64], v[:, :64])
    start = time.perf_counter()
    out = slicedkern.relu_attention(q, k, v)
    elapsed = time.perf_counter() - start
    small = 2048
    fast = slicedkern.relu_attention(q[:1, :small], k[:1, :small], v[:1, :small])
    dense = reference.relu_attention(q[:1, :small].astype(np.float64), k[:1, :small].astype(np.float64),
                                     v[:1, :small].astype(np.float64))
    err = float(np.linalg.norm(fast - dense) / np.linalg.norm(dense))
    print(f"relu_attention  batch={b} n={n} D={d} float32 (numpy): {elapsed * 1e3:8.1f} ms, "
          f"output {out.shape}")
    print(f"float32 vs dense float64 reference at n={small}: relative error {err:.2e}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the command; return the exit status.

    Parameters
    ----------
    argv : list of str, optional
        The arguments after ``python -m slicedkern``.

    Returns
    -------
    int
        0 on success; 2 for a usage error (argparse exits with 2 itself on malformed options).
    """
    parser = argparse.ArgumentParser(prog="python -m slicedkern", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # __version__ is importlib.metadata.version("slicedkern"): what pip reports as installed
    parser.add_argument("--version", action="version", version=f"%(prog)s {slicedkern.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="time sliced ReLU attention on the embedded problem")
    demo.add_argument("--batch", type=int, default=8)
    demo.add_argument("--n", type=int, default=65536)
    demo.add_argument("--dim", type=int, default=64)
    demo.set_defaults(func=_demo)
    bench_parser = sub.add_parser(
        "bench", help="sliced attention vs softmax attention vs the dense reference, over L",
        description=bench.description(), formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=bench.main)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
