"""The replay's in-place write guard on its own: it copies only what a replayed step writes, refuses the write that
passes its budget, and the torch internals it reads exist in this torch.

Through a real Trainer (a step whose writes pass the budget is not replayed, and training is unchanged) it is
``tests/integration/test_replay_side_effects.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_hookdiag._hooks import HookSet
from lightning_hookdiag._inplace import InPlaceGuard, ReplayWriteLimit
from lightning_hookdiag._rerun import MicroBatch, capture_rng, replay_step
from lightning_hookdiag._torch_internals import DispatchMode, version, written_tensors


def test_the_guard_copies_only_what_is_written_and_refuses_the_write_that_passes_the_budget():
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    net.register_buffer("unwritten", torch.zeros(1000))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    batch = MicroBatch(torch.randn(6, 4), 0, capture_rng(torch.device("cpu")))

    def run(micro: MicroBatch) -> torch.Tensor:
        with torch.no_grad():
            net[2].weight.mul_(0.5)
        return net(micro.batch).sum()  # BatchNorm updates its running statistics: an op that does not declare it

    assert replay_step([batch], run, net, _no_hooks(), torch.device("cpu")) == 1
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())

    # In write order: 2.weight (32 B), num_batches_tracked (8 B), then running_mean (16 B) would pass 40 B.
    with pytest.raises(ReplayWriteLimit, match=r"into 1\.running_mean, .* to 56 B, over the limit of 40 B"):
        replay_step([batch], run, net, _no_hooks(), torch.device("cpu"), budget=40)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    guard = InPlaceGuard(net)
    with guard:
        net(batch.batch)
    assert guard.saved_bytes == 8 + 16 + 16  # the buffer of 4000 B is never written, so never copied
    assert guard.restore() == []


def test_the_torch_internals_the_guard_reads_exist():
    assert issubclass(DispatchMode, object)
    t = torch.zeros(2)
    assert version(t) == 0
    t.add_(1)
    assert version(t) == 1
    out = torch.empty(2)
    assert written_tensors(torch.ops.aten.add_.Tensor, (t, t), {}) == [t]
    assert written_tensors(torch.ops.aten.add.out, (t, t), {"out": out}) == [out]
    # A batch norm writes its running statistics in training only, and never in its backward.
    x, mean, var = torch.randn(4, 2), torch.zeros(2), torch.ones(2)
    norm = torch.ops.aten.native_batch_norm.default
    assert written_tensors(norm, (x, None, None, mean, var, True, 0.1, 1e-5), {}) == [mean, var]
    assert written_tensors(norm, (x, None, None, mean, var, False, 0.1, 1e-5), {}) == []
    backward = torch.ops.aten.native_batch_norm_backward.default
    assert written_tensors(backward, (x, x, None, mean, var, mean, var, True, 1e-5, [True] * 3), {}) == []


def _no_hooks() -> Any:
    return HookSet({}, None)
