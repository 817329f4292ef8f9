"""UnregisteredWatch (lightning_hookdiag._unregistered) and rule unregistered_module: who counts, who stays silent."""

from __future__ import annotations

import pytest
import torch
from helpers import TinyModule, count_hooks, make_trainer
from torch import nn
from torch.nn import functional as F

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag._unregistered import UnregisteredWatch, where_held
from lightning_hookdiag.rules import ROOT


class _Net(nn.Module):
    """A registered head; around it, what a forward may call without registering it."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 1)
        self.blocks = [nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))]  # the bug
        self.heads = {"aux": nn.Linear(4, 4)}  # the bug, as a dict
        self.teacher = [nn.Linear(4, 4)]  # unregistered, run under no_grad: a teacher
        self.frozen = [nn.Linear(4, 4).requires_grad_(False)]
        self.calls = ("blocks", "heads", "teacher", "frozen", "inline", "tied")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "blocks" in self.calls:
            x = self.blocks[0](x)
        if "heads" in self.calls:
            x = self.heads["aux"](x)
        if "teacher" in self.calls:
            with torch.no_grad():
                self.teacher[0](x)
        if "frozen" in self.calls:
            x = self.frozen[0](x)
        if "inline" in self.calls:
            x = nn.ReLU()(x)  # no parameters
        if "tied" in self.calls:
            tied = nn.Linear(4, 1)
            tied.weight, tied.bias = self.head.weight, self.head.bias  # registered weights
            tied(x)
        return self.head(x)


def _watch(net: nn.Module, x: torch.Tensor) -> dict[str, list[str]]:
    watch = UnregisteredWatch(net)
    watch.attach()
    try:
        net(x)
    finally:
        watch.remove()
    return watch.facts({})["unregistered"]


def test_only_layers_with_trainable_parameters_of_their_own_run_with_grad_count_each_once():
    net = _Net()
    found = _watch(net, torch.randn(2, 4))
    # The Sequential holds 2 x (16 + 4) elements; its Linears are not reported again.
    assert found == {
        ROOT: ["blocks[0] (Sequential, 40 parameter elements)", "heads['aux'] (Linear, 20 parameter elements)"]
    }
    assert torch.nn.modules.module._global_forward_hooks == {}
    net.calls = ("teacher", "frozen", "inline", "tied")
    assert _watch(net, torch.randn(2, 4)) == {}


def test_the_finding_names_the_innermost_registered_caller():
    outer = nn.Sequential(nn.Identity())
    net = _Net()
    net.calls = ("blocks",)
    outer.append(net)  # the module that holds the list is "1"
    assert _watch(outer, torch.randn(2, 4)) == {"1": ["blocks[0] (Sequential, 40 parameter elements)"]}
    hidden = nn.Linear(2, 2)
    object.__setattr__(net, "hidden", hidden)  # an attribute that nn.Module.__setattr__ did not register
    assert (where_held(net, hidden), where_held(net, net.head)) == ("hidden", "")  # registered: not "held"


def test_nothing_is_counted_inside_backward_or_after_a_window_s_facts():
    net = _Net()
    net.calls = ("blocks",)
    watch = UnregisteredWatch(net)
    watch.attach()
    out = net(torch.randn(2, 4))
    assert len(watch.facts({})["unregistered"][ROOT]) == 1
    net(torch.randn(2, 4))  # the same layer again in a later step: reported again, once
    assert watch.facts({})["unregistered"] == {ROOT: ["blocks[0] (Sequential, 40 parameter elements)"]}
    watch.remove()
    watch.remove()  # idempotent
    out.sum().backward()
    assert watch.facts({})["unregistered"] == {}


class _ListModule(TinyModule):
    def __init__(self, registered: bool) -> None:
        super().__init__()
        blocks = [nn.Linear(4, 4), nn.Linear(4, 4)]
        self.blocks = nn.ModuleList(blocks) if registered else blocks
        self.record_enabled = False

    def forward(self, x):
        for block in self.blocks:
            x = F.relu(block(x))
        return self.model(x)


@pytest.mark.parametrize("registered", [False, True])
def test_a_fit_names_layers_kept_in_a_list_and_its_fix_is_silent(registered):
    module = _ListModule(registered)
    health = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", output={"summary": False})
    make_trainer([health], max_steps=2).fit(module)
    found = [f for f in health.findings if f.rule == "unregistered_module"]
    if registered:
        assert found == []
        return
    (f,) = found
    assert (f.layer, f.step, f.value) == (ROOT, 0, 2.0)
    assert "blocks[0] (Linear, 20 parameter elements), blocks[1] (Linear, 20 parameter elements)" in f.message
    assert "nn.ModuleList" in f.message
    assert count_hooks(module) == 0  # the global hook included


def test_the_global_hook_leaves_after_an_exception_in_training_step():
    module = _ListModule(False)
    seen: list[int] = []

    def fail(mod, batch_idx):
        seen.append(len(torch.nn.modules.module._global_forward_hooks))
        raise RuntimeError("boom")

    module.on_step = fail
    with pytest.raises(RuntimeError, match="boom"):
        make_trainer([LayerHealthCallback(every_n_steps=1)], max_steps=2).fit(module)
    assert seen == [1]
    assert count_hooks(module) == 0
