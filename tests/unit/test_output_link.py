"""``output_link``: how a loss's autograd graph reads the output layer's output (issue 35, item 13)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from lightning_hookdiag._precursor_probes import nll_sign, output_link, read_output
from lightning_hookdiag.rules._precursors import SIGMOID_LINK, SOFTMAX_LINK
from lightning_hookdiag.rules._readings import NORMALISED_OVER_WRONG_DIM, SQUASHED_TWICE_SIGMOID, SQUASHED_TWICE_SOFTMAX


def _head() -> tuple[torch.Tensor, torch.Tensor]:
    out = nn.Linear(4, 3)(torch.randn(5, 4))
    return out, torch.zeros(5, dtype=torch.long)


def test_softmax_losses_sigmoid_losses_and_a_regression_loss():
    out, labels = _head()
    assert output_link(F.cross_entropy(out.view(-1, 3) / 2.0, labels).grad_fn, out.grad_fn) == SOFTMAX_LINK
    assert output_link(F.nll_loss(out.log_softmax(-1), labels).grad_fn, out.grad_fn) == SOFTMAX_LINK
    assert output_link((out.softmax(-1) ** 2).sum().grad_fn, out.grad_fn) == SOFTMAX_LINK
    target = torch.ones(5, 3)
    assert output_link(F.binary_cross_entropy_with_logits(out, target).grad_fn, out.grad_fn) == SIGMOID_LINK
    assert output_link(F.binary_cross_entropy(out.sigmoid(), target).grad_fn, out.grad_fn) == SIGMOID_LINK
    assert output_link(F.mse_loss(out, target).grad_fn, out.grad_fn) == 0
    # Both on one step: the softmax wins.
    both = F.mse_loss(out, target) + F.binary_cross_entropy_with_logits(out, target) + F.cross_entropy(out, labels)
    assert output_link(both.grad_fn, out.grad_fn) == SOFTMAX_LINK


def test_a_softmax_that_does_not_read_the_output_does_not_count():
    out, labels = _head()
    other = nn.Linear(4, 3)(torch.randn(5, 4))
    loss = F.mse_loss(out, torch.ones(5, 3)) + F.cross_entropy(other, labels)
    assert output_link(loss.grad_fn, out.grad_fn) == 0
    # Below the output: a softmax inside the model, before the head, is no link either.
    hidden = torch.randn(5, 4, requires_grad=True).softmax(-1)
    head = nn.Linear(4, 3)(hidden)
    assert output_link(F.mse_loss(head, torch.ones(5, 3)).grad_fn, head.grad_fn) == 0


def test_the_walk_stops_after_its_limit_and_on_a_loss_without_graph():
    out, labels = _head()
    deep = out
    for _ in range(50):
        deep = deep * 1.0
    loss = F.cross_entropy(deep, labels)
    assert output_link(loss.grad_fn, out.grad_fn, limit=20) == 0
    assert output_link(loss.grad_fn, out.grad_fn) == SOFTMAX_LINK
    assert output_link(None, out.grad_fn) == 0


def test_the_walk_notes_a_squash_read_twice_and_a_softmax_over_another_dim_than_the_classes():
    out, labels = _head()
    target = torch.ones(5, 3)
    sigmoid = read_output(F.binary_cross_entropy_with_logits(out.sigmoid().view(5, 3), target).grad_fn, out.grad_fn)
    assert (sigmoid.misread, sigmoid.size, sigmoid.reached) == (SQUASHED_TWICE_SIGMOID, 1, True)
    softmax = read_output(F.cross_entropy(out.softmax(-1), labels).grad_fn, out.grad_fn)
    assert (softmax.misread, softmax.size) == (SQUASHED_TWICE_SOFTMAX, 3)  # the 3 classes it normalised
    batch = read_output(F.nll_loss(out.log_softmax(0), labels).grad_fn, out.grad_fn)
    assert (batch.misread, batch.size) == (NORMALISED_OVER_WRONG_DIM, 5)  # the batch of 5
    # The healthy pairs, and a reshape between log_softmax and nll_loss (the dims no longer line up): nothing.
    healthy = [
        F.binary_cross_entropy(out.sigmoid(), target),
        F.nll_loss(out.log_softmax(-1), labels),
        F.nll_loss(out.log_softmax(1), labels),
        F.cross_entropy(out, labels),
        F.binary_cross_entropy_with_logits(out * out.sigmoid(), target),
        F.nll_loss(out.log_softmax(0).reshape(5, 3), labels),
    ]
    assert [read_output(loss.grad_fn, out.grad_fn).misread for loss in healthy] == [0.0] * len(healthy)


def test_the_sign_of_an_nll_loss_at_the_root_through_constant_scalings():
    out, labels = _head()
    nll = F.nll_loss(out, labels)
    assert nll_sign(nll.grad_fn) == 1.0
    assert float(nll_sign((nll / 2.0).grad_fn)) == 1.0  # Lightning's division under gradient accumulation
    assert float(nll_sign((nll * -3.0).grad_fn)) == -1.0
    # Not an nll_loss at the root, or a factor that requires grad: not judged.
    assert nll_sign((nll + 1.0).grad_fn) is None
    assert nll_sign(F.mse_loss(out, torch.ones(5, 3)).grad_fn) is None
    assert nll_sign((nll * torch.tensor(2.0, requires_grad=True)).grad_fn) is None


def test_the_sign_is_read_under_a_dispatch_mode_of_the_users():
    # A Python number's saved tensor reached aten as the bare number under a dispatch mode (a profiler's op counter,
    # FlopCounterMode): the sign's op raised inside training.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    out, labels = _head()
    nll = F.nll_loss(out, labels)
    with Passthrough():
        assert float(nll_sign((nll / 2.0).grad_fn)) == 1.0
        assert float(nll_sign((nll * -3.0).grad_fn)) == -1.0
