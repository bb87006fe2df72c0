"""Sliced kernels in R^d: random directions, multi-slice kernel sums and attention, energy distance,
MMD and the radial profile of a sliced kernel.

A sliced kernel averages a 1-D profile ``f`` over directions ``theta`` of the unit sphere::

    K(x, y) = E_theta f(<theta, x> - <theta, y>)  ~  (1/P) sum_p f(<theta_p, x> - <theta_p, y>)

Every slice is one 1-D sort-scan kernel sum (:func:`slicedkern.kernel_sum`), so a sum over ``n``
queries and ``m`` keys costs ``O(P (n + m) log m)`` instead of ``O(n m d)`` (docs/mathematics.rst,
"Slicing in R^d"). The functions here are compositions of the public :func:`slicedkern.kernel_sum` /
:func:`slicedkern.kernel_attention` with plain array operations (projections, sums), so gradients
flow wherever those two are differentiable (torch autograd, ``jax.grad``), and :func:`slicedkern.vjp`
pulls them back chunk of slices by chunk.

Directions are generated on the host with NumPy (:func:`directions`), from a seed, so the same seed
gives the same directions on every backend.

Modules: ``directions`` (the directions and the ``directions=`` argument), ``plan`` (the chunked
slice plan, its forward and pullback), ``ops`` (kernel sums, attention), ``stats`` (energy distance,
MMD), ``radial`` (the radial profile).

Examples
--------
>>> import numpy as np, slicedkern
>>> from slicedkern.sliced import energy_distance
>>> rng = np.random.default_rng(0)
>>> x, y = rng.normal(size=(500, 3)), rng.normal(size=(400, 3)) + [1.0, 0.0, 0.0]
>>> ed = energy_distance(x, y, directions=256, seed=0)
>>> ed.shape, bool(0.3 < ed < 0.8)
((), True)
"""

from .directions import directions
from .ops import sliced_attention, sliced_kernel_sum
from .radial import radial_profile
from .stats import energy_distance, mmd

__all__ = ["directions", "sliced_kernel_sum", "sliced_attention", "energy_distance", "mmd",
           "radial_profile"]
