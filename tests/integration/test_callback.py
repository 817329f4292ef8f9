"""End-to-end tests of LayerHealthCallback with real Trainers, checked against a hand-written reference."""

import csv
import gc
import logging
import math
import re
import warnings
import weakref

import pytest
import torch
from helpers import RecordingLogger, TinyModule, by_name, count_hooks, depths, make_data, make_trainer
from helpers.keys import parse_key
from helpers.reference import activation_stats, dead_fraction, flat, l2, replay_sequential, weights_after
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_hookdiag import LayerHealthCallback, LayerHealthWarning

P = "layer_health"


def by_step(logger: RecordingLogger) -> dict[int, dict[str, float]]:
    calls = logger.ours()
    steps = [s for s, _ in calls]
    assert len(steps) == len(set(steps)), f"logged more than once for a step: {steps}"
    return dict(calls)


def raw_by_step(logger: RecordingLogger, prefix: str = P) -> dict[int, dict[str, float]]:
    """The keys under ``prefix`` as logged (with the depth in them), by step."""
    return {s: m for s, m in logger.raw if any(parse_key(k, prefix) for k in m)}


def assert_forward_matches(metrics, module, step, accumulate, layers):
    outputs, _, _, _ = replay_sequential(module, step, accumulate)
    for i in layers:
        expected = activation_stats(flat(outputs[i]))
        for stat, value in expected.items():
            got = metrics[f"{P}/{stat}/model.{i}"]
            assert got == pytest.approx(value, rel=1e-5, abs=1e-6), (step, i, stat)


# ---------------------------------------------------------------------------------------------- sampling + forward
def test_forward_statistics_and_schedule_under_accumulation():
    module = TinyModule(data=make_data(n=96), batch_size=4)
    logger = RecordingLogger()
    callback = LayerHealthCallback(
        every_n_steps=2, output={"charts": "all"}
    )  # every statistic, the non-finite counts too
    make_trainer([callback], max_steps=5, accumulate_grad_batches=3, logger=logger).fit(module)

    logged = by_step(logger)
    assert sorted(logged) == [0, 2, 4]
    for step, metrics in logged.items():
        assert_forward_matches(metrics, module, step, 3, layers=[0, 1, 2])
        outputs, _, _, _ = replay_sequential(module, step, 3)
        assert len(outputs[1]) == 3  # pooled over all three micro-batches
        assert metrics[f"{P}/act_dead_frac/model.1"] == pytest.approx(dead_fraction(outputs[1]))
        # Only ReLU-family layers get a dead fraction.
        assert f"{P}/act_dead_frac/model.0" not in metrics
        # The keys carry each layer's place in the forward order.
        assert depths(raw_by_step(logger)[step]) == {f"model.{i}": i for i in range(3)}
    assert callback.last_step == 4
    assert by_name(callback.last_metrics) == logged[4]


def test_dead_units_pooled_over_micro_batches_not_averaged():
    # Units that fire in only one micro-batch are alive for the step; a per-micro-batch average would say otherwise.
    model = nn.Sequential(nn.Linear(1, 4), nn.ReLU(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0], [-1.0], [0.0], [0.0]]))
        model[0].bias.copy_(torch.tensor([0.0, 0.0, 0.0, -1.0]))
    x = torch.tensor([[1.0], [2.0], [-1.0], [-2.0]])
    data = torch.utils.data.TensorDataset(x, torch.zeros(4, 1))
    module = TinyModule(model=model, data=data, batch_size=2)  # one step: its update changes nothing measured
    logger = RecordingLogger()
    make_trainer([LayerHealthCallback(every_n_steps=1)], max_steps=1, accumulate_grad_batches=2, logger=logger).fit(
        module
    )
    # Unit 0 fires on the first micro-batch, unit 1 on the second, units 2 and 3 never: 2 of 4 dead.
    assert by_step(logger)[0][f"{P}/act_dead_frac/model.1"] == 0.5


# ---------------------------------------------------------------------------------------------- gradient side
@pytest.mark.parametrize(("accumulate", "clip"), [(1, None), (2, 0.01)])
def test_gradient_and_parameter_statistics_match_reference(accumulate, clip):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    module = TinyModule(model=model, data=make_data(n=64), batch_size=4)
    logger = RecordingLogger()
    make_trainer(
        [LayerHealthCallback(every_n_steps=1, output={"charts": "all"})],  # the gradients' non-finite counts (0) too
        max_steps=3,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        logger=logger,
    ).fit(module)
    for step, metrics in by_step(logger).items():
        outputs, grads, param_grads, before = replay_sequential(module, step, accumulate)
        after = weights_after(module, step)
        for i in range(5):
            assert metrics[f"{P}/act_grad_norm/model.{i}"] == pytest.approx(l2(flat(grads[i])), rel=1e-5)
            assert metrics[f"{P}/act_grad_nonfinite/model.{i}"] == 0
        # Linear followed by an in-place ReLU: its statistics are those of its own (pre-activation) output.
        assert_forward_matches(metrics, module, step, accumulate, layers=[0])
        assert metrics[f"{P}/act_mean/model.0"] != pytest.approx(metrics[f"{P}/act_mean/model.1"])
        total = 0.0
        for name, grad in param_grads.items():
            key = name.split(".")
            key = f"model.{key[0]}.{key[1]}"
            gnorm = l2(grad.reshape(-1).tolist())
            wnorm = l2(before[name].reshape(-1).tolist())
            update = l2((after[name] - before[name]).reshape(-1).tolist())
            assert metrics[f"{P}/param_grad_norm/{key}"] == pytest.approx(gnorm, rel=1e-5)  # pre-clip
            assert metrics[f"{P}/param_norm/{key}"] == pytest.approx(wnorm, rel=1e-5)
            assert metrics[f"{P}/param_update_ratio/{key}"] == pytest.approx(update / wnorm, rel=1e-4)
            total += gnorm**2
        assert metrics[f"{P}/grad_norm_total"] == pytest.approx(math.sqrt(total), rel=1e-5)
        if clip is not None:
            assert metrics[f"{P}/grad_norm_total"] > clip * 10  # the logged norm really is the unclipped one


def test_frozen_parameters_and_prefix_produce_no_gradient_keys():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    for p in model[0].parameters():
        p.requires_grad_(False)
    module = TinyModule(model=model)
    logger = RecordingLogger()
    make_trainer([LayerHealthCallback(every_n_steps=1)], max_steps=1, logger=logger).fit(module)
    metrics = by_step(logger)[0]
    assert not any(k.startswith(f"{P}/param_") and ".0." in k for k in metrics)
    # model.0's output does not require grad (frozen prefix): skipped for activation gradients, without error.
    assert f"{P}/act_grad_norm/model.0" not in metrics
    assert f"{P}/act_grad_norm/model.2" in metrics
    assert f"{P}/act_mean/model.0" in metrics
    assert f"{P}/param_norm/model.2.weight" in metrics


# ---------------------------------------------------------------------------------------------- logging
def test_every_logger_receives_one_call_per_sampled_step_and_csv_reads_back(tmp_path):
    recording = RecordingLogger()
    csv_logger = CSVLogger(tmp_path, name="run")
    callback = LayerHealthCallback(every_n_steps=3, stats=["act_mean", "act_grad_norm"])
    make_trainer([callback], max_steps=7, logger=[csv_logger, recording], log_every_n_steps=1).fit(TinyModule())
    logged = by_step(recording)
    assert sorted(logged) == [0, 3, 6]
    # 3 layers x 2 stats + the summary of act_grad_norm (min and max); no depth keys: the depth is in the keys.
    assert all(len(m) == 3 * 2 + 2 for m in logged.values())
    with open(f"{csv_logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    column = f"{P}.act_mean/2_model.2"  # as logged
    from_csv = {int(r["step"]): float(r[column]) for r in rows if r.get(column)}
    assert from_csv == pytest.approx({s: m[f"{P}/act_mean/model.2"] for s, m in logged.items()})


def test_stats_selection_limits_keys_and_custom_prefix():
    logger = RecordingLogger()
    callback = LayerHealthCallback(every_n_steps=1, stats=["act_dead_frac"], prefix="health")
    make_trainer([callback], max_steps=1, logger=logger).fit(TinyModule())
    assert set(logger.ours("health")[0][1]) == {"health/act_dead_frac/model.1", "health/act_dead_frac_max"}
    # As logged: the layer's group under the custom prefix, with its depth; the summary group with the alert count.
    (logged,) = raw_by_step(logger, "health").values()
    assert set(logged) == {"health.act_dead_frac/1_model.1", "health/act_dead_frac_max", "health/alerts_active"}


# ---------------------------------------------------------------------------------------------- lifecycle
class ProbeModule(TinyModule):
    def __init__(self) -> None:
        super().__init__(data=make_data(n=32))
        self.hooks_in_validation: list[int] = []
        self.hooks_in_training: list[int] = []

    def training_step(self, batch, batch_idx):
        self.hooks_in_training.append(count_hooks(self))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.hooks_in_validation.append(count_hooks(self))
        x, y = batch
        return self.loss(self(x), y)

    def val_dataloader(self):
        return self.train_dataloader()


def test_no_hooks_outside_sampled_training_batches_and_user_hooks_kept():
    module = ProbeModule()
    user_calls = []
    module.model[0].register_forward_hook(lambda m, a, o: user_calls.append(1))
    baseline = count_hooks(module)
    make_trainer([LayerHealthCallback(every_n_steps=2)], max_steps=4, val_check_interval=2, num_sanity_val_steps=2).fit(
        module
    )
    assert module.hooks_in_validation
    assert set(module.hooks_in_validation) == {baseline}  # sanity check and validation: only the user's hook
    # Sampled steps 0 and 2 carry our hooks: 3 of the statistics, 3 of the output-layer probe and the global forward
    # hook of unregistered_module; steps 1 and 3 none.
    assert module.hooks_in_training == [baseline + 7, baseline, baseline + 7, baseline]
    assert count_hooks(module) == baseline
    assert len(module.model[0]._forward_hooks) == 1
    assert user_calls  # the user's hook kept working throughout


def test_no_hooks_after_exception_in_training_step():
    module = TinyModule()

    def fail(mod, batch_idx):
        if batch_idx == 2:
            assert count_hooks(mod) == 7  # attached (see above): the failure happens inside a sampled batch
            raise RuntimeError("exploded in training_step")

    module.on_step = fail
    with pytest.raises(RuntimeError, match="exploded"):
        make_trainer([LayerHealthCallback(every_n_steps=1)], max_steps=5).fit(module)
    assert count_hooks(module) == 0


def test_fit_twice_and_teardown_are_safe():
    callback = LayerHealthCallback(every_n_steps=1)
    module = TinyModule()
    make_trainer([callback], max_steps=2).fit(module)
    make_trainer([callback], max_steps=4).fit(module)
    callback.teardown(None, module, "fit")  # type: ignore[arg-type]
    callback.teardown(None, module, "fit")  # type: ignore[arg-type]
    assert count_hooks(module) == 0
    assert callback.last_step is not None


def train_weights(with_callback: bool, **trainer_kwargs) -> dict[str, torch.Tensor]:
    torch.manual_seed(123)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(inplace=True), nn.Dropout(0.3), nn.Linear(16, 1))
    module = TinyModule(model=model, data=make_data(n=64), optimizer="adam", lr=0.01)
    module.record_enabled = False
    callbacks = [LayerHealthCallback(every_n_steps=1)] if with_callback else []
    torch.manual_seed(7)
    make_trainer(callbacks, max_steps=6, **trainer_kwargs).fit(module)
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("kwargs", [{}, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.1}])
def test_training_is_bit_identical_with_and_without_callback(kwargs):
    plain = train_weights(False, **kwargs)
    observed = train_weights(True, **kwargs)
    assert plain.keys() == observed.keys()
    for k in plain:
        assert torch.equal(plain[k], observed[k]), k


def graph_tensors() -> dict[int, weakref.ref]:
    """Every live tensor that is part of an autograd graph, by identity."""
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # isinstance() on torch's deprecated module proxies
        return {id(o): weakref.ref(o) for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn}


def test_no_autograd_graph_retained_after_sampled_batches():
    callback = LayerHealthCallback(every_n_steps=1)
    new_per_step = []
    # Graphs that earlier tests of the session left behind (held by a stored traceback, freed whenever the collector
    # gets to them) are not this fit's: only tensors that were not alive before the fit count.
    before = graph_tensors()

    class Probe(pl_callback_base()):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = graph_tensors()
            new_per_step.append(sum(1 for key, ref in now.items() if key not in before or before[key]() is not ref()))

    make_trainer([callback, Probe()], max_steps=3).fit(TinyModule())
    assert new_per_step == [0, 0, 0]
    for value in vars(callback).values():
        assert not (isinstance(value, torch.Tensor) and value.grad_fn is not None)


def pl_callback_base():
    from lightning.pytorch import Callback

    return Callback


# ---------------------------------------------------------------------------------------------- odd modules
class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.direct = nn.Linear(4, 4)
        self.never = nn.Linear(4, 4)
        self.argmax = ArgMax()
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        h = self.fc(x) + self.direct.forward(x)  # .forward() bypasses hooks
        self.argmax(h)
        return self.out(h)


class ArgMax(nn.Module):
    def forward(self, x):
        return x.argmax(-1)


def test_modules_that_did_not_run_or_have_no_float_output_warn_once():
    logger = RecordingLogger()
    callback = LayerHealthCallback(every_n_steps=1)
    with pytest.warns(LayerHealthWarning) as record:
        make_trainer([callback], max_steps=3, logger=logger).fit(TinyModule(model=Branchy()))
    messages = [str(w.message) for w in record if issubclass(w.category, LayerHealthWarning)]
    assert sum("'model.direct' did not run" in m for m in messages) == 1
    assert sum("'model.never' did not run" in m for m in messages) == 1
    assert sum("'model.argmax' holds no floating-point tensor" in m for m in messages) == 1
    assert not any("'model.fc'" in m for m in messages)
    metrics = by_step(logger)[0]
    assert f"{P}/act_mean/model.fc" in metrics
    assert not any(k.endswith(("/model.direct", "/model.never", "/model.argmax")) for k in metrics)


class LSTMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 3, batch_first=True)
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        out, _ = self.lstm(x.unsqueeze(1))
        return self.head(out[:, -1])


def test_tuple_outputs_use_first_floating_tensor():
    module = TinyModule(model=LSTMNet())
    logger = RecordingLogger()
    make_trainer([LayerHealthCallback(every_n_steps=1)], max_steps=1, logger=logger).fit(module)
    metrics = by_step(logger)[0]
    _, x, _, weights = module.record[0]
    ref = module.reference_model(weights)
    out, _ = ref.lstm(x.unsqueeze(1))
    expected = activation_stats(out.reshape(-1).tolist())
    assert metrics[f"{P}/act_std/model.lstm"] == pytest.approx(expected["act_std"], rel=1e-5)
    assert f"{P}/act_grad_norm/model.lstm" in metrics


class InjectNaN(nn.Module):
    def forward(self, x):
        x = x.clone()
        x[0, 0] = float("nan")
        x[1, 1] = float("inf")
        return x


def test_nonfinite_activations_are_counted_and_other_stats_stay_readable():
    model = nn.Sequential(nn.Linear(4, 4), InjectNaN(), nn.Linear(4, 1))
    module = TinyModule(model=model)
    logger = RecordingLogger()
    with pytest.warns(LayerHealthWarning) as record:
        make_trainer([LayerHealthCallback(every_n_steps=1)], max_steps=1, logger=logger).fit(module)
    assert any("nonfinite: 2 NaN/Inf output elements in model.1 at step 0" in str(w.message) for w in record)
    metrics = by_step(logger)[0]
    outputs, _, _, _ = replay_sequential(module, 0, 1)
    expected = activation_stats(flat(outputs[1]))
    assert metrics[f"{P}/act_nonfinite/model.1"] == 2
    assert metrics[f"{P}/act_mean/model.1"] == pytest.approx(expected["act_mean"], rel=1e-5)
    assert metrics[f"{P}/act_std/model.1"] == pytest.approx(expected["act_std"], rel=1e-5)
    assert metrics[f"{P}/act_nonfinite/model.2"] > 0


def test_bf16_mixed_close_to_fp32():
    def run(precision):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
        logger = RecordingLogger()
        make_trainer([LayerHealthCallback(every_n_steps=1)], max_steps=1, precision=precision, logger=logger).fit(
            TinyModule(model=model)
        )
        return by_step(logger)[0]

    full, half = run("32-true"), run("bf16-mixed")
    assert full.keys() == half.keys()
    for key in full:
        if "nonfinite" in key or "depth" in key:
            assert half[key] == full[key]
        elif "update_ratio" not in key:
            assert half[key] == pytest.approx(full[key], rel=0.05, abs=1e-3), key


# ---------------------------------------------------------------------------------------------- configuration
def assert_names(error: pytest.ExceptionInfo, facts: list[str]) -> None:
    """The message holds every key fact (the argument, the bad value, the valid choices), whatever its wording."""
    for fact in facts:
        assert fact in str(error.value), (fact, str(error.value))


@pytest.mark.parametrize(
    ("kwargs", "facts"),
    [
        ({"every_n_steps": 0}, ["every_n_steps", ">= 1", "got 0"]),
        ({"every_n_steps": True}, ["every_n_steps", ">= 1", "got True"]),
        ({"every_n_steps": 2.5}, ["every_n_steps", ">= 1", "got 2.5"]),
        ({"stats": ["act_mean", "act_meen"]}, ["['act_meen']", "act_mean", "act_std"]),
        ({"prefix": ""}, ["prefix", "non-empty", "got ''"]),
        ({"prefix": "/health"}, ["prefix", "'/'", "got '/health'"]),
        ({"measure": {"layer_types": ["torch.nn.Lineer"]}}, ["MeasureConfig.layer_types", "'torch.nn.Lineer'"]),
        ({"measure": {"dead_unit_types": ["relu"]}}, ["MeasureConfig.dead_unit_types", "'relu'"]),
        ({"layers": ["model.0", ""]}, ["layers", "non-empty", "['']"]),
        ({"measure": {"unit_dim": "last"}}, ["MeasureConfig.unit_dim", "integer axis or None", "got 'last'"]),
    ],
)
def test_invalid_configuration_raises_at_construction(kwargs, facts):
    with pytest.raises(ValueError, match=re.escape(facts[0])) as error:
        LayerHealthCallback(**kwargs)
    assert_names(error, facts)


def test_layer_that_matches_nothing_raises_when_fit_starts():
    callback = LayerHealthCallback(layers=["model.9"])
    with pytest.raises(ValueError, match="matches no module") as error:
        make_trainer([callback], max_steps=1).fit(TinyModule())
    assert_names(error, ["'model.9'", "model.2, model.1, model.0", "list_layers"])


def test_state_dict_round_trip():
    callback = LayerHealthCallback(every_n_steps=1)
    make_trainer([callback], max_steps=2).fit(TinyModule())
    restored = LayerHealthCallback(every_n_steps=1)
    restored.load_state_dict(callback.state_dict())
    assert restored.last_metrics == callback.last_metrics
    assert restored.last_step == 1
    assert all(not isinstance(v, torch.Tensor) for v in callback.state_dict()["last_metrics"].values())


def test_pickling_before_and_after_fit():
    import pickle

    callback = LayerHealthCallback(
        every_n_steps=1, rules={"dead_frac_threshold": 0.5}, measure={"layer_types": ["torch.nn.Linear"]}
    )
    restored = pickle.loads(pickle.dumps(callback))
    assert restored.layer_types == (nn.Linear,)
    assert restored.rule_config == callback.rule_config
    make_trainer([callback], max_steps=2).fit(TinyModule())
    after = pickle.loads(pickle.dumps(callback))
    assert after.last_metrics == callback.last_metrics
    assert after.last_step == 1


class SharedReLU(nn.Module):
    """One ReLU applied to hidden states of two different widths."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow = nn.Linear(4, 3)
        self.wide = nn.Linear(3, 5)
        self.act = nn.ReLU()
        self.head = nn.Linear(5, 1)

    def forward(self, x):
        return self.head(self.act(self.wide(self.act(self.narrow(x)))))


def test_unit_count_change_is_warned_once_and_never_reported_as_dead():
    logger = RecordingLogger()
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore")
    with pytest.warns(LayerHealthWarning) as record:
        make_trainer([callback], max_steps=3, logger=logger).fit(TinyModule(model=SharedReLU()))
    messages = [str(w.message) for w in record if "number of units of 'model.act' changed" in str(w.message)]
    assert len(messages) == 1
    for _, metrics in logger.ours():
        assert f"{P}/act_dead_frac/model.act" not in metrics
        assert f"{P}/act_mean/model.act" in metrics
    assert not [f for f in callback.findings if f.rule == "dead_units"]


# ---------------------------------------------------------------------------------------------- structure
def test_only_the_callback_the_replay_and_the_logger_writer_import_lightning():
    import ast
    from pathlib import Path

    import lightning_hookdiag

    package = Path(lightning_hookdiag.__file__).parent
    importers = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if any(name.split(".")[0] in ("lightning", "lightning_fabric", "pytorch_lightning") for name in names):
                importers.add(path.relative_to(package).as_posix())
    # The statistics, the step state, the sentinel and the rules are tested without a Trainer; publish.py is the
    # last stage, writing findings and images into Lightning's loggers.
    assert importers == {"_callback.py", "_replay.py", "_publish.py"}


# ------------------------------------------------------------------------------------------ settings and loggers
def test_settings_changed_after_construction_hold_for_the_next_fit():
    callback = LayerHealthCallback(every_n_steps=50, output={"summary": False})
    callback.every_n_steps, callback.stats = 2, ("act_mean",)
    logger = RecordingLogger()
    make_trainer([callback], max_steps=5, logger=logger).fit(TinyModule())
    logged = by_step(logger)
    assert sorted(logged) == [0, 2, 4]
    assert {key.split("/")[1] for metrics in logged.values() for key in metrics} == {"act_mean"}
    assert "'every_n_steps': 2" in callback.state_key  # the checkpoint key agrees with the schedule


def test_each_logger_is_written_once_per_histogram_step_and_only_if_it_stores_histograms(tmp_path, caplog):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recording, tensorboard = RecordingLogger(), TensorBoardLogger(tmp_path)
    callback = LayerHealthCallback(
        every_n_steps=2, measure={"histogram_every_n_steps": 2, "histogram_bins": 8}, output={"summary": False}
    )
    with caplog.at_level(logging.INFO):
        make_trainer([callback], max_steps=3, logger=[recording, tensorboard]).fit(TinyModule())
    # TensorBoard stores them: one histogram per series on each histogram step (steps 0 and 2), none twice.
    accumulator = EventAccumulator(tensorboard.log_dir, size_guidance={"histograms": 0}, purge_orphaned_data=False)
    accumulator.Reload()
    tags = accumulator.Tags()["histograms"]
    assert {tag.partition("/")[0] for tag in tags} == {f"{P}.act_hist", f"{P}.act_grad_hist"}
    assert len(tags) == 2 * 3  # outputs and their gradients, of the 3 layers
    for tag in tags:
        assert [event.step for event in accumulator.Histograms(tag)] == [0, 2], tag
    # The recording logger does not: no histogram reaches it, and it is named once in the whole fit.
    assert not [key for _, metrics in recording.raw for key in metrics if "_hist" in key]
    assert sum("RecordingLogger cannot store histograms" in r.message for r in caplog.records) == 1
