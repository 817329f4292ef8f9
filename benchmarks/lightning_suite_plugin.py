"""Pytest plugin for ``benchmarks/lightning_suite.py``: puts ``LayerHealthCallback`` into every Lightning ``Trainer``.

Loaded with ``-p lightning_suite_plugin`` (``benchmarks/`` on ``PYTHONPATH``) into a run of Lightning's own test
suite. Two options:

``--hookdiag-inject``
    Wrap ``lightning.pytorch.Trainer.__init__`` so that every Trainer, however a test builds it (directly, through a
    subclass, through ``LightningCLI``), gets one new ``LayerHealthCallback(every_n_steps=1)`` appended to its
    ``callbacks``. Without it the plugin only records, which makes the baseline run.
``--hookdiag-record PATH``
    Write one JSON line per test to ``PATH``: its outcome, the last lines of its failure, how many callbacks were
    injected, the findings of those callbacks by rule, and the ``LayerHealthWarning`` s pytest recorded, by rule.

Records are written line by line, so a run cut short by a timeout keeps what it finished.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

EVERY_N_STEPS = 1
TAIL_LINES = 12
TAIL_WIDTH = 300


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the plugin's two options."""
    group = parser.getgroup("hookdiag", "LayerHealthCallback injected into Lightning's tests")
    group.addoption("--hookdiag-inject", action="store_true", help="append LayerHealthCallback to every Trainer")
    group.addoption("--hookdiag-record", metavar="PATH", default=None, help="write one JSON line per test to PATH")


class _Recorder:
    """Collects, per test, the outcome and what the injected callbacks said, and writes it as one JSON line."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.callbacks: list[Any] = []
        self.current: dict[str, Any] | None = None
        if path is not None:
            path.write_text("")

    def start(self, nodeid: str) -> None:
        """Flush the previous test (its warnings are recorded after its last report) and open ``nodeid``'s record."""
        self.flush()
        self.callbacks = []
        self.current = {"nodeid": nodeid, "phases": {}, "tail": "", "warnings": []}

    def report(self, report: pytest.TestReport) -> None:
        """Keep the phase's outcome and, for a failure, the last lines of its traceback."""
        if self.current is None:
            return
        outcome = report.outcome
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        self.current["phases"][report.when] = outcome
        if report.failed and not self.current["tail"]:
            text = report.longreprtext.strip().splitlines()
            self.current["tail"] = "\n".join(line[:TAIL_WIDTH] for line in text[-TAIL_LINES:])

    def warning(self, message: str) -> None:
        """Keep the text of one ``LayerHealthWarning`` recorded for the current test."""
        if self.current is not None:
            self.current["warnings"].append(message)

    def flush(self) -> None:
        """Write the open record, with its findings and warnings counted by rule."""
        record = self.current
        self.current = None
        if record is None or self.path is None:
            return
        rule_of = {}
        findings: Counter[str] = Counter()
        for callback in self.callbacks:
            for finding in callback.findings:
                findings[finding.rule] += 1
                rule_of[f"LayerHealthCallback: {finding.message}"] = finding.rule
        by_rule: Counter[str] = Counter()
        for message in record.pop("warnings"):
            by_rule[rule_of.get(message, "note: " + _note_key(message))] += 1
        record["outcome"] = _outcome(record.pop("phases"))
        record["injected"] = len(self.callbacks)
        record["findings"] = dict(findings)
        record["warnings"] = dict(by_rule)
        with self.path.open("a") as stream:
            stream.write(json.dumps(record) + "\n")


def _note_key(message: str) -> str:
    """A one-time note's message with its numbers and quoted names blanked, so that notes of one kind count together."""
    message = re.sub(r"'[^']*'", "'…'", message)
    return re.sub(r"\d+(\.\d+)?", "N", message)[:100]


def _outcome(phases: dict[str, str]) -> str:
    """One word per test, as pytest's summary counts it (a failing teardown after a pass counts as an error)."""
    setup = phases.get("setup", "passed")
    call = phases.get("call")
    teardown = phases.get("teardown", "passed")
    if setup == "failed":
        return "error"
    if setup in ("skipped", "xfailed"):
        return setup
    if call in ("failed", "skipped", "xfailed", "xpassed"):
        return call
    if teardown == "failed":
        return "error"
    return "passed"


def _inject(recorder: _Recorder) -> None:
    """Wrap ``Trainer.__init__`` so that every Trainer gets a new ``LayerHealthCallback(every_n_steps=1)``."""
    from lightning.pytorch import Callback, Trainer

    from lightning_hookdiag import LayerHealthCallback

    original = Trainer.__init__

    @functools.wraps(original)
    def __init__(self: Trainer, *args: Any, **kwargs: Any) -> None:
        # Trainer's arguments are keyword-only; a copy, so that a test's own list is left as it passed it.
        callbacks = kwargs.get("callbacks")
        if callbacks is None:
            callbacks = []
        elif isinstance(callbacks, Callback):
            callbacks = [callbacks]
        else:
            callbacks = list(callbacks)
        callback = LayerHealthCallback(every_n_steps=EVERY_N_STEPS)
        recorder.callbacks.append(callback)
        kwargs["callbacks"] = [*callbacks, callback]
        original(self, *args, **kwargs)

    Trainer.__init__ = __init__


# The hooks below get no ``config`` to find the recorder in, and a pytest session has one: a module-level holder.
_RECORDER = _Recorder(None)


def pytest_configure(config: pytest.Config) -> None:
    """Set up the recorder and, with ``--hookdiag-inject``, the wrapped ``Trainer.__init__``."""
    global _RECORDER
    if not config.pluginmanager.hasplugin("rerunfailures"):
        # Lightning marks a few tests `flaky` for pytest-rerunfailures; without it they run once, in both runs alike.
        config.addinivalue_line("markers", "flaky(reruns, reruns_delay): rerun on failure (not installed: runs once)")
    path = config.getoption("--hookdiag-record")
    _RECORDER = _Recorder(Path(path) if path else None)
    if config.getoption("--hookdiag-inject"):
        _inject(_RECORDER)


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    """Open the test's record."""
    _RECORDER.start(nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Keep each phase's outcome."""
    _RECORDER.report(report)


def pytest_warning_recorded(warning_message: warnings.WarningMessage, when: str, nodeid: str, location: Any) -> None:
    """Keep the ``LayerHealthWarning`` s recorded for the current test."""
    from lightning_hookdiag import LayerHealthWarning

    if issubclass(warning_message.category, LayerHealthWarning):
        _RECORDER.warning(str(warning_message.message))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the last test's record."""
    _RECORDER.flush()
