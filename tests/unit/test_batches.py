"""repeated_rows (lightning_hookdiag._batches) against hand-built batches, and rule repeated_batch on real fits."""

from __future__ import annotations

import pytest
import torch
from helpers import TinyModule, make_trainer, run_rules
from torch.utils.data import TensorDataset

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag._batches import MIN_ROWS, ROW_SAMPLE, repeated_rows
from lightning_hookdiag.rules import BATCH, RULES


def test_every_counted_tensor_must_repeat_one_row():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (8, 16), generator=g)
    mask = torch.ones(8, 16, dtype=torch.long)  # repeats in any unpadded batch
    labels = torch.zeros(8, dtype=torch.long)  # 1-D: not counted
    assert repeated_rows({"input_ids": tokens, "attention_mask": mask, "labels": labels}).item() is False
    same = tokens[:1].expand(8, -1)
    assert repeated_rows({"input_ids": same, "attention_mask": mask, "labels": labels}).item() is True
    assert repeated_rows([same, (tokens,)]).item() is False  # nested: the second tensor differs
    assert repeated_rows((labels, "text", 3)) is None  # nothing with 2 dims
    assert repeated_rows(same[: MIN_ROWS - 1]) is None  # too few rows to judge


def test_rows_are_compared_at_evenly_strided_elements_over_the_whole_row():
    row = torch.arange(3 * ROW_SAMPLE, dtype=torch.float32)
    batch = row.repeat(8, 1)
    assert repeated_rows(batch).item() is True
    batch[3, 6] = -1.0  # on the stride (every 3rd element): seen
    assert repeated_rows(batch).item() is False
    batch[3, 6], batch[3, 7] = 6.0, -1.0  # between sampled elements: the documented blind spot
    assert repeated_rows(batch).item() is True
    image_rows = torch.zeros(8, 3, 32, 32)
    image_rows[:, :, 8:24, 8:24] = torch.randn(8, 3, 16, 16)  # identical black borders, different centres
    assert repeated_rows(image_rows).item() is False


def test_the_rule_reads_the_fact_and_names_the_batch_before_any_layer():
    values = {"batch_repeated": {BATCH: 1.0}, "act_dead_frac": {"relu": 1.0}}
    findings = run_rules(values, ["lin", "relu"], [], step=4)
    assert [(f.rule, f.layer) for f in findings] == [("repeated_batch", BATCH), ("dead_units", "relu")]
    assert "every row of the training batch is the same sample" in findings[0].message
    assert "step 4" in findings[0].message
    assert run_rules({"batch_repeated": {BATCH: 0.0}}, ["lin"], [], step=4) == []


class _Repeat(TensorDataset):
    def __getitem__(self, index: int):
        return super().__getitem__(0)


def _fit(data: TensorDataset, batch_size: int, **callback) -> LayerHealthCallback:
    module = TinyModule(data=data, batch_size=batch_size)
    module.record_enabled = False
    health = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", **callback, output={"summary": False})
    make_trainer([health], max_steps=2).fit(module)
    return health


@pytest.mark.parametrize("batch_size", [8, 4])
def test_a_loader_of_one_sample_is_named_and_small_batches_are_not_judged(batch_size):
    g = torch.Generator().manual_seed(0)
    data = _Repeat(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    found = [(f.rule, f.layer, f.step) for f in _fit(data, batch_size).findings if f.rule == "repeated_batch"]
    assert found == ([("repeated_batch", BATCH, 0)] if batch_size == 8 else [])


def test_a_dataset_with_duplicate_rows_in_a_batch_is_silent_and_the_rule_can_be_switched_off():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    x[1:4] = x[0]  # four equal rows out of eight: not the whole batch
    assert [f.rule for f in _fit(TensorDataset(x, torch.randn(32, 1, generator=g)), 8).findings] == []
    data = _Repeat(x, torch.randn(32, 1, generator=g))
    enabled = [r for r in RULES if r != "repeated_batch"]
    assert _fit(data, 8, rules={"enabled": enabled}).findings == []
