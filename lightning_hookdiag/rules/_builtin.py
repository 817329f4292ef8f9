"""The built-in rules, listed in one place: what a fit runs unless ``RuleConfig.enabled`` narrows it.

A user's rules are passed to the callback (``LayerHealthCallback(extensions=[...])``) and run beside these for that
callback only. The built-in components that gather the facts some of these rules read are listed in
:mod:`lightning_hookdiag.builtins`.
"""

from __future__ import annotations

from lightning_hookdiag.rules import (
    _activations as activations,
)
from lightning_hookdiag.rules import (
    _gradients as gradients,
)
from lightning_hookdiag.rules import (
    _nonfinite as nonfinite,
)
from lightning_hookdiag.rules import (
    _optimizers as optimizers,
)
from lightning_hookdiag.rules import (
    _parameters as parameters,
)
from lightning_hookdiag.rules import (
    _participation as participation,
)
from lightning_hookdiag.rules import (
    _precursors as precursors,
)
from lightning_hookdiag.rules import (
    _readings as readings,
)
from lightning_hookdiag.rules import (
    _spike as spike,
)
from lightning_hookdiag.rules._registry import Rule, by_order

__all__ = ["RULES"]

RULES: tuple[Rule, ...] = tuple(
    by_order(
        [
            nonfinite.nonfinite,
            spike.loss_spike,
            activations.eval_mode,
            activations.dead_units,
            gradients.no_gradient,
            gradients.vanishing_gradient,
            gradients.exploding_gradient,
            activations.saturation,
            activations.precision_headroom,
            parameters.update_ratio,
            parameters.warmup_stuck,
            parameters.stale_gradients,
            parameters.zeroed_gradients,
            activations.input_scale,
            parameters.not_updated,
            parameters.replica_divergence,
            precursors.attention_logits,
            precursors.logit_drift,
            precursors.unbounded_loss,
            readings.loss_below_floor,
            readings.squashed_twice,
            readings.wrong_softmax_dim,
            precursors.update_jump,
            activations.repeated_batch,
            parameters.unregistered_module,
            optimizers.shared_parameters,
            optimizers.scheduler_overstepped,
            participation.stopped_running,
            participation.output_unused,
            participation.idle_optimizer,
            participation.shadowed_method,
        ]
    )
)
"""Every built-in rule, in the order findings of the same layer are listed."""
