"""Logged keys read back by statistic and layer name, with a parser written here from the documented layout
(``docs/statistics.md#keys``), not the package's: a change to the layout the package writes fails the tests that
read its keys instead of being followed by them."""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import NamedTuple

from lightning_hookdiag._vocabulary import PER_PARAMETER_STATS

# One value per layer or parameter: ``<prefix>.<stat>/<depth>_<name>``, the depth zero-padded digits, or ``x`` in
# place of each digit for a parameter whose module has no place in the forward order.
_PER_LAYER = re.compile(r"(?P<stat>[^/]+)/(?P<depth>[0-9]+|x+)_(?P<name>.+)")


class Key(NamedTuple):
    """A logged key read back: its statistic, its layer or parameter (``None``: one value per step), its depth."""

    stat: str
    name: str | None
    depth: int | None


def parse_key(key: str, prefix: str) -> Key | None:
    """``key`` logged under ``prefix`` read back by the documented layout; ``None`` for a key of no such shape.

    ``<prefix>/<stat>`` is the summary group (one value per step); ``<prefix>/<stat>/<name>`` is a per-layer key as
    :func:`by_name` writes it (and as logs before the depth was in the key have it).
    """
    if key.startswith(prefix + "."):
        match = _PER_LAYER.fullmatch(key[len(prefix) + 1 :])
        if match is None:
            return None
        depth = match["depth"]
        return Key(match["stat"], match["name"], int(depth) if depth.isdigit() else None)
    if key.startswith(prefix + "/"):
        stat, _, name = key[len(prefix) + 1 :].partition("/")
        return Key(stat, name or None, None) if stat else None
    return None


def by_name(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` with each per-layer key read back as ``<prefix>/<stat>/<name>``, for tests that look a value up by
    statistic and layer name; the summary group and every other key stay as they are.

    The logged layout (``<prefix>.<stat>/<depth>_<name>``, ``docs/statistics.md#keys``) is checked on the keys as
    logged in ``tests/integration/test_keys.py``; the keys are read with :func:`parse_key`.
    """
    out = {}
    for key, value in metrics.items():
        head = key.partition("/")[0]
        prefix, dot, _ = head.rpartition(".")
        parsed = parse_key(key, prefix) if dot and prefix else None
        if parsed is not None and parsed.name is not None:
            out[f"{prefix}/{parsed.stat}/{parsed.name}"] = value
        else:
            out[key] = value
    return out


def csv_statistic(run_dir: Path, stat: str, prefix: str = "layer_health") -> dict[int, dict[str, float]]:
    """``{step: {layer: value}}`` of one per-layer statistic, read back from a CSVLogger run's ``metrics.csv``."""
    out: dict[int, dict[str, float]] = {}
    with open(run_dir / "metrics.csv", newline="") as fh:
        for row in csv.DictReader(fh):
            for key, cell in row.items():
                parsed = parse_key(key, prefix)
                if parsed is not None and parsed.stat == stat and parsed.name is not None and cell != "":
                    out.setdefault(int(row["step"]), {})[parsed.name] = float(cell)
    return out


def depths(metrics: dict[str, float], prefix: str = "layer_health") -> dict[str, int]:
    """The depth (place in the forward order) that each layer's keys in ``metrics`` carry, read with
    :func:`parse_key`; parameters' keys (which carry their module's depth) are left out."""
    out = {}
    for key in metrics:
        parsed = parse_key(key, prefix)
        if parsed is None or parsed.name is None or parsed.depth is None or parsed.stat in PER_PARAMETER_STATS:
            continue
        out[parsed.name] = parsed.depth
    return out
