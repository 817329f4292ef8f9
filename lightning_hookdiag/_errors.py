"""Warning and error types raised by lightning_hookdiag (the report's too), so that users can filter them precisely."""

from __future__ import annotations

__all__ = ["LayerHealthError", "LayerHealthWarning", "MissingExtraError", "ReportError", "ReportWarning"]


class LayerHealthWarning(UserWarning):
    """Something about the observed layers deserves attention (a layer did not run, an output was not observable)."""


class LayerHealthError(RuntimeError):
    """Raised when a health rule fires and the callback was configured with ``on_anomaly="raise"``."""


class ReportError(Exception):
    """The logs cannot be reported on (missing folder, no health keys, unknown statistic); the message says why."""


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the ``pip install`` extra that provides it."""


class ReportWarning(UserWarning):
    """Part of the logs was left out (a CSV row cut short by a run still writing it); the message says which."""
