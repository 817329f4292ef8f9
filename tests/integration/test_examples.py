"""The sick-network examples: each fault is detected and located at the right layer; the healthy baseline is silent.

Expected layers are derived independently of the rules: from the logged values in ``metrics.csv`` (the gradient
ratio in backward order, the dead fraction per ReLU, the first non-finite layer in forward order) and from the
model's structure (which Linear got the bad bias, where the ``UnsafeLog`` module sits), never hard-coded.
"""

from __future__ import annotations

import csv
import importlib
import re
import shlex
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
from helpers import csv_statistic
from helpers.keys import parse_key
from torch import nn

from lightning_hookdiag import LayerHealthCallback, LayerHealthError, LayerHealthWarning, RuleConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PREFIX = "layer_health"


def is_layer(key: str, stat: str, layer: str) -> bool:
    """``key`` is the logged key of ``stat`` of ``layer``."""
    parsed = parse_key(key, PREFIX)
    return parsed is not None and (parsed.stat, parsed.name) == (stat, layer)


def example(name: str) -> ModuleType:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


@dataclass
class Run:
    callback: LayerHealthCallback
    csv_dir: Path
    warnings: list[str]  # messages of the LayerHealthWarnings emitted during the run
    stdout: str

    def logged(self, stat: str) -> dict[int, dict[str, float]]:
        """``{step: {layer: value}}`` of one statistic, read back from the CSV file."""
        return csv_statistic(self.csv_dir, stat, PREFIX)

    def totals(self, stat: str) -> dict[int, float]:
        """``{step: value}`` of one value of the summary group (``<prefix>/<stat>``), read back from the CSV file."""
        key = f"{PREFIX}/{stat}"
        with open(self.csv_dir / "metrics.csv", newline="") as fh:
            return {int(r["step"]): float(r[key]) for r in csv.DictReader(fh) if r.get(key)}

    def losses(self) -> list[float]:
        with open(self.csv_dir / "metrics.csv", newline="") as fh:
            return [float(r["train_loss"]) for r in csv.DictReader(fh) if r.get("train_loss")]

    def forward_order(self, step: int) -> list[str]:
        """The layers logged at ``step``, by the depth their keys carry (their place in the forward order)."""
        depth: dict[str, int] = {}
        with open(self.csv_dir / "metrics.csv", newline="") as fh:
            for row in csv.DictReader(fh):
                if int(row["step"]) != step:
                    continue
                for key, cell in row.items():
                    parsed = parse_key(key, PREFIX)
                    if parsed is None or parsed.name is None or parsed.depth is None or cell == "":
                        continue
                    if not parsed.stat.startswith("param_"):
                        depth[parsed.name] = parsed.depth
        return sorted(depth, key=depth.__getitem__)


def execute(tmp_path: Path, capsys: pytest.CaptureFixture[str], call: Callable[[], LayerHealthCallback]) -> Run:
    """Run an example, recording every LayerHealthWarning (instead of the suite's turning them into errors)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        callback = call()
    stdout = capsys.readouterr().out
    (csv_file,) = tmp_path.rglob("metrics.csv")
    messages = [str(w.message) for w in record if issubclass(w.category, LayerHealthWarning)]
    return Run(callback, csv_file.parent, messages, stdout)


def child_names(net: nn.Sequential, kind: type[nn.Module]) -> list[str]:
    return [f"net.{name}" for name, module in net.named_children() if isinstance(module, kind)]


# --------------------------------------------------------------------------------------------- sick_vanishing
def first_crossing(norms: dict[str, float], forward: list[str], ratio: float) -> tuple[str | None, float]:
    """The first layer in backward order (chain: reversed forward order) from which no layer down to the input
    reaches ``ratio`` of the output end's norm, and the largest ratio over that input side."""
    backward = forward[::-1]
    reference = norms[backward[0]]
    assert reference > 0
    for i, layer in enumerate(backward[1:], 1):
        largest = max(norms[n] for n in backward[i:]) / reference
        if largest < ratio:
            return layer, largest
    return None, float("nan")


def test_vanishing_gradient_is_located_where_the_ratio_crosses_the_threshold(tmp_path, capsys):
    ex = example("sick_vanishing")
    run = execute(tmp_path, capsys, lambda: ex.main(["--log-dir", str(tmp_path)]))
    callback = run.callback
    threshold = RuleConfig().vanishing_ratio
    assert callback.rule_config.vanishing_ratio == threshold  # the example runs with the default threshold

    norms = run.logged("act_grad_norm")
    assert sorted(norms) == list(range(ex.MAX_STEPS))  # every step sampled
    expected: dict[int, tuple[str | None, float]] = {}
    for step, by_layer in norms.items():
        forward = run.forward_order(step)
        assert forward == callback.execution_order
        assert set(by_layer) == set(forward)
        expected[step] = first_crossing(by_layer, forward, threshold)
        # The story: the gradient fades across depth - the input end gets a vanishing share of the head's.
        assert by_layer[forward[0]] / by_layer[forward[-1]] < threshold**2

    # Alerts: a rule alerts on a layer the first time it fires there, and again when the located layer changes.
    alerts, previous = [], None
    for step in sorted(expected):
        layer = expected[step][0]
        if layer is not None and layer != previous:
            alerts.append((step, layer))
        previous = layer
    assert alerts, "the example must show a vanishing gradient"
    assert [(f.rule, f.step, f.layer) for f in callback.findings] == [("vanishing_gradient", s, n) for s, n in alerts]
    # The crossing is inside the network, not at either end, so locating it means something.
    forward = callback.execution_order
    for _, layer in alerts:
        assert 1 <= forward.index(layer) < len(forward) - 2
    for finding in callback.findings:
        assert finding.value == pytest.approx(expected[finding.step][1], rel=1e-9)
        assert finding.value < finding.threshold == threshold
    last = max(expected)
    assert callback.last_step == last
    assert [(f.rule, f.layer) for f in callback.last_findings] == [("vanishing_gradient", expected[last][0])]

    # Default on_anomaly="warn": one warning per alert, naming the layer; and the printout says it all.
    assert run.warnings == [f"LayerHealthCallback: {f.message}" for f in callback.findings]
    layer = callback.findings[0].layer
    assert re.search(rf"vanishing_gradient\s+{re.escape(layer)}\b", run.stdout)
    assert f"hookdiag report {run.csv_dir} --stat act_grad_norm" in run.stdout


# --------------------------------------------------------------------------------------------- sick_dead_relu
def test_dead_relu_is_named_and_the_healthy_relus_are_not(tmp_path, capsys):
    ex = example("sick_dead_relu")
    # From the structure: the ReLU right after the Linear whose bias is far below zero.
    net = ex.build_model().net
    names = [f"net.{n}" for n, _ in net.named_children()]
    (broken,) = [
        f"net.{n}" for n, m in net.named_children() if isinstance(m, nn.Linear) and float(m.bias.detach().max()) < -5
    ]
    dead = names[names.index(broken) + 1]
    relus = child_names(net, nn.ReLU)
    assert dead in relus
    assert len(relus) >= 3

    run = execute(tmp_path, capsys, lambda: ex.main(["--log-dir", str(tmp_path)]))
    callback = run.callback
    threshold = callback.rule_config.dead_frac_threshold

    dead_frac = run.logged("act_dead_frac")
    assert len(dead_frac) == ex.MAX_STEPS // 2  # every_n_steps=2
    for step, by_layer in dead_frac.items():
        assert set(by_layer) == set(relus), step  # the statistic exists for every ReLU, and only ReLUs
        assert by_layer[dead] == 1.0
        for relu in set(relus) - {dead}:
            assert by_layer[relu] < 0.1, (step, relu)  # healthy: far below the threshold

    dead_findings = [f for f in callback.findings if f.rule == "dead_units"]
    assert [(f.layer, f.step, f.value, f.threshold) for f in dead_findings] == [(dead, 0, 1.0, threshold)]
    assert [f.layer for f in callback.last_findings if f.rule == "dead_units"] == [dead]
    # The consequence: no gradient flows below a dead ReLU, so the Linear feeding it has a zero output gradient.
    norms = run.logged("act_grad_norm")
    assert all(by_layer[broken] == 0.0 and by_layer[dead] > 0 for by_layer in norms.values())
    # One finding per cause: the dead layer's finding says what it stops (no gradient from the Linear feeding it to
    # the input end); no vanishing_gradient of its own.
    assert [f.rule for f in callback.findings] == ["dead_units"]
    assert [f.rule for f in callback.last_findings] == ["dead_units"]
    below = names.index(broken) + 1  # the layers from the broken Linear down to the input end
    assert f"below {dead}, no layer from {broken} to the input end ({below} layers)" in dead_findings[0].message
    assert "the largest is exactly 0" in dead_findings[0].message
    assert any(dead in w and "dead_units" in w for w in run.warnings)
    assert "--stat act_dead_frac" in run.stdout


# --------------------------------------------------------------------------------------------------- sick_nan
def nan_origin(ex: ModuleType) -> str:
    (origin,) = child_names(ex.build_model().net, ex.UnsafeLog)
    return origin


def test_nan_origin_is_the_first_nonfinite_layer_in_forward_order(tmp_path, capsys):
    ex = example("sick_nan")
    origin = nan_origin(ex)
    run = execute(tmp_path, capsys, lambda: ex.main(["--log-dir", str(tmp_path), "--on-anomaly", "ignore"]))
    callback = run.callback
    assert run.warnings == []  # ignore: findings only

    # The per-layer counts are logged on the steps where one is not 0 (charts="default"), their largest on every step.
    nonfinite, worst = run.logged("act_nonfinite"), run.totals("act_nonfinite_max")
    assert sorted(worst) == list(range(ex.MAX_STEPS))
    sick_steps = [s for s in sorted(worst) if worst[s] > 0]
    assert sorted(nonfinite) == sick_steps
    assert all(max(nonfinite[s].values()) == worst[s] for s in sick_steps)
    first = sick_steps[0]
    assert first == ex.HEALTHY_STEPS > 0  # clean steps first: the callback sees the step it happens
    forward = run.forward_order(first)
    at = forward.index(origin)
    assert all(nonfinite[first][layer] == 0 for layer in forward[:at])
    assert nonfinite[first][origin] > 0
    # Every layer after the origin is non-finite too: picking the first one in forward order is what matters.
    assert all(nonfinite[first][layer] > 0 for layer in forward[at + 1 :])
    assert len(forward) - at - 1 >= 2

    forward_nonfinite = [f for f in callback.findings if f.rule == "nonfinite" and f.phase == "forward"]
    assert (forward_nonfinite[0].layer, forward_nonfinite[0].step) == (origin, first)
    assert forward_nonfinite[0].value == nonfinite[first][origin]
    assert callback.findings[0] == forward_nonfinite[0]  # the earliest problem is listed first
    assert not [f for f in callback.findings if f.step < first]
    # Only the origin on that step, not the downstream layers.
    assert [f.layer for f in forward_nonfinite if f.step == first] == [origin]
    # The backward pass: the non-finite gradient starts at the output end.
    backward = [f for f in callback.findings if f.rule == "nonfinite" and f.phase == "backward" and f.step == first]
    assert backward
    assert backward[0].layer == forward[-1]


def test_nan_with_on_anomaly_raise_names_the_origin(tmp_path, capsys):
    ex = example("sick_nan")
    origin = nan_origin(ex)
    callback = ex.make_callback("raise")
    expected = rf"^layer health check failed at step {ex.HEALTHY_STEPS} in {re.escape(origin)} \(rule nonfinite\)"
    with pytest.raises(LayerHealthError, match=expected):
        ex.train(tmp_path, callback)
    # Training stopped on that step: nothing was logged after it.
    (csv_file,) = tmp_path.rglob("metrics.csv")
    with open(csv_file, newline="") as fh:
        # The steps that logged the origin layer's output (every sampled step it ran on).
        rows = csv.DictReader(fh)
        steps = {int(r["step"]) for r in rows for k, v in r.items() if v and is_layer(k, "act_mean", origin)}
    assert max(steps) == ex.HEALTHY_STEPS == callback.last_step
    # The findings were recorded before raising, and the run still printed them.
    assert callback.findings[0].layer == origin
    assert "nonfinite" in capsys.readouterr().out

    # main() (raise by default) catches the error and prints it.
    main_callback = ex.main(["--log-dir", str(tmp_path / "main")])
    out = capsys.readouterr().out
    assert "LayerHealthError" in out
    assert f"in {origin} (rule nonfinite)" in out
    assert main_callback.findings[0].layer == origin


def test_nan_relu_is_not_reported_as_dead(tmp_path, capsys):
    ex = example("sick_nan")
    run = execute(tmp_path, capsys, lambda: ex.main(["--log-dir", str(tmp_path), "--on-anomaly", "ignore"]))
    relus = child_names(ex.build_model().net, nn.ReLU)
    nonfinite = run.logged("act_nonfinite")
    nan_relus = {(s, r) for s, by_layer in nonfinite.items() for r in relus if by_layer[r] > 0}
    assert nan_relus  # the premise: some ReLU outputs are NaN
    dead = {(f.step, f.layer) for f in run.callback.findings if f.rule == "dead_units"}
    assert not dead & nan_relus


# ------------------------------------------------------------------------------------------- healthy_baseline
def test_healthy_baseline_has_no_findings_and_no_warnings(tmp_path, capsys):
    ex = example("healthy_baseline")
    run = execute(tmp_path, capsys, lambda: ex.main(["--log-dir", str(tmp_path)]))
    callback = run.callback
    assert callback.on_anomaly == "warn"
    assert run.warnings == []
    assert callback.findings == []
    assert callback.last_findings == []
    # Silence is not for want of data: every rule's statistic was logged for every layer on every sampled step.
    sampled = list(range(0, ex.MAX_STEPS, callback.every_n_steps))
    assert callback.last_step == sampled[-1]
    layers = set(callback.execution_order)
    assert len(layers) == 7
    for stat in ("act_grad_norm", "act_mean", "act_std"):
        logged = run.logged(stat)
        assert sorted(logged) == sampled, stat
        assert all(set(by_layer) == layers for by_layer in logged.values()), stat
    # The non-finite counts, 0 on every layer, are charted by their largest (charts="default").
    for stat in ("act_nonfinite", "act_grad_nonfinite"):
        assert run.totals(f"{stat}_max") == dict.fromkeys(sampled, 0.0), stat
        assert run.logged(stat) == {}, stat
    assert all(len(by_layer) == 3 for by_layer in run.logged("act_dead_frac").values())
    # A learnable task, learned.
    losses = run.losses()
    assert len(losses) == ex.MAX_STEPS
    assert min(losses[-5:]) < 0.25 * losses[0]
    assert "no findings" in run.stdout


# ------------------------------------------------------------------------------------ as scripts, and the report
@pytest.mark.slow
def test_script_prints_commands_that_run_without_an_activated_venv(tmp_path):
    """The printed ``hookdiag report`` and ``tensorboard`` commands run as printed, from a shell whose PATH lacks the
    virtual environment (the README's set-up never activates it)."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "sick_vanishing.py"), "--log-dir", str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr  # warn: the run finishes, so the script succeeds
    assert "vanishing_gradient" in proc.stdout
    assert "vanishing_gradient" in proc.stderr  # the LayerHealthWarning
    report = re.search(r"^\s*(\S*hookdiag report \S+ --stat \S+)$", proc.stdout, re.MULTILINE)
    assert report is not None, proc.stdout
    out = tmp_path / "heatmap.png"
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    drawn = subprocess.run(
        [*shlex.split(report.group(1)), "--out", str(out)], capture_output=True, text=True, env=bare, check=False
    )
    assert drawn.returncode == 0, drawn.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tensorboard = re.search(r"^\s*(\S*tensorboard) --logdir (\S+)$", proc.stdout, re.MULTILINE)
    assert tensorboard is not None, proc.stdout
    assert list(Path(tensorboard.group(2)).glob("events.out.tfevents.*"))  # the sick run is in TensorBoard too
    version = subprocess.run(
        [*shlex.split(tensorboard.group(1)), "--version_tb"], capture_output=True, text=True, env=bare, check=False
    )
    assert version.returncode == 0, version.stderr


@pytest.mark.slow
def test_a_sick_script_stopped_by_layer_health_error_exits_non_zero(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "sick_nan.py"), "--log-dir", str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "training stopped with LayerHealthError" in proc.stdout
    assert proc.returncode == 1, proc.stdout[-2000:]


def test_the_printout_lists_each_finding_once(tmp_path, capsys):
    ex = example("sick_nan")
    callback = ex.main(["--log-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert callback.last_findings  # raise: stopped on its first finding
    for finding in callback.last_findings:
        assert out.count(finding.message) == 2, finding  # once in the findings, once in LayerHealthError's message
    assert f"findings of the last sampled step ({callback.last_step}): {len(callback.last_findings)}" in out


# ------------------------------------------------------------------------------------------ sick_between_steps
def test_between_steps_nan_is_named_on_its_own_step_by_the_sentinel(tmp_path, capsys):
    ex = example("sick_between_steps")
    assert ex.SICK_STEP % ex.EVERY_N_STEPS  # the failure falls between two sampled steps
    (origin,) = child_names(ex.build_model().net, ex.NaNOnStep)
    callback = ex.main(["--log-dir", str(tmp_path / "raise")])
    out = capsys.readouterr().out
    assert f"layer health check failed at step {ex.SICK_STEP} in {origin} (rule nonfinite)" in out
    assert f"sentinel: step {ex.SICK_STEP} tripped (nonfinite_loss, loss=nan), replayed" in out
    assert (callback.findings[0].step, callback.findings[0].layer) == (ex.SICK_STEP, origin)

    late = ex.main(["--log-dir", str(tmp_path / "late"), "--sentinel", "none", "--on-anomaly", "ignore"])
    first_sampled_after = (ex.SICK_STEP // ex.EVERY_N_STEPS + 1) * ex.EVERY_N_STEPS
    assert late.findings[0].step == first_sampled_after
    assert "the weights are already non-finite" in late.findings[0].message
