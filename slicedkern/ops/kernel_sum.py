"""``kernel_sum``: the 1-D sort-scan kernel sum, validated and dispatched."""

from __future__ import annotations

from .._lib.namespace import as_work, shape_str
from .._lib.typing import Array, Namespace
from .._spec import KernelSumSpec
from .._validate import broadcast_all, check_kernel, need_ndim, setup
from ..adapters import run
from ..engines import select
from ..kernels import PiecewiseLinear
from .attention import nan_rows_without_keys

__all__ = ["kernel_sum"]


def kernel_sum(x: Array, y: Array, w: Array, /, kernel: PiecewiseLinear, *, engine: str | None = None,
               xp: Namespace | None = None) -> Array:
    """Kernel sum ``S_i = sum_j f(x_i - y_j) w_j`` by sort-scan, in ``O((n M + m) log m)``.

    Parameters
    ----------
    x : array, shape (..., n)
        Queries.
    y : array, shape (..., m)
        Keys.
    w : array, shape (..., m) or (..., m, c)
        Weights: one scalar per key when ``w.ndim == y.ndim``, ``c`` columns otherwise.
    kernel : slicedkern.kernels.PiecewiseLinear
        The 1-D profile ``f`` (``ReLU()``, ``Abs()``, ``Hat(b)``, ...).
    engine : {"scan", "sweep", "triton"}, optional
        The engine that computes the sum and its gradient (docs/architecture.rst); default: the
        :func:`slicedkern.use_engine` setting, else triton for CUDA torch tensors when Triton is
        installed, the sweep for NumPy / CPU torch when numba is installed, else the scan.
    xp : array namespace, optional
        Inferred from the arrays when omitted.

    Returns
    -------
    array, shape (..., n) or (..., n, c)
        Leading dims are broadcast; namespace, device and (floating) dtype of the inputs.

    Notes
    -----
    Prefix sums and their combination run in float64 where the backend has it. A non-finite query
    gives a NaN row; a non-finite key or weight gives NaN for its whole batch row.

    Examples
    --------
    >>> import numpy as np, slicedkern
    >>> from slicedkern.kernels import ReLU
    >>> x, y, w = np.array([0.0, 2.0]), np.array([0.0, 1.0, 3.0]), np.ones(3)
    >>> slicedkern.kernel_sum(x, y, w, ReLU())
    array([0., 3.])
    """
    sources = (x, y, w)              # the caller's objects, for slicedkern.vjp
    xp, device, out_dtype, work = setup({"x": x, "y": y, "w": w}, xp, required=("x", "y", "w"))
    check_kernel(kernel)
    need_ndim(x, "x", 1, "(..., n)")
    need_ndim(y, "y", 1, "(..., m)")
    if w.ndim not in (y.ndim, y.ndim + 1):
        raise ValueError(f"argument 'w' must have shape (..., m) or (..., m, c) with the rank of 'y' "
                         f"({y.ndim}) or one more, got {shape_str(w)}")
    vector = w.ndim == y.ndim
    if vector:
        w = w[..., None]
    if w.shape[-2] != y.shape[-1]:
        raise ValueError(f"arguments 'y' and 'w' must have the same number of keys m, got {shape_str(y)} "
                         f"and {shape_str(w)}")
    _, arrays = broadcast_all(xp, {"x": x, "y": y, "w": w}, {"x": 1, "y": 1, "w": 2}, ("x", "y", "w"))
    x, y = (as_work(xp, arrays[k], work) for k in ("x", "y"))
    w = arrays["w"]                  # widened inside the prefix sums, after the gather
    spec = KernelSumSpec(kernel)
    inputs = (x, y, w)
    out = run(xp, spec, select(spec, inputs, engine), inputs, ("x", "y", "w"), out_dtype, squeeze=vector,
              sources=sources)
    return nan_rows_without_keys(xp, x, y, out)
