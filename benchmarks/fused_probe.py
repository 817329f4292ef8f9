"""What one fused, compiled pass per tensor would buy on the sampled step: evidence for a design decision.

The host path reduces an output larger than ``SMALL_TENSOR`` in four or five torch passes
(:func:`lightning_hookdiag.stats.host_activation_moments`) and a gradient in one or more
(:func:`~lightning_hookdiag.stats.host_gradient_moments`). The alternative is a kernel that reads each value once and
accumulates the zero count, sum, sum of squares, minimum and maximum together in float64: ``torch.compile``
(inductor's C++ backend) of a few lines. This probe swaps both host reductions for such a kernel inside real training
(the Trainer, models and batches of ``overhead.py``), with blocks of ``plain``, ``every_step`` and ``every_step``
with the swap interleaved, and reports each one's median step time and the kernel's compile time.

The swap is a probe, not a design: it is exact where the shipped path is (float64 sums) but drops its guard for a
mean far larger than the spread (the shipped path centres before squaring) and needs a C++ compiler at run time.
Outputs and gradients of at most ``SMALL_TENSOR`` elements are batched at the flush and never reach either function,
so on ``mlp48`` the swap changes nothing but its own call overhead: ``gpt2`` is the model it is about.

Usage::

    python benchmarks/fused_probe.py --models gpt2 --rounds 4 --json benchmarks/results_fused_probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead as O  # noqa: E402  (the benchmark's models, Trainer and timer)

from lightning_hookdiag import stats as S  # noqa: E402


def _one_pass(flat: Tensor) -> Tensor:
    wide = flat.to(torch.float64)
    return torch.stack([(flat != 0).sum().to(torch.float64), wide.sum(), (wide * wide).sum(), wide.amax(), wide.amin()])


def _square(flat: Tensor) -> Tensor:
    wide = flat.to(torch.float64)
    return (wide * wide).sum()


_fused = torch.compile(_one_pass, dynamic=True)
_fused_square = torch.compile(_square, dynamic=True)


def fused_activation_moments(x: Tensor, workspace: S.Workspace | None = None) -> tuple[list[float], float] | None:
    """:func:`~lightning_hookdiag.stats.host_activation_moments` in one compiled pass; ``None`` for NaN/Inf."""
    flat = x.detach().reshape(-1)  # always 1-D: one compiled kernel per dtype, whatever the output's rank
    if not flat.numel() or flat.dtype not in (torch.float32, torch.float64):
        return _shipped_activation(x, workspace)
    nonzero, total, square, hi, lo = _fused(flat).tolist()
    absmax = max(hi, -lo)
    if not (math.isfinite(absmax) and math.isfinite(square)):
        return None
    return [float(flat.numel()), nonzero, nonzero, total, square], absmax


def fused_gradient_moments(g: Tensor, workspace: S.Workspace | None = None) -> list[float] | None:
    """:func:`~lightning_hookdiag.stats.host_gradient_moments` from the same compiled pass."""
    flat = g.detach().reshape(-1)
    if not flat.numel() or flat.dtype not in (torch.float32, torch.float64):
        return _shipped_gradient(g, workspace)
    square = _fused_square(flat).item()
    return [float(flat.numel()), square, 0.0] if math.isfinite(square) else None


_shipped_activation = S.host_activation_moments
_shipped_gradient = S.host_gradient_moments


@contextlib.contextmanager
def swapped() -> Iterator[None]:
    """The fused reductions in place of the shipped ones (the sinks look them up on the module at each call)."""
    S.host_activation_moments, S.host_gradient_moments = fused_activation_moments, fused_gradient_moments
    try:
        yield
    finally:
        S.host_activation_moments, S.host_gradient_moments = _shipped_activation, _shipped_gradient


def compile_seconds() -> float:
    """Wall time of the first calls, float32 then float64 (the compile; inductor's cache may shorten it)."""
    t0 = time.perf_counter()
    for dtype in (torch.float32, torch.float64):
        for n in (4097, 40961):  # a second size: dynamic shapes compile once
            _fused(torch.randn(n, dtype=dtype))
            _fused_square(torch.randn(n, dtype=dtype))
    return time.perf_counter() - t0


def check_agreement() -> float:
    """Largest relative difference of the swapped activation moments from the shipped ones on random tensors."""
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for n in (32768, 131072, 524288):
        x = torch.randn(n, generator=g) * 3.0 + 0.5
        shipped, fused = _shipped_activation(x), fused_activation_moments(x)
        assert shipped is not None
        assert fused is not None
        for a, b in zip([*shipped[0], shipped[1]], [*fused[0], fused[1]], strict=True):
            worst = max(worst, abs(a - b) / max(abs(a), 1e-300))
    return worst


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt2", help="comma-separated, from overhead.MODELS")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    seconds = compile_seconds()
    worst = check_agreement()
    print(f"compile: {seconds:.1f} s; largest relative difference from the shipped moments: {worst:.1e}")
    specs = O.model_specs(quick=False)
    variants = ("plain", "every_step", "every_step_fused")
    walls: dict[str, dict[str, list[float]]] = {m: {v: [] for v in variants} for m in args.models.split(",")}
    with O.quiet():
        for r in range(args.rounds):
            for model, by_variant in walls.items():
                spec = specs[model]
                batches = O.batches_for(spec, 0)
                for variant in variants[r % 3 :] + variants[: r % 3]:  # rotated: no variant always runs first
                    swap = swapped() if variant == "every_step_fused" else contextlib.nullcontext()
                    with swap:
                        times, _ = O.run_block(
                            spec, batches, variant.removesuffix("_fused"), args.steps, args.warmup, 0
                        )
                    by_variant[variant] += [t.wall for t in times]
            print(f"round {r + 1}/{args.rounds} done")
    results: dict = {"compile_s": seconds, "largest_relative_difference": worst, "models": {}}
    for model, by_variant in walls.items():
        plain = statistics.median(by_variant["plain"])
        row = {
            v: {"median_ms": statistics.median(w) * 1e3, "x_plain": statistics.median(w) / plain}
            for v, w in by_variant.items()
        }
        results["models"][model] = row
        for v, summary in row.items():
            print(f"{model:8s} {v:18s} {summary['median_ms']:7.2f} ms  {summary['x_plain']:.3f} x plain")
    results["machine"] = O.machine_info()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
