"""Scale-out: sequence-parallel attention over a torch process group or a JAX mesh axis.

Each process holds a contiguous shard of the sequence and gets its shard of the output, equal to the
one-process op on the whole sequence (docs/scaling.rst). torch and JAX are imported only when their
arrays arrive. Modules: ``attention`` (the ops: validation, the ranks' agreement, then
the engine wrapper ``slicedkern.engines.ShardedEngine`` through the adapters, as every op runs), ``volume``
(communication volumes), ``_torch`` / ``_jax`` (the communicators; the agreement check).
"""

from . import volume
from .attention import count_bytes, hat_attention, hat_mixture_attention, kernel_attention, relu_attention

__all__ = ["relu_attention", "hat_attention", "hat_mixture_attention", "kernel_attention", "count_bytes",
           "volume"]
