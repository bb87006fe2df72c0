"""``python -m slicedkern bench --causal``: causal sliced attention and decoding next to softmax (torch, CPU).

Two tables, every method timed round-robin (one call of each in turn) and the best of ``repeats``
reported, so that a busy machine biases every method alike:

* **Causal attention** at each length ``L``: :func:`slicedkern.relu_attention` with ``causal=True``
  on every engine that has a causal mode (the engine the library picks first), and without
  ``causal`` on the default engine, forward and forward + backward (gradients of ``sum(out)`` for
  ``q, k, v``), on ``batch`` rows of ``L`` float32 scores and ``dim`` values; next to
  ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` on ``(batch, 1, L, dim)``
  queries, keys and values. SDPA costs ``O(L^2 dim)``: where one call would exceed ``budget``
  seconds it is timed at the largest power-of-two length that fits and scaled by ``(L / L0)^2``
  (marked ``~``).
* **Decoding**, per generated token of one attention layer at each cache length ``n`` (batch 1,
  4 heads of dimension ``decode_dim``): one :class:`slicedkern.DecodeCache` ``append`` + ``attend``
  of one token after a bulk fill of ``n`` keys, next to a softmax KV-cache step (write the new key
  and value into a preallocated buffer, then ``scaled_dot_product_attention`` of the new query over
  the filled part), mean over ``steps`` tokens. The mean includes the merges of
  runs of up to ``steps`` keys; the rarer larger merges are amortised over more tokens than are timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from .. import engines
from ..ops.attention import relu_attention
from ..ops.decode import DecodeCache

__all__ = ["CAUSAL_SIZES", "DECODE_SIZES", "run_causal"]

CAUSAL_SIZES = (1024, 4096, 16384)
DECODE_SIZES = (2 ** 10, 2 ** 11, 2 ** 14, 2 ** 17, 2 ** 20)
DECODE_HEADS = 4


def _best(methods: dict[str, Callable[[], object]], repeats: int, clock=time.perf_counter) -> dict[str, float]:
    best = {name: float("inf") for name in methods}
    for _ in range(max(repeats, 1)):
        for name, fn in methods.items():
            start = clock()
            fn()
            best[name] = min(best[name], clock() - start)
    return best


def _sliced(torch, q, k, v, *, causal: bool, backward: bool, engine: str | None):
    def run():
        if not backward:
            with torch.no_grad():
                return relu_attention(q, k, v, causal=causal, engine=engine)
        args = [a.detach().requires_grad_() for a in (q, k, v)]
        return torch.autograd.grad(relu_attention(*args, causal=causal, engine=engine).sum(), args)
    return run


def _sdpa(torch, rows: int, length: int, dim: int, *, backward: bool):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(rows, 1, length, dim, generator=g) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        if not backward:
            with torch.no_grad():
                return sdpa(q, k, v, is_causal=True)
        args = [a.detach().requires_grad_() for a in (q, k, v)]
        return torch.autograd.grad(sdpa(*args, is_causal=True).sum(), args)
    return run


def _sdpa_length(torch, rows: int, length: int, dim: int, budget: float, backward: bool) -> int:
    """The largest power-of-two length <= ``length`` whose SDPA call fits ``budget`` seconds, from a
    probe at (at most) 1024 scaled quadratically."""
    probe = min(length, 1024)
    t = _best({"probe": _sdpa(torch, rows, probe, dim, backward=backward)}, 1)["probe"]
    size = probe
    while size < length and t * (2 * size / probe) ** 2 <= budget:
        size *= 2
    return size


def causal_engines() -> list[str]:
    """The registered engines with a causal mode that run on CPU torch tensors here, in the registry's
    order of preference (triton, whose causal mode runs on CUDA tensors, is not one of them)."""
    return [name for name in engines.available("torch") if engines.get(name).supports_causal]


def _attention_table(torch, sizes: Sequence[int], batch: int, dim: int, repeats: int, budget: float,
                     engines: list[str], clock) -> list[str]:
    lines = [f"Causal attention: torch CPU float32, {batch} rows, D = {dim}, best of {repeats} round-robin "
             "calls; ~ = SDPA timed at a shorter length and scaled by (L / L0)^2", "",
             "| L | method | forward (ms) | fwd+bwd (ms) | SDPA fwd+bwd / this |", "|---:|---|---:|---:|---:|"]
    g = torch.Generator().manual_seed(0)
    for n in sizes:
        q, k = torch.randn(batch, n, generator=g), torch.randn(batch, n, generator=g)
        v = torch.randn(batch, n, dim, generator=g)
        rows = {f"relu causal, engine={e}": dict(causal=True, engine=e) for e in engines}
        rows["relu, not causal (default engine)"] = dict(causal=False, engine=None)
        methods, scale = {}, {}
        for label, options in rows.items():
            for backward in (False, True):
                run = _sliced(torch, q, k, v, backward=backward, **options)
                run()                                   # first use: compilation, allocator
                methods[(label, backward)] = run
        for backward in (False, True):
            size = _sdpa_length(torch, batch, n, dim, budget, backward)
            methods[("SDPA is_causal", backward)] = _sdpa(torch, batch, size, dim, backward=backward)
            scale[backward] = (n / size) ** 2
        best = _best(methods, repeats, clock)
        sdpa_total = best[("SDPA is_causal", True)] * scale[True]
        for label in [*rows, "SDPA is_causal"]:
            cells = []
            for backward in (False, True):
                factor = scale[backward] if label == "SDPA is_causal" else 1.0
                cells.append(f"{'~' if factor != 1.0 else ''}{best[(label, backward)] * factor * 1e3:.1f}")
            ratio = sdpa_total / best[(label, True)] if label != "SDPA is_causal" else 1.0
            lines.append(f"| {n} | {label} | {cells[0]} | {cells[1]} | {ratio:.2f} |")
    return lines


def _decode_table(torch, sizes: Sequence[int], dim: int, steps: int, clock, heads: int = DECODE_HEADS) -> list[str]:
    lines = [f"Decoding: time per generated token of one attention layer, batch 1, {heads} heads of dimension "
             f"{dim}, float32, mean over {steps} tokens after a bulk fill of n keys", "",
             "| n | DecodeCache (µs) | softmax KV cache, SDPA (µs) | softmax / DecodeCache |", "|---:|---:|---:|---:|"]
    g = torch.Generator().manual_seed(0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for n in sizes:
        total = n + steps
        k, q = torch.randn(1, heads, total, generator=g), torch.randn(1, heads, total, generator=g)
        v = torch.randn(1, heads, total, dim, generator=g)
        cache = DecodeCache("relu")
        cache.append(k[..., :n], v[..., :n, :])
        start = clock()
        for t in range(n, total):
            cache.append(k[..., t:t + 1], v[..., t:t + 1, :])
            cache.attend(q[..., t:t + 1])
        ours = (clock() - start) / steps
        del cache
        keys, values = torch.randn(1, heads, total, dim, generator=g), torch.randn(1, heads, total, dim, generator=g)
        new = torch.randn(1, heads, 1, dim, generator=g)
        start = clock()
        for t in range(n, total):
            keys[:, :, t], values[:, :, t] = new[:, :, 0], new[:, :, 0]
            sdpa(new, keys[:, :, :t + 1], values[:, :, :t + 1])
        softmax = (clock() - start) / steps
        lines.append(f"| {n} | {ours * 1e6:.1f} | {softmax * 1e6:.1f} | {softmax / ours:.2f} |")
    return lines


def run_causal(*, sizes: Sequence[int] = CAUSAL_SIZES, decode_sizes: Sequence[int] = DECODE_SIZES,
               batch: int = 8, dim: int = 64, repeats: int = 3, steps: int = 64, budget: float = 3.0,
               decode_dim: int = 16, clock: Callable[[], float] = time.perf_counter) -> str:
    """Run both sections (module docstring) and return them as Markdown tables.

    Parameters
    ----------
    sizes : sequence of int
        Sequence lengths ``L`` of the causal-attention section (empty: skip it).
    decode_sizes : sequence of int
        Cache lengths ``n`` of the decoding section (empty: skip it).
    batch, dim : int
        Rows and value dimension ``D`` of the causal-attention section.
    repeats : int
        Timed calls per method in the causal-attention section; the best is reported.
    steps : int
        Generated tokens timed per cache length.
    budget : float
        Seconds one SDPA call may take before it is timed shorter and extrapolated.
    decode_dim : int
        Head dimension of the decoding section (4 heads, batch 1).
    clock : callable
        The clock of every timing: wall seconds, or ``time.process_time`` for CPU seconds of the
        process (on a machine shared with other jobs, wall time mostly measures the waiting).

    Returns
    -------
    str

    Raises
    ------
    ValueError
        If torch is not installed (both sections compare with torch's softmax attention).

    Examples
    --------
    >>> from slicedkern.bench.causal import run_causal
    >>> print(run_causal(sizes=[256], decode_sizes=[256], repeats=1, steps=4))  # doctest: +SKIP
    """
    try:
        import torch
    except ImportError:
        raise ValueError("--causal compares with torch's softmax attention: pip install torch") from None
    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} threads"]
    if sizes:
        lines += ["", *_attention_table(torch, sizes, batch, dim, repeats, budget, causal_engines(), clock)]
    if decode_sizes:
        lines += ["", *_decode_table(torch, decode_sizes, decode_dim, steps, clock)]
    return "\n".join(lines)
