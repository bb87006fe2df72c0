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


def trace(engine: str, causal: bool, length: int = 200) -> tuple[list[str], int]:
    """``(files, returns)``: the package files whose functions run in the backward (in first-call
    order), and the number of calls from outside ``engines/<engine>/`` into it after the first."""
    rng = np.random.default_rng(0)
    q, k = (torch.tensor(rng.standard_normal((2, length)), dtype=torch.float32, requires_grad=True) for _ in range(2))
    v = torch.tensor(rng.standard_normal((2, length, 8)), dtype=torch.float32, requires_grad=True)
    out = slicedkern.relu_attention(q, k, v, causal=causal, engine=engine)
    g = torch.ones_like(out)
    files: list[str] = []
    package, home = str(PACKAGE) + "/", str(PACKAGE / "engines" / engine) + "/"
    entries = [0]

    def hook(frame, event, arg):
        # string prefixes, not paths: under Triton's interpreter every tl operation is a Python call
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(package):
            return
        name = str(pathlib.Path(path).relative_to(PACKAGE.parent))
        if name not in files:
            files.append(name)
        caller = None if frame.f_back is None else frame.f_back.f_code.co_filename
        if path.startswith(home) and caller is not None and caller.startswith(package) and not caller.startswith(home):
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
    parser.add_argument("--length", type=int, default=200, help="queries and keys per row (2 rows, D = 8)")
    args = parser.parse_args()
    files, returns = trace(args.engine, args.causal, args.length)
    print(f"{args.engine} {'causal' if args.causal else 'non-causal'} backward: {len(files)} package files, "
          f"{returns} returns into engines/{args.engine}/ from the rest of the package")
    for name in files:
        print("  ", name)


if __name__ == "__main__":
    main()
