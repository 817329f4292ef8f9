"""The trend rules: a step against the earlier ones of a :class:`~lightning_hookdiag._trends.History`.

``docs/rules.md#trend-rules``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Iterator

from lightning_hookdiag import _trends as trends
from lightning_hookdiag._names import LOSS
from lightning_hookdiag.rules._context import Context, finite
from lightning_hookdiag.rules._registry import Found, rule

__all__: list[str] = []


def _points(ctx: Context, stat: str, name: str, value: float, windows: int = 1) -> list[tuple[int, float]]:
    """The last ``windows * trend_window`` kept points of ``stat`` at ``name``, the current ``value`` last."""
    earlier = [] if ctx.history is None else [p for p in ctx.history.points(stat, name) if p[0] < ctx.step]
    return [*earlier, (ctx.step, value)][-windows * ctx.config.trend_window :]


@rule(order=16, phase="forward", stat="attn_logit_max")
def attention_logits(ctx: Context) -> Iterator[Found]:
    """Logits at the threshold, or rising steadily towards it."""
    for layer, value in ctx.stat("attn_logit_max").items():
        if finite(value) and (message := _attention_message(ctx, layer, value)):
            yield Found(layer, value, message, ctx.config.attn_logit_threshold)


def _attention_message(ctx: Context, layer: str, value: float) -> str:
    """The message of a logit at the threshold, or of a steady rise projected to cross it soon; else ``""``."""
    config, limit = ctx.config, ctx.config.attn_logit_threshold
    if value >= limit:
        start = _points(ctx, "attn_logit_max", layer, value, 4)[0]
        # At step 0 no update has run: the initial weights and the inputs' scale make it, not the learning rate.
        advice = (
            "qk-norm or a lower learning rate keeps it bounded"
            if start[0] != 0 or start[1] < limit
            else f"it was {start[1]:.4g} at step 0, before any optimizer update: not training but the scale of the"
            " inputs made it; look at the RMS of its inputs (an N(0, 1) embedding times sqrt(d_model) has an RMS of"
            " sqrt(d_model)) and at the initialisation of its query and key projections"
        )
        return (
            f"attention_logits: the largest attention logit |q.k|*scale of {layer} is {value:.4g} at step"
            f" {ctx.step}, at or above attn_logit_threshold={limit:g} (the softmax is close to one-hot; {advice})"
        )
    points = _points(ctx, "attn_logit_max", layer, value) if value >= config.attn_trend_floor else []
    if len(points) < config.trend_window or trends.rising_share(points) < 0.75:
        return ""
    crossing = trends.crossing_step(points, limit)
    if crossing is None:
        return ""
    spacing = statistics.median([b[0] - a[0] for a, b in zip(points, points[1:], strict=False)])
    if crossing - ctx.step > config.attn_trend_horizon * spacing:
        return ""
    first_step, first = points[0]
    return (
        f"attention_logits: the largest attention logit of {layer} rose from {first:.4g} at step {first_step} to"
        f" {value:.4g} at step {ctx.step} and, at its rate of {trends.log_slope(points):.3g} (log per step), crosses"
        f" attn_logit_threshold={limit:g} at about step {crossing}"
    )


SOFTMAX_LINK, SIGMOID_LINK = 2, 1
"""The values of ``output_link`` (for these rules, not logged): the loss read the output layer's output through a
softmax (cross entropy, NLL, softmax) or a sigmoid (BCE with logits, sigmoid); 0: neither. The larger one wins."""


def _read_through(ctx: Context, layer: str, link: int) -> bool:
    """Whether the loss read ``layer``'s output through ``link`` (``SIGMOID_LINK``: a sigmoid or a softmax).

    Only there are its outputs logits: ``docs/rules.md#the-output-logit-rules``.
    """
    seen = ctx.stat("output_link").get(layer)
    return finite(seen) and seen >= link


@rule(order=17, phase="forward", stat="logit_lse_mean")
def logit_drift(ctx: Context) -> Iterator[Found]:
    """The output logits' log Z drifted over the window while the loss stayed flat (a softmax reads them)."""
    config = ctx.config
    loss = ctx.stat("step_loss").get(LOSS)
    if not finite(loss):
        return
    losses = dict(_points(ctx, "step_loss", LOSS, float(loss), 4))
    for layer, value in ctx.stat("logit_lse_mean").items():
        # Only a softmax is blind to log Z: a regression head's or a sigmoid's shift moves the loss.
        if not (finite(value) and _read_through(ctx, layer, SOFTMAX_LINK)):
            continue
        points = _points(ctx, "logit_lse_mean", layer, value, 4)
        if len(points) < config.trend_window:
            continue
        # The earliest kept step from which log Z moved far while the loss stayed flat: a slow drift is caught once
        # it has accumulated, over up to 4 * trend_window sampled steps.
        for start, first in points[:-1]:
            if (old_loss := losses.get(start)) is None:
                continue
            drift, change = value - first, abs(loss - old_loss)
            if abs(drift) >= config.logit_drift_nats and change <= config.drift_loss_tolerance * abs(old_loss):
                message = (
                    f"logit_drift: the output logits of {layer} drifted: log Z (logit_lse_mean) moved by {drift:+.3g}"
                    f" nats from step {start} to step {ctx.step} (logit_drift_nats={config.logit_drift_nats:g}) while"
                    f" the loss changed by {change:.3g} (from {old_loss:.4g}); the softmax does not pin log Z, a z-loss"
                    " (1e-4 * log Z**2) does"
                )
                yield Found(layer, drift, message, config.logit_drift_nats)
                break


_UNBOUNDED_SLOPE = 10.0
"""``unbounded_loss``: the smallest fall of the loss per unit of growth of the largest ``|logit|``.

A cross-entropy with probability targets moves by at most twice the largest change of a logit (its gradient
``p - y`` has an L1 norm of at most 2), a Gaussian likelihood by half the change of its log-variance; BCE on a target
of 255 falls by up to 254 per unit of logit."""


@rule(order=18, phase="forward", stat="logit_absmax")
def unbounded_loss(ctx: Context) -> Iterator[Found]:
    """A negative loss that keeps falling while the logits (read by a softmax or a sigmoid) keep growing."""
    config = ctx.config
    loss = ctx.stat("step_loss").get(LOSS)
    if not finite(loss) or loss >= 0:  # a loss of a bounded family (cross-entropy, MSE) is never negative
        return
    losses = dict(_points(ctx, "step_loss", LOSS, float(loss), 4))
    growth = config.unbounded_growth
    for layer, value in ctx.stat("logit_absmax").items():
        # Its bound is that of a loss with probability targets: a regression head's loss has none to compare with.
        if not (finite(value) and _read_through(ctx, layer, SIGMOID_LINK)):
            continue
        points = [(s, v) for s, v in _points(ctx, "logit_absmax", layer, value, 4) if s in losses]
        if len(points) < config.trend_window:
            continue
        # Medians of thirds of the span: one noisy batch does not make or break a trend.
        third = len(points) // 3
        parts = [points[:third], points[third:-third], points[-third:]]
        logits = [statistics.median([v for _, v in part]) for part in parts]
        early, middle, late = (statistics.median([losses[s] for s, _ in part]) for part in parts)
        falls = (early - middle, middle - late)
        grown = logits[2] - logits[0]
        if not (
            late < 0
            and early - late >= (growth - 1) * abs(early)
            and early - late >= _UNBOUNDED_SLOPE * grown
            # A bounded loss that goes negative (a Gaussian likelihood) slows down as it nears its minimum; one with
            # no minimum falls as fast as the logits grow.
            and falls[1] > 0
            and falls[1] >= 0.5 * falls[0]
            and logits[0] > 0
            and logits[2] >= growth * logits[0]
            and logits[1] < logits[2]
        ):
            continue
        message = (
            f"unbounded_loss: the loss fell from {early:.4g} to {late:.4g} (medians of the first and last thirds of"
            f" steps {points[0][0]} to {points[-1][0]}) and keeps falling while the largest |logit| of {layer} grew"
            f" {logits[2] / logits[0]:.3g}x, from {logits[0]:.3g} to {logits[2]:.3g} (unbounded_growth={growth:g}); the"
            f" loss fell {(early - late) / grown:.3g} per unit of logit, more than a loss with probability targets can:"
            " the loss has no minimum, so the logits grow without bound. A loss of a bounded family (cross-entropy,"
            " BCE) below 0 means targets outside its domain: BCEWithLogits on 0/255 masks (divide by 255), labels that"
            " are not probabilities"
        )
        yield Found(layer, logits[2] / logits[0], message, growth)


_REAL_UPDATE = 1e-2
"""``update_jump``: the smallest median earlier update of a layer, relative to its weights, as a share of the median
layer's, that a jump is measured against.

Below it the layer was barely moving: a residual branch behind a zero-initialised norm (timm's ``zero_init_last``)
that AdamW's weight decay alone moved by ``lr * wd`` (1e-5 of its norm) while the median layer moved by 8e-3. Such
a layer that starts to learn is no jump; a BatchNorm's normal updates sit at 0.08 of the median layer's."""


def _layer_updates(ctx: Context) -> dict[str, list[tuple[int, float, float]]]:
    """Per layer, ``(step, update norm, weight norm)`` over its parameters, oldest first.

    The update norm is ``param_update_ratio * param_norm``; only parameters with a positive weight norm have a ratio.
    """
    by_step: dict[str, dict[int, list[tuple[float, float]]]] = {}
    norms_now = ctx.stat("param_norm")
    for param, ratio in ctx.stat("param_update_ratio").items():
        norm = norms_now.get(param)
        if not (finite(ratio) and finite(norm)):
            continue
        norms = dict(_points(ctx, "param_norm", param, norm))
        steps = by_step.setdefault(ctx.orders.owner(param), {})
        for step, r in dict(_points(ctx, "param_update_ratio", param, ratio)).items():
            if step in norms and r >= 0 and norms[step] > 0:
                steps.setdefault(step, []).append((r * norms[step], norms[step]))
    out: dict[str, list[tuple[int, float, float]]] = {}
    for layer, steps in by_step.items():
        if ctx.step in steps:  # a layer whose parameters did not all update now is not compared
            out[layer] = [
                (s, _norm(u for u, _ in parts), _norm(w for _, w in parts)) for s, parts in sorted(steps.items())
            ]
    return out


def _norm(parts: Iterable[float]) -> float:
    """The 2-norm of a concatenation, from the 2-norms of its parts."""
    return math.sqrt(sum(x * x for x in parts))


@rule(order=19, phase="backward", stat="param_update_ratio")
def update_jump(ctx: Context) -> Iterator[Found]:
    """A layer's update jumped far above its own recent ones and the typical jump, from a baseline that moved."""
    config = ctx.config
    jumps: dict[str, tuple[float, float]] = {}
    moved: dict[str, float] = {}  # per layer, the median earlier update relative to its weights
    for layer, points in _layer_updates(ctx).items():
        *earlier, (_, now, _) = points
        if len(earlier) < config.trend_window - 1:
            continue
        own = statistics.median([u for _, u, _ in earlier])
        if own > 0:
            jumps[layer] = (now / own, own)
            moved[layer] = statistics.median([u / w for _, u, w in earlier])
    if not jumps:
        return
    # A learning-rate schedule (warm-up) moves every layer's update together: compare with the typical jump too.
    typical = statistics.median([j for j, _ in jumps.values()])
    typical_moved = statistics.median(moved.values())
    for layer, (jump, own) in jumps.items():
        if moved[layer] < _REAL_UPDATE * typical_moved:
            continue  # its earlier updates were ~0: it starts to learn, and no ratio to them is a jump
        if jump >= config.update_jump_ratio and jump >= config.update_jump_ratio * typical:
            message = (
                f"update_jump: the optimizer update of {layer} at step {ctx.step} (the norm of its parameters' change)"
                f" is {jump:.3g}x the median {own:.3g} of its last {config.trend_window - 1} sampled updates"
                f" (update_jump_ratio={config.update_jump_ratio:g}; the median layer's is {typical:.3g}x), a precursor"
                " of a loss spike"
            )
            yield Found(layer, jump, message, config.update_jump_ratio)
