"""The sentinel under real 2-process training on CPU (gloo): every rank trips together, and nothing hangs."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow  # multi-process: left out of the fast loop, pytest -m "not slow"

WORKER = Path(__file__).with_name("sentinel_worker.py")
TIMEOUT_S = 240
P = "layer_health"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    """Both scenarios, started together: ``{"ddp": [rank0, rank1], "model_parallel": [rank0, rank1]}``."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    started = {}
    for mode in ("ddp", "model_parallel"):
        out = tmp_path_factory.mktemp(mode)
        log = open(out / "log.txt", "w")  # noqa: SIM115 - the process writes to it until it ends
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(out), mode], stdout=log, stderr=log, env=env, start_new_session=True
        )
        started[mode] = (proc, out, log)
    results = {}
    for mode, (proc, out, log) in started.items():
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"{mode}: hung for {TIMEOUT_S} s:\n{(out / 'log.txt').read_text()[-4000:]}")
        finally:
            log.close()
        assert proc.returncode == 0, (out / "log.txt").read_text()[-4000:]
        results[mode] = [torch.load(out / f"{mode}_rank{r}.pt", weights_only=False) for r in (0, 1)]
    return results


def same(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]]) -> bool:
    """Equal logged values, NaN equal to NaN (the NaN step's parameter gradients are NaN on every rank)."""
    flat_a = {(s, k): v for s, m in a.items() for k, v in m.items()}
    flat_b = {(s, k): v for s, m in b.items() for k, v in m.items()}
    return flat_a.keys() == flat_b.keys() and all(
        flat_a[k] == flat_b[k] or (math.isnan(flat_a[k]) and math.isnan(flat_b[k])) for k in flat_a
    )


def test_ddp_a_nan_on_one_rank_trips_every_rank_and_is_named_at_its_module_on_its_step(runs):
    ranks = runs["ddp"]
    for rank in ranks:
        assert [(t["step"], t["kind"], t["replayed"]) for t in rank["trips"]] == [(3, "nonfinite_loss", True)]
        first = rank["findings"][0]
        assert (first["rule"], first["step"], first["layer"]) == ("nonfinite", 3, "model.3")
    # The replayed statistics pool over both ranks exactly as a sampled step's: only rank 1's batch of 4 x 16
    # elements is NaN, and both ranks hold the same values.
    assert sorted(ranks[0]["logged"]) == [0, 3]
    assert ranks[0]["logged"][3][f"{P}/act_nonfinite/model.3"] == 4 * 16
    assert ranks[0]["logged"][3][f"{P}/act_nonfinite/model.2"] == 0
    assert same(ranks[0]["logged"], ranks[1]["logged"])


def test_ddp_the_sentinel_costs_one_collective_per_step(runs):
    for rank in runs["ddp"]:
        # Steps 1 and 2: the packed MAX all-reduce alone. Step 3: that, and the replay's agreement on success.
        assert rank["collectives"][1] == rank["collectives"][2] == 1
        assert rank["collectives"][3] == 2
        # Host transfers in on_before_optimizer_step: the sentinel's one packed read on every step, the sampled
        # step 0 included (its statistics are read elsewhere); on step 3 the trip's replay adds its own.
        assert {step: rank["reads"][step] for step in (0, 1, 2)} == {0: 1, 1: 1, 2: 1}
        assert rank["reads"][3] == 4


def test_fsdp2_is_not_replayed_says_why_and_does_not_hang(runs):
    ranks = runs["model_parallel"]
    for rank in ranks:
        assert [(t["step"], t["replayed"]) for t in rank["trips"]][:1] == [(1, False)]
        assert "ModelParallelStrategy strategy is not replayed" in rank["trips"][0]["reason"]
        loss = [f for f in rank["findings"] if f["layer"] == "loss"]
        assert loss
        assert loss[0]["step"] == 1
        assert "not replayed because" in loss[0]["message"]
        assert "step 2 is sampled" in loss[0]["message"]
        assert 2 in rank["logged"]  # the next step was sampled
    assert same(ranks[0]["logged"], ranks[1]["logged"])
