"""A character-level causal language model with softmax, sliced ReLU or sliced hat attention (issue 25).

The text ships with every Python: the source files of the standard library
(``sysconfig.get_paths()["stdlib"]``, the ``*.py`` files at its top level), split by file: every
tenth file (sorted by name) is validation text, the others training text, so that validation
measures text the model never saw. Characters are bytes clipped to 7 bits (128 symbols).

The model is a small GPT: a character embedding plus a learned position embedding, pre-LayerNorm
encoder layers with a causal mask, a final LayerNorm and a linear read-out. The three models differ
only in the class of their layers: ``torch.nn.TransformerEncoderLayer`` (softmax,
``nn.MultiheadAttention``) or :class:`slicedkern.nn.torch.SlicedTransformerEncoderLayer` with
``kernel="relu"`` or ``kernel="hat"`` (and ``rope=True``); same width, depth, optimiser, learning
rate, batches and steps.

Reported per model: validation bits per character (mean cross-entropy / ln 2 on fixed validation
windows) and the time of a training step (forward, backward, AdamW; median of the timed steps).
For scale, the same validation characters are scored by count n-gram models of orders 1 to 3 (0 to
2 characters of context, add-0.1 smoothing) fit on the training text.
Then each sliced model generates from a validation prompt with its layers' caches
(``init_cache`` / ``cache=``), one character at a time, and the script checks in float64 that the
characters and logits of the cached generation equal those of full causal recomputation over the
whole text so far.

Run from the repository root::

    PYTHONPATH=. python scripts/char_lm.py --size ci        # a few minutes on CPU (the size of the gallery example)
    PYTHONPATH=. python scripts/char_lm.py --size full --seeds 0,1,2 --context 256
    PYTHONPATH=. python scripts/char_lm.py --size full --seeds 0,1,2 --context 2048
    PYTHONPATH=. python scripts/char_lm.py --size full --context 2048 --steps 60 --models relu --compile
"""

from __future__ import annotations

import argparse
import math
import statistics
import sysconfig
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from slicedkern.nn.torch import SlicedTransformerEncoderLayer

VOCAB = 128
MODELS = ("softmax", "relu", "hat")


@dataclass(frozen=True)
class Size:
    width: int = 64
    heads: int = 4
    layers: int = 2
    batch: int = 8
    context: int = 256
    steps: int = 3000
    lr: float = 3e-3
    val_windows: int = 64
    max_bytes: int = 4_000_000          # of training text read (the validation text is a tenth of it)
    generate: int = 64


SIZES = {
    "ci": Size(width=32, context=64, steps=150, val_windows=16, max_bytes=400_000, generate=24),
    "medium": Size(steps=600, val_windows=32),
    "full": Size(),
}


def stdlib_text(max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) arrays of the standard library's top-level ``*.py`` files, split by file: about
    ``max_bytes`` characters of training text and a tenth of that of validation text."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if not files:
        raise RuntimeError("no *.py file in the standard library directory: this Python ships no sources")
    train, val, sizes = [], [], [0, 0]
    for index, path in enumerate(files):
        held_out = index % 10 == 0
        if sizes[held_out] >= (max_bytes // 10 if held_out else max_bytes):
            if sizes[0] >= max_bytes:
                break
            continue
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        (val if held_out else train).append(data)
        sizes[held_out] += data.size
    def join(parts):
        return np.minimum(np.concatenate(parts), VOCAB - 1).astype(np.int64)
    return join(train), join(val)


class CharLM(nn.Module):
    """Character embedding + learned positions, pre-LN causal encoder layers, LayerNorm, read-out."""

    def __init__(self, attention: str, size: Size) -> None:
        super().__init__()
        self.attention = attention
        self.embed = nn.Embedding(VOCAB, size.width)
        self.position = nn.Embedding(size.context, size.width)
        kw = dict(dim_feedforward=4 * size.width, dropout=0.0, batch_first=True, norm_first=True)
        if attention == "softmax":
            self.layers = nn.ModuleList(nn.TransformerEncoderLayer(size.width, size.heads, **kw)
                                        for _ in range(size.layers))
        else:
            self.layers = nn.ModuleList(SlicedTransformerEncoderLayer(size.width, size.heads, kernel=attention,
                                                                      rope=True, **kw)
                                        for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.width)
        self.out = nn.Linear(size.width, VOCAB)

    def forward(self, tokens: torch.Tensor, *, offset: int = 0, caches=None) -> torch.Tensor:
        """Logits (N, L, VOCAB) of tokens (N, L) at positions ``offset...``; ``caches`` (one per layer,
        sliced models only): generation, ``tokens`` being the new ones."""
        length = tokens.shape[1]
        positions = torch.arange(offset, offset + length, device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for i, layer in enumerate(self.layers):
            if self.attention == "softmax":
                mask = nn.Transformer.generate_square_subsequent_mask(length, device=x.device, dtype=x.dtype)
                x = layer(x, src_mask=mask, is_causal=True)
            else:
                x = layer(x, is_causal=True, cache=None if caches is None else caches[i])
        return self.out(self.norm(x))


def _windows(text: np.ndarray, starts: np.ndarray, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + np.arange(context + 1)
    chunk = torch.from_numpy(text[idx])
    return chunk[:, :-1], chunk[:, 1:]


def _val_starts(val: np.ndarray, size: Size) -> np.ndarray:
    return np.linspace(0, val.size - size.context - 2, size.val_windows).astype(np.int64)


def bits_per_char(model: CharLM, val: np.ndarray, size: Size) -> float:
    starts = _val_starts(val, size)
    model.eval()
    with torch.no_grad():
        x, y = _windows(val, starts, size.context)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    model.train()
    return float(loss) / math.log(2)


def ngram_bits(train_text: np.ndarray, val: np.ndarray, size: Size, order: int, alpha: float = 0.1) -> float:
    """Bits per character of a count n-gram model (``order - 1`` characters of context, add-``alpha``
    smoothing) fit on the training text, on the characters :func:`bits_per_char` scores: a scale for
    the models' numbers, and a check that two sizes' validation windows are equally hard."""
    def codes(text, ends):
        # the n-gram ending at each position as one integer in base VOCAB (order <= 8 fits int64)
        code = np.zeros(ends.shape, dtype=np.int64)
        for back in range(order - 1, -1, -1):
            code = code * VOCAB + text[ends - back]
        return code
    seen = codes(train_text, np.arange(order - 1, train_text.size))
    grams, gram_counts = np.unique(seen, return_counts=True)
    contexts, context_counts = np.unique(seen // VOCAB, return_counts=True)

    def lookup(keys, table, counts):
        at = np.minimum(np.searchsorted(table, keys), table.size - 1)
        return np.where(table[at] == keys, counts[at], 0)
    ends = (_val_starts(val, size)[:, None] + 1 + np.arange(size.context)).ravel()
    ends = ends[ends >= order - 1]
    gram = codes(val, ends)
    p = (lookup(gram, grams, gram_counts) + alpha) / (lookup(gram // VOCAB, contexts, context_counts) + alpha * VOCAB)
    return float(-np.log2(p).mean())


def train(attention: str, size: Size, seed: int, train_text: np.ndarray, val_text: np.ndarray, *,
          compile: bool = False) -> dict:
    """Train one model; with ``compile`` its training forward (and so backward) under
    ``torch.compile`` (the first tenth of the steps, the compile among them, is not timed)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = CharLM(attention, size)
    forward = torch.compile(model) if compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=size.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=size.lr, total_steps=size.steps, pct_start=0.1)
    times = []
    for _ in range(size.steps):
        x, y = _windows(train_text, rng.integers(0, train_text.size - size.context - 2, size.batch), size.context)
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(forward(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
        times.append(time.perf_counter() - start)
    timed = times[len(times) // 10:] or times
    return {"model": model, "bpc": bits_per_char(model, val_text, size), "step": statistics.median(timed)}


def generate_and_check(model: CharLM, prompt: np.ndarray, steps: int) -> dict:
    """Greedy generation with the layers' caches, checked in float64 against full recomputation.

    Returns the text, and the largest difference between the cached logits of each generated
    character and the logits of the full causal forward at its position (float64)."""
    model = model.double().eval()
    caches = [layer.init_cache() for layer in model.layers]
    tokens = torch.from_numpy(prompt)[None]
    with torch.no_grad():
        logits = model(tokens, caches=caches)[:, -1]
        out = tokens
        cached_logits = []
        for _ in range(steps):
            nxt = logits.argmax(-1, keepdim=True)
            cached_logits.append(logits)
            offset = out.shape[1]
            out = torch.cat([out, nxt], dim=1)
            if out.shape[1] >= model.position.num_embeddings:
                break
            logits = model(nxt, offset=offset, caches=caches)[:, -1]
        full = model(out[:, :-1])[:, prompt.size - 1:]
        cached = torch.stack(cached_logits, dim=1)
        diff = float((full[:, :cached.shape[1]] - cached).abs().max())
        same = bool(torch.equal(full[:, :cached.shape[1]].argmax(-1), cached.argmax(-1)))
    text = bytes(out[0].tolist()).decode("ascii", errors="replace")
    return {"text": text, "max_logit_difference": diff, "same_tokens": same}


def run(size: Size, seeds: list[int], models=MODELS, log=print, *, compile: bool = False) -> dict:
    train_text, val_text = stdlib_text(size.max_bytes)
    log(f"standard library text: {train_text.size} training and {val_text.size} validation characters; "
        f"width {size.width}, {size.heads} heads, {size.layers} layers, batch {size.batch}, context "
        f"{size.context}, {size.steps} steps, torch {torch.__version__}, {torch.get_num_threads()} threads"
        + (", torch.compile" if compile else ""))
    baselines = ", ".join(f"{order}-gram {ngram_bits(train_text, val_text, size, order):.3f}" for order in (1, 2, 3))
    log(f"count n-gram models fit on the training text, on the same validation characters: {baselines} bits/char")
    results = {name: [] for name in models}
    for seed in seeds:
        for name in models:
            r = train(name, size, seed, train_text, val_text, compile=compile)
            log(f"  seed {seed} {name:<8} validation {r['bpc']:.3f} bits/char, step {1e3 * r['step']:.1f} ms")
            results[name].append(r)
    prompt = val_text[: min(32, size.context // 2)]
    for name in models:
        if name == "softmax":
            continue
        check = generate_and_check(results[name][0]["model"], prompt, size.generate)
        log(f"  {name} generation with the cache: cached == full recomputation: {check['same_tokens']}, "
            f"max |logit difference| {check['max_logit_difference']:.1e} (float64); {check['text']!r}")
        results[name][0]["generation"] = check
    return results


def table(results: dict) -> str:
    def stat(values, fmt):
        if len(values) == 1:
            return fmt.format(values[0])
        return f"{fmt.format(statistics.mean(values))} ± {fmt.format(statistics.stdev(values))}"
    rows = [f"{'model':<10} {'validation bits/char':>22} {'step (ms)':>14}"]
    for name, runs in results.items():
        rows.append(f"{name:<10} {stat([r['bpc'] for r in runs], '{:.3f}'):>22} "
                    f"{stat([1e3 * r['step'] for r in runs], '{:.1f}'):>14}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="ci")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--context", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="train under torch.compile")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    size = SIZES[args.size]
    if args.context:
        size = replace(size, context=args.context)
    if args.steps:
        size = replace(size, steps=args.steps)
    results = run(size, [int(s) for s in args.seeds.split(",")], models=args.models.split(","),
                  compile=args.compile)
    print(table(results))


if __name__ == "__main__":
    main()
