"""
A character-level language model, trained and then generating with the cache
==============================================================================

A small GPT trained on text that ships with every Python, the source files of the standard
library (split by file: validation text is text the model never saw), three ways: softmax attention
(``nn.TransformerEncoderLayer``), sliced ReLU attention and sliced hat attention
(:class:`slicedkern.nn.torch.SlicedTransformerEncoderLayer`, ``rope=True``); same width, depth,
optimiser, batches and steps. Each model reports its validation bits per character and the time of
a training step; then each sliced model generates greedily, one character at a time, through its
layers' caches (``init_cache()`` and ``cache=``), and the characters and logits are checked, in
float64, against full causal recomputation over the whole text so far.

The data, the model, the training loop and the generation are all on this page.

.. note::

   **This is a smoke size** (width 32, context 64, 150 steps, one seed: about a minute on a CPU).
   The models have barely started to learn, so the bits per character do not rank the attentions,
   and at a context of 64 the sort-and-scan's fixed cost per call makes a sliced step slower than
   a softmax one. :ref:`The benchmarks <bench-causal>` have the measured comparison (3000 steps at
   context 256, and step times at context 2048, where a sliced step is 2 to 2.6x faster), made
   with ``scripts/char_lm.py`` in the repository, which runs the same model at larger sizes.
"""

import math
import statistics
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from slicedkern.nn.torch import SlicedTransformerEncoderLayer

torch.set_num_threads(1)        # stable timings on a shared machine

# The smoke size of this page.
WIDTH, HEADS, LAYERS, BATCH, CONTEXT, STEPS = 32, 4, 2, 8, 64, 150
VAL_WINDOWS, MAX_BYTES, GENERATE, SEED = 16, 400_000, 24, 0
VOCAB = 128                     # bytes clipped to 7 bits
MODELS = ("softmax", "relu", "hat")

# %%
# The text: the standard library's sources, split by file
# -------------------------------------------------------
# Every tenth file (sorted by name) is validation text, the others training text.


def stdlib_text(max_bytes):
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if not files:
        raise RuntimeError("this Python ships no standard library sources")
    parts, sizes = ([], []), [0, 0]
    for index, path in enumerate(files):
        held_out = index % 10 == 0
        if sizes[held_out] >= (max_bytes // 10 if held_out else max_bytes):
            if sizes[0] >= max_bytes:
                break
            continue
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        parts[held_out].append(data)
        sizes[held_out] += data.size
    return [np.minimum(np.concatenate(p), VOCAB - 1).astype(np.int64) for p in parts]


train_text, val_text = stdlib_text(MAX_BYTES)
print(f"{train_text.size} training and {val_text.size} validation characters")

# %%
# The model
# ---------
# A character embedding plus a learned position embedding, pre-LayerNorm encoder layers with a
# causal mask, a final LayerNorm and a linear read-out. Only the class of the layers changes. The
# sliced layers take ``cache=``: given the new tokens only, they return what the full causal
# forward would return at those positions.


class CharLM(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.attention = attention
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Embedding(CONTEXT, WIDTH)
        kw = dict(dim_feedforward=4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
        if attention == "softmax":
            layers = [nn.TransformerEncoderLayer(WIDTH, HEADS, **kw) for _ in range(LAYERS)]
        else:
            layers = [SlicedTransformerEncoderLayer(WIDTH, HEADS, kernel=attention,
                                                    rope=True, **kw)
                      for _ in range(LAYERS)]
        self.layers = nn.ModuleList(layers)
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens, offset=0, caches=None):
        """Logits (N, L, VOCAB) of ``tokens`` (N, L) at positions ``offset, ...``; with
        ``caches`` (one per layer), ``tokens`` are the new ones only."""
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position(torch.arange(offset, offset + length))
        for i, layer in enumerate(self.layers):
            if self.attention == "softmax":
                mask = nn.Transformer.generate_square_subsequent_mask(length, dtype=x.dtype)
                x = layer(x, src_mask=mask, is_causal=True)
            else:
                x = layer(x, is_causal=True, cache=None if caches is None else caches[i])
        return self.out(self.norm(x))


# %%
# Training and validation
# -----------------------
# Random windows of the training text at every step (seeded), AdamW with a one-cycle schedule;
# the step time is the median of the steps after the first tenth.


def windows(text, starts):
    chunk = torch.from_numpy(text[starts[:, None] + np.arange(CONTEXT + 1)])
    return chunk[:, :-1], chunk[:, 1:]


def bits_per_char(model):
    starts = np.linspace(0, val_text.size - CONTEXT - 2, VAL_WINDOWS).astype(np.int64)
    x, y = windows(val_text, starts)
    model.eval()
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    return float(loss) / math.log(2)


def train(attention):
    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    model = CharLM(attention)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=STEPS,
                                                   pct_start=0.1)
    times = []
    for _ in range(STEPS):
        x, y = windows(train_text, rng.integers(0, train_text.size - CONTEXT - 2, BATCH))
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
        times.append(time.perf_counter() - start)
    return model, bits_per_char(model), statistics.median(times[STEPS // 10:])


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


trained = {name: train(name) for name in MODELS}
Table(["attention", "validation bits / char", "training step (ms)"],
      [[name, f"{bpc:.3f}", f"{1e3 * step:.1f}"]
       for name, (_, bpc, step) in trained.items()])

# %%
# Generation with the cache equals full recomputation
# ---------------------------------------------------
# Greedy generation from a validation prompt, one character at a time: each layer's cache
# (``layer.init_cache()``) holds the keys and values seen so far, and the model sees only the
# new character. In float64, the logits of every generated character are compared with those of
# the full causal forward over the whole text at the same position.


def generate_and_check(model, prompt, steps):
    model = model.double().eval()
    caches = [layer.init_cache() for layer in model.layers]
    out = torch.from_numpy(prompt)[None]
    cached = []
    with torch.no_grad():
        logits = model(out, caches=caches)[:, -1]
        for _ in range(steps):
            cached.append(logits)
            nxt = logits.argmax(-1, keepdim=True)
            offset = out.shape[1]
            out = torch.cat([out, nxt], dim=1)
            if out.shape[1] >= CONTEXT:
                break
            logits = model(nxt, offset=offset, caches=caches)[:, -1]
        full = model(out[:, :-1])[:, prompt.size - 1:][:, :len(cached)]
        cached = torch.stack(cached, dim=1)
    text = bytes(out[0].tolist()).decode("ascii", errors="replace")
    same = bool(torch.equal(full.argmax(-1), cached.argmax(-1)))
    return text, same, float((full - cached).abs().max())


prompt = val_text[:min(32, CONTEXT // 2)]
for name in ("relu", "hat"):
    text, same, difference = generate_and_check(trained[name][0], prompt, GENERATE)
    assert same and difference < 1e-9, (name, same, difference)
    print(f"{name}: same characters as full recomputation, logits within {difference:.1e}")
    print(f"    {text!r}")
