"""The numeric contract at its edge: an accumulation that overflows is logged as it is, with a note; never a wrong
finite number. Within float32's range every statistic matches the float64 reference (test_stats.py)."""

import copy
import math
import re

import pytest
import torch
from helpers import RecordingLogger, TinyModule, make_data, make_trainer
from torch import nn

from lightning_hookdiag import LayerHealthCallback, LayerHealthWarning


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def test_a_float64_output_beyond_1e154_is_logged_non_finite_with_a_note():
    # Squares of 1e200 overflow float64: act_std cannot be represented. The output itself is finite, so
    # act_nonfinite is 0 and the note names the overflow; the loss stays finite (the layer after scales back).
    model = nn.Sequential(nn.Linear(4, 8), Scale(1e200), Scale(1e-200), nn.Linear(8, 1)).double()
    data = make_data()
    module = TinyModule(model=model, data=torch.utils.data.TensorDataset(*(t.double() for t in data.tensors)))
    first = copy.deepcopy(model[0])  # the weights the sampled step 0 ran with
    logger = RecordingLogger()
    callback = LayerHealthCallback(
        every_n_steps=1, layers=["model.1"], sentinel=None, output={"charts": "all"}
    )  # the 0 count
    trainer = make_trainer([callback], max_steps=1, logger=logger)
    with pytest.warns(LayerHealthWarning) as caught:
        trainer.fit(module)
    messages = [str(w.message) for w in caught]
    assert any(re.search(r"act_std of 'model\.1' is (inf|nan).*no NaN/Inf.*overflowed", m) for m in messages)
    ((_, metrics),) = logger.ours()
    assert metrics["layer_health/act_nonfinite/model.1"] == 0.0
    assert not math.isfinite(metrics["layer_health/act_std/model.1"])
    # The mean (a sum of values, not of squares) is finite and right: 1e200 times the first layer's mean output,
    # computed here by hand; the absolute maximum, held in float32, is inf, and has its note as well.
    x = module.data.tensors[0][:8]
    with torch.no_grad():
        expected = (first(x) * 1e200).mean().item()
    assert metrics["layer_health/act_mean/model.1"] == pytest.approx(expected, rel=1e-9)
    assert metrics["layer_health/act_absmax/model.1"] == math.inf
    assert any("act_absmax of 'model.1' is inf" in m for m in messages)


def test_float32_values_up_to_its_maximum_are_finite_and_silent(recwarn):
    model = nn.Sequential(nn.Linear(4, 8), Scale(1e36), Scale(1e-36), nn.Linear(8, 1))
    module = TinyModule(model=model, data=make_data())
    logger = RecordingLogger()
    trainer = make_trainer(
        [LayerHealthCallback(every_n_steps=1, layers=["model.1"], sentinel=None)], max_steps=1, logger=logger
    )
    trainer.fit(module)
    assert not [w for w in recwarn if "overflow" in str(w.message)]
    ((_, metrics),) = logger.ours()
    assert all(math.isfinite(v) for k, v in metrics.items() if "/model.1" in k)
