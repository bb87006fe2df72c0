"""The sweep engine's own calls, timed without the adapters: ``forward(for_backward=True)`` and
``backward`` of ``relu_attention``'s spec on 8 x 65536 float32 scores, D = 64 (NumPy arrays).

To compare two trees, run it alternately in each (``PYTHONPATH=<tree> python
scripts/sweep_call_timing.py 10``) and compare the best and the medians across runs.

Usage: ``python scripts/sweep_call_timing.py [REPEATS]``
"""

from __future__ import annotations

import sys
import time

import numpy as np

import slicedkern
from slicedkern.ops.attention import prepare


def main(repeats: int) -> None:
    rng = np.random.default_rng(0)
    b, n, d = 8, 65536, 64
    q, k = rng.normal(size=(b, n)).astype(np.float32), rng.normal(size=(b, n)).astype(np.float32)
    v = rng.normal(size=(b, n, d)).astype(np.float32)
    call = prepare(q, k, v, None, kernel=slicedkern.kernels.ReLU(), key_mask=None, center=True, normalize="abs",
                   eps=1e-6, causal=False, engine="sweep", xp=None)
    g = np.ones((b, n, d), np.float32)
    out, res = call.engine.forward(call.spec, call.inputs, xp=call.xp, for_backward=True)
    call.engine.backward(call.spec, call.inputs, out, res, g, xp=call.xp)       # warm
    forward, backward = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out, res = call.engine.forward(call.spec, call.inputs, xp=call.xp, for_backward=True)
        forward.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        call.engine.backward(call.spec, call.inputs, out, res, g, xp=call.xp)
        backward.append(time.perf_counter() - t0)
    for name, times in (("forward (keep)", forward), ("backward", backward)):
        times.sort()
        print(f"{name:15s} best {times[0] * 1e3:7.1f} ms   median {times[len(times) // 2] * 1e3:7.1f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
