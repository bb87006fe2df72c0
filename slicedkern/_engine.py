"""Engine selection: the array-API sort-scan, or the fused CPU sort-sweep.

Both compute the same forward and backward. ``"auto"`` picks the sweep for NumPy arrays and CPU
torch tensors when numba is installed, and the scan everywhere else (GPUs, JAX, other
namespaces). :func:`use_engine` overrides the choice for a block of code; :func:`engine_for`
says which engine a given array would get.
"""

from __future__ import annotations

import contextlib
import importlib.util

import array_api_compat as compat

__all__ = ["ENGINES", "use_engine", "engine_for", "sweep_available"]

ENGINES = ("auto", "scan", "sweep")
# A plain list (a stack of choices), not a ContextVar: torch.compile cannot trace ContextVar.get.
_choice: list = ["auto"]


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
    _choice.append(name)
    try:
        yield
    finally:
        _choice.pop()


def _sweep_serves(array) -> bool:
    if compat.is_numpy_array(array):
        return True
    if compat.is_torch_array(array):
        import torch
        # Compiled and functorch-transformed graphs need traceable torch ops: the scan.
        return (array.device.type == "cpu" and not torch.compiler.is_compiling()
                and not torch._C._functorch.is_functorch_wrapped_tensor(array))
    return False


def engine_for(array) -> str:
    """The engine a call on ``array`` runs with now: "scan" or "sweep"."""
    choice = _choice[-1]
    if choice == "scan":
        return "scan"
    serves = _sweep_serves(array)
    if choice == "sweep":
        if not serves:
            raise ValueError(f"the 'sweep' engine runs on NumPy arrays and CPU torch tensors, not "
                             f"{type(array).__module__}.{type(array).__name__}")
        return "sweep"
    return "sweep" if serves and sweep_available() else "scan"
