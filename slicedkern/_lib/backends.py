"""The one list of array backends, shared by the tests, ``python -m slicedkern bench`` and asv.

Each member names an array library on a kind of device. Nothing here imports a framework: a member
says how to find its library (:attr:`Backend.module`) and whether it needs a GPU; callers import it.
"""

from __future__ import annotations

import enum
import importlib.util

__all__ = ["Backend"]


class Backend(enum.Enum):
    """An array library on a device kind, in the order the tests and the bench list them."""

    NUMPY = "numpy"
    ARRAY_API_STRICT = "array_api_strict"
    TORCH = "torch"
    JAX = "jax"
    CUPY = "cupy"
    TORCH_CUDA = "torch_cuda"

    @property
    def module(self) -> str:
        """The importable name of the library."""
        return {"torch_cuda": "torch"}.get(self.value, self.value)

    @property
    def needs_gpu(self) -> bool:
        return self in (Backend.CUPY, Backend.TORCH_CUDA)

    @property
    def library(self) -> str:
        """The library as the engine registry names it (``"torch"`` for both torch devices)."""
        return self.module

    def installed(self) -> bool:
        """Whether the library can be imported here (a GPU backend may still find no GPU)."""
        return importlib.util.find_spec(self.module) is not None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)
