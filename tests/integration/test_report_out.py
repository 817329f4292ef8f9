"""``hookdiag report --out``: which file is written, what is printed, and a bad suffix as a usage error.

Every test reads a CSVLogger run written by a real ``Trainer.fit`` and runs the command as a user does: the console
script in a subprocess, or :func:`~lightning_hookdiag.report._cli.main` with the output captured.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TinyModule, make_trainer
from lightning.pytorch.loggers import CSVLogger
from matplotlib.backend_bases import FigureCanvasBase

import lightning_hookdiag
from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag.report._cli import main

REPO = Path(lightning_hookdiag.__file__).resolve().parent.parent
# The console script of the environment running the tests (``pip install -e .`` put it beside the interpreter).
HOOKDIAG = Path(sys.executable).parent / "hookdiag"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PDF_MAGIC = b"%PDF"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The log folder of a real three-step fit, logged by a CSVLogger."""
    root = tmp_path_factory.mktemp("fit")
    trainer = make_trainer(
        [LayerHealthCallback(every_n_steps=1)], max_steps=3, logger=CSVLogger(root, name="run"), log_every_n_steps=1
    )
    trainer.fit(TinyModule())
    return Path(trainer.logger.log_dir)


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def _hookdiag(*args: str) -> subprocess.CompletedProcess[str]:
    if not HOOKDIAG.exists():
        pytest.skip(f"no console script at {HOOKDIAG} (the package is not installed in this environment)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout, whichever copy the script was installed from
    return subprocess.run([str(HOOKDIAG), *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.slow
def test_unsupported_suffix_is_one_error_line_and_exit_2_from_the_console_script(run_dir: Path, tmp_path: Path) -> None:
    done = _hookdiag("report", str(run_dir), "--out", str(tmp_path / "heat.heatmap"))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("hookdiag: error: --out")
    assert "'.heatmap'" in lines[0]
    for suffix in FigureCanvasBase.get_supported_filetypes():
        assert f".{suffix}" in lines[0]
    assert done.stdout == ""  # checked before any work: no summary either
    assert _files(tmp_path) == set()


@pytest.mark.slow
def test_no_suffix_writes_and_prints_the_png_from_the_console_script(run_dir: Path, tmp_path: Path) -> None:
    done = _hookdiag("report", str(run_dir), "--out", str(tmp_path / "heat"))
    assert done.returncode == 0, done.stderr
    written = tmp_path / "heat.png"
    assert done.stdout.splitlines()[-1] == f"heatmap: {written}"
    assert _files(tmp_path) == {"heat.png"}
    assert written.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("suffix", [".heatmap", ".PNGX", ".v2"])
def test_unsupported_suffix_fails_before_reading_the_logs(
    suffix: str, run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / f"heat{suffix}"
    assert main(["report", str(run_dir), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"hookdiag: error: --out {out}: unsupported suffix '{suffix}'")
    for listed in (".png", ".pdf", ".svg"):
        assert listed in captured.err
    assert _files(tmp_path) == set()


def test_unsupported_suffix_fails_before_reading_the_logs_with_diff(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", "--diff", str(run_dir), str(run_dir), "--out", str(tmp_path / "r.heatmap")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("hookdiag: error: --out")
    assert _files(tmp_path) == set()


@pytest.mark.parametrize(("name", "magic"), [("heat.pdf", PDF_MAGIC), ("heat.PNG", PNG_MAGIC), ("a.b.png", PNG_MAGIC)])
def test_a_supported_suffix_writes_that_file_in_that_format(
    name: str, magic: bytes, run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(run_dir), "--out", str(tmp_path / name)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"heatmap: {tmp_path / name}"
    assert _files(tmp_path) == {name}
    assert (tmp_path / name).read_bytes()[: len(magic)] == magic


def test_no_suffix_appends_png_and_prints_that_path(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(run_dir), "--stat", "act_std", "--out", str(tmp_path / "heat")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"heatmap: {tmp_path / 'heat.png'}"
    assert _files(tmp_path) == {"heat.png"}
    assert (tmp_path / "heat.png").read_bytes()[:8] == PNG_MAGIC


def test_an_existing_folder_gets_the_default_file_name_inside_it(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "plots"
    folder.mkdir()
    assert main(["report", str(run_dir), "--stat", "act_std", "--out", str(folder)]) == 0
    written = folder / "layer_health_act_std.png"
    assert capsys.readouterr().out.splitlines()[-1] == f"heatmap: {written}"
    assert _files(tmp_path) == {"plots"}  # nothing beside the folder
    assert _files(folder) == {"layer_health_act_std.png"}
    assert written.read_bytes()[:8] == PNG_MAGIC


def test_an_existing_folder_with_a_dot_in_its_name_is_still_a_folder(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "plots.d"
    folder.mkdir()
    assert main(["report", str(run_dir), "--out", str(folder)]) == 0
    written = folder / "layer_health_act_grad_norm.png"
    assert capsys.readouterr().out.splitlines()[-1] == f"heatmap: {written}"
    assert written.read_bytes()[:8] == PNG_MAGIC


def test_diff_into_a_folder_and_without_a_suffix(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "plots"
    folder.mkdir()
    assert main(["report", "--diff", str(run_dir), str(run_dir), "--stat", "act_std", "--out", str(folder)]) == 0
    written = folder / "layer_health_diff_act_std.png"
    assert capsys.readouterr().out.splitlines()[-1] == f"ratio heatmap (B/A of act_std): {written}"
    assert written.read_bytes()[:8] == PNG_MAGIC

    assert main(["report", "--diff", str(run_dir), str(run_dir), "--out", str(tmp_path / "ratio")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(f": {tmp_path / 'ratio.png'}")
    assert (tmp_path / "ratio.png").read_bytes()[:8] == PNG_MAGIC


def test_a_missing_parent_folder_is_still_one_error_line(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(run_dir), "--out", str(tmp_path / "no" / "heat")]) == 2
    captured = capsys.readouterr()
    missing = tmp_path / "no"
    assert captured.err == f"hookdiag: error: {missing / 'heat.png'}: the folder {missing} does not exist\n"
