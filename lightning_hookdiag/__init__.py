"""Layer-by-layer activation and gradient health for PyTorch Lightning training runs.

Add :class:`LayerHealthCallback` to a ``Trainer``; use :func:`capture_activations` outside training and
:func:`list_layers` to find the names a selection accepts.
"""

from lightning_hookdiag.callback import LayerHealthCallback
from lightning_hookdiag.capture import capture_activations
from lightning_hookdiag.errors import LayerHealthError, LayerHealthWarning
from lightning_hookdiag.selection import LayerInfo, list_layers
from lightning_hookdiag.stats import ALL_STATS

__version__ = "0.1.0"

__all__ = [
    "ALL_STATS",
    "LayerHealthCallback",
    "LayerHealthError",
    "LayerHealthWarning",
    "LayerInfo",
    "__version__",
    "capture_activations",
    "list_layers",
]
