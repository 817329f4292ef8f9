"""What the report command raises and warns: bad input in one line, a missing extra, logs read only in part."""

from __future__ import annotations

__all__ = ["MissingExtraError", "ReportError", "ReportWarning"]


class ReportError(Exception):
    """The logs cannot be reported on (missing folder, no health keys, unknown statistic); the message says why."""


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the ``pip install`` extra that provides it."""


class ReportWarning(UserWarning):
    """Part of the logs was left out (a CSV row cut short by a run still writing it); the message says which."""
