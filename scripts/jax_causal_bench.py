"""JAX causal sliced ReLU attention: the first call of a new shape (trace, compile, run) and warm calls,
next to the non-causal op, forward and forward + backward, under ``jax.jit`` on the CPU.

For ``--rows`` x ``--length`` float32 scores and ``--dim`` values: ``relu_attention`` with and without
``causal=True`` on the engine the library picks (the sweep through a host callback where numba is
installed) and, with ``--engines sweep,scan``, on each engine named. The first call is timed once
per shape (a fresh shape each time, so nothing is cached); warm calls are the minimum of
``--repeats`` round-robin calls. Forward + backward is ``jax.jit(jax.grad)`` of ``sum(out)`` in
``q, k, v``.

Usage (from the repository root): ``PYTHONPATH=. python scripts/jax_causal_bench.py [--rows 8]
[--length 16384] [--dim 64] [--repeats 3] [--engines sweep]``
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import slicedkern


def _fn(causal, backward, engine):
    def fwd(q, k, v):
        return slicedkern.relu_attention(q, k, v, causal=causal, engine=engine)
    if backward:
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v)), argnums=(0, 1, 2)))
    return jax.jit(fwd)


def _block(x):
    return jax.block_until_ready(x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default="", help="comma-separated engines (default: the library's pick)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    engines = [e or None for e in args.engines.split(",")] if args.engines else [None]
    data = [jnp.asarray(rng.standard_normal(s), jnp.float32)
            for s in ((args.rows, args.length), (args.rows, args.length), (args.rows, args.length, args.dim))]
    print(f"jax {jax.__version__} on {jax.default_backend()}, {args.rows} x {args.length} float32, D = {args.dim}; "
          f"first call of a new shape, then min of {args.repeats} warm calls (round-robin)")
    methods = {}
    for engine in engines:
        for causal in (False, True):
            for backward in (False, True):
                name = (f"{'causal ' if causal else ''}{'fwd+bwd' if backward else 'fwd'}"
                        f"{' engine=' + engine if engine else ''}")
                fn = _fn(causal, backward, engine)
                start = time.perf_counter()
                _block(fn(*data))
                first = time.perf_counter() - start
                methods[name] = (fn, first)
    best = {name: float("inf") for name in methods}
    for _ in range(args.repeats):
        for name, (fn, _) in methods.items():
            start = time.perf_counter()
            _block(fn(*data))
            best[name] = min(best[name], time.perf_counter() - start)
    for name, (_, first) in methods.items():
        print(f"  {name:<34} first call {first:8.3f} s   warm {best[name]:8.4f} s")


if __name__ == "__main__":
    main()
