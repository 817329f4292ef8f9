"""Hand-written reference computations, independent of the package's sufficient-statistics path.

Activations and gradients are recomputed from the weights and inputs a recorded training batch saw, with
``retain_grad()`` on every intermediate output and the loss scaled by ``1/accumulate`` as Lightning does; statistics
are then taken element by element in Python floats.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import nn


def activation_stats(values: list[float]) -> dict[str, float]:
    finite = [v for v in values if math.isfinite(v)]
    mean = sum(finite) / len(finite)
    var = sum((v - mean) ** 2 for v in finite) / len(finite)
    return {
        "act_mean": mean,
        "act_std": math.sqrt(var),
        "act_absmax": max(abs(v) for v in finite),
        "act_zero_frac": sum(1 for v in values if v == 0) / len(values),
        "act_nonfinite": float(len(values) - len(finite)),
    }


def activation_stats_float64(x: torch.Tensor) -> dict[str, float]:
    """:func:`activation_stats` with float64 tensor ops, for tensors too large for a Python loop."""
    d = x.double().reshape(-1)
    finite = d[torch.isfinite(d)]
    return {
        "act_mean": finite.mean().item(),
        "act_std": finite.std(correction=0).item(),
        "act_absmax": finite.abs().max().item(),
        "act_zero_frac": (d == 0).double().mean().item(),
        "act_nonfinite": float(d.numel() - finite.numel()),
    }


def dead_fraction(outputs: list[torch.Tensor]) -> float:
    """Units on the last axis that are <= 0 for every row of every micro-batch."""
    units = outputs[0].shape[-1]
    dead = 0
    for u in range(units):
        if all(v <= 0 for out in outputs for v in out.reshape(-1, units)[:, u].tolist()):
            dead += 1
    return dead / units


def l2(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values if math.isfinite(v)))


def replay_sequential(
    module, step: int, accumulate: int, loss_scale: float | None = None
) -> tuple[dict[int, list[torch.Tensor]], dict[int, list[torch.Tensor]], dict[str, torch.Tensor], dict]:
    """Recompute outputs, output gradients and accumulated parameter gradients of ``module.model`` (a Sequential).

    Returns:
        ``(outputs, output_grads, param_grads, weights_before)`` with outputs/grads per layer index, one entry per
        micro-batch of the step.
    """
    records = [r for r in module.record if r[0] == step]
    assert records, f"no recorded batch for step {step}"
    outputs: dict[int, list[torch.Tensor]] = defaultdict(list)
    grads: dict[int, list[torch.Tensor]] = defaultdict(list)
    param_grads: dict[str, torch.Tensor] = {}
    weights = records[0][3]
    ref = module.reference_model(weights)
    for m in ref.modules():  # the reference must be able to keep pre-activations intact
        if isinstance(m, nn.ReLU):
            m.inplace = False
    for _, x, y, w in records:
        for k in w:
            torch.testing.assert_close(w[k], weights[k], rtol=0, atol=0)  # same weights for every micro-batch
        h = x
        kept = []
        for layer in ref:
            h = layer(h)
            if h.requires_grad:
                h.retain_grad()
            kept.append(h)
        loss = module.loss(h, y) / accumulate
        loss.backward()
        for i, t in enumerate(kept):
            outputs[i].append(t.detach().clone())
            if t.grad is not None:
                grads[i].append(t.grad.detach().clone())
    for name, p in ref.named_parameters():
        if p.grad is not None:
            param_grads[name] = p.grad.detach().clone()
    return outputs, grads, param_grads, weights


def weights_after(module, step: int) -> dict[str, torch.Tensor]:
    """The weights once step ``step`` was taken: those of the next recorded step, or the final ones."""
    later = [r for r in module.record if r[0] > step]
    if later:
        return later[0][3]
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}


def flat(tensors: list[torch.Tensor]) -> list[float]:
    return [v for t in tensors for v in t.reshape(-1).tolist()]
