"""What the host knows about a sampled optimizer step, for the ``not_updated`` rule: host facts only, no tensor work.

Per tracked parameter, a :class:`~lightning_hookdiag.rules.ParamFacts`. The learning rates are read before the step
(Lightning steps LR schedulers before ``on_train_batch_end``, where the step is diagnosed); whether the step ran comes
from a step post-hook on the optimizer, for the sampled step only (a ``GradScaler`` that finds an overflow does not
call ``optimizer.step()``: such a step changes nothing and is not a finding). What the rule makes of these facts:
``docs/rules.md#not_updated-why-a-parameter-did-not-move``.

The optimizers seen as a whole, read at the step (``docs/rules.md#the-optimizers-seen-as-a-whole``): which optimizers
hold each parameter (``shared_parameters``), and how far each LR scheduler advanced since the last sampled step
against how far Lightning can have stepped it (``scheduler_overstepped``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_hookdiag.rules import ParamFacts

__all__ = ["Schedule", "StepWatch", "held_by", "held_by_none"]


def held_by_none(params: Sequence[Tensor], optimizers: Iterable[Optimizer]) -> list[Tensor]:
    """The parameters of ``params`` in no param group of any of ``optimizers`` (by identity, on the host).

    Example:
        >>> head, body = torch.nn.Linear(2, 1), torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(body.parameters(), lr=0.1)
        >>> [p is head.weight for p in held_by_none([*body.parameters(), *head.parameters()], [opt])]
        [True, False]
    """
    held = {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
    return [p for p in params if id(p) not in held]


def _lr(lr: Any) -> float:
    if isinstance(lr, Tensor):  # a tensor lr (capturable optimizers): read only where that costs no device sync
        return float(lr) if lr.device.type == "cpu" and lr.numel() == 1 else math.nan
    return float(lr) if isinstance(lr, (int, float)) else math.nan


def held_by(optimizers: Iterable[Optimizer]) -> dict[int, tuple[int, ...]]:
    """Each held parameter's ``id`` to the indices of the ``optimizers`` that hold it, once per time held.

    Example:
        >>> body, head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
        >>> every = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=0.1)
        >>> holders = held_by([every, torch.optim.SGD(head.parameters(), lr=0.1)])
        >>> holders[id(body.weight)], holders[id(head.weight)]
        ((0,), (0, 1))
    """
    holders: dict[int, list[int]] = {}
    for index, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for p in group["params"]:
                holders.setdefault(id(p), []).append(index)
    return {key: tuple(indices) for key, indices in holders.items()}


Schedule = tuple["str | None", "int | None", "int | None", "int | None"]
"""How Lightning steps an optimizer's LR scheduler (``"step"``, ``"epoch"``), its ``last_epoch``, Lightning's clock for
that interval (the optimizer step for ``"step"``, the epoch for ``"epoch"``) and the scheduler's identity (``id``: a
callback such as ``StochasticWeightAveraging`` swaps in a scheduler of its own); all ``None`` without one."""


def _holder(group: Mapping[str, Any], schedule: Schedule, advance: tuple[int, int, int] | None) -> ParamFacts:
    """How ``group`` holds its parameters: the facts but the weights' dtype (:func:`_facts`) and ``applied``."""
    base, eps = _lr(group.get("initial_lr")), group.get("eps")  # initial_lr: set by every torch LR scheduler
    return ParamFacts(
        held=True,
        lr=_lr(group.get("lr", math.nan)),
        base_lr=None if math.isnan(base) else base,
        opt_eps=float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else None,
        interval=schedule[0],
        scheduler_steps=schedule[1],
        scheduler_advance=advance,
    )


class StepWatch:
    """The learning rates and the step of each optimizer stepped in one sampled window.

    :meth:`observe` each optimizer before it steps, :meth:`facts` once the step is done; :meth:`release` removes the
    hooks (also when the window is dropped).

    Example:
        >>> lin = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(lin.parameters(), lr=0.5)
        >>> lin(torch.ones(1, 2)).sum().backward()
        >>> watch = StepWatch()
        >>> watch.observe(opt)
        >>> opt.step()
        >>> facts = watch.facts(["lin.weight"], [lin.weight])
        >>> watch.release()
        >>> facts["lin.weight"].held, facts["lin.weight"].applied, facts["lin.weight"].lr
        (True, True, 0.5)
    """

    def __init__(self) -> None:
        self._rates: dict[int, tuple[Optimizer, list[ParamFacts]]] = {}
        self._applied: set[int] = set()
        self._handles: list[RemovableHandle] = []
        self._unheld: set[int] = set()
        # Kept across windows: which tracked parameters no optimizer holds and which optimizers hold each parameter,
        # with the membership they were found for.
        self._outside: tuple[tuple[Any, ...], list[Tensor], dict[int, tuple[int, ...]]] | None = None
        # Kept across windows: each scheduled optimizer's (Lightning clock, scheduler last_epoch, scheduler identity)
        # when last observed.
        self._clocks: dict[int, tuple[int, int, int | None]] = {}

    def observe(self, optimizer: Optimizer, schedule: Schedule = (None, None, None, None)) -> None:
        """Record the learning rates (and :data:`Schedule`) ``optimizer`` is about to step with; watch if it steps."""
        key = id(optimizer)
        if key in self._rates:
            return
        advance = self._advance(key, schedule)
        self._rates[key] = (optimizer, [_holder(g, schedule, advance) for g in optimizer.param_groups])
        register = getattr(optimizer, "register_step_post_hook", None)
        if callable(register):
            applied = self._applied
            self._handles.append(register(lambda opt, args, kwargs: applied.add(key)))
        else:  # not a torch optimizer: assume its step ran
            self._applied.add(key)

    def _advance(self, key: int, schedule: Schedule) -> tuple[int, int, int] | None:
        """How far the scheduler and Lightning's clock moved since ``key``'s last observation (and remember now's)."""
        interval, steps, clock, scheduler = schedule
        if interval is None or steps is None or clock is None:
            return None
        before = self._clocks.get(key)
        self._clocks[key] = (clock, steps, scheduler)
        if before is None or clock < before[0] or steps < before[1] or scheduler != before[2]:
            # First seen, the clock went back (a new fit, a scheduler reloaded), or another scheduler was swapped in
            # (StochasticWeightAveraging's SWALR starts at its own last_epoch): no span to compare.
            return None
        # Lightning steps a scheduler at most once per optimizer step ("step") or per epoch ("epoch").
        return steps - before[1], clock - before[0], before[0]

    def unheld(self, params: Sequence[Tensor], optimizers: Sequence[Optimizer]) -> list[Tensor]:
        """The parameters of ``params`` with a gradient that none of ``optimizers`` holds, remembered for :meth:`facts`.

        The head left out of ``configure_optimizers``, which the caller measures like the stepped ones. Membership
        is found again only when the param groups change, so a sampled step looks only at the parameters outside
        every group, normally none; frozen ones have no gradient and are not returned. Which optimizers hold each
        parameter (:func:`held_by`) is found with it, for :meth:`facts`.
        """
        # Changes when a param group is added or removed, or one gets another list or length of parameters.
        groups = tuple(
            (index, id(g["params"]), len(g["params"]))
            for index, optimizer in enumerate(optimizers)
            for g in optimizer.param_groups
        )
        key = (id(params), len(params), groups)
        if self._outside is None or self._outside[0] != key:
            self._outside = (key, held_by_none(params, optimizers), held_by(optimizers))
        found = [p for p in self._outside[1] if p.requires_grad and p.grad is not None]
        self._unheld.update(id(p) for p in found)
        return found

    def facts(self, names: Sequence[str], params: Sequence[Tensor]) -> dict[str, ParamFacts]:
        """Facts about the parameters (``names[i]`` is ``params[i]``'s) that a watched optimizer holds, or none does.

        A parameter in several groups gets the largest lr of them, and counts as applied if any of their optimizers
        stepped.
        """
        if not (self._rates or self._unheld):
            return {}  # nothing observed (the rule is disabled)
        holders: dict[int, tuple[ParamFacts, bool]] = {}  # (the holder of the largest lr, applied)
        for key, (optimizer, rates) in self._rates.items():
            applied = key in self._applied
            for group, rate in zip(optimizer.param_groups, rates, strict=False):
                for p in group["params"]:
                    top, was = holders.get(id(p), (rate, False))
                    holders[id(p)] = (rate if rate.lr > top.lr else top, applied or was)
        out: dict[str, ParamFacts] = {}
        membership = self._outside[2] if self._outside is not None else {}
        # A few distinct facts: building one costs microseconds.
        interned: dict[tuple[Any, ...], ParamFacts] = {}
        for name, p in zip(names, params, strict=True):
            holder = holders.get(id(p))
            if holder is None and id(p) not in self._unheld:
                continue  # not stepped in this window by a watched optimizer, e.g. another optimizer's turn
            facts_key = (holder, p.dtype, tuple(p.shape), membership.get(id(p), ()))
            if facts_key not in interned:
                interned[facts_key] = _facts(*facts_key)
            out[name] = interned[facts_key]
        return out

    def release(self) -> None:
        """Remove the step hooks and forget the window."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._rates, self._applied, self._unheld = [], {}, set(), set()


def _facts(
    holder: tuple[ParamFacts, bool] | None, dtype: torch.dtype, shape: tuple[int, ...], optimizers: tuple[int, ...]
) -> ParamFacts:
    """Facts of a parameter of ``dtype`` and ``shape`` held as ``holder`` says, or by no optimizer (``None``).

    ``holder``: its group's facts and whether its optimizer stepped; ``optimizers``: the indices of those that hold
    it (:func:`held_by`).
    """
    name = str(dtype).removeprefix("torch.")
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        eps, tiny = info.eps, info.smallest_normal * info.eps  # tiny: the smallest subnormal
    else:  # NaN: no rounding bound applies
        eps = tiny = math.nan
    if holder is None:
        return ParamFacts(held=False, applied=False, dtype=name, eps=eps, tiny=tiny, shape=shape)
    return replace(holder[0], applied=holder[1], dtype=name, eps=eps, tiny=tiny, shape=shape, optimizers=optimizers)
