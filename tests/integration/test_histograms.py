"""Histograms: fixed-edge counts pooled exactly, written to TensorBoard and read back, skipped elsewhere."""

import logging

import pytest
import torch
from helpers import TinyModule, by_name, make_data, make_trainer
from helpers.reference import bin_counts, flat, histogram_counts, replay_sequential
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag import _stats as S


def test_histogram_counts_match_reference_and_pool_exactly():
    edges = S.histogram_edges(16)
    a, b = torch.randn(50) * 3, torch.tensor([0.0, 1e-7, -2e5, float("inf"), float("nan"), 1e-6])
    pooled = histogram_counts(a, edges) + histogram_counts(b, edges)
    expected = bin_counts(a.tolist() + b.tolist(), edges.tolist())
    assert pooled.tolist() == expected
    assert sum(expected) == 50 + 4


def test_tensorboard_histograms_read_back(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoardLogger(tmp_path, name="tb")
    csv_logger = CSVLogger(tmp_path, name="csv")
    module = TinyModule(data=make_data(n=64))
    callback = LayerHealthCallback(
        every_n_steps=2, measure={"histogram_every_n_steps": 4, "histogram_bins": 16}, output={"summary": False}
    )
    with caplog.at_level(logging.INFO):
        make_trainer([callback], max_steps=6, accumulate_grad_batches=2, logger=[tb, csv_logger]).fit(module)
    assert sum("CSVLogger cannot store histograms" in r.message for r in caplog.records) == 1

    accumulator = EventAccumulator(tb.log_dir, size_guidance={"histograms": 0})
    accumulator.Reload()
    tag = "layer_health.act_hist/1_model.1"  # the layer's depth in its key, as the scalars
    events = accumulator.Histograms(tag)
    assert [e.step for e in events] == [0, 4]  # histogram steps only, a subset of the sampled steps
    edges = S.histogram_edges(16).tolist()
    for event in events:
        outputs, grads, _, _ = replay_sequential(module, event.step, accumulate=2)
        assert list(event.histogram_value.bucket) == bin_counts(flat(outputs[1]), edges)
        grad_event = next(
            e for e in accumulator.Histograms("layer_health.act_grad_hist/1_model.1") if e.step == event.step
        )
        assert list(grad_event.histogram_value.bucket) == bin_counts(flat(grads[1]), edges)
    assert tag not in callback.last_metrics  # histograms are not scalars
    assert not [k for k in by_name(callback.last_metrics) if "_hist/" in k]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"every_n_steps": 5, "measure": {"histogram_every_n_steps": 7}},
            r"MeasureConfig\.histogram_every_n_steps: expected None or a positive multiple of every_n_steps=5, got 7",
        ),
        ({"measure": {"histogram_every_n_steps": 0}}, r"MeasureConfig\.histogram_every_n_steps: .*got 0"),
        ({"measure": {"histogram_bins": 7}}, r"MeasureConfig\.histogram_bins: expected an even integer >= 4, got 7"),
    ],
)
def test_histogram_configuration_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LayerHealthCallback(**kwargs)
