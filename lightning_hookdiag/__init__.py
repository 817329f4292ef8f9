"""Layer-by-layer activation and gradient health for PyTorch Lightning training runs.

Add :class:`LayerHealthCallback` to a ``Trainer``; use :func:`capture_activations` outside training and
:func:`list_layers` to find the names a selection accepts. ``hookdiag report LOG_DIR`` draws what was logged.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Exports load on first use: the ``hookdiag report`` command reads logs without torch or Lightning, and importing
# the package for it should not cost the seconds those take to import.
_EXPORTS = {
    "ALL_STATS": "lightning_hookdiag._vocabulary",
    "Finding": "lightning_hookdiag.rules",
    "LayerHealthCallback": "lightning_hookdiag._callback",
    "LayerHealthError": "lightning_hookdiag._errors",
    "LayerHealthWarning": "lightning_hookdiag._errors",
    "LayerInfo": "lightning_hookdiag._selection",
    "OPT_IN_STATS": "lightning_hookdiag._vocabulary",
    "PRECURSOR_STATS": "lightning_hookdiag._vocabulary",
    "RuleConfig": "lightning_hookdiag.rules",
    "Trip": "lightning_hookdiag._step_state",
    "capture_activations": "lightning_hookdiag._capture",
    "list_layers": "lightning_hookdiag._selection",
    "MeasureConfig": "lightning_hookdiag._config",
    "OutputConfig": "lightning_hookdiag._config",
    "SentinelConfig": "lightning_hookdiag._config",
    "SpikeDetector": "lightning_hookdiag._sentinel",
}

# A literal list, so that linters and type checkers see the lazy exports.
__all__ = [
    "ALL_STATS",
    "Finding",
    "LayerHealthCallback",
    "LayerHealthError",
    "LayerHealthWarning",
    "LayerInfo",
    "MeasureConfig",
    "OPT_IN_STATS",
    "OutputConfig",
    "PRECURSOR_STATS",
    "RuleConfig",
    "SentinelConfig",
    "SpikeDetector",
    "Trip",
    "__version__",
    "capture_activations",
    "list_layers",
]

if TYPE_CHECKING:
    from lightning_hookdiag._callback import LayerHealthCallback
    from lightning_hookdiag._capture import capture_activations
    from lightning_hookdiag._config import MeasureConfig, OutputConfig, SentinelConfig
    from lightning_hookdiag._errors import LayerHealthError, LayerHealthWarning
    from lightning_hookdiag._selection import LayerInfo, list_layers
    from lightning_hookdiag._sentinel import SpikeDetector
    from lightning_hookdiag._step_state import Trip
    from lightning_hookdiag._vocabulary import ALL_STATS, OPT_IN_STATS, PRECURSOR_STATS
    from lightning_hookdiag.rules import Finding, RuleConfig


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_hookdiag' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
