"""Type aliases of the public signatures."""

from __future__ import annotations

from typing import Any

__all__ = ["Array", "Namespace", "ArrayOrFloat"]

#: An array of any array-API library (NumPy, torch, JAX, CuPy, ...): the standard has no common base
#: class, so annotations say "an array" and the functions check it.
Array = Any
#: An array-API namespace (``array_api_compat.array_namespace(x)``), or a library module.
Namespace = Any
#: A Python number or an array (bandwidths, mixture weights).
ArrayOrFloat = float | Any
