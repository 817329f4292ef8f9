"""Activation checkpointing and weight sharing: each forward counted once, every call of a shared module pooled."""

import pytest
import torch
from helpers import RecordingLogger, TinyModule, make_data, make_trainer
from helpers.observe import observed_outputs
from helpers.reference import activation_stats, l2
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_hookdiag import LayerHealthCallback

P = "layer_health"


class Checkpointed(nn.Module):
    def __init__(self, use_checkpoint: bool) -> None:
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = checkpoint(self.block, x, use_reentrant=False) if self.use_checkpoint else self.block(x)
        return self.head(h)


def logged(model: nn.Module, accumulate: int = 1, observed: list[int] | None = None) -> dict[str, float]:
    """The values logged on step 0; ``observed`` receives the layer index of every output the callback observed."""
    logger = RecordingLogger()
    module = TinyModule(model=model, data=make_data(n=32))
    extensions = [observed_outputs(observed)] if observed is not None else []
    callback = LayerHealthCallback(every_n_steps=1, extensions=extensions)
    make_trainer([callback], max_steps=1, accumulate_grad_batches=accumulate, logger=logger).fit(module)
    return logger.ours()[0][1]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_checkpointed_block_statistics_equal_the_plain_block(accumulate):
    observed: list[int] = []  # one layer index per output the callback observes
    torch.manual_seed(0)
    plain = Checkpointed(use_checkpoint=False)
    wrapped = Checkpointed(use_checkpoint=True)
    wrapped.load_state_dict(plain.state_dict())
    expected = logged(plain, accumulate, observed)
    plain_calls = sorted(observed)
    observed.clear()
    got = logged(wrapped, accumulate, observed)
    # Recomputation inside backward re-runs the block's forward hooks: they must not be observed again.
    assert sorted(observed) == plain_calls
    assert len(plain_calls) == 4 * accumulate
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


class Shared(nn.Module):
    """One Linear applied twice (weight sharing)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.shared = nn.Linear(6, 6)
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        return self.head(self.shared(torch.relu(self.shared(self.inp(x)))))


def test_shared_module_pools_all_its_calls():
    module = TinyModule(model=Shared(), data=make_data(n=16))
    logger = RecordingLogger()
    make_trainer([LayerHealthCallback(every_n_steps=1, output={"charts": "all"})], max_steps=1, logger=logger).fit(
        module
    )
    metrics = logger.ours()[0][1]

    _, x, y, weights = module.record[0]
    ref = module.reference_model(weights)
    first = ref.shared(ref.inp(x))
    first.retain_grad()
    second = ref.shared(torch.relu(first))
    second.retain_grad()
    module.loss(ref.head(second), y).backward()
    values = first.reshape(-1).tolist() + second.reshape(-1).tolist()
    for stat, value in activation_stats(values).items():
        assert metrics[f"{P}/{stat}/model.shared"] == pytest.approx(value, rel=1e-5), stat
    grads = first.grad.reshape(-1).tolist() + second.grad.reshape(-1).tolist()
    assert metrics[f"{P}/act_grad_norm/model.shared"] == pytest.approx(l2(grads), rel=1e-5)
    # The shared weight's gradient is the sum over both uses, as the optimizer sees it.
    assert metrics[f"{P}/param_grad_norm/model.shared.weight"] == pytest.approx(
        l2(ref.shared.weight.grad.reshape(-1).tolist()), rel=1e-5
    )
