"""
Monte-Carlo error of the slicing directions
===========================================

In dimension ``d`` a sliced estimate averages ``P`` one-dimensional computations, one per direction
``theta_p`` of the unit sphere. Its error against the exact value depends on how the directions are
chosen. :func:`slicedkern.directions` offers five families:

* ``"random"``: independent uniform directions, error ``~ P^(-1/2)``;
* ``"orthogonal"``: stacked random orthonormal frames;
* ``"sobol"``: scrambled Sobol' points pushed to the sphere (quasi-Monte-Carlo, needs SciPy);
* ``"design"``: a QMC slicing design, a fixed antipodal point set of large distance sum, randomly
  rotated by the seed;
* ``"projective"``: one of each antipodal pair of the design of ``2 P``: for an even profile such
  as the energy distance's, the design's estimate at the cost of ``P`` slices (what the
  statistics draw for an integer ``P``; see the "Choosing directions" page for the full
  comparison).

This example measures the relative error of the sliced energy distance
(:func:`slicedkern.energy_distance`, ``O(P n log n)``) in ``d = 10`` against the exact value computed
from all ``n^2`` pairwise distances, over a range of ``P`` and 16 seeds.
"""

import math

import matplotlib.pyplot as plt
import numpy as np

import slicedkern

rng = np.random.default_rng(0)
n, d = 500, 10
x = rng.standard_normal((n, d))
y = 1.3 * rng.standard_normal((n, d)) + 0.3          # shifted and wider


def mean_distance(a, b):
    """``E|A - B|`` over all pairs, densely."""
    sq = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T
    return np.sqrt(np.clip(sq, 0.0, None)).mean()


exact = 2 * mean_distance(x, y) - mean_distance(x, x) - mean_distance(y, y)
print(f"exact energy distance (dense, n^2 pairs): {exact:.6f}")

# %%
# A sliced estimate is the average, over the directions, of the *exact* 1-D energy distances of the
# projected samples, rescaled by ``1 / kappa_d`` so that it is unbiased over random directions.
# :func:`slicedkern.energy_distance` computes it in one call:

theta = slicedkern.directions(64, d, method="orthogonal", seed=0)
kappa = math.gamma(d / 2) / (math.sqrt(math.pi) * math.gamma((d + 1) / 2))
sliced = float(slicedkern.energy_distance(x, y, directions=theta))

# the same number from 64 one-dimensional problems, batched: shape (P, n, 1) -> (P,)
# one 1-D problem per direction: (P, n, 1) and (P, m, 1)
per_slice = slicedkern.energy_distance((x @ theta.T).T[..., None],
                                       (y @ theta.T).T[..., None])
print(f"sliced estimate, P = 64: {sliced:.6f}   mean of the 1-D distances / kappa_d: "
      f"{per_slice.mean() / kappa:.6f}")

# %%
# This makes the error curves cheap: for every family and seed, draw 256 directions once, compute
# the 256 one-dimensional distances in one batched call, and average the first ``P`` of them for
# each ``P`` (the first ``P`` directions of these three families are themselves a valid set of
# ``P``). A design is one point set per ``P``: it is drawn for every ``P`` on its own.

methods = ["random", "orthogonal", "sobol", "design", "projective"]
slices = [8, 16, 32, 64, 128, 256]
seeds = range(16)
errors = {}
print("relative error" + "".join(f"{f'P = {P}':>11s}" for P in slices))
for method in methods:
    estimates = np.empty((len(seeds), len(slices)))
    for row, seed in enumerate(seeds):
        if method in ("design", "projective"):
            estimates[row] = [
                float(slicedkern.energy_distance(
                    x, y, directions=slicedkern.directions(P, d, method=method, seed=seed)))
                for P in slices]
            continue
        theta = slicedkern.directions(slices[-1], d, method=method, seed=seed)
        per_slice = slicedkern.energy_distance((x @ theta.T).T[..., None],
                                               (y @ theta.T).T[..., None])
        estimates[row] = [per_slice[:P].mean() / kappa for P in slices]
    errors[method] = np.sqrt(np.mean((estimates - exact) ** 2, axis=0)) / exact
    print(f"{method:>14s}" + "".join(f"{e:11.1e}" for e in errors[method]))

ratio = errors["random"][-1] / errors["orthogonal"][-1]
print(f"at P = {slices[-1]}, orthogonal frames are {ratio:.1f}x more accurate than i.i.d. "
      "directions")
ratio = errors["orthogonal"][-1] / errors["projective"][-1]
print(f"at P = {slices[-1]}, the projective design is {ratio:.1f}x more accurate than orthogonal "
      "frames")

# %%
# Relative RMS error against ``P``, on log-log axes; the dotted line has slope ``-1/2``.

P = np.asarray(slices, dtype=float)
fig, ax = plt.subplots(figsize=(6.5, 4.5))
for method, marker in zip(methods, "osd^v"):
    ax.loglog(P, errors[method], marker=marker, label=method)
guide = errors["random"][0] * np.sqrt(P[0] / P)
ax.loglog(P, guide, "k:", lw=1, label=r"$\propto P^{-1/2}$")
ax.set_xlabel("number of slices P")
ax.set_ylabel("relative RMS error")
ax.set_title(f"sliced energy distance, d = {d}, n = m = {n}")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()
