"""Real 2-process DDP on CPU (gloo): pooled statistics equal those of the union of both processes' data."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TinyModule
from reference import activation_stats, dead_fraction, flat, l2, replay_sequential
from torch import nn

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
    for step, metrics in ranks[0][depth]["pooled"].items():
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
    assert ranks[0][1]["pooled"][0][f"{P}/act_std/model.0"] > 3 * alone


def test_collectives_per_sampled_step_do_not_grow_with_depth(ranks):
    shallow, deep = ranks[0][1]["collectives"], ranks[0][6]["collectives"]
    assert set(shallow.values()) == set(deep.values())
    assert len(set(shallow.values())) == 1
    assert 0 < next(iter(shallow.values())) <= 20
