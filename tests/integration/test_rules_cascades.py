"""One finding per cause: a chain of dead ReLU layers, and the gradient it stops, is one ``dead_units`` finding.

The model of issue 37: 48 blocks of ``Linear(64) + ReLU`` and a head (``net.0`` ... ``net.95``, head ``net.96``), He
init with zero biases, one bias at -10 (``net.60``). ``net.61`` is dead; every Linear after it outputs its zero bias,
so every later ReLU is dead too; and no gradient passes ``net.95``, so from ``net.94`` to the input end every output
gradient is exactly 0. Every fact the findings state is recomputed here from the recorded weights and batch.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from helpers import TinyModule, make_data, make_trainer
from torch import nn

from lightning_hookdiag import LayerHealthCallback

BLOCKS, WIDTH = 48, 64
STEPS, EVERY = 30, 10
SAMPLED = list(range(0, STEPS, EVERY))


class Stack(nn.Module):
    """``net``: BLOCKS x (Linear(WIDTH) + ReLU) and a Linear head, He-initialised; ``biases`` by Linear index."""

    def __init__(self, biases: dict[int, float], base: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(BLOCKS):
            linear = nn.Linear(WIDTH, WIDTH)
            nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
            nn.init.constant_(linear.bias, base)
            layers += [linear, nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(WIDTH, 1))
        with torch.no_grad():
            for index, bias in biases.items():
                self.net[index].bias.fill_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def fit(biases: dict[int, float], base: float = 0.0, **rules: object) -> tuple[LayerHealthCallback, TinyModule]:
    module = TinyModule(Stack(biases, base), data=make_data(n=64, d_in=WIDTH), batch_size=16, lr=0.01)
    callback = LayerHealthCallback(
        every_n_steps=EVERY, on_anomaly="ignore", rules=rules or None, output={"summary": False}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes on tiny runs; the findings are read below
        make_trainer([callback], max_steps=STEPS).fit(module)
    return callback, module


def reference(module: TinyModule, step: int) -> tuple[dict[str, float], dict[str, float]]:
    """Each ReLU's dead fraction and each layer's output-gradient norm on ``step``, from the recorded fit."""
    _, x, y, weights = next(r for r in module.record if r[0] == step)
    net = module.reference_model(weights).net
    outputs: dict[str, torch.Tensor] = {}
    h = x.double()
    for name, layer in net.double().named_children():
        h = layer(h)
        h.retain_grad()
        outputs[f"model.net.{name}"] = h
    nn.functional.mse_loss(h, y.double()).backward()
    dead = {
        name: (out <= 0).all(dim=0).double().mean().item()
        for name, out in outputs.items()
        if isinstance(net[int(name.rpartition(".")[2])], nn.ReLU)
    }
    return dead, {name: out.grad.norm().item() for name, out in outputs.items()}


def relus(first: int, last: int) -> list[str]:
    return [f"model.net.{i}" for i in range(first, last + 1, 2)]


def test_a_dead_chain_is_one_finding_at_its_first_layer_naming_how_far_it_reaches_and_the_gradient_it_stops():
    callback, module = fit({60: -10.0})
    # The premise, computed without the callback: net.61 to net.95 (18 ReLUs) are dead, every other one alive, and
    # the output gradient is exactly 0 from net.94 to the input end, on every sampled step.
    for step in SAMPLED:
        dead, grads = reference(module, step)
        assert [n for n, frac in dead.items() if frac >= 0.9] == relus(61, 95), step
        assert all(dead[n] == 1.0 for n in relus(61, 95))
        assert all(dead[n] < 0.9 for n in relus(1, 59))
        assert all(grads[f"model.net.{i}"] == 0.0 for i in range(95)), step
        assert grads["model.net.95"] > 0
        assert grads["model.net.96"] > 0

    # One finding, alerted once, found again on every sampled step: at the first dead layer in forward order.
    assert [(f.rule, f.layer, f.step) for f in callback.findings] == [("dead_units", "model.net.61", 0)]
    assert callback.alert_counts["dead_units"] == len(SAMPLED)
    assert callback.alert_counts["vanishing_gradient"] == 0  # not a finding of its own, 34 layers below the cause
    (found,) = callback.last_findings
    assert (found.value, found.threshold, found.phase, found.stat) == (1.0, 0.9, "forward", "act_dead_frac")
    _, grads = reference(module, SAMPLED[-1])
    message = found.message
    # How far it reaches: the 17 other dead layers, the first three and the last.
    assert "the first dead layer in forward order; 17 more layers after it are also dead: " in message
    assert "model.net.63, model.net.65, model.net.67, ..., model.net.95, with no live ReLU-family layer" in message
    # What it stops: the output gradient from net.94 to the input end (95 layers), measured against the head's.
    assert "below model.net.95, no layer from model.net.94 to the input end (95 layers)" in message
    head = re.search(r"the output end \(model\.net\.96, ([0-9.e+-]+)\); the largest is exactly 0", message)
    assert head is not None, message
    assert float(head.group(1)) == pytest.approx(grads["model.net.96"], rel=5e-3)  # printed to 3 significant digits


def test_the_healthy_twin_is_silent():
    callback, module = fit({60: 0.0})
    dead, grads = reference(module, SAMPLED[-1])
    assert max(dead.values()) < 0.9  # the premise: no layer is dead, and the gradient reaches the input end
    assert min(grads.values()) > 1e-3 * grads["model.net.96"]
    assert callback.findings == []
    assert sum(callback.alert_counts.values()) == 0


def test_two_dead_chains_with_live_layers_between_them_are_two_findings():
    # Biases of 0.1: a dead chain ends where a Linear's positive bias brings the units back. The first chain:
    # net.21 to net.27 (net.20 at -10, zero biases up to net.26, net.28 at 0.1 again); the second: net.61 to net.95.
    first = {20: -10.0, 22: 0.0, 24: 0.0, 26: 0.0}
    second = {60: -10.0, **dict.fromkeys(range(62, 95, 2), 0.0)}
    callback, module = fit({**first, **second}, base=0.1)
    dead, grads = reference(module, SAMPLED[-1])
    assert [n for n, frac in dead.items() if frac >= 0.9] == relus(21, 27) + relus(61, 95)
    assert max(dead[n] for n in relus(29, 59)) < 0.9  # alive between them: the second chain has a cause of its own
    assert all(grads[f"model.net.{i}"] == 0.0 for i in range(95))

    assert [(f.rule, f.layer, f.step) for f in callback.findings] == [
        ("dead_units", "model.net.21", 0),
        ("dead_units", "model.net.61", 0),
    ]
    assert callback.alert_counts["vanishing_gradient"] == 0
    early, late = callback.last_findings
    assert "3 more layers after it are also dead: model.net.23, model.net.25, model.net.27," in early.message
    assert "gradient" not in early.message  # the gradient stops at the later chain, which says so
    assert "17 more layers after it are also dead: model.net.63, model.net.65, model.net.67, ..., model.net.95" in (
        late.message
    )
    assert "below model.net.95, no layer from model.net.94 to the input end (95 layers)" in late.message


@pytest.mark.parametrize("enabled", [["vanishing_gradient"], ["vanishing_gradient", "no_gradient"]])
def test_without_dead_units_the_vanishing_gradient_is_still_reported(enabled):
    callback, _ = fit({60: -10.0}, enabled=enabled)
    assert [(f.rule, f.layer, f.step) for f in callback.findings] == [("vanishing_gradient", "model.net.94", 0)]
    assert callback.last_findings[0].value == 0.0


def test_a_vanishing_gradient_with_a_cause_of_its_own_stays_its_own_finding():
    # PyTorch's default init (std 1/sqrt(3 fan_in)) shrinks the gradient ~0.4x per block: it vanishes long before it
    # reaches the dead layer, whose Linear's bias of -10 kills only net.61 (the biases after it are not 0).
    class DefaultInit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            layers: list[nn.Module] = []
            for _ in range(BLOCKS):
                layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
            self.net = nn.Sequential(*layers, nn.Linear(WIDTH, 1))
            with torch.no_grad():
                self.net[60].bias.fill_(-10.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    module = TinyModule(DefaultInit(), data=make_data(n=64, d_in=WIDTH), batch_size=16, lr=0.01)
    callback = LayerHealthCallback(every_n_steps=EVERY, on_anomaly="ignore", output={"summary": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([callback], max_steps=1).fit(module)
    dead, grads = reference(module, 0)
    assert [n for n, frac in dead.items() if frac >= 0.9] == ["model.net.61"]
    head = grads["model.net.96"]
    # The first layer in backward order from which every output gradient stays below 1e-3 of the head's.
    alive = [i for i in range(96) if grads[f"model.net.{i}"] >= 1e-3 * head]
    vanishing = f"model.net.{min(alive) - 1}"
    assert int(vanishing.rpartition(".")[2]) > 62  # far above the dead layer, in backward order
    assert [(f.rule, f.layer) for f in callback.findings] == [
        ("dead_units", "model.net.61"),
        ("vanishing_gradient", vanishing),
    ]
    assert "gradient" not in callback.findings[0].message
