"""Packed all-reduces: many small tensors reduced across processes with one collective.

Every process passes tensors of the same shapes in the same order; they are flattened into one buffer of their
common dtype, reduced with a single ``torch.distributed.all_reduce`` and split back, so the number of collectives does
not grow with the number of tensors, and (a ring all-reduce) the bytes per process do not grow with the number of
processes. Nothing is read back to the host. Used to sync the aggregator's states and for per-step agreement between
processes (a flag that one process tripped); the cost at scale: ``docs/integrations.md#what-is-synced-and-how``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["all_reduce_max", "all_reduce_packed", "distributed_ready", "pack", "unpack"]

Op = Literal["sum", "max", "min"]


def distributed_ready() -> bool:
    """Whether ``torch.distributed`` is available and a default process group exists."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def pack(tensors: Sequence[Tensor], dtype: torch.dtype | None = None) -> Tensor:
    """Concatenate ``tensors`` into one flat buffer of ``dtype`` (default: the promoted dtype of all of them).

    Promotion is exact for the reductions used here: float32 values, counts and maxima survive a round trip through
    float64 unchanged.
    """
    if not tensors:
        raise ValueError("pack: expected at least one tensor, got none")
    if dtype is None:
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def unpack(buffer: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Split ``buffer`` back into tensors of the shapes and dtypes of ``like`` (the inverse of :func:`pack`)."""
    sizes = [t.numel() for t in like]
    if sum(sizes) != buffer.numel():
        raise ValueError(f"unpack: the buffer holds {buffer.numel()} elements, the tensors {sum(sizes)}")
    chunks = torch.split(buffer, sizes)
    return [c.reshape(t.shape).to(t.dtype) for c, t in zip(chunks, like, strict=True)]


def all_reduce_packed(tensors: Sequence[Tensor], op: Op = "sum", group: Any = None) -> list[Tensor]:
    """Reduce every tensor of ``tensors`` over the processes of ``group`` with one ``all_reduce``.

    Every process of the group must call this with tensors of the same shapes, in the same order: the collective
    pairs buffers element by element. Without an initialised process group the inputs are returned as they are.

    Args:
        tensors: The local values; not modified.
        op: ``"sum"``, ``"max"`` or ``"min"``.
        group: The process group; ``None`` for the default group.

    Returns:
        New tensors with the reduced values, in the shapes and dtypes of ``tensors``.
    """
    ops = {"sum": "SUM", "max": "MAX", "min": "MIN"}
    if op not in ops:
        raise ValueError(f"all_reduce_packed: expected op in {sorted(ops)}, got {op!r}")
    if not tensors or not distributed_ready():
        return list(tensors)
    buffer = pack(tensors)
    torch.distributed.all_reduce(buffer, op=getattr(torch.distributed.ReduceOp, ops[op]), group=group)
    return unpack(buffer, tensors)


def all_reduce_max(t: Tensor) -> Tensor:
    """MAX of ``t`` over the processes of the default group (``t`` itself without one)."""
    return all_reduce_packed([t], "max")[0]
