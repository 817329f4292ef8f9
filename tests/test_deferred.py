"""Small host tensors reduced in batches once per step: the same statistics as a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from reference import activation_stats_float64

from lightning_hookdiag import recorder as A
from lightning_hookdiag.aggregation import LayerStatsAggregator
from lightning_hookdiag.recorder import StepRecorder


def reference(outputs: list[torch.Tensor]) -> dict[str, float]:
    """Pooled statistics of one layer's outputs over several calls, by hand in float64."""
    return activation_stats_float64(torch.cat([o.reshape(-1) for o in outputs]))


def layer_outputs() -> dict[int, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    relu = torch.randn(16, 32, generator=g).relu()
    dropped = (torch.randn(16, 32, generator=g) * 3 + 1) * (torch.rand(16, 32, generator=g) > 0.5)  # -0.0 inside
    shifted = torch.randn(16, 32, generator=g) * 0.01 + 50.0  # the mean dominates: centred before squaring
    nan = torch.randn(16, 32, generator=g)
    nan[3, 4], nan[5, 6] = math.nan, math.inf
    other_shape = torch.randn(7, 5, generator=g)
    wide = torch.randn(16, 32, generator=g, dtype=torch.float64) * 1e3
    return {
        0: [relu, relu * 2],  # two calls of one layer pool into one row
        1: [dropped],
        2: [shifted],
        3: [nan],
        4: [other_shape],
        5: [wide],
    }


def recorded(outputs: dict[int, list[torch.Tensor]], unit_layers: frozenset[int] = frozenset(), deferred: bool = True):
    agg = LayerStatsAggregator(n_layers=len(outputs))
    recorder = StepRecorder(agg, unit_layers=unit_layers)
    for layer, calls in outputs.items():
        for output in calls:
            recorder.on_output(layer, output)
            recorder.on_grad(layer, output)
    assert bool(recorder._acts) == deferred  # really kept back (or reduced in the hook), as the test means
    agg.update()
    return agg.compute()


def test_batched_reduction_matches_float64_reference():
    outputs = layer_outputs()
    out = recorded(outputs)
    for layer, calls in outputs.items():
        expected = reference(calls)
        for stat, value in expected.items():
            assert out[stat][layer].item() == pytest.approx(value, rel=1e-6, abs=1e-12), (layer, stat)
        g = torch.cat([c.reshape(-1) for c in calls]).double()
        finite = g[torch.isfinite(g)]
        assert out["act_grad_norm"][layer].item() == pytest.approx(finite.square().sum().sqrt().item(), rel=1e-6)
        assert out["act_grad_nonfinite"][layer].item() == float((~torch.isfinite(g)).sum())
        assert out["count"][layer].item() == g.numel()


def test_batched_reduction_matches_the_per_call_path(monkeypatch):
    batched = recorded(layer_outputs(), unit_layers=frozenset({0, 1, 4}))
    monkeypatch.setattr(A, "SMALL_TENSOR", 0)  # every tensor reduced inside its hook, as before
    per_call = recorded(layer_outputs(), unit_layers=frozenset({0, 1, 4}), deferred=False)
    for stat in ("act_mean", "act_std", "act_absmax", "act_zero_frac", "act_nonfinite", "act_grad_norm"):
        torch.testing.assert_close(batched[stat], per_call[stat], rtol=1e-6, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(batched["act_dead_frac"], per_call["act_dead_frac"], equal_nan=True)


def test_dead_units_of_kept_back_outputs():
    x = torch.randn(8, 6)
    x[:, 2] = -1.0  # unit 2 never positive
    x[:, 5] = 0.0  # unit 5 never positive
    out = recorded({0: [x.relu()], 1: [torch.randn(8, 6)]}, unit_layers=frozenset({0}))
    assert out["act_dead_frac"][0].item() == pytest.approx(2 / 6)
    assert math.isnan(out["act_dead_frac"][1].item())


def test_a_unit_that_produced_a_nan_is_not_dead():
    x = torch.full((4, 3), -1.0)
    x[2, 1] = math.nan  # unit 1: NaN once, never positive otherwise
    out = recorded({0: [x], 1: [torch.ones(2)]}, unit_layers=frozenset({0}))
    assert out["act_dead_frac"][0].item() == pytest.approx(2 / 3)
    assert out["act_nonfinite"][0].item() == 1.0


def test_a_copy_is_kept_so_a_later_in_place_op_does_not_change_what_was_seen():
    agg = LayerStatsAggregator(n_layers=1)
    recorder = StepRecorder(agg)
    x = torch.tensor([[-1.0, 2.0], [3.0, -4.0]])
    recorder.on_output(0, x)
    x.relu_()  # what nn.ReLU(inplace=True) after the module does
    agg.update()
    assert agg.compute()["act_mean"].item() == pytest.approx(0.0)


def test_budget_reduces_early_and_reset_drops_what_was_kept(monkeypatch):
    monkeypatch.setattr(A, "_DEFERRED_BUDGET", 10)
    agg = LayerStatsAggregator(n_layers=1)
    recorder = StepRecorder(agg)
    recorder.on_output(0, torch.ones(4))
    assert recorder._acts  # 4 elements: under the budget
    recorder.on_output(0, torch.ones(8))
    assert not recorder._acts  # 12 elements: reduced in the hook
    recorder.on_output(0, torch.full((2,), 7.0))
    agg.reset()  # a discarded step
    assert not recorder._acts
    recorder.on_output(0, torch.full((3,), 2.0))
    agg.update()
    assert agg.compute()["act_mean"].item() == 2.0


def test_many_calls_of_one_shape_over_several_steps_reuse_the_kept_rows():
    # 40 calls of one shape outgrow the first 16 rows kept back (twice); a second step reuses the grown rows.
    g = torch.Generator().manual_seed(4)
    agg = LayerStatsAggregator(n_layers=40)
    recorder = StepRecorder(agg)
    buffers = []
    for step in range(2):
        outputs = [torch.randn(8, 4, generator=g) * (i + 1) + step for i in range(40)]
        for layer, output in enumerate(outputs):
            recorder.on_output(layer, output)
            recorder.on_grad(layer, output * 2)
        buffers.append([id(slab.buffer) for slab in recorder._slabs.values()])
        agg.update()
        out = agg.compute()
        agg.reset()
        for layer, output in enumerate(outputs):
            expected = reference([output])
            for stat, value in expected.items():
                assert out[stat][layer].item() == pytest.approx(value, rel=1e-6, abs=1e-12), (step, layer, stat)
            norm = (output.double() * 2).square().sum().sqrt().item()
            assert out["act_grad_norm"][layer].item() == pytest.approx(norm, rel=1e-6)
    assert len(buffers[0]) == 2  # one slab for outputs, one for gradients
    assert buffers[0] == buffers[1]
    assert all(slab.buffer.shape[0] == 64 for slab in recorder._slabs.values())


def test_rows_of_shapes_no_longer_seen_are_released():
    # A sequence length that changes from step to step must not leave rows behind for every length ever seen.
    agg = LayerStatsAggregator(n_layers=1)
    recorder = StepRecorder(agg)
    for length in (5, 6, 7, 7):
        output = torch.randn(2, length, 4)
        recorder.on_output(0, output)
        recorder.on_grad(0, output)
        agg.update()
        agg.reset()
        recorder.release(keep_host=True)  # what the callback does when a sampled step is logged
        assert {key[1] for key in recorder._slabs} == {torch.Size([2, length, 4])}
    outputs_key = (True, torch.Size([2, 7, 4]), torch.float32)
    kept = recorder._slabs[outputs_key].buffer
    recorder.on_output(0, torch.randn(2, 7, 4))
    assert recorder._slabs[outputs_key].buffer is kept  # a shape seen again: its rows are reused
    recorder.release()
    assert not recorder._slabs
