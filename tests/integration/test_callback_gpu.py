"""Checks that need a CUDA device: sync counts under torch.cuda.set_sync_debug_mode, 16-mixed with a GradScaler.

Skipped with a reason on machines without one (CI has none); run them where a GPU is available.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import RecordingLogger, TinyModule, make_data, make_trainer
from helpers.cost import SyncFreeModule, deep_mlp
from lightning.pytorch import Callback

from lightning_hookdiag import LayerHealthCallback

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class SyncWatch:
    """Counts CUDA synchronisations (``set_sync_debug_mode("warn")`` warnings) from each batch start to its end.

    Two callbacks share the count: ``first`` goes first in the list and ``last`` last, so the window covers every
    other callback's batch start and end (the package's one transfer happens in its ``on_train_batch_end``) and the
    forward and backward hooks in between.
    """

    def __init__(self) -> None:
        self.per_step: dict[int, int] = {}
        watch = self

        class First(Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                watch.step = trainer.global_step
                watch.catch = warnings.catch_warnings(record=True)
                watch.caught = watch.catch.__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")

        class Last(Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                torch.cuda.set_sync_debug_mode("default")
                watch.catch.__exit__(None, None, None)
                syncs = sum("synchroniz" in str(w.message) for w in watch.caught)
                watch.per_step[watch.step] = watch.per_step.get(watch.step, 0) + syncs

        self.first, self.last = First(), Last()


def cuda_syncs(blocks: int, observed: bool, sentinel: str | None = None) -> dict[int, int]:
    torch.manual_seed(0)
    watch = SyncWatch()
    callback = LayerHealthCallback(every_n_steps=2, on_anomaly="ignore", sentinel=sentinel, output={"summary": False})
    middle = [callback] if observed else []
    module = SyncFreeModule(model=deep_mlp(blocks), data=make_data(n=64))
    module.record_enabled = False
    make_trainer([watch.first, *middle, watch.last], max_steps=5, accelerator="cuda").fit(module)
    return watch.per_step


def test_cuda_syncs_per_sampled_step_are_constant():
    # Syncs the package adds to each step: with the callback minus without it (Lightning's own cancel out).
    added = {}
    for blocks in (1, 12):
        with_cb, without = cuda_syncs(blocks, True), cuda_syncs(blocks, False)
        added[blocks] = {step: with_cb[step] - without[step] for step in with_cb}
    print(f"CUDA syncs the package adds per step (steps 0, 2, 4 sampled), by depth: {added}")  # gpu_check.sh
    assert added[1] == added[12]  # does not grow with depth
    assert added[1][1] == added[1][3] == 0  # unsampled steps
    assert 1 <= added[1][2] == added[1][4] <= 2  # sampled steps: the one batched transfer (target 1)


@pytest.mark.parametrize("sentinel", ["loss", "loss+grads"])
def test_the_sentinel_adds_one_sync_per_optimizer_step(sentinel):
    without = cuda_syncs(4, False)
    base = cuda_syncs(4, True, sentinel=None)
    with_sentinel = cuda_syncs(4, True, sentinel=sentinel)
    extra = {step: with_sentinel[step] - base[step] for step in base}
    print(f"CUDA syncs the {sentinel!r} sentinel adds per step: {extra}")  # gpu_check.sh
    assert extra == dict.fromkeys(base, 1), (extra, base, without)


def test_16_mixed_gradient_norms_have_the_loss_scale_removed():
    def run(precision: str) -> dict[str, float]:
        torch.manual_seed(0)
        logger = RecordingLogger()
        module = TinyModule(model=deep_mlp(3), data=make_data(n=64))
        module.record_enabled = False
        make_trainer(
            [LayerHealthCallback(every_n_steps=1)], max_steps=1, precision=precision, logger=logger, accelerator="cuda"
        ).fit(module)
        return logger.ours()[0][1]

    full, half = run("32-true"), run("16-mixed")
    for key, value in full.items():
        if "act_grad_norm" in key or "param_grad_norm" in key:
            assert half[key] == pytest.approx(value, rel=0.05), key
