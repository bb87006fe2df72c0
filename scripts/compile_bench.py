"""Compiled against eager sliced attention: forward + backward of the torch layer, in one process.

    python scripts/compile_bench.py --length 2048 --causal 0 [--repeats 5] [--device cuda]

Prints one JSON line: the first compiled call (trace + compile + run, this process's first
``torch.compile``), then the minimum over ``--repeats`` timed steps of eager and compiled, side by
side, and their ratio. Run each configuration in its own process so that every first call is a
user's first call (docs/compile.rst, "Measured").
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from slicedkern.nn.torch import SlicedAttention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--causal", type=int, choices=(0, 1), default=0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dynamic", action="store_true", help="torch.compile(dynamic=True)")
    parser.add_argument("--device", default="cpu", help="cpu (the sweep), or cuda (triton)")
    args = parser.parse_args()
    torch.manual_seed(0)
    layer = SlicedAttention(64, 4, batch_first=True, device=args.device)
    x = torch.randn(args.batch, args.length, 64, requires_grad=True, device=args.device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    causal = bool(args.causal)

    def step(x):
        out = layer(x, x, x, need_weights=False, is_causal=causal)[0]
        out.sum().backward()
        sync()
        return out

    compiled_layer = torch.compile(layer, fullgraph=True, dynamic=args.dynamic or None)

    def compiled_step(x):
        out = compiled_layer(x, x, x, need_weights=False, is_causal=causal)[0]
        out.sum().backward()
        sync()
        return out

    step(x)                                   # the engines' own first call (numba's cache) apart
    start = time.perf_counter()
    compiled_step(x)
    first = time.perf_counter() - start
    times = {"eager": [], "compiled": []}
    for _ in range(args.repeats):
        for name, fn in (("eager", step), ("compiled", compiled_step)):
            start = time.perf_counter()
            fn(x)
            times[name].append(time.perf_counter() - start)
    eager, compiled = min(times["eager"]), min(times["compiled"])
    print(json.dumps({"device": args.device, "length": args.length, "batch": args.batch, "causal": causal,
                      "dynamic": args.dynamic,
                      "threads": torch.get_num_threads(), "first_compiled_s": round(first, 2),
                      "eager_ms": round(1e3 * eager, 2), "compiled_ms": round(1e3 * compiled, 2),
                      "compiled_over_eager": round(compiled / eager, 3)}))


if __name__ == "__main__":
    main()
