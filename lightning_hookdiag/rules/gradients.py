"""The rules on how the gradient travels to the input end.

``no_gradient`` (:func:`cut_off`: where it stops), ``vanishing_gradient`` and ``exploding_gradient`` (the output
gradients' norms over the output end's, and the layer that amplifies them)
(``docs/rules.md#why-the-gradient-rules-look-at-the-whole-input-side-of-a-layer``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Iterator, Mapping, Sequence

from lightning_hookdiag.names import owning_layer
from lightning_hookdiag.rules.context import Context, finite
from lightning_hookdiag.rules.findings import also, plural
from lightning_hookdiag.rules.registry import Found, rule

__all__ = ["cut_off"]


def cut_off(
    missing_grads: Collection[str],
    forward_order: Sequence[str],
    backward_order: Sequence[str],
    param_grad_norm: Mapping[str, float] | None = None,
) -> list[str]:
    """The layers the gradient never reached on its way to the input end, in forward order (``no_gradient``).

    A layer is cut off when its output required grad but received no gradient (``missing_grads``) and it ran
    before the first layer, in forward order, that did receive one (``backward_order``), and none of the parameters
    it owns received a non-zero gradient (``param_grad_norm``, when known). A layer that ran *after* some layer that
    received a gradient is a branch that does not reach the loss by design (BERT's pooler under a token-level head,
    an auxiliary output): the network before it learns, so it is not reported; nor is anything when no layer
    received a gradient (no backward ran). The parameter check covers modules that return a tuple: only the first
    floating-point output is watched, and an ``nn.LSTM`` whose ``h_n`` alone feeds the head still learns.

    Example:
        >>> cut_off({"body.0", "body.1", "pool"}, ["body.0", "body.1", "head", "pool"], ["head"])
        ['body.0', 'body.1']
        >>> cut_off({"lstm"}, ["lstm", "head"], ["head"], {"lstm.weight_hh_l0": 0.3})
        []
    """
    forward = {}
    for i, name in enumerate(forward_order):
        forward.setdefault(name, i)
    reached = [forward[n] for n in backward_order if n in forward]
    if not reached:
        return []
    first = min(reached)
    learning = set()
    if param_grad_norm:
        layers = set(forward)
        learning = {owning_layer(p, layers) for p, norm in param_grad_norm.items() if finite(norm) and norm > 0}
    return sorted(
        (n for n in missing_grads if forward.get(n, first) < first and n not in learning), key=forward.__getitem__
    )


@rule(order=4, phase="backward", stat="act_grad_norm")
def no_gradient(ctx: Context) -> Iterator[Found]:
    """The layers before the point the gradient never crossed (:func:`cut_off`)."""
    forward = sorted(ctx.orders.forward, key=ctx.orders.forward.__getitem__)
    backward = sorted(ctx.orders.backward, key=ctx.orders.backward.__getitem__)
    cut = cut_off(ctx.missing_grads, forward, backward, ctx.stat("param_grad_norm"))
    if cut:
        first, last = cut[0], cut[-1]
        reached = min((n for n in backward if n in ctx.orders.forward), key=ctx.orders.forward.__getitem__)
        yield Found(
            first,
            len(cut),
            f"no_gradient at step {ctx.step}: the output of {first} required grad but received no gradient, while"
            f" {reached}, later in forward order, did: the gradient stops between {last} and {reached} (a .detach(),"
            f" or an output that does not reach the loss), so {first} and what runs before the cut do not learn"
            f"{also(cut[1:], ' after it', 'cut off')}",
        )


def _gradient_ratios(ctx: Context) -> tuple[str, float, list[tuple[str, float]]] | None:
    """The output-end reference layer and norm, and every other usable layer's ratio to it, in backward order."""
    nonfinite = ctx.stat("act_grad_nonfinite")
    # A norm taken over only the finite part of a NaN-ridden gradient means nothing; `nonfinite` reports those.
    usable = [
        (layer, float(norm))
        for layer, norm in ctx.stat("act_grad_norm").items()
        if finite(norm) and norm >= 0 and not (finite(nonfinite.get(layer, 0.0)) and nonfinite.get(layer, 0.0) > 0)
    ]
    usable.sort(key=lambda item: ctx.orders.backward_key(item[0]))
    for i, (layer, norm) in enumerate(usable):
        if norm > 0:
            return layer, norm, [(name, n / norm) for name, n in usable[i + 1 :]]
    return None


def _input_side(rest: Sequence[tuple[str, float]], vanishing: bool) -> list[tuple[float, str]]:
    """For each layer of ``rest`` (backward order), the extreme ratio over it and every layer after it.

    Vanishing takes the largest ratio from a layer to the input end: the gradient signal is lost there only if no
    layer between it and the input still receives it (a residual stream carries it past q/k projections and
    zero-initialised branches). Exploding takes the smallest positive ratio: it blew up only if every layer from
    there to the input receives a blown-up gradient (an exact 0 is no signal at all, not a small one).
    """
    out: list[tuple[float, str]] = []
    best: tuple[float, str] | None = None
    for layer, ratio in reversed(rest):
        if vanishing:
            if best is None or ratio > best[0]:
                best = (ratio, layer)
        elif ratio > 0 and (best is None or ratio < best[0]):
            best = (ratio, layer)
        out.append(best if best is not None else (math.nan, layer))
    return out[::-1]


def _largest_gain(ref: tuple[str, float], rest: Sequence[tuple[str, float]]) -> tuple[str, str, float, float] | None:
    """Where the output-gradient norm grows most between consecutive layers in backward order (zeros skipped).

    Returns ``(layer, next_layer, gain, median of the other gains)``: ``next_layer``'s norm over ``layer``'s, the
    largest such ratio from the output end to the input end. In a chain, the gradient at ``next_layer``'s output is
    what ``layer``'s backward (and that of any unobserved module between them) makes of ``layer``'s output gradient,
    so ``layer`` is where the gradient is amplified. ``None`` with fewer than two positive norms.
    """
    chain = [ref, *((layer, norm) for layer, norm in rest if norm > 0)]
    gains = [(after[1] / before[1], before[0], after[0]) for before, after in zip(chain[:-1], chain[1:], strict=True)]
    if not gains:
        return None
    best = max(range(len(gains)), key=lambda i: gains[i][0])
    gain, layer, nxt = gains[best]
    others = [g for i, (g, _, _) in enumerate(gains) if i != best]
    return layer, nxt, gain, statistics.median(others) if others else math.nan


def _amplifier(ref_layer: str, rest: Sequence[tuple[str, float]], fired: str) -> tuple[str, str]:
    """``exploding_gradient``'s layer and the sentence saying where and how much the gradient grows.

    ``rest``: every other layer's ratio to the output end (``ref_layer``), in backward order; ``fired``: the layer
    from which the rule fired. Only the growth up to ``fired`` made it fire, so the gains are measured from the output
    end to ``fired``. The layer with the largest gain is named when it holds at least half of the orders of magnitude
    gained there (the growth happens in one place, as in a recurrent module); when the growth is spread over many
    layers (every block of a badly initialised stack amplifies a little), no layer is *the* amplifier and ``fired``,
    the first layer past the threshold, is named, with the largest gain in the message.
    """
    names = [layer for layer, _ in rest]
    upto = rest[: names.index(fired) + 1] if fired in names else list(rest)
    found = _largest_gain((ref_layer, 1.0), upto)  # ratios to the output end: the same gains as the norms
    if found is None:
        return fired, ""
    layer, nxt, gain, median = found
    # The growth from the output end to the fired layer, in orders of magnitude: the share the largest step holds.
    total = max(ratio for _, ratio in upto)
    share = min(1.0, math.log(gain) / math.log(total)) if gain > 1 and finite(total) and total > 1 else math.nan
    others = "" if not finite(median) else f"; the median of the other gains between consecutive layers is {median:.3g}"
    part = "" if not finite(share) else f", {share:.0%} of the orders of magnitude gained from the output end"
    gains = (
        f"{nxt}'s output gradient, the next observed one in backward order, is {gain:.3g} times {layer}'s (a layer"
        f" that keeps the gradient's scale has a gain near 1){part}{others}"
    )
    if finite(share) and share >= 0.5:
        return layer, f". The gradient grows most in the backward of {layer}: {gains}"
    return fired, f". The growth is spread over the layers up to {fired}, none holding most of it; the largest: {gains}"


@rule(order=5, phase="backward", stat="act_grad_norm")
def vanishing_gradient(ctx: Context) -> list[Found]:
    """From some layer to the input end, every output gradient is far smaller than the output end's."""
    return _gradient_scale(ctx, vanishing=True)


@rule(order=6, phase="backward", stat="act_grad_norm")
def exploding_gradient(ctx: Context) -> list[Found]:
    """From some layer to the input end, every output gradient is far larger than the output end's."""
    return _gradient_scale(ctx, vanishing=False)


def _gradient_scale(ctx: Context, vanishing: bool) -> list[Found]:
    ratios = _gradient_ratios(ctx)
    if ratios is None:
        return []
    ref_layer, ref_norm, rest = ratios
    threshold = ctx.config.vanishing_ratio if vanishing else ctx.config.exploding_ratio
    for i, ((layer, _), (ratio, extreme)) in enumerate(zip(rest, _input_side(rest, vanishing), strict=True)):
        if (ratio < threshold) if vanishing else (ratio > threshold):
            span = f"from {layer} to the input end ({plural(len(rest) - i, 'layer')})"
            if vanishing:
                title, named, where = "vanishing_gradient", layer, ""
                what = (
                    f"no layer {span} receives an output gradient of vanishing_ratio={threshold:g} times that of the"
                    f" output end ({ref_layer}, {ref_norm:.3g}); the largest is {ratio:.3g} times, at {extreme}"
                )
            else:  # named where the gradient grows, not where the growth is first seen
                title, (named, where) = "exploding_gradient", _amplifier(ref_layer, rest, layer)
                what = (
                    f"every layer {span} receives an output gradient more than exploding_ratio={threshold:g} times"
                    f" that of the output end ({ref_layer}, {ref_norm:.3g}); the smallest is {ratio:.3g} times, at"
                    f" {extreme}"
                )
            return [Found(named, ratio, f"{title} at step {ctx.step}: {what}{where}", threshold)]
    return []
