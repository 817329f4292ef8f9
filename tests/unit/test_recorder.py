"""StepRecorder: every output and gradient reduced into the recorder's own call table, then handed to the pooled state
as one step's rows, against a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.reference import activation_stats_float64, pending_rows, record, recorder_held, workspace_held

from lightning_hookdiag import _stats as S
from lightning_hookdiag._aggregation import LayerStatsAggregator
from lightning_hookdiag._recorder import StepRecorder


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


def recorded(outputs: dict[int, list[torch.Tensor]], unit_layers: frozenset[int] = frozenset()):
    agg = LayerStatsAggregator(n_layers=len(outputs), unit_layers=unit_layers)
    recorder = StepRecorder(len(outputs), unit_layers=unit_layers)
    for layer, calls in outputs.items():
        for output in calls:
            record(recorder, layer, output)
            recorder.on_grad(layer, output)
    assert pending_rows(recorder)[0] == sum(len(calls) for calls in outputs.values())  # one row per call
    agg.update(recorder.take())
    assert pending_rows(recorder) == (0, 0)  # handed over: the recorder starts the next step empty
    return agg.compute()


def test_call_rows_pool_to_the_float64_reference():
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


def test_dead_units_of_recorded_outputs():
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


def test_an_output_is_reduced_in_its_hook_so_a_later_in_place_op_does_not_change_what_was_seen():
    agg = LayerStatsAggregator(n_layers=1)
    recorder = StepRecorder(1)
    x = torch.tensor([[-1.0, 2.0], [3.0, -4.0]])
    record(recorder, 0, x)
    x.relu_()  # what nn.ReLU(inplace=True) after the module does
    agg.update(recorder.take())
    assert agg.compute()["act_mean"].item() == pytest.approx(0.0)


def test_reset_drops_the_rows_of_a_discarded_step():
    agg = LayerStatsAggregator(n_layers=1)
    recorder = StepRecorder(1)
    record(recorder, 0, torch.full((2,), 7.0))
    recorder.on_grad(0, torch.full((2,), 7.0))
    recorder.release()  # a discarded step
    agg.reset()
    assert pending_rows(recorder) == (0, 0)
    record(recorder, 0, torch.full((3,), 2.0))
    agg.update(recorder.take())
    out = agg.compute()
    assert out["act_mean"].item() == 2.0
    assert out["count"].item() == 3.0
    assert out["grad_count"].item() == 0.0


def test_many_calls_over_several_steps_reuse_the_call_table_and_copy_no_index_again():
    # 40 calls outgrow the first block of 16 rows (twice: blocks of 16, 16 and 32, none reallocated while its rows
    # are handed out), merged into one of 64 at the take; a second step with the same calls reuses it and the cached
    # device copies of its layer index and counts.
    g = torch.Generator().manual_seed(4)
    agg = LayerStatsAggregator(n_layers=40)
    recorder = StepRecorder(40)
    made = []

    class Made(torch.overrides.TorchFunctionMode):  # tables grown (rows of a call's width), host lists copied
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.tensor or (func is torch.empty and args[1:2] in ((S.ACT_ROW,), (S.GRAD_ROW,))):
                made[-1].append(func.__name__)
            return func(*args, **(kwargs or {}))

    for step in range(2):
        outputs = [torch.randn(8, 4, generator=g) * (i + 1) + step for i in range(40)]
        made.append([])
        with Made():
            for layer, output in enumerate(outputs):
                record(recorder, layer, output)
                recorder.on_grad(layer, output * 2)
            agg.update(recorder.take())
        out = agg.compute()
        agg.reset()
        recorder.release()
        for layer, output in enumerate(outputs):
            expected = reference([output])
            for stat, value in expected.items():
                assert out[stat][layer].item() == pytest.approx(value, rel=1e-6, abs=1e-12), (step, layer, stat)
            norm = (output.double() * 2).square().sum().sqrt().item()
            assert out["act_grad_norm"][layer].item() == pytest.approx(norm, rel=1e-6)
    assert sorted(made[0]) == ["empty"] * 8 + ["tensor"] * 4  # 16, 16, 32, then 64 rows, twice; index and counts
    assert made[1] == []  # the same calls again: nothing grown, nothing copied
    assert recorder_held(recorder) == (64, 1)


def test_varying_calls_keep_only_a_few_cached_patterns():
    # A sequence length that changes from step to step changes the counts: the cache must not grow without bound.
    agg = LayerStatsAggregator(n_layers=1)
    recorder = StepRecorder(1)
    for length in range(1, 30):
        output = torch.randn(2, length, 4)
        record(recorder, 0, output)
        agg.update(recorder.take())
        assert agg.compute()["count"].item() == output.numel()
        agg.reset()
        assert recorder_held(recorder)[1] <= 8
    recorder.release()
    assert not workspace_held(recorder.workspace)


def test_moments_off_still_counts_the_elements():
    agg = LayerStatsAggregator(n_layers=2, unit_layers={1})
    recorder = StepRecorder(2, moments=False, unit_layers=frozenset({1}))
    record(recorder, 0, torch.ones(3, 2))
    record(recorder, 1, torch.tensor([[-1.0, 2.0], [-3.0, 0.0]]))
    agg.update(recorder.take())
    out = agg.compute()
    assert out["count"].tolist() == [6.0, 4.0]
    assert out["act_dead_frac"][1].item() == 0.5
    assert agg.act_moments[:, 1:].abs().sum().item() == 0.0  # no moments were computed


# ------------------------------------------------------------------ issue 27 item 6: small tensors reduced in stacks
def _stacked_and_single(outputs: dict[int, list[torch.Tensor]], monkeypatch=None):
    results = []
    for stack_small in (True, False):
        agg = LayerStatsAggregator(n_layers=len(outputs))
        recorder = StepRecorder(len(outputs), stack_small=stack_small)
        for layer, calls in outputs.items():
            for output in calls:
                record(recorder, layer, output)
                recorder.on_grad(layer, output * 3)
        agg.update(recorder.take())  # reduces what is still stacked first
        results.append(agg.compute())
        recorder.release()
    return results


def test_stacked_small_outputs_and_gradients_match_the_reference_and_the_single_path():
    outputs = layer_outputs()
    outputs[6] = [torch.randn(16, 32, dtype=torch.bfloat16), torch.full((16, 32), -0.0, dtype=torch.bfloat16)]
    outputs[7] = [torch.randn(3, 4).t()]  # not contiguous
    stacked, single = _stacked_and_single(outputs)
    for layer, calls in outputs.items():
        expected = reference(calls)
        for stat, value in expected.items():
            assert stacked[stat][layer].item() == pytest.approx(value, rel=1e-6, abs=1e-12), (layer, stat)
            assert stacked[stat][layer].item() == pytest.approx(single[stat][layer].item(), rel=1e-12, abs=0), stat
        finite = torch.cat([(c * 3).double().reshape(-1) for c in calls])  # the gradients as recorded (bf16 too)
        finite = finite[torch.isfinite(finite)]
        norm = finite.square().sum().sqrt().item()
        assert stacked["act_grad_norm"][layer].item() == pytest.approx(norm, rel=1e-6)
        assert stacked["act_grad_nonfinite"][layer].item() == sum((~torch.isfinite(c)).sum().item() for c in calls)


def _stack_sizes(recorder: StepRecorder) -> list[int]:
    """The element capacity of each stack the recorder holds."""
    return [b.numel() for stacks in recorder._stacks.values() for b in stacks._buffers.values()]


def test_a_full_stack_is_reduced_at_once_and_the_copies_stay_bounded(monkeypatch):
    from lightning_hookdiag import _stats as S

    monkeypatch.setattr(S, "CHUNK_ELEMENTS", 64)  # a stack of 16-element outputs holds 4 of them
    outputs = {i: [torch.randn(4, 4) + i] for i in range(10)}
    agg = LayerStatsAggregator(n_layers=10)
    recorder = StepRecorder(10, stack_small=True)
    for layer, calls in outputs.items():
        record(recorder, layer, calls[0])
    assert pending_rows(recorder)[0] == 8  # two full stacks reduced, the last two outputs still held
    assert all(n <= 64 for n in _stack_sizes(recorder))
    agg.update(recorder.take())
    out = agg.compute()
    for layer, calls in outputs.items():
        assert out["act_mean"][layer].item() == pytest.approx(calls[0].double().mean().item(), rel=1e-9)


def test_an_output_changed_in_place_after_its_hook_is_measured_as_it_was():
    agg = LayerStatsAggregator(n_layers=1)
    recorder = StepRecorder(1, stack_small=True)
    x = torch.tensor([[-1.0, 2.0], [3.0, -4.0]])
    record(recorder, 0, x)
    torch.relu_(x)  # what ReLU(inplace=True) after the layer does
    agg.update(recorder.take())
    assert agg.compute()["act_mean"].item() == 0.0  # (-1 + 2 + 3 - 4) / 4, not the ReLU's 5 / 4


def test_release_drops_what_the_stacks_hold():
    recorder = StepRecorder(1, stack_small=True)
    record(recorder, 0, torch.ones(3))
    recorder.release()
    assert pending_rows(recorder) == (0, 0)
    assert _stack_sizes(recorder) == []
    assert recorder.take() is None  # nothing left to hand down
