"""Regenerate the README's screenshots of what the loggers show, from real runs of ``examples/sick_dead_block.py``.

One command, from the root of a clone, after the README's set-up:

    .venv/bin/python docs/screenshots.py --out docs/

It trains the example twice (the dead block and its healthy twin, in parallel, into a temporary folder or
``--log-dir``), starts this Python's ``tensorboard`` on each run's event files (``127.0.0.1``, a free port), waits
until it has loaded them, and takes headless Chromium screenshots of the Time series view (the landing page, no tag
filter typed), the Text tab (the findings) and the Images tab (the heatmap). When an ``mlflow`` with its web UI is
found (``--mlflow``, or ``mlflow`` next to this Python), the MLflow run page of the dead block too. Every server it
starts is stopped when it ends, also on an error. About a minute on 2 cores.

Written to ``--out`` (the names the README uses):

- ``tensorboard_dead_block.png``, ``tensorboard_dead_block_text.png``, ``tensorboard_dead_block_images.png``
- ``tensorboard_healthy.png`` (the healthy twin has no findings, so no Text tab)
- ``mlflow_dead_block.png``, ``mlflow_dead_block_overview.png`` (only with an MLflow UI)

Needs Chromium, from the system's package manager (not a browser build that a Python package downloads). On Debian
and Ubuntu:

    apt-get update && apt-get install -y chromium

(``chromium-headless-shell`` works too; on macOS, ``--chromium "/Applications/Google Chrome.app/Contents/MacOS/Google
Chrome"``.) The MLflow screenshot needs the full ``mlflow`` package: ``mlflow-skinny``, which ``.[dev]`` installs, has
no web UI (no ``flask``, no built front end); install ``mlflow`` into a separate virtual environment and pass its
``mlflow`` with ``--mlflow``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "sick_dead_block.py"
SICK, HEALTHY = "sick_dead_block", "sick_dead_block_healthy"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "chromium-headless-shell", "google-chrome", "google-chrome-stable")
WIDTH, HEIGHT = 1600, 1200  # window size of a screenshot
MAX_HEIGHT = 6000
IMAGES_TAB_TOP = 290  # pixels above the first image in the Images tab (TensorBoard 2.21)
IMAGE_CARD_WIDTH = 350  # width an image is scaled to in the Images tab
SERVER_WAIT_S = 90.0
TRAIN_WAIT_S = 300.0
SHOT_WAIT_S = 120.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get_json(url: str) -> object | None:
    """The JSON body of ``url``, or ``None`` while the server does not answer (yet) or answers with an error."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read().decode())
    except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
        return None


def wait_for(what: str, ready: Callable[[], bool], server: subprocess.Popen[bytes], log: Path) -> None:
    """Poll ``ready`` until it is true; fail with the server's log if it exits first or ``SERVER_WAIT_S`` passes."""
    deadline = time.monotonic() + SERVER_WAIT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{what} exited with status {server.returncode}:\n{log.read_text()[-3000:]}")
        if ready():
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what} was not ready after {SERVER_WAIT_S:.0f} s:\n{log.read_text()[-3000:]}")


@contextmanager
def server(command: Sequence[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``command`` with its output in ``log``; terminate it (kill after 10 s) when the block ends."""
    with open(log, "wb") as out:
        process = subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def train(log_dir: Path) -> None:
    """Run the example, sick and healthy, in parallel (each uses one thread), into ``log_dir``."""
    env = dict(os.environ)
    # The example imports lightning_hookdiag: the one of this checkout, also when another copy is installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    runs = {}
    for extra in ([], ["--healthy"]):
        command = [sys.executable, str(EXAMPLE), "--log-dir", str(log_dir), *extra]
        log = log_dir / f"train{'_healthy' if extra else ''}.log"
        with open(log, "wb") as out:
            runs[log] = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
    for log, process in runs.items():
        try:
            status = process.wait(timeout=TRAIN_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
            status = -9
        if status != 0:
            for other in runs.values():
                if other.poll() is None:
                    other.kill()
                    other.wait(timeout=10)
            raise RuntimeError(f"{' '.join(process.args)} exited with status {status}:\n{log.read_text()[-3000:]}")


def run_dir(log_dir: Path, name: str) -> Path:
    """The one ``version_N`` folder the example wrote for ``name``."""
    (found,) = sorted((log_dir / name).glob("version_*"))
    return found


def find_chromium(given: str | None) -> str:
    """The Chromium executable: ``given``, or the first of the usual names on ``PATH``."""
    if given is not None:
        return given
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path is not None:
            return path
    raise SystemExit(
        f"no Chromium found (looked for {', '.join(CHROMIUM_NAMES)} on PATH); install it with your system's package "
        "manager, e.g. `apt-get update && apt-get install -y chromium`, or pass --chromium PATH"
    )


def screenshot(chromium: str, url: str, png: Path, profile: Path, height: int = HEIGHT, budget_ms: int = 15000) -> None:
    """Headless Chromium renders ``url`` into ``png`` after ``budget_ms`` of virtual time (the page's own timers)."""
    command = [
        chromium,
        "--headless=new",
        "--no-sandbox",  # as root in a container there is no user namespace for the sandbox
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        # A fresh throw-away profile per screenshot: no lock shared with a running browser, and no state kept from
        # the page before (MLflow's charts stayed loading when its run Overview had been opened in the same profile).
        f"--user-data-dir={tempfile.mkdtemp(prefix='chromium-', dir=profile)}",
        f"--window-size={WIDTH},{height}",
        f"--virtual-time-budget={budget_ms}",
        f"--screenshot={png}",
        url,
    ]
    if png.exists():
        png.unlink()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=SHOT_WAIT_S, check=False)
    if proc.returncode != 0 or not png.exists():
        raise RuntimeError(f"{chromium} failed ({proc.returncode}) on {url}:\n{proc.stderr[-3000:]}")
    print(f"  {png}  <-  {url}")


def png_size(png: Path) -> tuple[int, int]:
    """``(width, height)`` of a PNG, from its IHDR chunk (no imaging library needed)."""
    header = png.read_bytes()[:24]
    if header[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{png} is not a PNG file")
    width, height = struct.unpack(">II", header[16:24])
    return width, height


def images_tab_height(log_dir: Path, name: str) -> int:
    """A window height that shows the whole heatmap in the Images tab.

    The tab scales each image to its card's width (``IMAGE_CARD_WIDTH`` pixels), and a heatmap has one row per
    layer, so a deep model's is several times taller than wide; the window grows with it (at most ``MAX_HEIGHT``).
    """
    heatmaps = sorted(run_dir(log_dir, name).glob("*heatmap*.png"))
    if not heatmaps:
        return HEIGHT
    width, height = png_size(heatmaps[0])
    return max(HEIGHT, min(MAX_HEIGHT, IMAGES_TAB_TOP + IMAGE_CARD_WIDTH * height // width + 60))


def tensorboard_loaded(base: str, plugins: Sequence[str]) -> bool:
    """Whether TensorBoard has read the event files far enough that every one of ``plugins`` has data."""
    listing = get_json(f"{base}/data/plugins_listing")
    if not isinstance(listing, dict):
        return False
    return all(isinstance(listing.get(p), dict) and listing[p].get("enabled") for p in plugins)


def tensorboard_shots(
    log_dir: Path, name: str, shots: Sequence[tuple[Path, str, int]], chromium: str, profile: Path
) -> None:
    """Serve the run ``<log_dir>/<name>_tb`` with TensorBoard and screenshot each ``(png, tab, window height)``."""
    events = run_dir(log_dir, f"{name}_tb").parent
    port = free_port()
    # ?forceSVG=true: the charts are drawn as SVG in the page, not on an OffscreenCanvas in a worker, whose drawing
    # headless Chromium's virtual time does not wait for (lines were missing from some screenshots).
    base = f"http://127.0.0.1:{port}"
    # --logdir_spec NAME:PATH names the run after the example: "<name>/version_0" (with --logdir, "version_0").
    command = [str(Path(sys.executable).parent / "tensorboard"), "--logdir_spec", f"{name}:{events}"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    needed = ["scalars", "text", "images"] if name == SICK else ["scalars", "images"]
    log = log_dir / f"tensorboard_{name}.log"
    with server(command, log) as process:
        wait_for("tensorboard", lambda: tensorboard_loaded(base, needed), process, log)
        for png, tab, height in shots:
            screenshot(chromium, f"{base}/?forceSVG=true#{tab}", png, profile, height)


def find_mlflow(given: str | None) -> str | None:
    """An ``mlflow`` executable that has the web UI: ``given``, or the one next to this Python if its package does."""
    if given is not None:
        return given
    here = Path(sys.executable).parent / "mlflow"
    ui = subprocess.run(
        [sys.executable, "-c", "import flask, mlflow.server"], capture_output=True, text=True, check=False
    )
    if here.exists() and ui.returncode == 0:
        return str(here)
    return None


def mlflow_run_url(base: str, experiment: str) -> str | None:
    """The UI address of the latest run of ``experiment``, asked of the server's REST API."""
    query = urllib.parse.urlencode({"experiment_name": experiment})
    found = get_json(f"{base}/api/2.0/mlflow/experiments/get-by-name?{query}")
    if not isinstance(found, dict):
        return None
    experiment_id = found["experiment"]["experiment_id"]
    body = json.dumps({"experiment_ids": [experiment_id], "max_results": 1}).encode()
    request = urllib.request.Request(
        f"{base}/api/2.0/mlflow/runs/search", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        runs = json.loads(response.read().decode()).get("runs", [])
    if not runs:
        return None
    return f"{base}/#/experiments/{experiment_id}/runs/{runs[0]['info']['run_id']}"


def mlflow_shot(mlflow: str, log_dir: Path, png: Path, chromium: str, profile: Path) -> None:
    """Serve the example's MLflow file store with ``mlflow server`` and screenshot the dead block's run."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    store = (log_dir / "mlruns").resolve().as_uri()
    command = [mlflow, "server", "--backend-store-uri", store, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--workers", "1"]
    log = log_dir / "mlflow_server.log"
    env_var = "MLFLOW_ALLOW_FILE_STORE"
    # mlflow 3.7 and later refuse a file: store unless this is set (see docs/loggers.md).
    os.environ.setdefault(env_var, "true")
    with server(command, log) as process:
        wait_for(
            "mlflow server",
            lambda: get_json(f"{base}/api/2.0/mlflow/experiments/search?max_results=1") is not None,
            process,
            log,
        )
        url = mlflow_run_url(base, SICK)
        if url is None:
            raise RuntimeError(f"mlflow server at {base} has no run of the experiment {SICK}")
        # The run's Overview (the findings are tags ``layer_health.finding.NNNN``), and its Model metrics tab
        # (a chart section per key prefix, and the heatmaps).
        # The charts first: after the Overview (which lists all 1,000+ metrics) the one-worker server was still busy
        # when the charts asked for their histories, and they were caught loading.
        screenshot(chromium, f"{url}/model-metrics", png, profile)
        screenshot(chromium, url, png.with_name(f"{png.stem}_overview.png"), profile)


def main(argv: Sequence[str] | None = None) -> int:
    """Train, serve, screenshot; 0 when every screenshot was written (an error or exit status otherwise)."""
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where the PNGs go (default: docs/)")
    parser.add_argument("--log-dir", type=Path, help="keep the runs' logs here (default: a temporary folder)")
    parser.add_argument("--chromium", help=f"Chromium or Chrome executable (default: the first of {CHROMIUM_NAMES})")
    parser.add_argument(
        "--mlflow", help="an `mlflow` executable with the web UI (default: this Python's, if it has it)"
    )
    parser.add_argument("--no-mlflow", action="store_true", help="skip the MLflow screenshot")
    args = parser.parse_args(argv)
    chromium = find_chromium(args.chromium)
    mlflow = None if args.no_mlflow else find_mlflow(args.mlflow)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    with tempfile.TemporaryDirectory(prefix="hookdiag_shots_") as scratch:
        log_dir = (args.log_dir or Path(scratch) / "logs").resolve()
        log_dir.mkdir(parents=True, exist_ok=True)
        if any(log_dir.iterdir()):
            raise SystemExit(f"--log-dir {log_dir} is not empty: the runs must be the only ones there")
        profile = Path(scratch) / "chromium-profiles"
        profile.mkdir()
        started = time.monotonic()
        print(f"training {SICK} and its healthy twin into {log_dir} ...")
        train(log_dir)
        print(f"trained in {time.monotonic() - started:.0f} s; screenshots:")
        sick_shots = [
            (out / "tensorboard_dead_block.png", "timeseries", HEIGHT),
            (out / "tensorboard_dead_block_text.png", "text", HEIGHT),
            (out / "tensorboard_dead_block_images.png", "images", images_tab_height(log_dir, SICK)),
        ]
        tensorboard_shots(log_dir, SICK, sick_shots, chromium, profile)
        tensorboard_shots(
            log_dir, HEALTHY, [(out / "tensorboard_healthy.png", "timeseries", HEIGHT)], chromium, profile
        )
        if mlflow is None:
            print("no MLflow screenshot: no `mlflow` with the web UI (mlflow-skinny has none); see --mlflow")
        else:
            mlflow_shot(mlflow, log_dir, out / "mlflow_dead_block.png", chromium, profile)
        print(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
