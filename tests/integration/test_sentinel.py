"""The always-on sentinel: trips between sampled steps, replays of the tripped step, and their side effects (none)."""

from __future__ import annotations

import math
import pickle
import random
import re

import pytest
import torch
from helpers import RecordingLogger, TinyModule, count_hooks, force_trips, make_data, make_trainer
from helpers.dropping import fit_dropping
from lightning.pytorch import Callback
from torch import nn

from lightning_hookdiag import LayerHealthCallback, LayerHealthError, LayerHealthWarning
from lightning_hookdiag._sentinel import SpikeDetector

P = "layer_health"


class Clock:
    """The optimizer step the LightningModule is in, as its training_step sees it (also during a replay)."""

    def __init__(self) -> None:
        self.step = -1
        self.calls: list[int] = []


def clocked(module: TinyModule) -> Clock:
    clock = Clock()

    def tick(m: TinyModule, batch_idx: int) -> None:
        clock.step = m.global_step
        clock.calls.append(m.global_step)

    module.on_step = tick
    return clock


class NaNAt(nn.Module):
    """Identity, except NaN in every output on optimizer step ``step``."""

    def __init__(self, clock: Clock, step: int) -> None:
        super().__init__()
        self.clock, self.step = clock, step

    def forward(self, x):
        return x * float("nan") if self.clock.step == self.step else x


class ScaleAt(nn.Module):
    """Identity, except outputs multiplied by ``factor`` on optimizer step ``step`` (a planted blow-up)."""

    def __init__(self, clock: Clock, step: int, factor: float) -> None:
        super().__init__()
        self.clock, self.step, self.factor = clock, step, factor

    def forward(self, x):
        return x * self.factor if self.clock.step == self.step else x


class _NaNGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class BackwardNaNAt(nn.Module):
    """Identity forward; on optimizer step ``step`` its backward turns the gradient into NaN."""

    def __init__(self, clock: Clock, step: int) -> None:
        super().__init__()
        self.clock, self.step = clock, step

    def forward(self, x):
        return _NaNGradient.apply(x) if self.clock.step == self.step else x


def mlp_with(make_sick, blocks: int = 6) -> tuple[TinyModule, Clock]:
    """``blocks`` x (Linear, ReLU) with a sick module inserted after the third block's Linear, then a head."""
    module = TinyModule(data=make_data(n=64), lr=0.05)
    clock = clocked(module)
    layers: list[nn.Module] = []
    for i in range(blocks):
        layers.append(nn.Linear(4 if i == 0 else 16, 16))
        if i == 2:
            layers.append(make_sick(clock))
        layers.append(nn.ReLU())
    module.model = nn.Sequential(*layers, nn.Linear(16, 1))
    module.record_enabled = False
    return module, clock


SICK = "model.5"  # the sick module's name in mlp_with: Linear, ReLU, Linear, ReLU, Linear, <sick>


def params_finite(module: nn.Module) -> bool:
    return all(torch.isfinite(p).all() for p in module.parameters())


# ------------------------------------------------------------------------------------------ between sampled steps
def test_a_forward_nan_between_sampled_steps_is_named_on_its_own_step_at_its_module():
    module, _ = mlp_with(lambda clock: NaNAt(clock, step=13))
    logger = RecordingLogger()
    callback = LayerHealthCallback(every_n_steps=10, on_anomaly="ignore", output={"summary": False})
    make_trainer([callback], max_steps=16, logger=logger).fit(module)

    first = callback.findings[0]
    assert (first.rule, first.step, first.layer) == ("nonfinite", 13, SICK)
    assert "first non-finite layer in forward order" in first.message
    assert [t.step for t in callback.trips if t.replayed] == [13]
    assert callback.trips[0].kind == "nonfinite_loss"
    assert callback.trips[0].last_finite_step == 12
    # The replay is logged at its own step with the keys of a sampled step.
    logged = dict(logger.ours())
    assert sorted(logged) == [0, 10, 13]
    assert logged[13][f"{P}/act_nonfinite/{SICK}"] == 8 * 16  # every element of the step's batch of 8
    assert logged[13][f"{P}/act_nonfinite/model.4"] == 0
    # The same keys as a sampled step, but for the output layer's largest logit: NaN there, and a NaN precursor means
    # "not observed" (the NaN itself is act_nonfinite's to report). The per-layer non-finite counts are logged on
    # the step where one is not 0 (charts="default"); on the healthy step 10 only their summary is.
    counts = {k for k in logged[13] if k.split("/")[1] in ("act_nonfinite", "act_grad_nonfinite") and k.count("/") == 2}
    assert f"{P}/act_nonfinite/model.4" in counts
    assert not [k for k in logged[10] if k.split("/")[1] in ("act_nonfinite", "act_grad_nonfinite")]
    assert set(logged[13]) == (set(logged[10]) | counts) - {f"{P}/logit_absmax/model.13"}
    assert count_hooks(module) == 0


def test_raise_stops_before_the_optimizer_step_so_every_weight_stays_finite():
    module, _ = mlp_with(lambda clock: NaNAt(clock, step=13))
    trainer = make_trainer([LayerHealthCallback(every_n_steps=10, on_anomaly="raise")], max_steps=16)
    with pytest.raises(LayerHealthError, match=rf"at step 13 in {SICK} \(rule nonfinite\)"):
        trainer.fit(module)
    assert params_finite(module)
    assert trainer.global_step == 13  # step 13 was never applied
    assert count_hooks(module) == 0


def test_without_the_sentinel_the_failure_is_only_seen_at_the_next_sampled_step():
    module, _ = mlp_with(lambda clock: NaNAt(clock, step=13))
    callback = LayerHealthCallback(every_n_steps=10, on_anomaly="ignore", sentinel=None, output={"summary": False})
    make_trainer([callback], max_steps=21).fit(module)
    assert callback.trips == []
    assert [f.step for f in callback.findings] == [20]
    assert "weights are already non-finite before step 20" in callback.findings[0].message
    assert "they were last observed finite at step 10" in callback.findings[0].message


def test_a_checkpoint_moves_between_runs_with_and_without_the_sentinel(tmp_path):
    # Without a sentinel the checkpoint's entry is None (as it always was); with one, its baseline. Each resumes the
    # other: a baseline a run without a sentinel loads goes unused, and a sentinel resumed from None starts empty.
    saved = {}
    for sentinel in (None, "loss"):
        trainer = make_trainer(
            [LayerHealthCallback(every_n_steps=2, sentinel=sentinel, output={"summary": False})], max_steps=4
        )
        trainer.fit(TinyModule(), make_data())
        saved[sentinel] = tmp_path / f"{sentinel}.ckpt"
        trainer.save_checkpoint(saved[sentinel])
    entries = {s: next(iter(torch.load(p, weights_only=False)["callbacks"].values())) for s, p in saved.items()}
    assert entries[None]["sentinel"] is None
    assert len(entries["loss"]["sentinel"]["losses"]) == 4
    assert entries["loss"]["sentinel"]["last_finite_step"] == 3
    for sentinel, other in ((None, "loss"), ("loss", None)):
        callback = LayerHealthCallback(every_n_steps=2, sentinel=sentinel, output={"summary": False})
        trainer = make_trainer([callback], max_steps=6)
        trainer.fit(TinyModule(), make_data(), ckpt_path=saved[other])
        assert callback.trips == []
        assert callback.last_step == 4
        resumed = callback.state_dict()["sentinel"]
        if sentinel is None:
            assert resumed is None
        else:  # steps 4 and 5 only: the checkpoint without a sentinel held no baseline
            assert len(resumed["losses"]) == 2
            assert resumed["last_finite_step"] == 5


def test_stop_stops_after_the_tripped_step():
    module, _ = mlp_with(lambda clock: NaNAt(clock, step=13))
    trainer = make_trainer([LayerHealthCallback(every_n_steps=10, on_anomaly="stop")], max_steps=30)
    with pytest.warns(LayerHealthWarning) as record:
        trainer.fit(module)
    assert any(f"in {SICK} at step 13" in str(w.message) for w in record)
    assert trainer.global_step == 14  # Lightning stops after the batch: step 13 was applied


# ------------------------------------------------------------------------------------------------ replay fidelity
@pytest.mark.parametrize(("precision", "accumulate"), [("32-true", 1), ("32-true", 2), ("bf16-mixed", 2)])
def test_a_replay_logs_the_values_a_regular_sampled_step_logs(monkeypatch, precision, accumulate):
    regular_log = RecordingLogger()
    fit_dropping([LayerHealthCallback(every_n_steps=3, on_anomaly="ignore", sentinel=None, output={"summary": False})],
                 regular_log, precision=precision, accumulate_grad_batches=accumulate)  # fmt: skip
    replay_log = RecordingLogger()
    callback = LayerHealthCallback(
        every_n_steps=100, on_anomaly="ignore", sentinel=force_trips({3}), output={"summary": False}
    )
    module = fit_dropping([callback], replay_log, precision=precision, accumulate_grad_batches=accumulate)

    regular, replayed = dict(regular_log.ours())[3], dict(replay_log.ours())[3]
    assert set(regular) == set(replayed)
    assert f"{P}/act_grad_norm/model.0" in replayed
    for key, value in regular.items():
        assert replayed[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key
    # Every micro-batch of step 3 ran once in training and once more in the replay.
    assert module.steps_seen.count(3) == 2 * accumulate
    assert callback.trips[0].replayed


def test_training_and_the_users_logged_values_are_bit_identical_with_replays(monkeypatch):
    plain_log = RecordingLogger()
    plain = fit_dropping([], plain_log, accumulate_grad_batches=2)
    plain_rng = torch.get_rng_state()
    replay_log = RecordingLogger()
    callback = LayerHealthCallback(
        every_n_steps=100, on_anomaly="ignore", sentinel=force_trips({2, 5}), output={"summary": False}
    )
    replayed = fit_dropping([callback], replay_log, accumulate_grad_batches=2)

    assert [t.step for t in callback.trips] == [2, 5]
    assert all(t.replayed for t in callback.trips)
    for (name, a), b in zip(plain.state_dict().items(), replayed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # weights and BatchNorm running statistics
    a_opt, b_opt = plain.trainer.optimizers[0].state_dict(), replayed.trainer.optimizers[0].state_dict()
    for a, b in zip(a_opt["state"].values(), b_opt["state"].values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(plain_rng, torch.get_rng_state())

    def users(log: RecordingLogger) -> list[tuple[int | None, dict[str, float]]]:
        calls = [(s, {k: v for k, v in m.items() if k.startswith("user/")}) for s, m in log.calls]
        return [(s, m) for s, m in calls if m]

    assert users(plain_log) == users(replay_log)
    assert any("user/mean_out" in m for _, m in users(plain_log))  # the metric's epoch value is among them


class HooksChecked(Callback):
    """After LayerHealthCallback's on_before_optimizer_step (it runs later): no hook may be left on any module."""

    def __init__(self) -> None:
        self.checked = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        assert count_hooks(pl_module) == 0 or trainer.global_step % 100 == 0
        self.checked += 1


def test_no_hook_is_left_after_any_replay(monkeypatch):
    checker = HooksChecked()
    callback = LayerHealthCallback(
        every_n_steps=100, on_anomaly="ignore", sentinel=force_trips({1, 2, 4, 6}), output={"summary": False}
    )
    module = fit_dropping([callback, checker], RecordingLogger())
    # Steps 1 and 2 are one persisting failure: only its first step is replayed.
    assert [(t.step, t.replayed) for t in callback.trips] == [(1, True), (2, False), (4, True), (6, True)]
    assert "the previous step tripped too" in callback.trips[1].reason
    assert checker.checked == 8
    assert count_hooks(module) == 0
    pickle.loads(pickle.dumps(callback))  # released at teardown: no module or hook handle is left to pickle


# ------------------------------------------------------------------------------------------------ loss spikes
def test_a_planted_activation_blow_up_is_named_by_loss_spike_at_its_module():
    module, _ = mlp_with(lambda clock: ScaleAt(clock, step=17, factor=1e4))
    callback = LayerHealthCallback(
        every_n_steps=10, on_anomaly="ignore", sentinel={"warmup": 5}, output={"summary": False}
    )
    make_trainer([callback], max_steps=18).fit(module)
    assert [(t.step, t.kind, t.replayed) for t in callback.trips] == [(17, "loss_spike", True)]
    spike = [f for f in callback.findings if f.rule == "loss_spike"]
    assert [(f.step, f.layer) for f in spike] == [(17, SICK)]
    assert spike[0].value == pytest.approx(1e4, rel=0.05)  # RMS growth since step 10
    assert "grew" in spike[0].message
    assert "since step 10" in spike[0].message


def test_a_loss_jump_of_1e8_trips_and_healthy_noise_never_does():
    rng = random.Random(0)
    for seed in range(5):
        rng.seed(seed)
        detector = SpikeDetector()
        # A decaying loss with heavy multiplicative noise (log-normal, sigma 0.35) over 20 000 steps.
        losses = [2.0 * math.exp(-i / 4000) * math.exp(rng.gauss(0.0, 0.35)) + 1e-3 for i in range(20_000)]
        assert not any(detector.observe(v) for v in losses)
        assert detector.observe(detector.median() * 1e8)
    # A loss that crosses zero (a likelihood) uses the linear scale.
    detector = SpikeDetector(warmup=5)
    assert not any(detector.observe(v) for v in [-1.0, -0.5, 0.2, -0.1, 0.3, -0.4, 0.1])
    assert detector.observe(1e8)


def test_a_long_healthy_run_never_trips():
    torch.manual_seed(0)
    data = make_data(n=512, d_in=8)
    module = TinyModule(
        model=nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1)), data=data, batch_size=4
    )
    module.record_enabled = False
    callback = LayerHealthCallback(
        every_n_steps=50, on_anomaly="raise", sentinel="loss+grads", output={"summary": False}
    )
    make_trainer([callback], max_steps=400).fit(module)
    assert callback.trips == []


# ------------------------------------------------------------------------------------------------ backward NaN
def test_a_backward_only_nan_is_caught_on_its_step_with_grads_and_one_step_later_with_loss():
    module, _ = mlp_with(lambda clock: BackwardNaNAt(clock, step=13))
    with_grads = LayerHealthCallback(every_n_steps=10, on_anomaly="raise", sentinel="loss+grads")
    with pytest.raises(LayerHealthError, match=r"at step 13 in model\.4 \(rule nonfinite\)") as info:
        make_trainer([with_grads], max_steps=16).fit(module)
    assert "output gradient of model.4" in str(info.value)  # the input of the module whose backward broke
    assert with_grads.trips[0].kind == "nonfinite_grad"
    assert params_finite(module)

    module, _ = mlp_with(lambda clock: BackwardNaNAt(clock, step=13))
    loss_only = LayerHealthCallback(every_n_steps=10, on_anomaly="raise", sentinel="loss")
    with pytest.raises(LayerHealthError, match=r"at step 14 in model\.0 \(rule nonfinite\)") as info:
        make_trainer([loss_only], max_steps=16).fit(module)
    message = str(info.value)
    assert "the weights are already non-finite before step 14" in message
    assert "last observed finite at step 10" in message
    assert "the sentinel last saw a finite step at step 13" in message


# ------------------------------------------------------------------------------------------------ no replay
class ManualModule(TinyModule):
    def __init__(self, clock_step: int) -> None:
        super().__init__(data=make_data(n=64))
        self.automatic_optimization = False
        self.record_enabled = False
        self.nan_step = clock_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        loss = self.loss(self(x), y)
        if self.global_step == self.nan_step:
            loss = loss * float("nan")
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


def test_manual_optimization_is_not_replayed_and_the_next_step_is_sampled():
    logger = RecordingLogger()
    callback = LayerHealthCallback(every_n_steps=10, on_anomaly="ignore", output={"summary": False})
    module = ManualModule(clock_step=3)
    make_trainer([callback], max_steps=6, logger=logger).fit(module)
    # Step 3's NaN loss is stepped into the weights by the user's own optimizer.step(): steps 4 and 5 trip too.
    assert [(t.step, t.replayed) for t in callback.trips] == [(3, False), (4, True), (5, False)]
    first = callback.findings[0]
    assert (first.rule, first.step, first.layer) == ("nonfinite", 3, "loss")
    assert "not replayed because of manual optimization" in first.message
    assert "step 4 is sampled" in first.message
    steps = [s for s, _ in logger.ours()]
    assert steps == [0, 3, 4]  # step 3: parameter statistics only; step 4: a full sampled step
    logged = dict(logger.ours())
    assert not any(k.startswith(f"{P}/act_") for k in logged[3])
    assert f"{P}/param_norm/model.0.weight" in logged[3]
    assert f"{P}/act_mean/model.0" in logged[4]
    at_4 = [f.message for f in callback.findings if f.step == 4]
    assert any("the weights are already non-finite before step 4" in m for m in at_4)
    assert count_hooks(module) == 0


def test_a_step_marked_for_sampling_at_the_end_of_a_fit_is_not_sampled_in_the_next_fit():
    # Step 3, the last of the first fit, trips and cannot be replayed: its next step would be sampled. The next fit
    # (a new Trainer, steps from 0) has its own schedule: before the per-fit state it sampled its step 4 too.
    callback = LayerHealthCallback(every_n_steps=10, on_anomaly="ignore", output={"summary": False})
    make_trainer([callback], max_steps=4).fit(ManualModule(clock_step=3))
    assert [(t.step, t.replayed) for t in callback.trips] == [(3, False)]
    logger = RecordingLogger()
    module = TinyModule(data=make_data(n=64))
    make_trainer([callback], max_steps=6, logger=logger).fit(module)
    assert [s for s, _ in logger.ours()] == [0]
    assert callback.trips == []  # the healthy second fit never trips (and a fresh fit has its own trips)
    assert count_hooks(module) == 0


# ------------------------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize(
    ("kwargs", "facts"),
    [
        ({"sentinel": "grads"}, ["sentinel", "['loss', 'loss+grads', None]", "got 'grads'"]),
        ({"sentinel": True}, ["sentinel", "['loss', 'loss+grads', None]", "got True"]),
        ({"sentinel": {"window": 2}}, ["SentinelConfig.window", ">= 3", "got 2"]),
        ({"sentinel": {"warmup": 60}}, ["SentinelConfig.warmup", "[3, window=50]", "got 60"]),
        ({"sentinel": {"zscore": 0}}, ["SentinelConfig.zscore", "> 0", "got 0"]),
        ({"sentinel": {"ratio": 1.0}}, ["SentinelConfig.ratio", "> 1", "got 1.0"]),
        ({"sentinel": {"floor": 1.0}}, ["SentinelConfig.floor", "[0, 1)", "got 1.0"]),
        ({"sentinel": {"mode": "grads"}}, ["SentinelConfig.mode", "['loss', 'loss+grads', None]", "got 'grads'"]),
        ({"sentinel": {"detector": "spikes"}}, ["SentinelConfig.detector", "SpikeDetector", "got 'spikes'"]),
        ({"rules": {"spike_growth": math.inf}}, ["spike_growth", "> 1", "got inf"]),
    ],
)
def test_bad_sentinel_settings_are_rejected_naming_the_value(kwargs, facts):
    with pytest.raises(ValueError, match=re.escape(facts[0])) as error:
        LayerHealthCallback(**kwargs)
    assert all(fact in str(error.value) for fact in facts), (facts, str(error.value))


def test_the_sentinel_state_survives_a_checkpoint_round_trip():
    callback = LayerHealthCallback(every_n_steps=10, on_anomaly="ignore", output={"summary": False})
    module, _ = mlp_with(lambda clock: NaNAt(clock, step=25))
    make_trainer([callback], max_steps=27).fit(module)
    state = callback.state_dict()
    restored = LayerHealthCallback(every_n_steps=10)
    restored.load_state_dict(state)
    assert restored.trips == callback.trips
    sentinel = restored.state_dict()["sentinel"]
    assert sentinel == state["sentinel"]
    assert len(sentinel["losses"]) == 25  # the healthy steps 0 to 24 fill the baseline window
    assert sentinel["last_finite_step"] == 24
    assert sentinel["previous_trip"] == 26  # the NaN weights keep the loss NaN after step 25


def test_a_second_fit_starts_from_a_fresh_baseline():
    callback = LayerHealthCallback(
        every_n_steps=10, on_anomaly="raise", sentinel={"warmup": 3}, output={"summary": False}
    )
    module, _ = mlp_with(lambda clock: nn.Identity())
    make_trainer([callback], max_steps=30).fit(module)
    assert len(callback.state_dict()["sentinel"]["losses"]) == 30
    # The same callback on a run whose loss is 1e6 times larger: no spike against the first run's losses.
    big, _ = mlp_with(lambda clock: nn.Identity())
    big.data.tensors = (big.data.tensors[0], big.data.tensors[1] * 1e3)
    big.lr = 1e-9  # a loss level of its own, stable
    make_trainer([callback], max_steps=5).fit(big)
    assert callback.trips == []


def _reference_spike(window: list[float], loss: float, zscore: float, ratio: float, recent: int = 5) -> bool:
    """The documented test, by hand.

    Centre: the lower median of the latest ``recent`` losses; spread: 1.4826 * MAD of consecutive differences /
    sqrt(2); log scale over the positive losses of a non-negative window, linear otherwise.
    """

    def median(values: list[float]) -> float:
        ordered, n = sorted(values), len(values)
        return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2

    def spread(values: list[float]) -> float:
        steps = [values[i + 1] - values[i] for i in range(len(values) - 1)]
        trend = median(steps)
        return 1.4826 * median([abs(s - trend) for s in steps]) / math.sqrt(2)

    if loss >= 0 and all(v >= 0 for v in window):
        logs = [math.log(v) for v in window if v > 0]
        if loss == 0 or len(logs) < 3:
            return False
        latest = sorted(logs[-recent:])
        rise = math.log(loss) - latest[(len(latest) - 1) // 2]
        return rise > math.log(ratio) and rise > zscore * spread(logs)
    latest = sorted(window[-recent:])
    centre = latest[(len(latest) - 1) // 2]
    scale = median([abs(v) for v in window if v != 0]) if any(window) else 0.0
    rise = loss - centre
    return rise > 0 and rise > (ratio - 1) * max(abs(centre), scale) and rise > zscore * spread(window)


def test_spike_decisions_match_the_documented_definition_also_near_the_ratio_bound():
    # The detector skips the sorts when the loss is below ratio x the smallest recent loss; every decision must
    # still be the definition's, on windows of every shape (descending, zero-heavy, with negative losses) and on
    # losses right at the bounds.
    rng = random.Random(11)
    detector_args = {"window": 30, "warmup": 5, "zscore": 3.0, "ratio": 4.0}
    decisions = {True: 0, False: 0}
    for trial in range(400):
        detector = SpikeDetector(**detector_args)
        level, spread = 10 ** rng.uniform(-3, 3), rng.choice([0.0, 0.01, 0.3, 1.0])
        slope = rng.choice([0.0, 0.0, -0.2])  # a fast descent: a decade every ~12 steps
        size = rng.randint(5, 30)
        window = [level * math.exp(slope * i + rng.gauss(0, spread)) for i in range(size)]
        if trial % 7 == 0:
            window[rng.randrange(len(window))] = -level  # a non-positive loss: the linear scale
        if trial % 5 == 0:
            window = [0.0 if rng.random() < 0.7 else v for v in window]  # a hinge loss, mostly 0
        for value in window:
            detector.record(value)
        positive = [v for v in window if v > 0][-5:] or [level]
        low = min(positive)
        bound = low * 4.0
        candidates = [bound, bound * (1 + 1e-12), bound * (1 - 1e-12), low * rng.uniform(0, 50), level * 1e3, 0.0]
        for loss in candidates:
            expected = _reference_spike(window, loss, detector_args["zscore"], detector_args["ratio"])
            assert detector.is_spike(loss) is expected, (window, loss)
            decisions[expected] += 1
    assert decisions[True] > 100  # both outcomes exercised
    assert decisions[False] > 100


class _DetachedSideFrom(nn.Module):
    """A side branch that stops reaching the loss from step ``start`` on (its output is detached)."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.main, self.side = nn.Linear(4, 1), nn.Linear(4, 2)
        self.start, self.step = start, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = self.side(x)  # runs before main, which gets a gradient: a detached side is cut off from it
        return self.main(x) + 0 * (side.detach() if self.step >= self.start else side).sum()


def test_a_replayed_step_names_an_output_that_got_no_gradient(monkeypatch):
    # The replay attaches and removes its own hooks, so the batch end finds none attached; what the hooks saw of
    # the missing gradient must come from the replay itself.
    module = TinyModule(model=_DetachedSideFrom(start=1))
    module.on_step = lambda m, i: setattr(m.model, "step", m.global_step)
    callback = LayerHealthCallback(
        every_n_steps=100, on_anomaly="ignore", sentinel=force_trips({2}), output={"summary": False}
    )
    make_trainer([callback], max_steps=4, logger=RecordingLogger()).fit(module)
    assert [trip.step for trip in callback.trips] == [2]
    assert callback.trips[0].replayed
    cut = [f for f in callback.findings if f.rule == "no_gradient"]
    assert [(f.layer, f.step) for f in cut] == [("model.side", 2)]
    assert cut[0].message.startswith("no_gradient at step 2: the output of model.side required grad")
