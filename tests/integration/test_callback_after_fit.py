"""What the callback holds after a fit: no module, no tensor, no history of an earlier fit, on every exit path."""

from __future__ import annotations

import collections
import functools
import inspect
import io
import pickle
import types

import pytest
import torch
from helpers import TinyModule, count_hooks, force_trips, make_data, make_trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightning_hookdiag import ALL_STATS, OPT_IN_STATS, LayerHealthCallback, LayerHealthError
from lightning_hookdiag.components import Setup, component
from lightning_hookdiag.rules import BUILTIN_RULES

EVERY_STAT = [*ALL_STATS, *OPT_IN_STATS]


class Finder(pickle.Pickler):
    """Pickles into memory and records every tensor and module it is asked to write."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO())
        self.found: list[str] = []

    def reducer_override(self, obj):
        if isinstance(obj, (torch.Tensor, nn.Module)):
            self.found.append(type(obj).__name__)
        return NotImplemented


def held(callback: LayerHealthCallback) -> list[str]:
    finder = Finder()
    finder.dump(callback)
    return finder.found


class Boom(Callback):
    """Raises in one Lightning hook on one optimizer step."""

    def __init__(self, hook: str, step: int) -> None:
        self.hook, self.step = hook, step

    def __getattribute__(self, name):
        hook = object.__getattribute__(self, "hook")
        if name == hook:

            def boom(trainer, *args, **kwargs):
                if trainer.global_step == object.__getattribute__(self, "step"):
                    raise RuntimeError(f"boom in {hook}")

            return boom
        return object.__getattribute__(self, name)


def module() -> TinyModule:
    m = TinyModule(data=make_data(n=64))
    m.record_enabled = False
    return m


def test_after_a_fit_the_callback_holds_no_module_and_no_tensor():
    m = module()
    callback = LayerHealthCallback(every_n_steps=2, stats=EVERY_STAT, on_anomaly="ignore", output={"summary": False})
    make_trainer([callback], max_steps=5).fit(m)
    assert callback.last_step == 4  # guards the test: the statistics were computed
    assert held(callback) == []
    assert count_hooks(m) == 0


# Sampled step 2: the window is open, hooks, probes and the saved-bytes tracker attached; step 1: unsampled.
@pytest.mark.parametrize(
    ("hook", "step"),
    [
        ("on_train_batch_start", 2),
        ("on_before_backward", 2),
        ("on_after_backward", 2),
        ("on_before_optimizer_step", 2),
        ("on_train_batch_end", 1),
        ("on_before_backward", 1),
    ],
)
def test_after_an_exception_at_any_stage_the_callback_holds_no_module_and_no_tensor(hook, step):
    m = module()
    callback = LayerHealthCallback(every_n_steps=2, stats=EVERY_STAT, on_anomaly="ignore", output={"summary": False})
    # The failing callback comes after ours: ours has already done its part of the hook when it raises.
    with pytest.raises(RuntimeError, match=f"boom in {hook}"):
        make_trainer([callback, Boom(hook, step)], max_steps=5).fit(m)
    assert held(callback) == []
    assert count_hooks(m) == 0
    assert not torch.overrides._get_current_function_mode_stack()  # the attention probe's mode is gone too


def test_a_second_fit_starts_a_fresh_trend_history():
    callback = LayerHealthCallback(every_n_steps=2, on_anomaly="ignore", output={"summary": False})

    def steps() -> list[int]:  # the trend history as checkpointed
        return [s for s, _ in callback.state_dict()["history"]["points"]["param_norm"]["model.0.weight"]]

    make_trainer([callback], max_steps=20).fit(module())
    assert steps() == list(range(0, 20, 2))
    make_trainer([callback], max_steps=10).fit(module())
    assert steps() == list(range(0, 10, 2))  # only the second fit's: an earlier fit's values are no trend of this one


# ------------------------------------------------------------------------------ every exit, every opt-in statistic
FULL = {
    "every_n_steps": 2,
    "stats": EVERY_STAT,
    "measure": {"precision_targets": "float16", "histogram_every_n_steps": 2},
    "sentinel": "loss+grads",
    "output": {"summary": False},
    "on_anomaly": "ignore",
}


class Attention(nn.Module):
    """A block with attention, so that the attention probe (a torch-function mode) is entered on sampled steps."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.act = nn.ReLU()
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).unsqueeze(1)
        a, _ = self.attn(h, h, h)
        return self.out(self.act(a.squeeze(1)))


class Validated(TinyModule):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        return self.loss(self(x), y)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size)


def attention_module(fail_replays: bool = False) -> Validated:
    m = Validated(model=Attention(), data=make_data(n=64))
    m.record_enabled = False
    if fail_replays:

        def on_step(module, batch_idx):
            if "log" in module.__dict__:  # a replay silences self.log by shadowing it on the instance
                raise RuntimeError("the replay fails")

        m.on_step = on_step
    return m


_ATOMS = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType, torch.dtype, torch.device)


def reachable(callback: LayerHealthCallback) -> list[str]:
    """The paths of every module or tensor reachable from the callback's attributes (containers, objects, closures).

    ``log``/``log_dict`` are Lightning's: it binds the LightningModule's methods onto every callback at each fit, and
    ``__getstate__`` leaves them out of a pickle.
    """
    found: list[str] = []
    seen: set[int] = set()

    def walk(obj, path: str) -> None:
        if isinstance(obj, _ATOMS) or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, (torch.Tensor, nn.Module)):
            found.append(f"{path}: {type(obj).__name__}")
        elif isinstance(obj, dict):
            for key, value in obj.items():
                walk(key, f"{path}[{key!r}]")
                walk(value, f"{path}[{key!r}]")
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            for i, value in enumerate(obj):
                walk(value, f"{path}[{i}]")
        elif isinstance(obj, types.MethodType):
            walk(obj.__self__, f"{path}.__self__")
        elif isinstance(obj, (types.FunctionType, functools.partial)):
            cells = obj.__closure__ or () if isinstance(obj, types.FunctionType) else (obj.func, obj.args)
            for i, cell in enumerate(cells):
                walk(cell.cell_contents if isinstance(cell, types.CellType) else cell, f"{path}<closure {i}>")
        else:
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    walk(getattr(obj, name), f"{path}.{name}")
            if hasattr(obj, "__dict__"):
                walk(vars(obj), path)

    for name, value in vars(callback).items():
        if name not in ("log", "log_dict"):
            walk(value, name)
    return found


def assert_released(callback: LayerHealthCallback, m: nn.Module) -> None:
    assert reachable(callback) == []
    assert held(callback) == []  # and a pickle writes none either
    pickle.loads(pickle.dumps(callback))
    assert count_hooks(m) == 0
    assert not torch.overrides._get_current_function_mode_stack()  # the attention probe's mode is gone too


def test_the_walk_finds_what_a_fit_holds():
    # Guards the tests below: in the middle of a sampled step, the walk finds the modules and tensors of the run.
    seen = []

    class Look(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(reachable(trainer.callbacks[0]))

    m = attention_module()
    callback = LayerHealthCallback(**FULL)
    make_trainer([callback, Look()], max_steps=1).fit(m)
    assert any(path.startswith("_run") and path.endswith(": Linear") for path in seen[0])
    assert any(path.startswith("_run") and path.endswith(": Tensor") for path in seen[0])
    assert_released(callback, m)


# Sampled steps 0, 2 (hooks, probes, saved-bytes tracker attached between batch start and end); step 1 unsampled;
# accumulation of 2 micro-batches, validation every 3 batches: in the middle of step 1's window.
STAGES = [
    ("setup", 0),
    ("on_fit_start", 0),
    ("on_train_batch_start", 2),
    ("on_before_backward", 2),
    ("on_after_backward", 2),
    ("on_before_optimizer_step", 2),
    ("on_train_batch_end", 2),
    ("on_train_batch_end", 1),
    ("on_validation_start", 1),
    ("on_validation_batch_end", 1),
]


@pytest.mark.parametrize(("hook", "step"), STAGES)
def test_after_an_exception_at_any_stage_with_every_opt_in_statistic_nothing_is_held(hook, step, tmp_path):
    m = attention_module()
    callback = LayerHealthCallback(**{**FULL, "every_n_steps": 1 if "validation" in hook else 2})
    logger = TensorBoardLogger(tmp_path)  # histograms are written
    with pytest.raises(RuntimeError, match=f"boom in {hook}"):
        make_trainer(
            [callback, Boom(hook, step)],
            max_steps=5,
            accumulate_grad_batches=2,
            val_check_interval=3,
            logger=logger,
        ).fit(m)
    assert_released(callback, m)


@pytest.mark.parametrize("fail", [False, True], ids=["replayed", "replay_failed"])
def test_after_an_exception_just_after_a_replay_nothing_is_held(monkeypatch, fail):
    m = attention_module(fail_replays=fail)
    callback = LayerHealthCallback(**{**FULL, "sentinel": force_trips({1}, mode="loss+grads")})
    with pytest.raises(RuntimeError, match="boom in on_before_optimizer_step"):
        make_trainer([callback, Boom("on_before_optimizer_step", 1)], max_steps=5).fit(m)
    ((trip_step, replayed),) = [(t.step, t.replayed) for t in callback.trips]
    assert (trip_step, replayed) == (1, not fail)  # guards the test: the replay ran (and failed, or not)
    assert_released(callback, m)


def test_after_on_anomaly_raise_on_a_replayed_step_nothing_is_held(monkeypatch):
    m = attention_module()
    callback = LayerHealthCallback(**{**FULL, "on_anomaly": "raise", "sentinel": force_trips({1}, mode="loss+grads")})
    with pytest.raises(LayerHealthError, match="loss_spike"):
        make_trainer([callback], max_steps=5).fit(m)
    assert callback.last_step == 1  # the replayed step was logged before the error
    assert_released(callback, m)


# ------------------------------------------------------------------------------------- the callback's own shape
# The top-level settings, and each group as its validated configuration object (rules= is rule_config, ...).
CONFIG = {
    "every_n_steps",
    "layers",
    "stats",
    "prefix",
    "on_anomaly",
    "measure_config",
    "sentinel_config",
    "rule_config",
    "output_config",
    "extensions",  # split into component factories and rules
}
RESULTS = {"last_metrics", "last_step", "layer_names", "execution_order", "findings", "last_findings", "trips"}


def public(callback: LayerHealthCallback) -> set[str]:
    """The attributes a user can read: the private ones are the callback's to change."""
    return {name for name in vars(callback) if not name.startswith("_")}


def test_the_callback_holds_its_configuration_its_results_and_one_run_slot():
    callback = LayerHealthCallback(rules={"trend_window": 7})
    assert public(callback) == CONFIG | RESULTS
    parameters = set(inspect.signature(LayerHealthCallback.__init__).parameters) - {"self"}
    # One attribute per argument (a group's is its configuration object); **deprecated holds none.
    groups = {"measure", "sentinel", "rules", "output"}
    assert (parameters - groups - {"deprecated"}) | {f"{g.removesuffix('s')}_config" for g in groups} == CONFIG
    # The rules' memory is empty before the first fit, and sized by the callback's rule settings.
    state = callback.state_dict()
    assert state["alerts"] == {"active": [], "counts": {rule.name: 0 for rule in BUILTIN_RULES}}
    assert state["last_finite"] == {}
    assert state["history"] == {"window": 28, "points": {}}  # 4 * trend_window: logit_drift looks back this far
    assert set(callback.alert_counts.values()) == {0}


FIT_PARTS_BUILT: list[int] = []  # a count only: a Setup holds the model, which the callback must not keep


def _count_parts_built(setup: Setup) -> None:
    """Counts the fits that built their parts; builds nothing. Module-level and marked without the decorator's
    syntax, so that pickle finds the function by its name (the callback must stay picklable)."""
    FIT_PARTS_BUILT.append(1)


count_parts_built = component(_count_parts_built)


def test_the_run_is_one_object_from_fit_start_to_the_end_of_fit():
    # A fit builds its parts once, at its start: a component factory passed in extensions= is called once per fit
    # (with that fit's Setup), never per step or per sampled step.
    setups = FIT_PARTS_BUILT
    setups.clear()
    extensions = [count_parts_built]
    callback, model = LayerHealthCallback(every_n_steps=2, output={"summary": False}, extensions=extensions), module()
    make_trainer([callback], max_steps=3).fit(model)
    assert len(setups) == 1
    assert public(callback) - {"log", "log_dict"} == CONFIG | RESULTS
    assert_released(callback, model)
    make_trainer([callback], max_steps=3).fit(module())
    assert len(setups) == 2  # the next fit: a run of its own
