import collections

import pytest
import torch
from helpers.reference import record
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hookdiag import _stats as S
from lightning_hookdiag._aggregation import LayerStatsAggregator, host_values
from lightning_hookdiag._recorder import StepRecorder


def pool(agg: LayerStatsAggregator, rec: StepRecorder) -> dict[str, torch.Tensor]:
    """Hand the recorder's step to the aggregator and pool it, as the run does at the end of a window."""
    agg.update(rec.take())
    return agg.compute()


def test_micro_batches_pool_exactly_and_reset_clears():
    agg = LayerStatsAggregator(n_layers=2, unit_layers={1})
    rec = StepRecorder(2, unit_layers=frozenset({1}))
    a = torch.tensor([[1.0, -2.0], [0.0, 4.0]])
    b = torch.tensor([[3.0, -1.0], [-5.0, -1.0]])
    record(rec, 0, a)
    record(rec, 0, b)
    record(rec, 1, a)
    record(rec, 1, b)
    out = pool(agg, rec)
    union = torch.cat([a.reshape(-1), b.reshape(-1)]).double()
    assert out["act_mean"][0].item() == pytest.approx(union.mean().item())
    assert out["act_std"][0].item() == pytest.approx(union.std(correction=0).item())
    assert out["act_absmax"][0].item() == 5.0
    assert out["act_zero_frac"][0].item() == pytest.approx(1 / 8)
    # Unit 0 positive in a and b; unit 1 positive only in a: neither dead after pooling, though b alone has one.
    assert out["act_dead_frac"][1].item() == 0.0
    assert torch.isnan(out["act_dead_frac"][0])
    assert out["count"].tolist() == [8.0, 8.0]
    agg.reset()
    record(rec, 1, b)
    assert pool(agg, rec)["act_dead_frac"][1].item() == 0.5
    assert agg.compute()["count"].tolist() == [0.0, 4.0]


def test_unit_layout_is_layer_ordered_whatever_the_firing_order():
    agg = LayerStatsAggregator(n_layers=3, unit_layers={0, 2})
    rec = StepRecorder(3, moments=False, unit_layers=frozenset({0, 2}))
    record(rec, 2, torch.tensor([[1.0, -1.0, -1.0]]))  # layer 2 learned first
    record(rec, 0, torch.tensor([[-1.0, 1.0]]))
    out = pool(agg, rec)
    assert agg.unit_sizes == [2, 0, 3]
    assert out["act_dead_frac"][0].item() == 0.5
    assert out["act_dead_frac"][2].item() == pytest.approx(2 / 3)
    assert out["count"].tolist() == [2.0, 0.0, 3.0]  # counted even without moments
    agg.reset()
    assert agg.unit_max.shape == (5,)
    assert torch.isneginf(agg.unit_max).all()


def test_changed_unit_count_is_flagged_not_mixed():
    agg = LayerStatsAggregator(n_layers=1, unit_layers={0})
    rec = StepRecorder(1, unit_layers=frozenset({0}))
    record(rec, 0, torch.ones(2, 3))
    record(rec, 0, torch.ones(2, 4))
    out = pool(agg, rec)
    assert rec.unit_mismatch == {0}  # seen by the recorder, handed down with the rows
    assert agg.unit_mismatch == {0}
    assert torch.isnan(out["act_dead_frac"]).all()


def test_outputs_without_float_tensor_are_recorded():
    agg = LayerStatsAggregator(n_layers=1)
    rec = StepRecorder(1)
    record(rec, 0, (torch.tensor([1, 2]),))
    assert rec.no_float_output == {0}
    assert pool(agg, rec)["count"].reshape(-1).tolist() == [0.0]


def test_gradient_pooling_and_scale():
    agg = LayerStatsAggregator(n_layers=1)
    rec = StepRecorder(1)
    rec.on_grad(0, torch.tensor([6.0, 0.0]))
    rec.on_grad(0, torch.tensor([8.0, float("nan")]))
    agg.grad_scale = torch.tensor(2.0)
    out = pool(agg, rec)
    assert out["act_grad_norm"].item() == pytest.approx(5.0)
    assert out["act_grad_nonfinite"].item() == 1
    assert out["grad_count"].item() == 4


def test_parameter_rows_written_by_index():
    agg = LayerStatsAggregator(n_layers=0, n_params=3)
    values = torch.tensor([[9.0, 4.0, 0.0, 1.0]], dtype=torch.float64)
    agg.update(params=(torch.tensor([2]), values, slice(None)))
    agg.update(params=(torch.tensor([2]), torch.tensor([0.09], dtype=torch.float64), 2))
    out = agg.compute()
    assert out["param_norm"].tolist() == [0.0, 0.0, 3.0]
    assert out["param_grad_norm"][2].item() == 2.0
    assert out["param_update_ratio"][2].item() == pytest.approx(0.1)
    assert out["param_seen"].tolist() == [0.0, 0.0, 1.0]
    assert out["grad_norm_total"].item() == 2.0


def test_collective_state_count_does_not_depend_on_layers():
    small, big = LayerStatsAggregator(2, 3), LayerStatsAggregator(200, 300)
    assert small.reduce_of == big.reduce_of
    assert small.act_moments.shape[1] == S.ACT_SLOTS


def test_host_and_device_observations_of_one_layer_pool_together():
    # Micro-batch a is finite (host fast path), b holds a NaN (exact device path): the layer's statistics are those
    # of the union of their finite values, whichever path each took.
    agg = LayerStatsAggregator(n_layers=1)
    rec = StepRecorder(1)
    a = torch.tensor([1.0, -2.0, 0.0, 4.0])
    b = torch.tensor([3.0, float("nan"), -6.0])
    record(rec, 0, a)
    rec.on_grad(0, a)
    assert agg.act_moments.sum().item() == 0  # the recorder's until the step's rows are handed down
    record(rec, 0, b)
    rec.on_grad(0, b)
    out = pool(agg, rec)
    finite = torch.tensor([1.0, -2.0, 0.0, 4.0, 3.0, -6.0], dtype=torch.float64)
    assert out["act_mean"].item() == pytest.approx(finite.mean().item())
    assert out["act_std"].item() == pytest.approx(finite.std(correction=0).item())
    assert out["act_absmax"].item() == 6.0
    assert out["act_nonfinite"].item() == 1
    assert out["act_zero_frac"].item() == pytest.approx(1 / 7)
    assert out["act_grad_norm"].item() == pytest.approx(finite.norm().item())
    assert out["act_grad_nonfinite"].item() == 1
    assert out["count"].item() == 7
    # a discarded window: the recorder drops its rows
    record(rec, 0, a)
    rec.release()
    agg.reset()
    assert pool(agg, rec)["count"].item() == 0


def test_units_of_an_undeclared_layer_are_an_error():
    agg = LayerStatsAggregator(n_layers=2, unit_layers={1})
    rec = StepRecorder(2, unit_layers=frozenset({0}))  # disagrees with the aggregator
    record(rec, 0, torch.ones(2, 3))
    with pytest.raises(ValueError, match="unit_layers") as error:
        agg.update(rec.take())
    assert "layer 0" in str(error.value)  # the bad layer
    assert "[1]" in str(error.value)  # the declared ones
    for make in (
        lambda: LayerStatsAggregator(2, unit_layers=[0, 2, 5]),
        lambda: StepRecorder(2, unit_layers={0, 2, 5}),
    ):
        with pytest.raises(ValueError, match="unit_layers") as error:
            make()
        assert "[2, 5]" in str(error.value)  # the bad indices
        assert "[0, 2)" in str(error.value)  # the valid range


def test_units_wait_for_their_layout_then_keep_it_across_steps():
    agg = LayerStatsAggregator(n_layers=2, unit_layers={0, 1})
    rec = StepRecorder(2, moments=False, unit_layers=frozenset({0, 1}))
    record(rec, 1, torch.tensor([[-1.0, 2.0, -3.0]]))
    record(rec, 1, torch.tensor([[-1.0, -2.0, 3.0]]))
    agg.update(rec.take())
    assert agg.unit_sizes == [0, 0]  # pending until compute (or a sync) lays the layer out
    assert agg.compute()["act_dead_frac"][1].item() == pytest.approx(1 / 3)
    assert agg.unit_sizes == [0, 3]
    agg.reset()
    record(rec, 0, torch.tensor([[5.0, -5.0]]))  # a layer laid out later goes before it, in layer order
    record(rec, 1, torch.tensor([[1.0, 1.0, -1.0]]))
    out = pool(agg, rec)
    assert agg.unit_sizes == [2, 3]
    assert out["act_dead_frac"].tolist() == pytest.approx([0.5, 1 / 3])
    assert agg.unit_max.tolist() == [5.0, -5.0, 1.0, 1.0, -1.0]


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_the_step_path_pays_no_copy_of_its_results():
    agg = LayerStatsAggregator(n_layers=3, n_params=2, histogram_bins=8)
    rec = StepRecorder(3, histogram_bins=8)
    rec.histograms = True
    for layer in range(3):
        rec.on_tensor(layer, torch.randn(4, 5))
    agg.update(rec.take())
    with _Ops() as counted:
        pooled = agg.pooled()
    assert counted.ops["clone"] == 0
    computed = agg.compute()  # newer torchmetrics copy every result here (17 clones); 1.4, the floor, does not
    assert pooled.keys() == computed.keys()
    for name, value in pooled.items():
        assert torch.equal(value.reshape(-1).nan_to_num(-7.0), computed[name].reshape(-1).nan_to_num(-7.0)), name


def test_each_state_is_reduced_as_declared_and_nothing_else_is_accepted():
    agg = LayerStatsAggregator(n_layers=2, n_params=1)
    assert agg.reduce_of == {
        "param_stats": "max",  # replicated parameters: counted once
        "act_moments": "sum",
        "act_absmax": "max",
        "grad_moments": "sum",
        "unit_max": "max",
        "layer_orders": "max",  # agreed with the states: no collective of their own
    }
    assert LayerStatsAggregator(n_layers=2, unit_layers={0}).reduce_of["unit_bad"] == "max"
    assert LayerStatsAggregator(n_layers=1, n_params=1, sharded_params=True).reduce_of["param_stats"] == "sum"
    agg.add_state("extra", torch.zeros(2), "max")
    agg.pool("extra", torch.tensor([1.0, -1.0]))
    agg.pool("extra", torch.tensor([-2.0, 3.0]))
    assert agg.pooled()["extra"].tolist() == [1.0, 3.0]
    with pytest.raises(ValueError, match="mean_state") as error:
        agg.add_state("mean_state", torch.zeros(1), "mean")
    assert "'mean'" in str(error.value)  # the bad value
    assert "'sum' or 'max'" in str(error.value)  # the valid choices


def test_host_values_become_a_1d_tensor_of_the_dtype_on_the_device():
    out = host_values([1.5, 2.0, -3.0], torch.float64, torch.device("cpu"))
    assert out.dtype == torch.float64
    assert out.device.type == "cpu"
    assert out.tolist() == [1.5, 2.0, -3.0]
    assert host_values(iter([]), torch.float32, torch.device("cpu")).shape == (0,)


def test_orders_agreed_by_their_maxima_keep_a_one_rank_layer_where_it_ran_and_every_missed_gradient():
    from lightning_hookdiag._aggregation import LayerOrders, agreed_orders, order_positions

    # Layers 0 trunk, 1 head, 2 rare (selected after head); rare runs on rank 1 only, between trunk and head, and
    # misses its gradient there; head misses it on rank 0.
    rank0 = order_positions(LayerOrders([0, 1], [1, 0], [1]), 3)
    rank1 = order_positions(LayerOrders([0, 2, 1], [1, 0], [2]), 3)
    merged = agreed_orders([max(a, b) for a, b in zip(rank0, rank1, strict=True)], 3)
    assert merged == LayerOrders([0, 2, 1], [1, 0], [1, 2])
    # One process: its own orders back.
    assert agreed_orders(rank1, 3) == LayerOrders([0, 2, 1], [1, 0], [2])
    # A tie on the latest position goes to the earliest: layer 3 ran last on rank 1, head sat there on rank 0.
    rank0 = order_positions(LayerOrders([0, 2, 1], [], []), 4)
    rank1 = order_positions(LayerOrders([0, 1, 3], [], []), 4)
    assert agreed_orders([max(a, b) for a, b in zip(rank0, rank1, strict=True)], 4).forward == [0, 2, 1, 3]


def test_rows_built_by_hand_pool_to_their_statistics_over_two_steps_of_rows():
    # The pooled state receives finished per-layer tensors, whoever made them: here written by hand for layer 0's
    # outputs [1, -2, 0, 4] then [3] (two updates, as two processes' rows would add), gradient [3, 4], units [1, -1].
    from lightning_hookdiag._stats import LayerRows

    def rows(act: list[float], absmax: float, units: dict[int, torch.Tensor]) -> LayerRows:
        moments = torch.zeros(2, S.ACT_SLOTS, dtype=torch.float64)
        moments[0] = torch.tensor(act, dtype=torch.float64)
        grad = torch.zeros(2, S.GRAD_SLOTS, dtype=torch.float64)
        grad[0] = torch.tensor([2.0, 25.0, 0.0], dtype=torch.float64)
        return LayerRows(moments, torch.tensor([absmax, 0.0]), grad, units, frozenset())

    agg = LayerStatsAggregator(n_layers=2, unit_layers={0})
    agg.update(rows([4.0, 3.0, 3.0, 3.0, 21.0], 4.0, {0: torch.tensor([1.0, -1.0])}))
    agg.update(rows([1.0, 1.0, 1.0, 3.0, 9.0], 3.0, {}))
    out = agg.compute()
    values = torch.tensor([1.0, -2.0, 0.0, 4.0, 3.0], dtype=torch.float64)
    assert out["act_mean"][0].item() == pytest.approx(values.mean().item(), rel=1e-12)
    assert out["act_std"][0].item() == pytest.approx(values.std(correction=0).item(), rel=1e-12)
    assert out["act_absmax"][0].item() == 4.0
    assert out["act_zero_frac"][0].item() == pytest.approx(1 / 5)
    assert out["act_grad_norm"][0].item() == pytest.approx(50**0.5)  # two steps of rows: 25 + 25
    assert out["act_dead_frac"][0].item() == 0.5
    assert out["count"].tolist() == [5.0, 0.0]
