"""torch.compile: compiled models are observed, names carry no _orig_mod, and compilations stay bounded."""

import pytest
import torch
from helpers import RecordingLogger, TinyModule, count_hooks, force_trips, make_data, make_trainer
from torch import nn
from torch._dynamo.utils import counters

from lightning_hookdiag import LayerHealthCallback


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def run(model: nn.Module, steps: int, every: int = 2) -> tuple[RecordingLogger, TinyModule]:
    logger = RecordingLogger()
    module = TinyModule(model=model, data=make_data(n=256), optimizer="adam", lr=0.01)
    module.record_enabled = False
    make_trainer([LayerHealthCallback(every_n_steps=every)], max_steps=steps, logger=logger).fit(module)
    return logger, module


def frames_compiled() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_compiled_model_matches_eager_and_names_have_no_orig_mod():
    eager_logger, _ = run(net(), steps=5)
    compiled_logger, module = run(torch.compile(net(), backend="eager"), steps=5)
    eager, compiled = dict(eager_logger.ours()), dict(compiled_logger.ours())
    assert sorted(compiled) == [0, 2, 4]
    for step in compiled:
        assert compiled[step].keys() == eager[step].keys()
        assert not any("_orig_mod" in k for k in compiled[step])
        for key, value in eager[step].items():
            assert compiled[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert count_hooks(module) == 0
    assert torch._dynamo.eval_frame._stance.stance == "default"


def test_compilations_stay_bounded_whatever_the_run_length():
    run(torch.compile(net(), backend="eager"), steps=4)
    short = frames_compiled()
    torch._dynamo.reset()
    counters.clear()
    run(torch.compile(net(), backend="eager"), steps=16)
    long = frames_compiled()
    assert short >= 1  # unsampled steps really run compiled code
    assert long == short  # sampled steps run eagerly: no recompile per sample, no growth with length


@pytest.mark.slow
def test_inductor_compiled_model_is_observed():
    logger, _ = run(torch.compile(net()), steps=3, every=1)
    calls = dict(logger.ours())
    assert sorted(calls) == [0, 1, 2]
    assert "layer_health/act_grad_norm/model.2" in calls[2]
    assert "layer_health/param_update_ratio/model.4.weight" in calls[2]


def test_compiled_model_gets_the_same_opt_in_statistics_as_eager():
    from lightning_hookdiag import OPT_IN_STATS

    def opt_in_run(model: nn.Module) -> dict:
        logger = RecordingLogger()
        module = TinyModule(model=model, data=make_data(n=256), optimizer="adam", lr=0.01)
        module.record_enabled = False
        callback = LayerHealthCallback(
            every_n_steps=2, stats=list(OPT_IN_STATS), measure={"precision_targets": "float8_e5m2"}
        )
        make_trainer([callback], max_steps=5, logger=logger).fit(module)
        assert count_hooks(module) == 0
        return dict(logger.ours())

    eager = opt_in_run(net())
    compiled = opt_in_run(torch.compile(net(), backend="eager"))
    assert sorted(compiled) == [0, 2, 4]
    for step in compiled:
        assert compiled[step].keys() == eager[step].keys()
        assert "layer_health/act_saved_bytes/model.1" in compiled[step]
        for key, value in eager[step].items():
            assert compiled[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_a_replay_of_a_compiled_model_observes_every_layer_like_eager(monkeypatch):
    def replayed(model: nn.Module) -> tuple[dict[str, float], TinyModule]:
        logger = RecordingLogger()
        module = TinyModule(model=model, data=make_data(n=256), optimizer="adam", lr=0.01)
        module.record_enabled = False
        callback = LayerHealthCallback(
            every_n_steps=100, on_anomaly="ignore", sentinel=force_trips({3}), output={"summary": False}
        )
        make_trainer([callback], max_steps=5, logger=logger).fit(module)
        assert [(t.step, t.replayed) for t in callback.trips] == [(3, True)]
        return dict(logger.ours())[3], module

    eager, _ = replayed(net())
    compiled, module = replayed(torch.compile(net(), backend="eager"))
    assert set(compiled) == set(eager)
    assert "layer_health/act_grad_norm/model.4" in compiled
    for key, value in eager.items():
        assert compiled[key] == pytest.approx(value, rel=1e-6), key
    assert count_hooks(module) == 0
