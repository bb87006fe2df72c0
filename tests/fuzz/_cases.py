"""What the fuzz suite draws: one call of a public op, as plain NumPy data, and its strategies.

A :class:`Case` is one call (``op``, positional and keyword arguments) whose arrays are held as
float64 (or bool) NumPy values already rounded to the dtype each one is sent with, so that the
backend under test and the float64 oracle see exactly the same numbers. ``repr(case)`` is a
runnable NumPy reproducer.

Forward cases (gradient cases: ``_grad_cases``):

* :func:`forward_cases` -- hostile inputs for value checks: batch dims 0-2 that broadcast
  (``Lq != Lk``, empty axes), mixed float64 / float32 / float16 dtypes, key masks with fully masked
  rows, scores from a tiny grid (exact ties, duplicated scores, ``q == k``, ``+-0.0``) or from a
  continuum, scales from 1e-30 to 1e30 (within what each dtype holds), common offsets, per-head
  bandwidths and mixture weights (floats, 0-d arrays or batch-shaped arrays), every normaliser,
  ``center`` on and off, and ``eps`` from 0 to 1e30 (the defaults too).

Under JAX every new input shape costs a compilation of seconds, so ``few_shapes`` (a tuple of
:class:`Layout`, usually :data:`FEW_LAYOUTS` or part of it) draws the shapes from those only (the
values, dtypes and options stay free); an empty tuple draws any shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import slicedkern
from slicedkern import reference
from slicedkern.kernels import Abs, Hat, HatMixture, PiecewiseLinear, ReLU

__all__ = ["Arr", "Case", "OPS", "OP_NAMES", "FLOAT_DTYPES", "Layout", "FEW_LAYOUTS", "forward_cases",
           "layouts", "kernels", "np_dtype", "promote", "log_uniform", "hat_params", "mask", "attention_options"]

#: op name -> (the public function, its dense float64 oracle)
OPS = {
    "kernel_sum": (slicedkern.kernel_sum, reference.kernel_sum),
    "relu_attention": (slicedkern.relu_attention, reference.relu_attention),
    "hat_attention": (slicedkern.hat_attention, reference.hat_attention),
    "hat_mixture_attention": (slicedkern.hat_mixture_attention, reference.hat_mixture_attention),
    "kernel_attention": (slicedkern.kernel_attention, reference.kernel_attention),
}
OP_NAMES = tuple(OPS)

#: Names of the positional parameters of each op (for reproducers and gradient reports).
POSITIONAL = {
    "kernel_sum": ("x", "y", "w", "kernel"),
    "relu_attention": ("q", "k", "v"),
    "hat_attention": ("q", "k", "v", "bandwidth"),
    "hat_mixture_attention": ("q", "k", "v", "bandwidths", "weights"),
    "kernel_attention": ("q", "k", "v", "kernel"),
}

FLOAT_DTYPES = ("float64", "float32", "float16")

#: Range of log10(scale) that a dtype holds with room to spare: scores reach about 12x the scale
#: (offsets included) and must stay finite; below the range values would flush to zero entirely.
LOG_SCALE_RANGE = {"float64": (-30.0, 30.0), "float32": (-30.0, 30.0), "float16": (-4.0, 3.0)}

#: Largest common offset of the scores, in units of their scale, that a dtype keeps finite.
MAX_OFFSET = {"float64": 1e6, "float32": 1e3, "float16": 10.0}

#: A few exactly representable scores: exact ties, duplicated scores and both signed zeros.
GRID = (-1.0, -0.5, -0.25, -0.0, 0.0, 0.25, 0.5, 1.0)

#: Sentinel of an option left at the op's default (the keyword is not passed at all).
DEFAULT = "<default>"


def np_dtype(name: str):
    """The NumPy dtype called ``name`` ("float64", "float32", "float16" or "bool")."""
    return np.dtype(name)


def promote(*names: str) -> str:
    """The promoted floating dtype name (the same rule in NumPy, torch, JAX and the standard)."""
    return np.result_type(*(np_dtype(n) for n in names)).name


# --------------------------------------------------------------------------------------- cases
@dataclass(frozen=True, eq=False)
class Arr:
    """An array argument: float64 (or bool) ``values``, exactly representable in ``dtype``."""

    values: np.ndarray
    dtype: str

    def __post_init__(self):
        if self.dtype not in ("bool", "int64"):
            with np.errstate(all="ignore"):
                rounded = self.values.astype(np_dtype(self.dtype)).astype(np.float64)
            assert np.array_equal(rounded, self.values), "Arr values must be rounded to their dtype first"

    @classmethod
    def rounded(cls, values, dtype: str) -> Arr:
        """``values`` rounded (to nearest) to ``dtype``, kept as float64."""
        with np.errstate(all="ignore"):
            return cls(np.asarray(values, dtype=np.float64).astype(np_dtype(dtype)).astype(np.float64), dtype)

    @property
    def shape(self) -> tuple:
        return self.values.shape

    def on(self, backend):
        """The array on ``backend`` (a :class:`tests._helpers.Backend`), in its dtype."""
        return backend.asarray(self.values, dtype=self.dtype)

    def __repr__(self):
        body = f"np.array({self.values.tolist()!r}, dtype=np.{self.dtype})"
        return body if self.values.size else f"{body}.reshape({self.values.shape})"


@dataclass(eq=False)
class Case:
    """One call ``OPS[op][0](*args, **kwargs)``; arrays are :class:`Arr`, the rest plain Python."""

    op: str
    args: tuple
    kwargs: dict = field(default_factory=dict)

    @property
    def function(self):
        return OPS[self.op][0]

    @property
    def oracle(self):
        return OPS[self.op][1]

    @property
    def is_attention(self) -> bool:
        return self.op != "kernel_sum"

    def on(self, backend) -> tuple[list, dict]:
        """Positional and keyword arguments as arrays of ``backend`` (a keyword's pair of arrays, such
        as ``segment_ids``, too)."""
        def convert(a):
            if isinstance(a, tuple) and any(isinstance(x, Arr) for x in a):
                return tuple(convert(x) for x in a)
            return a.on(backend) if isinstance(a, Arr) else a
        return [convert(a) for a in self.args], {k: convert(a) for k, a in self.kwargs.items()}

    def numpy(self) -> tuple[list, dict]:
        """Positional and keyword arguments as float64 (or bool, or integer) NumPy arrays."""
        def convert(a):
            if isinstance(a, tuple) and any(isinstance(x, Arr) for x in a):
                return tuple(convert(x) for x in a)
            return a.values.copy() if isinstance(a, Arr) else a
        return [convert(a) for a in self.args], {k: convert(a) for k, a in self.kwargs.items()}

    def float_positions(self) -> list[int]:
        """Positions of the floating array arguments: the ones that get gradients."""
        return [i for i, a in enumerate(self.args) if isinstance(a, Arr) and a.dtype != "bool"]

    def arg_name(self, position: int) -> str:
        return POSITIONAL[self.op][position]

    def out_dtype(self) -> str:
        """Promoted dtype of the data arrays (x, y, w or q, k, v): the output's dtype."""
        return promote(*(a.dtype for a in self.args[:3]))

    def out_shape(self) -> tuple:
        """Shape of the output: the broadcast batch of every array (the key mask too) and the core."""
        first, keys, weights = (a.shape for a in self.args[:3])
        vector = not self.is_attention and len(weights) == len(keys)
        batches = [first[:-1], keys[:-1], weights[:-1] if vector else weights[:-2]]
        if "key_mask" in self.kwargs:
            batches.append(self.kwargs["key_mask"].shape[:-1])
        core = (first[-1],) if vector else (first[-1], weights[-1])
        return np.broadcast_shapes(*batches) + core

    def replaced(self, position: int, values: np.ndarray) -> Case:
        """The same call with positional argument ``position`` holding ``values`` instead."""
        args = list(self.args)
        args[position] = Arr.rounded(values, self.args[position].dtype)
        return Case(self.op, tuple(args), dict(self.kwargs))

    def option(self, name: str, default):
        """A keyword option's effective value (``default`` when it was not passed)."""
        return self.kwargs.get(name, default)

    def __repr__(self):
        names = POSITIONAL[self.op]
        lines = [f"{n} = {a!r}" for n, a in zip(names, self.args)]
        lines += [f"{k} = {a!r}" for k, a in self.kwargs.items()]
        call = ", ".join(list(names[:len(self.args)]) + [f"{k}={k}" for k in self.kwargs])
        lines.append(f"out = slicedkern.{self.op}({call})")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Layout:
    """Shapes of one call: each array's own batch shape (they broadcast together) and the sizes.

    For ``kernel_sum`` ``q, k, v`` stand for ``x, y, w`` and ``vector`` makes ``w`` (..., m).
    """

    q_batch: tuple
    k_batch: tuple
    v_batch: tuple
    mask_batch: tuple
    lq: int
    lk: int
    dv: int
    vector: bool = False

    @property
    def batch(self) -> tuple:
        return np.broadcast_shapes(self.q_batch, self.k_batch, self.v_batch)


#: The only shapes JAX is given (compilations are per shape): batched and broadcast, unbatched,
#: and one with no keys at all.
FEW_LAYOUTS = (
    Layout(q_batch=(2,), k_batch=(1,), v_batch=(2,), mask_batch=(2,), lq=5, lk=7, dv=2),
    Layout(q_batch=(), k_batch=(), v_batch=(), mask_batch=(), lq=3, lk=4, dv=1, vector=True),
    Layout(q_batch=(1,), k_batch=(1,), v_batch=(1,), mask_batch=(1,), lq=2, lk=0, dv=1),
)


def _sub_batch(draw, batch: tuple) -> tuple:
    """A shape that broadcasts to ``batch``: leading dims dropped, some others set to 1."""
    drop = draw(st.integers(0, len(batch)))
    return tuple(1 if draw(st.booleans()) else d for d in batch[drop:])


@st.composite
def layouts(draw, *, few_shapes: tuple = (), max_len: int = 12, max_batch: int = 3, vector_ok: bool = False):
    """A :class:`Layout`: batch dims 0-2 of size 1-3, each array with its own broadcastable batch.

    ``vector_ok`` (kernel sums): ``w`` may be (..., m), and its batch has the rank of ``y``'s.
    """
    if few_shapes:
        layout = draw(st.sampled_from(few_shapes))
        return layout if vector_ok or not layout.vector else Layout(**{**layout.__dict__, "vector": False})
    batch = tuple(draw(st.lists(st.integers(1, max_batch), max_size=2)))
    k_batch = _sub_batch(draw, batch)
    if vector_ok:
        # kernel_sum tells w (..., m) from w (..., m, c) by its rank: w's batch has y's rank
        v_batch = tuple(1 if draw(st.booleans()) else d for d in batch[len(batch) - len(k_batch):])
    else:
        v_batch = _sub_batch(draw, batch)
    q_batch = _sub_batch(draw, batch)
    if not vector_ok and len(v_batch) + 1 == len(q_batch) == len(k_batch):
        # q, k and v of one rank read as scaled_dot_product_attention's (..., L, E) features, a
        # documented error of the attention ops (they name it): keep v's batch rank apart
        v_batch = (1,) + v_batch
    return Layout(q_batch=q_batch, k_batch=k_batch, v_batch=v_batch,
                  mask_batch=_sub_batch(draw, batch), lq=draw(st.integers(0, max_len)),
                  lk=draw(st.integers(0, max_len)), dv=draw(st.integers(1, 3)),
                  vector=vector_ok and draw(st.booleans()))


def _param_shape(draw, batch: tuple) -> tuple:
    """A per-head parameter shape: at most the batch's rank, broadcasting to it."""
    return _sub_batch(draw, batch)


# -------------------------------------------------------------------------------- value pieces
def log_uniform(draw, lo: float, hi: float) -> float:
    """``10**e``, ``e`` uniform in [lo, hi] (shrinks towards 1.0)."""
    if lo > 0 or hi < 0:
        return 10.0 ** draw(st.floats(lo, hi))
    return draw(st.one_of(st.just(1.0), st.builds(lambda e: 10.0 ** e, st.floats(lo, hi))))


def _scale_for(draw, dtypes, log_range=(-30.0, 30.0)) -> float:
    """A scale that every dtype in ``dtypes`` holds (see :data:`LOG_SCALE_RANGE`), within ``log_range``."""
    lo = max([LOG_SCALE_RANGE[d][0] for d in dtypes] + [log_range[0]])
    hi = min([LOG_SCALE_RANGE[d][1] for d in dtypes] + [log_range[1]])
    return log_uniform(draw, lo, hi)


def _unit_array(draw, shape: tuple, mode: str) -> np.ndarray:
    """Float64 values of order one: ``grid`` (ties), ``uniform`` in [-1, 1] or ``zero`` (+-0.0)."""
    elements = {"grid": st.sampled_from(GRID),
                "uniform": st.floats(-1.0, 1.0, allow_subnormal=False),
                "zero": st.sampled_from((0.0, -0.0))}[mode]
    return draw(hnp.arrays(np.float64, shape, elements=elements))


def _bandwidth(draw, scale: float) -> float:
    """A positive bandwidth on the scores' scale (often a grid value: exact ties ``|q - k| = b``)."""
    factor = draw(st.one_of(st.sampled_from((1.0, 0.5, 0.25)), st.floats(0.03, 10.0)))
    return factor * scale


def _positive_array(values: np.ndarray, dtype: str) -> Arr:
    """Bandwidth values rounded to ``dtype``, kept positive where rounding would flush them."""
    arr = Arr.rounded(values, dtype)
    tiny = float(np.finfo(np_dtype(dtype)).smallest_subnormal)
    return Arr.rounded(np.maximum(arr.values, tiny), dtype)


def _parameter(draw, values_of, batch: tuple, dtype: str, *, allow_float: bool):
    """A hat parameter as a Python float, a 0-d array, or a per-head (batch-shaped) array.

    ``values_of(shape)`` draws the float64 values.
    """
    forms = (["float"] if allow_float else []) + ["0-d", "per-head"]
    form = draw(st.sampled_from(forms))
    if form == "float":
        return float(values_of(()))
    shape = () if form == "0-d" else _param_shape(draw, batch)
    return values_of(shape), dtype


@st.composite
def kernels(draw, scale: float, lattice=None):
    """A profile: ReLU, Abs, Hat, HatMixture or a random PiecewiseLinear, on the scores' scale.

    ``lattice`` (a function of a drawn integer) places every knot on it instead (gradient cases).
    """
    kind = draw(st.sampled_from(("relu", "abs", "hat", "mixture", "piecewise")))
    if kind == "relu":
        return ReLU()
    if kind == "abs":
        return Abs()

    def width():
        return lattice(draw(st.integers(1, 3))) if lattice else _bandwidth(draw, scale)

    if kind == "hat":
        return Hat(width())
    coeff = st.one_of(st.sampled_from((1.0, -1.0, 0.5, 0.0)), st.floats(-2.0, 2.0, allow_subnormal=False))
    if kind == "mixture":
        n = draw(st.integers(1, 3))
        return HatMixture([width() for _ in range(n)], draw(st.lists(coeff, min_size=n, max_size=n)))
    n = draw(st.integers(0, 4))
    if lattice:
        knots = [lattice(draw(st.integers(-2, 2))) for _ in range(n)]
    else:
        knots = [scale * t for t in draw(st.lists(st.one_of(st.sampled_from(GRID), st.floats(-1.5, 1.5)),
                                                  min_size=n, max_size=n))]
    return PiecewiseLinear(knots, draw(st.lists(coeff, min_size=n, max_size=n)), slope=draw(coeff),
                           intercept=scale * draw(coeff))


def mask(draw, layout: Layout):
    """A key mask (..., Lk), or ``None``; some batch rows fully masked."""
    if not draw(st.booleans()):
        return None
    shape = layout.mask_batch + (layout.lk,)
    keep = draw(st.sampled_from((0.5, 0.9)))
    mask = draw(hnp.arrays(np.float64, shape, elements=st.floats(0.0, 1.0))) < keep
    rows_off = draw(hnp.arrays(np.bool_, layout.mask_batch, elements=st.booleans()))
    mask &= ~(rows_off & draw(st.booleans()))[..., None]
    return Arr(mask, "bool")


def attention_options(draw, op: str) -> dict:
    """Normaliser, centring and eps (each sometimes left at the op's default)."""
    options = {}
    normalize = draw(st.sampled_from((DEFAULT, "abs", "relu", "count", None)))
    if normalize != DEFAULT:
        options["normalize"] = normalize
    if op in ("relu_attention", "kernel_attention"):
        center = draw(st.sampled_from((DEFAULT, True, False)))
        if center != DEFAULT:
            options["center"] = center
    eps = draw(st.one_of(st.just(DEFAULT), st.sampled_from((0.0, 1e-300, 1.0)),
                         st.builds(lambda e: 10.0 ** e, st.integers(-30, 30))))
    if eps != DEFAULT:
        options["eps"] = eps
    return options


def hat_params(draw, op: str, batch: tuple, dtype: str, draw_width, draw_weight):
    """Positional hat parameters of ``hat_attention`` / ``hat_mixture_attention``.

    ``draw_width(shape)`` / ``draw_weight(shape)`` give float64 values; arrays come back as
    :class:`Arr` in ``dtype``, floats and lists as they are.
    """
    if op == "hat_attention":
        b = _parameter(draw, draw_width, batch, dtype, allow_float=True)
        return (b if isinstance(b, float) else _positive_array(*b),)
    n = draw(st.integers(1, 3))
    params = []
    for values_of, positive in ((draw_width, True), (draw_weight, False)):
        if draw(st.booleans()):
            params.append([float(values_of(())) for _ in range(n)])
            continue
        shape = draw(st.sampled_from(((), _param_shape(draw, batch)))) + (n,)
        values = values_of(shape)
        params.append(_positive_array(values, dtype) if positive else Arr.rounded(values, dtype))
    return tuple(params)


# ---------------------------------------------------------------------------------- forward
@st.composite
def forward_cases(draw, op: str, *, has_float16: bool, few_shapes: tuple = (), dtypes=FLOAT_DTYPES,
                  log_scale_range=(-30.0, 30.0)):
    """Hostile but finite inputs for ``op``: see the module docstring.

    ``dtypes``: those the arrays are drawn from (float16 only if ``has_float16``);
    ``log_scale_range``: bounds of log10 of the scales of scores and of values (each dtype's own
    range, :data:`LOG_SCALE_RANGE`, narrows it further).
    """
    layout = draw(layouts(few_shapes=few_shapes, vector_ok=op == "kernel_sum"))
    dtypes = tuple(d for d in dtypes if has_float16 or d != "float16")
    q_dt, k_dt, v_dt = (draw(st.sampled_from(dtypes)) for _ in range(3))
    param_dt = promote(q_dt, k_dt, v_dt)
    scale = _scale_for(draw, {q_dt, k_dt, param_dt}, log_scale_range)

    mode = draw(st.sampled_from(("grid", "uniform", "zero")))
    k = _unit_array(draw, layout.k_batch + (layout.lk,), mode)
    q_shape = layout.q_batch + (layout.lq,)
    if k.size and draw(st.booleans()):          # queries equal to keys
        idx = draw(hnp.arrays(np.intp, q_shape, elements=st.integers(0, k.size - 1)))
        q = k.ravel()[idx]
    else:
        q = _unit_array(draw, q_shape, mode)
    max_offset = min(MAX_OFFSET[d] for d in (q_dt, k_dt))
    offset = draw(st.sampled_from((0.0, 1.0, 1e3, 1e6)).filter(lambda o: o <= max_offset))
    q_arr, k_arr = Arr.rounded((q + offset) * scale, q_dt), Arr.rounded((k + offset) * scale, k_dt)

    v_shape = layout.v_batch + ((layout.lk,) if layout.vector else (layout.lk, layout.dv))
    v_scale = _scale_for(draw, {v_dt}, log_scale_range)
    v_arr = Arr.rounded(_unit_array(draw, v_shape, draw(st.sampled_from(("uniform", "grid", "zero")))) * v_scale,
                        v_dt)
    batch = layout.batch

    def widths(shape):
        return np.asarray(draw(hnp.arrays(np.float64, shape, elements=st.one_of(
            st.sampled_from((1.0, 0.5, 0.25)), st.floats(0.03, 10.0))))) * scale

    def weights(shape):
        return np.asarray(draw(hnp.arrays(np.float64, shape, elements=st.one_of(
            st.sampled_from((1.0, -1.0, 0.0)), st.floats(-2.0, 2.0, allow_subnormal=False)))))

    if op == "kernel_sum":
        return Case(op, (q_arr, k_arr, v_arr, draw(kernels(scale))))
    options = attention_options(draw, op)
    key_mask = mask(draw, layout)
    if key_mask is not None:
        options["key_mask"] = key_mask
    args = (q_arr, k_arr, v_arr)
    if op == "kernel_attention":
        args += (draw(kernels(scale)),)
    elif op in ("hat_attention", "hat_mixture_attention"):
        args += hat_params(draw, op, batch, param_dt, widths, weights)
    return Case(op, args, options)
