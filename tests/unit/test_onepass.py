"""The one-pass fast path (:class:`~lightning_hookdiag._onepass.OnePass`): same rows as today's path, the numeric
contract, and every fallback with exactly one note and today's values.

Compiling is slow (15-30 s on 2 loaded cores), so one instance is warmed per module; other instances warm from
dynamo's cache of the same functions (a guard check, no compile) unless a test wants a compile to happen.
"""

import math

import pytest
import torch
from helpers.reference import activation_stats_float64
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from lightning_hookdiag import _stats as S
from lightning_hookdiag._onepass import FAST_MIN_ELEMENTS, OnePass
from lightning_hookdiag._recorder import SMALL_ELEMENTS

pytestmark = pytest.mark.slow  # compile tests (pyproject's marker)

SMALL = 4096  # the tests' min_elements: small tensors exercise the fast path quickly
DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module")
def fast():
    torch.manual_seed(0)
    fast = OnePass(min_elements=SMALL, gradients=True)  # the CPU's gradients stay on today's path by default
    seconds = fast.warm(DTYPES)
    assert seconds is not None, fast.notes
    assert seconds > 0
    assert fast.notes == [f"onepass: compiled 8 reductions in {seconds:.1f} s"]
    assert fast.warm(DTYPES) == 0.0
    assert len(fast.notes) == 1
    return fast


def _warmed(**kwargs) -> OnePass:
    """A fresh instance whose warm-up is served by dynamo's cache of the module's compiled functions."""
    instance = OnePass(min_elements=SMALL, **{"gradients": True, **kwargs})
    assert instance.warm(DTYPES) is not None, instance.notes
    instance.notes.clear()
    return instance


def _rows(reduce, x: torch.Tensor, grad: bool = False, units: bool = False, **kwargs):
    """``(pooled row, per-unit maxima, histogram)``: the rows a reduction wrote, pooled as the aggregator pools them."""
    width = S.GRAD_ROW if grad else S.ACT_ROW
    written: list[tuple[list[int], torch.Tensor]] = []

    def reserve(sizes: list[int]) -> torch.Tensor:
        written.append((sizes, torch.full((len(sizes), width), float("nan"), dtype=torch.float64)))
        return written[-1][1]

    maxima, hist = reduce(x, reserve, S.Workspace(), grad, units, **kwargs)
    assert len(written) == 1  # the rows are asked for once
    assert sum(written[0][0]) == x.numel()
    rows = written[0][1]
    pooled = rows.sum(0)
    if not grad:
        pooled[S.ROW_MIN], pooled[S.ROW_MAX] = rows[:, S.ROW_MIN].min(), rows[:, S.ROW_MAX].max()
    return pooled, maxima, hist


def _today(x, grad=False, units=False, **kwargs):
    kwargs.pop("shift", None)

    def reduce(x, reserve, *args, **kw):
        return S.reduce_tensor(x, reserve(S.piece_sizes(x)), *args, **kw)

    return _rows(reduce, x, grad, units, **kwargs)


def _with_specials(x: torch.Tensor) -> torch.Tensor:
    flat = x.view(-1)
    flat[3], flat[10], flat[11], flat[12], flat[-1] = float("nan"), float("inf"), -0.0, 0.0, float("-inf")
    return x


SHAPES = {
    "flat": (9000,),
    "dense [batch, units]": (64, 200),
    "sequence [batch, time, units]": (4, 33, 96),
    "conv [batch, channels, h, w]": (6, 16, 12, 12),
    "over one piece": (2, S.CHUNK_ELEMENTS // 2 + 999),
}


def _assert_same_row(got: torch.Tensor, expected: torch.Tensor, grad: bool) -> None:
    counts = [S.GROW_NONZERO, S.GROW_NONZERO_FINITE] if grad else [S.ROW_NONZERO, S.ROW_NONZERO_FINITE]
    assert got[counts].tolist() == expected[counts].tolist()  # exact counts
    if not grad:
        assert got[[S.ROW_MIN, S.ROW_MAX]].tolist() == expected[[S.ROW_MIN, S.ROW_MAX]].tolist()  # exact extremes
    sums = [S.GROW_SUMSQ] if grad else [S.ROW_SUM, S.ROW_SUMSQ]
    torch.testing.assert_close(got[sums], expected[sums], rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("kind", ["output", "output with units", "gradient"])
def test_fast_path_writes_todays_row_and_unit_maxima(fast, name, dtype, kind):
    x = _with_specials((torch.randn(SHAPES[name]) * 3 + 1.5).to(dtype))
    grad, units = kind == "gradient", kind == "output with units"
    before = fast.paths["fast"]
    with torch.compiler.set_stance("fail_on_recompile"):  # what warm() compiled serves every shape
        got, got_units, _ = _rows(fast.reduce_tensor, x, grad, units, shift=1.5)
    expected, expected_units, _ = _today(x, grad, units)
    # Today's path by design: [1, n, 1] (one unit per element: a layout warm() does not compile).
    todays = units and x.ndim == 1
    assert fast.paths["fast"] == before + (not todays), fast.paths
    _assert_same_row(got, expected, grad)
    if units:
        assert got_units.dtype == expected_units.dtype == dtype
        assert torch.equal(got_units, expected_units)  # NaN maxima are +inf in both
    else:
        assert got_units is None
        assert expected_units is None


def test_histograms_on_the_fast_path_are_todays(fast):
    x = _with_specials(torch.randn(64, 200) * 100)
    edges = S.histogram_edges(16)
    got, _, got_hist = _rows(fast.reduce_tensor, x, edges=edges, shift=0.0)
    expected, _, expected_hist = _today(x, edges=edges)
    assert torch.equal(got_hist, expected_hist)
    assert got_hist.sum() == x.isfinite().sum()
    _assert_same_row(got, expected, grad=False)


def _finalized(row: torch.Tensor, n: int) -> dict[str, float]:
    moments, absmax = S.moments_from_rows(row[None], torch.tensor([float(n)], dtype=torch.float64))
    return {k: v.item() for k, v in S.finalize_activations(moments, absmax).items()}


CONTRACT = {
    # name: (mean, spread, shift): the shift is a pooled mean of an earlier step, near but not at this mean
    "mean 1e4 x spread": (1e4, 1.0, 1e4 + 0.37),
    "mean 1e5 x spread": (3e5, 3.0, 3e5 - 1.1),
    "|x| near 1e18": (1e18, 2e17, 9e17),
    "mean -1e4 x spread of small values": (-2e-3, 2e-7, -2e-3 + 1e-8),
}


@pytest.mark.parametrize("first_zero", [False, True], ids=["", "first element 0"])
@pytest.mark.parametrize("name", list(CONTRACT))
def test_numeric_contract_against_float64(fast, name, first_zero):
    mean, spread, shift = CONTRACT[name]
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(1 << 21, dtype=torch.float64, generator=g) * spread + mean).float()
    if first_zero:
        x[0] = 0.0
    reference = activation_stats_float64(x)
    got = _finalized(_rows(fast.reduce_tensor, x, shift=shift)[0], x.numel())
    for stat, value in reference.items():
        assert math.isclose(got[stat], value, rel_tol=1e-5, abs_tol=1e-300 if value == 0 else 0), (stat, got, value)


@pytest.mark.parametrize("scale", [1e-20, 1.0, 1e18], ids=["1e-20", "1", "1e18"])
def test_a_gradient_is_reduced_in_one_pass_against_float64(fast, scale):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(1 << 21, dtype=torch.float64, generator=g) * scale).float()
    x[0], x[1], x[2] = -0.0, 0.0, float("nan")
    before = fast.paths["fast"]
    row = _rows(fast.reduce_tensor, x, grad=True)[0]  # no shift: a gradient's squares do not cancel
    assert fast.paths["fast"] == before + 1
    finite = [v for v in x.double().tolist() if math.isfinite(v)]
    assert math.isclose(row[S.GROW_SUMSQ].item(), math.fsum(v * v for v in finite), rel_tol=1e-12)
    nonzero = sum(v != 0 for v in finite) + 1  # NaN counts as non-zero and -0.0 as zero, as today's path counts
    assert row[[S.GROW_NONZERO, S.GROW_NONZERO_FINITE]].tolist() == [nonzero, nonzero - 1]


def test_shift_as_a_device_tensor_and_a_non_finite_shift(fast):
    x = torch.randn(100_000) * 2 + 7
    expected = _finalized(_today(x)[0], x.numel())
    for shift in (torch.tensor(6.9, dtype=torch.float32), torch.tensor(float("nan")), float("inf")):
        got = _finalized(_rows(fast.reduce_tensor, x, shift=shift)[0], x.numel())
        for stat, value in expected.items():
            assert math.isclose(got[stat], value, rel_tol=1e-9), (shift, stat)


def _assert_todays_values(instance: OnePass, x: torch.Tensor, grad: bool = False, units: bool = False) -> None:
    got, got_units, _ = _rows(instance.reduce_tensor, x, grad, units, shift=0.0)
    expected, expected_units, _ = _today(x, grad, units)
    assert torch.equal(got, expected)  # today's own path: the very same numbers
    assert (got_units is None and expected_units is None) or torch.equal(got_units, expected_units)


def _fall_back_twice(instance: OnePass, x: torch.Tensor, reason: str, with_units: bool = True) -> None:
    for units in (with_units, False):
        _assert_todays_values(instance, x, units=units)
    assert instance.paths == {f"today: {reason}": 2}, instance.paths


def test_no_compiler_falls_back_with_one_note():
    instance = OnePass(has_compiler=False, min_elements=SMALL)
    assert instance.warm(DTYPES) is None
    _fall_back_twice(instance, torch.randn(64, 200), "no_compiler")
    assert instance.notes == ["onepass: no C++ compiler found for CPU kernels: every tensor takes the per-piece path"]


def test_failed_compile_falls_back_with_one_note(fast):
    def broken_backend(graph, example_inputs):
        raise RuntimeError("the C++ compiler crashed")

    instance = OnePass(backend=broken_backend, min_elements=SMALL)
    assert instance.warm(DTYPES) is None
    _fall_back_twice(instance, torch.randn(64, 200), "compile_failed")
    assert len(instance.notes) == 1
    assert "compiling the reduction failed" in instance.notes[0]
    assert "the C++ compiler crashed" in instance.notes[0]


def test_recompile_limit_falls_back_with_one_note(fast):
    # Another backend is another graph of the same functions, of which the module's warm-up already holds several.
    instance = OnePass(backend="eager", min_elements=SMALL)
    with torch._dynamo.config.patch(recompile_limit=1):
        assert instance.warm(DTYPES) is None
    _fall_back_twice(instance, torch.randn(64, 200), "recompile_limit")
    assert instance.notes == ["onepass: torch._dynamo's recompile limit was reached: today's path from now on"]


class _CountingMode(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", [FlopCounterMode, _CountingMode], ids=["FlopCounterMode", "TorchDispatchMode"])
def test_active_dispatch_mode_falls_back_with_one_note(fast, mode):
    instance = _warmed()
    x = torch.randn(64, 200)
    kwargs = {"display": False} if mode is FlopCounterMode else {}
    with mode(**kwargs):
        _fall_back_twice(instance, x, "dispatch_mode")
    assert instance.notes == ["onepass: a TorchDispatchMode is active: today's path while it is"]
    _rows(instance.reduce_tensor, x, shift=0.0)  # the mode is gone: the fast path again
    assert instance.paths["fast"] == 1


class _FunctionMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_active_function_mode_falls_back_with_one_note(fast):
    instance = _warmed()
    x = torch.randn(64, 200)
    with _FunctionMode(), torch.compiler.set_stance("fail_on_recompile"):  # it would compile again: it must not
        _fall_back_twice(instance, x, "function_mode")
    assert instance.notes == ["onepass: a TorchFunctionMode is active: today's path while it is"]


def test_callers_own_force_eager_stance_is_lifted_around_the_call(fast):
    # What the callback's hooks will do: they hold force_eager for the user's compiled model, not for this reduction.
    instance = _warmed()
    x = torch.randn(64, 200)
    with torch.compiler.set_stance("force_eager"), torch.compiler.set_stance("default"):
        got = _rows(instance.reduce_tensor, x, shift=0.0)[0]
    assert instance.paths == {"fast": 1}
    _assert_same_row(got, _today(x)[0], grad=False)


def test_force_eager_stance_falls_back_without_running_the_eager_body(fast):
    instance = _warmed()
    x = torch.randn(64, 200)
    with torch.compiler.set_stance("force_eager"):
        _fall_back_twice(instance, x, "eager")
    assert len(instance.notes) == 1
    assert "would run eagerly" in instance.notes[0]
    _rows(instance.reduce_tensor, x, shift=0.0)
    assert instance.paths["fast"] == 1  # a transient reason: the fast path after the stance


def test_unsupported_dtype_falls_back_with_one_note(fast):
    instance = _warmed()
    for dtype in (torch.float8_e4m3fn, torch.float16, torch.float64):
        instance.paths.clear()
        # today's unit_maxima has no float8 amax on the CPU
        _fall_back_twice(instance, torch.randn(64, 200).to(dtype), "dtype", with_units=dtype != torch.float8_e4m3fn)
    assert instance.notes == [
        f"onepass: {dtype} is not read by the fast path: today's path for it"
        for dtype in ("torch.float8_e4m3fn", "torch.float16", "torch.float64")
    ]
    with pytest.raises(ValueError, match=r"dtypes: \[torch.float16\] are not read by the fast path"):
        instance.warm([torch.float16])


@pytest.mark.parametrize(
    ("x", "shift", "units", "reason"),
    [
        (torch.randn(100), 0.0, False, "small"),  # below min_elements: stays stacked / per piece
        (torch.randn(64, 200), None, False, "no_shift"),  # no pooled mean yet
        (torch.randn(200, 64).t(), 0.0, False, "not_contiguous"),
        (torch.randn(9000), 0.0, True, "not_warmed"),  # one unit per element, [1, n, 1]: never compiled mid-run
    ],
    ids=["small", "no shift", "not contiguous", "layout not warmed"],
)
def test_routine_choices_take_todays_path_without_a_note(fast, x, shift, units, reason):
    instance = _warmed()
    got, got_units, _ = _rows(instance.reduce_tensor, x, units=units, shift=shift)
    expected, expected_units, _ = _today(x, units=units)
    assert torch.equal(got, expected)
    assert (got_units is None and expected_units is None) or torch.equal(got_units, expected_units)
    assert instance.paths == {f"today: {reason}": 1}
    assert instance.notes == []


def test_a_tensor_without_rows_or_units_makes_no_compiled_call(fast):
    # A stacked tensor (its rows come from the stack) or one only counted: a compiled pass would be thrown away.
    instance = _warmed()
    x = torch.randn(64, 200)
    maxima, hist = instance.reduce_tensor(x, None, S.Workspace(), shift=0.0)
    assert (maxima, hist) == (None, None)
    assert instance.paths == {"today: stacked": 1}
    assert instance.notes == []


def test_the_cpus_gradients_take_todays_path_by_default(fast):
    instance = OnePass(min_elements=SMALL)
    assert instance.warm(DTYPES) is not None, instance.notes
    instance.notes.clear()
    x = torch.randn(64, 200)
    got, _, _ = _rows(instance.reduce_tensor, x, grad=True)
    assert torch.equal(got, _today(x, grad=True)[0])
    assert instance.paths == {"today: gradient": 1}
    assert instance.notes == []


def test_bad_min_elements_is_a_clear_error():
    with pytest.raises(ValueError, match=r"min_elements: expected an int >= 2, got 0"):
        OnePass(min_elements=0)
    assert FAST_MIN_ELEMENTS == SMALL_ELEMENTS + 1  # just above what the recorder stacks: no tensor takes both
