"""Reading back ``findings.jsonl``: the findings and sentinel trips a run wrote beside its logs, one JSON object a line.

:class:`~lightning_hookdiag._publish.FindingsWriter` appends them to a CSV or TensorBoard logger's ``log_dir``; each
object has ``"kind"`` (``"finding"`` or ``"trip"``), ``"step"``, ``"rule"`` and ``"message"``. No torch or Lightning
import, as for the rest of the report.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from lightning_hookdiag._errors import ReportError, ReportWarning

__all__ = ["FINDINGS_FILE", "format_findings", "read_findings"]

FINDINGS_FILE = "findings.jsonl"  # publish writes it under this name (defined here: the report imports no Lightning)


def read_findings(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The findings and trips of a run, in the order they were written; none when the run wrote no file.

    Args:
        run_dir: A logger's ``log_dir``, or the ``findings.jsonl`` file itself.

    Raises:
        ReportError: If ``run_dir`` does not exist, or a line (other than a last one cut short) is not a JSON object.

    Warns:
        ReportWarning: If the last line is cut short (a run still writing it); it is left out.
    """
    path = Path(run_dir)
    if not path.exists():
        raise ReportError(f"{path}: no such file or folder")
    if path.is_dir():
        path = path / FINDINGS_FILE
        if not path.is_file():
            return []
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines) and not text.endswith("\n"):
                warnings.warn(f"{path}:{number}: left out a line cut short ({error})", ReportWarning, stacklevel=2)
                break
            raise ReportError(f"{path}:{number}: not a JSON line ({error})") from error
        if not isinstance(record, dict) or "kind" not in record:
            raise ReportError(f"{path}:{number}: expected a JSON object with a 'kind', got {line[:80]!r}")
        records.append(record)
    return records


def format_findings(records: list[dict[str, Any]]) -> str:
    """The records as text, one per line: ``step <k>  <rule>  <message>``.

    Example:
        >>> print(format_findings([{"kind": "finding", "step": 3, "rule": "dead_units", "message": "fc1: 97% dead"}]))
        step 3  dead_units  fc1: 97% dead
    """
    width = max((len(str(r.get("step"))) for r in records), default=0)
    return "\n".join(f"step {str(r.get('step')):>{width}}  {r.get('rule')}  {r.get('message')}" for r in records)
