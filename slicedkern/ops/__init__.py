"""The public 1-D ops: each validates its arguments once, builds a spec, selects the engine once and
calls the framework's adapter."""

from .attention import hat_attention, hat_mixture_attention, kernel_attention, relu_attention
from .decode import DecodeCache
from .kernel_sum import kernel_sum
from .segments import segment_ids_from_cu_seqlens

__all__ = ["DecodeCache", "kernel_sum", "relu_attention", "hat_attention", "hat_mixture_attention", "kernel_attention",
           "segment_ids_from_cu_seqlens"]
