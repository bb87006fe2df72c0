"""Registers, spill stack and shared memory of the triton engine's kernels, compiled for a
GPU on a machine without one (Triton's compiler and the ``ptxas`` / ``cuobjdump`` it ships):

    PYTHONPATH=. python scripts/triton_resources.py [--dtypes float32,bfloat16,float64] [--arch 90]
        [--blocks 64,64,32] [--calls forward,small,causal,backward,decode]

The launches of a call are captured with their real arguments from the engine's own functions on
CPU tensors, without running them, then compiled for ``sm_<arch>``: ``forward`` (the small-L sort
``sort_rows`` of 1024 float32 scores, pass 1 ``tile_sums``, pass 2 ``attend_eval``
(attention's epilogue), ReLU with the "abs" normaliser, centred), ``small`` (the same forward of short rows in one
launch, ``small_attend``), ``causal`` (the same kernels as a level of causal
attention runs them: indicator column, no epilogue; the merge of its bottom-up merge sort and its
dense leaves),
``backward`` (every variant a two-pass forward and its backward compile) and ``decode``
(``decode_attend`` of ``DecodeCache``'s device runs, ReLU, centred, "abs"; values in float64
whatever ``--dtypes`` says). A kernel that needs more registers than the 255 a thread may hold
spills to a per-thread stack in local memory
(``STACK``): on a GPU every spilled value is a memory round trip inside the tile loop
(docs/benchmarks.rst, "On a GPU"). The figures come from the Triton installed here, which may not
be the GPU machine's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"     # real JIT functions: compiled here, never launched

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402


def forward_launches(dtype, length: int = 1024, rows: int = 8, dv: int = 64) -> list:
    """``(name, jitted function, args, kwargs)`` of the forward's launches, captured, not run."""
    import array_api_compat.torch as xp

    from slicedkern._spec import Normalizer
    from slicedkern.engines._vjp import Form
    from slicedkern.engines.triton import _sums
    from slicedkern.kernels import Profile, ReLU
    kernels = _sums.loaded()
    captured = []

    class Captured:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                captured.append((self.name, self.fn, args, kwargs))
            return launch
    originals = {name: getattr(kernels, name) for name in ("sort_rows", "tile_sums", "attend_eval")}
    g = torch.Generator().manual_seed(0)
    y, x = torch.randn(rows, length, generator=g), torch.randn(rows, length, generator=g)
    w = torch.randn(rows, length, dv, generator=g).to(dtype)
    try:
        for name, fn in originals.items():
            setattr(kernels, name, Captured(name, fn))
        table = _sums.build_table(xp, y, w, ones=True)
        form = Form(Profile.of(ReLU()), Normalizer("abs", 1e-6), center=True)
        _sums.attend(xp, table, _sums.sort_queries(xp, x), form, (rows,), factor=None, dtype=dtype)
    finally:
        for name, fn in originals.items():
            setattr(kernels, name, fn)
    return captured


def small_launches(dtype, length: int = 1024, rows: int = 8, dv: int = 64) -> list:
    """The one-launch forward of short rows (``attend_small``: sorts, both passes, epilogue), captured."""
    import array_api_compat.torch as xp

    from slicedkern._spec import Normalizer
    from slicedkern.engines._vjp import Form, Inputs
    from slicedkern.engines.triton import _sums
    from slicedkern.kernels import Profile, ReLU
    g = torch.Generator().manual_seed(0)
    y, x = torch.randn(rows, length, generator=g), torch.randn(rows, length, generator=g)
    w = torch.randn(rows, length, dv, generator=g).to(dtype)
    factor = torch.ones(rows, length, dtype=torch.float64)

    def run():
        form = Form(Profile.of(ReLU()), Normalizer("abs", 1e-6), center=True)
        _sums.attend_small(xp, Inputs(x, y, w, None), form, (rows,), factor=factor, dtype=dtype)
    return _captured(("small_attend",), run)


def _variant(args, kwargs) -> str:
    """What makes a launch a compiled variant: its constexpr keywords, the constexpr fields of its
    records and which of its optional arrays are absent (the kernels' heuristics read those)."""
    def constants(value):
        if isinstance(value, triton.language.constexpr):
            return repr(value.value)
        if value is None:
            return "None"
        if isinstance(value, tuple):
            return "(" + ",".join(constants(v) for v in value) + ")"
        return "_"
    return repr(sorted(kwargs.items())) + "".join(constants(a) for a in args)


def _captured(names, run, variants: bool = False) -> list:
    """``(name, jitted function, args, kwargs)`` of the launches of the kernels ``names`` that
    ``run()`` makes, captured, not run: the first of each name, or with ``variants`` the first of
    each compiled variant (a kernel and its constexpr arguments), named ``<kernel>_<i>``."""
    from slicedkern.engines import triton as engine
    from slicedkern.engines.triton import _sums
    kernels = _sums.loaded()
    captured = {}

    class Captured:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                key = (self.name, _variant(args, kwargs)) if variants else self.name
                if key not in captured:
                    number = sum(seen[0] == self.name for seen in captured)
                    label = f"{self.name}_{number}" if variants else self.name
                    captured[key] = (label, self.fn, args, kwargs)
            return launch
    originals = {name: getattr(kernels, name) for name in names}
    accepts = engine.interpreted
    try:
        engine.interpreted = lambda: True      # the engine takes the CPU tensors: nothing is launched
        for name, fn in originals.items():
            setattr(kernels, name, Captured(name, fn))
        run()
    finally:
        engine.interpreted = accepts
        for name, fn in originals.items():
            setattr(kernels, name, fn)
    return list(captured.values())


def causal_launches(dtype, length: int = 1024, heads: int = 8, dv: int = 64) -> list:
    """The launches of one level of causal attention (the first of each kernel), the sort of its
    runs, its combination, the
    pull-back of its dense leaves, the running totals' block sums, and the backward's row dots and
    finish of ``dv``, captured."""
    import slicedkern
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, heads, length, generator=g).to(dtype).requires_grad_() for _ in range(2))
    v = torch.randn(1, heads, length, dv, generator=g).to(dtype).requires_grad_()

    def run():
        out = slicedkern.relu_attention(q, k, v, causal=True, engine="triton")
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    return _captured(("leaf_eval", "tile_sums", "sums_eval", "dots_eval", "merge_runs", "causal_epilogue",
                      "leaf_pullback", "row_dots", "causal_dv", "position_sums", "causal_row_dots", "sort_rows"), run)


def backward_launches(dtype, length: int = 1024, heads: int = 8, dv: int = 64) -> list:
    """Every compiled variant of the kernels that attention's forward and backward launch (ReLU,
    centred, "abs" normaliser), captured; the forward's come first (``_0``). Nothing runs: the
    backward reads unset residuals, on which it decides nothing (``_vjp._silent_rows`` is a mask)."""
    import slicedkern
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, heads, length, generator=g).to(dtype).requires_grad_() for _ in range(2))
    v = torch.randn(1, heads, length, dv, generator=g).to(dtype).requires_grad_()

    def run():
        from slicedkern.engines.triton import _sums
        fused, _sums.SMALL_FUSED = _sums.SMALL_FUSED, 0      # the two-pass forward, whatever the length
        try:
            out = slicedkern.relu_attention(q, k, v, engine="triton")
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        finally:
            _sums.SMALL_FUSED = fused
    return _captured(("sort_rows", "tile_sums", "attend_eval", "sums_eval", "dots_eval", "row_dots",
                      "column_sums"), run, variants=True)


def decode_launches(dtype, length: int = 1000, heads: int = 4, dv: int = 16) -> list:
    """``decode_attend`` of a DecodeCache's device runs (``dtype`` unused: the runs hold float64)."""
    import array_api_compat.torch as xp

    from slicedkern._spec import Normalizer
    from slicedkern.engines.triton._decode import DeviceRuns
    from slicedkern.kernels import Profile, ReLU

    def run():
        runs = DeviceRuns(xp, Profile.of(ReLU()), center=True, normalizer=Normalizer("abs", 1e-6), dv=dv)
        runs.append(torch.randn(heads, length), torch.randn(heads, length, dv))
        runs.attend(torch.randn(heads, 1))
    return _captured(("decode_attend",), run)


def resources(fn, args, kwargs, arch: int) -> dict:
    """Compile ``fn`` for ``sm_<arch>`` at these arguments: ``REG`` (per thread), ``STACK`` (spilled
    bytes per thread), static ``SHARED`` (cuobjdump) and the dynamic shared memory Triton asks for.
    A kernel with heuristics (its flags derived from its arguments) is compiled with their values.

    The signature is the one a launch makes: Triton's own binder specialises the arguments (an
    integer equal to 1, a record's field too, becomes a constant; a Python float is float32), so
    that what compiles here compiles at a launch (Triton 3.6 failed on a record's constant field
    that this script had passed as an integer, docs/benchmarks.rst, "On a GPU")."""
    kwargs = dict(kwargs)
    heuristics = {}
    while isinstance(fn, triton.runtime.Heuristics):
        heuristics.update(fn.values)
        fn = fn.fn
    values = dict(zip(fn.arg_names, args), **kwargs)
    for name, rule in heuristics.items():
        kwargs[name] = rule(values)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    bind = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = bind(*args, debug=False, **kwargs)
    options, signature, constants, attrs = fn._pack_args(backend, {"debug": False, **kwargs}, bound, specialization,
                                                         options)
    compiled = triton.compile(ASTSource(fn, signature, constants, attrs), target=target, options=options.__dict__)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    return {key: int(value) for key, value in found.items()} | {"dynamic SHARED": compiled.metadata.shared,
                                                                 "warps": compiled.metadata.num_warps}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16,float64", help="the values' dtypes")
    p.add_argument("--arch", type=int, default=90, help="compute capability, 90 for Hopper (H100, H200)")
    p.add_argument("--blocks", default=None, help="BLOCK_M,BLOCK_N,BLOCK_C instead of the engine's")
    p.add_argument("--warps", type=int, default=None, help="pass 2's warps instead of the engine's")
    p.add_argument("--calls", default="forward", help="comma list of forward, small, causal, backward, decode")
    a = p.parse_args(argv)
    from slicedkern.engines.triton import _sums
    if a.blocks:
        _sums.BLOCK_M, _sums.BLOCK_N, _sums.BLOCK_C = (int(b) for b in a.blocks.split(","))
    if a.warps:
        _sums.MERGE_WARPS = a.warps
    print(f"triton {triton.__version__}, sm_{a.arch}, blocks (M, N, C) = {_sums.BLOCK_M, _sums.BLOCK_N, _sums.BLOCK_C}"
          f" (float64: at most 16 each), pass 2 on {_sums.MERGE_WARPS} warps")
    calls = {"forward": forward_launches, "small": small_launches, "causal": causal_launches,
             "backward": backward_launches,
             "decode": decode_launches}
    for call in a.calls.split(","):
        for name in a.dtypes.split(",") if call != "decode" else ["float64"]:
            for kernel, fn, args, kwargs in calls[call](getattr(torch, name)):
                print(f"  {call:>8}  {kernel:>13}  {name:>8}  {resources(fn, args, dict(kwargs), a.arch)}",
                      flush=True)


if __name__ == "__main__":
    main()
