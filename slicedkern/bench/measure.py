"""How the bench measures: best-of timing, peak-memory probes, extrapolation, the progress bar.

Framework-free: torch is imported only by the CUDA memory probe, when it is used.
"""

from __future__ import annotations

import gc
import math
import shutil
import time
from collections.abc import Callable
from typing import TextIO

from .results import Memory, Timing

__all__ = ["Progress", "Probe", "proc_status", "timed", "predict"]


class Progress:
    """A one-line progress bar on a stream (a terminal), redrawn with carriage returns.

    Parameters
    ----------
    total : int
        Number of steps (may be raised later through the attribute, once it is known).
    stream : file
        Where to draw.
    enabled : bool
        False draws nothing (a stream that is not a terminal would keep every redraw).
    """

    def __init__(self, total: int, stream: TextIO, enabled: bool):
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
def proc_status(field_name: str) -> int | None:
    """A size field of ``/proc/self/status`` (``"VmRSS"``, ``"VmHWM"``) in bytes; None off Linux."""
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
        # Without the trim, pages freed by earlier cells still count in the RSS the peak starts from.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class Probe:
    """Measures the peak extra memory of one call, by ``method``; a context manager.

    ``separate`` probes (tracemalloc) slow the call down and run it once more outside the timings;
    the others wrap the first timed call. After the block, :attr:`result` holds the
    :class:`~slicedkern.bench.results.Memory`.

    Parameters
    ----------
    method : {"tracemalloc", "rss", "cuda"} or None
        None measures nothing (the result's ``nbytes`` stays None).
    """

    def __init__(self, method: str | None):
        self.method = method
        self.separate = method == "tracemalloc"
        self.result = Memory(None, method or "")

    def __enter__(self) -> Probe:
        gc.collect(0)               # a full collection costs ~0.5 s once torch is imported
        self.base = None
        if self.method == "tracemalloc":
            import tracemalloc
            tracemalloc.start()
            self.base = tracemalloc.get_traced_memory()[0]
        elif self.method == "rss":
            if _reset_peak_rss():
                self.base = proc_status("VmRSS")
        elif self.method == "cuda":
            import torch
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc) -> bool:
        self.result = Memory(None, self.method or "")
        if self.method == "tracemalloc":
            import tracemalloc
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            self.result.nbytes = max(peak - self.base, 0)
        elif self.method == "rss" and self.base is not None:
            peak = proc_status("VmHWM")
            if peak is not None:
                self.result.nbytes = max(peak - self.base, 0)
        elif self.method == "cuda":
            import torch
            torch.cuda.synchronize()
            self.result.nbytes = max(torch.cuda.max_memory_allocated() - self.base, 0)
        return False


# ----------------------------------------------------------------------------------------- timing
def timed(run: Callable, args: tuple, *, repeats: int, min_time: float, probe: Probe | None,
          per_shape_compile: bool) -> tuple[Timing, Memory]:
    """Best time of up to ``repeats`` calls of ``run(*args)`` and the peak memory of one.

    Parameters
    ----------
    run : callable
        The call to time; it returns once its result is computed (the backends synchronise).
    args : tuple
        Its arguments.
    repeats : int
        Most timed calls; fewer once they took ``min_time`` seconds in all.
    min_time : float
        See ``repeats``.
    probe : Probe or None
        Memory probe: a separate call for ``probe.separate`` ones, else around the first timed call.
    per_shape_compile : bool
        Make one untimed call first (JAX compiles once per input shape).

    Returns
    -------
    Timing, Memory
    """
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


def predict(history: list[tuple[int, float]], n: int, quadratic: bool) -> float:
    """Time at ``n`` extrapolated from the largest measured size (``L^2`` or ``L log L``).

    Parameters
    ----------
    history : list of (int, float)
        ``(L, seconds)`` measured so far; not empty.
    n : int
        The size to predict.
    quadratic : bool
        Scale as ``L^2`` instead of ``L log L``.

    Returns
    -------
    float
    """
    m, t = max(history)
    scale = (n / m) ** 2 if quadratic else (n * math.log2(n)) / (m * math.log2(m))
    return t * scale
