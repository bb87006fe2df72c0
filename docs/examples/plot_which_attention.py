"""
Which attention for which task, at the smoke size
=================================================

The table of :doc:`/which_attention` comes from one script in the repository,
``scripts/which_attention.py``: four tasks (a character-level causal language model, LRA's ListOps,
a Pathfinder-style task and point-cloud shapes), six attentions (softmax and five sliced
variants, among them ``slices=4``) in the same model with the same budget, three seeds per cell.
This page runs that script at its ``ci`` size, the size CI builds these pages with.

.. note::

   **This is a smoke size**: width 32, one layer, 30 training steps, sequences of 16 to 256 tokens.
   It checks that every task and variant trains and reports; its numbers rank nothing (30 steps
   leave every model near chance, and at these lengths a sort-and-scan call costs more than
   softmax). The measured table, at the ``small`` and ``full`` sizes, is on
   :doc:`/which_attention`.
"""

import importlib.util
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)        # the same threads for every variant on a shared machine

# The script lives in the repository's scripts/ folder, two levels above this page's source.
try:
    here = Path(__file__).resolve().parent
except NameError:               # sphinx-gallery runs an example from its own folder
    here = Path.cwd()
path = here.parents[1] / "scripts" / "which_attention.py"
spec = importlib.util.spec_from_file_location("which_attention", path)
which_attention = importlib.util.module_from_spec(spec)
sys.modules["which_attention"] = which_attention
spec.loader.exec_module(which_attention)

# %%
# Train every (task, variant, seed) at the ``ci`` size
# ----------------------------------------------------
# The metric is bits per character for the language model (lower is better) and test accuracy
# for the three classifiers; ``ms/step`` is the median time of a training step (forward, backward
# and AdamW).

size = which_attention.SIZES["ci"]
results = which_attention.run(size, which_attention.TASKS, list(which_attention.VARIANTS), seeds=[0, 1, 2])
print(which_attention.table(results))

# %%
# Learning curves
# ---------------
# The metric on the fixed test batches during training, mean over the seeds.

fig = which_attention.plot_curves(results)
