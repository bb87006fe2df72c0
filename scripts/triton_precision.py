"""Float32 precision of the triton engine's ReLU attention, forward and gradients, against the
float64 dense reference on the same rounded inputs (normwise: ``||got - exact|| / ||exact||``),
beside the floor (the exact result rounded to float32). Runs under Triton's interpreter on the CPU
(no GPU needed; the default) or, with ``TRITON_INTERPRET=0`` on a machine with CUDA, on the GPU:

    TRITON_INTERPRET=1 PYTHONPATH=. python scripts/triton_precision.py [--causal] [--length 512]
        [--dim 16] [--heads 2] [--leaf 4] [--offset 30]

Four cases: ``v ~ N(0, 1)`` and ``v ~ offset + N(0, 1)`` (``--offset``), each uncentred and
centred (``relu_attention``'s default). Centring offset values cancels: the result is the values'
spread, the float32 tile sums round at the scale of the offset. ``--leaf``: the causal path's
dense leaf (small leaves give more levels at a small length). docs/benchmarks.rst quotes its
numbers.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import slicedkern  # noqa: E402
import slicedkern.engines.triton as engine  # noqa: E402
from slicedkern import reference  # noqa: E402


def relative(got, exact) -> float:
    return float(np.linalg.norm(got - exact) / np.linalg.norm(exact))


def errors(q, k, v, cot, *, causal: bool, device: str, **kw) -> dict:
    """Per output (``out``, ``dq``, ``dk``, ``dv``): the error of float32 inputs on the triton
    engine and that of the exact result rounded to float32."""
    args = [torch.tensor(a, dtype=torch.float32, device=device).requires_grad_() for a in (q, k, v)]
    out = slicedkern.relu_attention(*args, causal=causal, engine="triton", **kw)
    got = (out, *torch.autograd.grad((out.double() * torch.tensor(cot, device=device)).sum(), args))
    exact_args = [torch.tensor(a.detach().cpu().numpy().astype(np.float64)).requires_grad_() for a in args]
    exact_out = reference.relu_attention(*exact_args, causal=causal, **kw)
    exact = (exact_out, *torch.autograd.grad((exact_out * torch.tensor(cot)).sum(), exact_args))
    found = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, exact):
        a, b = a.detach().double().cpu().numpy(), b.detach().numpy()
        found[name] = (relative(a, b), relative(b.astype(np.float32).astype(np.float64), b))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--leaf", type=int, default=None, help="causal dense leaf (default: the engine's)")
    parser.add_argument("--offset", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.leaf is not None:
        engine.CAUSAL_LEAF = args.leaf
    device = "cuda" if torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] != "1" else "cpu"
    rng = np.random.default_rng(args.seed)
    shape = (args.heads, args.length)
    print(f"{'causal' if args.causal else 'non-causal'} ReLU attention, float32, L = {args.length}, "
          f"D = {args.dim}, {args.heads} heads, {device}; error (floor)")
    for label, offset, kw in (("uncentred", 0.0, {"center": False}), ("centred", 0.0, {"center": True}),
                              (f"+{args.offset:g}, unc.", args.offset, {"center": False}),
                              (f"+{args.offset:g}, centred", args.offset, {"center": True})):
        q, k = rng.normal(size=shape), rng.normal(size=shape)
        v = rng.normal(size=shape + (args.dim,)) + offset
        cot = rng.normal(size=shape + (args.dim,))
        found = errors(q, k, v, cot, causal=args.causal, device=device, **kw)
        print(f"  {label:14s}" + "  ".join(f"{n} {e:.2e} ({f:.1e})" for n, (e, f) in found.items()), flush=True)


if __name__ == "__main__":
    main()
