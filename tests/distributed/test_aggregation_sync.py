"""Cross-process pooling with two packed all-reduces, on 2 and 4 CPU processes (gloo); DTensor replicas on a 2-D
mesh; one logged name per module and parameter under every wrapper.

``sync_worker.py`` runs the processes (both worlds at once, in one fixture); this file regenerates every
rank's observations and checks the pooled values against float64 statistics of their union.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sync_worker as W
import torch
from helpers.reference import activation_stats, bin_counts, dead_fraction, flat, l2

from lightning_hookdiag import _stats as S

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("sync_worker.py")
WORLDS = (2, 4)
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[int, list[dict[str, Any]]]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    outs = {w: tmp_path_factory.mktemp(f"sync{w}") for w in WORLDS}
    procs = {
        w: subprocess.Popen(
            [sys.executable, str(WORKER), str(outs[w]), str(w)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for w in WORLDS
    }
    results = {}
    for w, proc in procs.items():
        try:
            log, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            pytest.fail(f"sync_worker.py {w} timed out after {TIMEOUT_S} s")
        assert proc.returncode == 0, log[-4000:]
        results[w] = [torch.load(outs[w] / f"rank{r}.pt", weights_only=False) for r in range(w)]
    return results


def union(world: int, n_layers: int, step: int) -> tuple[dict[int, list[torch.Tensor]], dict[int, list[torch.Tensor]]]:
    """Every rank's outputs and output gradients per layer (the worker's observations, regenerated here)."""
    outputs: dict[int, list[torch.Tensor]] = {}
    grads: dict[int, list[torch.Tensor]] = {}
    for rank in range(world):
        for layer, x, g in W.observations(rank, n_layers, step, world):
            outputs.setdefault(layer, []).append(x)
            grads.setdefault(layer, []).append(g)
    return outputs, grads


CASES = [(n, sharded) for n in (4, 16) for sharded in (False, True)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}layers-{'sharded' if c[1] else 'replicated'}")
def test_pooled_values_equal_float64_statistics_of_the_union(worlds, world, case):
    n_layers, sharded = case
    edges = S.histogram_edges(W.BINS).tolist()
    for step in range(W.STEPS):
        values = worlds[world][0]["pooled"][case][step]["values"]
        outputs, grads = union(world, n_layers, step)
        for layer in range(n_layers):
            expected = activation_stats(flat(outputs[layer]))
            for stat, want in expected.items():
                assert values[stat][layer].item() == pytest.approx(want, rel=1e-6, abs=1e-12), (step, layer, stat)
            assert values["act_grad_norm"][layer].item() == pytest.approx(l2(flat(grads[layer])), rel=1e-6)
            assert values["count"][layer].item() == len(flat(outputs[layer]))
            assert values["act_hist"][layer].tolist() == bin_counts(flat(outputs[layer]), edges)
            assert values["grad_hist"][layer].tolist() == bin_counts(flat(grads[layer]), edges)
            dead = values["act_dead_frac"][layer].item()
            if layer % 2:
                assert dead == pytest.approx(dead_fraction(outputs[layer]), abs=1e-12), (step, layer)
            else:
                assert math.isnan(dead)
        parts = [W.param_values(r, n_layers, step, sharded) for r in range(world)]
        pooled = sum(parts) if sharded else parts[0]  # replicated: the same value on every process, counted once
        assert values["param_norm"].tolist() == pytest.approx(pooled[:, 0].sqrt().tolist(), rel=1e-12)
        assert values["param_grad_norm"].tolist() == pytest.approx(pooled[:, 1].sqrt().tolist(), rel=1e-12)
        ratio = (pooled[:, 2].sqrt() / pooled[:, 0].sqrt()).tolist()
        assert values["param_update_ratio"].tolist() == pytest.approx(ratio, rel=1e-12)
        if sharded:  # parts differ by design: nothing to compare
            assert "param_norm_min" not in values
        else:  # the same weights on every process: smallest and largest norm are the same numbers
            assert torch.equal(values["param_norm_min"], values["param_norm"])


@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_holds_identical_values(worlds, world):
    ranks = worlds[world]
    for case in CASES:
        for step in range(W.STEPS):
            first = ranks[0]["pooled"][case][step]["values"]
            for other in ranks[1:]:
                for key, value in first.items():
                    assert torch.equal(value, other["pooled"][case][step]["values"][key]) or (
                        torch.equal(value.isnan(), other["pooled"][case][step]["values"][key].isnan())
                    ), (case, step, key)


def test_the_late_layer_ran_on_one_rank_only_and_ranks_differ():
    # Guards the tests above: the dead-unit layer LATE runs on the last rank only on step 0, and a unit that is
    # alive only on that rank makes any single rank's dead fraction wrong.
    ran = [any(layer == W.LATE for layer, _, _ in W.observations(r, 4, 0, 4)) for r in range(4)]
    assert ran == [False, False, False, True]
    outputs, _ = union(4, 4, 1)
    alone = [x for layer, x, _ in W.observations(0, 4, 1, 4) if layer == 3]
    assert dead_fraction(alone) != dead_fraction(outputs[3])


def _expected_bytes(n_layers: int, sharded: bool, step: int) -> list[int]:
    """Bytes of the SUM and the MAX buffer: every state once, whatever the number of processes.

    Each buffer has the widest dtype of its states: float64 sums; maxima in float32 unless the replicated parameter
    statistics (float64, reduced with a maximum) are among them.
    """
    unit_layers = range(1, n_layers, 2)
    sums = n_layers * (S.ACT_SLOTS + S.GRAD_SLOTS + 2 * W.BINS) + (4 * n_layers if sharded else 0)
    if step == 0:
        sums += 3 * len(unit_layers)  # the unit-count agreement, until every dead-unit layer ran somewhere
    # Replicated parameters: their 4 columns and minus each weight sum of squares (the smallest over processes).
    maxima = n_layers + (0 if sharded else 5 * n_layers) + sum(W.units_of(i) for i in unit_layers) + n_layers
    maxima += 5 * n_layers  # the layer orders (five numbers per layer), a state: the callback agrees them every sync
    return [8 * sums, (4 if sharded else 8) * maxima]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}layers-{'sharded' if c[1] else 'replicated'}")
def test_two_all_reduces_whose_bytes_do_not_depend_on_the_world_size(worlds, case):
    n_layers, sharded = case
    for world in WORLDS:
        for rank in worlds[world]:
            for step, record in enumerate(rank["pooled"][case]):
                assert record["calls"] == {"all_reduce": 2}, (world, step)  # no gather, no barrier, nothing else
                assert record["bytes"] == _expected_bytes(n_layers, sharded, step), (world, step)
                # The agreed unit counts are read back once; afterwards a sync never waits for the device.
                assert record["host_reads"] == (1 if step == 0 else 0), (world, step)


def test_collectives_do_not_grow_with_the_number_of_layers(worlds):
    counts = {
        (world, case, step): sum(record["calls"].values())
        for world in WORLDS
        for case in CASES
        for step, record in enumerate(worlds[world][0]["pooled"][case])
    }
    assert set(counts.values()) == {2}


@pytest.mark.parametrize("world", WORLDS)
def test_unit_counts_that_disagree_leave_the_layer_untracked_on_every_rank(worlds, world):
    last = world - 1
    for rank, results in enumerate(worlds[world]):
        step0, step1 = results["mismatch"]
        # Layer 0: 4 units on the last rank, 3 elsewhere when first seen: no rank tracks it, none crashes.
        assert math.isnan(step0["dead"][0])
        assert math.isnan(step1["dead"][0])
        # Layer 1: agreed at 5 units, then 6 on the last rank: its flag in the MAX buffer reaches every rank.
        assert step0["dead"][1] == 1.0
        assert math.isnan(step1["dead"][1])
        assert step1["mismatch"] == ([0, 1] if rank == last else [0])
        # Layer 2 is unaffected: unit 0 alive on the last rank only, unit 1 dead everywhere.
        assert step0["dead"][2] == 0.5
        assert step1["dead"][2] == 0.5


@pytest.mark.parametrize("world", WORLDS)
def test_replicas_that_differ_give_the_smallest_norm_in_the_same_two_all_reduces(worlds, world):
    for results in worlds[world]:
        replicated = results["divergence"]["replicated"]
        # Largest and smallest over the processes that measured each parameter; none measured the last one.
        assert replicated["param_norm"] == [2.0, math.sqrt(4 + world - 1), 3.0, 0.0]
        assert replicated["param_norm_min"] == [2.0, 2.0, 3.0, math.inf]
        assert replicated["calls"] == {"all_reduce": 2}
        assert replicated["host_reads"] == 0
        sharded = results["divergence"]["sharded"]
        assert sharded["param_norm_min"] is None
        assert sharded["calls"] == {"all_reduce": 2}


# ------------------------------------------------------------------------------------------------ replicas
REPLICAS = {
    "hsdp": [2, 2],  # (Replicate, Shard): the replicate dimension holds 2 copies
    "shard_replicate": [2, 2],
    "shard_shard": [1, 1],
    "replicate_replicate": [4, 4],
    "submesh_shard": [2, 2],  # sharded over a 1-D sub-mesh of 2: the other 2 processes hold a copy each
}


@pytest.mark.parametrize("layout", sorted(REPLICAS))
def test_dtensor_norms_on_a_2d_mesh_equal_the_full_tensors(worlds, layout):
    for rank in worlds[4]:
        got = rank["replicas"][layout]
        assert got["replicas"] == REPLICAS[layout]
        assert got["param_norm"] == pytest.approx(got["expected_norm"], rel=1e-6)
        assert got["param_grad_norm"] == pytest.approx(got["expected_grad_norm"], rel=1e-6)


def test_the_2d_layouts_shard_unevenly(worlds):
    # Guards the test: 5 rows over 2 shards are uneven; over 2 x 2 the local parts differ between ranks.
    sizes = {tuple(r["replicas"]["shard_shard"]["local_numel"]) for r in worlds[4]}
    assert len(sizes) > 1


def test_partial_placement_is_an_error(worlds):
    message = worlds[4][0]["replicas"]["partial_error"]
    assert message == (
        "replicas: expected Shard or Replicate placements on a parameter, got Partial(sum) in"
        " (Partial(sum), Shard(dim=0))"
    )


# ---------------------------------------------------------------------------------------------------- names
LEAVES = ["model.encoder.0", "model.encoder.1", "model.encoder.2", "model.block.0", "model.block.1", "model.head"]
LAYERS = ["model.encoder.0", "model.encoder.1", "model.encoder.2", "model.block", "model.head"]
OWNERS = {
    "model.encoder.0.weight": "model.encoder.0",
    "model.encoder.0.bias": "model.encoder.0",
    "model.encoder.2.weight": "model.encoder.2",
    "model.encoder.2.bias": "model.encoder.2",
    "model.block.0.weight": "model.block",  # a selected container owns its children's parameters
    "model.block.0.bias": "model.block",
    "model.head.weight": "model.head",
    "model.head.bias": "model.head",
}
VARIANTS = ["plain", "ddp", "fsdp1", "fsdp2", "compile", "compile_parts", "checkpoint", "ddp_compile_checkpoint"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_selection_params_rules_and_report_agree_on_names_under_wrappers(worlds, variant):
    for rank in worlds[2]:
        names = rank["names"][variant]
        assert names["leaves"] == LEAVES
        assert names["types"] == ["Linear", "ReLU", "Linear", "Linear", "Tanh", "Linear"]  # the wrapped module
        assert names["layers"] == LAYERS
        assert names["params"] == list(OWNERS)
        assert names["rule_owner"] == OWNERS
        assert names["report_owner"] == OWNERS
        # Depth order keeps each layer's parameters together (by name within a layer).
        assert names["report_order"] == sorted(OWNERS, key=lambda p: (LAYERS.index(OWNERS[p]), p))
