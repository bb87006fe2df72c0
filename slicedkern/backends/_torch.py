"""PyTorch fast paths (CPU and CUDA)."""

from __future__ import annotations

import torch


def searchsorted_right(sorted_keys, values, strict=False):
    """torch's native batched ``searchsorted`` (leading shapes must match exactly)."""
    return torch.searchsorted(sorted_keys.contiguous(), values.contiguous(), right=not strict)


def take_rows(table, index):
    """``torch.gather`` with the index expanded over the columns (a view, no copy).

    ``take_along_dim`` would also do it, but it wraps negative indices first (a full extra pass).
    """
    return torch.gather(table, -2, index[..., None].expand(*index.shape, table.shape[-1]))


def prefix_table(keys, weights):
    """One allocation: write ``[w, y w]`` below a zero row, then an in-place cumulative sum."""
    m, c = weights.shape[-2], weights.shape[-1]
    table = torch.empty((*weights.shape[:-2], m + 1, 2 * c), dtype=keys.dtype, device=keys.device)
    table[..., 0, :] = 0
    table[..., 1:, :c] = weights
    table[..., 1:, c:] = table[..., 1:, :c]
    table[..., 1:, c:] *= keys[..., None]
    return table.cumsum_(-2)


# ------------------------------------------------------------------------------- autograd adapter
def _namespace():
    import array_api_compat.torch as xp
    return xp


class SortScan(torch.autograd.Function):
    """One sort-scan op (its static ``spec``) as an autograd node.

    ``forward`` is context-free and ``setup_context`` saves only the inputs, the output and a few
    per-query scalars of the attention normaliser, so the graph holds ``O(n Dv)`` memory like the
    inputs; ``backward`` is the same core VJP as JAX's and :func:`slicedkern.vjp`.
    """

    @staticmethod
    def forward(spec, out_dtype, *arrays):
        from .._diff import forward
        out, residuals = forward(spec, arrays, xp=_namespace())
        out = out.to(out_dtype)
        aux = residuals[1] if residuals else {}
        return (out, aux.get("take"), aux.get("relu_count"), aux.get("den"))

    @staticmethod
    def setup_context(ctx, inputs, output):
        spec, _, *arrays = inputs
        out, take, relu_count, den = output
        ctx.spec = spec
        ctx.n_arrays = len(arrays)
        ctx.has_aux = take is not None
        ctx.has_den = den is not None
        saved = list(arrays) + [out]
        if ctx.has_aux:
            saved += [take, relu_count] + ([den] if ctx.has_den else [])
            ctx.mark_non_differentiable(take, relu_count, *([den] if ctx.has_den else []))
        ctx.save_for_backward(*saved)

    @staticmethod
    def backward(ctx, grad_out, *_):
        from .._diff import backward
        saved = ctx.saved_tensors
        arrays = saved[:ctx.n_arrays]
        out = saved[ctx.n_arrays]
        residuals = ()
        if ctx.has_aux:
            aux = {"take": saved[ctx.n_arrays + 1], "relu_count": saved[ctx.n_arrays + 2]}
            if ctx.has_den:
                aux["den"] = saved[ctx.n_arrays + 3]
            residuals = (out, aux)
        if not any(ctx.needs_input_grad[2:]):
            return (None, None) + (None,) * ctx.n_arrays
        grads = backward(ctx.spec, arrays, residuals, grad_out.to(arrays[0].dtype), xp=_namespace())
        grads = [g if need else None for g, need in zip(grads, ctx.needs_input_grad[2:])]
        return (None, None, *grads)


def apply(spec, arrays, out_dtype):
    """Run ``spec`` on torch tensors; an autograd node only when some input requires grad."""
    if torch.is_grad_enabled() and any(a.requires_grad for a in arrays if a.is_floating_point()):
        return SortScan.apply(spec, out_dtype, *arrays)[0]
    from .._diff import forward
    out, _ = forward(spec, arrays, xp=_namespace())
    return out
