"""The opt-in statistics (``stats=[...]`` names of :data:`~lightning_hookdiag.vocabulary.OPT_IN_STATS`).

They live apart from the default path: :func:`plan_opt_in` decides once, when fit starts, what a run needs, and
the components of :mod:`~lightning_hookdiag.precision`, :mod:`~lightning_hookdiag.kurtosis` and
:mod:`~lightning_hookdiag.saved_memory` are built only when asked for. With ``stats=None`` none is, so the default
cost is unchanged. What each opt-in statistic is: ``docs/statistics.md#opt-in-statistics``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_hookdiag import precision

__all__ = ["OptInPlan", "plan_opt_in"]


@dataclass(frozen=True)
class OptInPlan:
    """What the opt-in statistics of one fit need.

    Attributes:
        act_targets: Target dtype names of the activation precision headroom (empty: not computed).
        grad_targets: Target dtype names of the output-gradient precision headroom.
        logged: Logged statistic names, in vocabulary order (precision ones expanded per target).
        note: Why a requested statistic is not computed (precision headroom without a target), or ``""``.
    """

    act_targets: tuple[str, ...] = ()
    grad_targets: tuple[str, ...] = ()
    logged: tuple[str, ...] = ()
    note: str = ""


def plan_opt_in(
    stats: Sequence[str], precision_targets: Sequence[str] | None, trainer_precision: str | int | None
) -> OptInPlan:
    """Decide what the requested opt-in statistics need.

    Args:
        stats: The resolved ``stats=`` names.
        precision_targets: Resolved ``precision_targets=`` names; ``None`` derives the target from the Trainer.
        trainer_precision: ``trainer.precision`` (``"16-mixed"``, ``"bf16-mixed"``, ``"32-true"``, ...).

    Example:
        >>> plan = plan_opt_in(["act_overflow_frac", "act_kurtosis"], None, "16-mixed")
        >>> plan.act_targets, plan.grad_targets, plan.logged
        (('float16',), (), ('act_kurtosis', 'act_overflow_frac_float16'))
        >>> plan_opt_in(["act_overflow_frac"], None, "32-true").note[:60]
        'act_overflow_frac: the Trainer runs in 32-true precision, wh'
    """
    wanted = set(stats)
    precision_stats = [s for s in precision.PRECISION_BASE_STATS if s in wanted]
    targets = (
        tuple(precision_targets) if precision_targets is not None else precision.default_targets(trainer_precision)
    )
    note = ""
    if precision_stats and not targets:
        note = (
            f"{', '.join(precision_stats)}: the Trainer runs in {trainer_precision} precision, which implies no"
            " lower-precision target, so no precision headroom is computed; to plan a switch, pass"
            f" precision_targets= with names from {list(precision.PRECISION_TARGETS)}"
        )
    act = targets if {"act_underflow_frac", "act_overflow_frac"} & wanted else ()
    grad = targets if {"act_grad_underflow_frac", "act_grad_overflow_frac"} & wanted else ()
    logged = [s for s in ("act_kurtosis", "act_absmax_over_std") if s in wanted]
    logged += precision.logged_names(precision_stats, targets)
    if "act_saved_bytes" in wanted:
        logged.append("act_saved_bytes")
    return OptInPlan(act_targets=act, grad_targets=grad, logged=tuple(logged), note=note)
