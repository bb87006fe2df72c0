"""Which package files a backward passes through, and how often it leaves an engine's folder and
comes back: a profile hook over one small backward (causal and not) on an engine, under Triton's
interpreter for the triton engine. For the before / after of a redesign of the backward
(docs/architecture.rst, "Engines").

Usage: ``TRITON_INTERPRET=1 python scripts/backward_trace.py [--engine triton] [--causal]``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np
import torch

import slicedkern

PACKAGE = pathlib.Path(slicedkern.__file__).resolve().parent


def trace(engine: str, causal: bool) -> tuple[list[str], int]:
    """``(files, returns)``: the package files whose functions run in the backward (in first-call
    order), and the number of calls from outside ``engines/<engine>/`` into it after the first."""
    rng = np.random.default_rng(0)
    q, k = (torch.tensor(rng.standard_normal((2, 200)), dtype=torch.float32, requires_grad=True) for _ in range(2))
    v = torch.tensor(rng.standard_normal((2, 200, 8)), dtype=torch.float32, requires_grad=True)
    out = slicedkern.relu_attention(q, k, v, causal=causal, engine=engine)
    g = torch.ones_like(out)
    files: list[str] = []
    home = PACKAGE / "engines" / engine
    entries = [0]

    def hook(frame, event, arg):
        if event != "call":
            return
        path = pathlib.Path(frame.f_code.co_filename)
        if PACKAGE not in path.parents:
            return
        name = str(path.relative_to(PACKAGE.parent))
        if name not in files:
            files.append(name)
        caller = None if frame.f_back is None else pathlib.Path(frame.f_back.f_code.co_filename)
        if home in path.parents and caller is not None and PACKAGE in caller.parents and home not in caller.parents:
            entries[0] += 1

    sys.setprofile(hook)
    try:
        torch.autograd.grad(out, (q, k, v), g)
    finally:
        sys.setprofile(None)
    return files, max(entries[0] - 1, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="triton")
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    files, returns = trace(args.engine, args.causal)
    print(f"{args.engine} {'causal' if args.causal else 'non-causal'} backward: {len(files)} package files, "
          f"{returns} returns into engines/{args.engine}/ from the rest of the package")
    for name in files:
        print("  ", name)


if __name__ == "__main__":
    main()
