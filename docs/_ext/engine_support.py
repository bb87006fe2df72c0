"""Render the engine support table of ``docs/backends.rst`` from the engines' own answers.

:func:`slicedkern.engines.support.support` asks every engine's ``decline`` about one array of each
case below that this machine can make (a library that is not installed is left out, and said so);
:func:`write` turns the answers into ``docs/generated/engine_support.inc``, which the page includes.
Run at every build by ``docs/conf.py``.
"""

from __future__ import annotations

import importlib.util
import os

from slicedkern.engines import ENGINE_NAMES
from slicedkern.engines.support import FEATURES, support

__all__ = ["cases", "render", "write"]


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def cases() -> tuple[dict, list]:
    """``(cases, missing)``: an array (or a tracing context) per case, and the libraries not installed."""
    import numpy as np

    found, missing = {"NumPy": np.zeros(4)}, []
    if _installed("array_api_strict"):
        import array_api_strict
        found["array_api_strict"] = array_api_strict.zeros(4)
    else:
        missing.append("array_api_strict")
    if _installed("torch"):
        import torch
        found["torch, CPU"] = torch.zeros(4)

        def under_func(ask):
            torch.func.grad(lambda x: ask(x).sum())(torch.zeros(4))
        found["torch, CPU, under torch.func"] = under_func
    else:
        missing.append("torch")
    if _installed("jax"):
        import jax
        import jax.numpy as jnp
        found["JAX, CPU"] = jnp.zeros(4)

        def under_jit(ask):
            jax.jit(lambda x: ask(x) * 1.0)(jnp.zeros(4))
        found["JAX, CPU, under jax.jit"] = under_jit
    else:
        missing.append("jax")
    return found, missing


def render(table: dict, missing: list) -> str:
    """The table as a reStructuredText list table, the reasons as numbered notes below it."""
    notes: list[str] = []

    def cell(answers: dict) -> str:
        parts = []
        for feature in FEATURES:
            reason = answers[feature]
            if reason is None:
                parts.append(f"{feature}: yes")
                continue
            if reason not in notes:
                notes.append(reason)
            parts.append(f"{feature}: no [{notes.index(reason) + 1}]")
        return ", ".join(parts)

    lines = [".. list-table::", "   :header-rows: 1", "   :stub-columns: 1", "",
             "   * - arrays", *(f"     - ``{name}``" for name in ENGINE_NAMES)]
    for label, answers in table.items():
        lines.append(f"   * - {label}")
        lines += [f"     - {cell(answers[name])}" for name in ENGINE_NAMES]
    lines += ["", "Why an engine declines (its ``decline`` reason, verbatim):", ""]
    lines += [f"{i}. {reason}" for i, reason in enumerate(notes, start=1)]
    if missing:
        lines += ["", f"Not installed where these pages were built, so not probed: {', '.join(missing)}."]
    return "\n".join(lines) + "\n"


def write(path: str) -> None:
    found, missing = cases()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = render(support(found), missing)
    with open(path, "w") as f:
        f.write(text)
