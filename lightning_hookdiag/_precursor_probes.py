"""Instability precursors: the attention-logit (``attn_logit_max``) and output-logit statistics, on by default.

:class:`AttentionProbe`, a torch-function mode entered only during a sampled training forward, measures the attention
calls of the modules in scope; :class:`PrecursorProbes`, the component, runs it and measures the output layer
(definitions, bounds and blind spots: ``docs/statistics.md#instability-precursors``). The mode is entered while the
attention modules in scope run (:func:`attention_modules`), or for the whole forward in a model without any such
module, and sees every call made there: ``nn.MultiheadAttention``'s fused fast path runs only in eval mode without
grad and refuses inputs with a torch-function handler (the mode gives every tensor one), so the Python path runs;
compiled models run sampled batches eagerly (``force_eager``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from typing_extensions import override

from lightning_hookdiag import _stats as stats
from lightning_hookdiag._aggregation import LayerStatsAggregator
from lightning_hookdiag._hooks import first_floating_tensor
from lightning_hookdiag._selection import named_modules, unmatched_error
from lightning_hookdiag._torch_internals import calling_modules, exit_mode, in_backward
from lightning_hookdiag._vocabulary import OUTPUT_LAYER_STATS, PRECURSOR_STATS
from lightning_hookdiag.components import Component, Setup, WindowStart, component, module_hook
from lightning_hookdiag.rules._precursors import SIGMOID_LINK, SOFTMAX_LINK
from lightning_hookdiag.rules._readings import NORMALISED_OVER_WRONG_DIM, SQUASHED_TWICE_SIGMOID, SQUASHED_TWICE_SOFTMAX

__all__ = [
    "AttentionProbe",
    "READING_FACTS",
    "PrecursorProbes",
    "Reading",
    "attention_modules",
    "attention_scope",
    "eager_logit_absmax",
    "output_link",
    "nll_sign",
    "probes",
    "read_output",
    "sdpa_logit_absmax",
]

MASKED = -5000.0
"""Eager softmax inputs at or below this are masked entries, not logits."""
MAX_ROWS = 32
"""Query rows measured per attention call at most (evenly strided, the last one included)."""

_SOFTMAX = frozenset({F.softmax, torch.softmax, Tensor.softmax})

# F.cross_entropy is log_softmax then nll_loss; an nll_loss straight on the output reads it as log-probabilities.
_LINKS = dict.fromkeys(
    ("LogSoftmaxBackward0", "SoftmaxBackward0", "NllLossBackward0", "NllLoss2DBackward0"), SOFTMAX_LINK
)
_LINKS |= dict.fromkeys(
    ("BinaryCrossEntropyWithLogitsBackward0", "SigmoidBackward0", "LogSigmoidBackward0"), SIGMOID_LINK
)
READING_FACTS = ("loss_misread", "loss_misread_size", "nll_below_zero")
"""What :class:`PrecursorProbes` pools of :func:`read_output` (for the rules, not logged; NaN where none): the
largest misread code, the size of the dim it normalised, and the largest ``-loss`` of an ``nll_loss`` that read the
output layer (positive: the loss was below its floor of 0)."""
MAX_GRAPH_NODES = 1024
"""Autograd nodes :func:`output_link` visits at most, from the loss towards the output."""

# Nodes that move no value between a squash and the loss that reads it: the squash's output reaches the loss as it is.
_PASS_THROUGH = frozenset(
    {
        "ViewBackward0",
        "ReshapeAliasBackward0",
        "UnsafeViewBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "UnsqueezeBackward0",
        "CloneBackward0",
        "ToCopyBackward0",
        "AliasBackward0",
    }
)
# A loss node, or a log_softmax that a loss reads: the consumer whose input a squash below it must not be.
_CONSUMERS = frozenset({"BinaryCrossEntropyWithLogitsBackward0", "LogSoftmaxBackward0", "NllLossBackward0"})
_NLL = frozenset({"NllLossBackward0", "NllLoss2DBackward0"})
_SCALINGS = frozenset({"DivBackward0", "MulBackward0"})


class Reading:
    """How a loss's autograd graph reads the output layer's output: what :func:`read_output` found on its walk."""

    def __init__(self) -> None:
        self.link = 0
        """``SOFTMAX_LINK``, ``SIGMOID_LINK`` or 0, as :func:`output_link` returns it."""
        self.reached = False
        """Whether the walk reached the output node."""
        self.misread = 0.0
        """One of the codes of :mod:`lightning_hookdiag.rules._readings` (the largest found), 0 where none."""
        self.size = 0
        """For a squash read twice or over the wrong dim: the size of the dim it normalised (1 for a sigmoid)."""


def _dim(node: Any) -> int | None:
    """A (log-)softmax node's ``dim``, made non-negative (torch reports ``-1`` as ``2**64 - 1``), or ``None``."""
    try:  # a graph already back-propagated has freed its saved tensors
        result = getattr(node, "_saved_result", None)
    except RuntimeError:
        return None
    if not isinstance(result, Tensor) or result.dim() == 0:
        return None
    dim = int(node._saved_dim)
    if dim >= 1 << 63:
        dim -= 1 << 64
    return dim % result.dim()


def _judge(reading: Reading, name: str, node: Any, consumer: tuple[str, Any] | None) -> None:
    """Note a squash read twice, or normalised over another dim than the ``nll_loss`` reading it takes as classes."""
    if consumer is None:
        return
    kind, reader = consumer
    if name == "SigmoidBackward0" and kind == "BinaryCrossEntropyWithLogitsBackward0":
        reading.misread, reading.size = max(reading.misread, SQUASHED_TWICE_SIGMOID), max(reading.size, 1)
    elif name == "SoftmaxBackward0" and kind == "LogSoftmaxBackward0":
        dim = _dim(node)
        if dim is not None and reading.misread < SQUASHED_TWICE_SOFTMAX:
            reading.misread, reading.size = SQUASHED_TWICE_SOFTMAX, int(node._saved_result.shape[dim])
    elif name == "LogSoftmaxBackward0" and kind in _NLL and reader is not None:
        dim = _dim(node)
        shape = node._saved_result.shape if dim is not None else ()
        classes = 1 if len(shape) > 1 else 0  # nll_loss reads dim 1 (dim 0 unbatched) as the classes
        if dim is not None and dim != classes and shape[dim] > 1:
            reading.misread, reading.size = NORMALISED_OVER_WRONG_DIM, int(shape[dim])


def read_output(loss: Any, output: Any, limit: int = MAX_GRAPH_NODES) -> Reading:
    """How the loss's autograd graph reads the ``output`` node: one breadth-first walk from ``loss`` (its ``grad_fn``).

    The walk does not go below ``output`` (the output tensor's ``grad_fn``): the nodes between a loss and the head
    are few (a cross entropy: two, and a reshape), so the model below the head is not walked. Host-only work on the
    autograd graph (a node's saved ``dim`` and its result's shape, no value): no kernel, no sync. Besides the link
    (:func:`output_link`), it notes each squash whose output a logits-taking consumer reads as it is (through views
    and copies only), and a ``log_softmax`` that ``nll_loss`` reads directly over another dim than its classes.
    """
    reading = Reading()
    queue: deque[tuple[Any, int, tuple[str, Any] | None]] = deque([(loss, 0, None)])
    seen: set[tuple[int, int]] = set()
    while queue and len(seen) < limit:
        node, link, consumer = queue.popleft()
        if node is None or (id(node), link) in seen:
            continue
        seen.add((id(node), link))
        name = type(node).__name__
        _judge(reading, name, node, consumer)
        if node is output:
            reading.reached = True
            reading.link = max(reading.link, link)
            continue
        link = max(link, _LINKS.get(name, 0))
        if name in _CONSUMERS or name in _NLL:
            below: tuple[str, Any] | None = (name, node)
        elif name in _PASS_THROUGH and consumer is not None:
            below = (consumer[0], None)  # the same consumer, no longer a direct one
        else:
            below = None
        queue.extend((child, link, below) for child, _ in node.next_functions)
    return reading


def output_link(loss: Any, output: Any, limit: int = MAX_GRAPH_NODES) -> int:
    """Whether the loss's autograd graph reaches the ``output`` node through a softmax- or sigmoid-family node.

    Returns:
        ``SOFTMAX_LINK`` or ``SIGMOID_LINK`` (:mod:`lightning_hookdiag.rules._precursors`; the largest on any path), or
        0 where no path has one or the output is not reached within ``limit`` nodes (:func:`read_output`).
    """
    return read_output(loss, output, limit).link


def nll_sign(loss: Any) -> Tensor | float | None:
    """The sign the loss's scalings give an ``nll_loss`` at its root, or ``None`` where its root is none.

    An ``nll_loss`` (``cross_entropy`` included) of log-probabilities is never negative (``-log p`` with ``p <= 1``,
    weights ``>= 0``): a negative one proves that its input is not log-probabilities. The loss may be that
    ``nll_loss`` divided or multiplied by Python numbers (Lightning divides it by ``accumulate_grad_batches``): their
    signs' product (a CPU scalar, never read on the host; ``1.0`` with no scaling) times the loss has the
    ``nll_loss``'s sign. A scaling by a tensor that requires grad, or by anything but a CPU scalar, is not followed.
    """
    node, sign = loss, None
    while node is not None and type(node).__name__ in _SCALINGS:
        try:  # a graph already back-propagated has freed its saved tensors
            other = getattr(node, "_saved_other", None)
        except RuntimeError:
            return None
        if not (isinstance(other, Tensor) and other.dim() == 0 and other.device.type == "cpu"):
            return None
        if node.next_functions[1][0] is not None:  # a factor that requires grad
            return None
        # A CPU op: no device, no read. A Python number's saved tensor is a "wrapped number", which a dispatch mode
        # (a profiler's op counter) hands to aten as the bare number; a copy first makes it a plain tensor.
        factor = torch.sign(other.to(torch.float64, copy=True))
        sign = factor if sign is None else sign * factor
        node = node.next_functions[0][0]
    if node is None or type(node).__name__ not in _NLL:
        return None
    return 1.0 if sign is None else sign


def _bounds(shape: Sequence[int], per_row: int, budget: int) -> tuple[int, slice]:
    # How many leading batch elements and which rows (dim -2) of a shape tensor stay within the bounds: the rows are
    # evenly strided and end with the last one (in a causal model the row that sees every key).
    lead = math.prod(shape[1:-2]) * per_row  # logits per row of one batch element
    batch = min(shape[0] if len(shape) > 2 else 1, max(1, budget // max(lead, 1)))
    rows = max(1, min(MAX_ROWS, budget // max(batch * lead, 1)))
    stride = max(1, math.ceil(shape[-2] / rows))
    return batch, slice((shape[-2] - 1) % stride, None, stride)


def _cut(t: Tensor, batch: int, rows: slice | None = None, length: int = 0) -> Tensor:
    """``t``'s first ``batch`` elements (if it has that dim) and ``rows`` of dim -2 (if given and not broadcast)."""
    if t.dim() > 2 and t.shape[0] > batch:
        t = t[:batch]
    return t[..., rows, :] if rows is not None and t.shape[-2] == length and length > 1 else t


def sdpa_logit_absmax(
    query: Tensor,
    key: Tensor,
    scale: float | None = None,
    budget: int = 1 << 22,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
) -> Tensor:
    """The largest ``|q . k| * scale`` over the unmasked logits of a bounded subsample of query rows (0-d float32).

    Args:
        query: ``[..., heads, L, E]`` (or ``[..., L, E]``), as given to ``F.scaled_dot_product_attention``.
        key: ``[..., heads_k, S, E]``; ``heads_k`` may divide ``heads`` (grouped-query attention).
        scale: sdpa's ``scale=``; ``None`` means ``1 / sqrt(E)``.
        budget: Logits computed per call at most (fewer batch elements are used beyond it).
        attn_mask: sdpa's mask: boolean (``True``: attend) or additive (entries ``<= -5000`` count as masked).
        is_causal: sdpa's causal flag (row ``i`` attends to keys ``0..i``).
    """
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    length, keys = query.shape[-2], key.shape[-2]
    batch, rows = _bounds(query.shape, keys, budget)
    q, k = _cut(query, batch, rows, length).float(), _cut(key, batch).float()
    shape = (*q.shape[:-1], keys)
    if q.dim() >= 3 and k.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        heads, kv = q.shape[-3], k.shape[-3]
        # Query head h attends with key head h // (heads // kv), as sdpa's enable_gqa and HF's repeat_kv pair them.
        q = q.reshape(*q.shape[:-3], kv, heads // kv, *q.shape[-2:])
        k = k.unsqueeze(-3)
    logits = torch.matmul(q, k.transpose(-1, -2)).reshape(shape).abs()
    keep = None
    if isinstance(attn_mask, Tensor):
        mask = _cut(attn_mask, batch, rows, length)
        keep = mask if mask.dtype == torch.bool else mask > MASKED
    if is_causal:  # sdpa's causal mask is aligned top-left
        causal = torch.arange(keys, device=logits.device) <= torch.arange(length, device=logits.device)[rows, None]
        keep = causal if keep is None else keep & causal
    if keep is not None:
        logits = torch.where(keep, logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    # |x| * s is monotone in |x|, so scaling the maximum is the maximum of the scaled products (also in float).
    return logits.amax() * abs(scale)


def eager_logit_absmax(scores: Tensor, budget: int = 1 << 22) -> Tensor:
    """The largest ``|x|`` over unmasked entries (``> -5000``) of a softmax input's bounded row subsample."""
    batch, rows = _bounds(scores.shape, scores.shape[-1], budget)
    x = _cut(scores, batch, rows, scores.shape[-2]).float()
    return torch.where(x > MASKED, x.abs(), torch.zeros((), dtype=x.dtype, device=x.device)).amax()


def _arg(args: Sequence[Any], kwargs: Mapping[str, Any], index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


class AttentionProbe(TorchFunctionMode):
    """Per-module maximum attention logits of the attention calls made while the mode is entered.

    A call counts for the innermost ``Module.__call__`` on the Python stack if it is one of ``modules`` (whose order
    :attr:`names` keeps); every other torch function costs the handler a dictionary lookup.
    """

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        super().__init__()
        self.names: list[str] = list(modules)
        self._slot: dict[int, int] = {id(m): i for i, m in enumerate(modules.values())}
        self._in_mha = 0  # nesting depth of F.multi_head_attention_forward, whose eager softmax is 3-D
        self.reset()

    def reset(self, device: torch.device | None = None) -> None:
        """Forget every measurement (``device``: where the maxima live)."""
        self.maxima = torch.full((len(self.names),), -1.0, device=device)
        """Per module, the largest logit seen since :meth:`reset` (``-1``: no call seen)."""
        self.calls = {"sdpa": 0, "softmax": 0}
        """Attention calls measured since :meth:`reset`, by kind."""

    def __torch_function__(
        self, func: Any, types: Sequence[type], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward:
            # A Python composite that is itself a torch function: the mode is off inside its handler, so the sdpa or
            # softmax it calls would go unseen. Run its body with the mode on (one hop skipped: no recursion).
            self._in_mha += 1
            try:
                with self:
                    return torch.overrides.redispatch_function(func, types, args, kwargs)
            finally:
                self._in_mha -= 1
        out = func(*args, **kwargs)
        if (func is F.scaled_dot_product_attention or func in _SOFTMAX) and not in_backward():
            self._observe(func, args, kwargs)
        return out

    def _observe(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        slot = self._slot.get(id(next(calling_modules(2), None)))
        if slot is None:
            return
        with torch.no_grad():
            kind = "sdpa" if func is F.scaled_dot_product_attention else "softmax"
            if kind == "sdpa":
                query, key = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")
                if not (isinstance(query, Tensor) and isinstance(key, Tensor)) or query.is_nested:
                    return
                mask, causal = _arg(args, kwargs, 3, "attn_mask"), bool(_arg(args, kwargs, 5, "is_causal", False))
                value = sdpa_logit_absmax(query, key, kwargs.get("scale"), attn_mask=mask, is_causal=causal)
            else:
                scores, dim = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "dim")
                if not isinstance(scores, Tensor) or dim not in (-1, scores.dim() - 1):
                    return
                # Eager attention's scores are [batch, heads, queries, keys]; nn.MultiheadAttention folds the heads
                # into the batch. A 3-D softmax elsewhere is as likely a per-token classifier's probabilities.
                if scores.dim() < (3 if self._in_mha else 4) or not scores.is_floating_point() or scores.is_nested:
                    return
                value = eager_logit_absmax(scores)
            if self.maxima.device != value.device:
                self.maxima = self.maxima.to(value.device)
            self.maxima[slot] = torch.maximum(self.maxima[slot], value.to(self.maxima.dtype))
        self.calls[kind] += 1


class PrecursorProbes(Component):
    """The precursor statistics of one fit: the attention probe's, and ``log Z`` and ``|logit|`` of the output layer.

    With one output candidate (a named output layer) its every call is measured; with several (the selection), the
    output of the last one to run in a micro-batch, at the micro-batch's end. Pooled in ``precursor_sums``, ``[sum of
    log Z, rows, loss, processes that saw a loss]``, and ``precursor_maxima``: the largest ``|logit|``, the output
    layer's index among the candidates (so that every process names the same one: the latest in selection order any
    of them measured), the :func:`output_link` of the loss to that output (the largest seen), then the attention
    maxima (``-1``: no call seen).

    The attention probe's mode is entered only while an attention module of the scope runs (:func:`attention_modules`;
    a Python handler on every torch call of the rest of the forward and of the statistics' hooks cost the transformer
    benchmark milliseconds per sampled step). A scope without one (attention written inline in a block) has the mode
    entered for the whole sampled forward, until a sampled forward that reached its loss made no attention call.

    Args:
        stats: The resolved ``stats=`` names; only those of :data:`~lightning_hookdiag.PRECURSOR_STATS` matter.
        attention_scope: ``{name: module}`` calls may be attributed to (selected modules and their ancestors).
        output_candidates: ``{name: module}`` output-layer candidates (the named output layer, or the selection).
        aggregator: Where the states are registered.
        selection_outputs: The candidates are the hook set's modules, in its order (``output_layer=None``): their
            outputs come through :attr:`on_output`, the recorder's sink, rather than through a hook of this
            component's own on each (97 registered and called per sampled step on a 48-block MLP: 0.45 ms).
    """

    provides = ("precursors",)

    def __init__(
        self,
        stats: Sequence[str],
        attention_scope: Mapping[str, nn.Module],
        output_candidates: Mapping[str, nn.Module],
        aggregator: LayerStatsAggregator,
        selection_outputs: bool = False,
    ) -> None:
        self.attention = AttentionProbe(attention_scope) if "attn_logit_max" in stats else None
        self.output_stats = tuple(s for s in OUTPUT_LAYER_STATS if s in stats)
        self._outputs = dict(output_candidates) if self.output_stats else {}
        if self.output_stats and selection_outputs:
            self.on_output = self._note_output
        self._last: tuple[int, Tensor] | None = None
        self._node: Any = None  # the autograd node of the output measured last, until the forward ends
        self.link = 0
        """The largest :func:`output_link` of a loss to the output layer since :meth:`reset`."""
        self.misread = (0.0, 0)
        """The largest :attr:`Reading.misread` code since :meth:`reset`, and its :attr:`Reading.size`."""
        self._nll_below: Tensor | None = None  # the largest -loss of an nll_loss root that read the output
        self._zero(None)
        self.attention_on = self.attention is not None
        """Whether the mode is entered on sampled forwards: off once a sampled step's forward made no attention call
        in scope (a model without attention pays for no handler on its later sampled steps)."""
        self._attention_modules = attention_modules(attention_scope) if self.attention is not None else []
        """The attention modules of the scope: where there are some, the mode is entered only while one of them
        runs, so that the rest of the forward and the statistics' own torch calls pass no Python handler."""
        self._inside = 0  # attention modules running (nested ones count too)
        self._forwards = 0
        self._loss: Tensor | None = None
        self._owners: dict[str, list[str]] = {}
        self._aggregator = aggregator
        n = len(self.attention.names) if self.attention is not None else 0
        aggregator.add_state("precursor_sums", aggregator.new_state(4, dtype=torch.float64), "sum")
        aggregator.add_state("precursor_maxima", aggregator.new_state(3 + n, fill=-1.0, dtype=torch.float64), "max")
        aggregator.add_state("loss_reading", aggregator.new_state(3, fill=-math.inf, dtype=torch.float64), "max")

    def _zero(self, device: torch.device | None) -> None:
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)
        """The output layer's ``[sum of log Z over rows, rows]`` since :meth:`reset`."""
        self.absmax = torch.full((), -1.0, device=device)
        """The output layer's largest ``|logit|`` since :meth:`reset` (``-1``: no output seen)."""
        self.layer = -1
        """Index among the candidates of the layer measured last (the output layer; ``-1``: none)."""

    @override
    def attach(self) -> None:
        if self.attached:
            return
        if self.attention_on and self.attention is not None:  # attention_on implies a probe
            self._attach_attention(self.attention)
        if self.output_stats:
            exits = self.hold()  # attached: the recorder hands outputs to attached components only
            for i, module in enumerate(self._outputs.values() if self.on_output is None else ()):
                exits.enter_context(module.register_forward_hook(module_hook(self._output_hook, i)))

    def _attach_attention(self, probe: AttentionProbe) -> None:
        """Enter the mode for the whole forward, or, where the scope has attention modules, only while one runs."""
        exits = self.hold()
        self._inside = 0
        exits.callback(exit_mode, probe)
        if not self._attention_modules:
            # TorchFunctionMode.__enter__ is unannotated; untyped_calls_exclude matches the receiver's class (ours).
            probe.__enter__()  # type: ignore[no-untyped-call]
            return
        for module in self._attention_modules:
            exits.enter_context(module.register_forward_pre_hook(module_hook(self._enter_attention, probe)))
            # First among the module's forward hooks, and also when its forward raises: the other hooks (its
            # statistics) run outside the mode.
            leave = module_hook(self._leave_attention, probe)
            exits.enter_context(module.register_forward_hook(leave, prepend=True, always_call=True))

    def _enter_attention(self, probe: AttentionProbe, module: nn.Module, args: Any) -> None:
        if self._inside == 0:
            probe.__enter__()  # type: ignore[no-untyped-call]
        self._inside += 1

    def _leave_attention(self, probe: AttentionProbe, module: nn.Module, args: Any, output: Any) -> None:
        self._inside -= 1
        if self._inside == 0:
            exit_mode(probe)

    def _output_hook(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward():
            return
        tensor = first_floating_tensor(output)
        if tensor is not None:
            self._note_output(index, tensor)

    def _note_output(self, index: int, tensor: Tensor) -> None:
        """Keep the output ``tensor`` of candidate ``index`` if it can be logits (the last kept one is measured)."""
        if tensor.dim() < 2 or tensor.numel() == 0 or not tensor.requires_grad:
            return
        self._last = (index, tensor)
        if len(self._outputs) == 1:  # a named output layer: every call is measured
            self._measure_last()

    @override
    def end_forward(self, loss: Tensor | None) -> None:
        """Measure the output, note how the loss reads it, and detach everything: the probes never see backward."""
        self._measure_last()
        if loss is not None and self._node is not None:
            # Host work on the graph the forward built, once per sampled micro-batch: no handler on any torch call.
            self._read(loss, read_output(loss.grad_fn, self._node))
        if loss is not None and self.attached:
            if self.attention_on:  # the mode is entered
                self._forwards += 1  # a forward that reached its loss under the mode
            value = loss.detach().double().reshape(())
            self._loss = value if self._loss is None else self._loss + value
        self.remove()

    def _read(self, loss: Tensor, reading: Reading) -> None:
        """Keep what the walk found; for an ``nll_loss`` that read the output, its value (on the device, no sync)."""
        self.link = max(self.link, reading.link)
        self.misread = max(self.misread, (reading.misread, reading.size))
        sign = nll_sign(loss.grad_fn) if reading.reached else None
        if sign is not None:
            below = -(loss.detach().double() * sign).reshape(())
            self._nll_below = below if self._nll_below is None else torch.maximum(self._nll_below, below)

    @override
    def end_micro_batch(self) -> None:  # also without a backward (a replay, a training_step that returned no loss)
        self._measure_last()

    def _measure_last(self) -> None:
        """Measure the output kept by the last hook that fired, then let it go."""
        last, self._last = self._last, None
        if last is None:
            return
        index, tensor = last
        self._node = tensor.grad_fn
        with torch.no_grad():
            logits = tensor.detach()
            if self.sums.device != logits.device:
                self._zero(logits.device)
            # A block of rows at a time: the float32 copy and the temporaries of logsumexp hold at most
            # CHUNK_ELEMENTS values, not a copy of the whole (a 128 k vocabulary at 8 k tokens is 4 GiB of float32).
            rows = logits.reshape(-1, logits.shape[-1])
            log_z = rows.shape[1] > 1  # log Z of one logit is the logit itself (a regression output): not logged
            for part in rows.split(max(1, stats.CHUNK_ELEMENTS // rows.shape[1])):
                x = part.float()
                if log_z:
                    self.sums[0] += torch.logsumexp(x, dim=-1).sum()
                self.absmax = torch.maximum(self.absmax, x.abs().amax())
            if log_z:
                self.sums[1] += rows.shape[0]  # a Python scalar is a kernel argument: no host data is copied
        self.layer = index

    @override
    def remove(self) -> None:
        super().remove()
        self._last = self._node = None  # no reference to an output or its graph outlives the forward

    @override
    def reset(self, window: WindowStart) -> None:
        if self.attention is not None:
            self.attention.reset(window.device)
        if self.output_stats:
            self._zero(window.device)
        self._loss, self._forwards, self.link = None, 0, 0
        self.misread, self._nll_below = (0.0, 0), None

    def fold(self) -> None:
        """Pool this process's step; stop entering the mode where forwards reaching a loss made no attention call."""
        agg = self._aggregator
        device = agg.act_moments.device  # every state lives there (new_state)
        sums = torch.zeros(4, dtype=torch.float64, device=device)
        maxima = [torch.full((1,), -1.0, dtype=torch.float64, device=device)] * 3
        if self.output_stats:
            sums[:2] = self.sums.to(device)
            maxima[0] = self.absmax.to(device, torch.float64).reshape(1)
            # Fills, not copies: a Python scalar is a kernel argument.
            maxima[1] = torch.full((1,), float(self.layer), dtype=torch.float64, device=device)
            maxima[2] = torch.full((1,), float(self.link), dtype=torch.float64, device=device)
        if self._loss is not None:
            sums[2] = self._loss.to(device)
            sums[3] = 1.0
        if self.attention is not None:
            maxima.append(self.attention.maxima.to(device, torch.float64))
        reading = torch.full((3,), -math.inf, dtype=torch.float64, device=device)
        if self.misread[0] > 0:
            # Fills, not copies: a Python scalar is a kernel argument.
            reading[0], reading[1] = self.misread[0], float(self.misread[1])
        if self._nll_below is not None:
            reading[2] = self._nll_below.to(device)
        agg.pool("precursor_sums", sums)
        agg.pool("loss_reading", reading)
        agg.pool("precursor_maxima", torch.cat(maxima))
        probe = self.attention
        if probe is not None and self.attention_on and self._forwards and not any(probe.calls.values()):
            self.attention_on = False

    def finalize(self, pooled: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The step's values (NaN where nothing was seen); :meth:`facts` names their owners."""
        sums, maxima = pooled["precursor_sums"], pooled["precursor_maxima"]
        lse, rows, loss, seen = sums.unbind()
        values: dict[str, Tensor] = {"step_loss": torch.where(seen > 0, loss / seen, math.nan).reshape(1)}
        self._owners = {"step_loss": ["loss"]}
        if self.output_stats:
            found = {
                "logit_lse_mean": torch.where(rows > 0, lse / rows, math.nan).reshape(1),
                "logit_absmax": torch.where(maxima[0] >= 0, maxima[0], math.nan).reshape(1),
            }
            for stat in self.output_stats:
                values[stat], self._owners[stat] = found[stat], []
        values["output_layer"], self._owners["output_layer"] = maxima[1].reshape(1), [""]
        values["output_link"], self._owners["output_link"] = maxima[2].reshape(1), [""]
        reading = torch.where(pooled["loss_reading"] > -math.inf, pooled["loss_reading"], math.nan)
        for i, name in enumerate(READING_FACTS):
            values[name], self._owners[name] = reading[i].reshape(1), [""]
        if self.attention is not None:
            attention = maxima[3:]
            values["attn_logit_max"] = torch.where(attention >= 0, attention, math.nan)
            self._owners["attn_logit_max"] = self.attention.names
        return values

    def facts(self, host: Mapping[str, list[float]]) -> dict[str, Any]:
        """``precursors``: each statistic's owners; the output layer's is the pooled one every process agreed on.

        ``output_link`` (for the rules, not logged) belongs to the output layer too: how a loss read its output.

        A process names the last candidate it saw run: in a rank-dependent branch the processes can differ.
        """
        owners, self._owners = self._owners, {}
        if self.output_stats:
            index = int(host["output_layer"][0])
            name = list(self._outputs)[index] if 0 <= index < len(self._outputs) else ""
            owners.update((stat, [name]) for stat in (*self.output_stats, "output_link", *READING_FACTS))
        return {"precursors": owners}


@component
def probes(setup: Setup) -> PrecursorProbes | None:
    """The fit's :class:`PrecursorProbes`, when a precursor statistic is in ``stats=``."""
    config = setup.config
    if not set(PRECURSOR_STATS) & set(config.stats):
        return None
    every = named_modules(setup.model)
    output = setup.modules
    if config.output_layer is not None:
        if config.output_layer not in every:
            raise unmatched_error(config.output_layer, "output_layer", list(every))
        output = {config.output_layer: every[config.output_layer]}
    scope = attention_scope(every, list(setup.modules))
    return PrecursorProbes(config.stats, scope, output, setup.aggregator, selection_outputs=output is setup.modules)


def attention_modules(scope: Mapping[str, nn.Module]) -> list[nn.Module]:
    """The modules of ``scope`` that are attention modules: ``nn.MultiheadAttention`` or a class named ``*Attention*``.

    Hugging Face's (``LlamaAttention``, ``GPT2Attention``, ``BertSelfAttention``), timm's ``Attention`` and nanoGPT's
    ``CausalSelfAttention`` are; an attention written inline in a block's ``forward`` is not (the probe then watches
    the whole forward, see :class:`PrecursorProbes`).

    Example:
        >>> layer = nn.TransformerEncoderLayer(8, 2)
        >>> [type(m).__name__ for m in attention_modules(dict(layer.named_modules()))]
        ['MultiheadAttention']
    """
    return [
        m for m in scope.values() if isinstance(m, nn.MultiheadAttention) or "attention" in type(m).__name__.lower()
    ]


def attention_scope(modules: Mapping[str, nn.Module], selected: Sequence[str]) -> dict[str, nn.Module]:
    """Those of ``modules`` (all, named as by ``named_modules``) that are ``selected`` or contain a selected one.

    Attention calls are attributed to these. HF attention modules own no parameter (their projections are children),
    so the default selection does not select them, but they contain selected modules.
    """
    wanted = {".".join(parts[:i]) for parts in (n.split(".") for n in selected) for i in range(1, len(parts) + 1)}
    return {name: module for name, module in modules.items() if name in wanted}
