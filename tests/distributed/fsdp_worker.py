"""Run by test_params_fsdp.py in a subprocess: parameter statistics of sharded models against unsharded copies.

Two modes, each saving one file per rank under ``OUT``:

``python fsdp_worker.py OUT torch``
    Spawns 2 CPU processes (gloo). On each, the same small MLP (layer sizes that do not divide by 2, so shards are
    uneven and some are empty) is sharded, trained for ``STEPS`` steps on very different per-rank data, and
    measured with :class:`~lightning_hookdiag._params.ParameterTracker` and
    :class:`~lightning_hookdiag._aggregation.LayerStatsAggregator` exactly as the callback does. An unsharded deep
    copy replays both ranks' batches (FSDP averages gradients over ranks) and gives the expected values. Also saved:
    two deliberately wrong variants (the local shard's norm as is; shards reduced with ``max`` as for replicated
    parameters) and the number of ``torch.distributed`` collectives issued by ``compute()``. Cases (layout, depth):

    - ``fsdp``: :func:`torch.distributed.fsdp.fully_shard` on every Linear and the root, 1 and 6 hidden layers;
    - ``fsdp1``: ``FullyShardedDataParallel(use_orig_params=True)`` on CPU, as Lightning's ``FSDPStrategy`` wraps:
      plain-tensor parameters, each this rank's part of one flat parameter (some empty, without a gradient);
    - ``hsdp``: ``fully_shard`` on a 2 x 1 (replicate x shard) mesh: both ranks hold the same, replicated, shard;
    - ``submesh``: ``fully_shard`` over the size-1 data-parallel dimension of a 1 x 2 mesh, like a parameter that
      tensor parallelism leaves replicated: both ranks hold the whole parameter and see the same data.

    Saves ``OUT/torch_rank{r}.pt``.

``python fsdp_worker.py OUT lightning STRATEGY ACCELERATOR DEVICES``
    A real ``Trainer.fit`` with :class:`~lightning_hookdiag.LayerHealthCallback`: STRATEGY ``model_parallel``
    (Lightning's ``ModelParallelStrategy``, FSDP2 applied in ``configure_model``; runs on CPU) or ``fsdp``
    (Lightning's ``FSDPStrategy``; Lightning allows it on GPU only). Lightning re-executes this script for the other
    ranks. Saves ``OUT/lightning_rank{r}.pt`` with the logged values per step and the unsharded reference.
"""

from __future__ import annotations

import copy
import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

WORLD = 2
STEPS = 2
BATCH = 6
OPTIMIZER = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}
STATS = ("param_norm", "param_grad_norm", "param_update_ratio")
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
)
_counting = {"active": False, "calls": 0}


def count_collectives() -> None:
    """Wrap the ``torch.distributed`` collectives so that :func:`counted` can count the calls made inside it."""
    import torch.distributed as dist

    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapper(*args: Any, _original: Callable = original, **kwargs: Any) -> Any:
            if _counting["active"]:
                _counting["calls"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, wrapper)


@contextmanager
def counted() -> Iterator[dict[str, Any]]:
    """Count collectives issued in the block; the count is in ``["calls"]`` afterwards."""
    _counting["active"], _counting["calls"] = True, 0
    try:
        yield _counting
    finally:
        _counting["active"] = False


def make_model(depth: int) -> nn.Sequential:
    """``5 -> 7 (x depth) -> 3 -> 1`` with ReLUs, from seed 0: odd sizes, so 2 shards are uneven (or empty)."""
    torch.manual_seed(0)
    sizes = [5] + [7] * depth + [3, 1]
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    """The deterministic batch of ``rank`` at ``step``; rank 1's inputs have 10x the spread and are shifted."""
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(BATCH, 5, generator=g) * (1 + 9 * rank) + 3 * rank
    return x, torch.randn(BATCH, 1, generator=g)


def linear_modules(model: nn.Sequential) -> dict[str, nn.Module]:
    """The Linear layers of ``model`` by their index in it, as the callback names selected modules."""
    return {str(i): m for i, m in enumerate(model) if isinstance(m, nn.Linear)}


def shard(model: nn.Sequential, mesh: Any = None) -> None:
    """FSDP2 on every Linear and on the root."""
    from torch.distributed.fsdp import fully_shard

    for module in linear_modules(model).values():
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def reference_step(ref: nn.Module, optimizer: torch.optim.Optimizer, world: int, step: int) -> dict[str, Tensor]:
    """One unsharded step on every rank's batch with the mean loss over ranks (FSDP's mean of gradients).

    Returns float64 ``param_norm``, ``param_grad_norm``, ``param_update_ratio`` (per parameter, in
    ``ref.named_parameters()`` order) and ``grad_norm_total``, taken from the full tensors.
    """
    params = [p for _, p in ref.named_parameters()]
    before = [p.detach().clone() for p in params]
    optimizer.zero_grad()
    loss = sum(nn.functional.mse_loss(ref(x), y) for x, y in (batch(r, step) for r in range(world))) / world
    loss.backward()  # type: ignore[union-attr]
    grads = [p.grad.detach().clone() for p in params]  # type: ignore[union-attr]
    optimizer.step()
    weight = torch.stack([b.double().norm() for b in before])
    grad = torch.stack([g.double().norm() for g in grads])
    update = torch.stack([(p.detach() - b).double().norm() for p, b in zip(params, before, strict=True)])
    return {
        "param_norm": weight,
        "param_grad_norm": grad,
        "param_update_ratio": update / weight,
        "grad_norm_total": grad.square().sum().sqrt().reshape(1),
    }


# --------------------------------------------------------------------------------------------- torch mode
def torch_case(rank: int, depth: int, layout: str) -> dict[str, Any]:
    """Train a sharded model and its unsharded reference for ``STEPS`` steps and measure every step."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_hookdiag import _params as P
    from lightning_hookdiag._aggregation import LayerStatsAggregator
    from lightning_hookdiag._params import ParameterTracker, local_tensor, named_parameters_of

    model = make_model(depth)
    ref = copy.deepcopy(model)
    net: nn.Module = model
    if layout == "fsdp1":
        # FSDP1 with the original parameters exposed, as Lightning's FSDPStrategy does: each parameter is a plain
        # tensor holding this rank's part of one flat parameter (possibly nothing, then without a gradient).
        from torch.distributed.fsdp import FullyShardedDataParallel

        net = FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))
    else:
        mesh = None
        if layout == "hsdp":
            mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))
        elif layout == "submesh":
            mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))["dp"]
        shard(model, mesh)
    # On a data-parallel submesh of size 1 the ranks are replicas that see the same data (as tensor-parallel ranks
    # do): the reference is one process.
    data_rank, world = (0, 1) if layout == "submesh" else (rank, WORLD)
    optimizer = torch.optim.SGD(model.parameters(), **OPTIMIZER)
    ref_optimizer = torch.optim.SGD(ref.parameters(), **OPTIMIZER)

    params = named_parameters_of(linear_modules(model))
    names = list(params)
    assert names == list(named_parameters_of(linear_modules(ref))) == [n for n, _ in ref.named_parameters()]
    tracker = ParameterTracker(params, snapshot=True)
    aggregator = LayerStatsAggregator(n_layers=0, n_params=len(params), sharded_params=True)
    replicated = LayerStatsAggregator(n_layers=0, n_params=len(params), sharded_params=False)

    steps = []
    for step in range(STEPS):
        x, y = batch(data_rank, step)
        nn.functional.mse_loss(net(x), y).backward()
        plist = list(params.values())
        shard_only = {
            "param_norm": torch.stack([local_tensor(p).detach().double().norm() for p in plist]),
            "param_grad_norm": torch.stack(
                [
                    torch.zeros((), dtype=torch.float64) if p.grad is None else local_tensor(p.grad).double().norm()
                    for p in plist
                ]
            ),
        }
        measured = tracker.before_step(optimizer.param_groups)
        assert measured is not None
        for agg in (aggregator, replicated):
            agg.update(params=(measured[0], measured[1], slice(None)))
        optimizer.step()
        updated = tracker.after_step()
        assert updated is not None
        for agg in (aggregator, replicated):
            agg.update(params=(updated[0], updated[1], P.P_UPDATE_SQ))
            agg.update()
        with counted() as count:
            values = {k: v.detach().clone() for k, v in aggregator.compute().items()}
        calls = count["calls"]
        wrong = {k: v.detach().clone() for k, v in replicated.compute().items()}
        aggregator.reset()
        replicated.reset()
        optimizer.zero_grad()
        steps.append(
            {
                "values": values,
                "collectives": calls,
                "replicated_reduction": wrong,
                "shard_only": shard_only,
                "expected": reference_step(ref, ref_optimizer, world, step),
            }
        )
    return {
        "names": names,
        "steps": steps,
        "param_types": sorted({type(p).__name__ for p in params.values()}),
        "local_numel": [local_tensor(p).numel() for p in params.values()],
        "numel": [p.numel() for p in params.values()],
    }


def torch_rank(rank: int, port: int, out_dir: str) -> None:
    """One spawned process: join the gloo group, run every case, save the results."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    count_collectives()
    try:
        results = {
            ("fsdp", 1): torch_case(rank, 1, "fsdp"),
            ("fsdp", 6): torch_case(rank, 6, "fsdp"),
            ("fsdp1", 1): torch_case(rank, 1, "fsdp1"),
            ("hsdp", 1): torch_case(rank, 1, "hsdp"),
            ("submesh", 1): torch_case(rank, 1, "submesh"),
        }
        torch.save(results, os.path.join(out_dir, f"torch_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port that is free on localhost right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch(out_dir: str) -> None:
    """Spawn the 2 processes of the torch mode."""
    import torch.multiprocessing as mp

    mp.spawn(torch_rank, args=(free_port(), out_dir), nprocs=WORLD, join=True)


# ------------------------------------------------------------------------------------------- Lightning mode
def run_lightning(out_dir: str, strategy: str, accelerator: str, devices: int) -> None:
    """``Trainer.fit`` with the callback under FSDP2 (``model_parallel``) or FSDP (``fsdp``)."""
    import lightning.pytorch as pl
    from helpers import make_trainer
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hookdiag import LayerHealthCallback
    from lightning_hookdiag._replay import sharded

    count_collectives()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model(1)
            self.unsharded = [copy.deepcopy(self.model)]  # a list: not a submodule, so never sharded nor moved

        def configure_model(self) -> None:
            if strategy == "model_parallel":
                shard(self.model, self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), **OPTIMIZER)

        def train_dataloader(self) -> DataLoader:
            xs, ys = zip(*(batch(self.global_rank, step) for step in range(STEPS)), strict=True)
            return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=BATCH, shuffle=False)

    class Recording(LayerHealthCallback):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.pooled: dict[int, dict[str, float]] = {}
            self.collectives: dict[int, int] = {}
            self.sharded: bool | None = None

        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            super().on_fit_start(trainer, pl_module)
            self.sharded = sharded(trainer, dict(pl_module.named_parameters()))

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            # Every step is sampled: its window is pooled and logged here, once its optimizer has stepped.
            before = self.last_step
            with counted() as count:
                super().on_train_batch_end(*args, **kwargs)
            assert self.last_step is not None
            assert self.last_step != before
            self.pooled[self.last_step] = dict(self.last_metrics)
            self.collectives[self.last_step] = count["calls"]

    module = Module()
    callback = Recording(every_n_steps=1, on_anomaly="ignore", output={"summary": False})
    kind: Any = (
        ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
        if strategy == "model_parallel"
        else strategy
    )
    trainer = make_trainer(
        [callback],
        max_steps=STEPS,
        accelerator=accelerator,
        devices=devices,
        strategy=kind,
        use_distributed_sampler=False,
    )
    trainer.fit(module)
    ref = module.unsharded[0]
    ref_optimizer = torch.optim.SGD(ref.parameters(), **OPTIMIZER)
    expected = {step: reference_step(ref, ref_optimizer, trainer.world_size, step) for step in range(STEPS)}
    torch.save(
        {
            "names": [f"model.{n}" for n, _ in ref.named_parameters()],
            "pooled": callback.pooled,
            "collectives": callback.collectives,
            "expected": expected,
            "sharded": callback.sharded,
            "world_size": trainer.world_size,
            "param_types": sorted({type(p).__name__ for p in module.parameters()}),
            "findings": [f.rule for f in callback.findings],
        },
        os.path.join(out_dir, f"lightning_rank{trainer.global_rank}.pt"),
    )


def main(argv: list[str]) -> None:
    """Dispatch on the mode, see the module docstring."""
    out_dir, mode = argv[0], argv[1]
    if mode == "torch":
        run_torch(out_dir)
    elif mode == "lightning":
        run_lightning(out_dir, argv[2], argv[3], int(argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for the helpers package
    main(sys.argv[1:])
