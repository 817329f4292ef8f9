"""Every trainable parameter is counted by default, under the module that owns it, leaf or not."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from helpers import RecordingLogger, TinyModule, count_hooks, make_trainer
from helpers.zoo import ViT
from torch import nn
from torch.utils.data import TensorDataset

from lightning_hookdiag import LayerHealthCallback, LayerHealthWarning
from lightning_hookdiag._params import owned_parameters
from lightning_hookdiag._selection import is_default_layer, resolve_layers

P = "layer_health"


class AttentionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.embed(x.reshape(x.shape[0], 2, 4))
        h, _ = self.attn(h, h, h)
        return self.head(h.mean(1))


class GradNorms(pl.Callback):
    """Independent reference: the total gradient norm as clip_grad_norm_ sees it, and each gradient in float64."""

    def __init__(self) -> None:
        self.total: dict[int, float] = {}
        self.grads: dict[int, dict[str, torch.Tensor]] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.total[trainer.global_step] = float(torch.nn.utils.get_total_norm(grads, norm_type=2.0))
        self.grads[trainer.global_step] = {
            n: p.grad.detach().double().clone() for n, p in pl_module.named_parameters() if p.grad is not None
        }


def _fit(module, callback, steps=2):
    logger, reference = RecordingLogger(), GradNorms()
    make_trainer([callback, reference], max_steps=steps, logger=logger).fit(module)
    return dict(logger.ours()), reference


def test_multihead_attention_is_a_default_layer_and_its_parameters_are_counted(caplog):
    module = TinyModule(model=AttentionNet(), data=TensorDataset(torch.randn(16, 8), torch.randn(16, 1)))
    module.record_enabled = False
    callback = LayerHealthCallback(every_n_steps=1)
    with caplog.at_level(logging.INFO):
        logged, reference = _fit(module, callback)  # a LayerHealthWarning would fail the test
    assert "model.attn" in callback.layer_names
    assert "'model.attn.out_proj' did not run" in caplog.text  # a note: MultiheadAttention uses it functionally
    for step in (0, 1):
        metrics = logged[step]
        assert f"{P}/act_grad_norm/model.attn" in metrics
        for name in ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"):
            expected = float(reference.grads[step][f"model.attn.{name}"].norm())
            assert metrics[f"{P}/param_grad_norm/model.attn.{name}"] == pytest.approx(expected, rel=1e-6, abs=0)
        assert metrics[f"{P}/grad_norm_total"] == pytest.approx(reference.total[step], rel=1e-6, abs=0)
    assert count_hooks(module) == 0


def test_vit_class_token_and_position_embedding_are_counted_and_total_matches_clipping():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 3, 16, 16, generator=g), torch.randn(16, 10, generator=g))
    module = TinyModule(model=ViT(depth=1), data=data)
    module.record_enabled = False
    logged, reference = _fit(module, LayerHealthCallback(every_n_steps=1))
    metrics = logged[1]
    for name in ("model.cls_token", "model.pos_embed"):
        expected = float(reference.grads[1][name].norm())
        assert metrics[f"{P}/param_grad_norm/{name}"] == pytest.approx(expected, rel=1e-6, abs=0)
    assert f"{P}/act_mean/model" not in metrics  # the ViT itself is not a layer: its output is the head's
    assert metrics[f"{P}/grad_norm_total"] == pytest.approx(reference.total[1], rel=1e-6, abs=0)


def test_parameters_of_the_lightning_module_itself_keep_their_bare_name():
    class Scaled(TinyModule):
        def __init__(self) -> None:
            super().__init__()
            self.temperature = nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            return self.model(x) * self.temperature

    module = Scaled()
    module.record_enabled = False
    logged, reference = _fit(module, LayerHealthCallback(every_n_steps=1), steps=1)
    expected = float(reference.grads[0]["temperature"].norm())
    assert logged[0][f"{P}/param_grad_norm/temperature"] == pytest.approx(expected, rel=1e-6, abs=0)
    assert logged[0][f"{P}/grad_norm_total"] == pytest.approx(reference.total[0], rel=1e-6, abs=0)


def test_a_selection_narrows_the_parameters_and_the_total():
    module = TinyModule(model=AttentionNet(), data=TensorDataset(torch.randn(16, 8), torch.randn(16, 1)))
    module.record_enabled = False
    logged, reference = _fit(module, LayerHealthCallback(every_n_steps=1, layers=["model.head"]), steps=1)
    keys = {k for k in logged[0] if "/param_grad_norm/" in k}
    assert keys == {f"{P}/param_grad_norm/model.head.weight", f"{P}/param_grad_norm/model.head.bias"}
    grads = reference.grads[0]
    expected = float(torch.stack([grads["model.head.weight"].norm(), grads["model.head.bias"].norm()]).norm())
    assert logged[0][f"{P}/grad_norm_total"] == pytest.approx(expected, rel=1e-6, abs=0)


def test_exclude_drops_the_excluded_module_s_own_parameters_only():
    module = TinyModule(model=AttentionNet(), data=TensorDataset(torch.randn(16, 8), torch.randn(16, 1)))
    module.record_enabled = False
    # Without the excluded MultiheadAttention, nothing observes its out_proj, whose parameters do train.
    with pytest.warns(LayerHealthWarning, match="'model.attn.out_proj' did not run"):
        logged, _ = _fit(module, LayerHealthCallback(every_n_steps=1, measure={"exclude": ["model.attn"]}), steps=1)
    keys = {k.rsplit("/", 1)[1] for k in logged[0] if "/param_grad_norm/" in k}
    assert "model.attn.in_proj_weight" not in keys
    assert {"model.attn.out_proj.weight", "model.embed.weight", "model.head.bias"} <= keys


def test_owned_parameters_names_each_shared_parameter_once_by_its_first_owner():
    shared = nn.Linear(2, 2)
    net = nn.Sequential(shared, nn.ReLU(), shared)
    assert list(owned_parameters(net)) == ["0.weight", "0.bias"]
    compiled = nn.Sequential(torch.compile(nn.Sequential(nn.Linear(2, 2))))
    assert list(owned_parameters(compiled)) == ["0.0.weight", "0.0.bias"]  # no _orig_mod segment


def test_default_layers_are_leaves_and_modules_computing_with_their_own_parameters():
    class LayerScaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.gamma = nn.Parameter(torch.ones(2))

    assert is_default_layer(nn.MultiheadAttention(4, 2))
    assert is_default_layer(LayerScaled())
    assert not is_default_layer(ViT(depth=1))  # owns cls_token beside whole sub-networks
    assert not is_default_layer(nn.ParameterList([nn.Parameter(torch.ones(1))]))
    net = nn.Sequential(nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True))
    names = list(resolve_layers(net))
    assert "0.self_attn" in names
    assert "0.self_attn.out_proj" in names
    assert "0" not in names
