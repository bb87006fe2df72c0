"""The runner: which columns to time on a backend, and the loop that fills the table.

Every cell is measured, extrapolated (one call would exceed the budget) or skipped (the dense
reference above :data:`DENSE_MAX`); a failing column is reported in the footer, never fatal.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TextIO

import numpy as np

import slicedkern
from slicedkern import engines, reference
from slicedkern._lib.backends import Backend

from .backends import (
    BACKEND_NAMES,
    BenchBackend,
    NumpySoftmax,
    Sdpa,
    default_backend,
    installed_backends,
    make_backend,
)
from .measure import Probe, Progress, predict, timed
from .results import SOFTMAX_KEYS, BenchResult, Column, Memory, Timing

__all__ = ["DEFAULT_SIZES", "HEADLINE_FACTOR", "DENSE_MAX", "run_bench", "sweep_serves"]

#: Sequence lengths of the default run.
DEFAULT_SIZES = (1024, 4096, 16384, 65536)
#: Largest L of the dense reference, which holds (batch, L, L) float64 matrices.
DENSE_MAX = 4096
#: The sliced ReLU forward (the headline) is extrapolated only beyond this many times the budget.
HEADLINE_FACTOR = 30
_HAT_BANDWIDTH = 0.5
_TINY = 64                 # sequence length of the warm-up calls (JIT compilation, lazy init)
_CALIBRATE = 1024          # a baseline first asked for above this is timed here to extrapolate


@dataclass
class Task:
    """One column being filled: how to build its call, its inputs, what it measured so far."""

    column: Column
    make: Callable          # backend -> closure(q, k, v, g), or raises
    inputs: Callable        # (backend, n) -> (q, k, v, g)
    probe: str | None       # memory method, None: no memory figure
    per_shape_compile: bool = False
    history: list = field(default_factory=list)     # (n, seconds) measured
    runner: Callable | None = None
    failed: str = ""


def sweep_serves(backend: BenchBackend) -> tuple[bool, str]:
    """Whether the "sweep" engine serves this backend's arrays here, and why not.

    Parameters
    ----------
    backend : BenchBackend
        The backend, on its device.

    Returns
    -------
    bool, str
        True and ``""``, or False and the reason.
    """
    if backend.device == "cpu" and "sweep" in engines.available(backend.library):
        return True, ""
    # available() answers for CPU arrays only; the registry's refusal of a real array says why
    # (numba missing, a JAX array, a CUDA tensor) in the words an op call would raise.
    try:
        engines.select(None, backend.inputs(4, batch=1)[:1], "sweep")
    except ValueError as exc:
        return False, str(exc).removeprefix("argument 'engine': ")
    return False, f"the sweep engine does not serve {backend.library} arrays here"


def _auto_engine(backend: BenchBackend) -> str:
    """The engine the library picks for this backend's arrays when none is asked for."""
    return engines.engine_for(backend.inputs(4, batch=1)[0])


def _build_tasks(backend: BenchBackend, engine_names: list[str], with_sdpa: bool,
                 sdpa_device: str) -> list[Task]:
    def same_inputs(b, n):
        return b.inputs(n)

    def relu(engine):
        return functools.partial(slicedkern.relu_attention, engine=engine)

    def hat(q, k, v):
        return slicedkern.hat_attention(q, k, v, _HAT_BANDWIDTH)

    probe = backend.memory_method()
    tasks = []
    for engine in engine_names:
        col = Column(f"relu_fwd:{engine}", "ReLU fwd", engine, always=True)
        mem = "rss" if (engine == "sweep" and probe == "tracemalloc") else probe   # numba: not traced
        tasks.append(Task(col, lambda b, e=engine: b.forward(relu(e)), same_inputs, mem))
    for engine in engine_names:
        col = Column(f"relu_fwdbwd:{engine}", "ReLU fwd+bwd", engine)
        tasks.append(Task(col, lambda b, e=engine: b.forward_backward(relu(e)), same_inputs, None))
    auto = _auto_engine(backend)
    tasks.append(Task(Column("hat_fwd", "hat fwd", f"b={_HAT_BANDWIDTH:g} {auto}"),
                      lambda b: b.forward(hat), same_inputs, None))
    if with_sdpa:
        sdpa = Sdpa(sdpa_device, backend)
        tasks.append(Task(Column("sdpa", "SDPA fwd", "softmax", quadratic=True),
                          lambda b: sdpa.run, sdpa.inputs, sdpa.probe))
    else:
        # without torch the softmax baseline is a NumPy one: the headline comparison holds on every install
        softmax = NumpySoftmax(backend)
        tasks.append(Task(Column("softmax", "softmax fwd", "NumPy", quadratic=True),
                          lambda b: softmax.run, softmax.inputs, softmax.probe))
    tasks.append(Task(Column("dense", "dense fwd", "ReLU O(L^2)", quadratic=True),
                      lambda b: b.forward(reference.relu_attention), same_inputs, probe))
    for t in tasks:
        # SDPA runs on torch whatever the backend: it is not jitted, so nothing to compile per shape
        t.per_shape_compile = backend.member is Backend.JAX and t.column.key not in SOFTMAX_KEYS
    return tasks


def _machine_lines(backend: BenchBackend) -> list[str]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:                  # not on Linux
        usable = os.cpu_count()
    lines = [f"slicedkern {slicedkern.__version__} bench on {platform.platform()}, Python "
             f"{platform.python_version()}",
             f"CPU: {cpu}, {os.cpu_count()} logical CPUs ({usable} usable)"]
    versions = [f"numpy {np.__version__}"]
    if Backend.TORCH.installed():
        import torch
        versions.append(f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
        if backend.device == "cuda" and torch.cuda.is_available():
            lines.append(f"GPU: {torch.cuda.get_device_name()}")
    if backend.member is Backend.JAX:
        versions.append(f"jax {backend.jax.__version__} ({backend.dev})")
    if importlib.util.find_spec("numba") is not None:
        import numba
        versions.append(f"numba {numba.__version__} ({numba.get_num_threads()} threads)")
    lines.append("versions: " + ", ".join(versions))
    return lines


def run_bench(*, backend: str | None = None, sizes: Iterable[int] = DEFAULT_SIZES,
              device: str = "cpu", batch: int = 8, dim: int = 64, repeats: int = 3,
              budget: float = 3.0, min_time: float = 1.0, progress: bool | None = None,
              stream: TextIO | None = None) -> BenchResult:
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
        backend = default_backend()
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
    if not Backend(backend).installed():
        raise ValueError(f"backend {backend!r} is not installed here (installed: "
                         f"{', '.join(installed_backends())})")
    sizes = sorted({int(n) for n in sizes})
    if not sizes or sizes[0] < 2:
        raise ValueError(f"sizes must be integers >= 2, got {sizes}")
    bar = Progress(1, stream, stream.isatty() if progress is None else progress)
    try:
        result = _run(bar, backend, sizes, device, batch, dim, repeats=repeats, budget=budget,
                      min_time=min_time)
    finally:
        bar.close()
    result.elapsed = time.perf_counter() - start
    return result


def _run(bar: Progress, backend: str, sizes: list[int], device: str, batch: int, dim: int, *,
         repeats: int, budget: float, min_time: float) -> BenchResult:
    """The body of :func:`run_bench`: set up the tasks, warm them up, then fill the table."""
    with_sdpa = Backend.TORCH.installed()
    bar.show(f"importing {backend}" + (" and torch (SDPA)" if backend != "torch" and with_sdpa
                                       else ""))
    be = make_backend(backend, device, batch, dim)
    notes = []
    engine_names = ["scan"]
    serves, why = sweep_serves(be)
    if serves:
        engine_names.append("sweep")
    else:
        notes.append(f"sweep engine: not shown ({why})")
    if not with_sdpa:
        notes.append("softmax: SDPA needs torch (not installed here); the softmax column is the same "
                     "attention written in NumPy, float32")
    tasks = _build_tasks(be, engine_names, with_sdpa, device)
    result = BenchResult(
        config=dict(backend=backend, device=device, batch=batch, dim=dim, dtype="float32",
                    repeats=repeats, budget=budget, headline_factor=HEADLINE_FACTOR,
                    dense_max=DENSE_MAX, gradients=be.gradients),
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


def _cell(task: Task, be: BenchBackend, n: int, *, repeats: int, budget: float,
          min_time: float) -> tuple[Timing, Memory | None, str]:
    """Measure (or extrapolate, or skip) one cell: ``(Timing, Memory or None, error note)``."""
    if task.failed:
        return Timing(note="n/a"), None, ""
    if task.column.key == "dense" and n > DENSE_MAX:
        return Timing(note="skip"), None, ""
    args = None
    try:
        if not task.history and n > _CALIBRATE:         # one call at a small size to extrapolate from
            args = task.inputs(be, _CALIBRATE)
            task.history.append((_CALIBRATE, timed(
                task.runner, args, repeats=1, min_time=0.0, probe=None,
                per_shape_compile=task.per_shape_compile)[0].seconds))
        if task.history:
            guess = predict(task.history, n, task.column.quadratic)
            if guess > budget * (HEADLINE_FACTOR if task.column.always else 1):
                return Timing(guess, estimated=True), None, ""
        args = task.inputs(be, n)
        probe = Probe(task.probe) if task.probe else None
        timing, memory = timed(task.runner, args, repeats=repeats, min_time=min_time, probe=probe,
                               per_shape_compile=task.per_shape_compile)
    except Exception as exc:                # noqa: BLE001 - e.g. out of memory: reported, not fatal
        task.failed = f"{type(exc).__name__}: {exc}"
        return (Timing(note="n/a"), None,
                f"{task.column.title} {task.column.sub} at L={n}: {_short(task.failed)}")
    finally:
        args = None                 # free this cell's inputs (no gc.collect: costly after torch)
    task.history.append((n, timing.seconds))
    return timing, (memory if task.probe else None), ""
