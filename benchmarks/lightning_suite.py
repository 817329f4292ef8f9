"""Lightning's own tests, run with ``LayerHealthCallback(every_n_steps=1)`` added to every ``Trainer`` (issue 35).

Runs the trainer, loops, models and callbacks tests of Lightning's test suite twice, at the installed Lightning's
version: once as they are (the baseline) and once with the pytest plugin ``lightning_suite_plugin.py`` (beside this
file) appending a new ``LayerHealthCallback(every_n_steps=1)`` to every Trainer. Prints, in markdown, the counts of
both runs, every test that fails only with the callback (sorted into the expected ones, tests that count callbacks or
logged keys, each with its reason, and the rest, each a defect until explained), and the ``LayerHealthWarning`` s by
rule. CPU only: Lightning's GPU, TPU and standalone tests skip themselves.

Lightning's tests are not in its wheel or its PyPI sdist; they come from its git repository, at the tag of the
installed version (``python -c "import lightning; print(lightning.__version__)"``)::

    git clone --filter=blob:none --no-checkout https://github.com/Lightning-AI/pytorch-lightning /tmp/pl
    git -C /tmp/pl archive 2.6.5 pyproject.toml src/version.info tests/tests_pytorch | tar x -C /tmp/lightning-src
    PYTHONPATH=$PWD python benchmarks/lightning_suite.py /tmp/lightning-src --jobs 2 > lightning_suite.md

The repository has no tag for 2.6.6 (the version installed here as this was written): 2.6.6 is 2.6.5 with one fix
to ``lightning/pytorch/core/saving.py`` (checkpoint class paths, compared file by file against the 2.6.6 sdist), so
the 2.6.5 tests are the ones to run; the script says when the tree's ``src/version.info`` is not the installed
version, and refuses another minor version. The source tree is read, never written: pytest runs in its ``tests/``
with Lightning's own ``pyproject.toml`` settings (warnings as errors where Lightning sets them), and the records go
to ``--out``. ``models/test_onnx.py`` is left out when ``onnxruntime`` is not installed (it imports it at the top).

``--report-only`` reads the records of an earlier run again; ``--modes callback`` runs one side, e.g. to look at one
file: ``--dirs trainer/test_trainer.py --modes callback``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DIRS = ("trainer", "loops", "models", "callbacks")
MODES = ("baseline", "callback")
RERUN = "rerun"
FAILING = ("failed", "error")
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")

# Tests that fail with the callback because they assert on the set of callbacks, on the calls a logger gets, or on the
# keys that were logged: what the issue expects. Keyed by test function (parameters stripped): the reason, and a text
# that the end of the failure must contain to show it is that assertion (the callback's keys or the callback itself).
# Each was read and its failure checked; a listed test failing without that text is reported as a defect.
LOGGED_CALLS = "layer_health"  # the summary group (layer_health/...) and the per-layer keys (layer_health.<stat>/...)
CALLBACK_LIST = "LayerHealthCallback object"
EXPECTED: dict[str, tuple[str, str]] = {
    "test_log_every_n_steps": (
        "asserts that the logger's `log_metrics` calls are one every `log_every_n_steps` steps and nothing between "
        "(`assert_has_calls` on a consecutive sequence); the callback logs its keys on every sampled step",
        LOGGED_CALLS,
    ),
    "test_eval_step_logging": (
        "asserts the exact list of the logger's `log_metrics` calls (`mock_calls == [...]`)",
        LOGGED_CALLS,
    ),
    "test_validation_step_log_with_tensorboard": (
        "asserts the exact list of the logger's `log_metrics` calls (`mock_calls == [...]`)",
        LOGGED_CALLS,
    ),
    "test_logger_after_fit_predict_test_calls": (
        "asserts the exact set of keys a logger received over fit (`logs == {'fit': 1, 'validate': 1}`)",
        LOGGED_CALLS,
    ),
    "test_attach_model_callbacks": (
        "asserts the exact list of `trainer.callbacks` (`== []`, then the model's callbacks merged in)",
        CALLBACK_LIST,
    ),
    "test_checkpoint_callbacks_are_last": (
        "asserts the exact order of `trainer.callbacks` (checkpoint callbacks last)",
        CALLBACK_LIST,
    ),
    "test_configure_external_callbacks": (
        "asserts the exact list of `trainer.callbacks` with callbacks from entry points (`== []`, ...)",
        CALLBACK_LIST,
    ),
    "test_log_metrics_epoch_step_values": (
        "asserts that the logger's `log_metrics` calls are exactly the `_step`/`_epoch` keys' calls, in order "
        "(`assert_has_calls` on a consecutive sequence)",
        LOGGED_CALLS,
    ),
    "test_log_on_train_start": (
        "asserts the exact list of the logger's `log_metrics` calls (`mock_calls == [one call]`)",
        LOGGED_CALLS,
    ),
    "test_throughput_monitor_fit": (
        "asserts the exact list of the logger's `log_metrics` calls (ThroughputMonitor's)",
        LOGGED_CALLS,
    ),
    "test_throughput_monitor_fit_with_validation": (
        "asserts the exact list of the logger's `log_metrics` calls (ThroughputMonitor's)",
        LOGGED_CALLS,
    ),
    "test_throughput_monitor_fit_no_length_fn": (
        "asserts the exact list of the logger's `log_metrics` calls (ThroughputMonitor's)",
        LOGGED_CALLS,
    ),
    "test_throughput_monitor_fit_gradient_accumulation": (
        "asserts the exact list of the logger's `log_metrics` calls (ThroughputMonitor's)",
        LOGGED_CALLS,
    ),
    "test_throughput_monitor_variable_batch_size": (
        "asserts the number of the logger's `log_metrics` calls (one per batch, ThroughputMonitor's)",
        LOGGED_CALLS,
    ),
}


def is_expected(nodeid: str, record: dict) -> bool:
    """Whether a failure is one of :data:`EXPECTED`, with its evidence in the failure's text."""
    entry = EXPECTED.get(function_name(nodeid))
    return entry is not None and entry[1] in record["tail"]


@dataclass
class Shard:
    """One pytest process: a mode and the test paths it runs."""

    mode: str
    index: int
    paths: list[str]

    def record(self, out: Path) -> Path:
        """Where the plugin writes this shard's JSON lines."""
        return out / f"{self.mode}-{self.index}.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="Lightning source tree: has pyproject.toml and tests/tests_pytorch")
    parser.add_argument("--dirs", nargs="+", default=list(DIRS), help="paths under tests/tests_pytorch to run")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--jobs", type=int, default=1, help="pytest processes at once, over both modes")
    parser.add_argument("--out", type=Path, default=Path("/tmp/lightning_suite"), help="folder for the records")
    parser.add_argument("--timeout", type=int, default=7200, help="seconds one pytest process may run")
    parser.add_argument("--report-only", action="store_true", help="report on the records already in --out")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, after --")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be an integer >= 1, got {args.jobs}")
    tests = args.source / "tests" / "tests_pytorch"
    if not tests.is_dir() or not (args.source / "pyproject.toml").is_file():
        parser.error(f"{args.source} is not a Lightning source tree: it needs pyproject.toml and tests/tests_pytorch")
    return args


def check_version(source: Path) -> str:
    """A line naming the tests' and the installed version; exits if their major.minor differ."""
    import lightning

    installed = lightning.__version__
    version_file = source / "src" / "version.info"
    tests = version_file.read_text().strip() if version_file.is_file() else "unknown (no src/version.info)"
    if tests.split(".")[:2] != installed.split(".")[:2] and not tests.startswith("unknown"):
        sys.exit(f"the tests in {source} are Lightning {tests}, the installed Lightning is {installed}")
    return f"Lightning installed: {installed}; tests from source tree version: {tests}"


def left_out() -> dict[str, str]:
    """Test files that cannot be collected here, with the reason."""
    skipped = {}
    if importlib.util.find_spec("onnxruntime") is None:
        skipped["tests_pytorch/models/test_onnx.py"] = "imports onnxruntime, not installed"
    return skipped


def shards(source: Path, dirs: list[str], modes: list[str], jobs: int, ignored: dict[str, str]) -> list[Shard]:
    """Split the test files of ``dirs`` into ``jobs`` shards per mode, balanced by file size, modes interleaved."""
    tests = source / "tests"
    files: list[Path] = []
    for name in dirs:
        path = tests / "tests_pytorch" / name
        files.extend(sorted(path.rglob("test_*.py")) if path.is_dir() else [path])
    relative = [str(f.relative_to(tests)) for f in files if str(f.relative_to(tests)) not in ignored]
    relative.sort(key=lambda name: -(tests / name).stat().st_size)
    buckets: list[list[str]] = [[] for _ in range(jobs)]
    sizes = [0] * jobs
    for name in relative:
        smallest = sizes.index(min(sizes))
        buckets[smallest].append(name)
        sizes[smallest] += (tests / name).stat().st_size
    return [Shard(mode, i, sorted(bucket)) for i, bucket in enumerate(buckets) if bucket for mode in modes]


def command(shard: Shard, out: Path, extra: list[str]) -> list[str]:
    """The pytest command line of one shard."""
    cmd = [sys.executable, "-m", "pytest", *shard.paths, "-p", "lightning_suite_plugin"]
    cmd += ["--hookdiag-record", str(shard.record(out)), "-q", "--color=no", "-p", "no:cacheprovider"]
    # A hung test dumps its stack into the log instead of hanging the run silently.
    cmd += ["-o", "faulthandler_timeout=600"]
    if shard.mode != "baseline":
        cmd.append("--hookdiag-inject")
    return cmd + extra


def run_shards(source: Path, out: Path, todo: list[Shard], jobs: int, timeout: int, extra: list[str]) -> dict:
    """Run the shards, ``jobs`` at a time; returns each mode's wall time and pytest exit codes."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    pending = list(todo)
    running: list[tuple[Shard, subprocess.Popen, float]] = []
    timing: dict = {"wall_s": {}, "exit_codes": {}}
    while pending or running:
        while pending and len(running) < jobs:
            shard = pending.pop(0)
            log = (out / f"{shard.mode}-{shard.index}.log").open("w")
            cmd = ["timeout", str(timeout), *command(shard, out, extra)]
            process = subprocess.Popen(cmd, cwd=source / "tests", env=env, stdout=log, stderr=subprocess.STDOUT)
            running.append((shard, process, time.monotonic()))
        time.sleep(2)
        for item in list(running):
            shard, process, start = item
            if process.poll() is None:
                continue
            running.remove(item)
            name = f"{shard.mode}-{shard.index}"
            timing["wall_s"][name] = round(time.monotonic() - start, 1)
            timing["exit_codes"][name] = process.returncode
            print(f"{name}: exit {process.returncode} in {timing['wall_s'][name]} s", file=sys.stderr)
    return timing


def load(out: Path, mode: str) -> dict[str, dict]:
    """Every test's record of one mode, by node id."""
    records = {}
    for path in sorted(out.glob(f"{mode}-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records[record["nodeid"]] = record
    return records


def function_name(nodeid: str) -> str:
    """The test function of a node id, parameters and class stripped."""
    return nodeid.split("::")[-1].split("[")[0]


def counts_table(runs: dict[str, dict[str, dict]]) -> list[str]:
    """Markdown rows: outcome counts per mode."""
    lines = ["| run | tests | " + " | ".join(OUTCOMES) + " |", "|---|---:|" + "---:|" * len(OUTCOMES)]
    for mode, records in runs.items():
        counts = Counter(record["outcome"] for record in records.values())
        cells = " | ".join(str(counts.get(outcome, 0)) for outcome in OUTCOMES)
        lines.append(f"| {mode} | {len(records)} | {cells} |")
    return lines


def failure_section(title: str, nodeids: list[str], records: dict[str, dict], reasons: bool) -> list[str]:
    """A markdown list of failing tests, with the reason (expected) or the end of the traceback (defects)."""
    lines = [f"### {title} ({len(nodeids)})", ""]
    if not nodeids:
        return [*lines, "None.", ""]
    for nodeid in nodeids:
        record = records[nodeid]
        if reasons:
            lines.append(f"- `{nodeid}`: {EXPECTED[function_name(nodeid)][0]}")
            continue
        tail = ["  " + line for line in record["tail"].splitlines()]
        lines += [f"- `{nodeid}` ({record['outcome']})", "", "  ```", *tail, "  ```", ""]
    return [*lines, ""]


def outcome_of(records: dict[str, dict], nodeid: str) -> str:
    """A test's outcome in one run, ``"absent"`` when that run has no record of it."""
    return records.get(nodeid, {}).get("outcome", "absent")


def comparison(base: dict[str, dict], cb: dict[str, dict], rerun: dict[str, dict]) -> tuple[list[str], dict]:
    """Markdown of the tests whose outcome the callback changed: expected, passing when rerun alone, and defects."""
    only = sorted(n for n in cb if outcome_of(cb, n) in FAILING and outcome_of(base, n) == "passed")
    expected = [n for n in only if is_expected(n, cb[n])]
    unexplained = [n for n in only if not is_expected(n, cb[n])]
    flaky = [n for n in unexplained if outcome_of(rerun, n) == "passed"]
    defects = [n for n in unexplained if n not in flaky]
    fixed = sorted(n for n in cb if outcome_of(cb, n) == "passed" and outcome_of(base, n) in FAILING)
    both = sorted(n for n in cb if outcome_of(cb, n) in FAILING and outcome_of(base, n) in FAILING)
    missing = sorted(set(base) ^ set(cb))
    title = "Fail only with the callback, expected (count callbacks or logged keys)"
    lines = failure_section(title, expected, cb, True)
    title = "Fail only with the callback, but passed when rerun alone with it (timing under load)"
    lines += failure_section(title, flaky, cb, False)
    lines += failure_section("Fail only with the callback, not explained (defects)", defects, cb, False)
    lines.append(f"Failing in both runs (not the callback's doing): {len(both)}; failing only without it: {len(fixed)}")
    lines += [", ".join(f"`{n}`" for n in both + fixed) or "none", ""]
    if missing:
        lines += [f"In one run only (a run cut short?): {len(missing)}.", ""]
    numbers = {"expected": expected, "passed_on_rerun": flaky, "defects": defects}
    numbers.update(failing_in_both=both, failing_only_baseline=fixed)
    return lines, numbers


def unexplained(out: Path) -> list[str]:
    """Node ids (relative to the source tree's ``tests/``) that fail only with the callback and are not expected."""
    base, cb = load(out, "baseline"), load(out, "callback")
    failing = [n for n in cb if outcome_of(cb, n) in FAILING and outcome_of(base, n) == "passed"]
    return [n.removeprefix("tests/") for n in sorted(failing) if not is_expected(n, cb[n])]


def warnings_table(records: dict[str, dict]) -> tuple[list[str], dict]:
    """Markdown of the LayerHealthWarnings pytest recorded, by rule (or kind of note), next to the findings."""
    warned: Counter[str] = Counter()
    found: Counter[str] = Counter()
    for record in records.values():
        warned.update(record["warnings"])
        found.update(record["findings"])
    injected = sum(record["injected"] for record in records.values())
    total = sum(warned.values())
    lines = [f"Callbacks injected: {injected}. LayerHealthWarnings recorded by pytest: {total}.", ""]
    lines += ["| rule or note | warnings | findings |", "|---|---:|---:|"]
    for key, count in sorted(warned.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {key} | {count} | {found.get(key, '')} |")
    return [*lines, ""], {"injected": injected, "warnings": dict(warned), "findings": dict(found)}


def report(runs: dict[str, dict[str, dict]], header: list[str]) -> tuple[str, dict]:
    """The markdown report and its numbers."""
    lines = ["# Lightning's tests with LayerHealthCallback(every_n_steps=1) in every Trainer", "", *header, ""]
    lines += [*counts_table(runs), ""]
    summary: dict = {mode: dict(Counter(r["outcome"] for r in records.values())) for mode, records in runs.items()}
    if set(MODES) <= set(runs):
        more, numbers = comparison(runs["baseline"], runs["callback"], runs.get("rerun", {}))
        lines += more
        summary.update(numbers)
    if "callback" in runs:
        more, numbers = warnings_table(runs["callback"])
        lines += more
        summary.update(numbers)
    return "\n".join(lines), summary


def main(argv: list[str] | None = None) -> int:
    """Run (unless ``--report-only``), print the report; exit 1 if a test fails only with the callback, unexplained."""
    args = parse_args(argv)
    header = [check_version(args.source)]
    ignored = left_out()
    header += [f"Left out: `{path}` ({why})." for path, why in ignored.items()]
    header.append(f"Test paths: {', '.join(args.dirs)} (under tests/tests_pytorch); CPU only.")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for mode in args.modes:
            for stale in args.out.glob(f"{mode}-*"):
                stale.unlink()
        todo = shards(args.source, args.dirs, args.modes, args.jobs, ignored)
        timing = run_shards(args.source, args.out, todo, args.jobs, args.timeout, args.pytest_args)
        for stale in args.out.glob(f"{RERUN}-*"):
            stale.unlink()
        again = unexplained(args.out) if set(args.modes) == set(MODES) else []
        if again:
            # A failure that passes when its test runs alone is told apart from one that fails every time.
            rerun = run_shards(args.source, args.out, [Shard(RERUN, 0, again)], 1, args.timeout, args.pytest_args)
            for key, values in rerun.items():
                timing[key].update(values)
        (args.out / "timing.json").write_text(json.dumps(timing, indent=1))
    runs = {mode: load(args.out, mode) for mode in (*MODES, RERUN) if any(args.out.glob(f"{mode}-*.jsonl"))}
    text, summary = report(runs, header)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(text)
    return 1 if summary.get("defects") else 0


if __name__ == "__main__":
    sys.exit(main())
