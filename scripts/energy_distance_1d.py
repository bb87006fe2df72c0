"""Accuracy and time of the 1-D energy distance: slicedkern's exact evaluation and its peers.

For n = m samples of several data sets, unweighted and with uniform random weights, prints one
table row per data set, size, weighting and method: the relative error against the long-double
oracle of ``tests/test_exact1d.py`` (exact integer running sums, error ~1e-18) and, on the timed
data set, the minimum time over ``--repeats`` runs, the methods interleaved in each repeat. Methods:

* ``slicedkern``: ``slicedkern.energy_distance`` (exact 1-D path; NumPy: compiled merge);
* ``scipy``: ``scipy.stats.energy_distance(...) ** 2`` (SciPy returns ``sqrt(2 int (F - G)^2)``, the
  convention is checked against the pairwise definition at the start);
* ``plain numpy``: argsort of the pooled sample, cumulative sum of the normalised signed weights, one
  dot product of the squared CDF gap with the spacings.

Data sets: ``normal`` (x, y ~ N(0, 1): equal distributions, the hard case for a CDF difference),
``ties`` (both rounded to multiples of 1/4), ``heavy`` (Cauchy), ``nearly_equal`` (y = x up to a
relative 1e-15, weights of y those of x up to 1e-12).

Usage::

    python scripts/energy_distance_1d.py                       # n = 1e5, 1e6, 1e7 (many minutes)
    python scripts/energy_distance_1d.py --sizes 1e5,1e6 --data normal,ties --repeats 5
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

import slicedkern  # noqa: E402


def plain_numpy(x, y, a=None, b=None):
    """The six-line NumPy version: pooled argsort, cumulative weights, one dot product."""
    a = np.full(x.size, 1.0 / x.size) if a is None else a / a.sum()
    b = np.full(y.size, 1.0 / y.size) if b is None else b / b.sum()
    z = np.concatenate([x, y])
    order = np.argsort(z)
    d = np.cumsum(np.concatenate([a, -b])[order])[:-1]
    return 2.0 * np.dot(d * d, np.diff(z[order]))


def slicedkern_ed(x, y, a=None, b=None):
    return slicedkern.energy_distance(x, y, x_weights=a, y_weights=b)


def methods():
    """``{name: callable(x, y, a, b)}`` of everything importable here."""
    found = {"slicedkern": slicedkern_ed}
    try:
        from scipy.stats import energy_distance as scipy_ed
        found["scipy"] = lambda x, y, a, b: scipy_ed(x, y, a, b) ** 2
    except ImportError:
        pass
    found["plain numpy"] = plain_numpy
    return found


def data(name, n, rng, weighted):
    """``(x, y, a, b)`` of the named data set."""
    x, y = rng.normal(size=n), rng.normal(size=n)
    a, b = (rng.random(n), rng.random(n)) if weighted else (None, None)
    if name == "ties":
        x, y = np.round(4 * x) / 4, np.round(4 * y) / 4
    elif name == "heavy":
        x, y = rng.standard_cauchy(size=n), rng.standard_cauchy(size=n)
    elif name == "nearly_equal":
        y = x * (1 + 1e-15 * rng.normal(size=n))
        if weighted:
            b = a * (1 + 1e-12 * rng.normal(size=n))
    return x, y, a, b


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
    parser.add_argument("--data", default="normal,ties,heavy,nearly_equal", help="comma list of data sets")
    parser.add_argument("--timed", default="normal", help="the data set whose times are measured")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method (minimum kept)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    rng = np.random.default_rng(args.seed)
    import numba
    import scipy
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at start (a shared machine: times are minima of {args.repeats} runs, "
          "methods interleaved)")
    print(f"# numpy {np.__version__}, scipy {scipy.__version__}, numba {numba.__version__}; weights ~ U(0, 1)")
    check_scipy_convention(rng)
    found = methods()
    slicedkern_ed(rng.normal(size=10), rng.normal(size=9), rng.random(10), None)   # compile / load
    slicedkern_ed(rng.normal(size=10), rng.normal(size=9))
    print("| data | n = m | weights | method | relative error | time (ms) | time / slicedkern |")
    print("|---|---:|---|---|---:|---:|---:|")
    for name in args.data.split(","):
        for n in sizes:
            for weighted in (False, True):
                x, y, a, b = data(name, n, rng, weighted)
                start = time.perf_counter()
                reference = oracle_energy_distance(x, y, a, b)
                oracle_s = time.perf_counter() - start
                repeats = args.repeats if name == args.timed else 1
                best, values = {}, {}
                for _ in range(repeats):            # interleaved: each repeat runs every method once
                    for method, f in found.items():
                        seconds, values[method] = best_time(f, (x, y, a, b), 1)
                        best[method] = min(best.get(method, float("inf")), seconds)
                for method in found:
                    value = np.float64(np.asarray(values[method]))
                    timing = (f"{best[method] * 1e3:.0f} | {best[method] / best['slicedkern']:.2f}"
                              if name == args.timed else "- | -")
                    print(f"| {name} | {n:.0e} | {'random' if weighted else 'none'} | {method} | "
                          f"{rel_error(value, reference):.1e} | {timing} |", flush=True)
                print(f"# oracle {name} {n:.0e} {'weighted' if weighted else 'unweighted'}: "
                      f"{float(reference):.17g} ({oracle_s:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
