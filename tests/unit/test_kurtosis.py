"""Outlier statistics: pooled kurtosis and absmax/std against float64 references, in the aggregator."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from helpers import by_name
from helpers.reference import outlier_reference

from lightning_hookdiag import _kurtosis as O
from lightning_hookdiag._aggregation import LayerStatsAggregator
from lightning_hookdiag._recorder import StepRecorder
from lightning_hookdiag._vocabulary import ACTIVATION_STATS


def pooled(chunks: list[torch.Tensor]) -> dict[str, float]:
    """Pool ``chunks`` as micro-batch outputs of layer 0 through the recorder the callback uses."""
    agg = LayerStatsAggregator(1)
    outliers = O.Outliers(agg, kurtosis=True, absmax_over_std=True)
    recorder = StepRecorder(1, components=[outliers])
    outliers.attach()  # as in a sampled micro-batch: the recorder hands tensors to attached components
    for chunk in chunks:
        recorder.on_tensor(0, chunk)
    agg.update(recorder.take())
    out = agg.pooled()
    out.update(outliers.finalize(out))
    return {k: out[k].reshape(-1)[0].item() for k in ("act_kurtosis", "act_absmax_over_std")}


def student_t(shape: tuple[int, ...], df: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(shape, generator=g, dtype=torch.float64)
    chi2 = torch.distributions.Chi2(torch.tensor(df, dtype=torch.float64)).sample(shape)
    return (normal / (chi2 / df).sqrt()).float()


def test_kurtosis_of_heavy_tailed_micro_batches_matches_float64():
    torch.manual_seed(1)
    chunks = [student_t((64, 33), df=3.0, seed=s) * (1 + s) + s for s in range(3)]
    chunks[1][0, 0] = math.nan  # left out, like act_std does
    chunks[2][5, 1] = -math.inf
    expected = outlier_reference(chunks)
    assert expected["act_kurtosis"] > 6  # genuinely heavy-tailed
    got = pooled(chunks)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key


def test_planted_massive_activation_channel_is_seen():
    g = torch.Generator().manual_seed(0)
    healthy = torch.randn(8, 16, 64, generator=g)
    massive = healthy.clone()
    massive[:, :, 7] = 100.0 + torch.randn(8, 16, generator=g)  # one channel two orders above the rest
    calm, spiky = pooled([healthy[:4], healthy[4:]]), pooled([massive[:4], massive[4:]])
    assert calm["act_kurtosis"] == pytest.approx(outlier_reference([healthy])["act_kurtosis"], rel=1e-6)
    assert calm["act_kurtosis"] == pytest.approx(3.0, abs=0.2)  # normal data
    for key, value in outlier_reference([massive]).items():
        assert spiky[key] == pytest.approx(value, rel=1e-6), key
    assert spiky["act_kurtosis"] > 20 * calm["act_kurtosis"] / 3
    assert spiky["act_absmax_over_std"] > 7


@pytest.mark.parametrize("shift", [30.0, 100.0])
def test_large_mean_against_the_spread_does_not_cancel(shift):
    # |mean| / std = 52 and 173: raw power sums in float32 would lose every digit.
    g = torch.Generator().manual_seed(2)
    chunks = [torch.rand(4096, generator=g) * 2 - 1 + shift for _ in range(2)]
    expected = outlier_reference(chunks)["act_kurtosis"]
    assert expected == pytest.approx(1.8, rel=0.05)  # uniform
    assert pooled(chunks)["act_kurtosis"] == pytest.approx(expected, rel=1e-6)


def test_a_shift_near_the_mean_keeps_every_digit_where_sums_about_zero_cancel():
    # |mean| / std = 1e4 / 0.58: sums about zero keep ~1e-3 of the kurtosis; about a shift near the mean, all of it.
    g = torch.Generator().manual_seed(3)
    chunks = [(torch.rand(4096, generator=g, dtype=torch.float64) * 2 - 1 + 1e4).float() for _ in range(3)]
    expected = outlier_reference(chunks)["act_kurtosis"]
    about_zero = O.finalize_kurtosis(torch.stack([O.power_sums(c) for c in chunks]).sum(0, keepdim=True)).item()
    shift = torch.tensor(1e4 + 0.37, dtype=torch.float64)  # a previous step's mean: close, not equal
    about_shift = O.finalize_kurtosis(torch.stack([O.power_sums(c, shift=shift) for c in chunks]).sum(0, keepdim=True))
    assert about_shift.item() == pytest.approx(expected, rel=1e-6)
    assert about_zero != pytest.approx(expected, rel=1e-6)  # the guard: without the shift the test would fail


def test_the_callback_takes_the_shift_from_the_last_pooled_mean(tmp_path):
    from helpers import TinyModule, count_hooks, make_trainer
    from lightning.pytorch import Callback
    from torch import nn
    from torch.utils.data import TensorDataset

    from lightning_hookdiag import LayerHealthCallback

    class Offset(nn.Module):
        def forward(self, x):
            return x * 1e-3 + 1e4  # the mean dwarfs the spread

    g = torch.Generator().manual_seed(4)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    module = TinyModule(model=nn.Sequential(Offset(), nn.Linear(4, 1)), data=data, batch_size=32, lr=1e-12)
    module.record_enabled = False
    callback = LayerHealthCallback(every_n_steps=1, stats=["act_mean", "act_kurtosis"], layers=["model.0"])
    seen = {}

    class Watch(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen[callback.last_step] = by_name(callback.last_metrics)["layer_health/act_kurtosis/model.0"]

    make_trainer([callback, Watch()], max_steps=3).fit(module)
    # The same batch every step, and Offset has no weights: every step's reference is the same.
    expected = outlier_reference([data.tensors[0] * 1e-3 + 1e4])["act_kurtosis"]
    assert seen[1] == pytest.approx(expected, rel=1e-6)  # about step 0's pooled mean
    assert seen[2] == pytest.approx(expected, rel=1e-6)
    assert seen[0] != pytest.approx(expected, rel=1e-6)  # step 0: about zero (documented)
    # Released at teardown: no hook is left, and the per-fit state (closures over the model) no longer pickles along.
    assert count_hooks(module) == 0
    assert pickle.loads(pickle.dumps(callback)).last_step == 2


def test_power_sums_of_half_precision_equal_those_of_its_float32_copy():
    x = (torch.randn(1000) * 300).half()
    assert torch.equal(O.power_sums(x), O.power_sums(x.float()))
    assert O.power_sums(x).dtype == torch.float64


def test_constant_or_empty_output_has_undefined_kurtosis():
    sums = torch.stack([O.power_sums(torch.full((10,), 3.0)), torch.zeros(5, dtype=torch.float64)])
    assert torch.isnan(O.finalize_kurtosis(sums)).all()


def test_power_sums_pool_additively():
    a, b = torch.randn(100).double(), torch.randn(50).double() + 4
    torch.testing.assert_close(O.power_sums(a) + O.power_sums(b), O.power_sums(torch.cat([a, b])), rtol=1e-12, atol=0)


def test_default_recorder_path_registers_no_opt_in_state():
    agg = LayerStatsAggregator(2)
    assert not {"act_precision", "grad_precision", "act_power", "act_saved"} & set(agg.reduce_of)
    agg.update()
    out = agg.compute()
    assert set(out) >= set(ACTIVATION_STATS)
    assert not {"act_kurtosis", "act_absmax_over_std", "act_saved_bytes"} & set(out)


def test_power_sums_leave_their_input_untouched():
    x = torch.tensor([1.0, math.nan, -math.inf, 4.0], dtype=torch.float64)
    before = x.clone()
    O.power_sums(x)
    torch.testing.assert_close(x, before, equal_nan=True, rtol=0, atol=0)
