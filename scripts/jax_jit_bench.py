"""The Flax layer under ``jax.jit``: compile time and step time, forward and ``jax.grad``, with the
engine each compiled call runs.

    python scripts/jax_jit_bench.py --length 2048 --causal 0

Prints one JSON line: the first jitted call of the forward and of the gradient (trace + compile +
run), the minimum over ``--repeats`` steps of each, and whether the compiled program holds a host
callback (the sweep on the CPU) or the scan's sort-and-scan in XLA (docs/compile.rst, "JAX").
"""

from __future__ import annotations

import argparse
import json
import time

import jax
from flax import nnx

from slicedkern.nn.flax import SlicedAttention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--causal", type=int, choices=(0, 1), default=0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    layer = SlicedAttention(64, 4, batch_first=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (args.batch, args.length, 64))
    causal = bool(args.causal)
    graph, state, rest = nnx.split(layer, nnx.Param, ...)    # parameters apart (the gradient's), the rest

    def forward(state, x):
        return nnx.merge(graph, state, rest)(x, x, x, is_causal=causal)[0]

    def loss(state, x):
        return forward(state, x).sum()

    jitted = {"forward": jax.jit(forward), "grad": jax.jit(jax.grad(loss))}
    result = {"length": args.length, "batch": args.batch, "causal": causal}
    for name, fn in jitted.items():
        start = time.perf_counter()
        text = fn.lower(state, x).as_text()          # the trace, which the first call would do
        jax.block_until_ready(fn(state, x))
        result[f"{name}_first_s"] = round(time.perf_counter() - start, 2)
        result[f"{name}_host_callback"] = "callback" in text
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(state, x))
            times.append(time.perf_counter() - start)
        result[f"{name}_ms"] = round(1e3 * min(times), 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
