"""Torch CPU timings of causal sliced ReLU attention (issue 13), all in one run, interleaved.

For ``--rows`` x ``--length`` float32 scores and ``D`` values (default 8 x 65536, D = 64):
``relu_attention`` forward and forward + backward, causal and not, next to
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` on (rows, 1 head, L, D)
float32 queries, keys and values (forward and forward + backward). SDPA costs ``O(L^2 D)``: where a
run would take longer than ``--sdpa-budget`` seconds it is measured at the largest power-of-two
length that fits and scaled by ``(L / L0)^2`` (printed as *extrapolated*).

The methods are timed round-robin (one repeat of each in turn), and the minimum of ``--repeats`` is
reported, so that a shared, loaded machine biases every method alike. ``--clock process`` (with
``--threads 1``) reports CPU seconds of the process instead of wall seconds: on a machine shared with
other jobs, wall time mostly measures the waiting.

Usage (from the repository root): ``PYTHONPATH=. python scripts/causal_bench.py [--rows 8]
[--length 65536] [--dim 64] [--repeats 3] [--threads 1 --clock process] [--causal-engines
sweep,scan]`` (``--causal-engines``: the causal rows on each engine named, ``auto`` the default
rule's); decoding:
``... --decode 10,14,18,20 [--steps 256]``
"""

from __future__ import annotations

import argparse
import time

import torch

import slicedkern
from slicedkern.bench.causal import run_causal

CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
_clock = time.perf_counter


def _timed(fn):
    start = _clock()
    fn()
    return _clock() - start


def _sliced(q, k, v, *, causal, backward, engine=None):
    def run():
        if backward:
            args = [a.detach().requires_grad_() for a in (q, k, v)]
            out = slicedkern.relu_attention(*args, causal=causal, engine=engine)
            out.sum().backward()
        else:
            with torch.no_grad():
                slicedkern.relu_attention(q, k, v, causal=causal, engine=engine)
    return run


def _sdpa(rows, length, dim, *, backward, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(rows, 1, length, dim, generator=g) for _ in range(3))

    def run():
        if backward:
            args = [a.detach().requires_grad_() for a in (q, k, v)]
            torch.nn.functional.scaled_dot_product_attention(*args, is_causal=True).sum().backward()
        else:
            with torch.no_grad():
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return run


def _sdpa_length(rows, length, dim, budget, backward):
    """The largest power-of-two length <= ``length`` whose SDPA run fits in ``budget`` seconds (from
    a probe at 1024, scaled quadratically)."""
    probe = min(length, 1024)
    t = _timed(_sdpa(rows, probe, dim, backward=backward))
    size = probe
    while size < length and t * (2 * size / probe) ** 2 <= budget:
        size *= 2
    return size


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--sdpa-budget", type=float, default=60.0)
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall")
    parser.add_argument("--causal-engines", default="auto",
                        help="comma list of engines for the causal rows (auto, sweep, scan)")
    parser.add_argument("--only", default="", help="time only the methods whose name contains this")
    parser.add_argument("--decode", default="", help="comma list of log2 cache lengths: time decoding instead")
    parser.add_argument("--steps", type=int, default=256)
    args = parser.parse_args()
    global _clock
    _clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.decode:
        # the decoding table of ``python -m slicedkern bench --causal`` (4 heads of --dim), on this clock
        print(run_causal(sizes=[], decode_sizes=[1 << int(e) for e in args.decode.split(",")], decode_dim=args.dim,
                         steps=args.steps, clock=_clock))
        return
    g = torch.Generator().manual_seed(0)
    q = torch.randn(args.rows, args.length, generator=g)
    k = torch.randn(args.rows, args.length, generator=g)
    v = torch.randn(args.rows, args.length, args.dim, generator=g)

    methods = {}
    for backward in (False, True):
        tag = "fwd+bwd" if backward else "fwd"
        methods[f"relu_attention {tag}"] = (_sliced(q, k, v, causal=False, backward=backward), 1.0)
        methods[f"relu_attention engine=scan {tag}"] = (
            _sliced(q, k, v, causal=False, backward=backward, engine="scan"), 1.0)
        for engine in args.causal_engines.split(","):
            name = "relu_attention causal" + ("" if engine == "auto" else f" engine={engine}")
            methods[f"{name} {tag}"] = (_sliced(q, k, v, causal=True, backward=backward,
                                                engine=None if engine == "auto" else engine), 1.0)
        if args.only not in f"SDPA is_causal {tag}":      # the filter leaves SDPA out: skip its probe
            continue
        size = _sdpa_length(args.rows, args.length, args.dim, args.sdpa_budget, backward)
        note = "" if size == args.length else f" (measured at L={size}, x{(args.length / size) ** 2:g})"
        methods[f"SDPA is_causal {tag}{note}"] = (_sdpa(args.rows, size, args.dim, backward=backward),
                                                   (args.length / size) ** 2)
    small = [a[:1, :1024] for a in (q, k, v)]       # first-use costs outside the timings, cheaply
    for backward in (False, True):
        _sliced(*small, causal=False, backward=backward)()
        for engine in args.causal_engines.split(","):
            _sliced(*small, causal=True, backward=backward, engine=None if engine == "auto" else engine)()
    methods = {name: m for name, m in methods.items() if args.only in name}
    best = {name: float("inf") for name in methods}
    for _ in range(args.repeats):
        for name, (fn, _) in methods.items():
            best[name] = min(best[name], _timed(fn))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rows} x {args.length} float32, "
          f"D = {args.dim}, min of {args.repeats} round-robin repeats, {args.clock} clock")
    for name, (_, factor) in methods.items():
        extra = f"  -> {best[name] * factor:9.2f} s extrapolated" if factor != 1.0 else ""
        print(f"  {name:60s} {best[name]:9.3f} s{extra}")


if __name__ == "__main__":
    main()
