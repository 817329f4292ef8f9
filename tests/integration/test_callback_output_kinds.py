"""Module outputs of every tensor kind on a real fit: those that cannot be reduced are skipped with one note, never a
crash, and the other layers' statistics stay exact.

Kinds: nested tensors (strided and jagged layout, also feeding the loss so their gradient arrives), sparse,
integer, bool, complex (an FFT), quantized, meta tensors, a wrapper subclass that dispatches its own operations (as
DTensor does), and a plain subclass (``as_subclass``) and an ``nn.Parameter``, which are ordinary tensors and measured.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from helpers import RecordingLogger, TinyModule, count_hooks, make_trainer
from helpers.reference import activation_stats, flat, l2
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from lightning_hookdiag import LayerHealthCallback, LayerHealthWarning, capture_activations
from lightning_hookdiag._vocabulary import OPT_IN_STATS

P = "layer_health"


class Wrapped(Tensor):
    """A wrapper subclass, as ``DTensor`` and torchao's float8 tensors are: it holds a tensor and runs each op."""

    inner: Tensor

    @staticmethod
    def __new__(cls, inner: Tensor) -> Wrapped:
        shape, dtype, device = inner.shape, inner.dtype, inner.device
        return Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=inner.requires_grad)

    def __init__(self, inner: Tensor) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"Wrapped({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(t: Any) -> Any:
            return t.inner if isinstance(t, Wrapped) else t

        def wrap(t: Any) -> Any:
            return Wrapped(t) if isinstance(t, Tensor) else t

        return tree_map(wrap, func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {})))


class Plain(Tensor):
    """A subclass without its own dispatch: an ordinary tensor, measured."""


def _make(kind: str, h: Tensor) -> Any:
    if kind == "nested_strided":
        return torch.nested.as_nested_tensor([h[:3], h[3:]])
    if kind == "nested_jagged":
        return torch.nested.as_nested_tensor([h[:3], h[3:]], layout=torch.jagged)
    if kind == "sparse":
        return h.to_sparse()
    if kind == "int":
        return h.argmax(-1)
    if kind == "bool":
        return h > 0
    if kind == "complex":
        return torch.fft.fft(h)
    if kind == "quantized":
        return torch.quantize_per_tensor(h.detach(), 0.05, 0, torch.qint8)
    if kind == "meta":
        return torch.empty_like(h, device="meta")
    if kind == "wrapper":
        return Wrapped(h.detach())
    if kind == "plain_subclass":
        return h.as_subclass(Plain)
    if kind == "parameter":
        return nn.Parameter(h.detach().clone())
    raise ValueError(kind)


def _dense(kind: str, out: Any) -> Tensor | None:
    """A float tensor of ``h``'s shape computed from the odd output, so that its gradient reaches it (or None)."""
    if kind == "nested_strided":
        return torch.cat(out.unbind())
    if kind == "nested_jagged":
        return out.values()
    if kind == "sparse":
        return out.to_dense()
    if kind == "complex":
        return out.real
    if kind == "plain_subclass":
        return out.as_subclass(Tensor)
    return None


class Odd(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, h: Tensor) -> Any:
        return _make(self.kind, h)


class Net(nn.Module):
    """``a`` -> ``odd`` -> ``b``; ``odd``'s output joins ``b``'s input where it has a float form."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(4, 4)
        self.odd = Odd(kind)
        self.b = nn.Linear(4, 1)
        self.kept: dict[str, Tensor] | None = None  # test instrumentation: the reference keeps its outputs here

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        dense = _dense(self.kind, self.odd(h))
        out = self.b(h if dense is None else h + 0.5 * dense)
        if self.kept is not None:
            h.retain_grad()
            out.retain_grad()
            self.kept.update(a=h, b=out)
        return out


SKIPPED = {
    "nested_strided": "is a nested tensor",
    "nested_jagged": "is a nested tensor",
    "sparse": "is a sparse tensor",
    "int": "holds no floating-point tensor",
    "bool": "holds no floating-point tensor",
    "complex": "holds no floating-point tensor (an integer, bool, complex or quantized",
    "quantized": "holds no floating-point tensor",
    "meta": "is a meta tensor",
    "wrapper": "is a Wrapped, a tensor subclass that dispatches its own operations",
}
MEASURED = ["plain_subclass", "parameter"]


def _fit(kind: str, callback: LayerHealthCallback | None) -> tuple[TinyModule, RecordingLogger, list[str]]:
    torch.manual_seed(0)
    module = TinyModule(model=Net(kind))
    logger = RecordingLogger()
    callbacks = [] if callback is None else [callback]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(callbacks, max_steps=3, logger=logger).fit(module)
    return module, logger, [str(w.message) for w in caught if issubclass(w.category, LayerHealthWarning)]


def _reference(module: TinyModule, step: int) -> dict[str, float]:
    """Statistics of ``a`` and ``b`` recomputed from the weights and batch the Trainer used at ``step``."""
    (_, x, y, weights) = next(r for r in module.record if r[0] == step)
    ref = module.reference_model(weights)
    ref.kept = {}
    module.loss(ref(x), y).backward()
    expected = {}
    for name in ("a", "b"):
        out = ref.kept[name]
        for stat, value in activation_stats(flat([out.detach()])).items():
            expected[f"{P}/{stat}/model.{name}"] = value
        expected[f"{P}/act_grad_norm/model.{name}"] = l2(flat([out.grad]))
    return expected


@pytest.mark.parametrize("kind", [*SKIPPED, *MEASURED])
def test_every_output_kind_leaves_the_fit_and_the_other_layers_intact(kind: str) -> None:
    module, logger, messages = _fit(
        kind, LayerHealthCallback(every_n_steps=1, output={"charts": "all"})
    )  # every statistic
    assert count_hooks(module) == 0
    steps = [step for step, metrics in logger.ours()]
    assert steps == [0, 1, 2]
    metrics = logger.ours()[-1][1]
    for key, value in _reference(module, 2).items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-12), key
    odd_keys = [key for key in metrics if key.endswith("/model.odd")]
    notes = [m for m in messages if "'model.odd'" in m]
    if kind in SKIPPED:
        assert odd_keys == []
        assert len(notes) == 1, messages  # one-time: three sampled steps, one note
        assert SKIPPED[kind] in notes[0]
    else:
        # An ordinary tensor under another class: measured like any output (the values are those of ``a``).
        assert metrics[f"{P}/act_mean/model.odd"] == pytest.approx(metrics[f"{P}/act_mean/model.a"], rel=1e-12)
        assert metrics[f"{P}/act_std/model.odd"] == pytest.approx(metrics[f"{P}/act_std/model.a"], rel=1e-12)


@pytest.mark.parametrize("kind", ["nested_strided", "nested_jagged", "complex", "meta", "wrapper"])
def test_training_is_bit_identical_with_and_without_the_callback(kind: str) -> None:
    watched, _, _ = _fit(kind, LayerHealthCallback(every_n_steps=1))
    alone, _, _ = _fit(kind, None)
    for (name, p), q in zip(watched.model.named_parameters(), alone.model.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("kind", ["nested_strided", "nested_jagged", "meta", "wrapper"])
def test_opt_in_statistics_histograms_and_accumulation_skip_them_too(kind: str) -> None:
    """Every sink an output reaches (kurtosis, precision headroom, saved bytes, histograms) is spared it."""
    callback = LayerHealthCallback(
        every_n_steps=1,
        sentinel="loss+grads",
        measure={"extra_stats": list(OPT_IN_STATS), "histogram_every_n_steps": 1, "precision_targets": ["bfloat16"]},
    )
    torch.manual_seed(0)
    module = TinyModule(model=Net(kind))
    logger = RecordingLogger()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([callback], max_steps=2, logger=logger, accumulate_grad_batches=2).fit(module)
    notes = [str(w.message) for w in caught if "'model.odd'" in str(w.message)]
    assert len(notes) == 1
    assert SKIPPED[kind] in notes[0]
    metrics = logger.ours()[-1][1]
    assert not any(key.endswith("/model.odd") for key in metrics)
    assert f"{P}/act_kurtosis/model.a" in metrics
    assert f"{P}/act_grad_norm/model.b" in metrics


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_output_gradient_is_skipped_too(layout: torch.layout) -> None:
    """The nested output feeds the loss: its gradient (a nested tensor as well) arrives and is skipped, not reduced."""
    kind = "nested_strided" if layout == torch.strided else "nested_jagged"
    _, logger, messages = _fit(kind, LayerHealthCallback(every_n_steps=1))
    assert not any("'model.odd' required grad but received no gradient" in m for m in messages)
    assert not any(key.endswith("/model.odd") for _, metrics in logger.ours() for key in metrics)
    notes = [m for m in messages if "'model.odd'" in m]
    assert len(notes) == 1
    assert "nested tensor" in notes[0]
    assert "sparse" not in notes[0]


class Teacher(nn.Module):
    """A frozen ``TransformerEncoder`` kept in eval mode: run without grad on a padded batch, it takes the fast path
    that turns the batch into a strided nested tensor, which every layer inside the encoder returns."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)
        self.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(x.shape[0], 2, 2).repeat(1, 3, 4)  # (batch, 6 tokens, 8 features)
        padding = torch.zeros(x.shape[0], 6, dtype=torch.bool, device=x.device)
        padding[::2, 4:] = True  # every other sequence is 4 tokens long
        return self.encoder(tokens, src_key_padding_mask=padding)[:, 0, :4]


class Distill(nn.Module):
    """A student trained towards a target that a frozen teacher's features shift, as in distillation."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = Teacher()
        self.student = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: Tensor) -> Tensor:
        self.teacher.eval()  # frozen: Lightning puts the whole model in train mode when the fit starts
        with torch.no_grad():
            hint = self.teacher(x).mean(-1, keepdim=True)
        return self.student(x) + hint


LAYERS = ["model.teacher.encoder.layers.0", "model.teacher.encoder.layers.1.linear1", "model.student.*"]


def test_a_frozen_transformer_encoder_in_a_training_step_is_skipped_as_nested() -> None:
    module = TinyModule(model=Distill())
    logger = RecordingLogger()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback = LayerHealthCallback(
            layers=LAYERS, every_n_steps=1, output={"charts": "all"}
        )  # every statistic, compared
        make_trainer([callback], max_steps=2, logger=logger).fit(module)
    messages = [str(w.message) for w in caught if issubclass(w.category, LayerHealthWarning)]
    for name in LAYERS[:2]:
        notes = [m for m in messages if f"'{name}'" in m and "nested tensor" in m]
        assert len(notes) == 1, messages
    metrics = logger.ours()[-1][1]
    assert not any(".teacher." in key for key in metrics)
    # The student is measured exactly: its first layer's output recomputed from the step's weights and batch.
    (_, x, _, weights) = next(r for r in module.record if r[0] == 1)
    expected = nn.functional.linear(x, weights["student.0.weight"], weights["student.0.bias"])
    for stat, value in activation_stats(flat([expected])).items():
        assert metrics[f"{P}/{stat}/model.student.0"] == pytest.approx(value, rel=1e-5, abs=1e-12), stat
    assert count_hooks(module) == 0


def test_capture_activations_keeps_the_nested_outputs_of_the_fast_path() -> None:
    model = Distill().eval()
    x = torch.randn(4, 4)
    names = ["teacher.encoder.layers.0", "teacher.encoder"]
    with torch.no_grad(), capture_activations(model, names) as acts:
        expected = model(x)
    assert acts["teacher.encoder.layers.0"].is_nested
    assert acts["teacher.encoder.layers.0"].layout == torch.strided
    assert not acts["teacher.encoder"].is_nested  # the encoder pads its output back
    hint = acts["teacher.encoder"][:, 0, :4].mean(-1, keepdim=True)
    assert torch.equal(model.student(x) + hint, expected)
