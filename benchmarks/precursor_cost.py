"""Incremental cost of the precursor probes (``attn_logit_max``, ``logit_lse_mean``, ``logit_absmax``) on one step.

The Trainer-level benchmark (``overhead.py --variants plain,every_step,precursors``) compares whole blocks of steps,
which on a shared, loaded machine resolves a few percent at best. This script prices the probes alone, inside the
same plain training loop (forward, loss, backward, Adam step) of an ``overhead.py`` model: steps with and without
the probes attached alternate, and each step is timed by the process's CPU time (``time.process_time``), which
other jobs on the machine do not inflate the way they inflate wall time. The extra time of a probed step divided by
``every_n_steps`` (50, the callback's default) and by the plain step time is the amortised cost.

Usage::

    python benchmarks/precursor_cost.py --model transformer                  # all three statistics
    python benchmarks/precursor_cost.py --model gpt2 --stats attn_logit_max  # one family
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402

from lightning_hookdiag._aggregation import LayerStatsAggregator  # noqa: E402
from lightning_hookdiag._precursor_probes import PrecursorProbes, attention_scope  # noqa: E402
from lightning_hookdiag._selection import named_modules, resolve_layers  # noqa: E402
from lightning_hookdiag._vocabulary import PRECURSOR_STATS  # noqa: E402
from lightning_hookdiag.components import WindowStart  # noqa: E402


def measure(model_name: str, stats: list[str], pairs: int, every: int = 50, quick: bool = False) -> dict[str, float]:
    """Median CPU milliseconds of a plain and of a probed step, and the amortised cost in percent."""
    spec = overhead.model_specs(quick)[model_name]
    torch.manual_seed(0)
    model = spec.build()
    optimizer = torch.optim.Adam(model.parameters(), 1e-4)
    x, y = spec.batch(torch.Generator().manual_seed(0))
    selected = resolve_layers(model)
    scope = attention_scope(named_modules(model), list(selected))
    probes = PrecursorProbes(stats, scope, selected, LayerStatsAggregator(len(selected)))
    window = WindowStart(torch.device("cpu"), lambda stat: [])

    def step(probed: bool) -> None:
        if probed:
            probes.reset(window)
            probes.attach()
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        if probed:
            probes.end_forward(loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if probed:
            probes.fold()  # as after every sampled step: a model without attention stops entering the mode

    for _ in range(3):
        step(False)
        step(True)
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(pairs):
        for probed in (False, True) if i % 2 else (True, False):
            start = time.process_time()
            step(probed)
            times[probed].append(time.process_time() - start)
    plain, probed = statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3
    return {
        "plain_ms": plain,
        "probed_ms": probed,
        "amortised_pct": (probed - plain) / plain / every * 100,
        "attention_on": probes.attention_on,
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer", choices=overhead.MODELS)
    parser.add_argument("--stats", default=",".join(PRECURSOR_STATS))
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="overhead.py's small models (a smoke run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    stats = [s for s in args.stats.split(",") if s]
    r = measure(args.model, stats, args.pairs, quick=args.quick)
    print(
        f"{args.model} {stats}: plain {r['plain_ms']:.2f} ms, probed {r['probed_ms']:.2f} ms (CPU time);"
        f" at every_n_steps=50: {r['amortised_pct']:.3f}% per step"
        f" (attention probe {'on' if r['attention_on'] else 'off after the first step: no attention call'})"
    )
    return r


if __name__ == "__main__":
    main()
