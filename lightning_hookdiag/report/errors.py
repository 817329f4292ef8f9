"""Errors of the report command: bad input it can explain in one line, and a missing optional dependency."""

from __future__ import annotations

__all__ = ["MissingExtraError", "ReportError"]


class ReportError(Exception):
    """The logs cannot be reported on (missing folder, no health keys, unknown statistic); the message says why."""


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the ``pip install`` extra that provides it."""
