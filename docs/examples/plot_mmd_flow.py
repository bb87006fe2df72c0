"""
A sliced-MMD gradient flow in 2-D
=================================

A gradient flow of the squared MMD moves the points of a cloud ``x`` along ``-grad_x MMD^2(x, y)``
until they are distributed like a target cloud ``y``. With the *negative distance* kernel
``K(a, b) = -|a - b|`` the squared MMD is the energy distance, a kernel that gives a well-behaved
flow: far points are pulled in, close points repel each other, and nothing has to be tuned.

Here the kernel is sliced: :func:`slicedkern.mmd` with the 1-D profile ``-Abs()`` averages
``-|<theta, a - b>|`` over ``P`` directions, which is ``kappa_d`` times the energy distance
(``kappa_2 = 2 / pi``), at the cost of ``P`` sorts of the ``n + m`` points per step instead of ``n m``
distances. Fresh random directions are drawn at every step (a stochastic gradient).

The gradient comes from ``torch.autograd`` when torch is installed; otherwise from
:func:`slicedkern.vjp`, which pulls back :func:`slicedkern.mmd` on NumPy arrays with the same
sort-scan backward.
"""

import math

import matplotlib.pyplot as plt
import numpy as np

import slicedkern
from slicedkern.kernels import Abs

try:
    import torch
except ImportError:
    torch = None

rng = np.random.default_rng(0)
n = 400
# start: a tight Gaussian blob off to the side; target: a noisy ring
start = 0.4 * rng.standard_normal((n, 2)) + np.array([-2.5, -1.5])
angle = rng.uniform(0.0, 2.0 * math.pi, n)
ring = 1.5 * np.stack([np.cos(angle), np.sin(angle)], axis=1)
target = ring + 0.08 * rng.standard_normal((n, 2))

kernel = -Abs()            # the profile -|r|: sliced MMD^2 = kappa_d * energy distance
n_slices = 64
steps = 40
step_size = 1.0 * n        # the gradient of a mean over points carries a factor 1/n

# %%
# Check the identity ``mmd(x, y, -Abs()) = kappa_d * energy_distance(x, y)`` on the starting clouds,
# with the same directions for both.

theta = slicedkern.directions(n_slices, 2, seed=0)
kappa_2 = 2.0 / math.pi
mmd = float(slicedkern.mmd(start, target, kernel, directions=theta))
energy = float(slicedkern.energy_distance(start, target, directions=theta))
print("mmd(x, y, -Abs())          =", mmd)
print("kappa_2 * energy_distance  =", kappa_2 * energy)

# %%
# The flow: plain gradient descent on the positions of ``x``.


def gradient_torch(x, y, seed):
    x = torch.from_numpy(x).requires_grad_(True)
    loss = slicedkern.mmd(x, torch.from_numpy(y), kernel, directions=n_slices, seed=seed)
    (grad,) = torch.autograd.grad(loss, x)
    return float(loss.detach()), grad.numpy()


def gradient_vjp(x, y, seed):
    loss, pullback = slicedkern.vjp(slicedkern.mmd, x, y, kernel, directions=n_slices,
                                    seed=seed)
    grad = pullback(np.ones_like(loss))[0]
    return float(loss), grad


gradient = gradient_torch if torch is not None else gradient_vjp
threads = torch.get_num_threads() if torch is not None else None
if torch is not None:
    torch.set_num_threads(1)          # small problems: one thread is as fast and steadier

x = start.copy()
snapshots, losses = {0: x.copy()}, []
for step in range(steps):
    loss, grad = gradient(x, target, seed=step)
    losses.append(loss)
    x = x - step_size * grad
    if step + 1 in (5, 15):
        snapshots[step + 1] = x.copy()
snapshots[steps] = x
if torch is not None:
    torch.set_num_threads(threads)

final = float(slicedkern.mmd(x, target, kernel, directions=256, seed=123))
print(f"sliced MMD^2: {losses[0]:.4f} at the start, {final:.2e} after {steps} steps "
      f"({'torch autograd' if torch is not None else 'slicedkern.vjp'})")

# %%
# Start, two intermediate states, and the end of the flow, over the target ring; and the loss.

fig, axes = plt.subplots(1, 5, figsize=(16, 3.6),
                         gridspec_kw={"width_ratios": [1, 1, 1, 1, 1.2]})
for ax, (step, points) in zip(axes, snapshots.items()):
    ax.scatter(target[:, 0], target[:, 1], s=4, color="0.75", label="target y")
    ax.scatter(points[:, 0], points[:, 1], s=4, color="C0", label="x")
    ax.set_title(f"step {step}")
    ax.set_xlim(-4, 2.5)
    ax.set_ylim(-3.5, 2.5)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
axes[0].legend(loc="upper right", fontsize=7, markerscale=3)
axes[-1].semilogy(np.arange(steps), losses)
axes[-1].set_xlabel("step")
axes[-1].set_title("sliced MMD$^2$ (-|r| kernel)")
fig.tight_layout()
plt.show()
