"""Hand-written reference computations, independent of the package's sufficient-statistics path.

Activations and gradients are recomputed from the weights and inputs a recorded training batch saw, with
``retain_grad()`` on every intermediate output and the loss scaled by ``1/accumulate`` as Lightning does; statistics
are then taken element by element in Python floats.

Not references, and named here only so that tests share them: drivers of the package's own path
(``activation_moments``, ``gradient_moments``, ``square_sum``, ``histogram_counts``, ``record``) and structural probes
that read its private fields (``pending_rows``, ``recorder_held``, ``workspace_held``, ``tracker_held``).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_hookdiag._hooks import first_floating_tensor
from lightning_hookdiag._stats import (
    ACT_ROW,
    GRAD_ROW,
    Workspace,
    activation_row,
    chunked_sum,
    chunks,
    gradient_moments_from_rows,
    gradient_row,
    moments_from_rows,
    reduce_tensor,
)


def record(recorder: Any, layer: int, output: Any) -> None:
    """Hand a raw module output to a recorder as the hook set does: its first floating-point tensor."""
    recorder.on_tensor(layer, first_floating_tensor(output))


def pending_rows(recorder: Any) -> tuple[int, int]:
    """Output and gradient rows a recorder's call tables hold since its last take."""
    return tuple(sum(len(held) for _, held, _ in recorder._tables[kind]._blocks) for kind in ("act", "grad"))


def recorder_held(recorder: Any) -> tuple[int, int]:
    """``(rows of a recorder's output call table, call patterns whose device copies it caches)``: both bounded."""
    table = recorder._tables["act"]
    return sum(block.shape[0] for block, _, _ in table._blocks), len(table._patterns)


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


def activation_moments(
    x: Tensor, dtype: torch.dtype = torch.float64, workspace: Workspace | None = None
) -> tuple[Tensor, Tensor]:
    """Additive and max-reducible sufficient statistics of one floating-point tensor.

    NaN and Inf are counted, then treated as absent: they never make the mean, std or absmax unreadable. This is
    :func:`activation_row` and :func:`moments_from_rows` for one tensor (the recorder writes rows and converts a
    whole step's rows at once).

    Args:
        x: Any floating-point tensor (any dtype, any device).
        dtype: Dtype of the returned additive vector and of the accumulation.
        workspace: Scratch memory reused across calls; ``None`` allocates temporaries.

    Returns:
        ``(moments, absmax)``: ``moments`` is a ``[5]`` vector ``[count, nonzero, nonzero_finite, sum, sum_sq]``
        (sum and sum of squares over finite elements), ``absmax`` the 0-d maximum of ``|x|`` over finite elements.

    Example:
        >>> moments, absmax = activation_moments(torch.tensor([0.0, 1.0, -3.0, 4.0, float("nan")]))
        >>> [round(m, 5) for m in moments.tolist()], absmax.item()
        ([5.0, 4.0, 3.0, 2.0, 26.0], 4.0)
    """
    moments, absmax = moments_from_rows(*_piece_rows(x, ACT_ROW, activation_row, dtype, workspace))
    return moments.sum(0), absmax.amax(0)


def gradient_moments(g: Tensor, dtype: torch.dtype = torch.float64, workspace: Workspace | None = None) -> Tensor:
    """Additive sufficient statistics of one gradient tensor: ``[count, sum_sq over finite, nonfinite count]``.

    Example:
        >>> gradient_moments(torch.tensor([3.0, 4.0, float("inf")])).tolist()
        [3.0, 25.0, 1.0]
    """
    return gradient_moments_from_rows(*_piece_rows(g, GRAD_ROW, gradient_row, dtype, workspace)).sum(0)


def _piece_rows(
    x: Tensor,
    width: int,
    reduce: Callable[[Tensor, Tensor, Workspace | None], Tensor],
    dtype: torch.dtype,
    workspace: Workspace | None,
) -> tuple[Tensor, Tensor]:
    """``(rows, counts)``: one ``[width]`` row per piece of ``x`` (one row of zeros, count 0, for an empty tensor)."""
    pieces = list(chunks(x)) if x.numel() else []
    rows = torch.zeros(max(len(pieces), 1), width, dtype=dtype, device=x.device)
    for piece, row in zip(pieces, rows, strict=False):
        reduce(piece, row, workspace)
    return rows, torch.tensor([p.numel() for p in pieces] or [0], dtype=dtype, device=x.device)


def square_sum(x: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """Sum of squares of a tensor as a 0-d ``dtype`` tensor, accumulated in ``dtype``; NaN/Inf propagate.

    Example:
        >>> f"{square_sum(torch.tensor([3e30, 4e30])).item():.6g}"  # float32 squares would overflow
        '2.5e+61'
    """

    def piece_square_sum(piece: Tensor) -> Tensor:
        wide = piece.detach().reshape(-1).to(dtype)
        return torch.dot(wide, wide)

    return chunked_sum(piece_square_sum, x) if x.numel() else torch.zeros((), dtype=dtype, device=x.device)


def histogram_counts(x: Tensor, edges: Tensor) -> Tensor:
    """Counts of the finite elements of ``x`` in the ``len(edges) + 1`` bins ``edges`` delimit, as the recorder bins.

    Bin ``i`` holds ``edges[i-1] < x <= edges[i]``.

    Example:
        >>> x = torch.tensor([-5.0, 0.0, 0.05, 3.0, float("nan")])
        >>> histogram_counts(x, torch.tensor([-1.0, 0.0, 1.0])).tolist()
        [1.0, 1.0, 1.0, 1.0]
    """
    _, hist = reduce_tensor(x, None, Workspace(), edges=edges)
    assert hist is not None
    return hist


def workspace_held(workspace: Workspace) -> dict[tuple[str, torch.dtype], int]:
    """Elements a :class:`Workspace` holds per role and dtype (none once released, nor a view of a dropped buffer)."""
    held = {(role, dtype): b.numel() for (role, _, dtype), b in workspace._buffers.items()}
    return held if held or not workspace._views else {("views", torch.uint8): len(workspace._views)}


def tracker_held(tracker: Any) -> tuple[int, int]:
    """``(weight elements in snapshots, parameter sets cached)`` of a ``ParameterTracker``: both must stay bounded."""
    return sum(b.numel() for _, _, before in tracker._snapshots for b in before), len(tracker._patterns)


def precision_counts(values: list[float], target: torch.dtype) -> tuple[int, int, int]:
    """Non-zero (non-NaN), underflow and overflow-risk counts by float comparison in Python (float64)."""
    info = torch.finfo(target)
    tiny, half_max = float(info.tiny), float(info.max) / 2
    nonzero = [v for v in values if v == v and v != 0]
    return (
        len(nonzero),
        sum(1 for v in nonzero if abs(v) < tiny),
        sum(1 for v in nonzero if abs(v) >= half_max),
    )


def outlier_reference(chunks: list[torch.Tensor]) -> dict[str, float]:
    """Kurtosis and absmax/std of the finite elements of all chunks together, in float64, two-pass."""
    values = torch.cat([c.reshape(-1).double() for c in chunks])
    values = values[torch.isfinite(values)]
    centred = values - values.mean()
    m2 = (centred**2).mean()
    return {
        "act_kurtosis": ((centred**4).mean() / m2**2).item(),
        "act_absmax_over_std": (values.abs().max() / m2.sqrt()).item(),
    }


def bin_counts(values: list[float], edges: list[float]) -> list[float]:
    """Per-bin counts of the finite ``values`` by bisection, in Python floats."""
    counts = [0.0] * (len(edges) + 1)
    for v in values:
        if math.isfinite(v):
            counts[bisect.bisect_left(edges, v)] += 1  # bin i holds edges[i-1] < v <= edges[i]
    return counts
