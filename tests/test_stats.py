import math

import pytest
import torch
from reference import activation_stats

from lightning_hookdiag import stats as S


def finalize_one(*tensors: torch.Tensor) -> dict[str, float]:
    pooled = [S.activation_moments(t) for t in tensors]
    moments = torch.stack([m for m, _ in pooled]).sum(0, keepdim=True)
    absmax = torch.stack([a for _, a in pooled]).amax().reshape(1)
    return {k: v.item() for k, v in S.finalize_activations(moments, absmax).items()}


@pytest.mark.parametrize(
    "values",
    [
        [0.0, 1.0, -3.0, 2.5, 0.0],
        [float("nan"), 1.0, float("inf"), -2.0, 0.0, float("-inf")],
        [1e4 + 0.5, 1e4 - 0.5, 1e4 + 1.5, 1e4 - 1.5],  # large mean, small spread: cancellation trap
    ],
)
def test_activation_statistics_match_reference(values):
    expected = activation_stats(values)
    got = finalize_one(torch.tensor(values))
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_pooling_over_chunks_equals_statistics_of_the_union():
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randn(5, 7, generator=g) * s + m for s, m in ((1.0, 0.0), (10.0, 3.0), (0.1, -5.0))]
    chunks[1][0, 0] = float("nan")
    union = torch.cat([c.reshape(-1) for c in chunks]).tolist()
    expected = activation_stats(union)
    got = finalize_one(*chunks)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_do_not_overflow(dtype):
    # 60000^2 overflows float16 (max 65504) and loses bf16 precision badly: statistics must be taken in float32+.
    x = torch.tensor([60000.0, -60000.0, 30000.0, 0.0], dtype=dtype)
    expected = activation_stats([float(v) for v in x.float()])
    got = finalize_one(x)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key


def test_all_nonfinite_tensor_keeps_counts_readable():
    got = finalize_one(torch.tensor([float("nan"), float("inf")]))
    assert got["act_nonfinite"] == 2
    assert got["act_zero_frac"] == 0
    assert got["act_absmax"] == 0


def test_gradient_moments_reference():
    g = torch.tensor([[3.0, -4.0], [float("nan"), 12.0]])
    count, sumsq, nonfinite = S.gradient_moments(g).tolist()
    assert (count, nonfinite) == (4, 1)
    assert sumsq == pytest.approx(9 + 16 + 144)
    pooled = (S.gradient_moments(g) + S.gradient_moments(torch.tensor([5.0])))[None]
    out = S.finalize_gradients(pooled, scale=torch.tensor(4.0))
    assert out["act_grad_norm"].item() == pytest.approx(math.sqrt(9 + 16 + 144 + 25) / 4)
    assert out["act_grad_nonfinite"].item() == 1


def reference_unit_maxima(x: torch.Tensor, unit_dim: int) -> list[float]:
    units = x.shape[unit_dim]
    result = []
    for u in range(units):
        values = x.select(unit_dim, u).reshape(-1).tolist()
        result.append(max(values))
    return result


@pytest.mark.parametrize(
    ("shape", "unit_dim", "expected_dim"),
    [((6, 5), None, 1), ((2, 3, 5), None, 2), ((2, 4, 3, 3), None, 1), ((2, 4, 2, 3, 3), None, 1), ((2, 4, 5), 1, 1)],
)
def test_unit_maxima_axis(shape, unit_dim, expected_dim):
    x = torch.randn(*shape)
    got = S.unit_maxima(x, unit_dim)
    assert got.tolist() == pytest.approx(reference_unit_maxima(x, expected_dim))


def test_dead_fraction_reduces_over_batch_before_units():
    # Unit 0 is active only in sample 0, unit 1 only in sample 1, unit 2 never. Per-sample dead fractions average
    # to 2/3; the correct answer (dead for every sample) is 1/3.
    x = torch.tensor([[1.0, -1.0, 0.0], [-1.0, 2.0, -3.0]])
    maxima = S.unit_maxima(x)
    dead = S.finalize_dead_fraction(maxima, torch.zeros(3, dtype=torch.long), 1, torch.float64)
    assert dead.item() == pytest.approx(1 / 3)


def test_dead_fraction_nan_for_untracked_layers():
    dead = S.finalize_dead_fraction(torch.tensor([1.0]), torch.tensor([1]), 3, torch.float64)
    assert math.isnan(dead[0].item())
    assert dead[1].item() == 0
    assert math.isnan(dead[2].item())


def test_resolve_stats_orders_and_validates():
    assert S.resolve_stats(None) == S.ALL_STATS
    assert S.resolve_stats("act_std") == ("act_std",)
    with pytest.raises(ValueError, match=r"unknown statistic\(s\) \['act_sdt'\].*act_std"):
        S.resolve_stats(["act_sdt"])
    with pytest.raises(ValueError, match="at least one statistic"):
        S.resolve_stats([])


def test_accumulation_dtype():
    assert S.accumulation_dtype(torch.device("cpu")) == torch.float64
    assert S.accumulation_dtype(torch.device("mps")) == torch.float32


def test_units_with_nan_are_not_dead_after_pooling():
    # One NaN sample in unit 0 (other samples <= 0); unit 1 is <= 0 everywhere. Only unit 1 is dead.
    a = S.unit_maxima(torch.tensor([[float("nan"), -1.0], [-2.0, 0.0]]))
    b = S.unit_maxima(torch.tensor([[-1.0, -3.0]]))
    pooled = torch.fmax(torch.fmax(torch.full((2,), float("-inf")), a), b)
    dead = S.finalize_dead_fraction(pooled, torch.zeros(2, dtype=torch.long), 1, torch.float64)
    assert dead.item() == 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_workspace_gives_the_same_results_and_is_reused(dtype):
    ws = S.Workspace()
    big = torch.tensor([0.0, -0.0, 1.5, float("nan"), float("-inf"), -2.0, 3.0, 0.0], dtype=dtype)
    small = torch.tensor([-0.0, 4.0, float("inf")], dtype=dtype)
    for x in (big, small, big):  # a smaller tensor reuses the larger buffer; results must not leak between calls
        expected = activation_stats([float(v) for v in x.double()])
        moments, absmax = S.activation_moments(x, workspace=ws)
        got = {k: v.item() for k, v in S.finalize_activations(moments[None], absmax[None]).items()}
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-6), key
        assert S.gradient_moments(x, workspace=ws).tolist() == S.gradient_moments(x).tolist()
    assert x.isnan().any()  # the input itself is never modified
    buffers = list(ws._buffers.values())
    assert len(buffers) == 1
    assert buffers[0].numel() == 2 * big.numel()
    ws.release()
    assert not ws._buffers


def finalize_host(*tensors: torch.Tensor) -> dict[str, float]:
    found = [S.host_activation_moments(t) for t in tensors]
    assert all(f is not None for f in found)
    moments = torch.tensor([[sum(col) for col in zip(*(m for m, _ in found), strict=True)]], dtype=torch.float64)
    absmax = torch.tensor([max(a for _, a in found)])
    return {k: v.item() for k, v in S.finalize_activations(moments, absmax).items()}


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        ([0.0, 1.0, -3.0, 2.5, 0.0], torch.float32),
        ([0.0, 2.0, 0.5, 0.0, 7.25], torch.float32),  # no sign bit: absmax read from the bit pattern
        ([0.0, 2.0, 0.5, 0.0, 7.25], torch.float64),
        ([-0.0, 0.0, -0.0, 2.0, -1.0], torch.float32),  # negative zeros (dropout of negative inputs) are zeros
        ([-0.0, -0.0, 3.5], torch.float64),
        ([1e4 + 0.5, 1e4 - 0.5, 1e4 + 1.5, 1e4 - 1.5], torch.float32),  # cancellation trap: centred path
        ([60000.0, -60000.0, 30000.0, -0.0], torch.float16),  # the square would overflow float16
        ([60000.0, -60000.0, 30000.0, -0.0], torch.bfloat16),
    ],
)
def test_host_fast_path_matches_reference(values, dtype):
    x = torch.tensor(values, dtype=dtype)
    expected = activation_stats([float(v) for v in x.double()])
    got = finalize_host(x)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_host_fast_path_matches_float64_reference_on_large_tensors():
    g = torch.Generator().manual_seed(3)
    relu = torch.randn(1 << 20, generator=g).relu()
    # Dropout multiplies by a 0/1 mask: negative inputs become -0.0.
    dropped = (torch.randn(1 << 20, generator=g) * 3 + 1) * (torch.rand(1 << 20, generator=g) > 0.5)
    shifted = torch.randn(1 << 20, generator=g) * 0.01 + 50.0
    ws = S.Workspace()
    for x in (relu, dropped, shifted):
        d = x.double()
        expected = {
            "act_mean": d.mean().item(),
            "act_std": d.std(correction=0).item(),
            "act_absmax": d.abs().max().item(),
            "act_zero_frac": (d == 0).double().mean().item(),
            "act_nonfinite": 0.0,
        }
        # Sums of squares are float32 BLAS dots: over a million elements of similar size their rounding errors
        # add up to ~1e-5 relative (measured up to 1e-4 on 2 M saturated tanh outputs); counts are exact.
        for moments, absmax in (S.host_activation_moments(x, ws), S.activation_moments(x)):
            as_row = torch.as_tensor(moments, dtype=torch.float64).reshape(1, -1)
            stats = S.finalize_activations(as_row, torch.as_tensor(absmax).reshape(1))
            for key, value in expected.items():
                assert stats[key].item() == pytest.approx(value, rel=1e-4), key
            assert stats["act_zero_frac"].item() == expected["act_zero_frac"]
        count, square, nonfinite = S.host_gradient_moments(x, ws)
        assert (count, nonfinite) == (x.numel(), 0.0)
        assert square == pytest.approx(d.square().sum().item(), rel=1e-4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 3e38])
def test_host_fast_path_declines_nonfinite_and_overflow(bad):
    # A NaN/Inf (or finite values whose square overflows float32) must take the exact device path.
    x = torch.tensor([1.0, bad, -2.0])
    assert S.host_activation_moments(x) is None
    assert S.host_gradient_moments(x) is None
    assert S.host_activation_moments(torch.zeros(0)) is None
    assert S.host_gradient_moments(torch.tensor([3.0, -4.0])) == [2.0, 25.0, 0.0]


def test_workspace_keeps_only_host_buffers_between_sampled_steps():
    ws = S.Workspace()
    host, _ = ws.get(8, torch.float32, torch.device("cpu"))
    ws.get(8, torch.float32, torch.device("meta"))  # stands in for an accelerator
    ws.release(keep_host=True)
    assert [device.type for device, _ in ws._buffers] == ["cpu"]
    assert ws.get(8, torch.float32, torch.device("cpu"))[0].data_ptr() == host.data_ptr()
    ws.release()
    assert not ws._buffers
