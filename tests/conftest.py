"""Pytest configuration only: the session's environment and the per-test seed. Helpers live in ``tests/helpers``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# The models here are tiny: one thread avoids oversubscribing the 2 cores of CI (and of developer machines, where
# other jobs run beside the tests) and is faster than two for such sizes.
torch.set_num_threads(1)


def pytest_configure() -> None:
    # Subprocesses (the multi-process workers, the examples, the CLI) import the package from this checkout, as the
    # tests do, not whichever copy is installed (an editable install may point at another worktree).
    root = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
