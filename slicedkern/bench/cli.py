"""The options of ``python -m slicedkern bench``, and the command itself."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import TextIO

from .backends import BACKEND_NAMES, default_backend, installed_backends
from .causal import CAUSAL_SIZES, DECODE_SIZES, run_causal
from .results import plot
from .run import DEFAULT_SIZES, HEADLINE_FACTOR, run_bench
from .stats import STATS_SIZES, run_stats

__all__ = ["add_arguments", "main"]


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``python -m slicedkern bench`` to ``parser``.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The ``bench`` subcommand's parser.
    """
    default = default_backend()
    parser.add_argument("--backend", choices=BACKEND_NAMES, default=default,
                        help=f"array library of the sliced ops and the dense reference "
                             f"(default: {default}; installed: "
                             f"{', '.join(installed_backends())})")
    parser.add_argument("--sizes", type=_sizes_arg, default=list(DEFAULT_SIZES), metavar="L,L,...",
                        help=f"sequence lengths (default: {','.join(map(str, DEFAULT_SIZES))})")
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
                        help=f"a cell is extrapolated (~) instead of run where one call would "
                             f"exceed this (the sliced ReLU forward: {HEADLINE_FACTOR} x this); "
                             f"inf runs everything (default: 3)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also save a log-log plot of time vs L (needs matplotlib)")
    parser.add_argument("--stats", action="store_true",
                        help="instead of attention, time the two-sample statistics (NumPy): the 1-D "
                             "energy distance next to SciPy and a plain NumPy version, and the "
                             "energy distance in R^3 (sliced, exact, auto, SciPy cdist)")
    parser.add_argument("--stats-sizes", type=_sizes_arg, default=list(STATS_SIZES), metavar="N,N,...",
                        help=f"n = m of the 1-D statistics (default: {','.join(map(str, STATS_SIZES))})")
    parser.add_argument("--causal", action="store_true",
                        help="instead, time causal attention next to SDPA(is_causal=True) and per-token "
                             "decoding (DecodeCache) next to a softmax KV-cache step (torch, CPU); "
                             "--batch, --dim, --repeats and --budget apply")
    parser.add_argument("--causal-sizes", type=_sizes_arg, default=list(CAUSAL_SIZES), metavar="L,L,...",
                        help=f"sequence lengths of --causal (default: {','.join(map(str, CAUSAL_SIZES))})")
    parser.add_argument("--decode-sizes", type=_sizes_arg, default=list(DECODE_SIZES), metavar="N,N,...",
                        help=f"cache lengths of --causal's decoding table "
                             f"(default: {','.join(map(str, DECODE_SIZES))})")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr (default: when stderr is a terminal)")


def main(args: argparse.Namespace, *, stdout: TextIO | None = None,
         stderr: TextIO | None = None) -> int:
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
    if getattr(args, "stats", False):
        print(run_stats(sizes=args.stats_sizes, repeats=args.repeats), file=stdout)
        return 0
    if getattr(args, "causal", False):
        try:
            table = run_causal(sizes=args.causal_sizes, decode_sizes=args.decode_sizes, batch=args.batch,
                               dim=args.dim, repeats=args.repeats, budget=args.budget)
        except ValueError as exc:
            print(f"error: {exc}", file=stderr)
            return 2
        print(table, file=stdout)
        return 0
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        # said before the run, not after minutes of timing
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
