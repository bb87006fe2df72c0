"""slicedkern: sliced-kernel primitives by sort-and-scan, on every array-API backend.

Sums ``sum_j f(q_i - k_j) v_j`` with a piecewise-linear ``f`` (ReLU, ``|r|``, hats, mixtures of hats)
are computed in ``O(n log n)`` from one sort of the keys and prefix sums, instead of ``O(n^2)``.
Works unchanged on NumPy, PyTorch, JAX, CuPy and any array-API namespace; importing it imports none
of the frameworks.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from . import kernels, reference
from .adapters.vjp import vjp
from .engines import engine_for, use_engine
from .ops import (
    DecodeCache,
    hat_attention,
    hat_mixture_attention,
    kernel_attention,
    kernel_sum,
    relu_attention,
    segment_ids_from_cu_seqlens,
)
from .sliced import directions, energy_distance, mmd, radial_profile, sliced_attention, sliced_kernel_sum

try:                                   # one source of truth: the version in pyproject.toml
    __version__ = _version("slicedkern")
except PackageNotFoundError:           # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["DecodeCache", "kernels", "reference", "kernel_sum", "relu_attention", "hat_attention",
           "hat_mixture_attention", "kernel_attention", "vjp", "use_engine", "engine_for",
           "directions", "sliced_kernel_sum", "sliced_attention", "energy_distance", "mmd",
           "radial_profile", "segment_ids_from_cu_seqlens",
           "__version__"]
