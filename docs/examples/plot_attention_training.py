"""
Training a transformer with sliced attention
============================================

:class:`slicedkern.nn.torch.SlicedTransformerEncoderLayer` takes the arguments of
``torch.nn.TransformerEncoderLayer``: a model switches from softmax to sliced attention by
changing one class name. This example trains the same small transformer three ways, with softmax
attention (``nn.MultiheadAttention``), sliced ReLU attention and sliced hat attention, on two
synthetic tasks generated on the fly:

* **shapes**: classify point clouds of 8 shapes (sphere, cube, cylinder, cone, torus, dumbbell,
  rocket, snowman) sampled on their surfaces, randomly rotated, anisotropically scaled, noisy, with
  up to half of the points dropped (dropped points are padding: ``src_key_padding_mask``). The model
  is point-wise: a linear embedding of each point, encoder layers, a masked mean pool;
* **recall**: among ``L`` filler tokens a few key-value tokens are hidden; the last token names a
  key and the model must answer its value.

The code (data, model, training loop) lives in ``scripts/attention_training.py``, which also
produces the full table of the documentation (3 seeds, mean ± std, and time per training step at
``L`` = 1K, 4K, 16K). Here it runs at a size that builds in about a minute; set the environment
variable ``SLICEDKERN_EXAMPLE_SIZE=medium`` (or ``full``) for the larger runs.

Measured at the ``medium`` size (width 32, 4 heads, 2 pre-LN layers, 150 AdamW steps, the same
hyperparameters for all three; seeds 0, 1, 2; mean ± std), with
``PYTHONPATH=. python scripts/attention_training.py --size medium --timing-repeats 2 --threads 1``
on one thread of a 2-core machine shared with other jobs (the times are CPU-bound and noisy; the
accuracies are not):

=========================================  =============  =============  =============
measure                                    softmax        sliced ReLU    sliced hat
=========================================  =============  =============  =============
shapes accuracy (8 classes, chance 0.125)  0.357 ± 0.039  0.388 ± 0.026  0.385 ± 0.027
recall accuracy, L = 1024 (chance 0.125)   0.130 ± 0.025  0.107 ± 0.044  0.109 ± 0.041
recall training step, L = 1K               211 ms         163 ms         133 ms
recall training step, L = 4K               5.05 s         1.45 s         1.02 s
recall training step, L = 16K              107 s          4.02 s         3.16 s
=========================================  =============  =============  =============

The step times are one training step (forward, backward, AdamW) at batch 1, best of 2. On shapes
the sliced models are level with softmax (within one standard deviation); no model learned
recall at this size (all at chance). The cost of a step grows like ``L^2`` for softmax and like
``L log L`` for the sliced layers: at 16K the sliced step is 27× (ReLU) and 34× (hat) faster.
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
import attention_training as at  # noqa: E402

torch.set_num_threads(1)
SIZE = at.SIZES[os.environ.get("SLICEDKERN_EXAMPLE_SIZE", "ci")]
SEEDS = [0] if SIZE is at.SIZES["ci"] else [0, 1, 2]

# %%
# The one line that differs between the three models
# ----------------------------------------------------
# ``encoder_layer`` builds ``nn.TransformerEncoderLayer`` for softmax and
# ``SlicedTransformerEncoderLayer`` (same arguments, plus ``kernel=``) otherwise:
layer = at.encoder_layer("sliced-hat", SIZE)
print(layer.self_attn)

# %%
# Train and test
# --------------
# Fresh batches at every step (seeded), the same optimiser, learning rate and number of steps for
# every attention, then accuracy on a held-out set shared by all three.
accuracy, seconds = at.accuracy_table(["shapes", "recall"], at.ATTENTIONS, SEEDS, SIZE)

# %%
# Time per training step against sequence length
# -----------------------------------------------
# Softmax attention costs ``O(L^2)`` per step, sliced attention ``O(L log L)``.
lengths = [256, 1024] if SIZE is at.SIZES["ci"] else [1024, 4096, 16384]
timings = {(a, n): at.step_time(a, SIZE, n) for n in lengths for a in at.ATTENTIONS}
print(at.format_tables(accuracy, seconds, timings, at.ATTENTIONS))
at.plot_timings(timings, at.ATTENTIONS)
