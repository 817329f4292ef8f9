"""The rules on what the optimizer step did to the weights (``docs/rules.md#the-rules``)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from lightning_hookdiag.rules._context import Context, ParamFacts, finite, stat
from lightning_hookdiag.rules._findings import MAX_LISTED, listing, plural, spread
from lightning_hookdiag.rules._registry import Found, rule

__all__ = ["moved_mass_bound"]


def _slow_layers(ctx: Context, values: Mapping[str, Mapping[str, float]]) -> dict[str, tuple[float, float]] | None:
    """Each moved layer's ``(||dw|| / ||w||, ||dw|| / ||g||)`` if every one is slow (``update_ratio``), else ``None``.

    Over all of a layer's tracked parameters together; the second ratio is the learning rate the step effectively
    applied (SGD's ``lr``). Left out: a layer whose weights are all exactly 0 (a zero-initialised norm), and one whose
    gradient is exactly 0 (a branch behind a zero-initialised norm), which moves by weight decay alone
    (``lr * weight_decay``, 1e-5 with AdamW's defaults).
    """
    ratios, norms, grads = (stat(values, s) for s in ("param_update_ratio", "param_norm", "param_grad_norm"))
    sums: dict[str, list[float]] = {}  # layer -> squared norms of [update, weights, gradient]
    for param, ratio in ratios.items():
        norm, grad = norms.get(param, math.nan), grads.get(param, math.nan)
        if finite(ratio) and finite(norm) and finite(grad) and ratio >= 0:
            layer = sums.setdefault(ctx.orders.owner(param), [0.0, 0.0, 0.0])
            layer[0] += (ratio * norm) * (ratio * norm)  # inf, not OverflowError
            layer[1] += norm * norm
            layer[2] += grad * grad
    updates = {k: (math.sqrt(u / w), math.sqrt(u / g)) for k, (u, w, g) in sums.items() if w > 0 and g > 0}
    # Exactly 0 is no update at all (a parameter outside every optimizer group, lr 0 in a warm-up): not a low one.
    moved = {k: u for k, u in updates.items() if u[0] > 0}
    low, lr_low = ctx.config.update_ratio_low, ctx.config.effective_lr_low
    if moved and all(ratio < low and lr < lr_low for ratio, lr in moved.values()):
        return moved
    return None


def _held_low(fact: ParamFacts) -> bool:
    """Whether an LR scheduler holds the parameter's lr below ``_SCHEDULED_LOW`` of its base lr (a warm-up)."""
    base = fact.base_lr
    return base is not None and base > 0 and finite(fact.lr) and fact.lr < _SCHEDULED_LOW * base


@rule(order=9, phase="forward", stat="param_update_ratio", reads=["baseline"])
def update_ratio(ctx: Context) -> list[Found]:
    """Every layer's update is too small for its weights and its gradient."""
    assert ctx.baseline is not None
    # The whole network, not one layer: a norm layer's weights of 1 move by at most about lr per step under Adam,
    # so one layer alone is below 1e-5 in healthy fine-tuning. And small against the gradient too: in a converged
    # fit the weights stop moving because the gradient is small, not the learning rate.
    now, before = _slow_layers(ctx, ctx.values), _slow_layers(ctx, ctx.baseline.values)
    if now is None or before is None:
        return []
    # A scheduler holding the lr low while it rises (or stays: a warm-up that has not stepped yet) is a warm-up; one
    # whose lr fell more than 2x since the last sampled step (a decay stepped far too often: 10x a step) is what this
    # rule is for. The effective lr wobbles with Adam's moments, hence the factor.
    stepped = [f for f in ctx.fact("param_facts", {}).values() if f.held and f.applied]
    if (
        stepped
        and all(_held_low(f) for f in stepped)
        and (
            any(f.scheduler_steps == 0 for f in stepped)
            or max(lr for _, lr in now.values()) >= 0.5 * max(lr for _, lr in before.values())
        )
    ):
        return []
    low, lr_low = ctx.config.update_ratio_low, ctx.config.effective_lr_low
    layers = sorted(now, key=ctx.orders.forward_key)
    fastest = max(now, key=lambda k: now[k][0])
    ratio, lr = now[fastest]
    slow = f"by less than update_ratio_low={low:g} of their norm at step {ctx.step} and at step {ctx.baseline.step}"
    where = f"the most, {ratio:.3g}, in {fastest}; the first layer in forward order: {layers[0]}"
    message = (
        f"update_ratio: the optimizer step changed the weights of every one of the {plural(len(now), 'layer')}"
        f" that got a gradient {slow} ({where}), and by less than effective_lr_low={lr_low:g} times their gradient"
        f" ({lr:.3g} in {fastest}): the learning rate is too low for the weights to move"
    )
    return [Found(layers[0], ratio, message, low)]


@rule(order=11, phase="backward", stat="param_stale_grad_norm")
def stale_gradients(ctx: Context) -> list[Found]:
    """Parameters that held a gradient at the step's first backward."""
    # A parameter that no optimizer holds keeps its gradient because zero_grad() never clears it: not_updated names
    # that cause exactly, so it is left to that rule when it runs.
    facts = ctx.fact("param_facts", {}) if "not_updated" in ctx.enabled else {}
    stale = {
        p: norm
        for p, norm in ctx.stat("param_stale_grad_norm").items()
        if isinstance(norm, (int, float))
        and not isinstance(norm, bool)
        and norm != 0  # NaN is stale too
        and (p not in facts or facts[p].held)
    }
    if not stale:
        return []
    owners = ctx.orders.owners(stale)
    first = [p for p in stale if ctx.orders.owner(p) == owners[0]]
    message = (
        f"stale_gradients: at the first backward of step {ctx.step}, {plural(len(stale), 'parameter')} already held a"
        f" non-zero gradient ({listing(first)} in {owners[0]}, the first of {plural(len(owners), 'layer')} in forward"
        f" order; norm {stale[first[0]]:.3g}): .grad was not zeroed after the last optimizer step, so the gradients of"
        " all past steps add up. Either zero_grad() is not called (manual optimization), or these parameters are in"
        " none of the optimizer's param groups, which zero_grad() clears"
    )
    return [Found(owners[0], len(stale), message)]


@rule(order=10, phase="backward", stat="param_update_ratio", reads=["param_facts"])
def warmup_stuck(ctx: Context) -> list[Found]:
    """An LR scheduler that has not stepped once holds the lr at its low starting value."""
    # A scheduler that never stepped holds the lr low; stepped every n steps on purpose ("frequency"), interval
    # "step" is not this mistake.
    stuck = [
        p
        for p, f in ctx.fact("param_facts", {}).items()
        if f.held and f.applied and f.scheduler_steps == 0 and f.interval != "step" and _held_low(f)
    ]
    if ctx.step < 1 or not stuck:
        return []
    owners = ctx.orders.owners(stuck)
    fact = ctx.fact("param_facts", {})[stuck[0]]
    assert fact.base_lr is not None
    share = fact.lr / fact.base_lr
    how = (
        "Lightning steps a scheduler once per epoch unless configure_optimizers returns it as {'scheduler': ...,"
        " 'interval': 'step'}: a warm-up written in steps then lasts that many epochs"
        if fact.interval == "epoch"
        else "nothing stepped it (in manual optimization, call the scheduler's step() after opt.step())"
    )
    message = (
        f"warmup_stuck at step {ctx.step}: the LR scheduler has not stepped once in"
        f" {plural(ctx.step, 'optimizer step')} and holds the learning rate at its starting value {fact.lr:.3g},"
        f" {share:.3g} of its base lr {fact.base_lr:.3g} ({spread(stuck, owners)}): {how}"
    )
    return [Found(owners[0], share, message, _SCHEDULED_LOW)]


@rule(order=12, phase="backward", stat="param_grad_norm", reads=["param_facts"])
def zeroed_gradients(ctx: Context) -> list[Found]:
    """Gradients reached the layers' outputs, yet no parameter held one at the step."""
    facts = ctx.fact("param_facts", {})
    if not any(f.held and f.applied for f in facts.values()):
        return []
    # Measured parameters are those an optimizer stepped with a gradient; an exact 0 is zero_grad(set_to_none=False).
    grads = ctx.stat("param_grad_norm")
    measured = set(grads) | set(ctx.stat("param_norm")) | set(ctx.stat("param_update_ratio"))
    if any(not (finite(g) and g == 0) for g in grads.values()) or measured - set(grads):
        return []
    owners = {ctx.orders.owner(p) for p, f in facts.items() if f.held}
    norms = ctx.positive("act_grad_norm")
    reached = sorted((layer for layer in norms if layer in owners), key=ctx.orders.forward_key)
    if not reached:
        return []
    first, norm = reached[0], norms[reached[0]]
    held = sorted(p for p, f in facts.items() if f.held and ctx.orders.owner(p) == first)
    what = "was 0" if grads else "was None"
    message = (
        f"zeroed_gradients at step {ctx.step}: the backward reached the outputs of {plural(len(reached), 'layer')}"
        f" with parameters (the first in forward order: {first}, output gradient norm {norm:.3g}), but at the"
        f" optimizer step every parameter's .grad {what} ({listing(held)} in {first}): the gradients were zeroed"
        " between backward and the step, so the step changes nothing. In manual optimization call opt.zero_grad()"
        " before manual_backward(loss), not between it and opt.step()"
    )
    return [Found(first, norm, message)]


def moved_mass_bound(ratio: float, eps: float) -> float:
    """Upper bound on the share of a weight's squared mass held by the entries that changed across a step.

    Why it bounds it: ``docs/rules.md#not_updated-why-a-parameter-did-not-move``.

    Args:
        ratio: ``param_update_ratio``, ``||dw|| / ||w||``, ``>= 0``.
        eps: ``torch.finfo(dtype).eps`` of the weights.

    Example:
        >>> moved_mass_bound(0.0, 2**-7), moved_mass_bound(2**-10, 2**-7), moved_mass_bound(1e-3, 2**-23)
        (0.0, 0.0625, 1.0)
    """
    return min(1.0, 2.0 * ratio / eps) ** 2  # the min first: squaring a float beyond 1e154 raises OverflowError


_SCHEDULED_LOW = 1e-2
"""``not_updated`` does not report rounding while a scheduler holds the lr below this share of its base lr."""


# Why a parameter did not move, in the order a module's finding names them.
_UNHELD, _LR_ZERO, _ROUNDED = "unheld", "lr_zero", "rounded"
_FLOAT32_EPS = 2.0**-23


def _stuck(facts: ParamFacts, bound: float | None, intended: float, threshold: float) -> str | None:
    """Why a parameter with a finite, non-zero gradient did not move, or ``None``.

    ``bound``: :func:`moved_mass_bound` of its update ratio, ``None`` if not measured; ``intended``: the update ratio
    of a plain SGD step, ``lr * param_grad_norm / param_norm`` (NaN if unknown).
    """
    if not facts.held:  # measured anyway: a weight that moved (changed by hand) is not reported
        return _UNHELD if bound is None or bound < threshold else None
    if not facts.applied or bound is None or bound >= threshold:
        return None
    if facts.lr == 0.0:
        # A scheduler at lr 0 (a warm-up from 0, the end of a decay) raises it again, unless it scales a base of 0.
        return _LR_ZERO if not facts.base_lr else None
    if facts.base_lr is not None and facts.lr < _SCHEDULED_LOW * facts.base_lr:
        return None
    # Rounding loses an update that float32 master weights would keep: weights coarser than float32, and a step meant
    # to move them (plain SGD's lr x gradient at least half a float32 ulp; a converged parameter's residual gradient
    # asks for no change). `>=` is False for NaN: an unknown lr or weight norm.
    return _ROUNDED if facts.eps > _FLOAT32_EPS and intended >= _FLOAT32_EPS / 2 else None


@rule(order=14, phase="backward", stat="param_update_ratio", reads=["param_facts"])
def not_updated(ctx: Context) -> Iterator[Found]:
    """Per module, parameters with a gradient whose weights did not move, and why."""
    facts = ctx.fact("param_facts", {})
    threshold = ctx.config.moved_mass_threshold
    ratios, norms = ctx.stat("param_update_ratio"), ctx.positive("param_norm")
    stuck: dict[str, dict[str, list[tuple[str, float]]]] = {}  # owner -> cause -> [(parameter, value)]
    for param, grad in ctx.positive("param_grad_norm").items():
        if (fact := facts.get(param)) is None:
            continue
        ratio = ratios.get(param)
        bound = moved_mass_bound(ratio, fact.eps) if finite(ratio) and ratio >= 0 else None
        intended = fact.lr * grad / norms[param] if param in norms else math.nan
        if (cause := _stuck(fact, bound, intended, threshold)) is not None:
            value = float(grad) if cause == _UNHELD else float(bound)  # type: ignore[arg-type]
            stuck.setdefault(ctx.orders.owner(param), {}).setdefault(cause, []).append((param, value))
    for owner, causes in stuck.items():
        order = [c for c in (_UNHELD, _LR_ZERO, _ROUNDED) if c in causes]
        sentences = "; ".join(_stuck_sentence(ctx, cause, causes[cause]) for cause in order)
        message = f"not_updated: the weights of {owner} did not move across step {ctx.step}: {sentences}"
        value = max(v for _, v in causes[order[0]])  # the finding's value and statistic come from its first cause
        unheld = order[0] == _UNHELD
        yield Found(owner, value, message, 0.0 if unheld else threshold, stat="param_grad_norm" if unheld else None)


def _stuck_sentence(ctx: Context, cause: str, found: list[tuple[str, float]]) -> str:
    names = listing([p for p, _ in found])
    them, their = ("it", "its") if len(found) == 1 else ("them", "their")
    if cause == _UNHELD:
        norms = ", ".join(f"{v:.3g}" for _, v in found[:MAX_LISTED])
        return (
            f"{names} got a gradient (norm {norms}) but no optimizer of the Trainer holds {them}, so no change was"
            f" applied: add {them} to configure_optimizers, or set requires_grad=False to freeze {them} on purpose"
        )
    if cause == _LR_ZERO:
        return (
            f"{names} did not change although {their} gradient is finite and non-zero: the learning rate of the"
            " param group is 0 and no LR scheduler raises it, so no change was applied"
        )
    first, bound = max(found, key=lambda item: item[1])
    fact = ctx.fact("param_facts", {})[first]
    what = (
        f"did not change at all although the learning rate is {fact.lr:.3g}"
        if bound == 0.0
        else f"changed in almost none of {their} entries (at most {bound:.2%} of the weights' squared mass can have"
        f" changed, from param_update_ratio={ctx.stat('param_update_ratio')[first]:.3g}, eps={fact.eps:.3g} and"
        f" moved_mass_threshold={ctx.config.moved_mass_threshold:g}; lr={fact.lr:.3g})"
    )
    return (
        f"{names} {what}: the update was rounded away in {fact.dtype}, each change being below half a unit in the"
        f" last place of its weight; to fix, keep float32 master weights (precision='bf16-mixed' or '16-mixed') or"
        " raise the learning rate"
    )


@rule(order=15, phase="forward", stat="param_norm")
def replica_divergence(ctx: Context) -> Iterator[Found]:
    """Per module, parameters whose norms differ between processes."""
    rtol = ctx.config.replica_rtol
    highest = ctx.stat("param_norm")
    apart: dict[str, list[tuple[str, float, float]]] = {}  # owner -> [(parameter, smallest, largest)]
    for param, low in ctx.stat("param_norm_min").items():
        high = highest.get(param)
        if finite(high) and finite(low) and high - low > rtol * high:
            apart.setdefault(ctx.orders.owner(param), []).append((param, float(low), float(high)))
    for owner, found in apart.items():
        spread = max((high - low) / high for _, low, high in found)
        norms = listing([f"{p} {low:.9g} to {high:.9g}" for p, low, high in found])
        message = (
            f"replica_divergence: the weights of {owner} differ between processes before step {ctx.step}:"
            f" {plural(len(found), 'replicated parameter')} {'has' if len(found) == 1 else 'have'} different norms on"
            f" different processes ({norms}; relative difference up to {spread:.3g} > replica_rtol={rtol:g}). DDP"
            " replicas must be identical: a rank-dependent update or a weight changed on one process only makes each"
            " process train its own model"
        )
        yield Found(owner, spread, message, rtol)


@rule(order=21, phase="forward", stat="registration", reads=["unregistered"])
def unregistered_module(ctx: Context) -> Iterator[Found]:
    """Layers with trainable parameters ran in the forward without being submodules."""
    for parent, modules in ctx.fact("unregistered", {}).items():
        message = (
            f"unregistered_module at step {ctx.step}: the forward of {parent} ran {plural(len(modules), 'module')} with"
            f" trainable parameters outside its registered submodules: {listing(list(modules))}. self.parameters()"
            " does not yield their parameters, so no optimizer built from it updates them, no checkpoint saves them"
            " and .to(device) does not move them; hold layers in nn.ModuleList / nn.ModuleDict, not in a Python list"
            " or dict"
        )
        yield Found(parent, len(modules), message)
