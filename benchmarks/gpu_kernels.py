"""CUDA kernels per observed output and gradient, and syncs per step, of ``LayerHealthCallback`` (issue 27, item 8).

Method
------
Kernels: each model of ``overhead.py`` trains with a real Trainer, ``every_n_steps=2``, default statistics.
``tests/helpers/package_code.py`` runs every call of the package's code (its forward hooks, its output-gradient tensor
hooks, the callback's Lightning methods) inside a ``torch.profiler.record_function`` range named after what it is;
``torch.profiler`` records steps ``2..2+steps`` (steps 0 and 1, with their one-time caches, are not recorded). For
each kind of range, the kernels launched inside it are counted, as the profiler links them to the CPU op that
launched them (``FunctionEvent.kernels``, summed over the range's subtree), and, as a cross-check, the CUDA runtime
launch and copy calls made inside it (``cudaLaunchKernel``, ``cudaMemcpyAsync``, ...). Divided by the number of
ranges of that kind: kernels per observed output (forward hook), per output gradient (tensor hook), and per
sampled step for the callback's methods (parameter statistics, pooling, the transfer, the rules). The whole
window's kernels per step, with and without the callback, are reported too.

Syncs: the same fits under ``torch.cuda.set_sync_debug_mode("warn")``, counting the warnings raised per step,
with the callback minus without it, and the package lines (``file:line``) that raised them.

``--dry-run`` runs the same code paths on the CPU, where there are no kernels and no sync warnings: it reports the
top-level aten ops inside each range in place of kernels (what ``overhead.py --count-ops`` counts, less views) and
the package's host reads (``item``, ``tolist``, ``cpu``, ...) per step in place of syncs. It checks that the script
works on a machine without a GPU; its numbers are not kernel counts.

Usage::

    python benchmarks/gpu_kernels.py --json /tmp/gpu_kernels.json            # on a CUDA machine
    python benchmarks/gpu_kernels.py --dry-run --quick --models mlp          # on the CPU, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler import record_function

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import overhead  # noqa: E402
from helpers.package_code import PACKAGE_DIR, package_code  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from lightning_hookdiag import LayerHealthCallback  # noqa: E402

LABEL = "hookdiag"
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaMemsetAsync")
"""CUDA runtime calls that put work on the stream (kernel launches, copies and fills)."""
HOST_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


def _scope(kind: str) -> contextlib.AbstractContextManager:
    return record_function(f"{LABEL}:{kind}")


class _Window(Callback):
    """Starts ``prof`` at step ``first`` and stops it at step ``last`` (batch starts), so only those steps count."""

    def __init__(self, prof: Any, first: int, last: int) -> None:
        self.prof, self.first, self.last = prof, first, last
        self.step = -1

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.step = trainer.global_step
        if trainer.global_step == self.first:
            self.prof.start()
        elif trainer.global_step == self.last:
            self.prof.stop()


def _subtree(event: Any) -> Iterator[Any]:
    stack = [event]
    while stack:
        e = stack.pop()
        yield e
        stack.extend(e.cpu_children)


def _top_level_aten(event: Any) -> int:
    # aten ops directly under non-aten ranges: what Python dispatched (an op's own sub-ops are not launches of it).
    count, stack = 0, list(event.cpu_children)
    while stack:
        e = stack.pop()
        if e.name.startswith("aten::"):
            count += 0 if e.name in ("aten::detach", "aten::view", "aten::alias", "aten::empty") else 1
        else:
            stack.extend(e.cpu_children)
    return count


def _callback(fast_path: str) -> LayerHealthCallback:
    measure = {"fast_path": fast_path}
    return LayerHealthCallback(every_n_steps=2, on_anomaly="ignore", output={"summary": False}, measure=measure)


def count_kernels(spec: Any, device: str, steps: int, observed: bool, fast_path: str = "auto") -> dict[str, Any]:
    """Kernels (CUDA) or top-level aten ops (CPU) per range kind, per call, over ``steps`` steps from step 2.

    The fast path (``MeasureConfig.fast_path``) compiles at step 0's end and runs from step 2 on, the recorded steps.
    """
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    batch = overhead.batches_for(spec, 0, count=1)[0]
    task = overhead.Task(spec.build())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    prof = profile(activities=activities)
    window = _Window(prof, 2, 2 + steps)
    callback = _callback(fast_path) if observed else None
    callbacks = [window] + ([callback] if callback is not None else [])
    scoped = package_code(callback, _scope) if callback is not None else contextlib.nullcontext()
    with overhead.quiet(), scoped:
        overhead.fit(task, [batch], 2 + steps + 1, callbacks)
    events = prof.events()
    per_kind: dict[str, Counter[str]] = defaultdict(Counter)
    for e in events:
        if not e.name.startswith(f"{LABEL}:") or (e.cpu_parent is not None and _inside(e.cpu_parent)):
            continue  # an outer range of ours counts what is nested in it
        kind = e.name.split(":", 1)[1]
        c = per_kind[kind]
        c["calls"] += 1
        for sub in _subtree(e):
            c["kernels"] += len(sub.kernels)
            c["launches"] += sub.name in LAUNCHES
        c["aten_ops"] += _top_level_aten(e)
    totals = Counter()
    for e in events:
        totals["kernels"] += len(e.kernels)
        totals["launches"] += e.name in LAUNCHES
        totals["aten_ops"] += e.cpu_parent is None and e.name.startswith("aten::")
    out: dict[str, Any] = {"steps": steps, "window": {k: v / steps for k, v in totals.items()}}
    sampled = len(range(2, 2 + steps, 2))
    for kind, c in per_kind.items():
        out[kind] = {"calls_per_step": c["calls"] / steps, "calls_per_sampled_step": c["calls"] / sampled}
        out[kind].update({k: c[k] / c["calls"] for k in ("kernels", "launches", "aten_ops")})
        out[kind]["per_step"] = {k: c[k] / steps for k in ("kernels", "launches", "aten_ops")}
    return out


def _inside(event: Any) -> bool:
    while event is not None:
        if event.name.startswith(f"{LABEL}:"):
            return True
        event = event.cpu_parent
    return False


class _Syncs(Callback):
    """Per step: sync warnings (CUDA) or the package's host reads (CPU), and the package lines behind them."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.per_step: dict[int, int] = {}
        self.lines: Counter[str] = Counter()
        self._caught: list[Any] = []
        self._catch: Any = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.step = trainer.global_step
        self._catch = warnings.catch_warnings(record=True)
        self._caught = self._catch.__enter__()
        warnings.simplefilter("always")
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")

    def end(self) -> None:
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(None, None, None)
        syncs = [w for w in self._caught if "synchroniz" in str(w.message) or "host read" in str(w.message)]
        self.per_step[self.step] = self.per_step.get(self.step, 0) + len(syncs)
        for w in syncs:
            if str(Path(w.filename).resolve()).startswith(PACKAGE_DIR):
                self.lines[f"{Path(w.filename).name}:{w.lineno}"] += 1


@contextlib.contextmanager
def _host_reads_as_warnings() -> Iterator[None]:
    # On the CPU there is no sync to warn about: the package's host reads stand in for them, warned at the caller.
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def wrap(name: str, original: Any) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            warnings.warn(f"host read: Tensor.{name}", UserWarning, stacklevel=2)
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def count_syncs(spec: Any, device: str, steps: int, observed: bool, fast_path: str = "auto") -> _Syncs:
    """Sync warnings (or host reads) per step over ``2 + steps`` steps, sampled every other step."""
    torch.manual_seed(0)
    batch = overhead.batches_for(spec, 0, count=1)[0]
    task = overhead.Task(spec.build())
    watch = _Syncs(device)

    class Last(Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, b: Any, batch_idx: int) -> None:
            watch.end()

    callback = _callback(fast_path) if observed else None
    callbacks = [watch, *([callback] if callback is not None else []), Last()]
    reads = _host_reads_as_warnings() if device == "cpu" else contextlib.nullcontext()
    with overhead.quiet(), reads:
        overhead.fit(task, [batch], 2 + steps, callbacks)
    return watch


def run(models: list[str], device: str, steps: int, quick: bool, fast_path: str = "auto") -> dict[str, Any]:
    """Kernels and syncs of every model in ``models``; prints one line per model."""
    specs = overhead.model_specs(quick)
    overhead.TRAINER_DEVICE.update(accelerator="gpu" if device == "cuda" else "cpu", precision="32-true")
    unit = "kernels" if device == "cuda" else "aten_ops"
    results: dict[str, Any] = {}
    for model in models:
        spec = specs[model]
        kernels = count_kernels(spec, device, steps, observed=True, fast_path=fast_path)
        plain = count_kernels(spec, device, steps, observed=False)
        syncs = count_syncs(spec, device, steps, observed=True, fast_path=fast_path)
        plain_syncs = count_syncs(spec, device, steps, observed=False)
        added = {s: syncs.per_step[s] - plain_syncs.per_step.get(s, 0) for s in syncs.per_step}
        results[model] = {
            "description": spec.description,
            "kernels": kernels,
            "plain_window": plain["window"],
            "syncs_added_per_step": added,
            "sync_lines": dict(syncs.lines.most_common(20)),
        }
        out, grad = kernels.get("hook:output", {}), kernels.get("hook:grad", {})
        cb = kernels.get("callback", {})
        sampled = [v for s, v in added.items() if s % 2 == 0 and s >= 2]
        per = "calls_per_sampled_step"
        print(
            f"{model:<12} {unit} per observed output {out.get(unit, 0):6.1f} (x{out.get(per, 0):.0f}"
            f" per sampled step), per gradient {grad.get(unit, 0):6.1f} (x{grad.get(per, 0):.0f}),"
            f" callback methods {cb.get('per_step', {}).get(unit, 0):6.1f} per step (sampled or not);"
            f" {'syncs' if device == 'cuda' else 'host reads'} added per sampled step {sampled},"
            f" per step {added}",
            flush=True,
        )
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,cnn,transformer,mlp48", help="comma-separated overhead.py models")
    p.add_argument("--steps", type=int, default=4, help="recorded steps (from step 2; every other one sampled)")
    p.add_argument("--dry-run", action="store_true", help="on the CPU: aten ops for kernels, host reads for syncs")
    p.add_argument("--quick", action="store_true", help="the tiny models of overhead.py --quick")
    p.add_argument("--json", default=None, help="where to write the results")
    p.add_argument("--fast-path", choices=("auto", "on", "off"), default="auto", help="MeasureConfig.fast_path")
    args = p.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: run with --dry-run to check the script on the CPU")
    models = args.models.split(",")
    bad = [m for m in models if m not in overhead.MODELS]
    if bad:
        p.error(f"--models: {', '.join(bad)} not in {', '.join(overhead.MODELS)}")
    results = {
        "device": device,
        "machine": overhead.machine_info(),
        "fast_path": args.fast_path,
        "results": run(models, device, args.steps, args.quick, args.fast_path),
    }
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return results


if __name__ == "__main__":
    main()
