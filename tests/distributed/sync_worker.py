"""Run by test_aggregation_sync.py: ``python sync_worker.py OUT WORLD`` spawns WORLD CPU processes (gloo).

Every rank saves ``OUT/rank{r}.pt`` with:

``"pooled"``
    For each case ``(n_layers, sharded_params)`` and sampled step, what
    :class:`~lightning_hookdiag._aggregation.LayerStatsAggregator` computed from this rank's observations (see
    :func:`observations`; the test regenerates every rank's and pools them in float64), and what ``compute()`` did:
    collectives by name, the bytes each ``all_reduce`` carried, and the values read back to the host.
``"divergence"``
    Replicated parameters whose weights differ between ranks: the largest and smallest norm over processes.
``"replicas"`` (4 processes only)
    DTensor parameters on a 2 x 2 ``DeviceMesh`` (and a 1-D sub-mesh of it) with several placements, measured as
    the callback measures them, next to the norms of the full tensors.
``"names"`` (2 processes only)
    The logged names that selection, parameter tracking, the rules and the report give one model under DDP, FSDP1,
    FSDP2, ``torch.compile`` and activation checkpointing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from fsdp_worker import COLLECTIVES  # one list of what counts as a collective, for both workers
from torch import Tensor, nn

STEPS = 2
BINS = 8
LATE = 1  # a dead-unit layer that runs on the last rank only on step 0, then everywhere
_log: dict[str, Any] = {"active": False}


def _reset_log() -> None:
    _log.update(calls={}, bytes=[], host_reads=0)


def instrument() -> None:
    """Wrap the ``torch.distributed`` collectives and the tensor-to-host reads so :func:`recorded` can count them."""
    import torch.distributed as dist

    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def collective(*args: Any, _name: str = name, _original: Callable = original, **kwargs: Any) -> Any:
            if _log["active"]:
                _log["calls"][_name] = _log["calls"].get(_name, 0) + 1
                if _name == "all_reduce":
                    _log["bytes"].append(args[0].numel() * args[0].element_size())
            return _original(*args, **kwargs)

        setattr(dist, name, collective)
    for name in ("tolist", "item", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def read(self: Tensor, *args: Any, _original: Callable = original, **kwargs: Any) -> Any:
            if _log["active"]:
                _log["host_reads"] += 1
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, read)


@contextmanager
def recorded() -> Iterator[dict[str, Any]]:
    """Record collectives, all-reduce bytes and host reads issued in the block."""
    _reset_log()
    _log["active"] = True
    try:
        yield _log
    finally:
        _log["active"] = False


# ------------------------------------------------------------------------------------------------ observations
def units_of(layer: int) -> int:
    return 3 + layer % 4


def calls(rank: int, layer: int, step: int, world: int) -> int:
    """How many times ``layer`` runs on ``rank`` in ``step`` (0: not at all); differs between ranks."""
    if layer == LATE and step == 0:
        return 0 if rank < world - 1 else 2
    return 1 + (rank + layer) % 2


def observations(rank: int, n_layers: int, step: int, world: int) -> list[tuple[int, Tensor, Tensor]]:
    """``(layer, output, output gradient)`` of every call on ``rank``, in this rank's firing order.

    Each rank draws from a different distribution (spread and shift grow with the rank), odd layers are dead-unit
    layers whose unit 0 is alive on the last rank only, and odd ranks run the layers in reverse order.
    """
    out = []
    order = range(n_layers) if rank % 2 == 0 else reversed(range(n_layers))
    for layer in order:
        for call in range(calls(rank, layer, step, world)):
            g = torch.Generator().manual_seed(10_000 * step + 100 * layer + 10 * rank + call)
            x = torch.randn(5, units_of(layer), generator=g) * (1 + 4 * rank) + 2 * rank
            x[0, 1] = 0.0
            if layer % 2:
                x = x.clamp(min=0) - 1.0  # every unit dead ...
                x[:, 0] += 2.0 if rank == world - 1 else 0.0  # ... but unit 0 on the last rank
                x[1, 2] = 0.5 * (rank + 1)  # unit 2 alive everywhere
            grad = torch.randn(5, units_of(layer), generator=g) * (1 + rank)
            out.append((layer, x, grad))
    return out


def param_values(rank: int, n_params: int, step: int, sharded: bool) -> Tensor:
    """``[n_params, 4]`` squared norms and seen flags: this rank's part (sharded) or the common value."""
    g = torch.Generator().manual_seed(1000 * step + (rank if sharded else 999))
    values = torch.rand(n_params, 4, generator=g, dtype=torch.float64) + 0.5
    values[:, 3] = 1.0
    return values


def pooled_case(rank: int, world: int, n_layers: int, sharded: bool) -> list[dict[str, Any]]:
    """Feed ``STEPS`` sampled steps of observations through the package, as the callback does, and compute."""
    from lightning_hookdiag._aggregation import LayerStatsAggregator
    from lightning_hookdiag._recorder import StepRecorder

    units = frozenset(range(1, n_layers, 2))
    agg = LayerStatsAggregator(
        n_layers, n_params=n_layers, sharded_params=sharded, histogram_bins=BINS, unit_layers=units
    )
    rec = StepRecorder(n_layers, unit_layers=units, histogram_bins=BINS)
    rec.histograms = True
    steps = []
    for step in range(STEPS):
        for layer, x, grad in observations(rank, n_layers, step, world):
            rec.on_tensor(layer, x)
            rec.on_grad(layer, grad)
        index = torch.arange(n_layers)
        agg.update(rec.take(), params=(index, param_values(rank, n_layers, step, sharded), slice(None)))
        with recorded() as log:
            values = {k: v.detach().clone() for k, v in agg.compute().items()}
        steps.append(
            {
                "values": values,
                "calls": dict(log["calls"]),
                "bytes": list(log["bytes"]),
                "host_reads": log["host_reads"],
            }
        )
        agg.reset()
    return steps


def mismatch_case(rank: int, world: int) -> list[dict[str, Any]]:
    """Unit counts that disagree: between ranks when first seen (layer 0), on one rank after agreement (layer 1).

    Layer 2 is healthy. Returns, per step, the pooled ``act_dead_frac`` and this rank's ``unit_mismatch``.
    """
    from lightning_hookdiag._aggregation import LayerStatsAggregator
    from lightning_hookdiag._recorder import StepRecorder

    agg = LayerStatsAggregator(3, unit_layers={0, 1, 2})
    rec = StepRecorder(3, moments=False, unit_layers=frozenset({0, 1, 2}))
    last = rank == world - 1
    steps = []
    for step in range(2):
        rec.on_tensor(0, -torch.ones(2, 4 if last else 3))
        rec.on_tensor(1, -torch.ones(2, 6 if last and step == 1 else 5))
        rec.on_tensor(2, torch.tensor([[1.0 if last else -1.0, -1.0]]))
        agg.update(rec.take())
        steps.append({"dead": agg.compute()["act_dead_frac"].tolist(), "mismatch": sorted(agg.unit_mismatch)})
        agg.reset()
    return steps


def divergence_case(rank: int, world: int) -> dict[str, Any]:
    """Replicated parameters whose weights differ between ranks, through one sync (and a sharded twin).

    Parameter 0 is the same everywhere, parameter 1's weight sum of squares is ``4 + rank``, parameter 2 is measured
    on the last rank only (``9``), parameter 3 nowhere. Returns the pooled norms and what the sync issued.
    """
    from lightning_hookdiag._aggregation import LayerStatsAggregator

    out: dict[str, Any] = {}
    for sharded in (False, True):
        agg = LayerStatsAggregator(0, n_params=4, sharded_params=sharded)
        values = torch.zeros(4, 4, dtype=torch.float64)
        values[:2, 3] = 1.0  # measured
        values[0, 0], values[1, 0] = 4.0, 4.0 + rank
        if rank == world - 1:
            values[2] = torch.tensor([9.0, 1.0, 0.0, 1.0], dtype=torch.float64)
        agg.update(params=(torch.arange(4), values, slice(None)))
        with recorded() as log:
            pooled = agg.compute()
        out["sharded" if sharded else "replicated"] = {
            "param_norm": pooled["param_norm"].tolist(),
            "param_norm_min": pooled["param_norm_min"].tolist() if "param_norm_min" in pooled else None,
            "calls": dict(log["calls"]),
            "host_reads": log["host_reads"],
        }
    return out


# ---------------------------------------------------------------------------------------------------- replicas
def replica_cases(rank: int) -> dict[str, Any]:
    """DTensor parameters on a 2 x 2 mesh (and its 1-D sub-meshes), measured by the tracker and the aggregator."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from lightning_hookdiag import _params as P
    from lightning_hookdiag._aggregation import LayerStatsAggregator
    from lightning_hookdiag._params import ParameterTracker

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    layouts: dict[str, tuple[Any, tuple]] = {
        "hsdp": (mesh, (Replicate(), Shard(0))),
        "shard_replicate": (mesh, (Shard(0), Replicate())),
        "shard_shard": (mesh, (Shard(0), Shard(1))),
        "replicate_replicate": (mesh, (Replicate(), Replicate())),
        "submesh_shard": (mesh["shard"], (Shard(0),)),
    }
    out: dict[str, Any] = {}
    for name, (m, placements) in layouts.items():
        g = torch.Generator().manual_seed(7)
        full = [torch.randn(5, 3, generator=g), torch.randn(3, generator=g)]  # 5 and 3 rows: uneven shards
        grads = [torch.randn(5, 3, generator=g), torch.randn(3, generator=g)]
        params = []
        for weight, grad in zip(full, grads, strict=True):
            place = placements if weight.dim() > 1 or not any(p.is_shard(1) for p in placements) else None
            if place is None:  # a 1-D tensor has no dim 1: shard its dim 0 instead
                place = tuple(Shard(0) if p.is_shard() else p for p in placements)
            p = nn.Parameter(distribute_tensor(weight, m, place))
            p.grad = distribute_tensor(grad, m, place)
            params.append(p)
        tracker = ParameterTracker({f"w{i}": p for i, p in enumerate(params)}, snapshot=False)
        agg = LayerStatsAggregator(n_layers=0, n_params=len(params), sharded_params=True)
        measured = tracker.before_step([{"params": params}])
        assert measured is not None
        agg.update(params=(measured[0], measured[1], slice(None)))
        values = agg.compute()
        out[name] = {
            "replicas": [P.replicas(p) for p in params],
            "local_numel": [p.to_local().numel() for p in params],
            "param_norm": values["param_norm"].tolist(),
            "param_grad_norm": values["param_grad_norm"].tolist(),
            "expected_norm": [w.double().norm().item() for w in full],
            "expected_grad_norm": [w.double().norm().item() for w in grads],
        }
    partial = DTensor.from_local(torch.ones(2), mesh, (Partial(), Shard(0)))
    try:
        P.replicas(partial)
        out["partial_error"] = None
    except ValueError as err:
        out["partial_error"] = str(err)
    return out


# ------------------------------------------------------------------------------------------------------- names
class Net(nn.Module):
    """A LightningModule-like holder: ``model`` with an encoder, a block (a container) and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6))
        self.block = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.encoder(x)))


class Holder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def wrapped_variants() -> dict[str, nn.Module]:
    """The same model under each wrapper; names must not change."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.nn.parallel import DistributedDataParallel

    def checkpointed() -> nn.Module:
        net = Net()
        apply_activation_checkpointing(net, checkpoint_wrapper, check_fn=lambda m: isinstance(m, nn.Linear))
        return net

    def fsdp2() -> nn.Module:
        net = Net()
        for m in net.modules():
            if isinstance(m, nn.Linear):
                fully_shard(m)
        fully_shard(net)
        return net

    def compiled_parts() -> nn.Module:
        net = Net()
        net.encoder = torch.compile(net.encoder)  # type: ignore[assignment]
        return net

    return {
        "plain": Net(),
        "ddp": DistributedDataParallel(Net()),
        "fsdp1": FullyShardedDataParallel(
            Net(),
            use_orig_params=True,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            device_id=torch.device("cpu"),
        ),
        "fsdp2": fsdp2(),
        "compile": torch.compile(Net()),  # type: ignore[dict-item]
        "compile_parts": compiled_parts(),
        "checkpoint": checkpointed(),
        "ddp_compile_checkpoint": DistributedDataParallel(torch.compile(checkpointed())),  # type: ignore[arg-type]
    }


def name_cases() -> dict[str, Any]:
    """What each consumer calls each module and parameter, per wrapper."""
    from lightning_hookdiag._params import named_parameters_of
    from lightning_hookdiag._selection import resolve_layers
    from lightning_hookdiag.report._health_log import Scalar, build_health_log
    from lightning_hookdiag.rules import Observed, RuleConfig, evaluate

    out = {}
    for variant, model in wrapped_variants().items():
        modules = resolve_layers(Holder(model))  # leaves, as layers=None selects
        containers = resolve_layers(Holder(model), layers=["model.block", "model.head", "model.encoder.*"])
        params = named_parameters_of(containers)
        layers = list(containers)
        config = RuleConfig(enabled=("nonfinite",))
        rule_owner = {}
        for param in params:
            step = Observed(0, {"param_grad_norm": {param: float("nan")}}, {"forward_order": layers})
            (finding,) = evaluate(step, None, config)
            rule_owner[param] = finding.layer
        scalars = [Scalar(f"layer_health/depth/{name}", 0, float(i)) for i, name in enumerate(layers)]
        scalars += [Scalar(f"layer_health/param_norm/{param}", 0, 1.0) for param in params]
        log = build_health_log(scalars)
        report_owner = {param: layers[log.depth_of(param, "param_norm")] for param in params}  # type: ignore[index]
        out[variant] = {
            "leaves": list(modules),
            # FSDP2 subclasses the module in place (FSDPLinear): the torch.nn class it is
            "types": [
                next(c.__name__ for c in type(m).__mro__ if c.__module__.startswith("torch.nn.modules"))
                for m in modules.values()
            ],
            "layers": layers,
            "params": list(params),
            "rule_owner": rule_owner,
            "report_owner": report_owner,
            "report_order": log.layers("param_norm"),
        }
    return out


# ------------------------------------------------------------------------------------------------------ driver
def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    instrument()
    try:
        results: dict[str, Any] = {
            "pooled": {(n, shard): pooled_case(rank, world, n, shard) for n in (4, 16) for shard in (False, True)},
            "mismatch": mismatch_case(rank, world),
            "divergence": divergence_case(rank, world),
        }
        if world == 4:
            results["replicas"] = replica_cases(rank)
        if world == 2:
            results["names"] = name_cases()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fsdp_worker import free_port

    out_dir, world = sys.argv[1], int(sys.argv[2])
    mp.spawn(run_rank, args=(world, free_port(), out_dir), nprocs=world, join=True)
