"""Logged keys read back by statistic and layer name, with the package's own key parser."""

from __future__ import annotations

import csv
from pathlib import Path

from lightning_hookdiag.keys import parse_key
from lightning_hookdiag.vocabulary import PER_PARAMETER_STATS


def by_name(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` with each per-layer key read back as ``<prefix>/<stat>/<name>``, for tests that look a value up by
    statistic and layer name; the summary group and every other key stay as they are.

    The logged layout (``<prefix>.<stat>/<depth>_<name>``, ``docs/statistics.md#keys``) is checked on the keys as
    logged in ``tests/integration/test_keys.py``; the depth part is read with the package's parser.
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
    """The depth (place in the forward order) that each layer's keys in ``metrics`` carry, read with the package's
    parser; parameters' keys (which carry their module's depth) are left out."""
    out = {}
    for key in metrics:
        parsed = parse_key(key, prefix)
        if parsed is None or parsed.name is None or parsed.depth is None or parsed.stat in PER_PARAMETER_STATS:
            continue
        out[parsed.name] = parsed.depth
    return out
