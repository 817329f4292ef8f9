"""What the training batch itself shows: the facts of rule ``repeated_batch`` (``docs/rules.md#repeated_batch``).

A batch of one sample repeated trains the model on one example while the loss falls as if it learned.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_hookdiag._aggregation import LayerStatsAggregator
from lightning_hookdiag._hooks import tensors
from lightning_hookdiag._names import BATCH
from lightning_hookdiag.components import Component, Setup, component

__all__ = ["MIN_ROWS", "ROW_SAMPLE", "BatchRows", "batch_rows", "repeated_rows"]

MIN_ROWS = 8
"""Batches with fewer rows are not judged: small batches of a dataset with few distinct rows repeat by chance."""

ROW_SAMPLE = 4096
"""Elements compared per row at most, evenly strided over the whole row."""


def repeated_rows(batch: Any) -> Tensor | None:
    """Whether every tensor of ``batch`` with 2 or more dims holds one row repeated (0-d bool, on its device).

    Only tensors of at least :data:`MIN_ROWS` rows count (why: ``docs/rules.md#repeated_batch``); ``None``: none does.
    """
    same: Tensor | None = None
    for _, t in tensors(batch):
        if t.dim() < 2 or t.shape[0] < MIN_ROWS or t.is_sparse or t.is_nested:
            continue
        rows = t.detach().reshape(t.shape[0], -1)
        stride = max(1, math.ceil(rows.shape[1] / ROW_SAMPLE))
        sample = rows[:, ::stride]
        equal = (sample == sample[:1]).all()
        same = equal if same is None else same & equal
    return same


class BatchRows(Component):
    """Whether a sampled step's batches repeat one row, pooled as ``batch_rows``: ``[judged, differs]``, maxima.

    Pooled so that every process reaches the same finding: some process judged a batch, and none differed.
    """

    replays = False
    provides = ("batch_repeated",)

    def __init__(self, aggregator: LayerStatsAggregator) -> None:
        self._aggregator = aggregator
        aggregator.add_state("batch_rows", aggregator.new_state(2, dtype=torch.float64), "max")

    @override
    def observe_batch(self, batch: Any) -> None:
        same = repeated_rows(batch)
        if same is not None:
            agg = self._aggregator
            seen = agg.new_state(2, fill=1.0, dtype=torch.float64)  # on the states' device, as batch_rows is
            seen[1] = ~same.to(seen.device)
            agg.pool("batch_rows", seen)

    @override
    def finalize(self, pooled: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {"batch_rows": pooled["batch_rows"]}

    @override
    def facts(self, host: Mapping[str, list[float]]) -> dict[str, Any]:
        """``batch_repeated``: ``{BATCH: 1.0}`` if a judged batch repeated one row on every process, else ``0.0``."""
        judged, differs = host["batch_rows"]
        return {"batch_repeated": {BATCH: 1.0 if differs == 0 else 0.0}} if judged > 0 else {}


@component
def batch_rows(setup: Setup) -> BatchRows | None:
    """The fit's :class:`BatchRows`, when rule ``repeated_batch`` is enabled."""
    return BatchRows(setup.aggregator) if "repeated_batch" in setup.config.rules else None
