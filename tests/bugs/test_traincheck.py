"""TrainCheck's bugs (OSDI 2025) as ported: each port reproduces its bug and not its fix, and every published bug is
either ported or on record with why not.

The benchmark (``test_bugs.py``) checks what the callback says on each port and its twin; here the ports whose bug
the callback cannot see are shown to reproduce, measured on the fit itself.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from cases import BY_NAME, CASES
from helpers import make_trainer
from traincheck import NOT_PORTED, PORTS

pytestmark = pytest.mark.slow

# The bug ids of TrainCheck's artifact table (docs/ae-eval-s5.1-silent-issue-detection.md).
PUBLISHED = {
    "baichuan2-86", "deepspeed-1801", "deepspeed-5794", "lightning-thunder-725", "mmpretrain-702", "pytorch-51800",
    "pytorch-84803", "pytorch-96600", "pytorch-104336", "pytorch-115607", "pytorch-forum-84911",
    "stackoverflow-60335387", "stackoverflow-67180955", "transformers-17877", "transformers-23723",
    "transformers-33844", "transformers-34204", "x-jxmnop-ddp-out-of-sync",
}  # fmt: skip


def _fit(module: pl.LightningModule, steps: int, **trainer: object) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([], steps, **trainer).fit(module)


def test_every_published_bug_is_ported_or_on_record_with_why_not():
    ported = {case.name.removeprefix("tc_").replace("_", "-") for case in PORTS}
    assert ported | {bug for bug, _, _ in NOT_PORTED} == PUBLISHED
    assert not ported & {bug for bug, _, _ in NOT_PORTED}
    assert all(case.source.startswith("https://") for case in PORTS)
    assert all(case in CASES for case in PORTS)


@pytest.mark.parametrize("sick", [True, False])
def test_mmpretrain_702_the_stage_meant_to_be_frozen_trains_under_lightning_only_on_the_bug(sick):
    torch.manual_seed(0)
    fit = BY_NAME["tc_mmpretrain_702"].build(sick)
    stage = fit.module.model.stage0[0].weight
    before = stage.detach().clone()
    _fit(fit.module, 2)
    assert (not torch.equal(before, stage)) is sick


@pytest.mark.parametrize("sick", [True, False])
def test_transformers_33844_validation_runs_with_dropout_only_on_the_bug(sick):
    torch.manual_seed(0)
    fit = BY_NAME["tc_transformers_33844"].build(sick)
    module = fit.module
    _fit(module, 4, **fit.trainer)
    module.eval()
    x = module.data.tensors[0][:4]
    with torch.no_grad():
        assert torch.equal(module(x), module(x)) is not sick


@pytest.mark.parametrize("sick", [True, False])
def test_pytorch_forum_84911_nothing_the_optimizer_holds_gets_a_gradient_only_on_the_bug(sick):
    torch.manual_seed(0)
    fit = BY_NAME["tc_pytorch_forum_84911"].build(sick)
    head = fit.module.model._fc.weight
    before = head.detach().clone()
    _fit(fit.module, 2)
    assert torch.equal(before, head) is sick
