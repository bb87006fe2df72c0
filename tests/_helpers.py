"""Shared test helpers: backends, data movement and dtype/device-aware assertions.

Nothing here imports a framework at module import time; a backend's library is imported only when
that backend is requested (and a missing one is a skip, never a failure).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import array_api_compat as compat
import numpy as np
import pytest

from slicedkern._lib.backends import Backend as BackendName
from slicedkern.engines import available as engines_available

__all__ = ["ALL_BACKENDS", "Backend", "backend_ids", "make_backend", "backend_context", "jax_x64", "selected_backends",
           "require_selected", "assert_meta", "assert_close", "assert_values_close", "rel_err", "to_numpy",
           "scan_atol", "attention_atol", "central_differences", "names_argument", "scaled_kernel", "tie_scores",
           "queries_on_knots",
           "N", "M", "C", "DECODE_CHUNKS", "decode_data", "poison_decode_data"]

#: Every backend the suite knows about (the one list shared with the bench and asv); the last two
#: need a GPU.
ALL_BACKENDS = BackendName.names()

ENV_VAR = "SLICEDKERN_BACKENDS"


def parse_backends(text: str | None) -> tuple[str, ...]:
    """Backend names from a comma list (``None`` / empty: all); unknown names raise ``ValueError``."""
    if text is None or not text.strip():
        return ALL_BACKENDS
    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [n for n in names if n not in ALL_BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; choose among {list(ALL_BACKENDS)}")
    return names


def selected_backends(config) -> tuple[str, ...]:
    """``--backend`` wins over the ``SLICEDKERN_BACKENDS`` environment variable; default: all."""
    option = config.getoption("--backend", default=None)
    return parse_backends(option if option is not None else os.environ.get(ENV_VAR))


def require_selected(config, *names: str) -> None:
    """Skip the calling test unless every backend in ``names`` is selected (``--backend`` / env)."""
    missing = [n for n in names if n not in selected_backends(config)]
    if missing:
        pytest.skip(f"backend(s) {missing} not selected")


@dataclass(frozen=True)
class Backend:
    """One array library on one device, as the tests see it.

    Attributes
    ----------
    name : str
        One of :data:`ALL_BACKENDS`.
    xp : module
        The array-API namespace that ``array_api_compat.array_namespace`` returns for its arrays.
    device : object
        The device arrays are created on (for ``array_api_strict`` a non-default one on purpose).
    native : module
        The library itself (``numpy``, ``torch``, ``jax.numpy``, ...), for native dtypes.
    """

    name: str
    xp: Any
    device: Any
    native: Any
    engine: str | None = None

    def __repr__(self):
        return f"Backend({self.name!r}, engine={self.engine!r})"

    # -- dtypes -------------------------------------------------------------------------------
    def dtype(self, name: str | None):
        """The backend's dtype called ``name`` ("float64", "float32", "float16", "bfloat16", "bool")."""
        if name is None:
            return None
        if name == "bfloat16":
            if self.name not in ("torch", "torch_cuda", "jax"):
                pytest.skip(f"{self.name} has no bfloat16")
            return self.native.bfloat16
        if name == "float16" and self.name == "array_api_strict":
            pytest.skip("array_api_strict has no float16")
        return getattr(self.xp, name)

    @property
    def is_jax(self) -> bool:
        return self.name == "jax"

    # -- data movement ------------------------------------------------------------------------
    def asarray(self, a, dtype: str | None = None):
        """A fresh copy of NumPy data ``a`` as an array of this backend, on its device."""
        a = np.array(a, copy=True)
        dt = self.dtype(dtype)
        if self.name in ("torch", "torch_cuda"):
            t = self.native.asarray(a, device=self.device)
            return t.to(dt) if dt is not None else t.clone()
        if self.name == "jax":
            import jax
            arr = self.native.asarray(a, dtype=dt) if dt is not None else self.native.asarray(a)
            return jax.device_put(arr, self.device)
        if self.name == "cupy":
            arr = self.native.asarray(a)
            return arr.astype(dt) if dt is not None else arr
        if self.name == "array_api_strict":
            return self.xp.asarray(a, dtype=dt, device=self.device, copy=True)
        return np.asarray(a, dtype=dt)

    def to_numpy(self, a) -> np.ndarray:
        return to_numpy(a)


def to_numpy(a) -> np.ndarray:
    """Any backend's array as a NumPy array (half-precision torch arrays go through float64)."""
    if isinstance(a, np.ndarray):
        return a
    if compat.is_torch_array(a):
        import torch
        if a.dtype in (torch.bfloat16, torch.float16):
            return a.detach().to("cpu", torch.float64).numpy()
        return a.detach().cpu().numpy()
    if compat.is_cupy_array(a):
        return a.get()
    if compat.is_jax_array(a):
        return np.asarray(a)
    return np.from_dlpack(a)


def _numpy_backend():
    import array_api_compat.numpy as cnp
    return Backend("numpy", cnp, "cpu", np)


def _strict_backend():
    xs = pytest.importorskip("array_api_strict")
    return Backend("array_api_strict", xs, xs.Device("device1"), xs)


def _torch_backend(cuda: bool):
    torch = pytest.importorskip("torch")
    if cuda and not torch.cuda.is_available():
        pytest.skip("torch_cuda needs a CUDA GPU")
    import array_api_compat.torch as ctorch
    return Backend("torch_cuda" if cuda else "torch", ctorch,
                   torch.device("cuda", 0) if cuda else torch.device("cpu"), torch)


def _jax_backend():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    return Backend("jax", jnp, jax.devices("cpu")[0] if not _jax_gpu(jax) else jax.devices()[0], jnp)


def _jax_on_cpu() -> bool:
    """Whether JAX is installed and computes on the CPU (where the sweep serves it)."""
    if importlib.util.find_spec("jax") is None:
        return False
    import jax
    return not _jax_gpu(jax)


def _jax_gpu(jax) -> bool:
    try:
        return jax.default_backend() != "cpu"
    except Exception:  # pragma: no cover
        return False


def _cupy_backend():
    cupy = pytest.importorskip("cupy")
    try:
        ndev = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        ndev = 0
    if ndev == 0:
        pytest.skip("cupy needs a CUDA GPU")
    import array_api_compat.cupy as ccupy
    return Backend("cupy", ccupy, cupy.cuda.Device(0), cupy)


def backend_ids(names) -> list[str]:
    """The fixture's ids: each CPU backend once per engine that serves it (``numpy-scan``,
    ``numpy-sweep``, ``torch-scan``, ``torch-sweep``, ``jax-scan``, ``jax-sweep`` where JAX computes
    on the CPU), the others once (their engine: the scan)."""
    ids = []
    for name in names:
        cpu = name in ("numpy", "torch") or (name == "jax" and _jax_on_cpu())
        engines = engines_available(name) if cpu else []
        ids += [f"{name}-{e}" for e in engines] if len(engines) > 1 else [name]
    return ids


def make_backend(name: str) -> Backend:
    """Build the :class:`Backend` called ``name`` (``numpy-sweep``: NumPy with the sweep engine as
    the default of the test); skips the calling test when it is unavailable."""
    if "-" in name:
        base, engine = name.split("-")
        backend = make_backend(base)
        return Backend(backend.name, backend.xp, backend.device, backend.native, engine)
    if name == "numpy":
        return _numpy_backend()
    if name == "array_api_strict":
        return _strict_backend()
    if name == "torch":
        return _torch_backend(cuda=False)
    if name == "torch_cuda":
        return _torch_backend(cuda=True)
    if name == "jax":
        return _jax_backend()
    if name == "cupy":
        return _cupy_backend()
    raise ValueError(f"unknown backend {name!r}")


@contextlib.contextmanager
def jax_x64(enabled: bool):
    """Set ``jax_enable_x64`` for the duration of the block, then restore the previous value."""
    import jax
    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", enabled)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


@contextlib.contextmanager
def backend_context(*names: str, engine: str | None = None):
    """Context a test on these backends runs in: x64 on for JAX (float64 comparisons), and the
    backend's engine as the default of every op call."""
    import slicedkern
    with contextlib.ExitStack() as stack:
        if "jax" in names:
            pytest.importorskip("jax")
            stack.enter_context(jax_x64(True))
        if engine is not None:
            stack.enter_context(slicedkern.use_engine(engine))
        yield


# ---------------------------------------------------------------------------------- assertions
def assert_meta(actual, *, like=None, backend: Backend | None = None, shape=None, dtype=None):
    """Namespace (array type), device, shape and dtype of ``actual``.

    The expected namespace / device / dtype come from ``like`` (an array) or ``backend``; ``shape``
    and ``dtype`` override those of ``like``.
    """
    if like is not None:
        exp_type = type(like)
        exp_space = compat.array_namespace(like)
        exp_device = compat.device(like)
        shape = tuple(like.shape) if shape is None else shape
        dtype = like.dtype if dtype is None else dtype
    else:
        assert backend is not None, "pass like= or backend="
        exp_type, exp_space, exp_device = None, backend.xp, backend.device
    space = compat.array_namespace(actual)
    assert space is exp_space, f"namespace {space.__name__} instead of {exp_space.__name__}"
    if exp_type is not None:
        assert type(actual) is exp_type, f"type {type(actual)} instead of {exp_type}"
    assert compat.device(actual) == exp_device, f"device {compat.device(actual)} != {exp_device}"
    if shape is not None:
        assert tuple(actual.shape) == tuple(shape), f"shape {tuple(actual.shape)} != {tuple(shape)}"
    if dtype is not None:
        assert actual.dtype == dtype, f"dtype {actual.dtype} != {dtype}"


def rel_err(actual, expected) -> float:
    """Normwise relative error ``||a - e|| / ||e||`` (absolute when ``e == 0``), on NumPy copies."""
    a = np.asarray(to_numpy(actual), dtype=np.float64)
    e = np.asarray(to_numpy(expected), dtype=np.float64)
    num = float(np.linalg.norm((a - e).ravel()))
    den = float(np.linalg.norm(e.ravel()))
    return num / den if den > 0 else num


def assert_values_close(actual, expected, *, rtol, atol=None, err_msg=""):
    """Values only, in float64 NumPy: NaNs at the same places, normwise relative error <= ``rtol``
    and elementwise ``|a - e| <= atol + rtol |e|``.

    ``atol`` defaults to ``rtol * max|e|``: an error is judged against the magnitude of the data, so
    entries that are small only because of cancellation are not held to a relative bound. The
    normwise bound is ``||a - e|| <= rtol ||e|| + atol sqrt(N)``.
    """
    a = np.asarray(to_numpy(actual), dtype=np.float64)
    e = np.asarray(to_numpy(expected), dtype=np.float64)
    assert a.shape == e.shape, f"shape {a.shape} != {e.shape}"
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    assert np.array_equal(nan_a, nan_e), f"NaN at different places {err_msg}: got {np.argwhere(nan_a)}, " \
                                         f"expected {np.argwhere(nan_e)}"
    a, e = a[~nan_e], e[~nan_e]
    assert np.all(np.isfinite(a)), f"non-finite values {err_msg}"
    if e.size == 0:
        return
    scale = float(np.max(np.abs(e)))
    if atol is None:
        atol = rtol * scale
    atol = np.broadcast_to(np.asarray(atol, dtype=np.float64), nan_e.shape)[~nan_e]
    den = float(np.linalg.norm(e))
    err = float(np.linalg.norm(a - e))
    allowed = rtol * den + float(np.linalg.norm(atol))
    assert err <= allowed, (
        f"normwise error {err:.3e} (relative {err / den if den else np.inf:.3e}) > allowed {allowed:.3e} "
        f"(rtol {rtol:.1e}) {err_msg}")
    diff = np.abs(a - e)
    bad = diff > atol + rtol * np.abs(e)
    if np.any(bad):
        i = int(np.argmax(np.where(bad, diff - atol - rtol * np.abs(e), -np.inf)))
        raise AssertionError(f"{int(bad.sum())} / {bad.size} elements differ beyond |a - e| <= atol + rtol |e| "
                             f"(rtol {rtol:.1e}); worst: got {a[i]!r}, expected {e[i]!r}, atol {atol[i]:.3e} "
                             f"{err_msg}")


def assert_close(actual, expected, *, rtol, atol=None, dtype=None, err_msg=""):
    """Namespace, type, device, shape and dtype of ``actual`` against ``expected`` (an array of the
    same backend, usually the dense reference), then the values as :func:`assert_values_close`.

    ``dtype`` is the expected dtype when it differs from ``expected.dtype`` (e.g. a float16 result
    checked against a float64 reference).
    """
    assert_meta(actual, like=expected, dtype=dtype)
    assert_values_close(actual, expected, rtol=rtol, atol=atol, err_msg=err_msg)


def central_differences(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """The gradient of the scalar ``f`` at ``x`` by central differences, one entry at a time."""
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[index] += eps
        down[index] -= eps
        grad[index] = (f(up) - f(down)) / (2 * eps)
    return grad


def names_argument(message: str, *names: str) -> bool:
    """Whether an error message names every argument in ``names`` (quoted, or as a whole word)."""
    import re
    return all(re.search(rf"(?<![\w']){re.escape(n)}(?![\w'])|'{re.escape(n)}'", message) for n in names)


# ----------------------------------------------------------------------------------------- data
def scaled_kernel(kernel, scale: float):
    """``r -> kernel(r / scale)`` as a :class:`~slicedkern.kernels.PiecewiseLinear` (same shape of
    profile at another length scale; the values keep their magnitude)."""
    from slicedkern.kernels import PiecewiseLinear
    return PiecewiseLinear(tuple(scale * t for t in kernel.knots),
                           tuple(c / scale for c in kernel.coeffs),
                           kernel.slope / scale, kernel.intercept)


def tie_scores(rng, shape, values=(-1.0, -0.5, 0.0, 0.25, 0.5, 1.0)):
    """Scores drawn from a few dyadic values: many exact ties, exact differences."""
    return rng.choice(np.asarray(values, dtype=np.float64), size=shape)


def queries_on_knots(rng, keys, knots, n):
    """``n`` queries, each equal to a key or to key + knot for a knot (exact ties with every kink).

    All distinct such values are included when there are at most ``n`` of them.
    """
    keys = np.unique(np.asarray(keys).ravel())
    cands = np.unique(np.concatenate([keys] + [keys + t for t in knots]))
    if cands.size >= n:
        return rng.choice(cands, size=n, replace=False)
    return rng.permutation(np.concatenate([cands, rng.choice(cands, size=n - cands.size)]))


#: Canonical sizes: JAX compiles every eager op once per shape, so tests reuse these shapes.
N, M, C = 24, 32, 2


def scan_atol(x, y, w, kernel, *, factor: float = 64.0, eps: float = 2.0 ** -52) -> float:
    """A-priori absolute error scale of a sort-scan kernel sum, from the magnitude of the data.

    The scan forms ``s P0[r] - P1[r]`` per knot: terms of size ``|s - y| |w|`` that cancel. Its
    rounding error is therefore bounded by a small multiple of
    ``eps (|slope| + sum_m |c_m|) span sum_j |w_j| + eps |intercept| sum_j |w_j|``, ``span`` the spread of
    all scores, whatever the (possibly zero) exact value. ``factor`` is the small multiple.
    """
    x, y, w = (np.asarray(to_numpy(a), dtype=np.float64) for a in (x, y, w))
    scores = np.concatenate([x.ravel(), y.ravel()])
    scores = scores[np.isfinite(scores)]
    span = float(np.ptp(scores)) if scores.size else 0.0
    w = w[..., None] if w.ndim == y.ndim else w
    wsum = float(np.max(np.sum(np.abs(np.nan_to_num(w)), axis=-2))) if w.size else 0.0
    lipschitz = abs(kernel.slope) + sum(abs(c) for c in kernel.coeffs)
    return factor * eps * (lipschitz * span + abs(kernel.intercept) + 1.0) * wsum


def attention_atol(q, k, v, kernel, *, key_mask=None, center=False, normalize="count", eps=1e-6,
                   expected=None, factor: float = 64.0, eps_dtype: float = 2.0 ** -52):
    """Elementwise a-priori error scale of sort-scan attention, shape (..., Lq, Dv).

    The numerator carries the absolute error of a kernel sum (see :func:`scan_atol`, with the
    centring term ``mu R`` on top), the "abs" / "relu" normaliser that of a ReLU sum of ones; the
    quotient divides both by ``max(den, eps)``, so rows whose normaliser is tiny (a query below every
    key under "relu") are legitimately less accurate in absolute terms.
    ``expected`` (the reference output) scales the normaliser's contribution.
    """
    q, k, v = (np.asarray(to_numpy(a), dtype=np.float64) for a in (q, k, v))
    batch = np.broadcast_shapes(q.shape[:-1], k.shape[:-1], v.shape[:-2])
    q = np.broadcast_to(q, batch + q.shape[-1:])
    k = np.broadcast_to(k, batch + k.shape[-1:])
    v = np.broadcast_to(v, batch + v.shape[-2:])
    valid = np.ones(k.shape, bool) if key_mask is None else np.broadcast_to(to_numpy(key_mask), k.shape)
    scores = np.concatenate([q[np.isfinite(q)], k[valid & np.isfinite(k)]])
    span = float(np.ptp(scores)) if scores.size else 0.0
    vv = np.where(valid[..., None], v, 0.0)
    count = valid.sum(axis=-1)[..., None, None].astype(np.float64)           # (..., 1, 1)
    vsum = np.abs(vv).sum(axis=-2, keepdims=True)                              # (..., 1, Dv)
    mu = np.abs(vv.sum(axis=-2, keepdims=True)) / np.maximum(count, 1.0) if center else 0.0
    lipschitz = abs(kernel.slope) + sum(abs(c) for c in kernel.coeffs)
    unit = factor * eps_dtype * (lipschitz * span + abs(kernel.intercept) + 1.0)
    d_num = unit * (vsum + mu * count)                                         # (..., 1, Dv)
    shape = batch + (q.shape[-1], v.shape[-1])
    if normalize is None:
        return np.broadcast_to(d_num, shape)
    if normalize == "count":
        return np.broadcast_to(d_num / np.maximum(count, 1.0), shape)
    r = q[..., :, None] - k[..., None, :]
    prof = np.abs(r) if normalize == "abs" else np.maximum(r, 0.0)
    den = np.where(valid[..., None, :], prof, 0.0).sum(axis=-1)[..., None]      # (..., Lq, 1)
    d_den = factor * eps_dtype * (2.0 * span + 1.0) * count
    out = 0.0 if expected is None else np.abs(np.asarray(to_numpy(expected), dtype=np.float64))
    return np.broadcast_to((d_num + out * d_den) / np.maximum(den, eps), shape)


# -- decoding runs (tests/engines/test_sweep_decode.py, tests/engines/test_triton.py) ------------------
#: Chunk sizes appended one after the other: 40 keys, carries into runs of every size.
DECODE_CHUNKS = (1, 1, 3, 1, 5, 2, 7, 1, 1, 4, 14)


def decode_data(rng, n=40, dv=3, batch=(2, 3)):
    """``(q, k, v, mask)`` for decoding: tied keys (5 and 3), a query tied with a key (7 and 2), a
    random key mask."""
    q, k = rng.normal(size=batch + (n,)), rng.normal(size=batch + (n,))
    k[..., 5] = k[..., 3]
    q[..., 7] = k[..., 2]
    v = rng.normal(size=batch + (n, dv))
    mask = rng.random(batch + (n,)) > 0.2
    return q, k, v, mask


def poison_decode_data(q, k, v, mask):
    """The NaN rule's case, in place, on two batch rows: row 0 takes a NaN key at position 10 (every
    query that sees it is NaN); row 1 has an infinite value at 12 that its mask leaves out (not read)
    and a NaN query at 20 (NaN alone)."""
    mask[:] = True
    k[0, 10] = np.nan
    v[1, 12, 0] = np.inf
    mask[1, 12] = False
    q[1, 20] = np.nan
