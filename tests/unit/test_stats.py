import math

import pytest
import torch
from helpers import reference as R
from helpers.reference import activation_stats, activation_stats_float64

from lightning_hookdiag import _stats as S
from lightning_hookdiag._vocabulary import ALL_STATS


def finalize_one(*tensors: torch.Tensor) -> dict[str, float]:
    pooled = [R.activation_moments(t) for t in tensors]
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
    count, sumsq, nonfinite = R.gradient_moments(g).tolist()
    assert (count, nonfinite) == (4, 1)
    assert sumsq == pytest.approx(9 + 16 + 144)
    pooled = (R.gradient_moments(g) + R.gradient_moments(torch.tensor([5.0])))[None]
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
    assert S.resolve_stats(None) == ALL_STATS
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
        moments, absmax = R.activation_moments(x, workspace=ws)
        got = {k: v.item() for k, v in S.finalize_activations(moments[None], absmax[None]).items()}
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-6), key
        assert R.gradient_moments(x, workspace=ws).tolist() == R.gradient_moments(x).tolist()
    assert x.isnan().any()  # the input itself is never modified
    # One buffer each, reused.
    assert R.workspace_held(ws) == {("pair", torch.float64): 2 * big.numel(), ("narrow", dtype): big.numel()}
    ws.release()
    assert not R.workspace_held(ws)


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        ([0.0, 1.0, -3.0, 2.5, 0.0], torch.float32),
        ([0.0, 2.0, 0.5, 0.0, 7.25], torch.float64),
        ([-0.0, 0.0, -0.0, 2.0, -1.0], torch.float32),  # negative zeros (dropout of negative inputs) are zeros
        ([-0.0, -0.0, 3.5], torch.float64),
        ([-0.0, float("nan"), -0.0, float("-inf")], torch.float32),  # -0.0 next to non-finite values
        ([1e4 + 0.5, 1e4 - 0.5, 1e4 + 1.5, 1e4 - 1.5], torch.float32),  # cancellation trap
        ([60000.0, -60000.0, 30000.0, -0.0], torch.float16),  # the square would overflow float16
        ([60000.0, -60000.0, 30000.0, -0.0], torch.bfloat16),
        ([float("nan"), -0.0, 2.0], torch.bfloat16),
    ],
)
def test_every_input_family_matches_reference(values, dtype):
    x = torch.tensor(values, dtype=dtype)
    expected = activation_stats([float(v) for v in x.double()])
    got = finalize_one(x)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def _one_path(x: torch.Tensor, ws: S.Workspace) -> dict[str, float]:
    moments, absmax = R.activation_moments(x, workspace=ws)
    stats = S.finalize_activations(moments[None], absmax[None])
    return {k: v.item() for k, v in stats.items()}


def _large_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    n = 1 << 20
    return {
        "relu": torch.randn(n, generator=g).relu(),
        # Dropout multiplies by a 0/1 mask: negative inputs become -0.0.
        "dropout": (torch.randn(n, generator=g) * 3 + 1) * (torch.rand(n, generator=g) > 0.5),
        "mean_50_std_0.01": torch.randn(n, generator=g) * 0.01 + 50.0,
        "mean_1e4_std_1": torch.randn(n + 77, generator=g) + 1e4,  # not a multiple of the 128-element rows
        "saturated_tanh": torch.tanh(torch.randn(2 * n, generator=g) * 20),
        "near_constant": torch.full((n,), 0.1) + torch.rand(n, generator=g) * 1e-3,
        "centred": torch.randn(n, generator=g),
    }


@pytest.mark.parametrize("name", list(_large_tensors()))
def test_statistics_match_float64_to_1e6_on_large_tensors(name):
    # 1 M+ elements, on any CPU: the square sums must not depend on the BLAS kernel (a float32 ``dot`` was 1.7e-4
    # off on the ReLU tensor on an AMD EPYC) or cancel when the mean is much larger than the spread.
    x = _large_tensors()[name]
    expected = activation_stats_float64(x)
    ws = S.Workspace()
    stats = _one_path(x, ws)
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, rel=1e-6, abs=1e-300), key
    assert stats["act_zero_frac"] == expected["act_zero_frac"]
    d = x.double()
    count, square, nonfinite = R.gradient_moments(x, workspace=ws).tolist()
    assert (count, nonfinite) == (x.numel(), 0.0)
    assert square == pytest.approx(d.square().sum().item(), rel=1e-6)
    assert R.gradient_moments(x)[1].item() == pytest.approx(d.square().sum().item(), rel=1e-6)
    assert R.square_sum(x).item() == pytest.approx(d.square().sum().item(), rel=1e-6)


@pytest.mark.parametrize("scale", [1e20, 1e30, 1e-25, 1e-40])
@pytest.mark.parametrize("nan", [False, True], ids=["finite", "with_nan"])
def test_statistics_stay_finite_and_exact_for_extreme_magnitudes(scale, nan):
    # Squares of |x| > 1.8e19 overflow float32 and squares of |x| < 1e-19 underflow it; the statistics of finite
    # values must stay finite and exact anyway (1e-30 * randn also reaches subnormals), also next to a NaN.
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(300_000, generator=g) + 0.3) * scale
    if nan:
        x[17] = float("nan")
    expected = activation_stats_float64(x)
    stats = _one_path(x, S.Workspace())
    assert all(math.isfinite(v) for v in stats.values()), stats
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, rel=1e-6), key
    finite = x[torch.isfinite(x)].double()
    expected_sq = finite.square().sum().item()
    count, square, nonfinite = R.gradient_moments(x).tolist()
    assert (count, nonfinite) == (x.numel(), float(nan))
    assert square == pytest.approx(expected_sq, rel=1e-6)


def test_float32_maximum_and_float64_inputs_stay_finite():
    top = torch.finfo(torch.float32).max
    x = torch.tensor([top, -top, top / 2, 0.0])
    d = x.double()
    stats = _one_path(x, S.Workspace())
    assert stats["act_std"] == pytest.approx(d.std(correction=0).item(), rel=1e-6)
    assert stats["act_mean"] == pytest.approx(d.mean().item(), rel=1e-6)
    assert R.gradient_moments(x)[1].item() == pytest.approx(d.square().sum().item(), rel=1e-6)
    # float64 inputs: the pooled square term is float64 itself, so finite up to |x| ~ 1e154.
    big = torch.tensor([1e150, -3e150, 2e150], dtype=torch.float64)
    stats = _one_path(big, S.Workspace())
    assert stats["act_absmax"] == 3e150
    assert stats["act_std"] == pytest.approx(big.std(correction=0).item(), rel=1e-6)
    assert R.square_sum(big).item() == pytest.approx(14e300, rel=1e-6)
    assert R.square_sum(torch.zeros(5)).item() == 0.0
    assert R.gradient_moments(torch.zeros(5)).tolist() == [5.0, 0.0, 0.0]
    assert R.gradient_moments(torch.zeros(0)).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_values_are_counted_and_left_out_of_every_other_statistic(bad):
    x = torch.tensor([1.0, bad, -2.0, 0.0])
    got = finalize_one(x)
    expected = {"act_mean": -1 / 3, "act_std": math.sqrt(14 / 9), "act_absmax": 2.0, "act_zero_frac": 0.25}
    assert got == pytest.approx({**expected, "act_nonfinite": 1.0})
    assert R.gradient_moments(x).tolist() == [4.0, 5.0, 1.0]
    assert R.gradient_moments(torch.tensor([3.0, -4.0])).tolist() == [2.0, 25.0, 0.0]


class _LaunchCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts dispatched aten ops that are not views, detaches or allocations (a kernel launch each on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (func.is_view or name in ("detach", "alias", "empty", "empty_strided", "empty_like")):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_one_output_costs_at_most_ten_launches_and_one_gradient_eight(dtype):
    # The launch budget of the one path: an output's moments in 10 ops, a gradient's in 8, whatever the dtype, the size
    # or the memory layout; a warm workspace allocates nothing. (Issue 21 counted 9 and 6 with count_nonzero, one op
    # here but two kernels on a GPU: a comparison, then a sum; now both are ops of their own, one pass fewer.)
    ws = S.Workspace()
    x = torch.randn(64, 32, dtype=dtype).t()  # not contiguous
    act_row, grad_row = torch.empty(S.ACT_ROW, dtype=torch.float64), torch.empty(S.GRAD_ROW, dtype=torch.float64)
    S.activation_row(x, act_row, ws)  # warm
    with _LaunchCounter() as counter:
        S.activation_row(x, act_row, ws)
    assert len(counter.ops) <= 10, counter.ops
    with _LaunchCounter() as counter:
        S.gradient_row(x, grad_row, ws)
    assert len(counter.ops) <= 8, counter.ops
    with _LaunchCounter() as counter:
        S.unit_maxima(x)
    assert len(counter.ops) <= 2, counter.ops
    d = x.double()
    nonzero = d.count_nonzero().item()
    expected = [nonzero, nonzero, d.sum().item(), d.square().sum().item(), d.min().item(), d.max().item()]
    assert act_row.tolist() == pytest.approx(expected)


def test_workspace_views_are_reused_and_release_drops_every_buffer():
    ws = S.Workspace()
    cpu = torch.device("cpu")
    finite, pair = ws.get(8, torch.float64, torch.float64, cpu)
    assert pair.is_contiguous()
    assert pair.shape == (2, 8)
    # Same dtype, other role: the narrow copy never shares memory with the float64 pair.
    starts = sorted([(finite.data_ptr(), 8 * 8), (pair.data_ptr(), 2 * 8 * 8)])
    assert starts[0][0] + starts[0][1] <= starts[1][0]
    smaller = ws.get(4, torch.float64, torch.float64, cpu)
    assert (smaller[0].data_ptr(), smaller[1].data_ptr()) == (finite.data_ptr(), pair.data_ptr())  # reused
    assert ws.get(8, torch.float64, torch.float64, cpu)[1] is pair  # the views of a size are kept
    bigger = ws.get(16, torch.float64, torch.float64, cpu)  # grows: new memory, no stale views
    assert bigger[1].shape == (2, 16)
    assert ws.get(4, torch.float64, torch.float64, cpu)[1].shape == (2, 4)
    narrow, wide = ws.get(8, torch.float32, torch.float64, cpu)  # a float32 tensor's scratch
    assert narrow.dtype == torch.float32
    assert (wide.dtype, wide.shape) == (torch.float64, (2, 8))
    ws.release()
    assert not R.workspace_held(ws)


def _reference_rows(values: list[float]) -> tuple[list[float], list[float]]:
    # By hand, in Python floats (float64): both rows count -0.0 as zero and NaN/Inf as non-zero (the gradient row's
    # two counts only serve their difference, the non-finite count).
    finite = [v for v in values if math.isfinite(v)]
    act = [
        sum(1 for v in values if v != 0),
        sum(1 for v in finite if v != 0),
        math.fsum(finite),
        math.fsum(v * v for v in finite),
        min(finite, default=0.0),
        max(finite, default=0.0),
    ]
    return act, [act[0], act[1], math.fsum(v * v for v in finite)]


@pytest.mark.parametrize(
    ("dtype", "values"),
    [
        (torch.float8_e4m3fn, [-0.0, 0.0, 2.0, -1.5, 448.0, float("nan")]),  # e4m3fn has NaN but no Inf
        (torch.float8_e5m2, [-0.0, 0.0, 2.0, -1.5, 57344.0, float("nan"), float("inf")]),
    ],
    ids=["e4m3fn", "e5m2"],
)
def test_float8_outputs_are_widened_exactly_and_counted_like_any_float(dtype, values):
    # float8 has no integer view of its width among the bit-pattern counts: it is widened to float32, which
    # represents every float8 value (and its sign of zero) exactly.
    x = torch.tensor(values, dtype=torch.float32).to(dtype)
    act_expected, grad_expected = _reference_rows([float(v) for v in x.double()])
    ws = S.Workspace()
    act = S.activation_row(x, torch.empty(S.ACT_ROW, dtype=torch.float64), ws).tolist()
    grad = S.gradient_row(x, torch.empty(S.GRAD_ROW, dtype=torch.float64), ws).tolist()
    assert act == act_expected
    assert grad == grad_expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "values",
    [
        [-0.0, 0.0, -0.0, 2.0, -1.0],
        [-0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, 3.0],
        [float("nan"), float("inf")],  # nothing finite: the extrema read 0
        [1e-45, -1e-45, 1e-40, -0.0, 0.0],  # float32 subnormals are non-zero, squares normal in float64
        [3e30, -1e30, 2.5e30, -0.0, float("nan")],  # squares beyond float32's range
    ],
    ids=["negative_zeros", "nonfinite_and_negative_zeros", "all_nonfinite", "subnormals", "1e30"],
)
def test_rows_match_a_hand_reference_on_every_edge_of_the_narrow_passes(values, dtype):
    # The counts, NaN/Inf removal and extrema run in the input's dtype, the sums on a float64 copy: each edge case
    # against values worked out in Python floats from the tensor's own (rounded) elements.
    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    x = torch.stack([x, x]).t()[:, 0]  # not contiguous
    act_expected, grad_expected = _reference_rows([float(v) for v in x.double()])
    before = x.clone()
    ws = S.Workspace()
    act = S.activation_row(x, torch.empty(S.ACT_ROW, dtype=torch.float64), ws).tolist()
    grad = S.gradient_row(x, torch.empty(S.GRAD_ROW, dtype=torch.float64), ws).tolist()
    assert act[:2] == act_expected[:2]
    assert grad[:2] == grad_expected[:2]
    assert act[2:] == pytest.approx(act_expected[2:], rel=1e-12, abs=0.0)
    assert grad[2] == pytest.approx(grad_expected[2], rel=1e-12, abs=0.0)
    nonfinite = sum(1 for v in x.double().tolist() if not math.isfinite(v))
    assert R.gradient_moments(x, workspace=ws).tolist()[2] == nonfinite
    assert torch.equal(x.double().nan_to_num(7.0), before.double().nan_to_num(7.0))  # the input is not modified
    assert torch.equal(x.signbit(), before.signbit())
