"""``python -m slicedkern bench``: sliced attention vs softmax attention vs the dense reference.

A first look at what the sort-scan buys, on the backends installed here. For every sequence length
``L`` it times, on one backend and device:

* sliced ReLU attention (:func:`slicedkern.relu_attention`), forward and forward+backward, once per
  engine that can serve the arrays ("scan", and "sweep" where it is wired in and numba is present);
* hat attention (:func:`slicedkern.hat_attention`), forward, with the engine the library picks;
* softmax attention, ``torch.nn.functional.scaled_dot_product_attention``, forward (where torch is
  installed, whatever the backend);
* the dense ``O(L^2)`` reference (:func:`slicedkern.reference.relu_attention`), forward;

then prints a table of times, speed-ups and peak memory, and optionally a log-log plot.

The comparison is "same L, same D": sliced attention takes one projected score per token
(``q, k`` of shape ``(batch, L)``) and values ``(batch, L, D)``; SDPA gets its natural inputs,
``q, k, v`` of shape ``(batch, 1, L, D)`` (one head). Neither timing includes the projections that
produce the scores.

Everything framework-specific is imported inside the functions here: importing ``slicedkern`` (or
this module) imports none of torch, JAX, numba or matplotlib.
"""

from __future__ import annotations

import abc
import argparse
import gc
import importlib.util
import math
import os
import platform
import re
import shutil
import sys
import textwrap
import time
from dataclasses import dataclass, field

__all__ = ["DEFAULT_SIZES", "BenchResult", "Column", "Timing", "Memory", "description",
           "add_arguments", "run_bench", "plot", "main"]

#: Sequence lengths of the default run.
DEFAULT_SIZES = (1024, 4096, 16384, 65536)

_BACKENDS = ("numpy", "torch", "jax")
_DENSE_MAX = 4096          # the dense reference holds (batch, L, L) float64 matrices
_HAT_BANDWIDTH = 0.5
_TINY = 64                 # sequence length of the warm-up calls (JIT compilation, lazy init)
_CALIBRATE = 1024          # a baseline first asked for above this is timed here to extrapolate
_HEADLINE_FACTOR = 30      # the sliced ReLU forward is extrapolated only beyond 30 x the budget


# ------------------------------------------------------------------------------------------ results
@dataclass(frozen=True)
class Column:
    """One timed quantity of the table.

    Parameters
    ----------
    key : str
        Stable identifier, e.g. ``"relu_fwd:scan"``, ``"sdpa"``.
    title : str
        First header line.
    sub : str
        Second header line.
    quadratic : bool
        Whether its cost grows as ``L^2`` (the baselines) rather than ``L log L``; used to
        extrapolate the cells that are not run.
    always : bool
        The headline (the sliced ReLU forward): extrapolated only where one call would exceed 30
        times the per-call budget; the other columns are extrapolated instead of run where one
        call would exceed the budget.
    """

    key: str
    title: str
    sub: str
    quadratic: bool = False
    always: bool = False


@dataclass
class Timing:
    """The time of one cell: measured, extrapolated, or not available.

    Parameters
    ----------
    seconds : float or None
        Best time per call, or the extrapolated time when ``estimated``; None when not available.
    estimated : bool
        True when the call was not run and ``seconds`` comes from a smaller ``L``.
    calls : int
        Number of timed calls.
    note : str
        Why the cell is not available (or an error message).
    """

    seconds: float | None = None
    estimated: bool = False
    calls: int = 0
    note: str = ""

    @property
    def measured(self) -> bool:
        """Whether the cell holds a measured time."""
        return self.seconds is not None and not self.estimated


@dataclass
class Memory:
    """Peak extra memory of one call.

    Parameters
    ----------
    nbytes : int or None
        Bytes above what was in use before the call (inputs excluded, output included).
    method : str
        ``"tracemalloc"``, ``"rss"`` or ``"cuda"`` (see :data:`_MEMORY_METHODS`).
    """

    nbytes: int | None = None
    method: str = ""


_MEMORY_METHODS = {
    "tracemalloc": "t = tracemalloc peak of the allocations made during one call (NumPy data "
                   "buffers included)",
    "rss": "r = rise of the process's peak resident set size during one call (Linux VmHWM, reset "
           "through /proc/self/clear_refs after malloc_trim; counts every allocator: torch, XLA, "
           "numba; page-granular)",
    "cuda": "c = torch.cuda.max_memory_allocated() above the memory allocated before the call",
}
_MEMORY_TAGS = {"tracemalloc": "t", "rss": "r", "cuda": "c"}


@dataclass
class BenchResult:
    """Everything a bench run measured, and its rendering as text.

    Attributes
    ----------
    config : dict
        backend, device, batch, dim, dtype, repeats, budget.
    machine : list of str
        Header lines describing the machine and the library versions.
    sizes : list of int
        The sequence lengths (table rows).
    columns : list of Column
        The timed quantities (table columns), in display order.
    times : dict
        ``(L, column key) -> Timing``.
    memory : dict
        ``(L, column key) -> Memory`` for the forward columns.
    notes : list of str
        Errors and skipped columns, for the footer.
    elapsed : float
        Wall time of the run in seconds.
    """

    config: dict
    machine: list[str]
    sizes: list[int]
    columns: list[Column]
    times: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    elapsed: float = 0.0

    def column(self, key: str) -> Column | None:
        """The column with ``key``, or None."""
        return next((c for c in self.columns if c.key == key), None)

    def sliced_forward_keys(self) -> list[str]:
        """Keys of the sliced ReLU forward columns (one per engine)."""
        return [c.key for c in self.columns if c.key.startswith("relu_fwd:")]

    def best_sliced(self, size: int) -> float | None:
        """Fastest measured sliced ReLU forward time at ``size`` over the engines."""
        found = [self.times[size, k].seconds for k in self.sliced_forward_keys()
                 if self.times.get((size, k), Timing()).measured]
        return min(found) if found else None

    def speedup(self, size: int, baseline: str) -> tuple[float | None, bool]:
        """``baseline time / best sliced ReLU forward time`` and whether the baseline is estimated."""
        best = self.best_sliced(size)
        base = self.times.get((size, baseline))
        if best is None or base is None or base.seconds is None:
            return None, False
        return base.seconds / best, base.estimated

    def format(self) -> str:
        """The header, both tables and the footer, as text."""
        lines = list(self.machine)
        c = self.config
        lines.append(f"problem: batch={c['batch']} D={c['dim']} {c['dtype']}, backend={c['backend']} "
                     f"device={c['device']}; best of up to {c['repeats']} calls per cell")
        lines.append("")
        lines.append("time per call")
        lines += _render([("L", "")] + [(col.title, col.sub) for col in self.columns],
                         [[str(n)] + [_fmt_time(self.times.get((n, col.key), Timing()))
                                      for col in self.columns] for n in self.sizes])
        lines.append("")
        mem_keys = [k for k in self.sliced_forward_keys()] + [k for k in ("sdpa", "dense")
                                                             if self.column(k)]
        speed_keys = [k for k in ("sdpa", "dense") if self.column(k)]
        head = ([("L", "")] + [("speed-up", "vs " + self.column(k).title) for k in speed_keys]
                + [("peak MiB", self.column(k).title + (" " + self.column(k).sub
                                                       if k.startswith("relu") else ""))
                   for k in mem_keys])
        body = []
        for n in self.sizes:
            row = [str(n)]
            for k in speed_keys:
                ratio, est = self.speedup(n, k)
                text = "n/a" if ratio is None else f"{ratio:.0f}x" if ratio >= 100 else f"{ratio:.3g}x"
                row.append(("~" if est and ratio is not None else "") + text)
            for k in mem_keys:
                row.append(_fmt_memory(self.memory.get((n, k), Memory())))
            body.append(row)
        lines.append("speed-up of sliced ReLU attention (fastest engine, forward) and peak memory "
                     "(forward)")
        lines += _render(head, body)
        lines.append("")
        lines += self._footer()
        return "\n".join(lines)

    def _footer(self) -> list[str]:
        c = self.config
        out = [
            "notes:",
            "  sliced attention gets one score per token, q, k: (batch, L), v: (batch, L, D); SDPA gets "
            "its natural inputs q, k, v: (batch, 1, L, D) (one head): the same L and D; the "
            "projections that make the scores are not timed.",
            f"  '~' = not run because one call would take over --budget {c['budget']:g} s: "
            f"extrapolated from the largest L measured (x L^2 for SDPA and dense, x L log L for the "
            f"others; the sliced ReLU forward is measured up to {_HEADLINE_FACTOR} x the budget).",
            f"  'skip' = dense reference not run above L = {_DENSE_MAX} (O(L^2) float64 memory).",
            "  'n/a' = not available here (engine not for this device or without numba, op failed).",
            "  speed-up = baseline forward time / fastest sliced ReLU forward time.",
            "  fwd+bwd = the forward and the gradients of sum(g * out) with respect to q, k and v: "
            + {"torch": "torch autograd.", "jax": "jax.grad, jitted.",
               "numpy": "slicedkern.vjp."}[c["backend"]]
            + (" JAX timings are of jitted functions, compiled (per shape) before timing."
               if c["backend"] == "jax" else ""),
        ]
        used = sorted({m.method for m in self.memory.values() if m.nbytes is not None})
        for method in used:
            out.append("  peak memory, " + _MEMORY_METHODS[method])
        out += ["  " + note for note in self.notes]
        out.append(f"total bench time {self.elapsed:.1f} s")
        return [w for line in out for w in textwrap.wrap(
            line, width=100, subsequent_indent="    " if line.startswith("  ") else "",
            drop_whitespace=True) or [""]]


def _fmt_time(t: Timing) -> str:
    if t.seconds is None:
        return t.note if t.note in ("skip",) else "n/a"
    s = t.seconds
    text = (f"{s * 1e6:.3g} us" if s < 1e-3 else f"{s * 1e3:.3g} ms" if s < 1
            else f"{s:.3g} s")
    return ("~" + text) if t.estimated else text


def _fmt_memory(m: Memory) -> str:
    if m.nbytes is None:
        return "n/a"
    return f"{m.nbytes / 2 ** 20:.1f} {_MEMORY_TAGS[m.method]}"


def _render(head: list[tuple[str, str]], body: list[list[str]]) -> list[str]:
    """A right-aligned text table with a two-line header."""
    widths = [max(len(h[0]), len(h[1]), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
    fmt = "  ".join("{:>%d}" % w for w in widths)
    lines = [fmt.format(*(h[0] for h in head)), fmt.format(*(h[1] for h in head)),
             "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*row) for row in body]
    return lines


# ------------------------------------------------------------------------------------ progress bar
class _Progress:
    """A one-line progress bar on a stream (a terminal), redrawn with carriage returns."""

    def __init__(self, total: int, stream, enabled: bool):
        self.total, self.stream, self.enabled = max(total, 1), stream, enabled
        self.done, self.start = 0, time.perf_counter()

    def show(self, label: str) -> None:
        """Draw the bar with ``label`` as the step in progress."""
        if not self.enabled:
            return
        width = shutil.get_terminal_size((80, 20)).columns - 1
        frac = self.done / self.total
        bar = "#" * round(20 * frac) + "-" * (20 - round(20 * frac))
        text = (f"[{bar}] {self.done}/{self.total} {time.perf_counter() - self.start:5.1f}s "
                f"{label}")
        self.stream.write("\r" + text[:width].ljust(width))
        self.stream.flush()

    def step(self, label: str = "") -> None:
        """Count one step as done."""
        self.done += 1
        self.show(label)

    def close(self) -> None:
        """Erase the bar."""
        if self.enabled:
            width = shutil.get_terminal_size((80, 20)).columns - 1
            self.stream.write("\r" + " " * width + "\r")
            self.stream.flush()


# ---------------------------------------------------------------------------------- memory probes
def _proc_status(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Return freed heap memory to the OS and reset VmHWM to the current RSS (Linux >= 4.0)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class _Probe:
    """Measures the peak extra memory of one call, by ``method``.

    ``separate`` probes (tracemalloc) slow the call down and run it once more outside the timings;
    the others wrap the first timed call.
    """

    def __init__(self, method: str | None):
        self.method = method
        self.separate = method == "tracemalloc"

    def __enter__(self):
        gc.collect(0)               # a full collection costs ~0.5 s once torch is imported
        self.base = None
        if self.method == "tracemalloc":
            import tracemalloc
            tracemalloc.start()
            self.base = tracemalloc.get_traced_memory()[0]
        elif self.method == "rss":
            if _reset_peak_rss():
                self.base = _proc_status("VmRSS")
        elif self.method == "cuda":
            import torch
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        self.result = Memory(None, self.method or "")
        if self.method == "tracemalloc":
            import tracemalloc
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            self.result.nbytes = max(peak - self.base, 0)
        elif self.method == "rss" and self.base is not None:
            peak = _proc_status("VmHWM")
            if peak is not None:
                self.result.nbytes = max(peak - self.base, 0)
        elif self.method == "cuda":
            import torch
            torch.cuda.synchronize()
            self.result.nbytes = max(torch.cuda.max_memory_allocated() - self.base, 0)
        return False


# ----------------------------------------------------------------------------------- the backends
class _Backend(abc.ABC):
    """Inputs, synchronisation and differentiation for one array library on one device."""

    name = ""

    def __init__(self, device: str, batch: int, dim: int, seed: int = 0):
        import numpy as np
        self.device, self.batch, self.dim = device, batch, dim
        self.rng = np.random.default_rng(seed)

    def host_inputs(self, n: int, *, batch: int | None = None):
        """float32 NumPy ``q, k (batch, n)``, ``v, g (batch, n, D)``."""
        import numpy as np
        b = self.batch if batch is None else batch
        q, k = (self.rng.standard_normal((b, n), dtype=np.float32) for _ in range(2))
        v, g = (self.rng.standard_normal((b, n, self.dim), dtype=np.float32) for _ in range(2))
        return q, k, v, g

    def inputs(self, n: int, *, batch: int | None = None):
        """``q, k, v, g`` on this backend and device."""
        return tuple(self.convert(a) for a in self.host_inputs(n, batch=batch))

    def memory_method(self) -> str | None:
        """How to probe the memory of calls on this backend."""
        return "rss" if _proc_status("VmHWM") is not None else None

    @abc.abstractmethod
    def convert(self, a):
        """``a`` (NumPy) as an array of this backend, on its device."""

    def sync(self, out):
        """Wait for ``out`` to be computed."""
        return out

    @abc.abstractmethod
    def forward(self, fn, engine=None):
        """A closure computing ``fn(q, k, v)`` on given arrays, under ``engine``."""

    @abc.abstractmethod
    def forward_backward(self, fn, engine=None):
        """A closure computing ``fn(q, k, v)`` and the gradients of ``sum(g * out)``."""


def _engine_ctx(engine):
    import contextlib

    from . import _engine
    return contextlib.nullcontext() if engine is None else _engine.use_engine(engine)


class _NumpyBackend(_Backend):
    name = "numpy"

    def convert(self, a):
        return a

    def memory_method(self):
        return "tracemalloc"

    def forward(self, fn, engine=None):
        def run(q, k, v, g):
            with _engine_ctx(engine):
                return fn(q, k, v)
        return run

    def forward_backward(self, fn, engine=None):
        from ._dispatch import vjp

        def run(q, k, v, g):
            with _engine_ctx(engine):
                _, pullback = vjp(fn, q, k, v)
                return pullback(g)
        return run


class _TorchBackend(_Backend):
    name = "torch"

    def __init__(self, device, batch, dim, seed=0):
        super().__init__(device, batch, dim, seed)
        import torch
        self.torch = torch
        self.dev = torch.device(device)
        if self.dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here")

    def convert(self, a):
        return self.torch.from_numpy(a).to(self.dev)

    def memory_method(self):
        return "cuda" if self.dev.type == "cuda" else super().memory_method()

    def sync(self, out):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()
        return out

    def forward(self, fn, engine=None):
        def run(q, k, v, g):
            with _engine_ctx(engine), self.torch.no_grad():
                return self.sync(fn(q, k, v))
        return run

    def forward_backward(self, fn, engine=None):
        def run(q, k, v, g):
            for a in (q, k, v):                # the inputs are this cell's own leaf tensors
                a.requires_grad_(True)
                a.grad = None
            with _engine_ctx(engine):
                out = fn(q, k, v)
                out.backward(g)
            return self.sync((q.grad, k.grad, v.grad))
        return run


class _JaxBackend(_Backend):
    name = "jax"

    def __init__(self, device, batch, dim, seed=0):
        super().__init__(device, batch, dim, seed)
        import jax
        self.jax = jax
        platform_name = {"cuda": "gpu"}.get(device, device)
        try:
            self.dev = jax.devices(platform_name)[0]
        except RuntimeError as exc:
            raise ValueError(f"--device {device}: JAX has no such device here ({exc})") from None

    def convert(self, a):
        return self.jax.device_put(a, self.dev)

    def memory_method(self):
        return super().memory_method() if self.dev.platform == "cpu" else None

    def sync(self, out):
        return self.jax.block_until_ready(out)

    def forward(self, fn, engine=None):
        jitted = self.jax.jit(lambda q, k, v: fn(q, k, v))

        def run(q, k, v, g):
            with _engine_ctx(engine):          # the engine is read while tracing
                return self.sync(jitted(q, k, v))
        return run

    def forward_backward(self, fn, engine=None):
        import jax.numpy as jnp
        jax = self.jax
        grad = jax.jit(jax.grad(lambda q, k, v, g: jnp.sum(fn(q, k, v) * g), argnums=(0, 1, 2)))

        def run(q, k, v, g):
            with _engine_ctx(engine):
                return self.sync(grad(q, k, v, g))
        return run


def _make_backend(name, device, batch, dim) -> _Backend:
    if name == "numpy" and device != "cpu":
        raise ValueError(f"--backend numpy runs on the CPU only, not --device {device}")
    cls = {"numpy": _NumpyBackend, "torch": _TorchBackend, "jax": _JaxBackend}[name]
    return cls(device, batch, dim)


def installed_backends() -> list[str]:
    """The backends of :data:`_BACKENDS` whose library can be imported here."""
    return [b for b in _BACKENDS if importlib.util.find_spec(b) is not None]


def sweep_serves(backend: _Backend) -> tuple[bool, str]:
    """Whether the "sweep" engine serves this backend's arrays here, and why not."""
    from . import _engine
    if not _engine.sweep_available():
        return False, "the sweep engine needs numba"
    try:
        with _engine.use_engine("sweep"):
            _engine.engine_for(backend.inputs(4, batch=1)[0])
    except ValueError as exc:
        return False, str(exc)
    return True, ""


# -------------------------------------------------------------------------------------- the runs
@dataclass
class _Task:
    column: Column
    make: object            # backend -> closure(q, k, v, g) or raises
    inputs: object          # (backend, n) -> (q, k, v, g)
    probe: str | None       # memory method, None: no memory figure
    per_shape_compile: bool = False
    history: list = field(default_factory=list)     # (n, seconds) measured
    runner: object = None
    failed: str = ""


def _timed(run, args, *, repeats, min_time, probe, per_shape_compile):
    """Best time of up to ``repeats`` calls (fewer once ``min_time`` is spent) and the memory."""
    memory = Memory()
    if per_shape_compile:
        run(*args)                                    # compile for this shape, untimed
    if probe is not None and probe.separate:
        with probe:
            run(*args)
        memory = probe.result
    best, spent, calls = math.inf, 0.0, 0
    for i in range(max(repeats, 1)):
        wrap = probe if (i == 0 and probe is not None and not probe.separate) else None
        if wrap is not None:
            wrap.__enter__()
        start = time.perf_counter()
        out = run(*args)
        elapsed = time.perf_counter() - start
        if wrap is not None:
            wrap.__exit__(None, None, None)
            memory = wrap.result
        del out
        best, spent, calls = min(best, elapsed), spent + elapsed, calls + 1
        if spent >= min_time:
            break
    return Timing(best, calls=calls), memory


def _predict(history, n, quadratic):
    """Time at ``n`` extrapolated from the largest measured size (``L^2`` or ``L log L``)."""
    m, t = max(history)
    scale = (n / m) ** 2 if quadratic else (n * math.log2(n)) / (m * math.log2(m))
    return t * scale


def _machine_lines(backend: _Backend) -> list[str]:
    import numpy as np

    import slicedkern
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    lines = [f"slicedkern {slicedkern.__version__} bench on {platform.platform()}, Python "
             f"{platform.python_version()}",
             f"CPU: {cpu}, {os.cpu_count()} logical CPUs ({usable} usable)"]
    versions = [f"numpy {np.__version__}"]
    if importlib.util.find_spec("torch") is not None:
        import torch
        versions.append(f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
        if backend.device == "cuda" and torch.cuda.is_available():
            lines.append(f"GPU: {torch.cuda.get_device_name()}")
    if backend.name == "jax":
        versions.append(f"jax {backend.jax.__version__} ({backend.dev})")
    if importlib.util.find_spec("numba") is not None:
        import numba
        versions.append(f"numba {numba.__version__} ({numba.get_num_threads()} threads)")
    lines.append("versions: " + ", ".join(versions))
    return lines


def _build_tasks(backend: _Backend, engines: list[str], with_sdpa: bool, sdpa_device: str):
    import slicedkern
    from slicedkern import reference

    def same_inputs(b, n):
        return b.inputs(n)

    def hat(q, k, v):
        return slicedkern.hat_attention(q, k, v, _HAT_BANDWIDTH)

    probe = backend.memory_method()
    tasks = []
    for engine in engines:
        col = Column(f"relu_fwd:{engine}", "ReLU fwd", engine, always=True)
        mem = "rss" if (engine == "sweep" and probe == "tracemalloc") else probe   # numba: not traced
        tasks.append(_Task(col, lambda b, e=engine: b.forward(slicedkern.relu_attention, e),
                           same_inputs, mem))
    for engine in engines:
        col = Column(f"relu_fwdbwd:{engine}", "ReLU fwd+bwd", engine)
        tasks.append(_Task(col, lambda b, e=engine: b.forward_backward(slicedkern.relu_attention, e),
                           same_inputs, None))
    auto = _auto_engine(backend)
    tasks.append(_Task(Column("hat_fwd", "hat fwd", f"b={_HAT_BANDWIDTH:g} {auto}"),
                       lambda b: b.forward(hat), same_inputs, None))
    if with_sdpa:
        sdpa = _Sdpa(sdpa_device, backend)
        tasks.append(_Task(Column("sdpa", "SDPA fwd", "softmax", quadratic=True),
                           lambda b: sdpa.run, sdpa.inputs, sdpa.probe))
    tasks.append(_Task(Column("dense", "dense fwd", "ReLU O(L^2)", quadratic=True),
                       lambda b: b.forward(reference.relu_attention), same_inputs, probe))
    for t in tasks:
        t.per_shape_compile = backend.name == "jax" and t.column.key != "sdpa"
    return tasks


def _auto_engine(backend: _Backend) -> str:
    from . import _engine
    return _engine.engine_for(backend.inputs(4, batch=1)[0])


class _Sdpa:
    """torch ``scaled_dot_product_attention`` on ``(batch, 1, L, D)`` float32 inputs."""

    def __init__(self, device: str, backend: _Backend):
        import torch
        self.torch, self.backend = torch, backend
        self.dev = torch.device(device)
        if self.dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here")
        self.probe = "cuda" if self.dev.type == "cuda" else (
            "rss" if _proc_status("VmHWM") is not None else None)

    def inputs(self, backend, n):
        torch, b = self.torch, self.backend
        gen = torch.Generator().manual_seed(n)
        shape = (b.batch, 1, n, b.dim)
        return tuple(torch.randn(shape, generator=gen, dtype=torch.float32).to(self.dev)
                     for _ in range(3)) + (None,)

    def run(self, q, k, v, g):
        torch = self.torch
        with torch.no_grad():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        return out


def run_bench(*, backend: str | None = None, sizes=DEFAULT_SIZES, device: str = "cpu",
              batch: int = 8, dim: int = 64, repeats: int = 3, budget: float = 3.0,
              min_time: float = 1.0, progress: bool | None = None, stream=None) -> BenchResult:
    """Run the benchmark and return its results (nothing is printed but the progress bar).

    Parameters
    ----------
    backend : {"numpy", "torch", "jax"}, optional
        Array library of the sliced ops and the dense reference; default torch where installed,
        else NumPy.
    sizes : sequence of int
        Sequence lengths ``L`` (sorted increasingly).
    device : {"cpu", "cuda"}
        Device of the arrays (torch, JAX) and of SDPA.
    batch, dim : int
        Batch size and value dimension ``D``.
    repeats : int
        Most timed calls per cell; the best is reported. A cell stops early once its calls took
        ``min_time`` seconds in all.
    budget : float
        Seconds per call above which a cell is not run but extrapolated from the largest size
        measured (``L^2`` for SDPA and the dense reference, ``L log L`` for the others); the sliced
        ReLU forward is run up to 30 times the budget. ``math.inf`` runs everything.
    min_time : float
        See ``repeats``.
    progress : bool, optional
        Draw a progress bar on ``stream``; default: when ``stream`` is a terminal.
    stream : file, optional
        Stream of the progress bar (default ``sys.stderr``).

    Returns
    -------
    BenchResult
        Render it with :meth:`BenchResult.format`.

    Raises
    ------
    ValueError
        For a backend that is not installed or a device it does not have.
    """
    start = time.perf_counter()
    stream = sys.stderr if stream is None else stream
    if backend is None:
        backend = "torch" if importlib.util.find_spec("torch") is not None else "numpy"
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if importlib.util.find_spec(backend) is None:
        raise ValueError(f"backend {backend!r} is not installed here (installed: "
                         f"{', '.join(installed_backends())})")
    sizes = sorted({int(n) for n in sizes})
    if not sizes or sizes[0] < 2:
        raise ValueError(f"sizes must be integers >= 2, got {sizes}")
    bar = _Progress(1, stream, stream.isatty() if progress is None else progress)
    try:
        result = _run(bar, backend, sizes, device, batch, dim, repeats=repeats, budget=budget,
                      min_time=min_time)
    finally:
        bar.close()
    result.elapsed = time.perf_counter() - start
    return result


def _run(bar, backend, sizes, device, batch, dim, *, repeats, budget, min_time) -> BenchResult:
    """The body of :func:`run_bench`: set up the tasks, warm them up, then fill the table."""
    bar.show(f"importing {backend}" + (" and torch (SDPA)" if backend != "torch" and
                                       importlib.util.find_spec("torch") is not None else ""))
    be = _make_backend(backend, device, batch, dim)
    notes = []
    engines = ["scan"]
    serves, why = sweep_serves(be)
    if serves:
        engines.append("sweep")
    else:
        notes.append(f"sweep engine: not shown ({why})")
    with_sdpa = importlib.util.find_spec("torch") is not None
    if not with_sdpa:
        notes.append("SDPA: not shown (torch is not installed)")
    tasks = _build_tasks(be, engines, with_sdpa, device)
    result = BenchResult(
        config=dict(backend=backend, device=device, batch=batch, dim=dim, dtype="float32",
                    repeats=repeats, budget=budget),
        machine=_machine_lines(be), sizes=sizes, columns=[t.column for t in tasks], notes=notes)

    bar.total = len(tasks) * (len(sizes) + 1)
    for task in tasks:                      # warm-up: JIT compilation, lazy initialisation
        bar.show(f"warm-up {task.column.title} {task.column.sub}")
        try:
            task.runner = task.make(be)
            task.runner(*task.inputs(be, min(_TINY, sizes[0])))
        except Exception as exc:            # noqa: BLE001 - reported in the table, not fatal
            task.failed = f"{type(exc).__name__}: {exc}"
            notes.append(f"{task.column.title} {task.column.sub}: {_short(task.failed)}")
        bar.step()
    for n in sizes:
        for task in tasks:
            bar.show(f"L={n} {task.column.title} {task.column.sub}")
            timing, mem, error = _cell(task, be, n, repeats=repeats, budget=budget,
                                       min_time=min_time)
            result.times[n, task.column.key] = timing
            if error:
                notes.append(error)
            if mem is not None:
                result.memory[n, task.column.key] = mem
            bar.step()
    return result


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _cell(task: _Task, be: _Backend, n: int, *, repeats, budget, min_time):
    """Measure (or extrapolate, or skip) one cell: ``(Timing, Memory or None, error note)``."""
    if task.failed:
        return Timing(note="n/a"), None, ""
    if task.column.key == "dense" and n > _DENSE_MAX:
        return Timing(note="skip"), None, ""
    args = None
    try:
        if not task.history and n > _CALIBRATE:         # one call at a small size to extrapolate from
            args = task.inputs(be, _CALIBRATE)
            task.history.append((_CALIBRATE, _timed(
                task.runner, args, repeats=1, min_time=0.0, probe=None,
                per_shape_compile=task.per_shape_compile)[0].seconds))
        if task.history:
            guess = _predict(task.history, n, task.column.quadratic)
            if guess > budget * (_HEADLINE_FACTOR if task.column.always else 1):
                return Timing(guess, estimated=True), None, ""
        args = task.inputs(be, n)
        probe = _Probe(task.probe) if task.probe else None
        timing, memory = _timed(task.runner, args, repeats=repeats, min_time=min_time, probe=probe,
                                per_shape_compile=task.per_shape_compile)
    except Exception as exc:                # noqa: BLE001 - e.g. out of memory: reported, not fatal
        task.failed = f"{type(exc).__name__}: {exc}"
        return (Timing(note="n/a"), None,
                f"{task.column.title} {task.column.sub} at L={n}: {_short(task.failed)}")
    finally:
        args = None                 # free this cell's inputs (no gc.collect: costly after torch)
    task.history.append((n, timing.seconds))
    return timing, (memory if task.probe else None), ""


# ------------------------------------------------------------------------------------------- plot
def plot(result: BenchResult, path: str) -> None:
    """Save a log-log plot of time per call against ``L`` to ``path`` (needs matplotlib).

    Measured points are joined by solid lines; extrapolated ones are open markers on dotted lines.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for col in result.columns:
        pts = [(n, result.times[n, col.key]) for n in result.sizes
               if result.times.get((n, col.key), Timing()).seconds is not None]
        meas = [(n, t.seconds) for n, t in pts if not t.estimated]
        est = [(n, t.seconds) for n, t in pts if t.estimated]
        label = f"{col.title} ({col.sub})"
        line = None
        if meas:
            (line,) = ax.plot(*zip(*meas), "o-", label=label)
        if est:
            tail = meas[-1:] + est
            color = line.get_color() if line is not None else None
            ax.plot(*zip(*tail), ":", color=color)
            ax.plot(*zip(*est), "o", mfc="none", color=color,
                    label=None if line is not None else label + " (est.)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length L")
    ax.set_ylabel("seconds per call")
    c = result.config
    ax.set_title(f"slicedkern bench: {c['backend']} {c['device']}, batch {c['batch']}, D {c['dim']}, "
                 f"{c['dtype']} (open markers: extrapolated)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


# -------------------------------------------------------------------------------- command line
def _sizes_arg(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.replace(" ", "").split(",") if s]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError(f"sizes must be integers >= 2, got {text!r}")
    return sizes


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def description() -> str:
    """The description of ``python -m slicedkern bench --help``: this module's docstring, in part."""
    body = __doc__.split("\n\n", 1)[1].split("\n\nEverything framework-specific", 1)[0]
    return re.sub(r":\w+:`([^`]*)`", r"\1", body).replace("``", "").strip()   # plain text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``python -m slicedkern bench`` to ``parser``."""
    default_backend = "torch" if importlib.util.find_spec("torch") is not None else "numpy"
    parser.add_argument("--backend", choices=_BACKENDS, default=default_backend,
                        help=f"array library of the sliced ops and the dense reference "
                             f"(default: {default_backend}; installed: "
                             f"{', '.join(installed_backends())})")
    parser.add_argument("--sizes", type=_sizes_arg, default=list(DEFAULT_SIZES), metavar="L,L,...",
                        help="sequence lengths (default: %s)" % ",".join(map(str, DEFAULT_SIZES)))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="device of the arrays and of SDPA (default: cpu)")
    parser.add_argument("--batch", type=_positive_int, default=8, help="batch size (default: 8)")
    parser.add_argument("--dim", type=_positive_int, default=64,
                        help="value dimension D (default: 64)")
    parser.add_argument("--repeats", type=_positive_int, default=3,
                        help="most timed calls per cell, best reported; fewer once a cell took "
                             "--min-time seconds (default: 3)")
    parser.add_argument("--min-time", type=float, default=1.0, metavar="SECONDS",
                        help="stop repeating a cell once its calls took this long (default: 1)")
    parser.add_argument("--budget", type=float, default=3.0, metavar="SECONDS",
                        help="a cell is extrapolated (~) instead of run where one call would exceed "
                             "this (the sliced ReLU forward: 30 x this); inf runs everything "
                             "(default: 3)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also save a log-log plot of time vs L (needs matplotlib)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr (default: when stderr is a terminal)")


def main(args: argparse.Namespace, *, stdout=None, stderr=None) -> int:
    """Run the bench for parsed command-line ``args``; print the table (and save the plot).

    Parameters
    ----------
    args : argparse.Namespace
        From a parser set up by :func:`add_arguments`.
    stdout, stderr : file, optional
        Streams of the table and of the progress bar / errors.

    Returns
    -------
    int
        The exit status: 0, or 2 for a usage error (backend not installed, no such device,
        matplotlib missing for ``--plot``).
    """
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("error: --plot needs matplotlib: pip install matplotlib", file=stderr)
        return 2
    try:
        result = run_bench(backend=args.backend, sizes=args.sizes, device=args.device,
                           batch=args.batch, dim=args.dim, repeats=args.repeats, budget=args.budget,
                           min_time=args.min_time, progress=args.progress, stream=stderr)
    except ValueError as exc:
        print(f"error: {exc}", file=stderr)
        return 2
    print(result.format(), file=stdout)
    if args.plot:
        plot(result, args.plot)
        print(f"plot saved to {args.plot}", file=stdout)
    return 0
