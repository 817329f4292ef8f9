"""Packed all-reduces: many small tensors reduced across processes with one collective, nothing read to the host.

The number of collectives does not grow with the number of tensors, nor (a ring all-reduce) the bytes per process
with the number of processes; the cost at scale: ``docs/integrations.md#what-is-synced-and-how``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["all_reduce_max", "all_reduce_packed", "pack", "unpack"]

Op = Literal["sum", "max", "min"]


def pack(tensors: Sequence[Tensor]) -> Tensor:
    """Concatenate ``tensors`` into one flat buffer of their promoted dtype.

    Promotion is exact for the reductions used here: float32 values, counts and maxima survive a round trip through
    float64 unchanged.
    """
    if not tensors:
        raise ValueError("pack: expected at least one tensor, got none")
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def unpack(buffer: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Split ``buffer`` back into tensors of the shapes and dtypes of ``like`` (the inverse of :func:`pack`)."""
    sizes = [t.numel() for t in like]
    if sum(sizes) != buffer.numel():
        raise ValueError(f"unpack: the buffer holds {buffer.numel()} elements, the tensors {sum(sizes)}")
    return [c.reshape(t.shape).to(t.dtype) for c, t in zip(buffer.split(sizes), like, strict=True)]


def all_reduce_packed(tensors: Sequence[Tensor], op: Op = "sum", group: Any = None) -> list[Tensor]:
    """New tensors, of the shapes and dtypes of ``tensors`` (not modified), reduced over ``group`` by one all_reduce.

    Every process of the group (``None``: the default one) must call this with tensors of the same shapes, in the same
    order: the collective pairs buffers element by element. Without an initialised process group the inputs are
    returned as they are.
    """
    if op not in ("sum", "max", "min"):
        raise ValueError(f"all_reduce_packed: expected op in ['max', 'min', 'sum'], got {op!r}")
    if not tensors or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return list(tensors)
    buffer = pack(tensors)
    torch.distributed.all_reduce(buffer, op=getattr(torch.distributed.ReduceOp, op.upper()), group=group)
    return unpack(buffer, tensors)


def all_reduce_max(t: Tensor) -> Tensor:
    """MAX of ``t`` over the processes of the default group (``t`` itself without one)."""
    return all_reduce_packed([t], "max")[0]
