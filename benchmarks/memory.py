"""Peak memory of one training step, plain against a sampled step of ``LayerHealthCallback`` (issue 27).

Method
------
Each run of a (model, variant) pair is a fresh Python process, so that no allocator state, cached buffer or page
one run touched is seen by the next; each pair runs ``--repeats`` times (default 3), the variants interleaved, and
the median of each number is reported, with every run's peak (a fresh process's peak moves by several MiB). The
process builds the model, then trains exactly one step with a real ``lightning.pytorch.Trainer`` (``max_steps=1``,
``limit_train_batches=1``, ``logger=False``, no checkpointing, no progress bar). Two probe callbacks bracket the
step: the first in the callback list marks its start in ``on_train_batch_start``, the last in the list marks its end
in ``on_train_batch_end`` (after the optimizer step and after the measured callback's own logging, pooling and host
transfer). The number reported is the increase of the
step's peak over the state right before it:

* CPU: peak resident memory. At the start the kernel's high-water mark is reset (``echo 5 >
  /proc/self/clear_refs``) and ``VmRSS`` is read; at the end ``VmHWM`` is read. Peak = ``VmHWM - VmRSS(start)``.
* CUDA (``--device cuda``): ``torch.cuda.reset_peak_memory_stats()`` and ``memory_allocated()`` at the start,
  ``max_memory_allocated()`` at the end (what the tensors take, not what the caching allocator reserves).

``retained`` is what is still held at the end of the step over its start (resident memory or allocated bytes).

Models (the issue's two):

* ``lm_head``: ``Embedding(32000, 128)`` then ``Linear(128, 32000)``; tokens ``[4, 512]``, so the logits are
  ``4 x 512 x 32000`` float32 (250 MiB); cross-entropy over the vocabulary.
* ``big``: ``Embedding(32000, 4096)``, 4 x (``Linear(4096, 4096)`` + ``ReLU``), ``Linear(4096, 32000)``: 329 M
  parameters (1256 MiB of float32 weights); tokens ``[4, 16]``, so activations are small next to the weights.

The optimizer is plain SGD (no momentum, ``lr=1e-3``): it keeps no state, so a plain step's peak is its gradients
and activations, which is what the issue's plain peaks (+768 MB, +1290 MB) are. Adam would add two weight-sized
buffers on the first step (+2.5 GiB on ``big``) in every variant alike and hide nothing, but it would not fit the
issue's numbers.

Variants:

* ``plain``: no diagnostics callback;
* ``callback``: ``LayerHealthCallback(every_n_steps=1)``: default statistics, every leaf layer, step 0 sampled;
* ``tutorial``: ``overhead.TutorialCallback``: a forward hook per leaf layer storing ``output.std().item()``, a full
  backward hook storing ``grad_output[0].norm().item()`` and the gradient norm of every parameter (as in the
  issue's table and in ``overhead.py``).

Usage::

    python benchmarks/memory.py                      # both models, CPU, writes benchmarks/results_memory.json
    python benchmarks/memory.py --device cuda        # the same on a CUDA device (max_memory_allocated)
    python benchmarks/memory.py --quick              # tiny models: checks that the script works (seconds)
    python benchmarks/memory.py --models lm_head --precision bf16-mixed --device cuda
    python benchmarks/memory.py --step 1             # a later sampled step: the reused buffers are held before it
    python benchmarks/memory.py --repeats 5          # 5 processes per variant (default 3), medians reported
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MIB = 2**20
MODELS = ("lm_head", "big")
VARIANTS = ("plain", "callback", "tutorial")


@dataclass(frozen=True)
class Spec:
    """One of the measured models: its sizes and what its peak is compared against."""

    vocab: int
    width: int
    depth: int
    batch: int
    seq: int

    def build(self) -> Any:
        import torch
        from torch import nn

        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Embedding(self.vocab, self.width)]
        for _ in range(self.depth):
            layers += [nn.Linear(self.width, self.width), nn.ReLU()]
        layers.append(nn.Linear(self.width, self.vocab))
        return nn.Sequential(*layers)

    def batch_tensors(self) -> tuple[Any, Any]:
        import torch

        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.vocab, (self.batch, self.seq), generator=g)
        targets = torch.randint(0, self.vocab, (self.batch, self.seq), generator=g)
        return tokens, targets

    @property
    def logits_bytes(self) -> int:
        return self.batch * self.seq * self.vocab * 4

    @property
    def params(self) -> int:
        return 2 * self.vocab * self.width + self.depth * (self.width + 1) * self.width + self.vocab

    def describe(self) -> str:
        body = f"Embedding({self.vocab}, {self.width})"
        if self.depth:
            body += f", {self.depth} x (Linear({self.width}) + ReLU)"
        return f"{body}, Linear({self.width}, {self.vocab}); tokens [{self.batch}, {self.seq}]"


SPECS = {
    "lm_head": Spec(vocab=32000, width=128, depth=0, batch=4, seq=512),
    "big": Spec(vocab=32000, width=4096, depth=4, batch=4, seq=16),
}
QUICK_SPECS = {
    "lm_head": Spec(vocab=2000, width=32, depth=0, batch=2, seq=256),
    "big": Spec(vocab=2000, width=256, depth=2, batch=2, seq=8),
}


# --------------------------------------------------------------------------------------------------- the worker
def _status(*keys: str) -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+) kB", text).group(1)) * 1024 for k in keys}  # type: ignore[union-attr]


class _Meter:
    """Reads the memory state at the step's start and its peak at the end, on the CPU or on a CUDA device."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.start = 0
        self.peak = 0
        self.end = 0

    def mark_start(self) -> None:
        import torch

        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
            return
        # Resets VmHWM to the current resident size (Linux >= 4.0), so the mark at the end is this step's peak.
        Path("/proc/self/clear_refs").write_text("5")
        self.start = _status("VmRSS")["VmRSS"]

    def mark_end(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
            self.end = torch.cuda.memory_allocated()
            return
        status = _status("VmRSS", "VmHWM")
        self.peak, self.end = status["VmHWM"], status["VmRSS"]


def _probes(meter: _Meter, step: int = 0) -> tuple[Any, Any]:
    from lightning.pytorch import Callback

    class Start(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == step:
                meter.mark_start()

    class End(Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == step:
                meter.mark_end()

    return Start(), End()


def make_callback(variant: str) -> Any:
    """The diagnostics callback of ``variant`` (``None`` for ``plain``)."""
    if variant == "plain":
        return None
    if variant == "callback":
        from lightning_hookdiag import LayerHealthCallback

        return LayerHealthCallback(every_n_steps=1, output={"summary": False})
    if variant == "tutorial":
        sys.path.insert(0, str(HERE))
        import overhead

        return overhead.TutorialCallback()
    raise ValueError(f"variant: {variant!r} is not one of {', '.join(VARIANTS)}")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    lightning_logger = logging.getLogger("lightning.pytorch")
    level = lightning_logger.level
    lightning_logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        # Lightning's advice about a one-batch run and the rules' findings on a random-init model are not measured.
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            lightning_logger.setLevel(level)


def measure(spec: Spec, variant: str, device: str = "cpu", precision: str = "32-true", step: int = 0) -> dict[str, Any]:
    """Peak and retained memory of training step ``step`` of ``spec`` under ``variant`` in this process (bytes).

    ``step`` > 0 trains that many steps first (each one sampled): what the callback keeps across sampled steps (its
    reused buffers) is then in the state before the measured step, not in its peak; ``start`` tells it.
    """
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F  # noqa: N812
    from torch.utils.data import DataLoader

    net = spec.build()
    batch = spec.batch_tensors()

    class Task(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, b: Any, batch_idx: int) -> Any:
            tokens, targets = b
            logits = self.net(tokens)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            return DataLoader([batch] * (step + 1), batch_size=None)

    meter = _Meter(device)
    start, end = _probes(meter, step)
    extra = make_callback(variant)
    callbacks = [start, *([extra] if extra is not None else []), end]
    trainer = pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        precision=precision,
        max_steps=step + 1,
        limit_train_batches=step + 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    t0 = time.perf_counter()
    with _quiet():
        trainer.fit(Task())
    if getattr(extra, "last_step", 0) is None:
        raise RuntimeError("the callback did not sample step 0: nothing was measured")
    return {
        "peak": meter.peak - meter.start,
        "retained": meter.end - meter.start,
        "start": meter.start,
        "seconds": time.perf_counter() - t0,
    }


# ------------------------------------------------------------------------------------------------------ driving
def run_worker(
    model: str, variant: str, device: str, precision: str, quick: bool, timeout: float, step: int = 0
) -> dict[str, Any]:
    """:func:`measure` in a fresh process; its result (bytes) or ``{"error": ...}``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", model, variant, "--device", device]
    cmd += ["--precision", precision, "--step", str(step)] + (["--quick"] if quick else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-2000:]}"}
    return json.loads(lines[-1])


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's runs as one result: the median of each number, with every run's peak kept (``peaks``).

    A process's peak resident memory moves by several MiB from one fresh process to the next (glibc's heap, the
    kernel's pages), so one run per variant can put a plain step's noise into the callback's extra; the median of
    a few interleaved runs does not.
    """
    errors = [r for r in runs if "error" in r]
    if errors:
        return errors[0]
    merged: dict[str, Any] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    merged["peaks"] = [r["peak"] for r in runs]
    return merged


def _row(spec: Spec, model: str, per_variant: dict[str, dict[str, Any]]) -> dict[str, Any]:
    plain = per_variant.get("plain", {}).get("peak")
    out: dict[str, Any] = {"model": spec.describe(), "params": spec.params, "logits_bytes": spec.logits_bytes}
    out["reference"] = "logits" if model == "lm_head" else "weights"
    out["reference_bytes"] = spec.logits_bytes if model == "lm_head" else 4 * spec.params
    for variant, r in per_variant.items():
        out[variant] = r
        if plain is not None and "peak" in r and variant != "plain":
            r["extra"] = r["peak"] - plain
            r["extra_over_reference"] = r["extra"] / out["reference_bytes"]
    return out


def format_table(results: dict[str, dict[str, Any]], device: str) -> str:
    """A markdown table of the results (MiB)."""
    what = "peak resident memory" if device == "cpu" else "max_memory_allocated"
    lines = [
        f"| model ({what}, over the state before the step) | plain step | with the callback | extra |"
        " extra / reference | tutorial's hooks (extra) | retained after the step: callback / plain |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def mib(v: float | None) -> str:
        return "n/a" if v is None else f"{v / MIB:+.0f} MiB"

    for model, row in results.items():
        plain, cb, tut = (row.get(v, {}) for v in ("plain", "callback", "tutorial"))
        if any("error" in r for r in (plain, cb, tut)):
            errors = "; ".join(f"{v}: {row[v]['error'][-200:]}" for v in VARIANTS if "error" in row.get(v, {}))
            lines.append(f"| {model} | {errors} | | | | | |")
            continue
        ratio = cb.get("extra_over_reference")
        share = "n/a" if ratio is None else f"{ratio:.2f} x the {row['reference']}"
        lines.append(
            f"| {model}: {row['model']} | {mib(plain.get('peak'))} | {mib(cb.get('peak'))} | {mib(cb.get('extra'))}"
            f" | {share} | {mib(tut.get('extra'))}"
            f" | {mib(cb.get('retained'))} / {mib(plain.get('retained'))} |"
        )
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}
    info["platform"] = platform.platform()
    with contextlib.suppress(OSError):
        total = re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())
        info["memory_gib"] = round(int(total.group(1)) / 2**20, 1) if total else None
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE, check=False
        ).stdout.strip()
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", default="32-true", help="Trainer precision, e.g. bf16-mixed (CUDA)")
    p.add_argument("--quick", action="store_true", help="tiny models: a check that the script runs")
    p.add_argument("--json", default=str(HERE / "results_memory.json"), help="where to write the results")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per worker process")
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--step", type=int, default=0, help="measure this step (earlier ones sampled too): 1 = a later one")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per variant, interleaved; medians reported")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats: at least 1 process per variant; got {args.repeats}")
    if args.step < 0:
        p.error(f"--step: the step to measure, 0 or later; got {args.step}")
    for name, valid in (("models", MODELS), ("variants", VARIANTS)):
        chosen = getattr(args, name).split(",")
        bad = [c for c in chosen if c not in valid]
        if bad:
            p.error(f"--{name}: {', '.join(bad)} not in {', '.join(valid)}")
        setattr(args, name, chosen)
    return args


def main(argv: list[str] | None = None, run: Callable[..., dict[str, Any]] = run_worker) -> dict[str, Any]:
    args = parse_args(argv)
    specs = QUICK_SPECS if args.quick else SPECS
    if args.worker:
        model, variant = args.worker
        print(json.dumps(measure(specs[model], variant, args.device, args.precision, args.step)))
        return {}
    results: dict[str, dict[str, Any]] = {}
    for model in args.models:
        runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in args.variants}
        for _ in range(args.repeats):  # interleaved: drift in the machine's state hits every variant alike
            for variant in args.variants:
                later = {"step": args.step} if args.step else {}
                result = run(model, variant, args.device, args.precision, args.quick, args.timeout, **later)
                runs[variant].append(result)
                print(f"  {model} {variant}: {result}", file=sys.stderr, flush=True)
        results[model] = _row(specs[model], model, {v: _median(r) for v, r in runs.items()})
    table = format_table(results, args.device)
    print(table)
    written = {
        "device": args.device,
        "precision": args.precision,
        "step": args.step,
        "quick": args.quick,
        "unit": "bytes",
        "method": "fresh process per run, variants interleaved, medians over --repeats runs; one Trainer step; peak"
        " over the state right before the step",
        "repeats": args.repeats,
        "optimizer": "SGD, no momentum (no optimizer state)",
        "machine": machine_info(),
        "results": results,
        "table": table,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(written, indent=2) + "\n")
    return written


if __name__ == "__main__":
    main()
