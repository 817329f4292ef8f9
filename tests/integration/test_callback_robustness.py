"""Inputs users actually have: extreme magnitudes, skipped batches, LBFGS, failing loggers, empty and sparse outputs,
reentrant checkpointing, failed fits, two callbacks on one Trainer, and bad arguments (issue 12)."""

import copy
import math
import pickle
import re

import pytest
import torch
from helpers import RecordingLogger, TinyModule, by_name, count_hooks, force_trips, make_trainer
from helpers.stance import compiles, current_stance
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_hookdiag import LayerHealthCallback, LayerHealthWarning

P = "layer_health"


def by_step(logger: RecordingLogger) -> dict[int, dict[str, float]]:
    return dict(logger.ours())


# ------------------------------------------------------------------------------------------ extreme magnitudes
class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class GradScale(nn.Module):
    """Identity forward; multiplies the gradient flowing back through it (what a diverging run does)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return _GradScale.apply(x, self.factor)


@pytest.mark.parametrize("factor", [1e20, 1e30])
def test_huge_finite_activations_give_finite_exact_statistics(factor):
    # Linear(x) * 1e20 logged act_std = inf, and * 1e30 NaN with act_nonfinite = 0.
    model = nn.Sequential(nn.Linear(4, 8), Scale(factor), Scale(1 / factor), nn.Linear(8, 1))
    module = TinyModule(model=model)
    logger = RecordingLogger()
    # charts="all": the non-finite count is logged although it is 0.
    callback = LayerHealthCallback(every_n_steps=1, layers=["model.1"], on_anomaly="ignore", output={"charts": "all"})
    make_trainer([callback], max_steps=1, logger=logger).fit(module)
    metrics = by_step(logger)[0]
    _, x, _, weights = module.record[0]
    ref = module.reference_model(weights).double()
    expected = (ref[0](x.double()) * factor).reshape(-1)
    assert metrics[f"{P}/act_std/model.1"] == pytest.approx(expected.std(correction=0).item(), rel=1e-6)
    assert metrics[f"{P}/act_mean/model.1"] == pytest.approx(expected.mean().item(), rel=1e-6)
    assert metrics[f"{P}/act_absmax/model.1"] == pytest.approx(expected.abs().max().item(), rel=1e-6)
    assert metrics[f"{P}/act_nonfinite/model.1"] == 0
    assert all(math.isfinite(v) for v in metrics.values())


class GradRecorder(LayerHealthCallback.__mro__[1]):  # a plain Lightning Callback
    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = {n: p.grad.detach().double().clone() for n, p in pl_module.named_parameters()}


def test_finite_exploding_gradients_fire_exploding_not_nonfinite():
    # A gradient multiplied by 1e22 between two layers: every element is finite, its float32 square is not.
    model = nn.Sequential(nn.Linear(4, 8), GradScale(1e22), nn.ReLU(), nn.Linear(8, 1))
    module = TinyModule(model=model)
    logger = RecordingLogger()
    recorder = GradRecorder()
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", output={"charts": "all"})  # the 0 counts too
    make_trainer([recorder, callback], max_steps=1, logger=logger).fit(module)
    metrics = by_step(logger)[0]
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    grad = recorder.grads["model.0.weight"]
    assert metrics[f"{P}/param_grad_norm/model.0.weight"] == pytest.approx(grad.norm().item(), rel=1e-6)
    assert metrics[f"{P}/act_grad_nonfinite/model.0"] == 0
    rules = {f.rule for f in callback.findings}
    assert "exploding_gradient" in rules
    assert "nonfinite" not in rules


# ------------------------------------------------------------------------------------------ compile stance


@pytest.mark.slow
def test_two_callbacks_leave_the_compile_stance_as_it_was():
    module = TinyModule()
    callbacks = [LayerHealthCallback(every_n_steps=1, prefix="a"), LayerHealthCallback(every_n_steps=1, prefix="b")]
    make_trainer(callbacks, max_steps=3).fit(module)
    assert current_stance() == "default"
    assert compiles()


# ------------------------------------------------------------------------------------------ skipped batches
class SkipSecondBatch(TinyModule):
    """``on_train_batch_start`` returns -1 on batch 1 (Lightning skips the rest of the epoch), and the module is
    called in ``on_train_epoch_end`` with values far larger than training ever produces."""

    def __init__(self) -> None:
        super().__init__()
        self.hooks_at_epoch_end: list[int] = []

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == 1 else None

    def on_train_epoch_end(self):
        self.hooks_at_epoch_end.append(count_hooks(self))
        with torch.no_grad():
            self.model(torch.full((2, 4), 30.0))


def test_batch_skipped_by_on_train_batch_start_removes_hooks_and_drops_the_window():
    module = SkipSecondBatch()
    logger = RecordingLogger()
    make_trainer([LayerHealthCallback(every_n_steps=1)], max_steps=2, max_epochs=3, logger=logger).fit(module)
    assert module.hooks_at_epoch_end == [0, 0]
    assert count_hooks(module) == 0
    metrics = by_step(logger)
    assert sorted(metrics) == [0, 1]
    for step, x, _, weights in module.record:  # each step saw exactly one batch, and nothing else
        out = module.reference_model(weights)[0](x).detach().double()
        assert metrics[step][f"{P}/act_absmax/model.0"] == pytest.approx(out.abs().max().item(), rel=1e-6)
        assert metrics[step][f"{P}/act_mean/model.0"] == pytest.approx(out.mean().item(), rel=1e-6)


# ------------------------------------------------------------------------------------------ LBFGS
class LBFGSModule(TinyModule):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4)


def test_lbfgs_measures_weights_before_and_update_across_the_whole_step():
    module = LBFGSModule()
    logger = RecordingLogger()
    callback = LayerHealthCallback(every_n_steps=1, layers=["model.0"])
    make_trainer([callback], max_steps=2, logger=logger).fit(module)
    # training_step runs once per closure evaluation: the first record of a step holds the weights before it.
    first = {}
    for step, x, y, weights in module.record:
        first.setdefault(step, (x, y, weights))
    assert len(module.record) > 2  # LBFGS did evaluate several trial points
    x, y, before = first[0]
    after = first[1][2]
    metrics = by_step(logger)[0]
    w0, w1 = before["0.weight"].double(), after["0.weight"].double()
    assert metrics[f"{P}/param_norm/model.0.weight"] == pytest.approx(w0.norm().item(), rel=1e-6)
    ratio = (w1 - w0).norm().item() / w0.norm().item()
    assert metrics[f"{P}/param_update_ratio/model.0.weight"] == pytest.approx(ratio, rel=1e-5)
    ref = module.reference_model(before)
    nn.functional.mse_loss(ref(x), y).backward()
    assert metrics[f"{P}/param_grad_norm/model.0.weight"] == pytest.approx(ref[0].weight.grad.norm().item(), rel=1e-5)


def test_a_step_finished_before_its_update_is_not_pooled_into_the_next_sampled_step(monkeypatch):
    # on_anomaly="raise" finishes a tripped step at its first closure, before the update; with no finding, training
    # goes on. LBFGS then evaluates the closure again: those forwards and backwards were pooled into the next sampled
    # step (step 2 here), and their saved bytes too.
    def fit(trips: set[int]) -> dict[int, dict[str, float]]:
        logger = RecordingLogger()
        stats = ["act_mean", "act_std", "act_grad_norm", "act_saved_bytes", "param_norm"]
        callback = LayerHealthCallback(
            every_n_steps=2,
            stats=stats,
            on_anomaly="raise",
            sentinel=force_trips(trips),
            rules={"enabled": ["saturation"]},
            output={"summary": False},
        )
        torch.manual_seed(0)
        module = LBFGSModule()
        make_trainer([callback], max_steps=3, logger=logger).fit(module)
        assert count_hooks(module) == 0
        assert [t.step for t in callback.trips] == sorted(trips)
        return dict(logger.ours())

    healthy, tripped = fit(set()), fit({0})
    assert tripped[2] == healthy[2]


# ------------------------------------------------------------------------------------------ failing logger
class BrokenLogger(RecordingLogger):
    def log_metrics(self, metrics, step=None):
        raise OSError("disk full")


def test_a_failing_logger_does_not_cost_the_other_loggers_or_the_rules_the_step():
    module = TinyModule()
    with torch.no_grad():
        module.model[0].bias.fill_(-100.0)  # every ReLU unit dead: the dead_units rule fires on step 0
    healthy = RecordingLogger()
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore")
    with pytest.raises(OSError, match="disk full"):
        make_trainer([callback], max_steps=2, logger=[BrokenLogger(), healthy]).fit(module)
    assert sorted(by_step(healthy)) == [0]
    assert "dead_units" in {f.rule for f in callback.findings}
    assert callback.last_step == 0
    assert count_hooks(module) == 0


# ------------------------------------------------------------------------------------------ empty and sparse outputs
class EmptyBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.relu = nn.ReLU()
        self.empty_lin = nn.Linear(4, 3)
        self.empty_relu = nn.ReLU()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        empty = self.empty_relu(self.empty_lin(x[:0]))  # the only call of these two: zero elements
        mixed = self.relu(self.lin(x[:0]))  # an empty call of modules that also run on real data
        return self.head(self.relu(self.lin(x))) + empty.sum() + mixed.sum()


def test_empty_outputs_are_skipped_and_reported_as_empty():
    module = TinyModule(model=EmptyBranch())
    logger = RecordingLogger()
    with pytest.warns(LayerHealthWarning) as record:
        make_trainer([LayerHealthCallback(every_n_steps=1)], max_steps=2, logger=logger).fit(module)
    messages = [str(w.message) for w in record if w.category is LayerHealthWarning]
    assert len(messages) == 2, messages  # once per layer, not once per step
    for name in ("model.empty_lin", "model.empty_relu"):
        assert any(f"{name!r} ran during sampled step 0 but its output had no elements" in m for m in messages)
    assert not any("did not run" in m for m in messages)
    metrics = by_step(logger)[0]
    assert not any(key.endswith(("/model.empty_lin", "/model.empty_relu")) for key in metrics)
    assert f"{P}/param_norm/model.empty_lin.weight" in metrics  # its parameters are still stepped
    _, x, _, weights = module.record[0]
    ref = module.reference_model(weights)
    out = ref.relu(ref.lin(x)).detach().double()
    assert metrics[f"{P}/act_mean/model.relu"] == pytest.approx(out.mean().item(), rel=1e-6)
    dead = (out.amax(0) <= 0).double().mean().item()
    assert metrics[f"{P}/act_dead_frac/model.relu"] == dead


class ToSparse(nn.Module):
    def forward(self, x):
        return x.to_sparse()


class ToDense(nn.Module):
    def forward(self, x):
        return x.to_dense()


def test_sparse_outputs_are_skipped_with_one_warning():
    model = nn.Sequential(nn.Linear(4, 8), ToSparse(), ToDense(), nn.ReLU(), nn.Linear(8, 1))
    module = TinyModule(model=model)
    logger = RecordingLogger()
    with pytest.warns(LayerHealthWarning, match=r"output of 'model\.1' \(or its gradient\) is a sparse tensor") as rec:
        make_trainer([LayerHealthCallback(every_n_steps=1)], max_steps=2, logger=logger).fit(module)
    assert len([w for w in rec if w.category is LayerHealthWarning]) == 1
    metrics = by_step(logger)[1]
    assert f"{P}/act_mean/model.2" in metrics
    assert not any(key.endswith("/model.1") for key in metrics)
    assert count_hooks(module) == 0


# ------------------------------------------------------------------------------------------ missing gradients
class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 1)
        self.reentrant = reentrant

    def forward(self, x):
        h = self.inp(x)
        h = self.block(h) if self.reentrant is None else checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h)


def _checkpoint_run(reentrant: bool | None) -> dict[str, float]:
    torch.manual_seed(0)
    module = TinyModule(model=Checkpointed(reentrant))
    logger = RecordingLogger()
    make_trainer([LayerHealthCallback(every_n_steps=1)], max_steps=2, logger=logger).fit(module)
    assert count_hooks(module) == 0
    return by_step(logger)[1]


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_keeps_every_statistic(reentrant):
    plain, checkpointed = _checkpoint_run(None), _checkpoint_run(reentrant)
    assert f"{P}/act_grad_norm/model.block.0" in checkpointed
    assert checkpointed.keys() == plain.keys()
    for key, value in plain.items():
        assert checkpointed[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key


class DetachedSide(nn.Module):
    def __init__(self, side_first: bool) -> None:
        super().__init__()
        self.side_first = side_first
        self.main = nn.Linear(4, 1)
        self.side = nn.Linear(4, 2)

    def forward(self, x):
        side = self.side(x).detach() if self.side_first else None
        out = self.main(x)
        side = self.side(x).detach() if side is None else side
        return out + 0 * side.sum()


def test_output_cut_off_from_the_gradient_is_named_once():
    # side runs before main, which gets a gradient: the gradient never reaches side (rule no_gradient).
    module = TinyModule(model=DetachedSide(side_first=True))
    logger = RecordingLogger()
    with pytest.warns(LayerHealthWarning, match=r"no_gradient at step 0: the output of model\.side required") as record:
        make_trainer([LayerHealthCallback(every_n_steps=1)], max_steps=3, logger=logger).fit(module)
    assert len([w for w in record if w.category is LayerHealthWarning]) == 1
    metrics = by_step(logger)[2]
    assert f"{P}/act_grad_norm/model.main" in metrics
    assert f"{P}/act_grad_norm/model.side" not in metrics
    assert f"{P}/act_mean/model.side" in metrics


def test_output_that_runs_after_every_gradient_and_gets_none_is_a_note_and_output_unused(caplog):
    # side runs last: an output that does not reach the loss, like a pooler nothing reads: not a cut (no_gradient is
    # silent), a note; its parameters are in the optimizer and never get a gradient, which output_unused names (issue
    # 38, principle 2).
    module = TinyModule(model=DetachedSide(side_first=False))
    callback = LayerHealthCallback(every_n_steps=1)
    with caplog.at_level("INFO"), pytest.warns(LayerHealthWarning, match=r"output_unused at step 0: model\.side ran"):
        make_trainer([callback], max_steps=3).fit(module)
    assert {(f.rule, f.layer) for f in callback.findings} == {("output_unused", "model.side")}
    note = "'model.side' required grad but received no gradient"
    assert len([r for r in caplog.records if note in r.getMessage()]) == 1


# ------------------------------------------------------------------------------------------ failed fit
def test_callback_pickles_deep_copies_and_refits_after_a_failed_fit():
    module = TinyModule()

    def fail(mod, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("exploded in training_step")

    module.on_step = fail
    callback = LayerHealthCallback(every_n_steps=1)
    with pytest.raises(RuntimeError, match="exploded"):
        make_trainer([callback], max_steps=3).fit(module)
    restored = pickle.loads(pickle.dumps(callback))
    assert restored.last_step == callback.last_step == 0
    copy.deepcopy(callback)
    module.on_step = None
    make_trainer([callback], max_steps=2).fit(module)
    assert callback.last_step == 1
    assert count_hooks(module) == 0


# ------------------------------------------------------------------------------------------ bad arguments
@pytest.mark.parametrize(
    ("kwargs", "facts"),
    [
        ({"layers": 5}, ["layers", "module name or glob", "got 5"]),
        ({"measure": {"exclude": 5}}, ["MeasureConfig.exclude", "module name or glob", "got 5"]),
        ({"measure": {"layer_types": 5}}, ["MeasureConfig.layer_types", "nn.Module subclass", "import string", "5"]),
        ({"measure": {"dead_unit_types": 5}}, ["MeasureConfig.dead_unit_types", "nn.Module subclass", "5"]),
        ({"stats": 5}, ["stats", "statistic name", "got 5"]),
        ({"stats": [["act_mean"]]}, ["stats", "statistic name", "got [['act_mean']]"]),
        ({"output": {"summary": "false"}}, ["OutputConfig.summary", "True or False", "got 'false'"]),
        ({"output": {"summary": 1}}, ["OutputConfig.summary", "True or False", "got 1"]),
        ({"measure": 5}, ["measure", "MeasureConfig, a mapping of its fields or None", "got 5"]),
        ({"output": {"sumary": False}}, ["output", "unknown OutputConfig field(s) ['sumary']", "'summary'"]),
    ],
)
def test_wrongly_typed_arguments_name_the_argument(kwargs, facts):
    with pytest.raises(ValueError, match=re.escape(facts[0])) as error:
        LayerHealthCallback(**kwargs)
    assert all(fact in str(error.value) for fact in facts), (facts, str(error.value))


def test_unit_dim_out_of_range_raises_naming_it_and_the_layer():
    module = TinyModule()
    callback = LayerHealthCallback(every_n_steps=1, measure={"unit_dim": 5})
    with pytest.raises(ValueError, match="unit_dim") as error:
        make_trainer([callback], max_steps=1).fit(module)
    facts = ["unit_dim", "5", "'model.1'", "(8, 8)", "[-2, 1]"]  # the value, the layer, its shape, the valid axes
    assert all(fact in str(error.value) for fact in facts), str(error.value)
    assert count_hooks(module) == 0
    logger = RecordingLogger()
    make_trainer([LayerHealthCallback(every_n_steps=1, measure={"unit_dim": -1})], max_steps=1, logger=logger).fit(
        TinyModule()
    )
    assert f"{P}/act_dead_frac/model.1" in by_step(logger)[0]


class _SparseEmbeddingModule(TinyModule):
    """Token ids through nn.Embedding(sparse=True) into a linear head: SGD gets a sparse gradient."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randint(0, 12, (32, 3), generator=g), torch.randn(32, 1))
        super().__init__(nn.Sequential(nn.Embedding(12, 4, sparse=True), nn.Flatten(), nn.Linear(12, 1)), data)


def test_a_sparse_embedding_gradient_is_measured_in_a_real_fit():
    module = _SparseEmbeddingModule()
    logger = RecordingLogger()
    callback = LayerHealthCallback(every_n_steps=1, sentinel="loss+grads")
    make_trainer([callback], max_steps=2, logger=logger).fit(module)
    step, weights = module.record[-1][0], module.record[-1][3]
    metrics = dict(logger.calls[-1][1])
    assert logger.calls[-1][0] == step
    # The gradient of the last step, recomputed by hand from its batch and weights, densely.
    ref = module.reference_model(weights)
    x, y = module.record[-1][1], module.record[-1][2]
    nn.functional.mse_loss(ref(x), y).backward()
    dense = ref[0].weight.grad.to_dense().double()
    assert metrics["layer_health/param_grad_norm/model.0.weight"] == pytest.approx(dense.norm().item(), rel=1e-6)
    assert count_hooks(module) == 0
    assert callback.trips == []


class _InferenceTargetModule(TinyModule):
    """``training_step`` first runs the selected layers under ``torch.inference_mode()`` (a bootstrapped target)."""

    def __init__(self, width: int) -> None:
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
        super().__init__(nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 1)), data, batch_size=4)

    def training_step(self, batch, batch_idx):
        with torch.inference_mode():
            target = self.model(batch[0]).clone()
        return super().training_step(batch, batch_idx) + 0.0 * target.sum().item()


@pytest.mark.parametrize("width", [8, 8192], ids=["kept-back rows", "per-unit maxima in the hook"])
def test_layers_that_also_run_under_inference_mode_are_observed_without_breaking_the_fit(width):
    # The first call of a shape under inference mode used to create the scratch the next calls write into as an
    # inference tensor: "Inplace update to inference tensor outside InferenceMode" on the next training forward.
    module = _InferenceTargetModule(width)
    logger = RecordingLogger()
    callback = LayerHealthCallback(every_n_steps=2, sentinel=None)
    make_trainer([callback], max_steps=4, logger=logger).fit(module)
    step, x, _, weights = module.record[-2]  # the last sampled step (2)
    assert step == logger.calls[-1][0] == 2
    hidden = torch.relu(module.reference_model(weights)[0](x)).double()  # both calls of the step saw this
    metrics = dict(logger.calls[-1][1])
    assert metrics["layer_health/act_mean/model.1"] == pytest.approx(hidden.mean().item(), rel=1e-6)
    assert metrics["layer_health/act_std/model.1"] == pytest.approx(hidden.std(correction=0).item(), rel=1e-6)
    dead = (hidden.amax(dim=0) <= 0).double().mean().item()
    assert metrics["layer_health/act_dead_frac/model.1"] == pytest.approx(dead, abs=1e-12)
    assert count_hooks(module) == 0


# ------------------------------------------------------------------------------------------ what a window logs
def test_only_the_requested_statistics_are_logged():
    logger = RecordingLogger()
    callback = LayerHealthCallback(every_n_steps=1, stats=["act_mean", "param_norm"], output={"summary": False})
    make_trainer([callback], max_steps=2, logger=logger).fit(TinyModule())
    for _, metrics in logger.ours():
        # grad_norm_total is a statistic of its own: not logged unless asked for.
        # Neither has a summary; the depth is in the keys, never a scalar of its own.
        assert {key.split("/")[1] for key in metrics} == {"act_mean", "param_norm"}


def test_a_step_finished_before_its_update_logs_no_update_ratio(monkeypatch):
    # on_anomaly="raise" on a tripped step measures before the optimizer steps: there is no update to divide.
    logger = RecordingLogger()
    callback = LayerHealthCallback(
        every_n_steps=1,
        on_anomaly="raise",
        sentinel=force_trips({0}),
        rules={"enabled": ["saturation"]},
        output={"summary": False},
    )
    make_trainer([callback], max_steps=2, logger=logger).fit(TinyModule())
    logged = dict(logger.ours())
    assert not any("/param_update_ratio/" in key for key in logged[0])
    assert any("/param_norm/" in key for key in logged[0])
    assert any("/param_update_ratio/" in key for key in logged[1])


def test_gradient_accumulation_is_not_taken_for_stale_gradients():
    # The second micro-batch's backward finds the first one's gradients in .grad: that is accumulation, measured once
    # per window at its first backward, where zero_grad left none.
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", output={"summary": False})
    module = TinyModule()
    make_trainer([callback], max_steps=3, accumulate_grad_batches=2).fit(module)
    assert callback.last_step == 2
    assert [f for f in callback.findings if f.rule == "stale_gradients"] == []


def test_a_layer_type_selection_tracks_only_the_parameters_of_the_selected_layers():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    callback = LayerHealthCallback(
        every_n_steps=1, measure={"layer_types": ["torch.nn.Linear"]}, output={"summary": False}
    )
    make_trainer([callback], max_steps=1).fit(TinyModule(model=model))
    tracked = {key.rsplit("/", 1)[1] for key in by_name(callback.last_metrics) if "/param_norm/" in key}
    assert tracked == {"model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"}
