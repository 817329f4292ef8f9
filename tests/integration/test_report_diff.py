"""``hookdiag report --diff``: two real runs that differ by one planted change, the ratio heatmap, bad inputs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import TinyModule, make_trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag.report import Scalar, build_health_log, read_health_log
from lightning_hookdiag.report._cli import main
from lightning_hookdiag.report._diff import align, find_differences, format_diff, is_backward, ratio_figure

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def train(root: Path, scale: float, logger_cls: type = CSVLogger) -> Path:
    """A 3-Linear MLP; ``scale`` multiplies the middle Linear's initial weights (the planted change)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[2].weight.mul_(scale)
    logger = logger_cls(root)
    callback = LayerHealthCallback(
        every_n_steps=2, output={"charts": "all"}
    )  # every statistic compared, the 0 counts too
    make_trainer([callback], max_steps=5, logger=logger).fit(TinyModule(model=model))
    return Path(logger.log_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("diff")
    return {
        "base": train(root / "base", 1.0),
        "same": train(root / "same", 1.0),
        "planted": train(root / "planted", 3.0),
        "planted_tb": train(root / "planted_tb", 3.0, TensorBoardLogger),
    }


def test_the_planted_init_scale_change_is_named_first(runs, capsys):
    out = runs["planted"] / "ratio.png"
    assert main(["report", "--diff", str(runs["base"]), str(runs["planted"]), "--out", str(out)]) == 1
    lines = capsys.readouterr().out.splitlines()
    first = next(line for line in lines if line.startswith("first difference:"))
    # Step 0, the middle Linear's output: the first layer, its ReLU and everything before differ nowhere on step 0
    # in the forward pass; the layers below it differ only in the backward pass, which is reported after.
    assert first.startswith("first difference: step 0, model.2, act_mean: A=")
    a, b = read_health_log(runs["base"]), read_health_log(runs["planted"])
    a0, b0 = a.stats["act_mean"]["model.2"][0], b.stats["act_mean"]["model.2"][0]
    assert first == f"first difference: step 0, model.2, act_mean: A={a0:.4g} B={b0:.4g} (B/A={b0 / a0:.4g})"
    # The weights tripled, the bias did not: the planted change shows in param_norm of the weight only.
    assert b.stats["param_norm"]["model.2.weight"][0] == pytest.approx(3 * a.stats["param_norm"]["model.2.weight"][0])
    assert b.stats["param_norm"]["model.2.bias"][0] == a.stats["param_norm"]["model.2.bias"][0]
    assert "per statistic" in "\n".join(lines)
    assert any(line.strip().startswith("act_grad_norm: step 0, model.4: A=") for line in lines)
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_alignment_orders_forward_by_depth_and_backward_by_reversed_depth(runs):
    differences = find_differences(align(read_health_log(runs["base"]), read_health_log(runs["planted"])))
    step0 = [d for d in differences if d.step == 0]
    forward = [d.layer for d in step0 if not d.stat.startswith(("act_grad", "param_grad", "param_update"))]
    backward = [d.layer for d in step0 if d.stat.startswith("act_grad_")]
    assert forward[0] == "model.2"
    assert not {"model.0", "model.1"} & set(forward)  # upstream of the change: identical outputs and weights
    assert backward[0] == "model.4"
    assert backward[-1] == "model.0"
    assert differences[0].step == 0
    assert all(earlier.step <= later.step for earlier, later in zip(differences, differences[1:], strict=False))


def test_identical_runs_have_no_difference(runs, capsys):
    out = runs["same"] / "ratio.png"
    assert main(["report", "--diff", str(runs["base"]), str(runs["same"]), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "no difference beyond rtol=0.0001, atol=0" in text
    assert "aligned: 3 common steps (0..4), 5 common layers, 6 common parameters, 12 common statistics" in text


def test_csv_against_tensorboard_with_a_chosen_statistic(runs, capsys):
    # TensorBoard stores float32: the same run read back from it differs from CSV by float32 rounding only.
    out = runs["planted_tb"] / "std.png"
    argv = ["report", "--diff", str(runs["planted"]), str(runs["planted_tb"]), "--stat", "act_std", "--out", str(out)]
    assert main([*argv, "--rtol", "1e-6"]) == 0
    assert "ratio heatmap (B/A of act_std)" in capsys.readouterr().out
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert main(["report", "--diff", str(runs["base"]), str(runs["planted_tb"]), "--out", str(out)]) == 1


def test_ratio_heatmap_holds_log10_of_b_over_a_in_depth_order(runs):
    alignment = align(read_health_log(runs["base"]), read_health_log(runs["planted"]))
    image = ratio_figure(alignment, "act_std").axes[0].images[0]
    data = image.get_array()
    labels = [t.get_text() for t in image.axes.get_yticklabels()]
    assert labels == [f"model.{i}" for i in range(5)]
    a, b = alignment.a.stats["act_std"], alignment.b.stats["act_std"]
    for row, layer in enumerate(labels):
        for col, step in enumerate(alignment.steps):
            assert data[row, col] == pytest.approx(math.log10(b[layer][step] / a[layer][step]), abs=1e-12)
    assert data[0, 0] == 0.0  # upstream of the change on step 0


def write_csv(folder: Path, rows: list[tuple[str, int, float]]) -> Path:
    folder.mkdir(parents=True)
    keys = sorted({k for k, _, _ in rows})
    lines = [",".join([*keys, "step"])]
    for key, step, value in rows:
        lines.append(",".join([str(value) if k == key else "" for k in keys] + [str(step)]))
    (folder / "metrics.csv").write_text("\n".join(lines) + "\n")
    return folder


@pytest.mark.parametrize(
    ("a_rows", "b_rows", "facts"),
    [
        (
            [("layer_health/act_std/fc", 0, 1.0)],
            [("layer_health/act_std/fc", 5, 1.0)],
            ("share no step", "RUN_A has steps 0..0", "RUN_B has steps 5..5"),
        ),
        (
            [("layer_health/act_std/fc1", 0, 1.0)],
            [("layer_health/act_std/enc.0", 0, 1.0)],
            ("share no layer", "RUN_A logs e.g. fc1", "RUN_B logs e.g. enc.0"),
        ),
        (
            [("layer_health/act_std/fc", 0, 1.0)],
            [("enc_health/act_std/fc", 0, 1.0)],
            ("different prefixes", "RUN_A: 'layer_health'", "RUN_B: 'enc_health'", "--prefix"),
        ),
    ],
    ids=["no_common_step", "no_common_layer", "different_prefixes"],
)
def test_bad_pairs_are_one_error_line_and_exit_2(tmp_path, capsys, a_rows, b_rows, facts):
    a, b = write_csv(tmp_path / "a", a_rows), write_csv(tmp_path / "b", b_rows)
    assert main(["report", "--diff", str(a), str(b)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("hookdiag: error: ")
    assert captured.err.count("\n") == 1
    for fact in facts:
        assert fact in captured.err


@pytest.mark.parametrize(
    ("argv", "facts"),
    [
        (["--diff", "{a}", "{missing}"], ("{missing}", "no such file or folder")),
        (["{a}", "--diff", "{a}", "{a}"], ("LOG_DIR or --diff RUN_A RUN_B, not both", "got LOG_DIR {a}")),
        ([], ("expected LOG_DIR", "--diff RUN_A RUN_B")),
        (["--diff", "{a}", "{a}", "--rtol", "-1"], ("--rtol", "a finite number >= 0", "got -1")),
        (
            ["--diff", "{a}", "{a}", "--stat", "act_mean"],
            ("act_mean is not logged by both", "common statistics: act_std"),
        ),
    ],
    ids=["missing_dir", "both_forms", "neither_form", "bad_rtol", "stat_not_common"],
)
def test_bad_arguments_are_one_error_line_and_exit_2(tmp_path, capsys, argv, facts):
    a = write_csv(tmp_path / "a", [("layer_health/act_std/fc", 0, 1.0)])
    names = {"a": str(a), "missing": str(tmp_path / "nope")}
    assert main(["report", *(arg.format(**names) for arg in argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hookdiag: error: ")
    assert err.count("\n") == 1
    for fact in facts:
        assert fact.format(**names) in err


def test_the_text_report_names_what_was_aligned_and_each_statistic_s_first_difference():
    a = build_health_log([Scalar("layer_health/act_std/fc", s, 1.0) for s in (0, 2)])
    b = build_health_log([Scalar("layer_health/act_std/fc", s, 1.0 + s) for s in (0, 2)])
    alignment = align(a, b)
    assert format_diff(alignment, find_differences(alignment), rtol=1e-4, atol=0.0).splitlines() == [
        "aligned: 2 common steps (0..2), 1 common layer, 1 common statistic",
        "first difference: step 2, fc, act_std: A=1 B=3 (B/A=3)",
        "first difference per statistic (forward statistics in depth order, then backward ones):",
        "  act_std: step 2, fc: A=1 B=3 (B/A=3)",
    ]


def test_gradient_and_update_statistics_are_the_backward_ones():
    stats = ["act_std", "act_grad_norm", "act_grad_overflow_frac_float16", "param_norm", "param_grad_norm"]
    assert [s for s in stats + ["param_update_ratio"] if is_backward(s)] == [
        "act_grad_norm",
        "act_grad_overflow_frac_float16",
        "param_grad_norm",
        "param_update_ratio",
    ]


@pytest.mark.parametrize(("x", "y"), [(math.inf, 5.0), (math.inf, -math.inf), (-math.inf, 1e300), (2.0, math.inf)])
def test_an_infinity_differs_from_every_other_value_at_the_default_rtol(x, y):
    a = build_health_log([Scalar("layer_health/act_std/fc", 0, x)])
    b = build_health_log([Scalar("layer_health/act_std/fc", 0, y)])
    assert [(d.step, d.layer, d.stat) for d in find_differences(align(a, b))] == [(0, "fc", "act_std")]


def test_equal_infinities_do_not_differ():
    a = build_health_log([Scalar("layer_health/act_std/fc", 0, math.inf)])
    assert find_differences(align(a, build_health_log([Scalar("layer_health/act_std/fc", 0, math.inf)]))) == []


def test_a_selected_container_s_parameter_is_ordered_at_the_container_s_depth():
    # `enc` is a selected container (depth 1); `enc.block.weight` belongs to it, not to an unlogged `enc.block`.
    layers = ("stem", "enc", "head")
    rows = [Scalar(f"layer_health/act_std/{layer}", 0, 1.0) for layer in layers]
    rows += [Scalar(f"layer_health/depth/{layer}", 0, float(depth)) for depth, layer in enumerate(layers)]
    a = build_health_log(
        rows + [Scalar(f"layer_health/param_norm/{p}", 0, 1.0) for p in ("enc.block.weight", "head.weight")]
    )
    b = build_health_log(
        rows + [Scalar(f"layer_health/param_norm/{p}", 0, 2.0) for p in ("enc.block.weight", "head.weight")]
    )
    order = [d.layer for d in find_differences(align(a, b)) if d.stat == "param_norm"]
    assert order == ["enc.block.weight", "head.weight"]
