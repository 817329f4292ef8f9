"""The logged health statistics as plain data: ``(key, step, value)`` scalars parsed into a :class:`HealthLog`."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from lightning_hookdiag._errors import ReportError
from lightning_hookdiag._keys import LEGACY_DEPTH, known_prefixes, parse_key
from lightning_hookdiag._names import owning_layer
from lightning_hookdiag._vocabulary import LAYER_STATS, PER_PARAMETER_STATS, TOTAL_STATS

__all__ = ["HealthLog", "Scalar", "build_health_log", "depth_order", "detect_prefix", "stat_order_key"]

_DEFAULT_PREFIX = "layer_health"

_KNOWN_ORDER = {s: i for i, s in enumerate(LAYER_STATS + PER_PARAMETER_STATS + TOTAL_STATS)}


class Scalar(NamedTuple):
    """One logged number: the metric key, the step it was logged at, and its value."""

    key: str
    step: int
    value: float


def _prefixes_before(keys: Iterable[str], segments: frozenset[str], allow_last: bool) -> set[str]:
    found = set()
    for key in keys:
        parts = key.split("/")
        # A layer part follows the statistic segment; only per-step totals may end the key.
        for i in range(1, len(parts) if allow_last else len(parts) - 1):
            if parts[i] in segments:
                found.add("/".join(parts[:i]))
                break
    return found


def detect_prefix(keys: Iterable[str]) -> str:
    """The key prefix under which the health statistics were logged, among every key of the logs.

    Keys ``<prefix>.<stat>/<depth>_<name>`` of a known statistic decide first; failing those, the keys of older logs:
    ``<prefix>/depth/<layer>``, which every sampled step logged, then keys whose statistic segment is a known
    statistic name; failing all, the callback's default ``layer_health``.

    Args:
        keys: Every logged key of the run.

    Raises:
        ReportError: If the logs hold several prefixes (two callbacks with different ``prefix=``), which only the
            user can choose between.

    Example:
        >>> detect_prefix(["train_loss", "enc_health.act_mean/0_enc.0", "enc_health/act_std_min"])
        'enc_health'
        >>> detect_prefix(["train_loss", "enc_health/depth/enc.0", "enc_health/act_mean/enc.0"])
        'enc_health'
        >>> detect_prefix(["train_loss", "epoch"])
        'layer_health'
    """
    keys = list(keys)
    candidates = known_prefixes(keys, LAYER_STATS + PER_PARAMETER_STATS)
    if not candidates:
        candidates = _prefixes_before(keys, frozenset({LEGACY_DEPTH}), allow_last=False)
    if not candidates:
        candidates = _prefixes_before(keys, frozenset(LAYER_STATS + PER_PARAMETER_STATS), allow_last=False)
        candidates |= _prefixes_before(keys, frozenset(TOTAL_STATS), allow_last=True)
    if len(candidates) > 1:
        raise ReportError(
            f"the logs hold several health prefixes ({', '.join(sorted(candidates))}); pick one with --prefix"
        )
    return candidates.pop() if candidates else _DEFAULT_PREFIX


def depth_order(names: Iterable[str], depth: dict[str, int], parameters: bool = False) -> list[str]:
    """Sort layer names (or, with ``parameters``, parameter names by their owning layer) by ``depth``, shallow first.

    Names without a known depth follow, alphabetically, so that nothing logged is dropped from the report.

    Args:
        names: The layer (or parameter) names to sort.
        depth: Layer name to its depth (:attr:`HealthLog.depth`).
        parameters: ``names`` are parameter names, sorted by the depth of their owning layer.

    Example:
        >>> depth_order(["head", "stem", "body"], {"stem": 0, "body": 1, "head": 2})
        ['stem', 'body', 'head']
        >>> depth_order(["x.weight", "head.bias", "stem.weight"], {"stem": 0, "head": 1}, parameters=True)
        ['stem.weight', 'head.bias', 'x.weight']
    """

    def key(name: str) -> tuple[int, int, str, str]:
        owner = owning_layer(name, depth) if parameters else name
        d = depth.get(owner)
        # Within one depth by name, as a plain sort of the logged keys lists them (a container's own parameter
        # shares the depth of the first layer inside it).
        return (0, d, name, owner) if d is not None else (1, 0, owner, name)

    return sorted(names, key=key)


def stat_order_key(stat: str) -> tuple[int, str]:
    """Sort key of the one order the summary and ``--diff`` list statistics in: the vocabulary's, unknown names last."""
    return (_KNOWN_ORDER.get(stat, len(_KNOWN_ORDER)), stat)


@dataclass(frozen=True)
class HealthLog:
    """The health statistics of one run, as read back from its logs.

    Attributes:
        prefix: The key prefix the statistics were found under.
        steps: Every step at which a statistic was logged, ascending.
        stats: ``{stat: {layer: {step: value}}}`` for per-layer and per-parameter statistics.
        totals: ``{stat: {step: value}}`` for statistics without a layer part, such as ``grad_norm_total``.
        depth: Forward position of each layer: the depth in its keys (and a parameter's module's, from its key), or
            in older logs the ``<prefix>/depth/<layer>`` scalar of the latest step that logged it.
    """

    prefix: str
    steps: tuple[int, ...]
    stats: dict[str, dict[str, dict[int, float]]]
    totals: dict[str, dict[int, float]]
    depth: dict[str, int]

    @property
    def empty(self) -> bool:
        """Whether no statistic at all was found under :attr:`prefix`."""
        return not self.stats and not self.totals

    @property
    def stat_names(self) -> list[str]:
        """The keys of :attr:`stats`, in :func:`stat_order_key` order."""
        return sorted(self.stats, key=stat_order_key)

    @property
    def total_names(self) -> list[str]:
        """The keys of :attr:`totals`, in :func:`stat_order_key` order."""
        return sorted(self.totals, key=stat_order_key)

    def is_parameter_stat(self, stat: str) -> bool:
        """Whether ``stat`` is keyed by parameter name rather than by layer name."""
        return stat.startswith("param_")  # every name of PER_PARAMETER_STATS, and any added later

    def layers(self, stat: str) -> list[str]:
        """The names logged for ``stat``, in depth order (shallow first)."""
        return depth_order(self.stats[stat], self.depth, parameters=self.is_parameter_stat(stat))

    def depth_of(self, name: str, stat: str) -> int | None:
        """The depth shown for ``name`` under ``stat``: its own, or its owning layer's for a parameter."""
        return self.depth.get(owning_layer(name, self.depth) if self.is_parameter_stat(stat) else name)

    def stat_steps(self, stat: str) -> list[int]:
        """The steps at which ``stat`` was logged for at least one layer, ascending."""
        return sorted({step for series in self.stats[stat].values() for step in series})

    def matrix(self, stat: str) -> tuple[list[str], list[int], list[list[float]]]:
        """``stat`` as a layers x steps table; a layer not logged at a step holds NaN.

        Returns:
            The row names in depth order, the column steps ascending, and the rows of values.

        Example:
            >>> log = build_health_log([Scalar("layer_health.act_std/1_a", 0, 2.0),
            ...     Scalar("layer_health.act_std/0_b", 5, 3.0)])
            >>> log.matrix("act_std")
            (['b', 'a'], [0, 5], [[nan, 3.0], [2.0, nan]])
        """
        names, steps = self.layers(stat), self.stat_steps(stat)
        series = self.stats[stat]
        return names, steps, [[series[name].get(step, math.nan) for step in steps] for name in names]


def build_health_log(scalars: Iterable[Scalar], prefix: str | None = None) -> HealthLog:
    """Collect the health statistics among a run's scalars (in writing order); every other key is ignored.

    When a key is logged twice for one step, the later scalar wins, as it does in the loggers' own viewers.

    Args:
        scalars: Every scalar of the run, in writing order.
        prefix: The callback's ``prefix=``; ``None`` detects it with :func:`detect_prefix`.

    Raises:
        ReportError: If ``prefix`` is ``None`` and the logs hold several prefixes.

    Example:
        >>> log = build_health_log([Scalar("train_loss", 0, 0.9), Scalar("layer_health.act_std/0_fc", 0, 0.5),
        ...     Scalar("layer_health/grad_norm_total", 0, 2.0)])
        >>> log.stats, log.totals, log.depth
        ({'act_std': {'fc': {0: 0.5}}}, {'grad_norm_total': {0: 2.0}}, {'fc': 0})

        Older logs (``<prefix>/<stat>/<name>`` keys and ``<prefix>/depth/<layer>`` scalars) read the same:

        >>> build_health_log([Scalar("layer_health/depth/fc", 0, 0.0), Scalar("layer_health/act_std/fc", 0, 0.5)]).depth
        {'fc': 0}
    """
    scalars = list(scalars)
    if prefix is None:
        prefix = detect_prefix({s.key for s in scalars})
    stats: dict[str, dict[str, dict[int, float]]] = {}
    totals: dict[str, dict[int, float]] = {}
    depth: dict[str, int] = {}
    steps: set[int] = set()
    # sorted() is stable, so within one step the order of writing still decides which duplicate wins.
    for key, step, value in sorted(scalars, key=lambda s: s.step):
        parsed = parse_key(key, prefix)
        if parsed is None:
            continue
        stat, name = parsed.stat, parsed.name
        if stat == LEGACY_DEPTH and name is not None:  # an older log: the depth of a layer, as a scalar per step
            if math.isfinite(value):
                depth[name] = int(value)
            continue
        if name is None:
            totals.setdefault(stat, {})[step] = value
        else:
            stats.setdefault(stat, {}).setdefault(name, {})[step] = value
            if parsed.depth is not None:
                # A parameter's key carries its module's depth (depth_order finds the module as its owning layer).
                depth[name.rpartition(".")[0] if stat.startswith("param_") else name] = parsed.depth
        steps.add(step)
    return HealthLog(prefix=prefix, steps=tuple(sorted(steps)), stats=stats, totals=totals, depth=depth)
