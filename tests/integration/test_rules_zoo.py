"""The health rules on real architectures: silent on a zoo of healthy models, loud on sick networks.

Every healthy model trains for 105 optimizer steps with every step sampled, every default statistic (the precursors
included) and every rule enabled at its default threshold; a single finding on any step fails the test (the trend
rules need 8 to 32 sampled steps of history, so the run is long). The sick networks must be flagged within their first 5
sampled steps, by the rule that names their disease.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import by_name, count_hooks, make_trainer
from helpers.zoo import (
    ZOO,
    ResNet18,
    ViT,
    gain3_linear_stack,
    negative_bias_net,
    planted_nan_net,
    sigmoid_stack,
    zoo_module,
)
from torch import nn
from torch.utils.data import TensorDataset

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag._vocabulary import PRECURSOR_STATS
from lightning_hookdiag.rules import RULES

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # real architectures for 105 steps each: `pytest -m "not slow"` leaves them out

STEPS = 105


@pytest.fixture(autouse=True)
def _quiet_transformers() -> None:
    # transformers 5 logs config notes (a tiny vocabulary below GPT-2's default eos id) on every model built.
    import transformers

    transformers.logging.set_verbosity_error()


@pytest.mark.parametrize("name", ZOO)
def test_healthy_zoo_raises_no_finding_on_any_step(name):
    module = zoo_module(name, n=8 * STEPS)
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", output={"summary": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's note that the 105 steps run over more than one epoch
        make_trainer([callback], max_steps=STEPS).fit(module)
    assert callback.last_step == STEPS - 1
    assert callback.rule_config.enabled is None  # every rule was on
    assert tuple(callback.alert_counts) == RULES
    assert set(PRECURSOR_STATS) <= set(callback.stats)  # and every default statistic
    assert any("/logit_lse_mean/" in k for k in by_name(callback.last_metrics))
    assert torch._C._len_torch_function_stack() == 0
    assert [f.message for f in callback.findings] == []
    # Not even a finding that repeated an earlier alert.
    assert sum(callback.state_dict()["alerts"]["counts"].values()) == 0
    assert count_hooks(module) == 0


def test_resnet18_starts_with_zeroed_last_norm_and_an_exact_zero_branch_gradient():
    # The case that fooled the per-layer rule: the zero-initialised bn2 stops every gradient into its branch.
    net = ResNet18()
    assert all(float(b.bn2.weight.detach().abs().sum()) == 0.0 for layer in (net.layer1, net.layer4) for b in layer)
    seen: dict[str, float] = {}

    def watch(name):
        def hook(module, args, out):
            out.register_hook(lambda g: seen.__setitem__(name, float(g.norm())))

        return hook

    net.layer4[1].conv2.register_forward_hook(watch("conv2"))
    net.layer4[1].act2.register_forward_hook(watch("act2"))
    net(torch.randn(2, 3, 32, 32)).sum().backward()
    assert seen["conv2"] == 0.0
    assert seen["act2"] > 0.0  # the residual stream still carries the signal past the zeroed branch


def test_vit_owns_its_class_token_and_position_embedding_directly():
    net = ViT()
    assert {"cls_token", "pos_embed"} <= set(net._parameters)


def _sick_module(net: nn.Module, width: int = 32):
    from helpers import TinyModule

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, width, generator=g), torch.randn(64, 1, generator=g))
    module = TinyModule(model=net, data=data, batch_size=8, lr=0.01)
    module.record_enabled = False
    return module


@pytest.mark.parametrize(
    ("build", "rule", "stat"),
    [
        (sigmoid_stack, "vanishing_gradient", "act_grad_norm"),
        (gain3_linear_stack, "exploding_gradient", "act_grad_norm"),
        (negative_bias_net, "dead_units", "act_dead_frac"),
        (planted_nan_net, "nonfinite", "act_nonfinite"),
    ],
)
def test_sick_networks_are_flagged_within_five_sampled_steps(build, rule, stat):
    torch.manual_seed(0)
    module = _sick_module(build())
    callback = LayerHealthCallback(every_n_steps=2, on_anomaly="ignore", output={"summary": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NaN losses make Lightning warn
        make_trainer([callback], max_steps=9).fit(module)  # sampled steps 0, 2, 4, 6, 8
    hits = [f for f in callback.findings if f.rule == rule]
    assert hits, [f.message for f in callback.findings]
    assert hits[0].step in (0, 2, 4, 6, 8)
    assert hits[0].stat == stat


def test_vanishing_sigmoid_stack_names_the_layer_where_the_signal_is_lost():
    torch.manual_seed(0)
    module = _sick_module(sigmoid_stack())
    callback = LayerHealthCallback(
        every_n_steps=1, on_anomaly="ignore", rules={"enabled": ["vanishing_gradient"]}, output={"summary": False}
    )
    make_trainer([callback], max_steps=1).fit(module)
    (finding,) = callback.findings
    norms = {k.rsplit("/", 1)[1]: v for k, v in by_name(callback.last_metrics).items() if "/act_grad_norm/" in k}
    backward = sorted(norms, key=lambda n: -int(n.split(".")[1]))  # a chain: backward order is reversed depth
    ref = norms[backward[0]]
    # Independent reference: the first layer, from the output end, after which every layer is below 1e-3 of it.
    expected = next(n for i, n in enumerate(backward[1:], 1) if max(norms[m] for m in backward[i:]) / ref < 1e-3)
    assert finding.layer == expected
    assert finding.value == pytest.approx(max(norms[m] for m in backward[backward.index(expected) :]) / ref, rel=1e-6)
