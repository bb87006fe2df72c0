"""Copy the measured ``python -m slicedkern bench`` output of ``README.md`` into the docs.

The README holds the reference run (a test keeps its version line equal to the package's); the
Benchmarks page includes :func:`write`'s copy of it, taken at every build, so that the site and
the README cannot disagree. :func:`table` also reads the time table back as numbers, for the plot.
"""

from __future__ import annotations

import os
import re

__all__ = ["bench_output", "table", "write"]


def bench_output(readme: str) -> str:
    """The first fenced block of ``readme`` that is a bench run (its header says "bench on")."""
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", readme, flags=re.MULTILINE | re.DOTALL):
        if re.search(r"^slicedkern \S+ bench on ", block, flags=re.MULTILINE):
            return block
    raise ValueError("README.md shows no output of 'python -m slicedkern bench'")


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}


def _seconds(cell: str) -> tuple[float | None, bool]:
    """``(seconds, extrapolated)`` of a cell such as ``5.83 ms`` or ``~3.38 s``; None for skip."""
    m = re.fullmatch(r"(~?)([0-9.]+) (ns|us|µs|ms|s)", cell.strip())
    if not m:
        return None, False
    return float(m.group(2)) * _UNITS[m.group(3)], bool(m.group(1))


def table(output: str) -> tuple[list[str], dict[int, list[tuple[float | None, bool]]]]:
    """The "time per call" table of a bench run: column names and, per length, the cells."""
    lines = output.split("\n")
    start = lines.index("time per call")
    head1, head2, rule = lines[start + 1], lines[start + 2], lines[start + 3]
    spans = [(m.start(), m.end()) for m in re.finditer(r"-+", rule)]
    names = [f"{head1[a:b].strip()} {head2[a:b].strip()}".strip() for a, b in spans[1:]]
    rows = {}
    for line in lines[start + 4:]:
        if not line.strip():
            break
        rows[int(line[spans[0][0]:spans[0][1]])] = [_seconds(line[a:b]) for a, b in spans[1:]]
    return names, rows


def write(readme_path: str, path: str) -> str:
    """Write the README's bench output to ``path``; return it."""
    with open(readme_path, encoding="utf-8") as f:
        output = bench_output(f.read())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(output)
    return output


def plot(output: str, path: str) -> None:
    """Save a log-log plot of the time table: measured points filled, extrapolated ones hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, rows = table(output)
    lengths = sorted(rows)
    fig, ax = plt.subplots(figsize=(8, 4.8), layout="constrained")
    for j, name in enumerate(names):
        points = [(n, rows[n][j]) for n in lengths if rows[n][j][0] is not None]
        xs = [n for n, _ in points]
        ys = [t for _, (t, _) in points]
        (line,) = ax.loglog(xs, ys, "-", lw=1.5, label=name)
        for n, (t, extrapolated) in points:
            ax.plot(n, t, "o", color=line.get_color(), mfc="white" if extrapolated else line.get_color())
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set_xlabel("sequence length L")
    ax.set_ylabel("time per call (s)")
    ax.set_title("python -m slicedkern bench (hollow: extrapolated past the budget)", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.savefig(path, dpi=110)
    plt.close(fig)
