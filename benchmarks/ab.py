"""Before/after in one run: ``overhead.py`` against a base commit and the working tree, alternating A B A B.

The base commit's package is exported with ``git archive`` into a temporary directory; each run is a fresh process
of the working tree's ``overhead.py`` with either package first on ``PYTHONPATH``, so both sides use the same
benchmark code, models, batches and Trainer settings and differ only in the library. Runs alternate so that drift in
the machine's load hits both sides alike; the ratios reported are medians over each side's runs of the per-run
ratios (every variant against ``plain`` of the same run).

Usage::

    python benchmarks/ab.py --base 1a9f333 --runs 4 -- --models mlp,cnn,transformer --rounds 2 --steps 15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def export(commit: str, into: Path) -> Path:
    """The package of ``commit``, exported under ``into``; returns the directory to put on ``PYTHONPATH``."""
    archive = into / "base.tar"
    subprocess.run(["git", "archive", "-o", str(archive), commit, "lightning_hookdiag"], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def run(package: Path, args: list[str], json_path: Path) -> dict[str, Any]:
    """One ``overhead.py`` process with ``package`` first on the path."""
    env = {**os.environ, "PYTHONPATH": str(package)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), *args, "--json", str(json_path)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(json_path.read_text())


def ratios(payload: dict[str, Any], key: str = "median_ms") -> dict[str, dict[str, float]]:
    """Median step time (``key``: wall or process CPU) of every variant over ``plain``'s, per model.

    ``default_interval`` is amortised (wall time only).
    """
    out: dict[str, dict[str, float]] = {}
    for model, variants in payload["results"].items():
        base = variants["plain"][key]
        out[model] = {}
        for variant, r in variants.items():
            if variant == "default_interval":
                ms = variants["plain"]["median_ms"] + r["amortised_extra_ms"]
                out[model][variant] = ms / variants["plain"]["median_ms"]
            else:
                out[model][variant] = r[key] / base
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison, print the table, write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the commit to compare the working tree against")
    p.add_argument("--runs", type=int, default=4, help="overhead.py runs in all, alternating base and tree")
    p.add_argument("--json", default="benchmarks/results_ab.json")
    p.add_argument("overhead_args", nargs="*", help="passed to overhead.py (after --)")
    args = p.parse_args(argv)
    sides: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        base = export(args.base, Path(tmp))
        for i in range(args.runs):
            side = "before" if i % 2 == 0 else "after"
            package = base if side == "before" else ROOT
            sides[side].append(run(package, args.overhead_args, Path(tmp) / f"run{i}.json"))
            print(f"run {i + 1}/{args.runs} ({side}) done", file=sys.stderr)
    summary: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for key in ("median_ms", "median_cpu_ms"):
        summary[key] = {}
        for side, payloads in sides.items():
            per_run = [ratios(payload, key) for payload in payloads]
            summary[key][side] = {
                model: {v: statistics.median(r[model][v] for r in per_run) for v in per_run[0][model]}
                for model in per_run[0]
            }
    wall, cpu = summary["median_ms"], summary["median_cpu_ms"]
    print(f"{'model':<12} {'variant':<17} {'before':>8} {'after':>8} {'cpu before':>11} {'cpu after':>10}  (x plain)")
    for model, variants in wall["after"].items():
        for variant, after in variants.items():
            row = [wall["before"][model][variant], after, cpu["before"][model][variant], cpu["after"][model][variant]]
            print(f"{model:<12} {variant:<17} {row[0]:>8.3f} {row[1]:>8.3f} {row[2]:>11.3f} {row[3]:>10.3f}")
    payload = {"base": args.base, "overhead_args": args.overhead_args, "summary": summary, "runs": sides}
    Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
    return payload


if __name__ == "__main__":
    main()
