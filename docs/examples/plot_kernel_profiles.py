"""
Kernel profiles
===============

Every kernel of :mod:`slicedkern.kernels` is a continuous piecewise-linear function
``f(r) = a + b r + sum_m c_m ReLU(r - t_m)``. Kernels can be called on arrays, added, scaled and
reflected; here are the four built-in ones, their knots marked.
"""

import matplotlib.pyplot as plt
import numpy as np

from slicedkern.kernels import Abs, Hat, HatMixture, PiecewiseLinear, ReLU

kernels = {
    "ReLU()": ReLU(),
    "Abs()": Abs(),
    "Hat(1.0)": Hat(1.0),
    "HatMixture([0.5, 2.0], [1.0, 0.5])": HatMixture([0.5, 2.0], [1.0, 0.5]),
}
r = np.linspace(-3.0, 3.0, 601)

fig, axes = plt.subplots(1, 4, figsize=(13, 3.2), sharex=True)
for ax, (name, f) in zip(axes, kernels.items()):
    ax.plot(r, f(r), lw=2)
    knots = np.asarray(f.knots)
    ax.plot(knots, f(knots), "o", ms=5, color="C3", label="knots")
    ax.axhline(0.0, color="0.7", lw=0.8)
    ax.axvline(0.0, color="0.7", lw=0.8)
    ax.set_title(name, fontsize=10)
    ax.set_xlabel("r")
axes[0].set_ylabel("f(r)")
axes[0].legend(loc="upper left", fontsize=8)
fig.tight_layout()
plt.show()

# %%
# The representation
# ------------------
# Each profile is stored as its knots ``t_m``, their coefficients ``c_m``, a slope ``b`` and an
# intercept ``a``. The number of knots is what a sort-scan pays for: one binary search each.

for name, f in kernels.items():
    print(f"{name}\n    knots={f.knots}  coeffs={f.coeffs}\n"
          f"    slope={f.slope}  intercept={f.intercept}")

# %%
# The kernel algebra
# ------------------
# Sums, multiples and reflections ``r -> f(-r)`` are again piecewise linear. For instance
# ``|r| = 2 ReLU(r) - r`` and ``ReLU(r) + ReLU(-r) = |r|``:

identity = PiecewiseLinear(slope=1.0)          # f(r) = r
print(2 * ReLU() - identity == Abs())
print(ReLU() + ReLU().reflect() == Abs())
print(np.allclose((Hat(1.0) - 0.5 * Abs())(r), Hat(1.0)(r) - 0.5 * np.abs(r)))
