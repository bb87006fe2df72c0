"""What one call of the triton engine launches and allocates: kernel launches, sorts (a
``torch.sort``, or a launch of the engine's ``sort_rows`` for short rows; two in the one-launch
forward of short rows, ``small_attend``), and the intermediate
tensors of at least ``n * D`` elements (issue 26's structural counts), for the forward and the
forward+backward of ReLU attention, under Triton's interpreter on the CPU (the counts do not depend
on the device; no GPU needed):

    TRITON_INTERPRET=1 PYTHONPATH=. python scripts/triton_traffic.py [--length 256] [--dim 16] [--causal]
        [--bandwidths] [--two-pass]

and the host's share of a call (:func:`host_cost`, ``--host``): with the Triton launches replaced by
no-ops, the torch operators that would each launch a kernel on a GPU (views and bare allocations
left out) and the wall time of what remains. On a GPU at small L that share is the whole time
(docs/benchmarks.rst, "On a GPU").

Counted with a ``TorchDispatchMode`` (every aten op the call runs: its name, and every output tensor
with its size and dtype) and by wrapping the engine's Triton kernels (launches per kernel). The
inputs, the output and the gradients themselves are not intermediates; everything else of
``n * D`` elements or more is, with the bytes it holds, and the bytes of all intermediates, of any
size, are summed too (every tensor is held to the end, so that no address is counted twice).
"""

from __future__ import annotations

import argparse
import collections
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import slicedkern  # noqa: E402


class Recorder(TorchDispatchMode):
    """Every aten op, and the new storages of at least ``big`` elements an op allocates: an output
    whose storage is none of the op's tensor arguments' (views and in-place ops return theirs;
    ``set_`` / ``copy_`` are the interpreter moving kernel arguments). The large ones are held until
    the end, so that no later allocation reuses their address and is mistaken for them."""

    def __init__(self, big: int):
        super().__init__()
        self.big, self.ops, self.large, self.sorted_dtypes, self.held = big, collections.Counter(), [], [], []
        self.allocated = []          # (bytes, storage address) of every new storage, whatever its size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        self.ops[name] += 1
        if name in ("sort", "argsort"):
            self.sorted_dtypes.append(args[0].dtype)
        if name in ("set_", "copy_"):
            return out
        given = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if not isinstance(t, torch.Tensor):
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in given:
                continue
            self.allocated.append((t.untyped_storage().nbytes(), ptr))
            if t.numel() >= self.big:
                self.large.append((name, t.numel(), t.dtype, ptr))
            self.held.append(t)
        return out


def count(length: int, dim: int, heads: int, backward: bool, dtype=torch.float32, causal: bool = False,
          bandwidths: bool = False) -> dict:
    """The counts of one call of ReLU attention (centred, "abs"), or with ``bandwidths`` of hat
    attention with one bandwidth per head, learned (its gradient taken too). With ``backward``, the
    counts of the forward and backward together, and under ``"forward"`` those of the forward alone
    (as ``backward=False`` gives them: the same call, counted when the output is made)."""
    from slicedkern.engines.triton import _sums
    kernels = _sums.loaded()
    launches = collections.Counter()
    originals = {}
    for name in kernels.KERNELS:
        jitted = getattr(kernels, name)
        originals[name] = jitted

        class Counted:
            def __init__(self, name, jitted):
                self.name, self.jitted = name, jitted

            def __getitem__(self, grid):
                launches[self.name] += 1
                return self.jitted[grid]
        setattr(kernels, name, Counted(name, jitted))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, length, generator=g, dtype=dtype).requires_grad_(backward)
    k = torch.randn(1, heads, length, generator=g, dtype=dtype).requires_grad_(backward)
    v = torch.randn(1, heads, length, dim, generator=g, dtype=dtype).requires_grad_(backward)
    cot = torch.ones(1, heads, length, dim, dtype=dtype)
    width = torch.linspace(0.5, 1.5, heads, dtype=dtype).requires_grad_(backward)
    try:
        with Recorder(length * dim * heads) as rec:
            if bandwidths:
                out = slicedkern.hat_attention(q, k, v, width, causal=causal, engine="triton")
            else:
                out = slicedkern.relu_attention(q, k, v, causal=causal, engine="triton")
            forward = _counts(launches, rec, (out,), length * dim * heads * dtype.itemsize)
            inputs = (q, k, v, width) if bandwidths else (q, k, v)
            grads = torch.autograd.grad(out, inputs, cot) if backward else ()
    finally:
        for name, jitted in originals.items():
            setattr(kernels, name, jitted)
    if not backward:
        return forward
    return {**_counts(launches, rec, (out, *grads), length * dim * heads * dtype.itemsize), "forward": forward}


def _counts(launches: collections.Counter, rec: Recorder, kept: tuple, values_bytes: int) -> dict:
    """What ``launches`` and ``rec`` have counted so far; ``kept`` (the output, the gradients) are
    not intermediates."""
    kept = {t.untyped_storage().data_ptr() for t in kept}
    large = [(op, n, dt) for op, n, dt, ptr in rec.large if ptr not in kept]
    # a sort is torch's or, for short rows of float32 scores, one launch of the engine's own; the
    # one-launch forward of short rows sorts the keys and the queries in it
    sorted_dtypes = {str(dt).replace("torch.", "") for dt in rec.sorted_dtypes}
    sorted_dtypes |= {"float32"} if launches["sort_rows"] or launches["small_attend"] else set()
    sorts = rec.ops["sort"] + rec.ops["argsort"] + launches["sort_rows"] + 2 * launches["small_attend"]
    return {"launches": {name: n for name, n in launches.items() if n}, "sorts": sorts,
            "sorted dtypes": sorted(sorted_dtypes),
            # values read back to the host (``.item()``, ``bool(tensor)``): each a device synchronisation
            "host reads": rec.ops["_local_scalar_dense"],
            "large intermediates": len(large),
            "large float64": sum(dt == torch.float64 for _, _, dt in large),
            "large bytes / (n D itemsize)": sum(n * dt.itemsize for _, n, dt in large) / values_bytes,
            # every intermediate, small ones too (a causal level's arrays are each below n * D)
            "all bytes / (n D itemsize)": sum(b for b, ptr in rec.allocated if ptr not in kept) / values_bytes,
            "by op": dict(collections.Counter(op for op, _, _ in large))}


#: Operators that launch no kernel: views, metadata and bare allocations.
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "resize_", "lift_fresh", "set_", "detach",
              "alias", "is_nonzero", "result_type"}


class HostOps(TorchDispatchMode):
    """The aten operators a call runs that would launch a kernel on a GPU, by name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        returns = func._schema.returns
        view = bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
        if not view and name not in _NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def host_cost(length: int, dim: int, heads: int, backward: bool, repeat: int = 20, dtype=torch.float32,
              causal: bool = False) -> dict:
    """One call's host work, the engine's Triton launches replaced by no-ops (the results are then
    meaningless; only the host's work is measured): ``launches``, ``operators`` (the kernel-launching
    torch operators of a warm call, total and ``by op``) and ``host ms`` (the fastest of ``repeat``
    calls). The results are never read back: the backward decides nothing on the host (the rows
    whose normaliser sum is exactly 0 are a mask, ``_vjp._silent_rows``), so the counts are those
    of a real call."""
    import time

    from slicedkern.engines.triton import _sums
    kernels = _sums.loaded()
    launches = collections.Counter()
    originals = {name: getattr(kernels, name) for name in kernels.KERNELS}

    class Skipped:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches[self.name] += 1
            return launch
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, length, generator=g, dtype=dtype).requires_grad_(backward)
    k = torch.randn(1, heads, length, generator=g, dtype=dtype).requires_grad_(backward)
    v = torch.randn(1, heads, length, dim, generator=g, dtype=dtype).requires_grad_(backward)
    cot = torch.ones(1, heads, length, dim, dtype=dtype)

    def call():
        out = slicedkern.relu_attention(q, k, v, causal=causal, engine="triton")
        return torch.autograd.grad(out, (q, k, v), cot) if backward else out
    try:
        for name in originals:
            setattr(kernels, name, Skipped(name))
        call()                                    # warm: what is made once per profile and device
        launches.clear()
        with HostOps() as rec:
            call()
        calls = dict(launches)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    finally:
        for name, jitted in originals.items():
            setattr(kernels, name, jitted)
    return {"launches": calls, "operators": sum(rec.ops.values()), "host ms": min(times) * 1e3,
            "by op": dict(rec.ops.most_common())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--host", action="store_true", help="the host's share of a call instead (launches skipped)")
    p.add_argument("--causal", action="store_true", help="causal attention (the levels of the divide and conquer)")
    p.add_argument("--bandwidths", action="store_true", help="hat attention with learned per-head bandwidths")
    p.add_argument("--two-pass", action="store_true",
                   help="the sorts and two passes at every length (no one-launch forward of short rows)")
    a = p.parse_args(argv)
    if a.two_pass:
        from slicedkern.engines.triton import _sums
        _sums.SMALL_FUSED = 0
    both = None if a.host else count(a.length, a.dim, a.heads, True, causal=a.causal, bandwidths=a.bandwidths)
    for backward in (False, True):
        if a.host:
            found = host_cost(a.length, a.dim, a.heads, backward, causal=a.causal)
        else:
            found = {key: value for key, value in both.items() if key != "forward"} if backward else both["forward"]
        print(f"{'causal ' if a.causal else ''}{'forward+backward' if backward else 'forward'}, L = {a.length}, "
              f"D = {a.dim}, H = {a.heads}, float32:")
        for key, value in found.items():
            print(f"  {key}: {value}")


if __name__ == "__main__":
    main()
