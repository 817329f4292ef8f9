"""Checks that need a CUDA device: sync counts under torch.cuda.set_sync_debug_mode, 16-mixed with a GradScaler.

Skipped with a reason on machines without one (CI has none); run them where a GPU is available.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import RecordingLogger, TinyModule, make_data, make_trainer
from test_structure import CountingCallback, deep_mlp

from lightning_hookdiag import LayerHealthCallback

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class SyncDebugCallback(CountingCallback):
    """Counts CUDA synchronisations reported by set_sync_debug_mode while the package runs."""

    def _counted(self, method, *args):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return method(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                self.counter["calls"] += sum("synchroniz" in str(w.message) for w in caught)


def cuda_syncs(blocks: int) -> dict[int, int]:
    counter = {"active": False, "calls": 0}
    callback = SyncDebugCallback(counter, every_n_steps=2, on_anomaly="ignore")
    module = TinyModule(model=deep_mlp(blocks), data=make_data(n=64))
    module.record_enabled = False
    make_trainer([callback], max_steps=5, accelerator="cuda").fit(module)
    return callback.per_step


def test_cuda_syncs_per_sampled_step_are_constant():
    shallow, deep = cuda_syncs(1), cuda_syncs(12)
    assert shallow == deep
    assert max(shallow.values()) <= 2
    assert all(shallow[s] == 0 for s in (1, 3))


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
