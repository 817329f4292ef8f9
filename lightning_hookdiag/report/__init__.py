"""``hookdiag report``: the statistics a LayerHealthCallback logged, read back, summarised and drawn.

No torch or Lightning import, so a run can be inspected wherever its logs are; matplotlib and tensorboard are
imported only when needed. The command's use and output: ``docs/report.md``.
"""

from lightning_hookdiag._errors import MissingExtraError, ReportError, ReportWarning
from lightning_hookdiag.report._health_log import HealthLog, Scalar, build_health_log, depth_order, detect_prefix
from lightning_hookdiag.report._reading import read_health_log
from lightning_hookdiag.report._summary import format_summary

__all__ = [
    "HealthLog",
    "MissingExtraError",
    "ReportError",
    "ReportWarning",
    "Scalar",
    "build_health_log",
    "depth_order",
    "detect_prefix",
    "format_summary",
    "read_health_log",
]
