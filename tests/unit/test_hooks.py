import pytest
import torch
from helpers import count_hooks
from helpers.stance import compiles, current_stance
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_hookdiag import capture_activations
from lightning_hookdiag._hooks import HookSet, first_floating_tensor, tensors


def mlp(inplace: bool = False) -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(inplace=inplace), nn.Linear(5, 2))


def test_attach_remove_is_idempotent_and_leaves_user_hooks():
    net = mlp()
    user_calls = []
    user = net[0].register_forward_hook(lambda m, a, o: user_calls.append(1))
    baseline = count_hooks(net)
    hooks = HookSet(dict(net.named_children()), lambda i, o: None)
    hooks.attach()
    hooks.attach()  # a second attach must not double-register
    assert count_hooks(net) == baseline + 3
    hooks.remove()
    hooks.remove()
    assert count_hooks(net) == baseline
    net(torch.randn(2, 3))
    assert user_calls == [1]
    user.remove()


def test_a_set_of_no_module_is_attached_until_removed_and_restores_the_stance():
    from torch._dynamo import eval_frame

    hooks = HookSet({}, lambda i, o: None)
    hooks.attach()
    assert hooks.attached
    assert eval_frame._stance.stance == "force_eager"
    hooks.remove()
    assert not hooks.attached
    assert eval_frame._stance.stance == "default"


def test_gradient_sink_runs_without_grad_also_under_create_graph():
    net = mlp()
    modes = []
    hooks = HookSet({"0": net[0]}, lambda i, o: None, lambda i, g: modes.append(torch.is_grad_enabled()))
    with hooks:
        (grad,) = torch.autograd.grad(net(torch.randn(2, 3)).sum(), net[0].weight, create_graph=True)
    assert grad.requires_grad  # the graph was recorded for the caller, not for the sink
    assert modes == [False]
    assert torch.is_grad_enabled()


def test_reattaching_keeps_the_order_a_new_registration_would_have():
    # Between two sampled steps a user adds a hook: it runs before ours on the next step, as it would if ours were
    # registered anew; one added while ours are attached runs after ours.
    net = mlp()
    calls = []
    hooks = HookSet({"0": net[0]}, lambda i, o: calls.append("ours"))
    for cycle in range(3):
        hooks.attach()
        if cycle == 1:
            during = net[0].register_forward_hook(lambda m, a, o: calls.append("during"))
        net(torch.randn(2, 3))
        hooks.remove()
        assert count_hooks(net) == (1 if cycle >= 1 else 0) + (1 if cycle == 2 else 0)
        if cycle == 1:
            between = net[0].register_forward_hook(lambda m, a, o: calls.append("between"))
    assert calls == ["ours", "ours", "during", "during", "between", "ours"]
    during.remove()
    between.remove()
    assert count_hooks(net) == 0


def test_a_module_whose_hook_dict_was_replaced_gets_a_new_registration():
    from collections import OrderedDict

    net = mlp()
    calls = []
    hooks = HookSet({"0": net[0]}, lambda i, o: calls.append(i))
    hooks.attach()
    hooks.remove()
    net[0]._forward_hooks = OrderedDict()  # what rebuilding the module's state in place does
    hooks.attach()
    net(torch.randn(2, 3))
    assert calls == [0]
    hooks.remove()
    assert count_hooks(net) == 0


def test_hooks_removed_when_body_raises():
    net = mlp()
    with pytest.raises(RuntimeError, match="boom"), HookSet(dict(net.named_children()), lambda i, o: None):
        assert count_hooks(net) == 3
        raise RuntimeError("boom")
    assert count_hooks(net) == 0


def test_fired_order_is_execution_order_not_registration_order():
    class Reversed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)
            self.unused = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(self.b(self.b(x)))

    net = Reversed()
    calls = []
    with HookSet(dict(net.named_children()), lambda i, o: calls.append(i)) as hooks:
        net(torch.randn(1, 2))
    assert calls == [1, 1, 0]  # b runs twice (weight sharing): both calls are observed
    assert hooks.fired_names() == ["b", "a"]
    hooks.clear_order()
    assert hooks.fired_order == []


def test_gradient_hook_survives_inplace_relu_and_sees_pre_activation_gradient():
    torch.manual_seed(0)
    net = mlp(inplace=True)
    reference = mlp(inplace=False)
    reference.load_state_dict(net.state_dict())
    x = torch.randn(4, 3)

    grads: dict[int, torch.Tensor] = {}
    with HookSet(dict(net.named_children()), lambda i, o: None, lambda i, g: grads.__setitem__(i, g.clone())) as hooks:
        net(x).pow(2).sum().backward()

    pre = reference[0](x)
    pre.retain_grad()
    post = reference[1](pre)
    post.retain_grad()
    reference[2](post).pow(2).sum().backward()
    torch.testing.assert_close(grads[0], pre.grad)
    torch.testing.assert_close(grads[1], post.grad)
    assert hooks.grad_order == [2, 1, 0]


def test_full_backward_hook_would_break_on_inplace_relu():
    # Documents why tensor hooks are used: the alternative fails on this everyday pattern.
    net = mlp(inplace=True)
    net[0].register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(RuntimeError, match="inplace"):
        net(torch.randn(2, 3)).sum().backward()


def test_unfired_tensor_hooks_are_removed():
    net = mlp()
    outputs = []
    with HookSet(dict(net.named_children()), lambda i, o: outputs.append(o), lambda i, g: None):
        out = net(torch.randn(2, 3))
        assert all(len(o._backward_hooks) == 1 for o in outputs)
    # Backward never ran inside the block; the graph must not carry our hooks into a later backward.
    assert all(not o._backward_hooks for o in outputs)
    out.sum().backward()


def test_outputs_without_grad_get_no_gradient_hook():
    net = mlp()
    grads = []
    with HookSet(dict(net.named_children()), lambda i, o: None, lambda i, g: grads.append(i)), torch.no_grad():
        net(torch.randn(2, 3))
    assert grads == []


def test_checkpoint_recomputation_is_not_observed_twice():
    net = mlp()
    calls = []
    with HookSet(dict(net.named_children()), lambda i, o: calls.append(i), lambda i, g: None):
        x = torch.randn(2, 3, requires_grad=True)
        checkpoint(net, x, use_reentrant=False).sum().backward()
    assert calls == [0, 1, 2]


def test_sink_runs_without_grad_and_sees_values():
    net = mlp()
    seen = []

    def sink(i: int, out: torch.Tensor) -> None:
        seen.append((i, torch.is_grad_enabled(), out.clone()))

    x = torch.randn(2, 3)
    with HookSet({"0": net[0]}, sink):
        net(x)
    assert seen[0][0] == 0
    assert seen[0][1] is False
    torch.testing.assert_close(seen[0][2], net[0](x))


def test_compiled_module_is_observed_and_stance_restored():
    from torch._dynamo import eval_frame

    net = mlp()
    compiled = torch.compile(net, backend="eager")
    x = torch.randn(2, 3)
    compiled(x)  # compile first: hooks added afterwards are invisible to the compiled graph
    calls = []
    with HookSet(dict(net.named_children()), lambda i, o: calls.append(i)):
        assert eval_frame._stance.stance == "force_eager"
        compiled(x)
    assert calls == [0, 1, 2]
    assert eval_frame._stance.stance == "default"


def test_first_floating_tensor():
    assert first_floating_tensor(torch.tensor([1])) is None
    t = torch.tensor([1.0])
    assert first_floating_tensor([torch.tensor([1]), (None, {"a": t})]) is t
    assert first_floating_tensor("text") is None


def test_tensors_walks_every_dtype_with_its_path():
    i, f = torch.tensor([1]), torch.tensor([1.0])
    assert [(p, t) for p, t in tensors([i, ("a", {"x": f})], "batch")] == [("batch[0]", i), ("batch[1][1]['x']", f)]
    assert [p for p, _ in tensors({"x": (i, f)})] == [None, None]


@pytest.mark.parametrize("finished", [False, True])
def test_a_companion_that_raises_leaves_no_hook_behind(finished):
    from torch._dynamo import eval_frame

    from lightning_hookdiag._aggregation import LayerStatsAggregator
    from lightning_hookdiag._saved_memory import SavedMemoryTracker
    from lightning_hookdiag._unregistered import UnregisteredWatch
    from lightning_hookdiag.components import Component

    class Failing(Component):
        def end_micro_batch(self):
            raise RuntimeError("end failed")

        def remove(self):
            super().remove()
            raise RuntimeError("remove failed")

    net = mlp()
    modules = dict(net.named_children())
    trackers = [SavedMemoryTracker(modules, net, LayerStatsAggregator(len(modules))) for _ in range(2)]
    companions = [trackers[0], Failing(), UnregisteredWatch(net), trackers[1]]
    hooks = HookSet(modules, lambda i, o: None, lambda i, g: None, companions=companions)
    hooks.attach()
    net(torch.randn(2, 3))  # leaves tensor hooks on the outputs
    assert count_hooks(net) > 3
    with pytest.raises(RuntimeError, match="end failed" if finished else "remove failed"):  # the first error
        hooks.remove(finished=finished)
    assert count_hooks(net) == 0
    assert not hooks.attached
    assert not any(c.attached for c in companions)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # both trackers' pack hooks left
    assert eval_frame._stance.stance == "default"


@pytest.mark.parametrize("order", ["first_in_first_out", "nested"])
def test_overlapping_hook_sets_restore_the_stance_in_any_order(order):
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    a = HookSet(dict(net.named_children()), lambda i, out: None)
    b = HookSet(dict(net.named_children()), lambda i, out: None)
    with torch.compiler.set_stance("eager_on_recompile"):  # a user's own stance must come back too
        a.attach()
        b.attach()
        assert current_stance() == "force_eager"
        with capture_activations(net, "0"):
            net(torch.zeros(1, 2))
            assert current_stance() == "force_eager"
        first, second = (a, b) if order == "first_in_first_out" else (b, a)
        first.remove()
        assert current_stance() == "force_eager"  # the other set still needs it
        first.remove()  # idempotent: does not release the other set's claim
        assert current_stance() == "force_eager"
        second.remove()
        assert current_stance() == "eager_on_recompile"
    assert current_stance() == "default"
    assert compiles()
