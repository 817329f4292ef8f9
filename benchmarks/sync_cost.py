"""What syncing one sampled step's pooled statistics costs at scale, on paper (no processes are started).

Two paths are modelled, for one sampled step of :class:`~lightning_hookdiag.LayerHealthCallback` with its default
statistics:

``old``
    torchmetrics' ``gather_all_tensors`` for each state of ``LayerStatsAggregator`` (read in torchmetrics 1.4 and
    1.9): a barrier, an all-gather of the state's shape, a host check that all shapes are equal (a device sync on an
    accelerator), and an all-gather of the data; then ``torch.stack`` of the gathered copies and the reduction.
``new``
    The packed sync of :mod:`lightning_hookdiag._distributed`: every additive state in one float64 buffer, reduced
    with one SUM ``all_reduce``, every maximum in one buffer reduced with one MAX ``all_reduce``.

Per process and sampled step it prints bytes sent and received, the peak extra memory of the sync, the number of
collectives and host syncs, and an alpha-beta estimate of the time. Ring algorithms throughout (as the issue asks):
an all-reduce of ``n`` bytes over ``p`` processes takes ``2 (p - 1)`` steps and moves ``2 (p - 1) / p * n`` bytes
in each direction; an all-gather of ``n`` bytes per process takes ``p - 1`` steps and moves ``(p - 1) * n``; a
barrier is an all-reduce of one element. NCCL switches to trees for small messages at scale, which lowers the
latency term of both paths alike (``log p`` instead of ``p`` steps); the bandwidth terms are what differ.

Run: ``python benchmarks/sync_cost.py`` (``--markdown`` for the table in benchmarks/README.md).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from lightning_hookdiag import _params as P
from lightning_hookdiag import _stats as S

WORLDS = (8, 64, 512, 1024, 8192)
LAYERS = (100, 1000, 10000)

# alpha: seconds per ring step (launch, hop latency, protocol); beta: seconds per byte on the slowest link of the ring.
LINKS = {
    # NVLink 4 (H100 SXM, one node): ~300 GB/s of NCCL bus bandwidth per GPU, a few microseconds per step.
    "nvlink": (3e-6, 1 / 300e9),
    # InfiniBand NDR (400 Gb/s per GPU, across nodes): ~45 GB/s achieved, ~10 us per step.
    "infiniband": (10e-6, 1 / 45e9),
}


@dataclass(frozen=True)
class Model:
    """The per-layer shape of the states: what a typical network selects with the defaults."""

    params_per_layer: float = 1.0  # a Linear/Conv has weight and bias, a ReLU/LayerNorm none or two: one on average
    dead_unit_share: float = 1 / 3  # the share of selected layers that are ReLU-family (act_dead_frac)
    units: int = 1024  # units (channels, features) of each of those
    histogram_bins: int = 0  # histograms off (the default); 64 when histogram_every_n_steps is set


@dataclass(frozen=True)
class State:
    name: str
    elements: int
    itemsize: int
    op: str  # "sum" or "max"

    @property
    def nbytes(self) -> int:
        return self.elements * self.itemsize


def states(layers: int, model: Model, sharded_params: bool = False) -> list[State]:
    """The states of ``LayerStatsAggregator`` for ``layers`` selected layers (float64 sums, float32 maxima)."""
    n_params = round(layers * model.params_per_layer)
    dead_layers = round(layers * model.dead_unit_share)
    out = [
        State("act_moments", layers * S.ACT_SLOTS, 8, "sum"),
        State("act_absmax", layers, 4, "max"),
        State("grad_moments", layers * S.GRAD_SLOTS, 8, "sum"),
        State("unit_max", dead_layers * model.units, 4, "max"),
        State("param_stats", n_params * P.P_SLOTS, 8, "sum" if sharded_params else "max"),
    ]
    if model.histogram_bins:
        out += [State(n, layers * model.histogram_bins, 4, "sum") for n in ("act_hist", "grad_hist")]
    return out


@dataclass(frozen=True)
class Cost:
    sent: float  # bytes per process
    received: float
    peak_extra: float  # bytes of memory the sync allocates at its peak, beyond the states
    collectives: int
    host_syncs: int
    seconds: dict[str, float]


def allreduce_time(n: float, p: int, alpha: float, beta: float) -> float:
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta


def allgather_time(n: float, p: int, alpha: float, beta: float) -> float:
    return (p - 1) * alpha + (p - 1) * n * beta


def old_path(layers: int, p: int, model: Model) -> Cost:
    """torchmetrics' gather-based sync: per state, barrier + shape all-gather + host check + data all-gather."""
    sent = received = peak = 0.0
    seconds = dict.fromkeys(LINKS, 0.0)
    cache = sum(s.nbytes for s in states(layers, model))  # torchmetrics copies the local states before syncing
    for state in states(layers, model):
        shape_bytes = 8 * 1  # every state is 1-D or 2-D; the shape tensor is int64 per dimension (1 here, 2 for 2-D)
        shape_bytes *= 2 if state.name in ("act_moments", "grad_moments", "param_stats") else 1
        barrier = 8
        moved = 2 * (p - 1) / p * barrier + (p - 1) * shape_bytes + (p - 1) * state.nbytes
        sent += moved
        received += moved
        # The gathered copies (p of them) and their torch.stack (p more) are alive together.
        peak = max(peak, 2 * p * state.nbytes)
        for link, (alpha, beta) in LINKS.items():
            seconds[link] += allreduce_time(barrier, p, alpha, beta) + allgather_time(shape_bytes, p, alpha, beta)
            seconds[link] += allgather_time(state.nbytes, p, alpha, beta)
    n = len(states(layers, model))
    return Cost(sent, received, cache + peak, 3 * n, n, seconds)


def buffers(layers: int, model: Model) -> tuple[int, int]:
    """Bytes of the packed SUM and MAX buffers of the new path.

    A packed buffer has the widest dtype of its states; the MAX buffer also holds one flag per layer (units
    mismatched on some process) when dead units are tracked.
    """
    all_states = states(layers, model)
    sums, maxima = [s for s in all_states if s.op == "sum"], [s for s in all_states if s.op == "max"]
    flags = layers if round(layers * model.dead_unit_share) else 0
    sum_bytes = max(s.itemsize for s in sums) * sum(s.elements for s in sums)
    max_bytes = max(s.itemsize for s in maxima) * (sum(s.elements for s in maxima) + flags)
    return sum_bytes, max_bytes


def new_path(layers: int, p: int, model: Model) -> Cost:
    """The packed sync: one SUM and one MAX all-reduce (``distributed.all_reduce_packed``)."""
    all_states = states(layers, model)
    sum_bytes, max_bytes = buffers(layers, model)
    moved = 2 * (p - 1) / p * (sum_bytes + max_bytes)
    cache = sum(s.nbytes for s in all_states)
    # Each buffer exists twice at its peak: packed (reduced in place) and unpacked into the new states.
    peak = cache + 2 * max(sum_bytes, max_bytes) + min(sum_bytes, max_bytes)
    seconds = {
        link: allreduce_time(sum_bytes, p, alpha, beta) + allreduce_time(max_bytes, p, alpha, beta)
        for link, (alpha, beta) in LINKS.items()
    }
    return Cost(moved, moved, peak, 2, 0, seconds)


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _time(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def table(model: Model, markdown: bool = False) -> str:
    """The cost table for every world size and layer count."""
    head = [
        "ranks",
        "layers",
        "path",
        "sent/rank",
        "received/rank",
        "peak extra memory",
        "collectives",
        "host syncs",
        "time NVLink",
        "time InfiniBand",
    ]
    rows = []
    for layers in LAYERS:
        for p in WORLDS:
            for name, cost in (("old", old_path(layers, p, model)), ("new", new_path(layers, p, model))):
                rows.append(
                    [
                        str(p),
                        str(layers),
                        name,
                        _size(cost.sent),
                        _size(cost.received),
                        _size(cost.peak_extra),
                        str(cost.collectives),
                        str(cost.host_syncs),
                        _time(cost.seconds["nvlink"]),
                        _time(cost.seconds["infiniband"]),
                    ]
                )
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows])


def main(argv: list[str] | None = None) -> str:
    """Print (and return) the table; see ``--help``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--units", type=int, default=Model.units, help="units of each dead-unit layer")
    parser.add_argument("--dead-unit-share", type=float, default=Model.dead_unit_share)
    parser.add_argument("--histogram-bins", type=int, default=0, help="0: histograms off (the default)")
    args = parser.parse_args(argv)
    model = Model(units=args.units, dead_unit_share=args.dead_unit_share, histogram_bins=args.histogram_bins)
    links = ", ".join(f"{k}: alpha={a * 1e6:.0f} us, beta=1/({1 / b / 1e9:.0f} GB/s)" for k, (a, b) in LINKS.items())
    text = (
        f"Per process and sampled step; {model}; ring collectives ({links}).\n"
        f"old: torchmetrics gather_all_tensors per state; new: one SUM + one MAX all_reduce of packed buffers"
        f"\n\n{table(model, args.markdown)}"
    )
    print(text)
    return text


if __name__ == "__main__":
    main()
