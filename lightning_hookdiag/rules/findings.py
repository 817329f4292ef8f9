"""What the rules find: a :class:`Finding`, and the phrases every message shares (:func:`plural`, :func:`also`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MAX_LISTED", "PHASES", "Finding", "also", "listing", "plural"]


PHASES: tuple[str, ...] = ("forward", "backward")


# Names of the other affected layers listed in a nonfinite message; the count is always complete.
MAX_LISTED = 3


@dataclass(frozen=True)
class Finding:
    """One rule firing for one layer on one step.

    Attributes:
        rule: Name from :data:`~lightning_hookdiag.rules.RULES`.
        layer: The layer (module name) the finding is about; for findings about parameters, the parameter's
            module: the longest layer of ``forward_order``/``backward_order`` that prefixes its dotted name, else the
            name minus its last segment. ``LOSS`` for the loss itself; for a NaN made by functional code between
            two layers, the module whose forward made it (not necessarily selected), or ``ROOT``.
            ``exploding_gradient``: the layer whose backward amplifies the gradient most; ``no_gradient``: the first
            cut-off layer in forward order; ``eval_mode``: the first module in eval mode in forward order (a
            BatchNorm or Dropout, selected or not).
        step: The optimizer step the statistics describe.
        value: The observed value compared with ``threshold``: a count of non-finite elements or parameters
            (``nonfinite``), a dead fraction, a gradient-norm ratio, a lower bound on the saturated share, the
            number of cut-off layers (``no_gradient``) or of modules in eval mode (``eval_mode``), the largest bound
            on the moved share of a module's parameters (``not_updated``; for parameters no optimizer holds, their
            largest gradient norm), the largest relative spread of norms (``replica_divergence``).
        threshold: The threshold it crossed (``0.0`` for ``nonfinite``: any count above it fires).
        message: Human-readable sentence naming the rule and the layer.
        phase: ``"forward"`` (about activations) or ``"backward"`` (about gradients).
        stat: The statistic that triggered it (``act_nonfinite``, ``act_grad_nonfinite``, ``param_grad_norm``,
            ``param_norm`` (non-finite weights, replicas that differ), ``act_dead_frac``, ``act_grad_norm``,
            ``act_std``, ``act_absmax``, ``param_update_ratio`` (weights that did not move; ``param_grad_norm``
            for parameters no optimizer holds), ``training`` (``eval_mode``: the module's mode), or ``loss`` for a
            finding about the loss itself), e.g. to ignore non-finite gradients on steps that an fp16 ``GradScaler``
            skips.
    """

    rule: str
    layer: str
    step: int
    value: float
    threshold: float
    message: str
    phase: str
    stat: str

    def __str__(self) -> str:
        return self.message


def plural(n: int, word: str) -> str:
    """``n word``, with the plural ``s`` unless ``n`` is 1."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def listing(names: Sequence[str]) -> str:
    """The first :data:`MAX_LISTED` of ``names``, comma-separated, with ``...`` when there are more."""
    shown = ", ".join(names[:MAX_LISTED])
    return shown + (", ..." if len(names) > MAX_LISTED else "")


def also(others: Sequence[str], where: str, what: str) -> str:
    """``"; N more layer(s){where} is/are also {what}: <listing>"``, or ``""`` without ``others``."""
    if not others:
        return ""
    verb = "is" if len(others) == 1 else "are"
    return f"; {plural(len(others), 'more layer')}{where} {verb} also {what}: {listing(others)}"
