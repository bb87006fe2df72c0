"""GPU benchmark of the triton engine next to SDPA (FlashAttention), one command:

    pip install -e ".[triton]" && python scripts/gpu_bench.py --accuracy --json gpu_bench.json

Forward and forward+backward, float32 and bfloat16, B = 1, H = 8, D = 64, L = 1K ... 1M: time
(median of ``--repeat`` CUDA-event timings after warm-up), peak memory
(``torch.cuda.max_memory_allocated`` above the inputs) and the fraction of the memory-bandwidth
floor (the bytes that must move, over the card's bandwidth, divided by the measured time).
``--accuracy`` adds the normwise error of float32 / bfloat16 ReLU attention at L = 2^20 against the
float64 scan engine on the same (rounded) inputs. Prints a Markdown table; ``--json PATH`` saves the
rows. Targets (issue 15, here and never in a test): faster than SDPA from L <= 2048, >= 10x at 64K,
fwd+bwd at 1M fits, within 2x of the bandwidth floor from 64K on.

``--device cpu`` with ``TRITON_INTERPRET=1`` and small ``--lengths`` runs every code path under
Triton's interpreter (a smoke test; its times mean nothing).
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
    """Bytes any implementation must move: read q, k (one score per token), v; write the output;
    with the backward also read the output cotangent and write dq, dk, dv."""
    fwd = H * (2 * L + 2 * L * D) * itemsize
    bwd = H * (L * D + 2 * L + L * D) * itemsize if backward else 0
    return fwd + bwd


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


def run_ours(args, engine):
    def call(q, k, v):
        return slicedkern.relu_attention(q, k, v, engine=engine)
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


def measure(name, call, make, L, D, H, dtype, device, backward, repeat, bandwidth):
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

    try:
        seconds = timed(step, device, repeat)
    except torch.cuda.OutOfMemoryError:
        return {"impl": name, "L": L, "dtype": str(dtype).split(".")[-1], "pass": "fwd+bwd" if backward else "fwd",
                "ms": None, "peak_MiB": None, "floor_frac": None, "note": "out of memory"}
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20 if device.type == "cuda" else None
    floor = floor_bytes(L, D, H, torch.finfo(dtype).bits // 8, backward)
    frac = floor / (bandwidth * 1e9) / seconds if bandwidth else None
    return {"impl": name, "L": L, "dtype": str(dtype).split(".")[-1], "pass": "fwd+bwd" if backward else "fwd",
            "ms": seconds * 1e3, "peak_MiB": peak, "floor_frac": frac, "note": ""}


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
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--sdpa-max-length", type=int, default=262144,
                   help="skip SDPA above this L (quadratic time; 1M takes minutes per call)")
    p.add_argument("--engines", default="triton", help="comma list of our engines to time (triton, scan)")
    p.add_argument("--bandwidth", type=float, default=None, help="card bandwidth in GB/s (default: by name)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--accuracy", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    bandwidth = a.bandwidth or card_bandwidth(device)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else device}, "
          f"bandwidth {bandwidth} GB/s, torch {torch.__version__}")
    print("| impl | L | dtype | pass | time | peak memory above inputs | fraction of bandwidth floor | note")
    rows = []
    for L in (int(x) for x in a.lengths.split(",")):
        for dt in (getattr(torch, d) for d in a.dtypes.split(",")):
            for backward in (False, True):
                for engine in a.engines.split(","):
                    rows.append(measure(engine, run_ours(a, engine), ours_inputs, L, a.dim, a.heads, dt, device,
                                        backward, a.repeat, bandwidth))
                if L <= a.sdpa_max_length:
                    name = "sdpa-flash" if dt != torch.float32 else "sdpa-efficient"
                    rows.append(measure(name, run_sdpa(device), sdpa_inputs, L, a.dim, a.heads, dt, device,
                                        backward, a.repeat, bandwidth))
                for r in rows[-(len(a.engines.split(",")) + (L <= a.sdpa_max_length)):]:
                    print(_fmt(r), flush=True)
    if a.accuracy:
        for dtype, err in accuracy(device):
            print(f"accuracy L=2^20 {dtype}: {err:.3g} normwise vs float64 scan")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


def _fmt(r):
    def num(x, spec):
        return "-" if x is None else format(x, spec)
    return (f"| {r['impl']:>14} | {r['L']:>8} | {r['dtype']:>8} | {r['pass']:>7} | {num(r['ms'], '10.3f')} ms "
            f"| {num(r['peak_MiB'], '9.1f')} MiB | floor {num(r['floor_frac'], '6.3f')} | {r['note']}")


if __name__ == "__main__":
    main()
