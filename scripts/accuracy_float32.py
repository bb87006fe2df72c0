"""Float32 accuracy of the attention ops at large n (issue: core, numerics bar).

For each installed backend, computes each op on float32 inputs and compares, normwise
(``||out32 - out64|| / ||out64||``), with the NumPy float64 result on the same rounded inputs.
JAX runs with x64 disabled (its default), i.e. through the double-float accumulation.

Usage: ``python scripts/accuracy_float32.py [--n 262144] [--dim 4]``
"""

from __future__ import annotations

import argparse
import importlib.util

import numpy as np

import slicedkern
from slicedkern.kernels import Abs, HatMixture


def cases():
    return {
        "relu_attention": lambda q, k, v, **kw: slicedkern.relu_attention(q, k, v, **kw),
        "hat_attention(b=0.01)": lambda q, k, v, **kw: slicedkern.hat_attention(q, k, v, 0.01, **kw),
        "hat_attention(b=1)": lambda q, k, v, **kw: slicedkern.hat_attention(q, k, v, 1.0, **kw),
        "hat_mixture_attention(0.01,0.1,1)": lambda q, k, v, **kw: slicedkern.hat_mixture_attention(
            q, k, v, [0.01, 0.1, 1.0], [1.0, -0.5, 0.25], **kw),
        "kernel_attention(Abs, center)": lambda q, k, v, **kw: slicedkern.kernel_attention(
            q, k, v, Abs(), center=True, **kw),
        "kernel_attention(HatMixture)": lambda q, k, v, **kw: slicedkern.kernel_attention(
            q, k, v, HatMixture([0.05, 0.5], [1.0, 1.0]), **kw),
    }


def backends():
    out = {"numpy": (lambda a: a, np.asarray)}
    if importlib.util.find_spec("torch"):
        import torch
        out["torch"] = (torch.asarray, lambda a: a.numpy())
    if importlib.util.find_spec("jax"):
        import jax.numpy as jnp
        out["jax (x64 off)"] = (jnp.asarray, np.asarray)
    if importlib.util.find_spec("array_api_strict"):
        import array_api_strict as xs
        out["array_api_strict"] = (xs.asarray, lambda a: np.asarray(a))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2 ** 18)
    parser.add_argument("--dim", type=int, default=4)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, args.n)).astype(np.float32)
    k = rng.standard_normal((1, args.n)).astype(np.float32)
    v = rng.standard_normal((1, args.n, args.dim)).astype(np.float32)
    ops = cases()
    names = list(backends())
    print(f"n = {args.n}, D = {args.dim}: normwise relative error of float32 vs float64")
    print(f"{'op':36s}" + "".join(f"{b:>18s}" for b in names))
    for op_name, op in ops.items():
        exact = op(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
        row = []
        for to, back in backends().values():
            out = np.asarray(back(op(to(q), to(k), to(v))), dtype=np.float64)
            row.append(np.linalg.norm(out - exact) / np.linalg.norm(exact))
        print(f"{op_name:36s}" + "".join(f"{e:18.2e}" for e in row))


if __name__ == "__main__":
    main()
