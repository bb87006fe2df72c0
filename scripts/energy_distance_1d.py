"""Accuracy and time of the 1-D energy distance: slicedkern's exact evaluation and its peers.

For n = m samples (x ~ N(0, 1), y ~ N(shift, 1); the default shift 0 makes the two distributions
equal, the hard case for a CDF difference), unweighted and with uniform random weights, prints one
table row per size and method: the relative error against the long-double oracle of
``tests/test_exact1d.py`` (exact integer running sums, error ~1e-18) and the minimum time over
``--repeats`` runs. Methods:

* ``exact1d``: ``slicedkern._exact1d.energy_distance_1d``;
* ``scipy``: ``scipy.stats.energy_distance(...) ** 2`` (SciPy returns ``sqrt(2 int (F - G)^2)``, the
  convention is checked against the pairwise definition at the start);
* ``plain numpy``: argsort of the pooled sample, cumulative sum of the normalised signed weights, one
  dot product of the squared CDF gap with the spacings;
* ``slicedkern.energy_distance``: the package's public energy distance as it is installed.

Usage::

    python scripts/energy_distance_1d.py                       # n = 1e5, 1e6, 1e7 (minutes)
    python scripts/energy_distance_1d.py --sizes 1e5,1e6 --repeats 5 --shift 0.1
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_exact1d import exact_energy_distance, oracle_energy_distance, rel_error  # noqa: E402

from slicedkern._exact1d import energy_distance_1d  # noqa: E402


def plain_numpy(x, y, a=None, b=None):
    """The six-line NumPy version: pooled argsort, cumulative weights, one dot product."""
    a = np.full(x.size, 1.0 / x.size) if a is None else a / a.sum()
    b = np.full(y.size, 1.0 / y.size) if b is None else b / b.sum()
    z = np.concatenate([x, y])
    order = np.argsort(z)
    d = np.cumsum(np.concatenate([a, -b])[order])[:-1]
    return 2.0 * np.dot(d * d, np.diff(z[order]))


def methods():
    """``{name: callable(x, y, a, b)}`` of everything importable here."""
    found = {"exact1d": energy_distance_1d}
    try:
        from scipy.stats import energy_distance as scipy_ed
        found["scipy"] = lambda x, y, a, b: scipy_ed(x, y, a, b) ** 2
    except ImportError:
        pass
    found["plain numpy"] = plain_numpy
    try:
        from slicedkern import energy_distance as package_ed
        found["slicedkern.energy_distance"] = lambda x, y, a, b: package_ed(x, y, x_weights=a, y_weights=b)
    except Exception as exc:   # the package may be mid-restructure; the row says so
        print(f"# slicedkern.energy_distance not importable: {exc!r}")
    return found


def best_time(f, args, repeats):
    """Minimum wall time over ``repeats`` runs and the last result."""
    best, value = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        value = f(*args)
        best = min(best, time.perf_counter() - start)
    return best, value


def check_scipy_convention(rng):
    try:
        from scipy.stats import energy_distance as scipy_ed
    except ImportError:
        return
    x, y, a, b = rng.normal(size=7), rng.normal(size=5), rng.random(7), rng.random(5)
    exact = exact_energy_distance(x, y, a, b)
    err = rel_error(np.float64(scipy_ed(x, y, a, b) ** 2), exact)
    print(f"# convention: scipy.stats.energy_distance(...)**2 vs 2E|X-Y| - E|X-X'| - E|Y-Y'| (exact): "
          f"relative difference {err:.1e}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e5,1e6,1e7", help="comma list of n (= m)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method (minimum kept)")
    parser.add_argument("--shift", type=float, default=0.0, help="mean of y")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    rng = np.random.default_rng(args.seed)
    import numba
    import scipy
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at start (a shared machine: times are minima of {args.repeats} runs)")
    print(f"# numpy {np.__version__}, scipy {scipy.__version__}, numba {numba.__version__}; x ~ N(0, 1), "
          f"y ~ N({args.shift}, 1), weights ~ U(0, 1)")
    check_scipy_convention(rng)
    found = methods()
    energy_distance_1d(rng.normal(size=10), rng.normal(size=9), rng.random(10), None)   # compile / load
    print("| n = m | weights | method | relative error | time (ms) |")
    print("|---:|---|---|---:|---:|")
    for n in sizes:
        x, y = rng.normal(size=n), rng.normal(size=n) + args.shift
        for weighted in (False, True):
            a, b = (rng.random(n), rng.random(n)) if weighted else (None, None)
            start = time.perf_counter()
            reference = oracle_energy_distance(x, y, a, b)
            oracle_s = time.perf_counter() - start
            for name, f in found.items():
                seconds, value = best_time(f, (x, y, a, b), args.repeats)
                value = np.float64(np.asarray(value))
                print(f"| {n:.0e} | {'random' if weighted else 'none'} | {name} | "
                      f"{rel_error(value, reference):.1e} | {seconds * 1e3:.0f} |", flush=True)
            print(f"# oracle {n:.0e} {'weighted' if weighted else 'unweighted'}: {float(reference):.17g} "
                  f"({oracle_s:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
