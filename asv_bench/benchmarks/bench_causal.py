"""Causal attention and decoding (torch, CPU), next to softmax attention.

* ``CausalAttention``: ``relu_attention(q, k, v, causal=True)`` on 8 rows of ``n`` float32 scores and
  D = 64 values, forward and forward + backward, per engine; the peers are the same op without
  ``causal`` (``"noncausal"``: issue 25's targets are ratios to it) and
  ``scaled_dot_product_attention(is_causal=True)`` on (8, 1, n, 64) queries, keys and values (up to
  n = 16384: beyond, one call takes minutes).
* ``Decode``: the time of one generated token of one attention layer at cache length ``n`` (batch 1,
  4 heads of dimension 16): a ``DecodeCache`` append + attend (compiled on the host where numba is
  installed, whatever the engine parameter), or a softmax KV-cache step (write into a preallocated
  buffer, then ``scaled_dot_product_attention`` of the new query). The cache grows by one token per
  timed call; asv's few hundred calls move ``n`` by well under 1%.

``python -m slicedkern bench --causal`` prints the same comparisons as one table.
"""

from __future__ import annotations

from .common import BACKENDS, ENGINES, Benchmark, backend_module, public, random_inputs

ROWS = 8
DIM = 64
HEADS, HEAD_DIM = 4, 16


class CausalAttention(Benchmark):
    """Causal attention, forward and forward + backward, per engine, with SDPA as the peer."""

    params = [BACKENDS, ENGINES, [2 ** 12, 2 ** 14, 2 ** 16], ["slicedkern", "noncausal", "sdpa"]]
    param_names = ["backend", "engine", "n", "method"]
    timeout = 600

    def setup(self, backend, engine, n, method):
        if backend != "torch" or (method == "sdpa" and (engine != "scan" or n > 2 ** 14)):
            raise NotImplementedError("torch only; SDPA once (under engine 'scan'), up to n = 16384")
        backend_module("torch")
        import torch
        q, k, v, _ = random_inputs(n, batch=ROWS, dim=DIM)
        if method == "sdpa":
            sdpa = torch.nn.functional.scaled_dot_product_attention
            self.inputs = tuple(torch.from_numpy(v).unsqueeze(1).requires_grad_(True) for _ in range(3))
            self.fn = lambda *a: sdpa(*a, is_causal=True)
        else:
            relu_attention = public("relu_attention")
            self.inputs = tuple(torch.from_numpy(a).requires_grad_(True) for a in (q, k, v))
            causal = method == "slicedkern"
            self.fn = lambda *a: relu_attention(*a, causal=causal, engine=engine)
        try:
            self.time_forward_backward(backend, engine, n, method)           # warm-up; skips what this version lacks
        except (TypeError, ValueError) as exc:              # no causal=, or an engine without a causal mode
            raise NotImplementedError(f"not available here: {exc}") from exc

    def time_forward(self, backend, engine, n, method):
        import torch
        with torch.no_grad():
            self.fn(*self.inputs)

    def time_forward_backward(self, backend, engine, n, method):
        import torch
        torch.autograd.grad(self.fn(*self.inputs).sum(), self.inputs)


class Decode(Benchmark):
    """Time per generated token at cache length ``n``: ``DecodeCache`` or a softmax KV-cache step."""

    params = [BACKENDS, ENGINES, [2 ** 10, 2 ** 11, 2 ** 14, 2 ** 17, 2 ** 20], ["DecodeCache", "softmax"]]
    param_names = ["backend", "engine", "n", "method"]
    timeout = 600

    def setup(self, backend, engine, n, method):
        if backend != "torch" or engine != "scan":
            raise NotImplementedError("torch; DecodeCache picks its runs itself: timed once")
        backend_module("torch")
        import torch
        g = torch.Generator().manual_seed(0)
        self.new_k, self.new_q = torch.randn(1, HEADS, 1, generator=g), torch.randn(1, HEADS, 1, generator=g)
        self.new_v = torch.randn(1, HEADS, 1, HEAD_DIM, generator=g)
        if method == "DecodeCache":
            cache = public("DecodeCache")("relu")              # skips a version without it
            cache.append(torch.randn(1, HEADS, n, generator=g), torch.randn(1, HEADS, n, HEAD_DIM, generator=g))
            self.cache = cache
            return
        # room for asv's timed calls beyond n; only the first t + 1 rows are read
        self.keys = torch.randn(1, HEADS, n + 4096, HEAD_DIM, generator=g)
        self.values = torch.randn(1, HEADS, n + 4096, HEAD_DIM, generator=g)
        self.length = n

    def time_token(self, backend, engine, n, method):
        if method == "DecodeCache":
            self.cache.append(self.new_k, self.new_v)
            self.cache.attend(self.new_q)
            return
        import torch
        t = min(self.length, self.keys.shape[2] - 1)
        self.keys[:, :, t], self.values[:, :, t] = self.new_v[:, :, 0], self.new_v[:, :, 0]
        torch.nn.functional.scaled_dot_product_attention(self.new_v, self.keys[:, :, :t + 1], self.values[:, :, :t + 1])
        self.length += 1
