"""The torch side of sequence-parallel attention: a communicator over a process group, and the
agreement check every rank runs before the first collective (the autograd node is the adapters').

Imported only once a torch tensor reaches :mod:`slicedkern.distributed`.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

__all__ = ["TorchComm", "check_group", "agree"]

#: The dtypes a rank may hold, coded for the agreement check.
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: The length of the agreement vector: fields and batch dims, padded.
_META = 24


def check_group(group):
    """The group to use, or ``RuntimeError`` (the same on every rank, so nobody waits on a collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("slicedkern.distributed needs an initialised torch.distributed process group: "
                           "call torch.distributed.init_process_group(...) on every rank first "
                           "(argument 'group')")
    group = dist.group.WORLD if group is None else group
    if dist.get_rank(group) < 0:
        raise ValueError("argument 'group': this process is not a member of the group")
    return group


class TorchComm:
    """Collectives over a process group; ``log`` (a list, optional) records every call and its bytes."""

    def __init__(self, group, log=None):
        self.group, self.log = group, log
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def _record(self, op, t):
        if self.log is not None:
            self.log.append((op, t.numel() * t.element_size()))

    def gather(self, x, axis):
        block = torch.movedim(x, axis, 0).contiguous()
        self._record("all_gather", block)
        blocks = [torch.empty_like(block) for _ in range(self.size)]
        dist.all_gather(blocks, block, group=self.group)
        return torch.movedim(torch.cat(blocks, 0), 0, axis)

    def scatter_sum(self, x, axis):
        full = torch.movedim(x, axis, 0).contiguous()
        self._record("reduce_scatter", full)
        blocks = list(full.chunk(self.size, 0))
        out = torch.empty_like(blocks[0])
        dist.reduce_scatter(out, blocks, group=self.group)
        return torch.movedim(out, 0, axis)

    def sum(self, x):
        out = x.contiguous().clone()
        self._record("all_reduce", out)
        dist.all_reduce(out, group=self.group)
        return out


def _describe(prepared, error) -> list[int]:
    """The facts every rank must agree on, as integers (-1: this rank's own checks failed)."""
    if error is not None:
        return [-1] + [0] * (_META - 1)
    spec, inputs = prepared.spec, prepared.inputs
    q, k, v = inputs[:3]
    batch = list(q.shape[:-1])
    code = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else 9
    grad = torch.is_grad_enabled() and any(a.requires_grad for a in inputs if a.is_floating_point())
    facts = [1, q.shape[-1], k.shape[-1], v.shape[-1], code, _DTYPES.index(v.dtype) if v.dtype in _DTYPES else 9,
             zlib.crc32(repr(spec).encode()), int(grad), len(batch)] + batch
    if len(facts) > _META:
        raise ValueError(f"arguments 'q', 'k', 'v': at most {_META - 9} batch dims, got {len(batch)}")
    return facts + [0] * (_META - len(facts))


_FIELDS = ("queries per rank (q.shape[-1])", "keys per rank (k.shape[-1])", "value width (v.shape[-1])",
           "score dtype", "value dtype", "options and kernel",
           "gradient recording (some rank's inputs require grad, another's do not)", "batch rank")


def device_of(group):
    """Where the group's collectives take their tensors: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(prepared, error, group, log=None):
    """Raise on every rank unless all ranks validated their arguments and agree on shapes and dtypes.

    One small all-gather, before any other collective: a rank whose own checks failed still takes
    part (and raises its own error afterwards), so no rank is left waiting.
    """
    try:
        facts = _describe(prepared, error)
    except ValueError as exc:
        error, facts = exc, _describe(None, exc)
    mine = torch.tensor(facts, dtype=torch.int64, device=device_of(group))
    size = dist.get_world_size(group)
    if log is not None:
        log.append(("all_gather", mine.numel() * mine.element_size()))
    everyone = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(everyone, mine, group=group)
    table = [t.tolist() for t in everyone]
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(table) if row[0] < 0]
    if failed:
        raise ValueError(f"slicedkern.distributed: the arguments of rank(s) {failed} failed validation "
                         "(their own error says why); every rank stops")
    for i, field in enumerate(_FIELDS, start=1):
        values = [row[i] for row in table]
        if len(set(values)) > 1:
            if i in (4, 5):
                values = [str(_DTYPES[c]) if c < len(_DTYPES) else "other" for c in values]
            raise ValueError(f"arguments 'q', 'k', 'v': the ranks disagree on the {field}: "
                             f"{dict(enumerate(values))}; every rank must hold a shard of the same length, "
                             "dtype and batch shape, and pass the same options")
    batches = {tuple(row[9:9 + row[8]]) for row in table}
    if len(batches) > 1:
        raise ValueError(f"arguments 'q', 'k', 'v': the ranks disagree on the batch shape: {sorted(batches)}")
