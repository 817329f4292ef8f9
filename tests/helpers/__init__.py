"""Test helpers, one package: the suite's instruments, never a test module, and nothing here is collected.

``tests/`` is on ``sys.path`` (``pythonpath`` in ``pyproject.toml``; the multi-process workers put it there), so a
test imports ``from helpers import TinyModule`` or ``from helpers.reference import activation_stats``:

- ``fit``: tiny LightningModules, the in-memory ``RecordingLogger``, ``make_trainer``, hook counting, ``force_trips``.
- ``keys``: logged keys read back by statistic and layer name (``by_name``, ``depths``, ``csv_statistic``).
- ``rules``: ``run_rules``, the health rules on a hand-made step through the public ``evaluate``.
- ``reference``: hand-written reference computations the statistics are checked against.
- ``zoo``: healthy and sick networks for the rules; ``dropping``: a module a replay must restore exactly.
- ``cost``: host-transfer counting; ``package_code``: what the package itself runs, told apart from the model.
- ``observe``: what the callback observes, through a component passed in ``extensions=``; ``stance``: compile's.
- ``offline_wandb``, ``png``: W&B runs and PNG images read back without their libraries; ``scripts``: benchmarks.
"""

from .fit import ForcedSpikes, RecordingLogger, TinyModule, count_hooks, force_trips, make_data, make_trainer
from .keys import by_name, csv_statistic, depths
from .offline_wandb import finish_wandb, offline_wandb_logger
from .rules import run_rules
from .scripts import load_benchmark

__all__ = [
    "ForcedSpikes",
    "RecordingLogger",
    "TinyModule",
    "by_name",
    "count_hooks",
    "csv_statistic",
    "depths",
    "finish_wandb",
    "force_trips",
    "load_benchmark",
    "make_data",
    "make_trainer",
    "offline_wandb_logger",
    "run_rules",
]
