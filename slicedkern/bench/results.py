"""What a bench run measured, and its rendering: the two tables, the footer and the plot.

Nothing here imports a framework (matplotlib only inside :func:`plot`), so a result can be
rendered, and this module imported, wherever the package is.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

__all__ = ["Column", "Timing", "Memory", "BenchResult", "MEMORY_METHODS", "SOFTMAX_KEYS", "plot"]

#: The softmax-attention baselines: torch's SDPA where torch is installed, else a NumPy softmax.
SOFTMAX_KEYS = ("sdpa", "softmax")


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
        The headline (the sliced ReLU forward): extrapolated only where one call would exceed
        ``headline_factor`` times the per-call budget; the other columns are extrapolated instead
        of run where one call would exceed the budget.
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
        ``"tracemalloc"``, ``"rss"`` or ``"cuda"`` (see :data:`MEMORY_METHODS`).
    """

    nbytes: int | None = None
    method: str = ""


#: How each memory probe measures, as the footer explains it.
MEMORY_METHODS = {
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
        backend, device, batch, dim, dtype, repeats, budget; and the rules the run applied, which
        the footer states: headline_factor, dense_max, gradients (how fwd+bwd is computed).
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
        lines += render([("L", "")] + [(col.title, col.sub) for col in self.columns],
                        [[str(n)] + [format_time(self.times.get((n, col.key), Timing()))
                                     for col in self.columns] for n in self.sizes])
        lines.append("")
        baselines = [k for k in (*SOFTMAX_KEYS, "dense") if self.column(k)]
        mem_keys = self.sliced_forward_keys() + baselines
        speed_keys = baselines
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
                row.append(format_memory(self.memory.get((n, k), Memory())))
            body.append(row)
        lines.append("speed-up of sliced ReLU attention (fastest engine, forward) and peak memory "
                     "(forward)")
        lines += render(head, body)
        lines.append("")
        lines += self._footer()
        return "\n".join(lines)

    def _footer(self) -> list[str]:
        c = self.config
        out = [
            "notes:",
            "  sliced attention gets one score per token, q, k: (batch, L), v: (batch, L, D); softmax "
            "attention gets its natural inputs q, k, v: (batch, 1, L, D) (one head): the same L and D; the "
            "projections that make the scores are not timed.",
            f"  '~' = not run because one call would take over --budget {c['budget']:g} s: "
            f"extrapolated from the largest L measured (x L^2 for softmax and dense, x L log L for the "
            f"others; the sliced ReLU forward is measured up to {c['headline_factor']} x the "
            f"budget).",
            f"  'skip' = dense reference not run above L = {c['dense_max']} (O(L^2) float64 memory).",
            "  'n/a' = not available here (engine not for this device or without numba, op failed).",
            "  speed-up = baseline forward time / fastest sliced ReLU forward time.",
            "  fwd+bwd = the forward and the gradients of sum(g * out) with respect to q, k and v: "
            + c["gradients"],
        ]
        used = sorted({m.method for m in self.memory.values() if m.nbytes is not None})
        for method in used:
            out.append("  peak memory, " + MEMORY_METHODS[method])
        out += ["  " + note for note in self.notes]
        out.append(f"total bench time {self.elapsed:.1f} s")
        return [w for line in out for w in textwrap.wrap(
            line, width=100, subsequent_indent="    " if line.startswith("  ") else "",
            drop_whitespace=True) or [""]]


def format_time(t: Timing) -> str:
    """A cell of the time table: ``"12.3 ms"``, ``"~4.1 s"`` (extrapolated), ``"skip"``, ``"n/a"``."""
    if t.seconds is None:
        return t.note if t.note in ("skip",) else "n/a"
    s = t.seconds
    text = (f"{s * 1e6:.3g} us" if s < 1e-3 else f"{s * 1e3:.3g} ms" if s < 1
            else f"{s:.3g} s")
    return ("~" + text) if t.estimated else text


def format_memory(m: Memory) -> str:
    """A peak-memory cell: MiB and the tag of the probe that measured it, or ``"n/a"``."""
    if m.nbytes is None:
        return "n/a"
    return f"{m.nbytes / 2 ** 20:.1f} {_MEMORY_TAGS[m.method]}"


def render(head: list[tuple[str, str]], body: list[list[str]]) -> list[str]:
    """A right-aligned text table with a two-line header."""
    widths = [max(len(h[0]), len(h[1]), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = [fmt.format(*(h[0] for h in head)), fmt.format(*(h[1] for h in head)),
             "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*row) for row in body]
    return lines


def plot(result: BenchResult, path: str) -> None:
    """Save a log-log plot of time per call against ``L`` to ``path`` (needs matplotlib).

    Measured points are joined by solid lines; extrapolated ones are open markers on dotted lines.

    Parameters
    ----------
    result : BenchResult
        A finished run.
    path : str
        The image file; its extension picks the format.
    """
    # matplotlib's object API without pyplot: no GUI backend is chosen, no global figure kept.
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
