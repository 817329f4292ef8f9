"""The opt-in statistics (``stats=[...]`` names of :data:`~lightning_hookdiag._vocabulary.OPT_IN_STATS`).

:func:`plan_opt_in` decides once, when fit starts, what a run needs; the components of
:mod:`~lightning_hookdiag._precision`, :mod:`~lightning_hookdiag._kurtosis` and :mod:`~lightning_hookdiag._saved_memory`
are built only when asked for, so with ``stats=None`` the default cost is unchanged. What each statistic is:
``docs/statistics.md#opt-in-statistics``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_hookdiag._aggregation import LayerStatsAggregator
from lightning_hookdiag._stats import resolve_names
from lightning_hookdiag._vocabulary import OPT_IN_STATS
from lightning_hookdiag.components import TensorSink

__all__ = ["PRECISION_BASE_STATS", "PRECISION_TARGETS", "OptInPlan", "layer_sums", "plan_opt_in", "resolve_targets"]

PRECISION_TARGETS: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
}
"""The dtypes a precision headroom can be measured against, by name."""

PRECISION_BASE_STATS: tuple[str, ...] = tuple(s for s in OPT_IN_STATS if s.endswith("flow_frac"))
"""The ``stats=`` names of the headroom statistics; each is logged once per target, as ``<name>_<target>``."""

# Trainer precision without its "-mixed" / "-true" / "-float16" suffix -> the target it implies. Full-precision runs
# imply none: a user planning a switch names it with precision_targets=.
_FROM_TRAINER = {"16": "float16", "bf16": "bfloat16", "transformer-engine": "float8_e4m3fn"}


def resolve_targets(targets: str | torch.dtype | Sequence[str | torch.dtype] | None) -> tuple[str, ...] | None:
    """Validate a ``precision_targets=`` argument: dtype names or dtypes, returned as names in a fixed order.

    Example:
        >>> resolve_targets(["float8_e5m2", torch.float16])
        ('float16', 'float8_e5m2')
        >>> resolve_targets("fp16")
        Traceback (most recent call last):
        ...
        ValueError: precision_targets: unknown target(s) ['fp16']; expected names from ['float16', 'bfloat16', 'float8_e4m3fn', 'float8_e5m2']
    """  # noqa: E501
    if targets is None:
        return None
    items = [targets] if isinstance(targets, (str, torch.dtype)) else list(targets)
    by_dtype = {dtype: name for name, dtype in PRECISION_TARGETS.items()}
    names = [by_dtype.get(t, str(t)) if isinstance(t, torch.dtype) else t for t in items]
    return resolve_names("precision_targets", "target", names, tuple(PRECISION_TARGETS))


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
    """Decide what the requested opt-in statistics (of the resolved ``stats=``) need.

    ``precision_targets=None`` takes the target that ``trainer_precision`` (``trainer.precision``) implies: none for
    full precision (``32-true``, ``64-true``).

    Example:
        >>> plan = plan_opt_in(["act_overflow_frac", "act_kurtosis"], None, "16-mixed")
        >>> plan.act_targets, plan.grad_targets, plan.logged
        (('float16',), (), ('act_kurtosis', 'act_overflow_frac_float16'))
        >>> plan_opt_in(["act_overflow_frac"], None, "32-true").note[:60]
        'act_overflow_frac: the Trainer runs in 32-true precision, wh'
    """
    wanted = set(stats)
    if precision_targets is None:
        base = str(trainer_precision).removesuffix("-mixed").removesuffix("-true").removesuffix("-float16")
        precision_targets = [_FROM_TRAINER[base]] if base in _FROM_TRAINER else []
    targets = tuple(precision_targets)
    note = ""
    if not targets and (headroom := [s for s in PRECISION_BASE_STATS if s in wanted]):
        note = (
            f"{', '.join(headroom)}: the Trainer runs in {trainer_precision} precision, which implies no"
            " lower-precision target, so no precision headroom is computed; to plan a switch, pass"
            f" precision_targets= with names from {list(PRECISION_TARGETS)}"
        )
    logged = [
        name
        for stat in OPT_IN_STATS
        if stat in wanted
        for name in ([f"{stat}_{t}" for t in targets] if stat in PRECISION_BASE_STATS else [stat])
    ]
    return OptInPlan(
        act_targets=targets if {"act_underflow_frac", "act_overflow_frac"} & wanted else (),
        grad_targets=targets if {"act_grad_underflow_frac", "act_grad_overflow_frac"} & wanted else (),
        logged=tuple(logged),
        note=note,
    )


def layer_sums(agg: LayerStatsAggregator, state: str, width: int, fn: Callable[[int, Tensor], Tensor]) -> TensorSink:
    """Register the ``[n_layers, width]`` sum state ``state`` on the aggregator ``agg``, and a sink that pools into it.

    The sink adds ``fn(layer, tensor)`` to row ``layer``: the one shape of every opt-in statistic that is a
    vector of additive per-tensor sums, so that it pools exactly over calls, micro-batches and processes.

    Example:
        >>> agg = LayerStatsAggregator(n_layers=2)
        >>> sink = layer_sums(agg, "calls", 1, lambda layer, tensor: torch.ones(1))
        >>> sink(1, torch.zeros(3)); agg.calls.tolist()
        [[0.0], [1.0]]
    """
    agg.add_state(state, agg.new_state(agg.n_layers, width), "sum")

    def sink(layer: int, tensor: Tensor) -> None:
        agg.pool(state, fn(layer, tensor), layer)

    return sink
