"""Cost of what the callback writes besides scalars: findings and heatmap images, per call, on this CPU.

Run: ``PYTHONPATH=$PWD python benchmarks/logger_output.py`` (CSV and TensorBoard; medians of 20 calls).
"""

import os
import statistics
import tempfile
import time

os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
import numpy as np
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_hookdiag._heatmap_image import render
from lightning_hookdiag._publish import FindingsWriter, write_image
from lightning_hookdiag.rules._findings import Finding

tmp = tempfile.mkdtemp()
rng = np.random.default_rng(0)
for rows, cols in ((97, 10), (97, 256)):
    matrix = rng.lognormal(size=(rows, cols)).tolist()
    t = []
    for _ in range(20):
        s = time.perf_counter()
        img = render(matrix, cell=max(4, min(32, 384 // max(rows, cols))))
        t.append(time.perf_counter() - s)
    print(f"render {rows}x{cols}: {statistics.median(t) * 1e3:.2f} ms, image {img.shape}")
    for name, logger in (
        ("csv", CSVLogger(tmp, name=f"c{cols}")),
        ("tensorboard", TensorBoardLogger(tmp, name=f"t{cols}")),
    ):
        t = []
        for step in range(20):
            s = time.perf_counter()
            write_image([logger], "layer_health_heatmap/act_std", img, step)
            t.append(time.perf_counter() - s)
        print(f"  write_image {name}: {statistics.median(t) * 1e3:.2f} ms")
f = Finding(
    "dead_units", "net.61", 0, 1.0, 0.9, "dead_units: 100% of the units of net.61 ...", "forward", "act_dead_frac"
)
for name, logger in (("csv", CSVLogger(tmp, name="fc")), ("tensorboard", TensorBoardLogger(tmp, name="ft"))):
    w, t = FindingsWriter(), []
    for step in range(20):
        s = time.perf_counter()
        w.write([logger], step, [f, f, f], [])
        t.append(time.perf_counter() - s)
    print(f"write 3 findings {name}: {statistics.median(t) * 1e3:.3f} ms")
