"""Packed sequences and windows, timed as the issue's targets ask (docs/benchmarks.rst, "Packed
sequences and windows"): forward + backward through torch autograd, ``H`` heads, ``Dv`` value columns,
each number the minimum of ``--repeats`` runs, the rows of one table measured side by side.

* packed: ``--tokens`` tokens in documents of lengths drawn uniformly from ``--min-doc`` to
  ``--max-doc`` (the last one cut to fit): one call with ``segment_ids``, one plain call of the whole
  length (no documents), and the documents padded to the longest with ``key_mask`` (one batch);
* bands: causal with ``window=(--window, 0)`` against plain causal at ``--band-length``.

Usage::

    python scripts/packed_bench.py [--engine sweep] [--tokens 32768] [--heads 8] [--dv 64]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

import slicedkern


def _documents(rng, tokens: int, low: int, high: int) -> np.ndarray:
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(rng.integers(low, high + 1)))
    lengths[-1] -= sum(lengths) - tokens
    if lengths[-1] == 0:
        lengths.pop()
    return np.array(lengths)


def _time(fn, repeats: int) -> float:
    fn()                                               # compile / warm caches
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _step(q, k, v, **kw):
    """One forward + backward; returns a closure that runs it."""
    def run():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = slicedkern.relu_attention(*leaves, **kw)
        out.sum().backward()
    return run


def packed_rows(args, rng) -> list[tuple[str, float]]:
    lengths = _documents(rng, args.tokens, args.min_doc, args.max_doc)
    total, heads, dv = int(lengths.sum()), args.heads, args.dv
    cu = np.r_[0, np.cumsum(lengths)]
    ids = torch.as_tensor(slicedkern.segment_ids_from_cu_seqlens(cu))
    q, k = torch.randn(heads, total, dtype=torch.float64), torch.randn(heads, total, dtype=torch.float64)
    v = torch.randn(heads, total, dv, dtype=torch.float64)
    longest = int(lengths.max())
    # the padded batch: (docs, heads, longest), each document at the front of its row
    qp = torch.zeros(len(lengths), heads, longest, dtype=torch.float64)
    kp, vp = torch.zeros_like(qp), torch.zeros(len(lengths), heads, longest, dv, dtype=torch.float64)
    mask = torch.zeros(len(lengths), heads, longest, dtype=torch.bool)
    for d, (start, stop) in enumerate(zip(cu[:-1], cu[1:])):
        n = stop - start
        qp[d, :, :n], kp[d, :, :n], vp[d, :, :n] = q[:, start:stop], k[:, start:stop], v[:, start:stop]
        mask[d, :, :n] = True
    print(f"# {len(lengths)} documents of {args.min_doc}..{args.max_doc} tokens (longest {longest}), "
          f"{total} tokens, {heads} heads, Dv = {dv}, engine {args.engine}")
    rows = []
    for causal in (False, True):
        kind = "causal" if causal else "full"
        packed = _time(_step(q, k, v, segment_ids=ids, causal=causal, engine=args.engine), args.repeats)
        whole = _time(_step(q, k, v, causal=causal, engine=args.engine), args.repeats)
        padded = _time(_step(qp, kp, vp, key_mask=mask, causal=causal, engine=args.engine), args.repeats)
        rows += [(f"{kind}: packed (segment_ids)", packed), (f"{kind}: one call of {total}", whole),
                 (f"{kind}: padded to {longest} + key_mask", padded),
                 (f"{kind}: packed / one call (target <= 1.2)", packed / whole),
                 (f"{kind}: padded / packed (target >= 3)", padded / packed)]
    return rows


def band_rows(args) -> list[tuple[str, float]]:
    n, heads, dv = args.band_length, args.heads, args.dv
    q, k = torch.randn(heads, n, dtype=torch.float64), torch.randn(heads, n, dtype=torch.float64)
    v = torch.randn(heads, n, dv, dtype=torch.float64)
    causal = _time(_step(q, k, v, causal=True, engine=args.engine), args.repeats)
    band = _time(_step(q, k, v, window=(args.window, 0), engine=args.engine), args.repeats)
    return [(f"causal, L = {n}", causal), (f"window ({args.window}, 0), L = {n}", band),
            ("window / causal (target <= 2.5)", band / causal)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="sweep")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--min-doc", type=int, default=64)
    parser.add_argument("--max-doc", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dv", type=int, default=64)
    parser.add_argument("--band-length", type=int, default=16384)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=["packed", "bands"], default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# load average {os.getloadavg()[0]:.2f}, torch threads {torch.get_num_threads()}")
    rows = []
    if args.only in (None, "packed"):
        rows += packed_rows(args, np.random.default_rng(args.seed))
    if args.only in (None, "bands"):
        rows += band_rows(args)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        unit = "" if "/" in name else " s"
        print(f"{name:<{width}}  {value:10.3f}{unit}")


if __name__ == "__main__":
    main()
