"""Which engine serves which arrays, asked of the engines themselves (their ``decline`` reasons).

:func:`support` probes every registered engine with one array per case (a backend, a device, a
tracing context) and two specs (attention, and causal attention): the answer is ``None`` where the
engine serves the call (forward and backward: the backward runs on the forward's engine) or the
reason it declines. ``docs/backends.rst`` renders the table from it at build time, so the
documentation cannot drift from the code (SciPy renders its array-API capabilities the same way).
"""

from __future__ import annotations

from .._spec import AttentionSpec, Normalizer
from ..backends import backend_of
from ..kernels import ReLU
from . import ENGINE_NAMES, get

__all__ = ["FEATURES", "support"]

#: The calls each engine is asked about: attention (``relu_attention``'s spec) and its causal mode.
FEATURES = {
    "attention": AttentionSpec(kernel=ReLU(), center=True, normalizer=Normalizer("abs")),
    "causal": AttentionSpec(kernel=ReLU(), center=True, normalizer=Normalizer("abs"), causal=True),
}


def support(cases: dict) -> dict:
    """``{case: {engine name: {feature: reason or None}}}`` for ``cases`` (label -> an array, or a
    callable that calls its argument inside a context, such as a ``jax.jit`` trace, with an array).

    Examples
    --------
    >>> import numpy as np
    >>> table = support({"NumPy": np.zeros(3)})
    >>> table["NumPy"]["scan"]
    {'attention': None, 'causal': None}
    """
    table = {}
    for label, case in cases.items():
        answers: dict = {}

        def ask(a, answers=answers):
            for name in ENGINE_NAMES:
                engine = get(name)
                answers[name] = {feature: engine.decline(spec, (a,), backend_of(a))
                                 for feature, spec in FEATURES.items()}
            return a

        if callable(case):
            case(ask)
        else:
            ask(case)
        table[label] = answers
    return table
