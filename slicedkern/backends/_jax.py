"""The JAX row of the backend registry (jit- and vmap-safe)."""

from __future__ import annotations

import array_api_compat as compat
import jax
import jax.numpy as jnp
import numpy as np

from .._lib.namespace import exclusive_scan
from ._generic import ArrayBackend

try:  # JAX >= 0.7: a callback that reads XLA's buffers in place and writes its results into them
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # pragma: no cover - older JAX copies both ways through jax.pure_callback
    _buffer_callback = None


def _search_row(keys, vals):
    return jnp.searchsorted(keys, vals, side="right", method="scan_unrolled")


_search_rows = jax.vmap(_search_row)
_take_rows = jax.vmap(lambda table, index: table[index])


def _add_rows(a, b):
    """The operator of a plain prefix sum for :func:`inclusive_scan`: tuples of one array."""
    return (a[0] + b[0],)


def _varies_over_manual_axes(a) -> bool:
    """Whether traced ``a`` varies over a ``shard_map`` mesh axis (the attribute moved across versions)."""
    aval = jax.typeof(a)
    manual = getattr(aval, "manual_axis_type", None)
    return bool(getattr(manual, "varying", None) or getattr(aval, "vma", None))


def _standard(a: np.ndarray) -> np.ndarray:
    """A host array in a dtype NumPy computes in: bfloat16 (an ``ml_dtypes`` extension) as float32."""
    return a.astype(np.float32) if a.dtype.kind not in "fcbiu" else a


def _identity(a, message):
    return a


#: The identity, whose derivative raises: marks a value that has no gradient (DecodeCache). A custom
#: JVP serves ``jax.grad``, ``jvp`` and ``linearize`` alike, and leaves ``jit`` and ``vmap`` untouched.
_no_gradient = jax.custom_jvp(_identity, nondiff_argnums=(1,))


@_no_gradient.defjvp
def _no_gradient_jvp(message, primals, tangents):
    raise TypeError(message)


class JaxBackend(ArrayBackend):
    library = "jax"
    autograd = True

    def owns_namespace(self, xp) -> bool:
        return compat.is_jax_namespace(xp)

    def owns_array(self, a) -> bool:
        return compat.is_jax_array(a)

    def without_gradient(self, a, message: str):
        return _no_gradient(a, message)

    def is_traced(self, a) -> bool:
        return isinstance(a, jax.core.Tracer)

    def to_host(self, a) -> np.ndarray:
        return np.asarray(a)

    def host_callable(self, a) -> bool:
        # A concrete array says where it lives; a traced one runs where the computation is placed,
        # the default backend unless the caller committed its inputs elsewhere (docs/backends.rst,
        # "JAX on the CPU").
        if self.is_traced(a):
            # inside shard_map an array varies over manual mesh axes ("vma"): a callback's results
            # would not carry that type, and the custom_vjp refuses them; the scan serves it there
            if _varies_over_manual_axes(a):
                return False
            return jax.default_backend() == "cpu"
        return all(d.platform == "cpu" for d in a.devices())

    def host_call(self, fn, results, *arrays):
        """``fn`` on the host through a callback: legal under ``jit``, ``vmap`` and inside a
        ``custom_vjp``, and the same staged call outside them.

        The callback is ``jax.experimental.buffer_callback`` where JAX has it: ``fn`` reads XLA's
        input buffers without a copy and its results are copied once into XLA's output buffers
        (``jax.pure_callback`` copies every input and every result, which cost the sweep more than
        its own work at 8 x 16384 x 64: docs/backends.rst, "JAX on the CPU").

        ``vmap_method="broadcast_all"``: a vmapped call reaches ``fn`` once, with the mapped axis
        broadcast in front of every argument (the host code treats leading axes as batch rows and
        runs them in parallel), not once per mapped element ("sequential"). Results are declared in
        JAX's canonical dtypes: float64 becomes float32 without ``jax_enable_x64``.
        """
        shapes = tuple(jax.ShapeDtypeStruct(tuple(shape), jax.dtypes.canonicalize_dtype(dtype))
                       for shape, dtype in results)

        if _buffer_callback is not None:
            def in_place(ctx, outs, *host):
                values = fn(*(_standard(np.asarray(h)) for h in host))
                for dest, value in zip(outs, values):
                    dest = np.asarray(dest)
                    if np.shape(value) != dest.shape:
                        raise RuntimeError(f"a host result of shape {np.shape(value)} was declared as {dest.shape}")
                    np.copyto(dest, value, casting="unsafe")

            return _buffer_callback(in_place, shapes, vmap_method="broadcast_all")(*arrays)

        def on_host(*host):
            out = fn(*(_standard(np.asarray(h)) for h in host))
            return tuple(np.asarray(o, dtype=s.dtype) for o, s in zip(out, shapes))

        return jax.pure_callback(on_host, shapes, *arrays, vmap_method="broadcast_all")

    def holds_everywhere(self, xp, a, predicate) -> bool | None:
        # Inside a trace every jnp operation is staged, even on a concrete array closed over by the
        # jitted function, and bool() of the result fails: check concrete values on the host.
        if self.is_traced(a):
            return None
        return bool(np.all(predicate(np, np.asarray(a))))

    def compile(self, fn):
        return jax.jit(fn)

    def exclusive_rows(self, xp, a):
        if jax.default_backend() != "cpu":
            return super().exclusive_rows(xp, a)
        # XLA's cumsum on the CPU takes ~1.8x the odd-even scan's time on the tables the scan engine
        # builds (4 x 65537 x 66 float64: 354 ms against 196 ms); on accelerators it keeps its own
        return exclusive_scan(xp, _add_rows, (a,))[0]

    def take_rows(self, xp, table, index):
        # Row indexing vmapped over the batch, which XLA lowers to a gather of whole rows. The
        # generic take_along_axis gathers element by element: with ranks fresh from a search,
        # XLA on the CPU ran a ReLU sum (4 x 65536 queries, 33 columns) in 520 ms that way, 97 ms
        # this way.
        lead = jnp.broadcast_shapes(table.shape[:-2], index.shape[:-1])
        rows, cols = table.shape[-2], table.shape[-1]
        if 0 in lead or rows == 0 or cols == 0 or index.shape[-1] == 0:
            # nothing to gather (a reshape to (-1, ...) of an empty array has no size to infer)
            return jnp.zeros(lead + (index.shape[-1], cols), dtype=table.dtype)
        flat_table = jnp.reshape(jnp.broadcast_to(table, lead + (rows, cols)), (-1, rows, cols))
        flat_index = jnp.reshape(jnp.broadcast_to(index, lead + index.shape[-1:]), (-1, index.shape[-1]))
        return jnp.reshape(_take_rows(flat_table, flat_index), lead + (index.shape[-1], cols))

    def searchsorted_right(self, xp, sorted_keys, values):
        """``jnp.searchsorted`` vectorised over the leading axes with ``vmap``."""
        lead = values.shape[:-1]
        keys2 = jnp.reshape(sorted_keys, (-1, sorted_keys.shape[-1]))
        vals2 = jnp.reshape(values, (-1, values.shape[-1]))
        return jnp.reshape(_search_rows(keys2, vals2), lead + (values.shape[-1],))
