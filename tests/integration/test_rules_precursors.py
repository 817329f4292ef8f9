"""The instability-precursor rules on real training: injected sick layers named early, twins and the zoo silent.

Every case trains with a real Trainer, every step sampled, and the precursor statistics on (they are in the default
set); the zoo's silence over 105 steps is in ``test_rules_zoo.py``.
"""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
from helpers import TinyModule, by_name, count_hooks, make_trainer
from helpers.zoo import zoo_module
from torch import nn
from torch.utils.data import TensorDataset

from lightning_hookdiag import ALL_STATS, LayerHealthCallback
from lightning_hookdiag._vocabulary import PRECURSOR_STATS

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")

STATS = [*ALL_STATS, *PRECURSOR_STATS]
PRECURSOR_RULES = ["attention_logits", "logit_drift", "update_jump"]


@pytest.fixture(autouse=True)
def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


class _Watch(pl.Callback):
    """Listed after the health callback: keeps every sampled step's findings and one statistic of one layer."""

    def __init__(self, health: LayerHealthCallback, key: str) -> None:
        self.health, self.key = health, key
        self.findings: dict[int, list] = {}
        self.values: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = self.health.last_step
        if step is not None and step not in self.values:
            self.findings[step] = list(self.health.last_findings)
            self.values[step] = by_name(self.health.last_metrics).get(self.key, float("nan"))


def _health(**rules) -> LayerHealthCallback:
    return LayerHealthCallback(
        every_n_steps=1, stats=STATS, on_anomaly="ignore", rules=rules or None, output={"summary": False}
    )


class _GrowQK(pl.Callback):
    """After every optimizer step, scale W_q and W_k (and their biases) of one ViT block by ``factor``."""

    def __init__(self, block: int, factor: float) -> None:
        self.block, self.factor = block, factor

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        qkv = pl_module.model.blocks[self.block].attn.qkv
        rows = 2 * qkv.in_features  # the q and k thirds of the fused projection
        with torch.no_grad():
            qkv.weight[:rows].mul_(self.factor)
            qkv.bias[:rows].mul_(self.factor)


def _grow_run(factor: float, steps: int = 50) -> tuple[LayerHealthCallback, _Watch]:
    module = zoo_module("vit", n=8 * steps)
    health = _health()
    watch = _Watch(health, "layer_health/attn_logit_max/model.blocks.1.attn")
    make_trainer([health, watch, _GrowQK(1, factor)], max_steps=steps).fit(module)
    assert count_hooks(module) == 0
    return health, watch


def test_growing_attention_logits_are_named_with_their_projected_crossing_well_before_the_threshold():
    health, watch = _grow_run(1.08)  # W_q and W_k +8% a step: every logit x1.17 a step
    crossed = min(s for s, v in watch.values.items() if v >= 50.0)
    first = health.findings[0]
    assert (first.rule, first.layer, first.stat) == ("attention_logits", "model.blocks.1.attn", "attn_logit_max")
    assert first.step <= crossed - 5  # well before the level of 50 is reached
    assert first.value == watch.values[first.step] < 50.0
    projected = int(re.search(r"crosses attn_logit_threshold=50 at about step (\d+)", first.message).group(1))
    assert abs(projected - crossed) <= 3
    # From the crossing on, the level itself is reported, on the very step.
    (level,) = [f for f in watch.findings[crossed] if f.rule == "attention_logits"]
    assert level.value == watch.values[crossed] >= 50.0
    assert "at or above attn_logit_threshold=50" in level.message
    # Only the sick layer, only this rule.
    assert {(f.rule, f.layer) for step in watch.findings.values() for f in step} == {
        ("attention_logits", "model.blocks.1.attn")
    }


def test_attention_logits_twin_without_growth_is_silent():
    health, watch = _grow_run(1.0)
    assert max(watch.values.values()) < 5.0
    assert [f.message for f in health.findings] == []


class _ShiftBias(pl.Callback):
    """After every optimizer step, add ``shift`` to every vocabulary entry of the MLM head's bias."""

    def __init__(self, shift: float) -> None:
        self.shift = shift

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with torch.no_grad():
            pl_module.model.cls.predictions.decoder.bias.add_(self.shift)


def _drift_run(shift: float, steps: int = 24) -> tuple[LayerHealthCallback, _Watch, list[float]]:
    module = zoo_module("bert_mlm", n=8 * steps)
    losses: list[float] = []
    original = module.training_step

    def training_step(batch, batch_idx):
        loss = original(batch, batch_idx)
        losses.append(float(loss))
        return loss

    module.training_step = training_step
    health = _health()
    watch = _Watch(health, "layer_health/logit_lse_mean/model.cls.predictions.decoder")
    make_trainer([health, watch, _ShiftBias(shift)], max_steps=steps).fit(module)
    return health, watch, losses


def test_output_logits_drifting_under_a_flat_loss_are_named_at_the_head():
    health, watch, losses = _drift_run(0.5)
    steps = sorted(watch.values)
    # The injected drift: log Z rises by the shift each step (the softmax is shift-invariant, the loss is not moved).
    rises = [watch.values[b] - watch.values[a] for a, b in zip(steps, steps[1:], strict=False)]
    assert min(rises) > 0.45
    assert max(losses) - min(losses) < 0.1 * losses[0]
    first = health.findings[0]
    assert (first.rule, first.layer, first.stat) == ("logit_drift", "model.cls.predictions.decoder", "logit_lse_mean")
    # 5 nats accumulate by step 10; the rule waits for trend_window=8 sampled steps of history, then says so at once.
    reached = min(s for s in steps if watch.values[s] - watch.values[0] >= 5.0)
    assert first.step == reached
    assert first.value == pytest.approx(watch.values[first.step] - watch.values[0], rel=1e-9)
    assert {f.rule for f in health.findings} == {"logit_drift"}


def test_logit_drift_twin_without_the_shift_is_silent():
    health, watch, _ = _drift_run(0.0)
    assert max(watch.values.values()) - min(watch.values.values()) < 1.0
    assert [f.message for f in health.findings] == []


class _ScaleGrads(pl.Callback):
    """From step ``start`` on, multiply the gradients of the named layers by ``factor`` (SGD: the update too)."""

    def __init__(self, layers: list[str], start: int, factor: float) -> None:
        self.layers, self.start, self.factor = layers, start, factor

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.start:
            for name in self.layers:
                for p in pl_module.model.get_submodule(name).parameters():
                    p.grad.mul_(self.factor)


def _jump_run(layers: list[str]) -> tuple[LayerHealthCallback, _Watch]:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    data = TensorDataset(torch.randn(8 * 16, 16, generator=g), torch.randn(8 * 16, 1, generator=g))
    module = TinyModule(model=net, data=data, lr=0.02)
    module.record_enabled = False
    health = _health()
    watch = _Watch(health, "layer_health/param_update_ratio/model.2.weight")
    make_trainer([health, watch, _ScaleGrads(layers, 12, 8.0)], max_steps=16).fit(module)
    return health, watch


def test_an_update_jump_at_one_layer_is_named_on_the_step_it_happens():
    health, watch = _jump_run(["2"])
    assert watch.values[12] > 5 * watch.values[11]
    (finding,) = health.findings
    assert (finding.rule, finding.layer, finding.step) == ("update_jump", "model.2", 12)
    assert finding.value > 5.0


@pytest.mark.parametrize("layers", [[], ["0", "2", "4"]], ids=["untouched", "every_layer"])
def test_update_jump_twins_are_silent(layers):
    # Every layer's update jumping together is what a learning-rate schedule does: not a layer's precursor.
    health, _ = _jump_run(layers)
    assert [f.message for f in health.findings] == []


# The zoo's silence with the precursor rules (and every other) over 105 steps, every step sampled: test_rules_zoo.py.


def test_history_goes_into_the_checkpoint_state_and_comes_back():
    import json

    module = zoo_module("vit", n=8 * 4)
    health = _health()
    make_trainer([health], max_steps=4).fit(module)
    state = json.loads(json.dumps(health.state_dict()))
    points = state["history"]["points"]["attn_logit_max"]["model.blocks.0.attn"]
    assert [s for s, _ in points] == [0, 1, 2, 3]
    assert points[-1][1] == by_name(health.last_metrics)["layer_health/attn_logit_max/model.blocks.0.attn"]
    restored = _health()
    restored.load_state_dict(state)
    assert restored.state_dict()["history"]["points"]["attn_logit_max"]["model.blocks.0.attn"] == points


def test_a_replayed_step_is_probed_like_a_sampled_one(monkeypatch):
    from helpers import RecordingLogger, force_trips

    def run(every: int, trips: set[int]) -> dict[str, float]:
        module = zoo_module("vit", n=8 * 4)
        logger = RecordingLogger()
        health = LayerHealthCallback(
            every_n_steps=every,
            stats=STATS,
            on_anomaly="ignore",
            sentinel=force_trips(trips),
            output={"summary": False},
        )
        make_trainer([health], max_steps=4, logger=logger).fit(module)
        return dict(logger.ours())[3]

    regular = run(3, set())
    replayed = run(100, {3})
    keys = [k for k in regular if "/attn_logit_max/" in k or "/logit_" in k]
    assert len(keys) == 6
    assert {k: replayed[k] for k in keys} == {k: regular[k] for k in keys}


# ------------------------------------------------------------------------ a real instability: no qk-norm, high lr
class _QKAttention(nn.Module):
    def __init__(self, dim: int, heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.q_norm = nn.LayerNorm(dim // heads) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(dim // heads) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        out = nn.functional.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = _QKAttention(dim, heads, qk_norm)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _CopyLM(pl.LightningModule):
    """A 2-block pre-norm causal LM learning to repeat a random first half (an induction task), AdamW, no warm-up."""

    def __init__(self, qk_norm: bool, lr: float, vocab: int = 64, seq: int = 32, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.Sequential(*[_Block(dim, 2, qk_norm) for _ in range(2)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.lr, self.vocab = lr, vocab
        g = torch.Generator().manual_seed(1)
        half = torch.randint(0, vocab, (256, seq // 2 + 1), generator=g)
        self.tokens = torch.cat([half, half], 1)[:, : seq + 1]
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(x) + self.pos[: x.shape[1]])))

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(TensorDataset(self.tokens), batch_size=16)


def _copy_run(qk_norm: bool, steps: int = 120) -> tuple[_CopyLM, LayerHealthCallback, _Watch]:
    torch.manual_seed(0)
    module = _CopyLM(qk_norm, lr=0.03)
    health = LayerHealthCallback(  # the default statistics: the precursors are among them
        every_n_steps=2,
        on_anomaly="ignore",
        output={"summary": False},
        rules={"enabled": PRECURSOR_RULES},
    )
    watch = _Watch(health, "layer_health/attn_logit_max/blocks.0.attn")
    make_trainer([health, watch], max_steps=steps).fit(module)
    return module, health, watch


def test_high_lr_without_qk_norm_grows_attention_logits_past_100_and_is_warned_long_before_the_loss_fails():
    sick, health, watch = _copy_run(qk_norm=False)
    healthy, twin, twin_watch = _copy_run(qk_norm=True)
    # The instability: logits past 100 (Kimi K2 / Megatron clip there), while the qk-norm twin stays below 15 ...
    assert max(watch.values.values()) > 100
    assert max(twin_watch.values.values()) < 15
    # ... and the loss: the twin learns the task, the sick model does not (the final loss is far higher).
    tail = slice(-20, None)
    assert sum(sick.losses[tail]) / 20 > sum(healthy.losses[tail]) / 20 + 0.2
    first = health.findings[0]
    assert (first.rule, first.stat) == ("attention_logits", "attn_logit_max")
    assert first.layer in ("blocks.0.attn", "blocks.1.attn")
    # The warning comes in the first quarter of the run, while both losses are still level.
    gap = next(i for i, (a, b) in enumerate(zip(sick.losses, healthy.losses, strict=True)) if a > b + 0.1)
    assert first.step <= 30
    assert first.step < gap - 40
    assert [f.message for f in twin.findings] == []
