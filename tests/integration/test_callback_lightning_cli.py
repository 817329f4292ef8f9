"""``LayerHealthCallback`` configured from YAML through ``LightningCLI`` (``examples/cli_train.py``).

The valid configuration and one invalid one run the example as real commands in subprocesses, started together by
one module-scoped fixture (they spend most of their time importing); the other invalid configurations go through
the example's ``main(args)`` in-process, which fails the same way without the cost of a new interpreter.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from lightning_hookdiag._vocabulary import SUMMARIES

pytestmark = pytest.mark.slow

pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures] (the 'cli' extra)")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "cli_train.py"
CONFIG = ROOT / "examples" / "cli_config.yaml"
TIMEOUT_S = 180

# What cli_config.yaml selects: layers ["encoder.*", "head"], of types Linear/ReLU (drops encoder.2, a LayerNorm),
# minus exclude ["encoder.0"].
LAYERS = ["encoder.1", "encoder.3", "encoder.4", "head"]
RELU_LAYERS = ["encoder.1", "encoder.4"]
PARAMS = ["encoder.3.weight", "encoder.3.bias", "head.weight", "head.bias"]
STATS = ["act_mean", "act_std", "act_dead_frac", "act_grad_norm", "param_norm"]
EVERY_N_STEPS, MAX_STEPS = 2, 6


def health_args(config: dict[str, Any]) -> dict[str, Any]:
    (callback,) = config["trainer"]["callbacks"]
    assert callback["class_path"] == "lightning_hookdiag.LayerHealthCallback"
    return callback["init_args"]


def bad_stat(config: dict[str, Any]) -> None:
    health_args(config)["stats"] = ["act_mean", "act_meen"]


def zero_interval(config: dict[str, Any]) -> None:
    health_args(config)["every_n_steps"] = 0


def misspelt_rule(config: dict[str, Any]) -> None:
    health_args(config)["rules"] = {"dead_frac_treshold": 0.5}


def bad_layer_type(config: dict[str, Any]) -> None:
    health_args(config)["measure"]["layer_types"] = ["torch.nn.Linear", "torch.nn.Relu"]


def bad_extra_stat(config: dict[str, Any]) -> None:
    health_args(config)["measure"]["extra_stats"] = ["act_kurtosis", "act_kurt"]


def bad_warmup(config: dict[str, Any]) -> None:
    health_args(config)["sentinel"]["warmup"] = 60


def bad_heatmap_stat(config: dict[str, Any]) -> None:
    health_args(config)["output"]["heatmap_stats"] = ["act_stdd"]


# Each invalid configuration and the text its error message must contain.
BAD = {
    "bad_stat": (bad_stat, ["stats", "act_meen"]),
    "zero_interval": (zero_interval, ["every_n_steps", "got 0"]),
    "misspelt_rule": (misspelt_rule, ["dead_frac_treshold", "dead_frac_threshold"]),
    "bad_layer_type": (bad_layer_type, ["MeasureConfig.layer_types", "torch.nn.Relu"]),
    "bad_extra_stat": (bad_extra_stat, ["MeasureConfig.extra_stats", "act_kurt"]),
    "bad_warmup": (bad_warmup, ["SentinelConfig.warmup", "[3, window=30]", "got 60"]),
    "bad_heatmap_stat": (bad_heatmap_stat, ["OutputConfig.heatmap_stats", "act_stdd"]),
}
SUBPROCESS_BAD_CASE = "zero_interval"
# Where the callback's arguments are in the configuration, as the one error line names it.
KEY = "trainer.callbacks[0].init_args: "


def error_line(output: str) -> str:
    """The output's one ``error:`` line, asserting that there is no traceback and that it is the last line."""
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output[-3000:]
    assert output.rstrip().splitlines()[-1] == errors[0]
    return errors[0]


def start(config: Path, root: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    command = [sys.executable, str(SCRIPT), "fit", "--config", str(config), "--trainer.default_root_dir", str(root)]
    return subprocess.Popen(
        [*command, *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"{proc.args} did not finish in {TIMEOUT_S} s:\n{output}")
    return proc.returncode, output


def write_bad_config(case: str, directory: Path) -> Path:
    config = yaml.safe_load(CONFIG.read_text())
    BAD[case][0](config)
    path = directory / f"{case}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Start the valid run and one invalid one at once; yield ``{case: (process, default_root_dir)}``."""
    base = tmp_path_factory.mktemp("cli")
    procs: dict[str, Any] = {}
    for case in ("good", SUBPROCESS_BAD_CASE):
        root = base / case
        config = CONFIG if case == "good" else write_bad_config(case, base)
        # The CSVLogger's save_dir comes from the YAML (a relative path); point it into the temporary directory.
        procs[case] = (start(config, root, "--trainer.logger.init_args.save_dir", str(root / "logs")), root)
    yield procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def cli_train() -> ModuleType:
    """``examples/cli_train.py`` imported as a module, for the in-process cases.

    Its folder goes on ``sys.path`` as Python puts it there for ``python examples/cli_train.py`` (it imports
    ``_common`` from beside it).
    """
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("cli_train", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_matches_this_test() -> None:
    """The constants above describe cli_config.yaml; keep them in step."""
    config = yaml.safe_load(CONFIG.read_text())
    args = health_args(config)
    assert args["every_n_steps"] == EVERY_N_STEPS
    assert config["trainer"]["max_steps"] == MAX_STEPS
    assert args["stats"] == STATS
    assert args["measure"]["layer_types"] == ["torch.nn.Linear", "torch.nn.ReLU"]  # import strings, not classes
    assert {"layers", "on_anomaly", "measure", "sentinel", "rules", "output"} <= set(args)
    assert args["measure"]["exclude"] == ["encoder.0"]
    assert args["sentinel"] == {"mode": "loss+grads", "window": 30}
    assert "dead_frac_threshold" in args["rules"]


def test_cli_run_logs_exactly_the_configured_layers_and_stats(runs: dict[str, Any]) -> None:
    proc, root = runs["good"]
    rc, output = finish(proc)
    assert rc == 0, output
    (metrics_csv,) = root.glob("logs/**/metrics.csv")
    with open(metrics_csv, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        rows = list(reader)

    # Each layer's keys carry its place in the forward order (LAYERS is that order), a parameter its layer's.
    depth = {layer: i for i, layer in enumerate(LAYERS)}
    acts = [stat for stat in STATS if stat.startswith("act_")]
    expected = {f"layer_health.{stat}/{depth[layer]}_{layer}" for stat in acts for layer in LAYERS}
    expected -= {f"layer_health.act_dead_frac/{depth[layer]}_{layer}" for layer in LAYERS if layer not in RELU_LAYERS}
    expected |= {f"layer_health.param_norm/{depth[param.rpartition('.')[0]]}_{param}" for param in PARAMS}
    # The summary group: the worst layer's value of each statistic of SUMMARIES, and the count of active alerts.
    expected |= {f"layer_health/{stat}_{kind}" for stat in STATS for kind in SUMMARIES.get(stat, ())}
    expected |= {"layer_health/alerts_active"}
    assert {k for k in header if k.startswith("layer_health")} == expected

    logged = [row for row in rows if any(row[k] for k in expected)]
    assert [int(row["step"]) for row in logged] == list(range(0, MAX_STEPS, EVERY_N_STEPS))
    for row in logged:
        assert all(row[k] != "" for k in expected), row  # every key on every sampled step
    # LightningCLI saved the configuration it ran with, callback arguments included.
    saved = yaml.safe_load((metrics_csv.parent / "config.yaml").read_text())
    assert health_args(saved)["measure"]["layer_types"] == ["torch.nn.Linear", "torch.nn.ReLU"]


def test_cli_process_exits_with_one_error_line_naming_the_key(runs: dict[str, Any]) -> None:
    proc, root = runs[SUBPROCESS_BAD_CASE]
    rc, output = finish(proc)
    assert rc == 2, output  # argparse's exit status for a usage error
    line = error_line(output)
    assert line == f"error: {KEY}every_n_steps: expected an integer >= 1, got 0"
    assert not list(root.glob("**/metrics.csv")), "training must not start"


# Lightning 2.6 calls jsonargparse APIs that jsonargparse >= 4.49 deprecates (removed in 5.0, hence the "<5" pin).
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("case", list(BAD))
def test_cli_rejects_an_invalid_callback_argument(
    cli_train: ModuleType,
    case: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # In-process (the subprocess case above shows the exit status and the whole output): the parser exits.
    args = ["fit", "--config", str(write_bad_config(case, tmp_path)), "--trainer.default_root_dir", str(tmp_path)]
    args += ["--trainer.logger.init_args.save_dir", str(tmp_path / "logs")]
    # No global seeding in this process (seed_everything would also set PL_GLOBAL_SEED for every later test).
    args += ["--seed_everything", "false"]
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])  # pytest's own arguments are not the CLI's
    with pytest.raises(SystemExit) as excinfo:
        cli_train.main(args)
    assert excinfo.value.code == 2
    line = error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {KEY}")
    for text in BAD[case][1]:
        assert text in line, f"{text!r} not in the error: {line}"
    assert not list(tmp_path.glob("**/metrics.csv")), "training must not start"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # jsonargparse APIs Lightning 2.6 calls, as above
def test_the_yaml_sections_fill_the_nested_configurations(
    cli_train: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_hookdiag import LayerHealthCallback, MeasureConfig, OutputConfig, SentinelConfig

    args = ["fit", "--config", str(CONFIG), "--trainer.default_root_dir", str(tmp_path), "--seed_everything", "false"]
    args += ["--trainer.logger.init_args.save_dir", str(tmp_path / "logs"), "--trainer.max_steps", "1"]
    # A nested field from the command line, as LightningCLI offers for any argument.
    args += ["--trainer.callbacks.init_args.sentinel.warmup", "7"]
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])
    cli = cli_train.main(args)
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, LayerHealthCallback)]
    expected_measure = MeasureConfig(layer_types=["torch.nn.Linear", "torch.nn.ReLU"], exclude=["encoder.0"])
    assert callback.measure_config == expected_measure
    assert callback.sentinel_config == SentinelConfig(mode="loss+grads", window=30, warmup=7)
    assert callback.output_config == OutputConfig(summary=True)
    assert (callback.rule_config.dead_frac_threshold, callback.rule_config.vanishing_ratio) == (0.5, 1e-4)
    assert callback.layer_names == LAYERS  # the nested selection took effect
