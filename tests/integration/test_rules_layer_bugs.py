"""Issue 20's layer bugs in real Lightning fits, each with its fixed twin: a detached body (``no_gradient``), a ReLU
RNN whose gradient explodes through time (``exploding_gradient`` located in the RNN), a ``self.eval()`` left on in
``training_step`` (``eval_mode``), and metrics and losses kept on the module (not selected by default)."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import RecordingLogger, by_name, make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hookdiag import LayerHealthCallback, LayerHealthWarning

P = "layer_health"


def _fit(
    module: pl.LightningModule, steps: int, trainer_args: dict[str, Any] | None = None, **callback_args: Any
) -> tuple[LayerHealthCallback, list[str]]:
    """Fit with every step sampled; the callback and the messages of every LayerHealthWarning."""
    callback = LayerHealthCallback(every_n_steps=1, **callback_args, output={"summary": False})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer([callback], max_steps=steps, logger=RecordingLogger(), **(trainer_args or {})).fit(module)
    return callback, [str(w.message) for w in record if issubclass(w.category, LayerHealthWarning)]


# ------------------------------------------------------------------------------------------ metrics and losses
class _WithMetrics(pl.LightningModule):
    """A classifier keeping a torchmetrics Accuracy and MeanSquaredError and a loss module, called in training_step."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        self.train_acc = torchmetrics.classification.Accuracy(task="multiclass", num_classes=3)
        self.train_mse = torchmetrics.MeanSquaredError()  # its output requires grad: it used to warn
        self.loss_fn = nn.CrossEntropyLoss()
        self.batch_accuracy: list[float] = []  # by hand, the reference for act_mean/train_acc

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        self.batch_accuracy.append(float((logits.argmax(-1) == y).double().mean()))
        self.train_acc(logits, y)
        self.train_mse(logits.softmax(-1).amax(-1), torch.ones_like(y, dtype=logits.dtype))
        self.log("train_acc", self.train_acc)
        return self.loss_fn(logits, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g))
        return DataLoader(data, batch_size=8)


def assert_says(message: str, *facts: str) -> None:
    """The message states every one of ``facts`` (its key facts, not its whole wording)."""
    missing = [fact for fact in facts if fact not in message]
    assert not missing, f"{message!r} lacks {missing}"


def test_metrics_and_losses_on_the_module_are_not_observed_by_default():
    pytest.importorskip("torchmetrics")
    callback, warned = _fit(_WithMetrics(), steps=3)
    assert warned == []
    assert callback.findings == []
    observed = {key.rsplit("/", 1)[1] for key in by_name(callback.last_metrics) if key.count("/") == 2}
    assert observed == {"model.0", "model.1", "model.2", "model.0.weight", "model.0.bias", "model.2.weight",
                        "model.2.bias"}  # fmt: skip
    assert callback.layer_names == ["model.0", "model.1", "model.2"]


def test_metrics_and_losses_stay_selectable_by_name():
    pytest.importorskip("torchmetrics")
    module = _WithMetrics()
    callback, _ = _fit(module, steps=2, layers=["model.2", "train_acc", "loss_fn"])
    assert callback.layer_names == ["model.2", "train_acc", "loss_fn"]
    # Accuracy's output is the batch accuracy; the loss module's output is the loss itself.
    assert by_name(callback.last_metrics)[f"{P}/act_mean/train_acc"] == pytest.approx(
        module.batch_accuracy[-1], abs=1e-7
    )
    assert by_name(callback.last_metrics)[f"{P}/act_grad_norm/loss_fn"] == pytest.approx(1.0)  # d(loss)/d(loss)


# ------------------------------------------------------------------------------------------------ no_gradient
def _regression_data(n: int = 64, d_in: int = 8, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    return TensorDataset(x, x[:, :1] * 2 - x[:, 1:2])


class _Regressor(pl.LightningModule):
    """``body`` then ``head`` on a learnable regression; ``variant`` picks how the forward is written."""

    def __init__(self, variant: str = "fixed") -> None:
        super().__init__()
        self.variant = variant
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)
        if variant == "frozen_body":
            self.body.requires_grad_(False)
        if variant in ("teacher", "ema"):
            self.other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        if variant == "ema":
            self.other.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.variant == "detached":
            return self.head(self.body(x).detach())  # the bug
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.variant == "teacher":  # a teacher run under no_grad (its parameters still require grad)
            with torch.no_grad():
                y = 0.5 * y + 0.5 * self.other(x)
        out = self(x)
        if self.variant == "ema":  # an EMA copy, frozen, evaluated with grad enabled
            y = 0.5 * y + 0.5 * self.other(x)
        return nn.functional.mse_loss(out, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_regression_data(), batch_size=16)


def test_detached_body_is_found_at_its_first_layer_with_every_cut_off_layer_counted():
    module = _Regressor("detached")
    before = {k: v.clone() for k, v in module.body.state_dict().items()}
    callback, warned = _fit(module, steps=4)
    # Independent evidence of the bug: the body never moved, the head did.
    assert all(torch.equal(before[k], v) for k, v in module.body.state_dict().items())
    (finding,) = callback.findings  # alerted once, found on every step
    assert callback.state_dict()["alerts"]["counts"]["no_gradient"] == 4
    assert (finding.rule, finding.layer, finding.step) == ("no_gradient", "body.0", 0)
    assert finding.value == len(module.body)  # every layer of the body is cut off
    assert (finding.phase, finding.stat, finding.threshold) == ("backward", "act_grad_norm", 0.0)
    assert_says(
        finding.message,
        "no_gradient at step 0: the output of body.0",
        "stops between body.3 and head",
        "3 more layers after it are also cut off: body.1, body.2, body.3",
    )
    assert warned == [f"LayerHealthCallback: {finding.message}"]  # the finding, no separate warning
    assert f"{P}/act_grad_norm/head" in by_name(callback.last_metrics)
    assert f"{P}/act_grad_norm/body.3" not in by_name(callback.last_metrics)


def test_a_detached_body_is_found_once_per_step_over_accumulated_micro_batches():
    callback, _ = _fit(_Regressor("detached"), steps=2, trainer_args={"accumulate_grad_batches": 2})
    # One finding per optimizer step, not per micro-batch.
    assert callback.state_dict()["alerts"]["counts"]["no_gradient"] == 2
    assert [(f.layer, f.step, f.value) for f in callback.findings] == [("body.0", 0, 4.0)]


@pytest.mark.parametrize("variant", ["fixed", "frozen_body", "teacher", "ema"])
def test_no_gradient_is_silent_on_the_fixed_twin_frozen_teacher_and_ema(variant):
    callback, warned = _fit(_Regressor(variant), steps=4)
    assert [f.message for f in callback.findings] == []
    assert warned == []


class _Encoder(pl.LightningModule):
    """A user's head on an encoder whose extra output is unused by design."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "bert":  # BertModel keeps its pooler; the token-level head reads last_hidden_state only
            import transformers as T

            config = T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=16, vocab_size=64)  # fmt: skip
            self.encoder = T.BertModel(config)
        else:  # a time series LSTM whose head reads h_n: the watched first output, the sequence, gets no gradient
            self.encoder = nn.LSTM(3, 16, batch_first=True)
        self.head = nn.Linear(32 if kind == "bert" else 16, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.kind == "bert":
            hidden = self.encoder(input_ids=x).last_hidden_state
            return nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), y.flatten())
        _, (h, _) = self.encoder(x)
        return nn.functional.cross_entropy(self.head(h[-1]), y[:, 0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 64, (32, 16), generator=g) if self.kind == "bert" else torch.randn(32, 16, 3, generator=g)
        return DataLoader(TensorDataset(x, torch.randint(0, 2, (32, 16), generator=g)), batch_size=8)


@pytest.mark.parametrize("kind", ["bert", "lstm"])
def test_no_gradient_is_silent_on_outputs_unused_by_design(kind, caplog):
    if kind == "bert":
        pytest.importorskip("transformers")
    module = _Encoder(kind)
    with caplog.at_level("INFO"):
        callback, warned = _fit(module, steps=3)
    # no_gradient is silent: nothing is cut off. The BERT pooler's parameters are held by AdamW and never get a
    # gradient, which output_unused names (true: DDP refuses them without find_unused_parameters=True, and
    # BertForTokenClassification builds its BertModel with add_pooling_layer=False for that reason).
    said = [(f.rule, f.layer) for f in callback.findings]
    assert said == ([("output_unused", "encoder.pooler.dense")] if kind == "bert" else [])
    assert warned == [f"LayerHealthCallback: {f.message}" for f in callback.findings]  # the finding's warning only
    # The outputs really got no gradient (the premise of the test): the note says so, once per layer.
    unused = ["encoder.pooler.dense", "encoder.pooler.activation"] if kind == "bert" else ["encoder"]
    notes = [r.getMessage() for r in caplog.records if "received no gradient" in r.getMessage()]
    assert notes == [
        f"LayerHealthCallback: the output of {name!r} required grad but received no gradient on a sampled step (a"
        " detached branch, or an output that does not reach the loss); no act_grad statistics for it"
        for name in unused
    ]
    assert all(f"{P}/act_grad_norm/{name}" not in callback.last_metrics for name in unused)


# -------------------------------------------------------------------------------------------------- eval_mode
class _Classifier(pl.LightningModule):
    """A Linear-BatchNorm-ReLU-Dropout backbone and a linear head; ``variant`` decides what happens to the modes."""

    def __init__(self, variant: str = "fixed", validate: bool = False) -> None:
        super().__init__()
        self.variant = variant
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2))
        self.head = nn.Linear(16, 2)
        if variant == "frozen_bn":  # fine-tuning with frozen BatchNorm: eval mode and no gradient, on purpose
            self.backbone[1].eval().requires_grad_(False)
        if variant == "frozen_backbone":  # its Dropout's enclosing module learns nothing either
            self.backbone.eval().requires_grad_(False)
        self.validate = validate
        self.modes_seen: list[tuple[str, bool]] = []  # (hook, BatchNorm.training) as the fit ran

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.variant == "self_eval":
            self.eval()  # the bug: every forward from here on runs in eval mode
        self.modes_seen.append(("train", self.backbone[1].training))
        loss = nn.functional.cross_entropy(self.head(self.backbone(x)), y)
        if self.variant in ("probe", "probe_fixed") and batch_idx == 0:
            self.eval()  # an inner evaluation...
            with torch.no_grad():
                self.probe = self.head(self.backbone(x)).argmax(-1)
            if self.variant == "probe_fixed":
                self.train()  # ... that restores the mode afterwards
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.modes_seen.append(("val", self.backbone[1].training))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def _loader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()


def _fit_classifier(variant: str, validate: bool = False) -> tuple[_Classifier, LayerHealthCallback, list[str]]:
    module = _Classifier(variant, validate)
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", output={"summary": False})
    extra: dict[str, Any] = {"limit_val_batches": 0}
    if validate:
        extra = {"val_check_interval": 2, "limit_val_batches": 1, "num_sanity_val_steps": 1}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer([callback], max_steps=4, **extra).fit(module)
    return module, callback, [str(w.message) for w in record if issubclass(w.category, LayerHealthWarning)]


@pytest.mark.parametrize("variant", ["self_eval", "probe"])
@pytest.mark.parametrize("validate", [False, True])
def test_training_left_in_eval_mode_is_found(variant, validate):
    module, callback, _ = _fit_classifier(variant, validate)
    # The premise, recorded by the module: after step 0 every training forward ran in eval mode, also after a
    # validation (Lightning restores the mode each module had before it: eval).
    forward_modes = [training for hook, training in module.modes_seen if hook == "train"]
    assert forward_modes == [variant == "probe", False, False, False]
    # Step 0 of self_eval switched to eval inside training_step: the batch started in train mode, so that forward
    # is not reported; from step 1 on, every step is.
    (finding,) = [f for f in callback.findings if f.rule == "eval_mode"]  # alerted once, found on steps 1, 2, 3
    assert callback.state_dict()["alerts"]["counts"]["eval_mode"] == 3
    assert (finding.layer, finding.step, finding.value, finding.threshold) == ("backbone.1", 1, 2.0, 0.0)
    assert (finding.stat, finding.phase) == ("training", "forward")
    assert finding.message.startswith("eval_mode at step 1: backbone.1 (BatchNorm1d) ran with training=False")
    assert finding.message.endswith("1 more module is in eval mode too: backbone.3 (Dropout)")


@pytest.mark.parametrize("variant", ["fixed", "probe_fixed", "frozen_bn", "frozen_backbone"])
@pytest.mark.parametrize("validate", [False, True])
def test_eval_mode_is_silent_on_the_fixed_twin_frozen_bn_and_a_frozen_backbone(variant, validate):
    module, callback, warned = _fit_classifier(variant, validate)
    assert [f.message for f in callback.findings] == []
    assert warned == []
    trained = variant in ("fixed", "probe_fixed")
    assert {training for hook, training in module.modes_seen if hook == "train"} == {trained}
    if validate:  # validation ran in eval mode and Lightning restored the training modes afterwards
        val = [training for hook, training in module.modes_seen if hook == "val"]
        assert val == [False, False, False]  # the sanity check, after step 2, after step 4
        assert module.backbone[1].training is trained


# -------------------------------------------------------------------------------------- exploding, located
class _ReluRNN(nn.Module):
    """Embedding, a ReLU ``nn.RNN`` whose recurrent weight is ``gain`` times the identity, a head on the last step.

    An identity recurrence (IRNN) keeps the gradient's scale through time with ``gain=1``; ``gain=1.5``, a
    mis-scaled init, multiplies it by about 1.5 per time step on the way back through the sequence.
    """

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.rnn = nn.RNN(16, 32, nonlinearity="relu", batch_first=True)
        self.head = nn.Linear(32, 2)
        with torch.no_grad():
            self.rnn.weight_hh_l0.copy_(gain * torch.eye(32))
            self.rnn.bias_hh_l0.zero_()
            self.rnn.bias_ih_l0.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(x))
        return self.head(out[:, -1])


class _Sequences(pl.LightningModule):
    def __init__(self, gain: float) -> None:
        super().__init__()
        self.model = _ReluRNN(gain)
        self.first: tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor] | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.first is None:  # step 0's weights and batch, for the reference norms
            self.first = ({k: v.clone() for k, v in self.model.state_dict().items()}, x, y)
        return nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 20, (32, 25), generator=g)
        return DataLoader(TensorDataset(x, (x[:, 0] < 10).long()), batch_size=8)


def _reference_grad_norms(module: _Sequences) -> dict[str, float]:
    """Output-gradient norms of step 0, by hand: a fresh copy of the model, plain tensor hooks, float64."""
    weights, x, y = module.first
    net = _ReluRNN(1.0).double()
    net.load_state_dict({k: v.double() for k, v in weights.items()})
    norms: dict[str, float] = {}

    def watch(name: str):
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            out = out[0] if isinstance(out, tuple) else out
            out.register_hook(lambda g: norms.__setitem__(name, float(g.norm())))

        return hook

    for name in ("embed", "rnn", "head"):
        getattr(net, name).register_forward_hook(watch(name))
    nn.functional.cross_entropy(net(x), y).backward()
    return norms


def test_exploding_gradient_in_a_relu_rnn_names_the_rnn():
    module = _Sequences(gain=1.5)
    callback, _ = _fit(module, steps=3, on_anomaly="ignore")
    ref = _reference_grad_norms(module)
    gain = ref["embed"] / ref["rnn"]
    assert gain > 5e3  # the premise: the RNN's backward through 25 time steps multiplies the gradient
    assert ref["embed"] / ref["head"] > 1e3  # ... and the rule's own condition holds at the embedding
    found = [f for f in callback.findings if f.rule == "exploding_gradient"]
    assert [(f.layer, f.step) for f in found][:1] == [("model.rnn", 0)]
    assert found[0].value == pytest.approx(ref["embed"] / ref["head"], rel=1e-5)  # float32 vs float64: ~4e-8
    assert "every layer from model.embed to the input end (1 layer)" in found[0].message
    assert f"model.embed's output gradient, the next observed one in backward order, is {gain:.3g} times" in (
        found[0].message
    )


def test_a_gradient_stable_relu_rnn_is_silent():
    callback, warned = _fit(_Sequences(gain=1.0), steps=6)
    assert [f.message for f in callback.findings] == []
    assert warned == []
