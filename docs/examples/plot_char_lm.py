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

The code (data, model, training, generation) lives in ``scripts/char_lm.py``, which also produces
the larger tables of the documentation. Here it runs at the ``ci`` size (width 32, context 64, 150
steps: about a minute); ``SLICEDKERN_EXAMPLE_SIZE=medium`` (or ``full``) runs the larger ones. At
this size the models have barely started to learn, and the sliced layers' steps cost more than
softmax's: at a context of 64 the per-call overhead of the sort-and-scan dominates (see
``docs/benchmarks.rst`` for the table at contexts 256 and 2048).
"""

import os
import sys
from pathlib import Path

import torch

# The shared code sits in scripts/ of the repository (the gallery runs from docs/examples/).
try:
    _here = Path(__file__).resolve().parent
except NameError:                            # executed without a file name
    _here = Path.cwd()
sys.path.insert(0, str(_here.parents[1] / "scripts"))
import char_lm  # noqa: E402

torch.set_num_threads(1)
SIZE = char_lm.SIZES[os.environ.get("SLICEDKERN_EXAMPLE_SIZE", "ci")]
SEEDS = [0] if SIZE is char_lm.SIZES["ci"] else [0, 1, 2]

# %%
# Train the three models, then generate with the cache
# -----------------------------------------------------
# Fresh training windows at every step (seeded), the same optimiser and schedule for all three.
results = char_lm.run(SIZE, SEEDS)

# %%
# Validation bits per character and step time
# --------------------------------------------
print(char_lm.table(results))

# %%
# The cached generation equals full recomputation
# -----------------------------------------------
# One token at a time, each layer's cache holds the keys and values seen so far; the logits of
# every generated character equal those of the full causal forward (float64).
for name in ("relu", "hat"):
    check = results[name][0]["generation"]
    assert check["same_tokens"] and check["max_logit_difference"] < 1e-9, check
    print(f"{name}: {check['text']!r}")
