"""Bounded scratch memory: every reduction reads a tensor piece by piece, and the pieces pool exactly.

The pieces are :data:`~lightning_hookdiag._stats.CHUNK_ELEMENTS` (256 K) elements in production; these tests shrink
the limit so that small tensors are cut into many pieces, and compare with hand-written float64 references and with
the statistics of the tensor in one piece.
"""

import math

import pytest
import torch
from helpers.reference import activation_stats_float64, histogram_counts, pending_rows, tracker_held, workspace_held
from torch import nn

from lightning_hookdiag import _kurtosis as O
from lightning_hookdiag import _params as P
from lightning_hookdiag import _precision as PR
from lightning_hookdiag import _stats as S
from lightning_hookdiag._aggregation import LayerStatsAggregator
from lightning_hookdiag._recorder import StepRecorder


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(S, "CHUNK_ELEMENTS", 1000)
    return 1000


def _layouts() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    base = torch.randn(37, 3, 41, generator=g) * 2 + 0.5
    base[3, 1, 7] = float("nan")
    base[20, 0, 0] = float("-inf")
    base[5] = -0.0
    return {
        "contiguous": base,
        "transposed": base.transpose(0, 2),  # leading rows of 37 * 3 elements
        "strided rows": base.permute(1, 0, 2),  # a leading row (37 * 41) larger than a piece
        "sliced": base[:, :, ::2],
    }


@pytest.mark.parametrize("name", list(_layouts()))
def test_pieces_cover_every_element_once_as_views(name):
    x = _layouts()[name]
    pieces = list(S.chunks(x, limit=100))
    assert all(p.numel() <= 100 for p in pieces)
    assert sum(p.numel() for p in pieces) == x.numel()
    assert all(p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for p in pieces)  # no copy
    got = sorted(v for p in pieces for v in p.reshape(-1).tolist() if not math.isnan(v))
    expected = sorted(v for v in x.reshape(-1).tolist() if not math.isnan(v))
    assert got == expected


@pytest.mark.parametrize("name", list(_layouts()))
def test_recorded_statistics_of_many_pieces_match_the_float64_reference(name, small_pieces):
    x = _layouts()[name]
    agg = LayerStatsAggregator(n_layers=1)
    recorder = StepRecorder(1)
    recorder.on_tensor(0, x)
    recorder.on_grad(0, x)
    assert pending_rows(recorder)[0] == math.ceil(x.numel() / small_pieces) or name != "contiguous"
    agg.update(recorder.take())
    out = {k: v.reshape(-1)[0].item() for k, v in agg.compute().items() if v.numel() == 1}
    expected = activation_stats_float64(x)
    for key, value in expected.items():
        assert out[key] == pytest.approx(value, rel=1e-6), key
    finite = x[torch.isfinite(x)].double()
    assert out["act_grad_norm"] == pytest.approx(finite.square().sum().sqrt().item(), rel=1e-6)
    assert out["act_grad_nonfinite"] == (~torch.isfinite(x)).sum().item()
    assert out["count"] == x.numel()
    # The workspace never grew beyond one piece.
    assert max(n for (role, _), n in workspace_held(recorder.workspace).items() if role == "narrow") <= 1000


def test_a_piece_larger_than_the_limit_is_refused_with_the_way_out(small_pieces):
    with pytest.raises(ValueError, match=r"at most CHUNK_ELEMENTS=1000 elements, got 1001.*chunks\(x\)"):
        S.activation_row(torch.zeros(1001), torch.empty(S.ACT_ROW, dtype=torch.float64))


def test_opt_in_reductions_of_many_pieces_equal_those_of_one(small_pieces):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(50, 97, generator=g) * 3 + 1).t()  # not contiguous, 4850 elements: 5 pieces
    x[4, 4] = float("nan")
    whole = 10_000
    targets = [torch.float16, torch.float8_e4m3fn]
    pieces_counts = PR.precision_counts(x, targets)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S, "CHUNK_ELEMENTS", whole)
        assert torch.equal(pieces_counts, PR.precision_counts(x, targets))
        one_power = O.power_sums(x, shift=1.0)
        one_hist = histogram_counts(x, S.histogram_edges(8))
    torch.testing.assert_close(O.power_sums(x, shift=1.0), one_power, rtol=1e-12, atol=1e-9)
    assert torch.equal(histogram_counts(x, S.histogram_edges(8)), one_hist)
    # Against the reference: the kurtosis of the finite values.
    d = x[torch.isfinite(x)].double()
    m = d.mean()
    reference = ((d - m) ** 4).mean() / ((d - m) ** 2).mean() ** 2
    assert O.finalize_kurtosis(O.power_sums(x)[None]).item() == pytest.approx(reference.item(), rel=1e-9)


def test_parameter_norms_of_many_pieces_match_float64(small_pieces):
    g = torch.Generator().manual_seed(4)
    tensors = [
        torch.randn(3001, generator=g) * 1e22,  # 4 pieces; float32 squares would overflow
        torch.randn(7, generator=g),
        torch.randn(40, 60, generator=g).t(),  # not contiguous, 3 pieces
        torch.randn(1000, generator=g, dtype=torch.float64),
    ]
    got = P.squared_norms(tensors).tolist()
    for value, t in zip(got, tensors, strict=True):
        assert value == pytest.approx(sum(v * v for v in t.double().reshape(-1).tolist()), rel=1e-12)


def test_parameter_norms_never_cast_a_whole_parameter(small_pieces):
    # Every float64 buffer the norms allocate holds at most one piece.
    sizes = []

    class Allocations(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                    sizes.append(t.numel())
            return out

    big = torch.randn(10_000)
    with Allocations():
        P.squared_norms([big, torch.randn(5)])
    assert sizes
    assert max(sizes) <= 1000


def test_on_the_cpu_parameter_norms_read_pieces_already_cast_into_one_buffer(small_pieces):
    # The CPU's _foreach_norm casts each piece into a new buffer of its own, which glibc's malloc may never reuse
    # (+5 GB on a 329 M-parameter model in some processes; params._norms): the pieces reach it already in float64,
    # cast into one buffer of at most one piece, several small pieces at a time.
    norm_inputs, buffers = [], []

    class Watch(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket is torch.ops.aten._foreach_norm:
                norm_inputs.append([(t.dtype, t.numel()) for t in args[0]])
            elif func.overloadpacket is torch.ops.aten.empty:
                buffers.append((out.dtype, out.numel()))
            return out

    tensors = [torch.randn(2_500), torch.randn(5), torch.randn(3, 7)]
    with Watch():
        squares = P.squared_norms(tensors)
    assert buffers == [(torch.float64, 1000)]
    # Smallest pieces first (issue 39): the small ones share a buffer-full instead of each following a full piece.
    assert norm_inputs == [
        [(torch.float64, 5), (torch.float64, 21), (torch.float64, 500)],
        [(torch.float64, 1000)],
        [(torch.float64, 1000)],
    ]
    for value, t in zip(squares.tolist(), tensors, strict=True):
        assert value == pytest.approx(sum(v * v for v in t.double().reshape(-1).tolist()), rel=1e-12)


def test_update_samples_share_the_budget_smallest_first():
    assert P.update_samples([10, 20], budget=100) == [10, 20]
    assert P.update_samples([10, 5000, 100, 8000], budget=4000) == [10, 1945, 100, 1945]
    assert P.update_samples([10**8] * 4, budget=4000) == [1000] * 4  # the budget shared: never more
    # Many large parameters: the snapshot is kept between sampled steps, so the budget holds (a floor of 1024 entries
    # each used to keep 2 M entries here), down to one entry each when there are more parameters than entries.
    assert sum(P.update_samples([4096] * 2000, budget=1 << 20)) <= 1 << 20
    assert P.update_samples([50] * 8, budget=4) == [1] * 8
    assert sum(P.update_samples([10**6, 10**7, 5], budget=P.SNAPSHOT_ELEMENTS)) <= P.SNAPSHOT_ELEMENTS


def _adam_run(tracker_elements: int, dtype: torch.dtype = torch.float32, lr: float = 1e-3, magnitude: float = 0.0):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 64)).to(dtype)
    if magnitude:  # every weight +-magnitude: none close to 0, where an ulp is small enough for any update
        for p in net.parameters():
            p.data = torch.where(p.data >= 0, magnitude, -magnitude).to(dtype)
    tracker = P.ParameterTracker(P.named_parameters_of({"a": net[0], "b": net[2]}), snapshot_elements=tracker_elements)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.01)
    results = []
    for _ in range(4):
        opt.zero_grad()
        net(torch.randn(32, 256, dtype=dtype)).square().mean().backward()
        before = [p.detach().clone() for p in tracker.params]
        index, _ = tracker.before_step(opt.param_groups)
        opt.step()
        update_index, update_sq = tracker.after_step()
        exact = {
            i: (p.detach().double() - b.double()).square().sum().item()
            for i, (p, b) in enumerate(zip(tracker.params, before, strict=True))
        }
        results.append({i: (update_sq[row].item(), exact[i]) for row, i in enumerate(update_index.tolist())})
    return tracker, results


def test_sampled_update_norms_estimate_the_exact_ones():
    # 131 k + 33 k weights, a budget of 8 k entries: the weights are sampled (about 3.5 k entries each), the biases
    # kept whole. Measured against the exact update (weights copied in the test).
    tracker, results = _adam_run(8192)
    numels = [p.numel() for p in tracker.params]
    for step in results:
        for i, (estimate, exact) in step.items():
            if numels[i] <= 1024:
                assert estimate == pytest.approx(exact, rel=1e-6)  # kept whole: exact
            else:
                assert estimate == pytest.approx(exact, rel=0.1)  # ~3.5 k entries: within a few percent
    assert tracker_held(tracker)[0] == 0


def test_a_model_within_the_budget_is_measured_exactly():
    _, results = _adam_run(P.SNAPSHOT_ELEMENTS)
    for step in results:
        for estimate, exact in step.values():
            assert estimate == pytest.approx(exact, rel=1e-9)


def test_sampled_updates_rounded_away_in_bf16_read_zero():
    # bf16 weights of +-0.05 and an lr of 1e-8: every update is below half an ulp, so nothing moves; the sampled
    # estimate must say 0 as the exact one does (not_updated relies on it).
    _, results = _adam_run(4096, dtype=torch.bfloat16, lr=1e-8, magnitude=0.05)
    for step in results:
        for estimate, exact in step.values():
            assert exact == 0.0
            assert estimate == 0.0


def test_the_snapshot_is_bounded_whatever_the_model():
    tracker = P.ParameterTracker({f"w{i}": nn.Parameter(torch.randn(4096, 64)) for i in range(8)})
    for p in tracker.params:
        p.grad = torch.ones_like(p)
    tracker.before_step([{"params": tracker.params}])
    kept = tracker_held(tracker)[0]
    assert kept <= P.SNAPSHOT_ELEMENTS
    assert kept >= P.SNAPSHOT_ELEMENTS // 2
    tracker.release()


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_a_sampled_conv_weight_reads_every_kernel_tap(layout):
    # A [64, 64, 3, 3] weight whose centre taps alone move (a 3 x 3 conv at 1 x 1 resolution: the 8 others read the
    # zero padding), kept at about 1 entry in 9. A stride of 9 read one tap per step: 9x the update on every 9th
    # step, 0 on the others. Each step's estimate must follow the exact update.
    g = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(64, 64, 3, 3, generator=g))
    if layout == "transposed":  # not contiguous: sampled along its leading dimension
        w = nn.Parameter(torch.randn(64, 64, 3, 3, generator=g).transpose(0, 1))
    w.grad = torch.zeros_like(w)
    tracker = P.ParameterTracker({"w": w}, snapshot_elements=4096)  # 36_864 entries: a stride of at least 9
    centre = torch.zeros(3, 3)
    centre[1, 1] = 1.0
    for _ in range(9):  # the sample's start moves every step: every phase of a period of 9
        before = w.detach().double().clone()
        tracker.before_step([{"params": [w]}])
        with torch.no_grad():
            w.add_(centre * torch.randn(64, 64, 1, 1, generator=g))
        _, update_sq = tracker.after_step()
        exact = (w.detach().double() - before).square().sum().item()
        assert update_sq[0].item() == pytest.approx(exact, rel=0.25)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_a_sampled_parameter_keeps_as_many_entries_at_every_phase(layout):
    # The numel / kept scale is computed once per parameter set; the strided sample must hold that many entries
    # whatever the step's starting phase (10_007 entries, a share of 1_000: every 11th, 909 of them).
    t = torch.arange(10_007.0) if layout == "contiguous" else torch.arange(10_007.0 * 3).reshape(3, 10_007).t()
    lengths = {P._sample_view(t, 1_000, phase).numel() for phase in range(40)}
    assert len(lengths) == 1
    assert lengths.pop() <= 1_000
    view = P._sample_view(t, 1_000, 5)
    assert view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()  # a view, no copy
