"""``python -m slicedkern bench --stats``: the two-sample statistics next to their peers (NumPy).

* The 1-D energy distance of ``n = m`` samples of N(0, 1) (unweighted and with U(0, 1) weights):
  :func:`slicedkern.energy_distance`, ``scipy.stats.energy_distance(...) ** 2`` and the plain NumPy
  version (argsort of the pooled sample, cumulative weights, one dot product), with the relative
  error of each against a long-double evaluation whose CDF gap is an exact integer (unweighted
  rows; scripts/energy_distance_1d.py checks weighted ones).
* The energy distance in R^3 with ``P = 256`` random directions: ``method="sliced"``, ``"exact"``
  (the compiled dense sums on NumPy, with numba), ``"auto"`` (and which one it took), and the dense
  statistic from SciPy's ``cdist`` (``n m`` memory).
* The sliced energy distance in R^10 with ``P = 256`` fixed directions, the same data on NumPy
  (float64) and torch (float32 and float64, CPU), where torch is installed: the time of each and its
  ratio to NumPy's (where torch had once been measured at 5-6x NumPy's time).

Times are the best of ``repeats`` calls, the methods interleaved in each repeat (fair on a busy
machine). SciPy is optional: its rows are left out without it.
"""

from __future__ import annotations

import importlib.util
import time

import numpy as np

from ..backends import compiled_energy_pairs
from ..sliced import directions as make_directions
from ..sliced import energy_distance
from ..sliced.stats import SLICE_COST, SLICE_COST_COMPILED, _method

__all__ = ["STATS_SIZES", "STATS_RD_SIZES", "STATS_SLICED_SIZES", "run_stats"]

STATS_SIZES = (100_000, 1_000_000)
STATS_RD_SIZES = (500, 2000)
STATS_SLICED_SIZES = (20_000,)
_SLICED_DIM = 10
_DIRECTIONS = 256


def _plain_numpy(x, y, a, b):
    a = np.full(x.size, 1.0 / x.size) if a is None else a / a.sum()
    b = np.full(y.size, 1.0 / y.size) if b is None else b / b.sum()
    z = np.concatenate([x, y])
    order = np.argsort(z)
    d = np.cumsum(np.concatenate([a, -b])[order])[:-1]
    return 2.0 * np.dot(d * d, np.diff(z[order]))


def _oracle_unweighted(x, y) -> np.longdouble:
    n, m = x.size, y.size
    z = np.concatenate([x, y])
    order = np.argsort(z, kind="stable")
    i = np.cumsum(order < n)
    e = i * m - (np.arange(1, n + m + 1) - i) * n                     # exact integers
    d = (e.astype(np.longdouble) / (np.longdouble(n) * np.longdouble(m)))[:-1]
    zs = z[order].astype(np.longdouble)
    return 2 * np.sum(d * d * (zs[1:] - zs[:-1]))


def _peers_1d() -> dict:
    peers = {"slicedkern": lambda x, y, a, b: energy_distance(x, y, x_weights=a, y_weights=b)}
    if importlib.util.find_spec("scipy") is not None:
        from scipy.stats import energy_distance as scipy_ed
        peers["scipy"] = lambda x, y, a, b: scipy_ed(x, y, a, b) ** 2
    peers["plain numpy"] = _plain_numpy
    return peers


def _peers_rd() -> dict:
    peers = {f"slicedkern {m}": (lambda m: lambda x, y: energy_distance(x, y, directions=_DIRECTIONS, seed=0,
                                                                          method=m))(m)
             for m in ("sliced", "exact", "auto")}
    if importlib.util.find_spec("scipy") is not None:
        from scipy.spatial.distance import cdist
        peers["scipy cdist (dense)"] = lambda x, y: 2 * cdist(x, y).mean() - cdist(x, x).mean() - cdist(y, y).mean()
    return peers


def _interleaved(peers: dict, args: tuple, repeats: int) -> tuple[dict, dict]:
    best, values = {}, {}
    for _ in range(max(repeats, 1)):
        for name, fn in peers.items():
            start = time.perf_counter()
            values[name] = fn(*args)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    return best, values


def _sliced_across_libraries(sizes, repeats: int, rng) -> list[str]:
    """The sliced energy distance on NumPy and on torch, the same points and directions."""
    if importlib.util.find_spec("torch") is None:
        return []
    import torch

    theta = make_directions(_DIRECTIONS, _SLICED_DIM, seed=0)
    lines = ["", f"Sliced energy distance in R^{_SLICED_DIM}, n = m, P = {_DIRECTIONS} fixed directions, NumPy "
             f"against torch on the CPU ({torch.get_num_threads()} torch threads); time: best of {repeats}, "
             "interleaved", "", "| n = m | library | time (ms) | time / NumPy | value |", "|---:|---|---:|---:|---:|"]
    for n in sizes:
        x, y = rng.normal(size=(n, _SLICED_DIM)), rng.normal(size=(n, _SLICED_DIM)) + 0.1
        cases = {"NumPy float64": (x, y, theta)}
        for dtype in (torch.float32, torch.float64):
            cases[f"torch {str(dtype).split('.')[-1]}"] = tuple(torch.tensor(a, dtype=dtype) for a in (x, y, theta))
        peers = {name: (lambda args: lambda: energy_distance(args[0], args[1], directions=args[2]))(args)
                 for name, args in cases.items()}
        for fn in peers.values():
            fn()                                                        # first call: compile / load
        best, values = _interleaved(peers, (), repeats)
        for name in peers:
            lines.append(f"| {n} | {name} | {best[name] * 1e3:.1f} | {best[name] / best['NumPy float64']:.2f} | "
                         f"{float(values[name]):.6g} |")
    return lines


def run_stats(*, sizes=STATS_SIZES, rd_sizes=STATS_RD_SIZES, sliced_sizes=STATS_SLICED_SIZES, repeats: int = 3,
              seed: int = 0) -> str:
    """Run both sections and return them as Markdown tables (module docstring).

    Parameters
    ----------
    sizes : sequence of int
        ``n = m`` of the 1-D section.
    rd_sizes : sequence of int
        ``n = m`` of the R^3 section.
    sliced_sizes : sequence of int
        ``n = m`` of the NumPy-against-torch section (left out without torch).
    repeats : int
        Timed calls per method and size (the best is reported).
    seed : int
        Seed of the data.

    Returns
    -------
    str
    """
    rng = np.random.default_rng(seed)
    peers = _peers_1d()
    energy_distance(rng.normal(size=8), rng.normal(size=8), x_weights=rng.random(8))     # compile / load
    energy_distance(rng.normal(size=8), rng.normal(size=8))
    lines = ["1-D energy distance, n = m samples of N(0, 1); time: best of "
             f"{repeats}, methods interleaved", "",
             "| n = m | weights | method | time (ms) | time / slicedkern | relative error |",
             "|---:|---|---|---:|---:|---:|"]
    for n in sizes:
        for weighted in (False, True):
            x, y = rng.normal(size=n), rng.normal(size=n)
            a, b = (rng.random(n), rng.random(n)) if weighted else (None, None)
            best, values = _interleaved(peers, (x, y, a, b), repeats)
            reference = None if weighted else _oracle_unweighted(x, y)
            for name in peers:
                error = ("-" if reference is None else
                         f"{float(abs(np.longdouble(float(values[name])) - reference) / reference):.1e}")
                lines.append(f"| {n} | {'U(0, 1)' if weighted else 'none'} | {name} | {best[name] * 1e3:.1f} | "
                             f"{best[name] / best['slicedkern']:.2f} | {error} |")
    energy_distance(rng.normal(size=(8, 3)), rng.normal(size=(8, 3)), method="exact")   # compile / load
    peers = _peers_rd()
    compiled = compiled_energy_pairs(np, np.ones(1))
    rule = (f"(nm + (n^2 + m^2) / 2)(d + 5) <= {SLICE_COST_COMPILED:g}" if compiled
            else f"(n^2 + nm + m^2)(d + 3) <= {SLICE_COST:g}")
    lines += ["", f"Energy distance in R^3, n = m, P = {_DIRECTIONS} random directions ("
              f"{'compiled' if compiled else 'blockwise'} exact sums; auto rule: exact when {rule} "
              "P N (log2 N + d))", "",
              "| n = m | method | time (ms) | value |", "|---:|---|---:|---:|"]
    for n in rd_sizes:
        x, y = rng.normal(size=(n, 3)), rng.normal(size=(n, 3)) + 0.1
        best, values = _interleaved(peers, (x, y), repeats)
        took = _method("auto", _DIRECTIONS, n, n, 3, values_only=False, traced=False, compiled=compiled)
        for name in peers:
            label = f"{name} ({took})" if name.endswith("auto") else name
            lines.append(f"| {n} | {label} | {best[name] * 1e3:.1f} | {float(values[name]):.6g} |")
    lines += _sliced_across_libraries(sliced_sizes, repeats, rng)
    return "\n".join(lines)
