"""The fast path in a fit (``MeasureConfig.fast_path``): where it runs, its warm-up note, the same logged values as
today's path within the numeric contract, and each fallback with exactly one note and today's values exactly.

A real Trainer fits a model whose wide layer's output has 262,144 elements (the fast path's threshold) on every
step (``every_n_steps=1``): the first sampled step takes today's path (no pooled mean to shift around yet), then the
reduction is warmed, and the later steps take the fast path. Compiling is slow (7-76 s on this CPU), so the module's
fits share dynamo's cache of the compiled functions: only the first fit with the fast path compiles.
"""

import contextlib
import importlib.util
import logging
import math
import warnings
from collections.abc import Iterator

import pytest
import torch
from helpers import RecordingLogger, TinyModule, force_trips, make_data, make_trainer
from torch import nn
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hookdiag import LayerHealthCallback, LayerHealthWarning, MeasureConfig
from lightning_hookdiag import _torch_internals as torch_internals
from lightning_hookdiag._fast_path import fast_dtypes, uses_fast_path
from lightning_hookdiag._onepass import FAST_MIN_ELEMENTS, OnePass, has_compiler
from lightning_hookdiag._stats import ACT_ROW, GRAD_ROW, GROW_SUMSQ, Workspace

pytestmark = pytest.mark.slow  # compile tests (pyproject's marker)

BATCH, WIDTH, D_IN = 8, 32768, 16
STEPS = 3
STATS = ["act_mean", "act_std", "act_absmax", "act_zero_frac", "act_nonfinite", "act_dead_frac", "act_grad_norm"]
OFFSET = 1e3  # the wide layer's mean, ~1e3 times its spread: only a shift keeps float64 sums within the contract


def _model() -> nn.Module:
    torch.manual_seed(0)
    wide = nn.Linear(D_IN, WIDTH)
    with torch.no_grad():
        wide.bias.add_(OFFSET)
    return nn.Sequential(wide, nn.ReLU(), nn.Linear(WIDTH, 1))


@contextlib.contextmanager
def _notes() -> Iterator[list[tuple[str, str]]]:
    """The callback's fast-path notes given in the block: ``("info" | "warning", message)``."""
    found: list[tuple[str, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found.append(("info", record.getMessage()))

    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield found
        found += [("warning", str(w.message)) for w in caught if issubclass(w.category, LayerHealthWarning)]
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    found[:] = [(kind, text) for kind, text in found if "fast path" in text]


class Attend(nn.Module):
    """Self-attention over the wide output viewed ``[batch, 1 head, 64 positions, 512]``: the probe's sdpa call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.view(x.shape[0], 1, 64, -1)
        return F.scaled_dot_product_attention(q, q, q).reshape(x.shape)


def _attention_model() -> nn.Module:
    model = _model()
    return nn.Sequential(model[0], Attend(), *model[1:])


def _fit(fast_path: str, around: contextlib.AbstractContextManager | None = None, model=_model, precision=32, **kwargs):
    """Fit with ``fast_path``: ``(logged values per step, the module with its record, the fast-path notes)``."""
    module = TinyModule(model(), make_data(n=BATCH * STEPS, d_in=D_IN), batch_size=BATCH, lr=1e-6)
    logger = RecordingLogger()
    measure = MeasureConfig(fast_path=fast_path)
    callback = LayerHealthCallback(**{"every_n_steps": 1, "stats": STATS, **kwargs}, measure=measure)
    with _notes() as notes, around or contextlib.nullcontext():
        make_trainer([callback], max_steps=STEPS, logger=logger, precision=precision).fit(module)
    return logger.ours(), module, notes


def _assert_within_contract(got, expected) -> None:
    """The same steps and keys, and every value within 1e-9 relative (the contract allows 1e-5; NaN where NaN)."""
    assert [step for step, _ in got] == [step for step, _ in expected]
    for (step, values), (_, reference) in zip(got, expected, strict=True):
        assert values.keys() == reference.keys()
        for key, value in reference.items():
            same = math.isnan(value) and math.isnan(values[key])
            assert same or math.isclose(values[key], value, rel_tol=1e-9, abs_tol=1e-12), (
                step,
                key,
                values[key],
                value,
            )


def _identical(got, expected) -> bool:
    """The same steps and keys, and bit-identical values (NaN where NaN)."""
    if [(step, values.keys()) for step, values in got] != [(step, values.keys()) for step, values in expected]:
        return False
    pairs = [(g[k], e[k]) for (_, g), (_, e) in zip(got, expected, strict=True) for k in e]
    return all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in pairs)


@pytest.fixture(scope="module")
def off():
    return _fit("off")


@pytest.fixture(scope="module")
def on():
    return _fit("on")


def test_the_wide_output_reaches_the_fast_paths_threshold():
    assert BATCH * WIDTH >= FAST_MIN_ELEMENTS


def test_on_logs_todays_values_within_the_numeric_contract(off, on):
    off_values, _, off_notes = off
    on_values, _, _ = on
    assert off_notes == []  # "off": no fast path, no note
    assert [step for step, _ in off_values] == list(range(STEPS))
    _assert_within_contract(on_values, off_values)


def test_on_matches_a_float64_reference_on_the_fast_steps(on):
    # The wide layer's output, recomputed in float32 from the recorded weights and batch, reduced in float64.
    values, module, _ = on
    for step, x, _, weights in module.record[1:]:  # the steps after the first: the fast path's
        wide = module.reference_model(weights)[0]
        with torch.no_grad():
            out = wide(x).double()
        logged = dict(values)[step]
        assert math.isclose(logged["layer_health/act_mean/model.0"], out.mean().item(), rel_tol=1e-9)
        assert math.isclose(logged["layer_health/act_std/model.0"], out.std(correction=0).item(), rel_tol=1e-7)
        assert logged["layer_health/act_absmax/model.0"] == out.abs().max().item()
        relu = out.clamp_min(0)
        dead = (relu.amax(0) <= 0).double().mean().item()
        assert logged["layer_health/act_dead_frac/model.1"] == dead


def test_on_says_once_what_warming_cost_and_which_path_ran(on):
    _, _, notes = on
    kinds = [kind for kind, _ in notes]
    assert kinds == ["info", "info"], notes
    warm, ran = (text for _, text in notes)
    assert warm.startswith("LayerHealthCallback: fast path: compiled 3 reductions in ")
    # Step 1, the first on the fast path: the two wide outputs (Linear, ReLU) in one pass; the last layer's output and
    # its gradient are stacked, and the CPU's two wide gradients stay on today's path.
    assert ran == (
        "LayerHealthCallback: fast path: 2 tensors reduced in one pass on this step; today's path for: gradient 2,"
        " stacked 2"
    )


def test_auto_is_off_on_the_cpu(off):
    values, _, notes = _fit("auto")
    assert notes == []
    assert _identical(values, off[0])


def test_no_compiler_falls_back_with_one_note_and_todays_values(off, monkeypatch, tmp_path):
    # A machine without a C++ compiler: none on PATH, no $CXX.
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    values, _, notes = _fit("on")
    assert notes == [
        (
            "warning",
            "LayerHealthCallback: fast path: no C++ compiler found for CPU kernels: every tensor takes the per-piece"
            " path",
        )
    ]
    assert _identical(values, off[0])


class PassThrough(TorchDispatchMode):
    """A user's dispatch mode around the whole fit (a FLOP counter, a debugging mode): every op runs as it is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_around_the_fit_falls_back_with_one_note_and_todays_values(off, on):
    values, _, notes = _fit("on", PassThrough())
    assert notes == [
        ("warning", "LayerHealthCallback: fast path: a TorchDispatchMode is active: today's path while it is")
    ]
    assert _identical(values, off[0])


def test_the_attention_probe_and_a_replays_in_place_guard_are_left_for_the_compiled_call():
    # The probe's torch-function mode is entered for the whole sampled step, the in-place guard's dispatch mode for a
    # replay (a forced trip on step 1, which is not sampled): left for each compiled call, neither sends an output to
    # today's path.
    kwargs = {
        "every_n_steps": 2,
        "stats": [*STATS, "attn_logit_max"],
        "sentinel": force_trips({1}),
        "model": _attention_model,
    }
    off_values, _, _ = _fit("off", **kwargs)
    on_values, _, notes = _fit("on", **kwargs)
    assert [kind for kind, _ in notes] == ["info", "info"], notes
    assert "3 tensors reduced in one pass on this step; today's path for: gradient 3, stacked 2" in notes[1][1]
    _assert_within_contract(on_values, off_values)


def test_a_compiled_model_runs_its_sampled_steps_eagerly_and_the_reduction_compiled():
    # The hooks hold force_eager over the sampled steps (so that the compiled model runs them); each reduction call
    # lifts it for itself only. Unsampled steps (every_n_steps=2) run the compiled model.
    def compiled() -> nn.Module:
        return torch.compile(_model())

    off_values, _, _ = _fit("off", model=compiled, every_n_steps=2)
    on_values, _, notes = _fit("on", model=compiled, every_n_steps=2)
    assert [kind for kind, _ in notes] == ["info", "info"], notes
    assert "2 tensors reduced in one pass on this step" in notes[1][1]
    assert [step for step, _ in on_values] == [0, 2]
    _assert_within_contract(on_values, off_values)


def test_bf16_mixed_warms_bf16_too_and_logs_todays_values():
    # Under bf16 autocast the Linear outputs are bf16: the fit warms both dtypes (6 reductions) and reads them.
    off_values, _, _ = _fit("off", precision="bf16-mixed")
    on_values, _, notes = _fit("on", precision="bf16-mixed")
    assert [kind for kind, _ in notes] == ["info", "info"], notes
    assert notes[0][1].startswith("LayerHealthCallback: fast path: compiled 6 reductions in ")
    assert "2 tensors reduced in one pass on this step" in notes[1][1]
    _assert_within_contract(on_values, off_values)


def test_a_fast_call_reads_nothing_back_to_the_host():
    # A 0-d CPU shift made dynamo guard on `not isnan(shift.item())`: a host read per call (a sync on a GPU) and a
    # recompile for a NaN mean. The recorder's shifts are views of the pooled means, like these.
    fast = OnePass()
    assert fast.warm([torch.float32]) is not None, fast.notes
    x = torch.randn(FAST_MIN_ELEMENTS) + 3
    means = torch.tensor([3.0, float("nan")], dtype=torch.float64)
    table = torch.empty(1, ACT_ROW, dtype=torch.float64)
    for shift in means.view(-1, 1).unbind():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fast.reduce_tensor(x, lambda sizes: table[: len(sizes)], Workspace(), shift=shift)
        names = {event.name for event in prof.events()}
        assert not names & {"aten::item", "aten::_local_scalar_dense"}, names
    assert fast.paths == {"fast": 2}


def test_a_fast_gradient_makes_no_tensor_from_host_data():
    # A gradient has no shift; one made from the host number 0 in every hook is a copy from pageable memory on a GPU,
    # which waits for the device. It is made once (on the first call), never in later calls.
    fast = OnePass(gradients=True)  # on the CPU gradients take today's path unless asked
    assert fast.warm([torch.float32]) is not None, fast.notes
    g = torch.randn(FAST_MIN_ELEMENTS) * 1e-3
    table = torch.empty(1, GRAD_ROW, dtype=torch.float64)
    fast.reduce_tensor(g, lambda sizes: table[: len(sizes)], Workspace(), grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fast.reduce_tensor(g, lambda sizes: table[: len(sizes)], Workspace(), grad=True)
    names = {event.name for event in prof.events()}
    assert not names & {"aten::lift_fresh", "aten::item", "aten::_local_scalar_dense"}, names
    assert fast.paths == {"fast": 2}
    assert table[0, GROW_SUMSQ].item() == pytest.approx(g.double().square().sum().item(), rel=1e-12)


def test_where_each_setting_uses_the_fast_path():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [uses_fast_path(s, cpu) for s in ("auto", "on", "off")] == [False, True, False]
    # CUDA kernels come from Triton: "auto" uses the fast path there exactly when it is installed.
    triton = importlib.util.find_spec("triton") is not None
    assert has_compiler(cuda) is triton
    assert [uses_fast_path(s, cuda) for s in ("auto", "on", "off")] == [triton, True, False]
    assert uses_fast_path("auto", torch.device("mps")) is False


def test_warmed_dtypes_follow_the_precision():
    assert fast_dtypes("bf16-mixed") == fast_dtypes("bf16-true") == (torch.float32, torch.bfloat16)
    assert fast_dtypes("32-true") == fast_dtypes("16-mixed") == fast_dtypes(32) == (torch.float32,)


def test_the_torch_internals_of_the_fast_path_exist():
    assert torch_internals.check() == []


def test_bad_fast_path_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"MeasureConfig.fast_path: expected one of \['auto', 'on', 'off'\], got 'yes'"
    ):
        MeasureConfig(fast_path="yes")
