"""The one-pass fast path (issue 39 item 1) against today's per-piece path, per tensor, side by side.

Method: one thread. ``onepass_path`` says which path ``OnePass`` took. For each size (64 K - 16 M elements, or
``--sizes``), dtype (float32, bf16) and kind (an output, an output with per-unit maxima, a
gradient), both paths reduce the same tensor into a row the way the recorder asks for it
(``lightning_hookdiag._stats.reduce_tensor`` vs ``OnePass.reduce_tensor``), interleaved: each round times both, in
alternating order, as the best of ``--reps`` calls; the figure is the median over ``--rounds`` rounds.

Also measured, each in a fresh process:

* compile time of ``OnePass.warm`` (float32 and bf16: 8 graphs): cold (empty inductor cache) and warm (cache filled);
* peak extra resident memory of one call on a 16 M-element float32 tensor (64 MiB), per path (``ru_maxrss``);
* the numeric contract without a shift: the error of ``act_std`` at a mean 1e4 times the spread with ``shift=0``.

Usage::

    python benchmarks/onepass.py [--rounds 5] [--reps 3] [--out benchmarks/results_onepass.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lightning_hookdiag import _stats as S
from lightning_hookdiag._onepass import OnePass

SIZES = [1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24]
KINDS = {"output": (False, False), "output+units": (False, True), "gradient": (True, False)}


def _shape(n: int, units: bool) -> tuple[int, ...]:
    return (n // 512, 512) if units else (n,)


class _Rows:
    """Rows per call, reused: what the recorder's call table hands out."""

    def __init__(self, width: int = S.ACT_ROW) -> None:
        self.table = torch.empty(128, width, dtype=torch.float64)

    def __call__(self, sizes: list[int]) -> torch.Tensor:
        return self.table[: len(sizes)]


def _best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def speed(rounds: int, reps: int, sizes: list[int]) -> list[dict]:
    fast = OnePass(min_elements=min(sizes))  # every size on the fast path, to price it at the smallest too
    fast.warm()
    workspace = S.Workspace()
    results = []
    for n in sizes:
        for dtype in (torch.float32, torch.bfloat16):
            for kind, (grad, units) in KINDS.items():
                x = (torch.randn(_shape(n, units)) * 2 + 3).to(dtype)
                rows = _Rows(S.GRAD_ROW if grad else S.ACT_ROW)

                def today(x=x, grad=grad, units=units, rows=rows):
                    S.reduce_tensor(x, rows(S.piece_sizes(x)), workspace, grad, units)

                def one_pass(x=x, grad=grad, units=units, rows=rows):
                    fast.reduce_tensor(x, rows, workspace, grad, units, shift=3.0)

                today()
                seen = dict(fast.paths)
                one_pass()
                path = next(k for k, v in fast.paths.items() if v != seen.get(k, 0))
                pairs = []
                for r in range(rounds):
                    order = [today, one_pass] if r % 2 else [one_pass, today]
                    timed = {f: _best(f, reps) for f in order}
                    pairs.append((timed[today], timed[one_pass]))
                t_today = statistics.median(p[0] for p in pairs)
                t_fast = statistics.median(p[1] for p in pairs)
                ratios = [p[1] / p[0] for p in pairs]
                results.append(
                    {
                        "elements": n,
                        "dtype": str(dtype).removeprefix("torch."),
                        "kind": kind,
                        "onepass_path": path,
                        "today_ms": round(t_today * 1e3, 3),
                        "fast_ms": round(t_fast * 1e3, 3),
                        "ratio_median": round(statistics.median(ratios), 3),
                        "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
                    }
                )
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    workspace.release()
    return results


def _child(mode: str, rounds: int, reps: int, sizes: list[int]) -> dict:
    """One measurement in this (fresh) process: ``warm``, ``memory-fast`` or ``memory-today``."""  # noqa: D401
    torch.set_num_threads(1)
    if mode == "speed":
        return {"contract_without_shift": contract_without_shift(), "speed": speed(rounds, reps, sizes)}
    fast = OnePass()
    if mode == "warm":
        return {"warm_s": fast.warm()}
    fast.warm([torch.float32])
    x = torch.randn(1 << 24)
    workspace, rows, grad_rows = S.Workspace(), _Rows(), _Rows(S.GRAD_ROW)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if mode == "memory-fast":
        fast.reduce_tensor(x, rows, workspace, units=False, shift=0.0)
        fast.reduce_tensor(x.view(-1, 512), rows, workspace, units=True, shift=0.0)
        fast.reduce_tensor(x, grad_rows, workspace, grad=True)
    else:
        S.reduce_tensor(x, rows(S.piece_sizes(x)), workspace)
        S.reduce_tensor(x.view(-1, 512), rows(S.piece_sizes(x)), workspace, units=True)
        S.reduce_tensor(x, grad_rows(S.piece_sizes(x)), workspace, grad=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_extra_mib": round((peak - before) / 1024, 2), "input_mib": 64}


def _run_child(mode: str, cache: str, *extra: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    command = [sys.executable, __file__, "--child", mode, *extra]
    out = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True)  # progress on stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def contract_without_shift() -> dict:
    fast = OnePass()
    fast.warm([torch.float32])
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1 << 22, dtype=torch.float64, generator=g) + 1e4).float()
    reference = x.double().std(correction=0).item()
    errors = {}
    for label, shift in (("shift=0", 0.0), ("shift=pooled mean", 1e4 + 0.37)):
        rows = _Rows()
        fast.reduce_tensor(x, rows, S.Workspace(), shift=shift)
        row = rows.table[0]
        moments, absmax = S.moments_from_rows(row[None], torch.tensor([float(x.numel())], dtype=torch.float64))
        std = S.finalize_activations(moments, absmax)["act_std"].item()
        errors[label] = abs(std - reference) / reference
    return {"elements": x.numel(), "mean_over_spread": 1e4, "act_std_relative_error": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results_onepass.json"))
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated element counts")
    parser.add_argument("--child", choices=["warm", "memory-fast", "memory-today", "speed"])
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    if args.child:
        print(json.dumps(_child(args.child, args.rounds, args.reps, sizes)))
        return
    torch.set_num_threads(1)
    result: dict = {"threads": 1, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as cache:
        result["compile_cold"] = _run_child("warm", cache)
        result["compile_warm"] = _run_child("warm", cache)
        result["memory_today"] = _run_child("memory-today", cache)
        result["memory_fast"] = _run_child("memory-fast", cache)
        print(json.dumps(result), flush=True)
        # In the fresh cache that warm() filled: inductor's cache serves code generated for the sizes of whichever
        # compile came first, and the loop order it picked for other sizes can be several times slower.
        timing = ["--rounds", str(args.rounds), "--reps", str(args.reps), "--sizes", args.sizes]
        result.update(_run_child("speed", cache, *timing))
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
