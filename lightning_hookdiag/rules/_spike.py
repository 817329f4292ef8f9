"""Rule ``loss_spike``: the step the sentinel tripped on, and what in the network grew (``docs/rules.md#the-rules``)."""

from __future__ import annotations

from lightning_hookdiag._names import LOSS
from lightning_hookdiag.rules._activations import activation_scale
from lightning_hookdiag.rules._context import Context
from lightning_hookdiag.rules._findings import also
from lightning_hookdiag.rules._registry import Found, rule

__all__: list[str] = []


@rule(order=1, phase="forward", stat="loss", reads=["trip"], event=True)
def loss_spike(ctx: Context) -> list[Found]:
    """The sentinel's spike, at the first layer whose activation scale grew."""
    trip = ctx.trip
    assert trip is not None  # reads=["trip"]
    if trip.kind != "loss_spike":
        return []
    growth_limit = ctx.config.spike_growth
    against = "" if trip.baseline is None else f" the median of recent steps ({trip.baseline:.3g})"
    factor = (
        f" is {trip.loss / trip.baseline:.3g}x{against}"
        if trip.baseline and trip.baseline > 0
        else f" rose far above{against or ' its recent values'}"
    )
    head = f"loss_spike: the loss {trip.loss:.3g} at step {ctx.step}{factor}"
    if not trip.replayed:
        tail = f"; not replayed because {trip.reason}; step {ctx.step + 1} is sampled"
    elif ctx.baseline is None:
        tail = "; no earlier sampled step to compare the layers with"
    else:
        stat, now = activation_scale(ctx.values)
        _, before = activation_scale(ctx.baseline.values)
        grown = [
            (name, now[name] / before[name])
            for name in sorted(now.keys() & before.keys(), key=ctx.orders.forward_key)
            if before[name] > 0 and now[name] > growth_limit * before[name]
        ]
        if grown:
            layer, growth = grown[0]
            tail = (
                f"; the activation scale of {layer} grew {growth:.3g}x since step {ctx.baseline.step}, the first layer"
                f" in forward order to grow more than spike_growth={growth_limit:g}"
                f"{also([n for n, _ in grown[1:]], ' after it', 'grown')}"
            )
            return [Found(layer, growth, head + tail, growth_limit, stat=stat)]
        tail = (
            f"; no observed layer's activation scale grew more than spike_growth={growth_limit:g} since step"
            f" {ctx.baseline.step}, so the spike comes from the targets or the loss, not from the network"
            " (inputs far off their usual scale would have grown the first layer)"
        )
    return [Found(LOSS, trip.loss, head + tail, trip.baseline or 0.0)]
