"""Rule ``nonfinite``: where a NaN/Inf was born.

The outputs, the output gradients, the parameter gradients and the weights are each searched in the order a NaN
propagates through them, and the sentinel's trip says what the statistics cannot
(``docs/rules.md#nonfinite-and-broken-weights``, ``docs/rules.md#nonfinite-and-functional-code``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from lightning_hookdiag.rules.context import Context, finite
from lightning_hookdiag.rules.findings import LOSS, ROOT, Finding, also, listing, plural

if TYPE_CHECKING:  # the rules only read a Trip's fields; importing the sentinel at run time would import torch
    from lightning_hookdiag.sentinel import Trip

__all__ = [
    "nonfinite",
]


def _origin(
    ctx: Context, bad: Mapping[str, float], phase: str, stat: str, describe: Callable[[str, list[str]], str]
) -> Finding | None:
    """The ``nonfinite`` finding for the earliest of the ``bad`` layers in ``phase`` order, if any.

    ``describe(origin, others)`` writes the message; the value is ``bad[origin]``.
    """
    if not bad:
        return None
    key = ctx.orders.forward_key if phase == "forward" else ctx.orders.backward_key
    origin, *others = sorted(bad, key=key)
    return Finding(
        rule="nonfinite",
        layer=origin,
        step=ctx.step,
        value=float(bad[origin]),
        threshold=0.0,
        message=describe(origin, others),
        phase=phase,
        stat=stat,
    )


def nonfinite(ctx: Context) -> list[Finding]:
    """Rule ``nonfinite``: the origin of each NaN/Inf (outputs, gradients, weights) and of a non-finite loss."""
    found = _nonfinite_origins(ctx)
    weights = _nonfinite_weights(ctx)
    if weights is not None:
        # A broken weight makes everything computed from it non-finite: only a forward origin upstream of every
        # broken weight is still an origin of its own (its inputs come from healthy layers).
        first_broken = ctx.orders.forward_key(weights.layer)
        found = [f for f in found if f.phase == "forward" and ctx.orders.forward_key(f.layer) < first_broken]
        found.append(weights)
    trip = ctx.trip
    # A step that was not replayed always says so; a replayed one only when its statistics explain nothing.
    if trip is not None and trip.kind in ("nonfinite_loss", "nonfinite_grad") and not (found and trip.replayed):
        what = "loss" if trip.kind == "nonfinite_loss" else "parameter gradients"
        if trip.replayed:
            detail = (
                "the observed layers' outputs and output gradients stayed finite, so the NaN/Inf arose outside them"
                " (in the loss function, in a module that is not selected, or in a non-deterministic op)"
            )
        else:
            detail = f"not replayed because {trip.reason}; step {ctx.step + 1} is sampled"
        found.append(
            Finding(
                rule="nonfinite",
                layer=LOSS,
                step=ctx.step,
                value=1.0,
                threshold=0.0,
                message=f"nonfinite: non-finite {what} at step {ctx.step}{_last_finite_loss(trip)}; {detail}",
                phase="forward",
                stat="loss",
            )
        )
    return found


def _last_finite_loss(trip: Trip | None) -> str:
    if trip is None or trip.last_finite_step is None:
        return ""
    return f" (the sentinel last saw a finite step at step {trip.last_finite_step})"


def _nonfinite_weights(ctx: Context) -> Finding | None:
    """A finding naming the parameters whose weights are already NaN/Inf before the step, if any."""
    bad = [
        p for p, norm in ctx.stat("param_norm").items() if isinstance(norm, (int, float)) and not math.isfinite(norm)
    ]
    if not bad:
        return None
    owners = sorted({ctx.orders.owner(p) for p in bad}, key=ctx.orders.forward_key)
    known = [ctx.last_finite[p] for p in bad if ctx.last_finite and p in ctx.last_finite]
    when = f"; they were last observed finite at step {max(known)}" if known else ""
    return Finding(
        rule="nonfinite",
        layer=owners[0],
        step=ctx.step,
        value=float(len(bad)),
        threshold=0.0,
        message=f"nonfinite: the weights are already non-finite before step {ctx.step}: {listing(bad)}"
        f" ({plural(len(bad), 'parameter')} in {plural(len(owners), 'layer')}, the first in forward order:"
        f" {owners[0]}){when}{_last_finite_loss(ctx.trip)}. The weights broke on an earlier step; every activation and"
        " gradient computed from them is non-finite as a consequence and is not blamed on its layer",
        phase="forward",
        stat="param_norm",
    )


def _nonfinite_origins(ctx: Context) -> list[Finding]:
    step = ctx.step
    # Activations: a NaN propagates forward, so the first non-finite layer in forward order is where it was born.
    acts = {k: v for k, v in ctx.stat("act_nonfinite").items() if finite(v) and v > 0}
    forward = _origin(
        ctx,
        acts,
        "forward",
        "act_nonfinite",
        lambda origin, others: (
            f"nonfinite: {acts[origin]:.0f} NaN/Inf output elements in {origin} at step {step}"
            f" (the first non-finite layer in forward order{also(others, ' after it', 'non-finite')})"
        ),
    )
    if forward is not None and ctx.trip is not None and ctx.trip.nan_entry == forward.layer:
        forward = _made_between(ctx, forward)
    # Output gradients: a NaN propagates backward, so the origin is the first non-finite layer in backward order.
    grads = {k: v for k, v in ctx.stat("act_grad_nonfinite").items() if finite(v) and v > 0}
    backward = _origin(
        ctx,
        grads,
        "backward",
        "act_grad_nonfinite",
        lambda origin, others: (
            f"nonfinite: {grads[origin]:.0f} NaN/Inf elements in the output gradient of {origin}"
            f" at step {step} (the first non-finite output gradient in backward order"
            f"{also(others, ' after it in backward order', 'affected')})"
        ),
    )
    # Parameter gradients are formed from their module's output gradient, so the same backward-order origin holds.
    by_layer: dict[str, list[tuple[str, float]]] = {}
    for param, norm in ctx.stat("param_grad_norm").items():
        if isinstance(norm, (int, float)) and not math.isfinite(norm):
            by_layer.setdefault(ctx.orders.owner(param), []).append((param, norm))
    params = _origin(
        ctx,
        {layer: float(len(p)) for layer, p in by_layer.items()},
        "backward",
        "param_grad_norm",
        lambda origin, others: (
            f"nonfinite: non-finite parameter gradient norm in {origin} at step {step}"
            f" ({', '.join(f'{p}={n}' for p, n in by_layer[origin])}; the first such layer in backward order"
            f"{also(others, '', 'affected')})"
        ),
    )
    return [f for f in (forward, backward, params) if f is not None]


def _made_between(ctx: Context, entry: Finding) -> Finding:
    """The forward ``nonfinite`` finding when the first non-finite layer's input was already non-finite.

    The replay's trace (:mod:`lightning_hookdiag.provenance`) named the innermost module whose forward made the
    NaN/Inf (``trip.nan_origin``), or none: it was made outside every module's forward. The finding names that module
    (:data:`ROOT` for the LightningModule's own code) and sorts where ``entry`` does.
    """
    assert ctx.trip is not None
    first = entry.layer
    position = ctx.orders.forward.get(first, -1)
    earlier = [name for name, p in ctx.orders.forward.items() if p < position]
    previous = max(earlier, key=ctx.orders.forward.__getitem__) if earlier else None
    origin = ctx.trip.nan_origin
    if origin is None:
        where = "outside every module's forward (in training_step, or a function it calls)"
    elif origin == ROOT:
        where = f"inside the LightningModule's own forward ({ROOT})"
    else:
        where = f"inside the forward of {origin}"
    after = f"after the output of {previous} and " if previous is not None else ""
    layer = origin or ROOT
    ctx.orders.place(layer, first)
    return replace(
        entry,
        layer=layer,
        message=f"nonfinite: the NaN/Inf was made {where}, {after}before the input of {first}, at step {ctx.step}:"
        f" functional code there (torch.log, sqrt, a division) made it, not a selected layer. {first}, the first"
        f" non-finite selected layer in forward order, received it ({entry.value:.0f} NaN/Inf output elements)",
    )
