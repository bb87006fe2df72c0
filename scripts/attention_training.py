"""End-to-end evidence: the same small transformer with softmax, sliced ReLU or sliced hat attention.

Two synthetic tasks, generated here, trained on the CPU with fixed seeds:

* **shapes** -- point-cloud classification of 8 shapes (sphere, cube, cylinder, cone, torus and the
  composites dumbbell, rocket, snowman) sampled on their surfaces, with the ModelNet40-style
  augmentations of the paper: random rotation, anisotropic scale, Gaussian noise and point dropout
  (dropped points become padding, so every batch carries a ``key_padding_mask``). The model is a
  minimal point-wise transformer: a linear embedding of each point, pre-LayerNorm encoder layers,
  a masked mean pool and a linear classifier (no grouping or sampling);
* **recall** -- associative recall over long sequences: ``L`` tokens of filler, with ``PAIRS``
  key-value tokens hidden at random positions; the last token names one of the keys and the model
  must output its value (8 possible values: chance 1/8).

The three models differ only in the class of their encoder layers: ``torch.nn.TransformerEncoderLayer``
(softmax, ``nn.MultiheadAttention``) or :class:`slicedkern.nn.torch.SlicedTransformerEncoderLayer`
with ``kernel="relu"`` or ``kernel="hat"``; same width, depth, optimiser, learning rate and steps.

Run from the repository root::

    PYTHONPATH=. python scripts/attention_training.py                         # full table (long on 2 cores)
    PYTHONPATH=. python scripts/attention_training.py --size ci               # seconds: what CI runs
    PYTHONPATH=. python scripts/attention_training.py --tasks recall --seeds 0 --timing-lengths 1024,4096

The docs gallery example ``docs/examples/plot_attention_training.py`` is a self-contained, smaller
version of the shapes task (four shapes, one seed) with the same kind of model.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from slicedkern.nn.torch import SlicedTransformerEncoderLayer

ATTENTIONS = ("softmax", "sliced-relu", "sliced-hat")
SHAPES = ("sphere", "cube", "cylinder", "cone", "torus", "dumbbell", "rocket", "snowman")


@dataclass(frozen=True)
class Size:
    """Sizes of a run: model, data and training steps of each task."""

    width: int = 64
    heads: int = 4
    layers: int = 2
    points: int = 256            # points per cloud before dropout
    shape_steps: int = 300
    shape_batch: int = 32
    shape_test: int = 512
    length: int = 1024           # recall sequence length
    pairs: int = 8
    recall_steps: int = 400
    recall_batch: int = 16
    recall_test: int = 256
    lr: float = 2e-3


SIZES = {"full": Size(),
         # What fits in ~40 min on one shared CPU core (the numbers in the closing note).
         "medium": Size(width=32, heads=4, layers=2, points=128, shape_steps=150, shape_batch=16,
                        shape_test=256, length=1024, pairs=4, recall_steps=150, recall_batch=8,
                        recall_test=128),
         # What one seed of ran in a few minutes on the shared 2-core machine of the closing note.
         "small": Size(width=32, heads=4, layers=2, points=96, shape_steps=100, shape_batch=16, shape_test=128,
                       length=1024, pairs=4, recall_steps=100, recall_batch=4, recall_test=64),
         "ci": Size(width=32, heads=4, layers=1, points=64, shape_steps=25, shape_batch=16, shape_test=64,
                    length=256, pairs=4, recall_steps=25, recall_batch=8, recall_test=32)}


# ------------------------------------------------------------------------------------------- data
def _unit(rng, n):
    x = rng.normal(size=(n, 3))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _cube(rng, n):
    face = rng.integers(0, 6, n)
    p = rng.uniform(-1, 1, size=(n, 3))
    p[np.arange(n), face % 3] = np.where(face < 3, -1.0, 1.0)
    return 0.8 * p


def _cylinder(rng, n, radius=0.6, height=2.0):
    angle = rng.uniform(0, 2 * np.pi, n)
    z = rng.uniform(-height / 2, height / 2, n)
    r = np.full(n, radius)
    cap = rng.random(n) < 0.25                       # a quarter of the points on the two caps
    r[cap] = radius * np.sqrt(rng.random(cap.sum()))
    z[cap] = np.where(rng.random(cap.sum()) < 0.5, -height / 2, height / 2)
    return np.stack((r * np.cos(angle), r * np.sin(angle), z), axis=1)


def _cone(rng, n, radius=0.9, height=1.8):
    angle = rng.uniform(0, 2 * np.pi, n)
    t = np.sqrt(rng.random(n))                       # uniform on the lateral surface
    base = rng.random(n) < 0.3
    r = np.where(base, radius * np.sqrt(rng.random(n)), radius * t)
    z = np.where(base, -height / 2, height / 2 - height * t)
    return np.stack((r * np.cos(angle), r * np.sin(angle), z), axis=1)


def _torus(rng, n, major=0.75, minor=0.3):
    u, v = rng.uniform(0, 2 * np.pi, (2, n))
    return np.stack(((major + minor * np.cos(v)) * np.cos(u), (major + minor * np.cos(v)) * np.sin(u),
                     minor * np.sin(v)), axis=1)


def _two(rng, n, first, second):
    pick = rng.random(n) < 0.5
    out = first(rng, n)
    out[pick] = second(rng, n)[pick]
    return out


def sample_shape(rng, label, n):
    """``n`` points on the surface of shape ``SHAPES[label]``, before augmentation."""
    name = SHAPES[label]
    if name == "sphere":
        return _unit(rng, n)
    if name == "cube":
        return _cube(rng, n)
    if name == "cylinder":
        return _cylinder(rng, n)
    if name == "cone":
        return _cone(rng, n)
    if name == "torus":
        return _torus(rng, n)
    if name == "dumbbell":
        return _two(rng, n, lambda r, m: 0.45 * _unit(r, m) + [0.75, 0, 0],
                    lambda r, m: 0.45 * _unit(r, m) - [0.75, 0, 0])
    if name == "rocket":
        return _two(rng, n, lambda r, m: _cylinder(r, m, 0.4, 1.4) - [0, 0, 0.3],
                    lambda r, m: _cone(r, m, 0.4, 0.7) + [0, 0, 0.75])
    return _two(rng, n, lambda r, m: 0.55 * _cube(r, m) - [0, 0, 0.45],
                lambda r, m: 0.4 * _unit(r, m) + [0, 0, 0.5])


def shapes_batch(rng, batch, points):
    """Augmented clouds ``(B, points, 3)`` float32, padding mask ``(B, points)`` (True = dropped), labels."""
    labels = rng.integers(0, len(SHAPES), batch)
    clouds = np.empty((batch, points, 3))
    mask = np.zeros((batch, points), dtype=bool)
    for b, label in enumerate(labels):
        x = sample_shape(rng, label, points)
        rotation, r = np.linalg.qr(rng.normal(size=(3, 3)))
        rotation *= np.sign(np.diag(r))              # a uniformly random orthogonal matrix
        x = (x * rng.uniform(0.7, 1.3, 3)) @ rotation.T
        x += rng.normal(scale=0.02, size=x.shape)
        dropped = rng.random(points) < rng.uniform(0.0, 0.5)
        dropped[0] = False
        x -= x[~dropped].mean(axis=0)
        x /= np.linalg.norm(x[~dropped], axis=1).max()
        clouds[b], mask[b] = np.where(dropped[:, None], 0.0, x), dropped
    return (torch.tensor(clouds, dtype=torch.float32), torch.tensor(mask), torch.tensor(labels))


def recall_batch(rng, batch, length, pairs, n_keys=16, n_values=8, n_filler=16):
    """Token ids ``(B, L)`` and target values: ``pairs`` key-value tokens among filler, a query last.

    Vocabulary: ``n_filler`` filler tokens, then one token per (key, value) pair, then one query
    token per key.
    """
    tokens = rng.integers(0, n_filler, size=(batch, length))
    targets = np.empty(batch, dtype=np.int64)
    for b in range(batch):
        keys = rng.choice(n_keys, pairs, replace=False)
        values = rng.integers(0, n_values, pairs)
        slots = rng.choice(length - 1, pairs, replace=False)
        tokens[b, slots] = n_filler + keys * n_values + values
        asked = rng.integers(pairs)
        tokens[b, -1] = n_filler + n_keys * n_values + keys[asked]
        targets[b] = values[asked]
    return torch.tensor(tokens), torch.tensor(targets)


RECALL_VOCAB = 16 + 16 * 8 + 16
RECALL_CLASSES = 8


# ----------------------------------------------------------------------------------------- models
def encoder_layer(attention, size):
    """One pre-LayerNorm encoder layer; only the class (and kernel) changes between attentions."""
    common = {"dim_feedforward": 2 * size.width, "dropout": 0.0, "batch_first": True, "norm_first": True,
              "activation": "gelu"}
    if attention == "softmax":
        return nn.TransformerEncoderLayer(size.width, size.heads, **common)
    return SlicedTransformerEncoderLayer(size.width, size.heads, **common, kernel=attention.split("-")[1])


class Model(nn.Module):
    """Embedding, encoder layers, readout: a masked mean pool (shapes) or the last token (recall)."""

    def __init__(self, attention, size, embed, classes, pool):
        super().__init__()
        self.embed, self.pool = embed, pool
        self.layers = nn.ModuleList(encoder_layer(attention, size) for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.width)
        self.head = nn.Linear(size.width, classes)

    def forward(self, x, padding=None):
        h = self.embed(x)
        for layer in self.layers:
            # Each layer gets the boolean mask itself (nn.TransformerEncoder would turn it into floats).
            h = layer(h, src_key_padding_mask=padding)
        h = self.norm(h)
        if self.pool == "last":
            return self.head(h[:, -1])
        keep = (~padding).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


def make_model(task, attention, size):
    if task == "shapes":
        return Model(attention, size, nn.Linear(3, size.width), len(SHAPES), "mean")
    return Model(attention, size, nn.Embedding(RECALL_VOCAB, size.width), RECALL_CLASSES, "last")


def draw(task, rng, size, batch):
    if task == "shapes":
        x, mask, y = shapes_batch(rng, batch, size.points)
        return (x, mask), y
    x, y = recall_batch(rng, batch, size.length, size.pairs)
    return (x, None), y


# --------------------------------------------------------------------------------------- training
def train(task, attention, size, seed):
    """Train on fresh batches (seeded), return test accuracy and seconds per step."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = make_model(task, attention, size)
    steps = size.shape_steps if task == "shapes" else size.recall_steps
    batch = size.shape_batch if task == "shapes" else size.recall_batch
    optimiser = torch.optim.AdamW(model.parameters(), lr=size.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=size.lr, total_steps=steps, pct_start=0.1)
    start = time.perf_counter()
    for _ in range(steps):
        inputs, target = draw(task, rng, size, batch)
        loss = nn.functional.cross_entropy(model(*inputs), target)
        optimiser.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        schedule.step()
    seconds = (time.perf_counter() - start) / steps
    test_rng = np.random.default_rng(10_000 + seed)   # the same test set for every attention
    n_test = size.shape_test if task == "shapes" else size.recall_test
    correct = 0
    model.eval()
    with torch.no_grad():
        for _ in range(math.ceil(n_test / batch)):
            inputs, target = draw(task, test_rng, size, batch)
            correct += (model(*inputs).argmax(-1) == target).sum().item()
    return correct / (math.ceil(n_test / batch) * batch), seconds


def step_time(attention, size, length, batch=1, repeats=3):
    """Best time of one recall training step (forward, backward, AdamW) at sequence ``length``."""
    size = replace(size, length=length)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = make_model("recall", attention, size)
    optimiser = torch.optim.AdamW(model.parameters(), lr=size.lr)
    best = math.inf
    for i in range(repeats + 1):                     # the first step warms up
        inputs, target = draw("recall", rng, size, batch)
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(*inputs), target)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def accuracy_table(tasks, attentions, seeds, size, log=print):
    """``{(task, attention): [accuracy per seed]}`` and ``{(task, attention): [s/step per seed]}``."""
    accuracy, seconds = {}, {}
    for seed in seeds:                               # seed-major: a cut-short run still compares
        for task in tasks:
            for attention in attentions:
                acc, sec = train(task, attention, size, seed)
                accuracy.setdefault((task, attention), []).append(acc)
                seconds.setdefault((task, attention), []).append(sec)
                log(f"  {task:7s} {attention:12s} seed {seed}: accuracy {acc:.3f}, {sec * 1e3:.0f} ms/step")
    return accuracy, seconds


def mean_std(values):
    values = np.asarray(values)
    return f"{values.mean():.3f} ± {values.std(ddof=1) if len(values) > 1 else 0.0:.3f}"


def format_tables(accuracy, seconds, timings, attentions):
    lines = ["| task | " + " | ".join(attentions) + " |", "|---" * (len(attentions) + 1) + "|"]
    for task in sorted({t for t, _ in accuracy}):
        lines.append(f"| {task} accuracy | " + " | ".join(mean_std(accuracy[task, a]) for a in attentions) + " |")
        lines.append(f"| {task} ms/step (train) | "
                     + " | ".join(f"{1e3 * np.mean(seconds[task, a]):.0f}" for a in attentions) + " |")
    if timings:
        lines += ["", "| L (recall step, batch 1) | " + " | ".join(attentions) + " |",
                  "|---" * (len(attentions) + 1) + "|"]
        for length in sorted({n for _, n in timings}):
            lines.append(f"| {length} | " + " | ".join(
                f"{1e3 * timings[a, length]:.0f} ms" if (a, length) in timings else "-" for a in attentions) + " |")
    return "\n".join(lines)


def plot_timings(timings, attentions, path=None):
    import matplotlib.pyplot as plt  # optional: only for the plot

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for attention in attentions:
        points = sorted((n, t) for (a, n), t in timings.items() if a == attention)
        if points:
            ax.loglog(*zip(*points), "o-", label=attention)
    ax.set_xlabel("sequence length L")
    ax.set_ylabel("seconds per training step")
    ax.set_title("recall model, one training step (CPU)")
    ax.legend()
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--tasks", default="shapes,recall")
    parser.add_argument("--attentions", default=",".join(ATTENTIONS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--timing-lengths", default="1024,4096,16384",
                        help="recall step timings at these L ('' to skip)")
    parser.add_argument("--timing-repeats", type=int, default=3, help="best of this many timed steps")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--plot", default="", help="save the timing plot to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    size = SIZES[args.size]
    attentions = tuple(args.attentions.split(","))
    tasks = [t for t in args.tasks.split(",") if t]
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"size {args.size}: {size}; torch {torch.__version__}, {args.threads} thread(s)")
    timings = {}
    for length in (int(n) for n in args.timing_lengths.split(",") if n):
        for attention in attentions:
            timings[attention, length] = step_time(attention, size, length, repeats=args.timing_repeats)
            print(f"  step time L={length} {attention}: {1e3 * timings[attention, length]:.0f} ms", flush=True)
    accuracy, seconds = accuracy_table(tasks, attentions, seeds, size, log=lambda m: print(m, flush=True))
    print(format_tables(accuracy, seconds, timings, attentions))
    if args.plot and timings:
        plot_timings(timings, attentions, args.plot)


if __name__ == "__main__":
    main()
