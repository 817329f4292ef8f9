"""Attention-logit and output-logit probes against hand-written float64 references."""

from __future__ import annotations

import inspect
import math
import re
import sys

import pytest
import torch
from helpers import by_name, count_hooks, make_trainer
from helpers.zoo import ZooModule, _tokens, hf_model, zoo_module
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from lightning_hookdiag import ALL_STATS, LayerHealthCallback
from lightning_hookdiag import _torch_internals as torch_internals
from lightning_hookdiag._aggregation import LayerStatsAggregator
from lightning_hookdiag._precursor_probes import (
    AttentionProbe,
    attention_scope,
    eager_logit_absmax,
    sdpa_logit_absmax,
)
from lightning_hookdiag._selection import named_modules
from lightning_hookdiag._vocabulary import PRECURSOR_STATS
from lightning_hookdiag.components import WindowStart

STATS = [*ALL_STATS, *PRECURSOR_STATS]


def _reference(q: torch.Tensor, k: torch.Tensor, scale: float, keep: torch.Tensor | None = None) -> float:
    """max |q.k| * scale over the kept pairs, in float64, query head h paired with key head h // (H / Hk)."""
    q, k = q.double(), k.double()
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    logits = (q @ k.transpose(-1, -2) * scale).abs()
    if keep is not None:
        logits = logits[keep.expand_as(logits)]
    return float(logits.max())


def test_sdpa_logits_are_the_exact_maximum_with_scale_masks_and_grouped_heads():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 8, 16, generator=g) * 3, torch.randn(2, 2, 8, 16, generator=g) * 3
    q[0, 0, 0] = 10 * k[0, 0, 6]  # the largest product, at a pair that both masks below hide
    assert sdpa_logit_absmax(q, k).item() == pytest.approx(_reference(q, k, 1 / math.sqrt(16)), rel=1e-6)
    assert sdpa_logit_absmax(q, k, scale=0.3).item() == pytest.approx(_reference(q, k, 0.3), rel=1e-6)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    got = sdpa_logit_absmax(q, k, is_causal=True).item()
    assert got == pytest.approx(_reference(q, k, 0.25, causal), rel=1e-6)
    # A padding mask as HF builds it: boolean, and additive with finfo.min.
    pad = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    pad[0, ..., 5:] = False
    additive = torch.zeros(2, 1, 8, 8).masked_fill(~pad, torch.finfo(torch.float32).min)
    expected = _reference(q, k, 0.25, pad)
    assert sdpa_logit_absmax(q, k, attn_mask=pad).item() == pytest.approx(expected, rel=1e-6)
    assert sdpa_logit_absmax(q, k, attn_mask=additive).item() == pytest.approx(expected, rel=1e-6)
    assert expected < _reference(q, k, 0.25)  # the mask did hide the largest product


def test_sdpa_subsample_is_evenly_strided_rows_ending_at_the_last_one():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 100, 8, generator=g), torch.randn(1, 2, 100, 8, generator=g)
    rows = list(range(99, -1, -4))[::-1]  # ceil(100 / 32) = 4: rows 3, 7, ..., 99
    assert len(rows) == 25
    assert rows[-1] == 99
    expected = _reference(q[..., rows, :], k, 1 / math.sqrt(8))
    assert sdpa_logit_absmax(q, k).item() == pytest.approx(expected, rel=1e-6)
    # The largest product planted in an unsampled row is missed (the documented blind spot) ...
    q[0, 0, 50] = 100 * k[0, 0, 0] / k[0, 0, 0].norm()
    assert sdpa_logit_absmax(q, k).item() == pytest.approx(expected, rel=1e-6)
    # The budget of logits per call: 3 batch elements x 2 heads x 100 keys leave 10 rows (stride 10) for 6400 ...
    qb, kb = q.expand(3, -1, -1, -1), k.expand(3, -1, -1, -1)
    rows = list(range(9, 100, 10))
    expected = _reference(qb[..., rows, :], kb, 1 / math.sqrt(8))
    assert sdpa_logit_absmax(qb, kb, budget=6400).item() == pytest.approx(expected, rel=1e-6)
    # ... and below one row per batch element, only the first batch element's last row.
    expected = _reference(qb[:1, :, 99:], kb[:1], 1 / math.sqrt(8))
    assert sdpa_logit_absmax(qb, kb, budget=150).item() == pytest.approx(expected, rel=1e-6)


def test_eager_logits_skip_masked_entries():
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(2, 3, 5, 5, generator=g) * 10
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    masked = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    expected = float(scores.double().abs()[mask.expand_as(scores)].max())
    assert eager_logit_absmax(masked).item() == pytest.approx(expected, rel=1e-6)
    old_style = scores + (~mask) * -10000.0  # BERT's original additive mask
    assert eager_logit_absmax(old_style).item() == pytest.approx(expected, rel=1e-6)


class _HandWritten(nn.Module):
    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        return x.reshape(b, n, self.heads, c // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        out = F.scaled_dot_product_attention(q, k, v, scale=0.7)
        return out.transpose(1, 2).reshape(x.shape)


def test_hand_written_attention_is_attributed_to_the_innermost_module_in_scope():
    net = nn.Sequential(_HandWritten(), nn.Sequential(_HandWritten()))
    x = torch.randn(2, 5, 8)
    modules = named_modules(net)
    probe = AttentionProbe(attention_scope(modules, ["0.q", "1.0.q"]))
    with probe:
        net(x)
    found = {n: v for n, v in zip(probe.names, probe.maxima.tolist(), strict=True) if v >= 0}
    assert sorted(found) == ["0", "1.0"]  # not "1", the container that called "1.0"
    attn = net[0]
    expected = _reference(attn.split(attn.q(x)), attn.split(attn.k(x)), 0.7)
    assert found["0"] == pytest.approx(expected, rel=1e-6)
    # Outside the selection's scope a call is not observed.
    probe = AttentionProbe(attention_scope(modules, ["0.q"]))
    with probe:
        net(x)
    assert [n for n, v in zip(probe.names, probe.maxima.tolist(), strict=True) if v >= 0] == ["0"]


def _mha_reference(mha: nn.MultiheadAttention, x: torch.Tensor) -> float:
    dim, heads = mha.embed_dim, mha.num_heads
    w, b = mha.in_proj_weight, mha.in_proj_bias
    q, k = (F.linear(x, w[i * dim : (i + 1) * dim], b[i * dim : (i + 1) * dim]) for i in range(2))

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], t.shape[1], heads, dim // heads).transpose(1, 2)

    return _reference(split(q), split(k), 1 / math.sqrt(dim // heads))


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_in_training_mode_through_sdpa_and_through_softmax(need_weights):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(3, 6, 8) * 4
    probe = AttentionProbe({"mha": mha})
    with probe:
        mha(x, x, x, need_weights=need_weights)
    kind = "softmax" if need_weights else "sdpa"  # need_weights=True (the default) takes the eager path
    assert probe.calls == {"sdpa": 0, "softmax": 0} | {kind: 1}
    assert probe.maxima[0].item() == pytest.approx(_mha_reference(mha, x), rel=1e-5)


def test_multihead_attention_fast_path_cannot_run_under_the_probe():
    # The fused path runs only in eval mode without grad, never in training; and it refuses inputs with a
    # torch-function handler, which is what the probe's mode gives every tensor: even there the Python path runs.
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(3, 6, 8)
    probe = AttentionProbe({"mha": mha})
    with torch.no_grad(), probe:
        mha(x, x, x)
    assert probe.calls == {"sdpa": 0, "softmax": 1}
    assert probe.maxima[0].item() == pytest.approx(_mha_reference(mha, x), rel=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "bert_cls", "llama"])
def test_hugging_face_sdpa_and_eager_attention_give_the_same_logits(kind):
    import transformers

    transformers.logging.set_verbosity_error()
    results = {}
    for impl in ("sdpa", "eager"):
        torch.manual_seed(0)
        model = hf_model(kind)
        model.set_attn_implementation(impl)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(8)  # logits of order 100, far from the init's O(0.1)
        probe = AttentionProbe(named_modules(model))
        x = _tokens(4, 0)
        mask = torch.ones_like(x)
        mask[0, -5:] = 0  # padding: the mask path, not only is_causal
        with probe:
            model(input_ids=x, attention_mask=mask)
        kind_seen = "sdpa" if impl == "sdpa" else "softmax"
        assert probe.calls == {"sdpa": 0, "softmax": 0} | {kind_seen: 2}
        results[impl] = {n: v for n, v in zip(probe.names, probe.maxima.tolist(), strict=True) if v >= 0}
    assert len(results["sdpa"]) == 2
    assert results["sdpa"].keys() == results["eager"].keys()
    for name, value in results["sdpa"].items():
        assert value > 50
        assert value == pytest.approx(results["eager"][name], rel=1e-5)


def _head_outputs(module) -> dict[str, list[torch.Tensor]]:
    """Record the head's output on each training forward."""
    seen: dict[str, list[torch.Tensor]] = {}

    def hook(mod, args, out):
        if mod.training:
            seen.setdefault("head", []).append(out.detach().clone())

    module.model.head.register_forward_hook(hook)
    return seen


def test_callback_logs_vit_attention_and_output_logits_equal_to_references():
    module = zoo_module("vit", n=8 * 3)
    seen = _head_outputs(module)
    callback = LayerHealthCallback(every_n_steps=1, stats=STATS, on_anomaly="ignore", output={"summary": False})
    make_trainer([callback], max_steps=3).fit(module)
    metrics = by_name(callback.last_metrics)
    assert {k for k in metrics if "/attn_logit_max/" in k} == {
        f"layer_health/attn_logit_max/model.blocks.{i}.attn" for i in range(4)
    }
    logits = seen["head"][-1].double()
    assert metrics["layer_health/logit_lse_mean/model.head"] == pytest.approx(
        float(torch.logsumexp(logits, -1).mean()), rel=1e-6
    )
    assert metrics["layer_health/logit_absmax/model.head"] == pytest.approx(float(logits.abs().max()), rel=1e-6)
    assert torch._C._len_torch_function_stack() == 0


def test_callback_attention_value_matches_the_qk_of_the_step_it_describes():
    module = zoo_module("vit", n=8 * 2)
    refs: list[float] = []

    def reference(mod, args, out):
        if mod.training:
            b, n, c = args[0].shape
            qkv = mod.qkv(args[0]).reshape(b, n, 3, mod.heads, c // mod.heads).permute(2, 0, 3, 1, 4)
            refs.append(_reference(qkv[0], qkv[1], 1 / math.sqrt(c // mod.heads)))

    module.model.blocks[2].attn.register_forward_hook(reference)
    callback = LayerHealthCallback(every_n_steps=1, stats=STATS, on_anomaly="ignore", output={"summary": False})
    make_trainer([callback], max_steps=2).fit(module)
    assert by_name(callback.last_metrics)["layer_health/attn_logit_max/model.blocks.2.attn"] == pytest.approx(
        refs[-1], rel=1e-5
    )


def test_output_layer_named_by_the_user_and_its_errors():
    module = zoo_module("gpt2", n=8 * 2)
    callback = LayerHealthCallback(
        every_n_steps=1,
        stats=["logit_lse_mean"],
        measure={"output_layer": "model.transformer.ln_f"},
        output={"summary": False},
    )
    make_trainer([callback], max_steps=1).fit(module)
    named = by_name(callback.last_metrics)
    assert [k for k in named if "logit_" in k] == ["layer_health/logit_lse_mean/model.transformer.ln_f"]
    with pytest.raises(ValueError, match=r"output_layer: .*got 3"):
        LayerHealthCallback(measure={"output_layer": 3})
    with pytest.raises(ValueError, match=r"output_layer: .*got ''"):
        LayerHealthCallback(measure={"output_layer": ""})
    with pytest.raises(ValueError, match=r"output_layer='model.lm_head' names the layer of logit_lse_mean"):
        LayerHealthCallback(
            stats=["act_mean", "attn_logit_max"], measure={"output_layer": "model.lm_head"}
        )  # no output logits
    bad = LayerHealthCallback(
        stats=["logit_absmax"], measure={"output_layer": "model.lm_haed"}, output={"summary": False}
    )
    with pytest.raises(ValueError, match=r"output_layer.*model\.lm_haed.*model\.lm_head"):
        make_trainer([bad], max_steps=1).fit(zoo_module("gpt2", n=8))


def test_probes_exist_only_inside_attention_modules_of_sampled_forwards_and_leave_after_an_exception():
    # Issue 39: the mode is entered only while an attention module runs, so the rest of the forward (and the
    # statistics' hooks) pass no Python handler; it is left when the attention's forward raises.
    module = zoo_module("vit", n=8 * 4)
    block = module.model.blocks[0]
    inside, outside, in_step = [], [], []

    def attention_child(mod, args):
        inside.append(torch._C._len_torch_function_stack())
        if len(inside) == 3:  # step 2, sampled: raise inside the attention module
            raise RuntimeError("boom")

    handles = [
        block.attn.qkv.register_forward_pre_hook(attention_child),
        block.mlp.fc1.register_forward_pre_hook(lambda mod, args: outside.append(torch._C._len_torch_function_stack())),
    ]
    original = module.training_step

    def training_step(batch, batch_idx):
        in_step.append(torch._C._len_torch_function_stack())
        return original(batch, batch_idx)

    module.training_step = training_step
    callback = LayerHealthCallback(every_n_steps=2, stats=STATS, output={"summary": False})
    with pytest.raises(RuntimeError, match="boom"):
        make_trainer([callback], max_steps=4).fit(module)
    assert inside == [1, 0, 1]  # sampled steps 0 and 2 only
    assert outside == [0, 0]  # never outside an attention module (step 2 raised before its MLP)
    assert in_step == [0, 0, 0]
    assert torch._C._len_torch_function_stack() == 0
    for handle in handles:
        handle.remove()
    assert count_hooks(module) == 0


def test_without_attention_modules_the_probe_watches_the_whole_sampled_forward():
    # Attention written inline in a block's forward (no module named like attention): the mode covers the forward,
    # and its statistic is still measured, within 1e-5 of the scores' own largest entry.
    class Inline(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.qk = nn.Linear(16, 32)
            self.head = nn.Linear(16, 4)

        def forward(self, tokens):
            x = self.embed(tokens)
            q, k = self.qk(x).chunk(2, dim=-1)
            scores = (q @ k.transpose(-1, -2)).unsqueeze(1) / 4.0  # [batch, 1 head, queries, keys]
            self.seen = scores.detach().abs().amax().item()
            return self.head(scores.softmax(-1).squeeze(1) @ x).mean(1)

    x = _tokens(8 * 2, 0, vocab=50)
    net = Inline()
    module = ZooModule(net, "classify", TensorDataset(x, x[:, 0] % 4))
    callback = LayerHealthCallback(
        every_n_steps=1, stats=["attn_logit_max"], on_anomaly="ignore", output={"summary": False}
    )
    make_trainer([callback], max_steps=1).fit(module)
    values = {k: v for k, v in by_name(callback.last_metrics).items() if "attn_logit_max" in k}
    assert len(values) == 1
    assert next(iter(values.values())) == pytest.approx(net.seen, rel=1e-5)


def test_training_is_bit_identical_with_the_precursor_probes():
    def train(callbacks):
        module = zoo_module("gpt2", n=8 * 4)
        make_trainer(callbacks, max_steps=4).fit(module)
        return {k: v.clone() for k, v in module.state_dict().items()}

    plain = train([])
    probed = train([LayerHealthCallback(every_n_steps=1, stats=STATS, on_anomaly="ignore", output={"summary": False})])
    assert plain.keys() == probed.keys()
    assert all(torch.equal(plain[k], probed[k]) for k in plain)


def test_a_compiled_model_gets_the_same_precursor_statistics_as_eager():
    # Sampled batches run eagerly (the callback's hooks set the force_eager stance), so the mode sees every call.
    def run(compiled: bool) -> dict[str, float]:
        module = zoo_module("vit", n=8 * 3)
        if compiled:
            module.model = torch.compile(module.model, backend="eager")
        callback = LayerHealthCallback(
            every_n_steps=1, stats=list(PRECURSOR_STATS), on_anomaly="ignore", output={"summary": False}
        )
        make_trainer([callback], max_steps=3).fit(module)
        return {k: v for k, v in by_name(callback.last_metrics).items() if "logit" in k}

    eager, compiled = run(False), run(True)
    assert len(eager) == 6
    assert compiled == eager


def test_removing_the_probe_leaves_a_mode_entered_after_it_in_place():
    from lightning_hookdiag._precursor_probes import PrecursorProbes

    class Other(torch.overrides.TorchFunctionMode):
        pass

    probes = PrecursorProbes(["attn_logit_max"], {"attn": nn.Linear(2, 2)}, {}, LayerStatsAggregator(1))
    probes.attach()
    other = Other()
    other.__enter__()  # e.g. a `with torch.device(...)` opened inside training_step and still open
    probes.remove()
    stack = torch.overrides._get_current_function_mode_stack()
    assert stack == [other]
    other.__exit__(None, None, None)
    assert torch._C._len_torch_function_stack() == 0
    probes.remove()  # again: a no-op


# --------------------------------------------------------------------- the default set: attribution heuristics
class _TokenClassifier(nn.Module):
    """A per-token classifier whose forward returns probabilities: a 3-D softmax that is not attention."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.proj(x) * 30.0, dim=-1)


def test_a_3d_softmax_counts_as_attention_only_inside_multihead_attention():
    # [batch, tokens, classes] probabilities are not attention logits; nn.MultiheadAttention's eager path folds the
    # heads into the batch and is 3-D too, and is still seen (test_multihead_attention_... above); 4-D is eager
    # attention's [batch, heads, queries, keys].
    net = _TokenClassifier()
    probe = AttentionProbe({"net": net})
    with probe:
        net(torch.randn(2, 4, 8))
    assert probe.calls == {"sdpa": 0, "softmax": 0}
    assert probe.maxima[0].item() == -1.0

    class Eager4d(nn.Module):
        def forward(self, scores: torch.Tensor) -> torch.Tensor:
            return scores.softmax(-1)

    eager = Eager4d()
    scores = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0)) * 7
    probe = AttentionProbe({"eager": eager})
    with probe:
        eager(scores)
    assert probe.calls == {"sdpa": 0, "softmax": 1}
    assert probe.maxima[0].item() == pytest.approx(float(scores.double().abs().max()), rel=1e-6)


class _Score(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.weight).sum(-1)


class _StudentTeacher(nn.Module):
    """A student head, then a frozen teacher run under no_grad after it, then a 1-D score: which is the output?"""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6))
        self.teacher = nn.Linear(4, 6)
        self.score = _Score()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.student(x)
        with torch.no_grad():
            self.teacher(x)  # distillation target: not in the autograd graph
        self.score(logits.detach())  # a 1-D output: its last dimension is the batch
        return logits


def test_the_output_layer_is_the_last_module_whose_output_can_be_logits():
    from helpers import TinyModule

    seen: list[torch.Tensor] = []
    net = _StudentTeacher()
    net.student[2].register_forward_hook(lambda m, a, out: seen.append(out.detach().double()))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 6, generator=g))
    module = TinyModule(model=net, data=data)
    module.record_enabled = False
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", output={"summary": False})  # the default set
    make_trainer([callback], max_steps=2).fit(module)
    metrics = by_name(callback.last_metrics)
    assert sorted(k for k in metrics if "/logit_" in k) == [
        "layer_health/logit_absmax/model.student.2",
        "layer_health/logit_lse_mean/model.student.2",
    ]
    logits = seen[-1]
    assert metrics["layer_health/logit_lse_mean/model.student.2"] == pytest.approx(
        float(torch.logsumexp(logits, -1).mean()), rel=1e-6
    )
    assert metrics["layer_health/logit_absmax/model.student.2"] == pytest.approx(float(logits.abs().max()), rel=1e-6)


def test_a_one_wide_output_gets_its_largest_logit_but_no_log_z():
    from helpers import TinyModule

    seen: list[torch.Tensor] = []
    module = TinyModule()  # Linear(4, 8), ReLU, Linear(8, 1): a regression head
    module.record_enabled = False
    module.model[2].register_forward_hook(lambda m, a, out: seen.append(out.detach().double()))
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", output={"summary": False})
    make_trainer([callback], max_steps=2).fit(module)
    assert [k for k in by_name(callback.last_metrics) if "/logit_" in k] == ["layer_health/logit_absmax/model.2"]
    assert by_name(callback.last_metrics)["layer_health/logit_absmax/model.2"] == pytest.approx(
        float(seen[-1].abs().max()), rel=1e-6
    )


def test_a_model_without_attention_stops_paying_for_the_mode_after_its_first_sampled_step():
    from helpers import TinyModule

    def stack_sizes(module) -> list[int]:
        sizes: list[int] = []

        class Look(nn.Module):
            def forward(self, x):
                sizes.append(torch._C._len_torch_function_stack())
                return x

        module.model.insert(0, Look())
        callback = LayerHealthCallback(every_n_steps=2, on_anomaly="ignore", output={"summary": False})
        make_trainer([callback], max_steps=6).fit(module)
        return sizes

    mlp = TinyModule()
    mlp.record_enabled = False
    assert stack_sizes(mlp) == [1, 0, 0, 0, 0, 0]  # step 0 probed, no attention call: never again

    attn = nn.MultiheadAttention(4, 2, batch_first=True)
    inside: list[int] = []

    class SelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = attn

        def forward(self, x):
            inside.append(torch._C._len_torch_function_stack())
            return self.attn(x, x, x, need_weights=False)[0]

    net = nn.Sequential(nn.Unflatten(1, (1, 4)), SelfAttention(), nn.Flatten(), nn.Linear(4, 1))
    module = TinyModule(model=net)
    module.record_enabled = False
    # An attention module: the mode is entered while it runs (sampled steps 0, 2, 4), never outside it.
    assert stack_sizes(module) == [0, 0, 0, 0, 0, 0]
    assert inside == [1, 0, 1, 0, 1, 0]


def test_the_probes_copy_no_host_data_to_the_device_in_a_micro_batch():
    # The invariant of hooks.py: nothing per micro-batch turns Python values into tensors (aten.lift_fresh), which
    # on an accelerator is a host-to-device copy and a sync.
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_hookdiag._precursor_probes import PrecursorProbes

    class Fresh(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.fresh = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.fresh += func.overloadpacket.__name__ == "lift_fresh"
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = hf_model("gpt2")
    model.set_attn_implementation("sdpa")
    modules = named_modules(model)
    scope = attention_scope(modules, list(modules))
    probes = PrecursorProbes(PRECURSOR_STATS, scope, {"lm_head": model.lm_head}, LayerStatsAggregator(1))
    probes.reset(WindowStart(torch.device("cpu"), lambda stat: []))
    x = _tokens(2, 0)

    def fresh(probed: bool) -> int:
        with Fresh() as counter:
            for _ in range(2):  # two micro-batches
                if probed:
                    probes.attach()
                loss = model(input_ids=x, labels=x).loss
                if probed:
                    probes.end_forward(loss)
        return counter.fresh

    plain = fresh(False)  # transformers' own mask code makes a few
    assert fresh(True) == plain
    assert probes.attention.calls["sdpa"] == 4  # the probe did run: 2 layers x 2 micro-batches
    assert probes.sums[1].item() == 2 * 2 * 16  # and measured the head: 2 micro-batches of 2 x 16 rows


TORCH_INTERNALS = (
    "torch._C._current_graph_task_id",
    "torch._C._pop_torch_function_stack",
    "torch._C._push_on_torch_function_stack",
    "torch.overrides._get_current_function_mode_stack",
    "sys._getframe",
    "torch.nn.Module._call_impl",
    "torch.nn.Module._wrapped_call_impl",
    "torch.nn.modules.loss._Loss",
    "torch.nn.modules.batchnorm._BatchNorm",
    "torch.nn.modules.dropout._DropoutNd",
)
"""Every internal that lightning_hookdiag/_torch_internals.py reads."""


def missing_torch_internals() -> list[str]:
    """The internals of :data:`TORCH_INTERNALS` that this torch lacks."""

    def lookup(path: str) -> object:
        head, *parts = path.split(".")
        found: object = sys if head == "sys" else torch
        for part in parts:
            found = getattr(found, part, None)
        return found

    return sorted(path for path in TORCH_INTERNALS if not callable(lookup(path)))


def test_the_list_names_every_private_name_the_module_reads():
    # Read from the module's code (its docstring left out), so that a private name added there without adding it
    # here fails.
    source = inspect.getsource(torch_internals).split('"""', 2)[2]
    read = set(re.findall(r"\b(?:torch\._C|torch\.overrides|sys)\._\w+", source))
    read |= {f"torch.{m}" for m in re.findall(r"\bnn\.modules\.\w+\._\w+", source)}
    read |= {f"torch.nn.Module.{name}" for name in re.findall(r'"(_\w+_impl)"', source)}
    assert read == set(TORCH_INTERNALS)


def test_the_torch_internals_the_probes_rely_on_still_behave_as_expected():
    assert not missing_torch_internals(), f"torch {torch.__version__} lacks {missing_torch_internals()}"

    class Inner(nn.Module):
        def forward(self, x):
            return list(torch_internals.calling_modules(1))

    inner = Inner()
    outer = nn.Sequential(inner)
    callers = [m for m in outer(0) if isinstance(m, nn.Module)]
    assert callers[0] is inner
    assert outer in callers

    class Mode(torch.overrides.TorchFunctionMode):
        pass

    ours, theirs = Mode(), Mode()
    ours.__enter__()
    theirs.__enter__()
    torch_internals.exit_mode(ours)  # not on top: the mode above it stays entered
    assert torch.overrides._get_current_function_mode_stack() == [theirs]
    theirs.__exit__(None, None, None)

    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(torch_internals.in_backward()))
    y.sum().backward()
    assert seen == [True]
    assert not torch_internals.in_backward()


def test_a_torch_without_one_of_them_fails_loudly_naming_it(monkeypatch):
    monkeypatch.delattr(torch._C, "_pop_torch_function_stack")
    assert missing_torch_internals() == ["torch._C._pop_torch_function_stack"]
