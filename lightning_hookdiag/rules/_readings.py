"""The rules on how the loss reads the output layer's output (issue 38, principles 3 and 4).

What every healthy run keeps, whatever the model (``docs/rules.md#how-the-loss-reads-its-output``):

- an ``nll_loss`` (``cross_entropy`` included) of log-probabilities is never negative (``loss_below_floor``);
- a loss that takes logits (``BCEWithLogits``, ``cross_entropy``) is not fed probabilities (``squashed_twice``);
- the ``log_softmax`` that ``nll_loss`` reads normalises the dim it reads as the classes (``wrong_softmax_dim``).

The facts are what :func:`~lightning_hookdiag._precursor_probes.read_output` found on the walk of the loss's autograd
graph that the output-logit rules already make (``loss_misread``, ``loss_misread_size``, ``nll_below_zero``, owned by
the output layer), so they exist where the precursor statistics do (``logit_absmax``, on by default).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from lightning_hookdiag._names import LOSS
from lightning_hookdiag.rules._context import Context, finite
from lightning_hookdiag.rules._registry import Found, rule

__all__ = ["NORMALISED_OVER_WRONG_DIM", "SQUASHED_TWICE_SIGMOID", "SQUASHED_TWICE_SOFTMAX"]

SQUASHED_TWICE_SIGMOID, SQUASHED_TWICE_SOFTMAX, NORMALISED_OVER_WRONG_DIM = 1.0, 2.0, 3.0
"""The codes of :attr:`Reading.misread`: probabilities into a logits loss (a sigmoid into ``BCEWithLogits``, a softmax
into ``cross_entropy``'s ``log_softmax``), or a (log-)softmax over another dim than the one ``nll_loss`` reads as the
classes; 0: none (what :class:`~lightning_hookdiag._precursor_probes.Reading` notes)."""


@rule(order=18.5, phase="forward", stat="logit_absmax")
def loss_below_floor(ctx: Context) -> Iterator[Found]:
    """An ``nll_loss`` below 0, its floor: its input is not log-probabilities."""
    for layer, below in ctx.stat("nll_below_zero").items():
        if not (finite(below) and below > 0):
            continue
        message = (
            f"loss_below_floor: at step {ctx.step} the nll_loss that reads the output of {layer} is {-below:.4g},"
            " below 0, the floor of a negative log-likelihood (-log p >= 0 for any probability p <= 1): its input"
            f" is not log-probabilities. {layer}'s outputs go in as they are (raw logits, or probabilities without"
            " the log), so the loss has no minimum and falls by pushing the true class's output up without end;"
            " apply log_softmax first, or give the logits to cross_entropy"
        )
        yield Found(layer, -below, message, 0.0)


def _squash_message(ctx: Context, layer: str, code: float, size: int) -> str:
    """What a squash read twice costs: the loss's floor above 0, and the gradient its output layer gets."""
    loss = ctx.stat("step_loss").get(LOSS)
    now = f" (it is {loss:.4g} at step {ctx.step})" if finite(loss) else ""
    sent = _sent(ctx, layer)
    if code == SQUASHED_TWICE_SIGMOID:
        return (
            f"squashed_twice: the output of {layer} comes from a sigmoid and goes into"
            " binary_cross_entropy_with_logits, which applies the sigmoid again: its 'logits' are probabilities in"
            " (0, 1), so the predicted probability"
            f" never leaves (0.5, {_sigmoid(1.0):.3f}) and the loss never falls below {_softplus(-1.0):.3f} per"
            f" positive and {math.log(2.0):.3f} per negative sample{now}. The gradient the loss sends the sigmoid's"
            f" output{sent} never vanishes (|sigmoid(p) - y| >= 0.27), and the layer below gets at most 1/4 of it"
            " (p(1 - p)), less as the sigmoid saturates: drop the nn.Sigmoid, or use binary_cross_entropy on it"
        )
    floor = math.log(math.e + size - 1) - 1.0
    return (
        f"squashed_twice: the output of {layer} comes from a softmax and goes into cross_entropy, which applies"
        f" log_softmax again: its 'logits' are probabilities in [0, 1], so no class's probability exceeds"
        f" e / (e + {size - 1}) = {math.e / (math.e + size - 1):.3f} and the loss never falls below {floor:.3f}"
        f" whatever the weights{now}. The gradient the loss sends the softmax's output{sent} never vanishes, and the"
        " layer below gets it through the softmax's Jacobian, at most 1/2 of it and less as the softmax saturates:"
        " drop the nn.Softmax, or use nll_loss on its log"
    )


def _sent(ctx: Context, layer: str) -> str:
    """The output-gradient norms of ``layer`` and of the layer run just before it, and their ratio; ``""`` if none.

    In a chain the layer run just before the squash made its input: the ratio is what the squash passes down.
    """
    grads = ctx.stat("act_grad_norm")
    grad = grads.get(layer)
    if not finite(grad):
        return ""
    order = list(ctx.fact("forward_order", ()))
    before = order[order.index(layer) - 1] if layer in order and order.index(layer) > 0 else None
    below = grads.get(before) if before is not None else None
    passed = ""
    if finite(below) and grad > 0:
        passed = f"; {before}, run just before it, got {below:.3g}, {below / grad:.3g} of it"
    return f" (norm {grad:.3g} at step {ctx.step}{passed})"


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _softplus(x: float) -> float:
    return math.log1p(math.exp(x))


@rule(order=18.6, phase="forward", stat="logit_absmax")
def squashed_twice(ctx: Context) -> Iterator[Found]:
    """Probabilities (a sigmoid's, a softmax's output) fed as they are to a loss that takes logits."""
    sizes = ctx.stat("loss_misread_size")
    for layer, code in ctx.stat("loss_misread").items():
        if code in (SQUASHED_TWICE_SIGMOID, SQUASHED_TWICE_SOFTMAX):
            size = int(sizes.get(layer, 1))
            yield Found(layer, float(size), _squash_message(ctx, layer, code, size), 0.0)


@rule(order=18.7, phase="forward", stat="logit_absmax")
def wrong_softmax_dim(ctx: Context) -> Iterator[Found]:
    """A ``log_softmax`` read by ``nll_loss`` that normalised another dim than the one taken as the classes."""
    sizes = ctx.stat("loss_misread_size")
    for layer, code in ctx.stat("loss_misread").items():
        if code != NORMALISED_OVER_WRONG_DIM:
            continue
        size = int(sizes.get(layer, 0))
        message = (
            f"wrong_softmax_dim: at step {ctx.step} the log_softmax of {layer}'s output that nll_loss reads"
            f" normalised a dim of size {size} that is not the classes' (nll_loss reads dim 1 as the classes, dim 0"
            " of an unbatched input): each class's column sums to 1 over that dim (over the batch, when it is dim 0),"
            " so a sample's probabilities depend on the other samples and do not sum to 1; normalise over the"
            " classes (log_softmax(x, dim=-1) of a [batch, classes] output, or cross_entropy on the logits)"
        )
        yield Found(layer, float(size), message, 0.0)
