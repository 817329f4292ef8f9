"""The rules on how the gradient travels to the input end.

``docs/rules.md#why-the-gradient-rules-look-at-the-whole-input-side-of-a-layer``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import NamedTuple

from lightning_hookdiag._names import owning_layer
from lightning_hookdiag.rules._context import Context, finite, first_positions
from lightning_hookdiag.rules._findings import also, plural
from lightning_hookdiag.rules._registry import Found, rule

__all__ = ["InputSide", "cut_off", "input_side", "is_dead", "stopped_by_dead"]


def cut_off(
    missing_grads: Collection[str],
    forward_order: Sequence[str],
    backward_order: Sequence[str],
    param_grad_norm: Mapping[str, float] | None = None,
) -> list[str]:
    """The layers the gradient never reached on its way to the input end, in forward order (``no_gradient``).

    Which layers those are, and why a branch after the first layer that got a gradient is not one:
    ``docs/rules.md#no_gradient-where-the-gradient-stops``.

    Args:
        missing_grads: Layers whose output required grad but received no gradient.
        forward_order: Layers in the order their forward first ran.
        backward_order: Layers in the order their output gradient arrived.
        param_grad_norm: Parameter name to its gradient norm, when known: a layer whose parameters got one learns.

    Example:
        >>> cut_off({"body.0", "body.1", "pool"}, ["body.0", "body.1", "head", "pool"], ["head"])
        ['body.0', 'body.1']
        >>> cut_off({"lstm"}, ["lstm", "head"], ["head"], {"lstm.weight_hh_l0": 0.3})
        []
    """
    forward = first_positions(forward_order)
    reached = [forward[n] for n in backward_order if n in forward]
    if not reached:
        return []
    first = min(reached)
    learning = {owning_layer(p, forward) for p, norm in (param_grad_norm or {}).items() if finite(norm) and norm > 0}
    return sorted(
        (n for n in missing_grads if forward.get(n, first) < first and n not in learning), key=forward.__getitem__
    )


@rule(order=4, phase="backward", stat="act_grad_norm")
def no_gradient(ctx: Context) -> Iterator[Found]:
    """The layers before the point the gradient never crossed (:func:`cut_off`)."""
    backward = ctx.orders.backward_layers
    if cut := cut_off(ctx.fact("missing_grads", ()), ctx.orders.forward_layers, backward, ctx.stat("param_grad_norm")):
        first, last = cut[0], cut[-1]
        reached = min((n for n in backward if n in ctx.orders.forward), key=ctx.orders.forward.__getitem__)
        message = (
            f"no_gradient at step {ctx.step}: the output of {first} required grad but received no gradient, while"
            f" {reached}, later in forward order, did: the gradient stops between {last} and {reached} (a .detach(),"
            f" or an output that does not reach the loss), so {first} and what runs before the cut do not learn"
            f"{also(cut[1:], ' after it', 'cut off')}"
        )
        yield Found(first, len(cut), message)


def _gradient_ratios(ctx: Context) -> tuple[str, float, list[tuple[str, float]]] | None:
    """The output-end reference layer and norm, and every other usable layer's ratio to it, in backward order."""
    norms, nonfinite = ctx.stat("act_grad_norm"), ctx.positive("act_grad_nonfinite")
    # A norm taken over only the finite part of a NaN-ridden gradient means nothing; `nonfinite` reports those.
    usable = [(k, float(v)) for k, v in norms.items() if finite(v) and v >= 0 and k not in nonfinite]
    usable.sort(key=lambda item: ctx.orders.backward_key(item[0]))
    for i, (layer, norm) in enumerate(usable):
        if norm > 0:
            return layer, norm, [(name, n / norm) for name, n in usable[i + 1 :]]
    return None


def _amplifier(ref_layer: str, upto: Sequence[tuple[str, float]], input_end: str) -> tuple[str, str]:
    """``exploding_gradient``'s layer and the sentence saying where and how much the gradient grows.

    ``upto``: the other layers' ratios to the output end (``ref_layer``), in backward order, up to the layer from which
    the rule fired (the last): only the growth up to it made the rule fire, so only it is measured. ``input_end``: the
    side's layer nearest the input, named when no layer holds most of the growth (the origin of a stack that
    amplifies everywhere, ``docs/rules.md#where-an-explosion-is-made``).
    """
    fired = upto[-1][0]
    # Ratios to the output end give the same gains as the norms (zeros skipped). In a chain, the next layer's output
    # gradient is what a layer's backward (and any unobserved module's between them) makes of its own: it amplifies.
    chain = [(ref_layer, 1.0), *((layer, ratio) for layer, ratio in upto if ratio > 0)]
    gains = [(after[1] / before[1], before[0], after[0]) for before, after in zip(chain[:-1], chain[1:], strict=True)]
    if not gains:
        return fired, ""
    best = max(range(len(gains)), key=lambda i: gains[i][0])
    gain, layer, nxt = gains[best]
    rest_gains = [g for i, (g, _, _) in enumerate(gains) if i != best]
    median = statistics.median(rest_gains) if rest_gains else math.nan
    # The growth from the output end to the fired layer, in orders of magnitude: the share the largest step holds.
    total = max(ratio for _, ratio in upto)
    share = min(1.0, math.log(gain) / math.log(total)) if gain > 1 and finite(total) and total > 1 else math.nan
    others = "" if not finite(median) else f"; the median of the other gains between consecutive layers is {median:.3g}"
    part = "" if not finite(share) else f", {share:.0%} of the orders of magnitude gained from the output end"
    most = (
        f"{nxt}'s output gradient, the next observed one in backward order, is {gain:.3g} times {layer}'s (a layer"
        f" that keeps the gradient's scale has a gain near 1){part}{others}"
    )
    if finite(share) and share >= 0.5:
        return layer, f". The gradient grows most in the backward of {layer}: {most}"
    # Every layer amplifies a little and the threshold is crossed where depth made the product large enough: the
    # crossing says how deep the stack is, not where the growth starts. It starts at the input end, where the
    # exploded gradient is largest and the forward's amplification begins (an initialisation or a learning rate
    # that scales every layer).
    return input_end, (
        f". The growth is spread over the layers up to {fired}, none holding most of it (the largest: {most}): the"
        f" whole stack amplifies, so the growth starts at its input end, {input_end}, not where the threshold is"
        " first crossed"
    )


@rule(order=5, phase="backward", stat="act_grad_norm")
def vanishing_gradient(ctx: Context) -> list[Found]:
    """From some layer to the input end, every output gradient is far smaller than the output end's."""
    return _gradient_scale(ctx, vanishing=True)


@rule(order=6, phase="backward", stat="act_grad_norm")
def exploding_gradient(ctx: Context) -> list[Found]:
    """From some layer to the input end, every output gradient is far larger than the output end's."""
    return _gradient_scale(ctx, vanishing=False)


class InputSide(NamedTuple):
    """Where a gradient rule fires: from ``layer`` (and every layer after it in backward order) to the input end.

    Attributes:
        ref_layer: The output end (the reference), and ``ref_norm`` its output-gradient norm.
        layer: The first layer in backward order of the side past the threshold.
        span: How many observed layers the side holds, ``layer`` included.
        ratio: The side's extreme ratio to the output end (the largest for vanishing, the smallest for exploding), at
            ``extreme``.
        above: The observed layer just before ``layer`` in backward order (``ref_layer`` when there is none): the
            one whose backward took the gradient past the threshold.
        upto: The other layers' ratios to the output end, in backward order, up to ``layer``.
        input_end: The side's layer nearest the input end (the last in backward order with a positive ratio).
    """

    ref_layer: str
    ref_norm: float
    layer: str
    span: int
    ratio: float
    extreme: str
    above: str
    upto: list[tuple[str, float]]
    input_end: str = ""


def input_side(ctx: Context, vanishing: bool) -> InputSide | None:
    """Where ``vanishing_gradient`` (``exploding_gradient`` if not ``vanishing``) fires on this step, or ``None``."""
    ratios = _gradient_ratios(ctx)
    if ratios is None:
        return None
    ref_layer, ref_norm, rest = ratios
    threshold = ctx.config.vanishing_ratio if vanishing else ctx.config.exploding_ratio
    # The rule fires from the first layer whose input side (it and every layer after it in backward order) is past the
    # threshold: its largest ratio below it for vanishing (a residual stream carries the signal past q/k projections
    # and zero-initialised branches), its smallest positive one above it for exploding (an exact 0 is no signal at
    # all, not a small one). That is the layer after the last one that is not past it.
    within = [i for i, (_, r) in enumerate(rest) if (r >= threshold if vanishing else 0 < r <= threshold)]
    i = within[-1] + 1 if within else 0
    side = [(r, name) for name, r in reversed(rest[i:]) if vanishing or r > 0]  # a tie: the one nearest the input end
    if not side:
        return None
    ratio, extreme = (max if vanishing else min)(side, key=lambda item: item[0])
    # The layer just before it among every observed one, a non-finite gradient included: a dead ReLU passes 0 back
    # even for an Inf output gradient (its backward selects, it does not multiply).
    observed = sorted(ctx.stat("act_grad_norm"), key=ctx.orders.backward_key)
    at = observed.index(rest[i][0])
    above = observed[at - 1] if at > 0 else ref_layer
    input_end = side[0][1]  # side runs from the input end
    return InputSide(ref_layer, ref_norm, rest[i][0], len(rest) - i, ratio, extreme, above, rest[: i + 1], input_end)


def is_dead(ctx: Context, layer: str) -> bool:
    """Whether ``layer``'s ``act_dead_frac`` reaches ``dead_frac_threshold`` (NaN: its units are not tracked)."""
    frac = ctx.stat("act_dead_frac").get(layer)
    return finite(frac) and frac >= ctx.config.dead_frac_threshold


def stopped_by_dead(ctx: Context) -> InputSide | None:
    """The vanishing input side whose gradient a dead layer stopped, when ``dead_units`` reports it, or ``None``.

    The output gradient of the layer before a dead ReLU is its own times a derivative that is 0 on every unit that
    was ``<= 0``: exactly 0 below a fully dead layer. When the vanishing starts right below a dead layer (the observed
    layer just before the first starved one in backward order), the dead layer is the cause and the vanishing its
    consequence: ``dead_units`` says both in one finding (``docs/rules.md#dead_units-one-chain-one-finding``).
    """
    side = input_side(ctx, vanishing=True)
    return side if side is not None and _folded(ctx, side) else None


def _folded(ctx: Context, side: InputSide) -> bool:
    # With either rule off, nothing folds: the vanishing gradient keeps its own finding, or the dead units say nothing.
    enabled = ctx.enabled
    return "dead_units" in enabled and "vanishing_gradient" in enabled and is_dead(ctx, side.above)


def _gradient_scale(ctx: Context, vanishing: bool) -> list[Found]:
    side = input_side(ctx, vanishing)
    if side is None or (vanishing and _folded(ctx, side)):
        return []
    threshold = ctx.config.vanishing_ratio if vanishing else ctx.config.exploding_ratio
    span = f"from {side.layer} to the input end ({plural(side.span, 'layer')})"
    if vanishing:
        title, named, where = "vanishing_gradient", side.layer, ""
        what = (
            f"no layer {span} receives an output gradient of vanishing_ratio={threshold:g} times that of the output"
            f" end ({side.ref_layer}, {side.ref_norm:.3g}); the largest is {side.ratio:.3g} times, at {side.extreme}"
        )
    else:  # named where the gradient grows, not where the growth is first seen
        title, (named, where) = "exploding_gradient", _amplifier(side.ref_layer, side.upto, side.input_end)
        what = (
            f"every layer {span} receives an output gradient more than exploding_ratio={threshold:g} times that of"
            f" the output end ({side.ref_layer}, {side.ref_norm:.3g}); the smallest is {side.ratio:.3g} times, at"
            f" {side.extreme}"
        )
    return [Found(named, side.ratio, f"{title} at step {ctx.step}: {what}{where}", threshold)]
