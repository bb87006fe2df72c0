"""The backend registry: one row per array library, with the primitives the engines need.

The sort-scan speaks the array API standard; what the standard lacks or does slowly (a batched
``searchsorted``, a fused weighted row gather, an in-place blocked prefix sum) is a method of the
library's row, and everything else falls through to the standard-only :class:`ArrayBackend`. A row
is imported only when an array of its library reaches us (array-api-compat's ``is_*`` checks look at
modules the caller already imported), so importing :mod:`slicedkern` imports no framework.

To add a backend: a module ``_<library>.py`` with a subclass of :class:`ArrayBackend`, and one entry
in :data:`_ROWS` (see docs/architecture.rst).
"""

from __future__ import annotations

import sys

import array_api_compat as compat

from ._generic import ArrayBackend

__all__ = ["ArrayBackend", "ops_for", "backend_of", "same_library", "holds_everywhere", "is_traced",
           "is_numpy_namespace", "to_host", "searchsorted_right", "take_rows", "finite", "finite_keys", "finite_rows",
           "sorted_weights", "prefix_table", "combine_rows", "quiet_nonfinite",
           "quiet", "accurate_sum", "energy_distance_rows", "energy_distance_pairs",
           "compiled_energy_pairs",
           "has_autograd", "is_chunked", "without_gradient", "compiled_threads", "array_namespace", "is_array",
           "learn_types", "learn_loaded_frameworks"]

def _numpy_row():
    from ._numpy import NumpyBackend
    return NumpyBackend()


def _torch_row():
    from ._torch import TorchBackend  # imports torch: only once a torch array has arrived
    return TorchBackend()


def _dask_row():
    from ._dask import DaskBackend  # imports dask: only once a Dask array has arrived
    return DaskBackend()


def _jax_row():
    from ._jax import JaxBackend  # imports jax: only once a JAX array has arrived
    return JaxBackend()


#: (library, namespace test, array test, row loader): checked in order; the generic row serves the rest.
_ROWS = (
    ("numpy", compat.is_numpy_namespace, compat.is_numpy_array, _numpy_row),
    ("torch", compat.is_torch_namespace, compat.is_torch_array, _torch_row),
    ("jax", compat.is_jax_namespace, compat.is_jax_array, _jax_row),
    ("dask", compat.is_dask_namespace, compat.is_dask_array, _dask_row),
)
_GENERIC = ArrayBackend()
_loaded: dict = {}


def _row(library, load) -> ArrayBackend:
    row = _loaded.get(library)
    if row is None:
        row = _loaded[library] = load()
    return row


#: namespace -> registry row, memoised in a plain dict (see ``_BY_TYPE`` below for why not a cache)
_BY_NAMESPACE: dict = {}


def ops_for(xp) -> ArrayBackend:
    """The registry row of namespace ``xp`` (the generic one for libraries without a row)."""
    key = _namespace_key(xp)
    row = _BY_NAMESPACE.get(key)
    if row is None:
        row = _BY_NAMESPACE[key] = _first_row(1, xp)
    return row


def _first_row(test: int, value) -> ArrayBackend:
    """The first row of :data:`_ROWS` whose test number ``test`` (1: namespace, 2: array) accepts
    ``value``, loaded; the generic row if none does."""
    for row in _ROWS:
        if row[test](value):
            return _row(row[0], row[3])
    return _GENERIC


def _namespace_key(xp):
    """A namespace's module name (a string, which torch.compile looks up in a dict as a constant)."""
    name = getattr(xp, "__name__", None)
    return name if isinstance(name, str) else xp


#: ``type(a) -> (registry row, array-API namespace or None)``, filled on first sight of a type. A plain
#: dict on purpose: array-api-compat memoises its type tests with ``functools.lru_cache``, and
#: ``torch.compile`` warns once per such cache it traces through (92 lines in a user's log from one
#: compiled layer); a dict lookup it traces silently. Both answers depend on the
#: type alone.
_BY_TYPE: dict[type, tuple] = {}


def _by_type(a) -> tuple:
    entry = _BY_TYPE.get(type(a))
    if entry is None:
        row = _first_row(2, a)
        space = compat.array_namespace(a) if compat.is_array_api_obj(a) else None
        entry = _BY_TYPE[type(a)] = (row, space)
        if space is not None:
            _BY_NAMESPACE.setdefault(_namespace_key(space), row)
    return entry


def backend_of(a) -> ArrayBackend:
    """The registry row of array ``a``."""
    return _by_type(a)[0]


def array_namespace(a):
    """``array_api_compat.array_namespace(a)`` of one array, memoised by its type; ``TypeError`` for
    an object of no array library."""
    space = _by_type(a)[1]
    if space is None:
        raise TypeError(f"{type(a).__module__}.{type(a).__name__} is not an array of an array-API library")
    return space


def is_array(a) -> bool:
    """``array_api_compat.is_array_api_obj(a)``, memoised by type."""
    return _by_type(a)[1] is not None


def learn_loaded_frameworks() -> None:
    """:func:`learn_types` for torch's tensor types if torch is already imported (never imports it):
    so that a first call traced by ``torch.compile`` finds them memoised."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "empty") and hasattr(torch, "nn"):
        learn_types(torch.empty(0), torch.nn.Parameter(torch.empty(0), requires_grad=False))


def learn_types(*arrays) -> None:
    """Fill the type memo for ``arrays`` now (eagerly, outside any ``torch.compile`` trace): the layers
    and ``import slicedkern`` call it for torch's tensor types when torch is loaded."""
    for a in arrays:
        _by_type(a)


def same_library(a, b) -> bool:
    """Whether two namespaces are the same library (``numpy`` and ``array_api_compat.numpy`` are)."""
    if a is b:
        return True
    checks = (compat.is_numpy_namespace, compat.is_torch_namespace, compat.is_jax_namespace,
              compat.is_cupy_namespace, compat.is_array_api_strict_namespace, compat.is_dask_namespace)
    return any(check(a) and check(b) for check in checks)


def is_numpy_namespace(xp) -> bool:
    return compat.is_numpy_namespace(xp)


def is_traced(a) -> bool:
    """Whether ``a`` is an abstract value (a JAX tracer, or a tensor inside ``torch.compile``)."""
    return backend_of(a).is_traced(a)


def holds_everywhere(xp, a, predicate) -> bool | None:
    """``all(predicate(ns, a))`` when ``a``'s values are known now (``ns`` the namespace it is
    checked in), ``None`` when ``a`` is traced."""
    return backend_of(a).holds_everywhere(xp, a, predicate)


def without_gradient(a, message: str):
    """``a``, marked so that differentiating through it (torch autograd, ``jax.grad``) raises ``message``."""
    return backend_of(a).without_gradient(a, message)


def compiled_threads(a):
    """A context: numba's thread count in the calling thread capped, for its duration, by what
    ``a``'s library allows (:meth:`ArrayBackend.compiled_threads`)."""
    return backend_of(a).compiled_threads()


def to_host(a):
    """``a``'s values as a NumPy array (concrete arrays only)."""
    return backend_of(a).to_host(a)


# The primitives, called by the engines with their namespace: one line each, through the registry.
def searchsorted_right(xp, sorted_keys, values):
    return ops_for(xp).searchsorted_right(xp, sorted_keys, values)


def take_rows(xp, table, index):
    return ops_for(xp).take_rows(xp, table, index)


def finite(xp, a):
    return ops_for(xp).finite(xp, a)


def finite_keys(xp, values):
    return ops_for(xp).finite_keys(xp, values)


def finite_rows(xp, values, valid=None):
    return ops_for(xp).finite_rows(xp, values, valid)


def sorted_weights(xp, weights, perm, dtype, *, take=None, ones=False):
    return ops_for(xp).sorted_weights(xp, weights, perm, dtype, take=take, ones=ones)


def prefix_table(xp, keys, weights, perm, *, take=None, ones=False):
    return ops_for(xp).prefix_table(xp, keys, weights, perm, take=take, ones=ones)


def combine_rows(xp, table, indices, parts, weights, columns, *, cache=None):
    return ops_for(xp).combine_rows(xp, table, indices, parts, weights, columns, cache=cache)


def quiet_nonfinite(xp) -> bool:
    return ops_for(xp).quiet_nonfinite


def quiet(xp):
    return ops_for(xp).quiet()


def accurate_sum(xp, v):
    return ops_for(xp).accurate_sum(xp, v)


def energy_distance_rows(xp, x, y, a, b, batch):
    return ops_for(xp).energy_distance_rows(xp, x, y, a, b, batch)


def energy_distance_pairs(xp, x, y, a, b, batch):
    return ops_for(xp).energy_distance_pairs(xp, x, y, a, b, batch)


def compiled_energy_pairs(xp, *arrays) -> bool:
    """Whether :func:`energy_distance_pairs` will use compiled code for these arrays (``None`` skipped)."""
    return ops_for(xp).compiled_energy_pairs(tuple(a for a in arrays if a is not None))


def has_autograd(xp) -> bool:
    """Whether ``xp``'s library differentiates array code itself (torch autograd, ``jax.grad``)."""
    return ops_for(xp).autograd


def is_chunked(xp) -> bool:
    """Whether ``xp``'s arrays are lazy and split into chunks (Dask): the sliced ops then build a
    chunked plan (slicedkern/sliced/_chunked.py) whose primitives are the row's methods."""
    return ops_for(xp).chunked


# torch imported before slicedkern (the usual order): its tensor types are memoised now, eagerly,
# rather than inside a first call that torch.compile traces
learn_loaded_frameworks()
