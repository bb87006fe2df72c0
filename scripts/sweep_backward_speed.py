"""Forward and forward+backward of sliced attention on the sweep engine, before / after / reference.

Torch CPU, float32, ``torch.set_num_threads(THREADS)`` (default 2), B*H = 8 rows, D = 64, for each
length (default 16384 and 65536), through the public API with autograd (``q, k, v`` and, for the
hat, a per-row bandwidth requiring grad):

* ``relu``: ``slicedkern.relu_attention(q, k, v)`` (centred, "abs" normaliser);
* ``hat``: ``slicedkern.hat_attention(q, k, v, bandwidth)`` ("count" normaliser), bandwidth 0.5.

Three implementations, each in a process of its own, timed interleaved (one repeat of each in
turn, so that a shared machine's load hits them alike), minimum of ``--repeat``:

* ``after``: this checkout (``PYTHONPATH`` = the repository of this script);
* ``before``: ``--before`` (a checkout, optional), in a subprocess with ``PYTHONPATH`` set to it;
* ``reference``: the naive algorithm of the paper's published module, written here: per knot,
  concatenate the shifted queries with the keys, sort the 2n scores, prefix sums (cumsum) of the
  key terms in that order, unsort to the queries, and let autograd differentiate through the
  cumsums and gathers.

Two ways to time the backward (both printed):

* ``backward``: ``out.backward(g)`` with a given cotangent ``g``, timed on its own after the
  forward: the op's backward, as FlashAttention's benchmarks time theirs;
* ``via loss``: ``sum(out * g).backward()``, timed from the end of the forward, so it also holds
  torch's own work on the loss (the product, the sum, their backward: about as much as the op's
  backward at these sizes). Sessions before 2026-11-24 reported only this one.

Prints forward, both backwards and their ratios to the forward per op and length, and
forward+backward of the reference over that of ``after``. ``--small`` also prints min / median
per call of the NumPy forward at L = 16 and 1024 (8 rows, D = 64) and a sort + gather + cumsum of
the same data as a yardstick.

``--jax`` times JAX instead (ReLU, float32 inputs, jitted, on the CPU; ``--x64`` enables
``jax_enable_x64``, so that the scan accumulates in float64 as torch's does, not in double-float):
the forward next to NumPy's and the jitted ``value_and_grad`` next to torch's forward+backward, for
each engine of ``--jax-engines`` (default: ``auto``, the sweep through a host callback, and
``scan``, then compared with torch on the scan engine too), in one process.

On a machine with few cores, set ``OMP_WAIT_POLICY=passive``: the processes' OpenMP pools (torch's,
numba's) otherwise spin after each parallel region and take the cores of the process being timed.

Usage: ``python scripts/sweep_backward_speed.py [--lengths 16384 65536] [--repeat 3] [--small]``
or ``python scripts/sweep_backward_speed.py --jax --lengths 16384 [--jax-engines auto scan]``
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ the naive reference
def _relu_sums(torch, q, k, kv, t):
    """``sum_j ReLU(q_i - t - k_j) [kv_j]`` for every query: concatenate, sort 2n, cumsum, unsort.

    ``kv`` (B, m, C) are the key-side columns; returns (B, n, C).
    """
    b, n = q.shape
    m = k.shape[1]
    s = torch.cat([q - t, k], dim=1)                                   # (B, n + m)
    order = torch.argsort(s, dim=1, stable=True)
    inverse = torch.argsort(order, dim=1)
    is_key = torch.cat([torch.zeros(b, n), torch.ones(b, m)], dim=1)
    cols = torch.cat([torch.zeros(b, n, kv.shape[2]), kv], dim=1)      # query rows carry nothing
    idx = order[..., None].expand(-1, -1, kv.shape[2])
    c0 = torch.cumsum(torch.gather(cols, 1, idx), dim=1)              # sum of kv over keys <= s
    c1 = torch.cumsum(torch.gather(cols * (s * is_key)[..., None], 1, idx), dim=1)
    back = inverse[:, :n, None].expand(-1, -1, kv.shape[2])
    p0, p1 = torch.gather(c0, 1, back), torch.gather(c1, 1, back)
    return (q - t)[..., None] * p0 - p1


def reference_relu(torch, q, k, v, eps=1e-6):
    """Centred ReLU attention with the "abs" normaliser, the paper's naive way."""
    vc = v - v.mean(dim=1, keepdim=True)
    ones = torch.ones(k.shape + (1,))
    num = _relu_sums(torch, q, k, torch.cat([vc, ones], dim=2), 0.0)
    relu_count = num[..., -1:]
    # |r| = 2 ReLU(r) - r
    den = 2 * relu_count - (q * k.shape[1] - k.sum(dim=1, keepdim=True))[..., None]
    return num[..., :-1] / den.clamp_min(eps)


def reference_hat(torch, q, k, v, bandwidth):
    """Hat attention with the "count" normaliser: three ReLU sums (knots -b, 0, b), the naive way."""
    b = bandwidth[:, None]
    total = 0
    for t, c in ((-b, 1.0), (0.0, -2.0), (b, 1.0)):
        total = total + c * _relu_sums(torch, q, k, v, t)
    return total / b[..., None] / k.shape[1]


# --------------------------------------------------------------------------------------------- worker
def worker(threads):
    """Answer timing requests (one JSON line each) on stdin: this process's ``slicedkern``."""
    import torch
    torch.set_num_threads(threads)

    import slicedkern
    cache = {}

    def problem(length, rows, dim):
        key = (length, rows, dim)
        if key not in cache:
            gen = torch.Generator().manual_seed(length)
            q, k = torch.randn(rows, length, generator=gen), torch.randn(rows, length, generator=gen)
            v = torch.randn(rows, length, dim, generator=gen)
            g = torch.randn(rows, length, dim, generator=gen)
            cache.clear()
            cache[key] = (q, k, v, g, torch.full((rows,), 0.5))
        return cache[key]

    def call(op, impl, q, k, v, bw):
        if impl == "reference":
            return reference_relu(torch, q, k, v) if op == "relu" else reference_hat(torch, q, k, v, bw)
        if op == "relu":
            return slicedkern.relu_attention(q, k, v)
        return slicedkern.hat_attention(q, k, v, bw)

    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        q0, k0, v0, g, bw0 = problem(req["length"], req["rows"], req["dim"])
        q, k, v, bw = (a.clone().requires_grad_(True) for a in (q0, k0, v0, bw0))
        start = time.perf_counter()
        out = call(req["op"], req["impl"], q, k, v, bw)
        mid = time.perf_counter()
        if req["backward"] == "loss":
            (out * g).sum().backward()
        elif req["backward"]:
            out.backward(g)
        end = time.perf_counter()
        result = {"forward": mid - start, "backward": end - mid}
        if req.get("check"):
            # the reference computes the same function: compare outputs (float32 tolerance)
            ref = call(req["op"], "reference", q0, k0, v0, bw0)
            result["max_rel_diff"] = float((out.detach() - ref).abs().max() / ref.abs().max())
        # free this call's graph (and the engine's residuals in it) before the next request, as a
        # training step does after its backward: a forward-only request would otherwise keep it
        # alive through the next call's allocations
        del out, q, k, v, bw
        print(json.dumps(result), flush=True)


class Worker:
    def __init__(self, path, threads):
        env = dict(os.environ, PYTHONPATH=str(path))
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=str(path))

    def ask(self, **req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker died on {req}")
        return json.loads(line)

    def close(self):
        self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
        self.proc.stdin.flush()
        self.proc.wait()


# ------------------------------------------------------------------------------------------- JAX
def jax_calls(args):
    """JAX on the CPU, float32 (no x64), jitted, next to NumPy and torch, in this process.

    Per length: the ReLU attention forward of NumPy (default engine), of JAX jitted on the default
    engine (the sweep through a host callback) and with ``engine="scan"`` (what JAX used before);
    forward+backward of torch (autograd, default engine) and of JAX (jitted ``value_and_grad`` of
    ``sum(out * g)`` in q, k, v), each engine. Interleaved, min of ``--repeat``.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    torch.set_num_threads(args.threads)

    sys.path.insert(0, str(HERE))           # this checkout's slicedkern, as the workers' PYTHONPATH does
    import slicedkern
    print(f"slicedkern from {pathlib.Path(slicedkern.__file__).parent}")
    if args.x64:
        jax.config.update("jax_enable_x64", True)
    x64 = "on" if args.x64 else "off"
    print(f"JAX {jax.__version__} on {jax.default_backend()}, float32 (x64 {x64}), jitted; NumPy and torch "
          f"(threads = {args.threads}); rows = {args.rows}, D = {args.dim}, min of {args.repeat} (interleaved)")
    for length in args.lengths:
        rng = np.random.default_rng(length)
        q, k = rng.standard_normal((2, args.rows, length), dtype=np.float32)
        v, g = rng.standard_normal((2, args.rows, length, args.dim), dtype=np.float32)
        tq, tk, tv, tg = (torch.from_numpy(a) for a in (q, k, v, g))
        jq, jk, jv, jg = (jnp.asarray(a) for a in (q, k, v, g))

        def torch_train(engine=None):
            a, b, c = (t.clone().requires_grad_(True) for t in (tq, tk, tv))
            (slicedkern.relu_attention(a, b, c, engine=engine) * tg).sum().backward()

        def jax_fns(engine):
            fwd = jax.jit(lambda a, b, c: slicedkern.relu_attention(a, b, c, engine=engine))
            loss = jax.jit(jax.value_and_grad(
                lambda a, b, c: jnp.sum(slicedkern.relu_attention(a, b, c, engine=engine) * jg), argnums=(0, 1, 2)))
            return (lambda: jax.block_until_ready(fwd(jq, jk, jv)),
                    lambda: jax.block_until_ready(loss(jq, jk, jv)))

        cases = {"numpy forward": lambda: slicedkern.relu_attention(q, k, v),
                 "torch forward": lambda: slicedkern.relu_attention(tq, tk, tv), "torch fwd+bwd": torch_train}
        if "scan" in args.jax_engines:      # the comparison: JAX and torch on the same engine
            cases["torch[scan] forward"] = lambda: slicedkern.relu_attention(tq, tk, tv, engine="scan")
            cases["torch[scan] fwd+bwd"] = lambda: torch_train("scan")
        for engine in args.jax_engines:
            fwd, train = jax_fns(None if engine == "auto" else engine)
            cases[f"jax[{engine}] forward"], cases[f"jax[{engine}] fwd+bwd"] = fwd, train
        compile_s = {}
        for name, fn in cases.items():                      # compile / warm up, outside the timings
            start = time.perf_counter()
            fn()
            compile_s[name] = time.perf_counter() - start
        best = dict.fromkeys(cases, float("inf"))
        for _ in range(args.repeat):
            for name, fn in cases.items():
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
        out = np.asarray(cases["jax[" + args.jax_engines[0] + "] forward"]())
        diff = np.abs(out - slicedkern.relu_attention(q, k, v)).max() / np.abs(out).max()
        print(f"L = {length} (JAX vs NumPy output: max rel. diff {diff:.1e})")
        for name in cases:
            print(f"  {name:22s} {best[name] * 1e3:10.1f} ms   (first call {compile_s[name]:7.2f} s)")
        for engine in args.jax_engines:
            torch_name = "torch[scan]" if engine == "scan" else "torch"
            print(f"  jax[{engine}]: forward / NumPy forward = "
                  f"{best[f'jax[{engine}] forward'] / best['numpy forward']:.2f} (target <= 3); "
                  f"fwd+bwd / {torch_name} fwd+bwd = "
                  f"{best[f'jax[{engine}] fwd+bwd'] / best[f'{torch_name} fwd+bwd']:.2f} (target <= 1.5)")


# ---------------------------------------------------------------------------------------- small calls
def small_calls(threads, calls=2000):
    """min / median per call of the NumPy forward (8 x L, D = 64) at L = 16 and 1024, next to a sort +
    gather + cumsum of the same data."""
    import numpy as np

    sys.path.insert(0, str(HERE))           # this checkout's slicedkern, as the workers' PYTHONPATH does
    import slicedkern
    rng = np.random.default_rng(0)
    for length in (16, 1024):
        q, k = rng.standard_normal((8, length)), rng.standard_normal((8, length))
        v = rng.standard_normal((8, length, 64))

        def yardstick():
            order = np.argsort(k, axis=1)
            return np.cumsum(np.take_along_axis(v, order[..., None], axis=1), axis=1)

        for name, fn in (("relu_attention", lambda: slicedkern.relu_attention(q, k, v)),
                         ("sort+gather+cumsum", yardstick)):
            fn()
            samples = []
            for _ in range(calls if length == 16 else calls // 4):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            print(f"  NumPy 8 x {length:5d}, D = 64  {name:20s} min {min(samples) * 1e6:9.1f} us   "
                  f"median {np.median(samples) * 1e6:9.1f} us   median / min {np.median(samples) / min(samples):5.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[16384, 65536])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (numba keeps its default)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--before", default="",
                        help="a checkout to compare with, e.g. a git worktree of an older commit (default: none)")
    parser.add_argument("--ops", nargs="+", default=["relu", "hat"])
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--no-check", action="store_true", help="skip the output check (one reference call)")
    parser.add_argument("--small", action="store_true", help="also time small NumPy calls")
    parser.add_argument("--jax", action="store_true",
                        help="time JAX (jitted, float32, CPU) against NumPy and torch instead (ReLU only)")
    parser.add_argument("--x64", action="store_true", help="with --jax: enable jax_enable_x64 (float64 work)")
    parser.add_argument("--jax-engines", nargs="+", default=["auto", "scan"],
                        help="with --jax: the JAX engines to time ('auto': the sweep on the CPU)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.threads)
    if args.jax:
        return jax_calls(args)

    impls = {"after": Worker(HERE, args.threads)}
    if args.before:
        impls["before"] = Worker(pathlib.Path(args.before), args.threads)
    if not args.no_reference:
        # a process of its own: after the reference's large temporaries, the next call in the same
        # process pays for fresh pages (the allocator returned them), which would bias "after"
        impls["reference"] = Worker(HERE, args.threads)
    print(f"torch CPU float32, torch threads = {args.threads}, rows = {args.rows}, D = {args.dim}, "
          f"min of {args.repeat} (interleaved)")
    for length in args.lengths:
        for op in args.ops:
            shape = dict(length=length, rows=args.rows, dim=args.dim, op=op)
            names = list(impls)
            # warm-up (numba's cache, torch's allocator) and the check of the output against the reference
            check = impls["after"].ask(**shape, impl="after", backward=True, check=not args.no_check)
            if "before" in impls:
                impls["before"].ask(**shape, impl="before", backward=True)
            kinds = ("forward", "backward", "via loss")
            best = {name: dict.fromkeys(kinds, float("inf")) for name in names}
            for rep in range(args.repeat):
                # the order rotates, so that no implementation always follows the reference (whose
                # gigabytes of temporaries leave the next process to fault its pages in afresh)
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    w = impls[name]
                    seen = {"forward": w.ask(**shape, impl=name, backward=False)["forward"],
                            "backward": w.ask(**shape, impl=name, backward=True)["backward"],
                            "via loss": w.ask(**shape, impl=name, backward="loss")["backward"]}
                    for kind in kinds:
                        best[name][kind] = min(best[name][kind], seen[kind])
            diff = f"{check['max_rel_diff']:.1e}" if "max_rel_diff" in check else "not checked"
            print(f"L = {length}, {op} (output vs the reference: max rel. diff {diff})")
            for name in names:
                f, b, bl = (best[name][kind] for kind in kinds)
                print(f"  {name:9s} forward {f * 1e3:8.1f} ms   backward {b * 1e3:8.1f} ms ({b / f:5.2f}x)   "
                      f"fwd+bwd {(f + b) * 1e3:8.1f} ms   backward via loss {bl * 1e3:8.1f} ms ({bl / f:5.2f}x)")
            total = {name: best[name]["forward"] + best[name]["backward"] for name in names}
            if "reference" in best:
                print(f"  fwd+bwd: reference / after = {total['reference'] / total['after']:.1f}x"
                      + (f", before / after = {total['before'] / total['after']:.1f}x"
                         if "before" in best else ""))
    for w in impls.values():
        w.close()
    if args.small:
        small_calls(args.threads)


if __name__ == "__main__":
    main()
