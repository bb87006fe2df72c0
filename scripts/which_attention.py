"""Which attention for which task: one table of softmax against the sliced variants (issue 27).

Four tasks, with data that ships with Python or is generated here (nothing is downloaded):

* **lm** -- character-level causal language model on the standard library's source
  (``scripts/char_lm.py``'s text, split by file); bits per character on held-out files, lower is
  better;
* **listops** -- LRA's ListOps (:func:`slicedkern.bench.tasks.listops`): nested MAX / MIN / MED /
  SM expressions, 10 classes, sequences of ``listops_lengths`` tokens;
* **pathfinder** -- a Pathfinder-style task (:func:`slicedkern.bench.tasks.pathfinder`): are the
  two marked endpoints joined by one dashed path, among distractors; pixels as tokens;
* **shapes** -- point-cloud classification of 8 synthetic shapes (``scripts/attention_training.py``).

Every variant is the same model: a token embedding (a linear map of the points for shapes), learned
position embeddings (sequence tasks), pre-LayerNorm encoder layers, a final LayerNorm and a
read-out (per token for the LM, a masked mean pool for the classifiers). Only the attention of the
layers changes: ``torch.nn.TransformerEncoderLayer`` (softmax, ``nn.MultiheadAttention``) or
:class:`slicedkern.nn.torch.SlicedTransformerEncoderLayer` with the options of ``VARIANTS``; the
sliced layers of the sequence tasks also rotate their queries and keys (``rope=True``), as
``scripts/char_lm.py`` does. Same width, depth, optimiser (AdamW, one-cycle schedule, gradient
clipping), learning rate, batches (one data seed per model seed) and steps for all.

Reported per (task, variant): the metric on a fixed test set (mean ± sample std over the seeds),
the median time of a training step, and learning curves (the metric at ``checkpoints`` points).

Run from the repository root::

    PYTHONPATH=. python scripts/which_attention.py --size ci                    # about a minute
    PYTHONPATH=. python scripts/which_attention.py --size small --tasks listops --out listops.json
    PYTHONPATH=. python scripts/which_attention.py --size full --tasks pathfinder --out pathfinder.json

``full`` is sized so that one task's table (6 variants x 3 seeds) takes about 90 minutes of a
2-core machine; run one task at a time. The docs page ``docs/which_attention.rst`` holds the
tables that came out, with the commands; the gallery example ``plot_which_attention.py`` runs
this script at the ``ci`` size.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))     # the sibling scripts of the other tasks
import attention_training  # noqa: E402
import char_lm  # noqa: E402

from slicedkern.bench.tasks import LISTOPS_CLASSES, LISTOPS_VOCAB, listops, pathfinder  # noqa: E402
from slicedkern.nn.torch import SlicedTransformerEncoderLayer  # noqa: E402

TASKS = ("lm", "listops", "pathfinder", "shapes")
#: The variants: None is softmax, a dict the options of SlicedTransformerEncoderLayer.
VARIANTS = {
    "softmax": None,
    "relu": {"kernel": "relu"},
    "relu-linear": {"kernel": "relu", "score": "linear"},
    "relu-4-slices": {"kernel": "relu", "slices": 4},
    "hat": {"kernel": "hat"},
    "hat-mixture": {"kernel": "hat_mixture"},
}


@dataclass(frozen=True)
class Size:
    """Model, data and budget of a run; ``steps`` and ``batch`` are per task."""

    width: int = 64
    heads: int = 4
    layers: int = 2
    lr: float = 2e-3
    # full: 6 variants x 3 seeds of one task in about 80-90 minutes of the 2-core machine, from the
    # step times measured there (docs/which_attention.rst)
    steps: tuple[tuple[str, int], ...] = (("lm", 3000), ("listops", 400), ("pathfinder", 800),
                                          ("shapes", 1800))
    batch: tuple[tuple[str, int], ...] = (("lm", 8), ("listops", 16), ("pathfinder", 16), ("shapes", 32))
    lm_context: int = 256
    lm_bytes: int = 4_000_000
    listops_lengths: tuple[int, int] = (500, 2000)
    listops_depth: int = 10
    pathfinder_size: int = 32
    points: int = 256
    test: int = 512
    checkpoints: int = 6

    def of(self, field: str, task: str) -> int:
        return dict(getattr(self, field))[task]


SIZES = {
    "full": Size(),
    "small": Size(steps=(("lm", 600), ("listops", 300), ("pathfinder", 300), ("shapes", 200)),
                  listops_lengths=(100, 500), listops_depth=6, lm_bytes=1_000_000, points=128, test=256),
    "ci": Size(width=32, heads=2, layers=1, steps=(("lm", 30), ("listops", 30), ("pathfinder", 30), ("shapes", 30)),
               batch=(("lm", 4), ("listops", 8), ("pathfinder", 8), ("shapes", 8)), lm_context=32,
               lm_bytes=200_000, listops_lengths=(16, 48), listops_depth=3, pathfinder_size=16, points=32,
               test=32, checkpoints=3),
}


# ----------------------------------------------------------------------------------------- data
class Data:
    """Seeded batches of one task: ``batch(rng, n)`` -> ``(inputs, padding or None, targets)``."""

    def __init__(self, task: str, size: Size) -> None:
        self.task, self.size = task, size
        if task == "lm":
            self.train_text, self.val_text = char_lm.stdlib_text(size.lm_bytes)

    def batch(self, rng: np.random.Generator, n: int, split: str = "train"):
        size = self.size
        if self.task == "lm":
            text = self.train_text if split == "train" else self.val_text
            x, y = char_lm._windows(text, rng.integers(0, text.size - size.lm_context - 2, n), size.lm_context)
            return x, None, y
        if self.task == "listops":
            low, high = size.listops_lengths
            tokens, lengths, labels = listops(rng, n, min_length=low, max_length=high, max_depth=size.listops_depth)
            tokens = tokens[:, :lengths.max()]             # the batch's own longest, not max_length
            padding = np.arange(tokens.shape[1]) >= lengths[:, None]
            return torch.from_numpy(tokens), torch.from_numpy(padding), torch.from_numpy(labels)
        if self.task == "pathfinder":
            images, labels = pathfinder(rng, n, size=size.pathfinder_size)
            return torch.from_numpy(images.astype(np.int64)), None, torch.from_numpy(labels)
        clouds, padding, labels = attention_training.shapes_batch(rng, n, size.points)
        return clouds, padding, labels

    @property
    def vocab(self) -> int:
        return {"lm": char_lm.VOCAB, "listops": LISTOPS_VOCAB, "pathfinder": 256}.get(self.task, 0)

    @property
    def classes(self) -> int:
        return {"lm": char_lm.VOCAB, "listops": LISTOPS_CLASSES, "pathfinder": 2,
                "shapes": len(attention_training.SHAPES)}[self.task]

    @property
    def length(self) -> int:
        size = self.size
        return {"lm": size.lm_context, "listops": size.listops_lengths[1],
                "pathfinder": size.pathfinder_size ** 2, "shapes": 0}[self.task]


# ---------------------------------------------------------------------------------------- model
class Model(nn.Module):
    """Embedding (+ learned positions), pre-LN encoder layers, LayerNorm, per-token or pooled read-out."""

    def __init__(self, variant: str, data: Data, size: Size) -> None:
        super().__init__()
        self.causal = data.task == "lm"
        self.embed = nn.Linear(3, size.width) if data.task == "shapes" else nn.Embedding(data.vocab, size.width)
        self.position = nn.Embedding(data.length, size.width) if data.length else None
        common = {"dim_feedforward": 4 * size.width, "dropout": 0.0, "batch_first": True, "norm_first": True}
        options = VARIANTS[variant]
        if options is None:
            self.layers = nn.ModuleList(nn.TransformerEncoderLayer(size.width, size.heads, **common)
                                        for _ in range(size.layers))
        else:
            options = {**options, "rope": data.length > 0}
            self.layers = nn.ModuleList(SlicedTransformerEncoderLayer(size.width, size.heads, **common, **options)
                                        for _ in range(size.layers))
        self.softmax = options is None
        self.norm = nn.LayerNorm(size.width)
        self.head = nn.Linear(size.width, data.classes)

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        h = self.embed(x)
        if self.position is not None:
            h = h + self.position(torch.arange(x.shape[1], device=x.device))
        mask = None
        if self.causal and self.softmax:
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=h.dtype)
        for layer in self.layers:
            # each layer gets the boolean padding mask itself (nn.TransformerEncoder would make it float)
            h = layer(h, src_mask=mask, src_key_padding_mask=padding, is_causal=self.causal)
        h = self.norm(h)
        if self.causal:
            return self.head(h)                                         # (N, L, vocab)
        keep = torch.ones(h.shape[:2], dtype=h.dtype) if padding is None else (~padding).to(h.dtype)
        return self.head((h * keep[..., None]).sum(1) / keep.sum(1, keepdim=True))


def cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def loss_of(model: Model, batch) -> torch.Tensor:
    x, padding, y = batch
    return cross_entropy(model(x, padding), y)


def evaluate(model: Model, test: list) -> float:
    """Bits per character (lm) or accuracy on the fixed test batches."""
    model.eval()
    total = count = 0.0
    with torch.no_grad():
        for batch in test:
            x, padding, y = batch
            logits = model(x, padding)
            if model.causal:
                total += float(cross_entropy(logits, y)) / math.log(2) * y.numel()
            else:
                total += float((logits.argmax(-1) == y).sum())
            count += y.numel()
    model.train()
    return total / count


def train(task: str, variant: str, size: Size, seed: int, data: Data) -> dict:
    """One model: its test metric, median seconds per training step and learning curve."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    test_rng = np.random.default_rng(10_000 + seed)          # the same test set for every variant
    batch = size.of("batch", task)
    test = [data.batch(test_rng, batch, "test") for _ in range(max(1, size.test // batch))]
    model = Model(variant, data, size)
    steps = size.of("steps", task)
    optimiser = torch.optim.AdamW(model.parameters(), lr=size.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=size.lr, total_steps=steps, pct_start=0.1)
    marks = set(np.linspace(0, steps, size.checkpoints + 1).astype(int)[1:].tolist())
    curve, times = [], []
    for step in range(1, steps + 1):
        batch_data = data.batch(rng, batch)
        start = time.perf_counter()
        loss = loss_of(model, batch_data)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        schedule.step()
        times.append(time.perf_counter() - start)
        if step in marks:
            curve.append((step, evaluate(model, test)))
    return {"metric": curve[-1][1], "step_seconds": statistics.median(times[len(times) // 10:] or times),
            "curve": curve}


# ---------------------------------------------------------------------------------------- table
def run(size: Size, tasks, variants, seeds, log=print, out: Path | None = None) -> dict:
    """``{task: {variant: [result per seed]}}``, written to ``out`` (JSON) after every model."""
    results: dict = {"size": asdict(size), "seeds": list(seeds), "tasks": {}}
    for task in tasks:
        data = Data(task, size)
        for seed in seeds:                              # seed-major: a cut-short run still compares
            for variant in variants:
                result = train(task, variant, size, seed, data)
                results["tasks"].setdefault(task, {}).setdefault(variant, []).append(result)
                log(f"  {task:10s} {variant:14s} seed {seed}: {metric_name(task)} {result['metric']:.3f}, "
                    f"{result['step_seconds'] * 1e3:.0f} ms/step")
                if out is not None:
                    out.write_text(json.dumps(results, indent=1))
    return results


def metric_name(task: str) -> str:
    return "bits/char" if task == "lm" else "accuracy"


def table(results: dict) -> str:
    """One row per task and variant: metric mean ± std over seeds, ms per step, steps."""
    lines = [f"{'task':10s} {'variant':14s} {'metric':10s} {'mean ± std':>16s} {'ms/step':>8s} {'seeds':>5s}"]
    for task, variants in results["tasks"].items():
        for variant, runs in variants.items():
            values = [r["metric"] for r in runs]
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            ms = statistics.median(r["step_seconds"] for r in runs) * 1e3
            lines.append(f"{task:10s} {variant:14s} {metric_name(task):10s} "
                         f"{statistics.mean(values):9.3f} ± {std:.3f} {ms:8.0f} {len(values):5d}")
    return "\n".join(lines)


def rst_table(results: dict) -> str:
    """The table as reStructuredText (the docs page): a row per variant, a column per task, each cell
    ``mean ± std`` of the metric and the median ms per step."""
    tasks = list(results["tasks"])
    variants = list(dict.fromkeys(v for task in tasks for v in results["tasks"][task]))
    header = ["variant"] + [f"{task} ({metric_name(task)})" for task in tasks]
    rows = []
    for variant in variants:
        row = [variant]
        for task in tasks:
            runs = results["tasks"][task].get(variant, [])
            values = [r["metric"] for r in runs]
            if not values:
                row.append("")
                continue
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            ms = statistics.median(r["step_seconds"] for r in runs) * 1e3
            row.append(f"{statistics.mean(values):.3f} ± {std:.3f}, {ms:.0f} ms")
        rows.append(row)
    return _rst(header, rows)


def _rst(header: list, rows: list) -> str:
    """A simple reStructuredText table."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    rule = "  ".join("=" * w for w in widths)
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([rule, line(header), rule, *map(line, rows), rule])


def curve_table(results: dict, task: str) -> str:
    """How the gap moves with training, as reStructuredText: a row per variant, a column per
    checkpoint, each cell the metric's mean over seeds and, for the sliced variants, its difference
    from softmax's at the same step (positive: softmax ahead in bits per character; negative:
    softmax ahead in accuracy)."""
    variants = results["tasks"][task]
    steps = [s for s, _ in next(iter(variants.values()))[0]["curve"]]
    means = {v: np.mean([[m for _, m in r["curve"]] for r in runs], axis=0) for v, runs in variants.items()}
    base = means.get("softmax")
    header = ["variant"] + [f"step {s}" for s in steps]
    rows = []
    for variant, mean in means.items():
        if base is None or variant == "softmax":
            cells = [f"{m:.3f}" for m in mean]
        else:
            cells = [f"{m:.3f} ({m - b:+.3f})" for m, b in zip(mean, base)]
        rows.append([variant] + cells)
    return _rst(header, rows)


def plot_curves(results: dict, path=None):
    """Learning curves: the metric against steps, mean over seeds, one panel per task."""
    import matplotlib.pyplot as plt

    tasks = list(results["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for variant, runs in results["tasks"][task].items():
            steps = [s for s, _ in runs[0]["curve"]]
            mean = np.mean([[v for _, v in r["curve"]] for r in runs], axis=0)
            ax.plot(steps, mean, marker="o", markersize=3, label=variant,
                    linestyle="--" if variant == "softmax" else "-")
        ax.set_title(task)
        ax.set_xlabel("training step")
        ax.set_ylabel(metric_name(task))
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="ci")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated, of " + ", ".join(TASKS))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, help="override the steps of every task")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads")
    parser.add_argument("--context", type=int, help="override the language model's context (tokens)")
    parser.add_argument("--out", type=Path, help="JSON results, rewritten after every model")
    parser.add_argument("--plot", type=Path, help="learning curves (PNG)")
    parser.add_argument("--report", nargs="+", type=Path, metavar="JSON",
                        help="print the tables of earlier runs (their --out files) and exit")
    args = parser.parse_args(argv)
    if args.report:
        merged = {"tasks": {}}
        for path in args.report:
            merged["tasks"].update(json.loads(path.read_text())["tasks"])
        print(table(merged), rst_table(merged), sep="\n\n")
        for task in merged["tasks"]:
            print(f"\n{task}, the metric at each checkpoint (difference from softmax):\n{curve_table(merged, task)}")
        if args.plot:
            plot_curves(merged, args.plot)
        return
    tasks, variants = args.tasks.split(","), args.variants.split(",")
    for name, chosen, known in (("--tasks", tasks, TASKS), ("--variants", variants, VARIANTS)):
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            parser.error(f"{name}: unknown {unknown}; choose from {', '.join(known)}")
    size = SIZES[args.size]
    if args.steps:
        size = replace(size, steps=tuple((task, args.steps) for task, _ in size.steps))
    if args.context:
        size = replace(size, lm_context=args.context)
    if args.threads:
        torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"size {args.size}, seeds {seeds}, torch threads {torch.get_num_threads()}")
    results = run(size, tasks, variants, seeds, out=args.out)
    print(table(results))
    if args.plot:
        plot_curves(results, args.plot)


if __name__ == "__main__":
    main()
