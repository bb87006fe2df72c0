"""``python -m slicedkern bench``: sliced attention vs softmax attention vs the dense reference.

A first look at what the sort-scan buys, on the backends installed here. For every sequence length
``L`` it times, on one backend and device:

* sliced ReLU attention (:func:`slicedkern.relu_attention`), forward and forward+backward, once per
  engine that can serve the arrays ("scan", and "sweep" where it is wired in and numba is present);
* hat attention (:func:`slicedkern.hat_attention`), forward, with the engine the library picks;
* softmax attention, ``torch.nn.functional.scaled_dot_product_attention``, forward (where torch is
  installed, whatever the backend);
* the dense ``O(L^2)`` reference (:func:`slicedkern.reference.relu_attention`), forward;

then prints a table of times, speed-ups and peak memory, and optionally a log-log plot.

The comparison is "same L, same D": sliced attention takes one projected score per token
(``q, k`` of shape ``(batch, L)``) and values ``(batch, L, D)``; SDPA gets its natural inputs,
``q, k, v`` of shape ``(batch, 1, L, D)`` (one head). Neither timing includes the projections that
produce the scores.

Everything framework-specific is imported inside the functions here: importing ``slicedkern`` (or
this package) imports none of torch, JAX, numba or matplotlib.

The package: :mod:`~slicedkern.bench.results` (what was measured, the tables and the plot),
:mod:`~slicedkern.bench.measure` (timing, memory probes, progress bar),
:mod:`~slicedkern.bench.backends` (inputs, synchronisation and gradients per array library),
:mod:`~slicedkern.bench.run` (the columns and the runner), :mod:`~slicedkern.bench.cli` (the
command line).
"""

from __future__ import annotations

import re

from .cli import add_arguments, main
from .results import BenchResult, Column, Memory, Timing, plot
from .run import DEFAULT_SIZES, run_bench

__all__ = ["DEFAULT_SIZES", "BenchResult", "Column", "Timing", "Memory", "description",
           "add_arguments", "run_bench", "plot", "main"]


def description() -> str:
    """The description of ``python -m slicedkern bench --help``: this package's docstring, in part.

    Returns
    -------
    str
        The paragraphs after the title and before the implementation notes, as plain text.
    """
    body = __doc__.split("\n\n", 1)[1].split("\n\nEverything framework-specific", 1)[0]
    return re.sub(r":\w+:`([^`]*)`", r"\1", body).replace("``", "").strip()   # plain text
