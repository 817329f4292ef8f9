"""Rule ``nonfinite``: where a NaN/Inf was born, each kind searched in the order a NaN propagates through it.

``docs/rules.md#nonfinite-and-broken-weights``, ``docs/rules.md#nonfinite-and-functional-code``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from lightning_hookdiag._names import BATCH, LOSS, ROOT
from lightning_hookdiag.rules._context import Context, ParamFacts, finite
from lightning_hookdiag.rules._findings import also, listing, plural, spread
from lightning_hookdiag.rules._registry import Found, rule

__all__: list[str] = []


def _nonfinite(values: Iterable[tuple[str, object]]) -> list[str]:
    return [p for p, v in values if isinstance(v, (int, float)) and not math.isfinite(v)]


@rule(order=0, phase="forward", stat="act_nonfinite")
def nonfinite(ctx: Context) -> list[Found]:
    """The origin of each NaN/Inf (outputs, gradients, weights) and of a non-finite loss."""
    found = _nonfinite_origins(ctx)
    trip = ctx.trip
    if trip is not None and trip.bad_batch:
        # Every layer that received the batch is non-finite as a consequence: the first selected layer, and a NaN
        # traced to code outside every module's forward (or the LightningModule's own), which is where it entered.
        first = next((n for n in ctx.orders.forward_layers if n != ROOT), None)  # ROOT may sit beside the first
        entered = {first, ROOT} if trip.nan_origin is None else {first}
        found = [_nonfinite_batch(ctx), *(f for f in found if not (f.phase == "forward" and f.layer in entered))]
    found = _with_broken_by_step(ctx, found)
    if (weights := _nonfinite_weights(ctx)) is not None:
        # A broken weight makes everything computed from it non-finite: only a forward origin upstream of every
        # broken weight is still an origin of its own (its inputs come from healthy layers).
        first_broken = ctx.orders.forward_key(weights.layer)
        found = [f for f in found if f.phase == "forward" and ctx.orders.forward_key(f.layer) < first_broken]
        found.append(weights)
    # A step that was not replayed always says so; a replayed one only when its statistics explain nothing.
    if trip is not None and trip.kind in ("nonfinite_loss", "nonfinite_grad") and not (found and trip.replayed):
        what = "loss" if trip.kind == "nonfinite_loss" else "parameter gradients"
        detail = (
            "the observed layers' outputs and output gradients stayed finite, so the NaN/Inf arose outside them"
            " (in the loss function, in a module that is not selected, or in a non-deterministic op)"
            if trip.replayed
            else f"not replayed because {trip.reason}; step {ctx.step + 1} is sampled"
        )
        message = f"nonfinite: non-finite {what} at step {ctx.step}{_last_finite_loss(ctx)}; {detail}"
        found.append(Found(LOSS, 1.0, message, stat="loss"))
    return found


def _last_finite_loss(ctx: Context) -> str:
    if ctx.trip is None or ctx.trip.last_finite_step is None:
        return ""
    return f" (the sentinel last saw a finite step at step {ctx.trip.last_finite_step})"


def _nonfinite_batch(ctx: Context) -> Found:
    assert ctx.trip is not None
    bad = list(ctx.trip.bad_batch)
    held = ", ".join(f"{path} holds {n:g} NaN/Inf of its {size:g} elements" for path, n, size in bad[:3])
    more = f" (and {plural(len(bad) - 3, 'more tensor')})" if len(bad) > 3 else ""
    message = (
        f"nonfinite: the data is non-finite: the batch of step {ctx.step} already held NaN/Inf before any layer ran:"
        f" {held}{more}. Every layer computed from it is non-finite as a consequence and is not blamed; look at the"
        " data pipeline (a standardisation by a per-feature std that is 0 for a constant feature, a log of 0,"
        " missing values read as NaN)"
    )
    return Found(BATCH, sum(n for _, n, _ in bad), message, phase="forward", stat="batch_nonfinite")


def _with_broken_by_step(ctx: Context, found: list[Found]) -> list[Found]:
    """``found`` with the weights the optimizer step made NaN/Inf, where their gradients were finite before it.

    The update ratio ``||w_after - w_before|| / ||w_before||`` is non-finite exactly when ``w_after`` is, given a
    finite, non-zero ``w_before`` (a weight norm of 0 has no ratio). The update made the NaN/Inf only when every
    gradient of the step was finite: a non-finite gradient elsewhere reaches finite ones before the update (clipping
    by the total gradient norm, which is then non-finite, multiplies every gradient by it), so the origin stays where
    the gradient first went non-finite, and that finding says which weights the step spread it to.
    """
    norms, grads = ctx.positive("param_norm"), ctx.stat("param_grad_norm")
    bad = [p for p in _nonfinite(ctx.stat("param_update_ratio").items()) if p in norms and finite(grads.get(p))]
    if not bad:
        return found
    owners = ctx.orders.owners(bad)
    origin = next((i for i, f in enumerate(found) if f.phase == "backward"), None)
    if origin is None and (ctx.trip is None or ctx.trip.kind != "nonfinite_grad"):
        message = (
            f"nonfinite: the optimizer update of step {ctx.step} wrote NaN/Inf into finite weights from finite"
            f" gradients: {listing(bad)} ({spread(bad, owners)}) were finite with finite gradients before the step and"
            f" are not after it. {_step_cause(ctx.fact('param_facts', {}).get(bad[0]))}"
        )
        return [*found, Found(owners[0], len(bad), message, phase="backward", stat="param_update_ratio")]
    if origin is None:  # a non-finite gradient that no observed layer shows: the loss finding says so
        return found
    note = (
        f"; the optimizer update then made {listing(bad)} ({spread(bad, owners)}) non-finite too, whose gradients were"
        " finite before the step: the non-finite gradient reached them there (clipping by the total gradient norm,"
        " gradient_clip_val, multiplies every gradient by that norm, here non-finite)"
    )
    first = found[origin]
    return [*found[:origin], first._replace(message=first.message + note), *found[origin + 1 :]]


def _step_cause(fact: ParamFacts | None) -> str:
    if fact is None or not fact.held:
        return "Likely an eps or a learning rate below what the weights' dtype can hold, or an update beyond its range"
    dtype, tiny = fact.dtype, fact.tiny
    if fact.opt_eps is not None and 0 < fact.opt_eps < tiny / 2:
        return (
            f"Likely cause: the optimizer's eps={fact.opt_eps:g} is below half the smallest {dtype} number"
            f" ({tiny:.3g}), so it rounds to 0 in the {dtype} optimizer state, and Adam-like updates divide by"
            f" sqrt(v) + 0 = 0 where a squared gradient underflows; raise eps (1e-4 in float16) or keep float32"
            " master weights (precision='16-mixed' or 'bf16-mixed')"
        )
    if finite(fact.lr) and 0 < fact.lr < tiny / 2:
        return (
            f"Likely cause: the learning rate {fact.lr:g} is below half the smallest {dtype} number ({tiny:.3g}); keep"
            " float32 master weights (precision='16-mixed' or 'bf16-mixed')"
        )
    return (
        f"Likely cause: an eps or learning rate below what {dtype} can hold, or an update beyond its range (lr="
        f"{fact.lr:g}{'' if fact.opt_eps is None else f', eps={fact.opt_eps:g}'})"
    )


def _nonfinite_weights(ctx: Context) -> Found | None:
    bad = _nonfinite(ctx.stat("param_norm").items())
    if not bad:
        return None
    owners = ctx.orders.owners(bad)
    known = [ctx.last_finite[p] for p in bad if p in ctx.last_finite]
    when = f"; they were last observed finite at step {max(known)}" if known else ""
    if known and max(known) == ctx.step - 1:
        when += f", before its optimizer step: step {ctx.step - 1}'s update made them non-finite"
    elif ctx.trip is not None and ctx.trip.last_finite_step == ctx.step - 1 and ctx.trip.kind == "nonfinite_loss":
        when += (
            f"; the loss of step {ctx.step - 1} was still finite, so step {ctx.step - 1}'s optimizer update most"
            " likely made them non-finite"
        )
    message = (
        f"nonfinite: the weights are already non-finite before step {ctx.step}: {listing(bad)}"
        f" ({spread(bad, owners)}){when}{_last_finite_loss(ctx)}. The weights broke on an earlier step; every"
        " activation and gradient computed from them is non-finite as a consequence and is not blamed on its layer"
    )
    return Found(owners[0], len(bad), message, phase="forward", stat="param_norm")


def _nonfinite_origins(ctx: Context) -> list[Found]:
    found: list[Found] = []
    # Activations: a NaN propagates forward, so the first non-finite layer in forward order is where it was born.
    acts = ctx.positive("act_nonfinite")
    if acts:
        origin, *others = sorted(acts, key=ctx.orders.forward_key)
        message = (
            f"nonfinite: {acts[origin]:.0f} NaN/Inf output elements in {origin} at step {ctx.step}"
            f" (the first non-finite layer in forward order{also(others, ' after it', 'non-finite')})"
        )
        entry = Found(origin, acts[origin], message, phase="forward", stat="act_nonfinite")
        found.append(_made_between(ctx, entry) if ctx.trip is not None and ctx.trip.nan_entry == origin else entry)
    # Output gradients: a NaN propagates backward, so the origin is the first non-finite layer in backward order.
    grads = ctx.positive("act_grad_nonfinite")
    if grads:
        origin, *others = sorted(grads, key=ctx.orders.backward_key)
        message = (
            f"nonfinite: {grads[origin]:.0f} NaN/Inf elements in the output gradient of {origin}"
            f" at step {ctx.step} (the first non-finite output gradient in backward order"
            f"{also(others, ' after it in backward order', 'affected')})"
        )
        found.append(Found(origin, grads[origin], message, phase="backward", stat="act_grad_nonfinite"))
    # Parameter gradients are formed from their module's output gradient, so the same backward-order origin holds.
    by_layer: dict[str, list[tuple[str, float]]] = {}
    grad_norms = ctx.stat("param_grad_norm")
    for param in _nonfinite(grad_norms.items()):
        by_layer.setdefault(ctx.orders.owner(param), []).append((param, grad_norms[param]))
    if by_layer:
        origin, *others = sorted(by_layer, key=ctx.orders.backward_key)
        message = (
            f"nonfinite: non-finite parameter gradient norm in {origin} at step {ctx.step}"
            f" ({', '.join(f'{p}={n}' for p, n in by_layer[origin])}; the first such layer in backward order"
            f"{also(others, '', 'affected')})"
        )
        found.append(Found(origin, float(len(by_layer[origin])), message, phase="backward", stat="param_grad_norm"))
    return found


def _made_between(ctx: Context, entry: Found) -> Found:
    """The forward finding, moved to ``trip.nan_origin``, when the first non-finite layer's input was non-finite."""
    assert ctx.trip is not None
    first = entry.layer
    position = ctx.orders.forward.get(first, -1)
    previous = max(((p, n) for n, p in ctx.orders.forward.items() if p < position), default=(0, None))[1]
    origin = ctx.trip.nan_origin
    if origin is None:
        where = "outside every module's forward (in training_step, or a function it calls)"
    elif origin == ROOT:
        where = f"inside the LightningModule's own forward ({ROOT})"
    else:
        where = f"inside the forward of {origin}"
    after = f"after the output of {previous} and " if previous is not None else ""
    return entry._replace(
        layer=origin or ROOT,
        message=f"nonfinite: the NaN/Inf was made {where}, {after}before the input of {first}, at step {ctx.step}:"
        f" functional code there (torch.log, sqrt, a division) made it, not a selected layer. {first}, the first"
        f" non-finite selected layer in forward order, received it ({entry.value:.0f} NaN/Inf output elements)",
    )
