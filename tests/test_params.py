"""ParameterTracker against a hand-written reference, on both the host path and the accelerator path."""

import math

import pytest
import torch
from torch import nn

from lightning_hookdiag import params as P
from lightning_hookdiag import stats as S


def sq(t: torch.Tensor) -> float:
    return sum(v * v for v in t.double().reshape(-1).tolist())


@pytest.fixture(params=["host", "accelerator"])
def path(request, monkeypatch):
    if request.param == "accelerator":  # what a GPU takes: fused norms, a fresh copy per sampled step
        monkeypatch.setattr(S, "reads_on_host", lambda t: False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tracker_matches_reference_over_several_steps(path, dtype):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to(dtype)
    tracker = P.ParameterTracker(P.named_parameters_of({"a": net[0], "b": net[1]}))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    buffers = None
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
            # The difference is taken in the parameter's dtype: bf16 rounds it to 8 significant bits.
            assert update_sq[row].item() == pytest.approx(update, rel=1e-6 if dtype == torch.float32 else 2e-2)
        if path == "host":  # the copies are reused, not reallocated, from one sampled step to the next
            packs = [layout.pack.flat for layout in tracker._layouts.values() if layout.pack is not None]
            current = [id(b) for b in [*tracker._host_buffers.values(), *packs]]
            assert current
            assert buffers is None or current == buffers
            buffers = current
    tracker.release()
    assert not tracker._host_buffers
    assert not tracker._layouts


def test_packed_and_single_parameters_mixed_match_float64(path):
    # Small float32 host parameters are packed together, sorted by size; large, float64 and bfloat16 ones are
    # measured one by one. Interleaved, every value must still land on its own parameter.
    g = torch.Generator().manual_seed(3)
    shapes = [(64, 64), (P._PACKED + 1,), (3,), (64, 64), (5,), (2, 3), (1,)]
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
    if path == "host":
        layout = next(iter(tracker._layouts.values()))
        assert len(layout.packed) == 4  # the two 64 x 64, (2, 3) and (1,) float32 ones


def test_host_pack_keeps_nonfinite_sums_and_sums_each_tensor_alone():
    pack = P.HostPack([torch.Size([2]), torch.Size([2]), torch.Size([3]), torch.Size([2])])
    tensors = [
        torch.tensor([1.0, float("inf")]),
        torch.tensor([float("nan"), 2.0]),
        torch.tensor([3.0, 4.0, 12.0]),
        torch.tensor([-3e38, 3e38]),  # the float32 maximum: its square is exact in float64
    ]
    squares = pack.load(tensors).squares().tolist()
    assert squares[0] == math.inf
    assert math.isnan(squares[1])
    assert squares[2] == 169.0
    assert squares[3] == pytest.approx(2 * float(torch.tensor(3e38).double()) ** 2, rel=1e-12)
    assert pack.subtract(tensors).squares().tolist()[2:] == [0.0, 0.0]


def test_host_pack_sums_in_chunks_of_its_scratch_size(monkeypatch):
    # Scratch of 8 elements: five tensors of 3 go in chunks of two, one of 20 alone (a chunk larger than _WIDE).
    monkeypatch.setattr(P, "_WIDE", 8)
    g = torch.Generator().manual_seed(7)
    tensors = [torch.randn(3, generator=g) * 10.0**e for e in (-30, 0, 30, 5, -5)] + [torch.randn(4, 5, generator=g)]
    tensors.insert(2, torch.randn(1, generator=g))
    pack = P.HostPack([t.shape for t in tensors])
    assert [tuple(c.shape) for c in pack._chunks] == [(1, 1), (2, 3), (2, 3), (1, 3), (1, 20)]
    squares = pack.load(tensors).squares().tolist()
    for t, got in zip(tensors, squares, strict=True):
        assert got == pytest.approx(t.double().square().sum().item(), rel=1e-12)


def test_parameter_stepped_by_two_optimizers_in_one_window_gets_two_copies(path):
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
def test_norms_are_finite_and_match_float64_for_any_magnitude(path, scale):
    # A gradient of 1e22 per element (diverging run) is finite; its float32 square is not. 1 M+ elements: the sums
    # must also be exact to 1e-6 on any CPU (a BLAS dot was 1e-4 off on an AMD EPYC).
    g = torch.Generator().manual_seed(1)
    w = nn.Parameter(torch.randn(1024, 1100, generator=g) * 0.02 + 0.5)
    w.grad = (torch.randn(1024, 1100, generator=g) + 3.0) * scale
    tracker = P.ParameterTracker({"w": w})
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


def test_nonfinite_gradients_keep_a_nonfinite_norm(path):
    grads = [torch.tensor([1.0, float("inf")]), torch.tensor([float("nan"), 2.0]), torch.tensor([3.0, 4.0])]
    norms = P.squared_norms(grads).tolist()
    assert norms[0] == math.inf
    assert math.isnan(norms[1])
    assert norms[2] == pytest.approx(25.0, rel=1e-6)


def test_small_tensors_summed_together_match_float64_one_by_one():
    g = torch.Generator().manual_seed(5)
    tensors = [
        torch.randn(64, 64, generator=g) * 1e22,  # squares overflow float32
        torch.randn(100, generator=g) * 1e-30,  # squares underflow float32
        torch.randn(P._PACKED, generator=g) + 1e3,  # the largest batched size, mean >> std
        torch.randn(P._PACKED + 1, generator=g),  # one past it: the per-tensor path
        torch.tensor([1.0, float("nan")]),  # non-finite: recomputed alone, kept as NaN
        torch.zeros(0),
        torch.randn(7, generator=g, dtype=torch.float64),  # not float32: per tensor
        torch.randn(3, generator=g),
    ]
    squares = P.squared_norms(tensors).tolist()
    for t, got in zip(tensors, squares, strict=True):
        want = t.double().square().sum().item()
        if math.isnan(want):
            assert math.isnan(got)
        else:
            assert got == pytest.approx(want, rel=1e-6, abs=0.0)


def test_a_sparse_gradient_is_measured_like_its_dense_value(path):
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


def test_host_pack_sums_its_first_part_alone():
    # Weights, then gradients of the same shapes: the weights are packed apart and can be summed alone.
    g = torch.Generator().manual_seed(8)
    shapes = [torch.Size([3]), torch.Size([2, 2]), torch.Size([3])]
    weights = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) * 1e3 for s in shapes]
    pack = P.HostPack(shapes * 2, split=3).load([*weights, *grads])
    everything = pack.squares().tolist()
    for t, got in zip([*weights, *grads], everything, strict=True):
        assert got == pytest.approx(t.double().square().sum().item(), rel=1e-12)
    first = pack.squares(first=True).tolist()
    assert first == everything[:3]
    gradients_start = min(view.data_ptr() for view in pack.views[3:])
    assert all(chunk.data_ptr() < gradients_start for chunk in pack._chunks[: pack._first_chunks])


def test_a_packed_parameter_whose_shape_changes_gets_a_new_pack():
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


def test_packs_of_parameter_sets_no_longer_stepped_are_released():
    # A block skipped on some steps leaves its parameters without a gradient: the stepped set changes from step to
    # step, and a pack kept for every set ever seen grew without bound.
    g = torch.Generator().manual_seed(9)
    ps = [nn.Parameter(torch.randn(16, generator=g)) for _ in range(6)]
    tracker = P.ParameterTracker({f"p{i}": p for i, p in enumerate(ps)})
    opt = torch.optim.SGD(ps, lr=0.1)
    for step in range(20):
        for i, p in enumerate(ps):
            p.grad = torch.randn(16, generator=g) if (i + step) % 3 else None
        tracker.before_step(opt.param_groups)
        opt.step()
        tracker.after_step()
        assert len(tracker._layouts) == 1
        assert len(tracker._index_cache) <= 1
    tracker.release()
    assert not tracker._layouts
    assert not tracker._index_cache


@pytest.mark.parametrize("change", ["dtype", "device"])
def test_a_packed_parameter_cast_or_moved_gets_a_new_layout(monkeypatch, change):
    # `.data` replaced by float64 (or, as seen by the tracker, moved off the host): the float32 pack must not be
    # reused, or the copy from before the step is rounded and the update is mostly rounding error.
    w = nn.Parameter(torch.ones(8) + torch.arange(8) * 1e-3)
    tracker = P.ParameterTracker({"w": w})
    opt = torch.optim.SGD([w], lr=1e-9)
    w.grad = torch.ones(8)
    tracker.before_step(opt.param_groups)
    opt.step()
    tracker.after_step()
    if change == "dtype":
        w.data = w.data.double()
    else:
        monkeypatch.setattr(P.S, "reads_on_host", lambda t: False)
    w.grad = torch.ones(8, dtype=w.dtype)
    before = w.detach().clone()
    tracker.before_step(opt.param_groups)
    opt.step()
    _, update_sq = tracker.after_step()
    assert update_sq.item() == pytest.approx(sq(w.detach() - before), rel=1e-6)
    assert next(iter(tracker._layouts.values())).pack is None  # measured one by one now


def test_an_empty_host_pack_sums_to_nothing():
    assert P.HostPack([]).squares().tolist() == []
    pack = P.HostPack([torch.Size([2])], split=0).load([torch.tensor([3.0, 4.0])])
    assert pack.squares(first=True).tolist() == []
    assert pack.squares().tolist() == [25.0]
