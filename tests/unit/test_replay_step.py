"""The sentinel's parts on their own: its modes, the packed read of loss and gradients, and ``replay_step``, which puts
the random streams, buffers, gradients and hooks back whatever the replayed step does (raising included).

The same promises through a real Trainer (a tripped step's replay leaves training bit-identical) are in
``tests/integration/test_sentinel.py`` and ``test_replay_side_effects.py``.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from helpers import count_hooks
from torch import nn

from lightning_hookdiag import _rerun as SN
from lightning_hookdiag._hooks import HookSet
from lightning_hookdiag._provenance import NonFiniteTrace
from lightning_hookdiag._sentinel import LossSentinel, SpikeDetector
from lightning_hookdiag.components import Component


@pytest.mark.parametrize("mode", ["grads", None])
def test_a_loss_sentinel_needs_one_of_its_modes(mode):
    # None is the callback's "no sentinel", not a mode of the sentinel itself.
    with pytest.raises(ValueError, match="sentinel") as error:
        LossSentinel(mode)
    message = str(error.value)
    assert f"got {mode!r}" in message
    assert "['loss', 'loss+grads']" in message  # the valid modes, None not among them


@pytest.mark.parametrize("processes", [1, 2])
def test_the_packed_read_trips_on_the_right_steps(processes):
    # With processes, the packed values go through a MAX all-reduce (here the identity, after the NaN/-Inf mapping).
    reduce_max = None if processes == 1 else (lambda t: t.clone())
    sentinel = LossSentinel("loss+grads", SpikeDetector(warmup=3), reduce_max=reduce_max)
    healthy, bad = [torch.ones(3)], [torch.ones(2), torch.tensor([1.0, -math.inf])]
    huge = [torch.tensor([3e38, 3e38, -1.0])]  # finite, although its float32 sum overflows
    steps = [(1.0, healthy), (1.1, huge), (0.9, healthy), (1.0, bad), (math.nan, healthy), (1e8, healthy), (1, healthy)]
    trips = []
    for step, (loss, grads) in enumerate(steps):
        sentinel.observe_loss(torch.tensor(loss))
        trip = sentinel.check(step, grads, scale=torch.tensor(2.0))
        trips.append(None if trip is None else (trip.kind, trip.loss if math.isfinite(trip.loss) else "nan"))
    assert trips == [None, None, None, ("nonfinite_grad", 0.5), ("nonfinite_loss", "nan"), ("loss_spike", 5e7), None]


def test_sparse_gradients_are_checked_by_their_stored_values():
    # nn.Embedding(sparse=True) gradients: dense reductions fail on them; a NaN among their values must trip.
    sentinel = LossSentinel("loss+grads", SpikeDetector(warmup=3))
    healthy = torch.sparse_coo_tensor([[0, 4, 4]], [1.0, 2.0, 3.0], (6,))
    bad = torch.sparse_coo_tensor([[1, 3]], [1.0, math.nan], (6,))
    trips = []
    for step, grad in enumerate([healthy, bad, healthy]):
        sentinel.observe_loss(torch.tensor(1.0))
        trip = sentinel.check(step, [grad, torch.ones(2)])
        trips.append(None if trip is None else trip.kind)
    assert trips == [None, "nonfinite_grad", None]


def test_replay_helper_restores_rng_buffers_and_gradients_even_when_the_step_raises():
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    seen: list[int] = []
    hooks = HookSet({"0": net[0]}, lambda i, out: seen.append(i))
    micro = SN.MicroBatch(torch.randn(5, 3), 0, SN.capture_rng(torch.device("cpu")))
    before_rng, before_stats = torch.get_rng_state(), net[1].running_mean.clone()

    def run(m):
        net(m.batch).sum()
        torch.rand(3)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        SN.replay_step([micro], run, net, hooks, torch.device("cpu"))
    assert seen == [0]
    assert not hooks.attached
    assert count_hooks(net) == 0
    assert torch.equal(before_rng, torch.get_rng_state())
    assert torch.equal(before_stats, net[1].running_mean)
    assert int(net[1].num_batches_tracked) == 0
    assert all(p.grad is None for p in net.parameters())


def test_the_replay_restores_the_training_state_even_when_a_companion_fails_to_remove():
    class FailsToRemove(Component):
        def remove(self) -> None:
            super().remove()
            raise RuntimeError("companion remove failed")

    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    hooks = HookSet({"0": net[0], "1": net[1]}, lambda i, out: None, companions=[FailsToRemove()])
    micro = SN.MicroBatch(torch.randn(5, 3), 0, SN.capture_rng(torch.device("cpu")))
    before = torch.get_rng_state(), random.getstate(), net[1].running_mean.clone()

    def run(m):
        torch.rand(3), random.random()
        return net(m.batch).sum()

    with pytest.raises(RuntimeError, match="companion remove failed"):
        SN.replay_step([micro], run, net, hooks, torch.device("cpu"))
    assert count_hooks(net) == 0
    assert torch.equal(before[0], torch.get_rng_state())
    assert before[1] == random.getstate()
    assert torch.equal(before[2], net[1].running_mean)
    assert int(net[1].num_batches_tracked) == 0


def test_the_random_streams_and_a_buffer_the_step_resized_are_put_back():
    net = nn.Linear(3, 2)
    net.register_buffer("seen", torch.tensor([1.0, 2.0]))
    micro = SN.MicroBatch(torch.randn(5, 3), 0, SN.capture_rng(torch.device("cpu")))
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    buffer = net.seen

    def run(m):
        torch.rand(3), random.random(), np.random.rand()
        net.seen.resize_(1000).fill_(7.0)  # a larger storage, then new contents
        return net(m.batch).sum()

    SN.replay_step([micro], run, net, HookSet({}, None), torch.device("cpu"))
    assert torch.equal(before[0], torch.get_rng_state())
    assert before[1] == random.getstate()
    assert (before[2] == np.random.get_state()[1]).all()
    assert net.seen is buffer
    assert net.seen.tolist() == [1.0, 2.0]


def test_the_global_hook_is_removed_when_the_replay_raises():
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    hooks = HookSet({"0": net[0]}, lambda i, out: None)
    trace = NonFiniteTrace(net)
    micro = SN.MicroBatch(torch.randn(5, 3), 0, SN.capture_rng(torch.device("cpu")))

    def run(m):
        net(m.batch)
        assert len(torch.nn.modules.module._global_forward_hooks) == 1
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        SN.replay_step([micro], run, net, hooks, torch.device("cpu"), trace)
    assert count_hooks(net) == 0
    assert len(torch.nn.modules.module._global_forward_hooks) == 0


def test_float64_losses_keep_their_range_in_the_packed_read():
    sentinel = LossSentinel("loss", SpikeDetector(warmup=3))
    trips = []
    for step, loss in enumerate([1.0, 1.1, 0.9, 1.0, 1e300, 1.0, math.inf]):
        # Two micro-batches per step: their float64 sum must not overflow either.
        sentinel.observe_loss(torch.tensor(loss / 2, dtype=torch.float64))
        sentinel.observe_loss(torch.tensor(loss / 2, dtype=torch.float64))
        trip = sentinel.check(step)
        trips.append(None if trip is None else (trip.kind, trip.loss))
    assert trips == [None, None, None, None, ("loss_spike", 1e300), None, ("nonfinite_loss", trips[-1][1])]
    assert math.isnan(trips[-1][1])


def test_a_checkpoint_of_the_old_format_loads_the_same_window():
    # The state is the raw window of losses, as before; zeros and negatives among them keep their scale.
    sentinel = LossSentinel("loss", SpikeDetector(warmup=3))
    sentinel.load_state_dict({"losses": [1.0, 0.0, 2.0, 0.5, 1.5], "last_finite_step": 4, "previous_trip": None})
    assert list(sentinel.detector.losses) == [1.0, 0.0, 2.0, 0.5, 1.5]
    assert sentinel.detector.median() == 1.0  # lower median of the positive 1, 2, 0.5, 1.5
    assert sentinel.state_dict()["losses"] == [1.0, 0.0, 2.0, 0.5, 1.5]
    assert sentinel.detector.is_spike(1e6)
    assert not sentinel.detector.is_spike(5.0)
