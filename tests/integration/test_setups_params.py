"""Model setups the parameter statistics and the selection must take (issue 35): bf16 weights, complex parameters, a
LightningModule that holds only its own parameters, TorchScript submodules, and bad ``capture_activations`` names.

Every value is checked against float64 (complex128) computed here from the weights and gradients the fit really had.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import RecordingLogger, TinyModule, count_hooks, make_data, make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hookdiag import LayerHealthCallback, LayerHealthWarning, capture_activations

P = "layer_health"


class ParamRecorder(pl.Callback):
    """Test instrumentation: every parameter and gradient right before each optimizer step, in its own dtype."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        named = list(pl_module.named_parameters())
        self.weights.append({n: p.detach().clone() for n, p in named})
        self.grads.append({n: p.grad.detach().clone() for n, p in named if p.grad is not None})

    def on_train_end(self, trainer, pl_module) -> None:
        self.weights.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64, or complex128 for a complex tensor (never dropping an imaginary part)."""
    return t.to(torch.complex128 if t.is_complex() else torch.float64)


def norm64(t: torch.Tensor) -> float:
    """The L2 norm of ``t`` in float64 (of its magnitudes, for a complex tensor)."""
    return wide(t).abs().square().sum().sqrt().item()


def assert_parameter_statistics(logged: dict[int, dict[str, float]], rec: ParamRecorder, prefix: str = "") -> None:
    """param_norm, param_grad_norm and param_update_ratio of every parameter and step against float64 of the record."""
    for step, metrics in logged.items():
        before, after, grads = rec.weights[step], rec.weights[step + 1], rec.grads[step]
        for name, weight in before.items():
            key = name.removeprefix(prefix)
            assert metrics[f"{P}/param_norm/{key}"] == pytest.approx(norm64(weight), rel=1e-9), (step, key)
            assert metrics[f"{P}/param_grad_norm/{key}"] == pytest.approx(norm64(grads[name]), rel=1e-9), (step, key)
            ratio = norm64(wide(after[name]) - wide(weight)) / norm64(weight)
            assert metrics[f"{P}/param_update_ratio/{key}"] == pytest.approx(ratio, rel=1e-9), (step, key)


# ------------------------------------------------------------------------------------------ item 1: bf16 weights
def test_bf16_true_update_ratio_is_the_float64_ratio_of_the_bf16_weights():
    # The difference used to be taken in bf16 (8 significant bits): net.4.weight's ratio was 1.0e-4 relative off.
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 1))  # 4.3 K
    module = TinyModule(model=model, data=make_data(n=48, d_in=16), lr=0.01)
    logger, rec = RecordingLogger(), ParamRecorder()
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore")
    make_trainer([rec, callback], max_steps=6, logger=logger, precision="bf16-true").fit(module)
    assert all(w.dtype == torch.bfloat16 for w in rec.weights[0].values())
    logged = dict(logger.ours())
    assert sorted(logged) == list(range(6))
    assert_parameter_statistics(logged, rec)


# ------------------------------------------------------------------------------------------ item 2: complex weights
class SpectralConv1d(nn.Module):
    """A Fourier Neural Operator's spectral layer: the lowest ``modes`` Fourier modes mixed by complex weights."""

    def __init__(self, channels: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        self.weight = nn.Parameter(torch.randn(channels, channels, modes, dtype=torch.cfloat) / channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch, channels, points]
        coefficients = torch.fft.rfft(x)
        mixed = torch.zeros_like(coefficients)
        mixed[..., : self.modes] = torch.einsum("bim,iom->bom", coefficients[..., : self.modes], self.weight)
        return torch.fft.irfft(mixed, n=x.shape[-1])


def fno() -> nn.Module:
    return nn.Sequential(nn.Unflatten(1, (4, 8)), SpectralConv1d(4, 3), nn.GELU(), nn.Flatten(), nn.Linear(32, 1))


def final_weights(callbacks: list[pl.Callback], model: nn.Module, **kwargs: Any) -> dict[str, torch.Tensor]:
    module = TinyModule(model=model, **kwargs)
    make_trainer(callbacks, max_steps=4).fit(module)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_complex_parameters_are_measured_by_their_magnitudes():
    # Step 0 raised "linalg.vector_norm: dtype should be complex for complex inputs, but got Double".
    module = TinyModule(model=fno(), data=make_data(d_in=32))
    logger, rec = RecordingLogger(), ParamRecorder()
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore")
    make_trainer([rec, callback], max_steps=4, logger=logger).fit(module)
    logged = dict(logger.ours())
    assert sorted(logged) == [0, 1, 2, 3]
    assert rec.weights[0]["model.1.weight"].dtype == torch.cfloat
    assert_parameter_statistics(logged, rec)
    # The spectral layer's (real) output against complex128 / float64 of the step's weights and batch.
    for step, x, _, weights in module.record:
        ref = module.reference_model(weights).double()
        ref[1].weight.data = weights["1.weight"].to(torch.complex128)
        out = ref[1](ref[0](x.double())).reshape(-1)
        assert logged[step][f"{P}/act_std/model.1"] == pytest.approx(out.std(correction=0).item(), rel=1e-5)
        assert logged[step][f"{P}/act_mean/model.1"] == pytest.approx(out.mean().item(), rel=1e-5, abs=1e-9)
    assert count_hooks(module) == 0


def test_complex_parameters_train_bit_identically_with_the_callback():
    torch.manual_seed(1)
    model = fno()
    data = make_data(d_in=32)
    plain = final_weights([], copy.deepcopy(model), data=data)
    observed = final_weights([LayerHealthCallback(every_n_steps=1, on_anomaly="ignore")], model, data=data)
    assert all(torch.equal(plain[k], observed[k]) for k in plain)


class Spectrum(nn.Module):
    """A layer whose output is complex: the Fourier coefficients of its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(x)


class Magnitude(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z.abs()


def test_a_complex_output_is_skipped_with_one_note_and_the_fit_goes_on():
    model = nn.Sequential(nn.Linear(4, 8), Spectrum(), Magnitude(), nn.Linear(5, 1))
    module = TinyModule(model=model)
    logger, rec = RecordingLogger(), ParamRecorder()
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore")
    with pytest.warns(LayerHealthWarning, match="'model.1' holds no floating-point tensor") as caught:
        make_trainer([rec, callback], max_steps=3, logger=logger).fit(module)
    assert sum("'model.1'" in str(w.message) for w in caught) == 1
    logged = dict(logger.ours())
    assert sorted(logged) == [0, 1, 2]
    assert not [k for k in logged[0] if k.endswith("/model.1")]
    assert_parameter_statistics(logged, rec)
    for step, x, _, weights in module.record:  # the real output made from it is observed
        ref = module.reference_model(weights).double()
        out = ref[2](ref[1](ref[0](x.double()))).reshape(-1)
        assert logged[step][f"{P}/act_std/model.2"] == pytest.approx(out.std(correction=0).item(), rel=1e-6)


# ------------------------------------------------------------------------------------------ item 3: own parameters only
class MatrixFactorisation(pl.LightningModule):
    """Ratings ``U[row] . V[col]``: a LightningModule with two parameters of its own and no submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.U = nn.Parameter(torch.randn(10, 3))
        self.V = nn.Parameter(torch.randn(12, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        rows, cols, ratings = batch
        return ((self.U[rows] * self.V[cols]).sum(-1) - ratings).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(
            torch.randint(0, 10, (32,), generator=g), torch.randint(0, 12, (32,), generator=g), torch.randn(32)
        )
        return DataLoader(data, batch_size=8)


def test_a_module_with_only_its_own_parameters_is_tracked_with_one_note():
    # Refused at fit start: "no module left to observe after exclude=[]", with neither layers nor exclude given.
    module = MatrixFactorisation()
    logger, rec = RecordingLogger(), ParamRecorder()
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore")
    with pytest.warns(LayerHealthWarning, match="MatrixFactorisation has no layer to hook") as caught:
        make_trainer([rec, callback], max_steps=3, logger=logger).fit(module)
    assert sum("no layer to hook" in str(w.message) for w in caught) == 1
    logged = dict(logger.ours())
    assert sorted(logged) == [0, 1, 2]
    assert_parameter_statistics(logged, rec)
    grads = rec.grads[0]
    expected_total = math.sqrt(norm64(grads["U"]) ** 2 + norm64(grads["V"]) ** 2)
    assert logged[0][f"{P}/grad_norm_total"] == pytest.approx(expected_total, rel=1e-9)
    assert {k.split("/")[1] for k in logged[0]} == {
        "param_norm",
        "param_grad_norm",
        "param_update_ratio",
        "grad_norm_total",
        "param_update_ratio_min",  # the summary group
        "param_update_ratio_max",
    }


def test_an_exclude_that_removes_every_layer_is_still_an_error():
    module = TinyModule()
    with pytest.raises(ValueError, match=r"no module left to observe after exclude=\['model\.\*'\]"):
        make_trainer([LayerHealthCallback(measure={"exclude": ["model.*"]})], max_steps=1).fit(module)


# ------------------------------------------------------------------------------------------ item 4: TorchScript
def scripted_model() -> nn.Module:
    with pytest.warns(DeprecationWarning, match="torch.jit.script"):  # deprecated, still in use
        scripted = torch.jit.script(nn.Linear(8, 8))
    return nn.Sequential(nn.Linear(4, 8), scripted, nn.ReLU(), nn.Linear(8, 1))


def test_a_torchscript_submodule_is_skipped_with_one_note_and_its_parameters_measured():
    # Raised AttributeError: 'OrderedDictWrapper' object has no attribute 'get' before the first step.
    module = TinyModule(model=scripted_model())
    logger, rec = RecordingLogger(), ParamRecorder()
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore")
    with pytest.warns(LayerHealthWarning, match=r"TorchScript modules are not observed .*: model\.1$") as caught:
        make_trainer([rec, callback], max_steps=3, logger=logger).fit(module)
    assert sum("TorchScript" in str(w.message) for w in caught) == 1
    logged = dict(logger.ours())
    assert sorted(logged) == [0, 1, 2]
    assert not [k for k in logged[0] if k.endswith("/model.1")]  # no activation statistics of the scripted layer
    assert_parameter_statistics(logged, rec)  # model.1.weight and model.1.bias included
    for step, x, _, weights in module.record:  # the layers around it are observed as before
        ref = module.reference_model(weights).double()
        out = ref[0](x.double()).reshape(-1)
        assert logged[step][f"{P}/act_std/model.0"] == pytest.approx(out.std(correction=0).item(), rel=1e-6)
    assert count_hooks(module) == 0


def test_naming_a_torchscript_submodule_in_layers_is_a_clear_error():
    module = TinyModule(model=scripted_model())
    callback = LayerHealthCallback(layers=["model.0", "model.1"])
    with pytest.raises(ValueError, match=r"layers: 'model\.1' is a TorchScript module, which refuses forward hooks"):
        make_trainer([callback], max_steps=1).fit(module)
    assert count_hooks(module) == 0


def test_capture_activations_refuses_a_torchscript_module_by_name_and_skips_it_in_a_glob():
    net = scripted_model()
    with pytest.raises(ValueError, match=r"'1' is a TorchScript module"), capture_activations(net, "1"):
        pass
    with pytest.warns(LayerHealthWarning, match=r"not observed .*: 1$"), capture_activations(net, "*") as acts:
        net(torch.randn(2, 4))
    assert sorted(acts) == ["0", "2", "3"]
    assert acts["3"].shape == (2, 1)
    assert count_hooks(net) == 0


# ------------------------------------------------------------------------------------------ item 17: capture arguments
BAD_LAYERS = [
    (5, r"layers: expected a module name or glob, or a sequence of them, got 5"),
    (["0", None], r"layers: expected non-empty module names or globs, got \[None\]"),
    ([], r"layers: expected at least one module name or glob \(None: the default selection\), got \[\]"),
]


@pytest.mark.parametrize(("layers", "message"), [*BAD_LAYERS, (None, r"layers: expected a module name or glob.*None")])
def test_capture_activations_rejects_bad_layers_with_a_value_error(layers, message):
    # 5 and ["0", None] raised raw TypeErrors ("'int' object is not iterable").
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    with pytest.raises(ValueError, match=message), capture_activations(net, layers):
        pass
    assert count_hooks(net) == 0


@pytest.mark.parametrize(("layers", "message"), BAD_LAYERS)
def test_the_callback_rejects_the_same_layers_with_the_same_message(layers, message):
    module = TinyModule()
    with pytest.raises(ValueError, match=message):
        make_trainer([LayerHealthCallback(layers=layers)], max_steps=1).fit(module)
