"""The rules on the optimizers seen as a whole, read at the step (``docs/rules.md#the-optimizers-seen-as-a-whole``).

What every healthy run keeps, whatever the model: each parameter is held by one optimizer, once, and an LR scheduler
that Lightning steps advances no faster than Lightning steps it. Both are host facts of the sampled step
(:class:`~lightning_hookdiag.rules.ParamFacts`), gathered by ``optimizer_watch`` from the Trainer's optimizer list.
"""

from __future__ import annotations

from collections.abc import Iterator

from lightning_hookdiag.rules._context import Context, ParamFacts
from lightning_hookdiag.rules._findings import listing, plural, spread
from lightning_hookdiag.rules._registry import Found, rule

__all__: list[str] = []


def _indices(indices: tuple[int, ...]) -> str:
    """``"optimizers 0 and 1"``, ``"optimizer 0, 2 times"``, ``"optimizers 0 (2 times) and 1"``."""
    distinct = sorted(set(indices))
    if len(distinct) == 1:
        return f"optimizer {distinct[0]}, {plural(len(indices), 'time')}"
    named = [str(i) if indices.count(i) == 1 else f"{i} ({plural(indices.count(i), 'time')})" for i in distinct]
    return f"optimizers {' and '.join(named)}"


def _holds_every(facts: dict[str, ParamFacts]) -> list[int]:
    """The optimizers whose param groups hold every parameter that any optimizer holds."""
    held = [f.optimizers for f in facts.values() if f.optimizers]
    if not held:
        return []
    return sorted(i for i in set(held[0]) if all(i in h for h in held))


@rule(order=22, phase="backward", stat="optimizers", reads=["param_facts"])
def shared_parameters(ctx: Context) -> Iterator[Found]:
    """Parameters that two optimizers hold, or one optimizer twice: each update is applied more than once."""
    facts = dict(ctx.fact("param_facts", {}))
    shared = {p: f.optimizers for p, f in facts.items() if len(f.optimizers) > 1}
    if not shared:
        return
    owners = ctx.orders.owners(shared)
    first = next(p for p in shared if ctx.orders.owner(p) == owners[0])
    everything = _holds_every(facts)
    distinct = sorted({i for indices in shared.values() for i in indices})
    others = [i for i in distinct if i not in everything]
    if everything and others:
        # The GAN mistake: one optimizer built from self.parameters() next to one built from a part of the model.
        whole = everything[0]
        why = (
            f"optimizer {whole} holds every parameter of the model (built from self.parameters()?) while"
            f" {plural(len(others), 'other optimizer')} ({listing([str(i) for i in others])}) hold a part of it:"
            f" each step of optimizer {whole} also updates that part with the gradients of its own loss (a GAN's"
            " generator optimizer moving the discriminator). Build each optimizer from its own submodule's"
            " parameters"
        )
    else:
        why = (
            "each optimizer step applies its own update to them, with its own moments and learning rate, so they move"
            " more than once per step and no single optimizer's state describes them. Give every parameter to one"
            " optimizer (one param group)"
        )
    verb = "is" if len(shared) == 1 else "are"
    message = (
        f"shared_parameters at step {ctx.step}: {plural(len(shared), 'parameter')} {verb}"
        f" held more than once by the optimizers of the Trainer ({first} by {_indices(shared[first])};"
        f" {spread(list(shared), owners)}): {why}"
    )
    yield Found(owners[0], len(shared), message)


@rule(order=23, phase="backward", stat="lr", reads=["param_facts"])
def scheduler_overstepped(ctx: Context) -> Iterator[Found]:
    """An LR scheduler that advanced further than Lightning stepped it since the previous sampled step."""
    fast = {
        p: f.scheduler_advance
        for p, f in ctx.fact("param_facts", {}).items()
        if f.held and f.scheduler_advance is not None and f.scheduler_advance[0] > f.scheduler_advance[1]
    }
    if not fast:
        return
    owners = ctx.orders.owners(fast)
    first = next(p for p in fast if ctx.orders.owner(p) == owners[0])
    stepped, most, since = fast[first]
    interval = ctx.fact("param_facts", {})[first].interval
    if interval == "epoch":
        span = f"since epoch {since}, over {plural(most, 'epoch')}" if most else f"within epoch {since}"
        per = "once per epoch"
    else:
        span = f"since step {since}, over {plural(most, 'optimizer step')}"
        per = "at most once per optimizer step"
    message = (
        f"scheduler_overstepped at step {ctx.step}: the LR scheduler of {spread(list(fast), owners)} stepped"
        f" {plural(stepped, 'time')} {span}, while Lightning, which steps it {per} (interval={interval!r}), can have"
        f" stepped it at most {most} times: something else calls its step() too (a self.lr_schedulers().step() in"
        " training_step, or in an epoch hook), so the schedule runs faster than configured. Under automatic"
        " optimization leave the stepping to Lightning, or set automatic_optimization=False"
    )
    yield Found(owners[0], stepped / most if most else float(stepped), message, 1.0)
