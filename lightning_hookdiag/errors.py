"""Warning and error types raised by lightning_hookdiag, so that users can filter them precisely."""

from __future__ import annotations

__all__ = ["LayerHealthError", "LayerHealthWarning"]


class LayerHealthWarning(UserWarning):
    """Something about the observed layers deserves attention (a layer did not run, an output was not observable)."""


class LayerHealthError(RuntimeError):
    """Raised when a health rule fires and the callback was configured with ``on_anomaly="raise"``."""
