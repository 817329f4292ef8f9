"""The logged key scheme: one dashboard group per statistic, layers in forward order under a plain string sort.

Pure Python, no torch: the callback formats keys with it, the rules and the report parse them back.

- A value per layer or parameter: ``<prefix>.<stat>/<depth>_<name>``, e.g. ``layer_health.act_std/07_net.7``.
  TensorBoard and W&B group charts by the part before the first ``/``, so each statistic is one group; ``<depth>``
  is the layer's place in the forward order, zero-padded to the digits of the last place, so that a plain string
  sort (MLflow's) and a natural one (TensorBoard's) both list the layers input end first.
- A value per step: ``<prefix>/<stat>`` (``grad_norm_total``, the worst layer's value ``act_std_min``, ...,
  and the count of active alerts ``alerts_active``): the summary group, which sorts before every statistic's group.
- A name without a depth (a parameter of the LightningModule itself, or of a layer that has not run yet) has ``x``
  in place of each digit (``xx_scale``), which sorts after every number.

Logs written before this scheme (``<prefix>/<stat>/<name>``, with ``<prefix>/depth/<layer>`` scalars) still parse.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import NamedTuple

__all__ = [
    "ALERTS_ACTIVE",
    "LEGACY_DEPTH",
    "ParsedKey",
    "depth_of",
    "known_prefixes",
    "name_key",
    "parse_key",
    "step_key",
    "tag",
    "tag_width",
]

ALERTS_ACTIVE = "alerts_active"
"""The summary group's count of active alerts (``<prefix>/alerts_active``): the findings of the step's rules."""

LEGACY_DEPTH = "depth"
"""The statistic segment of the per-step depth scalars of old logs (``<prefix>/depth/<layer>``)."""

_UNNUMBERED = "x"


class ParsedKey(NamedTuple):
    """A logged key read back: its statistic, its name (``None`` for a per-step value) and the depth it carries."""

    stat: str
    name: str | None
    depth: int | None


def tag_width(n_layers: int) -> int:
    """Digits of the largest depth among ``n_layers`` layers (at least 1).

    Example:
        >>> tag_width(97), tag_width(10), tag_width(1)
        (2, 1, 1)
    """
    return len(str(max(n_layers - 1, 0)))


def tag(depth: int | None, width: int) -> str:
    """The depth part of a key: zero-padded digits, or ``x`` per digit without a depth.

    Example:
        >>> tag(7, 2), tag(None, 2)
        ('07', 'xx')
    """
    return _UNNUMBERED * width if depth is None else f"{depth:0{width}d}"


def name_key(prefix: str, stat: str, tag_: str, name: str) -> str:
    """The key of one layer's (or parameter's) value.

    Example:
        >>> name_key("layer_health", "act_dead_frac", "61", "net.61")
        'layer_health.act_dead_frac/61_net.61'
    """
    return f"{prefix}.{stat}/{tag_}_{name}"


def step_key(prefix: str, stat: str) -> str:
    """The key of a value with one number per step (the summary group).

    Example:
        >>> step_key("layer_health", "act_grad_norm_min")
        'layer_health/act_grad_norm_min'
    """
    return f"{prefix}/{stat}"


def depth_of(name: str, depth: Mapping[str, int], parameter: bool = False) -> int | None:
    """The depth a name is keyed with, given the depth of every numbered layer.

    A layer's own; else that of the nearest numbered layer it is inside (a module within a selected container);
    else the smallest of the numbered layers inside it (a container, such as an attention module whose projections
    are selected). A parameter takes its module's (the name minus its last segment); a parameter of the
    LightningModule itself has none.

    Example:
        >>> depth = {"enc.0": 0, "enc.1": 1, "head": 2}
        >>> depth_of("head.weight", depth, parameter=True), depth_of("enc", depth), depth_of("scale", depth, True)
        (2, 0, None)
    """
    if parameter:
        name = name.rpartition(".")[0]
        if not name:
            return None
    if name in depth:
        return depth[name]
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the nearest numbered ancestor first
        ancestor = ".".join(parts[:cut])
        if ancestor in depth:
            return depth[ancestor]
    inside = [d for layer, d in depth.items() if layer.startswith(name + ".")]
    return min(inside) if inside else None


def parse_key(key: str, prefix: str) -> ParsedKey | None:
    """Read a key logged under ``prefix`` back, in this scheme or the one before it; ``None`` for any other key.

    Example:
        >>> parse_key("layer_health.act_std/07_net.7", "layer_health")
        ParsedKey(stat='act_std', name='net.7', depth=7)
        >>> parse_key("layer_health.param_norm/xx_scale", "layer_health")
        ParsedKey(stat='param_norm', name='scale', depth=None)
        >>> parse_key("layer_health/act_std_min", "layer_health")
        ParsedKey(stat='act_std_min', name=None, depth=None)
        >>> parse_key("layer_health/act_std/net.7", "layer_health")  # an old log
        ParsedKey(stat='act_std', name='net.7', depth=None)
        >>> parse_key("train_loss", "layer_health") is None
        True
    """
    if key.startswith(prefix + "."):
        stat, sep, rest = key[len(prefix) + 1 :].partition("/")
        tag_, underscore, name = rest.partition("_")
        if not (stat and sep and underscore and name and tag_):
            return None
        if tag_.isdigit():
            return ParsedKey(stat, name, int(tag_))
        return ParsedKey(stat, name, None) if set(tag_) == {_UNNUMBERED} else None
    if key.startswith(prefix + "/"):
        stat, sep, name = key[len(prefix) + 1 :].partition("/")
        if not stat:
            return None
        return ParsedKey(stat, name if sep and name else None, None)
    return None


def known_prefixes(keys: Collection[str], stats: Collection[str]) -> set[str]:
    """The prefixes under which keys of this scheme name one of ``stats`` (``<prefix>.<stat>/<tag>_<name>``).

    Example:
        >>> sorted(known_prefixes(["exp-health.act_std/0_fc", "train_loss", "a.b/c"], ["act_std"]))
        ['exp-health']
    """
    found = set()
    for key in keys:
        head = key.partition("/")[0]
        prefix, dot, stat = head.rpartition(".")
        if dot and prefix and stat in stats and parse_key(key, prefix) is not None:
            found.add(prefix)
    return found
