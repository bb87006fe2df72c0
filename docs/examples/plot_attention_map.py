"""
Attention map: dense vs sort-scan
=================================

The sort-scan never forms the ``Lq x Lk`` matrix ``K_ij = f(q_i - k_j)``: it sorts the keys and reads
every sum off prefix sums. Yet the matrix is there implicitly, and it can be recovered exactly.
A kernel sum with weights ``w`` computes ``S = K w``; with the identity matrix as weights
(``w = I``, one column per key) the output *is* ``K``, column by column.

This example builds a hat attention map both ways, densely with
:func:`slicedkern.reference.kernel_matrix` and by sort-scan with :func:`slicedkern.kernel_sum`, and
checks that they agree to rounding.
"""

import matplotlib.pyplot as plt
import numpy as np

import slicedkern
from slicedkern import reference
from slicedkern.kernels import Hat, ReLU

rng = np.random.default_rng(0)
L = 64
t = np.arange(L)
# scores with some structure: a slow drift plus noise, for queries and keys
q = np.sin(2 * np.pi * t / L) + 0.1 * rng.standard_normal(L)
k = np.cos(2 * np.pi * t / L) + 0.1 * rng.standard_normal(L)
kernel = Hat(0.5)

dense = reference.kernel_matrix(q, k, kernel)            # (Lq, Lk), K_ij = f(q_i - k_j)
scan = slicedkern.kernel_sum(q, k, np.eye(L), kernel)    # (Lq, Lk): K = K @ I

print("shape:", scan.shape)
print("max |dense - sort-scan| =", np.abs(dense - scan).max())

# %%
# The two maps side by side, and their difference.

fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
im0 = axes[0].imshow(dense, cmap="viridis")
axes[0].set_title("dense: reference.kernel_matrix")
im1 = axes[1].imshow(scan, cmap="viridis")
axes[1].set_title("sort-scan: kernel_sum(q, k, I)")
diff = dense - scan
scale = max(np.abs(diff).max(), 1e-300)
im2 = axes[2].imshow(diff, cmap="RdBu_r", vmin=-scale, vmax=scale)
axes[2].set_title("difference")
labels = ("K_ij = f(q_i - k_j)", "K_ij = f(q_i - k_j)", "dense - sort-scan")
for ax, im, label in zip(axes, (im0, im1, im2), labels):
    ax.set_xlabel("key j")
    fig.colorbar(im, ax=ax, shrink=0.8, label=label)
axes[0].set_ylabel("query i")
fig.tight_layout()
plt.show()

# %%
# The same for the attention itself
# ---------------------------------
# Attention is a normalised kernel sum: sliced ReLU attention (paper eq. 3) divides
# ``sum_j ReLU(q_i - k_j) (v_j - mean(v))`` by ``sum_l |q_i - k_l|``. The dense reference computes
# exactly that with an explicit matrix; the sort-scan agrees with it to rounding.

v = rng.standard_normal((L, 8))
fast = slicedkern.relu_attention(q, k, v)
slow = reference.relu_attention(q, k, v)
print("relu_attention, max |dense - sort-scan| =", np.abs(fast - slow).max())

# the row-normalised ReLU map that relu_attention applies to the centred values
relu_map = slicedkern.kernel_sum(q, k, np.eye(L), ReLU())
relu_map = relu_map / np.abs(q[:, None] - k[None, :]).sum(axis=1, keepdims=True)
print("same output from the recovered map:",
      np.abs(relu_map @ (v - v.mean(axis=0)) - fast).max())
