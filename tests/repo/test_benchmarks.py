"""Smoke test of the overhead benchmark: it runs, and its numbers are well-formed (no timing assertions)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "overhead.py"


@pytest.mark.slow
def test_quick_benchmark_runs_and_writes_json(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "overhead", module)  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    out = tmp_path / "results.json"
    module.main(["--quick", "--json", str(out)])
    written = json.loads(out.read_text())
    for model in ("mlp", "transformer", "cnn"):
        variants = written["results"][model]
        assert {"plain", "every_step", "default_interval", "tutorial"} <= set(variants)
        assert variants["plain"]["median_ms"] > 0
        assert variants["every_step"]["median_ms"] > 0
    assert written["machine"]["torch"]


@pytest.mark.slow
def test_profile_breaks_a_sampled_step_down_by_the_librarys_own_functions(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "overhead", module)
    spec.loader.exec_module(module)
    out = tmp_path / "results.json"
    module.main(["--quick", "--models", "mlp", "--variants", "plain,every_step", "--profile", "--json", str(out)])
    profile = json.loads(out.read_text())["profile"]["mlp"]
    calls = profile["calls_per_step"]
    # Every step is sampled: the rules, the pooling and the parameter statistics ran once a step, the sinks per layer.
    for once in ("callback._finish (rules, logging, heatmaps)", "FitRun.collect (pool, transfer, values)"):
        assert calls[once] >= 1, calls
    assert calls["recorder.on_tensor (forward sink, total)"] > 1
    assert all(ms >= 0 for ms in profile["components_ms_per_step"].values())


def test_sync_cost_models_the_buffers_the_aggregator_really_packs():

    from lightning_hookdiag._aggregation import LayerStatsAggregator
    from lightning_hookdiag._distributed import pack
    from lightning_hookdiag._recorder import StepRecorder

    cost = load_benchmark("sync_cost")
    model = cost.Model(units=16, dead_unit_share=0.5)
    layers = 10
    relus = frozenset(range(0, layers, 2))
    agg = LayerStatsAggregator(layers, n_params=layers, unit_layers=relus)
    recorder = StepRecorder(layers, unit_layers=relus)
    for layer in relus:
        recorder.on_tensor(layer, torch.ones(2, 16))
    agg.update(recorder.take())
    agg.compute()  # the layout once every ReLU ran
    agg.reset()
    flags = torch.zeros(layers)
    sums = pack([agg.act_moments, agg.grad_moments])
    maxima = pack([agg.act_absmax, agg.param_stats, agg.unit_max, flags])
    assert cost.buffers(layers, model) == (sums.numel() * sums.element_size(), maxima.numel() * maxima.element_size())


def test_sync_cost_new_path_bytes_do_not_grow_with_ranks_and_old_path_bytes_do():
    cost = load_benchmark("sync_cost")
    model = cost.Model()
    new = [cost.new_path(1000, p, model) for p in cost.WORLDS]
    old = [cost.old_path(1000, p, model) for p in cost.WORLDS]
    bound = 2 * sum(cost.buffers(1000, model))
    assert all(c.received < bound and c.collectives == 2 and c.host_syncs == 0 for c in new)
    assert old[-1].received > 1000 * old[0].received / 2  # linear in the ranks: 8 -> 8192
    text = cost.main(["--markdown"])
    assert text.count("\n| 8192 |") == 6


def test_precursor_cost_benchmark_prices_the_probes_of_one_model():
    cost = load_benchmark("precursor_cost")
    result = cost.main(["--quick", "--model", "transformer", "--pairs", "2"])
    assert result["plain_ms"] > 0
    assert result["probed_ms"] > 0
    assert result["attention_on"]  # the transformer's attention calls were seen, so the probe stays on


@pytest.mark.slow
def test_memory_benchmark_measures_one_step_per_fresh_process(tmp_path):
    memory = load_benchmark("memory")
    out = tmp_path / "memory.json"
    memory.main(["--quick", "--models", "lm_head", "--repeats", "2", "--json", str(out)])
    written = json.loads(out.read_text())
    row = written["results"]["lm_head"]
    assert {"plain", "callback", "tutorial"} <= set(row), row
    for variant in ("plain", "callback", "tutorial"):  # two fresh processes each, their median reported
        peaks = row[variant]["peaks"]
        assert len(peaks) == 2
        assert row[variant]["peak"] == (peaks[0] + peaks[1]) / 2
    # A plain step holds the logits, their log-softmax and the gradient of the logits at once.
    assert row["plain"]["peak"] >= 2 * row["logits_bytes"]
    assert row["callback"]["extra"] == row["callback"]["peak"] - row["plain"]["peak"]
    assert row["tutorial"]["extra"] == row["tutorial"]["peak"] - row["plain"]["peak"]
    assert written["table"].count("\n| lm_head") == 1


def test_memory_benchmark_refuses_fewer_than_one_run_per_variant(capsys):
    memory = load_benchmark("memory")
    with pytest.raises(SystemExit):
        memory.main(["--quick", "--repeats", "0"])
    assert "--repeats: at least 1 process per variant; got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_gpu_kernels_dry_run_counts_per_output_per_gradient_and_host_reads_per_step():
    kernels = load_benchmark("gpu_kernels")
    result = kernels.main(["--dry-run", "--quick", "--models", "mlp", "--steps", "2"])["results"]["mlp"]
    counted = result["kernels"]
    # The quick MLP has 9 leaf layers (4 x Linear + ReLU, a head): one output and one gradient each per sampled step.
    assert counted["hook:output"]["calls_per_sampled_step"] == 9
    assert counted["hook:grad"]["calls_per_sampled_step"] == 9
    assert counted["hook:output"]["aten_ops"] > 0
    assert counted["hook:grad"]["aten_ops"] > 0
    # Sampled steps 0 and 2: the one batched transfer and the sentinel's read; steps 1 and 3: the sentinel's read.
    assert result["syncs_added_per_step"] == {0: 2, 1: 1, 2: 2, 3: 1}
