"""The rules on what the layers' forward does, over one step's activation statistics and module modes.

``eval_mode``, ``dead_units``, ``saturation``, ``precision_headroom``, ``input_scale`` and ``repeated_batch`` (what
the layers are fed); :func:`activation_scale` is
the per-layer scale that ``loss_spike`` compares too (``docs/rules.md#the-rules``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from lightning_hookdiag.rules.context import Context, finite
from lightning_hookdiag.rules.findings import BATCH, Finding, listing, plural

__all__ = [
    "SATURATING_TYPES",
    "activation_scale",
    "dead_units",
    "eval_mode",
    "input_scale",
    "precision_headroom",
    "repeated_batch",
    "saturation",
]


SATURATING_TYPES: tuple[str, ...] = ("Tanh", "Sigmoid")
"""Module class names the ``saturation`` rule checks."""


def eval_mode(ctx: Context) -> list[Finding]:
    """Rule ``eval_mode``: the first module, in forward order, that ran in eval mode in a training step."""
    if not ctx.eval_mode:
        return []
    given = {name: i for i, name in enumerate(ctx.eval_mode)}
    names = sorted(given, key=lambda n: (*ctx.orders.forward_key(n)[:2], given[n]))
    first, kind = names[0], ctx.eval_mode[names[0]]
    effect = (
        "drops nothing, so the regularisation the model was built with is off"
        if "Dropout" in kind
        else "normalises with its running statistics instead of the batch's and stops updating them"
    )
    others = [f"{n} ({ctx.eval_mode[n]})" for n in names[1:]]
    return [
        Finding(
            rule="eval_mode",
            layer=first,
            step=ctx.step,
            value=float(len(names)),
            threshold=0.0,
            message=f"eval_mode at step {ctx.step}: {first} ({kind}) ran with training=False in a training step while"
            f" the parameters it trains require grad: it {effect}. Is a model.eval() of an inner evaluation left on?"
            f" Call .train() after it{_modules_also(others)}",
            phase="forward",
            stat="training",
        )
    ]


def _modules_also(others: Sequence[str]) -> str:
    if not others:
        return ""
    verb = "is" if len(others) == 1 else "are"
    return f"; {plural(len(others), 'more module')} {verb} in eval mode too: {listing(others)}"


def dead_units(ctx: Context) -> list[Finding]:
    """Rule ``dead_units``: every layer whose dead fraction reaches ``dead_frac_threshold``."""
    threshold = ctx.config.dead_frac_threshold
    return [
        Finding(
            rule="dead_units",
            layer=layer,
            step=ctx.step,
            value=float(frac),
            threshold=threshold,
            message=f"dead_units: {frac:.1%} of the units of {layer} were <= 0 for every sample of step {ctx.step}"
            f" (dead_frac_threshold={threshold:g})",
            phase="forward",
            stat="act_dead_frac",
        )
        for layer, frac in ctx.stat("act_dead_frac").items()
        # NaN (a layer whose units are not tracked) compares False and is skipped with the rest.
        if finite(frac) and frac >= threshold
    ]


def saturation(ctx: Context) -> list[Finding]:
    """Rule ``saturation``: every Tanh/Sigmoid layer whose proven saturated share reaches ``saturation_frac``."""
    level, frac = ctx.config.saturation_level, ctx.config.saturation_frac
    means, stds = ctx.stat("act_mean"), ctx.stat("act_std")
    out: list[Finding] = []
    for layer, kind in ctx.layer_types.items():
        kind = kind.rpartition(".")[2]  # accept "torch.nn.Tanh" as well as "Tanh"
        mean, std = means.get(layer, math.nan), stds.get(layer, math.nan)
        if kind not in SATURATING_TYPES or not (finite(mean) and finite(std)):
            continue
        # Second moment of z in [-1, 1]: z = y for Tanh, z = 2y - 1 for Sigmoid.
        m2 = std * std + mean * mean if kind == "Tanh" else 4 * std * std + (2 * mean - 1) ** 2
        bound = min(1.0, max(0.0, (m2 - level * level) / (1 - level * level)))
        if bound >= frac:
            z = "|y|" if kind == "Tanh" else "|2y - 1|"
            out.append(
                Finding(
                    rule="saturation",
                    layer=layer,
                    step=ctx.step,
                    value=bound,
                    threshold=frac,
                    message=f"saturation: at least {bound:.1%} of the outputs of {layer} ({kind}) have {z} >"
                    f" {level:g} at step {ctx.step} (from act_mean={mean:.3g}, act_std={std:.3g}; saturation_frac="
                    f"{frac:g}): their local gradient is below {1 - level * level:.0%} of its maximum",
                    phase="forward",
                    stat="act_std",
                )
            )
    return out


def activation_scale(values: Mapping[str, Mapping[str, float]]) -> tuple[str, dict[str, float]]:
    """Per-layer activation scale: RMS of the finite outputs from act_mean/act_std, else act_absmax."""
    means, stds = values.get("act_mean") or {}, values.get("act_std") or {}
    if means and stds:
        rms = {k: math.hypot(means[k], stds[k]) for k in means.keys() & stds.keys()}  # no OverflowError at 1e200
        return "act_std", {k: v for k, v in rms.items() if finite(v)}
    return "act_absmax", {k: v for k, v in (values.get("act_absmax") or {}).items() if finite(v)}


# The opt-in precision statistics are logged per target dtype: "<base>_<target>".
_OVERFLOW_STATS = (("act_grad_overflow_frac_", "backward"), ("act_overflow_frac_", "forward"))


def precision_headroom(ctx: Context) -> list[Finding]:
    """Rule ``precision_headroom``: every layer whose share at risk in a target dtype is too large."""
    threshold = ctx.config.overflow_frac_threshold
    out: list[Finding] = []
    for stat, per_layer in ctx.values.items():
        for head, phase in _OVERFLOW_STATS:
            if not stat.startswith(head):
                continue
            target = stat[len(head) :]
            what = "outputs" if phase == "forward" else "output gradients"
            for layer, frac in per_layer.items():
                if finite(frac) and frac > threshold:
                    out.append(
                        Finding(
                            rule="precision_headroom",
                            layer=layer,
                            step=ctx.step,
                            value=float(frac),
                            threshold=threshold,
                            message=f"precision_headroom: {frac:.3g} of the non-zero {what} of {layer} at step"
                            f" {ctx.step} would overflow {target} or sit within 2x of its maximum"
                            f" (overflow_frac_threshold={threshold:g})",
                            phase=phase,
                            stat=stat,
                        )
                    )
            break
    return out


def input_scale(ctx: Context) -> list[Finding]:
    """Rule ``input_scale``: the first layer's output RMS, on the fit's first sampled step, is too large."""
    # Only while the weights are those the fit started from (no earlier sampled step): later, a first layer whose
    # weights blew up (a learning rate too high) has a large output RMS from perfectly scaled inputs.
    if ctx.baseline is not None:
        return []
    limit = ctx.config.input_scale_limit
    stat, scale = activation_scale(ctx.values)
    ran = [layer for layer in scale if layer in ctx.orders.forward]
    if not ran:
        return []
    first = min(ran, key=ctx.orders.forward_key)
    if not scale[first] > limit:
        return []
    return [
        Finding(
            rule="input_scale",
            layer=first,
            step=ctx.step,
            value=scale[first],
            threshold=limit,
            message=f"input_scale: the outputs of {first}, the first layer in forward order, have an RMS of"
            f" {scale[first]:.3g} at step {ctx.step}, the first sampled step of the fit (input_scale_limit={limit:g}):"
            " its inputs are likely far from unit scale (raw 0-255 pixels, unnormalised features); scale them to"
            " mean 0 and std 1",
            phase="forward",
            stat=stat,
        )
    ]


def repeated_batch(ctx: Context) -> list[Finding]:
    """Rule ``repeated_batch``: every row of the step's training batch was one sample repeated."""
    if ctx.stat("batch_repeated").get(BATCH) != 1.0:
        return []
    return [
        Finding(
            rule="repeated_batch",
            layer=BATCH,
            step=ctx.step,
            value=1.0,
            threshold=0.0,
            message=f"repeated_batch at step {ctx.step}: every row of the training batch is the same sample (each"
            " tensor of 2 or more dims, at least 8 rows): the model trains on one example while its loss falls;"
            " does the Dataset's __getitem__ use its index, and do the sampler and the collate function keep the"
            " samples apart?",
            phase="forward",
            stat="batch_repeated",
        )
    ]
