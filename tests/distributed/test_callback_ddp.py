"""Real 2-process DDP on CPU (gloo): pooled statistics equal those of the union of both processes' data."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TinyModule, by_name, depths
from helpers.reference import activation_stats, dead_fraction, flat, l2, replay_sequential
from torch import nn

pytestmark = pytest.mark.slow  # multi-process: left out of the fast loop, pytest -m "not slow"

P = "layer_health"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    worker = Path(__file__).with_name("ddp_worker.py")
    proc = subprocess.run(
        [sys.executable, str(worker), str(out)], capture_output=True, text=True, timeout=240, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def union_module(ranks, depth) -> TinyModule:
    """A module whose record holds both processes' micro-batches, for the reference replay."""
    template = ranks[0][depth]["record"][0][3]
    n_linear = len([k for k in template if k.endswith("weight")])
    layers: list[nn.Module] = []
    for i in range(n_linear - 1):
        layers += [nn.Linear(4 if i == 0 else 8, 8), nn.ReLU()]
    module = TinyModule(model=nn.Sequential(*layers, nn.Linear(8, 1)))
    module.record = ranks[0][depth]["record"] + ranks[1][depth]["record"]
    return module


@pytest.mark.parametrize("depth", [1, 6])
def test_every_rank_holds_the_same_pooled_values(ranks, depth):
    pooled0, pooled1 = ranks[0][depth]["pooled"], ranks[1][depth]["pooled"]
    assert sorted(pooled0) == [0, 2, 4]
    assert pooled0 == pooled1


@pytest.mark.parametrize("depth", [1, 6])
def test_pooled_values_equal_statistics_of_the_union(ranks, depth):
    module = union_module(ranks, depth)
    n_layers = len(module.model)
    for step, logged in ranks[0][depth]["pooled"].items():
        metrics = by_name(logged)
        # 2 micro-batches per process, 2 processes; each process's loss is its own mean, scaled by 1/accumulate.
        outputs, grads, param_grads, before = replay_sequential(module, step, accumulate=2)
        assert len(outputs[0]) == 4
        for i in range(n_layers):
            expected = activation_stats(flat(outputs[i]))
            for stat, value in expected.items():
                assert metrics[f"{P}/{stat}/model.{i}"] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, i, stat)
            assert metrics[f"{P}/act_grad_norm/model.{i}"] == pytest.approx(l2(flat(grads[i])), rel=1e-5)
            if isinstance(module.model[i], nn.ReLU):
                assert metrics[f"{P}/act_dead_frac/model.{i}"] == pytest.approx(dead_fraction(outputs[i]))
        for name, grad in param_grads.items():
            # DDP averages gradients over processes: the optimizer sees the mean of the per-process sums.
            assert metrics[f"{P}/param_grad_norm/model.{name}"] == pytest.approx(l2(flat([grad / 2])), rel=1e-5)
            assert metrics[f"{P}/param_norm/model.{name}"] == pytest.approx(l2(flat([before[name]])), rel=1e-5)


def test_each_rank_alone_would_be_wrong(ranks):
    # Guards the test itself: the shards differ so much that one process's statistics are far from the union's.
    module = union_module(ranks, 1)
    module.record = ranks[0][1]["record"]
    outputs, _, _, _ = replay_sequential(module, 0, accumulate=2)
    alone = activation_stats(flat(outputs[0]))["act_std"]
    assert by_name(ranks[0][1]["pooled"][0])[f"{P}/act_std/model.0"] > 3 * alone


def test_each_sampled_step_syncs_with_two_collectives_whatever_the_depth(ranks):
    # One SUM and one MAX all-reduce (test_aggregation_sync.py checks which); torchmetrics' gathers took 3 per state.
    for rank in ranks:
        for depth in (1, 6):
            assert set(rank[depth]["collectives"].values()) == {2}, (depth, rank[depth]["collectives"])


def test_a_relu_branch_first_run_on_one_rank_gets_the_same_layout_everywhere(ranks):
    # Rank 0 skips the branch on step 0, rank 1 runs it; both run it on step 2. Before the layout was agreed
    # between ranks, rank 1 alone learned the branch's 6 units and every rank died in the sync.
    branch = [r["branch"] for r in ranks]
    assert [b["global_step"] for b in branch] == [4, 4]
    assert 0 not in branch[0]["seen"]
    assert len(branch[1]["seen"][0]) == 1
    assert sorted(branch[0]["pooled"]) == [0, 2]
    # Every value agrees, depths included: rank 0 did not see the branch run on step 0, yet writes its depth, where
    # rank 1 ran it (the orders are agreed in the MAX all-reduce).
    assert branch[0]["pooled"] == branch[1]["pooled"]
    placed = depths(branch[0]["pooled"][0])
    assert placed["branch.1"] == placed["branch.0"] + 1
    for step, logged in branch[0]["pooled"].items():
        metrics = by_name(logged)
        outputs = branch[0]["seen"].get(step, []) + branch[1]["seen"][step]
        assert metrics[f"{P}/act_dead_frac/branch.1"] == pytest.approx(dead_fraction(outputs), abs=1e-12), step
        assert metrics[f"{P}/act_mean/branch.1"] == pytest.approx(activation_stats(flat(outputs))["act_mean"])
    # Guards the test: on step 2 some unit is dead on one rank only, so a per-rank fraction would differ.
    step2 = [branch[r]["seen"][2] for r in (0, 1)]
    assert dead_fraction(step2[0]) != dead_fraction(step2[0] + step2[1]) or dead_fraction(step2[1]) != dead_fraction(
        step2[0] + step2[1]
    )
    assert set(branch[0]["collectives"].values()) == {2}


def test_opt_in_statistics_pool_over_processes(ranks):
    from helpers.reference import outlier_reference, precision_counts

    assert ranks[0]["opt_in"]["pooled"] == ranks[1]["opt_in"]["pooled"]
    # The opt-in states ride in the same packed SUM and MAX all-reduces.
    assert set(ranks[0]["opt_in"]["collectives"].values()) == {2}
    module = union_module(ranks, "opt_in")
    targets = {"float16": torch.float16, "float8_e5m2": torch.float8_e5m2}
    for step, logged in ranks[0]["opt_in"]["pooled"].items():
        metrics = by_name(logged)
        outputs, grads, _, _ = replay_sequential(module, step, accumulate=2)
        for i in range(len(module.model)):
            for stat, value in outlier_reference(outputs[i]).items():
                assert metrics[f"{P}/{stat}/model.{i}"] == pytest.approx(value, rel=1e-6), (step, i, stat)
            for kind, tensors in (("act", outputs[i]), ("act_grad", grads[i])):
                for name, dtype in targets.items():
                    nonzero, under, over = precision_counts(flat(tensors), dtype)
                    assert metrics[f"{P}/{kind}_underflow_frac_{name}/model.{i}"] == pytest.approx(under / nonzero)
                    assert metrics[f"{P}/{kind}_overflow_frac_{name}/model.{i}"] == pytest.approx(over / nonzero)
            # Every micro-batch of both processes has 4 rows: Linear saves its input, ReLU its output.
            assert metrics[f"{P}/act_saved_bytes/model.{i}"] == 4 * (4, 8, 0)[i] * 4
        # The output layer's log Z and largest |logit|: a row-weighted mean and a max over both processes.
        head = torch.cat([t.reshape(-1, t.shape[-1]) for t in outputs[len(module.model) - 1]]).double()
        last = f"model.{len(module.model) - 1}"
        # One logit per row (a regression head): log Z would be the logit itself, so it is not logged.
        assert head.shape[-1] == 1
        assert f"{P}/logit_lse_mean/{last}" not in metrics
        assert metrics[f"{P}/logit_absmax/{last}"] == pytest.approx(float(head.abs().max()), rel=1e-6)


def test_a_weight_changed_on_one_rank_is_a_replica_divergence_on_every_rank(ranks):
    for rank in ranks:
        perturbed = rank["diverge"]["perturbed"]
        (finding,) = perturbed["findings"]
        assert (finding["rule"], finding["layer"], finding["step"]) == ("replica_divergence", "model.0", 2)
        assert (finding["stat"], finding["phase"], finding["threshold"]) == ("param_norm", "forward", 1e-6)
        # Reference: the norms of the weights each rank's step 2 saw (rank 1's carry the +0.5).
        norms = [float(r["diverge"]["perturbed"]["record"][2]["0.weight"].double().norm()) for r in ranks]
        assert norms[1] != norms[0]
        assert finding["value"] == pytest.approx((max(norms) - min(norms)) / max(norms), rel=1e-6)
        assert by_name(perturbed["pooled"][2])[f"{P}/param_norm/model.0.weight"] == pytest.approx(max(norms), rel=1e-6)
        assert "model.0.weight" in finding["message"]
        assert "differ between processes" in finding["message"]
        # Only the perturbed parameter: the bias stays identical; alerted once while it lasts (steps 2 and 4).
        assert "model.0.bias" not in finding["message"]
        # Compared inside the MAX all-reduce that was already there: still two collectives per sampled step.
        assert set(perturbed["collectives"].values()) == {2}


def test_replicas_left_alone_are_silent(ranks):
    for rank in ranks:
        healthy = rank["diverge"]["healthy"]
        assert healthy["findings"] == []
        assert sorted(healthy["pooled"]) == [0, 2, 4]
        norms = [float(r["diverge"]["healthy"]["record"][2]["0.weight"].double().norm()) for r in ranks]
        assert norms[0] == norms[1]  # guards the test: bit-identical replicas
        for depth in (1, 6, "opt_in"):
            assert not {"replica_divergence", "not_updated"} & set(rank[depth]["findings"]), depth
