"""The rules on what the layers' forward does, over one step's activation statistics and module modes.

:func:`activation_scale` is the per-layer scale that ``loss_spike`` compares too (``docs/rules.md#the-rules``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from lightning_hookdiag._names import BATCH
from lightning_hookdiag.rules._context import Context, finite, stat
from lightning_hookdiag.rules._findings import also, listing, plural
from lightning_hookdiag.rules._gradients import InputSide, is_dead, stopped_by_dead
from lightning_hookdiag.rules._registry import Found, rule

__all__ = ["SATURATING_TYPES", "SCALED_TYPES", "activation_scale"]


SATURATING_TYPES: tuple[str, ...] = ("Tanh", "Sigmoid")
"""Module class names the ``saturation`` rule checks."""


@rule(order=2, phase="forward", stat="training", reads=["eval_mode"])
def eval_mode(ctx: Context) -> Iterator[Found]:
    """The first module, in forward order, that ran in eval mode in a training step."""
    # A stable sort: modules of unknown position stay in the order they were given.
    names = sorted(ctx.fact("eval_mode", {}), key=lambda n: ctx.orders.forward_key(n)[:2])
    first, kind = names[0], ctx.fact("eval_mode", {})[names[0]]
    effect = (
        "drops nothing, so the regularisation the model was built with is off"
        if "Dropout" in kind
        else "normalises with its running statistics instead of the batch's and stops updating them"
    )
    others = [f"{n} ({ctx.fact('eval_mode', {})[n]})" for n in names[1:]]
    verb = "is" if len(others) == 1 else "are"
    also = f"; {plural(len(others), 'more module')} {verb} in eval mode too: {listing(others)}" if others else ""
    message = (
        f"eval_mode at step {ctx.step}: {first} ({kind}) ran with training=False in a training step while the"
        f" parameters it trains require grad: it {effect}. Is a model.eval() of an inner evaluation left on? Call"
        f" .train() after it{also}"
    )
    yield Found(first, len(names), message)


@rule(order=3, phase="forward", stat="act_dead_frac")
def dead_units(ctx: Context) -> Iterator[Found]:
    """One finding per chain of dead layers, at its first layer in forward order, with what it stops in backward.

    Dead layers count as one chain when no tracked layer (one with an ``act_dead_frac``) between them in forward order
    is alive: a layer whose units are nearly all ``<= 0`` passes nearly nothing but constants to the next, so every
    ReLU-family layer after it in a plain stack is dead or alive on a constant input, and its own bias decides which.
    A live tracked layer between two dead ones carries a signal again: the later one has a cause of its own
    (``docs/rules.md#dead_units-one-chain-one-finding``).
    """
    threshold = ctx.config.dead_frac_threshold
    fracs = ctx.stat("act_dead_frac")
    stop = stopped_by_dead(ctx)
    for chain in _dead_chains(ctx):
        origin, others = chain[0], chain[1:]
        frac = fracs[origin]
        where = "" if not others else "; the first dead layer in forward order"
        spreads = also(others, " after it", "dead", last=True)
        between = ", with no live ReLU-family layer between them" if others else ""
        stops = _stops(ctx, stop) if stop is not None and stop.above in chain else ""
        message = (
            f"dead_units: {frac:.1%} of the units of {origin} were <= 0 for every sample of step {ctx.step}"
            f" (dead_frac_threshold={threshold:g}{where}{spreads}{between}){stops}"
        )
        yield Found(origin, frac, message, threshold)


def _dead_chains(ctx: Context) -> list[list[str]]:
    """The dead layers in forward order, cut into chains wherever a tracked layer between them is alive."""
    tracked = sorted((k for k, v in ctx.stat("act_dead_frac").items() if finite(v)), key=ctx.orders.forward_key)
    chains: list[list[str]] = []
    previous_dead = False
    for layer in tracked:
        dead = is_dead(ctx, layer)
        if dead and previous_dead:
            chains[-1].append(layer)
        elif dead:
            chains.append([layer])
        previous_dead = dead
    return chains


def _stops(ctx: Context, side: InputSide) -> str:
    """The sentence for the vanishing gradient that a dead layer of the chain made: its consequence, not a finding."""
    if side.ratio == 0:
        ratio, learns = "exactly 0", "so their weights get no gradient from the loss"
    else:
        ratio, learns = f"{side.ratio:.3g} times, at {side.extreme}", "so their weights get almost none"
    return (
        f". Dead units pass no gradient back: below {side.above}, no layer from {side.layer} to the input end"
        f" ({plural(side.span, 'layer')}) receives an output gradient of vanishing_ratio="
        f"{ctx.config.vanishing_ratio:g} times that of the output end ({side.ref_layer}, {side.ref_norm:.3g}); the"
        f" largest is {ratio}, {learns}. This is the vanishing gradient from {side.layer}, a"
        " consequence of the dead units, not a finding of its own"
    )


@rule(order=7, phase="forward", stat="act_std")
def saturation(ctx: Context) -> Iterator[Found]:
    """Every Tanh/Sigmoid layer whose proven saturated share reaches ``saturation_frac``."""
    level, frac = ctx.config.saturation_level, ctx.config.saturation_frac
    means, stds = ctx.stat("act_mean"), ctx.stat("act_std")
    for layer, kind in ctx.fact("layer_types", {}).items():
        kind = kind.rpartition(".")[2]  # accept "torch.nn.Tanh" as well as "Tanh"
        mean, std = means.get(layer, math.nan), stds.get(layer, math.nan)
        if kind not in SATURATING_TYPES or not (finite(mean) and finite(std)):
            continue
        # Second moment of z in [-1, 1]: z = y for Tanh, z = 2y - 1 for Sigmoid.
        m2 = std * std + mean * mean if kind == "Tanh" else 4 * std * std + (2 * mean - 1) * (2 * mean - 1)
        bound = min(1.0, max(0.0, (m2 - level * level) / (1 - level * level)))
        if bound >= frac:
            z = "|y|" if kind == "Tanh" else "|2y - 1|"
            message = (
                f"saturation: at least {bound:.1%} of the outputs of {layer} ({kind}) have {z} > {level:g} at step"
                f" {ctx.step} (from act_mean={mean:.3g}, act_std={std:.3g}; saturation_frac={frac:g}): their local"
                f" gradient is below {1 - level * level:.0%} of its maximum"
            )
            yield Found(layer, bound, message, frac)


def activation_scale(values: Mapping[str, Mapping[str, float]]) -> tuple[str, dict[str, float]]:
    """Per-layer activation scale: RMS of the finite outputs from act_mean/act_std, else act_absmax."""
    means, stds = stat(values, "act_mean"), stat(values, "act_std")
    if means and stds:
        rms = {k: math.hypot(means[k], stds[k]) for k in means.keys() & stds.keys()}  # no OverflowError at 1e200
        return "act_std", {k: v for k, v in rms.items() if finite(v)}
    return "act_absmax", {k: v for k, v in stat(values, "act_absmax").items() if finite(v)}


# The opt-in precision statistics are logged per target dtype: "<base>_<target>".
_OVERFLOW_STATS = (
    ("act_grad_overflow_frac_", "backward", "output gradients"),
    ("act_overflow_frac_", "forward", "outputs"),
)


@rule(order=8, phase="forward", stat="act_overflow_frac")
def precision_headroom(ctx: Context) -> Iterator[Found]:
    """Every layer whose share at risk in a target dtype is too large."""
    threshold = ctx.config.overflow_frac_threshold
    for name, per_layer in ctx.values.items():
        for head, phase, what in _OVERFLOW_STATS:
            if name.startswith(head):
                for layer, frac in per_layer.items():
                    if finite(frac) and frac > threshold:
                        message = (
                            f"precision_headroom: {frac:.3g} of the non-zero {what} of {layer} at step {ctx.step}"
                            f" would overflow {name[len(head) :]} or sit within 2x of its maximum"
                            f" (overflow_frac_threshold={threshold:g})"
                        )
                        yield Found(layer, frac, message, threshold, phase, name)


@rule(order=13, phase="forward", stat="act_std", uses=["param_facts"])
def input_scale(ctx: Context) -> Iterator[Found]:
    """The first layer's inputs, on the fit's first sampled step, are far too large or far too small."""
    # Only while the weights are those the fit started from (no earlier sampled step): later, a first layer whose
    # weights blew up (a learning rate too high) has a large output RMS from perfectly scaled inputs.
    if ctx.baseline is not None:
        return
    limit = ctx.config.input_scale_limit
    stat, scale = activation_scale(ctx.values)
    first = min((layer for layer in scale if layer in ctx.orders.forward), key=ctx.orders.forward_key, default=None)
    if first is not None and scale[first] > limit:
        message = (
            f"input_scale: the outputs of {first}, the first layer in forward order, have an RMS of {scale[first]:.3g}"
            f" at step {ctx.step}, the first sampled step of the fit (input_scale_limit={limit:g}): its inputs are"
            " likely far from unit scale (raw 0-255 pixels, unnormalised features); scale them to mean 0 and std 1"
        )
        yield Found(first, scale[first], message, limit, stat=stat)
        return
    yield from _inputs_too_small(ctx)


SCALED_TYPES: tuple[str, ...] = ("Linear", "Conv1d", "Conv2d", "Conv3d")
"""Module class names whose input scale ``input_scale`` estimates from the weight gradient (``weight[o, ...]``
multiplies one input vector: a sample's features, a convolution's patch)."""


PASS_THROUGH_TYPES: tuple[str, ...] = (
    "Flatten",
    "Unflatten",
    "Identity",
    "Dropout",
    "Dropout1d",
    "Dropout2d",
    "Dropout3d",
    "AlphaDropout",
)
"""Parameter-free module class names that pass the inputs on with their scale, which ``input_scale`` looks past."""


def _first_weighted(ctx: Context) -> str | None:
    """The first layer in forward order, past :data:`PASS_THROUGH_TYPES` only, if it owns a tracked parameter.

    ``None`` when another layer comes first: one whose parameters are not tracked (a frozen stem, a body behind a
    stray ``.detach()``) makes what the next layer reads no longer the inputs.
    """
    params = set(ctx.stat("param_norm")) | set(ctx.fact("param_facts", {}))
    owners = {ctx.orders.owner(p) for p in params}
    for layer in ctx.orders.forward_layers:
        if layer in owners:
            return layer
        if ctx.fact("layer_types", {}).get(layer, "").rpartition(".")[2] not in PASS_THROUGH_TYPES:
            return None
    return None


def _inputs_too_small(ctx: Context) -> Iterator[Found]:
    """The first weighted layer's input vectors, estimated from ``||dL/dW|| / ||dL/dy||``, are far below unit norm.

    For ``y = W x + b`` summed over the batch (and a convolution's positions), ``dL/dW = sum dL/dy x^T``: with the
    output gradient uncorrelated with the inputs, ``||dL/dW||^2 ~ ||dL/dy||^2 E||x||^2``, so the ratio of the two
    norms estimates the RMS norm of one input vector, whatever the layer's width (a one-hot row has norm 1); the
    weights do not enter it. Measured margins: ``docs/rules.md#input_scale-both-ends``.
    """
    floor = ctx.config.input_scale_floor
    layer = _first_weighted(ctx)
    if layer is None or ctx.fact("layer_types", {}).get(layer, "").rpartition(".")[2] not in SCALED_TYPES:
        return  # an Embedding reads indices, a norm layer rescales its inputs itself: no input scale to check
    weight = f"{layer}.weight"
    fact = ctx.fact("param_facts", {}).get(weight)
    g_weight = ctx.stat("param_grad_norm").get(weight, math.nan)
    g_out = ctx.stat("act_grad_norm").get(layer, math.nan)
    if fact is None or len(fact.shape) < 2 or not (finite(g_weight) and finite(g_out) and g_out > 0):
        return
    norm = g_weight / g_out
    if norm >= floor:
        return
    fan_in = math.prod(fact.shape[1:])
    message = (
        f"input_scale: the inputs of {layer}, the first layer with parameters in forward order, have an estimated"
        f" norm of {norm:.3g} per input vector (RMS {norm / math.sqrt(fan_in):.3g} over its {fan_in} inputs) at step"
        f" {ctx.step}, the first sampled step of the fit, from its weight gradient norm {g_weight:.3g} over its"
        f" output gradient norm {g_out:.3g} (input_scale_floor={floor:g}): its inputs are far below unit scale"
        " (features divided by 255 twice, values in the wrong unit, a mask of 1e-6), so its weights barely shape"
        " its outputs and their gradient is as small; scale them to mean 0 and std 1"
    )
    yield Found(layer, norm, message, floor, phase="backward", stat="param_grad_norm")


@rule(order=20, phase="forward", stat="batch_repeated")
def repeated_batch(ctx: Context) -> Iterator[Found]:
    """Every row of the step's training batch was one sample repeated."""
    if ctx.stat("batch_repeated").get(BATCH) == 1.0:
        message = (
            f"repeated_batch at step {ctx.step}: every row of the training batch is the same sample (each tensor of 2"
            " or more dims, at least 8 rows): the model trains on one example while its loss falls; does the"
            " Dataset's __getitem__ use its index, and do the sampler and the collate function keep the samples"
            " apart?"
        )
        yield Found(BATCH, 1.0, message)
