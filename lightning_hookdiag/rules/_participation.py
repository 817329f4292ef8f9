"""The rules on each parameter's and each module's part in the run, read at the step (issue 38, principles 1 and 2).

What every healthy run keeps, whatever the model (``docs/rules.md#parameters-and-modules-read-at-the-step``):

- a module that ran on every sampled step keeps running (``stopped_running``);
- a module whose trainable parameters an optimizer holds sends its output to the loss (``output_unused``);
- an optimizer that steps holds at least one parameter that received a gradient (``idle_optimizer``);
- a parameter's Tensor methods are its own: none is hidden by an attribute set on it (``shadowed_method``).

The facts come from :mod:`lightning_hookdiag._participation` (``stopped_layers``, ``trainable``, ``shadowed``), the
step's orders and missing gradients, and the optimizer facts (:class:`~lightning_hookdiag.rules.ParamFacts`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping

from lightning_hookdiag.rules._context import Context, finite
from lightning_hookdiag.rules._findings import listing, plural
from lightning_hookdiag.rules._gradients import cut_off
from lightning_hookdiag.rules._registry import Found, rule

__all__: list[str] = []

_SETTERS = frozenset({"requires_grad_"})
"""Tensor methods that set the property of their name less ``_``: ``p.requires_grad_ = True`` meant the property."""


@rule(order=3.5, phase="forward", stat="count", reads=["stopped_layers"])
def stopped_running(ctx: Context) -> Iterator[Found]:
    """Layers that ran on every sampled step from the first, then stopped running."""
    stopped: Mapping[str, tuple[int, int]] = ctx.fact("stopped_layers", {})
    if not stopped:
        return
    first = next(iter(stopped))  # in the selection's order: the branch's first layer
    ran, absent = stopped[first]
    message = (
        f"stopped_running at step {ctx.step}: {first} ran in the training forward on each of the first"
        f" {plural(ran, 'sampled step')} and on none of the last {absent}"
        f"{_others(list(stopped)[1:])}: a module that took part in every step stopped taking part mid-run. A branch"
        " gated on the wrong clock (a warm-up of n epochs compared with the global step), a condition that became"
        " false for good, or a flag flipped by a callback; if it is meant to stop (a curriculum), disable the rule"
    )
    yield Found(first, float(absent), message)


def _others(names: list[str]) -> str:
    if not names:
        return ""
    return f" ({plural(len(names), 'more layer')} stopped with it: {listing(names)})"


def _grads(ctx: Context) -> set[str]:
    """The parameters that received a gradient at the step (a positive or non-finite norm)."""
    return {p for p, g in ctx.stat("param_grad_norm").items() if not finite(g) or g > 0}


@rule(order=4.5, phase="backward", stat="act_grad_norm", reads=["missing_grads", "param_facts", "trainable"])
def output_unused(ctx: Context) -> Iterator[Found]:
    """Layers that ran, whose trainable parameters an optimizer holds, whose output never reached the loss."""
    trainable = ctx.fact("trainable", frozenset())
    missing = ctx.fact("missing_grads", ())
    grads = _grads(ctx)
    if not grads:  # no backward reached any parameter: another rule's business (zeroed_gradients, nonfinite)
        return
    held: dict[str, list[str]] = {}
    for param, fact in ctx.fact("param_facts", {}).items():
        if fact.held and param in trainable:
            held.setdefault(ctx.orders.owner(param), []).append(param)
    forward, backward = ctx.orders.forward_layers, ctx.orders.backward_layers
    # Layers before the point the gradient never crossed are no_gradient's: a cut, not an output left out.
    cut = set(cut_off(missing, forward, backward, ctx.stat("param_grad_norm")))
    unused = [
        layer
        for layer in forward
        if layer in missing and layer not in cut and layer in held and not any(p in grads for p in held[layer])
    ]
    if not unused:
        return
    first = unused[0]
    params = held[first]
    message = (
        f"output_unused at step {ctx.step}: {first} ran in the training forward and its output required grad, but no"
        f" gradient came back to it: its output never reaches the loss. Its trainable parameters ({listing(params)})"
        " are held by an optimizer and never get a gradient, so they never learn (DistributedDataParallel refuses"
        " such parameters unless find_unused_parameters=True)"
        f"{_others_unused(unused[1:])}. An auxiliary head whose loss is not added to the total, or an output"
        " computed and dropped; if it is meant to run without training, run it under torch.no_grad() or freeze it"
    )
    yield Found(first, float(len(params)), message)


def _others_unused(names: list[str]) -> str:
    if not names:
        return ""
    return f"; {plural(len(names), 'more layer')} likewise: {listing(names)}"


@rule(order=13.5, phase="backward", stat="param_grad_norm", reads=["param_facts"], uses=["trainable"])
def idle_optimizer(ctx: Context) -> Iterator[Found]:
    """An optimizer that stepped although none of the parameters it holds received a gradient."""
    grads = _grads(ctx)
    if not grads:  # nothing got a gradient at all: zeroed_gradients says why
        return
    held: dict[int, list[str]] = {}
    for param, fact in ctx.fact("param_facts", {}).items():
        if fact.held and fact.applied:
            for index in set(fact.optimizers):
                held.setdefault(index, []).append(param)
    for index, params in sorted(held.items()):
        if any(p in grads for p in params):
            continue
        owners = ctx.orders.owners(params)
        why = _why_idle(params, ctx.fact("trainable"))
        message = (
            f"idle_optimizer at step {ctx.step}: optimizer {index} stepped, but none of the"
            f" {plural(len(params), 'parameter')} it holds ({listing(params)}, in {listing(owners)}) received a"
            f" gradient ({why}), while {plural(len(grads), 'other parameter')} did: the optimizer changes nothing."
            " Unfreeze what it is meant to train (requires_grad=True), or build it from the parameters that learn"
        )
        yield Found(owners[0], float(len(params)), message)


def _why_idle(params: list[str], trainable: Collection[str] | None) -> str:
    """Why none of an optimizer's ``params`` got a gradient, as far as ``trainable`` (``None``: unknown) tells."""
    frozen = [] if trainable is None else [p for p in params if p not in trainable]
    if not frozen:
        return "their modules' outputs do not reach the loss, or ran under torch.no_grad()"
    if len(frozen) == len(params):
        return "all of them have requires_grad=False"
    return f"{len(frozen)} of them have requires_grad=False ({listing(frozen)})"


def _fix(attr: str) -> str:
    """What to write instead of assigning to the Tensor attribute ``attr``."""
    meant = attr.removesuffix("_")
    if attr in _SETTERS:
        return f"set the property it stands for (`p.{meant} = True`) or call the method (`p.{attr}(True)`)"
    return f"remove the attribute (`del p.{attr}`) and call or read the Tensor's own"


@rule(order=13.6, phase="backward", stat="param_grad_norm", reads=["shadowed"])
def shadowed_method(ctx: Context) -> Iterator[Found]:
    """Parameters whose Tensor method or property an attribute set on them hides (``p.requires_grad_ = True``)."""
    shadowed: Mapping[str, tuple[str, ...]] = ctx.fact("shadowed", {})
    if not shadowed:
        return
    owners = ctx.orders.owners(shadowed)
    first = next(p for p in shadowed if ctx.orders.owner(p) == owners[0])
    attr = shadowed[first][0]
    still = " (the parameter is still frozen)" if attr == "requires_grad_" else ""
    message = (
        f"shadowed_method at step {ctx.step}: {plural(len(shadowed), 'parameter')} ({listing(list(shadowed))}, in"
        f" {listing(owners)}) carry an attribute that hides the Tensor's own {attr!r}: an assignment such as"
        f" `p.{attr} = ...` stored a value on the parameter and called nothing, so what it was meant to do did not"
        f" happen{still}. Instead, {_fix(attr)}"
    )
    yield Found(owners[0], float(len(shadowed)), message)
