"""ParameterTracker against a hand-written reference, on the one path every device takes."""

import math

import pytest
import torch
from helpers.reference import tracker_held
from torch import nn

from lightning_hookdiag import _params as P
from lightning_hookdiag._stats import CHUNK_ELEMENTS


def sq(t: torch.Tensor) -> float:
    return sum(v * v for v in t.double().reshape(-1).tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tracker_matches_reference_over_several_steps(dtype):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to(dtype)
    tracker = P.ParameterTracker(P.named_parameters_of({"a": net[0], "b": net[1]}))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(5, 3, dtype=dtype)).square().sum().backward()
        expected_before = [p.detach().clone() for p in tracker.params]
        index, values = tracker.before_step(opt.param_groups)
        opt.step()
        update_index, update_sq = tracker.after_step()
        assert index.tolist() == update_index.tolist()
        assert sorted(index.tolist()) == [0, 1, 2, 3]
        for row, i in enumerate(index.tolist()):
            p = tracker.params[i]
            weight, grad, _, seen = values[row].tolist()
            assert weight == pytest.approx(sq(expected_before[i]), rel=1e-6)
            assert grad == pytest.approx(sq(p.grad), rel=1e-6)
            assert seen == 1
            update = sq(p.detach().double() - expected_before[i].double())
            # The difference is taken in float64, not in the parameter's dtype (bf16 would round it to 8 bits).
            assert update_sq[row].item() == pytest.approx(update, rel=1e-12)
    tracker.release()
    assert tracker_held(tracker)[0] == 0


def test_parameters_of_mixed_dtypes_and_sizes_match_float64():
    # One fused reduction per dtype: float32, float64 and bfloat16 parameters interleaved, of magnitudes whose
    # float32 squares overflow or underflow; every value must still land on its own parameter.
    g = torch.Generator().manual_seed(3)
    shapes = [(64, 64), (65537,), (3,), (64, 64), (5,), (2, 3), (1,)]
    dtypes = [torch.float32, torch.float32, torch.float64, torch.float32, torch.bfloat16, torch.float32, torch.float32]
    scales = [1e22, 1.0, 1.0, 1e-30, 1.0, 1.0, 1e3]
    ps = [
        nn.Parameter((torch.randn(s, generator=g) * scale).to(dtype))
        for s, dtype, scale in zip(shapes, dtypes, scales, strict=True)
    ]
    tracker = P.ParameterTracker({f"p{i}": p for i, p in enumerate(ps)})
    opt = torch.optim.SGD(ps, lr=0.5)
    for step in range(2):
        for p in ps:
            grad = torch.randn(p.shape[::-1], generator=g) * (1e20 if step else 1e-20)
            p.grad = grad.to(p.dtype).t()  # 2-D: a non-contiguous gradient
        before = [p.detach().clone() for p in ps]
        index, values = tracker.before_step(opt.param_groups)
        opt.step()
        update_index, update_sq = tracker.after_step()
        assert index.tolist() == update_index.tolist()
        assert sorted(index.tolist()) == list(range(len(ps)))
        for row, i in enumerate(index.tolist()):
            weight, grad, _, seen = values[row].tolist()
            assert weight == pytest.approx(sq(before[i]), rel=1e-6)
            assert grad == pytest.approx(sq(ps[i].grad), rel=1e-6)
            assert update_sq[row].item() == pytest.approx(sq(ps[i].detach().double() - before[i].double()), rel=1e-6)


def test_parameter_stepped_by_two_optimizers_in_one_window_gets_two_copies():
    # Both optimizers step the same weight before the window ends. Each copy is measured against the weights at the
    # end of the window: the first copy must still hold the weights from before the first step, not be overwritten.
    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    tracker = P.ParameterTracker({"w": w})
    first, second = torch.optim.SGD([w], lr=0.5), torch.optim.SGD([w], lr=0.25)
    w.grad = torch.tensor([1.0, 1.0])
    tracker.before_step(first.param_groups)
    first.step()  # w = [0.5, 1.5]
    tracker.before_step(second.param_groups)
    second.step()  # w = [0.25, 1.25]
    _, update_sq = tracker.after_step()
    assert update_sq.tolist() == pytest.approx([2 * 0.75**2, 2 * 0.25**2])


@pytest.mark.parametrize("scale", [1.0, 1e22, 1e-30], ids=["unit", "huge", "tiny"])
def test_norms_are_finite_and_match_float64_for_any_magnitude(scale):
    # A gradient of 1e22 per element (diverging run) is finite; its float32 square is not. 1 M+ elements: the sums
    # must also be exact to 1e-6 on any CPU (a BLAS dot was 1e-4 off on an AMD EPYC).
    g = torch.Generator().manual_seed(1)
    w = nn.Parameter(torch.randn(1024, 1100, generator=g) * 0.02 + 0.5)
    w.grad = (torch.randn(1024, 1100, generator=g) + 3.0) * scale
    tracker = P.ParameterTracker({"w": w}, snapshot_elements=w.numel())  # kept whole: the update is exact
    opt = torch.optim.SGD([w], lr=0.5)
    before = w.detach().double().clone()
    _, values = tracker.before_step(opt.param_groups)
    with torch.no_grad():
        w.mul_(0.999)  # a bounded update whatever the gradient's scale
    _, update_sq = tracker.after_step()
    weight, grad, _, _ = values[0].tolist()
    assert weight == pytest.approx(before.square().sum().item(), rel=1e-6)
    assert math.isfinite(grad)
    assert grad == pytest.approx(w.grad.double().square().sum().item(), rel=1e-6)
    difference = w.detach().double() - before
    assert update_sq[0].item() == pytest.approx(difference.square().sum().item(), rel=1e-6)


def test_nonfinite_gradients_keep_a_nonfinite_norm():
    grads = [torch.tensor([1.0, float("inf")]), torch.tensor([float("nan"), 2.0]), torch.tensor([3.0, 4.0])]
    norms = P.squared_norms(grads).tolist()
    assert norms[0] == math.inf
    assert math.isnan(norms[1])
    assert norms[2] == pytest.approx(25.0, rel=1e-6)


def test_tensors_summed_together_match_float64_one_by_one():
    g = torch.Generator().manual_seed(5)
    tensors = [
        torch.randn(64, 64, generator=g) * 1e22,  # squares overflow float32
        torch.randn(100, generator=g) * 1e-30,  # squares underflow float32
        torch.randn(65536, generator=g) + 1e3,  # mean >> std
        torch.tensor([1.0, float("nan")]),  # non-finite: kept as NaN
        torch.zeros(0),
        torch.randn(7, generator=g, dtype=torch.float64),  # another dtype: its own fused reduction
        torch.randn(9, generator=g).to(torch.bfloat16),
        torch.randn(3, generator=g),
    ]
    squares = P.squared_norms(tensors).tolist()
    for t, got in zip(tensors, squares, strict=True):
        want = t.double().square().sum().item()
        if math.isnan(want):
            assert math.isnan(got)
        else:
            assert got == pytest.approx(want, rel=1e-6, abs=0.0)


def test_a_sparse_gradient_is_measured_like_its_dense_value():
    # nn.Embedding(sparse=True) hands SGD a sparse gradient, with repeated rows that add up.
    emb = nn.Embedding(10, 4, sparse=True)
    dense = nn.Linear(4, 1)
    tracker = P.ParameterTracker({"emb.weight": emb.weight, "lin.weight": dense.weight, "lin.bias": dense.bias})
    opt = torch.optim.SGD([*emb.parameters(), *dense.parameters()], lr=0.1)
    dense(emb(torch.tensor([1, 3, 3, 7]))).square().sum().backward()
    assert emb.weight.grad.is_sparse
    index, values = tracker.before_step(opt.param_groups)
    grads = {i: values[row, P.P_GRAD_SQ].item() for row, i in enumerate(index.tolist())}
    assert grads[0] == pytest.approx(sq(emb.weight.grad.to_dense()), rel=1e-6)
    assert grads[1] == pytest.approx(sq(dense.weight.grad), rel=1e-6)
    before = emb.weight.detach().clone()
    opt.step()
    update_index, update_sq = tracker.after_step()
    updates = dict(zip(update_index.tolist(), update_sq.tolist(), strict=True))
    assert updates[0] == pytest.approx(sq(emb.weight.detach() - before), rel=1e-6)


def test_a_parameter_whose_shape_changes_is_measured_in_its_new_shape():
    # `.data` replaced between sampled steps (a grown vocabulary): the same Parameter object, another shape.
    emb, bias = nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(3))
    tracker = P.ParameterTracker({"emb": emb, "bias": bias})
    opt = torch.optim.SGD([emb, bias], lr=0.1)
    for rows in (5, 7):
        if rows != emb.shape[0]:
            emb.data = torch.randn(rows, 3)
        emb.grad, bias.grad = torch.randn(rows, 3), torch.randn(3)
        before = emb.detach().clone()
        index, values = tracker.before_step(opt.param_groups)
        opt.step()
        _, update_sq = tracker.after_step()
        row = index.tolist().index(0)
        assert values[row, P.P_WEIGHT_SQ].item() == pytest.approx(sq(before), rel=1e-6)
        assert values[row, P.P_GRAD_SQ].item() == pytest.approx(sq(emb.grad), rel=1e-6)
        assert update_sq[row].item() == pytest.approx(sq(emb.detach() - before), rel=1e-6)


def test_index_cache_stays_small_when_the_stepped_set_changes():
    # A block skipped on some steps leaves its parameters without a gradient: the stepped set changes from step to
    # step; the cached device copies of the index must not grow with every set ever seen.
    g = torch.Generator().manual_seed(9)
    ps = [nn.Parameter(torch.randn(16, generator=g)) for _ in range(6)]
    tracker = P.ParameterTracker({f"p{i}": p for i, p in enumerate(ps)})
    opt = torch.optim.SGD(ps, lr=0.1)
    sets = set()
    for step in range(40):
        for i, p in enumerate(ps):
            p.grad = torch.randn(16, generator=g) if (i * 7 + step * 3) % 5 else None
        index, _ = tracker.before_step(opt.param_groups)
        sets.add(tuple(index.tolist()))
        opt.step()
        tracker.after_step()
        assert tracker_held(tracker)[1] <= 8
    assert len(sets) > 2


class _Launches(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (func.is_view or name in ("detach", "alias", "empty", "empty_strided", "empty_like", "lift_fresh")):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.float32, torch.bfloat16)])
def test_parameter_statistics_cost_a_constant_number_of_fused_ops(dtypes):
    # The launch budget (issue 21): the same ops for 3 parameters or 300, per dtype; none per parameter.
    def launches(n: int) -> list[str]:
        ps = [nn.Parameter(torch.randn(8, 4).to(dtypes[i % len(dtypes)])) for i in range(n)]
        for p in ps:
            p.grad = torch.randn_like(p)
        tracker = P.ParameterTracker({f"p{i}": p for i, p in enumerate(ps)})
        opt = torch.optim.SGD(ps, lr=0.1)
        tracker.before_step(opt.param_groups)  # warm: the index is copied to the device once
        tracker.after_step()
        with _Launches() as counter:
            tracker.before_step(opt.param_groups)
            tracker.after_step()
        return counter.ops

    few, many = launches(3 * len(dtypes)), launches(300 * len(dtypes))
    assert few == many, (few, many)
    assert few.count("_foreach_norm") == 2 * len(dtypes)  # before the step (weights and grads), after (updates)
    # On the CPU each _foreach_norm reads the pieces cast into one float64 buffer by a _foreach_copy_ (params._norms);
    # the update's reads their difference, taken in float64 after a second _foreach_copy_ (the weights after the step);
    # the snapshot is one more _foreach_copy_ per dtype, into the buffer kept across sampled steps.
    assert few.count("_foreach_copy_") == few.count("_foreach_norm") + 2 * len(dtypes)
    # Per dtype: the two norms and the update's _foreach_sub_ (one per dtype since the difference is taken in float64).
    assert len(few) - few.count("_foreach_copy_") <= 7 + 3 * len(dtypes), few


def test_a_plain_tensor_is_held_by_one_process():
    assert P.replicas(torch.zeros(3)) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(512, 1024), (2, 300_000)], ids=["rows", "long_rows"])
def test_update_of_a_large_strided_parameter_is_its_float64_difference(dtype, shape):
    # Kept whole (within SNAPSHOT_ELEMENTS) and cut into pieces of at most CHUNK_ELEMENTS along its rows (or parts of
    # a row longer than that); each piece's copy pairs with its view after the step, subtracted in float64.
    g = torch.Generator().manual_seed(7)
    w = nn.Parameter(torch.randn(shape[::-1], generator=g).to(dtype).t())  # a transposed weight
    assert not w.is_contiguous()
    assert CHUNK_ELEMENTS < w.numel() <= P.SNAPSHOT_ELEMENTS
    w.grad = torch.randn(shape, generator=g).to(dtype)
    tracker = P.ParameterTracker({"w": w})
    opt = torch.optim.SGD([w], lr=1e-3, weight_decay=0.1)
    before = w.detach().double().clone()
    tracker.before_step(opt.param_groups)
    opt.step()
    _, update_sq = tracker.after_step()
    expected = (w.detach().double() - before).square().sum().item()
    assert update_sq[0].item() == pytest.approx(expected, rel=1e-12)


def test_complex_parameters_are_measured_by_their_magnitudes():
    # A Fourier Neural Operator's spectral weights: the norm of the magnitudes, |z|**2 = re**2 + im**2.
    g = torch.Generator().manual_seed(2)
    w = nn.Parameter(torch.randn(4, 4, 3, dtype=torch.cfloat, generator=g))
    b = nn.Parameter(torch.randn(3, generator=g))
    w.grad, b.grad = torch.randn(4, 4, 3, dtype=torch.cfloat, generator=g), torch.randn(3, generator=g)
    tracker = P.ParameterTracker({"w": w, "b": b})
    opt = torch.optim.Adam([w, b], lr=0.1)
    before = w.detach().to(torch.complex128)
    index, values = tracker.before_step(opt.param_groups)
    opt.step()
    _, update_sq = tracker.after_step()
    row = index.tolist().index(0)
    weight, grad, _, _ = values[row].tolist()
    assert weight == pytest.approx(before.abs().square().sum().item(), rel=1e-12)
    assert grad == pytest.approx(w.grad.to(torch.complex128).abs().square().sum().item(), rel=1e-12)
    update = (w.detach().to(torch.complex128) - before).abs().square().sum().item()
    assert update_sq[row].item() == pytest.approx(update, rel=1e-12)


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("empty", "empty_strided", "empty_like", "clone", "mul", "_foreach_mul"):
            for t in out if isinstance(out, (tuple, list)) else [out]:
                self.sizes.append(t.numel())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_later_sampled_steps_reuse_the_snapshot_and_scratch(dtype):
    # Issue 39: the update snapshot and the float64 scratch are allocated (page-faulted) on the first sampled step
    # only; every later one writes into the same buffers, and its values still equal the float64 reference.
    g = torch.Generator().manual_seed(3)
    ps = [
        nn.Parameter(torch.randn(300, 200, generator=g).to(dtype)),
        nn.Parameter(torch.randn(7, generator=g).to(dtype)),
    ]
    tracker = P.ParameterTracker({"w": ps[0], "b": ps[1]})
    opt = torch.optim.Adam(ps, lr=0.05)
    for step in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        before = [p.detach().double().clone() for p in ps]
        with _Allocations() as allocations:
            index, values = tracker.before_step(opt.param_groups)
            opt.step()
            update_index, update_sq = tracker.after_step()
        big = [n for n in allocations.sizes if n >= 300 * 200]  # the snapshot (60_007 entries) or the scratch
        assert (big != []) == (step == 0), (step, allocations.sizes)
        assert tracker.after_step() is None  # measured
        expected = [((p.detach().double() - b) ** 2).sum().item() for p, b in zip(ps, before, strict=True)]
        got = dict(zip(update_index.tolist(), update_sq.tolist(), strict=True))
        for i, value in enumerate(expected):
            assert got[i] == pytest.approx(value, rel=1e-12)
        weights = dict(zip(index.tolist(), values[:, P.P_WEIGHT_SQ].tolist(), strict=True))
        for i, b in enumerate(before):
            assert weights[i] == pytest.approx((b**2).sum().item(), rel=1e-12)


def test_small_pieces_share_a_buffer_full_after_full_ones():
    # Issue 39: a 512 x 512 weight fills the CPU's float64 scratch (CHUNK_ELEMENTS) on its own; its bias used to take
    # a buffer-full of its own after it. Smallest first, the 8 biases and bias gradients share one: 4 + 4 + 1 norms.
    assert CHUNK_ELEMENTS == 512 * 512
    ps = [nn.Parameter(torch.randn(512, 512) if i % 2 == 0 else torch.randn(512)) for i in range(8)]
    for p in ps:
        p.grad = torch.randn_like(p)
    tracker = P.ParameterTracker({f"p{i}": p for i, p in enumerate(ps)}, snapshot=False)
    opt = torch.optim.SGD(ps, lr=0.1)
    tracker.before_step(opt.param_groups)
    with _Launches() as counter:
        index, values = tracker.before_step(opt.param_groups)
    assert counter.ops.count("_foreach_copy_") == counter.ops.count("_foreach_norm") == 9
    got = dict(zip(index.tolist(), values.tolist(), strict=True))
    for i, p in enumerate(ps):
        assert got[i][P.P_WEIGHT_SQ] == pytest.approx((p.detach().double() ** 2).sum().item(), rel=1e-12)
        assert got[i][P.P_GRAD_SQ] == pytest.approx((p.grad.double() ** 2).sum().item(), rel=1e-12)
