"""
Training a transformer with sliced attention
============================================

:class:`slicedkern.nn.torch.SlicedTransformerEncoderLayer` takes the arguments of
``torch.nn.TransformerEncoderLayer``: a model switches from softmax to sliced attention by
changing one class name. This example trains the same small point-cloud classifier three ways,
with softmax attention (``nn.MultiheadAttention``), sliced ReLU attention and sliced hat attention,
then times one training step of each against the number of points.

Everything runs on this page: the data, the model and the training loop below are the whole
program (the downloads at the bottom run on their own with torch, matplotlib and ``slicedkern``).

.. note::

   **This is a smoke size.** The page is built on every documentation build, on a shared CPU, so
   the models are tiny (width 32, 2 layers), train for a few hundred steps on one seed, and the
   task is an easy one (4 shapes). It shows the three models training and the cost of a step
   growing with the sequence length; it does not rank the attentions: with one seed at this
   budget, differences of a few points of accuracy are noise.

For a comparison that does, ``scripts/attention_training.py`` in the repository runs the same
kind of model on 8 shapes and on a long-range recall task, with 3 seeds. Measured with
``PYTHONPATH=. python scripts/attention_training.py --size medium --timing-repeats 2 --threads 1``
(width 32, 4 heads, 2 pre-LN layers, 150 AdamW steps, seeds 0, 1, 2, mean ± std; one thread of a
shared 2-core machine, so the times are noisy and the accuracies are not):

=========================================  =============  =============  =============
measure                                    softmax        sliced ReLU    sliced hat
=========================================  =============  =============  =============
shapes accuracy (8 classes, chance 0.125)  0.357 ± 0.039  0.388 ± 0.026  0.385 ± 0.027
recall accuracy, L = 1024 (chance 0.125)   0.130 ± 0.025  0.107 ± 0.044  0.109 ± 0.041
recall training step, L = 1K               211 ms         163 ms         133 ms
recall training step, L = 4K               5.05 s         1.45 s         1.02 s
recall training step, L = 16K              107 s          4.02 s         3.16 s
=========================================  =============  =============  =============

There, on shapes the sliced models are level with softmax (within one standard deviation); no
model learned recall at that size (all at chance); at 16K points a sliced training step is 27x
(ReLU) and 34x (hat) faster than a softmax one.
"""

import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn

from slicedkern.nn.torch import SlicedTransformerEncoderLayer

torch.set_num_threads(1)        # stable timings on a shared machine

# The smoke size of this page: raise STEPS and SEEDS for a real comparison.
WIDTH, HEADS, LAYERS = 32, 4, 2
POINTS, BATCH, STEPS, TEST = 64, 16, 200, 256
SEEDS = [0]
ATTENTIONS = ("softmax", "sliced ReLU", "sliced hat")

# %%
# The data: point clouds of four shapes
# -------------------------------------
# Points on the surface of a sphere, a cube, a cylinder or a torus, randomly rotated, scaled
# differently along each axis, with noise, and with up to half of the points dropped. Dropped
# points are padding: the model gets them masked with ``src_key_padding_mask``, as a batch of
# clouds of different sizes would be.

SHAPES = ("sphere", "cube", "cylinder", "torus")


def sample_shape(rng, label, n):
    """``n`` points on the surface of ``SHAPES[label]``."""
    if SHAPES[label] == "sphere":
        x = rng.normal(size=(n, 3))
        return x / np.linalg.norm(x, axis=1, keepdims=True)
    if SHAPES[label] == "cube":
        x = rng.uniform(-1, 1, size=(n, 3))
        face = rng.integers(0, 6, n)
        x[np.arange(n), face % 3] = np.where(face < 3, -1.0, 1.0)
        return 0.8 * x
    angle = rng.uniform(0, 2 * np.pi, n)
    if SHAPES[label] == "cylinder":
        z = rng.uniform(-1, 1, n)
        return np.stack((0.6 * np.cos(angle), 0.6 * np.sin(angle), z), axis=1)
    tube = rng.uniform(0, 2 * np.pi, n)                   # torus
    ring = 0.75 + 0.3 * np.cos(tube)
    height = 0.3 * np.sin(tube)
    return np.stack((ring * np.cos(angle), ring * np.sin(angle), height), axis=1)


def batch_of_clouds(rng, batch, points):
    """Clouds ``(B, points, 3)``, padding mask ``(B, points)`` (True = dropped), labels."""
    labels = rng.integers(0, len(SHAPES), batch)
    clouds = np.zeros((batch, points, 3))
    dropped = np.zeros((batch, points), dtype=bool)
    for b, label in enumerate(labels):
        x = sample_shape(rng, label, points)
        rotation, r = np.linalg.qr(rng.normal(size=(3, 3)))
        rotation *= np.sign(np.diag(r))                   # uniformly random orthogonal
        x = (x * rng.uniform(0.7, 1.3, 3)) @ rotation.T          # rotated, stretched
        x = x + rng.normal(scale=0.02, size=x.shape)
        drop = rng.random(points) < rng.uniform(0.0, 0.5)
        drop[0] = False                                   # at least one point stays
        x = x - x[~drop].mean(axis=0)
        clouds[b] = np.where(drop[:, None], 0.0, x / np.linalg.norm(x[~drop], axis=1).max())
        dropped[b] = drop
    return (torch.tensor(clouds, dtype=torch.float32), torch.tensor(dropped),
            torch.tensor(labels))


# %%
# The model: the one line that differs
# ------------------------------------
# A linear embedding of each point, pre-LayerNorm encoder layers, a mean over the points that are
# not padding, and a linear classifier. ``encoder_layer`` is the only place where the three
# models differ: ``nn.TransformerEncoderLayer`` for softmax attention, and
# ``SlicedTransformerEncoderLayer`` with the same arguments plus ``kernel=`` otherwise.


def encoder_layer(attention):
    common = dict(dim_feedforward=2 * WIDTH, dropout=0.0, batch_first=True, norm_first=True,
                  activation="gelu")
    if attention == "softmax":
        return nn.TransformerEncoderLayer(WIDTH, HEADS, **common)
    kernel = {"sliced ReLU": "relu", "sliced hat": "hat"}[attention]
    return SlicedTransformerEncoderLayer(WIDTH, HEADS, kernel=kernel, **common)


class PointCloudClassifier(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.embed = nn.Linear(3, WIDTH)
        self.layers = nn.ModuleList(encoder_layer(attention) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, len(SHAPES))

    def forward(self, points, padding):
        h = self.embed(points)
        for layer in self.layers:
            h = layer(h, src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).to(h.dtype)
        return self.head((self.norm(h) * keep).sum(1) / keep.sum(1))


print(encoder_layer("sliced hat"))

# %%
# Train and test
# --------------
# Fresh batches at every step (seeded), the same optimiser, learning-rate schedule and number of
# steps for every attention, then the accuracy on one held-out set shared by all three.


def train_and_test(attention, seed):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = PointCloudClassifier(attention)
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=3e-3,
                                                   total_steps=STEPS)
    start = time.perf_counter()
    for _ in range(STEPS):
        points, padding, labels = batch_of_clouds(rng, BATCH, POINTS)
        loss = nn.functional.cross_entropy(model(points, padding), labels)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        schedule.step()
    seconds = (time.perf_counter() - start) / STEPS
    points, padding, labels = batch_of_clouds(np.random.default_rng(10_000), TEST, POINTS)
    model.eval()
    with torch.no_grad():
        accuracy = (model(points, padding).argmax(-1) == labels).float().mean().item()
    return accuracy, seconds


class Table:
    """Rows shown as an HTML table in the gallery and a notebook, as text in a terminal."""

    def __init__(self, header, rows):
        self.header, self.rows = header, rows

    def _repr_html_(self):
        def cells(row, tag):
            return "".join(f"<{tag}>{c}</{tag}>" for c in row)

        body = "".join(f"<tr>{cells(row, 'td')}</tr>" for row in self.rows)
        return f"<table><tr>{cells(self.header, 'th')}</tr>{body}</table>"

    def __repr__(self):
        widths = [max(len(str(r[i])) for r in [self.header, *self.rows])
                  for i in range(len(self.header))]
        return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths))
                         for row in [self.header, *self.rows])


results = {(a, s): train_and_test(a, s) for s in SEEDS for a in ATTENTIONS}
Table(["attention", f"test accuracy ({len(SHAPES)} shapes, chance {1 / len(SHAPES):.2f})",
       "training step (ms)"],
      [[a, " / ".join(f"{results[a, s][0]:.3f}" for s in SEEDS),
        f"{1e3 * np.mean([results[a, s][1] for s in SEEDS]):.1f}"] for a in ATTENTIONS])

# %%
# The accuracies are of one seed (listed per seed if ``SEEDS`` has more), on 256 test clouds: a
# difference of 0.03 is about one standard error. The step times here are of 64 points, where the
# sort-and-scan's fixed cost per call is most of a sliced layer's time.
#
# Time per training step against the number of points
# ----------------------------------------------------
# One training step (forward, backward, AdamW) of one cloud of ``L`` points, best of two after a
# warm-up step. Softmax attention costs ``O(L^2)`` per layer, sliced attention ``O(L log L)``.

LENGTHS = [256, 512, 1024, 2048, 4096]


def step_time(attention, length, repeats=2):
    torch.manual_seed(0)
    model = PointCloudClassifier(attention)
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3)
    points, padding, labels = batch_of_clouds(np.random.default_rng(0), 1, length)
    best = float("inf")
    for i in range(repeats + 1):                          # step 0 warms up
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(points, padding), labels)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if i:
            best = min(best, time.perf_counter() - start)
    return best


timings = {a: [step_time(a, n) for n in LENGTHS] for a in ATTENTIONS}
Table(["L (points)"] + list(ATTENTIONS),
      [[n] + [f"{1e3 * timings[a][i]:.1f} ms" for a in ATTENTIONS]
       for i, n in enumerate(LENGTHS)])

# %%

fig, ax = plt.subplots(figsize=(6, 4))
for attention, marker in zip(ATTENTIONS, "osd"):
    ax.loglog(LENGTHS, np.asarray(timings[attention]) * 1e3, marker=marker, label=attention)
ax.set_xticks(LENGTHS, [str(n) for n in LENGTHS])
ax.minorticks_off()
ax.set_xlabel("points per cloud L")
ax.set_ylabel("one training step (ms)")
ax.set_title(f"width {WIDTH}, {LAYERS} layers, batch 1, one CPU thread")
ax.legend()
fig.tight_layout()
plt.show()
