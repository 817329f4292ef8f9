"""Real 2-process DDP on CPU (gloo): a layer that runs on one rank only gets the same depth, order and findings on every
rank (issue 35, item 8)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import depths

pytestmark = pytest.mark.slow  # multi-process: left out of the fast loop, pytest -m "not slow"

P = "layer_health"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp_order")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    worker = Path(__file__).with_name("order_worker.py")
    proc = subprocess.run(
        [sys.executable, str(worker), str(out)], capture_output=True, text=True, timeout=240, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_every_rank_holds_the_same_values_depths_orders_and_findings(ranks):
    assert sorted(ranks[0]) == sorted(ranks[1]) == [0, 2]
    for step in (0, 2):
        first, second = ranks[0][step], ranks[1][step]
        assert first["order"] == second["order"], step
        assert first["findings"] == second["findings"], step
        assert sorted(first["metrics"]) == sorted(second["metrics"]), step
        for key, value in first["metrics"].items():  # NaN (rare's output on step 2) equals NaN here
            assert value == second["metrics"][key] or (math.isnan(value) and math.isnan(second["metrics"][key])), key


def test_a_layer_run_by_one_rank_sits_where_that_rank_ran_it(ranks):
    for rank in ranks:
        for step in (0, 2):
            # Rank 1's forward order; rank 0 ran the same layers but rare.
            assert rank[step]["order"] == ["trunk.0", "trunk.1", "rare", "head"], step
            assert depths(rank[step]["metrics"]) == {"trunk.0": 0.0, "trunk.1": 1.0, "rare": 2.0, "head": 3.0}


def test_the_nan_made_on_one_rank_is_named_at_its_origin_on_every_rank(ranks):
    for rank in ranks:
        nonfinite = [layer for rule, layer, _ in rank[2]["findings"] if rule == "nonfinite"]
        assert nonfinite[:1] == ["rare"], rank[2]["findings"]
        assert [layer for rule, layer, _ in rank[0]["findings"] if rule == "nonfinite"] == []
