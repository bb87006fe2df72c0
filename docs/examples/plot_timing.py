"""
Time against sequence length
============================

Sliced ReLU attention costs ``O(L log L)``; softmax attention and the dense reference cost
``O(L^2)``. This example times the three on the CPU for sequence lengths up to 8192 and plots them
on log-log axes, where the slopes tell the complexity (a slope of 2 is quadratic, a slope close to 1
quasi-linear).

* **sliced**: :func:`slicedkern.relu_attention` on one score per token, ``q, k`` of shape ``(1, L)``,
  values ``(1, L, D)``;
* **softmax**: ``torch.nn.functional.scaled_dot_product_attention`` on ``(1, 1, L, D)`` queries, keys
  and values when torch is installed, otherwise a NumPy softmax attention;
* **dense**: :func:`slicedkern.reference.relu_attention`, which forms the ``L x L`` matrix (up to
  ``L = 4096`` here, to keep memory small).

The sizes are kept small so that the page builds in seconds; ``python -m slicedkern bench`` runs the
full comparison (see :doc:`/benchmarks`). The torch calls run on one thread, and the best of a few
calls is reported, which keeps the timings stable on a busy machine.
"""

import time

import matplotlib.pyplot as plt
import numpy as np

import slicedkern
from slicedkern import reference

try:
    import torch
except ImportError:                     # the example still runs, with NumPy only
    torch = None

SIZES = [256, 512, 1024, 2048, 4096, 8192]
DENSE_MAX = 4096
D = 32


def best_time(fn, repeats=3, budget=0.5):
    """Best wall-clock time of ``fn()`` over at most ``repeats`` calls (fewer past ``budget``
    seconds)."""
    fn()                                # warm-up: first-call costs (imports, compilation)
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
        if spent > budget:
            break
    return best


def numpy_softmax_attention(q, k, v):
    scores = q @ k.T / np.sqrt(q.shape[-1])
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (scores / scores.sum(axis=-1, keepdims=True)) @ v


# One thread for every torch call: a like-for-like comparison, and stable timings on a busy
# machine.
threads = torch.get_num_threads() if torch is not None else None
if torch is not None:
    torch.set_num_threads(1)

rng = np.random.default_rng(0)
results = {"sliced ReLU attention": [], "softmax attention": [], "dense reference": []}
for L in SIZES:
    q = rng.standard_normal((1, L)).astype(np.float32)
    k = rng.standard_normal((1, L)).astype(np.float32)
    v = rng.standard_normal((1, L, D)).astype(np.float32)
    Q, K, V = (rng.standard_normal((L, D)).astype(np.float32) for _ in range(3))
    if torch is not None:
        qs, ks, vs = (torch.from_numpy(a) for a in (q, k, v))
        Qt, Kt, Vt = (torch.from_numpy(a)[None, None] for a in (Q, K, V))
        sliced = best_time(lambda: slicedkern.relu_attention(qs, ks, vs))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        softmax = best_time(lambda: sdpa(Qt, Kt, Vt))
    else:
        sliced = best_time(lambda: slicedkern.relu_attention(q, k, v))
        softmax = best_time(lambda: numpy_softmax_attention(Q, K, V))
    if L <= DENSE_MAX:
        dense = best_time(lambda: reference.relu_attention(q, k, v), repeats=2)
    else:                               # an L x L matrix: skipped past DENSE_MAX
        dense = np.nan
    for name, value in zip(results, (sliced, softmax, dense)):
        results[name].append(value)
    dense_text = f"{dense * 1e3:8.2f} ms" if L <= DENSE_MAX else "(skipped: L > DENSE_MAX)"
    print(f"L = {L:5d}   sliced {sliced * 1e3:8.2f} ms   softmax {softmax * 1e3:8.2f} ms   "
          f"dense {dense_text}")

if torch is not None:
    torch.set_num_threads(threads)

# %%
# Log-log plot, with ``L log L`` and ``L^2`` guides through the largest measured sizes (small sizes
# are dominated by fixed per-call costs).

sizes = np.asarray(SIZES, dtype=float)
fig, ax = plt.subplots(figsize=(6.5, 4.5))
for (name, times), marker in zip(results.items(), "osd"):
    ax.loglog(sizes, np.asarray(times) * 1e3, marker=marker, label=name)
t0, L0 = results["sliced ReLU attention"][-1] * 1e3, sizes[-1]
guide = t0 * sizes * np.log(sizes) / (L0 * np.log(L0))
ax.loglog(sizes, guide, "k:", lw=1, label=r"$\propto L \log L$")
last = SIZES.index(DENSE_MAX)
t1, L1 = results["dense reference"][last] * 1e3, sizes[last]
ax.loglog(sizes, t1 * (sizes / L1) ** 2, "k--", lw=1, label=r"$\propto L^2$")
ax.set_xticks(SIZES, [str(L) for L in SIZES])
ax.minorticks_off()
ax.set_xlabel("sequence length L")
ax.set_ylabel("time per call (ms)")
backend = "torch CPU" if torch is not None else "NumPy"
ax.set_title(f"forward pass, D = {D}, float32 ({backend})")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()
