"""What the callback holds after a fit: no module, no tensor, no history of an earlier fit, on every exit path."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from conftest import TinyModule, count_hooks, make_data, make_trainer
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_hookdiag import ALL_STATS, OPT_IN_STATS, LayerHealthCallback

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
    callback = LayerHealthCallback(every_n_steps=2, stats=EVERY_STAT, summary=False, on_anomaly="ignore")
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
    callback = LayerHealthCallback(every_n_steps=2, stats=EVERY_STAT, summary=False, on_anomaly="ignore")
    # The failing callback comes after ours: ours has already done its part of the hook when it raises.
    with pytest.raises(RuntimeError, match=f"boom in {hook}"):
        make_trainer([callback, Boom(hook, step)], max_steps=5).fit(m)
    assert held(callback) == []
    assert count_hooks(m) == 0
    assert not torch.overrides._get_current_function_mode_stack()  # the attention probe's mode is gone too


def test_a_second_fit_starts_a_fresh_trend_history():
    callback = LayerHealthCallback(every_n_steps=2, summary=False, on_anomaly="ignore")
    make_trainer([callback], max_steps=20).fit(module())
    first = [s for s, _ in callback._history.points("param_norm", "model.0.weight")]
    assert first == list(range(0, 20, 2))
    make_trainer([callback], max_steps=10).fit(module())
    # Only the second fit's steps: an earlier fit's values are no trend of this one.
    assert [s for s, _ in callback._history.points("param_norm", "model.0.weight")] == list(range(0, 10, 2))
