"""Saved-activation memory per layer: hand-derived bytes, storages counted once, lifecycle, and in a real fit."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import RecordingLogger, TinyModule, by_name, count_hooks, make_data, make_trainer
from torch import nn

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag._aggregation import LayerStatsAggregator
from lightning_hookdiag._saved_memory import SavedMemoryTracker

F32 = 4  # bytes per float32 element
P = "layer_health"


def saved_bytes(model: nn.Module, modules: dict[str, nn.Module], x: torch.Tensor) -> dict[str, int]:
    tracker = SavedMemoryTracker(modules, model, LayerStatsAggregator(len(modules)))
    tracker.attach()
    try:
        model(x).sum().backward()
        tracker.end_micro_batch()
    finally:
        tracker.remove()
    return dict(zip(modules, tracker.peak, strict=True))


def no_saved_tensor_hooks() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize("inplace", [False, True], ids=["relu", "relu_inplace"])
def test_linear_relu_linear(inplace):
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=inplace), nn.Linear(8, 2))
    got = saved_bytes(net, dict(net.named_children()), torch.randn(3, 4))
    # Linear saves its input for the weight gradient (its weight is a parameter: not counted). ReLU saves its
    # result; in place, that result is the Linear's output storage, which the Linear itself never saved. The
    # second Linear saves the ReLU output again: the same storage, counted once.
    assert got == {"0": 3 * 4 * F32, "1": 3 * 8 * F32, "2": 0}
    assert no_saved_tensor_hooks()
    assert count_hooks(net) == 0


class Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x  # saves x twice (both operands)


class Slice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :1].exp()  # saves its result; a fresh 1-column tensor


def test_views_and_repeated_saves_of_one_storage_count_once():
    net = nn.Sequential(nn.Linear(4, 6), Square(), Slice())
    got = saved_bytes(net, dict(net.named_children()), torch.randn(5, 4))
    assert got == {"0": 5 * 4 * F32, "1": 5 * 6 * F32, "2": 5 * 1 * F32}


class Block(nn.Module):
    """A pre-norm single-head transformer block built from known modules."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.d = d
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.d), dim=-1)
        x = x + self.proj(att @ v)
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


def graph_saved_bytes(output: torch.Tensor, exclude: set[int]) -> int:
    """Independent reference: walk the autograd graph and add up the storages of every ``_saved_*`` tensor."""
    seen, total, stack, visited = set(exclude), 0, [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            value = getattr(node, attr)
            for t in value if isinstance(value, (tuple, list)) else [value]:
                # A Python number (the 1/sqrt(d) scale) is stored as a scalar, not a tensor autograd packs.
                if isinstance(t, torch.Tensor) and t.ndim > 0 and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
        stack += [n for n, _ in node.next_functions]
    return total


def test_transformer_block_attributes_to_the_innermost_module():
    torch.manual_seed(0)
    block, (b, t, d) = Block(), (2, 5, 8)
    x = torch.randn(b, t, d)
    got = saved_bytes(block, dict(block.named_modules()), x)
    tokens = b * t
    assert got == {
        # matmul/softmax run in the block itself: q and k (views of the qkv output) and the attention weights.
        "": tokens * 3 * d * F32 + b * t * t * F32,
        "ln1": tokens * d * F32 + 2 * tokens * F32,  # input, mean and rstd
        "qkv": tokens * d * F32,  # the ln1 output
        "proj": tokens * d * F32,  # att @ v
        "ln2": tokens * d * F32 + 2 * tokens * F32,
        "fc1": tokens * d * F32,
        "act": tokens * 4 * d * F32,  # GELU saves its input (the fc1 output)
        "fc2": tokens * 4 * d * F32,  # the GELU output
    }
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    assert sum(got.values()) == graph_saved_bytes(block(x), params)
    # Only the leaves selected: what the block does itself is not attributed to any of them.
    leaves = {n: m for n, m in block.named_modules() if n}
    assert saved_bytes(block, leaves, x) == {k: v for k, v in got.items() if k}


def test_recomputation_in_backward_is_not_counted():
    from torch.utils.checkpoint import checkpoint

    inner = nn.Sequential(nn.Linear(4, 8), nn.Tanh())

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.inner, x, use_reentrant=True)

    net = Checkpointed()
    x = torch.randn(3, 4, requires_grad=True)
    got = saved_bytes(net, {"inner.0": inner[0], "inner.1": inner[1]}, x)
    assert got == {"inner.0": 0, "inner.1": 0}  # reentrant checkpointing saves nothing in forward


def test_remove_is_idempotent_and_restores_everything():
    net = nn.Sequential(nn.Linear(2, 2))
    tracker = SavedMemoryTracker(dict(net.named_children()), net, LayerStatsAggregator(1))
    tracker.attach()
    tracker.attach()
    assert tracker.attached
    assert count_hooks(net) == 2
    tracker.remove()
    tracker.remove()
    assert not tracker.attached
    assert count_hooks(net) == 0
    assert no_saved_tensor_hooks()


def test_fit_logs_the_largest_micro_batch_and_shows_it_in_the_summary(capsys):
    # 12 samples in batches of 8: micro-batches of 8 and 4 rows form step 0; the pooled value is the larger one.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
    module = TinyModule(model=model, data=make_data(n=12))
    callback = LayerHealthCallback(every_n_steps=1, stats=["act_std", "act_saved_bytes"])
    logger = RecordingLogger()
    trainer = make_trainer([callback], max_steps=1, accumulate_grad_batches=2, logger=logger)
    trainer.fit(module)
    ((step, metrics),) = logger.ours()
    assert step == 0
    assert {k: v for k, v in metrics.items() if "act_saved_bytes" in k} == {
        f"{P}/act_saved_bytes/model.0": 8 * 4 * F32,
        f"{P}/act_saved_bytes/model.1": 8 * 8 * F32,
        f"{P}/act_saved_bytes/model.2": 0.0,
    }
    assert count_hooks(module) == 0
    assert no_saved_tensor_hooks()
    table = callback.summary_table().splitlines()
    assert table[1].split() == ["depth", "layer", "act_std", "act_saved_bytes", "findings"]
    assert table[3].split()[-2:] == ["256", "B"]  # model.1: 8 rows x 8 floats


class LBFGSModule(TinyModule):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


def test_lbfgs_closures_are_one_measurement_each_not_a_sum():
    # Every closure evaluation runs a forward that saves for its own backward; before, the evaluations of a step were
    # added up wherever the allocator gave a saved tensor a new address (1x-3x the bytes of one forward, by run).
    module = LBFGSModule(model=nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), data=make_data(n=8))
    callback = LayerHealthCallback(every_n_steps=1, stats=["act_mean", "act_saved_bytes"], output={"summary": False})
    make_trainer([callback], max_steps=2).fit(module)
    steps = [step for step, *_ in module.record]
    assert steps.count(0) > 1  # several closure evaluations per step
    assert steps.count(1) > 1
    assert callback.last_step == 1
    saved = {k.rsplit("/", 1)[1]: v for k, v in by_name(callback.last_metrics).items() if "act_saved_bytes" in k}
    # Linear saves its input (8 rows x 4), ReLU its output (8 x 8); the last Linear's input is ReLU's output.
    assert saved == {"model.0": 8 * 4 * F32, "model.1": 8 * 8 * F32, "model.2": 0.0}
    assert count_hooks(module) == 0
    assert no_saved_tensor_hooks()


def test_an_exception_in_a_sampled_training_step_leaves_no_hooks():
    module = TinyModule()

    def boom(m, batch_idx):
        raise RuntimeError("boom")

    module.on_step = boom
    callback = LayerHealthCallback(every_n_steps=1, stats=["act_saved_bytes"])
    with pytest.raises(RuntimeError, match="boom"):
        make_trainer([callback]).fit(module)
    assert count_hooks(module) == 0
    assert no_saved_tensor_hooks()
