"""Which BatchNorm and Dropout modules count as training in eval mode (the facts of rule ``eval_mode``)."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_hookdiag._eval_mode import EvalModeWatch, eval_mode_modules, mode_dependent_modules


def _net() -> nn.Module:
    net = nn.Module()
    net.block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.1))
    net.drops = nn.Sequential(nn.Dropout(0.5), nn.Dropout2d(0.5))  # no parameters anywhere below: the root's
    net.plain_bn = nn.BatchNorm1d(4, affine=False)  # no parameters of its own: the root's
    net.batch_stats_bn = nn.BatchNorm1d(4, track_running_stats=False)  # normalises with the batch in eval mode too
    net.no_op = nn.Dropout(0.0)  # drops nothing in either mode
    net.head = nn.Linear(4, 1)
    return net


def test_each_module_trains_its_own_parameters_or_its_nearest_enclosing_module_s():
    net = _net()
    owners = {name: owner for name, (module, owner) in mode_dependent_modules(net).items()}
    assert list(owners) == ["block.1", "block.2", "drops.0", "drops.1", "plain_bn", "batch_stats_bn", "no_op"]
    assert owners["block.1"] is net.block[1]
    assert owners["block.2"] is net.block
    assert all(owners[n] is net for n in ("drops.0", "drops.1", "plain_bn", "no_op"))
    assert owners["batch_stats_bn"] is net.batch_stats_bn


def test_only_modes_that_change_the_output_and_train_something_count():
    net = _net()
    candidates = mode_dependent_modules(net)
    assert eval_mode_modules(candidates) == {}  # all in train mode
    net.eval()
    expected = {"block.1": "BatchNorm1d", "block.2": "Dropout", "drops.0": "Dropout", "drops.1": "Dropout2d",
                "plain_bn": "BatchNorm1d"}  # fmt: skip
    assert eval_mode_modules(candidates) == expected
    net.block[1].requires_grad_(False)  # frozen BatchNorm: its own parameters decide, not the block's
    assert "block.1" not in eval_mode_modules(candidates)
    net.block.requires_grad_(False)
    assert list(eval_mode_modules(candidates)) == ["drops.0", "drops.1", "plain_bn"]  # the head still learns
    net.requires_grad_(False)
    assert eval_mode_modules(candidates) == {}


@pytest.mark.parametrize(("start", "end", "found"), [(True, True, True), (True, False, False), (False, True, False)])
def test_the_watch_needs_eval_mode_at_both_ends_of_training_step(start, end, found):
    net = _net()
    watch = EvalModeWatch(net)
    net.train(not start)
    watch.attach()
    net.train(not end)
    watch.end_forward(None)
    assert ("block.1" in watch.facts({})["eval_mode"]) is found
    assert watch.facts({})["eval_mode"] == {}  # taken once


def test_the_watch_collects_every_micro_batch_of_a_step():
    net = _net()
    watch = EvalModeWatch(net)
    watch.attach()
    watch.end_forward(None)
    net.block.eval()
    watch.attach()
    watch.end_forward(None)
    assert watch.facts({})["eval_mode"] == {"block.1": "BatchNorm1d", "block.2": "Dropout"}


def test_an_interrupted_batch_s_start_is_undone_by_remove():
    net = _net().eval()
    watch = EvalModeWatch(net)
    watch.attach()
    assert watch.attached
    watch.remove()  # the batch raised before its loss: what attach read is forgotten
    assert not watch.attached
    watch.end_forward(None)
    assert watch.facts({})["eval_mode"] == {}
