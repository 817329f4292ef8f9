"""The ``hookdiag report`` command: reading real CSVLogger/TensorBoardLogger runs, the summary, the heatmap, errors."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import TinyModule, make_data, make_trainer
from helpers.keys import parse_key
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

import lightning_hookdiag
from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag.report import ReportError, ReportWarning, Scalar, build_health_log, read_health_log
from lightning_hookdiag.report._cli import build_parser, main
from lightning_hookdiag.report._health_log import stat_order_key
from lightning_hookdiag.report._plot import draw_heatmap, heatmap_figure, load_matplotlib
from lightning_hookdiag.report._reading import read_csv_scalars

REPO = Path(lightning_hookdiag.__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Forward order deliberately differs from alphabetical order (net.body.conv < net.head < net.stem).
DEPTH = {"net.stem": 0, "net.body.conv": 1, "net.head": 2}
DEPTH_ORDER = sorted(DEPTH, key=DEPTH.__getitem__)
PARAMS = ["net.head.weight", "net.stem.weight", "net.body.conv.bias", "net.orphan.weight"]
PARAM_ORDER = ["net.stem.weight", "net.body.conv.bias", "net.head.weight", "net.orphan.weight"]  # orphan: no depth
STEPS = [0, 5, 10]
NAN = float("nan")


def expected_values(prefix: str = "layer_health") -> dict[str, dict[str, dict[int, float]]]:
    """The statistics the fake run logs; every value is exact in float32, which TensorBoard stores."""
    stats: dict[str, dict[str, dict[int, float]]] = {"act_grad_norm": {}, "act_mean": {}, "act_nonfinite": {}}
    for layer, d in DEPTH.items():
        stats["act_grad_norm"][layer] = {s: (s + 1) * 0.125 * (d + 1) for s in STEPS}
        stats["act_mean"][layer] = {s: (-1) ** d * (s + 1) / 4 for s in STEPS}
        stats["act_nonfinite"][layer] = dict.fromkeys(STEPS, 0.0)
    stats["act_grad_norm"]["net.head"][5] = 0.0  # masked on the log scale
    stats["act_grad_norm"]["net.body.conv"][10] = NAN
    del stats["act_grad_norm"]["net.body.conv"][0]  # the layer did not run on step 0
    stats["act_nonfinite"]["net.head"][10] = 3.0
    stats["param_norm"] = {p: {s: 1 + i / 2 + s / 8 for s in STEPS} for i, p in enumerate(PARAMS)}
    return stats


TOTALS = {"grad_norm_total": {s: 1 + s / 2 for s in STEPS}}


def write_run(logger: CSVLogger | TensorBoardLogger, prefix: str = "layer_health") -> Path:
    """Log the fake run the way Lightning and the callback would, several calls per step, then finalize."""
    stats = expected_values()
    for s in STEPS:
        # Lightning's own keys, one of them logged ahead of the step the callback describes.
        logger.log_metrics({"train_loss": 0.5 + s, "epoch": 0.0, "val/loss": 2.0}, step=s + 2)
        # Step 0 logs a depth order that later steps correct: the latest one must win.
        depth = {"net.head": 0, "net.stem": 2, "net.body.conv": 1} if s == 0 else DEPTH
        metrics = {f"{prefix}/depth/{name}": float(d) for name, d in depth.items()}
        for stat in ("act_grad_norm", "act_mean", "act_nonfinite"):
            metrics |= {f"{prefix}/{stat}/{layer}": v[s] for layer, v in stats[stat].items() if s in v}
        metrics[f"{prefix}/grad_norm_total"] = TOTALS["grad_norm_total"][s]
        logger.log_metrics(metrics, step=s)
        logger.log_metrics({f"{prefix}/param_norm/{p}": v[s] for p, v in stats["param_norm"].items()}, step=s)
        logger.log_metrics({"train_loss": 0.25 + s}, step=s)
    logger.save()
    logger.finalize("success")
    return Path(logger.log_dir)


def nan_safe(obj: object) -> object:
    """NaN != NaN, so compare nested dicts with NaN replaced by a marker."""
    if isinstance(obj, dict):
        return {k: nan_safe(v) for k, v in obj.items()}
    return "NaN" if isinstance(obj, float) and math.isnan(obj) else obj


@pytest.fixture
def csv_run(tmp_path: Path) -> Path:
    return write_run(CSVLogger(tmp_path / "csv_logs", name="run"))


@pytest.fixture
def tb_run(tmp_path: Path) -> Path:
    return write_run(TensorBoardLogger(tmp_path / "tb_logs", name="run"))


@pytest.fixture(params=["csv", "tensorboard"])
def any_run(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue("csv_run" if request.param == "csv" else "tb_run")


# ----------------------------------------------------------------------------------------------- reading


def test_fake_run_uses_both_file_formats_and_shared_steps(csv_run: Path, tb_run: Path) -> None:
    assert list(tb_run.glob("events.out.tfevents.*"))
    assert not (tb_run / "metrics.csv").exists()
    rows = (csv_run / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    steps = [r.split(",")[header.index("step")] for r in rows[1:]]
    assert steps.count("5") >= 3  # several rows share a step and must be merged
    assert sorted(DEPTH) != DEPTH_ORDER


def test_reader_returns_exactly_the_values_written(any_run: Path) -> None:
    log = read_health_log(any_run)
    assert log.prefix == "layer_health"
    assert nan_safe(log.stats) == nan_safe(expected_values())
    assert log.totals == TOTALS
    assert log.depth == DEPTH
    assert log.steps == tuple(STEPS)  # train_loss at steps 2, 7 and 12 is not a health step


def test_reader_orders_layers_and_parameters_by_depth(any_run: Path) -> None:
    log = read_health_log(any_run)
    assert log.layers("act_grad_norm") == DEPTH_ORDER
    assert log.layers("param_norm") == PARAM_ORDER
    assert log.depth_of("net.head.weight", "param_norm") == DEPTH["net.head"]
    assert log.depth_of("net.orphan.weight", "param_norm") is None


def test_reader_and_cli_accept_a_single_log_file(csv_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert nan_safe(read_health_log(csv_run / "metrics.csv").stats) == nan_safe(expected_values())
    assert main(["report", str(csv_run / "metrics.csv"), "--stat", "act_mean"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"heatmap: {csv_run / 'layer_health_act_mean.png'}")
    assert (csv_run / "layer_health_act_mean.png").read_bytes()[:8] == PNG_MAGIC


def test_prefix_is_detected_or_given(tmp_path: Path) -> None:
    run = write_run(CSVLogger(tmp_path, name="p"), prefix="probe/health")
    log = read_health_log(run)
    assert log.prefix == "probe/health"
    assert log.layers("act_mean") == DEPTH_ORDER

    both = CSVLogger(tmp_path, name="two")
    both.log_metrics({"enc_health/depth/a": 0.0, "enc_health/act_std/a": 1.0}, step=0)
    both.log_metrics({"dec_health/depth/b": 0.0, "dec_health/act_std/b": 2.0}, step=0)
    both.save()
    with pytest.raises(ReportError, match=r"several health prefixes \(dec_health, enc_health\)"):
        read_health_log(both.log_dir)
    assert read_health_log(both.log_dir, prefix="dec_health").stats == {"act_std": {"b": {0: 2.0}}}


# ----------------------------------------------------------------------------------------------- summary


def summary_rows(out: str, names: list[str]) -> list[list[str]]:
    """The table rows of the printed summary for ``names``, in printed order."""
    rows = [line.split() for line in out.splitlines() if line.startswith("  ")]
    return [r for r in rows if len(r) >= 5 and r[1] in names]


def test_cli_prints_summary_in_depth_order_and_writes_png(csv_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(csv_run)]) == 0
    out, err = capsys.readouterr()
    assert err == ""

    rows = summary_rows(out, DEPTH_ORDER)
    assert [r[1] for r in rows] == DEPTH_ORDER
    expected = expected_values()["act_grad_norm"]
    for depth, name, latest, low, high, *_ in rows:
        series = expected[name]
        finite = [v for v in series.values() if math.isfinite(v)]
        assert int(depth) == DEPTH[name]
        assert float(latest) == pytest.approx(series[max(series)], nan_ok=True)
        assert float(low) == pytest.approx(min(finite), rel=1e-3)
        assert float(high) == pytest.approx(max(finite), rel=1e-3)
    assert "grad_norm_total: latest 6 (step 10), min 1, max 6" in out
    assert "act_nonfinite: NaN/Inf in net.head (from step 10)" in out

    png = csv_run / "layer_health_act_grad_norm.png"
    assert out.rstrip().splitlines()[-1] == f"heatmap: {png}"
    assert png.read_bytes()[:8] == PNG_MAGIC
    import matplotlib.image

    image = matplotlib.image.imread(png)
    height, width = image.shape[:2]
    assert 200 <= height <= 1000
    assert 400 <= width <= 1600
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_cli_tensorboard_with_stat_and_out(tb_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_png = tmp_path / "mean.png"
    assert main(["report", str(tb_run), "--stat", "act_mean", "--out", str(out_png)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "layer_health/act_mean: 3 layers, 3 sampled steps (0..10)"
    assert [r[1] for r in summary_rows(out, DEPTH_ORDER)] == DEPTH_ORDER
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    assert not (tb_run / "layer_health_act_mean.png").exists()


def test_cli_parameter_stat_lists_parameters_in_depth_order(csv_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(csv_run), "--stat", "param_norm"]) == 0
    rows = summary_rows(capsys.readouterr().out, PARAMS)
    assert [r[1] for r in rows] == PARAM_ORDER
    assert rows[-1][0] == "-"  # no owning layer logged a depth
    assert (csv_run / "layer_health_param_norm.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--help"]) == 0
    assert "--stat" in capsys.readouterr().out


def test_cli_defaults_leave_the_statistic_and_the_prefix_to_the_logs() -> None:
    args = build_parser().parse_args(["report", "logs/version_0"])
    assert (args.log_dir, args.stat, args.out, args.prefix, args.diff) == ("logs/version_0", None, None, None, None)
    assert (args.rtol, args.atol) == (1e-4, 0.0)


# ----------------------------------------------------------------------------------------------- heatmap


def test_heatmap_masks_zero_nan_and_missing_cells(csv_run: Path) -> None:
    from matplotlib.colors import LogNorm, SymLogNorm

    log = read_health_log(csv_run)
    image = heatmap_figure(log, "act_grad_norm").axes[0].images[0]
    expected = expected_values()["act_grad_norm"]
    mask = image.get_array().mask.tolist()
    for r, name in enumerate(DEPTH_ORDER):
        for c, step in enumerate(STEPS):
            value = expected[name].get(step, NAN)
            assert mask[r][c] == (not (math.isfinite(value) and value > 0)), (name, step)
    positive = [v for series in expected.values() for v in series.values() if math.isfinite(v) and v > 0]
    assert isinstance(image.norm, LogNorm)
    assert (image.norm.vmin, image.norm.vmax) == (min(positive), max(positive))
    labels = [t.get_text() for t in image.axes.get_yticklabels()]
    assert labels == DEPTH_ORDER

    signed = heatmap_figure(log, "act_mean").axes[0].images[0]
    assert isinstance(signed.norm, SymLogNorm)
    assert not signed.get_array().mask.any()


def test_heatmap_has_a_row_per_layer_and_a_column_per_step() -> None:
    log = build_health_log([Scalar("layer_health/act_absmax/fc", s, 2.0**s) for s in range(3)])
    assert heatmap_figure(log, "act_absmax").axes[0].images[0].get_array().shape == (1, 3)


def test_heatmap_labels_thin_out_past_12_columns_and_the_root_gets_a_name() -> None:
    data = load_matplotlib().np.ones((3, 25))
    steps = list(range(0, 50, 2))
    fig, ax, image = draw_heatmap(
        data, data == 0, ["", "fc1", "fc2"], steps, cmap="viridis", norm=None, parameters=True
    )
    assert [t.get_text() for t in ax.get_yticklabels()] == ["(root)", "fc1", "fc2"]
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(s) for s in steps[::3]]  # ceil(25 / 12) = 3
    assert ax.get_ylabel().startswith("parameter ")
    assert image.get_array().shape == (3, 25)


def test_statistics_are_listed_in_vocabulary_order_then_by_name() -> None:
    names = ["param_norm", "zz_custom", "act_grad_norm", "act_std", "act_mean", "aa_custom", "grad_norm_total"]
    assert sorted(names, key=stat_order_key) == [
        "act_mean",
        "act_std",
        "act_grad_norm",
        "param_norm",
        "grad_norm_total",
        "aa_custom",
        "zz_custom",
    ]


def test_missing_matplotlib_names_the_extra(
    csv_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log = read_health_log(csv_run)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'lightning-hookdiag\[plot\]'"):
        heatmap_figure(log, "act_grad_norm")

    assert main(["report", str(csv_run)]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("hookdiag: error: ")
    assert "pip install 'lightning-hookdiag[plot]'" in err
    assert err.count("\n") == 1
    assert "Traceback" not in err
    assert [r[1] for r in summary_rows(out, DEPTH_ORDER)] == DEPTH_ORDER  # the summary still came first
    assert not (csv_run / "layer_health_act_grad_norm.png").exists()


def test_missing_tensorboard_names_the_extra_and_csv_still_works(
    csv_run: Path, tb_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert main(["report", str(tb_run)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'lightning-hookdiag[loggers]'" in err
    assert err.count("\n") == 1
    assert main(["report", str(csv_run)]) == 0


# ----------------------------------------------------------------------------------------------- bad input


def no_health_run(tmp_path: Path) -> Path:
    logger = CSVLogger(tmp_path, name="plain")
    for s in STEPS:
        logger.log_metrics({"train_loss": 1.0 / (s + 1), "epoch": 0.0}, step=s)
    logger.save()
    return Path(logger.log_dir)


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("missing dir", "no such file or folder"),
        ("empty dir", "no metrics.csv or events.out.tfevents.* files"),
        ("parent of the run", "run folders below it: "),
        ("not a log file", "not a metrics.csv or events.out.tfevents.* file"),
        ("csv without step column", "no 'step' column"),
        ("garbage event file", "no 'layer_health/...' keys"),
        ("no layer_health keys", "no 'layer_health/...' keys"),
        ("unknown stat", "stat 'act_bogus' is not in the logs"),
        ("per-step stat", "'grad_norm_total' is one number per step"),
        ("unknown prefix", "no 'nope/...' keys"),
        ("missing out folder", "does not exist"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(
    case: str, fragment: str, csv_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra: list[str] = []
    if case == "missing dir":
        target = tmp_path / "nowhere"
    elif case == "empty dir":
        target = tmp_path / "empty"
        target.mkdir()
    elif case == "parent of the run":
        target = csv_run.parent.parent
        fragment += str(csv_run)
    elif case == "not a log file":
        target = csv_run / "notes.txt"
        target.write_text("not a log")
    elif case == "csv without step column":
        target = tmp_path / "odd"
        target.mkdir()
        (target / "metrics.csv").write_text("a,b\n1,2\n")
    elif case == "garbage event file":
        target = tmp_path / "garbage"
        target.mkdir()
        (target / "events.out.tfevents.1.host").write_bytes(os.urandom(64))
    elif case == "no layer_health keys":
        target = no_health_run(tmp_path)
    else:
        target = csv_run
        extra = {
            "unknown stat": ["--stat", "act_bogus"],
            "per-step stat": ["--stat", "grad_norm_total"],
            "unknown prefix": ["--prefix", "nope"],
            "missing out folder": ["--out", str(tmp_path / "no" / "dir" / "x.png")],
        }[case]
    assert main(["report", str(target), *extra]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("hookdiag: error: ")
    assert err.count("\n") == 1
    assert "Traceback" not in err
    assert fragment in err
    if case == "unknown stat":
        for stat in ("act_mean", "act_nonfinite", "act_grad_norm", "param_norm"):
            assert stat in err


# ----------------------------------------------------------------------------------------------- processes


@pytest.mark.slow
def test_python_m_lightning_hookdiag_report(tb_run: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "lightning_hookdiag", "report", str(tb_run), "--stat", "param_norm"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout.splitlines()[0].startswith("layer_health/param_norm: 4 parameters")
    assert (tb_run / "layer_health_param_norm.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_report_runs_without_importing_torch_or_lightning(csv_run: Path, tb_run: Path, tmp_path: Path) -> None:
    # The package's own __init__ imports the callback (and so torch and Lightning); a stand-in parent package
    # isolates the report modules, which must work on a machine that only has the logs.
    script = textwrap.dedent(
        f"""
        import sys, types
        parent = types.ModuleType("lightning_hookdiag")
        parent.__path__ = [{str(REPO / "lightning_hookdiag")!r}]
        sys.modules["lightning_hookdiag"] = parent
        from lightning_hookdiag.report._cli import build_parser, main
        codes = [main(["report", {str(csv_run)!r}, "--out", {str(tmp_path / "a.png")!r}]),
                 main(["report", {str(tb_run)!r}, "--out", {str(tmp_path / "b.png")!r}])]
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "lightning", "lightning_fabric"))
        print("RESULT", codes, heavy)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "RESULT [0, 0] []" in done.stdout
    assert (tmp_path / "a.png").read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / "b.png").read_bytes()[:8] == PNG_MAGIC


# ----------------------------------------------------------------------------------------------- end to end


def test_report_of_a_real_training_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    callback = LayerHealthCallback(every_n_steps=2)
    trainer = make_trainer([callback], max_steps=5, logger=CSVLogger(tmp_path, name="fit"), log_every_n_steps=1)
    trainer.fit(TinyModule())
    log_dir = Path(trainer.logger.log_dir)

    log = read_health_log(log_dir)
    assert log.steps == (0, 2, 4)
    assert log.layers("act_grad_norm") == callback.execution_order
    for key, value in callback.last_metrics.items():
        parsed = parse_key(key, "layer_health")
        assert parsed is not None, key
        stat, layer = parsed.stat, parsed.name
        if layer is not None:
            assert log.stats[stat][layer][4] == pytest.approx(value, rel=1e-12, nan_ok=True)
            if not stat.startswith("param_"):  # the depth the key carries is the layer's place in the report
                assert log.depth[layer] == parsed.depth == callback.execution_order.index(layer)
        else:
            assert log.totals[stat][4] == pytest.approx(value, rel=1e-12, nan_ok=True)

    assert main(["report", str(log_dir)]) == 0
    out = capsys.readouterr().out
    assert [r[1] for r in summary_rows(out, callback.execution_order)] == callback.execution_order
    assert (log_dir / "layer_health_act_grad_norm.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("cut", ["inside the step cell", "inside a value"])
def test_a_csv_still_being_written_leaves_out_its_cut_last_row_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cut: str
) -> None:
    callback = LayerHealthCallback(every_n_steps=1, output={"summary": False})
    trainer = make_trainer([callback], max_steps=12, logger=CSVLogger(tmp_path, name="fit"), log_every_n_steps=50)
    trainer.fit(TinyModule(data=make_data(n=96)))
    log_dir = Path(trainer.logger.log_dir)
    whole = read_health_log(log_dir)
    assert whole.steps == tuple(range(12))
    csv_path = log_dir / "metrics.csv"
    text = csv_path.read_text()
    rows = text.splitlines(keepends=True)
    assert rows[-1].rstrip("\n").endswith(",11")  # step is CSVLogger's last column (it sorts them)
    # A run still writing: the last row is cut one character short of "11", or in the middle of its values.
    last = rows[-1].rstrip("\n")
    csv_path.write_text("".join(rows[:-1]) + (last[:-1] if cut == "inside the step cell" else last[: len(last) // 2]))

    with pytest.warns(ReportWarning, match="last row has no line end") as caught:
        log = read_health_log(log_dir)
    assert str(csv_path) in str(caught[0].message)
    assert log.steps == tuple(range(11))
    assert log.stats == {
        s: {n: {k: v for k, v in vs.items() if k < 11} for n, vs in ls.items()} for s, ls in whole.stats.items()
    }

    assert main(["report", str(log_dir)]) == 0
    captured = capsys.readouterr()
    (warning,) = [line for line in captured.err.splitlines() if line.startswith("hookdiag: warning:")]
    assert "that row was skipped" in warning
    assert "11 sampled steps (0..10)" in captured.out


def test_a_csv_whose_header_is_still_being_written_is_read_as_empty(tmp_path: Path) -> None:
    csv_path = tmp_path / "metrics.csv"
    csv_path.write_text("epoch,layer_health/act_mean/fc,st")
    with pytest.warns(ReportWarning, match="its header is incomplete"):
        assert read_csv_scalars(csv_path) == []


@pytest.mark.parametrize(
    "name", ["build_health_log", "depth_order", "detect_prefix", "format_summary", "read_health_log"]
)
def test_the_public_functions_document_every_argument(name):
    import inspect
    import re

    function = getattr(lightning_hookdiag.report, name)
    section = (function.__doc__ or "").partition("Args:\n")[2].partition("\n\n")[0]
    assert re.findall(r"^ {8}(\w+):", section, re.MULTILINE) == list(inspect.signature(function).parameters)
