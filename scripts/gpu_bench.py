"""GPU benchmark of the attention engines next to SDPA (FlashAttention); the timing part of the GPU
check (``scripts/gpu_check.sh``, issue 26):

    python scripts/gpu_bench.py --accuracy --json gpu_bench.json --budget 240

Per L (1K ... 1M): ``torch.sort`` of 8 x L float32 keys; a device copy of the forward+backward
floor's byte count (the bandwidth this card achieves); then, float32 and bfloat16, B = 1, H = 8,
D = 64, forward and forward+backward of our engines (``--engines``) and of SDPA (flash for bfloat16,
memory-efficient for float32; timed up to ``--sdpa-max-length``, beyond it extrapolated by L^2 and
marked "~"): time (median of ``--repeat`` CUDA-event timings after warm-up), peak memory
(``torch.cuda.max_memory_allocated`` above the inputs) and the fraction of the memory-bandwidth floor
(:func:`floor_bytes` over the vendor bandwidth, divided by the measured time). ``--causal-lengths``
adds causal rows, ``--profile-length`` a torch.profiler kernel table, ``--accuracy`` the normwise
error of float32 / bfloat16 ReLU attention at L = 2^20 against the float64 scan on the same (rounded)
inputs. Every row names the card; ``--json PATH`` is rewritten after every row and ``--budget``
skips the rows not started in time, so a time limit loses nothing already measured. Targets live in
issue 26 (never in a test): faster than SDPA from 4K, >= 100x at 64K, within 2x (forward) and 2.5x
(forward+backward) of the floor from 64K on, 1M forward+backward under 10 ms on an H100.
``--decode-lengths`` adds per-token decoding rows (``DecodeCache`` against a softmax KV cache).

``--device cpu`` with ``TRITON_INTERPRET=1`` and small ``--lengths`` runs every code path under
Triton's interpreter (a smoke test, ``tests/test_bench.py``; its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import slicedkern

#: Peak memory bandwidth in GB/s by device-name fragment (vendor figures); --bandwidth overrides.
BANDWIDTH_GBS = {"H200": 4800.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100-SXM4-80GB": 2039.0,
                 "A100": 1555.0, "L40S": 864.0, "RTX 4090": 1008.0, "A10G": 600.0, "L4": 300.0}


def card_bandwidth(device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, gbs in BANDWIDTH_GBS.items():
        if fragment in name:
            return gbs
    return None


def floor_bytes(L: int, D: int, H: int, itemsize: int, backward: bool) -> int:
    """Bytes any sort-based implementation must move, in the inputs' dtype.

    Forward: read q and k (one score per token) and v, write the output. Backward: read q, k, v again
    (the forward's residuals), the output and its cotangent, write dq, dk and dv; so forward+backward
    moves ``H (6 L + 6 L D)`` elements.
    """
    fwd = H * (2 * L + 2 * L * D)
    bwd = H * (2 * L + L * D + L * D + L * D + 2 * L + L * D) if backward else 0
    return (fwd + bwd) * itemsize


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeat: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()``, CUDA events on a GPU, wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ours_inputs(L, D, H, dtype, device, grad):
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, H, L, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(1, H, L, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(1, H, L, D, generator=g).to(device=device, dtype=dtype)
    return [a.requires_grad_(grad) for a in (q, k, v)]


def sdpa_inputs(L, D, H, dtype, device, grad):
    g = torch.Generator(device="cpu").manual_seed(0)
    return [torch.randn(1, H, L, D, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)
            for _ in range(3)]


def run_ours(engine, causal=False):
    """Our ReLU attention on ``engine`` ("auto": the automatic rule's pick)."""
    chosen = None if engine == "auto" else engine

    def call(q, k, v):
        return slicedkern.relu_attention(q, k, v, engine=chosen, causal=causal)
    return call


def run_sdpa(device):
    def call(q, k, v):
        if device.type != "cuda":
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        # flash has no float32 kernel: there the memory-efficient one, named in the table
        backends = ([SDPBackend.FLASH_ATTENTION] if q.dtype != torch.float32 else [SDPBackend.EFFICIENT_ATTENTION])
        with sdpa_kernel(backends):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return call


def _row(name, L, dtype, phase, **fields):
    row = {"impl": name, "L": L, "dtype": str(dtype).split(".")[-1], "pass": phase, "ms": None, "peak_MiB": None,
           "floor_frac": None, "note": ""}
    row.update(fields)
    return row


def measure(name, call, make, L, D, H, dtype, device, backward, repeat, bandwidth):
    phase = "fwd+bwd" if backward else "fwd"
    try:
        inputs = make(L, D, H, dtype, device, backward)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        cot = None

        def step():
            nonlocal cot
            out = call(*inputs)
            if backward:
                if cot is None:
                    cot = torch.ones_like(out)
                torch.autograd.grad(out, inputs, cot)
            return out

        seconds = timed(step, device, repeat)
    except torch.cuda.OutOfMemoryError:
        return _row(name, L, dtype, phase, note="out of memory")
    except Exception as exc:          # a failing row is a finding, not the end of the check
        return _row(name, L, dtype, phase, note=f"failed: {type(exc).__name__}: {str(exc)[:200]}")
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20 if device.type == "cuda" else None
    floor = floor_bytes(L, D, H, torch.finfo(dtype).bits // 8, backward)
    frac = floor / (bandwidth * 1e9) / seconds if bandwidth else None
    return _row(name, L, dtype, phase, ms=seconds * 1e3, peak_MiB=peak, floor_frac=frac)


def copy_row(L, D, H, dtype, device, repeat):
    """A device copy of the forward+backward floor's byte count: the bandwidth this card achieves."""
    nbytes = floor_bytes(L, D, H, torch.finfo(dtype).bits // 8, True)
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeat)
    # a copy reads and writes half the floor's bytes each
    return _row("device copy", L, dtype, "copy", ms=seconds * 1e3, GBs=nbytes / seconds / 1e9)


def sort_row(L, device, repeat, rows=8):
    """``torch.sort`` of ``rows x L`` float32 keys (what every sort-based pass pays at least once)."""
    keys = torch.randn(rows, L, device=device)
    seconds = timed(lambda: torch.sort(keys, dim=-1), device, repeat)
    return _row(f"torch.sort {rows} x L", L, torch.float32, "sort", ms=seconds * 1e3)


def decode_rows(n, device, steps=256, heads=4, dim=16):
    """Per generated token of one layer call, batch 1, ``heads`` heads of ``dim``, float32: our
    ``DecodeCache`` (``append`` + ``attend``) after a bulk fill of ``n`` keys, against a preallocated
    softmax KV cache (SDPA of the new query), the mean over ``steps`` tokens (issue 25's setting)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    total = n + steps
    k, q = (torch.randn(1, heads, total, generator=g).to(device) for _ in range(2))
    v = torch.randn(1, heads, total, dim, generator=g).to(device)
    rows = []
    try:
        cache = slicedkern.DecodeCache("relu")
        cache.append(k[..., :n], v[..., :n, :])
        cache.attend(q[..., n:n + 1])                 # first use: the kernel's compile
        _sync(device)
        t0 = time.perf_counter()
        for t in range(n, total):
            cache.append(k[..., t:t + 1], v[..., t:t + 1, :])
            cache.attend(q[..., t:t + 1])
        _sync(device)
        ours = (time.perf_counter() - t0) / steps
        rows.append(_row(f"DecodeCache ({type(cache._runs).__name__})", n, torch.float32, "decode token",
                         ms=ours * 1e3))
        del cache
    except Exception as exc:
        rows.append(_row("DecodeCache", n, torch.float32, "decode token",
                         note=f"failed: {type(exc).__name__}: {str(exc)[:200]}"))
    keys, values = (torch.randn(1, heads, total, dim, generator=g).to(device) for _ in range(2))
    new = torch.randn(1, heads, 1, dim, generator=g).to(device)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    _sync(device)
    t0 = time.perf_counter()
    for t in range(n, total):
        keys[:, :, t], values[:, :, t] = new[:, :, 0], new[:, :, 0]
        sdpa(new, keys[:, :, :t + 1], values[:, :, :t + 1])
    _sync(device)
    rows.append(_row("softmax KV cache (SDPA)", n, torch.float32, "decode token",
                     ms=(time.perf_counter() - t0) / steps * 1e3))
    return rows


def profile_table(call, L, D, H, dtype, device, top=15):
    """One forward+backward under torch.profiler: the CUDA kernels by total device time, the host's
    operators by count (each one a launch on a GPU), and the host's wall time of one call against the
    device time of the same call (host-bound when they are close)."""
    from torch.profiler import ProfilerActivity, profile
    q, k, v = ours_inputs(L, D, H, dtype, device, True)
    t0 = time.perf_counter()
    out = call(q, k, v)
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    _sync(device)
    first = time.perf_counter() - t0          # the Triton compile of every kernel this call uses

    def step():
        out = call(q, k, v)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    step()
    _sync(device)
    t0 = time.perf_counter()
    step()
    host = time.perf_counter() - t0           # returns before the device is done, unless it waited
    _sync(device)
    wall = time.perf_counter() - t0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    events = prof.key_averages()
    lines = [f"first call (compiles) {first * 1e3:.1f} ms; warm call: host returned after {host * 1e3:.3f} ms, "
             f"device done after {wall * 1e3:.3f} ms; {sum(e.count for e in events if e.key.startswith('aten::'))}"
             " aten calls",
             events.table(sort_by="cuda_time_total" if device.type == "cuda" else "cpu_time_total", row_limit=top,
                          max_name_column_width=60),
             events.table(sort_by="count", row_limit=top, max_name_column_width=60)]
    return "\n".join(lines)


def accuracy(device, L=2 ** 20, D=64, H=1):
    """Normwise error of ReLU attention in float32 / bfloat16 against float64 on the same inputs."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = ours_inputs(L, D, H, dtype, device, False)
        out = slicedkern.relu_attention(q, k, v, engine="triton").double()
        ref = slicedkern.relu_attention(q.double(), k.double(), v.double(), engine="scan")
        rows.append((str(dtype), float((out - ref).norm() / ref.norm())))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="1024,4096,16384,65536,262144,1048576")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--sdpa-max-length", type=int, default=65536,
                   help="time SDPA up to this L; above it the time is extrapolated by L^2 (marked '~')")
    p.add_argument("--engines", default="triton", help="comma list of our engines to time (triton, scan, auto)")
    p.add_argument("--causal-engines", default="auto", help="comma list of our engines for the causal rows")
    p.add_argument("--causal-lengths", default="",
                   help="comma list of L at which to time our causal attention too (bfloat16 and float32)")
    p.add_argument("--decode-lengths", default="",
                   help="comma list of cache lengths: per-token decoding rows (after the first length's rows)")
    p.add_argument("--bandwidth", type=float, default=None, help="card bandwidth in GB/s (default: by name)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--accuracy", action="store_true")
    p.add_argument("--profile-length", type=int, default=0,
                   help="print a torch.profiler kernel table of one forward+backward at this L")
    p.add_argument("--profile-dtypes", default="bfloat16", help="comma list of dtypes for --profile-length")
    p.add_argument("--budget", type=float, default=float("inf"),
                   help="seconds: rows not started by then are skipped (and listed as skipped)")
    p.add_argument("--json", default=None, help="write the rows here, rewritten after every row")
    p.add_argument("--tiles", default=None,
                   help="keys per tile, queries per block, columns per block and pass 2's warps of the triton "
                        "engine, M,N,C,W, instead of its own (an A/B of the kernels' shapes)")
    p.add_argument("--small-fused", type=int, default=None,
                   help="rows up to this length take the triton engine's one-launch forward (0: never), instead "
                        "of its own threshold (an A/B of the short rows' path)")
    a = p.parse_args(argv)
    if a.small_fused is not None:
        from slicedkern.engines.triton import _sums
        _sums.SMALL_FUSED = a.small_fused
    if a.tiles:
        from slicedkern.engines.triton import _sums
        _sums.BLOCK_M, _sums.BLOCK_N, _sums.BLOCK_C, _sums.MERGE_WARPS = (int(t) for t in a.tiles.split(","))
    device = torch.device(a.device)
    bandwidth = a.bandwidth or card_bandwidth(device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    tiles = f", triton tiles {a.tiles}" if a.tiles else ""
    tiles += f", one-launch forward up to L = {a.small_fused}" if a.small_fused is not None else ""
    print(f"device: {card}, vendor bandwidth {bandwidth} GB/s, torch {torch.__version__}{tiles}", flush=True)
    print("| impl | L | dtype | pass | time | peak memory above inputs | fraction of bandwidth floor | note")
    start, rows = time.perf_counter(), []

    def emit(found):
        for row in found if isinstance(found, list) else [found]:
            row["card"] = card
            rows.append(row)
            print(_fmt(row), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)

    def causal_rows(L, dtypes):
        for dt in dtypes:
            for backward in (False, True):
                for engine in a.causal_engines.split(","):
                    yield lambda L=L, dt=dt, b=backward, e=engine: measure(
                        f"{e} causal", run_ours(e, causal=True), ours_inputs, L, a.dim, a.heads, dt, device, b,
                        a.repeat, bandwidth)

    def plan():
        # the causal rows of a length right after its non-causal ones: the budget reaches them before
        # the longest non-causal lengths
        lengths = [int(x) for x in a.lengths.split(",")]
        causal = [int(x) for x in a.causal_lengths.split(",") if x]
        dtypes = [getattr(torch, d) for d in a.dtypes.split(",")]
        for L in lengths:
            yield lambda L=L: sort_row(L, device, a.repeat)
            for dt in dtypes:
                if device.type == "cuda":
                    yield lambda L=L, dt=dt: copy_row(L, a.dim, a.heads, dt, device, a.repeat)
                for backward in (False, True):
                    for engine in a.engines.split(","):
                        yield lambda L=L, dt=dt, b=backward, e=engine: measure(
                            e, run_ours(e), ours_inputs, L, a.dim, a.heads, dt, device, b, a.repeat, bandwidth)
                    yield lambda L=L, dt=dt, b=backward: sdpa_row(a, L, dt, device, b, bandwidth, rows)
            if L in causal:
                yield from causal_rows(L, dtypes)
            if L == lengths[0]:
                for n in (int(x) for x in a.decode_lengths.split(",") if x):
                    yield lambda n=n: decode_rows(n, device)
        for L in (L for L in causal if L not in lengths):
            yield from causal_rows(L, dtypes)

    skipped = 0
    for make_row in plan():
        if time.perf_counter() - start > a.budget:
            skipped += 1
            continue
        emit(make_row())
    if skipped:
        print(f"skipped {skipped} rows: the budget of {a.budget:.0f} s was spent", flush=True)
    if a.accuracy and time.perf_counter() - start <= a.budget:
        for dtype, err in accuracy(device):
            print(f"accuracy L=2^20 {dtype}: {err:.3g} normwise vs float64 scan", flush=True)
    if a.profile_length:
        engine = a.engines.split(",")[0]
        for name in a.profile_dtypes.split(","):
            print(f"\nkernels of one forward+backward, {engine}, L = {a.profile_length}, {name}, on {card}:")
            print(profile_table(run_ours(engine), a.profile_length, a.dim, a.heads, getattr(torch, name), device),
                  flush=True)

def sdpa_row(a, L, dtype, device, backward, bandwidth, rows):
    """SDPA (flash for half dtypes, memory-efficient for float32) up to ``--sdpa-max-length``; beyond
    it the largest measured time scaled by ``L^2``, marked as extrapolated."""
    name = "sdpa-flash" if dtype != torch.float32 else "sdpa-efficient"
    if L <= a.sdpa_max_length:
        return measure(name, run_sdpa(device), sdpa_inputs, L, a.dim, a.heads, dtype, device, backward, a.repeat,
                       bandwidth)
    phase = "fwd+bwd" if backward else "fwd"
    measured = [r for r in rows if r["impl"] == name and r["dtype"] == str(dtype).split(".")[-1]
                and r["pass"] == phase and r["ms"] is not None and not r["note"]]
    if not measured:
        return _row(name, L, dtype, phase, note="not measured")
    base = max(measured, key=lambda r: r["L"])
    return _row(name, L, dtype, phase, ms=base["ms"] * (L / base["L"]) ** 2,
                note=f"~ extrapolated by L^2 from L = {base['L']}")


def _fmt(r):
    def num(x, spec):
        return "-" if x is None else format(x, spec)
    note = r["note"] or (f"{r['GBs']:.0f} GB/s" if "GBs" in r else "")
    return (f"| {r['impl']:>16} | {r['L']:>8} | {r['dtype']:>8} | {r['pass']:>7} | {num(r['ms'], '10.3f')} ms "
            f"| {num(r['peak_MiB'], '9.1f')} MiB | floor {num(r['floor_frac'], '6.3f')} | {note}")


if __name__ == "__main__":
    main()
