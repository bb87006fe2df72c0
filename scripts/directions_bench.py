"""Accuracy of the direction families of ``slicedkern.directions`` (docs/directions.rst).

For every family (``random``, ``orthogonal``, ``sobol``, ``design``, ``projective``), dimension ``d`` and number of
slices ``P``: the RMS over seeds of the relative error of three sliced estimates against their dense
exact values:

* ``energy``: the sliced energy distance (:func:`slicedkern.energy_distance`), ``x ~ N(0, I)``,
  ``y ~ N(0.5 e_1, I)``, ``n`` points each; truth from all pairwise Euclidean distances;
* ``mmd``: the squared MMD of a Gaussian-like sliced kernel, a positive mixture of three hats of
  bandwidths ``(0.5, 1, 2) sqrt(2 d)`` (:class:`slicedkern.kernels.HatMixture`), same samples; truth
  ``mmd(..., method="exact")`` (the radial profile on all pairwise distances);
* ``attention``: :func:`slicedkern.sliced_attention` with the ReLU profile and ``normalize="count"``,
  ``L`` queries and keys ``~ N(0, I)``, values ``~ N(0, 1)`` with 4 columns; the limit ``P -> inf``
  is ``(kappa_d / 2) sum_j |q_i - k_j| v_j / L`` (``E_theta relu(<theta, z>) = kappa_d |z| / 2``),
  computed densely; the error is the relative Frobenius norm of the difference.

Then the time to build a design by the descent (what a size that is not shipped costs once per
process) and to read a shipped one. ``--write-designs`` recomputes the package data
(``slicedkern/sliced/designs.npz``) with a longer descent.

Run from the repository root, one thread::

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/directions_bench.py --size full   # about 20 min
    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/directions_bench.py --size ci     # seconds
    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/directions_bench.py --write-designs
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

from slicedkern.kernels import HatMixture, ReLU
from slicedkern.sliced import _design, directions, energy_distance, mmd, sliced_attention

FAMILIES = ("random", "orthogonal", "sobol", "design", "projective")
TASKS = ("energy", "mmd", "attention")
SIZES = {
    # dims, slices, seeds, n (energy), n (mmd), L (attention)
    "ci": dict(dims=(3, 10), slices=(16, 64), seeds=2, n_energy=400, n_mmd=300, length=128),
    "full": dict(dims=(2, 3, 5, 10, 20, 50, 100), slices=(16, 64, 256, 1024), seeds=8, n_energy=10000,
                 n_mmd=1000, length=512),
}
#: Adam steps of the shipped designs (the on-the-fly descent takes ``_design._STEPS``).
SHIPPED_STEPS = 1500


def kappa(dim):
    return math.exp(math.lgamma(dim / 2) - math.lgamma((dim + 1) / 2)) / math.sqrt(math.pi)


def pairwise(a, b):
    """All distances ``|a_i - b_j|`` (float64)."""
    sq = np.sum(a * a, axis=1)[:, None] + np.sum(b * b, axis=1)[None, :] - 2.0 * a @ b.T
    return np.sqrt(np.maximum(sq, 0.0))


def mean_distance(a, b, block=1024):
    return sum(float(pairwise(a[i:i + block], b).sum()) for i in range(0, len(a), block)) / (len(a) * len(b))


def mmd_kernel(dim):
    scale = math.sqrt(2.0 * dim)                  # the typical distance between two N(0, I) points
    return HatMixture([0.5 * scale, scale, 2.0 * scale], [1.0, 1.0, 1.0])


class Task:
    """One estimate: data built once per ``d``, its exact value, and its relative error for ``theta``."""

    def __init__(self, name, dim, size):
        rng = np.random.default_rng(1000 + dim)
        self.name, self.dim = name, dim
        if name in ("energy", "mmd"):
            n = size["n_energy" if name == "energy" else "n_mmd"]
            self.x = rng.standard_normal((n, dim))
            self.y = rng.standard_normal((n, dim))
            self.y[:, 0] += 0.5
            if name == "energy":
                x, y = self.x, self.y
                self.exact = 2 * mean_distance(x, y) - mean_distance(x, x) - mean_distance(y, y)
            else:
                self.kernel = mmd_kernel(dim)
                self.exact = float(mmd(self.x, self.y, self.kernel, method="exact"))
        else:
            length = size["length"]
            self.q, self.k = rng.standard_normal((length, dim)), rng.standard_normal((length, dim))
            self.v = rng.standard_normal((length, 4))
            self.exact = 0.5 * kappa(dim) * (pairwise(self.q, self.k) @ self.v) / length

    def error(self, theta):
        if self.name == "energy":
            value = float(energy_distance(self.x, self.y, directions=theta, method="sliced"))
            return value / self.exact - 1.0
        if self.name == "mmd":
            value = float(mmd(self.x, self.y, self.kernel, directions=theta, method="sliced"))
            return value / self.exact - 1.0
        out = sliced_attention(self.q, self.k, self.v, ReLU(), directions=theta, normalize="count")
        return float(np.linalg.norm(out - self.exact) / np.linalg.norm(self.exact))


def error_table(size, tasks, families, progress):
    """``{(task, d, P, family): RMS relative error}`` over ``size["seeds"]`` seeds."""
    out = {}
    for dim in size["dims"]:
        for name in tasks:
            task = Task(name, dim, size)
            for n_slices in size["slices"]:
                for family in families:
                    errs = [task.error(directions(n_slices, dim, method=family, seed=seed))
                            for seed in range(size["seeds"])]
                    out[name, dim, n_slices, family] = math.sqrt(float(np.mean(np.square(errs))))
                if progress:
                    print(f"  {name} d={dim} P={n_slices}: " + " ".join(
                        f"{f}={out[name, dim, n_slices, f]:.2e}" for f in families), file=sys.stderr, flush=True)
    return out


def print_table(errors, size, tasks, families):
    gain = "orthogonal" in families and "design" in families
    for name in tasks:
        print(f"\n{name}: RMS relative error over {size['seeds']} seeds")
        header = f"{'d':>4} {'P':>5} | " + " | ".join(f"{f:>10}" for f in families)
        header += " | orth/design" if gain else ""
        header += " | orth/proj" if "projective" in families and gain else ""
        print(header)
        print("-" * len(header))
        for dim in size["dims"]:
            for n_slices in size["slices"]:
                row = [errors[name, dim, n_slices, f] for f in families]
                line = f"{dim:>4} {n_slices:>5} | " + " | ".join(f"{e:>10.2e}" for e in row)
                if gain:
                    ratio = errors[name, dim, n_slices, "orthogonal"] / errors[name, dim, n_slices, "design"]
                    line += f" | {ratio:>10.1f}x"
                    if "projective" in families:
                        ratio = errors[name, dim, n_slices, "orthogonal"] / errors[name, dim, n_slices, "projective"]
                        line += f" | {ratio:>8.1f}x"
                print(line)


def build_times(size):
    """Seconds to build a design by the on-the-fly descent, and to get a shipped one (fresh cache)."""
    print("\nDesign build: on-the-fly descent (seconds, one thread) / shipped (read and cached)")
    header = f"{'d':>4} | " + " | ".join(f"{'P=' + str(p):>16}" for p in size["slices"])
    print(header)
    print("-" * len(header))
    for dim in size["dims"]:
        cells = []
        for n_slices in size["slices"]:
            start = time.perf_counter()
            _design.build_half_design(-(-n_slices // 2), dim)
            built = time.perf_counter() - start
            _design._cached_design.cache_clear()
            _design._shipped.cache_clear()
            start = time.perf_counter()
            _design.unrotated_design(n_slices, dim)
            first = time.perf_counter() - start
            shipped = f"P{n_slices}_d{dim}" in _design._shipped()
            cells.append(f"{built:6.3f} / {first:6.3f}{'s' if shipped else ' '}")
        print(f"{dim:>4} | " + " | ".join(f"{c:>16}" for c in cells))
    print("(first use in a process: s = read from the package data, otherwise the descent)")


def plot(errors, size, tasks, families, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    dims = [d for d in (3, 10, 100) if d in size["dims"]] or list(size["dims"])[:3]
    fig, axes = plt.subplots(len(tasks), len(dims), figsize=(3.2 * len(dims), 2.6 * len(tasks)), squeeze=False)
    slices = np.asarray(size["slices"], dtype=float)
    for row, name in enumerate(tasks):
        for col, dim in enumerate(dims):
            ax = axes[row][col]
            for family, marker in zip(families, "osd^v"):
                ax.loglog(slices, [errors[name, dim, p, family] for p in size["slices"]], marker=marker,
                          label=family)
            ax.set_title(f"{name}, d = {dim}", fontsize=9)
            ax.tick_params(labelsize=7)
            if row == len(tasks) - 1:
                ax.set_xlabel("P", fontsize=8)
            if col == 0:
                ax.set_ylabel("RMS relative error", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot written to {path}")


def write_designs(path):
    """The package data: every shipped (P, d), descent of ``SHIPPED_STEPS`` steps; float32 up to
    d = 20 (the sizes the ops use by default), float16 above (errors there are >= 1e-3 anyway)."""
    arrays = {}
    for dim in _design.SHIPPED_DIMS:
        for n_slices in _design.SHIPPED_SLICES:
            start = time.perf_counter()
            half = _design.build_half_design(n_slices // 2, dim, steps=SHIPPED_STEPS)
            arrays[f"P{n_slices}_d{dim}"] = half.astype(np.float32 if dim <= 20 else np.float16)
            print(f"P = {n_slices:5d}, d = {dim:3d}: {time.perf_counter() - start:6.2f} s", flush=True)
    np.savez_compressed(path, **arrays)
    print(f"{len(arrays)} designs, {os.path.getsize(path) / 1e6:.2f} MB written to {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--dims", type=lambda s: tuple(int(v) for v in s.split(",")), default=None)
    parser.add_argument("--slices", type=lambda s: tuple(int(v) for v in s.split(",")), default=None)
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--tasks", type=lambda s: tuple(s.split(",")), default=TASKS)
    parser.add_argument("--families", type=lambda s: tuple(s.split(",")), default=FAMILIES)
    parser.add_argument("--plot", default=None, metavar="PNG", help="write the error curves there")
    parser.add_argument("--no-build-times", action="store_true")
    parser.add_argument("--progress", action="store_true", help="one line per (task, d, P) on stderr")
    parser.add_argument("--write-designs", nargs="?", const=_design._DATA, default=None, metavar="NPZ",
                        help="recompute the shipped designs (default: the package's designs.npz) and exit")
    args = parser.parse_args(argv)
    if args.write_designs:
        write_designs(args.write_designs)
        return
    size = dict(SIZES[args.size])
    for key in ("dims", "slices", "seeds"):
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    print(f"directions_bench --size {args.size}: dims {size['dims']}, P {size['slices']}, {size['seeds']} seeds; "
          f"n = m = {size['n_energy']} (energy), {size['n_mmd']} (mmd), L = {size['length']} (attention)")
    start = time.perf_counter()
    errors = error_table(size, args.tasks, args.families, args.progress)
    print_table(errors, size, args.tasks, args.families)
    print(f"\n(errors in {time.perf_counter() - start:.0f} s)")
    if not args.no_build_times:
        build_times(size)
    if args.plot:
        plot(errors, size, args.tasks, args.families, args.plot)


if __name__ == "__main__":
    main()
